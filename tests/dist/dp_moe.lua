-- dp_moe.lua — a tiny hybrid MoE model (KDA + MLA mixers, 8 routed experts top-2 with a shared one, Quantile
-- Balancing) trained by tide.train on the fixture corpus: the MoE case of tests/dist/dp_check.sh (the balancers'
-- routing batch spans the ranks: counts summed, margins gathered in rank order). --model.moe.estimator and
-- --model.moe.balance pick the balancer.
return {
  name = "dp_moe",
  model = {
    kind = "hybrid", vocab_size = 320, dim = 32, n_layers = 2, mixers = "KM", ffn_dim = 48, dtype = "f64",
    recompute = "none",
    kda = { heads = 2, head_dim = 16 }, mla = { heads = 2, q_rank = 16, kv_rank = 16, nope_dim = 8, rope_dim = 8, v_dim = 8 },
    moe = { n_experts = 8, top_k = 2, expert_dim = 16, n_shared = 1, first_dense = false, balance = "quantile",
      estimator = "exact" },
  },
  data = { path = "tests/fixtures/tiny_corpus.txt", seq_len = 32, batch_size = 8 },
  optim = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 },
  schedule = { kind = "wsd", warmup = 2, decay_start = 4, decay_end = 6, min_lr = 3e-4 },
  train = { steps = 6, ckpt_every = 3, log_every = 1, seed = 3, threads = 1, quiet = true, out = "runs/dp_moe" },
}
