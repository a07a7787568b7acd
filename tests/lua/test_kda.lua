-- kda: the Lua side of Kimi Delta Attention (spec/kda.md) — the F.kda / F.kda_gate / F.causal_conv1d /
-- F.l2norm wrappers against the recurrence and plain-Lua references, nn.KDA (names, init, decay groups,
-- whole-layer gradient check, decode == prefill, split == one pass, packing and leaks, extreme gates,
-- errors), and a KDA-only language model (decode == full forward, training, greedy generation).
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F
local optim = require "tide.optim"

local max_abs_diff, max_abs = T.max_abs_diff, T.max_abs

local function randn(shape, dtype) return tide.randn(shape, { dtype = dtype or "f64" }) end

-- kernel inputs: q, k L2-normalised (q scaled), g from the bounded gate, β ∈ (0, 1)
local function kda_inputs(B, Tn, H, dk, dv)
  local q = F.l2norm(randn({ B, Tn, H, dk }), { scale = 1 / math.sqrt(dk) })
  local k = F.l2norm(randn({ B, Tn, H, dk }))
  local v = randn({ B, Tn, H, dv })
  local g = F.kda_gate(randn({ B, Tn, H, dk }), randn({ H }) * 0.5, randn({ H * dk }), { gate_lower_bound = -5 })
  local beta = randn({ B, Tn, H }):sigmoid()
  local s0 = randn({ B, H, dk, dv }) * 0.5
  return q, k, v, g, beta, s0
end

-- ---- functional wrappers -----------------------------------------------------------------------------------

T.test("F.kda: chunk and chunk_safe == recurrent with s0 and packed documents (f64 1e-12, f32 1e-5)", function()
  tide.manual_seed(1)
  local B, Tn, H, dk, dv = 2, 37, 2, 5, 4
  local q, k, v, g, beta, s0 = kda_inputs(B, Tn, H, dk, dv)
  local cu = { 0, 10, 37, 50, 74 }    -- a boundary inside each row; 37 is the start of row 2
  local ro, rs = F.kda(q, k, v, g, beta, { s0 = s0, cu_seqlens = cu, path = "recurrent" })
  T.ok(max_abs(ro) > 0.05, "a non-trivial output")
  for _, c in ipairs({ 1, 4, 16 }) do
    local o, s = F.kda(q, k, v, g, beta, { s0 = s0, cu_seqlens = cu, chunk = c })
    T.ok(max_abs_diff(o, ro) <= 1e-12, "chunk " .. c .. " o differs by " .. max_abs_diff(o, ro))
    T.ok(max_abs_diff(s, rs) <= 1e-12, "chunk " .. c .. " state differs by " .. max_abs_diff(s, rs))
  end
  local o, s = F.kda(q, k, v, g, beta, { s0 = s0, cu_seqlens = tide.tensor(cu, { dtype = "i32" }), path = "chunk_safe", chunk = 8 })
  T.ok(max_abs_diff(o, ro) <= 1e-12 and max_abs_diff(s, rs) <= 1e-12, "chunk_safe with an i32 cu_seqlens tensor")
  -- f32 chunk path against the f64 recurrence: T.near is absolute below 1, relative above
  local function f(x) return x:to("f32") end
  local o32, s32 = F.kda(f(q), f(k), f(v), f(g), f(beta), { s0 = f(s0), cu_seqlens = cu })
  T.eq(o32:dtype(), "f32")
  T.near(o32, ro, 1e-5)
  T.near(s32, rs, 1e-5)
end)

T.test("F.kda_decode_rows: R rows over their own states == each row's recurrent step alone, bitwise, in place", function()
  tide.manual_seed(4)
  local R, H, dk, dv = 5, 3, 16, 8
  for _, dt in ipairs({ "f64", "f32" }) do
    local q, k, v, g, beta, s0 = kda_inputs(R, 1, H, dk, dv)
    local function c(x) return x:to(dt) end
    q, k, v, g, beta, s0 = c(q), c(k), c(v), c(g), c(beta), c(s0)
    -- each row's own state: separate tensors, one of them a view into a larger buffer
    local states, want_o, want_s = {}, {}, {}
    local big = tide.zeros({ 2, H, dk, dv }, { dtype = dt })
    for r = 1, R do
      local sr = s0:narrow(1, r, 1)
      if r == 3 then states[r] = big:narrow(1, 2, 1); states[r]:copy_(sr) else states[r] = sr:clone() end
      local o1, st1 = F.kda(q:narrow(1, r, 1), k:narrow(1, r, 1), v:narrow(1, r, 1), g:narrow(1, r, 1),
        beta:narrow(1, r, 1), { s0 = sr:contiguous(), path = "recurrent" })
      want_o[r], want_s[r] = o1:tolist(), st1:tolist()
    end
    for _, nt in ipairs({ 1, 2 }) do
      local threads = tide.num_threads()
      tide.set_num_threads(nt)
      local st = {}
      for r = 1, R do st[r] = states[r]:clone() end
      local o = F.kda_decode_rows(q:reshape(R, H, dk), k:reshape(R, H, dk), v:reshape(R, H, dv), g:reshape(R, H, dk),
        beta:reshape(R, H), st)
      tide.set_num_threads(threads)
      T.eq(o:shape(), { R, H, dv })
      for r = 1, R do
        T.eq(o:narrow(1, r, 1):tolist(), want_o[r], dt .. " row " .. r .. " output bitwise")
        T.eq(st[r]:tolist(), want_s[r], dt .. " row " .. r .. " state advanced in place, bitwise")
      end
    end
    F.kda_decode_rows(q:reshape(R, H, dk), k:reshape(R, H, dk), v:reshape(R, H, dv), g:reshape(R, H, dk),
      beta:reshape(R, H), states)
    T.eq(states[3]:tolist(), want_s[3], "a view into a larger buffer is written in place")
    T.eq(big:narrow(1, 1, 1):abs():max():item(), 0, "the rest of that buffer is untouched")
  end
  -- errors name the problem
  local q, k, v, g, beta, s0 = kda_inputs(2, 1, 2, 4, 4)
  local function args(t) return q:reshape(2, 2, 4), k:reshape(2, 2, 4), v:reshape(2, 2, 4), g:reshape(2, 2, 4), beta:reshape(2, 2), t end
  local a = s0:narrow(1, 1, 1):clone()
  T.raises(function() F.kda_decode_rows(args({ a, a })) end, "states[0] and states[1] are the same memory")
  T.raises(function() F.kda_decode_rows(args({ a })) end, "must be [R, H, dk] x3")
  T.raises(function() F.kda_decode_rows(args({ a, tide.zeros({ 1, 2, 4, 3 }, { dtype = "f64" }) })) end,
    "states[1] is [1, 2, 4, 3] but must be")
  T.raises(function() F.kda_decode_rows(args({ a, tide.zeros({ 1, 2, 4, 4 }) })) end, "the state of f64 inputs is f64")
  T.raises(function() F.kda_decode_rows(args({ a, tide.zeros({ 1, 2, 4, 8 }, { dtype = "f64" }):narrow(4, 1, 4) })) end,
    "must be contiguous")
  T.raises(function() F.kda_decode_rows(args({})) end, "states must be a non-empty list")
end)

T.test("F.conv_decode_rows: R rows over their own histories == F.causal_conv1d of each row's token alone, bitwise, in place", function()
  tide.manual_seed(6)
  local R, Cc, K = 6, 40, 4
  for _, dt in ipairs({ "f64", "f32" }) do
    local x = randn({ R, 1, Cc }):to(dt)
    local w = randn({ Cc, 1, K }):to(dt)
    local hist = randn({ R, K - 1, Cc }):to(dt)
    for _, silu in ipairs({ true, false }) do
      local want_y, want_h = {}, {}
      for r = 1, R do
        local xr, hr = x:narrow(1, r, 1), hist:narrow(1, r, 1)
        want_y[r] = F.causal_conv1d(xr, w, { cache = hr, silu = silu }):tolist()
        want_h[r] = F.concat({ hr, xr }, 2):narrow(2, 2, K - 1):tolist()   -- the row's last K - 1 inputs
      end
      for _, nt in ipairs({ 1, 2 }) do
        local threads = tide.num_threads()
        tide.set_num_threads(nt)
        -- each row's own history: separate tensors, one of them a view into a larger buffer
        local big = tide.zeros({ 2, K - 1, Cc }, { dtype = dt })
        local hs = {}
        for r = 1, R do
          if r == 2 then hs[r] = big:narrow(1, 2, 1); hs[r]:copy_(hist:narrow(1, r, 1)) else hs[r] = hist:narrow(1, r, 1):clone() end
        end
        local y = F.conv_decode_rows(x, w, hs, { silu = silu })
        tide.set_num_threads(threads)
        T.eq(y:shape(), { R, 1, Cc })
        for r = 1, R do
          T.eq(y:narrow(1, r, 1):tolist(), want_y[r], dt .. " row " .. r .. " output bitwise")
          T.eq(hs[r]:tolist(), want_h[r], dt .. " row " .. r .. " history shifted in place")
        end
        T.eq(big:narrow(1, 1, 1):abs():max():item(), 0, "the rest of that buffer is untouched")
        -- the rows in another order and a subset of them: each row's bits are its own
        local sub = { hist:narrow(1, 5, 1):clone(), hist:narrow(1, 1, 1):clone() }
        local ys = F.conv_decode_rows(F.concat({ x:narrow(1, 5, 1), x:narrow(1, 1, 1) }, 1), w, sub, { silu = silu })
        T.eq(ys:narrow(1, 1, 1):tolist(), want_y[5], "a row's output does not depend on the batch")
        T.eq(ys:narrow(1, 2, 1):tolist(), want_y[1], "a row's output does not depend on the batch")
      end
    end
  end
  -- errors name the problem
  local x, w = randn({ 2, 1, 3 }), randn({ 3, 4 })
  local a = randn({ 1, 3, 3 })
  T.raises(function() F.conv_decode_rows(x, w, { a, a }) end, "caches[0] and caches[1] are the same memory")
  T.raises(function() F.conv_decode_rows(x, w, { a }) end, "x is [2, 1, 3] but must be [R, C] or [R, 1, C] with R = 1")
  T.raises(function() F.conv_decode_rows(x, w, { a, randn({ 1, 2, 3 }) }) end, "caches[1] is [1, 2, 3] but must be")
  T.raises(function() F.conv_decode_rows(x, w, { a, tide.zeros({ 1, 3, 3 }) }) end, "f32")
  T.raises(function() F.conv_decode_rows(x, w, { a, randn({ 1, 3, 6 }):narrow(3, 1, 3) }) end, "must be contiguous")
  T.raises(function() F.conv_decode_rows(x, randn({ 4, 4 }), { a, a:clone() }) end, "w is [4, 4] but must be [C, K] with C = 3")
  T.raises(function() F.conv_decode_rows(x, w, {}) end, "caches must be a non-empty list")
  T.raises(function() F.conv_decode_rows(x, w, { a, a:clone() }, { silu = "yes" }) end, "silu must be a boolean")
end)

T.test("F.kda_gate, F.causal_conv1d and F.l2norm equal plain-Lua references (f64 1e-14)", function()
  tide.manual_seed(2)
  local H, D = 2, 3
  local z, A, dt = randn({ 2, H, D }), randn({ H }), randn({ H * D })
  local zs, As, dts = z:tolist(), A:tolist(), dt:tolist()
  local function sig(u) return 1 / (1 + math.exp(-u)) end
  local function softplus(u) return math.log(1 + math.exp(u)) end
  local bounded, soft = {}, {}
  for n = 0, 1 do
    for h = 0, H - 1 do
      for c = 0, D - 1 do
        local i = n * H * D + h * D + c + 1
        local w = zs[i] + dts[h * D + c + 1]
        bounded[i] = -3 * sig(math.exp(As[h + 1]) * w)
        soft[i] = -math.exp(As[h + 1]) * softplus(w)
      end
    end
  end
  T.near(F.kda_gate(z, A, dt, { gate_lower_bound = -3 }):tolist(), bounded, 1e-14)
  T.near(F.kda_gate(z, A, dt:reshape(H, D), { gate_form = "softplus" }):tolist(), soft, 1e-14)

  -- conv: x [B=2, T=6, C=3], K = 3, cache, a document boundary at flattened 4 (row 1, t = 4)
  local B, Tn, Cc, K = 2, 6, 3, 3
  local x, w, cache = randn({ B, Tn, Cc }), randn({ Cc, 1, K }), randn({ B, K - 1, Cc })
  local xs, ws, cs = x:tolist(), w:tolist(), cache:tolist()
  local function ref(silu, with_cache, cu_start)
    local out = {}
    for b = 0, B - 1 do
      for t = 0, Tn - 1 do
        -- start of t's document in this row (row starts are boundaries)
        local doc = 0
        if cu_start and b == 0 and t >= cu_start then doc = cu_start end
        for c = 0, Cc - 1 do
          local y = 0
          for j = 0, K - 1 do
            local s = t - K + 1 + j
            local val = 0
            if s >= doc then val = xs[b * Tn * Cc + s * Cc + c + 1]
            elseif doc == 0 and with_cache then val = cs[b * (K - 1) * Cc + (s + K - 1) * Cc + c + 1] end
            y = y + ws[c * K + j + 1] * val
          end
          if silu then y = y / (1 + math.exp(-y)) end
          out[#out + 1] = y
        end
      end
    end
    return out
  end
  T.near(F.causal_conv1d(x, w):tolist(), ref(false, false), 1e-14)
  T.near(F.causal_conv1d(x, w:reshape(Cc, K), { cache = cache, silu = true }):tolist(), ref(true, true), 1e-14)
  T.near(F.causal_conv1d(x, w, { cache = cache, cu_seqlens = { 0, 4, 12 } }):tolist(), ref(false, true, 4), 1e-14)

  local y = randn({ 2, 5 })
  local ys, want = y:tolist(), {}
  for r = 0, 1 do
    local ss = 0
    for i = 1, 5 do ss = ss + ys[r * 5 + i] ^ 2 end
    for i = 1, 5 do want[r * 5 + i] = 0.7 * ys[r * 5 + i] / math.sqrt(ss + 1e-6) end
  end
  T.near(F.l2norm(y, { scale = 0.7 }):tolist(), want, 1e-14)
end)

T.test("F wrappers: bad options are Lua errors carrying the C message and the caller's line", function()
  tide.manual_seed(3)
  local q, k, v, g, beta = kda_inputs(1, 5, 1, 3, 2)
  local e = T.raises(function() F.kda(q, k, v, g, beta, { path = "chunked" }) end,
    'kda: path must be "chunk", "chunk_safe" or "recurrent", got "chunked"')
  T.ok(e:find("test_kda.lua:", 1, true), "location: " .. e)
  T.raises(function() F.kda(q, k, v, g, beta, { lowerbound = -3 }) end, "kda: unknown key 'lowerbound'")
  T.raises(function() F.kda(q, k, v, g, beta, { chunk = 2.5 }) end, "kda: chunk must be an integer, got 2.5")
  -- from the engine: the message names the op and the values
  e = T.raises(function() F.kda(q, k, v, g, beta, { s0 = randn({ 1, 1, 2, 2 }) }) end, "kda: s0 is [1, 1, 2, 2] but must be [B, H, dk, dv] = [1, 1, 3, 2]")
  T.ok(e:find("test_kda.lua:", 1, true), "location: " .. e)
  T.raises(function() F.kda(q, k, v, g * 3, beta, { chunk = 16 }) end, "is outside [-5, 0]")
  T.raises(function() F.kda(q, k, v, g, beta, { cu_seqlens = { 0, 3, 2, 5 } }) end, "cu_seqlens must be strictly increasing")
  T.raises(function() F.kda_gate(g, randn({ 1 }), randn({ 3 }), { gate_form = "sigmoid" }) end,
    'kda_gate: gate_form must be "bounded" or "softplus", got "sigmoid"')
  T.raises(function() F.kda_gate(g, randn({ 2 }), randn({ 3 })) end, "kda_gate: z [1, 5, 1, 3], A_log [2], dt_bias [3]")
  T.raises(function() F.causal_conv1d(v:reshape(1, 5, 2), randn({ 2, 2, 4 })) end, "a 3-d w must be [C, 1, K], got [2, 2, 4]")
  T.raises(function() F.causal_conv1d(v:reshape(1, 5, 2), randn({ 2, 4 }), { silu = "yes" }) end, "silu must be a boolean")
  T.raises(function() F.l2norm(q, { epsilon = 1 }) end, "l2norm: unknown key 'epsilon'")
end)

-- ---- nn.KDA --------------------------------------------------------------------------------------------------

local function small_layer(gate, dtype)
  return nn.KDA(8, { heads = 2, head_dim = 4, chunk = 4, gate_form = gate, dtype = dtype or "f64" })
end

-- random values in every parameter, so gradients and outputs exercise every path (init puts A_log at 0)
local function scramble(m)
  m.A_log:copy_(randn({ m.heads }) * 0.5)
  m.dt_bias:copy_(randn({ m.heads * m.head_dim }))
  m.o_norm.weight:copy_(randn({ m.head_dim }) * 0.3 + 1)
  for _, name in ipairs({ "q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj" }) do
    m[name].weight:scale_(20)   -- 0.02 -> 0.4: O(1) activations at d = 8
  end
end

-- the whole layer in plain Lua numbers, one sequence (B = 1): kda.md §1 steps 1-7 around the recurrence §3
local function reference_layer(m, xs, Tn)
  local d, H, dk, K = m.dim, m.heads, m.head_dim, m.conv_size
  local Cn = H * dk
  local P = {}
  for name, t in m:named_parameters() do P[name] = t:tolist() end
  local function sig(u) return 1 / (1 + math.exp(-u)) end
  local function lin(W, nout, nin, x)
    local y = {}
    for o = 0, nout - 1 do
      local acc = 0
      for i = 0, nin - 1 do acc = acc + W[o * nin + i + 1] * x[i + 1] end
      y[o + 1] = acc
    end
    return y
  end
  local rows = {}
  for t = 0, Tn - 1 do
    local x = {}
    for i = 1, d do x[i] = xs[t * d + i] end
    local r = { x = x }
    r.q, r.k, r.v = lin(P["q_proj.weight"], Cn, d, x), lin(P["k_proj.weight"], Cn, d, x), lin(P["v_proj.weight"], Cn, d, x)
    r.z = lin(P["f_b_proj.weight"], Cn, dk, lin(P["f_a_proj.weight"], dk, d, x))
    r.b = lin(P["b_proj.weight"], H, d, x)
    r.zeta = lin(P["g_proj.weight"], Cn, d, x)
    rows[t] = r
  end
  local function conv(name, t, c)
    local w, acc = P[name .. "_conv1d.weight"], 0
    for j = 0, K - 1 do
      local s = t - K + 1 + j
      if s >= 0 then acc = acc + w[c * K + j + 1] * rows[s][name][c + 1] end
    end
    return acc * sig(acc)
  end
  local out = {}
  local S = {}
  for h = 0, H - 1 do
    S[h] = {}
    for i = 0, dk * dk - 1 do S[h][i] = 0 end
  end
  for t = 0, Tn - 1 do
    local r = rows[t]
    local normed = {}
    for h = 0, H - 1 do
      local q, k, v, g = {}, {}, {}, {}
      local sq, sk = 0, 0
      for c = 0, dk - 1 do
        local ch = h * dk + c
        q[c], k[c], v[c] = conv("q", t, ch), conv("k", t, ch), conv("v", t, ch)
        sq, sk = sq + q[c] ^ 2, sk + k[c] ^ 2
        local w = r.z[ch + 1] + P.dt_bias[ch + 1]
        local a = math.exp(P.A_log[h + 1])
        if m.gate_form == "bounded" then g[c] = m.gate_lower_bound * sig(a * w) else g[c] = -a * math.log(1 + math.exp(w)) end
      end
      for c = 0, dk - 1 do
        q[c] = q[c] / math.sqrt(sq + 1e-6) / math.sqrt(dk)
        k[c] = k[c] / math.sqrt(sk + 1e-6)
      end
      local beta, Sh = sig(r.b[h + 1]), S[h]
      for i = 0, dk - 1 do
        local a = math.exp(g[i])
        for j = 0, dk - 1 do Sh[i * dk + j] = a * Sh[i * dk + j] end
      end
      local u = {}
      for j = 0, dk - 1 do
        local sk_ = 0
        for i = 0, dk - 1 do sk_ = sk_ + Sh[i * dk + j] * k[i] end
        u[j] = beta * (v[j] - sk_)
      end
      for i = 0, dk - 1 do
        for j = 0, dk - 1 do Sh[i * dk + j] = Sh[i * dk + j] + k[i] * u[j] end
      end
      local o, ms = {}, 0
      for j = 0, dk - 1 do
        local acc = 0
        for i = 0, dk - 1 do acc = acc + Sh[i * dk + j] * q[i] end
        o[j] = acc
        ms = ms + acc * acc / dk
      end
      for j = 0, dk - 1 do
        normed[h * dk + j + 1] = o[j] / math.sqrt(ms + m.norm_eps) * P["o_norm.weight"][j + 1] * sig(r.zeta[h * dk + j + 1])
      end
    end
    local y = lin(P["o_proj.weight"], d, Cn, normed)
    for i = 1, d do out[#out + 1] = y[i] end
  end
  return out
end

T.test("nn.KDA equals a plain-Lua implementation of kda.md §1 and §3 (f64 1e-12), both gates", function()
  for _, gate in ipairs({ "bounded", "softplus" }) do
    tide.manual_seed(16)
    local m = small_layer(gate)
    scramble(m)
    local x = randn({ 1, 11, 8 })
    local want = reference_layer(m, x:tolist(), 11)
    local got = m:forward(x):tolist()
    local worst = 0
    for i = 1, #want do worst = math.max(worst, math.abs(got[i] - want[i])) end
    T.ok(worst <= 1e-12, gate .. ": differs from the reference by " .. worst)
    T.ok(max_abs(m:forward(x)) > 0.1, "a non-trivial output")
  end
end)

T.test("nn.KDA: checkpoint names and shapes (formats.md §2); tiny layer has 100,290 parameters", function()
  tide.manual_seed(4)
  local m = nn.KDA(128, { heads = 2, head_dim = 64 })
  local shapes = {}
  for name, t in m:named_parameters() do shapes[name] = t:shape() end
  T.eq(shapes, {
    ["q_proj.weight"] = { 128, 128 }, ["k_proj.weight"] = { 128, 128 }, ["v_proj.weight"] = { 128, 128 },
    ["g_proj.weight"] = { 128, 128 }, ["o_proj.weight"] = { 128, 128 }, ["q_conv1d.weight"] = { 128, 1, 4 },
    ["k_conv1d.weight"] = { 128, 1, 4 }, ["v_conv1d.weight"] = { 128, 1, 4 }, ["f_a_proj.weight"] = { 64, 128 },
    ["f_b_proj.weight"] = { 128, 64 }, ["b_proj.weight"] = { 2, 128 }, A_log = { 2 }, dt_bias = { 128 },
    ["o_norm.weight"] = { 64 },
  })
  T.eq(m:num_parameters(), 100290)   -- spec/README.md test oracle 1: the tiny KDA layer
  -- inside the LM the layer sits under self_attn
  local lm = nn.TransformerLM({ vocab_size = 320, dim = 16, n_layers = 1, n_heads = 2, mixer = "kda" })
  T.ok(lm:state_dict()["model.layers.0.self_attn.A_log"] ~= nil)
  T.ok(lm:state_dict()["model.layers.0.self_attn.q_conv1d.weight"] ~= nil)
end)

T.test("nn.KDA init: A_log 0, softplus(dt_bias) log-uniform in [1e-3, 1e-1], taps U(-0.5, 0.5), out_std", function()
  tide.manual_seed(5)
  local m = nn.KDA(256, { heads = 4, head_dim = 64, out_std = 0.005 })
  T.eq(max_abs(m.A_log), 0)
  local ldt, n = {}, 256
  for i, b in ipairs(m.dt_bias:to("f64"):tolist()) do
    local dt = math.log(1 + math.exp(b))
    T.ok(dt >= 1e-3 * (1 - 1e-5) and dt <= 1e-1 * (1 + 1e-5), "dt " .. dt .. " outside [1e-3, 1e-1]")
    ldt[i] = math.log(dt)
  end
  local mean = 0
  for _, v in ipairs(ldt) do mean = mean + v / n end
  -- ln dt ~ U(ln 1e-3, ln 1e-1): mean -4.605, sd 1.329; s.e. of the mean over 256 = 0.083, bound 4 s.e.
  T.near(mean, (math.log(1e-3) + math.log(1e-1)) / 2, 0.34)
  for _, name in ipairs({ "q_conv1d", "k_conv1d", "v_conv1d" }) do
    local w = m[name].weight
    T.ok(max_abs(w) <= 0.5, name .. " taps within [-0.5, 0.5]")
    -- variance of U(-0.5, 0.5) = 1/12; 1,024 taps: s.e. of the variance ≈ 0.0024, bound 4 s.e.
    T.near(w:sum_squares() / w:numel(), 1 / 12, 0.01)
  end
  local function std(t) return math.sqrt(t:sum_squares() / t:numel()) end
  T.near(std(m.q_proj.weight), 0.02, 0.02 * 0.03)                -- 65,536 samples
  T.near(std(m.f_a_proj.weight), 0.02, 0.02 * 0.05)
  T.near(std(m.o_proj.weight), 0.005, 0.005 * 0.03)
  T.eq(m.o_norm.weight:sum():item(), 64)
end)

T.test("decay groups: A_log, dt_bias and the conv taps get no weight decay (optim.md §1)", function()
  tide.manual_seed(6)
  local m = nn.KDA(8, { heads = 2, head_dim = 4, dtype = "f64" })
  local opt = optim.AdamW(m, { lr = 0.05, weight_decay = 0.2 })
  local decay, no_decay = opt:group_names()
  T.eq(decay, { "q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "o_proj.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight" })
  T.eq(no_decay, { "A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight" })
  -- with g = 0 the decay group scales by (1 - lr·wd) and the rest stays bitwise (optim.md oracle 1)
  local before = {}
  for name, t in m:named_parameters() do
    before[name] = t:tolist()
    t:set_grad(tide.zeros_like(t))
  end
  opt:step()
  for name, t in m:named_parameters() do
    if name:find("conv1d") or name == "A_log" or name == "dt_bias" or name == "o_norm.weight" then
      T.eq(t:tolist(), before[name], name)
    else
      local want = {}
      for i, x in ipairs(before[name]) do want[i] = x * (1 - 0.05 * 0.2) end
      T.near(t:tolist(), want, 1e-15, name)
    end
  end
end)

T.test("gradient check of the whole layer w.r.t. x and every parameter, bounded and softplus (f64)", function()
  for _, gate in ipairs({ "bounded", "softplus" }) do
    tide.manual_seed(7)
    local m = small_layer(gate)
    scramble(m)
    local x = tide.randn({ 2, 7, 8 }, { dtype = "f64", requires_grad = true })
    local inputs = { x }
    for _, t in m:named_parameters() do inputs[#inputs + 1] = t end
    T.eq(#inputs, 15)
    -- central differences with h = 1e-6 in f64: truncation ~h²·f''' and rounding ~1e-16/h; an element
    -- passes when |analytic - numeric| <= 1e-8 + 1e-6·|numeric|
    T.gradcheck(function() return m:forward(x) end, inputs, { atol = 1e-8, rtol = 1e-6, max_checks = 64 })
  end
end)

T.test("prefill(T) + step(1) == forward(T + 1) (f64 1e-12), bounded and softplus", function()
  for _, gate in ipairs({ "bounded", "softplus" }) do
    tide.manual_seed(8)
    local m = small_layer(gate)
    scramble(m)
    local x = randn({ 2, 10, 8 })
    local full = m:forward(x)
    tide.no_grad(function()
      local cache = {}
      local pre = m:prefill(x:narrow(2, 1, 9), cache)
      T.ok(max_abs_diff(pre, full:narrow(2, 1, 9)) <= 1e-12, gate .. " prefill")
      T.eq(cache.state:shape(), { 2, 2, 4, 4 })
      T.eq(cache.conv.q:shape(), { 2, 3, 8 })
      T.eq(cache.pos, 9)
      local d = max_abs_diff(m:step(x:narrow(2, 10, 1), cache), full:narrow(2, 10, 1))
      T.ok(d <= 1e-12, gate .. " step differs by " .. d)
      -- decoding token by token from an empty cache
      local c2 = {}
      for t = 1, 10 do
        d = max_abs_diff(m:step(x:narrow(2, t, 1), c2), full:narrow(2, t, 1))
        T.ok(d <= 1e-12, gate .. " token " .. t .. " differs by " .. d)
      end
      T.ok(max_abs_diff(c2.state, cache.state) <= 1e-12, "state after 10 steps == after prefill 9 + step 1")
    end)
  end
end)

-- loss of a run over segments with the cache carried; returns the concatenated output
local function run_segments(m, x, sizes, cu_rows, recompute)
  local cache, outs, start = {}, {}, 1
  for _, n in ipairs(sizes) do
    local seg = x:narrow(2, start, n)
    local cu, reset
    if cu_rows then
      -- the boundaries of each row inside (start, start + n), shifted to the segment, flattened over B·n;
      -- a boundary exactly at the segment start resets that row's carried cache
      cu, reset = { 0 }, {}
      for b, row in ipairs(cu_rows) do
        reset[b] = false
        for _, c in ipairs(row) do
          if c > start - 1 and c < start - 1 + n then cu[#cu + 1] = (b - 1) * n + c - (start - 1) end
          if c == start - 1 then reset[b] = true end
        end
        if b < #cu_rows then cu[#cu + 1] = b * n end
      end
      cu[#cu + 1] = #cu_rows * n
    end
    local function fwd() return m:forward(seg, { cache = cache, cu_seqlens = cu, reset = reset }) end
    outs[#outs + 1] = recompute and tide.recompute(fwd) or fwd()
    start = start + n
  end
  return F.concat(outs, 2)
end

local function grads_of(m)
  local g = {}
  for name, t in m:named_parameters() do g[name] = t:grad(); t:zero_grad() end
  return g
end

T.test("split at arbitrary points with the cache carried == one pass: outputs and gradients (f64)", function()
  tide.manual_seed(9)
  local m = small_layer("bounded")
  scramble(m)
  local x = randn({ 2, 23, 8 })
  local R = randn({ 2, 23, 8 })
  local one = m:forward(x)
  ;(one * R):sum():backward()
  local g1 = grads_of(m)
  for _, sizes in ipairs({ { 5, 1, 2, 9, 6 }, { 1, 1, 21 }, { 22, 1 } }) do
    local split = run_segments(m, x, sizes)
    local d = max_abs_diff(split, one)
    T.ok(d <= 1e-12, "split output differs by " .. d)
    ;(split * R):sum():backward()
    local g2 = grads_of(m)
    for name, g in pairs(g1) do
      -- gradients sum over tokens: scaled tolerance, relative to the largest entry
      local e = max_abs_diff(g2[name], g) / math.max(1, max_abs(g))
      T.ok(e <= 1e-12, name .. " gradient differs by " .. e)
    end
  end
  -- the same under recompute regions, one per segment (the long-context benchmark's pattern)
  local split = run_segments(m, x, { 8, 7, 8 }, nil, true)
  T.ok(max_abs_diff(split, one) <= 1e-12)
  ;(split * R):sum():backward()
  local g3 = grads_of(m)
  for name, g in pairs(g1) do
    T.ok(max_abs_diff(g3[name], g) / math.max(1, max_abs(g)) <= 1e-12, name .. " gradient under recompute")
  end
end)

T.test("packed documents split into segments with the cache carried == one packed pass (f64 1e-12)", function()
  tide.manual_seed(10)
  local m = small_layer("softplus")
  scramble(m)
  local x = randn({ 2, 20, 8 })
  -- row-relative document starts: row 1 has a boundary at 7, inside the last K-1 = 3 tokens of the first
  -- segment [0, 8) — the carried conv cache must be zero before it; row 2 at 12 and 13 (12 starts the third
  -- segment of {8, 4, 8}: that row resets while row 1 continues)
  local rows = { { 7, 15 }, { 12, 13 } }
  local cu = { 0, 7, 15, 20, 32, 33, 40 }
  local one = m:forward(x, { cu_seqlens = cu })
  local R = randn({ 2, 20, 8 })
  ;(one * R):sum():backward()
  local g1 = grads_of(m)
  for _, sizes in ipairs({ { 8, 4, 8 }, { 7, 6, 7 }, { 13, 1, 6 } }) do
    local split = run_segments(m, x, sizes, rows)
    local d = max_abs_diff(split, one)
    T.ok(d <= 1e-12, string.format("sizes {%s}: differs by %g", table.concat(sizes, ", "), d))
    ;(split * R):sum():backward()
    local g2 = grads_of(m)
    for name, g in pairs(g1) do
      T.ok(max_abs_diff(g2[name], g) / math.max(1, max_abs(g)) <= 1e-12, name .. " gradient")
    end
  end
end)

T.test("packed documents == separate runs (f64 1e-12); the conv reset and the state reset each matter", function()
  tide.manual_seed(11)
  local m = small_layer("bounded")
  scramble(m)
  local lens = { 6, 9, 5 }
  local docs = {}
  for i, n in ipairs(lens) do docs[i] = randn({ 1, n, 8 }) end
  local packed_x = F.concat(docs, 2)
  local cu = { 0, 6, 15, 20 }
  local packed = m:forward(packed_x, { cu_seqlens = cu })
  local start = 1
  for i, n in ipairs(lens) do
    local d = max_abs_diff(packed:narrow(2, start, n), m:forward(docs[i]))
    T.ok(d <= 1e-12, "document " .. i .. " differs by " .. d)
    start = start + n
  end
  -- (a) the conv reset alone (kda.md oracle 6): F.causal_conv1d over [A | B] without cu_seqlens reads A
  -- at exactly the first K-1 = 3 tokens of B and nowhere else
  local pre = m.q_proj:forward(packed_x)
  local w = m.q_conv1d.weight
  local with = F.causal_conv1d(pre, w, { cu_seqlens = cu, silu = true })
  local without = F.causal_conv1d(pre, w, { silu = true })
  for t = 7, 15 do
    local d = max_abs_diff(with:narrow(2, t, 1), without:narrow(2, t, 1))
    if t <= 9 then T.ok(d > 1e-3, "conv leak at B's token " .. (t - 6) .. ": " .. d)
    else T.eq(d, 0, "no conv difference from B's 4th token on") end
  end
  -- (b) through the layer, with no state leak possible: v_proj reads only inputs 1-4 and A lives on inputs
  -- 5-8, so v = 0 over A and the state after A is exactly 0; the run without cu_seqlens then differs from
  -- the packed run only through the conv history of q and k
  local A = randn({ 1, 6, 8 }) * tide.tensor({ 0, 0, 0, 0, 1, 1, 1, 1 }, { dtype = "f64" })
  local vw = m.v_proj.weight:tolist()
  for r = 0, 7 do for c = 5, 8 do vw[r * 8 + c] = 0 end end
  m.v_proj.weight:copy_(vw)
  local cacheA = {}
  m:prefill(A, cacheA)
  T.eq(max_abs(cacheA.state), 0, "the state after A is exactly zero")
  local AB = F.concat({ A, docs[2] }, 2)
  local reset = m:forward(AB, { cu_seqlens = { 0, 6, 15 } }):narrow(2, 7, 9)
  local leak = m:forward(AB):narrow(2, 7, 9)
  T.ok(max_abs_diff(reset, m:forward(docs[2])) <= 1e-12)
  T.ok(max_abs_diff(reset:narrow(2, 1, 1), leak:narrow(2, 1, 1)) > 1e-4, "the conv reset matters at B's first token")
  -- (c) with no conv leak possible: taps only on the current token (tap 4), so the conv has no memory;
  -- now the difference is the state alone, and it reaches every token of B
  for _, name in ipairs({ "q_conv1d", "k_conv1d", "v_conv1d" }) do
    local taps = m[name].weight:tolist()
    for c = 0, 7 do for j = 1, 3 do taps[c * 4 + j] = 0 end end
    m[name].weight:copy_(taps)
  end
  m.v_proj.weight:copy_(randn({ 8, 8 }) * 0.4)
  reset = m:forward(packed_x, { cu_seqlens = cu })
  leak = m:forward(packed_x)
  -- (chunks split differently at A's end: rounding only)
  T.ok(max_abs_diff(reset:narrow(2, 1, 6), leak:narrow(2, 1, 6)) <= 1e-12, "doc A is the same either way")
  T.ok(max_abs_diff(reset:narrow(2, 7, 1), leak:narrow(2, 7, 1)) > 1e-2, "the state reset matters at B's first token")
  for t = 7, 15 do
    -- the leaked state decays with α >= e^-5 per token (here 0.14 at B's first token, 3e-7 at its 9th), far
    -- above f64 rounding of O(1) outputs
    local d = max_abs_diff(reset:narrow(2, t, 1), leak:narrow(2, t, 1))
    T.ok(d > 1e-10, "the state reset matters at B's token " .. (t - 6) .. ": " .. d)
  end
end)

T.test("extreme gates: z + dt_bias = ±1e4, A_log in {-5, 5} give finite outputs and gradients", function()
  for _, gate in ipairs({ "bounded", "softplus" }) do
    for _, a in ipairs({ -5, 5 }) do
      for _, bias in ipairs({ -1e4, 1e4 }) do
        tide.manual_seed(12)
        local m = small_layer(gate)
        scramble(m)
        m.A_log:fill_(a)
        m.dt_bias:fill_(bias)
        local x = tide.randn({ 2, 9, 8 }, { dtype = "f64", requires_grad = true })
        local y = m:forward(x)
        local what = string.format("%s gate, A_log %g, dt_bias %g", gate, a, bias)
        T.ok(y:all_finite(), what .. ": output")
        T.ok(max_abs(y) > 0, what .. ": output is not all zero")
        y:sum():backward()
        T.ok(x:grad():all_finite(), what .. ": dx")
        for name, t in m:named_parameters() do T.ok(t:grad():all_finite(), what .. ": d" .. name) end
      end
    end
  end
end)

T.test("errors: input shape, gate name, lower bound outside [-80/chunk, 0), options, step with T > 1", function()
  local m = small_layer("bounded")
  local e = T.raises(function() m:forward(randn({ 2, 7 })) end, "nn.KDA: x must be [B, T, 8], got [2, 7]")
  T.ok(e:find("test_kda.lua:", 1, true), "location: " .. e)
  T.raises(function() m:forward(randn({ 1, 3, 6 })) end, "nn.KDA: x must be [B, T, 8], got [1, 3, 6]")
  T.raises(function() m:step(randn({ 1, 3, 8 }), {}) end, "nn.KDA: step: x must hold one token [B, 1, 8], got [1, 3, 8]")
  T.raises(function() m:forward(randn({ 1, 3, 8 }), { cu = { 0, 3 } }) end, "nn.KDA: unknown key 'cu' in forward options")
  T.raises(function() m:prefill(randn({ 1, 3, 8 })) end, "nn.KDA: prefill: cache must be a table")
  T.raises(function() m:forward(randn({ 2, 3, 8 }), { cache = {}, reset = { true } }) end,
    "nn.KDA: forward: reset lists 1 rows but x has B = 2")
  T.raises(function() m:forward(randn({ 1, 3, 8 }), { cu_seqlens = 3 }) end, "cu_seqlens must be a list of offsets")
  T.raises(function() m:forward(randn({ 1, 3, 8 }), { cu_seqlens = { 0, 2 } }) end, "cu_seqlens must start at 0 and end at B·T = 3")
  e = T.raises(function() nn.KDA(8, { heads = 2, head_dim = 4, gate_form = "swish" }) end,
    'nn.KDA: gate_form must be one of "bounded", "softplus", got "swish"')
  T.ok(e:find("test_kda.lua:", 1, true), "location: " .. e)
  T.raises(function() nn.KDA(8, { heads = 2, head_dim = 4, gate_lower_bound = -6 }) end,
    "gate_lower_bound must lie in [-80/chunk, 0) = [-5, 0) for the chunk path with chunk 16 (kda.md §5), got -6")
  T.raises(function() nn.KDA(8, { heads = 2, head_dim = 4, gate_lower_bound = 0 }) end, "got 0")
  T.raises(function() nn.KDA(8, { heads = 2, head_dim = 4, chunk = 32 }) end, "[-2.5, 0) for the chunk path with chunk 32")
  -- a bound that fits a smaller chunk is fine, and the softplus gate has none
  nn.KDA(8, { heads = 2, head_dim = 4, chunk = 8, gate_lower_bound = -10 })
  nn.KDA(8, { heads = 2, head_dim = 4, chunk = 64, gate_form = "softplus" })
  T.raises(function() nn.KDA(8, { heads = 2 }) end, "nn.KDA: head_dim must be a positive integer, got nil")
  T.raises(function() nn.KDA(8, { heads = 2, head_dim = 4, headdim = 4 }) end, "nn.KDA: unknown key 'headdim'")
  T.raises(function() nn.TransformerLM({ dim = 16, n_heads = 2, mixer = "mamba" }) end,
    "model: mixer must be 'attention' or 'kda', got 'mamba'")
  T.raises(function() nn.TransformerLM({ dim = 16, n_heads = 2, mixer = "kda", kda = { gates = 1 } }) end,
    "model: unknown key 'gates' in kda")
  T.raises(function() nn.TransformerLM({ dim = 16, n_layers = 2, n_heads = 2, mixer = { "kda" } }) end,
    "mixer lists 1 layers but n_layers is 2")
  local lm = nn.TransformerLM({ vocab_size = 300, dim = 16, n_layers = 1, n_heads = 2 })
  T.raises(function() lm:forward(tide.tensor({ { 1, 2, 3 } }, { dtype = "i32" }), nil, { cu_seqlens = { 0, 1, 3 } }) end,
    "cu_seqlens (packed documents) needs KDA layers")
end)

-- ---- the language model ------------------------------------------------------------------------------------

local function ids(rows) return tide.tensor(rows, { dtype = "i32" }) end

T.test("LM with KDA mixers: decode == full forward (f64 1e-12), KDA-only and hybrid; packed == separate", function()
  for _, mixer in ipairs({ "kda", { "kda", "attention", "kda" } }) do
    tide.manual_seed(13)
    local m = nn.TransformerLM({ vocab_size = 300, dim = 16, n_layers = type(mixer) == "table" and 3 or 2, n_heads = 2,
      mixer = mixer, kda = { chunk = 4, gate_form = "softplus" }, dtype = "f64" })
    local seq = { 5, 17, 200, 256, 3, 77, 41, 9, 1, 2 }
    local full = m:forward(ids({ seq }))
    -- count the decode steps taken by the first KDA layer: one-token calls with a cache use the recurrence
    local first = m.model.layers:get(1).self_attn
    local steps, step = 0, first.step
    first.step = function(...) steps = steps + 1; return step(...) end
    tide.no_grad(function()
      local cache = m:new_cache()
      T.ok(max_abs_diff(m:forward(ids({ { 5, 17, 200, 256 } }), cache), full:narrow(2, 1, 4)) <= 1e-12)
      for t = 5, #seq do
        local d = max_abs_diff(m:forward(ids({ { seq[t] } }), cache), full:narrow(2, t, 1))
        T.ok(d <= 1e-12, "position " .. t .. " differs by " .. d)
      end
      T.eq(cache[1].pos, #seq)
    end)
    T.eq(steps, #seq - 4)
  end
  tide.manual_seed(14)
  local m = nn.TransformerLM({ vocab_size = 300, dim = 16, n_layers = 2, n_heads = 2, mixer = "kda", dtype = "f64" })
  T.eq(m:cache_grows(), false)
  local a, b = { 1, 2, 3, 4, 5 }, { 9, 8, 7 }
  local packed = m:forward(ids({ { 1, 2, 3, 4, 5, 9, 8, 7 } }), nil, { cu_seqlens = { 0, 5, 8 } })
  T.ok(max_abs_diff(packed:narrow(2, 1, 5), m:forward(ids({ a }))) <= 1e-12)
  T.ok(max_abs_diff(packed:narrow(2, 6, 3), m:forward(ids({ b }))) <= 1e-12)
end)

T.test("greedy generation with KDA caches == argmax of the full forward; cache size independent of the prompt", function()
  tide.manual_seed(15)
  local m = nn.TransformerLM({ vocab_size = 300, dim = 16, n_layers = 2, n_heads = 2, mixer = "kda", dtype = "f64" })
  local tok = require("tide.data.tokenizer").byte_level({ vocab_size = 300 })
  local gen = require "tide.generate"
  local _, all = gen.generate(m, tok, { prompt = "abc", max_new_tokens = 12, temperature = 0, stop = false })
  T.eq(#all, 15)
  local seq = { 97, 98, 99 }
  for _ = 1, 12 do
    local logits = m:forward(ids({ seq })):narrow(2, #seq, 1):tolist()
    local best = 1
    for i = 2, #logits do if logits[i] > logits[best] then best = i end end
    seq[#seq + 1] = best - 1
  end
  T.eq(all, seq)
  -- no window restart for a KDA-only model: a prompt longer than max_seq_len decodes from its full context
  m.cfg.max_seq_len = 8
  local _, long = gen.generate(m, tok, { prompt = "abcdefghijkl", max_new_tokens = 3, temperature = 0, stop = false })
  local ctx = { 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108 }
  local logits = m:forward(ids({ ctx })):narrow(2, #ctx, 1):tolist()
  local best = 1
  for i = 2, #logits do if logits[i] > logits[best] then best = i end end
  T.eq(long[13], best - 1)
  -- the per-layer cache holds the same tensors whatever the prompt length: [B, H, dk, dv] and 3 × [B, 3, H·dk]
  local function cache_elems(n)
    local prompt = {}
    for i = 1, n do prompt[i] = 97 + i % 20 end
    local c = m:new_cache()
    tide.no_grad(function() m:forward(ids({ prompt }), c); m:forward(ids({ { 1 } }), c) end)
    local total = 0
    for _, lc in ipairs(c) do
      total = total + lc.state:numel()
      for _, s in ipairs({ "q", "k", "v" }) do total = total + lc.conv[s]:numel() end
    end
    return total
  end
  T.eq(cache_elems(2), 2 * (2 * 8 * 8 + 3 * 3 * 16))
  T.eq(cache_elems(200), cache_elems(2))
end)

T.test("a KDA-only LM (2 layers, d = 64) trains on the tiny corpus: loss below 2.0 after 120 steps", function()
  local train = require "tide.train"
  local r = train({
    model = { dim = 64, n_layers = 2, n_heads = 2, vocab_size = 320, mixer = "kda" },
    data = { path = "tests/fixtures/tiny_corpus.txt", doc_separator = "%", val_fraction = 0.1, seq_len = 64, batch_size = 8 },
    optim = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 },
    schedule = { kind = "cosine", warmup = 10 },
    train = { steps = 120, log_every = 1000, seed = 1, quiet = true, eval_batches = 2 },
  })
  -- ln 320 = 5.77 at the start. Measured: 1.675 (seeds 2, 3: 1.795, 1.674). The bound 2.0 lies below the
  -- corpus's own bigram conditional entropy (2.18 nats, fitted on the whole file), so passing needs context
  -- beyond the current token: the mixer must carry information across positions.
  T.ok(r.losses[1] > 5.5, "first loss " .. r.losses[1])
  T.ok(r.final_loss < 2.0, string.format("final loss %.4f (mean of the last 20 steps) should be < 2.0", r.final_loss))
end)

T.run()
