-- The `tide` command line, run as a child process: info, recipe errors with file:line, overrides,
-- and the test runner's aggregation.
local T = require "tide.testing"
local cli = require "tide.cli"

local exe = cli.exe_path()
local tmpdir = os.tmpname()
os.remove(tmpdir)
assert(os.execute("mkdir -p '" .. tmpdir .. "'") == 0, "cannot create " .. tmpdir)

local function write(name, text)
  local path = tmpdir .. "/" .. name
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

-- runs `tide ARGS`; returns output (stdout + stderr) and exit code
local function tide_cmd(args, env)
  local p = io.popen((env or "") .. " '" .. exe .. "' " .. args .. " 2>&1; echo \"__exit=$?\"")
  local out = p:read("*a")
  p:close()
  local code = tonumber(out:match("__exit=(%d+)%s*$"))
  return out:gsub("__exit=%d+%s*$", ""), code
end

local function contains(out, text)
  T.ok(out:find(text, 1, true), "expected output to contain '" .. text .. "', got:\n" .. out)
end

T.test("the test runs inside the tide executable", function()
  T.ok(exe and exe:match("/tide$"), "exe path: " .. tostring(exe))
end)

T.test("tide info prints the build summary", function()
  local out, code = tide_cmd("info")
  T.eq(code, 0, out)
  contains(out, "tide " .. require("tide").version)
  contains(out, "blas")
  contains(out, "cuda")
  contains(out, "GC64")
  T.ok(out:match("build     %a+[^\n]*, commit %x+"), "build type and commit:\n" .. out)
  T.ok(out:match("memory    [%d.]+ GiB RAM %([%d.]+ GiB available%); engine %d+ B in use"), "memory:\n" .. out)
  contains(tide_cmd("help"), "info                          version, build type and commit, threads, BLAS, CUDA, MPI, LuaJIT, memory")
end)

T.test("the executable's start-up environment: OpenBLAS kernels that fit the CPU, the user's choices kept", function()
  -- a fresh start (the test runner's own environment has both already set)
  local fresh = "env -u TIDE_NO_REEXEC -u OPENBLAS_CORETYPE -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT"
  local function core_of(out) return out:match("blas%s+OpenBLAS [%d.]+ (%S+)") end
  local out, code = tide_cmd("info", fresh)
  T.eq(code, 0, out)
  local core = core_of(out)
  T.ok(core, "a blas line naming the core:\n" .. out)
  local f = io.open("/proc/cpuinfo")
  local flags = f and (f:read("*a"):match("\nflags%s*:([^\n]*)") or "") or ""
  if f then f:close() end
  local function has(x) return flags:find(" " .. x .. " ", 1, true) or flags:find(" " .. x .. "$") end
  local generic = { Prescott = true, Core2 = true, Penryn = true, Dunnington = true, Nehalem = true }
  if has("avx2") and has("fma") then
    T.ok(not generic[core], "an AVX2 CPU runs OpenBLAS's generic kernels: " .. core)
  end
  -- tide info says when the kernels are the executable's choice, and over what
  local said = out:match("OPENBLAS_CORETYPE=(%S+) set at start: OpenBLAS had fallen back to (%S+) on this CPU")
  if said then T.eq(said, core, out) end
  -- an OPENBLAS_CORETYPE of the user's stands
  out, code = tide_cmd("info", fresh .. " OPENBLAS_CORETYPE=Prescott")
  T.eq(code, 0, out)
  T.eq(core_of(out), "Prescott", out)
  T.ok(not out:find("set at start", 1, true), "the user's own OPENBLAS_CORETYPE reported as the executable's:\n" .. out)
  -- as do the user's OpenMP settings, whether or not the executable starts again for the BLAS kernels
  local probe = write("env_probe.lua", "print('env', os.getenv('OMP_WAIT_POLICY'), os.getenv('GOMP_SPINCOUNT'))\nos.exit(0)\n")
  out = tide_cmd("run " .. probe, fresh .. " OMP_WAIT_POLICY=ACTIVE")
  contains(out, "env\tACTIVE\tnil")
  out = tide_cmd("run " .. probe, fresh)
  contains(out, "env\tPASSIVE\tnil")   -- ours: the short spin read at load, then left out of the children's
  -- the started-again process keeps its name (ps, top, perf)
  local comm = write("comm_probe.lua", "local f = io.open('/proc/self/comm')\nprint('comm', f and f:read('*l'))\nos.exit(0)\n")
  contains(tide_cmd("run " .. comm, fresh), "comm\ttide")
end)

T.test("require 'tide' works from a plain luajit with the library path set", function()
  local root = exe:gsub("/[^/]*/tide$", "")            -- <repo>/build/tide -> <repo>
  local lib = exe:gsub("/tide$", "/libtide.so")
  local script = write("plain.lua", [[
local tide = require "tide"
local x = tide.tensor({1, 2, 3}, {dtype = "f64", requires_grad = true})
local y = (x * x):sum()
y:backward()
print(string.format("plain %g %g", y:item(), x:grad():totable()[3]))
]])
  local cmd = "LUA_PATH='" .. root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;;' TIDE_LIB='" .. lib ..
              "' luajit '" .. script .. "' 2>&1"
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  contains(out, "plain 14 6")
  -- without OPENBLAS_CORETYPE, on a CPU whose model OpenBLAS does not know, the plain luajit says what to export
  local p2 = io.popen("env -u OPENBLAS_CORETYPE " .. cmd)
  local out2 = p2:read("*a")
  p2:close()
  contains(out2, "plain 14 6")
  local fresh = tide_cmd("info", "env -u TIDE_NO_REEXEC -u OPENBLAS_CORETYPE")
  local want = fresh:match("OPENBLAS_CORETYPE=(%S+) set at start")
  if want then
    contains(out2, "tide: OpenBLAS runs its generic kernels on this CPU")
    contains(out2, "export OPENBLAS_CORETYPE=" .. want .. " before starting luajit")
  else
    T.ok(not out2:find("generic kernels", 1, true), "a hint where OpenBLAS chose its own kernels:\n" .. out2)
  end
  T.ok(not out:find("generic kernels", 1, true), "a hint with OPENBLAS_CORETYPE set:\n" .. out)
end)

T.test("a recipe with a syntax error reports file:line", function()
  local path = write("syntax.lua", "return {\n  model = {dim = },\n}\n")
  local out, code = tide_cmd("run " .. path)
  T.eq(code, 1, out)
  contains(out, "tide: " .. path .. ":2:")
end)

T.test("a recipe failing while it loads reports file:line", function()
  local path = write("load_error.lua", "local cfg = {}\nlocal n = nil\nreturn {x = n + 1}\n")
  local out, code = tide_cmd("run " .. path)
  T.eq(code, 1, out)
  contains(out, path .. ":3: attempt to perform arithmetic")
end)

T.test("a recipe failing in cfg.run reports file:line", function()
  local path = write("run_error.lua", [[
return {
  steps = 2,
  run = function(cfg)
    error("stage exploded at step " .. cfg.steps)
  end,
}
]])
  local out, code = tide_cmd("run " .. path)
  T.eq(code, 1, out)
  contains(out, path .. ":4: stage exploded at step 2")
end)

T.test("--profile[=N]: the run's ops that took the most time, after the run; a bad N is one clear line", function()
  local path = write("profiled.lua", [[
local tide = require "tide"
return {
  run = function()
    local x = tide.randn({8, 4}, {requires_grad = true})
    local w = tide.randn({3, 4}, {requires_grad = true})
    tide.F.linear(x, w):sum():backward()
    print("ran")
    return 0
  end,
}
]])
  local out, code = tide_cmd("run " .. path .. " --profile=2")
  T.eq(code, 0, out)
  T.ok(out:find("ran\nprofile (--profile): the 2 ops that took the most time\n", 1, true), out)
  T.ok(out:find("\nlinear%s+[%d.]+%s+[%d.]+%%%s+[%d.]+ %(%s*1%)%s+[%d.]+ %(%s*1%)"), "linear's forward and backward, once each:\n" .. out)
  T.ok(out:match("ops [%d.]+ ms of [%d.]+ ms wall %(2 ops listed of %d+%)"), out)
  out, code = tide_cmd("run " .. path .. " --profile")
  T.eq(code, 0, out)
  contains(out, "the 25 ops that took the most time")
  out, code = tide_cmd("run " .. path)
  T.ok(not out:find("profile", 1, true), out)
  out, code = tide_cmd("run " .. path .. " --profile=0")
  T.eq(code, 1, out)
  contains(out, "--profile must be a positive integer")
end)

T.test("a tensor error in a recipe points at the recipe's line", function()
  local path = write("tensor_error.lua", [[
local tide = require "tide"
return {
  run = function()
    local a = tide.zeros({4, 64})
    local b = tide.zeros({32, 16})
    return a:matmul(b):sum():item()
  end,
}
]])
  local out, code = tide_cmd("run " .. path)
  T.eq(code, 1, out)
  contains(out, path .. ":6: matmul: a is [4, 64] but b is [32, 16]")
end)

local overrides = [[
return {
  model = {dim = 4, n_layers = 2, name = "tiny"},
  stages = {{steps = 10}, {steps = 20}},
  lr = 0.001,
  compile = false,
  run = function(cfg)
    print(string.format("dim=%s layers=%s name=%s lr=%s compile=%s steps2=%s resume=%s seed=%s",
      cfg.model.dim, cfg.model.n_layers, cfg.model.name, cfg.lr, tostring(cfg.compile),
      cfg.stages[2].steps, tostring(cfg.resume), tostring(cfg.seed)))
  end,
}
]]

T.test("--a.b=value overrides recipe fields with typed values", function()
  local path = write("overrides.lua", overrides)
  local out, code = tide_cmd("run " .. path .. " --model.dim=512 --model.name=big --lr=3e-4 --compile=true"
                             .. " --stages.2.steps=7 --resume --seed=42")
  T.eq(code, 0, out)
  contains(out, "dim=512 layers=2 name=big lr=0.0003 compile=true steps2=7 resume=true seed=42")
end)

T.test("an unknown recipe key is an error naming the key and the known ones", function()
  local path = write("overrides.lua", overrides)
  local out, code = tide_cmd("run " .. path .. " --model.dimm=8")
  T.eq(code, 1, out)
  contains(out, "unknown recipe key 'model.dimm'")
  contains(out, "did you mean 'model.dim'?")
  contains(out, "known keys at model: device, dim, dtype")   -- the recipe's keys and the model schema's
  contains(out, "n_layers, name, norm")
  local out2, code2 = tide_cmd("run " .. path .. " --optimizer.lr=1")
  T.eq(code2, 1, out2)
  contains(out2, "unknown recipe key 'optimizer.lr'")
  local out3, code3 = tide_cmd("run " .. path .. " --model.dim=big")
  T.eq(code3, 1, out3)
  contains(out3, "recipe key 'model.dim' is a number, got 'big'")
end)

T.test("--dry-run prints the patched config and runs nothing", function()
  local path = write("overrides.lua", overrides)
  local out, code = tide_cmd("run " .. path .. " --dry-run --model.dim=16")
  T.eq(code, 0, out)
  contains(out, "dim = 16,")
  contains(out, "dry_run = true,")
  T.ok(not out:find("layers=", 1, true), "cfg.run was not called:\n" .. out)
end)

T.test("a missing recipe file is a clear error", function()
  local out, code = tide_cmd("run " .. tmpdir .. "/no_such_recipe.lua")
  T.eq(code, 1, out)
  contains(out, "cannot open recipe '" .. tmpdir .. "/no_such_recipe.lua': No such file or directory")
  local out2, code2 = tide_cmd("run")         -- no recipe: the usage and the shipped recipes
  T.eq(code2, 0, out2)
  contains(out2, "usage: tide run RECIPE")
end)

T.test("a recipe that returns no table is an error", function()
  local path = write("no_table.lua", "local x = 1\n")
  local out, code = tide_cmd("run " .. path)
  T.eq(code, 1, out)
  contains(out, "must return a config table, got nil")
end)

T.test("unknown commands are errors", function()
  local out, code = tide_cmd("frobnicate")
  T.eq(code, 1, out)
  contains(out, "unknown command 'frobnicate'")
  local out2, code2 = tide_cmd("help")
  T.eq(code2, 0, out2)
  contains(out2, "usage: tide")
end)

T.test("tide test counts cases across files and fails when one fails", function()
  local dir = tmpdir .. "/suite"
  os.execute("mkdir -p '" .. dir .. "'")
  local function wf(name, text)
    local f = assert(io.open(dir .. "/" .. name, "w")); f:write(text); f:close()
  end
  wf("test_good.lua", [[
local T = require "tide.testing"
T.test("one", function() T.eq(1 + 1, 2) end)
T.test("two", function() T.near(0.1 + 0.2, 0.3, 1e-12) end)
T.run()
]])
  wf("test_bad.lua", [[
local T = require "tide.testing"
T.test("passes", function() T.ok(true) end)
T.test("fails", function() T.eq(2 + 2, 5) end)
T.run()
]])
  wf("test_crash.lua", "error('broken file')\n")
  local out, code = tide_cmd("test", "TIDE_TEST_DIR='" .. dir .. "'")
  T.eq(code, 1, out)
  contains(out, "FAIL  fails")
  contains(out, "expected 5, got 4")
  contains(out, "test_crash.lua:1: broken file")
  T.ok(out:match("\n3 passed, 2 failed\n?$"), "final line counts cases:\n" .. out)
  local out2, code2 = tide_cmd("test good", "TIDE_TEST_DIR='" .. dir .. "'")
  T.eq(code2, 0, out2)
  T.ok(out2:match("\n2 passed, 0 failed\n?$"), "pattern selects files:\n" .. out2)
end)

T.test("patch() keeps types and accepts the top-level flags", function()
  local cfg = { a = { b = 1, s = "x", on = false }, list = { 5, 6 } }
  cli.patch(cfg, "a.b", "2.5")
  cli.patch(cfg, "a.s", "17")
  cli.patch(cfg, "a.on", "true")
  cli.patch(cfg, "list.2", "9")
  cli.patch(cfg, "resume", nil)
  cli.patch(cfg, "out", "runs/x")
  T.eq(cfg, { a = { b = 2.5, s = "17", on = true }, list = { 5, 9 }, resume = true, out = "runs/x" })
  T.raises(function() cli.patch(cfg, "a", "3") end, "is a table; set its fields")
  T.raises(function() cli.patch(cfg, "a.on", "maybe") end, "is a boolean")
  T.raises(function() cli.patch(cfg, "a.b.c", "1") end, "is a number, not a table")
  T.raises(function() cli.patch(cfg, "stepz", "1") end, "unknown recipe key 'stepz'")
end)

T.test("every driver's config takes every command-line flag (tide.train, curricula, the RL loop)", function()
  local drivers = { ["tide.train"] = require("tide.train").KEYS.top, ["tide.curriculum"] = require("tide.curriculum").KEYS.top,
    ["tide.rl.loop"] = require("tide.rl.loop").KEYS.top }
  for name, top in pairs(drivers) do
    for flag in pairs(cli.TOP_LEVEL_FLAGS) do
      -- scale and stage steer a curriculum (a shortened scale, a stage to start at); the others are every driver's
      if (flag ~= "scale" and flag ~= "stage") or name == "tide.curriculum" then
        T.ok(top[flag], name .. " refuses the flag --" .. flag:gsub("_", "-"))
      end
    end
  end
end)

T.test("REPL evaluates expressions, continues incomplete chunks and reports errors", function()
  local input = write("repl_input.txt", table.concat({
    "1 + 2",
    "x = tide.ones({2})",
    "=x:sum():item()",
    "function f(a)",
    "  return a * 10",
    "end",
    "f(4)",
    "tide.zeros({2}):matmul(tide.zeros({3}))",
    "help(tide.zeros)",
  }, "\n") .. "\n")
  local out, code = tide_cmd("repl < '" .. input .. "'")
  T.eq(code, 0, out)
  contains(out, "3\n")
  contains(out, "> 2\n")
  contains(out, "40\n")
  contains(out, "matmul")
  contains(out, "tide.zeros(shape, opts)")
end)

T.test("parse_flags: typed command options, --a-b = --a_b, -o, one-line errors naming the flag", function()
  local spec = { max_new = { kind = "integer", default = 64, min = 1 }, temperature = { kind = "number", default = 1 },
    prompt = { kind = "string" }, greedy = { kind = "boolean", default = false }, lengths = { kind = "list" },
    out = { kind = "string", default = "report.html" } }
  local pos, f = cli.parse_flags({ "ck", "--max-new=5", "--prompt", "hi there", "--greedy", "--lengths=128,256",
    "-o", "r.html", "extra" }, spec, "tide sample", { o = "out" })
  T.eq(pos, { "ck", "extra" })
  T.eq(f.max_new, 5); T.eq(f.prompt, "hi there"); T.eq(f.greedy, true); T.eq(f.lengths, { 128, 256 })
  T.eq(f.temperature, 1, "default kept"); T.eq(f.out, "r.html")
  local function err(args)
    local ok, e = pcall(cli.parse_flags, args, spec, "tide sample")
    T.ok(not ok, "refused: " .. table.concat(args, " "))
    return tostring(e)
  end
  T.ok(err({ "--max_new=2.5" }):find("--max_new must be an integer", 1, true))
  T.ok(err({ "--max_new=0" }):find("must be in [1, inf]", 1, true))
  T.ok(err({ "--temperature=nan" }):find("finite number", 1, true))
  T.ok(err({ "--temperature=inf" }):find("finite number", 1, true))
  T.ok(err({ "--prompt" }):find("--prompt needs a value", 1, true))
  T.ok(err({ "--greedy=maybe" }):find("true or false", 1, true))
  local e = err({ "--top-q=3" })
  T.ok(e:find("unknown option '--top_q'", 1, true) and e:find("--temperature", 1, true), e)
  T.ok(not e:find("\n"), "one line")
end)

T.test("override UX: stages by name, warmups scaled with steps, schema keys, --help, recipe list, one-line errors", function()
  -- a stage addressed by name; its warmup follows a shortened steps unless set too
  local cfg, notes = cli.load_recipe("recipes/quickstart.lua", { { key = "stages.s128.steps", text = "20" } })
  T.eq(cfg.stages[1].steps, 20)
  T.eq(cfg.stages[1].lr.warmup, 3, "20 x 20/150 rounds to 3")
  T.ok(notes[1] and notes[1]:find("stages.s128.lr.warmup 20 -> 3", 1, true), tostring(notes[1]))
  cfg, notes = cli.load_recipe("recipes/quickstart.lua", { { key = "stages.1.steps", text = "20" },
    { key = "stages.s128.lr.warmup", text = "7" } })
  T.eq({ cfg.stages[1].steps, cfg.stages[1].lr.warmup, #notes }, { 20, 7, 0 }, "an explicit warmup wins, by either name")
  -- tide.train: the schedule's warmup and decay window follow train.steps
  cfg = cli.load_recipe("recipes/dense.lua", { { key = "train.steps", text = "60" } })
  T.eq({ cfg.schedule.warmup, cfg.schedule.decay_start, cfg.schedule.decay_end }, { 3, 48, 60 })
  -- a run so short that the window rounds shut (480 and 600 of 600 are both 2 of 2) keeps its order, which
  -- tide.train requires (warmup <= decay_start < decay_end); what the command line sets stands
  for _, c in ipairs({ { "2", { 0, 1, 2 } }, { "1", { 0, 0, 1 } }, { "3", { 0, 2, 3 } } }) do
    cfg = cli.load_recipe("recipes/dense.lua", { { key = "train.steps", text = c[1] } })
    T.eq({ cfg.schedule.warmup, cfg.schedule.decay_start, cfg.schedule.decay_end }, c[2], "train.steps " .. c[1])
  end
  cfg = cli.load_recipe("recipes/dense.lua", { { key = "train.steps", text = "2" },
    { key = "schedule.decay_start", text = "2" } })
  T.eq(cfg.schedule.decay_start, 2, "an explicit decay_start is left for the driver to judge")
  -- keys of the schema the recipe does not spell out
  cfg = cli.load_recipe("recipes/dense.lua", { { key = "train.quiet", text = "true" }, { key = "model.norm_eps", text = "1e-6" } })
  T.eq({ cfg.train.quiet, cfg.model.norm_eps }, { true, 1e-6 })
  cfg = cli.load_recipe("recipes/quickstart.lua", { { key = "model.moe.qb_rate", text = "0.5" } })
  T.eq(cfg.model.moe.qb_rate, 0.5)
  -- --scale first, wherever it stands: the other overrides edit the scaled config (its stage names, its dist table)
  cfg = cli.load_recipe("recipes/long_context_1m.lua", { { key = "dist.cp", text = "4" },
    { key = "stages.S1_1k.steps", text = "5" }, { key = "scale", text = "tiny" } })
  T.eq({ cfg.dist.cp, cfg.stages[2].name, cfg.stages[2].steps, cfg.scale_applied }, { 4, "S1_1k", 5, "tiny" })
  local ok, e = pcall(cli.load_recipe, "recipes/dense.lua", { { key = "train.quite", text = "true" } })
  T.ok(not ok and tostring(e):find("did you mean 'train.quiet'", 1, true), tostring(e))
  ok, e = pcall(cli.load_recipe, "recipes/quickstart.lua", { { key = "stages.s999.steps", text = "2" } })
  T.ok(not ok and tostring(e):find("unknown recipe key 'stages.s999.steps'", 1, true), tostring(e))
  -- the command line itself
  local out, code = tide_cmd("run recipes/dense.lua --help")
  T.eq(code, 0, out)
  contains(out, "--train.steps=600")
  contains(out, "--optim.lr=")
  out, code = tide_cmd("run")
  T.eq(code, 0, out)
  contains(out, "recipes/quickstart.lua")
  contains(out, "recipes/dense.lua")
  out, code = tide_cmd("data prepare --help")   -- a subcommand's --help: its command's usage
  T.eq(code, 0, out)
  contains(out, "usage: tide data prepare")
  out, code = tide_cmd("run recipes/dense.lua --seed=abc")
  T.eq(code, 1)
  T.eq(out, "tide: --seed must be an integer in [0, 2^32), got abc\n")
  out, code = tide_cmd("run recipes/dense.lua --threads=0")
  T.eq(code, 1)
  T.eq(out, "tide: --threads must be a positive integer, got 0\n")
  out, code = tide_cmd("run recipes/dense.lua --resume --out=" .. tmpdir .. "/never")
  T.eq(code, 1)
  T.ok(out:match("^tide: train: %-%-resume: no checkpoint under '[^\n]*never'.*start the run without %-%-resume\n$"), out)
end)

-- load_recipe's error for a refused key (a usage error: its message)
local function refused(path, key, text)
  local ok, e = pcall(cli.load_recipe, path, { { key = key, text = text or "1" } })
  T.ok(not ok, "--" .. key .. " is refused")
  return tostring(type(e) == "table" and e.msg or e)
end

T.test("schema keys the recipe leaves out: a curriculum's expect, sources of every kind, evals entries", function()
  local small = "tests/fixtures/curriculum_small.lua"     -- no expect table; text, passkey and mqar sources
  local cfg = cli.load_recipe(small, { { key = "expect.final_loss_below", text = "2.5" },
    { key = "sources.text.order", text = "sequential" }, { key = "sources.recall.power", text = "0.5" },
    { key = "sources.passkey.depth", text = "0.25" }, { key = "evals.1.seed", text = "77" },
    { key = "evals.1.filler", text = "random" } })
  T.eq({ cfg.expect, cfg.sources.text.order, cfg.sources.recall.power, cfg.sources.passkey.depth, cfg.evals[1].seed,
    cfg.evals[1].filler }, { { final_loss_below = 2.5 }, "sequential", 0.5, 0.25, 77, "random" })
  -- a recipe with an expect table that lacks a key
  cfg = cli.load_recipe("recipes/vlm_tiny.lua", { { key = "expect.final_loss_below", text = "3" } })
  T.eq(cfg.expect, { eval_accuracy_above = 0.9, final_loss_below = 3 })
  -- the values reach the driver, which checks them
  local out, code = tide_cmd("run " .. small .. " --dry-run --expect.final_loss_below=-1")
  T.eq({ code, out }, { 1, "tide: curriculum: expect.final_loss_below must be a number in [0, inf], got -1\n" })
  -- an unknown key at the same path is refused, with the known keys of the driver's or module's own set
  T.eq(refused(small, "expect.final_loss_belw"), "unknown recipe key 'expect.final_loss_belw', did you mean "
    .. "'expect.final_loss_below'? (known keys at expect: eval_accuracy_above, final_loss_below, val_maxvio_below)")
  T.eq(refused(small, "sources.text.ordr", "sequential"), "unknown recipe key 'sources.text.ordr', did you mean "
    .. "'sources.text.order'? (known keys at sources.text: doc_separator, exclude, field, format, kind, name, order, "
    .. "path, paths, seed, split, tokenizer, val_fraction)")
  T.eq(refused(small, "sources.recall.num_pair"), "unknown recipe key 'sources.recall.num_pair', did you mean "
    .. "'sources.recall.num_pairs'? (known keys at sources.recall: filler, filler_range, filler_source, filler_text, "
    .. "kind, length, num_pairs, power, seed, split, task, tokenizer, vocab_size)")
  T.eq(refused(small, "sources.passkey.power"), "unknown recipe key 'sources.passkey.power' (known keys at "
    .. "sources.passkey: depth, filler, filler_source, filler_text, kind, length, seed, split, task, tokenizer)")
  T.eq(refused(small, "evals.1.exampels"), "unknown recipe key 'evals.1.exampels', did you mean 'evals.1.examples'? "
    .. "(known keys at evals.1: batch, depth, depths, device, examples, filler, filler_text, lengths, seed, source, "
    .. "task, tokenizer)")
  -- an eval of an image source has the caption eval's keys
  cfg = cli.load_recipe("recipes/vlm_tiny.lua", { { key = "evals.1.samples", text = "3" } })
  T.eq(cfg.evals[1].samples, 3)
  T.eq(refused("recipes/vlm_tiny.lua", "evals.1.depths"), "unknown recipe key 'evals.1.depths' (known keys at "
    .. "evals.1: batch, examples, samples, source)")
end)

T.test("schema keys the recipe leaves out: tide.train's packed data sources, an RL recipe's sections", function()
  local packed = write("packed_schema.lua", [[
return { model = { vocab_size = 320, dim = 8, n_layers = 1 }, train = { steps = 2 },
  data = { sources = { t = { kind = "text", path = "tests/fixtures/tiny_corpus.txt" } }, mix = { t = 1 }, seq_len = 16,
    batch_size = 2 } }
]])
  local cfg = cli.load_recipe(packed, { { key = "data.sources.t.val_fraction", text = "0.1" },
    { key = "data.seed", text = "5" } })
  T.eq({ cfg.data.sources.t.val_fraction, cfg.data.seed }, { 0.1, 5 })
  T.eq(refused(packed, "data.sources.t.fraction"), "unknown recipe key 'data.sources.t.fraction' (known keys at "
    .. "data.sources.t: doc_separator, exclude, field, format, kind, name, order, path, paths, seed, split, tokenizer, "
    .. "val_fraction)")
  T.eq(refused(packed, "data.vocab_size"), "unknown recipe key 'data.vocab_size' (known keys at data: batch_size, mix, "
    .. "seed, seq_len, sources, tokenizer)")   -- packed data has the packer's keys, not the text stream's
  -- an RL recipe (kind = "rl", tide.rl.Recipe): its keys are tide.rl.loop.KEYS; expect and optim, which it leaves
  -- out, are tables the command line may create
  local rl = write("rl_schema.lua", [[
return { kind = "rl", name = "rl_schema", model = { vocab_size = 320, dim = 8, n_layers = 1 },
  sft = { steps = 2 }, rl = { env = "countdown", iterations = 2 }, train = { out = "runs/rl_schema" } }
]])
  cfg = cli.load_recipe(rl, { { key = "rl.top_k", text = "5" }, { key = "sft.rows", text = "4" },
    { key = "train.quiet", text = "true" }, { key = "expect.reward_above", text = "0.5" },
    { key = "optim.weight_decay", text = "0.01" }, { key = "on_nonfinite", text = "stop" } })
  T.eq({ cfg.rl.top_k, cfg.sft.rows, cfg.train.quiet, cfg.expect, cfg.optim, cfg.on_nonfinite },
    { 5, 4, true, { reward_above = 0.5 }, { weight_decay = 0.01 }, "stop" })
  local K = require("tide.rl.loop").KEYS
  local function known(t)
    local ks = {}
    for k in pairs(t) do ks[#ks + 1] = k end
    table.sort(ks)
    return table.concat(ks, ", ")
  end
  T.eq(refused(rl, "expect.reward_abov"), "unknown recipe key 'expect.reward_abov', did you mean "
    .. "'expect.reward_above'? (known keys at expect: " .. known(K.expect) .. ")")
  T.eq(refused(rl, "rl.temprature"), "unknown recipe key 'rl.temprature', did you mean 'rl.temperature'? "
    .. "(known keys at rl: " .. known(K.rl) .. ")")
  T.eq(refused(rl, "sft.row"), "unknown recipe key 'sft.row', did you mean 'sft.rows'? (known keys at sft: "
    .. known(K.sft) .. ")")
  local e = refused(rl, "optim.weight_decy")
  T.ok(e:find("did you mean 'optim.weight_decay'?", 1, true), e)
  e = refused(rl, "schedule.warmup")           -- tide.train's sections are not an RL recipe's
  T.ok(e:find("unknown recipe key 'schedule.warmup'", 1, true), e)
end)

T.test("expect bounds: a shortened run warns and exits 0, --check makes a miss exit 1; a steps value that is not a positive integer scales nothing", function()
  local recipe = write("expect_small.lua", [[
local r = dofile("tests/fixtures/curriculum_small.lua")
r.expect = { final_loss_below = 0.01 }
return r
]])
  local run = "run " .. recipe .. " --stages.a.steps=2 --stages.b.steps=2 --stages.c.steps=2 --out=" .. tmpdir .. "/expect"
  local out, code = tide_cmd(run)
  T.eq(code, 0, out)
  T.ok(out:match("\nwarning: final loss [%d.]+ is NOT below the expected 0%.0100\n"), out)
  contains(out, "warning: the recipe's expect bounds are not met (--check makes that fail the run)")
  out, code = tide_cmd(run .. " --overwrite --check")
  T.eq(code, 1, out)
  T.ok(out:match("\nfinal loss [%d.]+ is NOT below the expected 0%.0100\n$"), out)
  T.ok(not out:find("warning:", 1, true), out)
  -- the scaling note comes before the run's first line, even with stdout a pipe
  T.ok(out:match("^note: stages%.a%.lr%.warmup 2 %-> 1 "), out)
  -- a steps value that is not a positive integer: the driver's error alone, no scaling notes
  out, code = tide_cmd("run recipes/dense.lua --train.steps=-1 --out=" .. tmpdir .. "/neg")
  T.eq({ code, out }, { 1, "tide: tide.train: train.steps must be a positive integer, got -1\n" })
  out, code = tide_cmd("run recipes/quickstart.lua --stages.s128.steps=0 --dry-run")
  T.eq({ code, out }, { 1, "tide: curriculum: stage 's128': steps must be a positive integer, got 0\n" })
  out, code = tide_cmd("run recipes/dense.lua --model.dim --dry-run")
  T.eq({ code, out }, { 1, "tide: recipe key 'model.dim' is a number: give it a value (--model.dim=N)\n" })
end)

T.test("REPL on a terminal: Ctrl-C stops a running Lua loop, the variables stay; completion; help(Class)", function()
  -- a pseudo-terminal (the interrupt handler is installed only on one), driven by the system Python's pty module
  local driver = write("pty_repl.py", [=[
import os, pty, sys, time, select, signal
exe = sys.argv[1]
pid, fd = pty.fork()
if pid == 0:
    os.execv(exe, [exe, "repl"])
out, mark = b"", 0
def read_until(token, timeout):
    # waits for token in what arrived since the last match (so each prompt is a new one)
    global out, mark
    end = time.time() + timeout
    while time.time() < end:
        i = out.find(token, mark)
        if i >= 0:
            mark = i + len(token)
            return True
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                return False
            if not chunk:
                return False
            out += chunk
    return False
ok = read_until(b"> ", 20)
os.write(fd, b"keep = 41; n = 0; while true do n = n + 1 end\n")
time.sleep(1.0)
os.write(fd, b"\x03")
stopped = read_until(b"interrupted", 10) and read_until(b"> ", 5)
os.write(fd, b"=keep + 1, n > 1000\n")
alive = read_until(b"42\ttrue", 10) and read_until(b"> ", 5)
os.write(fd, b"help(tide.nn.MoE)\n")
helped = read_until(b'estimator = "auto"', 10) and read_until(b"> ", 5)
os.write(fd, b"\x04")
code = None
for _ in range(100):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        code = os.WEXITSTATUS(status)
        break
    read_until(b"never", 0.1)
    time.sleep(0.1)
if code is None:
    os.kill(pid, signal.SIGKILL)
print("prompt", ok, "stopped", stopped, "alive", alive, "help", helped, "exit", code)
]=])
  local p = io.popen("timeout 90 /usr/bin/python3 '" .. driver .. "' '" .. exe .. "' 2>&1")
  local out = p:read("*a")
  p:close()
  T.eq(out, "prompt True stopped True alive True help True exit 0\n", "the REPL session")
  -- completion: lazily loaded submodules and the methods of module instances
  local repl = require "tide.repl"
  local words = "\n" .. repl.completion_words({ m = require("tide").nn.Linear(2, 3) }) .. "\n"
  for _, w in ipairs({ "tide.nn.HybridLM", "tide.data.tokenizer", "tide.optim.AdamW", "m:forward", "m:parameters" }) do
    T.ok(words:find("\n" .. w .. "\n", 1, true), "completes " .. w)
  end
  -- help(Class): a one-line description first (the module file's header), then the constructor and its keys
  local nn = require("tide").nn
  local function first_line(cls) return (repl.class_help(cls):match("^([^\n]*)")) end
  T.eq(first_line(nn.Linear), "Linear — y = x Wᵀ + b with W stored [out, in] (HuggingFace layout).")
  T.eq(first_line(nn.MoE), "MoE — the sparse MoE FFN (spec/moe.md)")
  T.eq(first_line(nn.HybridLM), "HybridLM — the hybrid language model (spec/mla.md §7, attnres.md §3)")
  local h = repl.class_help(nn.HybridLM)
  T.ok(h:find("keys (default):", 1, true) and h:find("dim = 128", 1, true), h)
  T.ok(repl.class_help(nn.Linear):find("Linear(in_features, out_features, {bias = false, std = 0.02", 1, true))
  T.eq(repl.one_line({ "x.lua — a long one (with: colons; and. dots) and more words than fit" .. (" pad"):rep(30) }),
    "a long one (with: colons; and. dots) and more words than fit pad pad pad pad pad pad pad pad pad pad pad ...")
end)

local _, failed = T.run { exit = false }
os.execute("rm -rf '" .. tmpdir .. "'")
os.exit(failed > 0 and 1 or 0)
