-- moe: nn.MoE (spec/moe.md oracles 1-5, 7, 8; oracle 6 SiTU is in test_moe_ops) — the router, Quantile Balancing on
-- a fixed skewed batch and on a stream (with the sign baseline), centering and no leakage, the exact (interpolated)
-- and histogram (K3 App. D, two simulated ranks) estimators, f32 == f64 routing, the estimator rule,
-- the §5 metrics, LatentMoE, dispatch == a dense per-token loop, the latent router, a float64 gradient check of the
-- whole layer, and a hybrid LM with MoE FFNs training with QB.
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F
local optim = require "tide.optim"
local MoE = nn.MoE
local qb = require("tide.nn.balance").qb
local fmt = string.format

local function sig(x) return 1 / (1 + math.exp(-x)) end
local function situ(g, u) return 4 * math.tanh(g / 4) * sig(g) * 25 * math.tanh(u / 25) end
local function swiglu(g, u) return g * sig(g) * u end

local function matvec(W, rows, cols, v)      -- W flat row-major [rows, cols]
  local out = {}
  for r = 1, rows do
    local a = 0
    for c = 1, cols do a = a + W[(r - 1) * cols + c] * v[c] end
    out[r] = a
  end
  return out
end

-- TopK with ties to the lowest index (moe.md §2), 1-based expert numbers
local function topk_list(v, k)
  local idx = {}
  for j = 1, #v do idx[j] = j end
  table.sort(idx, function(a, c) if v[a] ~= v[c] then return v[a] > v[c] end return a < c end)
  local out = {}
  for i = 1, k do out[i] = idx[i] end
  return out
end

-- the MoE layer token by token in plain Lua (moe.md §2, §7, §8): the dispatch oracle
local function reference(moe, x)
  local d, n, k, de, rho = moe.dim, moe.n, moe.k, moe.d_e, moe.rho
  local X, m = x:tolist(), x:size(1)
  local Wr, b = moe.gate.weight:tolist(), moe.gate.e_score_correction_bias:tolist()
  local GU, DN = moe.experts.gate_up_proj:tolist(), moe.experts.down_proj:tolist()
  local lat = moe.latent_dim
  local din = lat or d
  local act = moe.activation == "situ" and situ or swiglu
  local out = {}
  for t = 0, m - 1 do
    local xt = {}
    for i = 1, d do xt[i] = X[t * d + i] end
    local s, sb = {}, {}
    for j, a in ipairs(matvec(Wr, n, d, xt)) do s[j] = sig(a); sb[j] = s[j] + b[j] end
    local sel = topk_list(sb, k)
    local tot = 0
    for _, e in ipairs(sel) do tot = tot + s[e] end
    local z = lat and matvec(moe.routed_expert_down_proj.weight:tolist(), din, d, xt) or xt
    local u = {}
    for o = 1, din do u[o] = 0 end
    for _, e1 in ipairs(sel) do
      local e, p = e1 - 1, rho * s[e1] / (tot + 1e-20)
      local h = {}
      for r = 1, de do
        local g, v = 0, 0
        for c = 1, din do
          g = g + GU[(e * 2 * de + r - 1) * din + c] * z[c]
          v = v + GU[(e * 2 * de + de + r - 1) * din + c] * z[c]
        end
        h[r] = act(g, v)
      end
      for o = 1, din do
        local y = 0
        for r = 1, de do y = y + DN[(e * din + o - 1) * de + r] * h[r] end
        u[o] = u[o] + p * y
      end
    end
    local y = u
    if lat then     -- RMSNorm once, on the aggregate (§7)
      local ms, g = 0, moe.routed_expert_norm.weight:tolist()
      for o = 1, din do ms = ms + u[o] ^ 2 end
      local r = 1 / math.sqrt(ms / din + moe.routed_expert_norm.eps)
      local un = {}
      for o = 1, din do un[o] = u[o] * r * g[o] end
      y = matvec(moe.routed_expert_up_proj.weight:tolist(), d, din, un)
    end
    local sh = moe.shared_experts
    if sh then
      local hs = moe.shared_dim
      local g = matvec(sh.gate_proj.weight:tolist(), hs, d, xt)
      local v = matvec(sh.up_proj.weight:tolist(), hs, d, xt)
      local h = {}
      for r = 1, hs do h[r] = act(g[r], v[r]) end
      local ys = matvec(sh.down_proj.weight:tolist(), d, hs, h)
      for o = 1, d do y[o] = y[o] + ys[o] end
    end
    for o = 1, d do out[#out + 1] = y[o] end
  end
  return out
end

local function set(t, values) tide.no_grad(function() t:copy_(tide.tensor(values, { dtype = t:dtype() }):reshape(t:shape())) end) end

local function loads(sel, n)
  local load = {}
  for j = 1, n do load[j] = 0 end
  for _, e in ipairs(sel:tolist()) do load[e + 1] = load[e + 1] + 1 end
  return load
end

local function maxvio(s, b, k)
  local n = s:size(2)
  local _, sel = F.topk(s + tide.tensor(b, { dtype = s:dtype() }), k)
  local mx = 0
  for _, l in ipairs(loads(sel, n)) do mx = math.max(mx, l) end
  local q = s:size(1) * k / n
  return (mx - q) / q
end

-- the spec's skewed routing batch (oracle 2): σ(N(0,1) + linspace(−3, 3, 64)_j), m = 4,096
local M_QB, N_QB, K_QB = 4096, 64, 4
local offsets
local function skewed_batch(dtype)
  if not offsets then
    local o = {}
    for j = 1, N_QB do o[j] = -3 + 6 * (j - 1) / (N_QB - 1) end
    offsets = tide.tensor(o)
  end
  local s = (tide.randn({ M_QB, N_QB }) + offsets):sigmoid()
  return dtype and s:to(dtype) or s
end

local function zeros_list(n) local b = {} for j = 1, n do b[j] = 0 end return b end

T.test("router: TopK on s + b, weights from s summing to rho (1e-6), ties to the lowest index, b no gradient", function()
  tide.manual_seed(3)
  local moe = MoE(8, { n_experts = 6, top_k = 2, expert_dim = 4, routed_scaling = 2.5 })
  local x = tide.randn({ 5, 8 })
  set(moe.gate.weight, tide.randn({ 6, 8 }):tolist())
  set(moe.gate.e_score_correction_bias, { 0, 0, 0, 0, 3, 2 })    -- pushes every token to experts 4 and 5
  local s = moe.gate:scores(x)
  local sel, p = moe.gate:route(s)
  local S, P = s:totable(), p:totable()
  for t, row in ipairs(sel:totable()) do
    T.eq(row, { 4, 5 }, "selection follows s + b")
    T.near(P[t], { 2.5 * S[t][5] / (S[t][5] + S[t][6]), 2.5 * S[t][6] / (S[t][5] + S[t][6]) }, 1e-6, "p from unbiased s")
    T.near(P[t][1] + P[t][2], 2.5, 1e-6)
  end
  -- b = 0, equal scores: the lowest indices win
  set(moe.gate.e_score_correction_bias, zeros_list(6))
  set(moe.gate.weight, zeros_list(48))
  local sel0 = moe.gate:route(moe.gate:scores(x))
  for _, row in ipairs(sel0:totable()) do T.eq(row, { 0, 1 }) end
  -- b is a buffer: in the state dict, not a parameter, no gradient
  set(moe.gate.weight, tide.randn({ 6, 8 }):tolist())
  set(moe.gate.e_score_correction_bias, { 0.1, -0.2, 0.3, 0, 0, -0.2 })
  moe(x):sum():backward()
  local b = moe.gate.e_score_correction_bias
  T.ok(not b:requires_grad() and b:grad() == nil, "b has no gradient")
  T.ok(moe:state_dict()["gate.e_score_correction_bias"] ~= nil, "b is in the state dict")
  for name in moe:named_parameters() do T.ok(not name:find("correction"), "b is not a parameter: " .. name) end
  T.ok(moe.gate.weight:grad():sum_squares() > 0, "the router weight gets a gradient through p")
end)

T.test("router: float64 gradient check through the renormalised p, TopK fixed (<= 1e-8)", function()
  tide.manual_seed(4)
  local moe = MoE(6, { n_experts = 5, top_k = 3, expert_dim = 2, routed_scaling = 2.827, dtype = "f64", std = 1 })
  set(moe.gate.e_score_correction_bias, { 0.05, -0.1, 0.2, 0, -0.05 })
  local x = tide.randn({ 7, 6 }, { dtype = "f64", requires_grad = true })
  local sel0 = moe.gate:route(moe.gate:scores(x)):tolist()
  local worst = T.gradcheck(function()
    local sel, p = moe.gate:route(moe.gate:scores(x))
    T.eq(sel:tolist(), sel0, "TopK stays fixed under the perturbation")
    return p
  end, { x, moe.gate.weight }, { atol = 1e-8, rtol = 1e-6 })
  T.ok(worst <= 1e-8, "worst " .. worst)
end)

T.test("QB fixed skewed batch (oracle 2): MaxVio ~6.5 before, <= 0.5 after 1, <= 0.05 from alternation 20", function()
  tide.manual_seed(11)
  local s = skewed_batch()
  local b = zeros_list(N_QB)
  local before = maxvio(s, b, K_QB)
  T.ok(before > 6 and before < 7, "MaxVio before " .. before)
  for it = 1, 30 do
    b = qb.update(s, b, K_QB)
    local v = maxvio(s, b, K_QB)
    if it == 1 then T.ok(v <= 0.5, "after 1 alternation " .. v) end
    if it >= 20 then T.ok(v <= 0.05, "alternation " .. it .. ": " .. v) end
  end
end)

T.test("QB stream (oracle 3) through nn.MoE: MaxVio_batch <= 0.6 from step 5, mean <= 0.3; sign u=1e-3 > 2 at 100", function()
  tide.manual_seed(12)
  local function run(balance, steps)
    local moe = MoE(4, { n_experts = N_QB, top_k = K_QB, expert_dim = 1, n_shared = 0, balance = balance })
    local vio = {}
    for step = 0, steps - 1 do
      local s = skewed_batch()
      moe:record(s, (moe.gate:route(s)))        -- route with the current b, as forward does
      vio[step] = moe:balance_step().maxvio_batch
    end
    return vio, moe
  end
  local vio, moe = run("quantile", 300)
  T.ok(vio[0] > 6, "step 0 is unbalanced: " .. vio[0])
  local sum = 0
  for step = 5, 299 do
    T.ok(vio[step] <= 0.6, "step " .. step .. ": " .. vio[step])
    sum = sum + vio[step]
  end
  T.ok(sum / 295 <= 0.3, "mean MaxVio_batch over steps 5-299: " .. sum / 295)
  local mt, bsum = moe:metrics(), 0
  for _, v in ipairs(moe.gate.e_score_correction_bias:tolist()) do bsum = bsum + v end
  T.near(bsum, 0, 1e-5, "b is centred")
  T.ok(mt.b_min < 0 and mt.b_max > 0 and mt.b_std > 0.1, "b spreads to undo the skew: std " .. mt.b_std)
  local svio = run("sign", 101)
  T.ok(svio[100] > 2, "sign baseline at step 100: " .. svio[100])
end)

T.test("QB centering and no leakage (oracle 4)", function()
  tide.manual_seed(13)
  local m, n, k = 512, 16, 2
  -- scores on a 2^-10 grid so every sum with the biases is exact in f64
  local s = (tide.rand({ m, n }, { dtype = "f64" }) * 1024):tolist()
  for i = 1, #s do s[i] = math.floor(s[i]) / 1024 end
  local st = tide.tensor(s, { dtype = "f64" }):reshape(m, n)
  local ffi = require "ffi"
  local sa = ffi.new("double[?]", m * n)
  for i = 1, m * n do sa[i - 1] = s[i] end
  local mu = qb.margins(sa, ffi.new("double[?]", n), m, n, k)
  local theta = qb.theta_exact(mu, m, n, k)
  local bhat, sum = {}, 0
  for j = 1, n do bhat[j] = -theta[j - 1] end
  local bc = qb.update(st, zeros_list(n), k)
  for j = 1, n do sum = sum + bc[j] end
  T.near(sum, 0, 1e-12, "centered")
  local _, sel1 = F.topk(st + tide.tensor(bhat, { dtype = "f64" }), k)
  local _, sel2 = F.topk(st + tide.tensor(bc, { dtype = "f64" }), k)
  T.eq(sel1:tolist(), sel2:tolist(), "b̂ and b̂ − mean(b̂) select the same sets")

  -- no leakage: batch t is routed with the bias of batches < t, whatever batch t holds
  local opts = { n_experts = 4, top_k = 2, expert_dim = 3, latent_dim = 4, dtype = "f64", std = 0.5 }
  local A = MoE(6, opts)
  local B = MoE(6, opts)
  B:load_state_dict(A:state_dict())
  local xs = { tide.randn({ 20, 6 }, { dtype = "f64" }), tide.randn({ 20, 6 }, { dtype = "f64" }) }
  for _, x in ipairs(xs) do A(x); A:balance_step(); B(x); B:balance_step() end
  local frozen = MoE(6, opts):eval()
  frozen:load_state_dict(A:state_dict())      -- the bias of batches 0, 1
  local x2, x2p = tide.randn({ 20, 6 }, { dtype = "f64" }), tide.randn({ 20, 6 }, { dtype = "f64" })
  local b_before = A.gate.e_score_correction_bias:tolist()
  T.near(A(x2), frozen(x2), 0, "step 2 routes with the bias of steps < 2")
  T.eq(A.gate.e_score_correction_bias:tolist(), b_before, "forward does not touch b")
  T.near(B(x2p), frozen(x2p), 0, "the perturbed batch too")
  A:balance_step(); B:balance_step()
  T.ok(A.gate.e_score_correction_bias:tolist()[1] ~= B.gate.e_score_correction_bias:tolist()[1],
    "after the step, b depends on batch 2")
end)

-- the scores of a batch as a double array [m·n]
local function f64_array(s)
  local ffi = require "ffi"
  local m, n = s:size(1), s:size(2)
  local a = ffi.new("double[?]", m * n)
  tide.check_status(tide.C.tide_to_f64_buffer(tide.raw(s), a, m * n))
  return a
end

-- the smallest gap, over tokens, between the k-th and the (k+1)-th largest s + b (in double arithmetic)
local function min_topk_gap(sa, b, m, n, k)
  local worst = math.huge
  local row = {}
  for t = 0, m - 1 do
    for j = 0, n - 1 do row[j + 1] = sa[t * n + j] + b[j] end
    table.sort(row, function(u, v) return u > v end)
    worst = math.min(worst, row[k] - row[k + 1])
  end
  return worst
end

T.test("QB exact estimator (oracle 5): the interpolated (1 − k/n) column quantile (f64 1e-12); no top-k ties", function()
  local ffi = require "ffi"
  tide.manual_seed(14)
  local m, n, k = M_QB, N_QB, K_QB
  local sa = f64_array(skewed_batch("f64"))
  local zero = ffi.new("double[?]", n)
  local mu = qb.margins(sa, zero, m, n, k)
  local theta = qb.theta_exact(mu, m, n, k)
  -- the reference: each column sorted ascending, numpy's linear interpolation at pos = (1 − k/n)(m − 1)
  local pos = (1 - k / n) * (m - 1)
  local lo = math.floor(pos)
  local worst, strict = 0, 0
  for j = 0, n - 1 do
    local col = {}
    for t = 0, m - 1 do col[t + 1] = mu[t * n + j] end
    table.sort(col)
    local ref = col[lo + 1] + (pos - lo) * (col[lo + 2] - col[lo + 1])
    worst = math.max(worst, math.abs(theta[j] - ref))
    -- between the (q+1)-th and the q-th largest (q = 256 here), strictly inside when they differ
    -- between the (q+1)-th and the q-th largest (q = 256 here), strictly inside when they differ (equal ones: the
    -- tokens whose cutoff expert is j all have μ = 0 there)
    local q = m * k / n
    local a, c = col[m - q], col[m - q + 1]
    if theta[j] >= a and theta[j] <= c and (a == c or (theta[j] > a and theta[j] < c)) then strict = strict + 1 end
  end
  T.ok(worst <= 1e-12, "exact θ vs the sorted-column quantile: " .. worst)
  T.eq(strict, n, "columns whose θ lies between the (q+1)-th and q-th largest margins (strictly when they differ)")
  -- odd sizes: m = 7, n = 3, k = 1 (pos = 4, an integer: no interpolation) and m = 10 (pos = 6, frac 0)
  for _, mm in ipairs({ 7, 10, 11 }) do
    local sm = f64_array(tide.randn({ mm, 3 }, { dtype = "f64" }):sigmoid())
    local mm_mu = qb.margins(sm, ffi.new("double[?]", 3), mm, 3, 1)
    local th = qb.theta_exact(mm_mu, mm, 3, 1)
    local p = (1 - 1 / 3) * (mm - 1)
    local l = math.floor(p)
    for j = 0, 2 do
      local col = {}
      for t = 0, mm - 1 do col[t + 1] = mm_mu[t * 3 + j] end
      table.sort(col)
      local ref = col[l + 1] + (l + 1 < mm and (p - l) * (col[l + 2] - col[l + 1]) or 0)
      T.near(th[j], ref, 1e-12, fmt("m = %d column %d", mm, j))
    end
  end
  -- after one alternation the interpolated estimator leaves a positive gap between every token's k-th and (k+1)-th
  -- biased score; the bare order statistic drives it to 0 (the threshold token lands on its own cutoff)
  local b_exact = qb.update_arrays(sa, zero, m, n, k, { estimator = "exact" })
  local b_bare = qb.update_arrays(sa, zero, m, n, k, { estimator = "order_statistic" })
  local g_exact, g_bare = min_topk_gap(sa, b_exact, m, n, k), min_topk_gap(sa, b_bare, m, n, k)
  T.ok(g_bare <= 1e-15, "the bare order statistic leaves a token on its cutoff: gap " .. g_bare)
  T.ok(g_exact > 1e-9, "the interpolated quantile leaves a positive gap: " .. g_exact)
end)

T.test("QB host arithmetic (engine/balance.c) == sort-based Lua references, bitwise: margins (with group masks, " ..
  "ties), both thresholds, the histogram; bad sizes named", function()
  local ffi = require "ffi"
  local seed = 12345
  local function u01() seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648 end
  local checked = 0
  for _, shape in ipairs({ { 1, 2, 1 }, { 7, 3, 1 }, { 64, 8, 2 }, { 257, 8, 3 }, { 100, 16, 7 }, { 33, 5, 4 } }) do
    local m, n, k = shape[1], shape[2], shape[3]
    for variant = 1, 3 do
      local s, b = ffi.new("double[?]", m * n), ffi.new("double[?]", n)
      for i = 0, m * n - 1 do
        -- variant 2: few distinct values (ties everywhere); 3: wide range
        s[i] = variant == 2 and math.floor(u01() * 4) / 4 or (variant == 3 and (u01() - 0.5) * 1e6 or u01())
      end
      for j = 0, n - 1 do b[j] = variant == 2 and 0 or (u01() - 0.5) * 0.2 end
      -- a mask allowing k+1 or more experts per token (half the tokens), all of them for the rest
      local allowed = ffi.new("uint8_t[?]", m * n)
      for t = 0, m - 1 do
        local cnt = 0
        for j = 0, n - 1 do
          local a = (t % 2 == 0 or u01() < 0.6) and 1 or 0
          allowed[t * n + j] = a
          cnt = cnt + a
        end
        for j = 0, n - 1 do
          if cnt >= k + 1 then break end
          if allowed[t * n + j] == 0 then allowed[t * n + j] = 1; cnt = cnt + 1 end
        end
      end
      for _, mask in ipairs({ false, true }) do
        local mu = qb.margins(s, b, m, n, k, mask and allowed or nil)
        local bad = 0
        for t = 0, m - 1 do
          local vals = {}
          for j = 0, n - 1 do
            if not mask or allowed[t * n + j] ~= 0 then vals[#vals + 1] = s[t * n + j] + b[j] end
          end
          table.sort(vals, function(x, y) return x > y end)
          local c = vals[k + 1]
          for j = 0, n - 1 do if mu[t * n + j] ~= s[t * n + j] - c then bad = bad + 1 end end
        end
        T.eq(bad, 0, fmt("margins m=%d n=%d k=%d variant %d mask %s", m, n, k, variant, tostring(mask)))
        -- thresholds: the column sorted ascending
        local th, os_ = qb.theta_exact(mu, m, n, k), qb.theta_order_statistic(mu, m, n, k)
        local pos = (1 - k / n) * (m - 1)
        local i = math.floor(pos)
        local frac = pos - i
        local r = math.min(math.floor(m * k / n) + 1, m)
        for j = 0, n - 1 do
          local col = {}
          for t = 0, m - 1 do col[t + 1] = mu[t * n + j] end
          table.sort(col)
          local lo = col[i + 1]
          local want = (frac > 0 and i + 1 < m) and lo + frac * (col[i + 2] - lo) or lo
          T.eq(th[j], want, fmt("theta_exact m=%d n=%d k=%d variant %d column %d", m, n, k, variant, j))
          T.eq(os_[j], col[m - r + 1], fmt("theta_order_statistic m=%d n=%d k=%d column %d", m, n, k, j))
        end
        -- the histogram over a range that clamps some required biases
        local lo_, hi_ = qb.histogram_range(b, n)
        if variant == 3 then lo_, hi_ = -1e5, 1e5 end
        local bins = 37
        local counts, clamped = qb.histogram(mu, m, n, lo_, hi_, bins)
        local want, wc = {}, 0
        for x = 0, n * bins - 1 do want[x] = 0 end
        local w = (hi_ - lo_) / bins
        for t = 0, m - 1 do
          for j = 0, n - 1 do
            local x = math.floor((-mu[t * n + j] - lo_) / w)
            if x < 0 then x = 0; wc = wc + 1 elseif x >= bins then x = bins - 1; wc = wc + 1 end
            want[j * bins + x] = want[j * bins + x] + 1
          end
        end
        local diff = 0
        for x = 0, n * bins - 1 do if tonumber(counts[x]) ~= want[x] then diff = diff + 1 end end
        T.eq(diff, 0, fmt("histogram counts m=%d n=%d k=%d variant %d", m, n, k, variant))
        T.eq(clamped, wc, "histogram clamped count")
        checked = checked + 1
      end
    end
  end
  T.eq(checked, 36, "cases checked")
  -- bad sizes and a mask that allows too few experts: one named error each
  local s2, b2 = ffi.new("double[?]", 6), ffi.new("double[?]", 3)
  T.raises(function() qb.margins(s2, b2, 2, 3, 3) end, "qb margins: bad sizes")
  local few = ffi.new("uint8_t[?]", 6, { 1, 0, 0, 1, 1, 1 })
  T.raises(function() qb.margins(s2, b2, 2, 3, 1, few) end, "token 0 allows 1 experts, fewer than top_k + 1 = 2")
  T.raises(function() qb.theta_exact(s2, 0, 3, 1) end, "qb theta: bad sizes")
end)

T.test("QB f32 and f64 runs on the same batch route identically for 20 alternations (interpolated quantile)", function()
  tide.manual_seed(15)
  local s64 = skewed_batch("f64")
  local s32 = s64:to("f32")
  local s = { f32 = s32, f64 = s32:to("f64") }     -- the same scores, held in each dtype
  local layers = {}
  for dt in pairs(s) do
    layers[dt] = MoE(4, { n_experts = N_QB, top_k = K_QB, expert_dim = 1, n_shared = 0, dtype = dt })
  end
  for it = 1, 20 do
    local sels = {}
    for dt, moe in pairs(layers) do
      local sel = moe.gate:route(s[dt])
      sels[dt] = sel:tolist()
      moe:record(s[dt], sel)
      moe:balance_step()
    end
    local diff = 0
    for i = 1, #sels.f64 do if sels.f32[i] ~= sels.f64[i] then diff = diff + 1 end end
    T.eq(diff, 0, "alternation " .. it .. ": selections that differ between f32 and f64")
  end
end)

-- two ranks sharing one routing batch, simulated in one process: each runs qb.update_arrays in a coroutine whose
-- group.sum_i64 yields its counts; when both have yielded, the sums are written back to both (an all-reduce)
local function two_ranks(parts, b, n, k, opts)
  local ffi = require "ffi"
  local function group()
    return { size = #parts, sum_i64 = function(a, len) coroutine.yield(a, len) end }
  end
  local cos, pending, out = {}, {}, {}
  for r, p in ipairs(parts) do
    local o = { group = group() }
    for key, v in pairs(opts) do o[key] = v end
    cos[r] = coroutine.create(function() return qb.update_arrays(p.s, b, p.m, n, k, o) end)
  end
  while true do
    local done = 0
    for r, co in ipairs(cos) do
      if coroutine.status(co) == "dead" then done = done + 1
      else
        local ok, a, len = coroutine.resume(co)
        assert(ok, a)
        if coroutine.status(co) == "dead" then out[r] = { a, len } else pending[r] = { a, len } end
      end
    end
    if done == #cos then break end
    if next(pending) then
      local len = pending[1][2]
      local sum = ffi.new("int64_t[?]", len)
      for _, p in pairs(pending) do for i = 0, len - 1 do sum[i] = sum[i] + p[1][i] end end
      for _, p in pairs(pending) do ffi.copy(p[1], sum, len * 8) end
      pending = {}
    end
  end
  return out
end

T.test("QB histogram estimator (oracle 5, K3 App. D): within one bin of exact; 2 ranks == the whole batch", function()
  local ffi = require "ffi"
  tide.manual_seed(14)
  local m, n, k = M_QB, N_QB, K_QB
  local s = skewed_batch("f64")
  local sa = f64_array(s)
  -- from b = 0 and from a spread b (the range follows b: [min b − 1, max b + 1])
  local b0 = ffi.new("double[?]", n)
  local b1 = qb.update_arrays(sa, b0, m, n, k, { estimator = "exact" })
  for _, b in ipairs({ b0, b1 }) do
    local mu = qb.margins(sa, b, m, n, k)
    local exact = qb.theta_exact(mu, m, n, k)
    local lo, hi = qb.histogram_range(b, n)
    local bmin, bmax = math.huge, -math.huge
    for j = 0, n - 1 do bmin = math.min(bmin, b[j]); bmax = math.max(bmax, b[j]) end
    T.near(lo, bmin - 1, 0); T.near(hi, bmax + 1, 0)
    local counts, clamped = qb.histogram(mu, m, n, lo, hi, 1000)
    T.eq(clamped, 0, "sigmoid scores keep every required bias inside [min b − 1, max b + 1]")
    -- counts are of the required bias r = c_t − s = −μ: a direct recount of one column
    local direct, w = 0, (hi - lo) / 1000
    for t = 0, m - 1 do if math.floor((-mu[t * n + 5] - lo) / w) == 17 then direct = direct + 1 end end
    T.eq(tonumber(counts[5 * 1000 + 17]), direct, "column 5, bin 17")
    local est = qb.theta_histogram(counts, m, n, k, lo, hi, 1000)
    local worst = 0
    for j = 0, n - 1 do worst = math.max(worst, math.abs(est[j] - exact[j]) / w) end
    T.ok(worst <= 1, "histogram b̂ − exact b̂ within one bin width: " .. worst .. " widths")
    -- the 2-rank all-reduced counts == the counts of the concatenated batch (exact integer equality)
    local half = m / 2
    local c1 = qb.histogram(mu, half, n, lo, hi, 1000)
    local c2 = qb.histogram(mu + half * n, half, n, lo, hi, 1000)
    local diff = 0
    for i = 0, n * 1000 - 1 do if c1[i] + c2[i] ~= counts[i] then diff = diff + 1 end end
    T.eq(diff, 0, "bins where rank 0 + rank 1 differs from the whole batch")
    -- end to end: two simulated ranks, each with half the tokens, all-reducing through group.sum_i64, set the
    -- same b as one rank with the whole batch (bit for bit: the same integer counts and token count)
    local whole = qb.update_arrays(sa, b, m, n, k, { estimator = "histogram" })
    local out = two_ranks({ { s = sa, m = half }, { s = sa + half * n, m = half } }, b, n, k, { estimator = "auto" })
    for r = 1, 2 do
      local nb, cl = out[r][1], out[r][2]
      local d = 0
      for j = 0, n - 1 do if nb[j] ~= whole[j] then d = d + 1 end end
      T.eq(d, 0, "rank " .. r .. ": experts whose b differs from the one-rank histogram")
      T.eq(cl, 0)
    end
  end
  -- out-of-range required biases (softmax-free scores outside [0, 1]) go to the edge bins and are counted
  local wide = f64_array(tide.randn({ 64, 8 }, { dtype = "f64" }) * 4)
  local z8 = ffi.new("double[?]", 8)
  local _, clamped = qb.update_arrays(wide, z8, 64, 8, 2, { estimator = "histogram" })
  T.ok(clamped > 0, "clamped required biases are counted: " .. clamped)
  -- through the module: histogram-estimated b within two bins of the exact one (each b̂ within one, then centering)
  local function bias(estimator)
    local moe = MoE(4, { n_experts = n, top_k = k, expert_dim = 1, n_shared = 0, estimator = estimator, dtype = "f64" })
    moe:record(s, (moe.gate:route(s)))
    local mt = moe:balance_step()
    return moe.gate.e_score_correction_bias:tolist(), mt
  end
  local be = bias("exact")
  local bh, mt = bias("histogram")
  T.eq(mt.qb_clamped, 0)
  T.near(bh, be, 2 * 2 / 1000 + 1e-12)
  T.raises(function() MoE(4, { n_experts = 4, top_k = 1, expert_dim = 1, hist_bins = 0 }) end, "hist_bins")
  T.raises(function() MoE(4, { n_experts = 4, top_k = 1, expert_dim = 1, estimator = "median" }) end, "estimator")
end)

T.test("QB estimator rule: auto is exact on one rank, histogram when the routing batch spans ranks", function()
  local balance = require "tide.nn.balance"
  T.eq(balance.estimator_for("auto", 1), "exact")
  T.eq(balance.estimator_for(nil, 1), "exact")
  T.eq(balance.estimator_for("auto", 2), "histogram")
  T.eq(balance.estimator_for("auto", 8), "histogram")
  T.eq(balance.estimator_for("exact", 4), "exact", "an explicit choice is kept")
  T.eq(MoE.DEFAULTS.estimator, "auto")
  local moe = MoE(4, { n_experts = 8, top_k = 2, expert_dim = 1, n_shared = 0 })
  T.eq(moe.balancer:estimator(1), "exact")
  T.eq(moe.balancer:estimator(2), "histogram")
  -- through balance_step: a 2-rank group selects the histogram (it reports qb_clamped; exact does not)
  local s = tide.randn({ 32, 8 }):sigmoid()
  moe:record(s, (moe.gate:route(s)))
  T.eq(moe:balance_step().qb_clamped, nil, "one rank: exact")
  local seen
  local g = { size = 2, sum_i64 = function(a, len) seen = len; for i = 0, len - 1 do a[i] = 2 * a[i] end end }
  moe:record(s, (moe.gate:route(s)))
  T.eq(moe:balance_step({ group = g }).qb_clamped, 0, "two ranks: the histogram, its counts all-reduced")
  T.eq(seen, 8 * 1000 + 2, "one all-reduce: n·bins counts, the token count and the clamped count")
  -- an exact estimator across ranks needs the margins gathered; without a gather it is refused in one line
  local ex = MoE(4, { n_experts = 8, top_k = 2, expert_dim = 1, n_shared = 0, estimator = "exact" })
  ex:record(s, (ex.gate:route(s)))
  T.raises(function() ex:balance_step({ group = g }) end, "needs the margins of all 2 ranks")
end)

T.test("QB: eval-mode forwards record nothing — the bias, the histogram and the step's statistics stay as they were", function()
  tide.manual_seed(16)
  for _, est in ipairs({ "exact", "histogram" }) do
    local moe = MoE(6, { n_experts = 8, top_k = 2, expert_dim = 2, n_shared = 0, estimator = est, dtype = "f64" })
    local x = tide.randn({ 40, 6 }, { dtype = "f64" })
    moe(x)
    local mt1 = moe:balance_step()
    local b1 = moe.gate.e_score_correction_bias:tolist()
    moe:eval()
    for _ = 1, 3 do moe(tide.randn({ 40, 6 }, { dtype = "f64" }) * 3) end
    T.eq(#moe._records, 0, est .. ": eval forwards are not recorded")
    T.eq(moe:balance_step(), mt1, est .. ": a balance step after eval forwards changes nothing")
    T.eq(moe.gate.e_score_correction_bias:tolist(), b1, est .. ": b unchanged")
    moe:train()
    moe(x)
    moe:balance_step()
    local b2 = moe.gate.e_score_correction_bias:tolist()
    -- the same training batch again from b1 gives the same b as a layer that never saw the eval batches
    local ref = MoE(6, { n_experts = 8, top_k = 2, expert_dim = 2, n_shared = 0, estimator = est, dtype = "f64" })
    ref:load_state_dict(moe:state_dict())
    tide.no_grad(function() ref.gate.e_score_correction_bias:copy_(tide.tensor(b1, { dtype = "f64" })) end)
    ref(x)
    ref:balance_step()
    T.eq(ref.gate.e_score_correction_bias:tolist(), b2, est .. ": the next update sees only training batches")
  end
end)

T.test("qb_rate β: b ← b + β(b̂ − b) exactly, still centred; β = 1 is the spec's rule; bad β named", function()
  local function make(rate)
    return MoE(4, { n_experts = N_QB, top_k = K_QB, expert_dim = 1, n_shared = 0, qb_rate = rate })
  end
  local full, half = make(1), make(0.5)
  local s = skewed_batch()
  for _, m in ipairs({ full, half }) do m:record(s, (m.gate:route(s))); m:balance_step() end
  local bf, bh = full.gate.e_score_correction_bias:tolist(), half.gate.e_score_correction_bias:tolist()
  local ref = qb.update(s, zeros_list(N_QB), K_QB, {})
  local worst, sum = 0, 0
  for j = 1, N_QB do
    worst = math.max(worst, math.abs(bf[j] - ref[j]), math.abs(bh[j] - 0.5 * ref[j]))
    sum = sum + bh[j]
  end
  T.ok(worst <= 1e-6, "β = 1 equals the one-step solution, β = 0.5 half of it from b = 0: " .. worst)
  T.near(sum, 0, 1e-5, "centred")
  -- a second step from b ≠ 0: b2 = b1 + β(b̂(b1) − b1)
  local s2 = skewed_batch()
  half:record(s2, (half.gate:route(s2)))
  half:balance_step()
  local ref2 = qb.update(s2, bh, K_QB, {})
  local b2 = half.gate.e_score_correction_bias:tolist()
  worst = 0
  for j = 1, N_QB do worst = math.max(worst, math.abs(b2[j] - (bh[j] + 0.5 * (ref2[j] - bh[j])))) end
  T.ok(worst <= 1e-6, "second step: " .. worst)
  for _, v in ipairs({ 0, 1.5, "x" }) do
    T.raises(function() make(v) end, "qb_rate must be a number in (0, 1]")
  end
end)

T.test("maxvio_global counting in eval mode, and the balancer window survives a checkpoint round trip", function()
  local moe = MoE(4, { n_experts = 4, top_k = 2, expert_dim = 2, n_shared = 0, balance = "none", dtype = "f64" })
  moe:eval()
  moe:count_eval_loads(true)
  local x = tide.randn({ 6, 4 }, { dtype = "f64" })
  tide.no_grad(function() moe:forward(x); moe:forward(x) end)
  local r = moe:count_eval_loads(false)
  local sel = moe.gate:route(moe.gate:scores(x))
  local want = { 0, 0, 0, 0 }
  for _, e in ipairs(sel:reshape(-1):tolist()) do want[e + 1] = want[e + 1] + 2 end
  T.eq(r.load, want)
  T.eq(r.tokens, 12)
  local mx = math.max(want[1], want[2], want[3], want[4])
  T.near(r.maxvio, (mx - 6) / 6, 1e-12)
  T.eq(moe:count_eval_loads(false), nil, "counting stopped")
  moe:train()
  local s = tide.tensor({ { 0.9, 0.3, 0.1, 0.1 }, { 0.9, 0.3, 0.1, 0.1 } }, { dtype = "f64" })
  for _ = 1, 3 do moe:record(s, (moe.gate:route(s))); moe:balance_step() end
  local st = require("tide.json").decode(require("tide.json").encode(moe:balancer_state()))
  local other = MoE(4, { n_experts = 4, top_k = 2, expert_dim = 2, n_shared = 0, balance = "none", dtype = "f64" })
  other:set_balancer_state(st)
  other:record(s, (other.gate:route(s)))
  moe:record(s, (moe.gate:route(s)))
  T.eq(other:balance_step().dead_experts, moe:balance_step().dead_experts)
  T.eq(other:balancer_state(), moe:balancer_state())
  T.raises(function() other:set_balancer_state({ steps = 1 }) end, "set_balancer_state")
end)

T.test("metrics (§5): load, maxvio, entropies, dead experts over a window, top-k change; none keeps b = 0", function()
  local moe = MoE(4, { n_experts = 4, top_k = 2, expert_dim = 1, n_shared = 0, balance = "none", dead_window = 2,
    dtype = "f64" })
  local function step(rows)
    local s = tide.tensor(rows, { dtype = "f64" })
    moe:record(s, (moe.gate:route(s)))
    return moe:balance_step()
  end
  local a = { 0.9, 0.3, 0.1, 0.1 }
  local mt = step({ a, a, a, a })
  T.eq(mt.load, { 4, 4, 0, 0 })
  T.near(mt.maxvio_batch, 1, 1e-12)
  T.near(mt.load_entropy, 0.5, 1e-12)
  T.near(mt.route_entropy, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2), 1e-12)
  T.eq(mt.dead_experts, 2)
  T.eq(mt.topk_changed, nil, "no previous step")
  local c = { 0.1, 0.2, 0.9, 0.8 }
  mt = step({ a, a, c, c })
  T.eq(mt.load, { 2, 2, 2, 2 })
  T.near(mt.maxvio_batch, 0, 0)
  T.near(mt.load_entropy, 1, 1e-12)
  T.eq(mt.dead_experts, 0)
  T.near(mt.topk_changed, 0.5, 0)
  T.eq(step({ a, a, a, a }).dead_experts, 0, "experts 2, 3 idle for 1 step < window 2")
  T.eq(step({ a, a, a, a }).dead_experts, 2, "idle for 2 steps")
  T.eq(moe.gate.e_score_correction_bias:tolist(), { 0, 0, 0, 0 })
  local m2 = moe:metrics()
  T.eq(m2.b_std, 0)
end)

T.test("dispatch == a dense per-token loop through the module (f32 1e-5): plain and LatentMoE, both activations", function()
  tide.manual_seed(21)
  for _, o in ipairs({ { latent_dim = 8, activation = "situ" }, { activation = "swiglu", routed_scaling = 2.5 } }) do
    local opts = { n_experts = 6, top_k = 2, expert_dim = 5, n_shared = 2, std = 0.4 }
    for key, v in pairs(o) do opts[key] = v end
    local moe = MoE(12, opts)
    set(moe.gate.e_score_correction_bias, { 0.02, -0.03, 0, 0.05, -0.01, -0.03 })
    local x = tide.randn({ 2, 5, 12 })
    local y = moe(x)
    T.eq(y:shape(), { 2, 5, 12 })
    T.near(y:tolist(), reference(moe, x:reshape(10, 12)), 1e-5)
  end
end)

T.test("LatentMoE (oracle 7): fused shared MLP == two narrower MLPs (f64 1e-12); norm once; tiny layer sizes", function()
  tide.manual_seed(22)
  local d, h = 10, 6
  local wide = nn.MLP(d, 2 * h, { activation = "situ", dtype = "f64", std = 0.5 })
  local a = nn.MLP(d, h, { activation = "situ", dtype = "f64" })
  local b = nn.MLP(d, h, { activation = "situ", dtype = "f64" })
  local G, U, D = wide.gate_proj.weight:tolist(), wide.up_proj.weight:tolist(), wide.down_proj.weight:tolist()
  local function rows(W, from) local out = {} for i = from * d + 1, (from + h) * d do out[#out + 1] = W[i] end return out end
  local function cols(W, from)
    local out = {}
    for r = 0, d - 1 do for c = from + 1, from + h do out[#out + 1] = W[r * 2 * h + c] end end
    return out
  end
  set(a.gate_proj.weight, rows(G, 0)); set(a.up_proj.weight, rows(U, 0)); set(a.down_proj.weight, cols(D, 0))
  set(b.gate_proj.weight, rows(G, h)); set(b.up_proj.weight, rows(U, h)); set(b.down_proj.weight, cols(D, h))
  local x = tide.randn({ 7, d }, { dtype = "f64" })
  T.near(wide(x), a(x) + b(x), 1e-12)
  -- norm applied once, to the aggregate: the module == the reference that norms Σ p_i E_i(z) (a norm per expert, or
  -- none, would not match at this tolerance)
  local moe = MoE(d, { n_experts = 4, top_k = 2, expert_dim = 3, latent_dim = 5, dtype = "f64", std = 0.5, n_shared = 0 })
  local xm = tide.randn({ 6, d }, { dtype = "f64" })
  T.near(moe(xm):tolist(), reference(moe, xm), 1e-12)
  -- spec README oracle 1: the tiny MoE layer (d 128, n 8, k 2, d_e 128, d_lat 64, one shared) has 263,232
  -- parameters (b is a buffer, not counted), 115,776 active
  local tiny = MoE(128, { n_experts = 8, top_k = 2, expert_dim = 128, latent_dim = 64 })
  T.eq(tiny:num_parameters(), 263232)
  local per_expert = (tiny.experts.gate_up_proj:numel() + tiny.experts.down_proj:numel()) / 8
  T.eq(tiny:num_parameters() - 6 * per_expert, 115776)
end)

T.test("latent router (oracle 8): dot with r = d, P = I, e_j = rows of W_r == the default router; cosine grads", function()
  tide.manual_seed(23)
  local d, n = 8, 6
  local base = MoE(d, { n_experts = n, top_k = 2, expert_dim = 2, std = 0.5 })
  local lat = MoE(d, { n_experts = n, top_k = 2, expert_dim = 2, router = "latent", similarity = "dot", router_rank = d })
  local eye = {}
  for i = 1, d do for j = 1, d do eye[#eye + 1] = i == j and 1 or 0 end end
  set(lat.gate.latent_proj.weight, eye)
  set(lat.gate.expert_vectors, base.gate.weight:tolist())
  local x = tide.randn({ 9, d })
  local s1, s2 = base.gate:scores(x), lat.gate:scores(x)
  T.near(s2:tolist(), s1:tolist(), 1e-6)
  T.eq(lat.gate:route(s2):tolist(), base.gate:route(s1):tolist())
  -- the cosine form: ω starts at ln 10; e_j and ω are in the no-decay group; float64 gradients of P, e_j, ω
  local cos = MoE(d, { n_experts = n, top_k = 2, expert_dim = 2, router = "latent", router_rank = 4, dtype = "f64", std = 0.5 })
  T.near(cos.gate.log_scale, math.log(10), 1e-12)
  local opt = optim.AdamW(cos)
  local _, no_decay = opt:group_names()
  local nd = table.concat(no_decay, " ")
  T.ok(nd:find("gate.expert_vectors", 1, true) and nd:find("gate.log_scale", 1, true), "no decay: " .. nd)
  local xd = tide.randn({ 5, d }, { dtype = "f64", requires_grad = true })
  local worst = T.gradcheck(function() return cos.gate:scores(xd) end,
    { xd, cos.gate.latent_proj.weight, cos.gate.expert_vectors, cos.gate.log_scale }, { atol = 1e-8, rtol = 1e-6 })
  T.ok(worst <= 1e-8, "worst " .. worst)
end)

T.test("float64 gradient check of the whole MoE layer (LatentMoE + shared, x and every parameter)", function()
  tide.manual_seed(24)
  local moe = MoE(6, { n_experts = 4, top_k = 2, expert_dim = 3, latent_dim = 4, n_shared = 1, dtype = "f64", std = 0.6 })
  set(moe.gate.e_score_correction_bias, { 0.1, -0.1, 0.05, 0 })
  local x = tide.randn({ 2, 3, 6 }, { dtype = "f64", requires_grad = true })
  local inputs = { x }
  for _, t in moe:named_parameters() do inputs[#inputs + 1] = t end
  T.eq(#inputs, 10)
  local worst = T.gradcheck(function() return moe(x) end, inputs, { atol = 1e-8, rtol = 1e-6 })
  T.ok(worst < 1e-7, "worst " .. worst)
end)

T.test("aux baseline: L = alpha Σ f_j P_j over the batch, in the hybrid's loss; b stays 0", function()
  tide.manual_seed(25)
  local moe = MoE(6, { n_experts = 4, top_k = 2, expert_dim = 3, balance = "aux", aux_alpha = 0.01, dtype = "f64", std = 0.5 })
  local x = tide.randn({ 10, 6 }, { dtype = "f64" })
  moe(x)
  local s = moe.gate:scores(x)
  local sel = moe.gate:route(s)
  local S, load = s:totable(), loads(sel, 4)
  local want = 0
  for j = 1, 4 do
    local P = 0
    for t = 1, 10 do
      local tot = 0
      for i = 1, 4 do tot = tot + S[t][i] end
      P = P + S[t][j] / tot / 10
    end
    want = want + (4 / (2 * 10)) * load[j] * P
  end
  T.near(moe.aux_loss, 0.01 * want, 1e-12)
  moe.aux_loss:backward()
  T.ok(moe.gate.weight:grad():sum_squares() > 0, "the aux loss trains the router")
  moe:balance_step()
  T.eq(moe.gate.e_score_correction_bias:tolist(), { 0, 0, 0, 0 })
  T.raises(function() MoE(6, { n_experts = 4, top_k = 2, expert_dim = 3, balance = "qb" }) end, "balance must be one of")
  T.raises(function() MoE(6, { n_experts = 4, top_k = 4, expert_dim = 3 }) end, "top_k = 4 must be < n_experts = 4")
  T.raises(function() MoE(6, { n_experts = 4, top_k = 2, expert_dim = 3, topk = 1 }) end, "unknown key 'topk'")
end)

T.test("seq_aux baseline: L = alpha mean over sequences of Σ f_j Pr_j (per row of [B, T, d]); alpha default 1e-4", function()
  tide.manual_seed(26)
  local moe = MoE(6, { n_experts = 4, top_k = 2, expert_dim = 3, balance = "seq_aux", dtype = "f64", std = 0.5 })
  T.eq(moe.aux_alpha, 1e-4)
  moe.aux_alpha = 0.01
  local B, Tn = 3, 5
  local x = tide.randn({ B, Tn, 6 }, { dtype = "f64" })
  moe(x)
  local xf = x:reshape(B * Tn, 6)
  local s = moe.gate:scores(xf)
  local sel = moe.gate:route(s)
  local S, SEL = s:totable(), sel:totable()
  local want = 0
  for b = 0, B - 1 do
    local f, P = { 0, 0, 0, 0 }, { 0, 0, 0, 0 }
    for t = 1, Tn do
      local row = S[b * Tn + t]
      local tot = row[1] + row[2] + row[3] + row[4]
      for j = 1, 4 do P[j] = P[j] + row[j] / tot / Tn end
      for _, e in ipairs(SEL[b * Tn + t]) do f[e + 1] = f[e + 1] + 4 / (2 * Tn) end
    end
    for j = 1, 4 do want = want + f[j] * P[j] / B end
  end
  T.near(moe.aux_loss, 0.01 * want, 1e-12)
  moe.aux_loss:backward()
  T.ok(moe.gate.weight:grad():sum_squares() > 0, "the seq_aux loss trains the router")
end)

T.test("group-limited routing: TopK only inside each token's topk_group best groups (sum of top-2 of s + b)", function()
  tide.manual_seed(27)
  local n, G, tg, k = 8, 4, 2, 2
  local moe = MoE(6, { n_experts = n, top_k = k, expert_dim = 2, n_group = G, topk_group = tg, dtype = "f64", std = 1 })
  local bias = { 0.3, -0.2, 0.1, 0, -0.1, 0.25, -0.3, 0.05 }
  set(moe.gate.e_score_correction_bias, bias)
  local x = tide.randn({ 40, 6 }, { dtype = "f64" })
  local s = moe.gate:scores(x)
  local sel = moe.gate:route(s)
  local S, SEL = s:totable(), sel:totable()
  local per = n / G
  for t = 1, 40 do
    local sb = {}
    for j = 1, n do sb[j] = S[t][j] + bias[j] end
    local gs = {}
    for g = 1, G do
      local a, b = sb[(g - 1) * per + 1], sb[(g - 1) * per + 2]
      gs[g] = { g = g, v = a + b }
    end
    table.sort(gs, function(u, v) return u.v > v.v or (u.v == v.v and u.g < v.g) end)
    local allowed = {}
    for i = 1, tg do allowed[gs[i].g] = true end
    local cand = {}
    for j = 1, n do if allowed[math.floor((j - 1) / per) + 1] then cand[#cand + 1] = j end end
    table.sort(cand, function(u, v) return sb[u] > sb[v] or (sb[u] == sb[v] and u < v) end)
    T.eq({ SEL[t][1] + 1, SEL[t][2] + 1 }, { cand[1], cand[2] }, "token " .. t)
  end
  T.raises(function() MoE(6, { n_experts = 8, top_k = 2, expert_dim = 2, n_group = 3 }) end, "must divide n_experts")
  T.raises(function() MoE(6, { n_experts = 8, top_k = 2, expert_dim = 2, n_group = 4, topk_group = 5 }) end,
    "must be <= n_group")
  T.raises(function() MoE(6, { n_experts = 8, top_k = 2, expert_dim = 2, topk_group = 2 }) end, "needs n_group")
end)

T.test("group-limited QB: the token cutoff is the (k+1)-th s + b over the token's allowed experts", function()
  local ffi = require "ffi"
  tide.manual_seed(28)
  local n, G, tg, k, m = 8, 4, 2, 2, 64
  local per = n / G
  local moe = MoE(6, { n_experts = n, top_k = k, expert_dim = 2, n_group = G, topk_group = tg, dtype = "f64", std = 1 })
  local bias = { 0.3, -0.2, 0.1, 0, -0.1, 0.25, -0.3, 0.05 }
  set(moe.gate.e_score_correction_bias, bias)
  local s = moe.gate:scores(tide.randn({ m, 6 }, { dtype = "f64" }))
  local sel = moe.gate:route(s)
  local S, SEL = s:totable(), sel:totable()
  local sa, ba = ffi.new("double[?]", m * n), ffi.new("double[?]", n)
  for t = 1, m do for j = 1, n do sa[(t - 1) * n + j - 1] = S[t][j] end end
  for j = 1, n do ba[j - 1] = bias[j] end
  local allowed = qb.allowed(sa, ba, m, n, G, tg)
  local mu = qb.margins(sa, ba, m, n, k, allowed)
  local mu_all = qb.margins(sa, ba, m, n, k)
  local differ = 0
  for t = 1, m do
    local row = (t - 1) * n
    -- the allowed groups by brute force: the tg best sums of each group's two s + b
    local gs = {}
    for g = 1, G do
      local a, b2 = S[t][(g - 1) * per + 1] + bias[(g - 1) * per + 1], S[t][(g - 1) * per + 2] + bias[(g - 1) * per + 2]
      gs[g] = { g = g, v = a + b2 }
    end
    table.sort(gs, function(u, v) return u.v > v.v or (u.v == v.v and u.g < v.g) end)
    local want, vals = {}, {}
    for i = 1, tg do want[gs[i].g] = true end
    for j = 1, n do
      local ok = want[math.floor((j - 1) / per) + 1] == true
      T.eq(allowed[row + j - 1] == 1, ok, fmt("token %d expert %d allowed", t, j))
      if ok then vals[#vals + 1] = S[t][j] + bias[j] end
    end
    for i = 1, k do T.eq(allowed[row + SEL[t][i]], 1, "the router chose inside the allowed groups") end
    table.sort(vals, function(u, v) return u > v end)
    local c = vals[k + 1]
    local above = 0
    for j = 1, n do
      T.near(mu[row + j - 1], S[t][j] - c, 1e-15, fmt("token %d margin %d", t, j))
      if allowed[row + j - 1] == 1 and S[t][j] + bias[j] > c then above = above + 1 end
    end
    T.eq(above, k, "exactly k allowed experts clear the cutoff: the ones TopK chose")
    if math.abs(mu[row] - mu_all[row]) > 1e-9 then differ = differ + 1 end
  end
  T.ok(differ > 0, "the group cutoff differs from the all-expert one on some tokens")
  -- balance_step uses it
  moe:record(s, sel)
  moe:balance_step()
  local want = qb.update_arrays(sa, ba, m, n, k, { n_group = G, topk_group = tg })
  local plain = qb.update_arrays(sa, ba, m, n, k, {})
  local got, gap = moe.gate.e_score_correction_bias:totable(), 0
  for j = 1, n do
    T.near(got[j], want[j - 1], 1e-12, "bias " .. j)
    gap = math.max(gap, math.abs(want[j - 1] - plain[j - 1]))
  end
  T.ok(gap > 1e-6, "the masked update is not the unmasked one")
end)

T.test("sign_normalized: b += u (q − load)/RMS(q − load)", function()
  local moe = MoE(4, { n_experts = 4, top_k = 2, expert_dim = 1, n_shared = 0, balance = "sign", sign_normalized = true,
    sign_rate = 0.1, dtype = "f64" })
  local a = { 0.9, 0.3, 0.1, 0.2 }
  local s = tide.tensor({ a, a, a, a }, { dtype = "f64" })
  moe:record(s, (moe.gate:route(s)))
  moe:balance_step()
  -- loads {4, 4, 0, 0}, q = 2: q − load = {−2, −2, 2, 2}, RMS 2
  T.eq(moe.gate.e_score_correction_bias:tolist(), { -0.1, -0.1, 0.1, 0.1 })
end)

T.test("HybridLM with MoE FFNs: layer 0 dense, trains with QB, the bias moves and is checkpointed", function()
  tide.manual_seed(26)
  local cfg = {
    vocab_size = 23, dim = 16, n_layers = 3, mixers = "K", ffn_dim = 24, residual = "prenorm", init_std = 0.1,
    kda = { heads = 2, head_dim = 4, chunk = 4 },
    moe = { n_experts = 4, top_k = 2, expert_dim = 8, latent_dim = 8, activation = "situ" },
  }
  local model = nn.HybridLM(cfg)
  T.ok(model.model.layers:get(1).mlp ~= nil and model.model.layers:get(1).block_sparse_moe == nil, "layer 0 dense")
  T.eq(#model:moe_layers(), 2)
  local opt = optim.AdamW(model, { lr = 1e-2 })
  for _, p in ipairs(opt.params) do T.ok(not p.name:find("correction"), "b is not optimised") end
  local ids = tide.rand({ 4, 12 }, { lo = 0, hi = 23 }):to("i32")
  local tgt = tide.rand({ 4, 12 }, { lo = 0, hi = 23 }):to("i32")
  local first, last
  for step = 1, 8 do
    local loss = model:loss(ids, tgt)
    if step == 1 then first = loss:item() end
    last = loss:item()
    loss:backward()
    opt:step(1e-2)
    opt:zero_grad()
    model:balance_step()
  end
  T.ok(last < first, string.format("loss %.4f -> %.4f", first, last))
  local mm = model:moe_metrics()
  T.ok(mm[0] == nil and mm[1] and mm[2], "metrics for layers 1, 2")
  for l = 1, 2 do
    T.ok(mm[l].b_std > 0, "layer " .. l .. " bias moved")
    local bsum = 0
    for _, v in ipairs(model.model.layers:get(l + 1).block_sparse_moe.gate.e_score_correction_bias:tolist()) do bsum = bsum + v end
    T.near(bsum, 0, 1e-6, "layer " .. l .. " bias centred")
    T.eq(mm[l].tokens, 48)
  end
  local sd = model:state_dict()
  local key = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
  T.ok(sd[key] ~= nil, key)
  local fresh = nn.HybridLM(cfg)
  fresh:load_state_dict(sd)
  T.eq(fresh.model.layers:get(2).block_sparse_moe.gate.e_score_correction_bias:tolist(), sd[key]:tolist())
  T.near(fresh:forward(ids), model:eval():forward(ids), 0)
  cfg.moe.first_dense = false
  T.eq(#nn.HybridLM(cfg):moe_layers(), 3, "first_dense = false")
end)

T.test("tide.train with a MoE hybrid: moe/* keys per step, the bias in checkpoints, resume bit-identical", function()
  local train, checkpoint = require "tide.train", require "tide.checkpoint"
  local TMP = os.getenv("TMPDIR") or "/tmp"
  local function tmpdir(name)
    local dir = string.format("%s/tide-test-moe-%d-%s", TMP, math.floor(tide.time() * 1e6) % 1e9, name)
    tide.C.tide_remove_tree(dir)
    return dir
  end
  local function cfg(over)
    local c = {
      model = { kind = "hybrid", vocab_size = 320, dim = 16, n_layers = 2, mixers = "K", ffn_dim = 24, residual = "prenorm",
        kda = { heads = 2, head_dim = 4, chunk = 4 }, moe = { n_experts = 4, top_k = 2, expert_dim = 8, latent_dim = 8 } },
      data = { path = "tests/fixtures/tiny_corpus.txt", doc_separator = "%", val_fraction = 0.1, seq_len = 16, batch_size = 4 },
      optim = { lr = 3e-3 }, schedule = { kind = "cosine", warmup = 2 },
      train = { steps = 6, ckpt_every = 3, eval_every = 3, log_every = 1000, seed = 1, quiet = true, eval_batches = 1 },
    }
    for k, v in pairs(over or {}) do c.train[k] = v end
    return c
  end
  local a_dir, b_dir = tmpdir("a"), tmpdir("b")
  local a = train(cfg({ out = a_dir }))
  local log = io.open(a_dir .. "/metrics.jsonl"):read("*a")
  T.ok(log:find('"moe/maxvio_batch/1"', 1, true) and log:find('"moe/b_std/1"', 1, true), "moe metrics in the JSONL")
  local ck = a_dir .. "/ckpt/step_00000003"
  local rd = checkpoint.open(ck)
  local b3 = rd:tensors("model.safetensors")["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
  rd:close()
  T.ok(b3 ~= nil and b3:sum_squares() > 0, "the step-3 bias is in the checkpoint and nonzero")
  local c = cfg({ out = b_dir })
  c.resume = ck
  local b = train(c)
  for step = 4, 6 do T.ok(b.losses[step] == a.losses[step], "step " .. step .. " resumed == uninterrupted") end
  tide.C.tide_remove_tree(a_dir)
  tide.C.tide_remove_tree(b_dir)
end)

T.run()
