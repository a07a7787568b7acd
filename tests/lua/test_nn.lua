-- nn: Module bookkeeping, HuggingFace names, initialisation, each layer against its formula,
-- causality, decode == prefill, state dicts.
local T = require "tide.testing"
local tide = require "tide"
local nn = tide.nn
local F = tide.F

local function small(opts)
  local cfg = { vocab_size = 320, dim = 16, n_layers = 2, n_heads = 2, dtype = "f64" }
  for k, v in pairs(opts or {}) do cfg[k] = v end
  return nn.TransformerLM(cfg)
end

local max_abs_diff = T.max_abs_diff

local function ids(rows, dtype)
  return tide.tensor(rows, { dtype = dtype or "i32" })
end

T.test("HuggingFace names, in order, untied head", function()
  tide.manual_seed(1)
  local m = small()
  local names = {}
  for name in m:named_parameters() do names[#names + 1] = name end
  local want = { "model.embed_tokens.weight" }
  for l = 0, 1 do
    local p = "model.layers." .. l .. "."
    for _, s in ipairs({ "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
      "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight" }) do
      want[#want + 1] = p .. s
    end
  end
  want[#want + 1] = "model.norm.weight"
  want[#want + 1] = "lm_head.weight"
  T.eq(names, want)
  T.eq(m.lm_head.weight:shape(), { 320, 16 })
  T.eq(m.model.layers:get(2).mlp.down_proj.weight:shape(), { 16, 64 })   -- ffn: 8/3·16 rounded up to 32s
end)

T.test("parameter count equals the closed form; tied head shares the table", function()
  tide.manual_seed(1)
  local V, d, L, ffn = 320, 16, 2, 64
  local per_layer = 4 * d * d + 3 * d * ffn + 2 * d
  local untied = small()
  T.eq(untied:num_parameters(), V * d + L * per_layer + d + V * d)
  local tied = small({ tie_embeddings = true })
  T.eq(tied:num_parameters(), V * d + L * per_layer + d)
  T.ok(tied.lm_head == nil)
  local sd = tied:state_dict()
  T.ok(sd["lm_head.weight"] == nil, "a tied model writes no lm_head.weight")
  -- the head reads the embedding table: changing the table changes the logits
  local x = ids({ { 1, 2, 3 } })
  local before = tied:forward(x)
  tied.model.embed_tokens.weight:scale_(2)
  T.ok(max_abs_diff(before, tied:forward(x)) > 1e-6)
end)

T.test("initialisation: N(0, 0.02²), output projections N(0, 0.02²/(2L)), gains 1", function()
  tide.manual_seed(3)
  local m = nn.TransformerLM({ vocab_size = 320, dim = 64, n_layers = 4, n_heads = 4 })
  local function std(t)
    local n = t:numel()
    return math.sqrt(t:sum_squares() / n)
  end
  local emb = std(m.model.embed_tokens.weight)          -- 20,480 samples: rel. s.e. ~0.5%
  T.near(emb, 0.02, 0.02 * 0.03)
  T.near(std(m.model.layers:get(1).self_attn.q_proj.weight), 0.02, 0.02 * 0.05)
  local out = 0.02 / math.sqrt(2 * 4)
  T.near(std(m.model.layers:get(3).self_attn.o_proj.weight), out, out * 0.05)
  T.near(std(m.model.layers:get(2).mlp.down_proj.weight), out, out * 0.05)
  T.eq(m.model.norm.weight:tolist()[7], 1)
  T.eq(m.model.layers:get(4).input_layernorm.weight:sum():item(), 64)
end)

T.test("F.linear: the bias in the GEMM equals matmul + add (values and gradients); bad shapes name both", function()
  tide.manual_seed(11)
  local x = tide.randn({ 3, 7, 6 }):requires_grad_(true)
  local w = tide.randn({ 5, 6 }):requires_grad_(true)
  local b = tide.randn({ 5 }):requires_grad_(true)
  local g = tide.randn({ 3, 7, 5 })
  F.linear(x, w, b):backward(g)
  local y1, gx1, gw1, gb1 = F.linear(x, w, b):tolist(), x:grad():tolist(), w:grad():tolist(), b:grad():tolist()
  x:zero_grad(); w:zero_grad(); b:zero_grad()
  local y2 = F.matmul(x, w, false, true) + b
  y2:backward(g)
  local function close(a, c, what)
    local worst = 0
    for i = 1, #a do worst = math.max(worst, math.abs(a[i] - c[i])) end
    T.ok(#a == #c and worst < 1e-5, what .. " differs by " .. worst)
  end
  close(y1, y2:tolist(), "y")
  close(gx1, x:grad():tolist(), "dx")
  close(gw1, w:grad():tolist(), "dW")
  close(gb1, b:grad():tolist(), "db")
  T.raises(function() F.linear(x, tide.randn({ 5, 4 })) end, "linear: x is [3, 7, 6] but weight is [5, 4]: in_features differ (6 vs 4)")
  T.raises(function() F.linear(x, w, tide.randn({ 6 })) end, "linear: bias is [6] but weight is [5, 6]")
  T.raises(function() F.linear(x, tide.randn({ 30 })) end, "weight is [30]; it must be 2-D")
end)

T.test("Linear, RMSNorm, LayerNorm and the SwiGLU MLP equal their formulas", function()
  tide.manual_seed(5)
  local x = tide.randn({ 2, 3, 4 }, { dtype = "f64" })
  local lin = nn.Linear(4, 5, { bias = true, dtype = "f64" })
  lin.bias:copy_({ 1, 2, 3, 4, 5 })
  local xs, w, y = x:tolist(), lin.weight:tolist(), lin:forward(x):tolist()
  local worst = 0
  for r = 0, 5 do
    for o = 0, 4 do
      local s = o + 1
      for i = 0, 3 do s = s + xs[r * 4 + i + 1] * w[o * 4 + i + 1] end
      worst = math.max(worst, math.abs(s - y[r * 5 + o + 1]))
    end
  end
  T.ok(worst < 1e-12, "Linear differs by " .. worst)

  local norm = nn.RMSNorm(4, { eps = 1e-5, dtype = "f64" })
  norm.weight:copy_({ 0.5, 1, 1.5, 2 })
  local got = norm:forward(x):tolist()
  worst = 0
  for r = 0, 5 do
    local ms = 0
    for i = 1, 4 do ms = ms + xs[r * 4 + i] ^ 2 end
    local inv = 1 / math.sqrt(ms / 4 + 1e-5)
    for i = 1, 4 do worst = math.max(worst, math.abs(xs[r * 4 + i] * inv * (0.5 * i) - got[r * 4 + i])) end
  end
  T.ok(worst < 1e-12, "RMSNorm differs by " .. worst)

  local ln = nn.LayerNorm(4, { dtype = "f64" })
  ln.bias:copy_({ 0.1, 0.2, 0.3, 0.4 })
  got = ln:forward(x):tolist()
  worst = 0
  for r = 0, 5 do
    local mu, var = 0, 0
    for i = 1, 4 do mu = mu + xs[r * 4 + i] / 4 end
    for i = 1, 4 do var = var + (xs[r * 4 + i] - mu) ^ 2 / 4 end
    for i = 1, 4 do
      local want = (xs[r * 4 + i] - mu) / math.sqrt(var + 1e-5) + 0.1 * i
      worst = math.max(worst, math.abs(want - got[r * 4 + i]))
    end
  end
  T.ok(worst < 1e-12, "LayerNorm differs by " .. worst)

  local mlp = nn.MLP(4, 6, { dtype = "f64" })
  local want = mlp.down_proj:forward(mlp.gate_proj:forward(x):silu() * mlp.up_proj:forward(x))
  T.ok(max_abs_diff(mlp:forward(x), want) < 1e-14)
end)

T.test("attention is causal: a later token never changes earlier outputs", function()
  tide.manual_seed(7)
  local m = small()
  local a = m:forward(ids({ { 10, 20, 30, 40, 50, 60 } }))
  local b = m:forward(ids({ { 10, 20, 30, 99, 98, 97 } }))
  local A, B = a:narrow(2, 1, 3), b:narrow(2, 1, 3)
  T.eq(max_abs_diff(A, B), 0)
  T.ok(max_abs_diff(a:narrow(2, 4, 1), b:narrow(2, 4, 1)) > 1e-6)
end)

T.test("decode with the key/value cache equals the full forward (f64, 1e-12)", function()
  tide.manual_seed(9)
  local m = small()
  local seq = { 5, 17, 200, 256, 3, 77, 41, 9 }
  local full = m:forward(ids({ seq }))
  tide.no_grad(function()
    local cache = m:new_cache()
    local pre = m:forward(ids({ { seq[1], seq[2], seq[3] } }), cache)   -- prefill 3
    T.ok(max_abs_diff(pre, full:narrow(2, 1, 3)) < 1e-12)
    for t = 4, #seq do
      local step = m:forward(ids({ { seq[t] } }), cache)               -- then one token at a time
      local d = max_abs_diff(step, full:narrow(2, t, 1))
      T.ok(d < 1e-12, "position " .. t .. " differs by " .. d)
    end
    T.eq(cache[1].pos, #seq)
  end)
end)

T.test("gradient check of an attention block and of the model loss (f64)", function()
  tide.manual_seed(11)
  local attn = nn.Attention(8, 2, { dtype = "f64" })
  local x = tide.randn({ 1, 5, 8 }, { dtype = "f64", requires_grad = true })
  T.gradcheck(function(v) return attn:forward(v) end, { x })
  local m = small({ n_layers = 1, vocab_size = 300 })
  local w = m.model.layers:get(1).self_attn.q_proj.weight
  local inp, tgt = ids({ { 1, 2, 3, 4 } }), ids({ { 2, 3, 4, 5 } })
  T.gradcheck(function(_) return m:loss(inp, tgt) end, { w }, { max_checks = 40 })
end)

T.test("state_dict round trip; errors name missing, unexpected and mis-shaped tensors", function()
  tide.manual_seed(13)
  local a = small()
  tide.manual_seed(14)
  local b = small()
  local x = ids({ { 1, 2, 3, 4 } })
  T.ok(max_abs_diff(a:forward(x), b:forward(x)) > 1e-6)
  b:load_state_dict(a:state_dict())
  T.eq(max_abs_diff(a:forward(x), b:forward(x)), 0)
  -- names are the checkpoint order
  local names = a:state_names()
  T.eq(names[1], "model.embed_tokens.weight")
  T.eq(names[#names], "lm_head.weight")

  local sd = a:state_dict()
  sd["model.norm.weight"] = nil
  T.raises(function() b:load_state_dict(sd) end, "missing model.norm.weight")
  sd = a:state_dict()
  sd["model.layers.9.mlp.up_proj.weight"] = tide.zeros({ 2 })
  T.raises(function() b:load_state_dict(sd) end, "unexpected model.layers.9.mlp.up_proj.weight")
  local missing, unexpected = b:load_state_dict(sd, false)
  T.eq(#missing, 0)
  T.eq(unexpected, { "model.layers.9.mlp.up_proj.weight" })
  sd = a:state_dict()
  sd["lm_head.weight"] = tide.zeros({ 16, 320 }, { dtype = "f64" })
  T.raises(function() b:load_state_dict(sd) end, "'lm_head.weight' is [16, 320] in the state dict but [320, 16] in the model")
  -- a tied model accepts (and ignores) the lm_head.weight HF checkpoints may carry
  local tied = small({ tie_embeddings = true })
  local tsd = tied:state_dict()
  tsd["lm_head.weight"] = tsd["model.embed_tokens.weight"]
  tied:load_state_dict(tsd)
end)

T.test("train/eval, children, zero_grad, config errors", function()
  local m = small()
  T.ok(m.training and m.model.layers:get(2).mlp.training)
  m:eval()
  T.ok(not m.training and not m.model.layers:get(2).mlp.training)
  m:train()
  T.ok(m.model.norm.training)
  local kids = {}
  for name in m:named_children() do kids[#kids + 1] = name end
  T.eq(kids, { "model", "lm_head" })
  T.eq(#m:modules(), 1 + 1 + 1 + 1 + 2 * (1 + 2 + 5 + 4) + 1 + 1)
  local loss = m:loss(ids({ { 1, 2 } }), ids({ { 2, 3 } }))
  loss:backward()
  T.ok(m.lm_head.weight:grad() ~= nil)
  m:zero_grad()
  T.ok(m.lm_head.weight:grad() == nil)
  T.raises(function() nn.TransformerLM({ dim = 16, n_layers = 1, n_heads = 2, widht = 3 }) end,
    "unknown key 'widht'; known keys:")
  T.raises(function() nn.TransformerLM({ dim = 18, n_heads = 4 }) end, "dim 18 is not divisible by n_heads 4")
  T.raises(function() nn.build({ kind = "moe" }) end, "unknown model kind 'moe'")
end)

T.test("sampling: greedy, temperature, top-k and top-p draw from the stated distributions", function()
  local generate = require "tide.generate"
  local logits = { 0, math.log(3), -1, -2 }
  T.eq(generate.sample(logits, { temperature = 0 }, 0.99), 1)
  T.eq(generate.sample(logits, { temperature = 1, top_k = 1 }, 0.99), 1)
  -- evenly spaced uniforms give the exact frequencies
  local function counts(opts, n)
    local c = { [0] = 0, 0, 0, 0 }
    for i = 0, n - 1 do
      local id = generate.sample(logits, opts, (i + 0.5) / n)
      c[id] = c[id] + 1
    end
    return c
  end
  local z = 1 + 3 + math.exp(-1) + math.exp(-2)
  local c = counts({ temperature = 1 }, 10000)
  T.near(c[1] / 10000, 3 / z, 2e-4)
  T.near(c[3] / 10000, math.exp(-2) / z, 2e-4)
  c = counts({ temperature = 1, top_k = 2 }, 1000)
  T.eq({ c[0], c[1], c[2], c[3] }, { 250, 750, 0, 0 })
  -- top-p 0.7: {0.664, 0.221, ...} keeps the two most likely (0.664 < 0.7 <= 0.885)
  c = counts({ temperature = 1, top_p = 0.7 }, 1000)
  T.eq({ c[0], c[1], c[2], c[3] }, { 250, 750, 0, 0 })
  c = counts({ temperature = 1, top_p = 0.5 }, 100)
  T.eq(c[1], 100)
  -- a high temperature flattens the distribution
  c = counts({ temperature = 100 }, 1000)
  T.ok(c[3] > 230 and c[1] < 270)
end)

T.test("greedy generation with the cache equals argmax over full forwards", function()
  tide.manual_seed(21)
  local m = small({ vocab_size = 300 })
  local tok = require("tide.data.tokenizer").byte_level({ vocab_size = 300 })
  local gen = require "tide.generate"
  local text, all = gen.generate(m, tok, { prompt = "ab", max_new_tokens = 12, temperature = 0, stop = false })
  T.eq(#all, 14)
  local seq = { 97, 98 }
  for _ = 1, 12 do
    local logits = m:forward(ids({ seq })):narrow(2, #seq, 1):tolist()
    local best = 1
    for i = 2, #logits do if logits[i] > logits[best] then best = i end end
    seq[#seq + 1] = best - 1
  end
  T.eq(all, seq)
  -- sampling is reproducible from its seed and leaves the global RNG alone
  local s0, o0 = tide.rng_state()
  local a = gen.generate(m, tok, { prompt = "ab", max_new_tokens = 10, temperature = 1, seed = 5, stop = false })
  local b = gen.generate(m, tok, { prompt = "ab", max_new_tokens = 10, temperature = 1, seed = 5, stop = false })
  T.eq(a, b)
  local s1, o1 = tide.rng_state()
  T.eq({ s1, o1 }, { s0, o0 })
  -- past the window the cache restarts from the last half and generation goes on
  local _, long = gen.generate(m, tok, { prompt = "ab", max_new_tokens = 20, temperature = 0, stop = false, window = 8 })
  T.eq(#long, 22)
end)

T.run()
