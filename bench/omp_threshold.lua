-- bench/omp_threshold.lua — where a kernel's second thread starts to pay (kernels/cpu/cpu.h: the parallel thresholds
-- by cost class). For one kernel of each class, at sizes around its threshold: the time on 1 thread, on 2 threads
-- with every OpenMP loop forced parallel (TIDE_OMP_SCALE=0) and on 2 threads with the thresholds as built, each the
-- best of `reps` timed batches after a warm-up. The crossover is the smallest size from which the forced 2-thread run
-- is at least 10% faster than 1 thread at every larger size; a threshold is right when at every size the built run
-- is serial where the forced 2 threads save less than 10% and parallel where they lose less than 10%. It reports; it asserts nothing. Each variant runs in a child process (the
-- scale is read once, at load).
--
--   tide run bench/omp_threshold.lua [--reps=5] [--results=DIR]
local tide = require "tide"
local F = require "tide.functional"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local fmt = string.format

-- the kernels, their class and the element count of one call at a size (the quantity their `if` clause compares)
local C = 64
local OPS = {
  { name = "rmsnorm", class = "TIDE_OMP_MIN_ROW", threshold = 3072, sizes = { 1024, 2048, 4096, 8192, 16384, 32768 },
    make = function(n) local x, w = tide.randn({ n / C, C }), tide.randn({ C }); return function() F.rmsnorm(x, w) end end },
  { name = "causal_conv1d (SiLU in double)", class = "TIDE_OMP_MIN_MATH", threshold = 1536,
    sizes = { 512, 1024, 2048, 4096, 8192, 16384 },
    make = function(n) local x, w = tide.randn({ 1, n / C, C }), tide.randn({ C, 4 })
      return function() F.causal_conv1d(x, w, { silu = true }) end end },
  { name = "attnres (3 sources)", class = "4 x TIDE_OMP_MIN_MATH", threshold = 6144, sizes = { 1024, 2048, 4096, 8192, 16384, 32768 },
    make = function(n)
      local s = { tide.randn({ n / C, C }), tide.randn({ n / C, C }), tide.randn({ n / C, C }) }
      local w, nu = tide.randn({ C }), tide.randn({ C })
      return function() F.attnres(s, w, nu) end
    end, elements = function(n) return 3 * n end },
  { name = "softmax", class = "TIDE_OMP_MIN_MATH / 4", threshold = 384, sizes = { 128, 256, 512, 1024, 2048, 4096 },
    make = function(n) local x = tide.randn({ n / C, C }); return function() x:softmax(-1) end end },
  { name = "situ_glu", class = "TIDE_OMP_MIN_MATH", threshold = 1536, sizes = { 512, 1024, 2048, 4096, 8192, 16384 },
    make = function(n) local g, u = tide.randn({ n }), tide.randn({ n }); return function() F.situ_glu(g, u) end end },
  { name = "linear, K = N = 64 (multiply-adds)", class = "TIDE_OMP_MIN_FMA", threshold = 786432,
    sizes = { 131072, 262144, 524288, 1048576, 2097152, 4194304 },
    make = function(n) local x, w = tide.randn({ n / (C * C), C }), tide.randn({ C, C }); return function() F.linear(x, w) end end },
}

local function best_time(fn, reps)
  fn()
  local best = math.huge
  for _ = 1, reps do
    local inner = 10
    local t0 = tide.time()
    for _ = 1, inner do fn() end
    best = math.min(best, (tide.time() - t0) / inner)
  end
  return best
end

-- the child: every op at every size on 1 and 2 threads, as built or forced (the environment says which)
local function child(cfg)
  tide.manual_seed(5)
  local out = {}
  tide.no_grad(function()
    for i, op in ipairs(OPS) do
      out[i] = {}
      for j, n in ipairs(op.sizes) do
        local fn = op.make(n)
        tide.set_num_threads(1)
        local t1 = best_time(fn, cfg.reps)
        tide.set_num_threads(2)
        local t2 = best_time(fn, cfg.reps)
        out[i][j] = { t1 = t1, t2 = t2 }
      end
    end
  end)
  io.write(json.encode(out), "\n")
  return 0
end

local function run_child(scale, reps)
  local exe = cli.exe_path() or "tide"
  local src = debug.getinfo(1, "S").source:match("^@(.*)$") or "bench/omp_threshold.lua"
  -- (the child sets its own OpenMP waiting, as every tide process does: the executable exports PASSIVE to its children)
  local cmd = fmt("env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT TIDE_OMP_SCALE=%s %s run %s --child=true --reps=%d", scale,
    cli.shell_quote(exe), cli.shell_quote(src), reps)
  local p = assert(io.popen(cmd))
  local text = p:read("*a")
  p:close()
  local line = text:match("(%[.*%])%s*$")
  local ok, obj = pcall(json.decode, line or "")
  if not ok or type(obj) ~= "table" then error("omp_threshold: the child run failed: " .. text:sub(-600), 0) end
  return obj
end

local function run(cfg)
  if cfg.child then return child(cfg) end
  results.wait_idle({ max_busy = 0.15, timeout = 60 })
  local built = run_child("1", cfg.reps)
  results.wait_idle({ max_busy = 0.15, timeout = 60 })
  local forced = run_child("0", cfg.reps)
  local record = { benchmark = "omp_threshold", date = os.date("!%Y-%m-%d %H:%M UTC"), tide_version = tide.version,
    threads = 2, reps = cfg.reps, ops = {} }
  local L = { "# omp_threshold: where a kernel's second thread starts to pay (2 cores)", "",
    fmt("%s, tide %s. For one kernel of each cost class (kernels/cpu/cpu.h), at sizes around its threshold: 1 thread, "
      .. "2 threads with every OpenMP loop forced parallel (TIDE_OMP_SCALE=0) and 2 threads as built; best of %d "
      .. "batches of 10 calls. Crossover: the smallest size from which forced 2 threads is >= 1.1x 1 thread at every "
      .. "larger size. Right: at every size the built run is serial where 2 threads forced save less than 10%%, and "
      .. "parallel where they lose less than 10%%.", record.date,
      tide.version, cfg.reps), "",
    "| kernel | class (threshold) | elements | 1 thread us | 2 threads forced us | forced speedup | 2 threads as built us | built runs | crossover | right |",
    "|---|---|---:|---:|---:|---:|---:|---|---|---|" }
  for i, op in ipairs(OPS) do
    local rows, cross = {}, nil
    for j = #op.sizes, 1, -1 do
      local f = forced[i][j]
      if f.t1 / f.t2 >= 1.1 then cross = op.sizes[j] else break end
    end
    local right = true
    for j, n in ipairs(op.sizes) do
      local b, f = built[i][j], forced[i][j]
      local elems = op.elements and op.elements(n) or n
      local par = elems > op.threshold
      -- the built decision against the forced measurement: serial where 2 threads would not save 10%, parallel where
      -- they do not lose 10%
      if (par and f.t2 > 1.1 * f.t1) or (not par and f.t2 * 1.1 < f.t1) then right = false end
      rows[j] = { elements = elems, t1 = f.t1, t2_forced = f.t2, t2_built = b.t2, parallel = par }
    end
    for j, row in ipairs(rows) do
      L[#L + 1] = fmt("| %s | %s (%d) | %d | %.2f | %.2f | %.2fx | %.2f | %s | %s | %s |", op.name, op.class, op.threshold,
        row.elements, 1e6 * row.t1, 1e6 * row.t2_forced, row.t1 / row.t2_forced, 1e6 * row.t2_built,
        row.parallel and "parallel" or "serial", j == 1 and (cross and tostring(cross) or "none") or "",
        j == 1 and (right and "yes" or "no") or "")
    end
    record.ops[#record.ops + 1] = { name = op.name, class = op.class, threshold = op.threshold, crossover = cross,
      right = right, rows = rows }
  end
  local md = table.concat(L, "\n") .. "\n"
  io.write(md)
  results.write(cfg.results, "omp_threshold", record, md, { "benchmark", "date", "ops" })
  return 0
end

return {
  reps = 20,                   -- timed batches per size and variant (the best counts)
  child = false,               -- (internal) run the measurements and print them as JSON
  results = "bench/results",   -- where omp_threshold.json / .md go; "" writes nothing
  run = run,
}
