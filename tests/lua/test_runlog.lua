-- runlog: what a run leaves for people to read besides TensorBoard — the progress line (elapsed time and ETA; a live
-- line rewritten with \r on a terminal, plain lines otherwise) of the curriculum and of tide.train, the per-expert
-- loads of every step record (moe/load/<layer>), and the final eval and expert-load tables as JSONL event records
-- and <run>/results.json.
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local log = require "tide.log"
local cli = require "tide.cli"
local curriculum = require "tide.curriculum"

local tmpdir = T.tmpdir
local fmt = string.format
local RECIPE = "tests/fixtures/curriculum_small.lua"

local function load(overrides)
  local o = {}
  for k, v in pairs(overrides) do o[#o + 1] = { key = k, text = v } end
  table.sort(o, function(a, b) return a.key < b.key end)
  return cli.load_recipe(RECIPE, o)
end

local function jsonl(path)
  local out = {}
  for line in io.lines(path) do out[#out + 1] = json.decode(line) end
  return out
end

T.test("progress text: stage, elapsed and ETA; the live line is cut to the terminal width", function()
  T.eq(log.progress_text({ stage = "s128", step = 30, steps = 340, loss = 2.5, lr = 3e-3, tok_per_s = 12345,
    elapsed = 62, eta = 3725 }), "[s128] step 30/340 | loss 2.5000 | lr 3.00e-03 | 12.3k tok/s | elapsed 1m02s | ETA 1h02m")
  local dir = tmpdir("progress", { create = true })
  local f = io.open(dir .. "/out.txt", "wb")
  local lg = log.open({ tty = true, out = f })
  lg.width = 30       -- 29 characters and the cursor
  lg:progress({ step = 1, steps = 10, loss = 1, elapsed = 1, eta = 9 })
  lg:progress({ step = 2, steps = 10, loss = 1, elapsed = 2, eta = 8 })
  lg:line("a message")
  lg:done()
  f:close()
  T.eq(io.open(dir .. "/out.txt", "rb"):read("*a"), "\r\27[Kstep 1/10 | loss 1.0000 | ela\r\27[Kstep 2/10 | loss 1.0000 | ela"
    .. "\r\27[Ka message\n")
end)

-- the curriculum's stdout as a child process (plain lines when stdout is a pipe, or a terminal under script(1))
local function run_child(out, tty)
  local exe = cli.shell_quote(cli.exe_path())
  local cmd = fmt("%s run %s --train.out=%s --train.quiet=false --train.log_every=5", exe, RECIPE, cli.shell_quote(out))
  if tty then cmd = fmt("script -qec %s /dev/null", cli.shell_quote(cmd)) end
  local p = io.popen(cmd .. " 2>&1")
  local text = p:read("*a")
  p:close()
  return text
end

T.test("curriculum progress: plain lines with elapsed and ETA every log_every steps, a live line on a terminal", function()
  local text = run_child(tmpdir("plain"), false)
  local steps = {}
  for line in text:gmatch("[^\n]+") do
    local st, s, eta = line:match("^%[(%a)%] step (%d+)/18 | loss [%d.]+ |.* | elapsed %d+s | ETA (%d+)s$")
    if st then steps[#steps + 1] = st .. s; T.ok(tonumber(eta) < 60, line) end
  end
  T.ok(not text:find("\r", 1, true), "no carriage return in plain lines")
  -- every 5 steps, at each stage end (6, 12, 18) and at the eval of stage a (3)
  T.eq(steps, { "a3", "a5", "a6", "b10", "b12", "c15", "c18" }, text)
  if os.execute("command -v script >/dev/null 2>&1") ~= 0 then
    print("  (script(1) not installed: the terminal half of this test is skipped)")
    return
  end
  local tty = run_child(tmpdir("tty"), true)
  local live = 0
  for s in tty:gmatch("\r\27%[K%[%a%] step (%d+)/18") do live = live + 1 end
  T.ok(live >= 10, fmt("%d live updates: %q", live, tty:sub(1, 400)))
end)

T.test("records carry per-expert loads; the final evals and expert loads are event records and results.json", function()
  local out = tmpdir("results")
  local cfg = load({ ["train.out"] = out })
  local r = curriculum.train(cfg)
  local recs = jsonl(out .. "/metrics.jsonl")
  local steps, evals, moe, stage_ends = 0, {}, {}, 0
  for _, rec in ipairs(recs) do
    if rec.event == nil then
      steps = steps + 1
      for l = 0, 1 do
        local load = rec["moe/load/" .. l]
        T.eq(#load, 4, "4 experts")
        local sum = 0
        for _, v in ipairs(load) do sum = sum + v end
        T.eq(sum, 256 * 2, fmt("step %d layer %d: top-2 of 256 tokens", rec.step, l))
      end
    elseif rec.event == "eval" then evals[#evals + 1] = rec
    elseif rec.event == "moe" then moe[#moe + 1] = rec
    elseif rec.event == "stage_end" then stage_ends = stage_ends + 1 end
  end
  T.eq({ steps, stage_ends }, { 18, 3 })
  T.eq(#evals, 2)
  for i, want in ipairs({ 32, 128 }) do
    local e = evals[i]
    T.eq({ e.step, e.task, e.source, e.T, e.depth, e.n, e.config, e.seed }, { 18, "passkey", "passkey", want, 0.5, 2,
      "curriculum_small", 1000003 })
    T.eq(e.acc, r.evals[i].accuracy)
  end
  -- an mqar row names its key-value pairs as D (the source's num_pairs, as tide eval writes it)
  local mq = require("tide.results").eval_record({ task = "mqar", source = "recall", length = 64, accuracy = 0.5,
    exact = 0.25, examples = 8, labelled = 32, seed = 7 }, 18, cfg)
  T.eq({ mq.event, mq.task, mq.config, mq.T, mq.D, mq.acc, mq.n, mq.seed }, { "eval", "mqar", "curriculum_small", 64, 4, 0.5,
    8, 7 })
  T.eq(require("tide.results").eval_tag(mq), "eval/recall/acc/64")
  T.eq(#moe, 2)
  for i, m in ipairs(moe) do
    local mt = r.moe[i - 1]
    T.eq({ m.layer, m.maxvio_batch, m.dead_experts, m.maxvio_val }, { i - 1, mt.maxvio_batch, mt.dead_experts,
      r.stages[3].maxvio_global[i - 1] })
    T.eq(m.load, mt.load)
  end
  -- results.json: the same rows, the stages with their held-out loss and MaxVio, the run's numbers
  local res = json.read(out .. "/results.json")
  T.eq({ res.name, res.step, res.tokens, #res.stages, #res.evals, #res.moe }, { "curriculum_small", 18, 18 * 256, 3, 2, 2 })
  T.near(res.final_loss, r.final_loss, 1e-15)
  T.eq(res.evals[2].acc, evals[2].acc)
  T.eq(res.moe[2].load, moe[2].load)
  for i, st in ipairs(res.stages) do
    T.eq({ st.name, st.step, st.seq_len, st.steps }, { ({ "a", "b", "c" })[i], 6 * i, 16 * 2 ^ i, 6 })
    T.near(st.val_loss, r.stages[i].val_loss, 1e-15)
    T.eq(st.maxvio_val["1"], r.stages[i].maxvio_global[1])
  end
  T.eq(res.expect_missed, {})
  -- a resume keeps the stages finished before it in results.json (from the stage_end records)
  local cfg2 = load({ ["train.out"] = out })
  cfg2.resume = out .. "/ckpt/step_00000014"
  curriculum.train(cfg2)
  local res2 = json.read(out .. "/results.json")
  T.eq(#res2.stages, 3)
  T.near(res2.stages[1].val_loss, res.stages[1].val_loss, 0)
  T.eq(res2.stages[1].seq_len, nil, "not known to the resumed process")
  T.eq(res2.stages[3].seq_len, 128)
end)

T.run()
