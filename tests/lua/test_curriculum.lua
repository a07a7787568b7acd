-- curriculum: tide.Curriculum (spec/long_context.md §2, §6, §7, test oracles 5 and 7) on a three-stage fixture
-- (tests/fixtures/curriculum_small.lua): the stage table and η segments, stage transitions that change the row
-- length, the rows per step and η exactly as written with tokens per step constant, an in-process resume across a
-- stage switch, a process killed with SIGKILL mid-stage and resumed (the same losses bit for bit, the checkpoint
-- left at the kill readable), --stage, --dry-run plans (the shipped recipes included), and config errors.
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local checkpoint = require "tide.checkpoint"
local curriculum = require "tide.curriculum"
local cli = require "tide.cli"

local RECIPE = "tests/fixtures/curriculum_small.lua"
local tmpdir = T.tmpdir     -- removed when T.run ends

local function load(overrides)
  local o = {}
  for k, v in pairs(overrides or {}) do o[#o + 1] = { key = k, text = v } end
  table.sort(o, function(a, b) return a.key < b.key end)
  return cli.load_recipe(RECIPE, o)
end

local function records(path)
  local out = {}
  local f = io.open(path, "rb")
  if not f then return out end
  for line in f:lines() do
    local r = json.decode(line)
    if r.step and not r.event then out[r.step] = r end
  end
  f:close()
  return out
end

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

T.test("stage table: rows, micro-batches, steps; η continuous at every switch (oracle 7)", function()
  local cfg = load()
  local st = curriculum.resolve(cfg)
  T.eq(#st, 3)
  local want = { { 32, 8, 4, 2 }, { 64, 4, 2, 2 }, { 128, 2, 1, 2 } }   -- T, rows/step, rows/micro, micro-batches
  for i, w in ipairs(want) do
    T.eq({ st[i].seq_len, st[i].rows, st[i].micro_rows, st[i].n_micro }, w, "stage " .. i)
    T.eq(st[i].rows * st[i].seq_len, 256, "tokens per step constant")
  end
  -- warmup from 0 to 1e-2 over 2 steps, then constant; linear 1e-2 -> 5e-3; cosine 5e-3 -> 1e-3
  T.near(curriculum.lr_at(st[1], 0), 5e-3, 1e-15)
  T.near(curriculum.lr_at(st[1], 5), 1e-2, 1e-15)
  T.near(curriculum.lr_at(st[2], 0), 1e-2, 1e-15)
  T.near(curriculum.lr_at(st[2], 5), 5e-3, 1e-15)
  T.near(curriculum.lr_at(st[3], 5), 1e-3, 1e-15)
  for i = 1, 2 do
    T.ok(math.abs(curriculum.lr_at(st[i], st[i].steps - 1) - curriculum.lr_at(st[i + 1], 0)) <= 1e-12,
      "η continuous at switch " .. i)
  end
  -- the shipped recipes resolve too, with constant tokens per step and continuous η
  for _, path in ipairs({ "recipes/quickstart.lua", "recipes/long_context_1m.lua" }) do
    local c = curriculum.apply_scale(cli.load_recipe(path, {}))
    local s = curriculum.resolve(c)
    for i = 1, #s - 1 do
      T.eq(s[i].tokens_per_step, s[i + 1].tokens_per_step, path .. ": tokens per step")
      T.ok(math.abs(curriculum.lr_at(s[i], s[i].steps - 1) - curriculum.lr_at(s[i + 1], 0)) <= 1e-12 * s[i].lr.from,
        path .. ": η continuous at switch " .. i)
    end
  end
end)

local full   -- the uninterrupted run, shared by the resume tests
local function full_run()
  if full then return full end
  local out = tmpdir("full")
  local r = curriculum.train(load({ ["train.out"] = out }))
  full = { r = r, out = out, recs = records(out .. "/metrics.jsonl") }
  return full
end

T.test("a checkpoint alone rebuilds its model: checkpoint.load_model gives the trained model's logits bit for bit", function()
  local f = full_run()
  local model, info = checkpoint.load_model(f.out)
  T.eq(info.step, 18, "the latest checkpoint")
  T.eq(info.kind, "hybrid")
  T.eq(info.config.name, load().name, "the run's resolved config rides along")
  T.eq(info.tokenizer.vocab_size, f.r.tokenizer.vocab_size)
  T.eq(info.tokenizer:id("<|endoftext|>"), f.r.tokenizer:id("<|endoftext|>"))
  local ids = {}
  for i = 1, 24 do ids[i] = (i * 37) % 250 end
  local x = tide.tensor(ids, { dtype = "i32" }):reshape({ 1, 24 })
  f.r.model:eval(); model:eval()
  local a, b = f.r.model:forward(x), model:forward(x)
  T.eq(a:shape(), b:shape())
  T.eq((a - b):abs():max():item(), 0, "logits equal")
  T.ok(a:abs():max():item() > 0, "and not all zero")
  -- a step directory works too; a directory without the metadata says what is missing in one line
  local m2 = checkpoint.load_model(info.dir)
  T.ok(m2 ~= nil)
  T.raises(function() checkpoint.load_model(f.out .. "/nope") end, "is not a directory")
end)

T.test("transitions: each step's row length, rows and η are the stage's, as written", function()
  local f = full_run()
  local st = curriculum.resolve(load())
  T.eq(f.r.steps, 18)
  local step = 0
  for _, s in ipairs(st) do
    for k = 0, s.steps - 1 do
      step = step + 1
      local rec = f.recs[step]
      T.ok(rec, "a record for step " .. step)
      T.eq(rec.stage, s.name, "step " .. step)
      T.eq(rec.seq_len, s.seq_len, "step " .. step)
      T.eq(rec.lr, curriculum.lr_at(s, k), "step " .. step)
      T.eq(rec.tokens, step * 256, "step " .. step)
      T.ok(rec.targets > 0 and rec.targets <= 256, "targets " .. tostring(rec.targets))
    end
  end
  T.ok(f.r.final_loss < f.r.losses[1], string.format("the loss falls: %.4f -> %.4f", f.r.losses[1], f.r.final_loss))
  -- a checkpoint at the first step of every stage after the first (the switch), and the final one
  local st2 = checkpoint.open(f.out .. "/ckpt/" .. checkpoint.dir_name(18)).state
  T.eq({ st2.format, st2.driver, st2.curriculum.stage, st2.curriculum.stage_name, st2.curriculum.stage_step },
    { 2, "curriculum", 3, "c", 6 })
  T.ok(#f.r.evals >= 2 and f.r.evals[1].accuracy >= 0, "the passkey eval rows")
end)

T.test("records: every step carries moe/route_entropy/<layer> and grad_norm_jitter, as tide.train's do", function()
  local f = full_run()
  local layers = {}
  for l in pairs(f.r.model:moe_metrics()) do layers[#layers + 1] = l end
  table.sort(layers)
  T.eq(layers, { 0, 1 }, "the fixture's MoE layers")
  for s = 1, f.r.steps do
    local rec = f.recs[s]
    for _, l in ipairs(layers) do
      local h = rec["moe/route_entropy/" .. l]
      T.ok(type(h) == "number" and h >= 0 and h <= 1, string.format("step %d: moe/route_entropy/%d = %s in [0, 1]", s, l,
        tostring(h)))
    end
    local j = rec.grad_norm_jitter
    if s == 1 then
      T.eq(j, nil, "no jitter from one gradient norm")
    else
      T.ok(type(j) == "number" and j >= 0 and j < 10, string.format("step %d: grad_norm_jitter = %s", s, tostring(j)))
    end
  end
  -- the validation MaxVio of every MoE layer at the end of every stage, printed as a table at the end; an expert
  -- takes each token at most once, so MaxVio <= n/k − 1 = 1 here
  T.eq(#f.r.stages, 3)
  for _, st in ipairs(f.r.stages) do
    for _, l in ipairs(layers) do
      local v = st.maxvio_global[l]
      T.ok(type(v) == "number" and v >= 0 and v <= 1 + 1e-12, string.format("stage %s layer %d: val MaxVio %s", st.name,
        l, tostring(v)))
    end
  end
  local tbl = curriculum.maxvio_table(f.r.stages)
  T.ok(tbl:find("| stage | val MaxVio L0 | val MaxVio L1 |", 1, true) and tbl:find("\n| c |", 1, true), tbl)
end)

T.test("val.mix = \"stage\": the stage's own mix over held-out twins of its sources, at every stage end", function()
  local sources = require "tide.data.sources"
  local cfg = load({ ["train.out"] = "" })
  local twins = sources.held_out(cfg.sources, "curriculum")
  T.eq({ twins.text.split, twins.recall.split, twins.passkey.split, twins.passkey.filler_source },
    { "val", "eval", "eval", "text" }, "text val splits, synthetic eval splits, the filler text's twin")
  T.eq(twins.text.order, nil, "the text twin keeps the source's order (shuffled by its seed)")
  T.eq(cfg.sources.text.split, nil, "the recipe's own sources are untouched")
  cfg.val = { mix = "stage", batches = 1 }
  for _, st in ipairs(cfg.stages) do st.steps = 3 end
  local r = curriculum.train(cfg)
  T.eq(#r.stages, 3)
  for _, st in ipairs(r.stages) do
    T.ok(type(st.val_loss) == "number" and st.val_loss > 0 and st.val_loss < 10, st.name .. ": val loss " .. tostring(st.val_loss))
    T.ok(type(st.maxvio_global[0]) == "number" and type(st.maxvio_global[1]) == "number", st.name .. ": val MaxVio per layer")
  end
  local bad = load({ ["train.out"] = "" })
  bad.sources.text.val_fraction = nil
  T.raises(function() sources.held_out(bad.sources, "curriculum") end,
    'curriculum: sources.text has no held-out split for val.mix = "stage" (val_fraction = nil; give it val_fraction > 0)')
  bad.val = { mix = "stage", batchez = 1 }
  T.raises(function() curriculum.train(bad) end, "unknown key 'batchez' in val; known keys: batches, mix, seed")
  -- the layout table is `dist` (the plan's and the runtime's); the old name says so
  local old = load({ ["train.out"] = "" })
  old.parallel = { gpus = 8 }
  T.raises(function() curriculum.train(old) end, "`parallel` is now `dist`")
  T.raises(function() curriculum.plan(old) end, "`parallel` is now `dist`")
  local typo = load({ ["train.out"] = "" })
  typo.dist = { gpu = 8 }
  T.raises(function() curriculum.train(typo) end, "unknown key 'gpu' in dist")
end)

T.test("expect: bounds checked by name and range; every miss is one line naming the stage, layer or length", function()
  local function cfg(ex) local c = load({ ["train.out"] = "" }); c.expect = ex; return c end
  T.raises(function() curriculum.check_expect(cfg({ val_maxvio_below = -1 })) end,
    "curriculum: expect.val_maxvio_below must be a number in [0, inf], got -1")
  T.raises(function() curriculum.check_expect(cfg({ eval_accuracy_above = 80 })) end,
    "curriculum: expect.eval_accuracy_above must be a number in [0, 1], got 80")
  T.raises(function() curriculum.check_expect(cfg({ final_loss_below = "low" })) end,
    "expect.final_loss_below must be a number")
  T.raises(function() curriculum.check_expect(cfg({ maxvio_below = 0.5 })) end,
    "unknown key 'maxvio_below' in expect; known keys: eval_accuracy_above, final_loss_below, val_maxvio_below")
  local c = cfg({ val_maxvio_below = 0.5 })
  c.val = nil
  T.raises(function() curriculum.check_expect(c) end, "expect.val_maxvio_below needs `val`")
  T.raises(function() curriculum.plan(cfg({ val_maxvio_below = "x" })) end, "expect.val_maxvio_below must be a number")
  local r = { final_loss = 1.9, evals = { { task = "mqar", length = 32, accuracy = 0.99 }, { task = "mqar", length = 4096,
    accuracy = 0.75 } }, stages = { { name = "a", maxvio_global = { [1] = 0.2, [2] = 0.3 } },
    { name = "b", maxvio_global = { [1] = 0.61, [2] = 0.1 } }, { name = "c", maxvio_global = {} } } }
  T.eq(curriculum.check_result(cfg({ final_loss_below = 2, eval_accuracy_above = 0.5, val_maxvio_below = 0.7 }),
    { final_loss = 1.9, evals = r.evals, stages = { r.stages[1], r.stages[2] } }), {}, "all met")
  T.eq(curriculum.check_result(cfg({ final_loss_below = 1.5, eval_accuracy_above = 0.8, val_maxvio_below = 0.5 }), r), {
    "final loss 1.9000 is NOT below the expected 1.5000",
    "mqar at length 4096: accuracy 0.750 is NOT above the expected 0.800",
    "stage 'b', MoE layer 1: validation MaxVio 0.610 is NOT below the expected 0.500",
    "stage 'c': no validation MaxVio was measured (no MoE layer routed the val tokens)",
  })
end)

T.test("resume: from a mid-stage checkpoint and across a stage switch, bit-identical losses (oracle 5)", function()
  local f = full_run()
  for _, from in ipairs({ 4, 6, 8 }) do    -- mid stage a; at the a -> b switch; mid stage b
    local out = tmpdir("resume" .. from)
    local cfg = load({ ["train.out"] = out })
    cfg.resume = f.out .. "/ckpt/" .. checkpoint.dir_name(from)
    if tide.C.tide_path_exists(cfg.resume) ~= 1 then
      -- keep_ckpts = 3 removed it: rerun the uninterrupted run's prefix in a fresh directory
      local pre = tmpdir("prefix" .. from)
      local c0 = load({ ["train.out"] = pre, ["train.keep_ckpts"] = "100" })
      curriculum.train(c0)
      cfg.resume = pre .. "/ckpt/" .. checkpoint.dir_name(from)
    end
    local r = curriculum.train(cfg)
    for s = from + 1, 18 do
      T.ok(r.losses[s] == f.r.losses[s], string.format("from %d, step %d: %.17g vs %.17g", from, s, r.losses[s] or -1,
        f.r.losses[s]))
    end
  end
end)

T.test("SIGKILL mid-stage: the checkpoint left is readable and --resume gives the same losses", function()
  local f = full_run()
  local out = tmpdir("killed")
  local exe = cli.exe_path()
  local threads = tide.num_threads()
  local cmd = string.format("TIDE_TEST_STEP_SLEEP=0.05 %s run %s --train.out=%s --threads=%d >/dev/null 2>&1 & echo $!", shell_quote(exe),
    RECIPE, shell_quote(out), threads)
  local p = io.popen(cmd)
  local pid = tonumber(p:read("*l"))
  p:close()
  T.ok(pid, "the child started")
  -- wait until the child is inside stage b (step >= 9, past the checkpoint at 8), then kill it without warning
  local t0, killed_at = tide.time(), nil
  while tide.time() - t0 < 120 do
    local recs = records(out .. "/metrics.jsonl")
    local last = 0
    for s in pairs(recs) do last = math.max(last, s) end
    if last >= 9 then killed_at = last; break end
    os.execute("sleep 0.05")
  end
  os.execute("kill -9 " .. pid .. " 2>/dev/null")
  os.execute("sleep 0.2")
  T.ok(killed_at and killed_at < 18, "killed mid-run at step " .. tostring(killed_at))
  -- the latest checkpoint loads completely: state, weights, optimiser moments
  local dir = checkpoint.resolve(out)
  local st = checkpoint.open(dir).state
  T.ok(st.step >= 8 and st.step <= 18, "latest checkpoint at step " .. st.step)
  local cfg = load({ ["train.out"] = out })
  cfg.resume = true
  local r = curriculum.train(cfg)
  T.eq(r.steps, 18)
  for s = st.step + 1, 18 do
    T.ok(r.losses[s] == f.r.losses[s], string.format("step %d: %.17g vs %.17g", s, r.losses[s] or -1, f.r.losses[s]))
  end
  -- the metrics file holds every step once, and the resumed steps equal the uninterrupted run's
  local recs = records(out .. "/metrics.jsonl")
  for s = 1, 18 do T.ok(recs[s] and recs[s].loss == f.recs[s].loss, "metrics step " .. s) end
end)

T.test("--stage NAME: starts that stage from a checkpoint (or fresh), at its first step", function()
  local f = full_run()
  local out = tmpdir("stage")
  local cfg = load({ ["train.out"] = out })
  cfg.resume = f.out .. "/ckpt/" .. checkpoint.dir_name(18)
  cfg.stage = "b"
  local r = curriculum.train(cfg)
  T.eq(r.steps, 18 + 12, "stages b and c again after the checkpoint's 18 steps")
  local recs = records(out .. "/metrics.jsonl")
  T.eq({ recs[19].stage, recs[19].seq_len, recs[19].lr }, { "b", 64, 1e-2 })
  local out2 = tmpdir("stage-fresh")
  local c2 = load({ ["train.out"] = out2 })
  c2.stage = "c"
  local r2 = curriculum.train(c2)
  T.eq(r2.steps, 6)
  T.raises(function()
    local c3 = load({ ["train.out"] = "" })
    c3.stage = "nope"
    curriculum.train(c3)
  end, "no stage named 'nope'")
end)

T.test("on_stage_start may rewrite its stage: the new mix, steps and η segment are what runs", function()
  local cfg = load({ ["train.out"] = "" })
  local seen = {}
  cfg.stages[3].on_stage_start = function(ctx, stage)
    seen[#seen + 1] = ctx.resumed
    stage.steps = 4
    stage.lr.to = 2e-3
    stage.mix = { recall = 1 }
  end
  local recs = {}
  cfg.hooks.on_step = function(ctx, rec) recs[rec.step] = { rec.stage, rec.lr, ctx.packer:tokens_per_source() } end
  local r = curriculum.train(cfg)
  T.eq(r.steps, 16, "6 + 6 + 4 steps")
  T.eq(seen, { false })
  T.eq(recs[16][1], "c")
  T.near(recs[16][2], 2e-3, 1e-15)
  -- (the first step of stage c still finishes a text document cut at the end of stage b: the carry-over)
  local before, after = recs[13][3], recs[16][3]
  T.eq(after.text, before.text, "stage c draws no new text")
  T.ok(after.recall > before.recall, "stage c draws recall documents")
end)

T.test("gradient accumulation: 1, 2 or 4 micro-batches per step give the same losses (f64, 1e-12)", function()
  local losses = {}
  for i, micro in ipairs({ 256, 128, 64 }) do
    local cfg = load({ ["train.out"] = "", ["micro_tokens"] = tostring(micro) })
    cfg.model.dtype = "f64"
    for _, st in ipairs(cfg.stages) do st.steps = 2; st.lr.warmup = 0 end
    cfg.evals = nil
    local st = curriculum.resolve(cfg)
    T.eq(st[1].n_micro, 256 / micro, "micro-batches in stage a")
    losses[i] = curriculum.train(cfg).losses
  end
  for i = 2, 3 do
    for s = 1, 6 do
      T.ok(math.abs(losses[i][s] - losses[1][s]) <= 1e-12 * math.abs(losses[1][s]),
        string.format("step %d: %.17g vs %.17g", s, losses[i][s], losses[1][s]))
    end
  end
end)

T.test("--dry-run prints the plan: parameters, the stage table, memory per token", function()
  local p = io.popen(shell_quote(cli.exe_path()) .. " run " .. RECIPE .. " --dry-run 2>&1")
  local text = p:read("*a")
  p:close()
  T.ok(text:find("dry run", 1, true), text)
  T.ok(text:find("| a | 32 | 256 | 8 | 2 | 6 |", 1, true), text)
  T.ok(text:find("| c | 128 | 256 | 2 | 2 | 6 |", 1, true), text)
  T.ok(text:find("bytes/token", 1, true), text)
end)

T.test("config errors name the problem", function()
  local function raises(patch, text)
    T.raises(function()
      local cfg = load({ ["train.out"] = "" })
      patch(cfg)
      curriculum.resolve(cfg)
    end, text)
  end
  raises(function(c) c.stages[2].seq_len = 100 end, "not a multiple of seq_len 100")
  raises(function(c) c.stages[1].mix = { nope = 1 } end, "which `sources` does not define")
  raises(function(c) c.stages[1].steps = nil end, "give a stop condition")
  raises(function(c) c.stages[1].bogus = 1 end, "unknown key 'bogus'")
  raises(function(c) c.stages[2].name = "a" end, "used twice")
  raises(function(c) c.stages[1].lr.warmup = 6 end, "lr.warmup")
  T.raises(function() tide.Curriculum{ stagez = {} } end, "unknown key 'stagez'")
  -- the full-scale recipe on this machine: refused before anything is allocated, naming why
  local big = cli.load_recipe("recipes/long_context_1m.lua", {})
  if not tide.cuda_available() then T.raises(function() curriculum.train(big) end, "has no CUDA device") end
  big.model.device, big.model.dtype = "cpu", "f32"
  T.raises(function() curriculum.train(big) end, "more than the")
end)

T.test("--dry-run's layout: memory per rank by dist.zero and the dp bytes per step from dist.step_bytes", function()
  local dist = require "tide.dist"
  local plan = require "tide.nn.plan"
  local function rows(zero)
    local c = cli.load_recipe("recipes/long_context_1m.lua", { { key = "dist.zero", text = tostring(zero) } })
    local text = curriculum.plan(c)
    local out = {}
    for line in text:gmatch("[^\n]+") do
      local name, cp, dp = line:match("^| (S%d_%w+) | %d+ | (%d+) | (%d+) |")
      if name then
        local cells = {}
        for cell in line:gmatch("|([^|]*)") do cells[#cells + 1] = cell:match("^%s*(.-)%s*$") end
        out[name] = { cp = tonumber(cp), dp = tonumber(dp), static = cells[8], fits = cells[10], bytes = cells[11] }
      end
    end
    return out, text, c
  end
  local r3, text, c = rows(3)
  T.ok(text:find("dist.zero = 3 (FSDP (ZeRO-3, planned))", 1, true), text)
  T.ok(r3.S0_8k and r3.S3_1m, "four stage rows")
  -- the bytes column is dist.step_bytes of the parameters a rank holds (dense + experts / ep), fp32 masters
  local mc = c.model
  local count = plan.count(mc)
  local experts = 0
  for _, pl in ipairs(count.per_layer) do if pl.ffn == "moe" then experts = experts + pl.ffn_params end end
  local per_rank = (count.total - experts) + experts / c.dist.ep
  for zero = 0, 3 do
    local rz = rows(zero)
    for name, row in pairs(rz) do
      T.eq(row.bytes, plan.human_bytes(dist.step_bytes(4 * per_rank, row.dp, zero)), name .. " zero " .. zero)
    end
  end
  -- ZeRO-1 divides the moments over dp, ZeRO-2 the gradients too: the static state per rank falls; only FSDP fits
  local r1, r2 = rows(1), rows(2)
  T.eq(r3.S0_8k.fits, "yes")
  T.eq(r1.S0_8k.fits, "NO")
  local function gb(s) local v, u = s:match("^([%d.]+) ([GT])B$"); return tonumber(v) * (u == "T" and 1000 or 1) end
  T.ok(gb(r2.S0_8k.static) < gb(r1.S0_8k.static), r2.S0_8k.static .. " vs " .. r1.S0_8k.static)
  -- the formula: the all-reduce's 2(n-1)/n, the owners' broadcasts, the reduce-scatter
  T.near(dist.step_bytes(100, 4, 0), 150, 1e-12)
  T.near(dist.step_bytes(100, 4, 1), 175, 1e-12)
  T.near(dist.step_bytes(100, 4, 2), 75 + 75 / 4 + 25, 1e-12)
  T.eq(dist.step_bytes(100, 1, 2), 0)
end)

T.test("dist options: each bad value is one line naming the key", function()
  local dist = require "tide.dist"
  local cases = {
    { { bucket_mb = -1 }, "dist.bucket_mb (MB per gradient bucket summed during the backward; 0: none) must be a finite number >= 0, got -1" },
    { { bucket_mb = "big" }, "dist.bucket_mb (MB per gradient bucket summed during the backward; 0: none) must be a finite number >= 0, got big" },
    { { bucket_mb = 1 / 0 }, "must be a finite number >= 0, got inf" },
    { { lanes = 0 }, "dist.lanes" },
    { { lanes = 1.5 }, "dist.lanes" },
    { { zero = 5 }, "dist.zero must be 0 (replicated AdamW state), 1" },
    { { dp = 2 }, "dist.dp = 2 but the job has 1 rank" },
    { { buckets = 4 }, "unknown key 'buckets' in dist" },
  }
  for _, c in ipairs(cases) do T.raises(function() dist.layout(c[1], "curriculum") end, c[2]) end
  local l = dist.layout({ lanes = 3, bucket_mb = 0.5 }, "curriculum")
  T.eq({ l.lanes, l.lane_opts.first, l.lane_opts.count, l.bucket_bytes }, { 3, 0, 3, 524288 }, "one rank hosts every lane")
  -- no bucket_mb: the device's default, chosen by the step (0 on the CPU, dist.BUCKET_MB_DEVICE on a GPU)
  T.eq(dist.layout({ lanes = 3 }, "curriculum").bucket_bytes, nil, "bucket size left to the device")
end)

local _, failed = T.run({ exit = false })
os.exit(failed == 0 and 0 or 1)
