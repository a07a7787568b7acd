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
--     val = {mix = {text_val = 1}, batches = 2},       -- the held-out loss (and MoE maxvio_global) at evals; mix =
--                                                      -- "stage": each stage's mix over held-out twins of its sources
--     evals = {{source = "recall", lengths = {256, 1024}, examples = 32}},   -- task accuracy at the end
--     hooks = {on_stage_start =, on_stage_end =, on_step =, on_eval =},     -- run-wide; stage hooks run first
--     train = {out = "runs/quickstart", seed = 1, ckpt_every = 50, log_every = 10},
--     expect = {final_loss_below = 2.2, eval_accuracy_above = 0.8, val_maxvio_below = 0.5},  -- else exit 1
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
local options = require "tide.options"
local sources = require "tide.data.sources"
local tokenizer = require "tide.data.tokenizer"
local F = tide.F

local fmt = string.format
local curriculum = {}

local TOP = options.with_run_flags {
  name = true, description = true, model = true, optim = true, tokens_per_step = true, micro_tokens = true,
  sources = true, stages = true, val = true, evals = true, hooks = true, train = true, parallel = true, dist = true,
  expect = true, scales = true, on_nonfinite = true, results = true,
  -- set by the command line besides the flags of every driver (options.RUN_FLAGS)
  stage = true, scale = true, scale_applied = true,
  -- the tokenizer: "byte" (the default: byte level with the model's vocab_size) or the path of a tokenizer.json
  tokenizer = true,
  -- set by Curriculum()
  kind = true, run = true, plan = true,
}
local TRAIN = {
  out = true, seed = true, ckpt_every = true, keep_ckpts = true, log_every = true, quiet = true, threads = true,
  collect_every = true, jitter_window = true, tensorboard = true,
}
local STAGE = {
  name = true, seq_len = true, tokens_per_step = true, micro_tokens = true, steps = true, tokens = true, lr = true,
  mix = true, eval = true, on_stage_start = true, on_stage_end = true, on_step = true, on_eval = true,
  description = true, long_ratio = true, freeze = true,
}
local EVAL = { every = true, tasks = true }
local LR = { kind = true, from = true, to = true, warmup = true, start = true }
local LR_KINDS = { constant = true, linear = true, cosine = true }
local LR_ALIASES = { stable = "constant", decay = "cosine" }
local HOOKS = { on_stage_start = true, on_stage_end = true, on_step = true, on_eval = true }
-- what `tide run` checks at the end (exit 1 on a miss): the mean training loss of the last 20 steps, every task
-- eval row's accuracy, and every MoE layer's validation MaxVio at the end of every stage
local EXPECT = { final_loss_below = { 0, math.huge }, eval_accuracy_above = { 0, 1 }, val_maxvio_below = { 0, math.huge } }

-- errors are one line "curriculum: ..." at the recipe's line (level 0: no position, for problems of the run itself)
local function bad(msg, level) options.fail("curriculum", msg, level == 0 and 0 or nil) end
local sorted_keys = options.sorted_keys
local function check_keys(t, known, where) options.check(t, known, where, "curriculum") end
local function pos_int(v, what) return options.pos_int(v, what, "curriculum") end

local deep_copy = options.deep_copy

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
      options.finite_number(v[2], where .. ": lr." .. v[1], "curriculum", nil, 0)
    end
    local warmup = lr.warmup or 0
    if type(warmup) ~= "number" or warmup < 0 or warmup ~= math.floor(warmup) or warmup >= steps then
      bad(fmt("%s: lr.warmup must be an integer in [0, steps = %d), got %s", where, steps, tostring(warmup)))
    end
    local mix = sources.mix(s.mix, cfg.sources or {}, where, "curriculum")
    local freeze = s.freeze or {}
    if type(freeze) ~= "table" then bad(fmt("%s: freeze must be a list of \"vit\", \"projector\", \"lm\"", where)) end
    local ev = s.eval or {}
    if type(ev) ~= "table" then bad(where .. ": eval must be a table {every = steps, tasks = true|false}") end
    check_keys(ev, EVAL, where .. ".eval")
    out[i] = {
      index = i, name = name, seq_len = T, tokens_per_step = tps, rows = rows, micro_rows = micro_rows,
      n_micro = math.floor(rows / micro_rows), steps = steps, mix = mix, eval_every = ev.every or 0,
      eval_tasks = ev.tasks == true, freeze = freeze,
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

-- ---- hooks and scales -----------------------------------------------------------------------------------------
local step = require "tide.step"
local moe_layers = step.moe_layers

-- the layer indices of a {[layer] = value} table, in order
local function moe_layer_ids(t)
  local ls = {}
  for l in pairs(t or {}) do ls[#ls + 1] = l end
  table.sort(ls)
  return ls
end

-- a stage's own hook first, then the run-wide one
local function call_hooks(st, hooks, name, ...)
  local a, b = st.spec[name], hooks[name]
  if a ~= nil and type(a) ~= "function" then bad(fmt("stage '%s': %s must be a function", st.name, name)) end
  if b ~= nil and type(b) ~= "function" then bad(fmt("hooks.%s must be a function", name)) end
  if a then a(...) end
  if b then b(...) end
end

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

-- held-out loss over cfg.val (a fixed packed set at the stage's T) and the MoE maxvio_global over the same tokens.
-- val.mix names sources and weights, or is "stage": the stage's own mix over the sources' held-out twins
-- (sources.held_out: text val splits, synthetic eval splits), so the balance is measured on held-out data that is
-- distributed as the stage's training batches are (a router may give each kind of document its own experts).
local VAL = { mix = true, batches = true, seed = true }
local function val_eval(ctx)
  local cfg, st = ctx.cfg, ctx.stage
  local vc = cfg.val
  if not vc then return nil end
  local built, mix = ctx.sources, nil
  if vc.mix == "stage" then
    ctx.val_sources = ctx.val_sources or sources.build(sources.held_out(cfg.sources, "curriculum"), ctx.tok,
      ctx.seed, "curriculum", (cfg.model or {}).vision)
    built, mix = ctx.val_sources, st.mix
  else
    mix = sources.mix(vc.mix, ctx.sources, "val", "curriculum")
  end
  local names = {}
  for _, e in ipairs(mix) do names[#names + 1] = e.name end
  local p = sources.packer(names, built, st.seq_len, vc.seed or 7919, ctx.eot)
  p:set_mix(sources.mix_entries(mix))
  local model = ctx.model
  -- context parallelism: the ranks of a cp group evaluate their slices of the same rows (step.cp_slice) and sum
  local cpg = ctx.cp_group and ctx.cp_group.size > 1 and ctx.cp_group or nil
  local pad_id = model.vision_cfg and model.vision_cfg.media_pad
  local sum, n = 0, 0
  local maxvio = step.with_eval_loads(model, function()
    for _ = 1, vc.batches or 2 do
      local b = p:next_rows(st.micro_rows)
      if cpg then b = step.cp_slice(b, cpg, pad_id) end
      local logits = model:forward(step.to_model(model, b.ids), nil, step.forward_opts(b))
      sum = sum + F.cross_entropy(logits, step.to_model(model, b.targets), { reduction = "sum" }):item()
      n = n + b.n_targets
    end
  end, cpg)
  if cpg then
    local t = cpg.sums({ sum, n })
    sum, n = t[1], t[2]
  end
  return { val_loss = n > 0 and sum / n or nil, maxvio_global = maxvio }
end

-- task accuracy (tide.evals) for every entry of cfg.evals: {source = NAME, lengths = {...}, depths = {...},
-- examples = n, batch = b}; the task options are the named source's (so the eval matches what was trained)
-- An entry naming an image-text source (squares, digits, image_text) scores captions instead (evals.captions) on
-- the source's held-out twin: {source = NAME, examples = n, batch = b} -> a row {task = "caption", source, accuracy,
-- label_accuracy, exact, examples}.
local IMAGE_KINDS = { squares = true, digits = true, image_text = true }
local CAPTION_EVAL = { source = true, examples = true, batch = true, samples = true }

local function caption_eval(ctx, e, sc)
  local evals = require "tide.evals"
  check_keys(e, CAPTION_EVAL, fmt("evals entry for the image source '%s'", e.source))
  local spec = sources.held_out({ [e.source] = sc }, "curriculum")
  local built = sources.build(spec, ctx.tok, ctx.cfg.seed or 0, "curriculum", (ctx.cfg.model or {}).vision)
  local r = evals.captions(ctx.model, built[e.source], { examples = e.examples, batch = e.batch, samples = e.samples })
  return { task = "caption", source = e.source, accuracy = r.accuracy, label_accuracy = r.label_accuracy,
    exact = r.exact, examples = r.examples, labelled = r.labelled, samples = r.samples }
end

local function task_evals(ctx, list)
  local evals = require "tide.evals"
  local rows = {}
  for _, e in ipairs(list or {}) do
    local sc = (ctx.cfg.sources or {})[e.source]
    if not sc then bad(fmt("evals: unknown source '%s'", tostring(e.source))) end
    if IMAGE_KINDS[sc.kind] then
      rows[#rows + 1] = caption_eval(ctx, e, sc)
      goto next_entry
    end
    local o = deep_copy(sc)
    o.task = o.kind
    o.kind, o.length, o.seed = nil, nil, nil
    for k, v in pairs(e) do if k ~= "source" then o[k] = v end end
    sources.filler_text(o, e.source, ctx.cfg.sources, ctx.sources, "curriculum")   -- the same text as in training
    o.tokenizer = ctx.tok
    o.seed = e.seed or 1000003
    for _, r in ipairs(evals.run(ctx.model, o)) do r.source = e.source; rows[#rows + 1] = r end
    ::next_entry::
  end
  return rows
end
curriculum.task_evals = task_evals

-- ---- run ------------------------------------------------------------------------------------------------------

-- the expect table: known keys, each bound a number in its range; val_maxvio_below needs the held-out set (`val`)
local function check_expect(cfg)
  local ex = cfg.expect
  if ex == nil then return end
  check_keys(ex, EXPECT, "expect")
  for _, k in ipairs(sorted_keys(ex)) do options.number_in(ex[k], EXPECT[k][1], EXPECT[k][2], "expect." .. k, "curriculum") end
  if ex.val_maxvio_below ~= nil and not cfg.val then
    bad("expect.val_maxvio_below needs `val`, the held-out set the MaxVio is measured on")
  end
end
curriculum.check_expect = check_expect

-- check_result(cfg, r) -> the lines of every expectation r misses (empty when all hold)
function curriculum.check_result(cfg, r)
  local ex, miss = cfg.expect or {}, {}
  if ex.final_loss_below and not (r.final_loss < ex.final_loss_below) then
    miss[#miss + 1] = fmt("final loss %.4f is NOT below the expected %.4f", r.final_loss, ex.final_loss_below)
  end
  if ex.eval_accuracy_above then
    for _, row in ipairs(r.evals or {}) do
      -- a caption row is judged by its label accuracy where the source marks labels
      local acc = row.task == "caption" and (row.label_accuracy or row.accuracy) or row.accuracy
      if not (acc > ex.eval_accuracy_above) then
        local what = row.task == "caption" and fmt("captions of '%s': %s accuracy", row.source,
          row.label_accuracy and "label" or "token") or fmt("%s at length %d: accuracy", row.task, row.length)
        miss[#miss + 1] = fmt("%s %.3f is NOT above the expected %.3f", what, acc, ex.eval_accuracy_above)
      end
    end
  end
  if ex.val_maxvio_below then
    for _, st in ipairs(r.stages or {}) do
      local mv = st.maxvio_global or {}
      if next(mv) == nil then
        miss[#miss + 1] = fmt("stage '%s': no validation MaxVio was measured (no MoE layer routed the val tokens)", st.name)
      end
      for _, l in ipairs(moe_layer_ids(mv)) do
        if not (mv[l] < ex.val_maxvio_below) then
          miss[#miss + 1] = fmt("stage '%s', MoE layer %d: validation MaxVio %.3f is NOT below the expected %.3f",
            st.name, l, mv[l], ex.val_maxvio_below)
        end
      end
    end
  end
  return miss
end

-- before anything is allocated: a model on a device this build cannot use, or too large for the memory there
local function preflight(cfg)
  local hint = next(cfg.scales or {}) and ("; --scale=" .. table.concat(sorted_keys(cfg.scales), "|") .. " runs a smaller one")
  step.preflight(cfg.model, "curriculum", "; `--dry-run` prints the plan" .. (hint or ""))
end
-- setup: the scale, the checks, the model (its initialisation draws from the RNG seeded here), the sources, the
-- optimiser, the shared step and run, and the hook context
-- the layout table was `parallel` (the plan's alone) before it became `dist` (the plan's and the runtime's)
local function no_parallel(cfg)
  if cfg.parallel ~= nil then
    bad("`parallel` is now `dist`: one table for the --dry-run plan and the runtime (dist = {dp, zero, gpus, "
      .. "gpu_memory, ep, cp, dtype})", 3)
  end
end

local function setup(cfg)
  cfg = apply_scale(cfg)
  check_keys(cfg, TOP, "the curriculum config")
  no_parallel(cfg)
  local tcfg = cfg.train or {}
  check_keys(tcfg, TRAIN, "train")
  step.check_numbers(cfg, "curriculum")
  check_expect(cfg)
  if cfg.val ~= nil then check_keys(cfg.val, VAL, "val") end
  local stages, by_name = resolve_stages(cfg)
  -- data parallelism (tide.dist): each rank runs its 1/dp of every step's micro-batches
  local dp = require("tide.dist").layout(cfg.dist, "curriculum")
  if dp.n > 1 or dp.lanes > 1 then
    for _, st in ipairs(stages) do
      if st.n_micro % dp.n ~= 0 then
        bad(fmt("stage '%s': its %d micro-batch(es) per step do not split over dist.dp = %d ranks (lower micro_tokens)",
          st.name, st.n_micro, dp.n), 2)
      end
      if st.n_micro % dp.lanes ~= 0 then
        bad(fmt("stage '%s': its %d micro-batch(es) per step do not split over dist.lanes = %d data lanes (lower "
          .. "micro_tokens, or set dist.lanes to a divisor that dist.dp divides)", st.name, st.n_micro, dp.lanes), 2)
      end
    end
  end
  local out = cfg.out or tcfg.out
  if out == "" then out = nil end
  local seed = cfg.seed or tcfg.seed or 0
  local threads = cfg.threads or tcfg.threads
  if threads then tide.set_num_threads(threads) end
  local hooks = cfg.hooks or {}
  check_keys(hooks, HOOKS, "hooks")
  if cfg.stage ~= nil and not by_name[cfg.stage] then
    local n = {}
    for _, s in ipairs(stages) do n[#n + 1] = s.name end
    bad(fmt("--stage: no stage named '%s' (stages: %s)", tostring(cfg.stage), table.concat(n, ", ")), 2)
  end

  preflight(cfg)
  tide.manual_seed(seed)
  local model = nn.build(cfg.model or {}, require("tide.dist").build_opts(dp))   -- (ep: this rank's experts only)
  local tok = tokenizer.for_model(cfg.tokenizer, model.cfg.vocab_size, "tokenizer", "curriculum")
  require("tide.dist").shard_model(model, dp)        -- expert parallelism: this rank's experts only
  local opt = optim.build(cfg.optim or {}, model)
  if dp.zero >= 1 then opt:shard(require("tide.dist"), dp.zero) end
  local C = { cfg = cfg, tcfg = tcfg, stages = stages, by_name = by_name, hooks = hooks, seed = seed, model = model,
    tok = tok, si = 1, stage_step = 0 }
  C.sources = sources.build(cfg.sources, tok, seed, "curriculum", (cfg.model or {}).vision)
  C.eot = tok:id("<|endoftext|>")
  C.dp = dp
  C.stepper = step.stepper({ model = model, optim = opt, clip = (cfg.optim or {}).clip, on_nonfinite = cfg.on_nonfinite,
    jitter_window = tcfg.jitter_window, dist = dp.group, bucket_bytes = dp.bucket_bytes,
    cp = dp.cp_group })
  C.run = step.run({ driver = "curriculum", name = cfg.name, cfg = cfg, out = out, quiet = tcfg.quiet,
    tensorboard = tcfg.tensorboard, keep_ckpts = tcfg.keep_ckpts, collect_every = tcfg.collect_every, model = model,
    optim = opt, stepper = C.stepper, dist = dp.group,
    tokenizer = tok,
    -- several ranks: every lane's state, gathered (a collective: every rank saves)
    get_data = function() return { packer = require("tide.dist").lane_states(C.packer) } end,
    set_data = function(cursors) C.pending_packer = cursors.packer end,
    get_position = function()
      return { stage = C.si, stage_name = stages[C.si].name, stage_step = C.stage_step, scale = cfg.scale or "full" }
    end,
    set_position = function(pos, _, dir) curriculum._set_position(C, pos, dir) end })
  -- the context the hooks see
  C.ctx = { cfg = cfg, seed = seed, model = model, optim = opt, sources = C.sources, tok = tok, eot = C.eot,
    stages = stages, logger = C.run.logger, out = out, cp_group = dp.cp_group }
  function C.ctx.log(msg) C.run.logger:line(msg) end
  return C
end

-- enter stage i (with the packer state of a checkpoint, or continuing the packer): on_stage_start(ctx, stage) gets
-- the recipe's own stage table, and whatever it changes there or in ctx.cfg (seq_len, steps, mix, lr, ...) is resolved
-- again for this stage and the ones after it (a resume runs the hook again, so the resumed run sees the same changes)
local function enter_stage(C, i, pstate, resumed)
  local stages, ctx = C.stages, C.ctx
  C.si = i
  ctx.stage, ctx.stage_index, ctx.resumed = stages[i], i, resumed
  call_hooks(stages[i], C.hooks, "on_stage_start", ctx, stages[i].spec)
  local again = resolve_stages(C.cfg)
  for j = i, #stages do stages[j] = again[j] end
  local st = stages[i]
  ctx.stage = st
  C.packer = C.packer or sources.packer(sorted_keys(C.sources), C.sources, st.seq_len, C.seed, C.eot, C.dp.lane_opts)
  if pstate then C.packer:set_state(pstate) end
  C.packer:set_seq_len(st.seq_len)
  C.packer:set_mix(sources.mix_entries(st.mix))
  ctx.packer = C.packer
  -- the stage's frozen parameter groups (vision.md §10: alignment trains only the ViT and projector)
  if C.model.set_frozen then
    local ok, err = pcall(C.model.set_frozen, C.model, st.freeze)
    if not ok then bad(fmt("stage '%s': %s", st.name, tostring(err):gsub("^[^:]*: ", "", 1)), 0) end
  elseif #st.freeze > 0 then
    bad(fmt("stage '%s': freeze needs a model with parameter groups (nn.HybridLM)", st.name), 0)
  end
  tide.reset_peak()
  local logger = C.run.logger
  logger:line(fmt("stage %d/%d '%s': T %d, %d rows/step in %d micro-batch(es), %d steps (%s tokens), lr %s %.3g -> %.3g",
    i, #stages, st.name, st.seq_len, st.rows, st.n_micro, st.steps, log.si(st.steps * st.tokens_per_step),
    st.lr.kind, st.lr.from, st.lr.to))
  -- the recompute mode this stage's micro-batches train in: "auto" is decided here, once per shape, by the model
  -- (nn.HybridLM:recompute_for), so the line says what the steps do
  local mode, auto = C.model.cfg.recompute or "layer", nil
  if mode == "auto" and C.model.recompute_for then
    local B, T = st.micro_rows, st.seq_len
    local cpg = C.dp.cp_group
    if cpg and cpg.size > 1 then T = T / cpg.size end
    mode, auto = C.model:recompute_for(B, T)
  end
  local ok, est = pcall(nn.plan.activation_bytes, C.model.cfg, st.seq_len, { recompute = mode, dtype = C.model.cfg.dtype })
  if ok and est then
    logger:line(fmt("  activation memory estimate: %.1f KB/token, %s per micro-batch of %d x %d, recompute %s",
      est.per_token / 1024, log.si(est.per_token * st.micro_rows * st.seq_len) .. "B", st.micro_rows, st.seq_len,
      auto and fmt("auto -> %s (%sB without recompute, budget %s)", mode, log.si(auto.need),
        auto.budget and (log.si(auto.budget) .. "B") or "unknown") or mode))
  end
end

-- a restored checkpoint's curriculum position: its stage at its step, or (--stage NAME) stage NAME from its first step
function curriculum._set_position(C, pos, dir)
  local stages = C.stages
  if not pos then bad(fmt("%s is not a curriculum checkpoint (no stage state)", dir), 0) end
  local jump = C.cfg.stage
  if jump and not C.in_rollback then
    C.stage_step = 0
    enter_stage(C, C.by_name[jump], C.pending_packer, true)
  else
    local i = pos.stage
    if not stages[i] or stages[i].name ~= pos.stage_name then
      bad(fmt("%s is at stage '%s', which this recipe does not have at position %d", dir, tostring(pos.stage_name), i or -1), 0)
    end
    C.stage_step = pos.stage_step
    enter_stage(C, i, C.pending_packer, true)
  end
  C.pending_packer = nil
end

-- resume (--resume [--stage NAME]) or start at stage 1 (or --stage NAME from a fresh initialisation)
local function start(C)
  local cfg, run = C.cfg, C.run
  local st = run:open(cfg.resume, cfg.overwrite)
  C.ctx.logger = run.logger
  if st then
    run.logger:line(fmt("resumed from %s at step %d (stage '%s', stage step %d)", run.resumed_from, run.step,
      C.stages[C.si].name, C.stage_step))
  else
    if cfg.stage then run.logger:line(fmt("starting at stage '%s' from a fresh initialisation", cfg.stage)) end
    enter_stage(C, cfg.stage and C.by_name[cfg.stage] or 1, nil, false)
  end
  run.logger:line(fmt("model: %s", C.model:extra_repr()))
  if C.dp.rank_map then run.logger:line(C.dp.rank_map) end
end

-- an eval: the held-out loss and MoE maxvio_global into rec, the expert-load line, the on_eval hooks
local function do_eval(C, rec)
  local r = val_eval(C.ctx)
  if r then
    rec.val_loss = r.val_loss
    for i, v in pairs(r.maxvio_global) do rec["moe/maxvio_global/" .. i] = v end
    local line = step.moe_line(C.model, r.maxvio_global)
    if line then C.run.logger:line("  " .. line) end
  end
  call_hooks(C.ctx.stage, C.hooks, "on_eval", C.ctx, rec)
  return r
end

-- the end of a stage: evaluate, task evals when the stage asks, hooks, the stage summary; false after the last stage
local function end_stage(C, result)
  local st, run = C.stages[C.si], C.run
  local rec = { step = run.step, event = "stage_end", stage = st.name }
  local r = do_eval(C, rec)
  local stage_evals
  if st.eval_tasks and C.cfg.evals then
    stage_evals = task_evals(C.ctx, C.cfg.evals)
    run.logger:line(require("tide.evals").table(stage_evals))
    require("tide.results").log_evals(run.logger, stage_evals, run.step, C.cfg, st.name)
  end
  call_hooks(st, C.hooks, "on_stage_end", C.ctx, st)
  local mem = tide.memory()
  result.stages[#result.stages + 1] = { name = st.name, seq_len = st.seq_len, steps = st.steps,
    val_loss = r and r.val_loss, maxvio_global = r and r.maxvio_global, mem_peak = mem.peak, evals = stage_evals,
    tok_per_s = st._tok and st._tok / math.max(st._time, 1e-9) or nil }
  run:record(rec)
  run.logger:line(fmt("stage '%s' done at step %d%s; peak memory %sB", st.name, run.step,
    rec.val_loss and fmt(", val loss %.4f", rec.val_loss) or "", log.si(mem.peak)))
  if C.si == #C.stages then return false end
  C.stage_step = 0
  enter_stage(C, C.si + 1, nil, false)
  run:save()    -- the switch is a step boundary: the checkpoint starts the new stage (long_context.md §6)
  return true
end

-- one step of the current stage: its micro-batches from the packer, η from the stage segment, the shared step, the
-- record, evals, hooks, the progress line; true when the run must stop
local function stage_step(C, total_steps)
  local st, run = C.stages[C.si], C.run
  C.eta_from = C.eta_from or { time = tide.time(), tokens = run.tokens }   -- the ETA's rate: this process's steps
  -- each rank packs its 1/dp of the step's micro-batches from the data lanes it hosts (pack.Lanes: lane j reads the
  -- documents j, j + lanes, ... of each source), n_micro / lanes from each lane in lane order
  local batches = C.packer:next_step(st.n_micro / C.dp.n, st.micro_rows)
  local rec = run:train_step(batches, curriculum.lr_at(st, C.stage_step))
  C.stage_step = C.stage_step + 1
  st._tok, st._time = (st._tok or 0) + st.tokens_per_step, (st._time or 0) + rec.step_time
  rec.stage, rec.seq_len = st.name, st.seq_len
  if not rec.skipped and st.eval_every > 0 and C.stage_step % st.eval_every == 0 and C.stage_step < st.steps then
    do_eval(C, rec)
  end
  call_hooks(st, C.hooks, "on_step", C.ctx, rec)
  run:record(rec)
  -- a plain line every log_every steps, at a stage end and at an eval; on a terminal a live line between them
  local logger = run.logger
  local plain = run.step % (C.tcfg.log_every or 10) == 0 or C.stage_step == st.steps or rec.val_loss ~= nil
  if plain or logger.tty then
    local now, left = tide.time(), 0
    for _, s in ipairs(C.stages) do left = left + s.steps * s.tokens_per_step end
    left = left - run.tokens      -- ETA: the tokens still to train at this process's rate so far
    local p = { stage = st.name, step = run.step, steps = total_steps, loss = rec.loss, val_loss = rec.val_loss,
      lr = rec.lr, tok_per_s = rec.tok_per_s, elapsed = now - run.t_start,
      eta = math.max(left, 0) * (now - C.eta_from.time) / math.max(run.tokens - C.eta_from.tokens, 1),
      note = rec.skipped and ("skipped (non-finite " .. rec.nonfinite_tensor .. ")") or nil }
    if plain then logger:line(log.progress_text(p)) else logger:progress(p) end
  end
  local ckpt_every = C.tcfg.ckpt_every or 0
  C.in_rollback = true       -- a rollback restores the checkpoint's own stage, not --stage's
  local stop = run:after_step(rec, ckpt_every > 0 and run.step % ckpt_every == 0 and C.stage_step < st.steps)
  C.in_rollback = false
  return stop
end

-- the validation MaxVio of every MoE layer at the end of every stage (nil without MoE layers or `val`)
function curriculum.maxvio_table(stages)
  local ls = moe_layer_ids((stages[#stages] or {}).maxvio_global)
  if #ls == 0 then return nil end
  local head, rule = { "| stage |" }, { "|---|" }
  for _, l in ipairs(ls) do head[#head + 1] = fmt(" val MaxVio L%d |", l); rule[#rule + 1] = "---:|" end
  local lines = { table.concat(head), table.concat(rule) }
  for _, st in ipairs(stages) do
    local row, mv = { fmt("| %s |", st.name) }, st.maxvio_global or {}
    for _, l in ipairs(ls) do row[#row + 1] = mv[l] and fmt(" %.3f |", mv[l]) or " – |" end
    lines[#lines + 1] = table.concat(row)
  end
  return table.concat(lines, "\n")
end

-- run(cfg) -> result: stages in order until the last is done (or the non-finite policy stops the run), then the
-- final checkpoint, the task evals and the expert-load table
local function run(cfg)
  local C = setup(cfg)
  start(C)
  local result = C.run.result
  result.stages, result.evals = {}, {}
  local total_steps = 0
  for _, s in ipairs(C.stages) do total_steps = total_steps + s.steps end
  while true do
    if C.stage_step >= C.stages[C.si].steps then
      if not end_stage(C, result) then break end
    elseif stage_step(C, total_steps) then
      break
    end
  end
  local r = C.run:finish()
  local logger = C.run.logger
  if r.steps_run == 0 and not r.stopped then
    -- a resumed run that had already finished: nothing trained, nothing to check
    logger:line(fmt("done: the run is already at step %d of %d, nothing to train", r.steps, total_steps))
    logger:close()
    r.already_done = true
    return r
  end
  if not r.stopped and C.cfg.evals then
    r.evals = task_evals(C.ctx, C.cfg.evals)
    logger:line(require("tide.evals").table(r.evals))
  end
  if not r.stopped then
    local tbl, moe = step.moe_table(C.model, (r.stages[#r.stages] or {}).maxvio_global)
    if tbl then logger:line(tbl) end
    local per_stage = curriculum.maxvio_table(r.stages)
    if per_stage then logger:line(per_stage) end
    r.moe = moe
  end
  r.moe = r.moe or (C.model.moe_metrics and C.model:moe_metrics() or {})
  -- the eval and expert-load tables as JSONL event records, the run's summary in <out>/results.json
  require("tide.results").finish_run(C.run, r, C.cfg, curriculum.check_result(C.cfg, r))
  logger:line(fmt("done: %d steps, %s tokens in %s, final loss %.4f%s", r.steps, log.si(r.tokens), log.duration(r.elapsed),
    r.final_loss, r.checkpoint and (", checkpoint " .. r.checkpoint) or ""))
  logger:close()
  return r
end
curriculum.train = run

-- ---- plan (--dry-run) -----------------------------------------------------------------------------------------
local function human(b) return nn.plan.human_bytes(b) end
curriculum.human = human

-- plan(cfg) -> the text --dry-run prints: the model (parameters, active parameters), the stage table (T, tokens
-- per step, sequences per step, micro-batches, steps, tokens, η segment, mix), activation memory per token and per
-- sequence for the recompute mode, and the parallel layout cfg.dist plans (gpus, ep, cp), checked against GPU memory
function curriculum.plan(cfg)
  cfg = apply_scale(cfg)
  check_keys(cfg, TOP, "the curriculum config")
  check_expect(cfg)
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
  no_parallel(cfg)
  local par = cfg.dist or {}
  local dtype = par.dtype or mc.dtype or "f32"
  local rc = mc.recompute or require("tide.defaults").recompute.mode
  local static = plan.static_bytes(mc, { dtype = dtype })
  add(fmt("static memory (%s): weights %s, gradients %s, AdamW moments %s; total %s", dtype, human(static.weights +
    (static.weights_bf16 or 0)), human(static.grads), human(static.moments), human(static.total)))
  add("")
  if par.gpus then
    -- per rank: the static state of the parameters it holds (the dense ones and 1/ep of the routed experts) as
    -- dist.zero divides it over the dp ranks (0: replicated; 1: the AdamW moments / dp; 2: the gradients too, after
    -- the reduce-scatter; 3, FSDP, planned: everything / (dp · cp · ep), each layer's weights gathered while it runs),
    -- plus the activations of one sequence's 1/cp slice (one sequence in flight per rank, the recompute mode's
    -- checkpoints); and the bytes one rank sends per step for the dp group's gradients and ZeRO's weights
    -- (dist.step_bytes: the runtime's count, tests/dist/dp_check.sh), gradients and weights in the master dtype
    local dist = require "tide.dist"
    local ep, zero = par.ep or 1, par.zero or 0
    local largest, experts = 0, 0
    for _, pl in ipairs(count.per_layer or {}) do
      largest = math.max(largest, pl.total)
      if pl.ffn == "moe" then experts = experts + (pl.ffn_params or 0) end
    end
    local gathered = largest * (dtype == "bf16" and 2 or 4) / ep
    local per_rank = (count.total - experts) + experts / ep            -- parameters a rank holds (zero 0-2)
    local master = dtype == "f64" and 8 or 4
    local P = math.max(count.total, 1)
    local wb, gb, mb = (static.weights + (static.weights_bf16 or 0)) / P, static.grads / P, static.moments / P
    local names = { [0] = "replicated", "ZeRO-1", "ZeRO-2", "FSDP (ZeRO-3, planned)" }
    add(fmt("parallel layout: %d GPUs of %s, ep %d, cp per stage, dp = GPUs / (ep·cp), dist.zero = %d (%s); "
      .. "activations with recompute = %s", par.gpus, human(par.gpu_memory or 0), ep, zero, names[zero] or "?", rc))
    -- the expert-parallel exchanges (dist.ep_bytes, the runtime's count: tests/dist/ep_layer.lua), tokens routed
    -- uniformly: of a rank's tokens · k rows, (ep − 1)/ep leave it and as many arrive, in the plan's dtype
    local n_moe, n_kda, n_mla = 0, 0, 0
    for _, pl in ipairs(count.per_layer or {}) do
      if pl.ffn == "moe" then n_moe = n_moe + 1 end
      if pl.mixer == "kda" then n_kda = n_kda + 1 elseif pl.mixer == "mla" then n_mla = n_mla + 1 end
    end
    -- the context-parallel exchanges (dist.cp_bytes, the runtime's count: tests/dist/cp_layer.lua)
    local kc, mlc = mc.kda or {}, mc.mla or {}
    local kda_shape = n_kda > 0 and { layers = n_kda, heads = kc.heads, head_dim = kc.head_dim, conv_size = kc.conv_size }
    local mla_shape = n_mla > 0 and { layers = n_mla, kv_rank = mlc.kv_rank, rope_dim = mlc.rope_dim }
    local moe_cfg = mc.moe or {}
    local d_route = moe_cfg.latent_dim or mc.dim or 0
    local es = dtype == "bf16" and 2 or (dtype == "f64" and 8 or 4)
    add("| stage | T | cp | dp | seqs/step per dp rank | act. bytes/token | activations per rank | static per rank | total per rank | fits | dp bytes sent per rank per step | ep bytes sent per rank per step | cp bytes sent per rank per step |")
    add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for _, st in ipairs(stages) do
      local est = plan.activation_bytes(mc, st.seq_len, { recompute = rc, dtype = dtype })
      local cp = (par.cp or {})[st.name] or 1
      local dp = par.gpus / (ep * cp)
      local act = est.total / cp
      local stat
      if zero == 3 then stat = static.total / par.gpus + gathered
      else
        stat = per_rank * (wb + (zero >= 2 and gb / dp or gb) + (zero >= 1 and mb / dp or mb))
      end
      local tot = act + stat
      local comm = dist.step_bytes(master * per_rank, math.max(dp, 1), zero)
      local rows = st.rows * st.seq_len / par.gpus * (moe_cfg.top_k or 0) * (ep - 1) / ep
      local ep_comm = n_moe * dist.ep_bytes(rows, rows, d_route, d_route, es, ep)
      local cp_comm = dist.cp_bytes({ P = cp, B = st.rows / math.max(dp, 1), T = st.seq_len, kda = kda_shape or nil,
        mla = mla_shape or nil, es = es, state_es = 4, recompute = rc ~= "none" }).total
      add(fmt("| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", st.name, st.seq_len, cp,
        dp == math.floor(dp) and tostring(dp) or fmt("%.2f (GPUs not divisible)", dp), fmt("%.3g", st.rows / dp),
        human(est.per_token), human(act), human(stat), human(tot),
        par.gpu_memory and (tot <= par.gpu_memory and "yes" or "NO") or "?", human(comm), human(ep_comm), human(cp_comm)))
    end
    add(fmt("(ep bytes: %d MoE layers, top-%d rows of width %d exchanged with uniform routing; cp bytes: per KDA layer "
      .. "(%d) the conv halo and the fp32 (h_ext | M) pairs of the rank's 2 segments, independent of T, per MLA layer (%d) "
      .. "the latent of its T/cp tokens, each gathered to the other cp − 1 ranks in the forward%s and reduced back in "
      .. "the backward)", n_moe, moe_cfg.top_k or 0, d_route, n_kda, n_mla, rc ~= "none" and ", again in the recompute," or ""))
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
    if r.already_done then return 0 end
    -- the expect bounds fail the run only under --check (the test suite); a user's shortened run gets warnings
    local miss = curriculum.check_result(cfg, r)
    for _, line in ipairs(miss) do io.stderr:write(cfg.check and "" or "warning: ", line, "\n") end
    if #miss > 0 and not cfg.check then
      io.stderr:write("warning: the recipe's expect bounds are not met (--check makes that fail the run)\n")
    end
    return (#miss > 0 and cfg.check) and 1 or 0
  end
  spec.plan = function(cfg) return curriculum.plan(cfg) end
  return spec
end

-- the config schema's key sets (tide.schema: what the command line may set beyond what a recipe spells out)
curriculum.KEYS = { top = TOP, train = TRAIN, stage = STAGE, lr = LR, eval = EVAL, val = VAL, expect = EXPECT,
  caption_eval = CAPTION_EVAL }

return setmetatable(curriculum, { __call = function(_, spec) return curriculum.new(spec) end })
