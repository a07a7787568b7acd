-- cp_layer.lua — context parallelism over MPI (spec/long_context.md §5) against the unsplit rows, under mpirun
-- (tests/dist/cp_check.sh: 2 and 4 ranks). Every rank builds the same layer, rows and loss weights; the reference is
-- the whole rows through the layer in this process, the test is the layer on this rank's zig-zag slices (tide.cp with
-- the world as the cp group: the conv halo, the KDA pairs and the MLA latents exchanged between the ranks). Asserted:
-- this rank's slices of the output and of the input gradient, the parameter gradients summed over the ranks, and the
-- bytes the rank sent for the forward and backward == dist.cp_bytes (the formula of the plan and bench/dist_cp), for
-- a KDA layer, an MLA layer and the small hybrid model (KDA + MLA under Block AttnRes, recompute per layer), in f64
-- (1e-10) and f32 (1e-5 relative), with documents that start inside segments and exactly at segment edges; and a
-- model's row in two calls through its caches (KDA-only, and KDA + MLA: the carried state and latents cost no
-- extra bytes).
local tide = require "tide"
local dist = require "tide.dist"
local cp = require "tide.cp"
local nn, F = tide.nn, tide.F

local fmt = string.format

local max_abs = require("tide.testing").max_abs

local function diff(a, b, rel)
  local d = max_abs(a:to("f64") - b:to("f64"))
  return rel and d / math.max(max_abs(b), 1e-30) or d
end

local P, rank, group
local B, TT = 2, 64
-- row 1: starts at 16 (an edge for P = 2 and 4), 27 (inside); row 2: at 31 (the last token of a P = 2 segment: the
-- next segment's conv history keeps one slot), 40 (an edge for P = 4, inside for P = 2), 57 (inside)
local CU = { 0, 16, 27, 64, 95, 104, 121, 128 }
local failures = 0

local function check(ok, msg)
  if not ok then
    failures = failures + 1
    io.stderr:write(fmt("rank %d FAIL %s\n", rank, msg))
  end
end

-- one case: build(dtype) -> module; fwd_full(m, x), fwd_cp(m, xs, ctx) -> y; x from make_x()
local function run_case(name, dtype, build, make_x, fwd_full, fwd_cp, shape)
  local tol, rel = dtype == "f64" and 1e-10 or 1e-5, dtype == "f32"
  local m = build(dtype)
  tide.manual_seed(123)
  local x = make_x(dtype)
  local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = CU, group = group })
  -- the reference: the whole rows
  local y0 = fwd_full(m, x)
  local r = tide.randn(y0:shape(), { dtype = y0:dtype() })
  local l0 = (y0 * r):sum()
  l0:backward()
  local g0 = {}
  for pname, p in m:named_parameters() do g0[pname] = p:grad() and p:grad():clone() end
  local gx0 = x:dtype() ~= "i32" and x:grad() and x:grad():clone()
  m:zero_grad()
  if gx0 then x:zero_grad() end
  -- this rank's slices
  local b0 = dist.bytes_sent()
  local y1 = fwd_cp(m, ctx:split(x), ctx)
  local l1 = (y1 * ctx:split(r)):sum()
  l1:backward()
  local sent = dist.bytes_sent() - b0
  local es = dtype == "f64" and 8 or 4
  local want = dist.cp_bytes({ P = P, B = B, T = TT, kda = shape.kda, mla = shape.mla, es = es, state_es = es,
    recompute = shape.recompute }).total
  check(sent == want, fmt("%s %s: the rank sent %d bytes, dist.cp_bytes says %d", name, dtype, sent, want))
  check(diff(y1, ctx:split(y0), rel) <= tol, fmt("%s %s: output differs by %.3g", name, dtype, diff(y1, ctx:split(y0), rel)))
  if gx0 then
    local d = diff(ctx:split(x:grad()), ctx:split(gx0), rel)
    check(d <= tol, fmt("%s %s: input gradient differs by %.3g", name, dtype, d))
  end
  local n = 0
  for pname, p in m:named_parameters() do
    if g0[pname] then
      local g = p:grad():to("f64"):contiguous()
      dist.allreduce_(g)
      local d = diff(g, g0[pname], rel)
      check(d <= tol, fmt("%s %s: gradient of %s (summed over the ranks) differs by %.3g", name, dtype, pname, d))
      n = n + 1
    end
  end
  check(n >= 8, fmt("%s: only %d parameter gradients compared", name, n))
  if rank == 0 and failures == 0 then print(fmt("ok   cp %d %s %s == unsplit (%d parameters)", P, name, dtype, n)) end
end

local function x_of(d) return function(dtype) return tide.randn({ B, TT, d }, { dtype = dtype, requires_grad = true }) end end

-- a row of 2·TT tokens in two calls of TT through the model's caches (a KDA-only model: the state and conv history
-- carried from call to call, the same on every rank), each call on this rank's slices, against the whole row in
-- one unsplit call; documents start in the first call's last conv window and exactly at the call boundary (reset).
-- The carry costs no bytes: the row's end state and conv history come from the pairs and tails gathered anyway.
local function run_carried(dtype, with_mla)
  local tol, rel = dtype == "f64" and 1e-10 or 1e-5, dtype == "f32"
  tide.manual_seed(9)
  local m = nn.HybridLM({
    vocab_size = 23, dim = 16, n_layers = 2, mixers = { "kda", with_mla and "mla" or "kda" }, ffn_dim = 24, dtype = dtype,
    init_std = 0.2, kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 },
    residual = "attnres_block", attnres = { block_layers = 2 }, recompute = "layer",
  })
  local Tr, n = 2 * TT, 2
  -- (an MLA cache carries no restart: with MLA no document starts exactly at the call boundary)
  local starts = with_mla and { { 16, 27, TT - 2 }, { TT - 9, TT + 31 } } or { { 16, 27, TT - 2 }, { TT, TT + 31 } }
  local full = { 0 }
  for b = 1, B do
    for _, t in ipairs(starts[b]) do full[#full + 1] = (b - 1) * Tr + t end
    full[#full + 1] = b * Tr
  end
  tide.manual_seed(321)
  local ids = tide.rand({ B, Tr }, { lo = 0, hi = 23 }):to("i32")
  local y0 = m:forward(ids, nil, { cu_seqlens = full })
  local r = tide.randn(y0:shape(), { dtype = dtype })
  ;(y0 * r):sum():backward()
  local g0 = {}
  for pname, p in m:named_parameters() do g0[pname] = p:grad() and p:grad():clone() end
  m:zero_grad()
  local b0 = dist.bytes_sent()
  local caches, loss, want = m:new_cache(), nil, 0
  local es = dtype == "f64" and 8 or 4
  for i = 0, n - 1 do
    local cu, reset = cp.call_documents(full, B, Tr, TT, i)
    local ctx = cp.context({ P = P, B = B, T = TT, cu_seqlens = cu, group = group })
    local part = function(t) return ctx:split(t:narrow(2, i * TT + 1, TT):contiguous()) end
    local y1 = m:forward(part(ids), caches, { cp = ctx, reset = reset })
    local d = diff(y1, part(y0), rel)
    check(d <= tol, fmt("carried %s: call %d's logits differ by %.3g", dtype, i + 1, d))
    local l = (y1 * part(r)):sum()
    loss = loss and loss + l or l
    want = want + dist.cp_bytes({ P = P, B = B, T = TT,
      kda = { layers = with_mla and 1 or 2, heads = 2, head_dim = 4, conv_size = 4 },
      mla = with_mla and { layers = 1, kv_rank = 8, rope_dim = 2 } or nil, es = es, state_es = es, recompute = true }).total
  end
  loss:backward()
  local sent = dist.bytes_sent() - b0
  check(sent == want, fmt("carried %s: the rank sent %d bytes, two calls of dist.cp_bytes say %d", dtype, sent, want))
  local k = 0
  for pname, p in m:named_parameters() do
    if g0[pname] then
      local g = p:grad():to("f64"):contiguous()
      dist.allreduce_(g)
      local d = diff(g, g0[pname], rel)
      check(d <= tol, fmt("carried %s: gradient of %s (summed over the ranks) differs by %.3g", dtype, pname, d))
      k = k + 1
    end
  end
  check(k >= 18, fmt("carried: only %d parameter gradients compared", k))
  if rank == 0 and failures == 0 then
    print(fmt("ok   cp %d a row in 2 calls through the caches (%s) %s == unsplit (%d parameters)", P,
      with_mla and "KDA + MLA" or "KDA", dtype, k))
  end
end

local function run()
  P, rank = dist.world(), dist.rank()
  group = dist.split(0)
  for _, dtype in ipairs({ "f64", "f32" }) do
    local kda1 = { layers = 1, heads = 2, head_dim = 4, conv_size = 4 }
    local mla1 = { layers = 1, kv_rank = 6, rope_dim = 2 }
    run_case("KDA", dtype, function(dt)
      tide.manual_seed(11)
      local m = nn.KDA(12, { heads = 2, head_dim = 4, chunk = 4, std = 0.3, dtype = dt })
      tide.no_grad(function() m.A_log:copy_(tide.randn({ 2 }, { dtype = dt }) * 0.5) end)
      return m
    end, x_of(12), function(m, x) return m:forward(x, { cu_seqlens = CU }) end,
      function(m, x, ctx) return m:forward(x, { cp = ctx }) end, { kda = kda1 })
    run_case("MLA", dtype, function(dt)
      tide.manual_seed(5)
      return nn.MLA(12, { heads = 2, q_rank = 8, kv_rank = 6, nope_dim = 4, rope_dim = 2, v_dim = 3, std = 0.3, dtype = dt })
    end, x_of(12), function(m, x) return m:forward(x, { cu_seqlens = CU }) end,
      function(m, x, ctx) return m:forward(x, { cp = ctx }) end, { mla = mla1 })
    run_case("hybrid", dtype, function(dt)
      tide.manual_seed(7)
      local m = nn.HybridLM({
        vocab_size = 23, dim = 16, n_layers = 4, mixers = { "kda", "mla", "kda", "mla" }, ffn_dim = 24, dtype = dt,
        init_std = 0.2, kda = { heads = 2, head_dim = 4, chunk = 4 },
        mla = { heads = 2, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 },
        residual = "attnres_block", attnres = { block_layers = 2 }, recompute = "layer",
      })
      for pname, t in m:named_parameters() do
        if pname:find("_res_proj") then tide.no_grad(function() t:copy_(tide.randn(t:shape(), { dtype = dt }) * 0.5) end) end
      end
      return m
    end, function() return tide.rand({ B, TT }, { lo = 0, hi = 23 }):to("i32") end,
      function(m, ids) return m:forward(ids, nil, { cu_seqlens = CU }) end,
      function(m, ids, ctx) return m:forward(ids, nil, { cp = ctx }) end,
      { kda = { layers = 2, heads = 2, head_dim = 4, conv_size = 4 }, mla = { layers = 2, kv_rank = 8, rope_dim = 2 },
        recompute = true })
    run_carried(dtype)
    run_carried(dtype, true)
  end

  local bad = dist.sum(failures)
  if bad > 0 and rank == 0 then io.stderr:write(fmt("cp_layer: %d failure(s) over the ranks\n", bad)) end
  return bad == 0 and 0 or 1
end

return { run = run }
