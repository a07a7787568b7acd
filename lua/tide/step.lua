-- step.lua — the ONE training step, and the run state every driver shares.
--
-- tide.train and tide.Curriculum (and the RL and data-parallel drivers) differ only in where their batches and
-- their η come from. Everything else is here, once:
--
--   Stepper:run(batches, lr) — one optimiser step over a list of micro-batches (spec/optim.md §5):
--     for each micro-batch: forward -> objective -> backward (gradients accumulate); the data loss of the step is
--     the sum of the token losses over all micro-batches divided by the step's unmasked targets, and an MoE aux
--     term (balance = "aux" / "seq_aux") is added once per step as the mean over micro-batches; then the global
--     gradient norm, clipping, the non-finite policy (skip: weights and optimiser untouched), AdamW at lr, the MoE
--     balancers (moe.md §4.1, over the whole step) -> the step's record (loss, grad norm, jitter, memory, MoE
--     metrics).
--   Run: the bookkeeping around it — the run directory, the metrics file, one checkpoint state shape (weights,
--     AdamW, Philox counter, data cursors, schedule position, MoE balancer windows, and the curriculum position
--     when the driver has one; `format` versioned), resume, rollback after 5 consecutive non-finite steps (twice,
--     then stop with a report), and the end-of-run summary.
local ffi = require "ffi"
local tide = require "tide"
local optim = require "tide.optim"
local checkpoint = require "tide.checkpoint"
local log = require "tide.log"
local json = require "tide.json"
local options = require "tide.options"
local F = tide.F

local fmt = string.format
local step = {}

-- the checkpoint state format this build writes; it reads every format from 1 (before the shared step) up to it
step.FORMAT = 2
-- consecutive non-finite steps before a rollback, and rollbacks before the run stops (DESIGN.md §6)
step.ROLLBACK_AFTER, step.MAX_ROLLBACKS = 5, 2

local function is_finite(x) return x == x and x ~= math.huge and x ~= -math.huge end
step.is_finite = is_finite

-- ---- the Philox counter as decimal strings (exact beyond 2^53) ------------------------------------------------
local function u64_str(x) return (tostring(ffi.new("uint64_t", x)):gsub("ULL$", "")) end
local function str_u64(s)
  local v = ffi.new("uint64_t", 0)
  for d in tostring(s):gmatch("%d") do v = v * 10 + tonumber(d) end
  return v
end

function step.rng_get()
  local s, o = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  tide.C.tide_rng_get(s, o)
  return { seed = u64_str(s[0]), offset = u64_str(o[0]) }
end

function step.rng_set(r) tide.C.tide_rng_set(str_u64(r.seed), str_u64(r.offset)) end

-- keep only the records of steps <= n (a resumed run rewrites what follows), and with `iterations` set only the
-- records of RL iterations <= iterations (an iteration whose groups were all held back trains no step, so the step
-- alone cannot tell it from the iterations before it). The kept lines go to a new file that is renamed over the old
-- one (tide_atomic_*): a kill during the rewrite leaves the old history whole.
-- TIDE_TEST_CKPT_KILL=metrics kills the process halfway through (the fault tests' window).
function step.truncate_metrics(path, n, iterations)
  if tide.C.tide_path_exists(path) ~= 1 then return end
  local text, err = tide.read_file(path)
  if not text then options.fail("metrics", err, 0) end
  local keep = {}
  for line in text:gmatch("[^\n]+") do
    local s = tonumber(line:match('^{"step":(%d+)'))
    local it = iterations and tonumber(line:match('"iteration":(%d+)'))
    if (s == nil or s <= n) and (it == nil or it <= iterations) then keep[#keep + 1] = line .. "\n" end
  end
  local C = tide.C
  local f = C.tide_atomic_open(path)
  local function fail() options.fail("metrics", "cannot rewrite " .. path .. ": " .. ffi.string(C.tide_last_error()), 0) end
  if f == nil then fail() end
  for i, line in ipairs(keep) do
    if C.tide_atomic_write(f, line, #line) ~= 0 then C.tide_atomic_abort(f); fail() end
    if i == math.floor(#keep / 2) then checkpoint.kill_point("metrics") end
  end
  if C.tide_atomic_commit(f) ~= 0 then fail() end
end

-- the serialisable part of a config (functions dropped)
local function plain(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do
    if type(x) ~= "function" then out[k] = plain(x) end
  end
  return out
end
step.plain = plain

local function C_is_dir(path) return tide.C.tide_is_dir(path) end

local function moe_layers(model) return model.moe_layers and model:moe_layers() or {} end
step.moe_layers = moe_layers

-- the per-layer MoE load metrics a step record carries (moe.md §5), keys as TensorBoard tags: moe/maxvio_batch/3
local MOE_KEYS = { "maxvio_batch", "load_entropy", "route_entropy", "dead_experts", "topk_changed", "b_std" }

-- ---- before a run -----------------------------------------------------------------------------------------------

-- bytes of memory available to this process on the CPU (MemAvailable), nil where /proc is absent
local function cpu_available()
  local f = io.open("/proc/meminfo")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  local kb = tonumber(text:match("MemAvailable:%s*(%d+)"))
  return kb and kb * 1024 or nil
end

-- preflight(model_cfg, who, hint): before anything is allocated, a model on a device this build or machine cannot
-- use, or one whose weights and optimiser state alone exceed the memory there, is refused in one line (+ hint)
function step.preflight(mc, who, hint)
  mc = options.deep_copy(mc or {})
  local device = tostring(mc.device or "cpu")
  if device:match("^cuda") and not tide.cuda_available() then
    options.fail(who, fmt("the model runs on %s, but this build or machine has no CUDA device%s", device, hint or ""), 0)
  end
  local plan = require("tide.nn").plan
  if device == "cpu" and plan and (mc.kind == nil or mc.kind == "hybrid") then
    mc.kind = nil
    local ok, st = pcall(plan.static_bytes, mc, { dtype = mc.dtype or "f32" })
    local avail = cpu_available()
    if ok and avail and st.total > avail then
      options.fail(who, fmt("the model's weights, gradients and AdamW state need %s, more than the %s of memory "
        .. "available%s", plan.human_bytes(st.total), plan.human_bytes(avail), hint or ""), 0)
    end
  end
end

-- check_numbers(cfg, who): the numeric fields every driver shares, each refused by name in one line (integers are
-- integers, counts positive, rates finite): cfg.train's counters, cfg.optim, the top-level seed and threads
local function nonneg_num(v, what, who, level) return options.finite_number(v, what, who, level, 0) end
local function clip_value(v, what, who, level)
  if v ~= false then options.finite_number(v, what, who, level, 0) end
end
local function betas(v, what, who, level)
  if type(v) ~= "table" or #v ~= 2 then options.fail(who, fmt("%s must be a pair {beta1, beta2}, got %s", what, tostring(v)), level) end
  for i = 1, 2 do
    if type(v[i]) ~= "number" or not (v[i] >= 0 and v[i] < 1) then
      options.fail(who, fmt("%s[%d] must be a number in [0, 1), got %s", what, i, tostring(v[i])), level)
    end
  end
end
step.NUMERIC = {
  train = { ckpt_every = options.nonneg_int, keep_ckpts = options.pos_int, log_every = options.pos_int,
    seed = options.seed, threads = options.pos_int, collect_every = options.nonneg_int, jitter_window = options.pos_int },
  optim = { lr = options.positive_number, eps = options.positive_number, weight_decay = nonneg_num, clip = clip_value,
    betas = betas },
}
local TOP_NUMERIC = { seed = options.seed, threads = options.pos_int }
function step.check_numbers(cfg, who)
  for _, section in ipairs({ "train", "optim" }) do options.fields(cfg[section], step.NUMERIC[section], section, who) end
  options.fields(cfg, TOP_NUMERIC, nil, who)
end

-- ---- the step ---------------------------------------------------------------------------------------------------
local Stepper = {}
Stepper.__index = Stepper

local STEPPER_KEYS = { model = true, optim = true, clip = true, on_nonfinite = true, jitter_window = true,
  objective = true, dist = true, bucket_bytes = true, cp = true }

-- stepper{model, optim, clip = 1.0 (0 or false: none), on_nonfinite = "skip" | "stop", jitter_window = 50,
--   objective = nil | function(model, batch, i, ctx) -> loss tensor (the micro-batch's mean; the step averages them;
--   ctx = {targets = the step's target count over every micro-batch and rank, micro = the count of those micro-batches};
--   model's forward takes the batch's document boundaries, images or cp slices: step.model_view),
--   dist = nil | tide.dist (data parallelism: each rank runs its own micro-batches of the step; the target count,
--   the losses, the non-finite decision and the gradients are summed over the ranks, in rank order, before the
--   norm, clipping and the update, so every rank applies the same update),
--   bucket_bytes = nil | n (with dist: the gradients summed in buckets of about n bytes while the last backward runs,
--   dist.reducer, under ZeRO-2 reduced to each parameter's owner; 0 or nil: one sum after it),
--   cp = nil | the dist group of the context-parallel ranks (dist.layout's cp_group: they are given the same rows;
--   each keeps its zig-zag slices of every micro-batch, tide.cp, and the model runs on them; the target count and
--   the gradients sum over the whole job as with data parallelism; an objective sees the slices, each cp rank's
--   micro-batch one of the step's ctx.micro)}
function step.stepper(o)
  options.check(o, STEPPER_KEYS, nil, "step.stepper")
  local policy = o.on_nonfinite or "skip"
  if policy ~= "skip" and policy ~= "stop" then
    options.fail("step", fmt("on_nonfinite must be 'skip' or 'stop', got '%s'", tostring(policy)))
  end
  local clip = o.clip
  if clip == nil then clip = 1.0 end
  local group = o.dist
  if group and group.world() == 1 then group = nil end
  local bgroup = group and group.balance_group() or nil
  -- expert parallelism: the parameters of this rank's experts (meta.ep: MoE:shard_experts) apart from the rest
  local ep_params, dense_params
  for _, p in ipairs(o.optim.params) do
    if p.meta and p.meta.ep then ep_params = ep_params or {}; ep_params[#ep_params + 1] = p
    else dense_params = dense_params or {}; dense_params[#dense_params + 1] = p end
  end
  -- recompute = "auto" decided once for every rank (nn.HybridLM:set_recompute_group)
  if group and o.model.set_recompute_group then o.model:set_recompute_group(group) end
  return setmetatable({ model = o.model, optim = o.optim, clip = clip, policy = policy, objective = o.objective,
    cp = o.cp and o.cp.size > 1 and o.cp or nil,
    jitter_window = o.jitter_window or 50, norms = {}, consecutive = 0, skipped = 0, first_bad = nil, dist = group,
    balance_group = bgroup, bucket_bytes = o.bucket_bytes, ep_params = ep_params, dense_params = dense_params or {} },
    Stepper)
end

-- the optimiser's gradient reducer (one per optimiser: the steppers of a run share it; ZeRO-2: reduced to the owners),
-- or nil: without several ranks or buckets, or when the parameters are not f32/f64 tensors of one device (those sum
-- after the backward). bucket_bytes nil: the device's default (dist.BUCKET_MB on the CPU, dist.BUCKET_MB_DEVICE on a
-- GPU, whose bucket sums run on a side stream beside the backward)
function Stepper:reducer()
  if self.red == nil then
    self.red = false
    local opt = self.optim
    local first = opt.params[1] and opt.params[1].param
    local bytes = self.bucket_bytes
    if bytes == nil and self.dist and first then
      bytes = math.floor((first:device() == "cpu" and self.dist.BUCKET_MB or self.dist.BUCKET_MB_DEVICE) * 2 ^ 20)
    end
    if self.dist and (bytes or 0) > 0 then
      local ok = true
      for _, p in ipairs(opt.params) do
        local dt = p.param:dtype()
        if p.param:device() ~= first:device() or (dt ~= "f32" and dt ~= "f64") then ok = false end
      end
      if ok then
        -- expert parallelism: the buckets hold the replicated parameters; the experts' gradients sum over their own
        -- ranks after finish (Stepper:step)
        opt.reducer = opt.reducer or self.dist.reducer(self.ep_params and self.dense_params or opt.params,
          bytes, opt.zero == 2 and self:dense_owners() or nil, self.ep_params ~= nil or self.cp ~= nil)
        self.red = opt.reducer
      end
    end
  end
  return self.red or nil
end

-- expert parallelism: each rank's experts' gradients (zeros where no token came) summed over the ranks that hold the
-- same experts (their tokens arrived through the exchange: the expert-parallel group's sum is already in them)
function Stepper:sum_experts()
  self.dist.ensure_grads(self.ep_params)
  local rep = self.ep_params[1].meta.ep_dp
  if rep then self.dist.allreduce_grads(self.ep_params, rep) end
end

-- ZeRO-2: the owner of each replicated parameter (self.dense_params' order; without ep, every parameter)
function Stepper:dense_owners()
  local all, out = self.optim:shard_owners(self.dist.world()), {}
  local at = {}
  for i, p in ipairs(self.optim.params) do at[p] = i end
  for k, p in ipairs(self.dense_params) do out[k] = all[at[p]] end
  return out
end

-- std / mean of the global gradient norm over the last jitter_window good steps (routing churn shows as a jumpy norm)
function Stepper:jitter(norm)
  local w = self.norms
  w[#w + 1] = norm
  if #w > self.jitter_window then table.remove(w, 1) end
  if #w < 2 then return nil end
  local mean, var = 0, 0
  for _, v in ipairs(w) do mean = mean + v end
  mean = mean / #w
  for _, v in ipairs(w) do var = var + (v - mean) ^ 2 end
  return mean > 0 and math.sqrt(var / (#w - 1)) / mean or nil
end

-- a batch tensor on the model's device (batches are built on the CPU; a model on cuda gets copies)
function step.to_model(model, t)
  local dev = model.cfg and model.cfg.device
  if t == nil or dev == nil or dev == "cpu" or t:device() == dev then return t end
  return t:to(dev)
end

-- the forward options of a packed batch: its document boundaries and its images (vision.md §7), or its
-- context-parallel slices (b.cp, which carries the documents), or nil
function step.forward_opts(b)
  if b.cp then return { cp = b.cp, images = b.images } end
  if not (b.cu_seqlens or b.images) then return nil end
  return { cu_seqlens = b.cu_seqlens, images = b.images }
end

-- the model as an objective sees it: a forward (and so the model's loss) given no options takes the batch's
-- (forward_opts: document boundaries, images, context-parallel slices), so an objective that calls m:forward(ids) or
-- m:loss(ids, targets) runs the batch as the default objective does; nil opts: the model itself
function step.model_view(model, opts)
  if not opts then return model end
  return setmetatable({ forward = function(_, ids, caches, o) return model:forward(ids, caches, o or opts) end },
    { __index = model })
end

-- context parallelism: the batch b ({ids [B, T], targets, cu_seqlens, images}) as this rank's zig-zag slices
-- (tide.cp) and the count of its targets (those not ignored, -100). With images, every rank of the group encodes all
-- of them and splices the image tokens its slices' placeholders (pad_id) take (images.rows): each image token's loss
-- is one rank's, so the encoder's gradients summed over the ranks are the one-rank gradients.
function step.cp_slice(b, group, pad_id)
  local B, T = b.ids:size(1), b.ids:size(2)
  local ctx = require("tide.cp").context({ P = group.size, B = B, T = T, cu_seqlens = b.cu_seqlens, group = group })
  local out = { cp = ctx, ids = ctx:split(b.ids), targets = ctx:split(b.targets) }
  if b.images then
    pad_id = b.images.pad_id or pad_id
    if not options.is_int(pad_id) then
      options.fail("step", "a batch with images under context parallelism needs the <|media_pad|> id (model.vision.media_pad)")
    end
    local im = {}
    for k, v in pairs(b.images) do im[k] = v end
    im.rows = ctx:local_ordinals(b.ids, pad_id)
    out.images = im
  end
  local n = 0
  for _, v in ipairs(out.targets:reshape(-1):tolist()) do if v ~= -100 then n = n + 1 end end
  out.n_targets = n
  return out
end

-- the default objective: Σ token losses / the step's targets, plus each MoE aux term / the micro-batch count
local function data_objective(self, b, N, n_micro)
  local logits = self.model:forward(step.to_model(self.model, b.ids), nil, step.forward_opts(b))
  local ce = F.cross_entropy(logits, step.to_model(self.model, b.targets), { reduction = "sum" })
  local l = ce * (1 / math.max(N, 1))
  local aux
  for _, m in ipairs(moe_layers(self.model)) do
    if m.aux_loss then
      local a = m.aux_loss * (1 / n_micro)
      l = l + a
      aux = (aux or 0) + a:item()
    end
  end
  return l, ce:item(), aux
end

-- n_targets of a micro-batch: given by the packer, else every target counts
local function targets_of(b) return b.n_targets or b.targets:numel() end

-- run(batches, lr) -> the step's record. batches: a list of {ids [B, T], targets [B, T], cu_seqlens = nil | offsets,
-- n_targets = nil | count}; each is released (set to nil in the list) after its backward.
function Stepper:run(batches, lr, t)
  local t0 = tide.time()
  local model, opt, group = self.model, self.optim, self.dist
  local bytes0 = group and group.bytes_sent()
  local n_micro, N, tokens = #batches, 0, 0
  if self.cp then
    local pad_id = model.vision_cfg and model.vision_cfg.media_pad
    for i, b in ipairs(batches) do batches[i] = step.cp_slice(b, self.cp, pad_id) end
  end
  for _, b in ipairs(batches) do N, tokens = N + targets_of(b), tokens + b.ids:numel() end
  -- data parallelism: the normaliser is the step's GLOBAL target count; an objective's mean is over every rank's
  -- micro-batches
  local n_mean = n_micro
  if group then
    local t = group.sums({ N, tokens, n_micro })
    N, tokens, n_mean = t[1], t[2], t[3]
  end
  -- what an objective may need of the whole step: the global target count and micro-batch count (its value is
  -- divided by `micro`, so an objective that sums over the step's samples scales its part by it)
  local ctx = { targets = N, micro = n_mean }
  local sum, aux_sum, bad = 0, nil, nil
  local red = group and self:reducer()
  for i = 1, n_micro do
    local b = batches[i]
    local l, value, aux, lv
    if self.objective then
      l = self.objective(step.model_view(model, step.forward_opts(b)), b, t, ctx)
      value = l:item()
      lv = value
      if n_mean > 1 then l = l * (1 / n_mean) end
    else
      l, value, aux = data_objective(self, b, N, n_mean)
      lv = aux or 0          -- the backpropagated loss is value / N + aux: finite when both parts are (one read less)
    end
    if not (is_finite(lv) and is_finite(value)) then bad = "loss"; break end
    sum = sum + value
    if aux then aux_sum = (aux_sum or 0) + aux end
    local tb
    if red and i == n_micro then red.arm(); tb = tide.time() end   -- the last backward: buckets sum meanwhile
    l:backward()
    if tb then self.backward_s = tide.time() - tb end
    batches[i] = nil
  end
  -- which replicated parameters got a gradient on this rank: after the sum, one that got none on any rank (unused by
  -- the step's batches: a vision tower in a text-only stage, or frozen) has none, as on one rank, so AdamW leaves it
  -- alone (no weight decay); the sums below give every parameter one first
  local has
  if group then
    has = {}
    for i, p in ipairs(self.dense_params) do has[i] = p.param:grad() ~= nil and 1 or 0 end
  end
  if red then
    -- every rank takes its part in every bucket's sum, also one that stopped at a non-finite loss (zeros)
    if not red.armed then red.arm() end
    local st = red.finish()
    self.comm_s, self.overlap_s, self.buckets, self.buckets_early = st.comm_s, st.overlap_s, st.buckets, st.early
    if self.ep_params then
      -- each rank's experts over the ranks that hold the same ones (as without buckets, below)
      local tc = tide.time()
      self:sum_experts()
      self.comm_s = self.comm_s + (tide.time() - tc)
    end
  end
  if group then
    -- one decision for the step: a non-finite loss on any rank skips it everywhere; then the sums over the ranks
    local vals = { bad and 1 or 0, sum, aux_sum and 1 or 0, aux_sum or 0 }
    for i = 1, #has do vals[4 + i] = has[i] end
    local t = group.sums(vals)
    if t[1] > 0 and not bad then bad = "loss" end   -- (the same record on every rank)
    sum = t[2]
    if t[3] > 0 then aux_sum = t[4] end
    for i = 1, #has do has[i] = t[4 + i] > 0 end
    if not bad and not red then
      local tc = tide.time()
      -- ZeRO-2: each rank keeps the summed gradients of the parameters it owns (a reduce-scatter in rank order)
      if opt.zero == 2 then
        group.reduce_scatter_grads(self.dense_params, self:dense_owners())
        if self.ep_params then
          -- each rank's experts over the ranks holding the same ones, kept whole (their state is the rank's own)
          self:sum_experts()
        end
      elseif self.ep_params then
        -- expert parallelism: the replicated parameters summed over every rank, each rank's experts over the ranks
        -- that hold the same ones (their tokens arrived through the exchange: the expert-parallel group's sum is
        -- already in the gradient)
        group.allreduce_grads(self.dense_params)
        self:sum_experts()
      else group.allreduce_grads(opt.params) end
      self.comm_s = tide.time() - tc
    end
    for i, p in ipairs(self.dense_params) do if not has[i] then p.param:zero_grad() end end
  end
  local loss = self.objective and sum / n_mean or sum / math.max(N, 1)
  local norm
  if not bad then
    local shards = opt.zero == 2 and group or nil
    norm = (self.clip and self.clip > 0) and optim.clip_grad_norm(opt.params, self.clip, shards)
      or optim.grad_norm(opt.params, shards)
    if not is_finite(norm) then
      local name = optim.first_nonfinite(opt.params)
      if shards then
        -- the first in parameter order over every rank's owned gradients: one answer for all ranks
        local idx = {}
        for i, p in ipairs(opt.params) do if p.name == name then idx = { i } end end
        local firsts = {}
        for r = 1, group.world() do firsts[r] = (r - 1 == group.rank() and idx[1]) or 0 end
        firsts = group.sums(firsts)
        local best
        for r = 1, #firsts do if firsts[r] > 0 and (not best or firsts[r] < best) then best = firsts[r] end end
        name = best and opt.params[best].name or nil
      end
      bad = "gradient of " .. (name or "?")
    end
  end
  -- a skipped step's loss is NaN when the loss itself was non-finite, the loss when only a gradient was
  local rec = { loss = bad == "loss" and (0 / 0) or loss, lr = lr, grad_norm = norm, targets = N, aux_loss = aux_sum }
  if bad then
    opt:zero_grad()
    if model.balance_step then model:balance_step({ discard = true }) end   -- MoE: drop the step's routing
    self.consecutive, self.skipped = self.consecutive + 1, self.skipped + 1
    self.first_bad = self.first_bad or fmt("%s at step %d", bad, (t or 0) + 1)
    rec.skipped, rec.nonfinite_tensor = true, bad
    if self.policy == "stop" then
      rec.stop = fmt("stopped at step %d: non-finite %s (on_nonfinite = 'stop')", (t or 0) + 1, bad)
    end
  else
    local poisoned = step.update_nonfinite(opt, opt:step(lr))
    opt:zero_grad()
    if poisoned then
      -- the update itself made a weight non-finite (an infinite or huge lr): the weights are lost, so the step
      -- counts as non-finite and the policy must roll back or stop at once; nothing is saved from them
      self.poisoned = fmt("%s after the update at step %d (lr %s)", poisoned, (t or 0) + 1, tostring(lr))
      self.skipped = self.skipped + 1
      self.first_bad = self.first_bad or self.poisoned
      rec.skipped, rec.nonfinite_tensor = true, poisoned
      rec.stop = self.policy == "stop" and fmt("stopped at step %d: non-finite %s (on_nonfinite = 'stop')", (t or 0) + 1,
        self.poisoned) or nil
    end
    -- MoE balancers set the selection bias from this step's routing, for the next step (moe.md §4.1); under data
    -- parallelism the routing batch is every rank's (counts summed, margins gathered in rank order)
    if model.balance_step then model:balance_step(group and { group = self.balance_group } or nil) end
    self.consecutive = 0
    rec.grad_norm_jitter = self:jitter(norm)
  end
  for l, mt in pairs(model.moe_metrics and model:moe_metrics() or {}) do
    for _, key in ipairs(MOE_KEYS) do
      if mt[key] ~= nil then rec["moe/" .. key .. "/" .. l] = mt[key] end
    end
    -- the step's tokens per expert (they sum to k x tokens): the expert-load heatmap of `tide plot`; a list, so
    -- JSONL only (TensorBoard takes the scalars)
    if type(mt.load) == "table" then
      local load = {}
      for j, v in ipairs(mt.load) do load[j] = v end
      rec["moe/load/" .. l] = load
    end
  end
  local dt = tide.time() - t0
  rec.tokens_step, rec.step_time, rec.tok_per_s = tokens, dt, tokens / math.max(dt, 1e-9)
  if group then
    -- what this rank handed to the network in the step (the gradient sum, ZeRO's weight broadcasts, the scalars),
    -- the mean over the ranks, the seconds of the gradient sum, and with buckets the share of them that ran while
    -- the backward was still running
    local b = group.bytes_sent() - bytes0
    rec["dist/bytes_sent"], rec["dist/bytes_sent_mean"] = b, group.sum(b) / group.world()
    rec["dist/allreduce_s"], self.comm_s = self.comm_s, nil
    if self.overlap_s then
      -- the share of the sum's seconds that ran during the backward, and of the backward's that had a sum running
      rec["dist/overlap"] = rec["dist/allreduce_s"] > 0 and self.overlap_s / rec["dist/allreduce_s"] or 0
      rec["dist/backward_overlapped"] = (self.backward_s or 0) > 0 and math.min(1, self.overlap_s / self.backward_s) or 0
      rec["dist/buckets"], rec["dist/buckets_early"] = self.buckets, self.buckets_early
      self.overlap_s, self.backward_s = nil, nil
    end
  end
  return rec
end

-- true when the non-finite policy asks for a rollback to the last checkpoint (at once when the weights are lost)
function Stepper:rollback_due()
  return self.policy == "skip" and (self.consecutive >= step.ROLLBACK_AFTER or self.poisoned ~= nil)
end

-- name of the first parameter (in order) holding a NaN or an infinity, or nil: one fused engine pass over all
-- the weights (tide_first_nonfinite), not one call per tensor
function step.first_nonfinite_param(params)
  return optim.first_nonfinite_of(params, function(p) return tide.raw(p.param) end)
end

-- update_nonfinite(opt, finite) -> nil, or what the update made non-finite ("weight <name>", "AdamW state ...").
-- finite is opt:step's answer: AdamW's kernel tests what it stores, so a clean step reads no weight again and
-- only a failed one locates the tensor; an optimiser that does not answer (nil) gets the full pass over the weights
function step.update_nonfinite(opt, finite)
  if finite == true then return nil end
  if finite == false and opt.first_nonfinite then return opt:first_nonfinite() or "weight ?" end
  local w = step.first_nonfinite_param(opt.params)
  if w then return "weight " .. w end
  return finite == false and "weight ?" or nil
end

-- ---- the run ----------------------------------------------------------------------------------------------------
local Run = {}
Run.__index = Run

local RUN_KEYS = { driver = true, name = true, cfg = true, out = true, quiet = true, keep_ckpts = true,
  collect_every = true, model = true, optim = true, stepper = true, tokenizer = true, get_data = true,
  set_data = true, get_position = true, set_position = true, tensorboard = true, dist = true }

-- run{driver = "train" | "curriculum", name, cfg (written to <out>/config.json), out, quiet, tensorboard = true (the
--   events file beside metrics.jsonl), keep_ckpts = 2,
--   collect_every = 1, model, optim, stepper, tokenizer, get_data () -> cursors, set_data (cursors, state),
--   get_position () -> nil | curriculum position, set_position (position, state, dir),
--   dist = nil | tide.dist: with several ranks only rank 0 prints, writes metrics and checkpoints (the state is
--   replicated); every rank reads the checkpoint it resumes from}
function step.run(o)
  options.check(o, RUN_KEYS, nil, "step.run")
  local self = setmetatable({}, Run)
  for k, v in pairs(o) do self[k] = v end
  if self.dist and self.dist.world() == 1 then self.dist = nil end
  self.writer = not self.dist or self.dist.is_root()
  if not self.writer then self.quiet = true end
  self.step, self.tokens, self.rollbacks = 0, 0, 0
  self.collect_every = o.collect_every or 1
  self.logger = log.open({ quiet = self.quiet })
  self.result = { losses = {}, out = o.out, model = o.model, tokenizer = o.tokenizer }
  self.t_start = tide.time()
  if self.writer and self.out and tide.C.tide_mkdir_p(self.out) ~= 0 then
    options.fail(o.driver, "cannot create '" .. self.out .. "': " .. ffi.string(tide.C.tide_last_error()))
  end
  return self
end

-- the one checkpoint state shape (besides the weights and the AdamW tensors, which checkpoint.save writes)
function Run:state()
  local moe = {}
  for i, m in ipairs(moe_layers(self.model)) do moe[i] = m:balancer_state() end
  local tok = self.tokenizer
  return {
    format = step.FORMAT, driver = self.driver, name = self.name, tokens = self.tokens,
    skipped = self.stepper.skipped, rng = step.rng_get(), moe = moe, threads = tide.num_threads(),
    tokenizer = tok and { kind = tok.kind, vocab_size = tok.vocab_size } or nil,
    data = self.get_data(), schedule = { step = self.step },
    curriculum = self.get_position and self.get_position() or nil,
    dist = self.dist and { dp = self.dist.world(), zero = self.optim.zero or 0 } or nil,
  }
end

-- a state.json of an earlier format, in this format's shape; a newer format is an error naming both versions
local function upgrade(st, dir)
  local v = st.format or 1
  if type(v) ~= "number" or v < 1 or v > step.FORMAT or v ~= math.floor(v) then
    options.fail("checkpoint", fmt("%s has state format %s; this build reads formats 1 to %d (a newer tide wrote it?)",
      dir, tostring(v), step.FORMAT), 0)
  end
  if v == 1 then
    -- format 1: tide.train kept {data = {train = cursor}}; the curriculum kept kind = "curriculum" and its
    -- stage, stage_name, stage_step, scale and packer at the top level
    if st.kind == "curriculum" then
      st.driver = "curriculum"
      st.curriculum = { stage = st.stage, stage_name = st.stage_name, stage_step = st.stage_step, scale = st.scale }
      st.data = { packer = st.packer }
      st.kind, st.stage, st.stage_name, st.stage_step, st.scale, st.packer = nil, nil, nil, nil, nil, nil
    else
      st.driver = "train"
    end
    st.schedule = { step = st.step }
    st.format = step.FORMAT
  end
  return st
end
step.upgrade = upgrade

-- ---- the schema of state.json (this format, after upgrade) -----------------------------------------------------
-- Each field: its check and what it must be. Checked on load, before anything is restored, so a hostile or damaged
-- state.json ends in one line naming the file and the field, never in a runtime error deep in a driver.
local is_int = options.is_int
local function show(v)
  if v == nil then return "nothing (the field is missing)" end
  if type(v) == "string" then return fmt("%q", v) end
  if type(v) == "number" then return (fmt("%.17g", v)) end
  return "a " .. type(v)
end
local function int_in(lo, hi, what)
  return { what = what, ok = function(v) return is_int(v) and v >= lo and v <= hi end }
end
local NONNEG = int_in(0, 2 ^ 53, "a non-negative integer")
local POS = int_in(1, 2 ^ 53, "a positive integer")
local STRING = { what = "a string", ok = function(v) return type(v) == "string" end }
local TABLE = { what = "a table", ok = function(v) return type(v) == "table" end }
local U64 = { what = "an unsigned 64-bit integer (decimal digits)", ok = function(v)
  return (type(v) == "string" and #v <= 20 and v:match("^%d+$") ~= nil and (#v < 20 or v <= "18446744073709551615"))
    or (is_int(v) and v >= 0 and v <= 2 ^ 53) end }
local DRIVER = { what = "\"train\", \"curriculum\" or \"rl\"", ok = function(v)
  return v == "train" or v == "curriculum" or v == "rl" end }
local function opt(spec) return { what = spec.what, ok = spec.ok, fields = spec.fields, optional = true } end
local function tbl(fields, optional) return { what = "a table", ok = TABLE.ok, fields = fields, optional = optional } end
local function list_of(spec, optional)
  return { what = "a list", ok = TABLE.ok, each = spec, optional = optional }
end

local STATE_SCHEMA = {
  format = int_in(1, step.FORMAT, "an integer from 1 to " .. step.FORMAT), step = NONNEG, driver = DRIVER,
  name = opt(STRING), tokens = opt(NONNEG), skipped = opt(NONNEG), threads = opt(POS),
  rng = tbl({ seed = U64, offset = U64 }),
  moe = list_of(TABLE, true),
  tokenizer = tbl({ kind = opt(STRING), vocab_size = POS }, true),
  data = tbl({}),
  schedule = tbl({ step = NONNEG }),
  optim = tbl({ kind = STRING, t = NONNEG }),
  dist = tbl({ dp = POS, zero = opt(NONNEG) }, true),    -- the layout that wrote it (absent: one rank)
  -- the driver's position: a curriculum's stage, an RL recipe's phase and iteration (and where RL started)
  curriculum = tbl({ stage = opt(POS), stage_step = opt(NONNEG), stage_name = opt(STRING), phase = opt(STRING),
    iteration = opt(NONNEG), rl_start = opt(STRING) }, true),
}

local function check_fields(t, schema, prefix, path)
  for _, k in ipairs(options.sorted_keys(schema)) do
    local spec, v, name = schema[k], t[k], prefix .. k
    if v == nil and spec.optional then
      -- absent and optional
    elseif not spec.ok(v) then
      options.fail("checkpoint", fmt("%s: field '%s' must be %s, got %s", path, name, spec.what, show(v)), 0)
    else
      if spec.fields then check_fields(v, spec.fields, name .. ".", path) end
      if spec.each then
        for i, x in ipairs(v) do
          if not spec.each.ok(x) then
            options.fail("checkpoint", fmt("%s: field '%s[%d]' must be %s, got %s", path, name, i, spec.each.what, show(x)), 0)
          end
        end
      end
    end
  end
end

-- a data cursor of the driver's state (text and task streams: batches drawn, one per step of tide.train; packers:
-- documents per source)
local function check_cursors(st, path)
  local function bad(name, what, v)
    options.fail("checkpoint", fmt("%s: field '%s' must be %s, got %s", path, name, what, show(v)), 0)
  end
  local train = st.data.train
  if st.driver == "train" and train ~= nil then
    if type(train) ~= "table" then bad("data.train", "a table", train) end
    if train.cursor ~= nil and not (is_int(train.cursor) and train.cursor >= 0 and train.cursor <= st.step) then
      bad("data.train.cursor", fmt("an integer from 0 to the step (%d)", st.step), train.cursor)
    end
  end
  for _, key in ipairs({ "train", "packer" }) do
    local p = st.data[key]
    if type(p) == "table" and p.cursors ~= nil then
      if type(p.cursors) ~= "table" then bad("data." .. key .. ".cursors", "a table", p.cursors) end
      for _, src in ipairs(options.sorted_keys(p.cursors)) do
        local v = p.cursors[src]
        if not NONNEG.ok(v) then bad(fmt("data.%s.cursors.%s", key, src), NONNEG.what, v) end
      end
      if p.draws ~= nil and not NONNEG.ok(p.draws) then bad("data." .. key .. ".draws", NONNEG.what, p.draws) end
    end
  end
end

-- check_state(st, path): st (upgraded to this format) against the schema; path names the file in the errors
function step.check_state(st, path)
  if type(st) ~= "table" then
    options.fail("checkpoint", fmt("%s: expected a JSON object, got %s", path, show(st)), 0)
  end
  check_fields(st, STATE_SCHEMA, "", path)
  if st.schedule.step ~= st.step then
    options.fail("checkpoint", fmt("%s: field 'schedule.step' must equal field 'step' (%d), got %s", path, st.step,
      show(st.schedule.step)), 0)
  end
  check_cursors(st, path)
  return st
end

-- write a checkpoint of the current step (no-op without a run directory)
function Run:save()
  if not self.out then return end
  if not self.meta then
    self.meta = checkpoint.describe(self.model, self.tokenizer, self.cfg, plain)
    self.meta["tide.format"] = step.FORMAT
  end
  local tok = self.tokenizer
  -- several ranks: every rank writes its shards of the weights and the moments (a collective), rank 0 the rest
  self.last_ckpt = checkpoint.save(self.out, self.step, { model = self.model, optim = self.optim, state = self:state(),
    keep = self.keep_ckpts or 2, metadata = self.meta, group = self.dist,
    files = tok and tok.save and function(dir) tok:save(dir .. "/tokenizer.json") end or nil })
end

-- what the messages call each driver
step.DRIVER_NAMES = { train = "tide.train", curriculum = "a curriculum", rl = "an RL recipe" }

-- restore(dir) -> state: weights, AdamW, counters, Philox counter, MoE windows, then the driver's cursors and position
function Run:restore(dir)
  local st = checkpoint.load(dir, { model = self.model, optim = self.optim,
    check = function(state, path)
      if type(state) ~= "table" then step.check_state(state, path) end
      step.check_state(upgrade(state, dir), path)
    end })
  if st.driver ~= self.driver then
    options.fail(self.driver, fmt("%s was written by %s, not %s (its data and schedule state do not carry over)", dir,
      step.DRIVER_NAMES[st.driver] or tostring(st.driver), step.DRIVER_NAMES[self.driver] or tostring(self.driver)), 0)
  end
  local tok = self.tokenizer
  if tok and st.tokenizer and st.tokenizer.vocab_size ~= tok.vocab_size then
    options.fail(self.driver, fmt("%s was written with a %d-id tokenizer, this run has %d", dir, st.tokenizer.vocab_size,
      tok.vocab_size), 0)
  end
  self.step, self.tokens = st.step, st.tokens or 0
  self.stepper.skipped = st.skipped or 0
  step.rng_set(st.rng)
  for i, m in ipairs(moe_layers(self.model)) do    -- the dead-expert windows and balancer state (moe.md §5)
    if st.moe and st.moe[i] then m:set_balancer_state(st.moe[i]) end
  end
  self.last_ckpt = dir
  if st.threads and st.threads ~= tide.num_threads() then
    -- reductions split by thread count: the run continues, but not bit-identically
    self.logger:line(fmt("note: %s was written with %d threads, this run uses %d; losses may differ in the last bits",
      dir, st.threads, tide.num_threads()))
  end
  self.set_data(st.data or {}, st)
  if self.set_position then self.set_position(st.curriculum, st, dir) end
  return st
end

-- the files and directories a run writes into its directory (a TensorBoard events.out.tfevents.* file too): a fresh
-- run finds none of them, or the directory belongs to another run
step.RUN_FILES = { "metrics.jsonl", "config.json", "ckpt", "results.json", "report.html", "reference", "trajectories" }

if not pcall(function() return ffi.C.close end) then pcall(ffi.cdef, "int close(int fd);") end
local function is_regular(path)
  if tide.C.tide_path_exists(path) ~= 1 then return false end
  local fd = tide.C.tide_open_regular(path, "file", nil)
  if fd < 0 then return false end
  ffi.C.close(fd)
  return true
end

-- run_files(out) -> the names of another run's files found in out (sorted; empty when there are none)
function step.run_files(out)
  local found = {}
  for _, name in ipairs(step.RUN_FILES) do
    local path = out .. "/" .. name
    -- a run's own files are regular (ckpt a directory); anything else in their place is not a run's (a FIFO
    -- config.json is replaced by the atomic write, a FIFO metrics.jsonl refused when it is opened)
    local is_dir = name == "ckpt" or name == "reference" or name == "trajectories"   -- directories (RL runs' too)
    if is_dir and tide.C.tide_is_dir(path) == 1 or not is_dir and is_regular(path) then
      found[#found + 1] = name
    end
  end
  local n = ffi.new("size_t[1]")
  local raw = tide.C.tide_list_dir(out, n)
  if raw ~= nil then
    local names = ffi.string(raw, n[0])
    tide.C.tide_free(raw)
    for name in names:gmatch("([^%z]+)%z") do
      if name:match("^events%.out%.tfevents%.") then found[#found + 1] = name end
    end
  end
  table.sort(found)
  return found
end

-- a fresh run into a directory that holds another run: refused, or (overwrite) that run's files are removed first
local function claim(self, out, overwrite, why)
  local found = step.run_files(out)
  if #found == 0 then return end
  if not overwrite then
    local ck = checkpoint.list(out) or {}
    local shown = {}
    for i, name in ipairs(found) do
      shown[i] = name == "ckpt" and fmt("ckpt/ with %d checkpoint%s", #ck, #ck == 1 and "" or "s") or name
    end
    options.fail(self.driver, fmt("'%s' holds another run (%s)%s; continue it with --resume, replace it with --overwrite, "
      .. "or choose another --out", out, table.concat(shown, ", "), why or ""), 0)
  end
  for _, name in ipairs(found) do
    if tide.C.tide_remove_tree(out .. "/" .. name) ~= 0 then
      options.fail(self.driver, fmt("--overwrite: cannot remove %s/%s: %s", out, name, ffi.string(tide.C.tide_last_error())), 0)
    end
  end
  self.logger:line(fmt("overwrite: removed the previous run in %s (%s)", out, table.concat(found, ", ")))
end

-- true when path (a checkpoint directory) lies inside the run directory out (both exist)
if not pcall(function() return ffi.C.realpath end) then pcall(ffi.cdef, "char *realpath(const char *path, char *resolved);") end
local function inside(path, out)
  local function real(p)
    local buf = ffi.new("char[4097]")
    return ffi.C.realpath(p, buf) ~= nil and ffi.string(buf) or p
  end
  local rp, ro = real(path), real(out)
  return rp:sub(1, #ro + 1) == ro .. "/"
end

-- open(resume, overwrite) -> the restored state or nil: resume (true = this run directory, or a path) or a fresh run;
-- then the metrics file (truncated after the resumed step, or started anew) and config.json. A fresh run never
-- writes into another run's directory unless overwrite says so; nothing of another run is pruned.
function Run:open(resume, overwrite)
  local out, st = self.out, nil
  if out and self.writer then
    for _, note in ipairs(checkpoint.recover(out)) do self.logger:line(note) end
  end
  -- the other ranks read the run directory only after rank 0 has recovered it
  if self.dist then self.dist.barrier() end
  if not self.writer then
    -- a rank other than 0: the checkpoint to resume from, read only; rank 0 checks and writes the directory
    if resume then
      local ok, dir = pcall(checkpoint.resolve, resume == true and out or resume)
      if not ok then options.fail(self.driver, fmt("--resume: %s", tostring(dir):gsub("^checkpoint: ", "")), 0) end
      st = self:restore(dir)
      self.resumed_from, self.start_step = dir, self.step
    end
    return st
  end
  if resume then
    local target = resume
    if target == true then
      if not out then options.fail(self.driver, "resume = true needs train.out (the run directory)", 0) end
      target = out
    end
    if C_is_dir(target) ~= 1 then
      options.fail(self.driver, fmt("--resume: '%s' does not exist (a run directory or a checkpoint directory)", target), 0)
    end
    local ok, dir = pcall(checkpoint.resolve, target)
    if not ok then
      options.fail(self.driver, fmt("--resume: %s", tostring(dir):gsub("^checkpoint: ", "")) .. (target == out
        and "; start the run without --resume" or ""), 0)
    end
    if out and not inside(dir, out) then
      claim(self, out, overwrite, fmt(", and --resume=%s is not one of its checkpoints", tostring(resume)))
    end
    st = self:restore(dir)
    self.resumed_from = dir
    self.start_step = self.step
    if out then
      local later = {}
      for _, name in ipairs(checkpoint.list(out) or {}) do
        if tonumber(name:match("^step_(%d+)$") or -1) > self.step then later[#later + 1] = name end
      end
      if #later > 0 then
        self.logger:line(fmt("note: resuming at step %d of a run that went further (%s): those checkpoints are kept "
          .. "and replaced as this run reaches their steps", self.step, table.concat(later, ", ")))
      end
      local pos = self.driver == "rl" and self.get_position and self.get_position() or nil
      step.truncate_metrics(out .. "/metrics.jsonl", self.step, pos and pos.iteration)
    end
  elseif out then
    claim(self, out, overwrite)
  end
  if out then
    self.logger = log.open({ path = out .. "/metrics.jsonl", quiet = self.quiet, tensorboard = self.tensorboard })
    if not resume and self.cfg then
      if tide.C.tide_file_write_text_atomic(out .. "/config.json", json.encode(plain(self.cfg)) .. "\n") ~= 0 then
        options.fail(self.driver, "cannot write config.json: " .. ffi.string(tide.C.tide_last_error()), 0)
      end
    end
  end
  return st
end

-- train_step(batches, lr) -> record: the one step, then the run's counters; the record is logged by record()
function Run:train_step(batches, lr)
  local rec = self.stepper:run(batches, lr, self.step)
  self.step = self.step + 1
  self.tokens = self.tokens + rec.tokens_step
  rec.tokens_step = nil
  rec.step, rec.time, rec.tokens = self.step, os.time(), self.tokens
  self.result.losses[self.step] = rec.loss
  if self.collect_every > 0 and self.step % self.collect_every == 0 then tide.collect() end
  local mem = tide.memory()
  rec.mem_current, rec.mem_peak = mem.current, mem.peak
  return rec
end

function Run:record(rec) self.logger:metrics(rec) end

-- after_step(rec, ckpt_due) -> true when the run must stop. The non-finite policy: stop on request; after 5
-- consecutive skips roll back to the last checkpoint (at most twice); otherwise checkpoint when due (never on a
-- skipped step: a rollback must land before the non-finite streak)
function Run:after_step(rec, ckpt_due)
  local s = self.stepper
  if rec.stop then self.result.stopped = rec.stop; return true end
  if s:rollback_due() then
    if self.rollbacks >= step.MAX_ROLLBACKS or not self.last_ckpt then
      local why = s.poisoned and fmt("non-finite %s", s.poisoned)
        or fmt("%d consecutive non-finite steps", s.consecutive)
      self.result.stopped = fmt("stopped at step %d: %s%s; first non-finite tensor: %s",
        self.step, why, self.last_ckpt and fmt(" after %d rollbacks", step.MAX_ROLLBACKS)
          or " and no checkpoint to roll back to", s.first_bad)
      return true
    end
    self.rollbacks, s.consecutive = self.rollbacks + 1, 0
    self.logger:line(fmt("rolling back to %s after %s (rollback %d of %d)", self.last_ckpt,
      s.poisoned and ("non-finite " .. s.poisoned) or fmt("%d consecutive non-finite steps", step.ROLLBACK_AFTER),
      self.rollbacks, step.MAX_ROLLBACKS))
    self.logger:metrics({ step = self.step, event = "rollback", checkpoint = self.last_ckpt, rollbacks = self.rollbacks })
    self:restore(self.last_ckpt)
    s.poisoned = nil
  elseif not rec.skipped and ckpt_due then
    self:save()
  end
  return false
end

-- finish() -> the result table: the final checkpoint (unless stopped), the mean of the last 20 finite losses, counters
function Run:finish()
  local r, logger = self.result, self.logger
  logger:done()
  if not r.stopped and self.stepper.poisoned then
    r.stopped = fmt("stopped at step %d: non-finite %s; the weights were not saved", self.step, self.stepper.poisoned)
  end
  local ran = self.step - (self.start_step or 0)
  if r.stopped then
    logger:line(r.stopped)
    logger:metrics({ step = self.step, event = "stopped", report = r.stopped })
  elseif ran > 0 or not (self.out and self.last_ckpt and self.last_ckpt:sub(1, #self.out + 6) == self.out .. "/ckpt/") then
    self:save()     -- (a resumed run that trained nothing keeps the checkpoint of its own directory it started from)
  end
  r.steps_run = ran
  local n, sum = 0, 0
  for s = math.max(1, self.step - 19), self.step do
    local v = r.losses[s]
    if v and is_finite(v) then sum, n = sum + v, n + 1 end
  end
  r.steps, r.tokens, r.elapsed = self.step, self.tokens, tide.time() - self.t_start
  r.final_loss, r.final_loss_n = n > 0 and sum / n or 0 / 0, n
  r.last_loss = r.losses[self.step]
  r.checkpoint, r.skipped, r.rollbacks = self.last_ckpt, self.stepper.skipped, self.rollbacks
  return r
end

-- the compact expert-load line of an eval: per MoE layer MaxVio of the last batch / over the validation tokens,
-- dead experts and the selection-bias spread
function step.moe_line(model, maxvio_global)
  local mt, parts, ls = model.moe_metrics and model:moe_metrics() or {}, {}, {}
  for l in pairs(mt) do ls[#ls + 1] = l end
  table.sort(ls)
  for _, l in ipairs(ls) do
    local m, g = mt[l], (maxvio_global or {})[l]
    if m.maxvio_batch then
      parts[#parts + 1] = fmt("L%d %.2f/%s/%d/%.3f", l, m.maxvio_batch, g and fmt("%.2f", g) or "-", m.dead_experts or 0,
        m.b_std or 0)
    end
  end
  if #parts == 0 then return nil end
  return "moe maxvio batch/global, dead, b_std: " .. table.concat(parts, "  ")
end

-- the expert-load table at the end of a run (per MoE layer, 0-based)
function step.moe_table(model, maxvio_global)
  local moe = model.moe_metrics and model:moe_metrics() or {}
  if not next(moe) then return nil end
  local ls = {}
  for l in pairs(moe) do ls[#ls + 1] = l end
  table.sort(ls)
  local lines = { "| MoE layer | MaxVio last batch | MaxVio val | dead experts | b std |", "|---:|---:|---:|---:|---:|" }
  local gv = maxvio_global or {}
  for _, l in ipairs(ls) do
    local mt = moe[l]
    lines[#lines + 1] = fmt("| %d | %s | %s | %d | %.3f |", l, mt.maxvio_batch and fmt("%.3f", mt.maxvio_batch) or "–",
      gv[l] and fmt("%.3f", gv[l]) or "–", mt.dead_experts or 0, mt.b_std or 0)
  end
  return table.concat(lines, "\n"), moe
end

-- the held-out pass's MaxVio per MoE layer (0-based, as model:moe_metrics()): count_eval_loads around fn()
function step.with_eval_loads(model, fn, group)
  local layers = moe_layers(model)
  for _, m in ipairs(layers) do m:count_eval_loads(true) end
  model:eval()
  local ok, a, b = pcall(tide.no_grad, fn)
  model:train()
  local maxvio = {}
  for _, m in ipairs(layers) do
    local r = m:count_eval_loads(false, ok and group or nil)
    for l = 1, model.cfg.n_layers do
      if r and model.model.layers:get(l).block_sparse_moe == m then maxvio[l - 1] = r.maxvio end
    end
  end
  if not ok then error(a, 0) end
  return maxvio, a, b
end

return step
