-- recompute: nn.HybridLM's activation-memory modes (long_context.md §4; nn/hybrid.lua) — recompute = "layer" and
-- "selective" give bitwise the losses, every parameter gradient and the MoE routing records (metrics and bias after
-- balance_step) of "none" over two training steps of a f64 hybrid with KDA + MLA mixers, LatentMoE FFNs with SiTU
-- shared experts and Block AttnRes; "layer" lowers the peak memory of forward + backward at T = 2048 (f32);
-- decoding with caches == the full forward, and training segment by segment through caches gives the gradients
-- of "none"; regions open only while gradients are recorded (not under no_grad, not for one-token decode steps);
-- "auto" (the default) picks none or layer by the activation estimate against the memory budget, once per shape;
-- the option is validated by name.
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F

local MODES = { "none", "layer", "selective" }

-- a 4-layer 3:1 hybrid: layer 0 a dense SiTU FFN, layers 1-3 LatentMoE (4 experts, top 2, one SiTU shared
-- expert), Block AttnRes with B = 2; the AttnRes pseudo-queries get values so the mixes are not uniform
local function model(seed, opts)
  tide.manual_seed(seed)
  local cfg = {
    vocab_size = 19, dim = 16, n_layers = 4, ffn_dim = 24, activation = "situ", dtype = "f64", init_std = 0.2,
    kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 },
    moe = { n_experts = 4, top_k = 2, expert_dim = 8, latent_dim = 8, activation = "situ" },
    residual = "attnres_block", attnres = { block_layers = 2 },
  }
  for k, v in pairs(opts or {}) do cfg[k] = v end
  local m = nn.HybridLM(cfg)
  tide.no_grad(function()
    for name, t in m:named_parameters() do
      if name:find("_res_proj") then t:copy_(tide.randn(t:shape(), { dtype = t:dtype() }) * 0.5) end
    end
  end)
  return m
end

local function ids(B, Tn, V) return tide.rand({ B, Tn }, { lo = 0, hi = V }):to("i32") end

local function discard_records(m) for _, moe in ipairs(m:moe_layers()) do moe:balance_step({ discard = true }) end end

-- max |a − b| / max(1, |b|) over two flat lists, and whether they are bitwise equal
local function rel_diff(a, b)
  T.eq(#a, #b, "element counts")
  local m, same = 0, true
  for i = 1, #a do
    if a[i] ~= b[i] then same = false end
    local d = math.abs(a[i] - b[i]) / math.max(1, math.abs(b[i]))
    if d ~= d then return math.huge, false end
    if d > m then m = d end
  end
  return m, same
end

local function grads(m)
  local out = {}
  for name, t in m:named_parameters() do
    local g = t:grad()
    out[name] = g and g:tolist() or false
  end
  return out
end

T.test("layer and selective == none bitwise: losses, every parameter gradient, MoE records over two steps (f64)", function()
  local x, y = ids(2, 12, 19), ids(2, 12, 19)
  local cu = { 0, 5, 12, 20, 24 }                     -- packed documents in both rows, on the second step
  local runs = {}
  for _, mode in ipairs(MODES) do
    local m = model(31, { recompute = mode })
    T.eq(m.cfg.recompute, mode)
    local r = { losses = {}, grads = {}, metrics = {}, bias = {} }
    for step = 1, 2 do
      m:zero_grad()
      local loss = m:loss(x, y, step == 2 and { cu_seqlens = cu } or nil)
      -- one routing record per MoE layer per forward: Lua runs once whatever the engine replays
      for i, moe in ipairs(m:moe_layers()) do T.eq(#moe._records, 1, mode .. ": records of MoE layer " .. i) end
      loss:backward()
      for i, moe in ipairs(m:moe_layers()) do T.eq(#moe._records, 1, mode .. ": backward records nothing, layer " .. i) end
      r.losses[step] = loss:item()
      r.grads[step] = grads(m)
      m:balance_step()
      r.metrics[step] = m:moe_metrics()
      local b = {}
      for i, moe in ipairs(m:moe_layers()) do b[i] = moe.gate.e_score_correction_bias:tolist() end
      r.bias[step] = b
    end
    runs[mode] = r
  end
  local ref = runs.none
  T.ok(ref.metrics[2][1].b_std > 0, "the balancer moved the bias (the second step routes with it)")
  for _, mode in ipairs({ "layer", "selective" }) do
    local r = runs[mode]
    local worst, bitwise, n = 0, true, 0
    for step = 1, 2 do
      T.eq(r.losses[step], ref.losses[step], mode .. " loss, step " .. step)
      for name, g in pairs(ref.grads[step]) do
        if g == false then
          -- layer 0's mixer-side AttnRes site reads one source (the embedding): no gradient in any mode
          T.ok(name:find("layers.0.self_attention_res", 1, true), "none: no gradient for " .. name)
          T.eq(r.grads[step][name], false, mode .. ": no gradient for " .. name)
        else
          local d, same = rel_diff(r.grads[step][name], g)
          -- the replay runs the same kernels on the same inputs: bitwise, not merely within 1e-12
          T.ok(same, string.format("%s: %s step %d differs by %.3g rel (expected bitwise)", mode, name, step, d))
          worst, bitwise, n = math.max(worst, d), bitwise and same, n + 1
        end
      end
      T.eq(r.metrics[step], ref.metrics[step], mode .. ": MoE metrics after balance_step, step " .. step)
      T.eq(r.bias[step], ref.bias[step], mode .. ": selection bias after balance_step, step " .. step)
    end
    T.ok(bitwise and worst == 0 and n > 100, "gradients compared: " .. n)
    print(string.format("    %-9s %d gradients over 2 steps: bitwise equal to none", mode, n))
  end
end)

-- peak engine bytes of one forward + backward above what is held before it
local function step_peak(m, x, y)
  m:zero_grad()
  tide.collect()
  local base = tide.memory().current
  tide.reset_peak()
  local loss = m:loss(x, y)
  loss:backward()
  local peak = tide.memory().peak - base
  loss = nil
  m:zero_grad()
  tide.collect()
  return peak
end

T.test("peak memory of forward + backward at T = 2048 (f32, d 64): layer < 0.45 none, selective < none", function()
  local Tn = 2048
  local m = model(32, {
    vocab_size = 64, dim = 64, ffn_dim = 128, dtype = "f32", init_std = 0.02,
    kda = { heads = 2, head_dim = 32 }, mla = { heads = 2, q_rank = 48, kv_rank = 32, nope_dim = 32, rope_dim = 16, v_dim = 32 },
    moe = { n_experts = 8, top_k = 2, expert_dim = 32, latent_dim = 32, activation = "situ" },
  })
  local x, y = ids(1, Tn, 64), ids(1, Tn, 64)
  local peak = {}
  for _, mode in ipairs(MODES) do
    m:set_recompute(mode)
    peak[mode] = step_peak(m, x, y)
    discard_records(m)
  end
  local r_layer, r_sel = peak.layer / peak.none, peak.selective / peak.none
  print(string.format("    peak MB: none %.1f, selective %.1f (%.3f of none), layer %.1f (%.3f of none)",
    peak.none / 2 ^ 20, peak.selective / 2 ^ 20, r_sel, peak.layer / 2 ^ 20, r_layer))
  T.ok(r_layer < 0.45, string.format("layer peak is %.3f of none (expected < 0.45)", r_layer))
  T.ok(peak.selective < peak.none, string.format("selective peak is %.3f of none (expected < 1)", r_sel))
  T.ok(peak.layer < peak.selective, "layer keeps less than selective")
end)

T.test("caches under recompute = \"layer\": decode == the full forward (1e-11); segments through caches == none bitwise", function()
  local m = model(33)
  m:set_recompute("layer")
  local x = ids(2, 10, 19)
  local full = m:forward(x)
  -- prefill with gradients recorded (every layer a region, the caches written inside it), then decode steps
  local cache = m:new_cache()
  local outs = { m:forward(x:narrow(2, 1, 6), cache) }
  tide.no_grad(function()
    for t = 7, 10 do outs[#outs + 1] = m:forward(x:narrow(2, t, 1), cache) end
  end)
  local d = rel_diff(F.concat(outs, 2):tolist(), full:tolist())
  T.ok(d <= 1e-11, string.format("decode differs from the full forward by %.3g", d))
  -- training through caches: two segments, the KDA state and MLA latent carried with their graph
  discard_records(m)
  local y = ids(2, 10, 19)
  local function segmented(mode)
    m:set_recompute(mode)
    m:zero_grad()
    local c = m:new_cache()
    local a = m:forward(x:narrow(2, 1, 4), c)
    local b = m:forward(x:narrow(2, 5, 6), c)
    local loss = F.cross_entropy(F.concat({ a, b }, 2):reshape(20, 19), y:reshape(20))
    loss:backward()
    discard_records(m)
    return loss:item(), grads(m)
  end
  local l0, g0 = segmented("none")
  local l1, g1 = segmented("layer")
  T.eq(l1, l0, "segmented loss")
  local worst = 0
  local n = 0
  for name, g in pairs(g0) do
    if g then worst, n = math.max(worst, (rel_diff(g1[name], g))), n + 1; T.eq(g1[name], g, name) else T.eq(g1[name], false, name) end
  end
  T.ok(n > 60, "gradients compared: " .. n)
  T.ok(worst == 0, string.format("segmented gradients differ by %.3g rel", worst))
  m:set_recompute("layer")
end)

T.test("regions open only while gradients are recorded: none under no_grad or for a one-token decode step", function()
  local m = model(35, { recompute = "layer" })
  local x = ids(1, 8, 19)
  local orig, calls = tide.recompute, 0
  tide.recompute = function(...) calls = calls + 1; return orig(...) end
  local ok, err = pcall(function()
    local function count(fn) calls = 0; fn(); discard_records(m); return calls end
    -- "layer": one region per layer; "selective": per layer the two PreNorm sites
    T.eq(count(function() m:forward(x) end), 4, "layer, gradients recorded")
    T.eq(count(function() tide.no_grad(function() m:forward(x) end) end), 0, "layer under no_grad")
    local cache = m:new_cache()
    T.eq(count(function() m:forward(x, cache) end), 4, "prefill through caches with gradients: regions")
    T.eq(count(function() m:forward(ids(1, 1, 19), cache) end), 0, "a one-token decode step runs plainly")
    m:set_recompute("selective")
    T.eq(count(function() m:forward(x) end), 8, "selective, gradients recorded")
    T.eq(count(function() tide.no_grad(function() m:forward(x) end) end), 0, "selective under no_grad")
    m:set_recompute("none")
    T.eq(count(function() m:forward(x) end), 0, "none")
  end)
  tide.recompute = orig
  if not ok then error(err, 0) end
end)

T.test("auto (the default): none when a micro-batch's activations fit the budget, layer when not; once per shape", function()
  local m = model(36)
  T.eq(m.cfg.recompute, "auto", "the default")
  local plan = nn.plan
  local need = plan.activation_bytes(m.cfg, 8, { recompute = "none", dtype = "f64" }).allocated * 2
  T.ok(need > 0, "need")
  -- the boundary: a budget of exactly the bytes needed trains without recompute, one byte less recomputes
  T.eq(select(1, plan.auto_recompute(m.cfg, 2, 8, { dtype = "f64", budget = need })), "none", "budget = need")
  local mode, info = plan.auto_recompute(m.cfg, 2, 8, { dtype = "f64", budget = need - 1 })
  T.eq(mode, "layer", "budget = need - 1")
  T.eq(info.need, need, "info.need")
  T.eq(info.budget, need - 1, "info.budget")
  -- the device's own budget (half its free memory here) fits this model: no recompute
  local b = plan.memory_budget("cpu")
  T.ok(type(b) == "number" and b > need, "the cpu budget " .. tostring(b))
  T.eq(m:recompute_for(2, 8), "none", "tiny model on the cpu")
  -- what the model runs: regions counted, and the result bitwise the explicit modes'
  local x, y = ids(2, 8, 19), ids(2, 8, 19)
  local orig, calls = tide.recompute, 0
  tide.recompute = function(...) calls = calls + 1; return orig(...) end
  local function run(mode, budget)
    m:set_recompute(mode, budget)
    m:zero_grad()
    calls = 0
    local loss = F.cross_entropy(m:forward(x):reshape(16, 19), y:reshape(16))
    loss:backward()
    discard_records(m)
    return loss:item(), grads(m), calls
  end
  local ok, err = pcall(function()
    local l0, g0, c0 = run("none")
    local la, ga, ca = run("auto")
    T.eq(c0, 0, "none: no region")
    T.eq(ca, 0, "auto with room: no region")
    local lb, gb, cb = run("auto", need - 1)
    T.eq(cb, 4, "auto over budget: one region per layer")
    T.eq(m:recompute_for(2, 8), "layer", "the decision")
    local lc, _, cc = run("auto", 2 * need)
    T.eq(cc, 0, "a new budget decides again")
    T.eq(la, l0, "auto loss"); T.eq(lb, l0, "auto (layer) loss"); T.eq(lc, l0, "loss")
    for name, g in pairs(g0) do T.eq(ga[name], g, name); T.eq(gb[name], g, name) end
    -- decided once per shape: the same shape keeps its mode even when the budget would now say otherwise
    m:set_recompute("auto", need - 1)
    T.eq(m:recompute_for(2, 8), "layer", "first decision")
    m.model.auto_budget = 100 * need
    T.eq(m:recompute_for(2, 8), "layer", "kept for the shape")
    T.eq(m:recompute_for(1, 8), "none", "another shape decides afresh")
  end)
  tide.recompute = orig
  if not ok then error(err, 0) end
  -- the plan's summary says what auto chose for the step's sequences
  local d = plan.describe(m.cfg, { seq_len = 8, tokens_per_step = 16, dtype = "f64", budget = need - 1 })
  T.ok(d:find("recompute = auto (layer)", 1, true), d)
  local a = plan.activation_bytes(m.cfg, 8, { recompute = "auto", dtype = "f64", rows = 2, budget = need })
  T.eq(a.recompute, "none", "activation_bytes resolves auto")
  T.eq(a.auto.need, need, "and reports the need")
  local dm = tide.device_memory("cpu")
  T.ok(dm.free > 0 and dm.total >= dm.free, string.format("cpu memory free %s of %s", dm.free, dm.total))
  T.raises(function() tide.device_memory("cuda:7") end, "device memory: device cuda:7 is not available")
  T.raises(function() plan.auto_recompute(m.cfg, 2, 8, { dtype = "f64", budget = "lots" }) end, "budget must be a number")
  T.raises(function() m:set_recompute("auto", -1) end, "recompute budget")
  T.raises(function() plan.auto_recompute(m.cfg, 0, 8) end, "rows")
end)

T.test("the recompute option is validated by name", function()
  T.raises(function() model(34, { recompute = "full" }) end, "recompute must be \"auto\", \"layer\", \"selective\" or \"none\", got \"full\"")
  T.raises(function() model(34, { recompute = true }) end, "recompute must be")
  local m = model(34)
  T.raises(function() m:set_recompute("layers") end, "recompute must be")
  T.eq(m.cfg.recompute, "auto", "a rejected mode changes nothing")
end)

T.run()
