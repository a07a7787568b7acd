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
  model = {
    kind = "hybrid", vocab_size = 320, dim = 64, n_layers = 4, mixers = "KMKM", ffn_dim = 192,
    kda = { heads = 2, head_dim = 32 }, mla = { heads = 2, q_rank = 48, kv_rank = 32, nope_dim = 32, rope_dim = 16,
    v_dim = 32 },
  },
  sft = { steps = 400, rows = 32, lr = 3e-3 },
  rl = {
    env = "countdown", env_cfg = { tools = "calc" }, objective = "grpo",
    iterations = 50, prompts = 8, G = 8, max_new = 64, max_turns = 4, temperature = 1.0, lr = 3e-4, updates = 1,
  },
  optim = { weight_decay = 0, clip = 1.0 },
  train = { out = "runs/agent_rl", ckpt_every = 10, log_every = 1, seed = 0 },
  expect = { format_rate_above = 0.9, reward_rises = true },
}
