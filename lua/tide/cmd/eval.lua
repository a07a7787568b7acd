-- tide eval CKPT: the held-out loss of a checkpoint (on its run's own validation data, the way the run measured it,
-- or on a file) and its accuracy on the synthetic recall tasks (tide.evals), as tables and a results JSON whose
-- records have formats.md §5's eval-result shape.
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide eval CKPT [--task val,mqar,passkey] [--lengths 128,256,...] [--data PATH] [--batches N] [-o results.json]

Evaluates the checkpoint CKPT (a run directory, its latest checkpoint, or a step directory); prints one table per
task and, with -o, writes the records as JSON.

  --task LIST         val (default): mean cross-entropy per token and perplexity on held-out data;
                      mqar, passkey: token accuracy and exact match of the synthetic recall tasks (spec/evals.md)
  val:
  --data PATH         a text file, a directory or token shards (.bin) instead of the run's validation data; every
                      window of the data is scored unless --batches is given
  --doc-separator S   (--data) a line that separates documents in a text file (e.g. %)
  --batches N         batches to score (default: as many as the run used at each evaluation)
  --seq-len T --batch-size B   (--data) the window and rows per batch (default: the run's, else 256 and 4)
  mqar / passkey (the options of the run's source of that kind when it has one, else the task's defaults):
  --lengths LIST      example lengths (default: the run's evals entry for that source, else 128,256,512)
  --depths LIST       passkey needle depths in [0, 1] (default: the run's, else 0,0.25,0.5,0.75,1)
  --examples N        examples per length (default: the run's, else 20)   --batch N  rows per forward (4)
  --seed S            the examples' seed (default: the run's evals seed, 1000003)
  -o, --out PATH      write {"checkpoint", "step", "results": [records]} to PATH
  --device DEV        cpu (default) or cuda:0]]

local SPEC = {
  task = { kind = "list", default = { "val" } },
  data = { kind = "string" }, doc_separator = { kind = "string" },
  batches = { kind = "integer", min = 1 }, seq_len = { kind = "integer", min = 2 }, batch_size = { kind = "integer", min = 1 },
  lengths = { kind = "list" }, depths = { kind = "list" }, examples = { kind = "integer", min = 1 },
  batch = { kind = "integer", min = 1 }, seed = { kind = "integer", min = 0 },
  out = { kind = "string" }, device = { kind = "string", default = "cpu" },
}
M.SPEC = SPEC

local fmt = string.format
local TASKS = { val = true, mqar = true, passkey = true }

local function fail(msg) error("eval: " .. msg, 0) end

local function copy(t)
  if type(t) ~= "table" then return t end
  local o = {}
  for k, v in pairs(t) do o[k] = copy(v) end
  return o
end

local function numbers(list, what)
  local out = {}
  for i, v in ipairs(list) do
    if type(v) ~= "number" then cli.usage_error(fmt("tide eval: --%s must be numbers, got '%s'", what, tostring(v))) end
    out[i] = v
  end
  return out
end

-- ---- val ------------------------------------------------------------------------------------------------------
-- the mean loss over batches from next() -> x, y (each batch's mean, then their mean: every batch has B·T targets)
local function mean_loss(model, next_batch, batches)
  local step = require "tide.step"
  local total = 0
  local maxvio = step.with_eval_loads(model, function()
    for _ = 1, batches do
      local x, y = next_batch()
      total = total + model:loss(step.to_model(model, x), step.to_model(model, y)):item()
    end
  end)
  return total / batches, maxvio
end

-- the loss on a file: every window of seq_len + 1 tokens in order (or the first `batches` batches of them)
local function val_on_data(model, info, f)
  local text = require "tide.data.text"
  local dc = (info.config or {}).data or {}
  local T = f.seq_len or dc.seq_len or math.min(256, info.model_config.max_seq_len or 256)
  local B = f.batch_size or dc.batch_size or 4
  local ds = text.load({ path = f.data, doc_separator = f.doc_separator, val_fraction = 0 }, info.tokenizer)
  if ds.train.n < T + 1 then fail(fmt("%s holds %d tokens, fewer than one window of %d + 1", f.data, ds.train.n, T)) end
  local s = text.stream(ds.train, { batch_size = B, seq_len = T, order = "sequential" })
  local batches = f.batches or math.max(1, math.floor(s.n_windows / B))
  local loss, maxvio = mean_loss(model, function() return s:next() end, batches)
  return { loss = loss, T = T, B = B, batches = batches, tokens = batches * B * T, data = f.data, maxvio = maxvio }
end

-- the run's own held-out data, measured as the run measured it: tide.train's validation split (train.eval_batches
-- batches), or a curriculum's `val` set at the checkpoint's stage
local function val_of_run(model, info, f)
  local cfg = info.config
  if not cfg then fail("the checkpoint carries no run config (an imported model): give --data PATH") end
  if cfg.kind == "curriculum" or cfg.sources then
    local vc = cfg.val
    if not vc then fail("the curriculum has no `val` set: give --data PATH") end
    local curriculum = require "tide.curriculum"
    local sources = require "tide.data.sources"
    local checkpoint = require "tide.checkpoint"
    local F = require("tide").F
    local step = require "tide.step"
    local stages = curriculum.resolve(copy(cfg))
    local r = checkpoint.open(info.dir)
    r:close()
    local pos = r.state.curriculum or {}
    local st = stages[pos.stage or #stages] or stages[#stages]
    local seed = cfg.seed or (cfg.train or {}).seed or 0
    local tok = info.tokenizer
    local eot = tok:id("<|endoftext|>")
    local built = sources.build(cfg.sources, tok, seed, "eval")
    local mix
    if vc.mix == "stage" then
      built, mix = sources.build(sources.held_out(cfg.sources, "eval"), tok, seed, "eval"), st.mix
    else
      mix = sources.mix(vc.mix, built, "val", "eval")
    end
    local names = {}
    for _, e in ipairs(mix) do names[#names + 1] = e.name end
    local T = st.seq_len
    local p = sources.packer(names, built, T, vc.seed or 7919, eot)
    p:set_mix(sources.mix_entries(mix))
    local batches = f.batches or vc.batches or 2
    local sum, n = 0, 0
    local maxvio = step.with_eval_loads(model, function()
      for _ = 1, batches do
        local b = p:next_rows(st.micro_rows)
        local logits = model:forward(step.to_model(model, b.ids), nil, { cu_seqlens = b.cu_seqlens })
        sum = sum + F.cross_entropy(logits, step.to_model(model, b.targets), { reduction = "sum" }):item()
        n = n + b.n_targets
      end
    end)
    return { loss = sum / n, T = T, B = st.micro_rows, batches = batches, tokens = n, maxvio = maxvio,
      data = "the run's val set at stage " .. st.name }
  end
  if not cfg.data then fail("the run config has no data section: give --data PATH") end
  local data = require "tide.data"
  local dc = copy(cfg.data)
  if dc.seed == nil then dc.seed = cfg.seed or (cfg.train or {}).seed or 0 end
  local d = data.build(dc, info.model_config.vocab_size)
  if not d.val then fail("the run has no validation split (data.val_fraction is 0 or too small): give --data PATH") end
  local s = d.val()
  local batches = f.batches or (cfg.train or {}).eval_batches or 4
  local loss, maxvio = mean_loss(model, function() return s:next() end, batches)
  return { loss = loss, T = dc.seq_len, B = dc.batch_size, batches = batches, tokens = batches * dc.batch_size * dc.seq_len,
    maxvio = maxvio, data = "the run's validation split" }
end

local function val_table(v)
  local lines = { "| task | data | T | batches | tokens | loss | perplexity |", "|---|---|---:|---:|---:|---:|---:|",
    fmt("| val | %s | %d | %d | %d | %.4f | %.3f |", v.data, v.T, v.batches, v.tokens, v.loss, math.exp(v.loss)) }
  return table.concat(lines, "\n") .. "\n"
end

-- ---- mqar / passkey ----------------------------------------------------------------------------------------------
-- the task rows: through the run's source of that kind (curriculum.task_evals: the options it trained on, text
-- fillers from the same text) when it has one, else tide.evals with the task's defaults
local function task_rows(model, info, task, f)
  local evals = require "tide.evals"
  local cfg = info.config or {}
  local src_name
  for _, name in ipairs(require("tide.options").sorted_keys(cfg.sources or {})) do
    local sc = cfg.sources[name]
    if type(sc) == "table" and sc.kind == task and not src_name then src_name = name end
  end
  local entry
  for _, e in ipairs(cfg.evals or {}) do
    if src_name and e.source == src_name then entry = copy(e) end
  end
  local lengths = f.lengths and numbers(f.lengths, "lengths") or (entry and entry.lengths) or { 128, 256, 512 }
  local o = { lengths = lengths, examples = f.examples or (entry and entry.examples) or evals.DEFAULTS.examples,
    batch = f.batch or (entry and entry.batch) or evals.DEFAULTS.batch }
  if task == "passkey" then
    o.depths = f.depths and numbers(f.depths, "depths") or (entry and entry.depths) or evals.DEFAULTS.depths
  end
  local seed = f.seed or (entry and entry.seed) or 1000003
  if src_name then
    local curriculum = require "tide.curriculum"
    local sources = require "tide.data.sources"
    o.source, o.seed = src_name, seed
    local run_seed = cfg.seed or (cfg.train or {}).seed or 0
    local ctx = { cfg = cfg, model = model, tok = info.tokenizer,
      sources = sources.build(cfg.sources, info.tokenizer, run_seed, "eval") }
    return curriculum.task_evals(ctx, { o }), cfg.sources[src_name], seed
  end
  o.task, o.seed, o.tokenizer = task, seed, info.tokenizer
  return evals.run(model, o), {}, seed
end

-- ---- the command ------------------------------------------------------------------------------------------------
-- evaluate(ckpt, flags) -> {records, tables (text), info}: flags as parse_flags returns them
function M.evaluate(ckpt, flags)
  local f = {}
  for k, s in pairs(SPEC) do f[k] = copy(s.default) end
  for k, v in pairs(flags or {}) do f[k] = v end
  local passkey = false
  for _, t in ipairs(f.task) do
    if not TASKS[t] then cli.usage_error(fmt("tide eval: unknown task '%s' (tasks: val, mqar, passkey)", tostring(t))) end
    passkey = passkey or t == "passkey"
  end
  if f.depths and not passkey then cli.usage_error("tide eval: --depths applies to the passkey task only") end
  local checkpoint = require "tide.checkpoint"
  local model, info = checkpoint.load_model(ckpt, { device = f.device ~= "cpu" and f.device or nil })
  local cfg = info.config or {}
  local config = cfg.name or info.kind
  local records, tables = {}, {}
  for _, task in ipairs(f.task) do
    if task == "val" then
      local v = f.data and val_on_data(model, info, f) or val_of_run(model, info, f)
      local maxvio
      for l, x in pairs(v.maxvio or {}) do maxvio = maxvio or {}; maxvio[tostring(l)] = x end
      records[#records + 1] = { task = "val", config = config, T = v.T, loss = v.loss, ppl = math.exp(v.loss),
        n = v.tokens, batches = v.batches, data = v.data, step = info.step, maxvio_global = maxvio }
      tables[#tables + 1] = val_table(v)
    else
      -- the task modules name their own line in a message; the user wants the message
      local ok, rows, src, seed = pcall(task_rows, model, info, task, f)
      if not ok then
        if type(rows) == "table" then error(rows, 0) end      -- a usage error
        error("eval: " .. tostring(rows):gsub("^[^:\n]*%.lua:%d+: ", ""), 0)
      end
      local evals = require "tide.evals"
      local syn = require "tide.data.synthetic"
      for _, r in ipairs(rows) do
        records[#records + 1] = { task = task, config = config, T = r.length,
          D = task == "mqar" and (src.num_pairs or syn.MQAR_DEFAULTS.num_pairs) or nil, depth = r.depth, seed = seed,
          acc = r.accuracy, exact = r.exact, n = r.examples, labelled = r.labelled, step = info.step }
      end
      tables[#tables + 1] = evals.table(rows)
    end
  end
  return { records = records, tables = tables, info = info }
end

function M.main(args)
  local pos, flags = cli.parse_flags(args, SPEC, "tide eval", { o = "out" })
  if #pos ~= 1 then cli.usage_error("tide eval: expected one checkpoint, got " .. #pos .. " argument(s) (tide eval --help)") end
  local r = M.evaluate(pos[1], flags)
  print(fmt("eval: %s (step %d, %s)", r.info.dir, r.info.step or 0, r.info.kind))
  for _, t in ipairs(r.tables) do io.write("\n", t) end
  if flags.out then
    local json = require "tide.json"
    local text = json.encode({ checkpoint = r.info.dir, step = r.info.step, kind = r.info.kind,
      results = json.array(r.records) }, { first = { "task", "config", "T", "D", "depth", "seed", "acc", "exact", "n", "loss", "ppl", "step", "checkpoint", "kind" } }) .. "\n"
    local C = require("tide").C
    if C.tide_file_write_text_atomic(flags.out, text) ~= 0 then
      error("eval: cannot write " .. flags.out .. ": " .. require("ffi").string(C.tide_last_error()), 0)
    end
    print("\nwrote " .. flags.out)
  end
  return 0
end

return M
