-- optim.lua — AdamW with decoupled weight decay (spec/optim.md §2) and global-norm clipping (§5).
--
-- Groups (§1, with the embedding rule of this release): weight decay applies to matrices (ndim >= 2)
-- except those a module registered with decay = false (embedding tables, KDA conv taps [H·dk, 1, 4]);
-- norm gains, biases, KDA A_log and dt_bias (1-D) never decay. Recipe patterns in `no_decay` move more parameters out of the decay group.
-- The update itself is one engine call per parameter (tide_adamw_step_checked_), in place, off the graph; the same
-- kernel pass flags a non-finite result (one i32 flag per device, read once per step: the step's post-update guard).
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local C = tide.C

local optim = {}

local function last_error() return ffi.string(C.tide_last_error()) end

local raw = tide.raw

-- named parameters from a module (anything with named_parameters) or a list of {name, tensor[, meta]}
local function collect_params(src)
  local list = {}
  if type(src) == "table" and src.named_parameters then
    for name, t, meta in src:named_parameters() do list[#list + 1] = { name = name, param = t, meta = meta or {} } end
  elseif type(src) == "table" then
    for i, e in ipairs(src) do
      if type(e) ~= "table" or type(e[1]) ~= "string" or not tide.is_tensor(e[2]) then
        error("optim: parameter " .. i .. " must be {name, tensor[, meta]}", 3)
      end
      list[#list + 1] = { name = e[1], param = e[2], meta = e[3] or {} }
    end
  else
    error("optim: expected a module or a list of {name, tensor} pairs, got a " .. type(src), 3)
  end
  return list
end

-- the decay rule: 2-D+ tensors decay unless their module or a recipe pattern says no
function optim.decays(name, t, meta, no_decay)
  if meta and meta.decay ~= nil then return meta.decay end
  for _, pat in ipairs(no_decay or {}) do
    if name:find(pat) then return false end
  end
  return t:dim() >= 2
end

local AdamW = {}
AdamW.__index = AdamW
optim.AdamW_class = AdamW

local ADAMW_KEYS = { lr = true, betas = true, eps = true, weight_decay = true, no_decay = true, clip = true, kind = true }
optim.KEYS = ADAMW_KEYS

-- AdamW(params, {lr = 3e-3, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1, no_decay = {patterns}})
function optim.AdamW(params, cfg)
  cfg = options.check(cfg or {}, ADAMW_KEYS, nil, "optim")
  local betas = cfg.betas or { 0.9, 0.95 }
  local self = setmetatable({
    lr = cfg.lr or 3e-3, beta1 = betas[1], beta2 = betas[2], eps = cfg.eps or 1e-8,
    weight_decay = cfg.weight_decay or 0.1, t = 0, groups = {}, flags = {},
  }, AdamW)
  if not (self.beta1 >= 0 and self.beta1 < 1 and self.beta2 >= 0 and self.beta2 < 1) then
    error(string.format("optim: betas must lie in [0, 1), got {%s, %s}", tostring(betas[1]), tostring(betas[2])), 2)
  end
  if not (self.lr > 0) then error("optim: lr must be positive, got " .. tostring(self.lr), 2) end
  self.params = collect_params(params)
  local seen = {}
  for _, p in ipairs(self.params) do
    if seen[p.name] then error("optim: parameter name '" .. p.name .. "' appears twice", 2) end
    seen[p.name] = true
    p.decay = optim.decays(p.name, p.param, p.meta, cfg.no_decay)
    p.m = tide.zeros_like(p.param)
    p.v = tide.zeros_like(p.param)
    local dev = p.param:device()
    self.flags[dev] = self.flags[dev] or tide.zeros({ 1 }, { dtype = "i32", device = dev })
    p.flag = self.flags[dev]
  end
  return self
end

-- names in the decay and no-decay groups
function AdamW:group_names()
  local decay, no_decay = {}, {}
  for _, p in ipairs(self.params) do
    if p.decay then decay[#decay + 1] = p.name else no_decay[#no_decay + 1] = p.name end
  end
  return decay, no_decay
end

-- step(lr) -> true when every updated value (weights, m, v) is finite, false when one is not (then
-- first_nonfinite() names it): one update of every parameter that has a gradient; lr defaults to cfg.lr. The test
-- is the update kernel's own; the step reads one flag per device, not the weights again.
function AdamW:step(lr)
  lr = lr or self.lr
  local rank = self.group and self.group.rank()
  for _, p in ipairs(self.params) do
    local g = (rank == nil or p.owner == rank) and C.tide_grad(raw(p.param)) or nil
    if g ~= nil then
      local rc = C.tide_adamw_step_checked_(raw(p.param), g, raw(p.m), raw(p.v), lr, self.beta1, self.beta2, self.eps,
        p.decay and self.weight_decay or 0, self.t, raw(p.flag))
      C.tide_tensor_release(g)
      if rc ~= 0 then error("optim.AdamW: parameter '" .. p.name .. "': " .. last_error(), 2) end
    end
  end
  self.t = self.t + 1
  local finite = true
  for _, f in pairs(self.flags) do   -- an OR over the devices: their order does not matter
    if f:item() ~= 0 then finite = false; f:zero_() end
  end
  if self.group then
    -- ZeRO-1: one answer for all ranks, then every owner's updated weights to every rank
    finite = not self.group.any(not finite)
    self:gather_params()
  end
  return finite
end

-- ---- ZeRO-1 (DESIGN.md §9): each parameter's AdamW moments live on one rank, its owner ----------------------------
-- shard(group): owners by size (largest first, each to the least loaded rank, the lower rank on ties: the same on
-- every rank); the moments of the parameters this rank does not own are dropped. step() then updates the owned
-- parameters (from the full, all-reduced gradients: the same arithmetic as unsharded, so the same bits) and
-- broadcasts each owner's weights; each owner writes its moments into its shard of the checkpoint (shard_tensors;
-- state_tensors() gathers them all to rank 0, a collective), load_state() keeps the owned ones, so a checkpoint
-- resumes under any number of ranks.
function AdamW:shard(group, level)
  local world = group.world()
  if world == 1 then return self end
  self.zero = level or 1   -- 2: the step reduce-scatters the gradients (each owner keeps its sums; Stepper:run)
  local ps = self.params
  local rank = group.rank()
  -- expert parallelism: a rank's experts (meta.ep) keep their whole state there (it is 1/ep of the experts' already,
  -- and no other rank of the world holds those weights); the replicated parameters are shared out over the world
  local idx, sizes = {}, {}
  for i, p in ipairs(ps) do
    if p.meta and p.meta.ep then p.owner, p.local_state = rank, true
    else idx[#idx + 1] = i; sizes[#sizes + 1] = p.param:numel() end
  end
  local owners = require("tide.dist").owners(sizes, world)
  for k, i in ipairs(idx) do ps[i].owner = owners[k] end
  for _, p in ipairs(ps) do
    if p.owner ~= rank then p.m, p.v = nil, nil end
  end
  self.group, self.sharded = group, true
  return self
end

-- the element count of every parameter, in order (what the owner assignment balances)
function AdamW:sizes()
  local n = {}
  for i, p in ipairs(self.params) do n[i] = p.param:numel() end
  return n
end

-- shard_owners(world) -> the rank that writes each parameter's moments into its optim shard of a sharded checkpoint:
-- ZeRO-1's owner (the rank that holds them); unsharded the same assignment (dist.owners of the sizes), so every rank
-- writes about 1/world of the bytes. shard_tensors(world, rank) -> names, tensors: the moments rank writes. Neither
-- is a collective.
function AdamW:shard_owners(world)
  if self.sharded then
    local o = {}
    for i, p in ipairs(self.params) do o[i] = p.owner end
    return o
  end
  return require("tide.dist").owners(self:sizes(), world)
end

function AdamW:shard_tensors(world, rank)
  local owners = self:shard_owners(world)
  local names, tensors = {}, {}
  for i, p in ipairs(self.params) do
    if owners[i] == rank then
      names[#names + 1] = p.name .. ".adam_m"; tensors[#tensors + 1] = p.m
      names[#names + 1] = p.name .. ".adam_v"; tensors[#tensors + 1] = p.v
    end
  end
  return names, tensors
end

-- the bytes of this rank's AdamW moments (all of them when unsharded)
function AdamW:moment_bytes()
  local n = 0
  for _, p in ipairs(self.params) do
    if p.m then n = n + p.m:nbytes() + p.v:nbytes() end
  end
  return n
end

-- every owner's weights to every rank: per (owner, dtype) one flat broadcast, parameters in order
function AdamW:gather_params()
  local g = self.group
  local rank = g.rank()
  tide.no_grad(function()
    local groups, keys = {}, {}
    for _, p in ipairs(self.params) do
      if p.local_state then goto next_param end      -- a rank's own experts: updated here, held by no other rank
      local key = p.owner .. "|" .. p.param:dtype()
      if not groups[key] then groups[key] = { owner = p.owner, list = {} }; keys[#keys + 1] = key end
      local l = groups[key].list
      l[#l + 1] = p.param
      ::next_param::
    end
    for _, key in ipairs(keys) do
      local gr = groups[key]
      local n = 0
      for _, t in ipairs(gr.list) do n = n + t:numel() end
      local flat
      if gr.owner == rank then
        local parts = {}
        for i, t in ipairs(gr.list) do parts[i] = t:reshape(t:numel()) end
        flat = #parts == 1 and parts[1]:clone() or tide.F.concat(parts, 1)
      else
        flat = tide.empty({ n }, { dtype = gr.list[1]:dtype() })
      end
      g.broadcast_(flat, gr.owner)
      if gr.owner ~= rank then
        local off = 0
        for _, t in ipairs(gr.list) do
          t:copy_(flat:narrow(1, off + 1, t:numel()):reshape(t:shape()))
          off = off + t:numel()
        end
      end
    end
  end)
end

-- what the last update made non-finite, the first in parameter order: "weight <name>", else "AdamW state
-- <name>.adam_m" (or .adam_v), or nil. The per-tensor pass over all of them runs only on this failure path.
function AdamW:first_nonfinite()
  local w = optim.first_nonfinite_of(self.params, function(p) return raw(p.param) end)
  if w then return "weight " .. w end
  for _, slot in ipairs({ "m", "v" }) do
    local name = optim.first_nonfinite_of(self.params, function(p) return raw(p[slot]) end)
    if name then return "AdamW state " .. name .. ".adam_" .. slot end
  end
  return nil
end

function AdamW:zero_grad()
  for _, p in ipairs(self.params) do C.tide_zero_grad(raw(p.param)) end
end

-- state tensors under the checkpoint names "<param>.adam_m" / "<param>.adam_v" (formats.md §6)
-- (sharded: a collective — the owners send their moments to rank 0, which returns them all; the others return empty
-- lists)
function AdamW:state_tensors()
  local names, tensors = {}, {}
  local g = self.group
  local rank = g and g.rank()
  for _, p in ipairs(self.params) do
    local m, v = p.m, p.v
    if g and p.owner ~= 0 then
      if rank == p.owner then
        g.send_(m, 0); g.send_(v, 0)
      elseif rank == 0 then
        m, v = tide.zeros_like(p.param), tide.zeros_like(p.param)
        g.recv_(m, p.owner); g.recv_(v, p.owner)
      end
    end
    if rank == nil or rank == 0 then
      names[#names + 1] = p.name .. ".adam_m"; tensors[#tensors + 1] = m
      names[#names + 1] = p.name .. ".adam_v"; tensors[#tensors + 1] = v
    end
  end
  return names, tensors
end

function AdamW:state() return { kind = "adamw", t = self.t } end

-- load_state(scalars, get) where get(name) returns the saved tensor or nil
function AdamW:load_state(s, get)
  if s.kind ~= "adamw" then error("optim: checkpoint holds optimiser '" .. tostring(s.kind) .. "', expected adamw", 2) end
  for _, p in ipairs(self.params) do
    for _, slot in ipairs(p.m and { "m", "v" } or {}) do   -- (sharded: the moments this rank owns)
      local key = p.name .. ".adam_" .. slot
      local src = get(key)
      if src == nil then error("optim: checkpoint lacks '" .. key .. "'", 2) end
      if src:numel() ~= p[slot]:numel() then
        error(string.format("optim: '%s' has %d elements in the checkpoint, %d in the model", key,
          src:numel(), p[slot]:numel()), 2)
      end
      p[slot]:copy_(src:reshape(p[slot]:shape()))
    end
  end
  self.t = s.t
end

---------------------------------------------------------------------------------------------------
-- gradients

-- each_grad(params, fn, who): fn(g) -> status for the gradient handle of every parameter that has one, in order;
-- a failing status is an error naming `who`, raised at the line that called who
local function each_grad(params, fn, who)
  for _, p in ipairs(params) do
    local g = C.tide_grad(raw(p.param or p))
    if g ~= nil then
      local rc = fn(g)
      C.tide_tensor_release(g)
      if rc ~= 0 then error(who .. ": " .. last_error(), 3) end
    end
  end
end

-- grad_norm(list[, group]) -> global L2 norm of the gradients (double accumulation); params without a grad count 0.
-- group (ZeRO-2: each rank holds the gradients it owns): every parameter's sum of squares in its own slot (0 where
-- this rank has no gradient), the slots summed over the ranks (one nonzero per slot: exact) and then added in
-- parameter order, as one rank adds them: the norm of the unsharded gradients, bit for bit
function optim.grad_norm(params, group)
  local total, out = 0, ffi.new("double[1]")
  if group then
    -- (expert parallelism: each rank's experts' squares are added over the expert-parallel group instead, as below)
    local sq, ep_total, ep = {}, 0, nil
    for i, p in ipairs(params) do
      sq[i] = 0
      local g = C.tide_grad(raw(p.param or p))
      local is_ep = p.meta and p.meta.ep
      if is_ep then ep = p.meta.ep end
      if g ~= nil then
        local rc = C.tide_sum_squares(g, out)
        C.tide_tensor_release(g)
        if rc ~= 0 then error("optim.grad_norm: " .. last_error(), 2) end
        if is_ep then ep_total = ep_total + out[0] else sq[i] = out[0] end
      end
    end
    sq = group.sums(sq)
    for i = 1, #params do total = total + sq[i] end
    if ep then total = total + ep.sums({ ep_total })[1] end
    return math.sqrt(total)
  end
  -- expert parallelism: each rank holds the gradients of its own experts (meta.ep: MoE:shard_experts); their sum of
  -- squares is added over the expert-parallel group, then to the replicated parameters' (the same on every rank)
  local ep_total, ep = 0, nil
  for _, p in ipairs(params) do
    local g = C.tide_grad(raw(p.param or p))
    if g ~= nil then
      local rc = C.tide_sum_squares(g, out)
      C.tide_tensor_release(g)
      if rc ~= 0 then error("optim.grad_norm: " .. last_error(), 2) end
      if p.meta and p.meta.ep then ep = p.meta.ep; ep_total = ep_total + out[0] else total = total + out[0] end
    elseif p.meta and p.meta.ep then
      ep = p.meta.ep
    end
  end
  if ep then total = total + ep.sums({ ep_total })[1] end
  return math.sqrt(total)
end

-- clip_grad_norm(params, max_norm[, group]) -> the norm before clipping. g ← g · min(1, c / (‖g‖ + 1e-6));
-- gradients stay bitwise unchanged when the factor is 1, and are left alone when the norm is not finite (group: as
-- grad_norm; each rank scales the gradients it holds)
function optim.clip_grad_norm(params, max_norm, group)
  local norm = optim.grad_norm(params, group)
  if norm ~= norm or norm == math.huge then return norm end
  local factor = max_norm / (norm + 1e-6)
  if factor < 1 then
    each_grad(params, function(g) return C.tide_scale_(g, factor) end, "optim.clip_grad_norm")
  end
  return norm
end

-- name of the first parameter (in order) for which handle_of(p) (a tide_tensor pointer, nil to skip) holds a NaN
-- or an infinity, or nil: all of them in one fused engine pass per device
function optim.first_nonfinite_of(params, handle_of)
  local n = #params
  local arr = ffi.new("tide_tensor *[?]", math.max(n, 1))
  for i, p in ipairs(params) do arr[i - 1] = handle_of(p) end
  local first = ffi.new("int[1]")
  if C.tide_first_nonfinite(arr, n, first) ~= 0 then
    error("optim: finite check: " .. ffi.string(C.tide_last_error()), 2)
  end
  return first[0] < n and params[first[0] + 1].name or nil
end

-- name of the first parameter (in order) whose gradient holds a NaN or an infinity, or nil
function optim.first_nonfinite(params)
  local grads = {}
  local ok, res = pcall(optim.first_nonfinite_of, params, function(p)
    local g = C.tide_grad(raw(p.param))
    if g ~= nil then grads[#grads + 1] = g end
    return g
  end)
  for _, g in ipairs(grads) do C.tide_tensor_release(g) end
  if not ok then error(res, 2) end
  return res
end

-- build(cfg, model): the optimiser a recipe's `optim` table names (kind "adamw", the default)
function optim.build(cfg, model)
  cfg = cfg or {}
  local kind = cfg.kind or "adamw"
  if kind ~= "adamw" then error("optim: unknown kind '" .. tostring(kind) .. "' (known: adamw)", 2) end
  local c = {}
  for k, v in pairs(cfg) do if k ~= "clip" and k ~= "kind" then c[k] = v end end
  return optim.AdamW(model, c)
end

return optim
