-- recall.lua — the MQAR recall study (issue 4; spec/evals.md §1, §5): pure KDA (mixers "K"), pure NoPE MLA
-- (mixers "M") and the hybrid (mixers "3:1"), at the same depth and about the same parameter count, each trained
-- on MQAR from scratch on the CPU at every sequence length and scored on held-out examples. Prints a table
-- (model x length: accuracy, parameters, training time) and writes <results>/recall.json and recall.md.
--
--   tide run recipes/recall.lua                            the full study (~16 min on 2 idle cores)
--   tide run recipes/recall.lua --lengths=256              one length (~3 min)
--   tide run recipes/recall.lua --models=hybrid,mla        a subset of the models
--   tide run recipes/recall.lua --vocab_size=1024 --lengths=256,1024 --num_pairs=16,64 --queries=2000000
--                                                          the evals.md §1 CPU default V and D = T/16 (hours)
--
-- Choices (tide's, stated so the numbers can be read): d = 64 and 2 layers (evals.md §1 CPU defaults; 2 layers
-- escaped the loss plateau in half the steps of 4, at half the cost a step). With 2 layers the "3:1" schedule
-- (mla.md §7: the last layer is MLA) is KDA then MLA. V = 64 and D = 16 pairs at both lengths, because within this
-- budget nothing left the plateau at ln(V/2) at larger V: V = 1,024 (4 layers, T = 256, 8,192 examples, lr 3e-3
-- and 1e-2; and T = 64, D = 4, 32,000 examples) and V = 256 with D = 16 (to 24,576 examples: 4.6%); V = 64 holds
-- at most 31 keys, hence D = 16 at T = 1,024 too. Batch 16 sequences at both lengths (4 at T = 1,024 left every
-- model near chance). Every cell gets the same training queries, optimiser, schedule and fresh examples (never
-- repeated). Residual "prenorm" (plain PreNorm, so the comparison is about the mixers); nn.HybridLM's small SwiGLU
-- FFN in every layer. A first NoPE MLA layer sees the tokens before it as an unordered set (no position encoding,
-- mla.md §2), so binding a value to the key just before it is hard to learn; KDA's short convolution gives it.
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local mqar = require "tide.data.mqar"
local F = tide.F

local MODELS = {
  kda = { mixers = "K", label = "KDA only" },
  mla = { mixers = "M", label = "MLA only (NoPE)" },
  hybrid = { mixers = "3:1", label = "hybrid 3:1" },
}

local function list(s, numbers)
  local out = {}
  for item in tostring(s):gmatch("[^,%s]+") do
    local v = numbers and tonumber(item) or item
    if v == nil then error("recall: '" .. item .. "' in '" .. tostring(s) .. "' is not a number", 0) end
    out[#out + 1] = v
  end
  return out
end

-- the tide.train config of one (model, length) cell
local function cell_config(cfg, kind, T, D)
  local B = cfg.batch_size
  local examples = math.max(B, math.floor(cfg.queries / D))
  local eval_examples = math.max(1, math.floor(cfg.eval_queries / D))
  local steps = math.max(1, math.floor(examples / B))
  return {
    name = string.format("recall-%s-%d", kind, T),
    model = {
      kind = "hybrid", vocab_size = cfg.vocab_size, dim = cfg.dim, n_layers = cfg.n_layers, mixers = MODELS[kind].mixers,
      ffn_dim = cfg.ffn_dim, residual = cfg.residual, kda = cfg.kda, mla = cfg.mla,
    },
    data = { task = "mqar", seq_len = T, num_pairs = D, batch_size = B, filler = cfg.filler, seed = cfg.seed,
      val_seed = cfg.seed + 1000, examples = examples, val_examples = eval_examples },
    optim = { lr = cfg.lr, betas = { 0.9, 0.98 }, weight_decay = cfg.weight_decay, clip = 1.0 },
    schedule = { kind = "cosine", warmup = math.max(1, math.floor(steps * cfg.warmup_fraction)), min_lr = cfg.lr / 10 },
    train = { steps = steps, log_every = math.max(1, math.floor(steps / 10)), eval_every = 0, eval_batches = 1,
      seed = cfg.seed, out = cfg.out ~= "" and (cfg.out .. "/" .. kind .. "-" .. T) or nil, quiet = cfg.quiet },
    overwrite = cfg.overwrite,   -- --overwrite reaches every cell's run directory
  }, D, B, examples
end

-- the 1-minute load average: the machine is shared, so the training times are read against it
local loadavg = require("tide.results").loadavg

-- parameters of the token mixers alone (the embedding, head, norms and FFNs are the same in every model)
local function mixer_params(model)
  local n = 0
  for l = 1, model.model.layers.n do n = n + model.model.layers:get(l).self_attn:num_parameters() end
  return n
end

-- held-out accuracy of a trained model: examples 0 .. n−1 of the validation seed, in batches of B
local function evaluate(model, dcfg, n, B)
  local c = mqar.check(dcfg)
  local hit, total = 0, 0
  model:eval()
  tide.no_grad(function()
    for first = 0, n - 1, B do
      local x, y = mqar.batch(c, first, math.min(B, n - first))
      local acc, k = mqar.accuracy(model:forward(x), y)
      hit, total = hit + acc * k, total + k
    end
  end)
  model:train()
  return hit / total, total
end

local function markdown(record)
  local L = {}
  L[#L + 1] = "# MQAR recall study (recipes/recall.lua)"
  L[#L + 1] = ""
  L[#L + 1] = string.format("%s, %d threads. V = %d, d = %d, %d layers, residual %s, filler %s; "
    .. "%d training queries per cell (D per example, fresh examples, never repeated), batch %d sequences, "
    .. "AdamW lr %g (cosine), seed %d; accuracy on %d held-out queries (evals.md §1).", record.date, record.threads,
    record.vocab_size, record.dim, record.n_layers, record.residual, record.filler, record.queries, record.batch_size,
    record.lr, record.seed, record.eval_queries)
  L[#L + 1] = ""
  L[#L + 1] = string.format("Total %.0f s; load average %s at the start, %s at the end (the machine is shared, so "
    .. "training times vary with it).", record.total_seconds, tostring(record.loadavg_start), tostring(record.loadavg_end))
  L[#L + 1] = ""
  local head = { "| model | params | mixer params |" }
  local rule = { "|---|---:|---:|" }
  for li, T in ipairs(record.lengths) do
    head[#head + 1] = string.format(" T = %d (D = %d) acc | train s |", T, record.pairs[li])
    rule[#rule + 1] = "---:|---:|"
  end
  L[#L + 1] = table.concat(head)
  L[#L + 1] = table.concat(rule)
  for _, kind in ipairs(record.models) do
    local row = {}
    for _, T in ipairs(record.lengths) do
      local r = record.results[kind .. "-" .. T]
      row[#row + 1] = string.format(" %.1f%% | %.0f |", 100 * r.accuracy, r.train_seconds)
      row.params, row.mixer_params, row.schedule = r.params, r.mixer_params, r.schedule
    end
    local letters = {}
    for l, m in ipairs(row.schedule) do letters[l] = m == "kda" and "K" or "M" end
    L[#L + 1] = string.format("| %s (%s) | %d | %d |%s", MODELS[kind].label, table.concat(letters), row.params,
      row.mixer_params, table.concat(row))
  end
  L[#L + 1] = ""
  for _, c in ipairs(record.claims) do
    L[#L + 1] = string.format("- T = %d: hybrid %.1f%% vs MLA %.1f%%: hybrid >= MLA − 2 points: %s", c.length,
      100 * c.hybrid, 100 * c.mla, c.holds and "yes" or "NO")
  end
  L[#L + 1] = ""
  return table.concat(L, "\n")
end

local function run(cfg)
  if cfg.threads then tide.set_num_threads(cfg.threads) end
  local lengths, models, pair_counts = list(cfg.lengths, true), list(cfg.models), list(cfg.num_pairs, true)
  if #pair_counts ~= 1 and #pair_counts ~= #lengths then
    error(string.format("recall: num_pairs lists %d values for %d lengths (give one, or one per length)",
      #pair_counts, #lengths), 0)
  end
  for _, k in ipairs(models) do
    if not MODELS[k] then error("recall: unknown model '" .. k .. "' (known: kda, mla, hybrid)", 0) end
  end
  local train = require "tide.train"
  local record = {
    study = "recall", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(), lengths = lengths,
    models = models, vocab_size = cfg.vocab_size, dim = cfg.dim, n_layers = cfg.n_layers, residual = cfg.residual,
    filler = cfg.filler, pairs = {}, queries = cfg.queries, batch_size = cfg.batch_size,
    lr = cfg.lr, seed = cfg.seed, eval_queries = cfg.eval_queries, kda = cfg.kda, mla = cfg.mla, ffn_dim = cfg.ffn_dim,
    results = {}, claims = {}, loadavg_start = loadavg(),
  }
  local t_all = tide.time()
  for li, T in ipairs(lengths) do
    record.pairs[li] = pair_counts[li] or pair_counts[1]
    for _, kind in ipairs(models) do
      local tcfg, D, B, n_examples = cell_config(cfg, kind, T, record.pairs[li])
      io.stderr:write(string.format("recall: %s, T = %d, D = %d, batch %d, %d steps\n", kind, T, D, B, tcfg.train.steps))
      -- train accuracy on the batch just seen, from the logits the loss already computed
      local curve = {}
      tcfg.loss = function(m, x, y, step)
        local logits = m:forward(x)
        if (step + 1) % tcfg.train.log_every == 0 then
          local acc = mqar.accuracy(logits:detach(), y)
          curve[#curve + 1] = { step = step + 1, accuracy = acc }
          if not cfg.quiet then
            io.stderr:write(string.format("  step %d: train batch accuracy %.1f%%\n", step + 1, 100 * acc))
          end
        end
        return F.cross_entropy(logits, y)
      end
      local r = train(tcfg)
      if r.stopped then error("recall: " .. tcfg.name .. " " .. r.stopped, 0) end
      local acc, n = evaluate(r.model, { vocab_size = cfg.vocab_size, seq_len = T, num_pairs = D, filler = cfg.filler,
        seed = tcfg.data.val_seed }, tcfg.data.val_examples, B)
      local res = {
        model = kind, mixers = MODELS[kind].mixers, schedule = r.model.schedule, length = T, pairs = D, batch = B,
        steps = r.steps, examples = n_examples, params = r.model:num_parameters(), mixer_params = mixer_params(r.model),
        accuracy = acc, labelled = n, final_loss = r.final_loss, train_seconds = r.elapsed, tok_per_s = r.tok_per_s,
        curve = curve,
      }
      record.results[kind .. "-" .. T] = res
      io.stderr:write(string.format("recall: %s T = %d: accuracy %.2f%% on %d queries, %d params, %.0f s\n",
        kind, T, 100 * acc, n, res.params, r.elapsed))
      r = nil
      collectgarbage()
    end
    local h, m = record.results["hybrid-" .. T], record.results["mla-" .. T]
    if h and m then
      record.claims[#record.claims + 1] = { length = T, hybrid = h.accuracy, mla = m.accuracy,
        holds = h.accuracy >= m.accuracy - 0.02 }
    end
  end
  record.total_seconds = tide.time() - t_all
  record.loadavg_end = loadavg()
  local md = markdown(record)
  io.write(md)
  require("tide.results").write(cfg.results, "recall", record, md, { "study", "date" })
  return record
end

return {
  name = "recall",
  lengths = "256,1024",            -- sequence lengths T
  models = "kda,mla,hybrid",       -- which of the three models
  num_pairs = "16",                -- D: one value for every length, or one per length ("16,64")
  vocab_size = 64, dim = 64, n_layers = 2, ffn_dim = 128, residual = "prenorm", filler = "zero",
  kda = { heads = 2, head_dim = 32 },
  mla = { heads = 2, nope_dim = 32, rope_dim = 16, kv_rank = 64, v_dim = 32 },
  queries = 196608,                -- training queries per cell, every model and length (examples = queries / D)
  batch_size = 16,                 -- sequences per step at every length (4 at T = 1,024 stayed near chance: too noisy)
  lr = 3e-3, weight_decay = 0.1, warmup_fraction = 0.1,
  eval_queries = 8192,             -- held-out queries scored per cell (eval_queries / D examples)
  seed = 1,
  out = "runs/recall",             -- per-cell metrics.jsonl and final checkpoint; "" writes none
  quiet = false,
  results = "bench/results",       -- where recall.json / recall.md go; "" writes nothing
  run = run,
}
