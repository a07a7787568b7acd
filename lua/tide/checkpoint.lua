-- checkpoint.lua — the checkpoint directory of formats.md §6:
--   <run>/ckpt/step_00001234/{model.safetensors, optim.safetensors, state.json}
--   <run>/ckpt/latest          the current directory name
-- A run of several ranks (data parallelism, DESIGN.md §9) writes the weights and the AdamW moments as shards, each
-- rank its own, with HuggingFace's index files beside them:
--   model-00001-of-00004.safetensors ...  rank r−1's share of the weights and buffers (dist.owners of their sizes)
--   model.safetensors.index.json          {"metadata": {"total_size": bytes, "tide.shards": 4}, "weight_map": {name: file}}
--   optim-00001-of-00004.safetensors ...  the moments of the parameters rank r−1 owns (ZeRO-1: the ones it holds)
--   optim.safetensors.index.json
-- Every rank writes its shards into the one step_XXXXXXXX.tmp/ (a file system all ranks see); when all of them are
-- complete (one collective decision), rank 0 writes the indexes and state.json and renames the directory: it becomes
-- visible only whole. Readers (load, resume, load_model, sample, eval, export) take either layout, and a sharded
-- checkpoint loads under any number of ranks: each tensor is read from the shard the index names.
-- consolidate(dir, out) writes a sharded checkpoint as a single-file one (`tide ckpt consolidate`).
-- Files are written into step_XXXXXXXX.tmp/ (each fsynced by the engine), the directory is fsynced and
-- renamed, then `latest` is replaced atomically: a run killed at any instant leaves the last good
-- checkpoint readable. A step saved again (after resuming from an older checkpoint) swaps directories: the old
-- copy is renamed to step_XXXXXXXX.old, the new one into place, then the old copy is removed; `latest` only ever
-- names a directory that was complete. A save that fails (a full disk, a file-size limit) removes its .tmp.
-- recover() (at the start of every run with a directory) repairs what a kill inside that window left: a step
-- directory that is missing while a complete .tmp or .old copy of it exists is put back (a copy is complete when it
-- holds state.json, written last), and every other .tmp / .old is removed, each in one reported line.
--
-- Loading converts dtypes by one rule: a float tensor of the model (weight or buffer) loads only from a float
-- tensor of the file, F32, F64 or BF16 (F16 is not read), converted to the model's dtype: f32 -> f64 and
-- bf16 -> f32/f64 are exact, f64 -> f32 and f32 -> bf16 round to nearest even (f64 -> bf16 through f32). Integer
-- and bool tensors are refused for float weights, float tensors for integer buffers, in one line naming the
-- tensor, its stored dtype and the expected one. (The MoE selection bias is F64 in checkpoints of every model
-- dtype, F32 in older ones: both load.) Optimiser state is float, under the same rule.
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local C = tide.C

local fmt = string.format
local checkpoint = {}

local function last_error() return ffi.string(C.tide_last_error()) end

-- TIDE_TEST_CKPT_KILL=<point> sends this process SIGKILL at that point of a save ("tmp": model.safetensors or this
-- rank's model shard written, "swap": the old copy renamed away, the new one not yet in place): the fault tests'
-- window into a real kill. TIDE_TEST_CKPT_KILL_RANK=r: only the process of that MPI rank (OMPI_COMM_WORLD_RANK)
pcall(ffi.cdef, "int getpid(void); int kill(int pid, int sig);")
function checkpoint.kill_point(point)
  if os.getenv("TIDE_TEST_CKPT_KILL") ~= point then return end
  local only = os.getenv("TIDE_TEST_CKPT_KILL_RANK")
  if only and only ~= (os.getenv("OMPI_COMM_WORLD_RANK") or "0") then return end
  ffi.C.kill(ffi.C.getpid(), 9)
end

local function check(rc, what)
  if rc ~= 0 then error("checkpoint: " .. what .. ": " .. last_error(), 3) end
end

function checkpoint.dir_name(step) return string.format("step_%08d", step) end

local function save_tensors(path, names, tensors, metadata)
  local n = #names
  local cnames = ffi.new("const char *[?]", math.max(n, 1))
  local ctensors = ffi.new("tide_tensor *[?]", math.max(n, 1))
  for i = 1, n do
    cnames[i - 1] = names[i]        -- the Lua strings in `names` keep the bytes alive
    ctensors[i - 1] = tide.raw(tensors[i])
  end
  local meta = nil
  if metadata then
    local m = {}
    for k, v in pairs(metadata) do m[k] = tostring(v) end
    meta = json.encode(m)
  end
  check(C.tide_safetensors_save(path, n, cnames, ctensors, meta), "writing " .. path)
end

-- list of step directory names under <run>/ckpt, sorted by step
function checkpoint.list(run_dir)
  local ckdir = run_dir .. "/ckpt"
  if C.tide_is_dir(ckdir) ~= 1 then return {} end
  local n = ffi.new("size_t[1]")
  local raw = C.tide_list_dir(ckdir, n)
  if raw == nil then error("checkpoint: cannot list " .. ckdir .. ": " .. last_error(), 2) end
  local names = ffi.string(raw, n[0])
  C.tide_free(raw)
  local out = {}
  for name in names:gmatch("([^%z]+)%z") do
    if name:match("^step_%d+$") then out[#out + 1] = name end
  end
  table.sort(out)
  return out
end

-- save(run_dir, step, {model =, optim =, state = {...}, metadata = {...}, keep = n, files = fn(dir), group =})
-- -> directory path. keep: how many step directories to leave (older ones are removed after `latest` moves); nil
-- keeps all. group (tide.dist with several ranks): the sharded layout, a collective (every rank calls it).
local function model_tensors(model)
  local names = model:state_names()
  local sd = model:state_dict()
  local tensors = {}
  for i, n in ipairs(names) do tensors[i] = sd[n] end
  return names, tensors
end

local expert_index

-- ---- expert parallelism: the routed experts under their per-expert names ------------------------------------------
-- A layer sharded by MoE:shard_experts holds experts [first, first + count) of the fused tensors
-- <p>.experts.gate_up_proj [n, 2·d_e, d_in] and <p>.experts.down_proj [n, d_out, d_e]. A run with dist.ep > 1 writes
-- them under formats.md §2's per-expert names, each expert once (by the first rank of the ranks that hold it):
--   <p>.experts.{j}.gate_proj.weight = gate_up_proj[j, 0:d_e], .up_proj.weight = gate_up_proj[j, d_e:2·d_e],
--   <p>.experts.{j}.down_proj.weight = down_proj[j]   (AdamW moments: the same names + .adam_m / .adam_v)
-- Readers fuse them back (fuse_experts), so every reader, and a run of any layout, loads either form.

-- the sharded expert tensors of model: {fused name = {first, count, n, writer}} (nil when none is sharded)
local function sharded_experts(model)
  local info
  model:walk(function(m, prefix)
    if m.ep and m.experts and m.experts.n_local then
      local ex = m.experts
      local rep = ex._param_meta.gate_up_proj.ep_dp
      -- the writer of expert slice k: the first rank holding it, rank (0·ep + k)·cp + 0 of the layout, which is the
      -- distance between the ep group's members k and 0 (the same whatever (d, c) this rank has)
      local writers = {}
      for k = 1, m.ep.size do writers[k] = m.ep.members[k] - m.ep.members[1] end
      local e = { first = ex.first, count = ex.n_local, n = m.n, size = m.ep.size, writer = rep == nil or rep.rank == 0,
        writers = writers }
      local base = (prefix == "" and "" or prefix .. ".") .. "experts."
      info = info or {}
      info[base .. "gate_up_proj"], info[base .. "down_proj"] = e, e
    end
  end)
  return info
end

-- the per-expert (name, tensor) pairs of the fused tensor t (experts first .. first + count − 1) named fused..suffix
local function split_experts(fused, suffix, t, first, out_n, out_t)
  local prefix, which = fused:match("^(.*%.experts)%.([%w_]+)$")
  local count = t:size(1)
  for j = 0, count - 1 do
    local e = t:narrow(1, j + 1, 1)
    local base = fmt("%s.%d.", prefix, first + j)
    if which == "gate_up_proj" then
      local de = t:size(2) / 2
      out_n[#out_n + 1] = base .. "gate_proj.weight" .. suffix
      out_t[#out_t + 1] = e:narrow(2, 1, de):reshape(de, t:size(3)):contiguous()
      out_n[#out_n + 1] = base .. "up_proj.weight" .. suffix
      out_t[#out_t + 1] = e:narrow(2, de + 1, de):reshape(de, t:size(3)):contiguous()
    else
      out_n[#out_n + 1] = base .. "down_proj.weight" .. suffix
      out_t[#out_t + 1] = e:reshape(t:size(2), t:size(3)):contiguous()
    end
  end
end

-- fuse_experts(dict) -> dict with every complete set of per-expert tensors (<p>.experts.{j}.{gate,up,down}_proj.weight
-- [+ suffix], j = 0 .. n−1) replaced by the fused tensors; a set with a gap is an error naming the missing expert
function checkpoint.fuse_experts(dict)
  local sets = {}
  for name in pairs(dict) do
    local prefix, j, which, suffix = name:match("^(.*%.experts)%.(%d+)%.([%w]+_proj)%.weight(.*)$")
    if prefix and (which == "gate_proj" or which == "up_proj" or which == "down_proj") then
      local key = prefix .. "\0" .. suffix
      local st = sets[key] or { prefix = prefix, suffix = suffix, n = 0 }
      sets[key] = st
      st.n = math.max(st.n, tonumber(j) + 1)
    end
  end
  for _, st in pairs(sets) do
    local gu, dn = {}, {}
    for j = 0, st.n - 1 do
      local base = fmt("%s.%d.", st.prefix, j)
      local g, u, d = dict[base .. "gate_proj.weight" .. st.suffix], dict[base .. "up_proj.weight" .. st.suffix],
        dict[base .. "down_proj.weight" .. st.suffix]
      if not (g and u and d) then
        error(fmt("checkpoint: expert %d of %s%s is missing (the per-expert tensors of experts 0 .. %d are expected)", j,
          st.prefix, st.suffix, st.n - 1), 0)
      end
      gu[j + 1] = tide.F.concat({ g, u }, 1):reshape(1, g:size(1) + u:size(1), g:size(2))
      dn[j + 1] = d:reshape(1, d:size(1), d:size(2))
      dict[base .. "gate_proj.weight" .. st.suffix], dict[base .. "up_proj.weight" .. st.suffix] = nil, nil
      dict[base .. "down_proj.weight" .. st.suffix] = nil
    end
    dict[st.prefix .. ".gate_up_proj" .. st.suffix] = tide.F.concat(gu, 1)
    dict[st.prefix .. ".down_proj" .. st.suffix] = tide.F.concat(dn, 1)
  end
  return dict
end

-- the fused expert tensors of dict cut to the experts a sharded model holds (info: sharded_experts; suffix: "" or
-- a moment's)
local function narrow_experts(dict, info, suffix)
  for fused, e in pairs(info or {}) do
    local t = dict[fused .. suffix]
    if t and t:size(1) ~= e.count then
      if t:size(1) ~= e.n then
        error(fmt("checkpoint: '%s' holds %d experts, the model %d", fused .. suffix, t:size(1), e.n), 0)
      end
      dict[fused .. suffix] = t:narrow(1, e.first + 1, e.count):contiguous()
    end
  end
  return dict
end

local function base_meta(step, parts)
  local meta = { format = "pt", ["tide.step"] = step, ["tide.version"] = ffi.string(C.tide_version()) }
  for k, v in pairs(parts.metadata or {}) do meta[k] = v end
  return meta
end

-- the run's extra files, then state.json last: a directory holding it is complete (recover relies on that)
local function write_state(tmp, step, parts, extra)
  if parts.files then parts.files(tmp) end       -- the run's extra files (the tokenizer), before state.json
  local state = {}
  for k, v in pairs(parts.state or {}) do state[k] = v end
  for k, v in pairs(extra or {}) do state[k] = v end
  state.step = step
  if parts.optim then state.optim = parts.optim:state() end
  check(C.tide_file_write_text_atomic(tmp .. "/state.json", json.encode(state, { first = { "step" } }) .. "\n"),
    "writing state.json")
  check(C.tide_fsync_dir(tmp), "syncing " .. tmp)
end

local function write_tmp(tmp, step, parts)
  check(C.tide_mkdir_p(tmp), "creating " .. tmp)
  local names, tensors = model_tensors(parts.model)
  save_tensors(tmp .. "/model.safetensors", names, tensors, base_meta(step, parts))
  checkpoint.kill_point("tmp")
  if parts.optim then
    local onames, otensors = parts.optim:state_tensors()
    save_tensors(tmp .. "/optim.safetensors", onames, otensors, { format = "pt", ["tide.step"] = step })
  end
  write_state(tmp, step, parts)
end

-- the finished tmp directory into place, `latest` moved to it, older checkpoints pruned
local function publish(run_dir, ckdir, name, tmp, keep)
  local final = ckdir .. "/" .. name
  local old = final .. ".old"
  if C.tide_path_exists(final) == 1 then
    -- the same step saved again: swap, so that a kill at any instant leaves a complete copy under a known name
    check(C.tide_remove_tree(old), "clearing " .. old)
    check(C.tide_rename_atomic(final, old), "renaming " .. final)
    checkpoint.kill_point("swap")
    check(C.tide_rename_atomic(tmp, final), "renaming " .. tmp)
    check(C.tide_file_write_text_atomic(ckdir .. "/latest", name .. "\n"), "updating latest")
    check(C.tide_remove_tree(old), "removing " .. old)
  else
    check(C.tide_rename_atomic(tmp, final), "renaming " .. tmp)
    check(C.tide_file_write_text_atomic(ckdir .. "/latest", name .. "\n"), "updating latest")
  end
  if keep then
    -- the newest `keep` up to this step stay; checkpoints past it (a run resumed from an earlier step) are not pruned
    local upto = {}
    for _, n in ipairs(checkpoint.list(run_dir)) do if n <= name then upto[#upto + 1] = n end end
    for i = 1, #upto - keep do
      check(C.tide_remove_tree(ckdir .. "/" .. upto[i]), "removing old " .. upto[i])
    end
  end
  return final
end

-- shard file names, HuggingFace's: model-00001-of-00004.safetensors (i from 1)
function checkpoint.shard_name(kind, i, n) return fmt("%s-%05d-of-%05d.safetensors", kind, i, n) end

-- the index of one kind: every name to its shard, the total bytes
local function write_index(path, names, tensors, owners, kind, world)
  local map, total = {}, 0
  for i, n in ipairs(names) do
    map[n] = checkpoint.shard_name(kind, owners[i] + 1, world)
    total = total + tensors[i]:nbytes()
  end
  local text = json.encode({ metadata = { total_size = total, ["tide.shards"] = world }, weight_map = map },
    { first = { "metadata" } })
  check(C.tide_file_write_text_atomic(path, text .. "\n"), "writing " .. path)
end

-- the moments' names and shapes for the optim index: every parameter's two, in order, with their owners
local function optim_layout(opt, world)
  local owners = opt:shard_owners(world)
  local names, tensors, own = {}, {}, {}
  for i, p in ipairs(opt.params) do
    for _, slot in ipairs({ "m", "v" }) do
      names[#names + 1] = p.name .. ".adam_" .. slot
      tensors[#tensors + 1] = p.param      -- (a moment has its parameter's shape and dtype: only nbytes is read)
      own[#own + 1] = owners[i]
    end
  end
  return names, tensors, own
end

-- the index entries of every expert of every rank (rank 0 writes the index): expert j of a layer sharded over P
-- ranks lives on the first of the ranks holding slice ⌊j / (n/P)⌋ (rank = (d·ep + e)·cp + c with d = c = 0); sizes from this
-- rank's slice (every expert has the same shape). Appended to names/tensors/owners (new lists).
expert_index = function(fnames, ftensors, ex, names, tensors, owners, suffix)
  local n2, t2, o2 = {}, {}, {}
  for i = 1, #names do n2[i], t2[i], o2[i] = names[i], tensors[i], owners[i] end
  for i, fused in ipairs(fnames) do
    local e = ex[fused]
    if e then
      local t = ftensors[i]
      local one = t:narrow(1, 1, 1)
      for j = 0, e.n - 1 do
        local en, et = {}, {}
        split_experts(fused, suffix, one, j, en, et)
        for k = 1, #en do
          n2[#n2 + 1] = en[k]
          local b = et[k]:nbytes()
          t2[#t2 + 1] = { nbytes = function() return b end }
          o2[#o2 + 1] = e.writers[math.floor(j / e.count) + 1]
        end
      end
    end
  end
  return n2, t2, o2
end

local function save_sharded(run_dir, step, parts)
  local g = parts.group
  local world, rank = g.world(), g.rank()
  local ckdir = run_dir .. "/ckpt"
  local name = checkpoint.dir_name(step)
  local tmp = ckdir .. "/" .. name .. ".tmp"
  local what = fmt("checkpoint: step %d was not saved", step)
  -- rank 0 prepares the directory; then every rank writes its shards into it
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      check(C.tide_mkdir_p(ckdir), "creating " .. ckdir)
      check(C.tide_remove_tree(tmp), "clearing " .. tmp)
      check(C.tide_mkdir_p(tmp), "creating " .. tmp)
    end)
  end
  g.agree(ok, what, err)
  local all_names, all_tensors = model_tensors(parts.model)
  local ex = sharded_experts(parts.model)
  -- the replicated tensors by size over the ranks; a sharded layer's experts by the first rank holding them
  local names, tensors = {}, {}
  for i, n in ipairs(all_names) do
    if not (ex and ex[n]) then names[#names + 1] = n; tensors[#tensors + 1] = all_tensors[i] end
  end
  local sizes = {}
  for i, t in ipairs(tensors) do sizes[i] = t:numel() end
  local owners = require("tide.dist").owners(sizes, world)
  ok, err = pcall(function()
    local mine_n, mine_t = {}, {}
    for i, n in ipairs(names) do
      if owners[i] == rank then mine_n[#mine_n + 1] = n; mine_t[#mine_t + 1] = tensors[i] end
    end
    for i, n in ipairs(all_names) do
      local e = ex and ex[n]
      if e and e.writer then split_experts(n, "", all_tensors[i], e.first, mine_n, mine_t) end
    end
    save_tensors(tmp .. "/" .. checkpoint.shard_name("model", rank + 1, world), mine_n, mine_t, base_meta(step, parts))
    checkpoint.kill_point("tmp")
    if parts.optim then
      local on, ot = parts.optim:shard_tensors(world, rank)
      if ex then
        -- the experts' moments: per expert, by the rank that writes the expert
        local keep_n, keep_t = {}, {}
        for i, n in ipairs(on) do
          local fused = n:match("^(.*)%.adam_[mv]$")
          if not ex[fused] then keep_n[#keep_n + 1] = n; keep_t[#keep_t + 1] = ot[i] end
        end
        on, ot = keep_n, keep_t
        for _, p in ipairs(parts.optim.params) do
          local e = ex[p.name]
          if e and e.writer then
            split_experts(p.name, ".adam_m", p.m, e.first, on, ot)
            split_experts(p.name, ".adam_v", p.v, e.first, on, ot)
          end
        end
      end
      save_tensors(tmp .. "/" .. checkpoint.shard_name("optim", rank + 1, world), on, ot,
        { format = "pt", ["tide.step"] = step })
    end
  end)
  local agreed, aerr = pcall(g.agree, ok, what, err)
  if not agreed then
    if rank == 0 then C.tide_remove_tree(tmp) end   -- the previous checkpoints are untouched
    error(aerr, 2)
  end
  -- every shard is complete: rank 0 writes the indexes and state.json (last) and publishes the directory
  local final = ckdir .. "/" .. name
  ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      local mn, mt, mo = names, tensors, owners
      if ex then mn, mt, mo = expert_index(all_names, all_tensors, ex, names, tensors, owners, "") end
      write_index(tmp .. "/model.safetensors.index.json", mn, mt, mo, "model", world)
      if parts.optim then
        local on, ot, oo = optim_layout(parts.optim, world)
        if ex then
          local dn, dt, dow = {}, {}, {}
          for i, n in ipairs(on) do
            if not ex[n:match("^(.*)%.adam_[mv]$")] then dn[#dn + 1] = n; dt[#dt + 1] = ot[i]; dow[#dow + 1] = oo[i] end
          end
          local pn, pt = {}, {}
          for _, p in ipairs(parts.optim.params) do
            if ex[p.name] then pn[#pn + 1] = p.name; pt[#pt + 1] = p.param end
          end
          on, ot, oo = dn, dt, dow
          for _, suffix in ipairs({ ".adam_m", ".adam_v" }) do
            on, ot, oo = expert_index(pn, pt, ex, on, ot, oo, suffix)
          end
        end
        write_index(tmp .. "/optim.safetensors.index.json", on, ot, oo, "optim", world)
      end
      write_state(tmp, step, parts)
      publish(run_dir, ckdir, name, tmp, parts.keep)
    end)
    if not ok then C.tide_remove_tree(tmp) end
  end
  g.agree(ok, what, err)
  return final
end

function checkpoint.save(run_dir, step, parts)
  if parts.group and parts.group.world() > 1 then return save_sharded(run_dir, step, parts) end
  local ckdir = run_dir .. "/ckpt"
  check(C.tide_mkdir_p(ckdir), "creating " .. ckdir)
  local name = checkpoint.dir_name(step)
  local tmp = ckdir .. "/" .. name .. ".tmp"
  check(C.tide_remove_tree(tmp), "clearing " .. tmp)
  local ok, err = pcall(write_tmp, tmp, step, parts)
  if not ok then
    C.tide_remove_tree(tmp)    -- a half-written copy is of no use; the previous checkpoints are untouched
    error(err, 2)
  end
  return publish(run_dir, ckdir, name, tmp, parts.keep)
end

-- every name in a directory, sorted
local function entries(dir)
  local n = ffi.new("size_t[1]")
  local raw = C.tide_list_dir(dir, n)
  if raw == nil then error("checkpoint: cannot list " .. dir .. ": " .. last_error(), 0) end
  local names = ffi.string(raw, n[0])
  C.tide_free(raw)
  local out = {}
  for name in names:gmatch("([^%z]+)%z") do out[#out + 1] = name end
  table.sort(out)
  return out
end

-- every name in <run>/ckpt (nil when there is no such directory)
local function ckpt_names(ckdir)
  if C.tide_is_dir(ckdir) ~= 1 then return nil end
  return entries(ckdir)
end

-- recover(run_dir) -> a list of lines saying what was repaired: a step directory missing while a complete .tmp
-- (the newer copy) or .old copy of it exists is put back; every other .tmp / .old left by an interrupted save is
-- removed
function checkpoint.recover(run_dir)
  local ckdir = run_dir .. "/ckpt"
  local names, notes = ckpt_names(ckdir), {}
  if not names then return notes end
  local present = {}
  for _, n in ipairs(names) do present[n] = true end
  for _, n in ipairs(names) do
    local base, kind = n:match("^(step_%d+)%.(%a+)$")
    if base and (kind == "tmp" or kind == "old") then
      local path, final = ckdir .. "/" .. n, ckdir .. "/" .. base
      if not present[base] and C.tide_path_exists(path .. "/state.json") == 1
          and (kind == "tmp" or not present[base .. ".tmp"] or C.tide_path_exists(final .. ".tmp/state.json") ~= 1) then
        check(C.tide_rename_atomic(path, final), "restoring " .. final)
        present[base] = true
        notes[#notes + 1] = fmt("checkpoint: restored %s from %s (a save was interrupted)", final, path)
      else
        check(C.tide_remove_tree(path), "removing " .. path)
        notes[#notes + 1] = fmt("checkpoint: removed %s, left by an interrupted save", path)
      end
      present[n] = nil
    end
  end
  return notes
end

-- latest(run_dir) -> the directory `latest` names, or nil when the run has no checkpoint
function checkpoint.latest(run_dir)
  local path = run_dir .. "/ckpt/latest"
  if C.tide_path_exists(path) ~= 1 then return nil end
  local text, err = tide.read_file(path, 4096)
  if not text then error("checkpoint: " .. err, 2) end
  local name = text:match("^%s*(.-)%s*$")
  if not name:match("^step_%d+$") then
    error("checkpoint: " .. run_dir .. "/ckpt/latest holds '" .. name .. "', expected step_XXXXXXXX", 2)
  end
  local dir = run_dir .. "/ckpt/" .. name
  if C.tide_is_dir(dir) ~= 1 then
    checkpoint.recover(run_dir)
    if C.tide_is_dir(dir) ~= 1 then
      local all = checkpoint.list(run_dir)
      error(fmt("checkpoint: %s/ckpt/latest names %s, which is missing, and no complete copy of it is left; %s", run_dir,
        name, #all > 0 and ("resume from one of the others (--resume=" .. run_dir .. "/ckpt/" .. all[#all] .. "): "
          .. table.concat(all, ", ")) or "there is no checkpoint to resume from (start the run afresh)"), 2)
    end
  end
  return dir
end

-- a run directory's `ckpt/latest` pointer file, or its `ckpt` directory, stands for the run directory
local function run_of_pointer(path)
  local p = path:gsub("/+$", "")
  local run = p:match("^(.*)/ckpt/latest$") or p:match("^(.*)/ckpt$")
  if run and C.tide_path_exists(run .. "/ckpt/latest") == 1 then return run end
  return nil
end

-- resolve a resume target: a step directory, or a run directory (its latest checkpoint; also given as its
-- ckpt/latest pointer file or its ckpt directory)
function checkpoint.resolve(path)
  path = run_of_pointer(path) or path
  if C.tide_path_exists(path .. "/state.json") == 1 then return path end
  local dir = checkpoint.latest(path)
  if not dir then error("checkpoint: no checkpoint under '" .. path .. "' (no ckpt/latest, no state.json)", 2) end
  return dir
end

local Reader = {}
Reader.__index = Reader

local function open_file(path)
  local h = C.tide_safetensors_open(path)
  if h == nil then error("checkpoint: " .. last_error(), 3) end
  return ffi.gc(h, C.tide_safetensors_close)
end

-- open(dir) -> reader with :tensors(file) -> {name = tensor}, :get(file, name), .state (state.json). A file name
-- ("model.safetensors", "optim.safetensors") stands for the file, or for the shards its index names.
function checkpoint.open(dir)
  local path = dir .. "/state.json"
  if C.tide_path_exists(path) ~= 1 then error("checkpoint: " .. path .. " is missing", 2) end
  local text, err = tide.read_file(path, tide.STATE_FILE_LIMIT)
  if not text then error("checkpoint: " .. err, 2) end
  local ok, state = pcall(json.decode, text)
  if not ok then error("checkpoint: " .. dir .. "/state.json: " .. tostring(state), 2) end
  return setmetatable({ dir = dir, state = state, files = {}, layouts = {} }, Reader)
end

local INDEX_LIMIT = 256 * 1024 * 1024

-- layout(file) -> {files = {shard names, sorted}, map = {tensor name = shard} or nil, index = path or nil}: the file
-- itself when it exists, else the shards of <file>.index.json (checked: every entry a .safetensors file name of the
-- directory, no path)
function Reader:layout(file)
  if self.layouts[file] then return self.layouts[file] end
  local single = self.dir .. "/" .. file
  local L
  if C.tide_path_exists(single) == 1 then
    L = { files = { file } }
  else
    local index = single .. ".index.json"
    if C.tide_path_exists(index) ~= 1 then
      error(fmt("checkpoint: %s has neither %s nor %s.index.json", self.dir, file, file), 0)
    end
    local text, err = tide.read_file(index, INDEX_LIMIT)
    if not text then error("checkpoint: " .. err, 0) end
    local ok, t = pcall(json.decode, text)
    if not ok then error(fmt("checkpoint: %s: %s", index, tostring(t)), 0) end
    if type(t) ~= "table" or type(t.weight_map) ~= "table" then
      error(fmt("checkpoint: %s has no weight_map object", index), 0)
    end
    local map, files, seen = {}, {}, {}
    for name, f in pairs(t.weight_map) do
      if type(name) ~= "string" or type(f) ~= "string" or f:find("/", 1, true) or f:sub(1, 1) == "."
          or not f:match("^[%w_.-]+%.safetensors$") then
        error(fmt("checkpoint: %s: weight_map[%s] = %s is not a .safetensors file of the directory", index,
          json.encode(name), json.encode(f)), 0)
      end
      map[name] = f
      if not seen[f] then seen[f] = true; files[#files + 1] = f end
    end
    table.sort(files)
    L = { files = files, map = map, index = index }
  end
  self.layouts[file] = L
  return L
end

-- is `file` stored as shards (an index) rather than one file?
function Reader:sharded(file) return self:layout(file).map ~= nil end

function Reader:file(name)
  if not self.files[name] then self.files[name] = open_file(self.dir .. "/" .. name) end
  return self.files[name]
end

-- the shard holding `name` of the logical `file` and the tensor's position in it, or nil
function Reader:locate(file, name)
  local L = self:layout(file)
  local f = L.map and L.map[name] or (not L.map and file or nil)
  if not f then return nil end
  local h = self:file(f)
  local i = C.tide_safetensors_find(h, name)
  if i < 0 then
    if L.map then error(fmt("checkpoint: %s puts '%s' in %s, which does not hold it", L.index, name, f), 0) end
    return nil
  end
  return h, i, f
end

-- get(file, name) -> a CPU tensor, or nil when the file has no such name
function Reader:get(file, name, device)
  local h, i, f = self:locate(file, name)
  if not h then return nil end
  local t = C.tide_safetensors_get(h, i, device or 0)
  if t == nil then error("checkpoint: " .. self.dir .. "/" .. f .. ": " .. last_error(), 2) end
  return tide.wrap(t)
end

-- every tensor of one (logical) file as {name = tensor}; a shard's tensor must be where the index puts it, once
function Reader:tensors(file, device)
  local L = self:layout(file)
  local out = {}
  for _, f in ipairs(L.files) do
    local h = self:file(f)
    for i = 0, C.tide_safetensors_count(h) - 1 do
      local name = ffi.string(C.tide_safetensors_name(h, i))
      if L.map and L.map[name] ~= f then
        error(fmt("checkpoint: %s/%s holds '%s', which %s puts %s", self.dir, f, name, L.index,
          L.map[name] and ("in " .. L.map[name]) or "in no shard"), 0)
      end
      if out[name] then error(fmt("checkpoint: tensor '%s' appears twice (again in %s/%s)", name, self.dir, f), 0) end
      local t = C.tide_safetensors_get(h, i, device or 0)
      if t == nil then error("checkpoint: " .. self.dir .. "/" .. f .. ": " .. last_error(), 2) end
      out[name] = tide.wrap(t)
    end
  end
  if L.map then
    for name, f in pairs(L.map) do
      if not out[name] then error(fmt("checkpoint: %s puts '%s' in %s, which does not hold it", L.index, name, f), 0) end
    end
  end
  return out
end

-- the dtype rule of the header comment: every tensor of `file` that the model has (want: name -> tide dtype name)
-- must be stored in a dtype of the same kind; checked on the header, before any bytes are read
local FLOAT_STORED = { F32 = true, F64 = true, BF16 = true }
local INT_STORED = { I32 = true, I64 = true, U8 = true }
local FLOAT_DTYPES = { f32 = true, f64 = true, bf16 = true }
local function refuse(where, name, stored, float, whose)
  error(string.format("checkpoint: %s: tensor '%s' is stored as %s, expected %s: %s", where, name, stored,
    float and "a float tensor (F32, F64 or BF16)" or "an integer tensor (I32, I64 or U8)", whose), 3)
end

function Reader:check_dtypes(file, want)
  for _, f in ipairs(self:layout(file).files) do
    local h = self:file(f)
    for i = 0, C.tide_safetensors_count(h) - 1 do
      local name = ffi.string(C.tide_safetensors_name(h, i))
      local dtype = want[name]
      if dtype then
        local stored = ffi.string(C.tide_safetensors_dtype(h, i))
        local ok = FLOAT_DTYPES[dtype] and FLOAT_STORED[stored] or (not FLOAT_DTYPES[dtype] and INT_STORED[stored])
        if not ok then
          refuse(self.dir .. "/" .. f, name, stored, FLOAT_DTYPES[dtype], "the model's tensor is " .. dtype)
        end
      end
    end
  end
end

-- get(file, name) for a tensor that must be float (optimiser state)
function Reader:get_float(file, name, device)
  local h, i, f = self:locate(file, name)
  if not h then return nil end
  local stored = ffi.string(C.tide_safetensors_dtype(h, i))
  if not FLOAT_STORED[stored] then refuse(self.dir .. "/" .. f, name, stored, true, "optimiser state is float") end
  return self:get(file, name, device)
end

-- the __metadata__ of a (logical) file: a sharded file's first shard's (every shard carries the same)
function Reader:metadata(file)
  return json.decode(ffi.string(C.tide_safetensors_metadata(self:file(self:layout(file).files[1]))))
end

function Reader:close()
  for k, h in pairs(self.files) do
    C.tide_safetensors_close(ffi.gc(h, nil))
    self.files[k] = nil
  end
end

-- load(dir, {model =, optim =, check = nil | function(state, path)}) -> state table; check sees state.json first
-- (it raises on a bad one), then weights and optimiser state are copied in place
function checkpoint.load(dir, parts)
  local r = checkpoint.open(dir)
  if parts.check then
    local ok, err = pcall(parts.check, r.state, dir .. "/state.json")
    if not ok then r:close(); error(err, 0) end
  end
  if parts.model then
    local want = {}
    for name, t in pairs(parts.model:state_dict()) do want[name] = t:dtype() end
    r:check_dtypes("model.safetensors", want)
    local ex = sharded_experts(parts.model)
    parts.model:load_state_dict(narrow_experts(checkpoint.fuse_experts(r:tensors("model.safetensors")), ex, ""))
  end
  if parts.optim then
    if not r.state.optim then error("checkpoint: " .. dir .. "/state.json has no optimiser state", 2) end
    local ex = parts.model and sharded_experts(parts.model)
    local fused
    parts.optim:load_state(r.state.optim, function(name)
      local t = r:get_float("optim.safetensors", name)
      local base = name:match("^(.*)%.adam_[mv]$")
      local split = base and base:match("^.*%.experts%.[%w_]+_proj$")
      if t == nil and split then
        -- the experts' moments stored per expert (a run with dist.ep > 1): fused once, on first need
        fused = fused or checkpoint.fuse_experts(r:tensors("optim.safetensors"))
        t = fused[name]
      end
      if t ~= nil and ex and ex[base] then
        local d = narrow_experts({ [name] = t }, { [base] = ex[base] }, name:sub(#base + 1))
        t = d[name]
      end
      return t
    end)
  end
  r:close()
  return r.state
end

-- ---- consolidate: a sharded checkpoint as a single-file one -----------------------------------------------------
-- consolidate(path, out[, {overwrite}]) -> {dir, out, step, files = {logical file = {shards, tensors, bytes}}}: the
-- checkpoint at path (a step directory or a run directory's latest) rewritten as model.safetensors (+
-- optim.safetensors) in a new step directory out: every tensor as stored (the same bytes), in shard order, the
-- first shard's metadata; state.json and the run's other files (tokenizer.json) copied. out is written as out.tmp and
-- renamed (hf.write_dir): absent, the old one or complete. It resumes, samples and exports like any checkpoint.
function checkpoint.consolidate(path, out, opts)
  opts = opts or {}
  path = run_of_pointer(path) or path
  if C.tide_is_dir(path) ~= 1 then error(fmt("checkpoint: '%s' is not a directory (a run or a checkpoint)", path), 0) end
  local dir = checkpoint.resolve(path)
  local r = checkpoint.open(dir)
  local kinds = { "model.safetensors" }
  if C.tide_path_exists(dir .. "/optim.safetensors") == 1 or C.tide_path_exists(dir .. "/optim.safetensors.index.json") == 1 then
    kinds[2] = "optim.safetensors"
  end
  local ok_sharded, sharded = pcall(r.sharded, r, "model.safetensors")
  if not ok_sharded then r:close(); error(sharded, 0) end
  if not sharded then
    r:close()
    error(fmt("checkpoint: %s is already single-file (model.safetensors): nothing to consolidate", dir), 0)
  end
  local shard_files, info = {}, { dir = dir, out = out, step = r.state.step, files = {} }
  local hf = require "tide.hf"
  local ok, err = pcall(hf.write_dir, out, opts.overwrite, "consolidate", function(tmp)
    for _, kind in ipairs(kinds) do
      local L = r:layout(kind)
      for _, f in ipairs(L.files) do shard_files[f] = true end
      shard_files[kind .. ".index.json"] = true
      local all = r:tensors(kind)                    -- (checks the index against the shards)
      local names, tensors, bytes = {}, {}, 0
      for _, f in ipairs(L.files) do
        local h = r:file(f)
        for i = 0, C.tide_safetensors_count(h) - 1 do
          names[#names + 1] = ffi.string(C.tide_safetensors_name(h, i))
        end
      end
      -- the experts of an expert-parallel run (stored per expert) fused back: the tensors of a one-rank run
      checkpoint.fuse_experts(all)
      local listed, kept = {}, {}
      for _, name in ipairs(names) do
        if all[name] then kept[#kept + 1] = name; listed[name] = true end
      end
      local extra = {}
      for name in pairs(all) do if not listed[name] then extra[#extra + 1] = name end end
      table.sort(extra)
      for _, name in ipairs(extra) do kept[#kept + 1] = name end
      names = kept
      for i, name in ipairs(names) do
        tensors[i] = all[name]
        bytes = bytes + all[name]:nbytes()
      end
      save_tensors(tmp .. "/" .. kind, names, tensors, r:metadata(kind))
      info.files[kind] = { shards = #L.files, tensors = #names, bytes = bytes }
    end
    -- every other file of the directory (state.json, tokenizer.json) as it is; shard files the index does not name
    -- (a rank's empty shard) are left out
    for _, name in ipairs(entries(dir)) do
      local src = dir .. "/" .. name
      if not shard_files[name] and not name:match("^model%-%d+%-of%-%d+%.safetensors$")
          and not name:match("^optim%-%d+%-of%-%d+%.safetensors$") and C.tide_is_dir(src) ~= 1 then
        local text, rerr = tide.read_file(src, 4 * 1024 * 1024 * 1024)
        if not text then error("checkpoint: " .. rerr, 0) end
        check(C.tide_file_write_atomic(tmp .. "/" .. name, text, #text), "writing " .. tmp .. "/" .. name)
      end
    end
  end)
  r:close()
  if not ok then error(err, 0) end
  return info
end

-- ---- a model from a checkpoint alone ------------------------------------------------------------------------
-- describe(model, tokenizer, cfg) -> the metadata entries that rebuild a run's model: tide.model (its kind and
-- resolved config as JSON), tide.tokenizer (the tokenizer's description) and tide.config (the run's resolved config)
function checkpoint.describe(model, tok, cfg, plain)
  local meta = {}
  if model and model.cfg then
    local mc = plain(model.cfg)
    meta["tide.model"] = json.encode({ kind = mc.kind or "dense", config = mc })
  end
  if tok then
    meta["tide.tokenizer"] = json.encode(tok.describe and tok:describe() or { kind = tok.kind, vocab_size = tok.vocab_size })
  end
  if cfg then meta["tide.config"] = json.encode(plain(cfg)) end
  return meta
end

local function meta_json(meta, key, path)
  local text = meta[key]
  if text == nil then return nil end
  local ok, v = pcall(json.decode, text)
  if not ok or type(v) ~= "table" then error(fmt("checkpoint: %s: metadata '%s' is not a JSON object", path, key), 0) end
  return v
end

-- load_model(path[, {device =, dtype =}]) -> model, info: path is a run directory (its latest checkpoint) or a
-- step directory. info = {dir, step, kind, model_config, config (the run's, or nil), tokenizer}. The model is built
-- from the tide.model metadata and its weights are loaded; the tokenizer is <dir>/tokenizer.json when the run had
-- one (tokenizer.load), else the byte-level vocabulary the metadata names.
function checkpoint.load_model(path, opts)
  opts = opts or {}
  path = run_of_pointer(path) or path
  if C.tide_is_dir(path) ~= 1 then error(fmt("checkpoint: '%s' is not a directory (a run or a checkpoint)", path), 0) end
  local dir = checkpoint.resolve(path)
  local r = checkpoint.open(dir)
  local file = dir .. "/model.safetensors"
  local ok, meta = pcall(r.metadata, r, "model.safetensors")
  if not ok then r:close(); error(meta, 0) end
  local desc = meta_json(meta, "tide.model", file)
  if not desc or type(desc.config) ~= "table" then
    r:close()
    error(fmt("checkpoint: %s has no tide.model metadata, so the model cannot be rebuilt from it alone (an "
      .. "older tide wrote it); load it from its recipe instead", file), 0)
  end
  local mc = desc.config
  if opts.device then mc.device = opts.device end
  if opts.dtype then mc.dtype = opts.dtype end
  local nn = require "tide.nn"
  local built, model = pcall(nn.build, mc)
  if not built then r:close(); error(fmt("checkpoint: %s: tide.model: %s", file, tostring(model)), 0) end
  local want = {}
  for name, t in pairs(model:state_dict()) do want[name] = t:dtype() end
  local loaded, err = pcall(function()
    r:check_dtypes("model.safetensors", want)
    model:load_state_dict(checkpoint.fuse_experts(r:tensors("model.safetensors")))
  end)
  r:close()
  if not loaded then error(err, 0) end
  local tokenizer = require "tide.data.tokenizer"
  local td = meta_json(meta, "tide.tokenizer", file) or { kind = "byte", vocab_size = mc.vocab_size }
  local tok
  if C.tide_path_exists(dir .. "/tokenizer.json") == 1 and tokenizer.load then
    tok = tokenizer.load(dir .. "/tokenizer.json")
  elseif td.kind == "byte" then
    tok = tokenizer.byte_level({ vocab_size = td.vocab_size or mc.vocab_size })
  else
    error(fmt("checkpoint: %s: the run's tokenizer (%s) is not in %s/tokenizer.json", file, tostring(td.kind), dir), 0)
  end
  return model, { dir = dir, step = r.state.step, kind = desc.kind, model_config = mc,
    config = meta_json(meta, "tide.config", file), tokenizer = tok }
end

return checkpoint
