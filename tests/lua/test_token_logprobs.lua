-- F.token_logprobs from Lua: values against hand-computed log-probs and entropies, the ignore index, [B, T, V]
-- logits, Lua-table targets, the gradient of both outputs against the formula, and the argument errors.
local T = require "tide.testing"
local tide = require "tide"
local F = tide.F

T.test("token_logprobs: values, ignore index, [B, T, V] and table targets", function()
  local x = tide.tensor({{1, 2, 3}, {1, 1, 1}, {0, -1, 4}}, { dtype = "f64" })
  local e1, e2, e3 = math.exp(1), math.exp(2), math.exp(3)
  local z = e1 + e2 + e3
  local h1 = -((e1 / z) * (1 - math.log(z)) + (e2 / z) * (2 - math.log(z)) + (e3 / z) * (3 - math.log(z)))
  local lp, h = F.token_logprobs(x, {2, 0, -100})
  T.near(lp, {3 - math.log(z), -math.log(3), 0}, 1e-12)
  T.near(h, {h1, math.log(3), 0}, 1e-12)
  -- another ignore index; the fused log-prob equals the gather of log_softmax
  local lp2 = F.token_logprobs(x, {1, 7, 2}, { ignore_index = 7 })
  local ls = F.log_softmax(x):totable()
  T.near(lp2, {ls[1][2], 0, ls[3][3]}, 1e-12)
  -- [B, T, V] logits with [B, T] targets give [B, T] outputs
  local x3 = tide.randn({2, 3, 5}, { dtype = "f64" })
  local t3 = tide.tensor({{0, 4, 2}, {1, -100, 3}}, { dtype = "i32" })
  local lp3, h3 = F.token_logprobs(x3, t3)
  T.eq(lp3:shape(), {2, 3})
  T.eq(h3:shape(), {2, 3})
  local flat = F.cross_entropy(x3, t3, { reduction = "none" })
  T.near(lp3, (-flat):totable(), 1e-12)
end)

T.test("token_logprobs: gradient of both outputs", function()
  -- L = Σ a logp + Σ b entropy: dL/dx_j = a ([j == t] - p_j) - b p_j (log p_j + H), 0 on the ignored row
  local xv = {{0.5, -1, 2, 0}, {1, 1, -2, 0.25}}
  local x = tide.tensor(xv, { dtype = "f64", requires_grad = true })
  local lp, h = F.token_logprobs(x, {2, -100})
  local a, b = 0.7, -1.3
  local L = (lp * a):sum() + (h * b):sum()
  L:backward()
  local m, s = -math.huge, 0
  for _, v in ipairs(xv[1]) do m = math.max(m, v) end
  for _, v in ipairs(xv[1]) do s = s + math.exp(v - m) end
  local lse, H, want = m + math.log(s), 0, { {}, {0, 0, 0, 0} }
  for _, v in ipairs(xv[1]) do H = H - math.exp(v - lse) * (v - lse) end
  for j, v in ipairs(xv[1]) do
    local p = math.exp(v - lse)
    want[1][j] = a * ((j == 3 and 1 or 0) - p) - b * p * ((v - lse) + H)
  end
  T.near(x:grad(), want, 1e-12)
  -- only logp used: the entropy's gradient counts as zero
  local y = tide.tensor(xv, { dtype = "f64", requires_grad = true })
  local lpy = F.token_logprobs(y, {2, 0})
  lpy:sum():backward()
  local g = y:grad():totable()
  local sm = F.softmax(tide.tensor(xv, { dtype = "f64" })):totable()
  T.near(g, {{-sm[1][1], -sm[1][2], 1 - sm[1][3], -sm[1][4]}, {1 - sm[2][1], -sm[2][2], -sm[2][3], -sm[2][4]}}, 1e-12)
end)

T.test("token_logprobs: argument errors name the op", function()
  local x = tide.randn({3, 4})
  T.raises(function() F.token_logprobs(x, {0, 5, 1}) end, "token_logprobs: target 5 at row 1")
  T.raises(function() F.token_logprobs(x, {0, 1}) end, "token_logprobs: targets are [2] but logits are [3, 4]")
  T.raises(function() F.token_logprobs("x", {0}) end, "token_logprobs: logits must be a tensor")
  T.raises(function() F.token_logprobs(x, {0, 1, 2}, { ignore = 1 }) end, "unknown option ignore")
  T.raises(function() F.token_logprobs(x, tide.randn({3})) end, "token_logprobs")
end)
