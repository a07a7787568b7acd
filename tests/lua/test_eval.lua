-- tide eval (lua/tide/cmd/eval.lua): the held-out loss equals the one the run measured (tide.train's validation
-- split, a curriculum's val set), the loss on a file equals a cross-entropy computed here from the model's logits,
-- the recall rows equal the curriculum's own final evals, the results JSON carries the same numbers in formats.md
-- §5's shape, and mistakes are one line.
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local cli = require "tide.cli"
local checkpoint = require "tide.checkpoint"
local train = require "tide.train"
local eval = require "tide.cmd.eval"

local tmpdir = T.tmpdir

local dense
local function dense_run()
  if dense then return dense end
  local dir = tmpdir("dense")
  local r = train({
    model = { dim = 32, n_layers = 2, n_heads = 2, vocab_size = 320 },
    data = { path = "tests/fixtures/tiny_corpus.txt", doc_separator = "%", val_fraction = 0.1, seq_len = 32, batch_size = 4 },
    optim = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 },
    schedule = { kind = "cosine", warmup = 5 },
    train = { steps = 24, log_every = 1000, seed = 1, quiet = true, eval_batches = 3, out = dir },
  })
  dense = { dir = dir, r = r }
  return dense
end

local hybrid
local function hybrid_run()
  if hybrid then return hybrid end
  local dir = tmpdir("hybrid")
  local cfg = cli.load_recipe("tests/fixtures/curriculum_small.lua", { { key = "train.out", text = dir } })
  local r = require("tide.curriculum").train(cfg)
  hybrid = { dir = dir, r = r }
  return hybrid
end

T.test("val: the loss of the run's own validation split, as the run measured it at its last step", function()
  local d = dense_run()
  local r = eval.evaluate(d.dir, {})
  local v = r.records[1]
  T.eq(v.task, "val"); T.eq(v.step, 24); T.eq(v.batches, 3); T.eq(v.T, 32); T.eq(v.n, 3 * 4 * 32)
  T.ok(type(d.r.val_loss) == "number", "the run measured a validation loss")
  T.eq(v.loss, d.r.val_loss, "the run's final validation loss")
  T.near(v.ppl, math.exp(v.loss), 1e-12)
  -- --batches changes how much is scored
  local two = eval.evaluate(d.dir, { batches = 2 }).records[1]
  T.eq(two.batches, 2)
  T.ok(two.loss ~= v.loss, "a different number of batches scores different tokens")
end)

T.test("val --data: equals the mean cross-entropy computed here from the model's logits over every window", function()
  local d = dense_run()
  local path = tmpdir("data", { create = true }) .. "/held_out.txt"
  local f = io.open(path, "w")
  f:write("The quick brown fox jumps over the lazy dog.\n%\nA stitch in time saves nine; é and ✓ too.\n")
  f:close()
  local r = eval.evaluate(d.dir, { data = path, doc_separator = "%", seq_len = 16, batch_size = 2 })
  local v = r.records[1]
  -- the tokens: <|endoftext|> before each document, then its bytes with its final newline (data/text.lua); windows
  -- of 16 + 1 in order
  local model, info = checkpoint.load_model(d.dir)
  model:eval()
  local tok = info.tokenizer
  local ids = {}
  for _, doc in ipairs({ "The quick brown fox jumps over the lazy dog.\n", "A stitch in time saves nine; é and ✓ too.\n" }) do
    ids[#ids + 1] = tok:id("<|endoftext|>")
    for _, b in ipairs(tok:encode(doc)) do ids[#ids + 1] = b end
  end
  local windows = math.floor((#ids - 1) / 16)
  local batches = math.floor(windows / 2)
  T.eq(v.batches, batches); T.eq(v.n, batches * 2 * 16)
  local total, n = 0, 0
  tide.no_grad(function()
    for w = 0, batches * 2 - 1 do
      local x = {}
      for t = 1, 16 do x[t] = ids[w * 16 + t] end
      local logits = model:forward(tide.tensor({ x }, { dtype = "i32" })):tolist()
      local V = #logits / 16
      for t = 1, 16 do
        local row, m = {}, -math.huge
        for k = 1, V do row[k] = logits[(t - 1) * V + k]; m = math.max(m, row[k]) end
        local s = 0
        for k = 1, V do s = s + math.exp(row[k] - m) end
        total = total + (m + math.log(s) - row[ids[w * 16 + t + 1] + 1])
        n = n + 1
      end
    end
  end)
  T.near(v.loss, total / n, 1e-5, "mean cross-entropy per token")
  T.eq(v.data, path)
end)

T.test("curriculum: val equals the run's last stage-end val loss; passkey rows equal the run's final evals", function()
  local h = hybrid_run()
  local r = eval.evaluate(h.dir, { task = { "val", "passkey" } })
  local last = h.r.stages[#h.r.stages]
  T.ok(type(last.val_loss) == "number", "the run measured a val loss at its last stage end")
  T.eq(r.records[1].loss, last.val_loss, "val loss")
  T.eq(r.records[1].T, last.seq_len)
  for l, x in pairs(last.maxvio_global or {}) do
    T.eq(r.records[1].maxvio_global[tostring(l)], x, "val MaxVio of layer " .. l)
  end
  local rows = {}
  for i = 2, #r.records do rows[#rows + 1] = r.records[i] end
  T.eq(#rows, #h.r.evals, "one row per length and depth")
  for i, e in ipairs(h.r.evals) do
    local row = rows[i]
    T.eq(row.task, "passkey"); T.eq(row.T, e.length); T.eq(row.depth, e.depth)
    T.eq(row.acc, e.accuracy, "accuracy at " .. e.length); T.eq(row.exact, e.exact); T.eq(row.n, e.examples)
    T.eq(row.labelled, e.labelled)
  end
  -- other lengths and examples: the same scorer, the run's passkey options
  local more = eval.evaluate(h.dir, { task = { "passkey" }, lengths = { 64 }, depths = { 0, 1 }, examples = 3 })
  T.eq(#more.records, 2); T.eq(more.records[1].T, 64); T.eq(more.records[2].depth, 1); T.eq(more.records[1].n, 3)
  -- mqar through the run's recall source: D is its num_pairs
  local m = eval.evaluate(h.dir, { task = { "mqar" }, lengths = { 32 }, examples = 4 })
  T.eq(m.records[1].D, 4); T.eq(m.records[1].labelled, 4 * 4)
  T.ok(m.records[1].acc >= 0 and m.records[1].acc <= 1)
end)

T.test("the command line: tables on stdout, -o writes the records (formats.md §5 shape); mistakes are one line", function()
  local d = dense_run()
  local exe = cli.shell_quote(cli.exe_path())
  local out = tmpdir("res", { create = true }) .. "/results.json"
  local p = io.popen(exe .. " eval " .. cli.shell_quote(d.dir) .. " --task val,mqar --lengths 128 --examples 2 -o "
    .. cli.shell_quote(out) .. " 2>&1")
  local text = p:read("*a")
  p:close()
  T.ok(text:find("| val | the run's validation split | 32 | 3 | 384 |", 1, true), "the val table: " .. text)
  T.ok(text:find("| mqar | 128 |", 1, true), "the mqar table")
  local r = json.read(out)
  T.eq(r.step, 24); T.eq(r.kind, "dense"); T.eq(#r.results, 2)
  local v, q = r.results[1], r.results[2]
  T.eq(v.task, "val"); T.eq(v.loss, d.r.val_loss); T.eq(v.config, "dense")
  for _, k in ipairs({ "task", "config", "T", "D", "seed", "acc", "n", "step" }) do T.ok(q[k] ~= nil, "mqar record has " .. k) end
  T.eq(q.T, 128); T.eq(q.D, 16); T.eq(q.n, 2); T.eq(q.seed, 1000003)
  local function one_line(args, want)
    local h = io.popen(exe .. " eval " .. args .. " 2>&1 >/dev/null; echo \"exit=$?\"")
    local lines = {}
    for line in h:lines() do lines[#lines + 1] = line end
    h:close()
    T.eq(#lines, 2, args .. ": " .. table.concat(lines, " | "))
    T.ok(lines[1]:find(want, 1, true), args .. ": '" .. want .. "' in " .. lines[1])
    T.ok(lines[2] ~= "exit=0", args .. ": non-zero exit")
  end
  local dir = cli.shell_quote(d.dir)
  one_line(cli.shell_quote(tmpdir("missing")), "is not a directory")
  one_line(dir .. " --task bogus", "unknown task 'bogus'")
  one_line(dir .. " --task val --depths 0.5", "--depths applies to the passkey task only")
  one_line(dir .. " --task mqar --lengths 32", "too short for num_pairs = 16")
  one_line(dir .. " --data " .. cli.shell_quote(tmpdir("nodata")), "does not exist")
  -- an imported checkpoint has no run config: val needs --data
  local hfdir = tmpdir("hf") .. "/x"
  require("tide.cmd.export").export(d.dir, hfdir)
  local imported = tmpdir("imported")
  require("tide.cmd.import").import(hfdir, imported)
  one_line(cli.shell_quote(imported), "carries no run config (an imported model): give --data PATH")
  local ok = eval.evaluate(imported, { data = "tests/fixtures/tiny_corpus.txt", seq_len = 32, batch_size = 4, batches = 3 })
  T.ok(ok.records[1].loss > 0)
end)

T.run()
