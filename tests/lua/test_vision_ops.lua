-- vision_ops: F.pos_interp and F.gelu_erf against PyTorch (Debian's python3-torch through /usr/bin/python3), forward
-- and gradient, f64 within 1e-12 and f32 within 1e-5 (of max(1, |value|)): pos_interp is torch's
-- interpolate(table.permute(2, 0, 1)[None], size = (h, w), mode = "bicubic", align_corners = False) per image
-- (upsample, downsample, non-square, 1x1, the native grid); gelu_erf is torch's F.gelu (approximate = "none").
-- Also F.grid_positions, F.rope2d's Lua arguments and F.gelu staying the tanh form. Needs /usr/bin/python3 with
-- python3-torch and python3-numpy (scripts/test_deps.sh).
local T = require "tide.testing"
local tide = require "tide"
local F = tide.F

local fmt = string.format
local PY = "/usr/bin/python3"

-- the Python side: reads IN (a header line, then one line of numbers per tensor), writes OUT (one line per tensor);
-- numbers as %.17g / repr, so every double crosses exactly
local SCRIPT = [==[
import sys
import torch
import torch.nn.functional as F

lines = open(sys.argv[1]).read().split("\n")
head = lines[0].split()
dtype = {"f32": torch.float32, "f64": torch.float64}[head[1]]
vec = lambda i: torch.tensor([float(v) for v in lines[i].split()], dtype=torch.float64).to(dtype)
out = []
if head[0] == "interp":
    Gh, Gw, d, n = int(head[2]), int(head[3]), int(head[4]), int(head[5])
    grids = [(int(head[6 + 2 * i]), int(head[7 + 2 * i])) for i in range(n)]
    table = vec(1).reshape(Gh, Gw, d).requires_grad_(True)
    parts = [F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False)[0]
             .permute(1, 2, 0).reshape(h * w, d) for h, w in grids]
    y = torch.cat(parts, 0)
else:
    table = vec(1).requires_grad_(True)
    y = F.gelu(table)
r = vec(2).reshape(y.shape)
(y * r).sum().backward()
with open(sys.argv[2], "w") as f:
    for t in (y, table.grad):
        f.write(" ".join(repr(float(v)) for v in t.detach().reshape(-1).tolist()) + "\n")
]==]

local state = {}
local function python()
  if state.script then return state end
  local p = io.popen(PY .. " -c 'import torch, numpy; print(torch.__version__)' 2>&1")
  local out = p:read("*a")
  local ok = p:close()
  if not ok then
    error(fmt("test_vision_ops needs %s with python3-torch (%s): run scripts/test_deps.sh", PY,
              out:gsub("\n", " "):sub(1, 200)), 0)
  end
  state.version = out:match("^%s*(.-)%s*$")
  state.dir = T.tmpdir("vision_ops", { create = true })
  state.script = state.dir .. "/torch_ref.py"
  local f = assert(io.open(state.script, "w"))
  f:write(SCRIPT)
  f:close()
  return state
end

local function numbers(list)
  local s = {}
  for i, v in ipairs(list) do s[i] = fmt("%.17g", v) end
  return table.concat(s, " ")
end

-- torch's output and input gradient for header (a string) and the tensors x, r (flat Lua lists)
local function torch_ref(head, x, r)
  local st = python()
  local inp, outp = st.dir .. "/in.txt", st.dir .. "/out.txt"
  local f = assert(io.open(inp, "w"))
  f:write(head, "\n", numbers(x), "\n", numbers(r), "\n")
  f:close()
  local p = io.popen(fmt("%s '%s' '%s' '%s' 2>&1", PY, st.script, inp, outp))
  local msg = p:read("*a")
  if not p:close() then error("torch_ref.py failed: " .. msg, 2) end
  local res = {}
  for line in io.lines(outp) do
    local v = {}
    for w in line:gmatch("%S+") do v[#v + 1] = tonumber(w) end
    res[#res + 1] = v
  end
  return res[1], res[2]
end

-- max |a − b| / max(1, |b|)
local function err(a, b)
  T.eq(#a, #b, "element count")
  local m = 0
  for i = 1, #a do m = math.max(m, math.abs(a[i] - b[i]) / math.max(1, math.abs(b[i]))) end
  return m
end

local TOL = { f64 = 1e-12, f32 = 1e-5 }

-- ours: forward and the gradient of sum(y ⊙ r) with respect to x
local function ours(fn, x, r)
  x:requires_grad_(true)
  local y = fn(x)
  local loss = (y * r):sum()
  loss:backward()
  return y:tolist(), x:grad():tolist()
end

T.test("F.pos_interp == torch bicubic (align_corners = false), forward and table gradient, f64 <= 1e-12, f32 <= 1e-5",
  function()
  local cases = {
    { G = { 8, 8 }, d = 5, grids = { { 8, 8 }, { 16, 16 }, { 4, 4 }, { 3, 11 }, { 1, 1 }, { 13, 5 }, { 64, 64 }, { 2, 2 } } },
    { G = { 5, 5 }, d = 3, grids = { { 7, 3 }, { 5, 5 }, { 1, 9 }, { 2, 1 }, { 24, 17 } } },
    { G = { 4, 6 }, d = 2, grids = { { 9, 2 }, { 4, 6 }, { 3, 3 } } },
  }
  for _, dt in ipairs({ "f64", "f32" }) do
    for ci, c in ipairs(cases) do
      tide.manual_seed(10 + ci)
      local tab = tide.randn({ c.G[1], c.G[2], c.d }, { dtype = dt })
      local L = 0
      local head = { "interp", dt, c.G[1], c.G[2], c.d, #c.grids }
      for _, g in ipairs(c.grids) do
        L = L + g[1] * g[2]
        head[#head + 1] = g[1]
        head[#head + 1] = g[2]
      end
      local r = tide.randn({ L, c.d }, { dtype = dt })
      local y, gt = ours(function(x) return F.pos_interp(x, c.grids) end, tab, r)
      local ty, tg = torch_ref(table.concat(head, " "), tab:tolist(), r:tolist())
      local ey, eg = err(y, ty), err(gt, tg)
      print(fmt("    %s table [%d,%d,%d], %d grids (%d tokens): max err forward %.2e, gradient %.2e vs torch %s", dt,
                c.G[1], c.G[2], c.d, #c.grids, L, ey, eg, python().version))
      T.ok(ey <= TOL[dt], fmt("%s case %d forward error %.3g > %g", dt, ci, ey, TOL[dt]))
      T.ok(eg <= TOL[dt], fmt("%s case %d gradient error %.3g > %g", dt, ci, eg, TOL[dt]))
    end
  end
end)

T.test("F.pos_interp: the native grid is the table itself (bitwise); grids as an int tensor; bad grids name the op",
  function()
  local tab = tide.randn({ 6, 6, 4 })
  T.eq(F.pos_interp(tab, { { 6, 6 } }):tolist(), tab:tolist())
  local g = tide.tensor({ { 3, 2 }, { 6, 6 } }, { dtype = "i32" })
  T.eq(F.pos_interp(tab, g):tolist(), F.pos_interp(tab, { { 3, 2 }, { 6, 6 } }):tolist())
  T.eq(F.pos_interp(tab, g):shape(), { 3 * 2 + 36, 4 })
  T.raises(function() F.pos_interp(tab, { { 3, 0 } }) end, "pos_interp: grids[1] must be {h, w} with positive integers")
  T.raises(function() F.pos_interp(tab, { 3, 2 }) end, "pos_interp: grids[1] must be {h, w}")
  T.raises(function() F.pos_interp(tab, "3x2") end, "pos_interp: grids must be a list of {h, w} or an int tensor")
  T.raises(function() F.pos_interp(tide.randn({ 6, 24 }), { { 2, 2 } }) end, "pos_interp: table must be [G, G, d]")
end)

T.test("F.gelu_erf == torch F.gelu (exact), forward and gradient, f64 <= 1e-12, f32 <= 1e-5; F.gelu stays tanh",
  function()
  local xs = {}
  for i = 0, 400 do xs[#xs + 1] = -10 + 20 * i / 400 end
  for _, v in ipairs({ -30, -6.5, -1e-8, 0, 1e-8, 6.5, 30 }) do xs[#xs + 1] = v end
  for _, dt in ipairs({ "f64", "f32" }) do
    tide.manual_seed(3)
    local x = tide.tensor(xs, { dtype = dt })
    local r = tide.randn({ #xs }, { dtype = dt })
    local y, gx = ours(F.gelu_erf, x, r)
    local ty, tg = torch_ref("gelu " .. dt, x:tolist(), r:tolist())
    local ey, eg = err(y, ty), err(gx, tg)
    print(fmt("    %s gelu_erf on %d points in [-30, 30]: max err forward %.2e, gradient %.2e vs torch", dt, #xs, ey, eg))
    T.ok(ey <= TOL[dt], fmt("%s forward error %.3g", dt, ey))
    T.ok(eg <= TOL[dt], fmt("%s gradient error %.3g", dt, eg))
  end
  -- vision.md §6: the tanh and erf forms differ by ~1e-3 (not interchangeable)
  local x = tide.tensor(xs, { dtype = "f64" })
  local d = T.max_abs_diff(F.gelu(x), F.gelu_erf(x))
  T.ok(d > 1e-4 and d < 1e-2, fmt("gelu vs gelu_erf differ by %.3g", d))
end)

T.test("F.grid_positions: (row, col) in raster order per image, i32; F.rope2d takes them and checks its options",
  function()
  local p = F.grid_positions({ { 2, 3 }, { 1, 2 } })
  T.eq(p:dtype(), "i32")
  T.eq(p:shape(), { 8, 2 })
  T.eq(p:tolist(), { 0, 0, 0, 1, 0, 2, 1, 0, 1, 1, 1, 2, 0, 0, 0, 1 })
  T.eq(F.grid_positions({}):shape(), { 0, 2 })
  T.raises(function() F.grid_positions({ { 2, 1.5 } }) end, "grid_positions: grids[1] must be {h, w} with positive integers")
  local x = tide.randn({ 8, 2, 8 }, { dtype = "f64" })
  local y = F.rope2d(x, p)
  T.eq(y:shape(), { 8, 2, 8 })
  -- token 0 sits at (0, 0): no rotation; theta only changes the slots past the first two
  T.ok(T.max_abs_diff(y[1], x[1]) == 0, "position (0, 0) is the identity")
  T.eq(F.rope2d(x, p, { theta = 100 }):tolist(), tide.F.rope2d(x, p, { theta = 100 }):tolist())
  T.ok(T.max_abs_diff(F.rope2d(x, p, { theta = 100 }), y) > 1e-3, "theta changes the rotation")
  T.raises(function() F.rope2d(x, p, { base = 10 }) end, "rope2d: unknown key 'base'")
  T.raises(function() F.rope2d(tide.randn({ 8, 2, 6 }), p) end, "rope2d: x must be [T, H, head_dim] with head_dim a multiple of 4")
end)
