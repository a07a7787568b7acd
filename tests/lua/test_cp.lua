-- cp: context parallelism in one process (spec/long_context.md §5, oracles 2-4): the zig-zag layout with every rank's
-- slice held here (tide.cp, the fake context), KDA state passing with the conv halo, MLA latent gather with the global
-- document mask, for P = 2 and 4: outputs and every gradient equal the unsplit run (f64 1e-10, f32 1e-5 rel), with
-- documents that start inside segments, exactly at a segment edge and within the conv history of the next segment;
-- M = 0 across a document start; a long row in calls on cp slices through one cache (the state and conv history
-- carried, documents at call boundaries; the hybrid's MLA latents with documents across calls) == the unsplit row;
-- images under cp; the fp32 fold over 64 segments against fp64, and the
-- bf16-cast chain that fails it.
local T = require "tide.testing"
local tide = require "tide"
local fmt = string.format
local nn, F = tide.nn, tide.F
local cp = require "tide.cp"

local max_abs_diff, max_abs = T.max_abs_diff, T.max_abs
local function randn_f64(shape) return tide.randn(shape, { dtype = "f64" }) end

-- B = 2 rows of 32: row 1 has starts at 8 (an edge for P = 2 and 4), 13 (inside); row 2 at 15 (the last token of a
-- P = 2 segment: the next segment's conv history keeps 1 of 3 slots; for P = 4 inside), 20 (an edge for P = 4)
local B, TT = 2, 32
local CU = { 0, 8, 13, 32, 47, 52, 64 }

local function params_of(m)
  local out = {}
  for name, p in m:named_parameters() do out[#out + 1] = { name, p } end
  return out
end

-- the gradients of x and of every parameter after loss = Σ y ⊙ r
local function grads(m, x, run, r)
  m:zero_grad()
  x:zero_grad()
  local y = run()
  local l = (y * r):sum()
  l:backward()
  local g = { x = x:grad():clone() }
  for _, np in ipairs(params_of(m)) do g[np[1]] = np[2]:grad() and np[2]:grad():clone() end
  return y:detach(), g
end

-- the layer (or model) on the whole rows vs on the fake cp slices: output and every gradient
local function compare(m, x, fwd_full, fwd_cp, P, tol, rel, what)
  local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = CU })
  local want_y = fwd_full(x)
  local r = tide.randn(want_y:shape(), { dtype = want_y:dtype() })
  local y0, g0 = grads(m, x, function() return fwd_full(x) end, r)
  local y1, g1 = grads(m, x, function() return ctx:unsplit(fwd_cp(ctx:split(x), ctx)) end, r)
  local function check(a, b, name)
    local scale = rel and math.max(max_abs(a), 1e-30) or 1
    local d = max_abs_diff(a, b) / scale
    T.ok(d <= tol, string.format("%s P = %d: %s differs by %.3g (tolerance %g)", what, P, name, d, tol))
  end
  T.ok(max_abs(y0) > 1e-3, what .. ": a non-trivial output")
  check(y0, y1, "output")
  local n = 0
  for name, g in pairs(g0) do
    T.ok(g1[name], what .. ": no gradient for " .. name .. " under cp")
    check(g, g1[name], "gradient of " .. name)
    n = n + 1
  end
  return n
end

local function kda_layer(dtype)
  tide.manual_seed(11)
  local m = nn.KDA(12, { heads = 2, head_dim = 4, chunk = 4, std = 0.3, dtype = dtype })
  tide.no_grad(function()
    m.A_log:copy_(tide.randn({ 2 }, { dtype = dtype }) * 0.5)
    m.o_norm.weight:copy_(tide.randn({ 4 }, { dtype = dtype }))
  end)
  return m
end

T.test("KDA on cp slices == the unsplit rows: state fold, conv halo, documents at and inside edges (f64 1e-10)", function()
  for _, P in ipairs({ 2, 4 }) do
    local m = kda_layer("f64")
    local x = tide.randn({ B, TT, 12 }, { dtype = "f64", requires_grad = true })
    local n = compare(m, x, function(z) return m:forward(z, { cu_seqlens = CU }) end,
      function(z, ctx) return m:forward(z, { cp = ctx }) end, P, 1e-10, false, "KDA")
    T.ok(n >= 14, "every parameter and x compared, got " .. n)
  end
end)

T.test("KDA on cp slices in f32 == the unsplit rows (1e-5 rel)", function()
  for _, P in ipairs({ 2, 4 }) do
    local m = kda_layer("f32")
    local x = tide.randn({ B, TT, 12 }, { dtype = "f32", requires_grad = true })
    compare(m, x, function(z) return m:forward(z, { cu_seqlens = CU }) end,
      function(z, ctx) return m:forward(z, { cp = ctx }) end, P, 1e-5, true, "KDA f32")
  end
end)

T.test("KDA cp without the fold or without the halo differs (each part is needed)", function()
  local m = kda_layer("f64")
  local x = tide.randn({ 1, TT, 12 }, { dtype = "f64" })
  local ctx = cp.context({ P = 2, B = 1, T = TT })
  local want = m:forward(x)
  local got = ctx:unsplit(m:forward(ctx:split(x), { cp = ctx }))
  T.ok(max_abs_diff(want, got) <= 1e-10, "one document: cp == unsplit")
  for _, part in ipairs({ "fold", "halo" }) do
    local c = cp.context({ P = 2, B = 1, T = TT })
    c.ablate = { [part] = true }
    local y = c:unsplit(m:forward(c:split(x), { cp = c }))
    T.ok(max_abs_diff(want:narrow(2, 9, 24), y:narrow(2, 9, 24)) > 1e-3, "without the " .. part .. " the result changes")
    T.ok(max_abs_diff(want:narrow(2, 1, 8), y:narrow(2, 1, 8)) <= 1e-12, "the first segment is the same either way")
  end
  -- a context that believes a document starts at every segment edge: no state, no halo across them
  local cut = cp.context({ P = 2, B = 1, T = TT, cu_seqlens = { 0, 8, 16, 24, 32 } })
  local wrong = cut:unsplit(m:forward(cut:split(x), { cp = cut }))
  T.ok(max_abs_diff(want:narrow(2, 9, 24), wrong:narrow(2, 9, 24)) > 1e-3, "dropping the carried state changes the result")
  T.ok(max_abs_diff(want:narrow(2, 1, 8), wrong:narrow(2, 1, 8)) <= 1e-12, "the first segment is the same either way")
end)

-- a long row processed call by call, each call on cp slices, through one cache: the state and the conv history
-- carried from call to call (and the same on every rank); documents start in a call's last conv window, at a
-- segment edge inside a call and exactly at a call boundary (reset)
local function carried(P, dtype, tol, rel)
  local m = kda_layer(dtype)
  local Tcall, n = 8 * P, 3
  local Tr = Tcall * n
  local starts = { { Tcall - 2, Tcall + 4 }, { 2 * Tcall, 2 * Tcall + 5 } }
  local full_cu = { 0 }
  for b = 1, B do
    for _, t in ipairs(starts[b]) do full_cu[#full_cu + 1] = (b - 1) * Tr + t end
    full_cu[#full_cu + 1] = b * Tr
  end
  local x = tide.randn({ B, Tr, 12 }, { dtype = dtype, requires_grad = true })
  local r = tide.randn({ B, Tr, 12 }, { dtype = dtype })
  local want_cache = {}
  local y0, g0 = grads(m, x, function() return m:forward(x, { cu_seqlens = full_cu }) end, r)
  tide.no_grad(function() m:forward(x, { cache = want_cache, cu_seqlens = full_cu }) end)
  local cache
  local y1, g1 = grads(m, x, function()
    cache = {}
    local ys = {}
    for i = 0, n - 1 do
      local cu, reset = cp.call_documents(full_cu, B, Tr, Tcall, i)
      local ctx = cp.context({ P = P, B = B, T = Tcall, cu_seqlens = cu })
      local xi = x:narrow(2, i * Tcall + 1, Tcall)
      ys[#ys + 1] = ctx:unsplit(m:forward(ctx:split(xi), { cp = ctx, cache = cache, reset = reset }))
    end
    return F.concat(ys, 2)
  end, r)
  local function check(a, b, name)
    local scale = rel and math.max(max_abs(a), 1e-30) or 1
    local d = max_abs_diff(a, b) / scale
    T.ok(d <= tol, string.format("P = %d %s: %s differs by %.3g (tolerance %g)", P, dtype, name, d, tol))
  end
  check(y0, y1, "output")
  local nn_ = 0
  for name, g in pairs(g0) do
    T.ok(g1[name], "no gradient for " .. name .. " through the carried cache")
    check(g, g1[name], "gradient of " .. name)
    nn_ = nn_ + 1
  end
  T.ok(nn_ >= 14, "every parameter and x compared, got " .. nn_)
  check(want_cache.state, cache.state:detach(), "the carried end state")
  for _, s in ipairs({ "q", "k", "v" }) do check(want_cache.conv[s], cache.conv[s]:detach(), "the carried conv " .. s) end
  T.eq(cache.pos, Tr, "cache.pos")
end

T.test("KDA cp calls through one cache == the unsplit long row: state and conv history carried (f64 1e-10, f32 1e-5 rel)", function()
  for _, P in ipairs({ 2, 4 }) do
    carried(P, "f64", 1e-10, false)
    carried(P, "f32", 1e-5, true)
  end
end)

T.test("F.kda_pairs == F.kda on [v | 0] from [0 | I], bitwise, forward and gradients (f64, f32; 75 chunks, documents)", function()
  for _, dt in ipairs({ "f64", "f32" }) do
    tide.manual_seed(4)
    local B, Tn, H, dk, dv = 2, 300, 2, 8, 5
    local function rn(shape) return tide.randn(shape, { dtype = dt }) end
    local q, k = F.l2norm(rn({ B, Tn, H, dk }), { eps = 1e-6 }), F.l2norm(rn({ B, Tn, H, dk }), { eps = 1e-6 })
    local v, g, beta = rn({ B, Tn, H, dv }), rn({ B, Tn, H, dk }):sigmoid() * -4, rn({ B, Tn, H }):sigmoid()
    local cu, r = { 0, 10, 300, 450, 600 }, rn({ B, H, dk, dv + dk })
    local eye = tide.zeros({ dk, dv + dk }, { dtype = dt })
    for i = 1, dk do eye:narrow(1, i, 1):narrow(2, dv + i, 1):fill_(1) end
    local s0 = eye:reshape(1, 1, dk, dv + dk):expand(B, H, dk, dv + dk):contiguous()
    local function run(f)
      local x = { q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_(), g:clone():requires_grad_(),
        beta:clone():requires_grad_() }
      local p = f(x)
      ;(p * r):sum():backward()
      local gs = {}
      for i = 1, 5 do gs[i] = x[i]:grad() end
      return p, gs
    end
    local p1, g1 = run(function(x)
      local vz = F.concat({ x[3], tide.zeros({ B, Tn, H, dk }, { dtype = dt }) }, 4)
      return select(2, F.kda(x[1], x[2], vz, x[4], x[5], { s0 = s0, cu_seqlens = cu, chunk = 4 }))
    end)
    local p2, g2 = run(function(x) return F.kda_pairs(x[1], x[2], x[3], x[4], x[5], { cu_seqlens = cu, chunk = 4 }) end)
    T.eq(max_abs_diff(p1, p2), 0, dt .. ": the pairs")
    for i, name in ipairs({ "q", "k", "v", "g", "beta" }) do T.eq(max_abs_diff(g1[i], g2[i]), 0, dt .. ": the gradient of " .. name) end
  end
  T.raises(function() F.kda_pairs(randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 4, 1, 2 }),
    randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 4, 1 }), { s0 = 1 }) end, "s0 is not an option here")
  T.raises(function() F.kda_pairs(randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 4, 1, 2 }),
    randn_f64({ 1, 4, 1, 2 }), randn_f64({ 1, 3, 1 })) end, "kda_pairs: q [1, 4, 1, 2]")
end)

T.test("a document start inside a segment makes its transition M = 0; h_ext is the state from the start", function()
  tide.manual_seed(3)
  local Tc, H, dk = 8, 2, 4
  local q = F.l2norm(tide.randn({ 2, Tc, H, dk }, { dtype = "f64" }), { scale = 0.5 })
  local k = F.l2norm(tide.randn({ 2, Tc, H, dk }, { dtype = "f64" }))
  local v = tide.randn({ 2, Tc, H, dk }, { dtype = "f64" })
  local g = F.kda_gate(tide.randn({ 2, Tc, H, dk }, { dtype = "f64" }) * 0.3, tide.zeros({ H }, { dtype = "f64" }),
    tide.randn({ H * dk }, { dtype = "f64" }) * 0.3 - 5, { gate_lower_bound = -5 })   -- slow decay: M far from 0
  local beta = tide.randn({ 2, Tc, H }, { dtype = "f64" }):sigmoid()
  local eye = tide.zeros({ dk, 2 * dk }, { dtype = "f64" })
  for i = 1, dk do eye:narrow(1, i, 1):narrow(2, dk + i, 1):fill_(1) end
  local s0 = eye:reshape(1, 1, dk, 2 * dk):expand(2, H, dk, 2 * dk):contiguous()
  local vz = F.concat({ v, tide.zeros({ 2, Tc, H, dk }, { dtype = "f64" }) }, 4)
  local cu = { 0, Tc, Tc + 3, 2 * Tc }          -- row 2 has a document start at its 4th token
  local _, st = F.kda(q, k, vz, g, beta, { s0 = s0, cu_seqlens = cu, chunk = 4 })
  local M1, M2 = st:narrow(1, 1, 1):narrow(4, dk + 1, dk), st:narrow(1, 2, 1):narrow(4, dk + 1, dk)
  T.ok(max_abs(M1) > 0.1, "no document start: M is the product of the chunk transitions")
  T.eq(max_abs(M2), 0, "a document start inside the segment: M = 0")
  -- h_ext of row 2 = the state of its last document alone, from zero
  local _, s_alone = F.kda(q:narrow(1, 2, 1):narrow(2, 4, Tc - 3), k:narrow(1, 2, 1):narrow(2, 4, Tc - 3),
    v:narrow(1, 2, 1):narrow(2, 4, Tc - 3), g:narrow(1, 2, 1):narrow(2, 4, Tc - 3), beta:narrow(1, 2, 1):narrow(2, 4, Tc - 3),
    { chunk = 4 })
  T.ok(max_abs_diff(st:narrow(1, 2, 1):narrow(4, 1, dk), s_alone) <= 1e-12, "h_ext = the last document's state")
end)

T.test("MLA on cp slices == the unsplit rows: latent gather, global document mask (f64 1e-10; f32 1e-5 rel)", function()
  -- the attention read from the latent (keys and values expanded 3 at a time, and by the default chunk that holds
  -- every key here), and the keys and values expanded whole (cp_latent = false)
  for _, path in ipairs({ { latent = true, chunk = 3 }, { latent = true }, { latent = false } }) do
    for _, dt in ipairs({ "f64", "f32" }) do
      for _, P in ipairs({ 2, 4 }) do
        tide.manual_seed(5)
        local m = nn.MLA(12, { heads = 2, q_rank = 8, kv_rank = 6, nope_dim = 4, rope_dim = 2, v_dim = 3, std = 0.3, dtype = dt })
        m.cp_latent, m.cp_chunk = path.latent, path.chunk
        local x = tide.randn({ B, TT, 12 }, { dtype = dt, requires_grad = true })
        compare(m, x, function(z) return m:forward(z, { cu_seqlens = CU }) end,
          function(z, ctx) return m:forward(z, { cp = ctx }) end, P, dt == "f64" and 1e-10 or 1e-5, dt == "f32",
          fmt("MLA %s, %s", dt, path.latent and ("latent, chunk " .. tostring(path.chunk or "default")) or "expanded"))
      end
    end
  end
end)

-- a small hybrid in f64 (test_hybrid's), 2 KDA + 2 MLA layers under Block AttnRes
local function hybrid(dtype, recompute)
  tide.manual_seed(7)
  local m = nn.HybridLM({
    vocab_size = 23, dim = 16, n_layers = 4, mixers = { "kda", "mla", "kda", "mla" }, ffn_dim = 24, dtype = dtype,
    init_std = 0.2, kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 },
    residual = "attnres_block", attnres = { block_layers = 2 }, recompute = recompute,
  })
  for name, t in m:named_parameters() do
    if name:find("_res_proj") then tide.no_grad(function() t:copy_(tide.randn(t:shape(), { dtype = dtype }) * 0.5) end) end
  end
  return m
end

T.test("the hybrid model on cp slices == the unsplit rows: logits and every gradient (f64 1e-10), recompute on and off", function()
  for _, rc in ipairs({ "none", "layer" }) do
    for _, P in ipairs({ 2, 4 }) do
      local m = hybrid("f64", rc)
      local ids = tide.rand({ B, TT }, { lo = 0, hi = 23 }):to("i32")
      local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = CU })
      local targets = tide.rand({ B, TT }, { lo = 0, hi = 23 }):to("i32")
      local function run(logits, tg)
        return F.cross_entropy(logits, tg, { reduction = "sum" })
      end
      m:zero_grad()
      local l0 = run(m:forward(ids, nil, { cu_seqlens = CU }), targets)
      l0:backward()
      local g0 = {}
      for name, p in m:named_parameters() do g0[name] = p:grad() and p:grad():clone() end
      m:zero_grad()
      local l1 = run(m:forward(ctx:split(ids), nil, { cp = ctx }), ctx:split(targets))
      l1:backward()
      T.near(l1:item(), l0:item(), 1e-10 * math.abs(l0:item()), "loss, recompute " .. rc .. ", P " .. P)
      local n = 0
      for name, p in m:named_parameters() do
        T.ok((g0[name] == nil) == (p:grad() == nil), name .. ": a gradient in one run only")
        local d = g0[name] and max_abs_diff(p:grad(), g0[name]) or 0
        T.ok(d <= 1e-10, string.format("recompute %s P %d: gradient of %s differs by %.3g", rc, P, name, d))
        n = n + 1
      end
      T.ok(n > 30, "every parameter compared")
    end
  end
end)

T.test("the hybrid model's long row in calls on cp slices through its caches (KDA state, MLA latents) == unsplit (f64 1e-10)", function()
  for _, P in ipairs({ 2, 4 }) do
    local m = hybrid("f64", "layer")
    local Tr, n = 2 * TT, 2
    -- documents start inside both calls (an MLA cache carries no restart: none at the call boundary)
    local starts = { { 8, 13, TT + 5 }, { 15, TT + 20 } }
    local full = { 0 }
    for b = 1, B do
      for _, t in ipairs(starts[b]) do full[#full + 1] = (b - 1) * Tr + t end
      full[#full + 1] = b * Tr
    end
    local ids = tide.rand({ B, Tr }, { lo = 0, hi = 23 }):to("i32")
    local targets = tide.rand({ B, Tr }, { lo = 0, hi = 23 }):to("i32")
    m:zero_grad()
    local l0 = F.cross_entropy(m:forward(ids, nil, { cu_seqlens = full }), targets, { reduction = "sum" })
    l0:backward()
    local g0 = {}
    for name, p in m:named_parameters() do g0[name] = p:grad() and p:grad():clone() end
    m:zero_grad()
    local caches, l1 = m:new_cache(), nil
    for i = 0, n - 1 do
      local cu, reset = cp.call_documents(full, B, Tr, TT, i)
      T.eq(reset, nil, "no document starts at a call boundary here")
      local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = cu })
      local part = function(t) return ctx:split(t:narrow(2, i * TT + 1, TT):contiguous()) end
      local l = F.cross_entropy(m:forward(part(ids), caches, { cp = ctx }), part(targets), { reduction = "sum" })
      l1 = l1 and l1 + l or l
    end
    l1:backward()
    T.near(l1:item(), l0:item(), 1e-10 * math.abs(l0:item()), "loss, P " .. P)
    local k = 0
    for name, p in m:named_parameters() do
      T.ok((g0[name] == nil) == (p:grad() == nil), name .. ": a gradient in one run only")
      local d = g0[name] and max_abs_diff(p:grad(), g0[name]) or 0
      T.ok(d <= 1e-10, string.format("P %d: gradient of %s differs by %.3g", P, name, d))
      k = k + 1
    end
    T.ok(k > 30, "every parameter compared")
    T.eq(caches[2].c:size(2), Tr, "the MLA cache holds the whole row's latents")
  end
end)

T.test("images under cp: every slice splices the image tokens its placeholders take (an image across a segment edge) == unsplit (f64 1e-10)", function()
  for _, P in ipairs({ 2, 4 }) do
    tide.manual_seed(3)
    local m = nn.HybridLM({
      vocab_size = 64, dim = 128, n_layers = 2, mixers = "KM", ffn_dim = 64, dtype = "f64",
      kda = { heads = 2, head_dim = 16, chunk = 4 }, mla = { heads = 2, kv_rank = 16, nope_dim = 16, rope_dim = 8, v_dim = 16 },
      vision = { patch = 4, dim = 32, heads = 2, layers = 1, mlp_dim = 64, grid = 4, media_pad = 9 },
    })
    -- row 1: an image's 4 placeholders at 14..17 (across the edge at 16), row 2's at 2..5 (across the edge at 4 for
    -- P = 4): the ranks' slices hold the image tokens out of their global order (rank 0 row 2's, then row 1's)
    local vals = {}
    for b = 0, B - 1 do
      for t = 0, TT - 1 do
        local s0 = b == 0 and 14 or 2
        vals[#vals + 1] = (t >= s0 and t < s0 + 4) and 9 or 10 + (t * 7 + b) % 50
      end
    end
    local ids = tide.tensor(vals, { dtype = "i32", shape = { B, TT } })
    local targets = tide.rand({ B, TT }, { lo = 0, hi = 64 }):to("i32")
    local patches = tide.randn({ 32, 48 }, { dtype = "f64" })
    local grids = { { 4, 4 }, { 4, 4 } }
    local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = CU })
    m:zero_grad()
    local l0 = F.cross_entropy(m:forward(ids, nil, { cu_seqlens = CU, images = { patches = patches, grids = grids } }),
      targets, { reduction = "sum" })
    l0:backward()
    local g0 = {}
    for name, p in m:named_parameters() do g0[name] = p:grad() and p:grad():clone() end
    m:zero_grad()
    local rows, k = ctx:local_ordinals(ids, 9)
    T.eq(k, 8, "placeholders over the batch")
    T.eq(#rows, 8, "the fake context holds every slice: every image token once")
    T.eq(rows, { 4, 5, 6, 7, 0, 1, 2, 3 }, "the image tokens in slice order")
    tide.no_grad(function()
      local wrong = F.cross_entropy(m:forward(ctx:split(ids), nil, { cp = ctx,
        images = { patches = patches, grids = grids, rows = { 0, 1, 2, 3, 4, 5, 6, 7 } } }), ctx:split(targets),
        { reduction = "sum" })
      T.ok(math.abs(wrong:item() - l0:item()) > 1e-6, "the tokens in global order land on the wrong placeholders")
    end)
    local l1 = F.cross_entropy(m:forward(ctx:split(ids), nil, { cp = ctx,
      images = { patches = patches, grids = grids, rows = rows } }), ctx:split(targets), { reduction = "sum" })
    l1:backward()
    T.near(l1:item(), l0:item(), 1e-10 * math.abs(l0:item()), "loss, P " .. P)
    local n = 0
    for name, p in m:named_parameters() do
      T.ok((g0[name] == nil) == (p:grad() == nil), name .. ": a gradient in one run only")
      local d = g0[name] and max_abs_diff(p:grad(), g0[name]) or 0
      T.ok(d <= 1e-10, string.format("P %d: gradient of %s differs by %.3g", P, name, d))
      if name:find("^vision_tower") and g0[name] then n = n + 1 end
    end
    T.ok(n > 5, "the encoder's gradients compared: " .. n)
  end
end)

T.test("the fp32 fold over 64 segments matches fp64 (1e-5 rel); a bf16-cast M chain does not (oracle 4)", function()
  tide.manual_seed(9)
  local P, Tc, H, dk = 32, 16, 2, 8
  local n = 2 * P
  local q = F.l2norm(tide.randn({ n, Tc, H, dk }, { dtype = "f64" }), { scale = 1 / math.sqrt(dk) })
  local k = F.l2norm(tide.randn({ n, Tc, H, dk }, { dtype = "f64" }))
  local v = tide.randn({ n, Tc, H, dk }, { dtype = "f64" })
  -- slow decay (the long-memory channels of a trained model): the chain of M matters over many segments
  local g = F.kda_gate(tide.randn({ n, Tc, H, dk }, { dtype = "f64" }) * 0.3, tide.zeros({ H }, { dtype = "f64" }),
    tide.randn({ H * dk }, { dtype = "f64" }) * 0.3 - 6, { gate_lower_bound = -5 })
  local beta = tide.randn({ n, Tc, H }, { dtype = "f64" }):sigmoid() * 0.3
  local eye = tide.zeros({ dk, 2 * dk }, { dtype = "f64" })
  for i = 1, dk do eye:narrow(1, i, 1):narrow(2, dk + i, 1):fill_(1) end
  local s0 = eye:reshape(1, 1, dk, 2 * dk):expand(n, H, dk, 2 * dk):contiguous()
  local _, pairs_seg = F.kda(q, k, F.concat({ v, tide.zeros({ n, Tc, H, dk }, { dtype = "f64" }) }, 4), g, beta,
    { s0 = s0, chunk = 16 })
  -- in gathered order: row-segment (rank p, slot s) holds segment seg(p, s)
  local ctx = cp.context({ P = P, B = 1, T = n * Tc })
  local order = {}
  for p = 0, P - 1 do
    for s = 0, 1 do order[#order + 1] = ctx:seg(p, s) end
  end
  local pairs = pairs_seg:index_select(1, tide.tensor(order, { dtype = "i64" }))
  local S64 = ctx:fold(pairs, dk)
  local S32 = ctx:fold(pairs:to("f32"), dk)
  local last = S64:narrow(1, 2, 1)           -- rank 0 slot 1: segment 63, the end of the chain
  T.ok(max_abs(last) > 0.1, "the last segment's start state is not trivial")
  local err32 = max_abs_diff(S32, S64) / max_abs(S64)
  T.ok(err32 <= 1e-5, "fp32 fold: " .. err32)
  -- negative control: the chain in bf16 between segments (M and h rounded to bf16 at every step)
  local function bf(t) return t:to("bf16"):to("f64") end
  local h
  for c = 0, n - 2 do
    local pc = pairs_seg:narrow(1, c + 1, 1)
    local he, Mc = pc:narrow(4, 1, dk):reshape(H, dk, dk), pc:narrow(4, dk + 1, dk):reshape(H, dk, dk)
    h = h and bf(bf(Mc):matmul(h) + he) or bf(he)
  end
  local errbf = max_abs_diff(h:reshape(1, H, dk, dk), last) / max_abs(S64)
  T.ok(errbf > 1e-5, "the bf16 chain must miss 1e-5, got " .. errbf)
end)

T.test("call_documents: a long row's documents per call (cu over the call, reset at its boundary)", function()
  -- B = 2 rows of 24 in 3 calls of 8: row 1 starts at 5 and 16 (a boundary), row 2 at 11
  local cu = { 0, 5, 16, 24, 35, 48 }
  local c0, r0 = cp.call_documents(cu, 2, 24, 8, 0)
  T.eq(c0, { 0, 5, 8, 16 }, "call 0")
  T.eq(r0, nil, "call 0: no reset")
  local c1, r1 = cp.call_documents(cu, 2, 24, 8, 1)
  T.eq(c1, { 0, 8, 11, 16 }, "call 1")
  T.eq(r1, nil, "call 1: no reset")
  local c2, r2 = cp.call_documents(cu, 2, 24, 8, 2)
  T.eq(c2, { 0, 8, 16 }, "call 2")
  T.eq(r2, { true, false }, "call 2: row 1 restarts")
  T.raises(function() cp.call_documents(cu, 2, 24, 7, 0) end, "do not cut a row of 24")
  T.raises(function() cp.call_documents(cu, 2, 24, 8, 3) end, "not one of the 3 calls")
end)

T.test("cp contexts reject layouts that do not cut", function()
  T.raises(function() cp.context({ P = 3, B = 1, T = 32 }) end, "multiple of 6")
  local m = kda_layer("f64")
  local ctx = cp.context({ P = 8, B = 1, T = 32 })     -- Tc = 2 < the conv history 3
  T.raises(function() m:forward(ctx:split(tide.randn({ 1, 32, 12 }, { dtype = "f64" })), { cp = ctx }) end,
    "shorter than the short convolution")
  T.raises(function() m:forward(tide.randn({ 1, 8, 12 }, { dtype = "f64" }), { cp = ctx, cu_seqlens = { 0, 8 } }) end,
    "takes no cu_seqlens")
  T.raises(function() m:forward(ctx:split(tide.randn({ 1, 32, 12 }, { dtype = "f64" })), { cp = ctx, reset = true }) end,
    "none was given")
  T.raises(function() cp.context({ P = 2, B = 1, T = 32, cu_seqlens = { 0, 5, 40 } }) end, "run from 0 to B")
  local mla = nn.MLA(12, { heads = 2, q_rank = 8, kv_rank = 6, nope_dim = 4, rope_dim = 2, v_dim = 3, dtype = "f64" })
  local c2 = cp.context({ P = 2, B = 1, T = 32 })
  T.raises(function() mla:forward(c2:split(tide.randn({ 1, 32, 12 }, { dtype = "f64" })), { cp = c2, cu_seqlens = { 0, 32 } }) end,
    "takes no cu_seqlens")
end)

T.run()
