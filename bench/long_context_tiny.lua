-- bench/long_context_tiny.lua — the shipped long-context recipe at `tiny` scale, end to end on the CPU
-- (recipes/long_context_1m.lua --scale=tiny: the spec/README.md `tiny` hybrid, stages 256 → 1K → 4K → 16K at 16,384
-- tokens per step up to S2, 16,384 at S3), against a baseline trained ONLY at the shortest stage (T = 256, its mix
-- and η) on as many tokens, same seed, same data sources. Both are scored at every stage length (recall: multi-query associative
-- recall; passkey: needle retrieval at depths 0, 0.5, 1; spec/evals.md). Prints and writes
-- <results>/long_context_tiny.md and .json: tokens/s and peak memory per stage of the curriculum, and the accuracy
-- table of both models. It reports; it asserts nothing (the claim lines say whether the curriculum model beats the
-- baseline at the longest trained length).
--
--   tide run bench/long_context_tiny.lua                     both runs (about 35 minutes on 2 idle cores)
--   tide run bench/long_context_tiny.lua --steps_scale=0.25  a quicker, shorter version of both
local tide = require "tide"
local cli = require "tide.cli"
local curriculum = require "tide.curriculum"
local results = require "tide.results"
local evals = require "tide.evals"

local fmt = string.format

local function load_tiny(cfg)
  local c = cli.load_recipe("recipes/long_context_1m.lua", {})
  c.scale = "tiny"
  c = curriculum.apply_scale(c)
  for _, st in ipairs(c.stages) do
    st.steps = math.max(1, math.floor(st.steps * cfg.steps_scale + 0.5))
    if st.lr.warmup then st.lr.warmup = math.min(st.lr.warmup, st.steps - 1) end
  end
  c.train.quiet = cfg.quiet
  c.train.ckpt_every = 0
  c.train.out = cfg.out ~= "" and cfg.out or nil
  c.overwrite = cfg.overwrite
  for _, e in ipairs(c.evals) do
    if e.source == "recall" then e.examples = cfg.recall_examples end
  end
  return c
end

-- token accuracy over all rows of (task, length) (passkey: pooled over depths), and the labelled positions
local function accuracy(rows, task, length)
  local hits, n = 0, 0
  for _, r in ipairs(rows) do
    if r.task == task and r.length == length then hits = hits + r.accuracy * r.labelled; n = n + r.labelled end
  end
  if n == 0 then return nil end
  return hits / n, n
end

-- the binomial standard error of an accuracy p over n labels
local function stderr(p, n) return math.sqrt(math.max(p * (1 - p), 1 / n) / n) end

local function run(cfg)
  if cfg.threads then tide.set_num_threads(cfg.threads) end
  local rec = { benchmark = "long_context_tiny", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(),
    load_start = results.loadavg(), steps_scale = cfg.steps_scale }
  -- 1. the curriculum
  local c = load_tiny(cfg)
  if c.train.out then c.train.out = c.train.out .. "/curriculum" end
  local lengths = c.evals[1].lengths
  local t0 = tide.time()
  local r = curriculum.train(c)
  rec.curriculum = { seconds = tide.time() - t0, steps = r.steps, tokens = r.tokens, final_loss = r.final_loss,
    stages = r.stages, evals = r.evals }
  io.stderr:write(fmt("long_context_tiny: curriculum %d steps in %.0f s\n", r.steps, rec.curriculum.seconds))
  -- 2. the baseline: the first stage only, as many steps as the whole curriculum
  local b = load_tiny(cfg)
  if b.train.out then b.train.out = b.train.out .. "/baseline" end
  -- as many tokens as the whole curriculum, in steps of the first stage's size
  local total, s0 = 0, b.stages[1].tokens_per_step or b.tokens_per_step
  for _, st in ipairs(b.stages) do total = total + st.steps * (st.tokens_per_step or b.tokens_per_step) end
  b.stages = { b.stages[1] }
  b.stages[1].steps = math.ceil(total / s0)
  b.stages[1].name = "S0_256_only"
  t0 = tide.time()
  local rb = curriculum.train(b)
  rec.baseline = { seconds = tide.time() - t0, steps = rb.steps, tokens = rb.tokens, final_loss = rb.final_loss,
    evals = rb.evals }
  rec.load_end = results.loadavg()
  r, rb = nil, nil
  collectgarbage()

  local L = {}
  L[#L + 1] = "# bench/long_context_tiny — the long-context recipe at tiny scale, curriculum vs shortest stage only"
  L[#L + 1] = ""
  L[#L + 1] = fmt("%s, %d threads; load average %s at the start, %s at the end (the machine is shared: times carry that "
    .. "noise). recipes/long_context_1m.lua --scale=tiny (the `tiny` hybrid of spec/README.md: d 128, 8 layers, 6 KDA + 2 "
    .. "MLA, MoE 8 experts top-2 with latent experts and Quantile Balancing, Block AttnRes)%s.",
    rec.date, rec.threads, tostring(rec.load_start), tostring(rec.load_end),
    cfg.steps_scale ~= 1 and fmt(", stage steps x %g", cfg.steps_scale) or "")
  L[#L + 1] = ""
  L[#L + 1] = "## The curriculum, per stage"
  L[#L + 1] = ""
  L[#L + 1] = "| stage | T | steps | tokens/s | peak memory | val loss |"
  L[#L + 1] = "|---|---:|---:|---:|---:|---:|"
  for _, s in ipairs(rec.curriculum.stages) do
    L[#L + 1] = fmt("| %s | %d | %d | %.0f | %s | %s |", s.name, s.seq_len, s.steps, s.tok_per_s or 0,
      curriculum.human(s.mem_peak), s.val_loss and fmt("%.4f", s.val_loss) or "–")
  end
  L[#L + 1] = ""
  L[#L + 1] = fmt("Curriculum: %d steps, %.0f s, final training loss %.4f. Baseline (T = 256 only): %d steps, %.0f s, "
    .. "final training loss %.4f.", rec.curriculum.steps, rec.curriculum.seconds, rec.curriculum.final_loss,
    rec.baseline.steps, rec.baseline.seconds, rec.baseline.final_loss)
  L[#L + 1] = ""
  L[#L + 1] = "## Accuracy by context length (token accuracy over labelled positions; passkey averaged over depths 0, 0.5, 1)"
  L[#L + 1] = ""
  L[#L + 1] = "| task | length | curriculum 256 → 16K | T = 256 only |"
  L[#L + 1] = "|---|---:|---:|---:|"
  rec.table = {}
  for _, task in ipairs({ "mqar", "passkey" }) do
    for _, len in ipairs(lengths) do
      local a, bb = accuracy(rec.curriculum.evals, task, len), accuracy(rec.baseline.evals, task, len)
      if a or bb then
        rec.table[#rec.table + 1] = { task = task, length = len, curriculum = a, baseline = bb }
        L[#L + 1] = fmt("| %s | %d | %s | %s |", task == "mqar" and "recall (MQAR)" or task, len,
          a and fmt("%.1f%%", 100 * a) or "–", bb and fmt("%.1f%%", 100 * bb) or "–")
      end
    end
  end
  L[#L + 1] = ""
  local longest = lengths[#lengths]
  rec.claims = {}
  for _, task in ipairs({ "mqar", "passkey" }) do
    local a, na = accuracy(rec.curriculum.evals, task, longest)
    local bb, nb = accuracy(rec.baseline.evals, task, longest)
    if a and bb then
      -- better = ahead by more than two standard errors of the difference
      local se = math.sqrt(stderr(a, na) ^ 2 + stderr(bb, nb) ^ 2)
      local verdict = a - bb > 2 * se and "the curriculum is better"
        or (a > bb and "the curriculum is ahead, within noise" or "the curriculum is NOT better")
      rec.claims[#rec.claims + 1] = { task = task, length = longest, curriculum = a, baseline = bb,
        labels_curriculum = na, labels_baseline = nb, stderr_difference = se, verdict = verdict }
      L[#L + 1] = fmt("- %s at the longest trained length (%d): curriculum %.1f%% vs T = 256 only %.1f%% over %d labels "
        .. "each (difference %+.1f points, standard error %.1f): %s%s", task == "mqar" and "recall" or task, longest,
        100 * a, 100 * bb, na, 100 * (a - bb), 100 * se, verdict,
        task == "passkey" and " (chance is 10% per digit)" or "")
    end
  end
  L[#L + 1] = ""
  L[#L + 1] = "The full evaluation tables (per depth for passkey) are in the JSON record."
  L[#L + 1] = ""
  local md = table.concat(L, "\n")
  io.write(md)
  results.write(cfg.results, "long_context_tiny", rec, md)
  return 0
end

return {
  name = "long_context_tiny",
  steps_scale = 1,
  recall_examples = 64,      -- recall examples per length (4 queries each: 256 labels)
  quiet = false,
  out = "",
  results = "bench/results",
  run = run,
}
