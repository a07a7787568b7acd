-- curriculum.lua — tide.Curriculum: pretraining that grows the context in stages (spec/long_context.md §2, §3, §6,
-- §7). A recipe returns Curriculum{...}; `tide run` calls its run(), `tide run --dry-run` prints its plan().
--
--   return tide.Curriculum{
--     name = "quickstart", model = {kind = "hybrid", ...}, optim = {lr = 3e-3, ...},
--     tokens_per_step = 8192,                 -- constant across stages (K2 practice); a stage may override it
--     micro_tokens = 4096,                    -- tokens per forward/backward (gradient accumulation fills the step)
--     sources = {                             -- named document sources, shared by every stage (their cursors too)
--       text = {kind = "text", path = "...", doc_separator = "%", val_fraction = 0.02},
--       recall = {kind = "mqar", vocab_size = 64, num_pairs = 8, length = "stage"},
--     },
--     stages = {
--       {name = "s256", seq_len = 256, steps = 100,          -- or tokens = N (stop condition)
--        mix = {text = 0.7, recall = {weight = 0.3, max_len = 256}},
--        lr = {kind = "constant", warmup = 10, from = 3e-3}, -- a segment: constant | linear | cosine, from -> to
--        eval = {every = 50, tasks = true}, on_stage_start = function(ctx, stage) stage.steps = 120 end},
--       ...
--     },
--     val = {mix = {text_val = 1}, batches = 2},       -- the held-out loss (and MoE maxvio_global) at evals
--     evals = {{source = "recall", lengths = {256, 1024}, examples = 32}},   -- task accuracy at the end
--     hooks = {on_stage_start =, on_stage_end =, on_step =, on_eval =},     -- run-wide; stage hooks run first
--     train = {out = "runs/quickstart", seed = 1, ckpt_every = 50, log_every = 10},
--   }
--
-- One optimiser step of a stage with length T: rows = tokens_per_step / T packed rows of T tokens, split into
-- micro-batches of micro_tokens / T rows; the loss of the step is the sum of the token losses over all
-- micro-batches divided by the number of unmasked targets of the whole step (so accumulation changes nothing but
-- memory); then clip, AdamW at the stage segment's η, and the MoE balancers (moe.md §4.1, over the whole step).
-- Stage switches happen only at step boundaries: the finished stage is evaluated and checkpointed, the next
-- stage's on_stage_start runs, the packer switches to the new T and mix keeping every source cursor and the
-- cut-document carry-over, and η continues from the segment's `from` (by default the previous segment's end).
-- A checkpoint holds the stage, the stage-local step, the packer state (draws, per-source cursors, carry-over),
-- the Philox counter and the MoE balancer windows besides weights and AdamW moments: `--resume` continues
-- mid-stage with bit-identical losses (same thread count); `--stage NAME` starts stage NAME (from the checkpoint
-- given by --resume, or from a fresh initialisation).
local ffi = require "ffi"
local tide = require "tide"
local nn = require "tide.nn"
local optim = require "tide.optim"
local checkpoint = require "tide.checkpoint"
local log = require "tide.log"
local json = require "tide.json"
local tokenizer = require "tide.data.tokenizer"
local F = tide.F

local fmt = string.format
local curriculum = {}

local TOP = {
  name = true, description = true, model = true, optim = true, tokens_per_step = true, micro_tokens = true,
  sources = true, stages = true, val = true, evals = true, hooks = true, train = true, parallel = true,
  expect = true, scales = true, on_nonfinite = true, results = true,
  -- set by the command line (--resume, --stage=NAME, --scale=NAME, --dry-run, --out, --seed, --threads)
  resume = true, stage = true, scale = true, scale_applied = true, dry_run = true, out = true, seed = true,
  threads = true,
  -- set by Curriculum()
  kind = true, run = true, plan = true,
}
local TRAIN = {
  out = true, seed = true, ckpt_every = true, keep_ckpts = true, log_every = true, quiet = true, threads = true,
  collect_every = true,
}
local STAGE = {
  name = true, seq_len = true, tokens_per_step = true, micro_tokens = true, steps = true, tokens = true, lr = true,
  mix = true, eval = true, on_stage_start = true, on_stage_end = true, on_step = true, on_eval = true,
  description = true, long_ratio = true,
}
local EVAL = { every = true, tasks = true }
local MIX = { weight = true, min_len = true, max_len = true }
local LR = { kind = true, from = true, to = true, warmup = true, start = true }
local LR_KINDS = { constant = true, linear = true, cosine = true }
local LR_ALIASES = { stable = "constant", decay = "cosine" }
local HOOKS = { on_stage_start = true, on_stage_end = true, on_step = true, on_eval = true }

local function bad(msg, level) error("curriculum: " .. msg, level or 3) end

local function sorted_keys(t)
  local out = {}
  for k in pairs(t) do out[#out + 1] = tostring(k) end
  table.sort(out)
  return out
end

local function check_keys(t, known, where)
  for k in pairs(t) do
    if not known[k] then
      bad(fmt("unknown key '%s' in %s; known keys: %s", tostring(k), where, table.concat(sorted_keys(known), ", ")), 4)
    end
  end
end

local function pos_int(v, what)
  if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then bad(fmt("%s must be a positive integer, got %s", what, tostring(v)), 4) end
  return v
end

local function deep_copy(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = deep_copy(x) end
  return out
end

-- ---- stages and learning-rate segments -------------------------------------------------------------------------

-- the resolved stage list: sequence length, rows per step and per micro-batch, steps, and the η segment with
-- `from` defaulting to the previous segment's end (so η is continuous across a switch unless a recipe says not)
local function resolve_stages(cfg)
  if type(cfg.stages) ~= "table" or #cfg.stages == 0 then bad("`stages` must be a non-empty list of stage tables") end
  local optim_lr = (cfg.optim or {}).lr or 1e-3
  local out, names, prev_to = {}, {}, nil
  for i, s in ipairs(cfg.stages) do
    local where = fmt("stages[%d]", i)
    if type(s) ~= "table" then bad(where .. " must be a table") end
    check_keys(s, STAGE, where)
    local name = s.name or ("stage" .. i)
    if names[name] then bad(fmt("%s: the stage name '%s' is used twice", where, name)) end
    names[name] = i
    where = fmt("stage '%s'", name)
    local T = pos_int(s.seq_len, where .. ": seq_len")
    local tps = pos_int(s.tokens_per_step or cfg.tokens_per_step, where .. ": tokens_per_step")
    if tps % T ~= 0 then
      bad(fmt("%s: tokens_per_step %d is not a multiple of seq_len %d (a step is a whole number of rows)", where, tps, T))
    end
    local rows = math.floor(tps / T)
    local micro_tokens = s.micro_tokens or cfg.micro_tokens or tps
    pos_int(micro_tokens, where .. ": micro_tokens")
    local micro_rows = math.max(1, math.min(rows, math.floor(micro_tokens / T)))
    if rows % micro_rows ~= 0 then
      bad(fmt("%s: %d rows per step do not split into micro-batches of %d rows (micro_tokens %d / seq_len %d)", where,
        rows, micro_rows, micro_tokens, T))
    end
    local steps
    if s.steps then steps = pos_int(s.steps, where .. ": steps")
    elseif s.tokens then steps = math.ceil(pos_int(s.tokens, where .. ": tokens") / tps)
    else bad(where .. ": give a stop condition, `steps` or `tokens`") end
    local lr = s.lr or {}
    if type(lr) ~= "table" then bad(where .. ": lr must be a table {kind, from, to, warmup}") end
    check_keys(lr, LR, where .. ".lr")
    local kind = lr.kind or "constant"
    kind = LR_ALIASES[kind] or kind       -- optim.md §6 names: "stable" holds η, "decay" is the cosine decay
    if not LR_KINDS[kind] then
      bad(fmt("%s: lr.kind must be constant, linear, cosine (or stable, decay), got %s", where, tostring(kind)))
    end
    local from = lr.from or prev_to or optim_lr
    local to = lr.to or from
    for _, v in ipairs({ { "from", from }, { "to", to } }) do
      if type(v[2]) ~= "number" or v[2] < 0 then bad(fmt("%s: lr.%s must be a number >= 0, got %s", where, v[1], tostring(v[2]))) end
    end
    local warmup = lr.warmup or 0
    if type(warmup) ~= "number" or warmup < 0 or warmup ~= math.floor(warmup) or warmup >= steps then
      bad(fmt("%s: lr.warmup must be an integer in [0, steps = %d), got %s", where, steps, tostring(warmup)))
    end
    if type(s.mix) ~= "table" or next(s.mix) == nil then bad(where .. ": `mix` must name at least one source") end
    local mix = {}
    for src, w in pairs(s.mix) do
      if not (cfg.sources or {})[src] then
        bad(fmt("%s: mix names the source '%s', which `sources` does not define (known: %s)", where, tostring(src),
          table.concat(sorted_keys(cfg.sources or {}), ", ")))
      end
      local e = type(w) == "table" and deep_copy(w) or { weight = w }
      check_keys(e, MIX, fmt("%s: mix.%s", where, src))
      if type(e.weight) ~= "number" or not (e.weight > 0) then
        bad(fmt("%s: the weight of source '%s' must be a number > 0, got %s", where, src, tostring(e.weight)))
      end
      e.name = src
      mix[#mix + 1] = e
    end
    table.sort(mix, function(a, b) return a.name < b.name end)
    local ev = s.eval or {}
    if type(ev) ~= "table" then bad(where .. ": eval must be a table {every = steps, tasks = true|false}") end
    check_keys(ev, EVAL, where .. ".eval")
    out[i] = {
      index = i, name = name, seq_len = T, tokens_per_step = tps, rows = rows, micro_rows = micro_rows,
      n_micro = math.floor(rows / micro_rows), steps = steps, mix = mix, eval_every = ev.every or 0,
      eval_tasks = ev.tasks == true,
      lr = { kind = kind, from = from, to = to, warmup = warmup, start = lr.start or (i == 1 and 0 or from) },
      spec = s,
    }
    prev_to = to
  end
  return out, names
end

curriculum.resolve = resolve_stages

-- η at stage-local step s (0-based) of a stage: a linear warmup from `start` to `from` over `warmup` steps, then
-- from -> to over the rest (constant: from; linear; cosine). A pure function of (stage, s).
function curriculum.lr_at(st, s)
  local lr = st.lr
  if s < lr.warmup then return lr.start + (lr.from - lr.start) * (s + 1) / lr.warmup end
  if lr.kind == "constant" then return lr.from end
  local span = st.steps - lr.warmup
  local x = span > 1 and (s - lr.warmup) / (span - 1) or 1
  if lr.kind == "linear" then return lr.from + (lr.to - lr.from) * x end
  return lr.to + (lr.from - lr.to) * 0.5 * (1 + math.cos(math.pi * x))
end

-- ---- sources and packers --------------------------------------------------------------------------------------
local SYNTHETIC = { mqar = true, passkey = true, copy = true }

local function build_sources(cfg, tok, seed)
  local data = require "tide.data"
  local out = {}
  for name, sc in pairs(cfg.sources or {}) do
    if type(sc) ~= "table" then bad(fmt("sources.%s must be a table", name)) end
    local o = deep_copy(sc)
    local kind = o.kind or "text"
    o.kind = nil
    o.tokenizer = tok
    if o.seed == nil then o.seed = seed end
    if kind == "text" then
      out[name] = data.pack.text_source(o)
    elseif SYNTHETIC[kind] then
      o.task = kind
      out[name] = data.synthetic.source(o)
    else
      bad(fmt("sources.%s: kind must be text, mqar, passkey or copy, got %s", name, tostring(kind)))
    end
  end
  return out
end

-- one packer for the whole run over every source of cfg.sources, in name order; a stage sets its mixture with
-- set_mix and its row length with set_seq_len, so every cursor and the carry-over continue
local function mix_entries(mix)
  local out = {}
  for _, e in ipairs(mix) do
    out[#out + 1] = { name = e.name, weight = e.weight, min_len = e.min_len, max_len = e.max_len }
  end
  return out
end

local function new_packer(names, sources, T, seed, eot)
  local data = require "tide.data"
  local entries = {}
  for _, name in ipairs(names) do entries[#entries + 1] = { source = sources[name], weight = 1, name = name } end
  return data.pack.Packer{ sources = entries, seq_len = T, seed = seed, eot = eot }
end

-- ---- the run state (what a checkpoint holds besides weights and AdamW) ------------------------------------------
local run_state = require "tide.train"           -- the Philox counter and metrics helpers tide.train uses
local rng_get, rng_set = run_state.rng_get, run_state.rng_set

local function moe_layers(model) return model.moe_layers and model:moe_layers() or {} end

-- a stage's own hook first, then the run-wide one
local function call_hooks(st, hooks, name, ...)
  local a, b = st.spec[name], hooks[name]
  if a ~= nil and type(a) ~= "function" then bad(fmt("stage '%s': %s must be a function", st.name, name)) end
  if b ~= nil and type(b) ~= "function" then bad(fmt("hooks.%s must be a function", name)) end
  if a then a(...) end
  if b then b(...) end
end

local function is_finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local truncate_metrics = run_state.truncate_metrics

-- apply --scale=NAME: cfg.scales[NAME] is a function(cfg) that edits the config in place (or returns a new one)
local function apply_scale(cfg)
  local scale = cfg.scale
  if scale == nil or scale == "full" or scale == "" or cfg.scale_applied == scale then return cfg end
  local f = (cfg.scales or {})[scale]
  if type(f) ~= "function" then
    bad(fmt("unknown scale '%s' (this recipe has: full%s)", tostring(scale),
      next(cfg.scales or {}) and (", " .. table.concat(sorted_keys(cfg.scales), ", ")) or ""), 3)
  end
  local r = f(cfg)
  if type(r) == "table" then cfg = r end
  cfg.scale, cfg.scale_applied = scale, scale     -- applied once: a caller may edit the scaled config and run it
  return cfg
end
curriculum.apply_scale = apply_scale

-- ---- evaluation -----------------------------------------------------------------------------------------------

-- held-out loss over cfg.val (a fixed packed set at the stage's T) and the MoE maxvio_global over the same tokens
local function val_eval(ctx)
  local cfg, st = ctx.cfg, ctx.stage
  local vc = cfg.val
  if not vc then return nil end
  local vst = { seq_len = st.seq_len, mix = {} }
  for src, w in pairs(vc.mix) do
    local e = type(w) == "table" and deep_copy(w) or { weight = w }
    e.name = src
    vst.mix[#vst.mix + 1] = e
  end
  table.sort(vst.mix, function(a, b) return a.name < b.name end)
  local names = {}
  for _, e in ipairs(vst.mix) do names[#names + 1] = e.name end
  local p = new_packer(names, ctx.sources, st.seq_len, vc.seed or 7919, ctx.eot)
  p:set_mix(mix_entries(vst.mix))
  local model = ctx.model
  local layers = moe_layers(model)
  for _, m in ipairs(layers) do m:count_eval_loads(true) end
  model:eval()
  local sum, n = 0, 0
  tide.no_grad(function()
    for _ = 1, vc.batches or 2 do
      local b = p:next_rows(st.micro_rows)
      local logits = model:forward(b.ids, nil, { cu_seqlens = b.cu_seqlens })
      sum = sum + F.cross_entropy(logits, b.targets, { reduction = "sum" }):item()
      n = n + b.n_targets
    end
  end)
  model:train()
  local out = { val_loss = n > 0 and sum / n or nil, maxvio_global = {} }
  for _, m in ipairs(layers) do
    local r = m:count_eval_loads(false)
    -- keyed by the 0-based layer index, as model:moe_metrics() is
    for l = 1, model.cfg.n_layers do
      if r and model.model.layers:get(l).block_sparse_moe == m then out.maxvio_global[l - 1] = r.maxvio end
    end
  end
  return out
end

-- task accuracy (tide.evals) for every entry of cfg.evals: {source = NAME, lengths = {...}, depths = {...},
-- examples = n, batch = b}; the task options are the named source's (so the eval matches what was trained)
local function task_evals(ctx, list)
  local evals = require "tide.evals"
  local rows = {}
  for _, e in ipairs(list or {}) do
    local sc = (ctx.cfg.sources or {})[e.source]
    if not sc then bad(fmt("evals: unknown source '%s'", tostring(e.source))) end
    local o = deep_copy(sc)
    o.task = o.kind
    o.kind, o.length, o.seed = nil, nil, nil
    for k, v in pairs(e) do if k ~= "source" then o[k] = v end end
    o.tokenizer = ctx.tok
    o.seed = e.seed or 1000003
    for _, r in ipairs(evals.run(ctx.model, o)) do r.source = e.source; rows[#rows + 1] = r end
  end
  return rows
end
curriculum.task_evals = task_evals

-- ---- run ------------------------------------------------------------------------------------------------------

-- bytes of memory available to this process on the CPU (MemAvailable), nil where /proc is absent
local function cpu_available()
  local f = io.open("/proc/meminfo")
  if not f then return nil end
  local text = f:read("*a")
  f:close()
  local kb = tonumber(text:match("MemAvailable:%s*(%d+)"))
  return kb and kb * 1024 or nil
end

-- before anything is allocated: a model on a device this build cannot use, or one whose weights and optimiser
-- state alone exceed the memory there, is refused with the plan's numbers instead of failing mid-allocation
local function preflight(cfg)
  local mc = deep_copy(cfg.model or {})
  local device = tostring(mc.device or "cpu")
  if device:match("^cuda") and not tide.cuda_available() then
    bad(fmt("the model runs on %s, but this build or machine has no CUDA device; `--dry-run` prints the plan%s", device,
      next(cfg.scales or {}) and (", --scale=" .. table.concat(sorted_keys(cfg.scales), "|") .. " runs a smaller one")
        or ""), 0)
  end
  local plan = nn.plan
  if device == "cpu" and plan and (mc.kind == nil or mc.kind == "hybrid") then
    mc.kind = nil
    local ok, st = pcall(plan.static_bytes, mc, { dtype = mc.dtype or "f32" })
    local avail = cpu_available()
    if ok and avail and st.total > avail then
      bad(fmt("the model's weights, gradients and AdamW state need %s, more than the %s of memory available; "
        .. "`--dry-run` prints the plan", plan.human_bytes(st.total), plan.human_bytes(avail)), 0)
    end
  end
end
local function run(cfg)
  cfg = apply_scale(cfg)
  check_keys(cfg, TOP, "the curriculum config")
  local tcfg = cfg.train or {}
  check_keys(tcfg, TRAIN, "train")
  local stages, by_name = resolve_stages(cfg)
  local out = cfg.out or tcfg.out
  if out == "" then out = nil end
  local seed = cfg.seed or tcfg.seed or 0
  local threads = cfg.threads or tcfg.threads
  if threads then tide.set_num_threads(threads) end
  local log_every, ckpt_every = tcfg.log_every or 10, tcfg.ckpt_every or 0
  local collect_every = tcfg.collect_every or 1
  local policy = cfg.on_nonfinite or "skip"
  local clip = (cfg.optim or {}).clip
  if clip == nil then clip = 1.0 end
  local hooks = cfg.hooks or {}
  check_keys(hooks, HOOKS, "hooks")

  preflight(cfg)
  tide.manual_seed(seed)
  local model = nn.build(cfg.model or {})
  local V = model.cfg.vocab_size
  local tok = tokenizer.byte_level({ vocab_size = V })
  local eot = tok:id("<|endoftext|>")
  local sources = build_sources(cfg, tok, seed)
  local opt = optim.build(cfg.optim or {}, model)
  local logger = log.open({ quiet = tcfg.quiet })

  local ctx = { cfg = cfg, model = model, optim = opt, sources = sources, tok = tok, eot = eot, stages = stages,
    logger = logger, out = out }
  function ctx.log(msg) logger:line(msg) end

  local si, stage_step, step, tokens, skipped = 1, 0, 0, 0, 0
  local packer
  local last_ckpt

  local function state()
    local moe = {}
    for i, m in ipairs(moe_layers(model)) do moe[i] = m:balancer_state() end
    return {
      kind = "curriculum", name = cfg.name, stage = si, stage_name = stages[si].name, stage_step = stage_step,
      tokens = tokens, skipped = skipped, packer = packer:state(), rng = rng_get(), moe = moe,
      threads = tide.num_threads(), scale = cfg.scale or "full",
      tokenizer = { kind = tok.kind, vocab_size = tok.vocab_size },
    }
  end

  local function save()
    if not out then return end
    last_ckpt = checkpoint.save(out, step, { model = model, optim = opt, state = state(), keep = tcfg.keep_ckpts or 2 })
  end

  local function enter_stage(i, pstate, resumed)
    si = i
    ctx.stage, ctx.stage_index, ctx.resumed = stages[i], i, resumed
    -- on_stage_start(ctx, stage) gets the recipe's own stage table: whatever it changes there or in ctx.cfg
    -- (seq_len, steps, mix, lr, ...) is resolved again for this stage and the ones after it (a resume runs the
    -- hook again, so the resumed run sees the same changes); ctx.model and ctx.optim can be changed directly
    call_hooks(stages[i], hooks, "on_stage_start", ctx, stages[i].spec)
    local again = resolve_stages(cfg)
    for j = i, #stages do stages[j] = again[j] end
    local st = stages[i]
    ctx.stage = st
    packer = packer or new_packer(sorted_keys(sources), sources, st.seq_len, seed, eot)
    if pstate then packer:set_state(pstate) end
    packer:set_seq_len(st.seq_len)
    packer:set_mix(mix_entries(st.mix))
    ctx.packer = packer
    tide.reset_peak()
    local plan = nn.plan
    local line = fmt("stage %d/%d '%s': T %d, %d rows/step in %d micro-batch(es), %d steps (%s tokens), lr %s %.3g -> %.3g",
      i, #stages, st.name, st.seq_len, st.rows, st.n_micro, st.steps, log.si(st.steps * st.tokens_per_step),
      st.lr.kind, st.lr.from, st.lr.to)
    logger:line(line)
    if plan and plan.activation_bytes then
      local ok, est = pcall(plan.activation_bytes, model.cfg, st.seq_len, { recompute = model.cfg.recompute or "layer",
        dtype = model.cfg.dtype })
      if ok and est then
        logger:line(fmt("  activation memory estimate: %.1f KB/token, %s per micro-batch of %d x %d", est.per_token / 1024,
          log.si(est.per_token * st.micro_rows * st.seq_len) .. "B", st.micro_rows, st.seq_len))
      end
    end
  end

  local function restore(dir, jump)
    local st = checkpoint.load(dir, { model = model, optim = opt })
    if st.kind ~= "curriculum" then bad(fmt("%s is not a curriculum checkpoint (no stage state)", dir)) end
    if st.tokenizer and st.tokenizer.vocab_size ~= tok.vocab_size then
      bad(fmt("%s was written with a %d-id tokenizer, this run has %d", dir, st.tokenizer.vocab_size, tok.vocab_size))
    end
    step, tokens, skipped = st.step, st.tokens or 0, st.skipped or 0
    rng_set(st.rng)
    for i, m in ipairs(moe_layers(model)) do if st.moe and st.moe[i] then m:set_balancer_state(st.moe[i]) end end
    last_ckpt = dir
    if st.threads and st.threads ~= tide.num_threads() then
      logger:line(fmt("note: %s was written with %d threads, this run uses %d; losses may differ in the last bits",
        dir, st.threads, tide.num_threads()))
    end
    if jump then
      -- --stage NAME: the checkpoint's weights, moments and data cursors, then stage NAME from its first step
      local i = by_name[jump]
      stage_step = 0
      enter_stage(i, st.packer, true)
    else
      local i = st.stage
      if not stages[i] or stages[i].name ~= st.stage_name then
        bad(fmt("%s is at stage '%s', which this recipe does not have at position %d", dir, tostring(st.stage_name), i or -1))
      end
      stage_step = st.stage_step
      enter_stage(i, st.packer, true)
    end
    return st
  end

  if out and tide.C.tide_mkdir_p(out) ~= 0 then bad("cannot create '" .. out .. "': " .. ffi.string(tide.C.tide_last_error())) end
  if cfg.stage ~= nil and not by_name[cfg.stage] then
    bad(fmt("--stage: no stage named '%s' (stages: %s)", tostring(cfg.stage), table.concat((function()
      local n = {}
      for _, s in ipairs(stages) do n[#n + 1] = s.name end
      return n
    end)(), ", ")), 2)
  end
  if cfg.resume then
    local target = cfg.resume
    if target == true then
      if not out then bad("--resume needs train.out (the run directory)") end
      target = out
    end
    local dir = checkpoint.resolve(target)
    restore(dir, cfg.stage)
    logger:line(fmt("resumed from %s at step %d (stage '%s', stage step %d)", dir, step, stages[si].name, stage_step))
    if out then
      truncate_metrics(out .. "/metrics.jsonl", step)
      logger = log.open({ path = out .. "/metrics.jsonl", quiet = tcfg.quiet })
      ctx.logger = logger
    end
  else
    if out then
      os.remove(out .. "/metrics.jsonl")
      logger = log.open({ path = out .. "/metrics.jsonl", quiet = tcfg.quiet })
      ctx.logger = logger
    end
    if cfg.stage then logger:line(fmt("starting at stage '%s' from a fresh initialisation", cfg.stage)) end
    enter_stage(cfg.stage and by_name[cfg.stage] or 1, nil, false)
  end
  logger:line(fmt("model: %s", model:extra_repr()))

  local result = { losses = {}, stages = {}, evals = {}, out = out, model = model, tokenizer = tok }
  local t_start = tide.time()
  local consecutive, rollbacks, first_bad = 0, 0, nil
  local layers = moe_layers(model)
  local total_steps = 0
  for _, s in ipairs(stages) do total_steps = total_steps + s.steps end

  local function do_eval(rec)
    local r = val_eval(ctx)
    if r then
      rec.val_loss = r.val_loss
      for i, v in pairs(r.maxvio_global) do rec["moe/maxvio_global/" .. i] = v end
      -- the compact expert-load line of every eval: per MoE layer MaxVio of the last batch / of the val set
      local mt, parts = model.moe_metrics and model:moe_metrics() or {}, {}
      local ls = {}
      for l in pairs(mt) do ls[#ls + 1] = l end
      table.sort(ls)
      for _, l in ipairs(ls) do
        local g = r.maxvio_global[l]
        parts[#parts + 1] = fmt("L%d %s/%s", l, mt[l].maxvio_batch and fmt("%.2f", mt[l].maxvio_batch) or "-",
          g and fmt("%.2f", g) or "-")
      end
      if #parts > 0 then logger:line("  moe maxvio batch/val: " .. table.concat(parts, "  ")) end
    end
    call_hooks(ctx.stage, hooks, "on_eval", ctx, rec)
    return r
  end

  while true do
    local st = stages[si]
    if stage_step >= st.steps then
      -- the stage is done: evaluate, hooks, checkpoint, next stage
      local rec = { step = step, event = "stage_end", stage = st.name }
      local r = do_eval(rec)
      local stage_evals
      if st.eval_tasks and cfg.evals then
        -- the task accuracies at the end of this stage (stage.eval.tasks = true)
        stage_evals = task_evals(ctx, cfg.evals)
        logger:line(require("tide.evals").table(stage_evals))
      end
      call_hooks(st, hooks, "on_stage_end", ctx, st)
      local mem = tide.memory()
      result.stages[#result.stages + 1] = { name = st.name, seq_len = st.seq_len, steps = st.steps,
        val_loss = r and r.val_loss, maxvio_global = r and r.maxvio_global, mem_peak = mem.peak, evals = stage_evals,
        tok_per_s = st._tok and st._tok / math.max(st._time, 1e-9) or nil }
      logger:metrics(rec)
      logger:line(fmt("stage '%s' done at step %d%s; peak memory %sB", st.name, step,
        rec.val_loss and fmt(", val loss %.4f", rec.val_loss) or "", log.si(mem.peak)))
      if si == #stages then break end
      stage_step = 0
      enter_stage(si + 1, nil, false)
      save()    -- the switch is a step boundary: the checkpoint starts the new stage (long_context.md §6)
    else
      local t0 = tide.time()
      local lr = curriculum.lr_at(st, stage_step)
      local batches, N = {}, 0
      for i = 1, st.n_micro do
        local b = packer:next_rows(st.micro_rows)
        batches[i] = b
        N = N + b.n_targets
      end
      local loss_sum, bad_what = 0, nil
      for i, b in ipairs(batches) do
        local logits = model:forward(b.ids, nil, { cu_seqlens = b.cu_seqlens })
        local ce = F.cross_entropy(logits, b.targets, { reduction = "sum" })
        local l = ce * (1 / math.max(N, 1))
        for _, m in ipairs(layers) do
          if m.aux_loss then l = l + m.aux_loss * (1 / st.n_micro) end     -- balance = "aux": the step's mean
        end
        local lv = ce:item()
        if not is_finite(lv) then bad_what = "loss"; break end
        loss_sum = loss_sum + lv
        l:backward()
        batches[i] = nil
        logits, ce, l = nil, nil, nil
      end
      local loss = loss_sum / math.max(N, 1)
      local norm
      if not bad_what then
        norm = (clip and clip > 0) and optim.clip_grad_norm(opt.params, clip) or optim.grad_norm(opt.params)
        if not is_finite(norm) then bad_what = "gradient of " .. (optim.first_nonfinite(opt.params) or "?") end
      end
      if bad_what then
        opt:zero_grad()
        if model.balance_step then model:balance_step({ discard = true }) end
        consecutive, skipped = consecutive + 1, skipped + 1
        first_bad = first_bad or fmt("%s at step %d", bad_what, step + 1)
        if policy == "stop" then result.stopped = fmt("stopped at step %d: non-finite %s", step + 1, bad_what) end
      else
        opt:step(lr)
        opt:zero_grad()
        if model.balance_step then model:balance_step() end
        consecutive = 0
      end
      step, stage_step = step + 1, stage_step + 1
      tokens = tokens + st.tokens_per_step
      result.losses[step] = bad_what and (0 / 0) or loss
      if collect_every > 0 and step % collect_every == 0 then tide.collect() end
      local now = tide.time()
      st._tok, st._time = (st._tok or 0) + st.tokens_per_step, (st._time or 0) + (now - t0)
      local mem = tide.memory()
      local rec = { step = step, time = os.time(), stage = st.name, seq_len = st.seq_len, tokens = tokens,
        loss = loss, lr = lr, grad_norm = norm, tok_per_s = st.tokens_per_step / math.max(now - t0, 1e-9),
        step_time = now - t0, targets = N, mem_peak = mem.peak, mem_current = mem.current }
      if bad_what then rec.skipped = true; rec.nonfinite_tensor = bad_what end
      for l, mt in pairs(model.moe_metrics and model:moe_metrics() or {}) do
        for _, key in ipairs({ "maxvio_batch", "load_entropy", "dead_experts", "topk_changed", "b_std" }) do
          if mt[key] ~= nil then rec["moe/" .. key .. "/" .. l] = mt[key] end
        end
      end
      if not bad_what and st.eval_every > 0 and stage_step % st.eval_every == 0 and stage_step < st.steps then
        do_eval(rec)
      end
      call_hooks(st, hooks, "on_step", ctx, rec)
      logger:metrics(rec)
      if step % log_every == 0 or stage_step == st.steps or rec.val_loss then
        logger:line(fmt("[%s] %s", st.name, log.progress_text({ step = step, steps = total_steps, loss = loss,
          val_loss = rec.val_loss, lr = lr, tok_per_s = rec.tok_per_s,
          note = bad_what and ("skipped (non-finite " .. bad_what .. ")") or nil })))
      end
      if result.stopped then break end
      if consecutive >= 5 and policy == "skip" then
        if rollbacks >= 2 or not last_ckpt then
          result.stopped = fmt("stopped at step %d: %d consecutive non-finite steps%s; first non-finite: %s", step,
            consecutive, last_ckpt and " after 2 rollbacks" or " and no checkpoint to roll back to", first_bad)
          break
        end
        rollbacks, consecutive = rollbacks + 1, 0
        logger:line(fmt("rolling back to %s after 5 consecutive non-finite steps (rollback %d of 2)", last_ckpt, rollbacks))
        logger:metrics({ step = step, event = "rollback", checkpoint = last_ckpt })
        restore(last_ckpt)
      elseif not bad_what and ckpt_every > 0 and step % ckpt_every == 0 and stage_step < st.steps then
        save()
      end
    end
  end
  if result.stopped then
    logger:line(result.stopped)
    logger:metrics({ step = step, event = "stopped", report = result.stopped })
  else
    save()
    if cfg.evals then
      result.evals = task_evals(ctx, cfg.evals)
      logger:line(require("tide.evals").table(result.evals))
    end
  end
  result.steps, result.tokens, result.elapsed, result.checkpoint = step, tokens, tide.time() - t_start, last_ckpt
  local n, sum = 0, 0
  for s = math.max(1, step - 19), step do
    local v = result.losses[s]
    if v and is_finite(v) then sum, n = sum + v, n + 1 end
  end
  result.final_loss = n > 0 and sum / n or 0 / 0
  result.moe = model.moe_metrics and model:moe_metrics() or {}
  if next(result.moe) and not result.stopped then
    -- the expert load at the end: per MoE layer (0-based) MaxVio of the last step's batch and of the last
    -- validation pass (moe.md §5), dead experts, the selection bias spread
    local ls = {}
    for l in pairs(result.moe) do ls[#ls + 1] = l end
    table.sort(ls)
    local lines = { "| MoE layer | MaxVio last batch | MaxVio val | dead experts | b std |", "|---:|---:|---:|---:|---:|" }
    local gv = (result.stages[#result.stages] or {}).maxvio_global or {}
    for _, l in ipairs(ls) do
      local mt = result.moe[l]
      lines[#lines + 1] = fmt("| %d | %s | %s | %d | %.3f |", l, mt.maxvio_batch and fmt("%.3f", mt.maxvio_batch) or "–",
        gv[l] and fmt("%.3f", gv[l]) or "–", mt.dead_experts or 0, mt.b_std or 0)
    end
    logger:line(table.concat(lines, "\n"))
  end
  logger:line(fmt("done: %d steps, %s tokens in %s, final loss %.4f%s", step, log.si(tokens), log.duration(result.elapsed),
    result.final_loss, last_ckpt and (", checkpoint " .. last_ckpt) or ""))
  logger:close()
  return result
end
curriculum.train = run

-- ---- plan (--dry-run) -----------------------------------------------------------------------------------------
local function human(b) return nn.plan.human_bytes(b) end
curriculum.human = human

-- plan(cfg) -> the text --dry-run prints: the model (parameters, active parameters), the stage table (T, tokens
-- per step, sequences per step, micro-batches, steps, tokens, η segment, mix), activation memory per token and per
-- sequence for the recompute mode, and the parallel layout cfg.parallel asks for, checked against GPU memory
function curriculum.plan(cfg)
  cfg = apply_scale(cfg)
  check_keys(cfg, TOP, "the curriculum config")
  local stages = resolve_stages(cfg)
  local plan = nn.plan
  local L = {}
  local function add(s) L[#L + 1] = s end
  local mc = deep_copy(cfg.model or {})
  mc.kind = nil
  add(fmt("# %s%s (dry run: nothing was executed)", cfg.name or "curriculum", cfg.scale and cfg.scale ~= "full" and
    (" --scale=" .. cfg.scale) or ""))
  if cfg.description then add(cfg.description) end
  local count = plan.count(mc)
  add(fmt("model: V %d, d %d, L %d; %s parameters (%.0f), %s active per token (%.0f)", mc.vocab_size, mc.dim, mc.n_layers,
    plan.human_count(count.total), count.total, plan.human_count(count.active), count.active))
  add("")
  add("| stage | T | tokens/step | seqs/step | micro-batches | steps | tokens | η segment | mix |")
  add("|---|---:|---:|---:|---:|---:|---:|---|---|")
  local total = 0
  for _, st in ipairs(stages) do
    local mix = {}
    for _, e in ipairs(st.mix) do mix[#mix + 1] = fmt("%s %g", e.name, e.weight) end
    total = total + st.steps * st.tokens_per_step
    add(fmt("| %s | %d | %d | %d | %d | %d | %s | %s %.3g→%.3g (warmup %d) | %s |", st.name, st.seq_len,
      st.tokens_per_step, st.rows, st.n_micro, st.steps, plan.human_count(st.steps * st.tokens_per_step), st.lr.kind, st.lr.from,
      st.lr.to, st.lr.warmup, table.concat(mix, ", ")))
  end
  add(fmt("total: %s tokens", plan.human_count(total)))
  add("")
  local par = cfg.parallel or {}
  local dtype = par.dtype or mc.dtype or "f32"
  local rc = mc.recompute or "layer"
  local static = plan.static_bytes(mc, { dtype = dtype })
  add(fmt("static memory (%s): weights %s, gradients %s, AdamW moments %s; total %s", dtype, human(static.weights +
    (static.weights_bf16 or 0)), human(static.grads), human(static.moments), human(static.total)))
  add("")
  if par.gpus then
    -- one rank holds 1/GPUs of the static state (ZeRO-3 / FSDP sharding of weights, gradients and moments over
    -- dp × cp × ep, each layer's weights gathered while it runs: the largest layer, its experts split over ep) plus
    -- the activations of one sequence's 1/cp slice (one sequence in flight per rank, the recompute mode's checkpoints)
    local ep = par.ep or 1
    local largest = 0
    for _, pl in ipairs(count.per_layer or {}) do largest = math.max(largest, pl.total) end
    local gathered = largest * (dtype == "bf16" and 2 or 4) / ep
    add(fmt("parallel layout: %d GPUs of %s, ep %d, cp per stage, dp = GPUs / (ep·cp); activations with recompute = %s",
      par.gpus, human(par.gpu_memory or 0), ep, rc))
    add("| stage | T | cp | dp | seqs/step per dp rank | act. bytes/token | activations per rank | static per rank | total per rank | fits |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for _, st in ipairs(stages) do
      local est = plan.activation_bytes(mc, st.seq_len, { recompute = rc, dtype = dtype })
      local cp = (par.cp or {})[st.name] or 1
      local dp = par.gpus / (ep * cp)
      local act = est.total / cp
      local stat = static.total / par.gpus + gathered
      local tot = act + stat
      add(fmt("| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s |", st.name, st.seq_len, cp,
        dp == math.floor(dp) and tostring(dp) or fmt("%.2f (GPUs not divisible)", dp), fmt("%.3g", st.rows / dp),
        human(est.per_token), human(act), human(stat), human(tot),
        par.gpu_memory and (tot <= par.gpu_memory and "yes" or "NO") or "?"))
    end
  else
    add(fmt("activation memory (recompute = %s, %s; one sequence per micro-batch row):", rc, dtype))
    add("| stage | T | bytes/token | per sequence | per micro-batch |")
    add("|---|---:|---:|---:|---:|")
    for _, st in ipairs(stages) do
      local est = plan.activation_bytes(mc, st.seq_len, { recompute = rc, dtype = dtype })
      add(fmt("| %s | %d | %s | %s | %s |", st.name, st.seq_len, human(est.per_token), human(est.total),
        human(est.total * st.micro_rows)))
    end
  end
  return table.concat(L, "\n")
end

-- Curriculum(spec) -> the recipe table: spec with kind = "curriculum", run and plan set; the keys are checked now,
-- the stages when it runs (after --scale and the command-line overrides)
function curriculum.new(spec)
  if type(spec) ~= "table" then bad("Curriculum{...} takes a table", 2) end
  check_keys(spec, TOP, "Curriculum{...}")
  spec.kind = "curriculum"
  spec.run = function(cfg)
    local r = run(cfg)
    if r.stopped then return 1 end
    local ex, code = cfg.expect or {}, 0
    if ex.final_loss_below and not (r.final_loss < ex.final_loss_below) then
      io.stderr:write(fmt("final loss %.4f is NOT below the expected %.4f\n", r.final_loss, ex.final_loss_below))
      code = 1
    end
    if ex.eval_accuracy_above then
      for _, row in ipairs(r.evals or {}) do
        if not (row.accuracy > ex.eval_accuracy_above) then
          io.stderr:write(fmt("%s at length %d: accuracy %.3f is NOT above the expected %.3f\n", row.task, row.length,
            row.accuracy, ex.eval_accuracy_above))
          code = 1
        end
      end
    end
    return code
  end
  spec.plan = function(cfg) return curriculum.plan(cfg) end
  return spec
end

return setmetatable(curriculum, { __call = function(_, spec) return curriculum.new(spec) end })
