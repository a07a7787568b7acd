-- agent_rl.lua — agentic RL post-training end to end (spec/rl.md): a tiny hybrid KDA/MLA model is warmed up on
-- formatted countdown demonstrations (SFT on the assistant tokens only), then trained by policy gradient on the
-- countdown environment with its `calc` tool: each iteration samples G answers per prompt on the model's caches
-- (tool calls run mid-sample, their results fed into the caches), scores them with the exact verifier (1 for a
-- correct expression, 0.1 for a well-formed wrong one, 0 without an answer tag), and updates the policy through
-- the shared training step.
--
--   tide run recipes/agent_rl.lua                          SFT warm-up, then GRPO
--   tide run recipes/agent_rl.lua --rl.objective=dapo      DAPO (clip-higher, token-level mean, dynamic sampling)
--   tide run recipes/agent_rl.lua --rl.objective=kimi      Kimi's squared mirror-descent surrogate
--   tide run recipes/agent_rl.lua --resume                 continue from runs/agent_rl/ckpt/latest
--
-- Every iteration writes one record to runs/agent_rl/metrics.jsonl (reward, format rate, accuracy, response
-- length, entropy, clip fraction, KL, zero-variance groups, tool calls per sample, sampling and update times).
local tide = require "tide"

return tide.rl.Recipe{
  name = "agent_rl",
  description = "tiny hybrid KDA/MLA agent: SFT warm-up, then GRPO/DAPO/Kimi on countdown with a calc tool",
  -- 2 layers, KDA then MLA: the hybrid's MLA is NoPE, so the KDA layer is what carries position (a 2-layer MLA-only
  -- stack still wrote "c:" and "calcalc:" for "calc:" after 150 warm-up steps); recompute off (a small model: it
  -- costs ~20% per step); one thread (sampling decodes one token per row: 1 thread decoded ~7x faster than 2 on
  -- shared cores)
  model = {
    kind = "hybrid", vocab_size = 320, dim = 64, n_layers = 2, mixers = "KM", ffn_dim = 192, recompute = "none",
    kda = { heads = 2, head_dim = 32 }, mla = { heads = 2, q_rank = 48, kv_rank = 32, nope_dim = 32, rope_dim = 16,
    v_dim = 32 },
  },
  -- a short warm-up: it teaches the markup (the calc call, the answer tag, <|im_end|>) to a format rate of ~0.8, and
  -- leaves the rest of the format to RL; it does not teach copying the prompt's numbers (see bench/results/agent_rl.md)
  sft = { steps = 60, rows = 16, lr = 5e-3 },
  rl = {
    env = "countdown", env_cfg = { tools = "calc" }, objective = "grpo",
    iterations = 50, prompts = 4, G = 8, max_new = 64, max_turns = 4, temperature = 1.0, lr = 1e-3, updates = 1,
  },
  optim = { weight_decay = 0, clip = 1.0 },
  train = { out = "runs/agent_rl", ckpt_every = 10, log_every = 1, seed = 0, threads = 1 },
  expect = { format_rate_above = 0.9, reward_rises = true },
}
