-- nn/balance.lua — the MoE balancers that write the selection bias b between optimiser steps (spec/moe.md §4):
-- Quantile Balancing (§4.1: the exact interpolated-quantile and the K3 App. D histogram estimators, qb_rate
-- averaging) and the sign rule (§4.2, optionally normalised), on host double arrays. nn.MoE records the step's scores and selections, computes
-- the loads, and asks its balancer for the new b; the aux and seq_aux losses are terms of the layer's forward and
-- leave b alone here.
--
--   balance.new(o)                        the balancer of one MoE layer (o: its resolved nn.MoE options)
--   balancer:update(s, b, m, n, k, load, group)  -> new b (double[n]) or nil (b stays), qb_clamped (histogram)
--   balance.estimator_for(estimator, ranks)      "auto" -> "exact" on one rank, "histogram" when the batch spans more
--   balance.qb                            the Quantile Balancing pieces (margins, θ estimators, centering)
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local C = tide.C

local fmt, floor = string.format, math.floor
local F64A = ffi.typeof("double[?]")

local balance = {}

-- the balancer options' defaults (nn.MoE's options of the same names)
local DEFAULTS = {
  balance = "quantile", estimator = "auto", hist_bins = 1000, qb_rate = 1, sign_rate = 1e-3,
  sign_normalized = false,
}
balance.DEFAULTS = DEFAULTS
balance.KINDS = { quantile = true, sign = true, aux = true, seq_aux = true, none = true }
balance.ESTIMATORS = { auto = true, exact = true, histogram = true, order_statistic = true }

-- ---- plain-array helpers (QB statistics are small: m·n doubles per step) ----------------------------------
-- f64_buffer(n) -> double[n] from malloc, freed by the collector: not zero-filled (ffi.new's arrays are, which for
-- the step's [m·n] scores and margins cost as much as the QB arithmetic itself); every user writes it whole
pcall(ffi.cdef, "void *malloc(size_t size); void free(void *p);")   -- (a second declaration raises: ignored)
local function f64_buffer(n)
  local p = ffi.C.malloc(math.max(n, 1) * 8)
  if p == nil then error(fmt("out of memory: a buffer of %d doubles", n), 0) end
  return ffi.gc(ffi.cast("double *", p), ffi.C.free)
end
balance.f64_buffer = f64_buffer

local function read_f64(t)
  local n = t:numel()
  local buf = f64_buffer(n)
  tide.check_status(C.tide_to_f64_buffer(tide.raw(t), buf, n))
  return buf, n
end

local function as_array(b, n)      -- a tensor, a 1-based Lua list or a double array -> double[n]
  if tide.is_tensor(b) then return (read_f64(b)) end
  local a = F64A(n)
  if type(b) == "table" then for j = 1, n do a[j - 1] = b[j] end
  elseif b ~= nil then for j = 0, n - 1 do a[j] = b[j] end end
  return a
end

-- Quantile Balancing pieces (moe.md §4.1), on double arrays: s [m·n] row-major scores, b [n]
local qb = {}
balance.qb = qb

-- margins μ_{t,j} = s_{t,j} − c_t, c_t = the (k+1)-th largest of s_t + b (over the experts allowed[t·n + j] ~= 0
-- when a mask is given: group-limited routing). The loops are C (engine/balance.c), as are the thresholds and the
-- histogram below: tests/lua/test_moe.lua holds them to Lua references
function qb.margins(s, b, m, n, k, allowed)
  local mu = f64_buffer(m * n)
  tide.check_status(C.tide_qb_margins(s, b, m, n, k, allowed, mu))
  return mu
end

-- group-limited routing's candidate sets (§2): allowed[t·n + j] = 1 when expert j's group is one of token t's
-- tg best groups of G contiguous groups, a group scoring the sum of its 2 best s + b (ties: the lower index, as
-- F.topk); the router pushes every other expert below all scores
function qb.allowed(s, b, m, n, G, tg)
  local per = n / G
  local allowed, gs, order = ffi.new("uint8_t[?]", m * n), F64A(G), {}
  for t = 0, m - 1 do
    local row = t * n
    for g = 0, G - 1 do
      local b1, b2 = -math.huge, -math.huge
      for j = g * per, (g + 1) * per - 1 do
        local v = s[row + j] + b[j]
        if v > b1 then b1, b2 = v, b1 elseif v > b2 then b2 = v end
      end
      gs[g] = per > 1 and b1 + b2 or b1
      order[g + 1] = g
    end
    table.sort(order, function(u, v) return gs[u] > gs[v] or (gs[u] == gs[v] and u < v) end)
    for i = 1, tg do
      local g = order[i]
      for j = g * per, (g + 1) * per - 1 do allowed[row + j] = 1 end
    end
  end
  return allowed
end

-- θ_j = the (1 − k/n) quantile of column j of μ [m·n], linearly interpolated (§4.1; numpy/torch's default): the
-- column sorted ascending x, pos = (1 − k/n)(m − 1), θ = x_⌊pos⌋ + frac(pos)·(x_⌊pos⌋+1 − x_⌊pos⌋). It lies between
-- the (q+1)-th and the q-th largest margins (q = m·k/n), so the threshold token is not left on its own cutoff.
function qb.theta_exact(mu, m, n, k)
  local theta = F64A(n)
  tide.check_status(C.tide_qb_theta_exact(mu, m, n, k, theta))
  return theta
end

-- θ_j = the bare r-th largest of column j, r = ⌊q⌋ + 1 (the report's Alg. 1 indices). Not a default: with c_t itself
-- an order statistic the threshold token sits exactly on its cutoff and the next step routes on ties (§4.1); kept
-- as estimator = "order_statistic" for studies of that effect.
function qb.theta_order_statistic(mu, m, n, k)
  local theta = F64A(n)
  tide.check_status(C.tide_qb_theta_order_statistic(mu, m, n, k, theta))
  return theta
end

-- the histogram estimator's range (K3 App. D): B uniform bins over [min_j b_j − 1, max_j b_j + 1], where sigmoid
-- scores keep every required bias. Every rank sharing the routing batch holds the same b, hence the same bins.
function qb.histogram_range(b, n)
  local lo, hi = math.huge, -math.huge
  for j = 0, n - 1 do
    if b[j] < lo then lo = b[j] end
    if b[j] > hi then hi = b[j] end
  end
  return lo - 1, hi + 1
end

-- per-expert histograms (counts int64 [n·bins], expert-major) of the REQUIRED BIAS r_{t,j} = c_t − s_{t,j} = −μ_{t,j}
-- over [lo, hi): bin ⌊(r − lo)/w⌋; required biases outside go to the edge bins and are counted in `clamped`. These
-- counts (and the token count m) are what the ranks sharing a routing batch all-reduce.
function qb.histogram(mu, m, n, lo, hi, bins)
  local counts, clamped = ffi.new("int64_t[?]", n * bins), ffi.new("int64_t[1]")
  tide.check_status(C.tide_qb_histogram(mu, m, n, lo, hi, bins, counts, clamped))
  return counts, tonumber(clamped[0])
end

-- b̂_j from the (all-reduced) counts of m tokens: the first bin i (ascending r) whose cumulative count reaches ⌈q⌉,
-- interpolated inside it, b̂_j = lo + (i + clamp((q − count_before)/count_i, 0, 1))·w. Returns θ = −b̂ (the exact
-- estimator's sign), so both go through qb.center.
function qb.theta_histogram(counts, m, n, k, lo, hi, bins)
  local theta, w = F64A(n), (hi - lo) / bins
  local q = m * k / n
  local need = math.ceil(q)
  for j = 0, n - 1 do
    local before, i, c = 0, 0, 0
    while true do
      c = tonumber(counts[j * bins + i])
      if before + c >= need or i == bins - 1 then break end
      before, i = before + c, i + 1
    end
    local f = c > 0 and (q - before) / c or 0
    f = math.max(0, math.min(1, f))
    theta[j] = -(lo + (i + f) * w)
  end
  return theta
end

-- b ← b̂ − mean(b̂), b̂ = −θ (centering: a common shift changes no TopK)
function qb.center(theta, n)
  local b, mean = F64A(n), 0
  for j = 0, n - 1 do mean = mean - theta[j] end
  mean = mean / n
  for j = 0, n - 1 do b[j] = -theta[j] - mean end
  return b
end

-- the estimator a balancer uses: "auto" (the default) is exact when the routing batch is on one rank and the
-- histogram when it spans more (dp×cp ranks share it: K3 all-reduces histogram counts, not margins, §4.1)
function balance.estimator_for(estimator, ranks)
  if estimator == nil or estimator == "auto" then return (ranks or 1) > 1 and "histogram" or "exact" end
  return estimator
end

-- qb.update(s, b, k, opts) -> new b (1-based Lua list), clamped: one alternation on scores s [m, n] (tensor) with the
-- bias b (tensor or list) used to route them; opts.estimator "auto" | "exact" | "histogram" | "order_statistic",
-- opts.bins, opts.group (the ranks sharing the routing batch, see qb.update_arrays)
function qb.update(s, b, k, opts)
  opts = opts or {}
  local m, n = s:size(1), s:size(2)
  local sa = read_f64(s)
  local nb, clamped = qb.update_arrays(sa, as_array(b, n), m, n, k, opts)
  local out = {}
  for j = 1, n do out[j] = nb[j - 1] end
  return out, clamped
end

-- one alternation on this rank's m routed tokens. opts.group, when the routing batch spans ranks: {size = ranks,
-- sum_i64 = function(int64 array, len) summing it in place over the ranks, gather_f64 = function(double array, len)
-- -> the concatenation over the ranks (a double array) and its length} — the histogram estimator needs sum_i64 only,
-- the exact ones gather_f64. Returns the centred new b (double[n]) and the required biases clamped into the edge
-- bins (histogram; summed over the ranks).
function qb.update_arrays(s, b, m, n, k, opts)
  local group = opts.group
  local ranks = group and group.size or 1
  local estimator = balance.estimator_for(opts.estimator, ranks)
  -- with group-limited routing the token cutoff c_t is the (k+1)-th largest s + b over the token's allowed experts
  -- (the set its TopK chose from); margins are still taken for every expert
  local G = opts.n_group or 1
  local allowed = G > 1 and qb.allowed(s, b, m, n, G, opts.topk_group or G) or nil
  local mu = qb.margins(s, b, m, n, k, allowed)
  local theta, clamped
  if estimator == "histogram" then
    local bins = opts.bins or DEFAULTS.hist_bins
    local lo, hi = qb.histogram_range(b, n)
    local counts
    counts, clamped = qb.histogram(mu, m, n, lo, hi, bins)
    local M = m
    if ranks > 1 then
      -- one all-reduce: the n·bins counts, the token count and the clamped count together
      local all = ffi.new("int64_t[?]", n * bins + 2)
      ffi.copy(all, counts, n * bins * 8)
      all[n * bins], all[n * bins + 1] = m, clamped
      group.sum_i64(all, n * bins + 2)
      counts, M, clamped = all, tonumber(all[n * bins]), tonumber(all[n * bins + 1])
    end
    theta = qb.theta_histogram(counts, M, n, k, lo, hi, bins)
  else
    local M = m
    if ranks > 1 then
      if not group.gather_f64 then
        error(fmt("the %s estimator needs the margins of all %d ranks (group.gather_f64); estimator = \"histogram\" "
          .. "all-reduces counts instead", estimator, ranks), 0)
      end
      mu, M = group.gather_f64(mu, m * n)
      M = M / n
    end
    if estimator == "exact" then theta = qb.theta_exact(mu, M, n, k)
    else theta = qb.theta_order_statistic(mu, M, n, k) end
  end
  return qb.center(theta, n), clamped
end

balance.read_f64 = read_f64

-- ---- one layer's balancer ------------------------------------------------------------------------------------
local Balancer = {}
Balancer.__index = Balancer

-- new(o) -> the balancer of kind o.balance with o's settings (errors name nn.MoE, whose options these are)
function balance.new(o)
  local who = "nn.MoE"
  local kind = options.one_of(o.balance, balance.KINDS, "balance", who)
  if type(o.qb_rate) ~= "number" or not (o.qb_rate > 0 and o.qb_rate <= 1) then
    options.fail(who, fmt("qb_rate must be a number in (0, 1], got %s", tostring(o.qb_rate)))
  end
  if o.hist_bins ~= nil then options.pos_int(o.hist_bins, "hist_bins", who) end
  return setmetatable({
    kind = kind,
    qb_opts = { estimator = o.estimator, rate = o.qb_rate, bins = o.hist_bins, n_group = o.n_group,
      topk_group = o.topk_group },
    sign_rate = o.sign_rate, sign_normalized = o.sign_normalized and true or false,
  }, Balancer)
end

-- estimator() -> the QB estimator this balancer uses for a routing batch over `ranks` ranks (nil: not QB)
function Balancer:estimator(ranks)
  if self.kind ~= "quantile" then return nil end
  return balance.estimator_for(self.qb_opts.estimator, ranks)
end

-- update(s [m·n], b [n], m, n, k, load, group) -> the new bias (double[n]) from one step's scores s (double arrays)
-- routed with bias b, whose per-expert loads (1-based list) are `load`; nil when this kind leaves b alone. Second
-- result: the required biases the histogram estimator clamped into its edge bins. group: the ranks sharing the
-- routing batch (qb.update_arrays); this rank's s and load are its share of it.
function Balancer:update(s, b, m, n, k, load, group)
  local nb
  if self.kind == "quantile" then
    local clamped
    local o = self.qb_opts
    if group then o = setmetatable({ group = group }, { __index = self.qb_opts }) end
    nb, clamped = qb.update_arrays(s, b, m, n, k, o)
    -- qb_rate β < 1: b ← b + β·(b̂ − b), an average of the per-step solutions. Both are centred, so the result is.
    -- With few tokens per expert (q = m·k/n) the one-step θ carries sampling noise of order 1/√q that β = 1 (the
    -- spec's rule) passes straight into the next step's routing; β averages it over about 2/β − 1 steps.
    local beta = self.qb_opts.rate
    if beta < 1 then for j = 0, n - 1 do nb[j] = b[j] + beta * (nb[j] - b[j]) end end
    return nb, clamped
  elseif self.kind == "sign" then
    if group and group.size > 1 then
      -- the global loads and token count: one all-reduce of n + 1 integers
      local all = ffi.new("int64_t[?]", n + 1)
      for j = 1, n do all[j - 1] = load[j] end
      all[n] = m
      group.sum_i64(all, n + 1)
      local g = {}
      for j = 1, n do g[j] = tonumber(all[j - 1]) end
      load, m = g, tonumber(all[n])
    end
    local q = m * k / n
    nb = F64A(n)
    local rms = 0
    if self.sign_normalized then
      -- Su's variant: sign(q − load) → (q − load)/RMS_j(q − load)
      for j = 1, n do rms = rms + (q - load[j]) ^ 2 / n end
      rms = math.sqrt(rms)
    end
    for j = 0, n - 1 do
      local e = q - load[j + 1]
      local step
      if self.sign_normalized then step = rms > 0 and e / rms or 0 else step = e > 0 and 1 or (e < 0 and -1 or 0) end
      nb[j] = b[j] + self.sign_rate * step
    end
    return nb
  end
  return nil
end

return balance
