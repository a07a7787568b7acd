-- long_context_1m.lua — the shipped long-context pretraining recipe at reference scale: the K3-shaped hybrid of
-- spec/README.md (`k3`: d 7,168, 93 layers, 69 KDA + 24 gated NoPE MLA, 896 routed experts top-16 with latent
-- experts and Quantile Balancing, Block AttnRes) through the stages of spec/long_context.md §2:
-- 8K → 64K → 256K → 1M tokens per sequence at a constant 2^26 tokens per optimiser step.
--
--   tide run recipes/long_context_1m.lua --dry-run               validate and print the plan (this machine)
--   tide run recipes/long_context_1m.lua --scale=tiny            the same recipe and code path at `tiny` scale on the
--                                                                CPU: stages 256 → 1K → 4K → 16K
--   tide run recipes/long_context_1m.lua --scale=tiny --dry-run  the tiny plan
--   tide run recipes/long_context_1m.lua --scale=smoke           every tiny stage for 2 steps (the test suite)
--   tide run recipes/long_context_1m.lua --resume                continue mid-stage from <out>/ckpt/latest
--   tide run recipes/long_context_1m.lua --stage=S2_256k --resume=<checkpoint>
--
-- The full-scale run needs GPU clusters (the plan prints the layout it assumes and whether one rank's memory
-- holds it); the data paths below are where the token shards of the pretraining and long-document corpora are
-- expected (formats.md §3 llm.c shards), written out so a cluster run only changes paths.
--
-- Stage plan (long_context.md §2; the 8K → 1M progression is tide's plan, shaped after K2 / Kimi-VL / Kimi Linear):
-- * tokens per step 2^26 = 67,108,864 in every stage (K2 kept 67M constant), so sequences per step fall 8,192 →
--   1,024 → 256 → 64 as T grows ×8, ×4, ×4.
-- * "long" documents are natural long documents (a length filter keeps those of at least half the stage length)
--   plus synthetic long-range tasks at the stage length (passkey retrieval, multi-query associative recall,
--   copying); "replay" is the previous stage's mix (here the 8K pretraining mix), to keep short-context skill.
--   long : replay = 0 : 100 (S0), 30 : 70 (S1, S2), 25 : 75 (S3).
-- * η (optim.md §6, K2's published values): warmup 500 steps to 2e-4 and stable through S0; the decay starts
--   with S1 (cosine 2e-4 → 1e-4), continues in S2 (1e-4 → 4e-5) and S3 anneals to 7e-6. Each segment starts
--   where the previous ended.
-- * Tokens per stage: S0 is the bulk of pretraining (15T here, K2 trained 15.5T); S1 200B, S2 60B, S3 20B.
local tide = require "tide"
local plan = tide.nn.plan

local TOKENS_PER_STEP = 2 ^ 26

-- the data mix of a long stage: `long` of the weight on long documents and synthetic tasks, the rest replay
local function long_mix(long, min_len)
  return {
    pretrain = 1 - long,                                          -- replay: the S0 mix
    long_docs = { weight = long * 0.7, min_len = min_len },       -- natural long documents (books, code, papers)
    passkey = long * 0.1, recall = long * 0.1, copy = long * 0.1, -- synthetic long-range tasks at the stage length
  }
end

local cfg = {
  name = "long_context_1m",
  description = "K3-shaped hybrid (k3 of spec/README.md), curriculum 8K → 64K → 256K → 1M at 2^26 tokens/step",
  model = plan.config("k3"),
  optim = { lr = 2e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 },
  tokens_per_step = TOKENS_PER_STEP,
  micro_tokens = 8192,             -- one sequence per forward (per rank on a cluster; accumulation fills the step)
  sources = {
    pretrain = { kind = "text", path = "data/pretrain", format = "shard", split = "train" },
    pretrain_val = { kind = "text", path = "data/pretrain_val", format = "shard", split = "train",
      order = "sequential" },
    long_docs = { kind = "text", path = "data/long_docs", format = "shard", split = "train" },
    passkey = { kind = "passkey", length = "stage" },
    recall = { kind = "mqar", vocab_size = 128, num_pairs = 64, length = "stage" },
    copy = { kind = "copy", length = 4096 },
  },
  stages = {
    { name = "S0_8k", seq_len = 8192, tokens = 15e12, lr = { kind = "constant", warmup = 500, from = 2e-4 },
      mix = { pretrain = 1 }, eval = { every = 2000 } },
    { name = "S1_64k", seq_len = 65536, tokens = 200e9, lr = { kind = "cosine", to = 1e-4 },
      mix = long_mix(0.30, 32768), eval = { every = 500 } },
    { name = "S2_256k", seq_len = 262144, tokens = 60e9, lr = { kind = "cosine", to = 4e-5 },
      mix = long_mix(0.30, 131072), eval = { every = 200 } },
    { name = "S3_1m", seq_len = 1048576, tokens = 20e9, lr = { kind = "cosine", to = 7e-6 },
      mix = long_mix(0.25, 524288), eval = { every = 100 } },
  },
  val = { mix = { pretrain_val = 1 }, batches = 8 },
  evals = {
    { source = "passkey", lengths = { 8192, 65536, 262144, 1048576 }, depths = { 0, 0.25, 0.5, 0.75, 1 }, examples = 20,
      batch = 1 },
    { source = "recall", lengths = { 8192, 65536, 262144, 1048576 }, examples = 20, batch = 1 },
  },
  -- the layout the plan checks: H200s (141 GB), experts split 64 ways, context parallel growing with T (zig-zag,
  -- long_context.md §5); data parallel takes the rest. Weights, gradients and AdamW state are sharded over
  -- all ranks (ZeRO-3 / FSDP style: each layer's weights are gathered when it runs). cp keeps one sequence's
  -- activation slice under ~80 GB with recompute = "layer" (the plan prints the bytes per token it assumes).
  dist = { gpus = 4096, gpu_memory = 141e9, ep = 64, dtype = "bf16", zero = 3,
    cp = { S0_8k = 1, S1_64k = 4, S2_256k = 16, S3_1m = 32 } },
  train = { out = "runs/long_context_1m", seed = 1, ckpt_every = 250, log_every = 10, keep_ckpts = 3 },
  scale = "full",
  scales = {},
}

-- --scale=tiny: the `tiny` config of spec/README.md on this machine's CPU, the same stages at 256 → 1K → 4K → 16K
-- (÷32, ÷64, ÷64, ÷64), the fortunes text as both corpora, the same synthetic tasks.
-- Tokens per step: 4,096 up to S2 (16, 4 and 1 rows), 16,384 at S3 (one 16K row). The full-scale rule (the same
-- tokens per step in every stage) would put S0 at 16,384 too, and this model learns recall from the number of
-- updates, not of tokens: at T = 256 with 90% recall documents it is at 100% token accuracy after 100 steps of
-- 4,096 tokens and still at 18% after 60 steps of 16,384.
cfg.scales.tiny = function(c)
  c.model = plan.config("tiny")
  c.description = "the `tiny` hybrid of spec/README.md on the CPU, curriculum 256 → 1K → 4K → 16K"
  c.optim.lr = 3e-3
  c.tokens_per_step, c.micro_tokens = 4096, 4096
  local text = { kind = "text", path = "/usr/share/games/fortunes", exclude = { "%.dat$", "%.u8$" }, doc_separator = "%",
    val_fraction = 0.02 }
  c.sources.pretrain = text
  c.sources.long_docs = text                 -- fortunes are short: the filter below keeps the longest ones
  c.sources.pretrain_val = { kind = "text", path = text.path, exclude = text.exclude, doc_separator = "%",
    val_fraction = 0.02, split = "val", order = "sequential" }
  -- recall as in the quickstart: 4 pairs over 32 task ids; short documents in every stage (the model learns the
  -- task from them) and row-length ones that stretch it to the stage length
  c.sources.recall = { kind = "mqar", vocab_size = 32, num_pairs = 4, length = "stage" }
  c.sources.recall_short = { kind = "mqar", vocab_size = 32, num_pairs = 4, length = 32 }
  c.sources.copy = { kind = "copy", length = 128 }
  local steps = { 150, 60, 40, 20 }
  local T = { 256, 1024, 4096, 16384 }
  local lr = { { kind = "constant", warmup = 10, from = 3e-3 }, { kind = "constant" },
    { kind = "cosine", to = 1e-3 }, { kind = "cosine", to = 3e-4 } }
  for i, st in ipairs(c.stages) do
    st.name = ({ "S0_256", "S1_1k", "S2_4k", "S3_16k" })[i]
    st.seq_len, st.tokens, st.steps, st.lr = T[i], nil, steps[i], lr[i]
    st.tokens_per_step = i == 4 and 16384 or nil
    -- S0: 90% short recall, 10% text (the model learns the task there); S1-S3: 35% long (fortunes of >= 400 bytes,
    -- row-length recall and passkey, copying), 65% replay (text and short recall)
    st.mix = i == 1 and { pretrain = 0.1, recall_short = 0.9 }
      or { pretrain = 0.3, recall_short = 0.35, long_docs = { weight = 0.1, min_len = 400 }, recall = 0.15,
        passkey = 0.05, copy = 0.05 }
    st.eval = { every = 0 }
  end
  c.val.batches = 1
  c.evals = {
    { source = "recall", lengths = { 256, 1024, 4096, 16384 }, examples = 16, batch = 1 },
    { source = "passkey", lengths = { 256, 1024, 4096, 16384 }, depths = { 0, 0.5, 1 }, examples = 2, batch = 1 },
  }
  c.dist = { dtype = "f32" }
  c.train = { out = "runs/long_context_1m-tiny", seed = 1, ckpt_every = 20, log_every = 5, keep_ckpts = 2 }
  return c
end

-- --scale=smoke: the tiny run cut to 2 steps per stage and 8,192-token micro-batches (ctest runs it end to end)
cfg.scales.smoke = function(c)
  c = cfg.scales.tiny(c)
  for _, st in ipairs(c.stages) do st.steps = 2; st.lr.warmup = math.min(st.lr.warmup or 0, 1) end
  c.evals = { { source = "passkey", lengths = { 256, 16384 }, depths = { 0.5 }, examples = 1, batch = 1 } }
  c.train.out, c.train.ckpt_every = "runs/long_context_1m-smoke", 0
  return c
end

return tide.Curriculum(cfg)
