-- vision: nn.VisionEncoder, the 2×2 merge and projector, the splice into the token embeddings, and the vision
-- option of nn.HybridLM (spec/vision.md oracles 1, 3, 4, 5, 7, 8; the ops' own oracles are in test_vision_ops and
-- tests/c; the data side in test_vision_data).
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F
local vision = nn.vision

local fmt = string.format
local max_abs_diff = T.max_abs_diff

-- tiny-vlm (vision.md §9) into a d = 128 language model
local function tiny_cfg(over)
  local c = { patch = 4, dim = 64, heads = 4, layers = 2, mlp_dim = 256, grid = 8 }
  for k, v in pairs(over or {}) do c[k] = v end
  return vision.config(c, 128)
end

local function encoder(over, dtype)
  tide.manual_seed(11)
  local c = tiny_cfg(over)
  return nn.VisionEncoder(c, { dtype = dtype or "f32" }), nn.VisionProjector(c, { dtype = dtype or "f32" }), c
end

local function randn(shape, dtype) return tide.randn(shape, { dtype = dtype or "f32" }) end

T.test("tiny-vlm: 206,144 parameters (ViT 107,328 + projector 98,816) under the Kimi-VL names (vision.md §9)", function()
  local vit, proj = encoder()
  T.eq(vit:num_parameters(), 107328, "ViT")
  T.eq(proj:num_parameters(), 98816, "projector")
  local want = {
    ["patch_embed.proj.weight"] = { 64, 48 }, ["patch_embed.proj.bias"] = { 64 }, ["patch_embed.pos_emb.weight"] = { 8, 8, 64 },
    ["encoder.blocks.0.norm0.weight"] = { 64 }, ["encoder.blocks.0.norm0.bias"] = { 64 },
    ["encoder.blocks.0.wqkv.weight"] = { 192, 64 }, ["encoder.blocks.0.wqkv.bias"] = { 192 },
    ["encoder.blocks.1.wo.weight"] = { 64, 64 }, ["encoder.blocks.1.mlp.fc0.weight"] = { 256, 64 },
    ["encoder.blocks.1.mlp.fc1.weight"] = { 64, 256 }, ["encoder.final_layernorm.bias"] = { 64 },
  }
  local names = {}
  for name, t in vit:named_parameters() do names[name] = t:shape() end
  for name, shape in pairs(want) do T.eq(names[name], shape, name) end
  local pn = {}
  for name, t in proj:named_parameters() do pn[#pn + 1] = name .. "=" .. table.concat(t:shape(), "x") end
  T.eq(table.concat(pn, " "), "pre_norm.weight=64 pre_norm.bias=64 linear_1.weight=256x256 linear_1.bias=256 "
    .. "linear_2.weight=128x256 linear_2.bias=128")
end)

T.test("oracle 1: the patch embed as a Linear on (c, ky, kx) patches == Conv2d(k = p, s = p) on the image (fp64)", function()
  local p, H, W, dv = 4, 8, 12, 5
  local img = randn({ H, W, 3 }, "f64"):tolist()          -- [H, W, 3] row-major
  local wc = randn({ dv, 3, p, p }, "f64"):tolist()       -- the Conv2d weight [d_v, 3, p, p]
  local b = randn({ dv }, "f64")
  local bl = b:tolist()
  local h, w = H / p, W / p
  -- patches in raster order, each in (c, ky, kx) order
  local pv = {}
  for r = 0, h - 1 do
    for c = 0, w - 1 do
      for ch = 0, 2 do
        for ky = 0, p - 1 do
          for kx = 0, p - 1 do pv[#pv + 1] = img[((r * p + ky) * W + c * p + kx) * 3 + ch + 1] end
        end
      end
    end
  end
  local patches = tide.tensor(pv, { dtype = "f64", shape = { h * w, 3 * p * p } })
  local lin = F.linear(patches, tide.tensor(wc, { dtype = "f64", shape = { dv, 3 * p * p } }), b):tolist()
  local worst = 0
  for r = 0, h - 1 do
    for c = 0, w - 1 do
      for o = 0, dv - 1 do
        local s = bl[o + 1]
        for ch = 0, 2 do
          for ky = 0, p - 1 do
            for kx = 0, p - 1 do
              s = s + wc[((o * 3 + ch) * p + ky) * p + kx + 1] * img[((r * p + ky) * W + c * p + kx) * 3 + ch + 1]
            end
          end
        end
        worst = math.max(worst, math.abs(s - lin[(r * w + c) * dv + o + 1]))
      end
    end
  end
  print("    " .. fmt("max |linear - conv| = %.1e", worst))
  T.ok(worst <= 1e-12, "linear == conv: " .. worst)
end)

T.test("oracle 4: the 2×2 merge table of a 4 x 4 grid; packed images offset by their patch counts", function()
  T.eq(vision.merge_index({ { 4, 4 } }), { 0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15 })
  T.eq(vision.merge_index({ { 2, 2 }, { 2, 4 } }), { 0, 1, 2, 3, 4, 5, 8, 9, 6, 7, 10, 11 })
  T.eq(vision.cu_seqlens({ { 2, 2 }, { 2, 4 }, { 6, 2 } }), { 0, 4, 12, 24 })
  T.raises(function() vision.merge_index({ { 4, 4 }, { 3, 4 } }) end, "image 2: the patch grid 3 x 4 is not even")
end)

T.test("oracle 5: 32 x 32 at p = 4 -> 64 patches -> 16 tokens of width 128; the output is finite", function()
  local vit, proj = encoder()
  local x = vit:forward(randn({ 64, 48 }), { { 8, 8 } })
  T.eq(x:shape(), { 64, 64 })
  local y = proj:forward(x, { { 8, 8 } })
  T.eq(y:shape(), { 16, 128 })
  T.ok(y:all_finite(), "finite")
end)

T.test("oracle 3: two images of different grids packed == each alone (fp64 <= 1e-12); B's output ignores A's pixels", function()
  local vit, proj = encoder(nil, "f64")
  local ga, gb = { 4, 6 }, { 8, 2 }
  local pa, pb = randn({ 24, 48 }, "f64"), randn({ 16, 48 }, "f64")
  local both = proj:forward(vit:forward(F.concat({ pa, pb }, 1), { ga, gb }), { ga, gb })
  local a = proj:forward(vit:forward(pa, { ga }), { ga })
  local b = proj:forward(vit:forward(pb, { gb }), { gb })
  local d = math.max(max_abs_diff(both:narrow(1, 1, 6), a), max_abs_diff(both:narrow(1, 7, 4), b))
  print("    " .. fmt("packed vs separate: max |Δ| = %.1e", d))
  T.ok(d <= 1e-12, "packed == separate: " .. d)
  -- isolation, f32, bitwise
  local v32, p32 = encoder()
  local qa, qb = randn({ 24, 48 }), randn({ 16, 48 })
  local y1 = p32:forward(v32:forward(F.concat({ qa, qb }, 1), { ga, gb }), { ga, gb }):narrow(1, 7, 4):tolist()
  local y2 = p32:forward(v32:forward(F.concat({ randn({ 24, 48 }), qb }, 1), { ga, gb }), { ga, gb }):narrow(1, 7, 4):tolist()
  T.eq(y1, y2, "image B bitwise unchanged")
end)

T.test("oracle 7: the splice replaces the placeholder rows; the count mismatch names both counts; gradients (fp64)", function()
  local PAD = 7
  local ids = tide.tensor({ 1, PAD, PAD, 3, 4, PAD, 5, PAD }, { dtype = "i32", shape = { 2, 4 } })
  local E = randn({ 2, 4, 3 }, "f64"):requires_grad_()
  local img = randn({ 4, 3 }, "f64"):requires_grad_()
  local out = vision.splice(E, ids, img, PAD)
  local o, e, im = out:reshape(8, 3):totable(), E:reshape(8, 3):totable(), img:totable()
  local k = 0
  for t, id in ipairs({ 1, PAD, PAD, 3, 4, PAD, 5, PAD }) do
    if id == PAD then k = k + 1; T.eq(o[t], im[k], "row " .. t .. " is image token " .. k)
    else T.eq(o[t], e[t], "row " .. t .. " is the embedding") end
  end
  local R = randn({ 2, 4, 3 }, "f64");
  (out * R):sum():backward()
  local gE, gI, r = E:grad():reshape(8, 3):totable(), img:grad():totable(), R:reshape(8, 3):totable()
  k = 0
  local worst = 0
  for t, id in ipairs({ 1, PAD, PAD, 3, 4, PAD, 5, PAD }) do
    for j = 1, 3 do
      if id == PAD then
        worst = math.max(worst, math.abs(gI[k + 1][j] - r[t][j]))
        T.eq(gE[t][j], 0, "no gradient into a placeholder's embedding")
      else
        worst = math.max(worst, math.abs(gE[t][j] - r[t][j]))
      end
    end
    if id == PAD then k = k + 1 end
  end
  T.ok(worst <= 1e-12, "dE at idx == d(projector output): " .. worst)
  T.raises(function() vision.splice(E, ids, randn({ 3, 3 }, "f64"), PAD) end,
    "the batch holds 4 <|media_pad|> placeholders (id 7) but the images give 3 image tokens")
  T.raises(function() vision.splice(E, ids, img, nil) end, "the <|media_pad|> id is not known")
end)

T.test("oracle 8: fp64 central differences of one ViT block + merge + projector at tiny-vlm dims (rel <= 1e-6)", function()
  tide.manual_seed(5)
  local c = tiny_cfg({ layers = 1 })
  local vit = nn.VisionEncoder(c, { dtype = "f64" })
  local proj = nn.VisionProjector(c, { dtype = "f64" })
  local grids = { { 2, 4 }, { 4, 2 } }
  local x = randn({ 16, 64 }, "f64"):requires_grad_()
  local blk = vit.encoder.blocks:get(1)
  local pos, cu = F.grid_positions(grids), vision.cu_seqlens(grids)
  local function fn(xx) return proj:forward(blk:forward(xx, pos, cu), grids) end
  local inputs = { x, blk.wqkv.weight, blk.wqkv.bias, blk.wo.weight, blk.norm0.weight, blk.mlp.fc0.weight,
    proj.pre_norm.bias, proj.linear_1.weight, proj.linear_2.weight }
  local worst = T.gradcheck(function(xx) return fn(xx) end, inputs, { atol = 1e-8, rtol = 1e-6, max_checks = 40 })
  print("    " .. fmt("max |analytic - numeric| = %.1e", worst))
end)

-- a tiny hybrid LM with the tiny-vlm encoder (d = 128 as tiny-vlm's projector)
local function vlm(over)
  tide.manual_seed(3)
  local cfg = {
    vocab_size = 64, dim = 128, n_layers = 2, mixers = "KM", ffn_dim = 64,
    kda = { heads = 2, head_dim = 16, chunk = 8 }, mla = { heads = 2, kv_rank = 16, nope_dim = 16, rope_dim = 8, v_dim = 16 },
    vision = { patch = 4, dim = 32, heads = 2, layers = 1, mlp_dim = 64, grid = 4, media_pad = 9 },
  }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return nn.HybridLM(cfg)
end

-- ids [1, T] with n placeholders (id 9) starting at position 2
local function batch(n, Tn)
  local ids = {}
  for t = 1, Tn do ids[t] = (t >= 3 and t < 3 + n) and 9 or (t % 7) + 10 end
  return tide.tensor(ids, { dtype = "i32", shape = { 1, Tn } })
end

T.test("nn.HybridLM vision = {...}: images in the batch splice at media_pad; every part gets a gradient; freeze groups", function()
  local m = vlm()
  T.ok(m.vision_tower and m.multi_modal_projector, "the encoder and projector exist")
  local names = {}
  for name in m:named_parameters() do names[name] = true end
  T.ok(names["vision_tower.patch_embed.proj.weight"] and names["multi_modal_projector.linear_2.bias"]
    and names["model.embed_tokens.weight"], "top-level names")
  local images = { patches = randn({ 16, 48 }), grids = { { 4, 4 } } }          -- 16 patches -> 4 tokens
  local ids = batch(4, 12)
  local logits = m:forward(ids, nil, { images = images })
  T.eq(logits:shape(), { 1, 12, 64 })
  -- the image changes the logits of positions at and after the placeholders, never before (causal LM)
  local other = m:forward(ids, nil, { images = { patches = randn({ 16, 48 }), grids = { { 4, 4 } } } })
  local a, b = logits:totable()[1], other:totable()[1]
  T.eq(a[1], b[1], "position 0 does not see the image")
  T.eq(a[2], b[2], "position 1 does not see the image")
  T.ok(max_abs_diff(logits:narrow(2, 7, 6), other:narrow(2, 7, 6)) > 1e-6, "later positions read the image")
  local function grads_after(frozen)
    m:set_frozen(frozen)
    m:zero_grad()
    local l = F.cross_entropy(m:forward(ids, nil, { images = images }), batch(4, 12))
    l:backward()
    local has = {}
    for name, t in m:named_parameters() do
      local g = t:grad()
      local grp = name:match("^vision_tower") and "vit" or name:match("^multi_modal_projector") and "projector" or "lm"
      has[grp] = has[grp] or (g ~= nil and g:abs():sum():item() > 0)
    end
    return has
  end
  local h = grads_after({})
  T.ok(h.vit and h.projector and h.lm, "all three groups train")
  h = grads_after({ "lm" })
  T.ok(h.vit and h.projector and not h.lm, "alignment stage: the LM frozen, the gradient flows through it")
  h = grads_after({ "vit", "projector" })
  T.ok(h.lm and not h.vit and not h.projector, "vision frozen")
  T.eq(m:set_frozen({}), 0, "unfreeze")
  T.raises(function() m:set_frozen({ "vision" }) end, "freeze[1] = vision: the groups are \"vit\", \"projector\" and \"lm\"")
  -- the count mismatch reaches the user as one line
  T.raises(function() m:forward(batch(3, 12), nil, { images = images }) end,
    "the batch holds 3 <|media_pad|> placeholders (id 9) but the images give 4 image tokens")
  T.raises(function() m:forward(ids, nil, { images = { patches = randn({ 15, 48 }), grids = { { 4, 4 } } } }) end,
    "images.patches must be [16, 48]")
  T.raises(function() nn.HybridLM({ vocab_size = 64, dim = 32, n_layers = 1, mixers = "K", kda = { heads = 2, head_dim = 16 } })
    :forward(ids, nil, { images = images }) end, "the batch holds images but the model has no vision encoder")
  T.raises(function() vlm({ vision = { dim = 30, heads = 2 } }) end, "vision head_dim = dim / heads = 15 must be a multiple of 4")
end)

T.test("generate with images in the prompt: the cached prefill splices them (first token == the full forward's argmax)", function()
  local m = vlm()
  local images = { patches = randn({ 16, 48 }), grids = { { 4, 4 } }, pad_id = 9 }
  local prompt = batch(4, 9):tolist()
  local logits = tide.no_grad(function() return m:forward(batch(4, 9), nil, { images = images }) end)
  local last = logits:narrow(2, 9, 1):reshape(64):tolist()
  local best = 1
  for v = 2, 64 do if last[v] > last[best] then best = v end end
  local gen = m:generate(prompt, { max_new = 3, images = images })
  T.eq(gen[1], best - 1, "first generated id")
  -- a batch of two prompts, one with and one without images, each as it is alone
  local plain = batch(0, 9):tolist()
  local both = m:generate({ prompt, plain }, { max_new = 3, images = { images, false } })
  T.eq(both[1], gen, "row with images")
  T.eq(both[2], m:generate(plain, { max_new = 3 }), "row without images")
end)

local mm = require "tide.data.multimodal"

T.test("label positions: the targets there are the digit, the colour and quadrant letters; text_only drops the image", function()
  local tok = require("tide.data.tokenizer").byte_level()
  local d = mm.digits_source({ split = "val", order = "sequential" })
  for i = 0, 4 do
    local ids, tg, n, images = d:doc(i)
    local _, label = d:digit(d:index(i))
    T.eq(#images, 1)
    local lp = d:label_positions(i)
    T.eq(#lp, 1)
    T.eq(tg[lp[1]], string.byte(tostring(label)), "the digit's target")
    T.eq(lp[1], n - 2, "the caption's last token")
  end
  local s = mm.squares_source({ split = "eval" })
  for i = 0, 4 do
    local _, caption = s:sample(i)
    local ids, tg, n = s:doc(i)
    local lp = s:label_positions(i)
    T.eq(#lp, 3)
    local got = string.char(tg[lp[1]], tg[lp[2]], tg[lp[3]])
    local want = caption:sub(1, 1) .. caption:match(" (.)") .. caption:match("%-(.)")
    T.eq(got, want, caption)
  end
  local st = mm.squares_source({ split = "eval", text_only = true })
  local ids, tg, n, images = st:doc(0)
  local _, caption = st:sample(0)
  T.eq(n, 1 + #caption, "<|endoftext|> and the caption alone")
  T.ok(images == nil or #images == 0, "no image")
  T.eq(tg[st:label_positions(0)[1]], caption:byte(1))
  T.raises(function() mm.digits_source({ text_only = "yes" }) end, "text_only must be true or false")
end)

T.test("a curriculum stage with freeze = {\"lm\"} trains only the ViT and projector; caption evals run on held-out images", function()
  local out = T.tmpdir("vision-curriculum")
  local cfg = tide.Curriculum{
    name = "vlm_test",
    model = { kind = "hybrid", vocab_size = 320, dim = 32, n_layers = 2, mixers = "KM", ffn_dim = 64,
      kda = { heads = 2, head_dim = 16 }, mla = { heads = 2, kv_rank = 16, nope_dim = 16, rope_dim = 8, v_dim = 16 },
      vision = { patch = 4, dim = 16, heads = 2, layers = 1, mlp_dim = 32, grid = 8 } },
    optim = { lr = 3e-3 },
    tokens_per_step = 256,
    sources = { squares = { kind = "squares" }, digits = { kind = "digits", val_fraction = 0.1 } },
    stages = {
      { name = "align", seq_len = 128, steps = 3, freeze = { "lm" }, mix = { squares = 0.5, digits = 0.5 } },
      { name = "joint", seq_len = 128, steps = 2, mix = { squares = 1 } },
    },
    evals = { { source = "squares", examples = 8, batch = 4, samples = 2 }, { source = "digits", examples = 8 } },
    train = { out = out, quiet = true, ckpt_every = 100 },
  }
  local snaps = {}
  cfg.hooks = {
    on_stage_start = function(ctx, st)
      local s = {}
      for name, t in ctx.model:named_parameters() do s[name] = t:tolist() end
      snaps[#snaps + 1] = s
    end,
  }
  local r = require("tide.curriculum").train(cfg)
  T.eq(#snaps, 2)
  local changed = {}
  for name, before in pairs(snaps[1]) do
    local after = snaps[2][name]
    local grp = name:match("^vision_tower") and "vit" or name:match("^multi_modal_projector") and "projector" or "lm"
    local diff = false
    for k = 1, #before do if before[k] ~= after[k] then diff = true break end end
    changed[grp] = changed[grp] or diff
    if grp == "lm" then T.ok(not diff, name .. " is frozen in the alignment stage") end
  end
  T.ok(changed.vit and changed.projector, "the ViT and projector trained")
  T.eq(#r.evals, 2)
  T.eq(r.evals[1].task, "caption")
  T.eq(r.evals[1].source, "squares")
  T.ok(r.evals[1].accuracy >= 0 and r.evals[1].accuracy <= 1 and r.evals[1].label_accuracy, "caption and label accuracy")
  T.eq(#r.evals[1].samples, 2)
  T.ok(type(r.evals[1].samples[1].expected) == "string" and r.evals[1].samples[1].expected:match("^%a+ %a+%-%a+$"),
    "the expected caption: " .. tostring(r.evals[1].samples[1].expected))
  -- tide sample --image on the run's checkpoint: the photo resized to the patch budget, greedy, reproducible
  local sample = require "tide.cmd.sample"
  local photo = "/usr/lib/python3/dist-packages/sklearn/datasets/images/china.jpg"
  local sink = { text = "", write = function(self, ...) for _, x in ipairs({ ... }) do self.text = self.text .. x end end,
    flush = function() end }
  local text, ids = sample.sample(r.checkpoint, { image = photo, prompt = "a", temperature = 0, max_new = 5, stop = "none" }, sink)
  T.eq(#ids, 5, "five new tokens")
  local _, ids2 = sample.sample(r.checkpoint, { image = photo, prompt = "a", temperature = 0, max_new = 5, stop = "none" }, sink)
  T.eq(ids2, ids, "greedy is reproducible")
  T.raises(function() sample.sample(r.checkpoint, { image = out .. "/none.png" }, sink) end, "--image: cannot open")
  T.raises(function()
    local c2 = tide.Curriculum{ model = { kind = "hybrid", vocab_size = 320, dim = 32, n_layers = 1, mixers = "K",
      kda = { heads = 2, head_dim = 16 } }, tokens_per_step = 128, sources = { t = { kind = "squares" } },
      stages = { { seq_len = 128, steps = 1, freeze = { "vit" }, mix = { t = 1 } } }, train = { out = out .. "2", quiet = true } }
    require("tide.curriculum").train(c2)
  end, "freeze[1] = \"vit\" needs a model with vision")
end)

T.test("nn.plan.count counts the vision encoder and projector as the built model has them", function()
  local m = vlm()
  local cfg = {
    vocab_size = 64, dim = 128, n_layers = 2, mixers = "KM", ffn_dim = 64,
    kda = { heads = 2, head_dim = 16, chunk = 8 }, mla = { heads = 2, kv_rank = 16, nope_dim = 16, rope_dim = 8, v_dim = 16 },
    vision = { patch = 4, dim = 32, heads = 2, layers = 1, mlp_dim = 64, grid = 4, media_pad = 9 },
  }
  local c = nn.plan.count(cfg)
  T.eq(c.total, m:num_parameters(), "total")
  T.eq(c.vision, m.vision_tower:num_parameters(), "ViT")
  T.eq(c.projector, m.multi_modal_projector:num_parameters(), "projector")
  local t = nn.plan.count({ vocab_size = 320, dim = 128, n_layers = 1, mixers = "K", kda = { heads = 2, head_dim = 64 },
    vision = { patch = 4, dim = 64, heads = 4, layers = 2, mlp_dim = 256, grid = 8 } })
  T.eq(t.vision + t.projector, 206144, "tiny-vlm")
end)

T.test("digits shift: a translation of the train split's images by at most s pixels, deterministic; val unshifted", function()
  local a = mm.digits_source({ split = "train", shift = 3, seed = 4 })
  local b = mm.digits_source({ split = "train", shift = 3, seed = 4 })
  local plain = mm.digits_source({ split = "train", seed = 4 })
  local moved = 0
  for i = 0, 19 do
    local dx, dy = a:offset(i)
    T.ok(math.abs(dx) <= 3 and math.abs(dy) <= 3, "within the bound")
    if dx ~= 0 or dy ~= 0 then moved = moved + 1 end
    local k = a:index(i)
    local img = a:digit(k, dx, dy):to("i32"):totable()
    local ref = plain:digit(k):to("i32"):totable()
    -- the shifted pixel (y, x) is the original (y - dy, x - dx), zero where that falls outside
    for y = 1, 32 do
      for x = 1, 32 do
        local sy, sx = y - dy, x - dx
        local want = (sy >= 1 and sy <= 32 and sx >= 1 and sx <= 32) and ref[sy][sx][1] or 0
        if img[y][x][1] ~= want then T.ok(false, fmt("doc %d pixel (%d, %d)", i, y, x)) end
      end
    end
    local ia, _, na = a:doc(i)
    local ib, _, nb = b:doc(i)
    T.eq(na, nb)
  end
  T.ok(moved >= 15, "most documents move: " .. moved)
  local v = mm.digits_source({ split = "val", shift = 3 })
  T.eq({ v:offset(5) }, { 0, 0 }, "the val split is never shifted")
  T.raises(function() mm.digits_source({ shift = 9 }) end, "shift must be an integer in [0, 8]")
end)
