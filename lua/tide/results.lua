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

-- ---- measuring on a shared machine ------------------------------------------------------------------------------
-- Timings on a machine others use are only comparable when taken side by side: the helpers below wait for an idle
-- machine, run the engines being compared in rounds (each round every engine once, the order rotating), and report
-- each comparison as the median and range of the per-round ratios, so that a slow moment hits both sides of a pair.

-- the /proc/stat totals: busy (user, nice, system, irq, softirq, steal) and all jiffies, and steal alone
local function cpu_times()
  local f = io.open("/proc/stat")
  if not f then return nil end
  local line = f:read("*l")
  f:close()
  local v = {}
  for n in line:gmatch("%d+") do v[#v + 1] = tonumber(n) end
  local user, nice, system, idle, iowait, irq, softirq, steal = v[1], v[2], v[3], v[4], v[5] or 0, v[6] or 0,
    v[7] or 0, v[8] or 0
  local busy = user + nice + system + irq + softirq + steal
  return busy, busy + idle + iowait, steal
end

local function sleep(s) ffi.C.usleep(math.floor(s * 1e6)) end
pcall(ffi.cdef, "int usleep(unsigned int usec);")

-- cpu_busy(seconds) -> the fraction of all cores' time spent busy over the next `seconds` (steal counted as busy:
-- the host took it), and the steal fraction alone; nil where /proc is absent
function results.cpu_busy(seconds)
  local b0, t0, s0 = cpu_times()
  if not b0 then return nil end
  sleep(seconds or 1)
  local b1, t1, s1 = cpu_times()
  local dt = math.max(t1 - t0, 1)
  return (b1 - b0) / dt, (s1 - s0) / dt
end

-- wait_idle{max_busy = 0.15, timeout = 60, sample = 1} -> {busy, steal, waited}: waits until a sample of the cores
-- (this process idle meanwhile) is at most max_busy busy, or the timeout passes; what it last saw is returned so
-- the record can say how quiet the machine was
function results.wait_idle(o)
  o = o or {}
  local max_busy, timeout, sample = o.max_busy or 0.15, o.timeout or 60, o.sample or 1
  local t0 = tide.time()
  local busy, steal = results.cpu_busy(sample)
  while busy and busy > max_busy and tide.time() - t0 < timeout do busy, steal = results.cpu_busy(sample) end
  return { busy = busy, steal = steal, waited = tide.time() - t0 }
end

-- interleave(rounds, runners, opts) -> {values = {name = {one number per round}}, idle = {wait_idle per round},
--   order = {names per round}}: runners = {{name, fn}, ...}; each round waits for an idle machine (opts: wait_idle's
--   options; opts.wait = false skips it) and calls every fn(round) once, the order rotated by one each round; fn
--   returns the number compared (seconds per step, say)
function results.interleave(rounds, runners, opts)
  opts = opts or {}
  local out = { values = {}, idle = {}, order = {} }
  for _, r in ipairs(runners) do out.values[r[1]] = {} end
  for round = 1, rounds do
    if opts.wait ~= false then out.idle[round] = results.wait_idle(opts) end
    local names = {}
    for k = 0, #runners - 1 do
      local r = runners[(round - 1 + k) % #runners + 1]
      names[#names + 1] = r[1]
      local v = r[2](round)
      out.values[r[1]][round] = v
    end
    out.order[round] = names
  end
  return out
end

-- paired(a, b) -> {median, min, max, n, ratios}: the per-round ratios a[i] / b[i] of two lists from interleave
function results.paired(a, b)
  local ratios = {}
  for i = 1, math.min(#a, #b) do ratios[i] = a[i] / b[i] end
  local lo, hi = math.huge, -math.huge
  for _, r in ipairs(ratios) do lo, hi = math.min(lo, r), math.max(hi, r) end
  return { median = #ratios > 0 and results.median(ratios) or nil, min = lo, max = hi, n = #ratios, ratios = ratios }
end

-- "1.42x (1.35-1.51x)": a paired ratio for a table
function results.ratio_str(p)
  if not p or not p.median then return "-" end
  return string.format("%.2fx (%.2f-%.2fx)", p.median, p.min, p.max)
end

-- ---- the PyTorch baselines -------------------------------------------------------------------------------------
-- Which PyTorch is fastest depends on the build as much as on the machine: Debian's python3-torch (1.13, OpenBLAS,
-- libgomp) is fastest with OMP_WAIT_POLICY=PASSIVE on some workloads, a PyPI build (2.x, MKL) with its default
-- environment. A benchmark with a PyTorch side runs every build it is given under both OpenMP settings and quotes the
-- fastest, recording all.
-- (the tide executable exports PASSIVE and a short spin for itself, so both are set or cleared for the child)
results.TORCH_SETTINGS = {
  { name = "default", env = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT" },
  { name = "PASSIVE", env = "env -u GOMP_SPINCOUNT OMP_WAIT_POLICY=PASSIVE" },
}

-- torch_version(python) -> torch.__version__ as that interpreter imports it (the last line of its output: an
-- import may print warnings first), or nil and why (the last line of what it printed on either stream)
function results.torch_version(python)
  local cli = require "tide.cli"
  local function run(redirect)
    local p = io.popen(cli.shell_quote(python) .. " -c 'import torch; print(torch.__version__)' " .. redirect)
    local out = p and p:read("*a") or ""
    if p then p:close() end
    return (out:gsub("%s+$", ""):match("([^\n]*)$")) or ""
  end
  local v = run("2>/dev/null"):match("^%s*(%d+%.%d+%S*)$")
  if v then return v end
  local last = run("2>&1")
  return nil, last ~= "" and last or "no output"
end

-- torch_engines(pythons) -> engines, builds, skipped: `pythons` a comma-separated list of interpreters (or a Lua
-- list); each that imports torch is a build {python, version}, and every build runs under every setting: engine
-- {python, version, setting, env, label = "<version> <setting>"}. skipped: {python, why} of those that do not
-- import torch. The same version twice (two paths to one install) counts once.
function results.torch_engines(pythons)
  local list = {}
  if type(pythons) == "table" then list = pythons
  else for item in tostring(pythons or ""):gmatch("[^,]+") do list[#list + 1] = item:match("^%s*(.-)%s*$") end end
  local engines, builds, skipped, seen = {}, {}, {}, {}
  for _, py in ipairs(list) do
    if py ~= "" then
      local v, why = results.torch_version(py)
      if not v then skipped[#skipped + 1] = { python = py, why = why }
      elseif not seen[v] then
        seen[v] = true
        builds[#builds + 1] = { python = py, version = v }
        for _, st in ipairs(results.TORCH_SETTINGS) do
          engines[#engines + 1] = { python = py, version = v, setting = st.name, env = st.env,
            label = v .. " " .. st.name }
        end
      end
    end
  end
  return engines, builds, skipped
end

-- ---- a helper process: JSON commands through a FIFO, one JSON line back per command -----------------------------
local Server = {}
Server.__index = Server

-- server(cmd, dir, who, quit) -> a running process: `cmd` is a shell command that reads its commands from the FIFO
-- whose path replaces "{fifo}" in it; its stderr goes to <dir>/<who>.err, quoted when it stops answering; `quit` is
-- what close() sends (default {cmd = "quit"})
function results.server(cmd, dir, who, quit)
  local cli = require "tide.cli"
  local fifo, err = dir .. "/" .. who .. ".cmd", dir .. "/" .. who .. ".err"
  os.remove(fifo)
  if os.execute("mkfifo " .. cli.shell_quote(fifo)) ~= 0 then error(who .. ": mkfifo " .. fifo .. " failed", 0) end
  local full = cmd:gsub("{fifo}", function() return cli.shell_quote(fifo) end) .. " 2>" .. cli.shell_quote(err)
  local p = assert(io.popen(full, "r"))
  local w = assert(io.open(fifo, "r+"))   -- "r+" opens a FIFO without waiting for the reader
  return setmetatable({ p = p, w = w, err = err, who = who, fifo = fifo, quit = quit or { cmd = "quit" } }, Server)
end

-- ask(obj) -> the decoded answer: obj is a table (sent as one JSON line) or a string (sent as the line itself); an
-- answer {error = ...} or a process that stopped answering raises one line
function Server:ask(obj)
  local line = type(obj) == "string" and obj or json.encode(obj)
  self.w:write(line, "\n")
  self.w:flush()
  local ans = self.p:read("*l")
  if not ans then
    local f = io.open(self.err)
    local e = f and f:read("*a") or ""
    if f then f:close() end
    local what = type(obj) == "table" and tostring(obj.cmd) or ("'" .. line .. "'")
    error(self.who .. ": the helper process stopped answering (" .. what .. "): " .. e:sub(-1200), 0)
  end
  local r = json.decode(ans)
  if r.error then error(self.who .. ": " .. r.error, 0) end
  return r
end

function Server:close()
  pcall(function() self:ask(self.quit) end)
  self.w:close()
  self.p:close()
  os.remove(self.fifo)
end

return results
