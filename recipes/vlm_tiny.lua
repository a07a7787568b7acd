-- vlm_tiny.lua — native vision end to end: the tiny-vlm encoder of spec/vision.md §9 (32x32 images, patch 4, an
-- 8x8 grid merged 2x2 into 16 tokens, ViT width 64, 2 blocks) in front of a small hybrid KDA/MLA language model,
-- trained from scratch through a four-stage curriculum (vision.md §10, Kimi k1.5's order):
--
--   lm        the language model alone on the captions (no images): it learns the caption language
--   align     the language model frozen; only the ViT and the projector train (freeze = {"lm"})
--   joint     everything trains
--   cooldown  everything trains, η decaying
--
-- on two image sources: `squares` (vision.md oracle 9: one solid square, 8 colours x 4 quadrants, caption
-- "<colour> <quadrant>") and `digits` (the 1,797 handwritten 8x8 digits Debian's python3-sklearn ships, scaled to
-- 32x32, caption "a handwritten 7"; the last 10% by file index are held out). Each image's 16 tokens sit in the
-- same packed rows as the text; the loss skips placeholders and the media wrapper tokens (vision.md §8).
--
--   tide run recipes/vlm_tiny.lua                   train (about N minutes on 2 cores), then the caption table
--   tide run recipes/vlm_tiny.lua --scale=text_only the same language model on the same captions without images:
--                                                   what the captions alone give (the digit is a guess: ~10%)
--   tide run recipes/vlm_tiny.lua --scale=smoke     two steps per stage: the whole path in seconds
--   tide run recipes/vlm_tiny.lua --dry-run         the plan
--
-- It ends with a table: caption-token accuracy on held-out images per source (teacher-forced), the accuracy on the
-- label tokens (the digit; the colour and quadrant words) and exact captions, then greedy captions of a few
-- held-out images.
local tide = require "tide"

local function recipe()
  return tide.Curriculum{
    name = "vlm_tiny",
    description = "tiny-vlm ViT (vision.md §9) + a small hybrid KDA/MLA LM; squares and digits captions",
    model = {
      kind = "hybrid", vocab_size = 320, dim = 128, n_layers = 2, mixers = "KM", ffn_dim = 256,
      kda = { heads = 2, head_dim = 32 },
      mla = { heads = 2, q_rank = 64, kv_rank = 32, nope_dim = 32, rope_dim = 16, v_dim = 32 },
      residual = "attnres_block", attnres = { block_layers = 2 },
      -- tiny-vlm: p 4, width 64, 4 heads, 2 blocks, MLP 256, table 8x8, projector 256 -> 256 -> 128. The table
      -- starts at std 0.5, not the weights' 0.02: MoonViT's comes trained (from SigLIP), and a table this small
      -- against the patch embeddings left where the square is nearly unread (left / right at chance after 500
      -- steps with 0.02; every colour, row and column right with 0.5)
      vision = { patch = 4, dim = 64, heads = 4, layers = 2, mlp_dim = 256, grid = 8, table_std = 0.5,
        mean = { 0.5, 0.5, 0.5 }, std = { 0.5, 0.5, 0.5 } },
      device = "cpu",
    },
    optim = { lr = 2e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.05, clip = 1.0 },
    tokens_per_step = 2048,               -- 16 rows of 128: about 50 captioned images a step
    sources = {
      squares = { kind = "squares", split = "train" },
      -- the train digits move by up to 3 pixels (of 32) each time they are drawn: 1,618 images are few, and
      -- without the shift the model learns them by heart (train loss 0.008, held-out digits 84%)
      digits = { kind = "digits", split = "train", val_fraction = 0.1, shift = 3 },
      -- the same captions without images: the first stage's language
      squares_text = { kind = "squares", split = "train", text_only = true },
      digits_text = { kind = "digits", split = "train", val_fraction = 0.1, text_only = true },
    },
    stages = {
      { name = "lm", seq_len = 128, steps = 60, lr = { kind = "constant", warmup = 10, from = 2e-3 },
        mix = { squares_text = 0.5, digits_text = 0.5 } },
      { name = "align", seq_len = 128, steps = 140, lr = { kind = "constant", from = 2e-3 },
        freeze = { "lm" }, mix = { squares = 0.5, digits = 0.5 } },
      -- joint, then a cooldown (vision.md §10): the digits are most of the mix, they take the longest; the caption
      -- table is printed at the end of joint (step 500, oracle 9's budget) and of the run
      { name = "joint", seq_len = 128, steps = 300, lr = { kind = "cosine", from = 2e-3, to = 1.1e-3 },
        mix = { squares = 0.25, digits = 0.75 }, eval = { tasks = true } },
      { name = "cooldown", seq_len = 128, steps = 300, lr = { kind = "cosine", to = 2e-4 },
        mix = { squares = 0.25, digits = 0.75 } },
    },
    evals = {
      { source = "squares", examples = 256, batch = 32, samples = 4 },
      { source = "digits", examples = 179, batch = 32, samples = 4 },
    },
    train = { out = "runs/vlm_tiny", seed = 1, ckpt_every = 100,
      log_every = 25, keep_ckpts = 2 },
    -- every held-out caption row above this (label accuracy where the source marks labels)
    expect = { eval_accuracy_above = 0.9 },
  }
end

local cfg = recipe(false)
cfg.scales = {}

-- --scale=text_only: the same language model, stages and captions without the images (no vision encoder, every
-- source text_only, nothing frozen, no expect bound): what the captions alone give
cfg.scales.text_only = function(c)
  c.name, c.model.vision, c.expect = "vlm_tiny_text_only", nil, nil
  for _, sc in pairs(c.sources) do sc.text_only = true end
  for _, st in ipairs(c.stages) do st.freeze = nil end
  c.train.out = c.train.out .. "_text_only"
  return c
end

-- --scale=smoke: two steps per stage and small evals (ctest vlm-tiny-smoke: the whole path, not the learning)
cfg.scales.smoke = function(c)
  for _, st in ipairs(c.stages) do st.steps = 2; st.lr.warmup = math.min(st.lr.warmup or 0, 1) end
  for _, e in ipairs(c.evals) do e.examples, e.samples = 8, 1 end
  c.expect = nil
  c.train.out, c.train.ckpt_every = "runs/vlm_tiny-smoke", 0
  return c
end

return cfg
