-- moe_balance.lua — the load-balancing study (issue 5; spec/moe.md §4, §5): one small MoE language model trained on
-- the quickstart's text (the `fortunes` files, byte tokenizer, same data config) with each balancer — Quantile
-- Balancing ("quantile"), the DeepSeek-V3 sign rule ("sign"), the classic batch aux loss ("aux", α = 1e-3) and no
-- balancing ("none") — from the default router initialisation and from a deliberately skewed one, same seed, same
-- data stream, same steps. Prints a table (balance x init: final loss, held-out loss, MaxVio of the last training
-- batch, held-out MaxVio, dead-expert fraction) and writes <results>/moe_balance.json and moe_balance.md.
--
--   tide run recipes/moe_balance.lua                           the full study (about 25 min on 2 cores)
--   tide run recipes/moe_balance.lua --balances=quantile,none  a subset of the balancers
--   tide run recipes/moe_balance.lua --inits=default           a subset of the initialisations
--   tide run recipes/moe_balance.lua --steps=5 --results=""    a smoke run (writes nothing)
--
-- Choices (stated so the numbers can be read):
-- * Model: nn.HybridLM, d = 64, 2 layers, both mixers KDA (mixers "K": the cheap one on a CPU; 2 heads x 32),
--   plain PreNorm; BOTH FFNs are MoE (first_dense = false, so the first layer — the hardest to balance — is
--   measured too): 16 routed experts, top-2, d_e = 64, SwiGLU, sigmoid router, one shared expert of width 64.
-- * Skewed init ("skewed"): after the seeded default initialisation, and before the first training step, every MoE
--   layer's router rows of experts 0..3 get an offset along the mean router input of the first training batch,
--   W_j ← W_j + a·x̄/|x̄|², a = 3 — the router logit of those 4 experts rises by exactly 3 at the batch mean (by
--   3·x_t·x̄/|x̄|² for token t). sigmoid(0) = 0.5 → sigmoid(3) = 0.95: the 4 hot experts take nearly every top-2
--   slot at step 1 (the first-step MaxVio of each run is in the table). The offset is an initialisation only: the
--   rows are trained parameters afterwards, and the selection bias b starts at 0 as in the default init.
-- * Balancers: "quantile" is the spec's rule (each step's solution replaces b: qb_rate = 1) with the exact
--   estimator (the interpolated (1 − k/n) quantile of each margin column); "quantile_hist" the same with K3's
--   histogram estimator (1,000 bins of required bias, App. D; the default when the routing batch spans ranks);
--   "quantile_os" the bare (⌊q⌋+1)-th largest margin that moe.md §4.1 warns against (estimator =
--   "order_statistic"), for comparison; "quantile_avg" is the exact estimator with qb_rate = 0.25
--   (b ← b + 0.25·(b̂ − b)), which averages the per-step solutions over a few steps. With
--   q = 256 tokens per expert per step the one-step solution carries sampling noise that β = 1 passes straight into
--   the next step's routing (measured: held-out MaxVio 0.25 with β = 1 at 1,024 tokens/step, 0.16 with β = 0.25,
--   0.09 with β = 0.25 at 2,048 tokens/step).
-- * Held-out MaxVio (moe.md §5 maxvio_global): after training, the whole validation split (`heldout_batches` = 0;
--   a number takes that many batches from its start; the same for every run) is routed through the model in eval
--   mode (no record, b unchanged); per layer load_j = tokens routed to j over the whole held-out set, MaxVio = (max_j load_j −
--   q)/q with q = m·k/n; the table gives the max over the layers. MaxVio of the last training batch is the same
--   over the last step's batch (moe/maxvio_batch), max over layers. Dead fraction: experts with no token over the
--   last 100 steps (moe/dead_experts), summed over layers / (16 x layers).
local tide = require "tide"
local results = require "tide.results"
local F = tide.F

local INITS = { default = true, skewed = true }
-- "quantile" is the spec's rule (qb_rate = 1: the new bias is the step's solution); "quantile_avg" is Quantile
-- Balancing with qb_rate = cfg.qb_avg_rate (b ← b + β(b̂ − b)), which averages the per-step solutions
local BALANCES = { quantile = true, quantile_hist = true, quantile_os = true, quantile_avg = true, sign = true,
  aux = true, none = true }
-- the Quantile Balancing variants: their nn.MoE balance options
local QB_VARIANTS = {
  quantile = { estimator = "exact" }, quantile_hist = { estimator = "histogram" },
  quantile_os = { estimator = "order_statistic" }, quantile_avg = { estimator = "exact" },
}

local function list(s)
  local out = {}
  for item in tostring(s):gmatch("[^,%s]+") do out[#out + 1] = item end
  return out
end

local function moe_layers(model) return model:moe_layers() end

-- the skewed init: W_j += a·x̄/|x̄|² for the hot experts, x̄ = the mean router input of batch x in each MoE layer
local function skew_router(model, x, cfg)
  local layers = moe_layers(model)
  local captured = {}
  for i, m in ipairs(layers) do
    local gate = m.gate
    gate.scores = function(self, xin)
      captured[i] = xin:detach()
      return getmetatable(self).scores(self, xin)
    end
  end
  model:eval()
  tide.no_grad(function() model:forward(x) end)
  model:train()
  for i, m in ipairs(layers) do
    m.gate.scores = nil
    local xb = captured[i]:mean(1, true)                       -- [1, d]
    local nrm2 = (xb * xb):sum():item()
    local dir = (xb * (cfg.skew_offset / nrm2)):tolist()       -- d values (tolist is flat, row-major)
    local W = m.gate.weight
    local d = #dir
    local flat = W:tolist()
    for j = 1, cfg.skew_experts do
      for c = 1, d do flat[(j - 1) * d + c] = flat[(j - 1) * d + c] + dir[c] end
    end
    tide.no_grad(function()
      W:copy_(tide.tensor(flat, { dtype = W:dtype(), device = W:device() }):reshape(W:shape()))
    end)
  end
end

-- route the held-out batches through the model without recording or updating b; per-layer loads over all of them
local function heldout(model, batches, n, k)
  local layers = moe_layers(model)
  local loads, tokens = {}, 0
  for i, m in ipairs(layers) do
    loads[i] = {}
    for j = 1, n do loads[i][j] = 0 end
    m.gate.route = function(self, s)
      local sel, p = getmetatable(self).route(self, s)
      for _, e in ipairs(sel:reshape(-1):tolist()) do loads[i][e + 1] = loads[i][e + 1] + 1 end
      return sel, p
    end
  end
  local loss = 0
  model:eval()
  tide.no_grad(function()
    for _, b in ipairs(batches) do
      loss = loss + F.cross_entropy(model:forward(b[1]), b[2]):item()
      tokens = tokens + b[1]:numel()
    end
  end)
  model:train()
  local worst, per_layer, dead = 0, {}, 0
  local q = tokens * k / n
  for i, m in ipairs(layers) do
    m.gate.route = nil
    local mx = 0
    for j = 1, n do
      mx = math.max(mx, loads[i][j])
      if loads[i][j] == 0 then dead = dead + 1 end
    end
    per_layer[i] = (mx - q) / q
    worst = math.max(worst, per_layer[i])
  end
  return { maxvio = worst, maxvio_per_layer = per_layer, loads = loads, tokens = tokens, dead = dead,
    loss = loss / #batches }
end

local function run_config(cfg, balance, init)
  local moe = {}
  for key, v in pairs(cfg.moe) do moe[key] = v end
  local variant = QB_VARIANTS[balance]
  moe.balance = variant and "quantile" or balance
  if variant then
    moe.estimator = variant.estimator
    moe.qb_rate = balance == "quantile_avg" and cfg.qb_avg_rate or cfg.qb_rate
  end
  return {
    name = "moe_balance-" .. balance .. "-" .. init,
    model = {
      kind = "hybrid", vocab_size = 320, dim = cfg.dim, n_layers = cfg.n_layers,
      mixers = cfg.mixers, ffn_dim = cfg.ffn_dim, residual = cfg.residual, kda = cfg.kda, moe = moe,
    },
    data = cfg.data_cfg,
    optim = cfg.optim,
    schedule = { kind = cfg.schedule.kind, min_lr = cfg.schedule.min_lr, decay = cfg.schedule.decay,
      warmup = math.min(cfg.schedule.warmup, math.floor(cfg.steps / 10)) },
    train = { steps = cfg.steps, log_every = math.max(1, math.floor(cfg.steps / 5)), eval_every = 0,
      eval_batches = cfg.heldout_batches, seed = cfg.seed, quiet = cfg.quiet,
      out = cfg.out ~= "" and (cfg.out .. "/" .. balance .. "-" .. init) or nil, ckpt_every = 0 },
    overwrite = cfg.overwrite,   -- --overwrite reaches every cell's run directory
  }
end

local function markdown(rec)
  local L = {}
  L[#L + 1] = "# MoE load balancing study (recipes/moe_balance.lua)"
  L[#L + 1] = ""
  L[#L + 1] = string.format("%s, %d thread(s) (the machine may be shared: train s carries that noise). nn.HybridLM d = %d, %d layers (mixers \"%s\", "
    .. "KDA %d x %d), both FFNs MoE: %d experts, top-%d, d_e = %d, %s, %d shared expert(s); byte text of the quickstart "
    .. "(batch %d x %d), AdamW lr %g (WSD), %d steps, seed %d. Skewed init: router rows of experts 0..%d offset so their "
    .. "logit rises by %g at the mean router input of the first batch. Held-out: %d validation batches (%d tokens) routed "
    .. "in eval mode, b unchanged; quantile_avg = quantile with qb_rate %g. Loss = mean of the last 20 training steps (aux runs include the α = 1e-3 aux term; "
    .. "the held-out loss is plain cross-entropy for all). Held-out, b averaged (QB runs, a diagnostic): the same pass "
    .. "with b = the mean of the biases used over the last " .. rec.avg_window .. " steps, which removes the sampling "
    .. "noise of the one-step solution the run ends with.", rec.date, rec.threads, rec.dim, rec.n_layers, rec.mixers,
    rec.kda.heads, rec.kda.head_dim, rec.moe.n_experts, rec.moe.top_k, rec.moe.expert_dim, rec.moe.activation,
    rec.moe.n_shared, rec.batch_size, rec.seq_len, rec.lr, rec.steps, rec.seed, rec.skew_experts - 1, rec.skew_offset,
    rec.heldout_batches, rec.heldout_tokens or 0, rec.qb_avg_rate)
  L[#L + 1] = ""
  L[#L + 1] = "| balance | init | final loss | held-out loss | MaxVio step 1 | MaxVio last batch | MaxVio held-out "
    .. "| held-out, b averaged | dead experts | train s |"
  L[#L + 1] = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  for _, r in ipairs(rec.runs) do
    L[#L + 1] = string.format("| %s | %s | %.4f | %.4f | %.2f | %.3f | %.3f | %s | %.1f%% | %.0f |", r.balance, r.init,
      r.final_loss, r.heldout_loss, r.maxvio_first, r.maxvio_last_batch, r.maxvio_heldout,
      r.maxvio_heldout_bavg and string.format("%.3f", r.maxvio_heldout_bavg) or "–", 100 * r.dead_fraction,
      r.train_seconds)
  end
  L[#L + 1] = ""
  for _, c in ipairs(rec.claims) do L[#L + 1] = "- " .. c end
  L[#L + 1] = ""
  return table.concat(L, "\n")
end

local function run(cfg)
  if cfg.threads then tide.set_num_threads(cfg.threads) end
  local balances, inits = list(cfg.balances), list(cfg.inits)
  for _, b in ipairs(balances) do if not BALANCES[b] then error("moe_balance: unknown balance '" .. b .. "'", 0) end end
  for _, i in ipairs(inits) do if not INITS[i] then error("moe_balance: unknown init '" .. i .. "'", 0) end end
  local train = require "tide.train"
  local data = require "tide.data"
  -- the fixed held-out set: the first validation batches (the same for every run)
  local d = data.build(cfg.data_cfg, 320)
  local vs = d.val()
  if cfg.heldout_split == "train" then
    -- random windows of the training split under another seed (same distribution as training, not the same batches)
    vs = data.text.stream(d.dataset.train, { batch_size = cfg.data_cfg.batch_size, seq_len = cfg.data_cfg.seq_len,
      seed = 1000003, order = "random" })
    vs.n_windows = math.floor((d.dataset.val.n - 1) / vs.T)
  end
  local hb = {}
  local nhb = cfg.heldout_batches
  if nhb == 0 then nhb = math.floor(vs.n_windows / vs.B) end      -- 0: the whole validation split, once
  for i = 1, nhb do local x, y = vs:next(); hb[i] = { x, y } end
  cfg.heldout_batches = nhb
  local rec = {
    study = "moe_balance", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(), dim = cfg.dim,
    n_layers = cfg.n_layers, mixers = cfg.mixers, kda = cfg.kda, moe = cfg.moe, steps = cfg.steps, seed = cfg.seed,
    lr = cfg.optim.lr, batch_size = cfg.data_cfg.batch_size, seq_len = cfg.data_cfg.seq_len,
    skew_experts = cfg.skew_experts, skew_offset = cfg.skew_offset, heldout_batches = cfg.heldout_batches,
    qb_rate = cfg.qb_rate, qb_avg_rate = cfg.qb_avg_rate, avg_window = cfg.avg_window, target_maxvio = cfg.target_maxvio,
    runs = {}, claims = {},
  }
  local t_all = tide.time()
  local by = {}
  for _, init in ipairs(inits) do
    for _, balance in ipairs(balances) do
      local tcfg = run_config(cfg, balance, init)
      local first_mv
      local bsum, bcount = {}, 0      -- the biases used over the last avg_window steps (QB runs: the noise floor)
      tcfg.loss = function(m, x, y, step)
        if step == 0 and init == "skewed" then skew_router(m, x, cfg) end
        if QB_VARIANTS[balance] and step >= cfg.steps - cfg.avg_window then
          for i, layer in ipairs(moe_layers(m)) do
            bsum[i] = bsum[i] or {}
            for j, v in ipairs(layer.gate.e_score_correction_bias:tolist()) do bsum[i][j] = (bsum[i][j] or 0) + v end
          end
          bcount = bcount + 1
        end
        if step == 1 then
          -- MaxVio of step 1 (the routing the init produces), from the first balance_step's metrics
          first_mv = 0
          for _, mt in pairs(m:moe_metrics()) do first_mv = math.max(first_mv, mt.maxvio_batch or 0) end
        end
        return m:loss(x, y)
      end
      io.stderr:write(string.format("moe_balance: balance = %s, init = %s, %d steps\n", balance, init, cfg.steps))
      local r = train(tcfg)
      if r.stopped then error("moe_balance: " .. tcfg.name .. " " .. r.stopped, 0) end
      local model = r.model
      local mv_last, dead, nl = 0, 0, 0
      for _, mt in pairs(model:moe_metrics()) do
        mv_last = math.max(mv_last, mt.maxvio_batch)
        dead = dead + mt.dead_experts
        nl = nl + 1
      end
      local ho = heldout(model, hb, cfg.moe.n_experts, cfg.moe.top_k)
      rec.heldout_tokens = ho.tokens
      local ho_avg
      if bcount > 0 then
        -- the same held-out pass with b = the mean of the biases used over the last avg_window steps: what is left
        -- when the one-step solution's sampling noise is averaged out (a diagnostic; training used the last b)
        local saved = {}
        for i, layer in ipairs(moe_layers(model)) do
          local bias = layer.gate.e_score_correction_bias
          saved[i] = bias:clone()
          local mean = {}
          for j, v in ipairs(bsum[i]) do mean[j] = v / bcount end
          tide.no_grad(function() bias:copy_(tide.tensor(mean, { dtype = bias:dtype(), device = bias:device() })) end)
        end
        ho_avg = heldout(model, hb, cfg.moe.n_experts, cfg.moe.top_k)
        for i, layer in ipairs(moe_layers(model)) do
          tide.no_grad(function() layer.gate.e_score_correction_bias:copy_(saved[i]) end)
        end
      end
      local row = {
        balance = balance, init = init, final_loss = r.final_loss, last_loss = r.last_loss, heldout_loss = ho.loss,
        maxvio_first = first_mv or 0 / 0, maxvio_last_batch = mv_last, maxvio_heldout = ho.maxvio,
        maxvio_heldout_bavg = ho_avg and ho_avg.maxvio or nil,
        maxvio_heldout_per_layer = ho.maxvio_per_layer, heldout_loads = ho.loads, heldout_dead = ho.dead,
        dead_fraction = dead / (cfg.moe.n_experts * nl), train_seconds = r.elapsed, params = model:num_parameters(),
      }
      rec.runs[#rec.runs + 1] = row
      by[balance .. "-" .. init] = row
      io.stderr:write(string.format("moe_balance: %s/%s: loss %.4f, held-out loss %.4f, MaxVio last %.3f, held-out %.3f, "
        .. "dead %.1f%%, %.0f s\n", balance, init, row.final_loss, row.heldout_loss, mv_last, ho.maxvio,
        100 * row.dead_fraction, r.elapsed))
      r, model = nil, nil
      collectgarbage()
    end
  end
  rec.total_seconds = tide.time() - t_all
  for _, init in ipairs(inits) do
    local a, n = by["aux-" .. init], by["none-" .. init]
    for _, qn in ipairs({ "quantile", "quantile_hist", "quantile_os", "quantile_avg" }) do
      local q = by[qn .. "-" .. init]
      if q then
        rec.claims[#rec.claims + 1] = string.format("%s init: %s held-out MaxVio %.3f <= %g: %s", init, qn,
          q.maxvio_heldout, cfg.target_maxvio, q.maxvio_heldout <= cfg.target_maxvio and "yes" or "NO")
        if a then
          rec.claims[#rec.claims + 1] = string.format("%s init: %s held-out loss %.4f vs aux %.4f (%+.2f%%), no worse: %s",
            init, qn, q.heldout_loss, a.heldout_loss, 100 * (q.heldout_loss / a.heldout_loss - 1),
            q.heldout_loss <= a.heldout_loss and "yes" or "NO")
        end
      end
    end
    if n then
      rec.claims[#rec.claims + 1] = string.format("%s init: none ends at held-out MaxVio %.3f, %.1f%% dead experts", init,
        n.maxvio_heldout, 100 * n.dead_fraction)
    end
  end
  rec.claims[#rec.claims + 1] = string.format("total wall time %.0f s", rec.total_seconds)
  local md = markdown(rec)
  io.write(md)
  results.write(cfg.results, "moe_balance", rec, md, { "study", "date" })
  return 0
end

return {
  name = "moe_balance",
  balances = "quantile,quantile_hist,quantile_os,quantile_avg,sign,aux,none",
  inits = "default,skewed",
  dim = 64, n_layers = 2, mixers = "K", ffn_dim = 128, residual = "prenorm",
  kda = { heads = 2, head_dim = 32 },
  moe = { n_experts = 16, top_k = 2, expert_dim = 64, n_shared = 1, activation = "swiglu", first_dense = false },
  -- the fortunes text of the quickstart; 10% of every file held out (the held-out MaxVio is measured over all of
  -- it: ~270K tokens, so its own sampling noise stays well under the 0.15 it is compared with); 2,048 routed tokens
  -- per step (q = 256 per expert)
  data_cfg = {
    path = "/usr/share/games/fortunes", exclude = { "%.dat$", "%.u8$" }, doc_separator = "%",
    val_fraction = 0.1, seq_len = 128, batch_size = 16,
  },
  optim = { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 },
  schedule = { kind = "wsd", warmup = 20, min_lr = 3e-4, decay = "cosine" },   -- decay over the last 20% of the steps
  steps = 600,
  skew_experts = 4, skew_offset = 3,
  heldout_batches = 0,             -- 0: the whole validation split, once
  qb_rate = 1,
  qb_avg_rate = 0.25,
  target_maxvio = 0.10,
  avg_window = 50,                 -- QB runs: held-out MaxVio also with b averaged over the last 50 steps            -- issue 13: held-out MaxVio of Quantile Balancing at 2,048 routed tokens per step
  heldout_split = "val",
  seed = 1,
  quiet = true,
  out = "",                        -- e.g. "runs/moe_balance": per-run metrics.jsonl (moe/* per step); "" writes none
  results = "bench/results",
  run = run,
}
