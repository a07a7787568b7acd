-- optim: AdamW against its closed form, decay groups, clipping, non-finite detection, schedules
-- (spec/optim.md test oracles 1, 6, 7, 8).
local T = require "tide.testing"
local tide = require "tide"
local optim = require "tide.optim"
local schedule = require "tide.schedule"

T.test("AdamW: 3 steps with a fixed gradient sequence equal the closed form (f64, 1e-12)", function()
  local w0 = { 0.5, -1.25, 2.0, 0.125 }
  local W = tide.tensor({ { 0.5, -1.25 }, { 2.0, 0.125 } }, { dtype = "f64", requires_grad = true })
  local b0 = { 0.3, -0.7 }
  local Bv = tide.tensor(b0, { dtype = "f64", requires_grad = true })
  local lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
  local opt = optim.AdamW({ { "w", W }, { "b", Bv } }, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd })
  local grads = { { 0.1, -0.2, 0.3, 1.5 }, { -0.05, 0.4, 0.0, 2.0 }, { 0.7, 0.1, -0.3, -1.0 } }
  local bgrads = { { 1, -1 }, { 0.5, 0.25 }, { -2, 3 } }
  local function reference(x0, gs, decay)
    local x, m, v = {}, {}, {}
    for i = 1, #x0 do x[i], m[i], v[i] = x0[i], 0, 0 end
    for t = 0, #gs - 1 do
      local g = gs[t + 1]
      for i = 1, #x do
        m[i] = b1 * m[i] + (1 - b1) * g[i]
        v[i] = b2 * v[i] + (1 - b2) * g[i] ^ 2
        local mh, vh = m[i] / (1 - b1 ^ (t + 1)), v[i] / (1 - b2 ^ (t + 1))
        if decay then x[i] = x[i] - lr * wd * x[i] end
        x[i] = x[i] - lr * mh / (math.sqrt(vh) + eps)
      end
    end
    return x
  end
  for t = 1, 3 do
    W:set_grad(tide.tensor(grads[t], { dtype = "f64", shape = { 2, 2 } }))
    Bv:set_grad(tide.tensor(bgrads[t], { dtype = "f64" }))
    opt:step()
    opt:zero_grad()
  end
  T.eq(opt.t, 3)
  T.near(W:tolist(), reference(w0, grads, true), 1e-12)
  T.near(Bv:tolist(), reference(b0, bgrads, false), 1e-12)
end)

T.test("AdamW with g = 0: decay weights scale by (1 - lr·wd), no-decay weights stay bitwise", function()
  local W = tide.tensor({ { 1.5, -2.0 }, { 0.25, 3.0 } }, { dtype = "f64", requires_grad = true })
  local g = tide.tensor({ 0.75, -0.5 }, { dtype = "f64", requires_grad = true })
  local opt = optim.AdamW({ { "w", W }, { "norm.weight", g } }, { lr = 0.05, weight_decay = 0.2 })
  W:set_grad(tide.zeros({ 2, 2 }, { dtype = "f64" }))
  g:set_grad(tide.zeros({ 2 }, { dtype = "f64" }))
  opt:step()
  T.near(W:tolist(), { 1.5 * 0.99, -2.0 * 0.99, 0.25 * 0.99, 3.0 * 0.99 }, 1e-15)
  T.eq(g:tolist(), { 0.75, -0.5 })
end)

T.test("decay groups: matrices decay; norms, biases and the embedding table do not", function()
  tide.manual_seed(1)
  local m = tide.nn.TransformerLM({ vocab_size = 320, dim = 16, n_layers = 1, n_heads = 2 })
  local opt = optim.AdamW(m, {})
  local decay, no_decay = opt:group_names()
  T.eq(decay, { "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "lm_head.weight" })
  T.eq(no_decay, { "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight" })
  -- a recipe pattern moves the head out of the decay group
  local opt2 = optim.AdamW(m, { no_decay = { "^lm_head%." } })
  local d2 = opt2:group_names()
  T.eq(#d2, 7)
  -- state tensors carry the checkpoint names
  local names = opt:state_tensors()
  T.eq(names[1], "model.embed_tokens.weight.adam_m")
  T.eq(names[2], "model.embed_tokens.weight.adam_v")
  T.raises(function() optim.AdamW(m, { lr = 1e-3, weight_decy = 0.1 }) end, "unknown key 'weight_decy'")
  T.raises(function() optim.AdamW(m, { betas = { 0.9, 1.5 } }) end, "betas must lie in [0, 1)")
end)

T.test("clipping: the norm becomes c when above it, gradients stay bitwise otherwise", function()
  local a = tide.tensor({ 3, 4 }, { dtype = "f64", requires_grad = true })
  local b = tide.tensor({ { 12 } }, { dtype = "f64", requires_grad = true })
  local params = { { name = "a", param = a }, { name = "b", param = b } }
  a:set_grad(tide.tensor({ 3, 4 }, { dtype = "f64" }))
  b:set_grad(tide.tensor({ { 12 } }, { dtype = "f64" }))
  local norm = optim.clip_grad_norm(params, 1.0)
  T.near(norm, 13, 1e-15)
  T.near(optim.grad_norm(params), 1.0, 1e-6)
  T.near(a:grad():tolist()[1] / a:grad():tolist()[2], 0.75, 1e-15)   -- direction kept
  a:set_grad(tide.tensor({ 0.3, 0.4 }, { dtype = "f64" }))
  b:set_grad(tide.tensor({ { 0.0 } }, { dtype = "f64" }))
  T.near(optim.clip_grad_norm(params, 1.0), 0.5, 1e-15)
  T.eq(a:grad():tolist(), { 0.3, 0.4 })
end)

T.test("a NaN in one gradient makes the norm non-finite and is found by name", function()
  local a = tide.tensor({ 1, 2 }, { requires_grad = true })
  local b = tide.tensor({ 1, 2 }, { requires_grad = true })
  local params = { { name = "first", param = a }, { name = "second", param = b } }
  a:set_grad(tide.tensor({ 1, 1 }))
  b:set_grad(tide.tensor({ 0 / 0, 1 }))
  local norm = optim.clip_grad_norm(params, 1.0)
  T.ok(norm ~= norm, "norm is NaN")
  T.eq(optim.first_nonfinite(params), "second")
  T.eq(a:grad():tolist(), { 1, 1 }, "a non-finite norm leaves gradients alone")
end)

T.test("AdamW:step answers whether the update stayed finite; first_nonfinite names the weight or the state", function()
  local W = tide.tensor({ { 0.5, -1.0 }, { 2.0, 0.25 } }, { requires_grad = true })
  local b = tide.tensor({ 0.3, -0.7 }, { requires_grad = true })
  local opt = optim.AdamW({ { "w", W }, { "b", b } }, { lr = 1e-2 })
  local function grads(gw, gb)
    W:set_grad(tide.tensor(gw, { shape = { 2, 2 } }))
    b:set_grad(tide.tensor(gb))
  end
  grads({ 0.1, -0.2, 0.3, 1.5 }, { 1, -1 })
  T.eq(opt:step(), true, "a clean update")
  T.eq(opt:first_nonfinite(), nil)
  -- f32 weights overflow when stored (lr 1e300): the flag trips although every input was finite
  grads({ 0.1, -0.2, 0.3, 1.5 }, { 1, -1 })
  T.eq(opt:step(1e300), false, "lr 1e300")
  T.eq(opt:first_nonfinite(), "weight w")
  -- only v of b overflows (a 1e30 gradient: v = 0.05e60 in double, inf as f32); the weights stay finite
  for _, p in ipairs(opt.params) do p.m:zero_(); p.v:zero_() end
  W:copy_(tide.tensor({ { 0.5, -1.0 }, { 2.0, 0.25 } }))
  b:copy_(tide.tensor({ 0.3, -0.7 }))
  grads({ 0.1, -0.2, 0.3, 1.5 }, { 1e30, -1 })
  T.eq(opt:step(), false, "v overflows")
  T.ok(W:all_finite() and b:all_finite(), "the weights are finite")
  T.eq(opt:first_nonfinite(), "AdamW state b.adam_v")
  -- the flag was read and cleared: a clean state updates clean again
  for _, p in ipairs(opt.params) do p.m:zero_(); p.v:zero_() end
  grads({ 0.1, -0.2, 0.3, 1.5 }, { 1, -1 })
  T.eq(opt:step(), true, "clean again")
  -- a NaN gradient (the step's guard skips those before the update; the kernel still reports it)
  grads({ 0.1, 0 / 0, 0.3, 1.5 }, { 1, -1 })
  T.eq(opt:step(), false, "NaN gradient")
  T.eq(opt:first_nonfinite(), "weight w")
end)

T.test("WSD schedule: the closed form at the spec's check points (1e-12)", function()
  local lr, lmin, Sw, Sd, Se = 3e-3, 3e-4, 30, 240, 300
  local f = schedule.new({ kind = "wsd", warmup = Sw, decay_start = Sd, decay_end = Se, min_lr = lmin }, lr, 300)
  local function want(t)
    if t < Sw then return lr * (t + 1) / Sw end
    if t < Sd then return lr end
    if t < Se then return lmin + (lr - lmin) * 0.5 * (1 + math.cos(math.pi * (t - Sd) / (Se - Sd))) end
    return lmin
  end
  for _, t in ipairs({ 0, Sw - 1, Sw, Sd, (Sd + Se) / 2, Se - 1, Se, Se + 50 }) do
    T.near(f(t), want(t), 1e-12, "t = " .. t)
  end
  T.near(f(0), 1e-4, 1e-15)
  T.near(f(270), (lr + lmin) / 2, 1e-15)
  local lin = schedule.new({ kind = "wsd", warmup = 0, decay_start = 10, decay_end = 20, min_lr = 0, decay = "linear" }, 1, 20)
  T.near(lin(15), 0.5, 1e-15)
  T.near(lin(5), 1, 0)
end)

T.test("cosine and constant schedules; bad settings are errors", function()
  local f = schedule.new({ kind = "cosine", warmup = 10, min_lr = 0.1 }, 1.0, 110)
  T.near(f(9), 1.0, 1e-15)
  T.near(f(10), 1.0, 1e-15)
  T.near(f(60), 0.55, 1e-12)
  T.near(f(110), 0.1, 0)
  local c = schedule.new({ kind = "constant", warmup = 4 }, 2.0, 100)
  T.near(c(1), 1.0, 1e-15)
  T.near(c(99), 2.0, 0)
  T.raises(function() schedule.new({ kind = "wsd", warmup = 50, decay_start = 40, decay_end = 60 }, 1, 60) end,
    "need warmup <= decay_start < decay_end, got 50, 40, 60")
  T.raises(function() schedule.new({ kind = "step" }, 1, 10) end, "kind must be one of wsd, cosine, constant")
  T.raises(function() schedule.new({ warmpu = 3 }, 1, 10) end, "unknown key 'warmpu'")
end)

T.run()
