-- mla: nn.MLA and F.mla_attention (spec/mla.md oracles 1-5): absorbed latent decode == expanded attention,
-- NoPE (no position enters; the rope slot still scores), causality and packing, the output gate, the
-- whole-layer float64 gradient check with two documents, the cache size, and errors.
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F

local max_abs_diff, max_abs = T.max_abs_diff, T.max_abs

local function randn(shape) return tide.randn(shape, { dtype = "f64" }) end

-- a small layer in f64 with weights large enough that every path matters (std 0.3)
local function layer(opts)
  local o = { heads = 3, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 5, std = 0.3, dtype = "f64" }
  for k, v in pairs(opts or {}) do o[k] = v end
  return nn.MLA(16, o)
end

T.test("names and shapes follow formats.md §2; cache values per token = d_c + d_r", function()
  local m = layer()
  local want = {
    ["q_a_proj.weight"] = { 12, 16 }, ["q_a_layernorm.weight"] = { 12 }, ["q_b_proj.weight"] = { 18, 12 },
    ["kv_a_proj_with_mqa.weight"] = { 10, 16 }, ["kv_a_layernorm.weight"] = { 8 }, ["kv_b_proj.weight"] = { 27, 8 },
    ["g_proj.weight"] = { 15, 16 }, ["o_proj.weight"] = { 16, 15 },
  }
  local n = 0
  for name, t in m:named_parameters() do
    T.ok(want[name], "unexpected parameter " .. name)
    T.eq(t:shape(), want[name], name)
    n = n + 1
  end
  T.eq(n, 8)
  local latent, mha = m:cache_values_per_token()
  T.eq(latent, 10)
  T.eq(mha, 3 * (4 + 2 + 5))
  local full = layer({ q_rank = false })
  T.ok(full.q_proj and not full.q_a_proj, "q_rank = nil/false gives the full-rank q_proj")
end)

T.test("absorbed latent decode == expanded attention at every step (f64 1e-12, gate on)", function()
  tide.manual_seed(3)
  local m = layer()
  local x = randn({ 2, 9, 16 })
  local full = m:forward(x)
  local cache, outs = {}, {}
  tide.no_grad(function()
    outs[1] = m:prefill(x:narrow(2, 1, 4), cache)
    for t = 5, 9 do outs[#outs + 1] = m:step(x:narrow(2, t, 1), cache) end
  end)
  T.near(max_abs_diff(F.concat(outs, 2), full), 0, 1e-12, "prefill 4 + 5 absorbed steps")
  T.eq(cache.pos, 9)
  T.eq(cache.c:shape(), { 2, 9, 8 })
  T.eq(cache.k_r:shape(), { 2, 9, 2 })
  -- the expanded path over the same cache gives the same token too
  local c2 = {}
  local a = tide.no_grad(function()
    m:prefill(x:narrow(2, 1, 8), c2)
    return m:forward(x:narrow(2, 9, 1), { cache = c2, absorbed = false })
  end)
  T.near(max_abs_diff(a, full:narrow(2, 9, 1)), 0, 1e-12, "expanded step")
end)

T.test("NoPE: no position enters (a document after 1000 tokens == alone); the rope slot contributes", function()
  tide.manual_seed(4)
  local m = layer()
  local xb = randn({ 1, 7, 16 })
  local alone = m:forward(xb)
  local row = F.concat({ randn({ 1, 1000, 16 }), xb }, 2)
  local packed = m:forward(row, { cu_seqlens = { 0, 1000, 1007 } })
  T.near(max_abs_diff(packed:narrow(2, 1001, 7), alone), 0, 1e-12, "doc B at position 1000")
  -- zero the k_r rows of W_DKV: the output moves by more than 1e-3 relative
  local w = m.kv_a_proj_with_mqa.weight
  local saved = w:clone()
  tide.no_grad(function() w:narrow(1, 9, 2):zero_() end)
  local no_rope = m:forward(xb)
  tide.no_grad(function() w:copy_(saved) end)
  T.ok(max_abs_diff(no_rope, alone) > 1e-3 * max_abs(alone), "the rope slot must change the output")
end)

T.test("causality is exact and packed documents equal separate runs (f64 1e-12)", function()
  tide.manual_seed(5)
  local m = layer()
  local x = randn({ 1, 12, 16 })
  local y1 = m:forward(x)
  local x2 = F.concat({ x:narrow(2, 1, 6), randn({ 1, 6, 16 }) }, 2)
  local y2 = m:forward(x2)
  T.eq(y2:narrow(2, 1, 6):tolist(), y1:narrow(2, 1, 6):tolist(), "outputs before the change are bitwise equal")
  local a, b = randn({ 1, 5, 16 }), randn({ 1, 7, 16 })
  local packed = m:forward(F.concat({ a, b }, 2), { cu_seqlens = { 0, 5, 12 } })
  T.near(max_abs_diff(packed:narrow(2, 1, 5), m:forward(a)), 0, 1e-12, "doc A")
  T.near(max_abs_diff(packed:narrow(2, 6, 7), m:forward(b)), 0, 1e-12, "doc B")
end)

T.test("output gate: W_G = 0 halves the output exactly; gate = false is the ungated layer", function()
  tide.manual_seed(6)
  local m = layer()
  local x = randn({ 2, 5, 16 })
  tide.no_grad(function() m.g_proj.weight:zero_() end)
  local gated = m:forward(x)
  local u = layer({ gate = false })
  for name, t in u:named_parameters() do tide.no_grad(function() t:copy_(m:state_dict()[name]) end) end
  local ungated = u:forward(x)
  -- σ(0) = ½ exactly, and the projection is linear: y_gated = ½ y_ungated up to rounding of one product
  T.near(max_abs_diff(gated * 2, ungated), 0, 1e-15, "W_G = 0 gives half")
end)

T.test("gradient check of the whole layer, two documents (f64, every input and parameter)", function()
  for _, q_rank in ipairs({ 12, false }) do
    tide.manual_seed(7)
    local m = layer({ q_rank = q_rank })
    local x = tide.randn({ 1, 9, 16 }, { dtype = "f64", requires_grad = true })
    local inputs = { x }
    for _, t in m:named_parameters() do inputs[#inputs + 1] = t end
    T.gradcheck(function() return m:forward(x, { cu_seqlens = { 0, 4, 9 } }) end, inputs,
      { atol = 1e-8, rtol = 1e-6, max_checks = 48 })
  end
end)

T.test("F.mla_attention and nn.MLA reject bad input with the reason", function()
  local q, kn, v = randn({ 1, 4, 2, 6 }), randn({ 1, 4, 2, 4 }), randn({ 1, 4, 2, 3 })
  T.raises(function() F.mla_attention(q, kn, nil, v) end, "k_r is NULL")
  T.raises(function() F.mla_attention(q, kn, randn({ 1, 4, 3 }), v) end, "need it [B, Tk, dr]")
  T.raises(function() F.mla_attention(q, kn, randn({ 1, 4, 2 }), v, { bogus = 1 }) end, "unknown key 'bogus'")
  T.raises(function() F.mla_attention(q, kn, randn({ 1, 4, 2 }), v, { cu_seqlens = { 0, 3, 5 } }) end, "end at B·T")
  T.raises(function() nn.MLA(16, { heads = 2, kv_rank = 8 }) end, "nope_dim must be a positive integer")
  T.raises(function() nn.MLA(16, { heads = 2, kv_rank = 8, nope_dim = 4, size = 3 }) end, "unknown key 'size'")
  local m = layer()
  T.raises(function() m:forward(randn({ 1, 3, 15 })) end, "x must be [B, T, 16]")
  T.raises(function() m:forward(randn({ 1, 3, 16 }), { cache = {}, cu_seqlens = { 0, 3 } }) end, "cannot be combined")
  T.raises(function() m:forward(randn({ 1, 3, 16 }), { cache = {}, absorbed = true }) end, "one token per row")
end)

-- the attention read from the latent: keys and values expanded chunk by chunk, never whole
local function expand(c, w, dn)
  local B, Tk, dc, H, E = c:size(1), c:size(2), c:size(3), w:size(1), w:size(2)
  local kn = F.linear(c, w:narrow(2, 1, dn):contiguous():reshape(H * dn, dc)):reshape(B, Tk, H, dn)
  local v = F.linear(c, w:narrow(2, dn + 1, E - dn):contiguous():reshape(H * (E - dn), dc)):reshape(B, Tk, H, E - dn)
  return kn, v
end

T.test("F.mla_latent_attention == F.mla_attention of the expanded keys and values, forward and gradients (f64 1e-13, f32 1e-5)", function()
  for _, dt in ipairs({ "f64", "f32" }) do
    tide.manual_seed(11)
    local B, Tq, Tk, H, dn, dr, dv, dc = 2, 6, 11, 3, 4, 2, 5, 7
    local function rn(shape) return tide.randn(shape, { dtype = dt }) end
    local q, c, kr, w = rn({ B, Tq, H, dn + dr }), rn({ B, Tk, dc }), rn({ B, Tk, dr }), rn({ H, dn + dv, dc })
    local r = rn({ B, Tq, H, dv })
    local cu = { 0, 4, 11, 12, 22 }        -- a document starts inside the queries, and one row is 2 documents
    local function grads(fn)
      local x = { q:clone():requires_grad_(), c:clone():requires_grad_(), kr:clone():requires_grad_(), w:clone():requires_grad_() }
      local o = fn(x[1], x[2], x[3], x[4])
      ;(o * r):sum():backward()
      return o, { x[1]:grad(), x[2]:grad(), x[3]:grad(), x[4]:grad() }
    end
    local o_ref, g_ref = grads(function(a, b, k, ww)
      local kn, v = expand(b, ww, dn)
      return F.mla_attention(a, kn, k, v, { cu_seqlens = cu, scale = 0.37 })
    end)
    local tol = dt == "f64" and 1e-13 or 1e-5
    for _, chunk in ipairs({ 1, 3, 4, 11, 64 }) do
      local o, g = grads(function(a, b, k, ww)
        return F.mla_latent_attention(a, b, k, ww, { cu_seqlens = cu, scale = 0.37, chunk = chunk })
      end)
      T.ok(max_abs_diff(o, o_ref) <= tol * max_abs(o_ref), string.format("%s chunk %d: output", dt, chunk))
      for i, name in ipairs({ "q", "c", "k_r", "w" }) do
        T.ok(max_abs_diff(g[i], g_ref[i]) <= tol * max_abs(g_ref[i]),
          string.format("%s chunk %d: gradient of %s off by %.3g", dt, chunk, name, max_abs_diff(g[i], g_ref[i])))
      end
    end
  end
end)

T.test("F.mla_latent_attention holds one chunk of the expansion, never the whole (engine peak, forward + backward)", function()
  -- a CP-like slice: 512 queries against 8192 keys, H·(dn + dv) = 512 values per key against a latent of 16
  local B, Tq, Tk, H, dn, dr, dv, dc = 1, 512, 8192, 8, 32, 8, 32, 16
  tide.manual_seed(2)
  local q, c, kr = tide.randn({ B, Tq, H, dn + dr }), tide.randn({ B, Tk, dc }), tide.randn({ B, Tk, dr })
  local w = tide.randn({ H, dn + dv, dc }, { std = 0.2 })
  local expansion = B * Tk * H * (dn + dv) * 4
  local function peak(fn)
    local x = { q:clone():requires_grad_(), c:clone():requires_grad_(), kr:clone():requires_grad_(), w:clone():requires_grad_() }
    tide.collect()
    local base = tide.memory().current
    tide.reset_peak()
    fn(x[1], x[2], x[3], x[4]):sum():backward()
    local p = tide.memory().peak - base
    return p
  end
  local p_exp = peak(function(a, b, k, ww)
    local kn, v = expand(b, ww, dn)
    return F.mla_attention(a, kn, k, v)
  end)
  local p_lat = peak(function(a, b, k, ww) return F.mla_latent_attention(a, b, k, ww, { chunk = 512 }) end)
  if os.getenv("TIDE_TEST_VERBOSE") then print(string.format("    peaks: expanded %.2f MB, latent %.2f MB, one expansion %.2f MB", p_exp / 2 ^ 20, p_lat / 2 ^ 20, expansion / 2 ^ 20)) end
  -- the expanded path holds the keys and values and, in its backward, their gradients: two expansions
  T.ok(p_exp >= 1.5 * expansion, string.format("the expanded path's peak %.1f MB holds its expansion (%.1f MB)", p_exp / 2 ^ 20, expansion / 2 ^ 20))
  T.ok(p_lat <= p_exp - 1.5 * expansion, string.format("the latent path's peak %.1f MB against the expanded path's %.1f MB (an expansion: %.1f MB)",
    p_lat / 2 ^ 20, p_exp / 2 ^ 20, expansion / 2 ^ 20))
  T.ok(p_lat <= expansion / 2, string.format("the latent path's peak %.1f MB is below half an expansion (%.1f MB)", p_lat / 2 ^ 20, expansion / 2 ^ 20))
end)

T.test("F.mla_latent_attention rejects bad input with the reason", function()
  local q, c, kr, w = randn({ 1, 4, 2, 6 }), randn({ 1, 5, 3 }), randn({ 1, 5, 2 }), randn({ 2, 7, 3 })
  T.raises(function() F.mla_latent_attention(q, c, kr, randn({ 2, 7, 4 })) end, "must be [B, Tq, H, dn + dr], [B, Tk, dc], [H, dn + dv, dc]")
  T.raises(function() F.mla_latent_attention(q, c, randn({ 1, 4, 2 }), w) end, "needs it [B, Tk, dr]")
  T.raises(function() F.mla_latent_attention(randn({ 1, 6, 2, 6 }), c, kr, w) end, "needs Tq <= Tk")
  T.raises(function() F.mla_latent_attention(q, c, kr, w, { chunk = 0 }) end, "chunk must be at least 1")
  T.raises(function() F.mla_latent_attention(q, c, kr, w, { chunk = 2.5 }) end, "whole number")
  T.raises(function() F.mla_latent_attention(q, c, kr, w, { bogus = 1 }) end, "unknown key 'bogus'")
end)

T.run()
