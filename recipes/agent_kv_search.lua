-- agent_kv_search.lua — multi-turn tool use (spec/rl.md §6 kv_search): the model must look up two keys of a hidden
-- table with the `search` tool, one call per key, then answer both values. Rewards: the share of values answered
-- exactly, minus 0.02 for each call beyond the two it needs (a process reward); credit per turn. A tiny hybrid
-- model is warmed up on the oracle policy's transcripts, then trained with GRPO.
--
--   tide run recipes/agent_kv_search.lua
--   tide run recipes/agent_kv_search.lua --rl.objective=dapo
local tide = require "tide"

return tide.rl.Recipe{
  name = "agent_kv_search",
  description = "tiny hybrid agent: multi-turn search-tool use on kv_search (SFT warm-up, then GRPO)",
  model = {
    kind = "hybrid", vocab_size = 320, dim = 64, n_layers = 4, mixers = "KMKM", ffn_dim = 192,
    kda = { heads = 2, head_dim = 32 }, mla = { heads = 2, q_rank = 48, kv_rank = 32, nope_dim = 32, rope_dim = 16,
    v_dim = 32 },
  },
  sft = { steps = 300, rows = 16, lr = 3e-3 },
  rl = {
    env = "kv_search", objective = "grpo", credit = "turn",
    iterations = 40, prompts = 8, G = 8, max_new = 80, max_turns = 8, temperature = 1.0, lr = 3e-4,
  },
  optim = { weight_decay = 0, clip = 1.0 },
  train = { out = "runs/agent_kv_search", ckpt_every = 10, log_every = 1, seed = 0 },
  expect = { reward_rises = true },
}
