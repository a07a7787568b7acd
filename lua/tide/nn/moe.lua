-- nn/moe.lua — the sparse MoE FFN (spec/moe.md): a router (§2 sigmoid + selection bias, softmax, or the §3 latent
-- router), routed experts as one fused dispatch node (F.moe_experts, §8), optional LatentMoE (§7), shared experts
-- as one MLP of width n_shared·d_e at full d (§1), a balancer that writes the selection bias between steps (§4:
-- Quantile Balancing, sign (optionally normalised), aux, seq_aux, none) and the §5 load metrics.
--
-- Names (formats.md §2, under the layer's `block_sparse_moe.`): gate.weight [n, d], gate.e_score_correction_bias
-- [n] (a buffer: in the state dict, not a parameter), shared_experts.{gate,up,down}_proj.weight,
-- routed_expert_down_proj.weight [d_lat, d], routed_expert_up_proj.weight [d, d_lat], routed_expert_norm.weight.
-- The routed experts are stored fused: experts.gate_up_proj [n, 2·d_e, d_in] and experts.down_proj [n, d_out, d_e];
-- formats.md's per-expert experts.{j}.gate_proj.weight = gate_up_proj[j, 0:d_e], up_proj.weight =
-- gate_up_proj[j, d_e:2·d_e], down_proj.weight = down_proj[j] (d_in = d_out = d_lat with LatentMoE, else d).
local ffi = require "ffi"
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local norms = require "tide.nn.norm"
local MLP = require "tide.nn.mlp"
local options = require "tide.options"
local defaults = require "tide.defaults"
local balance = require "tide.nn.balance"
local F = tide.F

local fmt = string.format
local F64A = ffi.typeof("double[?]")

local read_f64 = balance.read_f64

-- ---- the router (§2, §3) -----------------------------------------------------------------------------------
local Router = M.Module:extend("MoERouter")

function Router:init(dim, o)
  self.kind, self.n, self.k, self.rho = o.router, o.n_experts, o.top_k, o.routed_scaling
  self.n_group, self.topk_group = o.n_group or 1, o.topk_group or o.n_group or 1
  local po = { dtype = o.dtype == "bf16" and "f32" or o.dtype, device = o.device }   -- routing in fp32 (§2)
  if self.kind == "latent" then
    self.similarity, self.rank = o.similarity, o.router_rank
    self:child("latent_proj", Linear(dim, o.router_rank, { std = o.std, dtype = po.dtype, device = o.device }))
    -- e_j and ω: no weight decay (§3, optim.md §1)
    self:param("expert_vectors", M.Module.new_param({ o.n_experts, o.router_rank }, { "normal", 1 }, po), { decay = false })
    if self.similarity == "cosine" then
      self:param("log_scale", tide.full({ 1 }, math.log(10), { dtype = po.dtype, device = o.device }), { decay = false })
    end
  else
    self:param("weight", M.Module.new_param({ o.n_experts, dim }, { "normal", o.std }, po))
  end
  -- the selection bias b is float64 for every model dtype, and so is the selection sum s + b (route): the balancer
  -- computes b in double, and QB leaves top-k gaps of 1e-8 and below (its threshold token sits a fraction of one
  -- order-statistic spacing from its cutoff), which rounding b or s + b to float32 (~6e-8) would flip — f32 and f64
  -- models would route the same scores differently. DeepSeek-V3 likewise keeps this bias above the weights' precision.
  self:buffer("e_score_correction_bias", tide.zeros({ o.n_experts }, { dtype = "f64", device = o.device }))
end

-- scores(x [m, d]) -> s [m, n] in (0, 1) (softmax: rows sum to 1), fp32 for bf16 inputs
function Router:scores(x)
  if x:dtype() == "bf16" then x = x:to("f32") end
  local logits
  if self.kind == "latent" then
    local z = self.latent_proj:forward(x)
    local e = self.expert_vectors
    logits = F.linear(z, e)
    if self.similarity == "cosine" then
      local nz = (z * z):sum(2, true):sqrt()                       -- [m, 1]
      local ne = (e * e):sum(2, true):sqrt():reshape(1, self.n)    -- [1, n]
      logits = logits * self.log_scale:exp() / (nz * ne + 1e-6)
    end
  else
    logits = F.linear(x, self.weight)
  end
  if self.kind == "softmax" then return F.softmax(logits, -1) end
  return logits:sigmoid()
end

-- route(s) -> sel [m, k] i64 (TopK of s + b in float64, selection only), p [m, k] = ρ s_sel / (Σ s_sel + 1e-20)
-- from the unbiased s in its own dtype (differentiable through the gathered s)
function Router:route(s)
  local b = self.e_score_correction_bias
  if b:dtype() ~= "f64" then b = b:to("f64") end         -- a bias loaded into another dtype by hand
  local sb = s:detach()
  if sb:dtype() ~= "f64" then sb = sb:to("f64") end
  sb = sb + b
  if self.n_group > 1 then
    -- group-limited routing (§2, DeepSeek-V3): experts in n_group contiguous groups; a group scores the sum of its
    -- 2 best s + b; each token picks from its topk_group best groups only (the others pushed below every score)
    local m, G = sb:size(1), self.n_group
    local per = math.floor(self.n / G)
    local best = F.topk(sb:reshape(m, G, per), math.min(2, per))
    local _, gsel = F.topk(best:sum(3), self.topk_group)                        -- [m, topk_group]
    local keep = F.scatter_add(tide.zeros({ m, G }, { dtype = sb:dtype(), device = sb:device() }), 2, gsel,
      tide.ones({ m, self.topk_group }, { dtype = sb:dtype(), device = sb:device() }))
    sb = sb + (keep:reshape(m, G, 1):expand(m, G, per):reshape(m, self.n) - 1) * 1e9
  end
  local _, sel = F.topk(sb, self.k)
  local ss = F.gather(s, 2, sel)
  return sel, ss * self.rho / (ss:sum(2, true) + 1e-20)
end

function Router:extra_repr()
  return fmt("%s, n=%d, k=%d, rho=%g", self.kind, self.n, self.k, self.rho)
end

-- ---- the routed experts (fused storage) ------------------------------------------------------------------
local Experts = M.Module:extend("MoEExperts")

-- the expert slice the model being built keeps (MoE.with_expert_slice: expert parallelism), else nil
local build_slice = nil

-- with_expert_slice({rank = r, size = P}, fn) -> fn()'s results: the MoE layers built inside fn allocate only the
-- routed experts [r·n/P, (r+1)·n/P) of each fused tensor, drawn from the counters the whole tensor's draw gives
-- them (the random stream is counter-based: element i of a draw of N takes counter offset + i), so every weight is
-- the one a whole model's build and MoE:shard_experts leave, every later draw takes the counters it would, and no
-- rank ever holds the other ranks' experts
local function MoE_with_expert_slice(slice, fn)
  local prev = build_slice
  build_slice = slice
  local r = { pcall(fn) }
  build_slice = prev
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2)
end

-- a [n, ...] parameter of which only rows [first, first + count) are drawn: counters of the whole tensor's draw
local function slice_param(shape, init, po, first, count)
  local per = 1
  for i = 2, #shape do per = per * shape[i] end
  local local_shape = { count }
  for i = 2, #shape do local_shape[i] = shape[i] end
  local C = tide.C
  local seed, off = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  C.tide_rng_get(seed, off)
  local s0, o0 = seed[0], off[0]
  C.tide_rng_set(s0, o0 + ffi.cast("uint64_t", first) * per)
  local t = M.Module.new_param(local_shape, init, po)
  C.tide_rng_set(s0, o0 + ffi.cast("uint64_t", shape[1]) * per)
  return t
end

function Experts:init(n, d_in, d_e, d_out, o)
  self.n, self.d_in, self.d_e, self.d_out = n, d_in, d_e, d_out
  local po = { dtype = o.dtype, device = o.device }
  local sl = build_slice
  if sl then
    if n % sl.size ~= 0 then
      options.fail("nn.MoE", fmt("shard_experts: dist.ep = %d must divide n_experts = %d", sl.size, n))
    end
    local nl = n / sl.size
    self.n_local, self.first, self.built_slice = nl, sl.rank * nl, true
    self:param("gate_up_proj", slice_param({ n, 2 * d_e, d_in }, { "normal", o.std }, po, self.first, nl))
    self:param("down_proj", slice_param({ n, d_out, d_e }, { "normal", o.out_std }, po, self.first, nl))
    return
  end
  self:param("gate_up_proj", M.Module.new_param({ n, 2 * d_e, d_in }, { "normal", o.std }, po))
  self:param("down_proj", M.Module.new_param({ n, d_out, d_e }, { "normal", o.out_std }, po))
end

function Experts:extra_repr() return fmt("%d x (%d -> %d -> %d)", self.n, self.d_in, self.d_e, self.d_out) end

-- ---- the MoE layer -------------------------------------------------------------------------------------
local MoE = M.Module:extend("MoE")

local KEYS = {
  n_experts = true, top_k = true, expert_dim = true, n_shared = true, shared_dim = true, latent_dim = true,
  routed_scaling = true, activation = true, router = true, router_rank = true, similarity = true, balance = true,
  qb_rate = true, n_group = true, topk_group = true,
  sign_rate = true, sign_normalized = true, aux_alpha = true, estimator = true, hist_bins = true, capacity_factor = true,
  dead_window = true, std = true, out_std = true, norm_eps = true, dtype = true, device = true,
}
local CHOICES = {
  activation = { situ = true, swiglu = true }, router = { sigmoid = true, softmax = true, latent = true },
  similarity = { cosine = true, dot = true }, balance = balance.KINDS, estimator = balance.ESTIMATORS,
}
MoE.CHOICES, MoE.KEYS = CHOICES, KEYS
-- the defaults of the options above (the balancer's own: nn/balance.lua); aux_alpha depends on balance (init)
local DEFAULTS = {
  n_shared = 1, routed_scaling = 1.0, activation = "situ", router = "sigmoid", router_rank = 32, similarity = "cosine",
  capacity_factor = 0, dead_window = 100, std = defaults.init_std, norm_eps = defaults.norm_eps, dtype = "f32", device = "cpu",
}
for k, v in pairs(balance.DEFAULTS) do DEFAULTS[k] = v end
MoE.DEFAULTS = DEFAULTS

-- errors point at the first caller outside lua/tide (the line that built or called the layer)
local WHO = "nn.MoE"
local function bad(msg) options.fail(WHO, msg) end
local function pos_int(o, key) return options.pos_int(o[key], key, WHO) end

-- MoE(dim, {n_experts, top_k, expert_dim, n_shared = 1, shared_dim = n_shared·expert_dim, latent_dim (nil: experts
-- on x, no norm), routed_scaling = 1 (ρ), activation = "situ" | "swiglu", router = "sigmoid" | "softmax" | "latent"
-- (router_rank = 32, similarity = "cosine" | "dot"), balance = "quantile" | "sign" | "aux" | "seq_aux" | "none"
-- (sign_rate = 1e-3, sign_normalized = false, n_group = 1 and topk_group for group-limited routing, aux_alpha = 1e-3
-- for aux and 1e-4 for seq_aux, estimator = "auto" (exact on one rank, histogram when the routing batch spans ranks)
-- | "exact" | "histogram" | "order_statistic" (the bare (⌊q⌋+1)-th margin, for studies only), hist_bins = 1000,
-- qb_rate = 1),
-- capacity_factor = 0,
-- dead_window = 100, std = 0.02, out_std = std, norm_eps = 1e-5, dtype, device})
function MoE:init(dim, opts)
  opts = options.check(opts or {}, KEYS, nil, WHO)
  local o = options.with_defaults(opts, DEFAULTS, KEYS, nil, WHO)
  o.out_std = o.out_std or o.std
  local n, k, de = pos_int(o, "n_experts"), pos_int(o, "top_k"), pos_int(o, "expert_dim")
  if k >= n then bad(fmt("top_k = %d must be < n_experts = %d (the balancer needs the (k+1)-th score)", k, n)) end
  for key, set in pairs(CHOICES) do options.one_of(o[key], set, key, WHO) end
  if o.router == "latent" then pos_int(o, "router_rank") end
  if o.n_group ~= nil then
    local g = pos_int(o, "n_group")
    if n % g ~= 0 then bad(fmt("n_group = %d must divide n_experts = %d", g, n)) end
    local tg = o.topk_group == nil and g or pos_int(o, "topk_group")
    if tg > g then bad(fmt("topk_group = %d must be <= n_group = %d", tg, g)) end
    if tg * (n / g) < k + 1 then
      bad(fmt("topk_group = %d groups of %d experts hold fewer than top_k + 1 = %d experts", tg, n / g, k + 1))
    end
  elseif o.topk_group ~= nil then
    bad("topk_group needs n_group")
  end
  self.dim, self.n, self.k, self.d_e, self.rho = dim, n, k, de, o.routed_scaling
  self.latent_dim, self.activation, self.balance = o.latent_dim, o.activation, o.balance
  self.capacity_factor, self.dead_window = o.capacity_factor, o.dead_window
  self.aux_alpha = opts.aux_alpha or (o.balance == "seq_aux" and 1e-4 or 1e-3)   -- DeepSeek-V3's α for seq_aux
  self.balancer = balance.new(o)

  self:child("gate", Router(dim, o))
  local po = { std = o.std, dtype = o.dtype, device = o.device }
  local d_in = dim
  if o.latent_dim then
    d_in = pos_int(o, "latent_dim")
    self:child("routed_expert_down_proj", Linear(dim, d_in, po))
  end
  self:child("experts", Experts(n, d_in, de, d_in, o))
  if o.latent_dim then
    self:child("routed_expert_norm", norms.RMSNorm(d_in, { eps = o.norm_eps, dtype = o.dtype, device = o.device }))
    self:child("routed_expert_up_proj", Linear(d_in, dim, { std = o.out_std, dtype = o.dtype, device = o.device }))
  end
  local shared = o.shared_dim or o.n_shared * de
  if shared > 0 then
    self:child("shared_experts", MLP(dim, shared, { activation = o.activation, std = o.std, out_std = o.out_std,
      dtype = o.dtype, device = o.device }))
  end
  self.shared_dim = shared
  self._records, self._steps, self._last_used, self._metrics = {}, 0, {}, nil
  for j = 1, n do self._last_used[j] = 0 end
end

-- forward(x [..., d]) -> y [..., d]. In training mode the step's scores and selections are recorded for
-- balance_step (QB needs the whole step's batch, §4.1); with balance = "aux", self.aux_loss holds α Σ f_j P_j.
function MoE:forward(x)
  local shape = x:shape()
  local d = shape[#shape]
  if d ~= self.dim then bad(fmt("forward: x has last dim %d, expected %d", d, self.dim)) end
  if self.experts.built_slice then
    bad("forward: the layer was built with one rank's experts (nn.build's experts slice); shard it over its "
      .. "expert-parallel group first (dist.shard_model)")
  end
  local xf = x:reshape(-1, d)
  local m = xf:size(1)
  local s = self.gate:scores(xf)
  local sel, p = self.gate:route(s)
  if p:dtype() ~= xf:dtype() then p = p:to(xf:dtype()) end
  local z = self.routed_expert_down_proj and self.routed_expert_down_proj:forward(xf) or xf
  local u, dropped
  if self.ep then
    u, dropped = self:ep_experts(z, sel, p)
  else
    u, dropped = F.moe_experts(z, sel, p, self.experts.gate_up_proj, self.experts.down_proj,
      { activation = self.activation, capacity_factor = self.capacity_factor })
  end
  local y = u
  if self.routed_expert_norm then
    -- the norm applies once, to the weighted aggregate (§7)
    y = self.routed_expert_up_proj:forward(self.routed_expert_norm:forward(u))
  end
  if self.shared_experts then y = y + self.shared_experts:forward(xf) end
  self.aux_loss = nil
  if not self.training and self._eval_loads then
    -- maxvio_global (§5): tokens per expert over a fixed validation set, counted while it is routed in eval mode
    local loads = self._eval_loads
    for _, e in ipairs(sel:reshape(-1):tolist()) do loads[e + 1] = loads[e + 1] + 1 end
    loads.m = loads.m + m
  end
  if self.training then
    local sela = self:record(s, sel, dropped)
    if self.balance == "seq_aux" then
      -- the sequence-wise aux loss (§4.2, DeepSeek-V3): per sequence (a row of x [B, T, d]; all of x when it is
      -- 2-D) f_j = (n/(kT)) Σ_t 1[j ∈ sel_t] (constant) and Pr_j = (1/T) Σ_t s_tj / Σ_i s_ti; L = α mean_rows Σ_j f_j Pr_j
      local rows = #shape >= 3 and shape[1] or 1
      local T = math.floor(m / rows)
      local f = {}
      for b = 0, rows - 1 do
        for j = 1, self.n do f[b * self.n + j] = 0 end
        for i = b * T * self.k, (b + 1) * T * self.k - 1 do
          local e = b * self.n + sela[i] + 1
          f[e] = f[e] + 1
        end
      end
      for i = 1, #f do f[i] = f[i] * self.n / (self.k * T) end
      local P = (s / s:sum(2, true)):reshape(rows, T, self.n):mean(2)           -- [rows, n]
      local ft = tide.tensor(f, { dtype = P:dtype(), device = P:device() }):reshape(rows, self.n)
      self.aux_loss = (P * ft):sum() * (self.aux_alpha / rows)
    elseif self.balance == "aux" then
      -- classic aux loss over the batch (§4.2): f_j constant, the gradient flows through P_j only
      local f = {}
      for j = 1, self.n do f[j] = 0 end
      for i = 0, m * self.k - 1 do local e = sela[i] + 1; f[e] = f[e] + 1 end
      for j = 1, self.n do f[j] = f[j] * self.n / (self.k * m) end
      local P = (s / s:sum(2, true)):mean(1)
      self.aux_loss = (P * tide.tensor(f, { dtype = P:dtype(), device = P:device() })):sum() * self.aux_alpha
    end
  end
  shape[#shape] = self.dim
  return y:reshape(shape)
end

-- ---- expert parallelism (§9) ----------------------------------------------------------------------------------
-- shard_experts(ep, dp): this rank keeps only the routed experts [r·n/P, (r+1)·n/P) of the fused tensors (r, P: its
-- rank and the size of the expert-parallel group ep, from dist.split), the rest freed; the router, its bias and
-- everything else stay whole (replicated). dp: the group of ranks holding the same experts (their gradients are
-- summed over it), or nil. The parameters' meta names both groups (meta.ep, meta.ep_dp) for the step's reduction
-- and the global norm. Call it before the optimiser is built.
function MoE:shard_experts(ep, dp)
  local P = ep.size
  if self.n % P ~= 0 then bad(fmt("shard_experts: dist.ep = %d must divide n_experts = %d", P, self.n)) end
  local nl = self.n / P
  local first = ep.rank * nl
  local ex = self.experts
  if ex.built_slice and (ex.first ~= first or ex.n_local ~= nl) then
    bad(fmt("shard_experts: the layer was built with experts [%d, %d) but this rank of dist.ep = %d owns [%d, %d)",
      ex.first, ex.first + ex.n_local, P, first, first + nl))
  end
  for _, name in ipairs({ "gate_up_proj", "down_proj" }) do
    -- (a layer built with its slice holds it already: its parameters only take the groups' names)
    local part = ex.built_slice and ex[name]
      or tide.no_grad(function() return ex[name]:narrow(1, first + 1, nl):clone() end)
    local meta = ex._param_meta[name]
    ex[name] = nil
    ex:param(name, part:detach(), { decay = meta.decay, ep = ep, ep_dp = dp })
  end
  ex.n_local, ex.first, ex.built_slice = nl, first, nil
  self.ep = ep
  return self
end

local function i64_tensor(arr, n, cols)
  local t = tide.wrap(tide.C.tide_from_f64(tide.C.TIDE_I64, 1, ffi.new("int64_t[1]", n), 0, arr))
  return cols and t:reshape(n / cols, cols) or t
end

-- the routed experts across the ranks of self.ep (§9): each (token, slot) assignment goes to the rank owning its
-- expert (a stable counting sort by owner), the P×P row counts are exchanged, then the rows (in z's width: d_lat
-- with LatentMoE) with their local expert ids; the owner runs its experts on what arrived (F.moe_experts, one
-- assignment per row, weight 1), the outputs go back by the reverse exchange and each token sums its k outputs
-- weighted by p, in slot order. Both row exchanges are ops of the graph, so the backward mirrors them. The capacity
-- (capacity_factor > 0) is the whole expert-parallel batch's, ⌈cf · A / n⌉ with A its assignments, applied on the
-- owner to the rows in source-rank order: the rows one rank routing the concatenated batch would keep.
function MoE:ep_experts(z, sel, p)
  local ep, k, n = self.ep, self.k, self.n
  local P, nl = ep.size, self.n / ep.size
  local m = sel:size(1)
  local A = m * k
  local sa = read_f64(sel)
  local send, off = {}, {}
  for r = 1, P do send[r] = 0 end
  for a = 0, A - 1 do local r = math.floor(sa[a] / nl) + 1; send[r] = send[r] + 1 end
  local o = 0
  for r = 1, P do off[r] = o; o = o + send[r] end
  local tok, eid, pos = F64A(math.max(A, 1)), F64A(math.max(A, 1)), F64A(math.max(A, 1))
  for a = 0, A - 1 do
    local e = sa[a]
    local r = math.floor(e / nl)
    local q = off[r + 1]
    off[r + 1] = q + 1
    tok[q], eid[q], pos[a] = math.floor(a / k), e - r * nl, q
  end
  -- the count matrix: this rank's row to every rank, their rows back
  local cnt = F64A(P)
  for r = 1, P do cnt[r - 1] = send[r] end
  local ones = {}
  for r = 1, P do ones[r] = 1 end
  local rc = ep.alltoallv(i64_tensor(cnt, P), ones, ones):f64_array()
  local recv, n_recv = {}, 0
  for r = 1, P do recv[r] = tonumber(rc[r - 1]); n_recv = n_recv + recv[r] end
  -- (the sort runs on the host; a device model gets its indices copied, its rows exchanged by its backend: NCCL)
  local dev = z:device()
  local function on_dev(t) return dev == "cpu" and t or t:to(dev) end
  local rows = F.index_select(z, 1, on_dev(i64_tensor(tok, A)))
  local R = ep.exchange(rows, send, recv)
  local E = on_dev(ep.alltoallv(i64_tensor(eid, A, 1), send, recv))
  local d_out = self.experts.down_proj:size(2)
  local cap = 0
  if self.capacity_factor > 0 then
    local total = ep.sums({ A })[1]
    cap = math.ceil(self.capacity_factor * total / n)
  end
  -- (a rank that receives no rows still runs its experts, on none: their gradients are zeros, as one rank gives an
  -- expert without tokens)
  local out, dropped = F.moe_experts(R, E, tide.ones({ n_recv, 1 }, { dtype = R:dtype(), device = R:device() }),
    self.experts.gate_up_proj, self.experts.down_proj, { activation = self.activation, capacity = cap })
  local back = ep.exchange(out, recv, send)                        -- [A, d_out], in owner order
  local u = F.index_select(back, 1, on_dev(i64_tensor(pos, A))):reshape(m, k, d_out)
  return (u * p:reshape(m, k, 1)):sum(2), dropped
end

-- record(s [m, n], sel [m, k], dropped): adds one routed batch to the step's statistics (forward does this in
-- training mode; the balancer tests feed scores directly). Returns sel as a double array.
function MoE:record(s, sel, dropped)
  local sela = read_f64(sel)
  self._records[#self._records + 1] = { s = read_f64(s:detach()), sel = sela, m = s:size(1), dropped = dropped or 0 }
  return sela
end

-- the recorded step as one batch: s [m·n], sel [m·k] (double arrays), m
local function gather_records(self)
  local recs, n, k = self._records, self.n, self.k
  if #recs == 1 then return recs[1].s, recs[1].sel, recs[1].m, recs[1].dropped end
  local m, dropped = 0, 0
  for _, r in ipairs(recs) do m = m + r.m; dropped = dropped + r.dropped end
  local s, sel = balance.f64_buffer(m * n), balance.f64_buffer(m * k)
  local off = 0
  for _, r in ipairs(recs) do
    ffi.copy(s + off * n, r.s, r.m * n * 8)
    ffi.copy(sel + off * k, r.sel, r.m * k * 8)
    off = off + r.m
  end
  return s, sel, m, dropped
end

-- §5 metrics of one routed batch; advances the dead-expert window and the top-k-change reference when `advance`
local function batch_metrics(self, s, sel, m, dropped, advance, group)
  local n, k = self.n, self.k
  local load = {}
  for j = 1, n do load[j] = 0 end
  for i = 0, m * k - 1 do local e = sel[i] + 1; load[e] = load[e] + 1 end
  local m_local, load_local = m, load
  -- the routing batch spans the ranks (data parallelism): its loads, token count and drops are summed first, so
  -- MaxVio, the load entropy and the dead experts are the global batch's, on every rank alike
  if group and group.size > 1 then
    local all = ffi.new("int64_t[?]", n + 2)
    for j = 1, n do all[j - 1] = load[j] end
    all[n], all[n + 1] = m, dropped or 0
    group.sum_i64(all, n + 2)
    load = {}
    for j = 1, n do load[j] = tonumber(all[j - 1]) end
    m, dropped = tonumber(all[n]), dropped and tonumber(all[n + 1]) or nil
  end
  local q = m * k / n
  local maxload, ent = 0, 0
  for j = 1, n do
    if load[j] > maxload then maxload = load[j] end
    local f = load[j] / (m * k)
    if f > 0 then ent = ent - f * math.log(f) end
  end
  -- the per-token metrics run over this rank's m_local tokens; their sums are combined over the ranks
  local ml = m_local
  local rent = 0
  if k > 1 then
    for t = 0, ml - 1 do
      local tot, h = 0, 0
      for i = 0, k - 1 do tot = tot + s[t * n + sel[t * k + i]] end
      for i = 0, k - 1 do
        local pb = s[t * n + sel[t * k + i]] / (tot + 1e-20)
        if pb > 0 then h = h - pb * math.log(pb) end
      end
      rent = rent + h / math.log(k)
    end
  end
  -- top-k change: the share of positions whose selection (as a set) differs from the previous step's, compared
  -- only when the previous step routed the same number of positions (a fixed batch shape)
  local sorted = F64A(ml * k)
  for t = 0, ml - 1 do
    for i = 0, k - 1 do
      local v, a = sel[t * k + i], i
      while a > 0 and sorted[t * k + a - 1] > v do sorted[t * k + a] = sorted[t * k + a - 1]; a = a - 1 end
      sorted[t * k + a] = v
    end
  end
  local c, compared = 0, 0
  local prev = self._prev_sel
  if prev and prev.m == ml then
    compared = 1
    for t = 0, ml - 1 do
      for i = 0, k - 1 do
        if prev.sel[t * k + i] ~= sorted[t * k + i] then c = c + 1; break end
      end
    end
  end
  if group and group.size > 1 then
    local ints = ffi.new("int64_t[2]", c, compared)
    group.sum_i64(ints, 2)
    c, compared = tonumber(ints[0]), tonumber(ints[1]) == group.size and 1 or 0
    if group.gather_f64 then
      local r = ffi.new("double[1]", rent)
      local all, n_all = group.gather_f64(r, 1)
      rent = 0
      for i = 0, n_all - 1 do rent = rent + all[i] end
    else
      rent = rent * m / ml    -- (a group that sums integers only: this rank's mean)
    end
  end
  if k > 1 then rent = rent / m end
  local changed = compared == 1 and c / m or nil
  local steps = self._steps + (advance and 1 or 0)
  local dead = 0
  for j = 1, n do
    local last = (advance and load[j] > 0) and steps or self._last_used[j]
    -- dead: no token in each of the last min(window, steps) steps
    if steps - last >= math.min(self.dead_window, math.max(steps, 1)) then dead = dead + 1 end
    if advance then self._last_used[j] = last end
  end
  if advance then self._steps = steps; self._prev_sel = { sel = sorted, m = ml } end
  return {
    tokens = m, load = load, maxvio_batch = (maxload - q) / q, load_entropy = ent / math.log(n),
    route_entropy = k > 1 and rent or nil, dead_experts = dead, topk_changed = changed, dropped = dropped,
    aux_loss = self.aux_loss and self.aux_loss:item() or nil,
  }, load_local
end

-- balance_step(opts): after the optimiser step — computes the step's metrics and writes the new selection bias
-- from the step's recorded routing (used from the next forward only: no leakage, §4.1). opts.discard = true
-- drops the records (a skipped step); opts.group = the ranks sharing the routing batch (balance.lua,
-- qb.update_arrays: {size, sum_i64, gather_f64}). Returns the metrics, of the whole routing batch (every rank's).
function MoE:balance_step(opts)
  if opts and opts.discard then self._records = {}; return nil end
  if #self._records == 0 then return self._metrics end
  local s, sel, m, dropped = gather_records(self)
  self._records = {}
  local group = opts and opts.group
  local mt, load_local = batch_metrics(self, s, sel, m, dropped, true, group)
  local n, k = self.n, self.k
  local bias = self.gate.e_score_correction_bias
  local b = read_f64(bias)
  local nb, clamped = self.balancer:update(s, b, m, n, k, load_local, group)
  mt.qb_clamped = clamped
  if nb then
    local list = {}
    for j = 1, n do list[j] = nb[j - 1] end
    tide.no_grad(function() bias:copy_(tide.tensor(list, { dtype = bias:dtype(), device = bias:device() })) end)
  end
  self._metrics = mt
  return mt
end

-- metrics() -> the §5 metrics of the last balanced step (or of the recorded forwards not yet balanced) with the
-- current bias range: tokens, load (per expert, 1-based), maxvio_batch, load_entropy, route_entropy, dead_experts,
-- topk_changed, dropped, aux_loss, qb_clamped (histogram estimator), b_min, b_max, b_std
function MoE:metrics()
  local mt = self._metrics
  if #self._records > 0 then mt = batch_metrics(self, gather_records(self)) end
  local out = {}
  for key, v in pairs(mt or {}) do out[key] = v end
  mt = out
  local b = self.gate.e_score_correction_bias:tolist()
  local lo, hi, mean, var = math.huge, -math.huge, 0, 0
  for _, v in ipairs(b) do lo = math.min(lo, v); hi = math.max(hi, v); mean = mean + v / #b end
  for _, v in ipairs(b) do var = var + (v - mean) ^ 2 / #b end
  mt.b_min, mt.b_max, mt.b_std = lo, hi, math.sqrt(var)
  return mt
end

-- record_loads(rec, model): the step's per-expert loads of every MoE layer of model into its metrics record, as
-- rec["moe/load/<layer>"] = {tokens routed to expert 1, ..., expert n} (layer 0-based; top-k: they sum to k x the
-- step's tokens): the expert-load heatmap of `tide plot`. A list, so JSONL only (TensorBoard takes the scalars).
function MoE.record_loads(rec, model)
  for l, mt in pairs(model.moe_metrics and model:moe_metrics() or {}) do
    if type(mt.load) == "table" then
      local load = {}
      for j, v in ipairs(mt.load) do load[j] = v end
      rec["moe/load/" .. l] = load
    end
  end
end

-- count_eval_loads(true) starts counting tokens per expert in eval-mode forwards; count_eval_loads(false) stops
-- and returns {load = {...}, tokens = m, maxvio = (max_j load_j − q)/q} over everything routed in between (the
-- §5 maxvio_global when the forwards were a fixed validation set)
-- group (a dist group, optional; a collective): the counts are summed over its ranks first (context parallelism:
-- each rank routed its slices of the same rows)
function MoE:count_eval_loads(on, group)
  if on then
    local loads = { m = 0 }
    for j = 1, self.n do loads[j] = 0 end
    self._eval_loads = loads
    return nil
  end
  local loads = self._eval_loads
  self._eval_loads = nil
  if group and group.size > 1 then
    local v = { loads and loads.m or 0 }
    for j = 1, self.n do v[j + 1] = loads and loads[j] or 0 end
    v = group.sums(v)
    loads = { m = v[1] }
    for j = 1, self.n do loads[j] = v[j + 1] end
  end
  if not loads or loads.m == 0 then return nil end
  local q, mx, load = loads.m * self.k / self.n, 0, {}
  for j = 1, self.n do load[j] = loads[j]; mx = math.max(mx, loads[j]) end
  return { load = load, tokens = loads.m, maxvio = (mx - q) / q }
end

-- balancer_state() / set_balancer_state(st): what balance_step keeps between steps besides the bias buffer (the
-- dead-expert window: steps seen and the last step each expert had a token), for checkpoints. The top-k-change
-- reference (the previous step's selections) is not kept: after a resume moe/topk_changed restarts one step late.
function MoE:balancer_state()
  local last = {}
  for j = 1, self.n do last[j] = self._last_used[j] end
  return { steps = self._steps, last_used = last }
end

function MoE:set_balancer_state(st)
  if type(st) ~= "table" or type(st.last_used) ~= "table" or #st.last_used ~= self.n then
    bad(fmt("set_balancer_state: expected {steps, last_used = %d numbers}", self.n))
  end
  self._steps = st.steps
  for j = 1, self.n do self._last_used[j] = st.last_used[j] end
  self._prev_sel = nil
end

function MoE:extra_repr()
  return fmt("d=%d, n=%d, k=%d, d_e=%d, shared=%d, latent=%s, rho=%g, %s, balance=%s", self.dim, self.n, self.k,
    self.d_e, self.shared_dim, tostring(self.latent_dim or "off"), self.rho, self.activation, self.balance)
end

MoE.with_expert_slice = MoE_with_expert_slice
return MoE
