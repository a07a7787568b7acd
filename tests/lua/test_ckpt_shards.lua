-- sharded checkpoints (the layout several ranks write, lua/tide/checkpoint.lua): a one-rank checkpoint split here into
-- HuggingFace-style shards and index files reads back bitwise, resumes to the same run, loads as a model and
-- consolidates to the same bytes; a hostile or broken index (a path in weight_map, a tensor in the wrong shard or in
-- none, a missing shard, bad JSON) is one clear error. (tests/dist/dp_check.sh writes real shards under mpirun.)
local T = require "tide.testing"
local tide = require "tide"
local checkpoint = require "tide.checkpoint"
local json = require "tide.json"
local hf = require "tide.hf"
local dist = require "tide.dist"
local train = require "tide.train"
local C = tide.C

local FIXTURE = "tests/fixtures/tiny_corpus.txt"

local function cfg(out, train_fields, extra)
  return assert(loadstring("return " .. string.format([[{ model = { dim = 16, n_layers = 1, n_heads = 2,
    vocab_size = 320 }, data = { path = %q, doc_separator = "%%", seq_len = 16, batch_size = 2 }, optim = { lr = 3e-3 },
    train = { seed = 1, quiet = true, log_every = 1000, keep_ckpts = 5, out = %q, %s }%s }]], FIXTURE, out,
    train_fields, extra or "")))()
end

local function copy_tree(src, dst)
  T.eq(os.execute(string.format("cp -r '%s' '%s'", src, dst)), 0, "cp " .. src)
end

-- split(dir, world): dir's model.safetensors and optim.safetensors as `world` shards (dist.owners of the sizes, as
-- several ranks write them) with their index files; the single files removed
local function split(dir, world)
  local r = checkpoint.open(dir)
  for _, kind in ipairs({ "model", "optim" }) do
    local file = kind .. ".safetensors"
    local h = r:file(file)
    local names, sizes = {}, {}
    for i = 0, C.tide_safetensors_count(h) - 1 do
      names[#names + 1] = require("ffi").string(C.tide_safetensors_name(h, i))
    end
    local all = r:tensors(file)
    for i, n in ipairs(names) do sizes[i] = all[n]:numel() end
    local meta = r:metadata(file)
    local owners = dist.owners(sizes, world)
    local map = {}
    for rank = 0, world - 1 do
      local sn, st = {}, {}
      for i, n in ipairs(names) do
        if owners[i] == rank then sn[#sn + 1] = n; st[#st + 1] = all[n]; map[n] = checkpoint.shard_name(kind, rank + 1, world) end
      end
      hf.save_safetensors(dir .. "/" .. checkpoint.shard_name(kind, rank + 1, world), sn, st, meta)
    end
    hf.write_text(dir .. "/" .. file .. ".index.json", json.encode({ metadata = { ["tide.shards"] = world }, weight_map = map }))
  end
  r:close()
  T.eq(os.remove(dir .. "/model.safetensors"), true)
  T.eq(os.remove(dir .. "/optim.safetensors"), true)
end

-- x and y hold the same values bit for bit (same dtype and shape; f32/f64/bf16 go to f64 exactly)
local function same(x, y, what)
  T.eq(x:dtype(), y:dtype(), what .. ": dtype")
  T.eq(x:shape(), y:shape(), what .. ": shape")
  if x:numel() > 0 then
    local d = (x:to("f64") - y:to("f64")):abs():max():item()
    T.ok(d == 0, what .. ": differs by " .. tostring(d))
  end
end

local function same_tensors(a, b, file, what)
  local A, B = checkpoint.open(a), checkpoint.open(b)
  local ta, tb = A:tensors(file), B:tensors(file)
  local n = 0
  for name, x in pairs(ta) do
    T.ok(tb[name], what .. ": " .. name .. " is missing")
    same(tb[name], x, what .. ": " .. name)
    n = n + 1
  end
  for name in pairs(tb) do T.ok(ta[name], what .. ": extra " .. name) end
  A:close(); B:close()
  return n
end

T.test("a checkpoint in 3 shards + index reads, resumes, loads and consolidates as the single-file one", function()
  local out = T.tmpdir("one")
  local a = train(cfg(out, "steps = 6, ckpt_every = 3"))
  local step3 = out .. "/ckpt/" .. checkpoint.dir_name(3)
  -- a second run directory whose step-3 checkpoint is sharded
  local out2 = T.tmpdir("sharded", { create = true })
  T.eq(C.tide_mkdir_p(out2 .. "/ckpt"), 0)
  local s3 = out2 .. "/ckpt/" .. checkpoint.dir_name(3)
  copy_tree(step3, s3)
  split(s3, 3)
  local r = checkpoint.open(s3)
  T.ok(r:sharded("model.safetensors") and r:sharded("optim.safetensors"), "read as shards")
  T.eq(#r:layout("model.safetensors").files, 3)
  r:close()
  T.ok(same_tensors(step3, s3, "model.safetensors", "model") > 5)
  T.ok(same_tensors(step3, s3, "optim.safetensors", "optim") > 10)
  -- resumed from the shards: the uninterrupted run's steps 4-6, bitwise
  local b = train(cfg(out2, "steps = 6, ckpt_every = 3", string.format(", resume = %q", s3)))
  T.ok(b.losses[3] == nil and b.losses[4] ~= nil, "resumed at step 3 (steps 1-3 not run again)")
  for s = 4, 6 do T.ok(b.losses[s] == a.losses[s], string.format("step %d: %.17g vs %.17g", s, b.losses[s], a.losses[s])) end
  -- a model from the shards alone (what sample, eval and export read)
  local m, info = checkpoint.load_model(s3)
  T.eq(info.step, 3)
  local single = checkpoint.load_model(step3)
  for name, t in pairs(single:state_dict()) do same(m:state_dict()[name], t, name) end
  -- consolidated: single files again, the same bytes, state.json as it was; it resumes like the original
  local cons = T.tmpdir("cons")
  local ci = checkpoint.consolidate(s3, cons)
  T.eq(ci.files["model.safetensors"].shards, 3)
  local rc = checkpoint.open(cons)
  T.ok(not rc:sharded("model.safetensors") and not rc:sharded("optim.safetensors"), "single files")
  rc:close()
  T.ok(C.tide_path_exists(cons .. "/model-00001-of-00003.safetensors") == 0, "no shard copied")
  same_tensors(step3, cons, "model.safetensors", "consolidated model")
  same_tensors(step3, cons, "optim.safetensors", "consolidated optim")
  T.eq(T.read(cons .. "/state.json"), T.read(step3 .. "/state.json"))
  T.eq(checkpoint.open(cons):metadata("model.safetensors")["tide.model"], checkpoint.open(step3):metadata("model.safetensors")["tide.model"])
  local out3 = T.tmpdir("fromcons")
  local c = train(cfg(out3, "steps = 6, ckpt_every = 3", string.format(", resume = %q", cons)))
  T.ok(c.losses[3] == nil and c.losses[4] ~= nil, "resumed at step 3")
  for s = 4, 6 do T.ok(c.losses[s] == a.losses[s], string.format("step %d from the consolidated copy", s)) end
  -- refusals: an existing output, a checkpoint that is already single-file
  T.raises(function() checkpoint.consolidate(s3, cons) end, "exists and is not empty (pass --overwrite to replace it)")
  checkpoint.consolidate(s3, cons, { overwrite = true })
  T.raises(function() checkpoint.consolidate(step3, T.tmpdir("x")) end, "is already single-file (model.safetensors)")
end)

T.test("a hostile or broken index is one clear error naming the file", function()
  local out = T.tmpdir("h")
  train(cfg(out, "steps = 3, ckpt_every = 3"))
  local good = T.tmpdir("good", { create = true }) .. "/step"
  copy_tree(out .. "/ckpt/" .. checkpoint.dir_name(3), good)
  split(good, 2)
  local index = "model.safetensors.index.json"
  local base = json.decode(T.read(good .. "/" .. index))
  local function variant(name, edit)
    local d = T.tmpdir("v", { create = true }) .. "/" .. name
    copy_tree(good, d)
    edit(d)
    return d
  end
  local function with_map(name, f)
    return variant(name, function(d)
      local t = json.decode(T.read(d .. "/" .. index))
      f(t.weight_map, d)
      hf.write_text(d .. "/" .. index, json.encode(t))
    end)
  end
  local some = next(base.weight_map)
  local load = function(d) return checkpoint.open(d):tensors("model.safetensors") end
  local cases = {
    { with_map("path", function(m) m[some] = "../../etc/model.safetensors" end), "is not a .safetensors file of the directory" },
    { with_map("abs", function(m) m[some] = "/tmp/x.safetensors" end), "is not a .safetensors file of the directory" },
    { with_map("notst", function(m) m[some] = "state.json" end), "is not a .safetensors file of the directory" },
    { with_map("wrong", function(m)
        m[some] = m[some] == "model-00001-of-00002.safetensors" and "model-00002-of-00002.safetensors" or "model-00001-of-00002.safetensors"
      end), "puts" },
    { with_map("extra", function(m) m["model.nonexistent.weight"] = "model-00001-of-00002.safetensors" end),
      "puts 'model.nonexistent.weight' in model-00001-of-00002.safetensors, which does not hold it" },
    { with_map("dropped", function(m) m[some] = nil end), "which " },
    { with_map("missing", function(m, d) os.remove(d .. "/model-00002-of-00002.safetensors") end), "model-00002-of-00002.safetensors" },
    { variant("badjson", function(d) hf.write_text(d .. "/" .. index, "{\"weight_map\": {") end), index },
    { variant("nomap", function(d) hf.write_text(d .. "/" .. index, "{\"metadata\": {}}") end), "has no weight_map object" },
    { variant("none", function(d) os.remove(d .. "/" .. index) end), "has neither model.safetensors nor model.safetensors.index.json" },
  }
  for _, c in ipairs(cases) do
    local ok, err = pcall(load, c[1])
    T.ok(not ok, c[1] .. " must fail")
    T.ok(tostring(err):find(c[2], 1, true), c[1] .. ": " .. tostring(err))
    T.ok(not tostring(err):find("stack traceback", 1, true), "one line")
  end
  -- the good one still reads, and the bad ones fail the same way through load_model (what sample and export use)
  T.ok(next(load(good)))
  T.raises(function() checkpoint.load_model(cases[1][1]) end, "is not a .safetensors file of the directory")
end)

T.run()
