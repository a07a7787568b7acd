-- Autograd from Lua: gradients of small expressions against hand-computed values, no_grad,
-- recompute regions, accumulation, and a float64 gradient check of a small MLP.
local T = require "tide.testing"
local tide = require "tide"
local F = tide.F
local fmt = string.format

local function leaf(v) return tide.tensor(v, { dtype = "f64", requires_grad = true }) end

T.test("gradient of a polynomial", function()
  -- L = sum(x^3 + 2 x y - y), dL/dx = 3 x^2 + 2 y, dL/dy = 2 x - 1
  local x, y = leaf({1, -2, 0.5}), leaf({3, 4, -1})
  local L = (x ^ 3 + 2 * x * y - y):sum()
  T.near(L, (1 + 6 - 3) + (-8 - 16 - 4) + (0.125 - 1 + 1), 1e-12)
  L:backward()
  T.near(x:grad(), {3 + 6, 12 + 8, 0.75 - 2}, 1e-12)
  T.near(y:grad(), {1, -5, 0}, 1e-12)
end)

T.test("gradient through division, exp, log and broadcasting", function()
  -- L = sum(exp(a) / b + log(b)) with a [2, 2], b [2] broadcast over rows
  local a, b = leaf({{0, 1}, {2, -1}}), leaf({2, 4})
  local L = (a:exp() / b + b:log()):sum()
  L:backward()
  local e = math.exp
  T.near(a:grad(), {{e(0) / 2, e(1) / 4}, {e(2) / 2, e(-1) / 4}}, 1e-12)
  -- dL/db_j = sum_i -exp(a_ij) / b_j^2 + 2 / b_j  (b appears in both rows)
  T.near(b:grad(), {-(e(0) + e(2)) / 4 + 2 / 2, -(e(1) + e(-1)) / 16 + 2 / 4}, 1e-12)
end)

T.test("gradient of matmul and mean", function()
  -- L = mean(A B); dL/dA = 1/n * 1 B^T, dL/dB = 1/n * A^T 1
  local A = leaf({{1, 2}, {3, 4}})
  local B = leaf({{5, 6, 7}, {8, 9, 10}})
  local L = A:matmul(B):mean()
  L:backward()
  T.near(A:grad(), {{(5 + 6 + 7) / 6, (8 + 9 + 10) / 6}, {(5 + 6 + 7) / 6, (8 + 9 + 10) / 6}}, 1e-12)
  T.near(B:grad(), {{4 / 6, 4 / 6, 4 / 6}, {6 / 6, 6 / 6, 6 / 6}}, 1e-12)
end)

T.test("gradients accumulate until zero_grad", function()
  local x = leaf({1, 2})
  ;(x * x):sum():backward()
  T.near(x:grad(), {2, 4}, 1e-12)
  ;(x * 3):sum():backward()
  T.near(x:grad(), {5, 7}, 1e-12)
  x:zero_grad()
  T.eq(x:grad(), nil)
  ;(x * 3):sum():backward()
  T.near(x:grad(), {3, 3}, 1e-12)
end)

T.test("no_grad records nothing and restores grad mode on errors", function()
  local x = leaf({1, 2})
  local y = tide.no_grad(function() return x * 2 end)
  T.ok(not y:requires_grad(), "no history under no_grad")
  T.raises(function() y:sum():backward() end, "does not require grad")
  T.ok(tide.grad_enabled())
  T.raises(function() tide.no_grad(function() error("inside") end) end, "inside")
  T.ok(tide.grad_enabled(), "grad mode is restored after an error")
  local a, b = tide.no_grad(function(p, q) return p + q, p * q end, 2, 3)
  T.eq({a, b}, {5, 6})
  T.ok((x * 2):requires_grad())
end)

T.test("detach cuts the graph", function()
  local x = leaf({3})
  local L = (x * x:detach()):sum()   -- d/dx of x * const(x) = x
  L:backward()
  T.near(x:grad(), {3}, 1e-12)
end)

-- a 2-layer MLP with a softmax cross-entropy head
local function mlp(x, w1, b1, w2, targets)
  local h = F.linear(x, w1, b1):tanh()
  return F.cross_entropy(F.linear(h, w2), targets)
end

local function mlp_params()
  tide.manual_seed(7)
  local x = tide.randn({4, 3}, { dtype = "f64" })
  local w1 = tide.randn({5, 3}, { dtype = "f64", std = 0.5, requires_grad = true })
  local b1 = tide.randn({5}, { dtype = "f64", std = 0.1, requires_grad = true })
  local w2 = tide.randn({6, 5}, { dtype = "f64", std = 0.5, requires_grad = true })
  return x, w1, b1, w2, {1, 5, 0, 2}
end

T.test("recompute gives the same gradients as a plain backward", function()
  local x, w1, b1, w2, tg = mlp_params()
  mlp(x, w1, b1, w2, tg):backward()
  local g_plain = { w1:grad():totable(), b1:grad():totable(), w2:grad():totable() }
  w1:zero_grad(); b1:zero_grad(); w2:zero_grad()
  local loss = tide.recompute(mlp, x, w1, b1, w2, tg)
  loss:backward()
  T.near(w1:grad(), g_plain[1], 1e-12)
  T.near(b1:grad(), g_plain[2], 1e-12)
  T.near(w2:grad(), g_plain[3], 1e-12)
  T.ok(math.abs(g_plain[1][1][1]) > 1e-6, "gradients are not trivially zero")
end)

T.test("gradcheck of a small MLP in float64", function()
  local x, w1, b1, w2, tg = mlp_params()
  local worst = T.gradcheck(function(a, b, c) return mlp(x, a, b, c, tg) end, {w1, b1, w2})
  T.ok(worst < 1e-7, "worst |analytic - numeric| " .. worst)
end)

T.test("gradcheck catches a wrong gradient", function()
  -- detach hides the dependence on x from backward: the check must fail
  local x = leaf({0.5, -1.5})
  T.raises(function()
    T.gradcheck(function(a) return a * a:detach() end, {x})
  end, "gradcheck")
end)

T.test("gradcheck of softmax, rmsnorm and attention", function()
  tide.manual_seed(3)
  local x = tide.randn({2, 4}, { dtype = "f64", requires_grad = true })
  T.gradcheck(function(a) return F.softmax(a, 2) end, {x})
  local w = tide.randn({4}, { dtype = "f64", requires_grad = true })
  T.gradcheck(function(a, b) return F.rmsnorm(a, b) end, {x, w})
  local q = tide.randn({1, 2, 3, 4}, { dtype = "f64", requires_grad = true })
  local k = tide.randn({1, 2, 3, 4}, { dtype = "f64", requires_grad = true })
  local v = tide.randn({1, 2, 3, 4}, { dtype = "f64", requires_grad = true })
  T.gradcheck(function(a, b, c) return F.attention(a, b, c, { causal = true }) end, {q, k, v})
end)

T.test("attention: small heads run in parallel with the bits of one thread, forward and gradients", function()
  -- 6 heads of 40 x 40 scores: one head a thread at two threads, in sequence at one; the same products and rows
  tide.manual_seed(5)
  local q, k, v = tide.randn({ 2, 3, 40, 16 }), tide.randn({ 2, 3, 40, 16 }), tide.randn({ 2, 3, 40, 16 })
  local g = tide.randn({ 2, 3, 40, 16 })
  local threads = tide.num_threads()
  local function run(nt)
    tide.set_num_threads(nt)
    local a, b, c = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
    local o = F.attention(a, b, c, { causal = true })
    o:backward(g)
    return { o:tolist(), a:grad():tolist(), b:grad():tolist(), c:grad():tolist() }
  end
  local one, two = run(1), run(2)
  tide.set_num_threads(threads)
  for i, what in ipairs({ "out", "dq", "dk", "dv" }) do T.eq(two[i], one[i], what .. ": 2 threads == 1 thread, bitwise") end
  -- against the f64 op (whose gradient check is above and in test-ops)
  local o64 = F.attention(q:to("f64"), k:to("f64"), v:to("f64"), { causal = true })
  local d, ref = 0, o64:tolist()
  for i = 1, #ref do d = math.max(d, math.abs(one[1][i] - ref[i])) end
  T.ok(d < 1e-5, "f32 out vs f64: " .. d)
end)

T.test("tide.profile: each op's forward, backward and recompute calls, self times, fn's results and errors", function()
  local x, w1, b1, w2, tg = mlp_params()
  local r, a, b, c = tide.profile(function()
    local loss = tide.recompute(mlp, x, w1, b1, w2, tg)
    loss:backward()
    return "kept", nil, 3
  end)
  T.eq(a, "kept"); T.eq(b, nil); T.eq(c, 3)
  local by = {}
  for _, e in ipairs(r.ops) do by[e.name] = e end
  -- two Linears: each forward once, replayed once (the recompute region), its backward once, and that backward's
  -- products as matmul calls of their own (dx for the second layer only: x needs no gradient)
  T.ok(by.linear, "linear profiled:\n" .. r:table())
  T.eq(by.linear.fwd_calls, 2)
  T.eq(by.linear.replay_calls, 2)
  T.eq(by.linear.bwd_calls, 2)
  T.ok(by.matmul and by.matmul.fwd_calls >= 3, "the backward's products count as matmul:\n" .. r:table())
  T.eq(by.matmul.bwd_calls, 0)
  local sum, prev = 0, math.huge
  for _, e in ipairs(r.ops) do
    for _, k in ipairs({ "fwd_s", "bwd_s", "replay_s" }) do T.ok(e[k] >= 0, e.name .. " " .. k .. " " .. e[k]) end
    T.ok(e.total_s <= prev, "largest first")
    prev = e.total_s
    sum = sum + e.total_s
  end
  T.near(r.ops_s, sum, 1e-12)
  T.ok(r.ops_s <= r.wall_s, fmt("self times %.6f s within the wall %.6f s", r.ops_s, r.wall_s))
  T.ok(r:table(3):find("linear", 1, true), r:table(3))
  -- off again: ops after it are not counted
  T.eq(tide.C.tide_profile_set(0), 0)
  -- an error inside propagates and leaves the profiler off; a profile does not nest
  T.raises(function() tide.profile(function() error("inside", 0) end) end, "inside")
  T.eq(tide.C.tide_profile_set(0), 0)
  T.raises(function() tide.profile(function() tide.profile(function() end) end) end, "does not nest")
  T.raises(function() tide.profile(42) end, "expected a function")
  local r2 = tide.profile(function() return (w1 * 2):sum() end)
  T.eq(#r2.ops, 2, r2:table())
end)

T.test("backward errors are clear", function()
  local x = leaf({1, 2})
  T.raises(function() (x * 2):backward() end, "backward")
  T.raises(function() tide.tensor({1, 2}):sum():backward() end, "does not require grad")
end)

T.run()
