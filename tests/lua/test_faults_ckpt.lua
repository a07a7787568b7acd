-- faults in checkpoints and the run directory: a real SIGKILL inside the re-save window (old copy renamed away, new
-- one not yet in place) and inside an interrupted save or a metrics rewrite loses nothing and the next start repairs
-- or reports it; the metrics file, config.json and the logger refuse what is not a regular file; weights made
-- non-finite by the update itself stop the run without a checkpoint of them.
local ffi = require "ffi"
local T = require "tide.testing"
local tide = require "tide"
local checkpoint = require "tide.checkpoint"
local log = require "tide.log"
local train = require "tide.train"
local cli = require "tide.cli"
local C = tide.C

local FIXTURE = "tests/fixtures/tiny_corpus.txt"
local tmpdir = T.tmpdir     -- removed when T.run ends

-- the text of a config for a 1-layer model on the fixture; `train` and `extra` are spliced into it
local function cfg_text(out, train_fields, extra)
  return string.format([[{ model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 320 },
    data = { path = %q, doc_separator = "%%", seq_len = 16, batch_size = 2 }, optim = { lr = 3e-3 },
    train = { seed = 1, quiet = true, log_every = 1000, keep_ckpts = 5, out = %q, %s }%s }]],
    FIXTURE, out, train_fields, extra or "")
end

local function cfg(out, train_fields, extra)
  return assert(loadstring("return " .. cfg_text(out, train_fields, extra)))()
end

-- runs the config in a fresh `tide` process with TIDE_TEST_CKPT_KILL=point (and a shell prefix, e.g. a ulimit);
-- returns the exit status and output
local function run_killed(point, text, prefix)
  local dir = tmpdir("recipe", { create = true })
  local recipe = dir .. "/recipe.lua"
  local f = assert(io.open(recipe, "wb"))
  f:write("return { run = function() return require('tide.train').run(", text, ") end }\n")
  f:close()
  local p = io.popen((prefix or "") .. "TIDE_TEST_CKPT_KILL=" .. point .. " timeout 60 '" .. cli.exe_path() .. "' run '" .. recipe
    .. "' 2>&1; echo \"__exit=$?\"")
  local out = p:read("*a")
  p:close()
  return tonumber(out:match("__exit=(%d+)")), out
end

local function read(path)
  local s = tide.read_file(path)
  return s
end

local function exists(path) return C.tide_path_exists(path) == 1 end

local function weights(model)
  local out = {}
  for name, t in pairs(model:state_dict()) do out[name] = t:tolist() end
  return out
end

T.test("SIGKILL between the two renames of a re-save: latest is repaired from the complete copy, resume is exact", function()
  local out = tmpdir("swap")
  local a = train(cfg(out, "steps = 6, ckpt_every = 3"))
  local step6 = out .. "/ckpt/" .. checkpoint.dir_name(6)
  local step3 = out .. "/ckpt/" .. checkpoint.dir_name(3)
  T.eq(read(out .. "/ckpt/latest"), checkpoint.dir_name(6) .. "\n")
  -- resuming from step 3 reaches step 6 again, whose directory exists: the save swaps, and is killed in between
  local rc, text = run_killed("swap", cfg_text(out, "steps = 6, ckpt_every = 3", string.format(", resume = %q", step3)))
  T.eq(rc, 137, "killed by SIGKILL:\n" .. text)
  T.ok(not exists(step6), "the old copy was renamed away")
  T.ok(exists(step6 .. ".old/state.json") and exists(step6 .. ".tmp/state.json"), "both complete copies are left")
  T.eq(read(out .. "/ckpt/latest"), checkpoint.dir_name(6) .. "\n", "latest names the missing directory")
  -- the next start puts the new copy in place and removes the old one, one line each
  local notes = checkpoint.recover(out)
  T.eq(#notes, 2, table.concat(notes, "\n"))
  T.ok(notes[1]:find("removed " .. step6 .. ".old", 1, true), notes[1])
  T.ok(notes[2]:find("restored " .. step6 .. " from " .. step6 .. ".tmp", 1, true), notes[2])
  T.ok(exists(step6 .. "/state.json") and not exists(step6 .. ".tmp") and not exists(step6 .. ".old"))
  T.eq(checkpoint.latest(out), step6)
  -- the repaired checkpoint holds the first run's final weights, and the run resumes from it
  local m = require("tide.nn").build(cfg(out, "steps = 6").model)
  checkpoint.load(step6, { model = m })
  T.eq(weights(m), weights(a.model), "step 6 as the first run left it")
  local b = train(cfg(out, "steps = 6, ckpt_every = 3", string.format(", resume = %q", step3)))
  for s = 4, 6 do T.ok(b.losses[s] == a.losses[s], string.format("step %d: %.17g vs %.17g", s, b.losses[s], a.losses[s])) end
  local c = train(cfg(out, "steps = 7", ", resume = true"))
  T.eq(c.steps, 7, "resumed from the run directory")
end)

T.test("a kill inside a save (only the .tmp is touched); latest naming a lost directory says what to do", function()
  local out = tmpdir("tmpkill")
  train(cfg(out, "steps = 3, ckpt_every = 3"))
  local step3 = out .. "/ckpt/" .. checkpoint.dir_name(3)
  local step6 = out .. "/ckpt/" .. checkpoint.dir_name(6)
  local rc, text = run_killed("tmp", cfg_text(out, "steps = 6, ckpt_every = 3", ", resume = true"))
  T.eq(rc, 137, "killed by SIGKILL:\n" .. text)
  T.ok(exists(step6 .. ".tmp/model.safetensors") and not exists(step6 .. ".tmp/state.json"), "a half-written .tmp")
  T.eq(checkpoint.latest(out), step3, "latest still names the last complete checkpoint")
  -- the next run reports and removes it, and resumes from step 3
  local r = train(cfg(out, "steps = 6, ckpt_every = 3", ", resume = true"))
  T.eq(r.steps, 6)
  T.ok(not exists(step6 .. ".tmp") and exists(step6 .. "/state.json"))
  local notes = checkpoint.recover(out)
  T.eq(#notes, 0, "nothing left to repair")
  -- nothing to recover from: one line naming latest, the missing directory and the ones left
  T.eq(C.tide_remove_tree(step6), 0)
  T.raises(function() checkpoint.latest(out) end,
    "checkpoint: " .. out .. "/ckpt/latest names step_00000006, which is missing, and no complete copy of it is left; "
    .. "resume from one of the others (--resume=" .. step3 .. "): step_00000003")
end)

T.test("SIGKILL while metrics.jsonl is truncated on resume: the old history is whole, the next resume rewrites it", function()
  local out = tmpdir("metrics")
  train(cfg(out, "steps = 6, ckpt_every = 3"))
  local path = out .. "/metrics.jsonl"
  local before = read(path)
  local _, n = before:gsub("\n", "")
  T.eq(n, 6, "one record per step")
  local step3 = out .. "/ckpt/" .. checkpoint.dir_name(3)
  local rc, text = run_killed("metrics", cfg_text(out, "steps = 6, ckpt_every = 3", string.format(", resume = %q", step3)))
  T.eq(rc, 137, "killed by SIGKILL:\n" .. text)
  T.eq(read(path), before, "metrics.jsonl is untouched")
  train(cfg(out, "steps = 6, ckpt_every = 3", string.format(", resume = %q", step3)))
  local steps = {}
  for line in read(path):gmatch("[^\n]+") do steps[#steps + 1] = tonumber(line:match('^{"step":(%d+)')) end
  T.eq(steps, { 1, 2, 3, 4, 5, 6 }, "steps 1-3 kept, 4-6 written again")
end)

T.test("metrics.jsonl and config.json: a FIFO or a directory is refused (or replaced) without blocking", function()
  local dir = tmpdir("fifo-log", { create = true })
  local fifo = dir .. "/metrics.jsonl"
  T.ok(os.execute("mkfifo '" .. fifo .. "'") == 0)
  T.raises(function() log.open({ path = fifo }) end, "log: metrics file '" .. fifo .. "' is a FIFO (named pipe), not a regular file")
  T.eq(C.tide_mkdir_p(dir .. "/d"), 0)
  T.raises(function() log.open({ path = dir .. "/d" }) end, "is a directory, not a regular file")
  -- a resume reads the metrics through the regular-file check
  local out = tmpdir("fifo-resume")
  train(cfg(out, "steps = 2, ckpt_every = 2"))
  T.ok(os.remove(out .. "/metrics.jsonl"))
  T.ok(os.execute("mkfifo '" .. out .. "/metrics.jsonl'") == 0)
  T.raises(function() train(cfg(out, "steps = 3", ", resume = true")) end, "is a FIFO (named pipe), not a regular file")
  -- config.json is written atomically: a FIFO in its place is replaced, never opened
  local fresh = tmpdir("fifo-config", { create = true })
  T.ok(os.execute("mkfifo '" .. fresh .. "/config.json'") == 0)
  train(cfg(fresh, "steps = 1"))
  T.ok(read(fresh .. "/config.json"):find('"steps":1', 1, true), "config.json is a regular file with the config")
end)

T.test("a file-size limit (ulimit -f, SIGXFSZ) is a clear error like a full disk: no .tmp left, the last checkpoint kept", function()
  local out = tmpdir("fsize")
  train(cfg(out, "steps = 2, ckpt_every = 2"))
  local step2 = out .. "/ckpt/" .. checkpoint.dir_name(2)
  local size = tonumber(C.tide_file_size(step2 .. "/model.safetensors"))
  T.ok(size > 8192, "model.safetensors has " .. tostring(size) .. " bytes")
  -- a limit below the weights' file (ulimit -f counts KiB blocks) but above the metrics and config
  local rc, text = run_killed("none", cfg_text(out, "steps = 4, ckpt_every = 2", ", resume = true"),
    string.format("ulimit -f %d; ", math.floor(size / 1024 / 2)))
  T.eq(rc, 1, "an error, not a signal:\n" .. text)
  T.ok(text:find("File too large", 1, true) and text:find("model.safetensors", 1, true), text)
  local step4 = out .. "/ckpt/" .. checkpoint.dir_name(4)
  T.ok(not exists(step4 .. ".tmp") and not exists(step4), "no half-written step_4.tmp")
  T.eq(checkpoint.latest(out), step2)
  local r = train(cfg(out, "steps = 4, ckpt_every = 2", ", resume = true"))
  T.eq(r.steps, 4, "the run resumes from step 2")
end)

T.test("a hostile state.json: each mutation is refused in one line naming the file and the field", function()
  local json = require "tide.json"
  local out = tmpdir("schema")
  train(cfg(out, "steps = 3, ckpt_every = 3"))
  local dir = out .. "/ckpt/" .. checkpoint.dir_name(3)
  local path = dir .. "/state.json"
  local original = read(path)
  local cases = {
    { "data.train.cursor", function(s) s.data.train.cursor = -3 end, "an integer from 0 to the step (3)", "-3" },
    { "data.train.cursor", function(s) s.data.train.cursor = 1e15 end, "an integer from 0 to the step (3)", "1000000000000000" },
    { "data.train.cursor", function(s) s.data.train.cursor = "7" end, "an integer from 0 to the step (3)", '"7"' },
    { "data.train", function(s) s.data.train = "x" end, "a table", '"x"' },
    { "data", function(s) s.data = 3 end, "a table", "3" },
    { "step", function(s) s.step = 2.5 end, "a non-negative integer", "2.5" },
    { "step", function(s) s.step = nil end, "a non-negative integer", "nothing (the field is missing)" },
    { "schedule.step", function(s) s.schedule.step = 2.5 end, "a non-negative integer", "2.5" },
    { "schedule.step", function(s) s.schedule.step = 2 end, nil, "2" },
    { "schedule", function(s) s.schedule = nil end, "a table", "nothing (the field is missing)" },
    { "rng", function(s) s.rng = "abc" end, "a table", '"abc"' },
    { "rng.seed", function(s) s.rng.seed = -1 end, "an unsigned 64-bit integer (decimal digits)", "-1" },
    { "rng.offset", function(s) s.rng.offset = "99999999999999999999" end, "an unsigned 64-bit integer (decimal digits)", '"99999999999999999999"' },
    { "rng.offset", function(s) s.rng.offset = nil end, "an unsigned 64-bit integer (decimal digits)", "nothing (the field is missing)" },
    { "optim", function(s) s.optim = nil end, "a table", "nothing (the field is missing)" },
    { "optim.t", function(s) s.optim.t = "3" end, "a non-negative integer", '"3"' },
    { "optim.kind", function(s) s.optim.kind = 5 end, "a string", "5" },
    { "tokens", function(s) s.tokens = -1 end, "a non-negative integer", "-1" },
    { "skipped", function(s) s.skipped = 1.5 end, "a non-negative integer", "1.5" },
    { "threads", function(s) s.threads = 0 end, "a positive integer", "0" },
    { "moe", function(s) s.moe = 5 end, "a list", "5" },
    { "moe[1]", function(s) s.moe = { 5 } end, "a table", "5" },
    { "tokenizer.vocab_size", function(s) s.tokenizer = { vocab_size = "320" } end, "a positive integer", '"320"' },
    { "driver", function(s) s.driver = 7 end, '"train", "curriculum" or "rl"', "7" },
    { "curriculum.stage", function(s) s.curriculum = { stage = 0 } end, "a positive integer", "0" },
  }
  for _, case in ipairs(cases) do
    local field, mutate, what, got = case[1], case[2], case[3], case[4]
    local st = json.decode(original)
    mutate(st)
    T.eq(C.tide_file_write_text_atomic(path, json.encode(st)), 0)
    local ok, err = pcall(train, cfg(out, "steps = 4", string.format(", resume = %q", dir)))
    err = tostring(err)
    local want = what and string.format("checkpoint: %s: field '%s' must be %s, got %s", path, field, what, got)
      or string.format("checkpoint: %s: field '%s' must equal field 'step' (3), got %s", path, field, got)
    T.ok(not ok and err:find(want, 1, true), field .. ": expected\n  " .. want .. "\ngot\n  " .. err)
    T.ok(not err:find("\n", 1, true), field .. ": one line")
  end
  -- not an object at all
  T.eq(C.tide_file_write_text_atomic(path, "3"), 0)
  T.raises(function() train(cfg(out, "steps = 4", string.format(", resume = %q", dir))) end,
    "checkpoint: " .. path .. ": expected a JSON object, got 3")
  -- the original still resumes
  T.eq(C.tide_file_write_text_atomic(path, original), 0)
  T.eq(train(cfg(out, "steps = 4", string.format(", resume = %q", dir))).steps, 4)
end)

-- every weight of every checkpoint under out is finite
local function checkpoints_finite(out)
  for _, name in ipairs(checkpoint.list(out)) do
    local r = checkpoint.open(out .. "/ckpt/" .. name)
    for tname, t in pairs(r:tensors("model.safetensors")) do
      if not t:all_finite() then r:close(); return false, name .. " " .. tname end
    end
    r:close()
  end
  return true
end

T.test("an update that makes the weights non-finite (lr 1e300 in f32) stops the run; no checkpoint holds them", function()
  for _, policy in ipairs({ "skip", "stop" }) do
    local out = tmpdir("poison-" .. policy)
    local c = cfg(out, "steps = 4, ckpt_every = 1", string.format(", on_nonfinite = %q", policy))
    c.optim.lr = 1e300
    local r = train(c)
    T.ok(r.stopped and r.stopped:find("stopped at step 1: non-finite weight ", 1, true), policy .. ": " .. tostring(r.stopped))
    T.eq(#checkpoint.list(out), 0, policy .. ": nothing saved")
    c.overwrite = true   -- the same run again, into its own directory
    T.eq(train.run(c), 1, policy .. ": the run exits 1")
  end
  -- with a good checkpoint the skip policy rolls back twice, then stops; the checkpoints stay finite
  local out = tmpdir("poison-rollback")
  local c = cfg(out, "steps = 2, ckpt_every = 1")
  train(c)
  c.train.steps, c.resume, c.optim.lr = 6, true, 1e300
  local r = train(c)
  T.ok(r.stopped and r.stopped:find("after 2 rollbacks; first non-finite tensor: weight ", 1, true), tostring(r.stopped))
  T.eq(r.rollbacks, 2)
  T.eq(checkpoint.latest(out), out .. "/ckpt/" .. checkpoint.dir_name(2))
  local ok, where = checkpoints_finite(out)
  T.ok(ok, "a checkpoint holds a non-finite weight: " .. tostring(where))
end)

T.test("an update that makes only AdamW's v non-finite (a 1e30 gradient, no clipping) stops the run naming the state", function()
  for _, policy in ipairs({ "skip", "stop" }) do
    local out = tmpdir("poison-v-" .. policy)
    local c = cfg(out, "steps = 3, ckpt_every = 1", string.format(", on_nonfinite = %q", policy))
    c.optim.clip = false
    c.loss = function(m, x, y, t)
      if t == 0 then   -- backward adds into it: |g| ~ 1e30 is finite, g^2 stored as f32 is not
        local w = m.model.norm.weight
        w:set_grad(tide.zeros_like(w):fill_(1e30))
      end
      return m:loss(x, y)
    end
    local r = train(c)
    T.ok(r.stopped and r.stopped:find("stopped at step 1: non-finite AdamW state model.norm.weight.adam_v", 1, true),
      policy .. ": " .. tostring(r.stopped))
    T.eq(#checkpoint.list(out), 0, policy .. ": nothing saved")
  end
end)

T.test("a clean run reads no weight again after the update: the finite check is AdamW's own flag", function()
  local optim = require "tide.optim"
  local orig, calls = optim.first_nonfinite_of, 0
  optim.first_nonfinite_of = function(...) calls = calls + 1; return orig(...) end
  local ok, err = pcall(function()
    local r = train(cfg(tmpdir("clean-guard"), "steps = 3"))
    T.eq({ r.steps_run, r.skipped, calls }, { 3, 0, 0 }, "three clean steps, no per-tensor pass")
    local c = cfg(tmpdir("poison-guard"), "steps = 3", ", on_nonfinite = 'stop'")
    c.optim.lr = 1e300
    r = train(c)
    T.ok(calls >= 1 and r.stopped and r.stopped:find("non-finite weight ", 1, true), "the failure path locates it")
  end)
  optim.first_nonfinite_of = orig
  if not ok then error(err, 0) end
end)

local _, failed = T.run({ exit = false })
os.exit(failed > 0 and 1 or 0)
