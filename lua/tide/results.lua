-- results.lua — results on disk: for benchmarks and studies one JSON record and one Markdown table per run,
-- written atomically under a results directory (bench/results by default); for a training run its final evals and
-- expert-load table as event records in metrics.jsonl and a summary in <run>/results.json.
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"

local results = {}

-- write(dir, name, record, md, first): <dir>/<name>.json (keys `first` first) and <dir>/<name>.md; dir "" writes
-- nothing. Errors name the path.
function results.write(dir, name, record, md, first)
  if dir == "" then return end
  if tide.C.tide_mkdir_p(dir) ~= 0 then
    error(name .. ": cannot create '" .. dir .. "': " .. ffi.string(tide.C.tide_last_error()), 0)
  end
  local text = json.encode(record, { first = first or { "benchmark", "date" } }) .. "\n"
  for _, f in ipairs({ { dir .. "/" .. name .. ".json", text }, { dir .. "/" .. name .. ".md", md } }) do
    if tide.C.tide_file_write_text_atomic(f[1], f[2]) ~= 0 then
      error(name .. ": cannot write '" .. f[1] .. "': " .. ffi.string(tide.C.tide_last_error()), 0)
    end
  end
  io.stderr:write(name .. ": wrote " .. dir .. "/" .. name .. ".json and " .. name .. ".md\n")
end

-- ---- a training run's results: event records in its metrics.jsonl and <run>/results.json --------------------

-- eval_record(row, step, cfg, stage) -> one row of a task eval (tide.evals) in the JSONL's eval result shape
-- (formats.md §5, as tide eval writes it): task, config (the recipe's name), T (the context length), D (mqar: the
-- key-value pairs), acc, n (examples), seed, step; besides: source, depth (passkey), exact (share of examples with
-- every label right), labelled (scored positions), stage (a stage end's evals)
function results.eval_record(row, step, cfg, stage)
  local src = ((cfg or {}).sources or {})[row.source or ""] or {}
  local D
  if row.task == "mqar" then D = src.num_pairs or require("tide.data.synthetic").MQAR_DEFAULTS.num_pairs end
  return { step = step, event = "eval", task = row.task, source = row.source, config = (cfg or {}).name,
    stage = stage, T = row.length, D = D, depth = row.depth, acc = row.accuracy, exact = row.exact, n = row.examples,
    labelled = row.labelled, seed = row.seed, label_acc = row.label_accuracy }
end

-- the TensorBoard tag of an eval record's accuracy: eval/<source>/acc/<T>[/depth_<d>] (exact: .../exact/...)
-- (a caption eval, which has no T: eval/<source>/acc)
function results.eval_tag(rec, what)
  if rec.T == nil then return string.format("eval/%s/%s", rec.source or rec.task, what or "acc") end
  return string.format("eval/%s/%s/%d%s", rec.source or rec.task, what or "acc", rec.T,
    rec.depth and string.format("/depth_%g", rec.depth) or "")
end

-- log_evals(logger, rows, step, cfg, stage) -> the records: one {"event": "eval"} JSONL record per row, its
-- accuracy and exact match as TensorBoard scalars at the step
function results.log_evals(logger, rows, step, cfg, stage)
  local recs = {}
  for i, row in ipairs(rows or {}) do
    local rec = results.eval_record(row, step, cfg, stage)
    logger:metrics(rec, { [results.eval_tag(rec)] = rec.acc, [results.eval_tag(rec, "exact")] = rec.exact,
      [results.eval_tag(rec, "label_acc")] = rec.label_acc })
    recs[i] = rec
  end
  return recs
end

-- moe_rows(moe, maxvio_global) -> the expert-load table of a run's end, one row per MoE layer (0-based, in order):
-- {layer, maxvio_batch (last step), maxvio_val (held-out tokens), dead_experts, b_std, b_min, b_max, load (per
-- expert, the last step's tokens)}
function results.moe_rows(moe, maxvio_global)
  local ls = {}
  for l in pairs(moe or {}) do ls[#ls + 1] = l end
  table.sort(ls)
  local rows = {}
  for i, l in ipairs(ls) do
    local mt = moe[l]
    rows[i] = { layer = l, maxvio_batch = mt.maxvio_batch, maxvio_val = (maxvio_global or {})[l],
      dead_experts = mt.dead_experts, b_std = mt.b_std, b_min = mt.b_min, b_max = mt.b_max,
      load = type(mt.load) == "table" and json.array({ unpack(mt.load) }) or nil }
  end
  return rows
end

-- a {[layer] = v} table with JSON object keys ("0", "1", ...)
local function by_layer(t)
  if t == nil then return nil end
  local out = {}
  for l, v in pairs(t) do out[tostring(l)] = v end
  return out
end

-- the stage_end records of a metrics file (a resumed run's result holds only the stages it finished itself)
local function stage_ends(path)
  local out = {}
  local f = path and io.open(path, "rb")
  if not f then return out end
  for line in f:lines() do
    if line:find('"event":"stage_end"', 1, true) then
      local ok, r = pcall(json.decode, line)
      if ok and type(r) == "table" and r.stage then out[#out + 1] = r end
    end
  end
  f:close()
  return out
end

-- finish_run(run, r, cfg, missed): the end of a curriculum run (tide.step Run, its result, its config, the lines
-- of the expect bounds it misses) — the final task evals and the expert-load table as event records in the JSONL
-- ({"event": "eval"} per row, {"event": "moe"} per MoE layer) and the whole summary in <out>/results.json, written
-- atomically: name, step, tokens, elapsed_s, final_loss (mean of the last final_loss_n), stopped, checkpoint,
-- stages (name, seq_len, steps, step, val_loss, maxvio_val by layer, mem_peak, tok_per_s, evals), evals, moe,
-- expect, expect_missed. Returns the summary.
function results.finish_run(run, r, cfg, missed)
  local logger, step = run.logger, r.steps
  local evals = results.log_evals(logger, r.evals, step, cfg)
  local last = r.stages and r.stages[#r.stages] or {}
  local moe = results.moe_rows(r.moe, last.maxvio_global)
  for _, row in ipairs(moe) do
    local rec = { step = step, event = "moe" }
    for k, v in pairs(row) do rec[k] = v end
    logger:metrics(rec, {})           -- its numbers are the step records' tags already
  end
  local stages, seen = {}, {}
  local done_here = {}
  for _, st in ipairs(r.stages or {}) do done_here[st.name] = st end
  for _, e in ipairs(stage_ends(run.out and run.out .. "/metrics.jsonl")) do
    if not seen[e.stage] then
      seen[e.stage] = true
      local st = done_here[e.stage] or {}
      local mv = {}
      for k, v in pairs(e) do
        local l = k:match("^moe/maxvio_global/(%d+)$")
        if l then mv[l] = v end
      end
      local stage_evals = {}
      for i, row in ipairs(st.evals or {}) do stage_evals[i] = results.eval_record(row, e.step, cfg, e.stage) end
      stages[#stages + 1] = { name = e.stage, step = e.step, seq_len = st.seq_len, steps = st.steps,
        val_loss = e.val_loss, maxvio_val = next(mv) and mv or nil, mem_peak = st.mem_peak, tok_per_s = st.tok_per_s,
        evals = #stage_evals > 0 and stage_evals or nil }
    end
  end
  local summary = {
    name = cfg.name, step = step, tokens = r.tokens, elapsed_s = r.elapsed, final_loss = r.final_loss,
    final_loss_n = r.final_loss_n, stopped = r.stopped, checkpoint = r.checkpoint, skipped = r.skipped,
    rollbacks = r.rollbacks, stages = json.array(stages), evals = json.array(evals), moe = json.array(moe),
    expect = cfg.expect, expect_missed = json.array(missed or {}),
  }
  if run.out and run.writer ~= false then   -- (data parallelism: rank 0 writes)
    local path = run.out .. "/results.json"
    local text = json.encode(summary, { first = { "name", "step", "tokens", "elapsed_s", "final_loss" } }) .. "\n"
    if tide.C.tide_file_write_text_atomic(path, text) ~= 0 then
      error("results: cannot write '" .. path .. "': " .. ffi.string(tide.C.tide_last_error()), 0)
    end
    logger:line("results: " .. path)
  end
  return summary
end

-- numbers(s) -> the integers in s ("8192,32768" or a number) as a list: the size lists of benchmark options
function results.numbers(s)
  local out = {}
  for n in tostring(s):gmatch("%d+") do out[#out + 1] = tonumber(n) end
  return out
end

-- the 1-minute load average (nil where /proc is absent): benchmarks record it beside their timings
function results.loadavg()
  local f = io.open("/proc/loadavg")
  if not f then return nil end
  local line = f:read("*l")
  f:close()
  return line and tonumber(line:match("^(%S+)"))
end

-- sync(device): waits for the work queued on a GPU (a one-element read back is ordered after it); nothing on the cpu
function results.sync(device)
  if device ~= "cpu" then require("tide").zeros({ 1 }, { device = device }):item() end
end

-- median(xs) of a list of numbers (the list is not changed)
function results.median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

return results
