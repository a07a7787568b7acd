-- train.lua — tide.train(cfg): one fixed-length run of a recipe's config table, a thin driver over the shared step
-- (tide.step): the batch of each step comes from the data stream (or a packer over named sources), η from the
-- schedule; every `eval_every` steps the validation split is scored; every `ckpt_every` steps (and at the end) a
-- checkpoint is written (formats.md §6). train.micro_batches = N splits each step's batch into N micro-batches with
-- the same loss and gradients (only the memory changes). The non-finite policy, resume and the checkpoint state are
-- the step module's: a non-finite loss or gradient skips the step (the data cursor and t advance); 5 consecutive
-- skips roll back to the last checkpoint; after 2 rollbacks the run stops with a report naming the first
-- non-finite tensor (DESIGN.md §6). Resuming continues with bit-identical losses.
local ffi = require "ffi"
local tide = require "tide"
local nn = require "tide.nn"
local optim = require "tide.optim"
local schedule = require "tide.schedule"
local data = require "tide.data"
local sources = require "tide.data.sources"
local tokenizer = require "tide.data.tokenizer"
local log = require "tide.log"
local options = require "tide.options"
local generate = require "tide.generate"
local step = require "tide.step"
require "tide.checkpoint"   -- declares kill() and getpid() to the FFI (the fault test below)
local dist = require "tide.dist"

local fmt = string.format
local WHO = "tide.train"

local TRAIN_KEYS = {
  steps = true, eval_every = true, eval_batches = true, ckpt_every = true, keep_ckpts = true, out = true,
  log_every = true, seed = true, threads = true, collect_every = true, quiet = true, jitter_window = true,
  micro_batches = true, tensorboard = true,
}
local SECTIONS = {
  model = false,   -- checked by the model builder
  data = false,    -- checked by data.build, or below for packed data
  optim = optim.KEYS,
  schedule = false,   -- checked by schedule.new
  train = TRAIN_KEYS,
  sample = { prompts = true, max_new_tokens = true, temperature = true, top_k = true, top_p = true, seed = true },
  expect = { final_loss_below = true },
  dist = dist.KEYS,
}
-- and the command line's flags (options.RUN_FLAGS): --out, --seed, --threads override train.out/seed/threads
local TOP = options.with_run_flags {
  name = true, description = true, model = true, data = true, optim = true, schedule = true, train = true, dist = true,
  sample = true, on_nonfinite = true, run = true, loss = true, expect = true,
}
-- packed data: documents of named sources (tide.data.sources) packed into rows of seq_len, as a curriculum stage
local PACKED = { sources = true, mix = true, seq_len = true, batch_size = true, seed = true, tokenizer = true }

-- the numeric fields of tide.train's own sections (train, optim and the top-level seed/threads: step.check_numbers)
local function nonneg_num(v, what, who, level) return options.finite_number(v, what, who, level, 0) end
local function top_p(v, what, who, level)
  if type(v) ~= "number" or not (v > 0 and v <= 1) then
    options.fail(who, fmt("%s must be a number in (0, 1], got %s", what, tostring(v)), level)
  end
end
local NUMERIC = {
  train = { steps = options.pos_int, eval_every = options.nonneg_int, eval_batches = options.pos_int,
    micro_batches = options.pos_int },
  sample = { max_new_tokens = options.nonneg_int, temperature = nonneg_num, top_k = options.nonneg_int, top_p = top_p,
    seed = options.seed },
  expect = { final_loss_below = options.finite_number },
}

-- unknown keys are errors that name the key and list the known ones
local function validate(cfg)
  if type(cfg) ~= "table" then options.fail(WHO, "expected a config table, got a " .. type(cfg)) end
  options.check(cfg, TOP, "the config", WHO)
  for section, keys in pairs(SECTIONS) do
    local t = cfg[section]
    if t ~= nil and type(t) ~= "table" then options.fail(WHO, fmt("cfg.%s must be a table, got a %s", section, type(t))) end
    if t and keys then options.check(t, keys, "cfg." .. section, WHO) end
  end
  step.check_numbers(cfg, WHO)
  for section, spec in pairs(NUMERIC) do options.fields(cfg[section], spec, section, WHO) end
  if not cfg.data then options.fail(WHO, "the config needs a `data` table (path, seq_len, batch_size)") end
  options.check(cfg.data, cfg.data.sources and PACKED or data.KEYS, "cfg.data", WHO)
  local policy = cfg.on_nonfinite or "skip"
  if policy ~= "skip" and policy ~= "stop" then
    options.fail(WHO, "on_nonfinite must be 'skip' or 'stop', got '" .. tostring(policy) .. "'")
  end
end

-- the batches of one step: `micro` micro-batches of B / micro rows each (rows lo .. hi − 1 of the step's batch
-- alone when given: a data-parallel rank's share)
local function stream_batches(stream, micro, count_targets, lo, hi)
  local x, y
  if lo then x, y = stream:rows(lo, hi) else x, y = stream:next() end
  local B = x:shape()[1]
  local n = count_targets and function(t)
    local c = 0
    for _, v in ipairs(t:tolist()) do if v ~= data.pack.IGNORE then c = c + 1 end end     -- flat, row-major
    return c
  end
  local out, rows = {}, B / micro
  for i = 1, micro do
    local xi = micro == 1 and x or x:narrow(1, (i - 1) * rows + 1, rows)
    local yi = micro == 1 and y or y:narrow(1, (i - 1) * rows + 1, rows)
    out[i] = { ids = xi, targets = yi, n_targets = n and n(yi) or nil }
  end
  return out
end

-- data: {tokenizer, train = {B, T, next_step (micro) -> batches, state, set_state}, val = factory | nil, about}
local function build_data(cfg, V, seed, lane_opts)
  local dcfg = {}
  for k, v in pairs(cfg.data) do dcfg[k] = v end
  if dcfg.seed == nil then dcfg.seed = seed end
  if dcfg.sources then
    local B = options.pos_int(dcfg.batch_size, "data.batch_size", WHO)
    local T = options.pos_int(dcfg.seq_len, "data.seq_len", WHO)
    local tok = tokenizer.for_model(dcfg.tokenizer, V, "data.tokenizer", WHO)   -- "byte" or a tokenizer.json
    local built = sources.build(dcfg.sources, tok, dcfg.seed, WHO, (cfg.model or {}).vision)
    local names = options.sorted_keys(built)
    local packer = sources.packer(names, built, T, dcfg.seed, tok:id("<|endoftext|>"), lane_opts)
    local mix = {}
    for _, n in ipairs(names) do mix[n] = 1 end
    packer:set_mix(sources.mix_entries(sources.mix(dcfg.mix or mix, built, "data", WHO)))
    return { tokenizer = tok, about = fmt("packed documents of %s; batch %d x %d", table.concat(names, ", "), B, T),
      -- (several ranks: every data lane's state, gathered; next_step(micro, n_ranks): this rank's micro-batches of
      -- B / (micro · n_ranks) rows from the lanes it hosts)
      train = { B = B, T = T, state = function() return dist.lane_states(packer) end,
        set_state = function(s) packer:set_state(s) end, laned = true,
        next_step = function(micro, n_ranks) return packer:next_step(micro, B / (micro * (n_ranks or 1))) end } }
  end
  local d = data.build(dcfg, V)
  local stream = d.train
  local count = cfg.data.task ~= nil     -- synthetic tasks label only some positions
  return { tokenizer = d.tokenizer, val = d.val, count_targets = count,
    about = fmt("%d train tokens%s from %d file(s); batch %d x %d", d.dataset.train.n,
      d.dataset.val and fmt(", %d val tokens", d.dataset.val.n) or "", #d.dataset.files, stream.B, stream.T),
    train = { B = stream.B, T = stream.T, state = function() return stream:state() end,
      set_state = function(s) stream:set_state(s) end,
      next_step = function(micro) return stream_batches(stream, micro, count) end,
      -- a stream whose rows are drawn one by one: rank r of dp reads rows [r B/dp, (r + 1) B/dp) alone
      next_rows = stream.rows and function(micro, lo, hi) return stream_batches(stream, micro, count, lo, hi) end } }
end

-- the validation loss over eval_batches fixed batches, and with MoE layers their maxvio_global over the same tokens
-- (moe.md §5), keyed by the 0-based layer index
local function evaluate(model, d, batches)
  if not d.val then return nil end
  local total = 0
  local maxvio = step.with_eval_loads(model, function()
    local s = d.val()
    for _ = 1, batches do
      local x, y = s:next()
      total = total + model:loss(step.to_model(model, x), step.to_model(model, y)):item()
    end
  end)
  return total / batches, maxvio
end

-- setup: the model first (its initialisation draws from the RNG seeded here), then data, optimiser, the run
local function setup(cfg)
  local tcfg = cfg.train or {}
  local seed = cfg.seed or tcfg.seed or 0
  local threads = cfg.threads or tcfg.threads
  if threads then tide.set_num_threads(threads) end
  step.preflight(cfg.model, WHO)
  local dp = dist.layout(cfg.dist, WHO)
  tide.manual_seed(seed)
  local model = nn.build(cfg.model or {}, dist.build_opts(dp))   -- (expert parallelism: this rank's experts only)
  local V = model.cfg.vocab_size
  local d = build_data(cfg, V, seed, dp.lane_opts)
  if d.tokenizer.vocab_size ~= V then
    options.fail(WHO, fmt("the tokenizer has %d ids but the model's vocab_size is %d", d.tokenizer.vocab_size, V))
  end
  local micro = tcfg.micro_batches or 1
  options.pos_int(micro, "train.micro_batches", WHO)
  if d.train.B % (micro * dp.n) ~= 0 then
    options.fail(WHO, dp.n > 1
      and fmt("the batch of %d rows does not split into dist.dp x train.micro_batches = %d x %d micro-batches", d.train.B,
        dp.n, micro)
      or fmt("train.micro_batches %d does not divide the batch of %d rows", micro, d.train.B))
  end
  if dp.n > 1 then
    -- rank r trains on the r-th group of `micro` micro-batches of the step's global batch, so N ranks see what one rank
    -- with N x micro sees, and the data cursor (the step's batch) is the same on every rank. A text stream draws each
    -- row alone: the rank reads only its rows (r B/dp .. (r + 1) B/dp). Packed documents come from the rank's data
    -- lanes (dist.lanes). A synthetic task stream is drawn whole and the rank keeps its micro-batches.
    if d.train.next_rows then
      local rows_of, per = d.train.next_rows, d.train.B / dp.n
      d.train.next_step = function(m) return rows_of(m, dp.data_rank * per, (dp.data_rank + 1) * per) end
      d.reads = "only its rows of the stream"
    elseif d.train.laned then
      -- packed documents: the rank's data lanes (pack.Lanes) read documents no other rank reads
      local step_of = d.train.next_step
      d.train.next_step = function(m) return step_of(m, dp.n) end
      d.reads = fmt("only the documents of its %d data lane%s of %d", dp.lanes / dp.n, dp.lanes / dp.n == 1 and "" or "s",
        dp.lanes)
    else
      local all_of = d.train.next_step
      d.train.next_step = function(m)
        local all, mine = all_of(m * dp.n), {}
        for i = 1, m do mine[i] = all[dp.data_rank * m + i] end
        return mine
      end
      d.reads = "the step's whole batch, keeping its micro-batches"
    end
  end
  dist.shard_model(model, dp)                          -- expert parallelism: this rank's experts only
  local opt = optim.build(cfg.optim or {}, model)
  if dp.zero >= 1 then opt:shard(dist, dp.zero) end
  local loss_fn = cfg.loss
  local stepper = step.stepper({ model = model, optim = opt, clip = (cfg.optim or {}).clip,
    on_nonfinite = cfg.on_nonfinite, jitter_window = tcfg.jitter_window, dist = dp.group, bucket_bytes = dp.bucket_bytes,
    cp = dp.cp_group,
    objective = loss_fn and function(m, b, t, ctx) return loss_fn(m, b.ids, b.targets, t, ctx) end })
  local out = cfg.out or tcfg.out
  local run = step.run({ driver = "train", name = cfg.name, cfg = cfg, out = out, quiet = tcfg.quiet,
    tensorboard = tcfg.tensorboard, keep_ckpts = tcfg.keep_ckpts, collect_every = tcfg.collect_every, model = model,
    optim = opt, stepper = stepper,
    tokenizer = d.tokenizer, dist = dp.group,
    get_data = function() return { train = d.train.state() } end,
    set_data = function(cursors) d.train.set_state(cursors.train) end })
  run.dp, run.memory_line = dp.n, dp.n > 1 and dist.memory_line(opt, dp) or nil
  run.rank_map = dp.rank_map
  return model, d, run, micro
end

-- the loop: one shared step per iteration, the record, the eval, the progress line, the non-finite policy
local function loop(cfg, model, d, run, micro)
  local tcfg = cfg.train or {}
  local steps, eval_every, ckpt_every = tcfg.steps or 100, tcfg.eval_every or 0, tcfg.ckpt_every or 0
  local log_every, eval_batches = tcfg.log_every or 10, tcfg.eval_batches or 4
  local lr_at = schedule.new(cfg.schedule, run.optim.lr, steps)
  local logger = run.logger
  local t_start, done_here, t_log, tokens_log, val_loss = tide.time(), 0, tide.time(), 0, nil
  local tokens_per_step = d.train.B * d.train.T
  -- the fault tests (tests/dist/dp_check.sh): this rank raises, or is SIGKILLed, before step 5
  local fail_rank = tonumber(os.getenv("TIDE_TEST_FAIL_RANK") or "")
  local kill_rank = tonumber(os.getenv("TIDE_TEST_KILL_RANK") or "")
  while run.step < steps do
    if run.step == 4 and fail_rank == dist.rank() then
      error(fmt("TIDE_TEST_FAIL_RANK: rank %d fails at step %d (a test)", fail_rank, run.step + 1), 0)
    end
    if run.step == 4 and kill_rank == dist.rank() then ffi.C.kill(ffi.C.getpid(), 9) end   -- (cdef: tide.checkpoint)
    local rec = run:train_step(d.train.next_step(micro), lr_at(run.step))
    done_here = done_here + 1
    if not rec.skipped and eval_every > 0 and run.step % eval_every == 0 then
      local maxvio
      val_loss, maxvio = evaluate(model, d, eval_batches)
      rec.val_loss = val_loss
      for l, v in pairs(maxvio or {}) do rec["moe/maxvio_global/" .. l] = v end
      local line = step.moe_line(model, maxvio)
      if line then logger:line(line) end
    end
    run:record(rec)
    local now = tide.time()
    local p = { step = run.step, steps = steps, loss = rec.loss, lr = rec.lr, val_loss = rec.val_loss,
      elapsed = now - run.t_start, eta = (now - t_start) / done_here * (steps - run.step) }
    local plain_line = run.step % log_every == 0 or run.step == steps or rec.val_loss ~= nil
    if plain_line or logger.tty then
      p.tok_per_s = (tokens_per_step * (done_here - tokens_log)) / math.max(now - t_log, 1e-9)
      if plain_line then t_log, tokens_log = now, done_here end
      if rec.skipped then p.note = "skipped (non-finite " .. rec.nonfinite_tensor .. ")" end
      if plain_line then logger:line(log.progress_text(p)) else logger:progress(p) end
    end
    if run:after_step(rec, ckpt_every > 0 and run.step % ckpt_every == 0 and run.step < steps) then break end
  end
  local r = run:finish()
  if not r.stopped and d.val and (eval_every == 0 or run.step % eval_every ~= 0) then
    val_loss = evaluate(model, d, eval_batches)
  end
  r.val_loss = val_loss
  r.tok_per_s = done_here * tokens_per_step / math.max(tide.time() - t_start, 1e-9)
  return r
end

-- the summary line, the expected bound and the samples
local function report(cfg, r, d, logger)
  if r.steps_run == 0 and not r.stopped then
    -- resuming a finished run: nothing to train and no new losses to judge a bound by
    logger:line(fmt("done: the run is already at step %d of %d, nothing to train%s", r.steps, r.steps,
      r.checkpoint and (", checkpoint " .. r.checkpoint) or ""))
    return
  end
  logger:line(fmt("done: %d steps in %s, final loss %.4f (mean of the last %d)%s, %s tok/s%s",
    r.steps, log.duration(r.elapsed), r.final_loss, r.final_loss_n,
    r.val_loss and fmt(", val loss %.4f", r.val_loss) or "", log.si(r.tok_per_s),
    r.checkpoint and (", checkpoint " .. r.checkpoint) or ""))
  local expect = cfg.expect and cfg.expect.final_loss_below
  if expect and not r.stopped then
    r.expect_met = r.final_loss < expect
    logger:line(fmt("final loss %.4f %s the expected bound %.4f%s", r.final_loss,
      r.expect_met and "is below" or "is NOT below", expect,
      (r.expect_met or cfg.check) and "" or " (a warning; --check makes a missed bound fail the run)"))
  end
  if cfg.sample and not r.stopped then
    local sc = cfg.sample
    r.samples = {}
    for i, prompt in ipairs(sc.prompts or { "" }) do
      local text = generate.generate(r.model, d.tokenizer, {
        prompt = prompt, max_new_tokens = sc.max_new_tokens or 200, temperature = sc.temperature or 0.8,
        top_k = sc.top_k, top_p = sc.top_p, seed = (sc.seed or 0) + i - 1, window = d.train.T,
      })
      r.samples[i] = prompt .. text
      logger:line(fmt("--- sample %d ---\n%s", i, prompt .. text))
    end
  end
end

-- tide.train(cfg) -> result table: losses (per step), final_loss (mean of the last 20), val_loss, tok_per_s,
-- checkpoint, samples, stopped (a report when the non-finite policy ended the run), skipped, rollbacks, model
local function train(cfg)
  validate(cfg)
  local model, d, run, micro = setup(cfg)
  local st = run:open(cfg.resume, cfg.overwrite)
  if st then run.logger:line(fmt("resumed from %s at step %d", run.resumed_from, run.step)) end
  run.logger:line(fmt("model: %s", model:extra_repr()))
  run.logger:line("data: " .. d.about .. (micro > 1 and fmt(" in %d micro-batches", micro) or "")
    .. (run.dp > 1 and fmt("; data parallel over %d ranks (each its 1/%d of every step's batch; a rank reads %s)", run.dp,
      run.dp, d.reads or "?") or ""))
  if run.rank_map then run.logger:line(run.rank_map) end
  if run.memory_line then run.logger:line(run.memory_line) end
  local r = loop(cfg, model, d, run, micro)
  local W = dist.world()
  if W > 1 then
    -- what each rank's engine held at its peak (a collective: every rank's own number in its slot)
    local slots = {}
    for k = 1, W do slots[k] = 0 end
    slots[dist.rank() + 1] = tide.memory().peak
    slots = dist.sums(slots)
    local parts, top = {}, 0
    for k = 1, W do
      parts[k] = fmt("%.2f", slots[k] / 2 ^ 20)
      top = math.max(top, slots[k])
    end
    r.rank_peak_bytes = slots
    run.logger:line(fmt("memory per rank measured: engine peak %s MB (ranks 0..%d), max %.2f MB", table.concat(parts, " / "),
      W - 1, top / 2 ^ 20))
  end
  report(cfg, r, d, run.logger)
  run.logger:close()
  return r
end

-- the `tide run` entry: exit code 0, or 1 when the run stopped early (non-finite policy) or, with --check (the test
-- suite's runs), missed its bound
local function run_cfg(cfg)
  local r = train(cfg)
  return (r.stopped or (cfg.check and r.expect_met == false)) and 1 or 0
end

-- rng_get/rng_set and truncate_metrics stay reachable here for older callers; they live in tide.step
-- KEYS: the config schema's key sets (tide.schema: what the command line may set beyond what a recipe spells out)
return setmetatable({ run = run_cfg, train = train, rng_get = step.rng_get, rng_set = step.rng_set,
  truncate_metrics = step.truncate_metrics, KEYS = { top = TOP, sections = SECTIONS, packed = PACKED } }, { __call = function(_, c) return train(c) end })
