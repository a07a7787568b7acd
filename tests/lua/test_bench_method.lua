-- bench_method: the measuring helpers of tide.results that the benchmarks share — interleaved rounds with the
-- engine order rotating, paired per-round ratios (median, min, max), the machine-idleness probe, the helper
-- process answering JSON commands through a FIFO (its answers, its errors in one line, its end), and the PyTorch
-- builds and settings a baseline runs under.
local T = require "tide.testing"
local tide = require "tide"
local results = require "tide.results"

T.test("interleave: every runner once per round, the order rotating by one; values per runner in round order", function()
  local calls = {}
  local function runner(name, k) return { name, function(round) calls[#calls + 1] = name .. round; return k * round end } end
  local got = results.interleave(3, { runner("a", 1), runner("b", 10), runner("c", 100) }, { wait = false })
  T.eq(table.concat(calls, " "), "a1 b1 c1 b2 c2 a2 c3 a3 b3")
  T.eq(got.values.a, { 1, 2, 3 })
  T.eq(got.values.b, { 10, 20, 30 })
  T.eq(got.values.c, { 100, 200, 300 })
  T.eq(got.order[2], { "b", "c", "a" })
  T.eq(#got.idle, 0, "no idle waits when wait = false")
end)

T.test("paired: per-round ratios, their median and range; ratio_str", function()
  local p = results.paired({ 2, 3, 9, 4 }, { 1, 1, 3, 1 })
  T.eq(p.ratios, { 2, 3, 3, 4 })
  T.eq(p.median, 3)
  T.eq(p.min, 2)
  T.eq(p.max, 4)
  T.eq(p.n, 4)
  T.eq(results.ratio_str(p), "3.00x (2.00-4.00x)")
  T.eq(results.ratio_str(results.paired({}, {})), "-")
  -- pairing is what the rounds buy: a slow round on both sides leaves the ratio alone
  local q = results.paired({ 1.0, 5.0, 1.1 }, { 0.5, 2.5, 0.55 })
  T.near(q.min, 2, 1e-12)
  T.near(q.max, 2, 1e-12)
end)

T.test("cpu_busy and wait_idle: fractions in [0, 1]; a busy machine is waited for until the timeout", function()
  local busy, steal = results.cpu_busy(0.2)
  if busy == nil then print("    (no /proc/stat here: skipped)") return end
  T.ok(busy >= 0 and busy <= 1 and steal >= 0 and steal <= busy + 1e-12, string.format("busy %g steal %g", busy, steal))
  -- max_busy below anything measurable (negative): wait_idle gives up at the timeout and says what it saw
  local t0 = tide.time()
  local w = results.wait_idle({ max_busy = -1, timeout = 0.3, sample = 0.1 })
  local dt = tide.time() - t0
  T.ok(w.waited >= 0.3 and dt < 2, string.format("waited %.2f s (call %.2f s)", w.waited, dt))
  T.ok(w.busy >= 0 and w.busy <= 1, "busy " .. tostring(w.busy))
  -- an idle enough machine (max_busy above 1): no waiting beyond one sample
  local v = results.wait_idle({ max_busy = 2, timeout = 5, sample = 0.1 })
  T.ok(v.waited < 1, string.format("waited %.2f s", v.waited))
end)

T.test("server: JSON commands through a FIFO, one answer line each; an error answer and a dead helper raise one line", function()
  local dir = os.getenv("TMPDIR") or "/tmp"
  -- a shell helper: answers {"n": N+1} to {"n": N}, an error to anything else, and exits on quit
  local script = dir .. "/tide_test_server.sh"
  local f = assert(io.open(script, "w"))
  f:write([[
while read -r line; do
  case "$line" in
    *quit*) echo '{"ok": true}'; exit 0 ;;
    *die*) exit 3 ;;
    *'"n":'*) n=$(echo "$line" | sed 's/.*"n": *\([0-9]*\).*/\1/'); echo "{\"n\": $((n + 1))}" ;;
    *) echo '{"error": "unknown command"}' ;;
  esac
done < "$1"
]])
  f:close()
  local sv = results.server("sh " .. script .. " {fifo}", dir, "tide_test_helper")
  T.eq(sv:ask({ n = 41 }).n, 42)
  T.eq(sv:ask({ n = 1 }).n, 2)
  T.raises(function() sv:ask({ cmd = "other" }) end, "tide_test_helper: unknown command")
  T.eq(sv:ask({ n = 7 }).n, 8, "still answering after an error")
  T.raises(function() sv:ask({ cmd = "die" }) end, "tide_test_helper: the helper process stopped answering (die)")
  sv:close()
  local sv2 = results.server("sh " .. script .. " {fifo}", dir, "tide_test_helper")
  T.eq(sv2:ask({ n = 0 }).n, 1)
  sv2:close()
  local gone = io.open(dir .. "/tide_test_helper.cmd")
  T.ok(gone == nil, "close removes the FIFO")
  if gone then gone:close() end
  os.remove(script)
  os.remove(dir .. "/tide_test_helper.err")
end)

T.test("torch_engines: every interpreter that imports torch, under both OpenMP settings; the others named, one " ..
  "version once", function()
  local dir = os.getenv("TMPDIR") or "/tmp"
  -- fake interpreters: `python -c CODE` prints a version, or fails the way a Python without torch does
  local function fake(name, body)
    local path = dir .. "/tide_test_" .. name
    local f = assert(io.open(path, "w"))
    f:write("#!/bin/sh\n" .. body .. "\n")
    f:close()
    os.execute("chmod +x " .. path)
    return path
  end
  local a = fake("py_a", "echo 1.13.0a0")
  local b = fake("py_b", "echo 2.15.0+cu132")
  -- the same version behind a warning on both streams (an import may print some first)
  local b2 = fake("py_b2", "echo 'UserWarning: something' >&2; echo 'a notice'; echo 2.15.0+cu132")
  local none = fake("py_none", "echo 'ModuleNotFoundError: No module named torch' >&2; exit 1")
  local engines, builds, skipped = results.torch_engines(table.concat({ a, none, b, b2, dir .. "/tide_test_absent" }, ","))
  T.eq(#builds, 2, "two builds (b2 is b's version again, found behind its warnings)")
  T.eq(results.torch_version(b2), "2.15.0+cu132")
  T.eq(builds[1].version, "1.13.0a0")
  T.eq(builds[2].version, "2.15.0+cu132")
  local labels = {}
  for i, e in ipairs(engines) do labels[i] = e.label end
  T.eq(table.concat(labels, "|"), "1.13.0a0 default|1.13.0a0 PASSIVE|2.15.0+cu132 default|2.15.0+cu132 PASSIVE")
  T.eq(engines[2].env, results.TORCH_SETTINGS[2].env, "the PASSIVE engine's environment")
  T.eq(engines[3].python, b)
  T.eq(#skipped, 2, "the interpreter without torch and the missing one")
  T.eq(skipped[1].python, none)
  T.ok(skipped[1].why:find("No module named torch", 1, true), "why: " .. tostring(skipped[1].why))
  -- a Lua list works as the comma-separated string does; an empty list gives nothing
  local e2 = results.torch_engines({ b })
  T.eq(#e2, 2)
  T.eq(#(results.torch_engines("")), 0)
  for _, p in ipairs({ a, b, b2, none }) do os.remove(p) end
end)

T.run()
