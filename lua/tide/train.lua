-- train.lua — the training loop: tide.train(cfg) runs a recipe's config table.
--
-- One step (spec/optim.md §5): next batch -> forward -> loss -> backward -> global grad norm ->
-- clip -> AdamW at lr = schedule(t) -> t + 1 -> JSONL record. Every `eval_every` steps the validation
-- split is scored; every `ckpt_every` steps (and at the end) a checkpoint is written (formats.md §6).
-- A non-finite loss or gradient skips the step (weights and optimiser state untouched, data cursor
-- and t advance); 5 consecutive skips roll back to the last checkpoint; after 2 rollbacks the run
-- stops with a report naming the first non-finite tensor (DESIGN.md §6).
-- Resuming restores weights, optimiser moments, t, the data cursor and the RNG, so the losses after
-- a resume equal those of an uninterrupted run bit for bit.
local ffi = require "ffi"
local tide = require "tide"
local nn = require "tide.nn"
local optim = require "tide.optim"
local schedule = require "tide.schedule"
local data = require "tide.data"
local checkpoint = require "tide.checkpoint"
local log = require "tide.log"
local json = require "tide.json"
local generate = require "tide.generate"

local SECTIONS = {
  model = false,   -- checked by the model builder
  data = data.KEYS,
  optim = optim.KEYS,
  schedule = false,   -- checked by schedule.new
  train = {
    steps = true, eval_every = true, eval_batches = true, ckpt_every = true, keep_ckpts = true, out = true,
    log_every = true, seed = true, threads = true, collect_every = true, quiet = true, jitter_window = true,
  },
  sample = { prompts = true, max_new_tokens = true, temperature = true, top_k = true, top_p = true, seed = true },
  expect = { final_loss_below = true },
}
local TOP = {
  name = true, description = true, model = true, data = true, optim = true, schedule = true, train = true,
  sample = true, on_nonfinite = true, resume = true, run = true, loss = true, expect = true,
  -- set by the command line (--out, --seed, --threads, --dry-run); they override train.out/seed/threads
  out = true, seed = true, threads = true, dry_run = true,
}

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out)
  return out
end

-- unknown keys are errors that name the key and list the known ones
local function validate(cfg)
  if type(cfg) ~= "table" then error("tide.train: expected a config table, got a " .. type(cfg), 3) end
  for k in pairs(cfg) do
    if not TOP[k] then
      error("tide.train: unknown key '" .. tostring(k) .. "' in the config; known keys: " ..
        table.concat(sorted_keys(TOP), ", "), 3)
    end
  end
  for section, keys in pairs(SECTIONS) do
    local t = cfg[section]
    if t ~= nil and type(t) ~= "table" then
      error("tide.train: cfg." .. section .. " must be a table, got a " .. type(t), 3)
    end
    if t and keys then
      for k in pairs(t) do
        if not keys[k] then
          error("tide.train: unknown key '" .. tostring(k) .. "' in cfg." .. section .. "; known keys: " ..
            table.concat(sorted_keys(keys), ", "), 3)
        end
      end
    end
  end
  if not cfg.data then error("tide.train: the config needs a `data` table (path, seq_len, batch_size)", 3) end
  local policy = cfg.on_nonfinite or "skip"
  if policy ~= "skip" and policy ~= "stop" then
    error("tide.train: on_nonfinite must be 'skip' or 'stop', got '" .. tostring(policy) .. "'", 3)
  end
end

local function is_finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

-- uint64 (seed, offset) <-> decimal strings, exact beyond 2^53
local function u64_str(x)
  return (tostring(ffi.new("uint64_t", x)):gsub("ULL$", ""))
end
local function str_u64(s)
  local v = ffi.new("uint64_t", 0)
  for d in tostring(s):gmatch("%d") do v = v * 10 + tonumber(d) end
  return v
end

local function rng_get()
  local s, o = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  tide.C.tide_rng_get(s, o)
  return { seed = u64_str(s[0]), offset = u64_str(o[0]) }
end

local function rng_set(r) tide.C.tide_rng_set(str_u64(r.seed), str_u64(r.offset)) end

-- keep only the records of steps <= step (a resumed run rewrites what follows)
local function truncate_metrics(path, step)
  local f = io.open(path, "rb")
  if not f then return end
  local keep = {}
  for line in f:lines() do
    local s = tonumber(line:match('^{"step":(%d+)'))
    if s == nil or s <= step then keep[#keep + 1] = line end
  end
  f:close()
  f = assert(io.open(path, "wb"))
  for _, line in ipairs(keep) do f:write(line, "\n") end
  f:close()
end

-- the serialisable part of the config (functions dropped)
local function plain(v)
  if type(v) == "table" then
    local out = {}
    for k, x in pairs(v) do
      if type(x) ~= "function" then out[k] = plain(x) end
    end
    return out
  end
  return v
end

local function train(cfg)
  validate(cfg)
  local tcfg = cfg.train or {}
  local steps = tcfg.steps or 100
  local eval_every = tcfg.eval_every or 0
  local eval_batches = tcfg.eval_batches or 4
  local ckpt_every = tcfg.ckpt_every or 0
  local log_every = tcfg.log_every or 10
  local collect_every = tcfg.collect_every or 1
  local out = cfg.out or tcfg.out
  local seed = cfg.seed or tcfg.seed or 0
  local policy = cfg.on_nonfinite or "skip"
  local clip = (cfg.optim or {}).clip
  if clip == nil then clip = 1.0 end
  local threads = cfg.threads or tcfg.threads
  if threads then tide.set_num_threads(threads) end

  -- build: the model first (its initialisation draws from the RNG seeded here), then data and optimiser
  tide.manual_seed(seed)
  local model = nn.build(cfg.model or {})
  local V = model.cfg.vocab_size
  local dcfg = {}
  for k, v in pairs(cfg.data) do dcfg[k] = v end
  if dcfg.seed == nil then dcfg.seed = seed end
  local d = data.build(dcfg, V)
  if d.tokenizer.vocab_size ~= V then
    error(string.format("tide.train: the tokenizer has %d ids but the model's vocab_size is %d", d.tokenizer.vocab_size, V), 2)
  end
  local opt = optim.build(cfg.optim or {}, model)
  local lr_at = schedule.new(cfg.schedule, opt.lr, steps)
  local loss_fn = cfg.loss or function(m, x, y) return m:loss(x, y) end
  local stream = d.train
  local tokens_per_step = stream.B * stream.T

  local logger = log.open({ quiet = tcfg.quiet })
  local step, tokens, last_ckpt = 0, 0, nil
  local rollbacks, consecutive, skipped_total = 0, 0, 0

  local function state()
    local moe = {}
    for i, m in ipairs(model.moe_layers and model:moe_layers() or {}) do moe[i] = m:balancer_state() end
    return {
      data = { train = stream:state() }, rng = rng_get(), tokens = tokens, skipped = skipped_total, moe = moe,
      name = cfg.name, threads = tide.num_threads(),
      tokenizer = { kind = d.tokenizer.kind, vocab_size = d.tokenizer.vocab_size },
    }
  end

  local function restore(dir)
    local st = checkpoint.load(dir, { model = model, optim = opt })
    step, tokens, skipped_total = st.step, st.tokens or 0, st.skipped or 0
    stream:set_state(st.data.train)
    rng_set(st.rng)
    for i, m in ipairs(model.moe_layers and model:moe_layers() or {}) do    -- the dead-expert windows (moe.md §5)
      if st.moe and st.moe[i] then m:set_balancer_state(st.moe[i]) end
    end
    last_ckpt = dir
    if st.threads and st.threads ~= tide.num_threads() then
      -- reductions split by thread count: the run continues, but not bit-identically
      logger:line(string.format("note: %s was written with %d threads, this run uses %d; losses may differ in the last bits",
        dir, st.threads, tide.num_threads()))
    end
    return st
  end

  if out then
    if tide.C.tide_mkdir_p(out) ~= 0 then error("tide.train: cannot create '" .. out .. "': " .. ffi.string(tide.C.tide_last_error()), 2) end
  end
  if cfg.resume then
    local target = cfg.resume
    if target == true then
      if not out then error("tide.train: resume = true needs train.out (the run directory)", 2) end
      target = out
    end
    local dir = checkpoint.resolve(target)
    restore(dir)
    logger:line(string.format("resumed from %s at step %d", dir, step))
    if out then
      truncate_metrics(out .. "/metrics.jsonl", step)
      logger = log.open({ path = out .. "/metrics.jsonl", quiet = tcfg.quiet })
    end
  elseif out then
    os.remove(out .. "/metrics.jsonl")
    logger = log.open({ path = out .. "/metrics.jsonl", quiet = tcfg.quiet })
    local f = io.open(out .. "/config.json", "wb")
    if f then f:write(json.encode(plain(cfg)), "\n"); f:close() end
  end

  logger:line(string.format("model: %s", model:extra_repr()))
  logger:line(string.format("data: %d train tokens%s from %d file(s); batch %d x %d", d.dataset.train.n,
    d.dataset.val and string.format(", %d val tokens", d.dataset.val.n) or "", #d.dataset.files, stream.B, stream.T))

  -- the validation loss over eval_batches fixed batches; with MoE layers also their maxvio_global over the same
  -- tokens (moe.md §5), kept in `maxvio_global` ({[layer, 0-based] = value}) for the step's record
  local maxvio_global
  local function evaluate()
    if not d.val then return nil end
    local s = d.val()
    local total = 0
    local moe = model.moe_layers and model:moe_layers() or {}
    for _, m in ipairs(moe) do m:count_eval_loads(true) end
    model:eval()
    tide.no_grad(function()
      for _ = 1, eval_batches do
        local x, y = s:next()
        total = total + model:loss(x, y):item()
      end
    end)
    model:train()
    maxvio_global = {}
    for _, m in ipairs(moe) do
      local r = m:count_eval_loads(false)
      -- the layer index as in moe_metrics (0-based position in the stack)
      for l = 1, model.cfg.n_layers do
        if model.model.layers:get(l).block_sparse_moe == m and r then maxvio_global[l - 1] = r.maxvio end
      end
    end
    return total / eval_batches
  end

  local function save()
    if not out then return end
    last_ckpt = checkpoint.save(out, step, { model = model, optim = opt, state = state(), keep = tcfg.keep_ckpts or 2 })
  end

  local result = { losses = {}, out = out, model = model, tokenizer = d.tokenizer, skipped = 0, rollbacks = 0 }
  -- gradient-norm jitter: std / mean of the global gradient norm over the last `jitter_window` good steps
  -- (the model-wide monitor beside the MoE load metrics: routing churn shows up as a jumpy norm)
  local jitter_window, norms_seen = tcfg.jitter_window or 50, {}
  local function jitter(norm)
    norms_seen[#norms_seen + 1] = norm
    if #norms_seen > jitter_window then table.remove(norms_seen, 1) end
    if #norms_seen < 2 then return nil end
    local mean, var = 0, 0
    for _, v in ipairs(norms_seen) do mean = mean + v end
    mean = mean / #norms_seen
    for _, v in ipairs(norms_seen) do var = var + (v - mean) ^ 2 end
    return mean > 0 and math.sqrt(var / (#norms_seen - 1)) / mean or nil
  end
  local t_start = tide.time()
  local steps_done_here = 0
  local t_log, tokens_log = t_start, 0
  local val_loss
  local first_bad

  while step < steps do
    local t0 = tide.time()
    local lr = lr_at(step)
    local x, y = stream:next()
    local loss = loss_fn(model, x, y, step)
    local lv = loss:item()
    local norm, bad = nil, nil
    if is_finite(lv) then
      loss:backward()
      if clip and clip > 0 then
        norm = optim.clip_grad_norm(opt.params, clip)
      else
        norm = optim.grad_norm(opt.params)
      end
      if not is_finite(norm) then bad = "gradient of " .. (optim.first_nonfinite(opt.params) or "?") end
    else
      bad = "loss"
    end
    x, y, loss = nil, nil, nil
    if bad then
      opt:zero_grad()
      if model.balance_step then model:balance_step({ discard = true }) end   -- MoE: drop the step's routing
      consecutive = consecutive + 1
      skipped_total = skipped_total + 1
      first_bad = first_bad or string.format("%s at step %d", bad, step + 1)
      if policy == "stop" then
        result.stopped = string.format("stopped at step %d: non-finite %s (on_nonfinite = 'stop')", step + 1, bad)
      end
    else
      opt:step(lr)
      opt:zero_grad()
      -- MoE balancers update the selection bias from this step's routing, for the next step (moe.md §4.1)
      if model.balance_step then model:balance_step() end
      consecutive = 0
    end
    step = step + 1
    tokens = tokens + tokens_per_step
    steps_done_here = steps_done_here + 1
    result.losses[step] = lv
    if collect_every > 0 and step % collect_every == 0 then tide.collect() end

    local now = tide.time()
    local rec = {
      step = step, time = os.time(), tokens = tokens, loss = lv, lr = lr, grad_norm = norm,
      tok_per_s = tokens_per_step / math.max(now - t0, 1e-9), step_time = now - t0,
    }
    if bad then rec.skipped = true; rec.nonfinite_tensor = bad else rec.grad_norm_jitter = jitter(norm) end
    -- MoE load metrics per layer (moe.md §5), keys as TensorBoard tags: moe/maxvio_batch/3
    local moe_mt = model.moe_metrics and model:moe_metrics() or {}
    for l, mt in pairs(moe_mt) do
      for _, key in ipairs({ "maxvio_batch", "load_entropy", "route_entropy", "dead_experts", "topk_changed", "b_std" }) do
        if mt[key] ~= nil then rec["moe/" .. key .. "/" .. l] = mt[key] end
      end
    end

    if not bad and eval_every > 0 and step % eval_every == 0 then
      val_loss = evaluate()
      rec.val_loss = val_loss
      for l, v in pairs(maxvio_global or {}) do rec["moe/maxvio_global/" .. l] = v end
      if next(moe_mt) then     -- a compact expert-load line per eval: layer: MaxVio, dead experts, b std
        local parts, ls = {}, {}
        for l in pairs(moe_mt) do ls[#ls + 1] = l end
        table.sort(ls)
        for _, l in ipairs(ls) do
          local mt = moe_mt[l]
          if mt.maxvio_batch then
            local g = (maxvio_global or {})[l]
            parts[#parts + 1] = string.format("L%d %.2f/%s/%d/%.3f", l, mt.maxvio_batch, g and string.format("%.2f", g) or "-",
              mt.dead_experts, mt.b_std)
          end
        end
        logger:line("moe maxvio batch/global, dead, b_std: " .. table.concat(parts, "  "))
      end
    end
    local mem = tide.memory()
    rec.mem_current, rec.mem_peak = mem.current, mem.peak
    logger:metrics(rec)

    local elapsed = now - t_start
    local per_step = elapsed / steps_done_here
    local p = { step = step, steps = steps, loss = lv, lr = lr, val_loss = rec.val_loss, eta = per_step * (steps - step) }
    local plain_line = step % log_every == 0 or step == steps or rec.val_loss ~= nil
    if plain_line or logger.tty then
      p.tok_per_s = (tokens_per_step * (steps_done_here - tokens_log)) / math.max(now - t_log, 1e-9)
      if plain_line then t_log, tokens_log = now, steps_done_here end
      if bad then p.note = "skipped (non-finite " .. bad .. ")" end
      if plain_line then logger:line(log.progress_text(p)) else logger:progress(p) end
    end

    if result.stopped then break end
    if consecutive >= 5 and policy == "skip" then
      if rollbacks >= 2 or not last_ckpt then
        result.stopped = string.format("stopped at step %d: %d consecutive non-finite steps%s; first non-finite tensor: %s",
          step, consecutive, last_ckpt and " after 2 rollbacks" or " and no checkpoint to roll back to", first_bad)
        break
      end
      rollbacks = rollbacks + 1
      consecutive = 0
      logger:line(string.format("rolling back to %s after 5 consecutive non-finite steps (rollback %d of 2)", last_ckpt, rollbacks))
      logger:metrics({ step = step, event = "rollback", checkpoint = last_ckpt, rollbacks = rollbacks })
      restore(last_ckpt)
    elseif not bad and ckpt_every > 0 and step % ckpt_every == 0 and step < steps then
      -- (no checkpoint on a skipped step: a rollback must land before the non-finite streak)
      save()
    end
  end
  logger:done()

  if result.stopped then
    logger:line(result.stopped)
    logger:metrics({ step = step, event = "stopped", report = result.stopped })
  else
    save()
    if d.val and (eval_every == 0 or step % eval_every ~= 0) then val_loss = evaluate() end
  end
  local elapsed = tide.time() - t_start
  local n = 0
  local sum = 0
  for s = math.max(1, step - 19), step do
    local v = result.losses[s]
    if v and is_finite(v) then sum, n = sum + v, n + 1 end
  end
  result.steps = step
  result.final_loss = n > 0 and sum / n or 0 / 0
  result.last_loss = result.losses[step]
  result.val_loss = val_loss
  result.tokens = tokens
  result.elapsed = elapsed
  result.tok_per_s = steps_done_here * tokens_per_step / math.max(elapsed, 1e-9)
  result.checkpoint = last_ckpt
  result.skipped = skipped_total
  result.rollbacks = rollbacks
  logger:line(string.format("done: %d steps in %s, final loss %.4f (mean of the last %d)%s, %s tok/s%s",
    step, log.duration(elapsed), result.final_loss, n,
    val_loss and string.format(", val loss %.4f", val_loss) or "", log.si(result.tok_per_s),
    last_ckpt and (", checkpoint " .. last_ckpt) or ""))

  local expect = cfg.expect and cfg.expect.final_loss_below
  if expect and not result.stopped then
    result.expect_met = result.final_loss < expect
    logger:line(string.format("final loss %.4f %s the expected bound %.4f", result.final_loss,
      result.expect_met and "is below" or "is NOT below", expect))
  end

  if cfg.sample and not result.stopped then
    local sc = cfg.sample
    result.samples = {}
    for i, prompt in ipairs(sc.prompts or { "" }) do
      local text = generate.generate(model, d.tokenizer, {
        prompt = prompt, max_new_tokens = sc.max_new_tokens or 200, temperature = sc.temperature or 0.8,
        top_k = sc.top_k, top_p = sc.top_p, seed = (sc.seed or 0) + i - 1, window = stream.T,
      })
      result.samples[i] = prompt .. text
      logger:line(string.format("--- sample %d ---\n%s", i, prompt .. text))
    end
  end
  logger:close()
  return result
end

-- the `tide run` entry: exit code 0, or 1 when the run stopped early (non-finite policy)
local function run(cfg)
  local r = train(cfg)
  return (r.stopped or r.expect_met == false) and 1 or 0
end

-- tide.train(cfg) -> result table: losses (per step), final_loss (mean of the last 20), val_loss,
-- tok_per_s, checkpoint, samples, stopped (a report when the non-finite policy ended the run), model
-- rng_get/rng_set (the Philox counter as decimal strings) and truncate_metrics are shared with tide.Curriculum
return setmetatable({ run = run, train = train, rng_get = rng_get, rng_set = rng_set, truncate_metrics = truncate_metrics },
  { __call = function(_, cfg) return train(cfg) end })
