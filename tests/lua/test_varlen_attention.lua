-- varlen_attention: F.varlen_attention over packed images (spec/vision.md §3, §5, oracles 3 and 8): a Lua list and
-- an int tensor as cu_seqlens agree bitwise, the default scale is D^-1/2, packed images equal separate runs (f64
-- 1e-12) and do not see each other, the float64 gradient check, and errors.
local T = require "tide.testing"
local tide = require "tide"
local F = tide.F

local max_abs_diff = T.max_abs_diff

local function randn(shape, rg) return tide.randn(shape, { dtype = "f64", requires_grad = rg }) end

T.test("cu_seqlens as a list or an int tensor; default scale D^-1/2", function()
  tide.manual_seed(1)
  local q, k, v = randn({ 12, 2, 4 }), randn({ 12, 2, 4 }), randn({ 12, 2, 4 })
  local a = F.varlen_attention(q, k, v, { cu_seqlens = { 0, 5, 6, 12 } })
  local b = F.varlen_attention(q, k, v, { cu_seqlens = tide.from_table({ 0, 5, 6, 12 }, { dtype = "i32" }), scale = 0.5 })
  T.eq(a:tolist(), b:tolist(), "list + default scale == i32 tensor + scale 4^-1/2")
  T.eq(a:shape(), { 12, 2, 4 })
end)

T.test("packed images == separate runs (f64 1e-12); an image never sees another", function()
  tide.manual_seed(2)
  local A, B = { randn({ 5, 2, 4 }), randn({ 5, 2, 4 }), randn({ 5, 2, 4 }) }, { randn({ 9, 2, 4 }), randn({ 9, 2, 4 }), randn({ 9, 2, 4 }) }
  local packed = F.varlen_attention(F.concat({ A[1], B[1] }, 1), F.concat({ A[2], B[2] }, 1), F.concat({ A[3], B[3] }, 1),
                                    { cu_seqlens = { 0, 5, 14 } })
  local a = F.varlen_attention(A[1], A[2], A[3], { cu_seqlens = { 0, 5 } })
  local b = F.varlen_attention(B[1], B[2], B[3], { cu_seqlens = { 0, 9 } })
  T.near(max_abs_diff(packed:narrow(1, 1, 5), a), 0, 1e-12, "image A")
  T.near(max_abs_diff(packed:narrow(1, 6, 9), b), 0, 1e-12, "image B")
  -- bidirectional: the first token of B sees B's last token
  local B2 = B[2]:clone()
  tide.no_grad(function() B2:narrow(1, 9, 1):scale_(-2) end)
  local b2 = F.varlen_attention(B[1], B2, B[3], { cu_seqlens = { 0, 9 } })
  T.ok(max_abs_diff(b2:narrow(1, 1, 1), b:narrow(1, 1, 1)) > 1e-6, "token 1 must see token 9 (not causal)")
end)

T.test("gradient check of q, k, v (f64, three images, one of length 1)", function()
  tide.manual_seed(3)
  local q, k, v = randn({ 8, 2, 3 }, true), randn({ 8, 2, 3 }, true), randn({ 8, 2, 3 }, true)
  T.gradcheck(function() return F.varlen_attention(q, k, v, { cu_seqlens = { 0, 3, 4, 8 }, scale = 0.6 }) end,
    { q, k, v }, { atol = 1e-8, rtol = 1e-6 })
end)

T.test("F.varlen_attention rejects bad input with the reason", function()
  local q, k, v = randn({ 6, 2, 4 }), randn({ 6, 2, 4 }), randn({ 6, 2, 4 })
  T.raises(function() F.varlen_attention(q, k, v) end, "cu_seqlens is required")
  T.raises(function() F.varlen_attention(q, k, v, { cu_seqlens = { 0, 4, 2, 6 } }) end, "decreases at index 2")
  T.raises(function() F.varlen_attention(q, k, v, { cu_seqlens = { 0, 4, 7 } }) end, "needs 0 to T = 6")
  T.raises(function() F.varlen_attention(q, randn({ 5, 2, 4 }), v, { cu_seqlens = { 0, 6 } }) end, "must all be [T, H, D]")
  T.raises(function() F.varlen_attention(q, k, v, { cu_seqlens = { 0, 6 }, scale = 1 / 0 }) end, "scale must be finite")
  T.raises(function() F.varlen_attention(q, k, v, { cu_seqlens = { 0, 6 }, bogus = 1 }) end, "unknown key 'bogus'")
end)
