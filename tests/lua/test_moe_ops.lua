-- moe ops: F.situ_glu, F.topk, F.moe_experts (spec/moe.md §2, §6, §8) — one numeric check each against plain
-- Lua arithmetic, a float64 gradient check of the experts op, and the wrapper errors.
local T = require "tide.testing"
local tide = require "tide"
local F = tide.F

local function sig(x) return 1 / (1 + math.exp(-x)) end
local function situ(g, u, kg, kl) return kg * math.tanh(g / kg) * sig(g) * kl * math.tanh(u / kl) end

T.test("situ_glu == the formula (defaults 4, 25 and given caps); bounded by k_gate·k_lin", function()
  local g = tide.tensor({ -30, -2, -0.5, 0, 0.7, 3, 40 }, { dtype = "f64" })
  local u = tide.tensor({ 2, -60, 1.5, 9, -0.3, 5, 1e4 }, { dtype = "f64" })
  local gl, ul = g:tolist(), u:tolist()
  local want, want2 = {}, {}
  for i = 1, #gl do want[i] = situ(gl[i], ul[i], 4, 25); want2[i] = situ(gl[i], ul[i], 1.5, 2) end
  T.near(F.situ_glu(g, u), want, 1e-12)
  T.near(F.situ_glu(g, u, { k_gate = 1.5, k_lin = 2 }), want2, 1e-12)
  for _, v in ipairs(F.situ_glu(g * 1e3, u * 1e3):tolist()) do T.ok(math.abs(v) <= 100, "|h| <= 100, got " .. v) end
  T.raises(function() F.situ_glu(g, u, { kgate = 1 }) end, "situ_glu: unknown key 'kgate'")
  T.raises(function() F.situ_glu(g, u, { k_gate = -1 }) end, "k_gate = -1")
  T.raises(function() F.situ_glu(g, 3) end, "situ_glu: u must be a tensor")
end)

-- nn.MLP's SiTU FFN runs the fused op; on the CPU it rounds as the unfused chain of ten ops it replaced did, so a
-- model's numbers did not move with the switch: forward and both gradients bitwise, f32, over a wide range
T.test("situ_glu (f32, CPU) == the unfused chain ((tanh(g/k1)·k1)·σ(g))·(tanh(u/k2)·k2) bitwise, with its gradients", function()
  tide.manual_seed(11)
  local n = 20000
  local g0, u0, d0 = tide.randn({ n }) * 6, tide.randn({ n }) * 40, tide.randn({ n })
  for _, k in ipairs({ { 4, 25 }, { 1.5, 3 } }) do
    local function run(fused)
      local g, u = g0:detach():requires_grad_(true), u0:detach():requires_grad_(true)
      local h = fused and F.situ_glu(g, u, { k_gate = k[1], k_lin = k[2] })
        or ((g * (1 / k[1])):tanh() * k[1] * g:sigmoid()) * ((u * (1 / k[2])):tanh() * k[2])
      local l = (h * d0):sum()
      l:backward()
      return { h:f64_array(), g:grad():f64_array(), u:grad():f64_array() }
    end
    local a, b = run(false), run(true)
    for j, what in ipairs({ "h", "dg", "du" }) do
      local differ = 0
      for i = 0, n - 1 do if a[j][i] ~= b[j][i] then differ = differ + 1 end end
      T.eq(differ, 0, string.format("k %g, %g: elements of %s that differ from the unfused chain", k[1], k[2], what))
    end
  end
end)

T.test("topk: descending, ties to the lowest index, 0-based i64 indices, gradient to the chosen entries", function()
  local x = tide.tensor({ { 1, 3, 3, 2, 3 }, { 0, -1, 5, 5, 4 } }, { dtype = "f64", requires_grad = true })
  local v, i = F.topk(x, 3)
  T.eq(v:tolist(), { 3, 3, 3, 5, 5, 4 })
  T.eq(i:dtype(), "i64")
  T.eq(i:tolist(), { 1, 2, 4, 2, 3, 4 })
  v:sum():backward()
  T.eq(x:grad():tolist(), { 0, 1, 1, 0, 1, 0, 0, 1, 1, 1 })
  T.raises(function() F.topk(x, 6) end, "topk: k = 6 must be in [1, 5]")
  T.raises(function() F.topk(x, 1.5) end, "topk: k must be an integer")
end)

-- dense per-token loop over flat lists (§8 definition)
local function dense(x, sel, p, wgu, wd, m, k, din, de, dout, act)
  local out = {}
  for t = 0, m - 1 do
    for c = 0, dout - 1 do out[t * dout + c + 1] = 0 end
    for s = 0, k - 1 do
      local e = sel[t * k + s + 1]
      local h = {}
      for j = 0, de - 1 do
        local g, u = 0, 0
        for i = 0, din - 1 do
          g = g + wgu[(e * 2 * de + j) * din + i + 1] * x[t * din + i + 1]
          u = u + wgu[(e * 2 * de + de + j) * din + i + 1] * x[t * din + i + 1]
        end
        h[j] = act == "situ" and situ(g, u, 4, 25) or g * sig(g) * u
      end
      for c = 0, dout - 1 do
        local y = 0
        for j = 0, de - 1 do y = y + wd[(e * dout + c) * de + j + 1] * h[j] end
        out[t * dout + c + 1] = out[t * dout + c + 1] + p[t * k + s + 1] * y
      end
    end
  end
  return out
end

T.test("moe_experts == a dense per-token loop (both activations), gradients, capacity and errors", function()
  local m, k, n, din, de, dout = 5, 2, 4, 3, 2, 3
  local sel = { { 0, 2 }, { 2, 0 }, { 2, 3 }, { 0, 2 }, { 2, 2 } }   -- expert 1 idle, expert 2 in every token
  local flat_sel = {}
  for _, r in ipairs(sel) do for _, e in ipairs(r) do flat_sel[#flat_sel + 1] = e end end
  local x = tide.randn({ m, din }, { dtype = "f64", requires_grad = true })
  local p = tide.rand({ m, k }, { dtype = "f64", requires_grad = true })
  local wgu = tide.randn({ n, 2 * de, din }, { dtype = "f64", requires_grad = true })
  local wd = tide.randn({ n, dout, de }, { dtype = "f64", requires_grad = true })
  for _, act in ipairs({ "situ", "swiglu" }) do
    local u, dropped = F.moe_experts(x, sel, p, wgu, wd, { activation = act })
    T.eq(dropped, 0)
    T.near(u:tolist(), dense(x:tolist(), flat_sel, p:tolist(), wgu:tolist(), wd:tolist(), m, k, din, de, dout, act), 1e-12)
  end
  local seli = tide.tensor(sel, { dtype = "i32" })
  local worst = T.gradcheck(function(a, b, c, d) return F.moe_experts(a, seli, b, c, d, { k_gate = 1.5, k_lin = 2 }) end,
                            { x, p, wgu, wd }, { atol = 1e-8, rtol = 1e-6 })
  T.ok(worst < 1e-7, "gradient check worst " .. worst)
  -- capacity 0.5: cap = ceil(0.5·10/4) = 2; expert 0 has 3 and expert 2 has 6 assignments -> 1 + 4 dropped
  local _, dropped = F.moe_experts(x, sel, p, wgu, wd, { capacity_factor = 0.5 })
  T.eq(dropped, 5)
  T.raises(function() F.moe_experts(x, sel, p, wgu, wd, { activation = "relu" }) end,
           'moe_experts: activation must be "situ" or "swiglu", got "relu"')
  -- the capacity as a count: 2 is capacity_factor 0.5's; 4 drops expert 2's last two
  local u2, d2 = F.moe_experts(x, sel, p, wgu, wd, { capacity = 2 })
  T.eq(d2, 5)
  T.near(u2:tolist(), F.moe_experts(x, sel, p, wgu, wd, { capacity_factor = 0.5 }):tolist(), 0)
  T.eq(select(2, F.moe_experts(x, sel, p, wgu, wd, { capacity = 4 })), 2)
  T.raises(function() F.moe_experts(x, sel, p, wgu, wd, { capacity = 2, capacity_factor = 0.5 }) end,
           "give capacity or capacity_factor, not both")
  T.raises(function() F.moe_experts(x, sel, p, wgu, wd, { capacity = -1 }) end, "capacity = -1 must be 0")
  T.raises(function() F.moe_experts(x, sel, p, wgu, wd, { size = 1 }) end, "moe_experts: unknown key 'size'")
  T.raises(function() F.moe_experts(x, { { 0, 4 }, { 0, 0 }, { 0, 0 }, { 0, 0 }, { 0, 0 } }, p, wgu, wd) end,
           "expert id 4, outside [0, 4)")
  T.raises(function() F.moe_experts(x, sel, p, wd, wd) end, "must be [m, d_in], [m, k], [m, k]")
end)

T.run()
