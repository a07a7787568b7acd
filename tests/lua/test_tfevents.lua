-- tfevents: TensorBoard event files (formats.md §7, test oracle 5) — CRC32C and its masking, the two example records
-- byte for byte and parsed back, the writer beside metrics.jsonl (log.open), restarts (a resumed run's new file
-- starts a session at the step after the kept records), and the real tensorboard package's EventAccumulator reading
-- every scalar of a short curriculum run (its final eval rows included), a resume too (needs build/pyenv:
-- scripts/test_deps.sh).
local T = require "tide.testing"
local tide = require "tide"
local ffi = require "ffi"
local json = require "tide.json"
local log = require "tide.log"
local tf = require "tide.tfevents"
local cli = require "tide.cli"
local curriculum = require "tide.curriculum"

local tmpdir = T.tmpdir
local fmt = string.format

local function unhex(s) return (s:gsub("%s+", ""):gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end)) end
local function hex(s) return (s:gsub(".", function(c) return fmt("%02x", c:byte()) end)) end

-- the events.out.tfevents.* files of dir, sorted
local function event_files(dir)
  local n = ffi.new("size_t[1]")
  local raw = tide.C.tide_list_dir(dir, n)
  local out = {}
  if raw == nil then return out end
  local names = ffi.string(raw, n[0])
  tide.C.tide_free(raw)
  for name in names:gmatch("([^%z]+)%z") do
    if name:match("^events%.out%.tfevents%.") then out[#out + 1] = dir .. "/" .. name end
  end
  table.sort(out)
  return out
end

local f32 = ffi.new("float[1]")
local function as_f32(x) f32[0] = x; return f32[0] end

T.test("crc32c: 123456789 and the iSCSI vectors; masking (oracle 5)", function()
  T.eq(tf.crc32c("123456789"), 0xE3069283)
  T.eq(tf.crc32c(""), 0)
  T.eq(tf.crc32c(string.rep("\0", 32)), 0x8A9136AA)
  T.eq(tf.crc32c(string.rep("\255", 32)), 0x62A8AB43)
  local inc = {}
  for i = 0, 31 do inc[#inc + 1] = string.char(i) end
  T.eq(tf.crc32c(table.concat(inc)), 0x46DD794E)
  -- masked(c) = ((c >> 15) | (c << 17)) + 0xA282EAD8 mod 2^32, computed here with plain arithmetic
  for _, c in ipairs({ 0, 1, 0xE3069283, 0xFFFFFFFF, 0x80000000, 0x12345678 }) do
    local rot = (math.floor(c / 2^15) + (c % 2^15) * 2^17) % 2^32
    T.eq(tf.masked_crc(c), (rot + 0xA282EAD8) % 2^32, fmt("masked(0x%08X)", c))
  end
end)

T.test("the two records of §7 byte for byte, parsed back (oracle 5)", function()
  local scalar = tf.event({ wall_time = 1.7e9, step = 1, values = { { "loss", 1.0 } } })
  T.eq(hex(scalar), hex(unhex("09 00 00 00 40 fc 54 d9 41 10 01 2a 0d 0a 0b 0a 04 6c 6f 73 73 15 00 00 80 3f")))
  T.eq(#scalar, 26)
  local rec1 = tf.record(scalar)
  T.eq(hex(rec1), hex(unhex("1a 00 00 00 00 00 00 00 12 9b d8 2d") .. scalar .. unhex("0a 1d db 05")))
  T.eq(#rec1, 42)
  local version = tf.event({ wall_time = 1.7e9, file_version = "brain.Event:2" })
  T.eq(hex(version), hex(unhex("09 00 00 00 40 fc 54 d9 41 1a 0d 62 72 61 69 6e 2e 45 76 65 6e 74 3a 32")))
  local rec2 = tf.record(version)
  T.eq(hex(rec2), hex(unhex("18 00 00 00 00 00 00 00 a3 7f 4b 22") .. version .. unhex("ec ed 8f 9d")))
  T.eq(#rec2, 40)
  local ev = tf.parse(rec2 .. rec1)
  T.eq(#ev, 2)
  T.eq(ev[1].wall_time, 1.7e9)
  T.eq(ev[1].file_version, "brain.Event:2")
  T.eq(ev[1].step, 0)
  T.eq(ev[2].wall_time, 1.7e9)
  T.eq(ev[2].step, 1)
  T.eq(ev[2].values, { { "loss", 1.0 } })
  -- a damaged byte is found by its CRC, a cut file by its length
  local bad = rec2 .. rec1:sub(1, 20) .. "\0" .. rec1:sub(22)
  T.raises(function() tf.parse(bad, "x") end, "tfevents: x: record 2 at byte 40: the data CRC does not match")
  T.raises(function() tf.parse(rec2 .. rec1:sub(1, 30), "x") end, "record 2 at byte 40: 26 data bytes announced")
  T.raises(function() tf.parse("\27" .. rec2:sub(2), "x") end, "record 1 at byte 0: the length CRC does not match")
  -- large and negative steps (int64 varints), non-finite and out-of-range floats, step 0 left out
  local e = tf.parse(tf.record(tf.event({ wall_time = 2.5, step = 2^40 + 3,
    values = { { "a", 0 / 0 }, { "b", math.huge }, { "c", -1e300 }, { "d", 0.1 } } })))[1]
  T.eq(e.step, 2^40 + 3)
  T.ok(e.values[1][2] ~= e.values[1][2], "NaN stays NaN")
  T.eq({ e.values[2][2], e.values[3][2] }, { math.huge, -math.huge })
  T.eq(e.values[4][2], as_f32(0.1))
  T.eq(hex(tf.event({ wall_time = 1, step = -1 })), "09000000000000f03f10ffffffffffffffffff01")
  T.eq(hex(tf.event({ wall_time = 1, step = 0, session_start = true })), "09000000000000f03f3a020801")
end)

T.test("log.open writes an event file beside metrics.jsonl: every number a scalar, lists and strings not", function()
  local dir = tmpdir("log", { create = true })
  local lg = log.open({ path = dir .. "/metrics.jsonl", quiet = true })
  local t0 = tf.now()
  lg:metrics({ step = 1, time = 1, stage = "a", loss = 2.5, lr = 1e-3, skipped = false, ["moe/load/1"] = { 3, 5 },
    ["moe/maxvio_batch/1"] = 0.25 })
  -- on disk as soon as the record is logged (TensorBoard tails the growing file): nothing waits in a buffer
  local now = tf.read(lg.events_path)
  T.eq({ #now, now[#now].step, now[#now].values[1][1] }, { 5, 1, "moe/maxvio_batch/1" }, "step 1's scalars before close")
  lg:metrics({ step = 2, time = 2, loss = 0 / 0, grad_norm = math.huge })
  T.eq(#tf.read(lg.events_path), 7, "step 2's two scalars at once")
  lg:metrics({ step = 2, event = "eval", task = "mqar", acc = 0.5 }, { ["eval/mqar/acc/T64"] = 0.5 })
  lg:metrics({ event = "no step" })                      -- JSONL only
  local path = lg.events_path
  lg:close()
  local files = event_files(dir)
  T.eq(#files, 1)
  T.eq(files[1], path)
  T.ok(path:match("/events%.out%.tfevents%.%d+%.[^/]+$"), path)
  local ev = tf.read(path)
  T.eq(ev[1].file_version, "brain.Event:2")
  T.eq({ ev[2].step, ev[2].session_status }, { 1, 1 })    -- SessionLog START at step 1 (nothing kept before)
  local got = {}
  for i = 3, #ev do
    T.eq(#ev[i].values, 1, "one value per event")
    T.ok(ev[i].wall_time >= t0 - 1 and ev[i].wall_time <= tf.now() + 1, "wall_time is Unix time")
    got[#got + 1] = fmt("%d %s %s", ev[i].step, ev[i].values[1][1], tostring(ev[i].values[1][2]))
  end
  T.eq(got, { "1 loss 2.5", fmt("1 lr %s", tostring(as_f32(1e-3))), "1 moe/maxvio_batch/1 0.25",
    "2 grad_norm inf", "2 loss " .. tostring(as_f32(0 / 0)), "2 eval/mqar/acc/T64 0.5" })
  -- the JSONL has all four lines, the non-finite values as null
  local lines = {}
  for line in io.lines(dir .. "/metrics.jsonl") do lines[#lines + 1] = json.decode(line) end
  T.eq(#lines, 4)
  T.eq(lines[2].nonfinite, { "loss", "grad_norm" })
  -- tensorboard = false writes none
  local d2 = tmpdir("log_off", { create = true })
  log.open({ path = d2 .. "/metrics.jsonl", tensorboard = false }):close()
  T.eq(#event_files(d2), 0)
end)

T.test("a reopened metrics file gets a new event file whose session starts after its last record", function()
  local dir = tmpdir("reopen", { create = true })
  local lg = log.open({ path = dir .. "/metrics.jsonl", quiet = true })
  for s = 1, 5 do lg:metrics({ step = s, loss = s }) end
  local first = lg.events_path
  lg:close()
  local size = tide.C.tide_file_size(first)
  -- FIFOs planted at this second's and the next second's names are never opened (a new name is taken)
  local now = os.time()
  for _, t in ipairs({ now, now + 1 }) do
    for _, suffix in ipairs({ "", ".1", ".2" }) do
      os.execute(fmt("mkfifo '%s/events.out.tfevents.%d.%s%s' 2>/dev/null", dir, t, tf.hostname(), suffix))
    end
  end
  lg = log.open({ path = dir .. "/metrics.jsonl", quiet = true })
  T.ok(lg.events_path ~= first and lg.events_path:match("%.3$"), lg.events_path)
  local fd = tide.C.tide_open_regular(lg.events_path, "events", nil)
  T.ok(fd >= 0, "a regular file")
  ffi.C.close(fd)
  lg:metrics({ step = 6, loss = 6 })
  lg:close()
  T.eq(tide.C.tide_file_size(first), size, "the first file is untouched")
  local ev = tf.read(lg.events_path)
  T.eq({ ev[2].step, ev[2].session_status }, { 6, 1 })
  T.eq({ ev[3].step, ev[3].values[1][1] }, { 6, "loss" })
end)

T.test("a failed append (file-size limit) is an error naming the event file", function()
  local exe = cli.exe_path()
  local dir = tmpdir("efbig", { create = true })
  local script = dir .. "/w.lua"
  local f = io.open(script, "wb")
  f:write(fmt([[return { run = function()
  local w = require("tide.tfevents").open(%q)
  for s = 1, 10000 do w:scalars(s, 1, { { "loss", 1 } }) end
end }]], dir))
  f:close()
  local p = io.popen(fmt("ulimit -f 8; %s run %s 2>&1", cli.shell_quote(exe), cli.shell_quote(script)))
  local out = p:read("*a")
  p:close()
  T.ok(out:find("tfevents: cannot append to '" .. dir .. "/events.out.tfevents.", 1, true) and out:find("File too large"),
    out)
end)

-- the python side: every scalar of the run directory as {tag: [[step, value or "nan"/"inf"/"-inf"], ...]}
local READER = [[
import json, math, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
def v(x):
    return x if math.isfinite(x) else str(x)
print(json.dumps({t: [[s.step, v(s.value)] for s in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
]]

local PY = "build/pyenv/bin/python"
local function tensorboard_scalars(dir)
  if tide.C.tide_path_exists(PY) ~= 1 then
    error("build/pyenv is missing: run scripts/test_deps.sh (it installs the tensorboard package this test reads with)", 0)
  end
  local script = dir .. "/read_events.py"
  local f = io.open(script, "wb")
  f:write(READER)
  f:close()
  local p = io.popen(fmt("%s %s %s 2>&1", PY, cli.shell_quote(script), cli.shell_quote(dir)))
  local out = p:read("*a")
  local ok = p:close()
  local last = out:match("([^\n]*)\n?$")
  local okj, t = pcall(json.decode, last)
  if not okj or type(t) ~= "table" then error("tensorboard's EventAccumulator failed: " .. out, 0) end
  return t
end

-- every (tag, step) -> value the JSONL holds, as TensorBoard should show it (last record wins, as a purge would)
local function jsonl_scalars(path)
  local want = {}
  for line in io.lines(path) do
    local r = json.decode(line)
    if r.event == "eval" then
      -- a task eval row: its accuracy and exact match under eval/<source>/{acc,exact}/<T>[/depth_<d>]
      local results = require "tide.results"
      for _, what in ipairs({ { "acc", r.acc }, { "exact", r.exact } }) do
        local tag = results.eval_tag(r, what[1])
        want[tag] = want[tag] or {}
        want[tag][#want[tag] + 1] = { r.step, what[2] }
      end
    elseif r.event == "moe" then
      -- the expert-load table of the run's end: JSONL only (its numbers are the step records' tags)
    elseif type(r.step) == "number" then
      local nonfinite = {}
      for _, k in ipairs(r.nonfinite or {}) do nonfinite[k] = true end
      for k, v in pairs(r) do
        if k ~= "step" and k ~= "time" and (type(v) == "number" or nonfinite[k]) then
          want[k] = want[k] or {}
          want[k][#want[k] + 1] = { r.step, v }
        end
      end
    end
  end
  return want
end

local function compare(dir)
  local got = tensorboard_scalars(dir)
  local want = jsonl_scalars(dir .. "/metrics.jsonl")
  local tags, points = 0, 0
  for tag, list in pairs(want) do
    local g = got[tag]
    T.ok(g ~= nil, "TensorBoard has tag " .. tag)
    T.eq(#g, #list, "points of " .. tag)
    for i = 2, #g do T.ok(g[i][1] > g[i - 1][1], fmt("%s: one point per step (step %d after %d)", tag, g[i][1], g[i - 1][1])) end
    for i, w in ipairs(list) do
      T.eq(g[i][1], w[1], fmt("%s point %d: step", tag, i))
      if type(w[2]) == "number" then
        T.eq(g[i][2], as_f32(w[2]), fmt("%s at step %d", tag, w[1]))
      end
      points = points + 1
    end
    tags = tags + 1
  end
  for tag in pairs(got) do T.ok(want[tag] ~= nil, "TensorBoard's tag " .. tag .. " is in the JSONL") end
  return tags, points
end

T.test("a run that goes back (a rollback) starts a session there: TensorBoard keeps the later points", function()
  local dir = tmpdir("rollback", { create = true })
  local lg = log.open({ path = dir .. "/metrics.jsonl", quiet = true })
  for s = 1, 5 do lg:metrics({ step = s, loss = s }) end
  lg:metrics({ step = 5, event = "rollback", checkpoint = "ckpt/step_00000002", rollbacks = 1 })
  for s = 3, 6 do lg:metrics({ step = s, loss = 10 + s }) end
  lg:close()
  local starts = {}
  for _, e in ipairs(tf.read(lg.events_path)) do
    if e.session_status then starts[#starts + 1] = e.step end
  end
  T.eq(starts, { 1, 3 })
  local got = tensorboard_scalars(dir)
  T.eq(got.loss, { { 1, 1 }, { 2, 2 }, { 3, 13 }, { 4, 14 }, { 5, 15 }, { 6, 16 } })
  T.eq(#(got.rollbacks or {}), 0, "purged with the abandoned steps (it was logged at step 5)")
end)

local function load(overrides)
  local o = {}
  for k, v in pairs(overrides) do o[#o + 1] = { key = k, text = v } end
  table.sort(o, function(a, b) return a.key < b.key end)
  return cli.load_recipe("tests/fixtures/curriculum_small.lua", o)
end

T.test("tensorboard's EventAccumulator reads every scalar of a curriculum run, a resume included", function()
  local out = tmpdir("run")
  curriculum.train(load({ ["train.out"] = out }))
  local tags, points = compare(out)
  T.ok(tags >= 20 and points >= 18 * 20, fmt("%d tags, %d points", tags, points))
  local got = tensorboard_scalars(out)
  T.eq(#got["eval/passkey/acc/128/depth_0.5"], 1, "the final eval rows are scalars too")
  T.eq(got["eval/passkey/acc/128/depth_0.5"][1][1], 18)
  T.eq(#event_files(out), 1)
  -- resume at step 14: metrics.jsonl keeps steps <= 14, the new event file's session start drops the old 15-18
  local cfg = load({ ["train.out"] = out })
  cfg.resume = out .. "/ckpt/step_00000014"
  curriculum.train(cfg)
  T.eq(#event_files(out), 2)
  local tags2, points2 = compare(out)
  -- the same tags; 3 points fewer: a resume restarts grad_norm_jitter and moe/topk_changed (2 layers) one step late
  T.eq({ tags2, points2 }, { tags, points - 3 }, "the resumed run shows each point once")
end)

T.run()
