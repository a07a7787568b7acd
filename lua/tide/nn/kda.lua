-- nn/kda.lua — the Kimi Delta Attention layer (spec/kda.md §1): projections -> short causal conv + SiLU ->
-- L2 norm -> delta-rule kernel with a per-channel decay gate -> per-head RMSNorm -> sigmoid output gate ->
-- output projection. Names are the checkpoint names of formats.md §2 (self_attn.q_proj, q_conv1d, A_log, ...).
--
-- A cache table {state = [B, H, dk, dv], conv = {q =, k =, v =} ([B, K-1, H·dk] each), pos = n} carries
-- the recurrent state and the last K-1 pre-conv inputs (kda.md §7) from one call to the next: decoding,
-- and processing a long sequence segment by segment. The cache tensors are ordinary graph tensors, so
-- gradients flow through them across segments.
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local norms = require "tide.nn.norm"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F

local fmt = string.format

-- the depthwise tap tensor [C, 1, K] of one short convolution, as its own module so the checkpoint name
-- is <prefix>.q_conv1d.weight; taps get no weight decay (optim.md §1)
local ShortConv = M.Module:extend("ShortConv")

function ShortConv:init(channels, size, opts)
  self.channels, self.size = channels, size
  -- U(-0.5, 0.5): the PyTorch Conv1d default for fan-in 4 (spec/README.md, Initialisation)
  local w = tide.rand({ channels, 1, size }, { lo = -0.5, hi = 0.5, dtype = opts.dtype or "f32", device = opts.device })
  self:param("weight", w, { decay = false })
end

function ShortConv:extra_repr() return fmt("%d, kernel=%d, depthwise", self.channels, self.size) end

local KDA = M.Module:extend("KDA")

local KEYS = {
  heads = true, head_dim = true, conv_size = true, gate_form = true, gate_lower_bound = true, chunk = true, norm_eps = true,
  std = true, out_std = true, dtype = true, device = true,
}
KDA.KEYS = KEYS
local GATE_FORMS = { bounded = true, softplus = true }

-- errors point at the first caller outside lua/tide (the line that built or called the layer)
local WHO = "nn.KDA"
local function bad(msg) options.fail(WHO, msg) end
local function pos_int(v, name) return options.pos_int(v, name, WHO) end

-- softplus⁻¹(dt) = dt + log(1 − e^{−dt}); for dt >= 1e-4 the cancellation in 1 − e^{−dt} costs ~1e-12 relative
local function inv_softplus(dt) return dt + math.log(1 - math.exp(-dt)) end

-- KDA(dim, {heads, head_dim (dk = dv), conv_size = 4, gate_form = "bounded" | "softplus", gate_lower_bound = -5,
--   chunk = 16 (tide.defaults.kda), norm_eps = 1e-5, std = 0.02, out_std = std, dtype = "f32", device = "cpu"})
function KDA:init(dim, opts)
  opts = options.check(opts or {}, KEYS, nil, WHO)
  local kd = defaults.kda
  self.dim = pos_int(dim, "dim")
  local H = pos_int(opts.heads, "heads")
  local dk = pos_int(opts.head_dim, "head_dim")
  self.heads, self.head_dim = H, dk
  self.conv_size = options.int_at_least(opts.conv_size or kd.conv_size, 2, "conv_size", WHO)
  self.gate_form = options.one_of(opts.gate_form or kd.gate_form, GATE_FORMS, "gate_form", WHO)
  self.chunk = pos_int(opts.chunk or kd.chunk, "chunk")
  self.gate_lower_bound = opts.gate_lower_bound or kd.gate_lower_bound
  if self.gate_form == "bounded" then
    -- the dense chunk path needs exp(±G) normal in fp32/bf16 over a chunk: chunk·|lb| <= 80 (kda.md §5);
    -- held for every dtype, so a config that runs in f64 also runs on the GPU
    local lb = self.gate_lower_bound
    if type(lb) ~= "number" or not (lb < 0 and lb >= -80 / self.chunk) then
      bad(fmt("gate_lower_bound must lie in [-80/chunk, 0) = [%g, 0) for the chunk path with chunk %d (kda.md §5), got %s",
        -80 / self.chunk, self.chunk, tostring(lb)))
    end
  end
  -- the softplus gate is unbounded below: only the per-pair exponent path is safe (kda.md §5)
  self.path = self.gate_form == "bounded" and "chunk" or "chunk_safe"
  self.norm_eps = opts.norm_eps or defaults.norm_eps
  local std = opts.std or defaults.init_std
  local po = { dtype = opts.dtype, device = opts.device }
  local function lin(i, o, s) return Linear(i, o, { std = s, dtype = opts.dtype, device = opts.device }) end
  local inner = H * dk
  self:child("q_proj", lin(dim, inner, std))
  self:child("k_proj", lin(dim, inner, std))
  self:child("v_proj", lin(dim, inner, std))
  self:child("g_proj", lin(dim, inner, std))
  self:child("o_proj", lin(inner, dim, opts.out_std or std))
  self:child("q_conv1d", ShortConv(inner, self.conv_size, po))
  self:child("k_conv1d", ShortConv(inner, self.conv_size, po))
  self:child("v_conv1d", ShortConv(inner, self.conv_size, po))
  self:child("f_a_proj", lin(dim, dk, std))
  self:child("f_b_proj", lin(dk, inner, std))
  self:child("b_proj", lin(dim, H, std))
  -- A_log = 0 and dt_bias = softplus⁻¹(dt), dt ~ exp(U(ln 1e-3, ln 1e-1)) clamped >= 1e-4 (spec/README.md,
  -- Initialisation); neither decays (optim.md §1)
  self:param("A_log", M.Module.new_param({ H }, { "zeros" }, po), { decay = false })
  local u = tide.rand({ inner }, { lo = math.log(1e-3), hi = math.log(1e-1), dtype = "f64" }):tolist()
  for i = 1, inner do u[i] = inv_softplus(math.max(math.exp(u[i]), 1e-4)) end
  self:param("dt_bias", tide.tensor(u, { dtype = opts.dtype or "f32", device = opts.device }), { decay = false })
  self:child("o_norm", norms.RMSNorm(dk, { eps = self.norm_eps, dtype = opts.dtype, device = opts.device }))
end

-- the new conv cache of one stream: the last K-1 pre-conv inputs of each row, zero before the start of
-- the row's last document (that document is what the next segment continues, kda.md §8)
local function conv_tail(x, old, K1, mask)
  local T = x:size(2)
  local tail
  if T >= K1 then
    tail = x:narrow(2, T - K1 + 1, K1)
  else
    local prev = old or tide.zeros({ x:size(1), K1, x:size(3) }, { dtype = x:dtype(), device = x:device() })
    tail = F.concat({ prev, x }, 2):narrow(2, T + 1, K1)
  end
  if mask then tail = tail * mask end
  return tail
end

-- [B, K-1, 1] of 0/1, or nil when every row's last document covers the whole window; cu is a Lua list
local function tail_mask(cu, B, T, K1, dtype, device)
  if not cu then return nil end
  local start, i = {}, 1
  for b = 0, B - 1 do
    local s = 0
    for _, c in ipairs(cu) do
      if c > b * T and c < (b + 1) * T then s = c - b * T end
    end
    start[b + 1] = s
  end
  local vals, any = {}, false
  for b = 1, B do
    for j = 1, K1 do
      local t = T - K1 + j - 1          -- 0-based position in the row; negative = from the old cache
      local keep = start[b] == 0 or t >= start[b]
      vals[i] = keep and 1 or 0
      if not keep then any = true end
      i = i + 1
    end
  end
  if not any then return nil end
  return tide.tensor(vals, { shape = { B, K1, 1 }, dtype = dtype, device = device })
end

local FORWARD_KEYS = { cache = true, cu_seqlens = true, path = true, reset = true, state_rows = true, conv_rows = true, cp = true }

-- the carried cache of the rows that continue, the rows in `reset` zeroed (a new document starts exactly
-- at this call); multiplying keeps the graph and gives the dropped rows a zero gradient
local function reset_rows(t, reset, B)
  if t == nil or not reset then return t end
  local keep, any = {}, false
  for b = 1, B do
    local r = reset == true or reset[b]
    keep[b] = r and 0 or 1
    any = any or r
  end
  if not any then return t end
  local shape = { B }
  for _ = 2, t:dim() do shape[#shape + 1] = 1 end
  return t * tide.tensor(keep, { shape = shape, dtype = t:dtype(), device = t:device() })
end

-- forward(x [B, T, d], opts) -> [B, T, d]
--   opts.cu_seqlens: packed documents (Lua list of 0-based offsets {0, ..., B·T} or an int tensor); the conv
--     history and the state restart at every boundary (kda.md §8)
--   opts.cache: {state =, conv = {q =, k =, v =}} or {} — the layer starts from it (first document of each
--     row) and writes the new state, conv caches and pos back into it
--   opts.reset: true, or a list of B booleans: rows whose first document starts fresh at this call (a
--     boundary exactly at the segment start) and so ignore the carried cache
--   opts.path: kernel path override ("chunk", "chunk_safe", "recurrent"); default by gate
function KDA:forward(x, opts)
  opts = options.check(opts or {}, FORWARD_KEYS, "forward options", WHO)
  if not tide.is_tensor(x) or x:dim() ~= 3 or x:size(3) ~= self.dim then
    bad(fmt("x must be [B, T, %d], got %s", self.dim,
      tide.is_tensor(x) and ("[" .. table.concat(x:shape(), ", ") .. "]") or type(x)))
  end
  local cache = opts.cache
  if opts.cp then
    if opts.cu_seqlens or opts.state_rows or (cache and cache.rows) then
      bad("forward: cp (context parallelism) carries the documents itself and takes no cu_seqlens or row caches")
    end
    if opts.reset ~= nil then
      if not cache then bad("forward: reset restarts rows of a cache, and none was given") end
      if opts.reset ~= true and opts.reset ~= false and type(opts.reset) ~= "table" then
        bad("forward: reset must be a boolean or a list of B booleans, got " .. type(opts.reset))
      end
      if type(opts.reset) == "table" and #opts.reset ~= opts.cp.B then
        bad(fmt("forward: reset lists %d rows but the cp context has B = %d", #opts.reset, opts.cp.B))
      end
    end
    return self:forward_cp(x, opts.cp, opts.path, cache, opts.reset)
  end
  if cache and cache.rows then return self:forward_rows(x, opts) end
  local B, T = x:size(1), x:size(2)
  local H, dk = self.heads, self.head_dim
  local K1 = self.conv_size - 1
  if opts.reset ~= nil and opts.reset ~= true and opts.reset ~= false and type(opts.reset) ~= "table" then
    bad("forward: reset must be a boolean or a list of B booleans, got " .. type(opts.reset))
  end
  if type(opts.reset) == "table" and #opts.reset ~= B then
    bad(fmt("forward: reset lists %d rows but x has B = %d", #opts.reset, B))
  end
  local conv, s0 = {}, nil
  if cache then
    for _, name in ipairs({ "q", "k", "v" }) do conv[name] = reset_rows(cache.conv and cache.conv[name], opts.reset, B) end
    s0 = reset_rows(cache.state, opts.reset, B)
  end
  local cu = opts.cu_seqlens
  local cu_list
  if cu ~= nil then
    -- read once here (the cache mask) and made a tensor once for the three convs and the kernel
    if tide.is_tensor(cu) then cu_list = cu:tolist()
    elseif type(cu) == "table" then cu_list, cu = cu, tide.tensor(cu, { dtype = "i64", device = x:device() })
    else bad("forward: cu_seqlens must be a list of offsets or an integer tensor, got " .. type(cu)) end
  end

  -- 1-3. projections, causal conv + SiLU (fused), L2 norm per head; q carries dk^-1/2
  local pre = { q = self.q_proj:forward(x), k = self.k_proj:forward(x), v = self.v_proj:forward(x) }
  local function conv1d(name)
    if opts.conv_rows then   -- forward_rows' decoding step: each row's own history, advanced in place
      return F.conv_decode_rows(pre[name], self[name .. "_conv1d"].weight, opts.conv_rows[name], { silu = true })
    end
    return F.causal_conv1d(pre[name], self[name .. "_conv1d"].weight, { cache = conv[name], cu_seqlens = cu, silu = true })
  end
  local q = F.l2norm(conv1d("q"):reshape(B, T, H, dk), { eps = 1e-6, scale = 1 / math.sqrt(dk) })
  local k = F.l2norm(conv1d("k"):reshape(B, T, H, dk), { eps = 1e-6 })
  local v = conv1d("v"):reshape(B, T, H, dk)
  -- 4. β = σ(W_b x), one per head and token
  local beta = self.b_proj:forward(x):sigmoid()
  -- 5. the decay gate through the dk bottleneck (kda.md §2)
  local z = self.f_b_proj:forward(self.f_a_proj:forward(x)):reshape(B, T, H, dk)
  local g = F.kda_gate(z, self.A_log, self.dt_bias, { gate_form = self.gate_form, gate_lower_bound = self.gate_lower_bound })
  -- 6. the kernel; state_rows (forward_rows' decoding step): each row's own state, advanced in place
  local o, state
  if opts.state_rows then
    o = F.kda_decode_rows(q:reshape(B, H, dk), k:reshape(B, H, dk), v:reshape(B, H, dk), g:reshape(B, H, dk),
      beta:reshape(B, H), opts.state_rows):reshape(B, T, H, dk)
  else
    o, state = F.kda(q, k, v, g, beta, { s0 = s0, cu_seqlens = cu,
      path = opts.path or self.path, chunk = self.chunk, gate_lower_bound = self.gate_lower_bound })
  end
  -- 7. norm -> gate -> project (one o_norm weight [dv] shared by the heads)
  local n = self.o_norm:forward(o)
  local y = (n * self.g_proj:forward(x):reshape(B, T, H, dk):sigmoid()):reshape(B, T, H * dk)
  y = self.o_proj:forward(y)

  if cache then
    local mask = tail_mask(cu_list, B, T, K1, x:dtype(), x:device())
    cache.conv = {
      q = conv_tail(pre.q, conv.q, K1, mask), k = conv_tail(pre.k, conv.k, K1, mask), v = conv_tail(pre.v, conv.v, K1, mask),
    }
    if state then cache.state = state end
    cache.pos = (cache.pos or 0) + T
  end
  return y
end

-- forward_cp(x [R·B, 2·Tc, d], ctx): the layer on context-parallel slices (cp.lua; long_context.md §5). Each slice
-- holds two segments of its row; as row-segments [R·B·2, Tc] they run the layer's kernels with
--   the short convolutions' history: the last K−1 pre-conv inputs of the previous segment (gathered; zero at a
--     document start), so the convolution reads what the unsplit row would;
--   the state: each segment's end state from zero h_ext and its transition M (kda.md §4: S_end = M S0 + h_ext) in
--     ONE kernel call, v widened by dk zero columns and S0 = [0 | I]: the state's columns evolve independently, so
--     the first dv columns end at h_ext and the last dk at M (M = 0 past a document start inside the segment);
--     the pairs of every segment are gathered and folded (Ctx:fold, in the state dtype: f32 for bf16 inputs) into
--     each segment's true start state, and the kernel reruns from it.
-- The fold and the gathers are ops of the graph: the backward reaches every segment's M and h_ext (the gathers'
-- gradient is the reduce-scatter), which is the right-to-left fold of the state gradients in long_context.md §5.
-- cache ({} or a cache this call filled before, the same on every rank of the group): the rows continue from it
-- (a long row processed call by call, each call split over the ranks): segment 0 starts from its state and reads
-- its conv history; the call writes the rows' end state (every rank folds the whole chain) and their last K−1
-- pre-conv inputs (from the gathered tails) back, so the cache stays the same on every rank. reset (true or a list
-- of B booleans): those rows start a new document at this call and ignore the cache.
function KDA:forward_cp(x, ctx, path, cache, reset)
  local RB, T2 = x:size(1), x:size(2)
  local H, dk, K1, Tc = self.heads, self.head_dim, self.conv_size - 1, ctx.Tc
  if RB ~= ctx.R * ctx.B or T2 ~= 2 * Tc then
    bad(fmt("forward: a cp slice must be [R·B, 2·Tc, d] = [%d, %d, %d], got [%s]", ctx.R * ctx.B, 2 * Tc, self.dim,
      table.concat(x:shape(), ", ")))
  end
  local n, inner = RB * 2, H * dk
  local cu = tide.tensor(ctx.local_cu, { dtype = "i64", device = x:device() })
  local pre = {
    q = self.q_proj:forward(x):reshape(n, Tc, inner), k = self.k_proj:forward(x):reshape(n, Tc, inner),
    v = self.v_proj:forward(x):reshape(n, Tc, inner),
  }
  -- the conv halo: every segment's last K−1 pre-conv inputs, gathered; each row-segment reads its predecessor's
  local cconv = cache and cache.conv
  if cconv then
    local B = ctx.B
    cconv = { q = reset_rows(cconv.q, reset, B), k = reset_rows(cconv.k, reset, B), v = reset_rows(cconv.v, reset, B) }
  end
  local prev, mask = ctx:halo(K1, x:dtype(), x:device(), cconv ~= nil)
  local tails = ctx:gather(F.concat({ pre.q:narrow(2, Tc - K1 + 1, K1), pre.k:narrow(2, Tc - K1 + 1, K1),
    pre.v:narrow(2, Tc - K1 + 1, K1) }, 3))
  local src = cconv and F.concat({ tails, F.concat({ cconv.q, cconv.k, cconv.v }, 3) }, 1) or tails
  local halo = src:index_select(1, prev) * mask
  local hs = { q = halo:narrow(3, 1, inner), k = halo:narrow(3, inner + 1, inner), v = halo:narrow(3, 2 * inner + 1, inner) }
  local function conv1d(name)
    return F.causal_conv1d(pre[name], self[name .. "_conv1d"].weight,
      { cache = hs[name]:contiguous(), cu_seqlens = cu, silu = true })
  end
  local q = F.l2norm(conv1d("q"):reshape(n, Tc, H, dk), { eps = 1e-6, scale = 1 / math.sqrt(dk) })
  local k = F.l2norm(conv1d("k"):reshape(n, Tc, H, dk), { eps = 1e-6 })
  local v = conv1d("v"):reshape(n, Tc, H, dk)
  local beta = self.b_proj:forward(x):sigmoid():reshape(n, Tc, H)
  local z = self.f_b_proj:forward(self.f_a_proj:forward(x)):reshape(n, Tc, H, dk)
  local g = F.kda_gate(z, self.A_log, self.dt_bias, { gate_form = self.gate_form, gate_lower_bound = self.gate_lower_bound })
  local kopts = { cu_seqlens = cu, path = path or self.path, chunk = self.chunk, gate_lower_bound = self.gate_lower_bound }
  -- (h_ext | M) of every local segment in one call (F.kda_pairs: the kernel on [v | 0] from [0 | I], which keeps only
  -- its inputs for the backward), then gathered and folded into the start states
  local pairs = F.kda_pairs(q, k, v, g, beta, { cu_seqlens = cu, path = kopts.path, chunk = kopts.chunk,
    gate_lower_bound = kopts.gate_lower_bound })
  local init = cache and reset_rows(cache.state, reset, ctx.B)
  if init and init:dtype() ~= pairs:dtype() then init = init:to(pairs:dtype()) end
  local s0, s_end = ctx:fold(ctx:gather(pairs), dk, init, cache ~= nil)
  kopts.s0 = s0
  local o = F.kda(q, k, v, g, beta, kopts)
  if cache then
    local rows, tmask = ctx:row_tail(K1, x:dtype(), x:device())
    local t = tails:index_select(1, rows) * tmask
    cache.conv = { q = t:narrow(3, 1, inner), k = t:narrow(3, inner + 1, inner), v = t:narrow(3, 2 * inner + 1, inner) }
    cache.state, cache.pos = s_end, (cache.pos or 0) + ctx.T
  end
  local y = (self.o_norm:forward(o) * self.g_proj:forward(x):reshape(n, Tc, H, dk):sigmoid()):reshape(RB, T2, inner)
  return self.o_proj:forward(y)
end

-- B rows that each carry their own cache (opts.cache.rows = {B row caches}, all started or all empty). A decoding
-- step without gradients (T = 1, started rows, no reset or cu_seqlens) advances each row's own state and conv
-- histories in place (F.kda_decode_rows, F.conv_decode_rows): nothing is stacked, so the rows may differ from step
-- to step (a rollout's rows wait on tools, end and start) at no cost. Other calls stack the rows' conv histories
-- (and states) for the call and give each row its row of the new ones back (views of the stacked tensors); when
-- the rows are the ones of the previous call, in order, and their views untouched, that call's stacked tensors are
-- the stack (no copy). Every row's recurrence is its own, so row b's output equals its call alone.
local function stacked_of(rows, B, names)
  local st = rows[1].stack
  if not st or st.n ~= B or st.names ~= names then return nil end
  for r = 1, B do
    local c = rows[r]
    if c.stack ~= st or c.stack_i ~= r then return nil end
    for _, name in ipairs(names) do
      local cur = name == "state" and c.state or c.conv[name]
      if cur ~= st.views[name][r] then return nil end
    end
  end
  return st
end

local WITH_STATE, CONV_ONLY = { "state", "q", "k", "v" }, { "q", "k", "v" }

function KDA:forward_rows(x, opts)
  local rows, B = opts.cache.rows, x:size(1)
  if type(rows) ~= "table" or #rows ~= B then
    bad(fmt("forward: cache.rows must list one cache per row of x (%d), got %s", B,
      type(rows) == "table" and tostring(#rows) or type(rows)))
  end
  local started = rows[1].state ~= nil
  for r = 2, B do
    if (rows[r].state ~= nil) ~= started then bad("forward: cache.rows mixes started and empty caches") end
  end
  local T = x:size(2)
  local in_place = started and T == 1 and not tide.grad_enabled()
  if in_place and not opts.reset and opts.cu_seqlens == nil then
    -- a decoding step: each row's state and conv histories advanced in place by the row kernels, nothing stacked
    -- (the rows of a rollout change from step to step as rows wait on tools, end or start)
    local states, conv = {}, { q = {}, k = {}, v = {} }
    for r = 1, B do
      local c = rows[r]
      states[r] = c.state
      for _, name in ipairs(CONV_ONLY) do
        local h = c.conv[name]
        if not h:is_contiguous() then h = h:contiguous(); c.conv[name] = h end
        conv[name][r] = h
      end
    end
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.cache, o.state_rows, o.conv_rows = nil, states, conv
    local y = self:forward(x, o)
    for _, c in ipairs(rows) do c.pos = (c.pos or 0) + T end
    return y
  end
  local names = in_place and CONV_ONLY or WITH_STATE
  local tmp = { conv = {} }
  local prev
  if started then
    prev = stacked_of(rows, B, names)
    local t = {}
    for _, name in ipairs(names) do
      if prev then
        t[name] = prev.t[name]
      else
        local parts = {}
        for r = 1, B do parts[r] = name == "state" and rows[r].state or rows[r].conv[name] end
        t[name] = B == 1 and parts[1] or F.concat(parts, 1)
      end
    end
    tmp.state, tmp.conv = t.state, { q = t.q, k = t.k, v = t.v }
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.cache = tmp
  if in_place then
    local states = {}
    for r = 1, B do states[r] = rows[r].state end
    o.state_rows = states
  end
  local y = self:forward(x, o)
  if in_place and prev then
    -- the same rows as the previous step: the new conv tails written into its stacked tensors, so the rows' views
    -- (the stack's) stay theirs and a step makes no views (the tails are new tensors, never views of the stack)
    for _, name in ipairs(names) do prev.t[name]:copy_(tmp.conv[name]) end
    for _, c in ipairs(rows) do c.pos = (c.pos or 0) + T end
    return y
  end
  local t = { state = tmp.state, q = tmp.conv.q, k = tmp.conv.k, v = tmp.conv.v }
  local stack = { n = B, t = t, views = {}, names = names }
  for _, name in ipairs(names) do stack.views[name] = B == 1 and { t[name] } or F.split(t[name], 1, 1) end
  local vs = stack.views
  for r, c in ipairs(rows) do
    if not in_place then c.state = vs.state[r] end
    c.conv = { q = vs.q[r], k = vs.k[r], v = vs.v[r] }
    c.stack, c.stack_i = stack, r
    c.pos = (c.pos or 0) + T
  end
  return y
end

-- prefill(x [B, T, d], cache) -> [B, T, d]: the chunked path from (and into) cache
function KDA:prefill(x, cache)
  if type(cache) ~= "table" then bad("prefill: cache must be a table ({} to start empty), got " .. type(cache)) end
  return self:forward(x, { cache = cache })
end

-- step(x [B, 1, d], cache) -> [B, 1, d]: one decoding step, the token recurrence (kda.md §3)
function KDA:step(x, cache)
  if type(cache) ~= "table" then bad("step: cache must be a table ({} to start empty), got " .. type(cache)) end
  if tide.is_tensor(x) and x:dim() == 3 and x:size(2) ~= 1 then
    bad(fmt("step: x must hold one token [B, 1, %d], got [%s]", self.dim, table.concat(x:shape(), ", ")))
  end
  return self:forward(x, { cache = cache, path = "recurrent" })
end

-- an empty cache (the layer fills it on the first call)
function KDA:new_cache() return { pos = 0 } end

function KDA:extra_repr()
  return fmt("%d, heads=%d, head_dim=%d, gate_form=%s%s, chunk=%d, conv=%d", self.dim, self.heads, self.head_dim,
    self.gate_form, self.gate_form == "bounded" and fmt(" lb=%g", self.gate_lower_bound) or "", self.chunk, self.conv_size)
end

return KDA
