-- attnres: the Lua side of Attention Residuals (spec/attnres.md) — F.attnres and nn.AttnRes (names, init, decay
-- groups, gradients), and the residual strategies of nn.Residual on a stack of cheap stand-in sublayers:
-- Block AttnRes loop == explicit source bookkeeping (oracle 3), an end-to-end f64 gradient check (oracle 4), the
-- gamma chain (oracle 6), and the config errors.
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F
local optim = require "tide.optim"

local function randn(shape, std) return tide.randn(shape, { dtype = "f64", std = std or 1 }) end

local max_abs_diff, max_abs = T.max_abs_diff, T.max_abs

-- a module that only holds what a residual strategy attaches (a layer, or the model body)
local Holder = nn.Module:extend("Holder")

-- ---- F.attnres and nn.AttnRes ---------------------------------------------------------------------------------

T.test("F.attnres: w = 0 is the mean of the sources (f64 1e-15), w [1, d] == w [d], one source is the identity", function()
  tide.manual_seed(1)
  local d = 8
  local v = { randn({ 2, 3, d }), randn({ 2, 3, d }), randn({ 2, 3, d }), randn({ 2, 3, d }) }
  local nu = randn({ d }) + 1
  local mean = (v[1] + v[2] + v[3] + v[4]) * 0.25
  T.ok(max_abs_diff(F.attnres(v, tide.zeros({ d }, { dtype = "f64" }), nu), mean) <= 1e-15, "w = 0 mean")
  local w = randn({ d })
  local a, b = F.attnres(v, w, nu, { eps = 1e-6 }), F.attnres(v, w:reshape(1, d), nu, { eps = 1e-6 })
  T.eq(a, b)
  T.ok(max_abs_diff(a, mean) > 0.05, "a random w mixes differently from the mean")
  T.eq(F.attnres({ v[2] }, w, nu), v[2])
end)

T.test("F.attnres: f64 gradient check of every source, w and nu (atol 1e-8)", function()
  tide.manual_seed(2)
  local d = 5
  local v1, v2, v3 = randn({ 3, d }), randn({ 3, d }, 2), randn({ 3, d }, 0.5)
  local w, nu = randn({ d }), randn({ d }) + 1
  for _, x in ipairs({ v1, v2, v3, w, nu }) do x:requires_grad_(true) end
  local worst = T.gradcheck(function(a, b, c, ww, nn_) return F.attnres({ a, b, c }, ww, nn_) end, { v1, v2, v3, w, nu },
    { atol = 1e-8, rtol = 1e-7 })
  T.ok(worst <= 1e-8, "max error " .. worst)
end)

T.test("F.attnres: an f32 row's output and source gradients are the same bits wherever it sits (8-row blocks in "
  .. "vector lanes, the rest of the rows one by one; d = 13 leaves a tail of channels)", function()
  tide.manual_seed(7)
  local rows, d, n = 13, 13, 3
  local v = {}
  for i = 1, n do v[i] = tide.randn({ rows, d }) end
  local w, nu, g = tide.randn({ d }), tide.randn({ d }) + 1, tide.randn({ rows, d })
  -- the rows in the order perm (0-based original indices): output and source gradients
  local function run(perm)
    local idx = tide.tensor(perm, { dtype = "i64" })
    local vs = {}
    for i = 1, n do vs[i] = F.index_select(v[i], 1, idx):detach():requires_grad_(true) end
    local y = F.attnres(vs, w, nu)
    y:backward(F.index_select(g, 1, idx))
    local out = { y:detach() }
    for i = 1, n do out[#out + 1] = vs[i]:grad() end
    return out
  end
  local id, shifted = {}, {}
  for j = 0, rows - 1 do id[j + 1], shifted[j + 1] = j, (j + 5) % rows end
  local a, b = run(id), run(shifted)
  local back = tide.tensor(shifted, { dtype = "i64" })
  for k = 1, #a do T.eq(b[k], F.index_select(a[k], 1, back), "tensor " .. k) end
end)

T.test("F.attnres: bad arguments name the op and the argument", function()
  local d = 4
  local v = { randn({ 2, d }), randn({ 3, d }) }
  local w, nu = randn({ d }), randn({ d })
  T.raises(function() F.attnres({}, w, nu) end, "attnres: sources must be a non-empty table")
  T.raises(function() F.attnres(v[1], w, nu) end, "attnres: sources must be a non-empty table")
  T.raises(function() F.attnres(v, w, nu) end, "attnres: source 2 is [3, 4] but source 1 is [2, 4]")
  T.raises(function() F.attnres({ v[1] }, randn({ 2, d }), nu) end, "attnres: a 2-d w must be [1, d], got [2, 4]")
  T.raises(function() F.attnres({ v[1] }, randn({ d + 1 }), nu) end, "attnres: w is [5] and nu is [4]")
  T.raises(function() F.attnres({ v[1] }, w, nu, { epsilon = 1 }) end, "attnres: unknown key 'epsilon'")
  T.raises(function() F.attnres({ v[1] }, w, nu, { eps = -1 }) end, "attnres: eps must be finite and >= 0")
end)

T.test("nn.AttnRes: proj [1, d] = 0 and norm [d] = 1, checkpoint names when attached, no weight decay", function()
  local ar = nn.AttnRes(6, { dtype = "f64" })
  T.eq(ar:state_names(), { "proj.weight", "norm.weight" })
  T.eq(ar.proj.weight:shape(), { 1, 6 })
  T.eq(max_abs(ar.proj.weight), 0)
  T.eq(ar.norm.weight:tolist(), { 1, 1, 1, 1, 1, 1 })
  local layer = Holder()
  local site = nn.AttnRes.attach(layer, "self_attention_res", 6)
  T.ok(layer.self_attention_res == site, "the site is reachable as layer.self_attention_res")
  nn.AttnRes.attach(layer, "mlp_res", 6)
  T.eq(layer:state_names(), { "self_attention_res_proj.weight", "self_attention_res_norm.weight", "mlp_res_proj.weight",
    "mlp_res_norm.weight" })
  local decay, no_decay = optim.AdamW(layer, {}):group_names()
  T.eq(decay, {})
  T.eq(#no_decay, 4)
  -- at init the mix is the mean, whatever the sources (§1: the PreNorm-like start)
  tide.manual_seed(3)
  local v = { randn({ 3, 6 }), randn({ 3, 6 }, 3) }
  T.ok(max_abs_diff(ar:forward(v), (v[1] + v[2]) * 0.5) <= 1e-15, "init mix == mean")
  T.raises(function() nn.AttnRes(0) end, "nn.AttnRes: d must be a positive integer, got 0")
  T.raises(function() nn.AttnRes(4, { epsilon = 1 }) end, "nn.AttnRes: unknown key 'epsilon'")
end)

-- ---- a toy stack over a residual strategy ------------------------------------------------------------------
-- stand-in sublayers: mixer(xn) = tanh(xn W_m), ffn(h) = tanh(RMSNorm(h) W_f), all f64
local function make_stack(kind, L, d, ropts)
  ropts = ropts or {}
  ropts.dim, ropts.n_layers, ropts.dtype = d, L, "f64"
  local res = nn.Residual(kind, ropts)
  local layers = {}
  for l = 1, L do
    local layer = Holder()
    res:attach_layer(layer, l)
    layer.Wm = randn({ d, d }, 0.8 / math.sqrt(d))
    layer.Wf = randn({ d, d }, 0.8 / math.sqrt(d))
    layers[l] = layer
  end
  local model = Holder()
  res:attach_model(model)
  return { res = res, layers = layers, model = model, ones = tide.ones({ d }, { dtype = "f64" }) }
end

-- the same stand-in weights under another strategy
local function same_weights(s, kind, ropts)
  local L, d = #s.layers, s.layers[1].Wm:size(1)
  local t = make_stack(kind, L, d, ropts)
  for l = 1, L do t.layers[l].Wm, t.layers[l].Wf = s.layers[l].Wm, s.layers[l].Wf end
  return t
end

local function mixer(s, l, xn) return xn:matmul(s.layers[l].Wm):tanh() end
local function ffn(s, l, h) return F.rmsnorm(h, s.ones, 1e-5):matmul(s.layers[l].Wf):tanh() end

-- the layer loop of the interface; record(l, m, f, xn, st) sees every layer
local function run(s, x0, record)
  local res = s.res
  local st = res:begin(x0)
  for l = 1, #s.layers do
    local h = res:before_mixer(st, l)
    local xn = F.rmsnorm(h, s.ones, 1e-5)
    local m = mixer(s, l, xn)
    h = res:before_ffn(st, l, m, xn)
    local f = ffn(s, l, h)
    res:after_ffn(st, l, f)
    if record then record(l, m, f, xn, st) end
  end
  return res:final(st), st
end

-- every AttnRes site gets a random w and ν, so no mix is the plain mean
local function randomize(s)
  for _, holder in ipairs({ s.model, unpack(s.layers) }) do
    for name, t in holder:named_parameters() do
      if name:find("_proj.weight", 1, true) then t:copy_(randn(t:shape(), 0.7))
      elseif name:find("_norm.weight", 1, true) then t:copy_(randn(t:shape(), 0.2) + 1) end
    end
  end
end

-- attnres.md §3, "equivalent explicit form": sublayer by sublayer, the sources written out from the outputs so far.
-- out[l] = {m = mixer output, f = FFN output} of layer l (1-based). Plain functions, no closures over `out`: a
-- JIT trace keeps the closures it was recorded with alive, and their upvalues with them.
local function sum_layers(out, a, b, with_m_of)   -- Σ m and f of layers a..b, plus m of layer with_m_of
  local acc
  for l = a, b do
    acc = acc and acc + out[l].m or out[l].m
    acc = acc + out[l].f
  end
  if with_m_of then acc = acc and acc + out[with_m_of].m or out[with_m_of].m end
  return acc
end

-- the sources of a sublayer of 0-based layer l0: the embedding, every block ending at or before l0 − 1, and the
-- partial sum of the current block's finished sublayers (with this layer's mixer output for the FFN: ffn_of)
local function explicit_sources(out, x0, B, l0, ffn_of)
  local src = { x0 }
  local nb = math.floor(l0 / B)
  for j = 1, nb do src[#src + 1] = sum_layers(out, (j - 1) * B + 1, j * B) end
  if nb * B + 1 <= l0 or ffn_of then src[#src + 1] = sum_layers(out, nb * B + 1, l0, ffn_of) end
  return src
end

local function explicit_mix(site, src) return #src == 1 and src[1] or site:forward(src) end

local function explicit_block(s, x0, B)
  local L, out = #s.layers, {}
  for l = 1, L do
    local layer = s.layers[l]
    local h = explicit_mix(layer.self_attention_res, explicit_sources(out, x0, B, l - 1))
    out[l] = { m = mixer(s, l, F.rmsnorm(h, s.ones, 1e-5)) }
    h = explicit_mix(layer.mlp_res, explicit_sources(out, x0, B, l - 1, l))
    out[l].f = ffn(s, l, h)
  end
  local final_src = explicit_sources(out, x0, B, L)
  return s.model.output_attn_res:forward(final_src), #final_src
end

for _, c in ipairs({ { L = 7, B = 3 }, { L = 93, B = 12 } }) do
  T.test(string.format("Block AttnRes: loop == explicit sources, L = %d, B = %d (f64 1e-12; ⌈L/B⌉ + 1 final sources)",
    c.L, c.B), function()
    tide.manual_seed(10 + c.L)
    local d = 4
    local s = make_stack("attnres_block", c.L, d, { block_layers = c.B })
    randomize(s)
    local x0 = randn({ 2, 3, d })
    local n_mix = 0
    local y, st = run(s, x0, function(l, _, _, _, st)
      n_mix = math.max(n_mix, #s.res:sources(st))
    end)
    local ye, n_final = explicit_block(s, x0, c.B)
    local n_want = math.ceil(c.L / c.B) + 1
    T.eq(#s.res:sources(st), n_want, "sources of the final mix (loop)")
    T.eq(n_final, n_want, "sources of the final mix (explicit)")
    T.ok(n_mix <= n_want, "no mix reads more than the final one")
    local diff = max_abs_diff(y, ye)
    T.ok(diff <= 1e-12, "loop vs explicit differ by " .. diff)
    T.ok(max_abs(y - x0) > 0.1, "the stack did something")
  end)
end

T.test("Block AttnRes: K3 blocks close at layers 0, 12, ..., 84 and a mix reads at most 9 sources", function()
  local s = make_stack("attnres_block", 93, 2, { block_layers = 12 })
  local st = s.res:begin(randn({ 1, 2 }))
  local closed, most = {}, 0
  for l = 1, 93 do
    local before = #st.blocks
    s.res:before_mixer(st, l)
    if #st.blocks > before then closed[#closed + 1] = l - 1 end
    local h = s.res:before_ffn(st, l, randn({ 1, 2 }))
    most = math.max(most, #s.res:sources(st))
    s.res:after_ffn(st, l, randn({ 1, 2 }))
    T.ok(h ~= nil)
  end
  T.eq(closed, { 0, 12, 24, 36, 48, 60, 72, 84 })
  T.eq(most, 9)
end)

T.test("Block AttnRes: f64 gradient check of a 3-layer stack, B = 2, through blocks, prefix and the final mix", function()
  tide.manual_seed(20)
  local d = 3
  local s = make_stack("attnres_block", 3, d, { block_layers = 2 })
  randomize(s)
  local x0 = randn({ 2, d }):requires_grad_(true)
  local inputs = { x0 }
  for _, holder in ipairs({ s.layers[1], s.layers[2], s.layers[3], s.model }) do
    for _, t in holder:named_parameters() do inputs[#inputs + 1] = t end
  end
  local W = s.layers[2].Wm:requires_grad_(true)
  inputs[#inputs + 1] = W
  T.eq(#inputs, 1 + 3 * 4 + 2 + 1)
  local worst = T.gradcheck(function() return (run(s, x0)) end, inputs, { atol = 1e-8, rtol = 1e-7 })
  T.ok(worst <= 1e-8, "max error " .. worst)
  -- every site that mixes gets a gradient; layer 1's attention site never mixes (one source: the embedding)
  T.ok(s.layers[1].self_attention_res_proj.weight:grad() == nil, "layer 1 reads the embedding directly")
  for _, t in ipairs({ s.layers[2].self_attention_res_proj.weight, s.layers[1].mlp_res_norm.weight,
    s.model.output_attn_res_proj.weight }) do
    T.ok(max_abs(t:grad()) > 1e-6, "a mixing site has a gradient")
  end
end)

T.test("Full AttnRes: loop == explicit mixes of every sublayer output so far, and an f64 gradient check", function()
  tide.manual_seed(30)
  local d, L = 3, 3
  local s = make_stack("attnres_full", L, d)
  randomize(s)
  local x0 = randn({ 2, d }):requires_grad_(true)
  local y, st = run(s, x0)
  T.eq(#st.ys, 2 * L + 1)
  -- explicit: sublayer k reads AttnRes(y_0 .. y_{k-1}) (§2)
  local ys = { x0 }
  for l = 1, L do
    local layer = s.layers[l]
    local h = #ys == 1 and ys[1] or layer.self_attention_res:forward(ys)
    ys[#ys + 1] = mixer(s, l, F.rmsnorm(h, s.ones, 1e-5))
    ys[#ys + 1] = ffn(s, l, layer.mlp_res:forward(ys))
  end
  T.ok(max_abs_diff(y, s.model.output_attn_res:forward(ys)) <= 1e-15, "loop vs explicit")
  local inputs = { x0 }
  for _, holder in ipairs({ s.layers[1], s.layers[2], s.layers[3], s.model }) do
    for _, t in holder:named_parameters() do inputs[#inputs + 1] = t end
  end
  local worst = T.gradcheck(function() return (run(s, x0)) end, inputs, { atol = 1e-8, rtol = 1e-7 })
  T.ok(worst <= 1e-8, "max error " .. worst)
end)

T.test("residual names: per-layer sites and model.output_attn_res_{norm,proj} (formats.md §2)", function()
  local s = make_stack("attnres_block", 2, 4, { block_layers = 2 })
  T.eq(s.layers[1]:state_names(), { "self_attention_res_proj.weight", "self_attention_res_norm.weight",
    "mlp_res_proj.weight", "mlp_res_norm.weight" })
  T.eq(s.model:state_names(), { "output_attn_res_proj.weight", "output_attn_res_norm.weight" })
  T.eq(s.model.output_attn_res_proj.weight:shape(), { 1, 4 })
  local g = make_stack("gamma_chain", 2, 4, { gamma_mode = "channel" })
  T.eq(g.layers[2]:state_names(), { "attn_gamma" })
  T.eq(g.layers[2].attn_gamma:shape(), { 4 })
  local gs = make_stack("gamma_chain", 2, 4)
  T.eq(gs.layers[1].attn_gamma:shape(), { 1 })
  local gt = make_stack("gamma_chain", 2, 4, { gamma_mode = "token" })
  T.eq(gt.layers[1]:state_names(), { "attn_gamma_proj.weight" })
  local _, no_decay = optim.AdamW(gt.layers[1], {}):group_names()
  T.eq(no_decay, { "attn_gamma_proj.weight" })
  T.eq(make_stack("prenorm", 2, 4).layers[1]:state_names(), {})
end)

-- ---- the gamma chain (§6) -----------------------------------------------------------------------------------
local MODES = { "scalar", "channel", "token" }

local function gamma_params(s)
  local out = {}
  for l = 1, #s.layers do
    for _, t in s.layers[l]:named_parameters() do out[#out + 1] = t end
  end
  return out
end

T.test("gamma chain: γ = 0 (the init) reproduces prenorm bitwise in all three modes", function()
  tide.manual_seed(40)
  local p = make_stack("prenorm", 5, 6)
  local x0 = randn({ 2, 3, 6 })
  local y = run(p, x0)
  for _, mode in ipairs(MODES) do
    local g = same_weights(p, "gamma_chain", { gamma_mode = mode })
    for _, t in ipairs(gamma_params(g)) do T.eq(max_abs(t), 0, mode .. ": γ starts at 0") end
    T.eq(run(g, x0), y, mode)
  end
end)

T.test("gamma chain: the unrolled form Σ_j (Π_{i>j} γ_i) m_j == the recurrence (f64 1e-12), all modes", function()
  for k, mode in ipairs(MODES) do
    tide.manual_seed(50 + k)
    local L, d = 6, 5
    local s = make_stack("gamma_chain", L, d, { gamma_mode = mode })
    for _, t in ipairs(gamma_params(s)) do t:copy_(randn(t:shape(), mode == "token" and 1.5 or 0.8)) end
    local ms, gammas, abar = {}, {}, {}
    run(s, randn({ 2, 3, d }), function(l, m, _, xn, st)
      ms[l], gammas[l], abar[l] = m, s.res:gamma(l, xn), st.abar
    end)
    for l = 1, L do
      local acc
      for j = 1, l do
        local term = ms[j]
        for i = j + 1, l do term = term * gammas[i] end
        acc = acc and acc + term or term
      end
      local diff = max_abs_diff(acc, abar[l])
      T.ok(diff <= 1e-12 * math.max(1, max_abs(acc)), string.format("%s layer %d: unrolled vs recurrence %.3g", mode, l, diff))
    end
    T.ok(max_abs(abar[L] - ms[L]) > 0.01, mode .. ": the chain carries earlier mixer outputs")
  end
end)

T.test("gamma chain: f64 gradient check of γ (scalar, channel) and ψ (token)", function()
  for k, mode in ipairs(MODES) do
    tide.manual_seed(60 + k)
    local s = make_stack("gamma_chain", 3, 4, { gamma_mode = mode })
    local params = gamma_params(s)
    for _, t in ipairs(params) do t:copy_(randn(t:shape(), 0.7)) end
    local x0 = randn({ 2, 4 }):requires_grad_(true)
    local inputs = { x0, unpack(params) }
    local worst = T.gradcheck(function() return (run(s, x0)) end, inputs, { atol = 1e-8, rtol = 1e-7 })
    T.ok(worst <= 1e-8, mode .. ": max error " .. worst)
    T.ok(max_abs(params[2]:grad()) > 1e-6, mode .. ": γ of layer 2 has a gradient")
  end
end)

-- ---- configuration errors ----------------------------------------------------------------------------------
T.test("residual config: kinds, B, gamma modes; the gamma chain cannot be combined with AttnRes", function()
  local cfg = nn.residual_config({ residual = "attnres_block", attnres = { block_layers = 12 } })
  T.eq(cfg, { kind = "attnres_block", block_layers = 12, eps = 1e-5 })
  T.eq(nn.residual_config({ residual = "gamma_chain" }), { kind = "gamma_chain", gamma_mode = "scalar", eps = 1e-5 })
  T.eq(nn.residual_config({ residual = "prenorm", attnres = false, gamma_chain = false }).kind, "prenorm")
  T.raises(function() nn.residual_config({ residual = { "attnres_block", "gamma_chain" } }) end,
    "residual: {attnres_block, gamma_chain}: the gamma chain cannot be combined with AttnRes")
  T.raises(function() nn.residual_config({ residual = "gamma_chain", attnres = { block_layers = 2 } }) end,
    "residual = \"gamma_chain\" cannot be combined with attnres options")
  T.raises(function() nn.residual_config({ residual = "attnres_full", gamma_chain = { mode = "token" } }) end,
    "residual = \"attnres_full\" cannot be combined with gamma_chain options")
  T.raises(function() nn.residual_config({ residual = "attnres_block", attnres = { block_layers = 0 } }) end,
    "attnres.block_layers must be a positive integer, got 0")
  T.raises(function() nn.residual_config({ residual = "attnres_block" }) end, "attnres_block needs attnres.block_layers")
  T.raises(function() nn.residual_config({ residual = "gamma_chain", gamma_chain = { mode = "vector" } }) end,
    "gamma_chain.mode must be \"scalar\", \"channel\" or \"token\", got vector")
  T.raises(function() nn.residual_config({ residual = "highway" }) end, "residual: must be one of")
  T.raises(function() nn.residual_config({ residual = "attnres_block", attnres = { blocks = 2 } }) end,
    "residual: unknown key 'blocks' in attnres")

  T.raises(function() nn.Residual("attnres_block", { dim = 4, block_layers = 0 }) end,
    "nn.Residual: block_layers must be a positive integer, got 0")
  T.raises(function() nn.Residual("attnres_block", { dim = 4, block_layers = 1.5 }) end, "block_layers must be a positive integer")
  T.raises(function() nn.Residual("attnres_block", { dim = 4 }) end, "attnres_block needs block_layers")
  T.raises(function() nn.Residual("attnres_full", { dim = 4, gamma_mode = "scalar" }) end,
    "gamma_mode is an option of gamma_chain; it cannot be combined with attnres_full")
  T.raises(function() nn.Residual("gamma_chain", { dim = 4, block_layers = 2 }) end,
    "block_layers is an option of attnres_block, not of gamma_chain")
  T.raises(function() nn.Residual("gamma_chain", { dim = 4, gamma_mode = "vector" }) end, "gamma_mode must be")
  T.raises(function() nn.Residual("resnet", { dim = 4 }) end, "nn.Residual: kind must be one of")
  T.raises(function() nn.Residual("attnres_full", {}) end, "nn.Residual: dim must be a positive integer")
  -- forgetting to attach is an error naming the call to make
  local r = nn.Residual("attnres_block", { dim = 2, block_layers = 1 })
  local st = r:begin(randn({ 1, 2 }))
  r:before_mixer(st, 1)
  T.raises(function() r:before_ffn(st, 1, randn({ 1, 2 })) end, "layer 1 has no AttnRes parameters: call attach_layer(layer, 1)")
  local g = make_stack("gamma_chain", 2, 2, { gamma_mode = "token" })
  local gst = g.res:begin(randn({ 1, 2 }))
  g.res:before_ffn(gst, 1, randn({ 1, 2 }))
  T.raises(function() g.res:before_ffn(gst, 2, randn({ 1, 2 })) end, "mode \"token\" needs the layer's PreNorm'd input")
end)

T.test("attnres leaves no graph behind", function()
  -- traces keep the closures they were recorded with (and so their upvalues) alive: flush them first
  require("jit").flush()
  collectgarbage()
  collectgarbage()
  T.eq(tide.graph_live_nodes(), 0)
  T.eq(tide.live_tensors(), 0)
end)

T.run()
