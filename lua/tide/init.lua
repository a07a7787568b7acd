-- tide: the Lua front end of the engine.
--
--   local tide = require "tide"
--
-- Loads the declarations between the TIDE_CDEF markers of engine/tide.h, binds the engine (ffi.C inside
-- the `tide` executable, libtide.so otherwise) and gathers the library: tensors (tide.tensor.lua),
-- functional ops (tide.F), autograd helpers, memory and runtime information. Submodules written on top
-- of this (tide.nn, tide.optim, ...) load lazily on first access.
local ffi = require "ffi"

assert(jit, "tide: needs LuaJIT")
if not ffi.abi("gc64") then
  error("tide: this LuaJIT was built without GC64 (LUAJIT_ENABLE_GC64); rebuild it with GC64", 0)
end

local tide = {}

-- <repo>/lua/tide/init.lua -> <repo>
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
tide.lua_dir = here:match("^(.*)/[^/]*$") or "."       -- <repo>/lua
tide.root = tide.lua_dir:match("^(.*)/[^/]*$") or "."   -- <repo>

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- the header: $TIDE_HEADER, or engine/tide.h of this tree
local header_path = os.getenv("TIDE_HEADER") or (tide.root .. "/engine/tide.h")
local header = read_file(header_path)
if not header then
  error("tide: cannot read the engine header '" .. header_path .. "' (set TIDE_HEADER to its path)", 0)
end
local cdef = header:match("/%* TIDE_CDEF_BEGIN %*/(.-)/%* TIDE_CDEF_END %*/")
if not cdef then
  error("tide: '" .. header_path .. "' has no TIDE_CDEF_BEGIN/TIDE_CDEF_END section", 0)
end
-- a second `require` of a fresh copy of this module (tests do that) must not redefine the types
if not pcall(ffi.typeof, "tide_tensor") then ffi.cdef(cdef) end

-- the C namespace: the host executable exports the engine; plain luajit loads the shared library
local C
tide.in_host = pcall(function() return ffi.C.tide_version end)
if tide.in_host then
  C = ffi.C
else
  local lib = os.getenv("TIDE_LIB") or (tide.root .. "/build/libtide.so")
  local ok, l = pcall(ffi.load, lib)
  if not ok then
    error("tide: cannot load the engine library '" .. lib .. "': " .. tostring(l) ..
          " (build it, or set TIDE_LIB to libtide.so)", 0)
  end
  C = l
end
tide.C = C
tide.version = ffi.string(C.tide_version())

-- OpenBLAS on a CPU model newer than the library runs its generic kernels; the tide executable sets
-- OPENBLAS_CORETYPE before the library loads (engine/host/main.c), a plain luajit cannot: say so, once
if not tide.in_host and not rawget(_G, "__tide_blas_hint_said") then
  local hint = C.tide_blas_core_hint()
  if hint ~= nil then
    rawset(_G, "__tide_blas_hint_said", true)
    io.stderr:write(string.format("tide: OpenBLAS runs its generic kernels on this CPU (%s; the CPU model is newer "
      .. "than the library): export OPENBLAS_CORETYPE=%s before starting luajit for several times faster matrix "
      .. "products (the tide executable sets it itself)\n", ffi.string(C.tide_blas_info()), ffi.string(hint)))
  end
end

-- ---- reading files ------------------------------------------------------------------------------------
-- tide.read_file(path, max_bytes) -> the whole file as a string, or nil and one line naming the file and what is
-- wrong: it is missing, it is not a regular file (a FIFO, a device, a directory: refused without blocking), or it
-- is longer than max_bytes (nil or 0: no limit). Every Lua reader of files goes through it; the engine's check
-- (tide_open_regular) is the one its own readers use.
tide.STATE_FILE_LIMIT = 64 * 2 ^ 20   -- JSON state and config files, `latest`: more is not a state file
function tide.read_file(path, max_bytes)
  if type(path) ~= "string" then return nil, "read_file: the path must be a string, got a " .. type(path) end
  local n = ffi.new("size_t[1]")
  local p = C.tide_read_file(path, n, max_bytes or 0)
  if p == nil then return nil, ffi.string(C.tide_last_error()) end
  local s = ffi.string(p, n[0])
  C.tide_free(p)
  return s
end

-- the package table is visible to tide.tensor / tide.functional while they load
package.loaded["tide"] = tide

local Tensor = require "tide.tensor"
tide.Tensor = Tensor.type          -- the ctype of tensors (ffi.istype(tide.Tensor, x))
tide.is_tensor = Tensor.is_tensor  -- tide.is_tensor(x) -> boolean
tide.raw = Tensor.raw              -- tide.raw(t) -> tide_tensor* for calling tide.C directly
tide.wrap = Tensor.wrap            -- tide.wrap(ptr) owns a NEW reference returned by a C function
tide.check = Tensor.check          -- tide.check(ptr) = wrap, raising tide_last_error() on NULL
tide.check_status = Tensor.check_status
tide.methods = Tensor.methods      -- tensor methods (extend with care)

-- creation: tide.zeros(shape, opts) ... ; opts = {dtype="f32", device="cpu", requires_grad=false}
tide.empty = Tensor.empty
tide.zeros = Tensor.zeros
tide.ones = Tensor.ones
tide.full = Tensor.full            -- tide.full(shape, value, opts)
tide.arange = Tensor.arange        -- tide.arange(n) | (a, b[, step][, opts]): [a, b)
tide.randn = Tensor.randn          -- opts.mean (0), opts.std (1)
tide.rand = Tensor.rand            -- opts.lo (0), opts.hi (1)
tide.tensor = Tensor.from_table    -- tide.tensor({{1, 2}, {3, 4}}, opts) or a flat table or a number
tide.from_table = Tensor.from_table
tide.zeros_like = Tensor.zeros_like
tide.ones_like = Tensor.ones_like
tide.dtype = Tensor.dtype_id       -- "f32" -> 0
tide.device = Tensor.device_id     -- "cuda:0" -> 1
tide.dtype_name = Tensor.dtype_name
tide.device_name = Tensor.device_name

tide.F = require "tide.functional"

-- ---- autograd ----------------------------------------------------------------------------------

local unpack = unpack or table.unpack
local function pack(...) return { n = select("#", ...), ... } end

-- runs fn(...) with gradient recording off; returns fn's results
function tide.no_grad(fn, ...)
  local prev = C.tide_set_grad_enabled(0)
  local r = pack(pcall(fn, ...))
  C.tide_set_grad_enabled(prev)
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

-- runs fn(...) with gradient recording on (inside a no_grad region, for example)
function tide.enable_grad(fn, ...)
  local prev = C.tide_set_grad_enabled(1)
  local r = pack(pcall(fn, ...))
  C.tide_set_grad_enabled(prev)
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

function tide.grad_enabled() return C.tide_grad_enabled() ~= 0 end

-- runs fn(...) as a recompute region: its activations are dropped and recomputed during backward
function tide.recompute(fn, ...)
  Tensor.check_status(C.tide_recompute_begin())
  local r = pack(pcall(fn, ...))
  local st = C.tide_recompute_end()
  if not r[1] then error(r[2], 0) end
  Tensor.check_status(st)
  return unpack(r, 2, r.n)
end

-- backpropagates from loss (numel 1, or pass grad of loss's shape)
function tide.backward(loss, grad) return loss:backward(grad) end

function tide.graph_live_nodes() return tonumber(C.tide_graph_live_nodes()) end

-- ---- RNG -------------------------------------------------------------------------------------------

function tide.manual_seed(n)
  if type(n) ~= "number" and not ffi.istype("uint64_t", n) then
    error("tide.manual_seed: seed must be a number, got " .. type(n), 2)
  end
  C.tide_manual_seed(n)
end

-- returns seed, offset (as Lua numbers when exact, else uint64 cdata)
function tide.rng_state()
  local s, o = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  C.tide_rng_get(s, o)
  local function num(x) return x < 2 ^ 53 and tonumber(x) or x end
  return num(s[0]), num(o[0])
end

function tide.set_rng_state(seed, offset) C.tide_rng_set(seed, offset) end

-- ---- memory and runtime ----------------------------------------------------------------------------

-- engine memory of a device ("cpu" by default): {current=, peak=, cached=, limit=, n_alloc=, n_cache_hits=}
tide.memory = Tensor.memory
-- the device's memory as the system reports it ("cpu" by default): {free =, total =} bytes (the engine's cached
-- blocks count as used: tide.memory().cached)
tide.device_memory = Tensor.device_memory
-- full Lua collection, which releases every unreachable tensor; returns tide.memory()
tide.collect = Tensor.collect
function tide.reset_peak(device) C.tide_memory_reset_peak(Tensor.device_id(device or "cpu")) end
function tide.empty_cache(device) C.tide_memory_empty_cache(Tensor.device_id(device or "cpu")) end
function tide.set_memory_limit(bytes, device)
  Tensor.check_status(C.tide_memory_set_limit(Tensor.device_id(device or "cpu"), bytes or 0))
  Tensor.limit_changed()
end
function tide.live_tensors() return tonumber(C.tide_live_tensors()) end

function tide.num_threads() return C.tide_num_threads() end
function tide.set_num_threads(n) C.tide_set_num_threads(n) end
function tide.time() return C.tide_time_now() end
function tide.cuda_available() return C.tide_cuda_available() ~= 0 end

-- a table describing the build and the machine
function tide.info()
  local ops = {}
  for i = 0, C.tide_op_count() - 1 do ops[#ops + 1] = ffi.string(C.tide_op_name(i)) end
  return {
    version = tide.version,
    build = ffi.string(C.tide_build_info()),
    threads = C.tide_num_threads(),
    blas = ffi.string(C.tide_blas_info()),
    cuda = C.tide_cuda_available() ~= 0,
    cuda_devices = C.tide_cuda_device_count(),
    cuda_info = ffi.string(C.tide_cuda_info()),
    mpi = C.tide_mpi_available() ~= 0,
    luajit = jit.version,
    gc64 = ffi.abi("gc64"),
    host = tide.in_host,
    ops = ops,
  }
end

-- ---- the op profiler ----------------------------------------------------------------------------------------
-- tide.profile(fn, ...) -> report, fn's results: the engine's ops while fn runs, per op its calls and self time
-- (host wall time inside the op less the ops it ran itself) as forward, backward and recompute replay:
--   report.ops = { {name, total_s, fwd_s, fwd_calls, bwd_s, bwd_calls, replay_s, replay_calls}, ... } (largest
--   first), report.ops_s (their sum), report.wall_s (fn's wall time: the rest is Lua, the optimiser's update and
--   other engine calls that are not ops; gradient sums in the backward count as add), report:table(n) the n largest
--   as text. On CUDA an op's time is its launch (the kernels run asynchronously). Not nested.
local ProfileReport = {}
ProfileReport.__index = ProfileReport

function ProfileReport:table(n)
  n = n or 20
  local L = { string.format("%-24s %10s %6s %20s %20s %20s", "op", "total ms", "share", "forward ms (calls)",
    "backward ms (calls)", "recompute ms (calls)") }
  local function cell(s, c) return c > 0 and string.format("%10.2f (%7d)", s * 1e3, c) or string.format("%20s", "-") end
  for i = 1, math.min(n, #self.ops) do
    local e = self.ops[i]
    L[#L + 1] = string.format("%-24s %10.2f %5.1f%% %s %s %s", e.name, e.total_s * 1e3,
      self.wall_s > 0 and 100 * e.total_s / self.wall_s or 0, cell(e.fwd_s, e.fwd_calls), cell(e.bwd_s, e.bwd_calls),
      cell(e.replay_s, e.replay_calls))
  end
  L[#L + 1] = string.format("ops %.2f ms of %.2f ms wall (%d ops listed of %d); the rest: Lua, the optimiser's update, "
    .. "engine calls that are not ops", self.ops_s * 1e3, self.wall_s * 1e3, math.min(n, #self.ops), #self.ops)
  return table.concat(L, "\n")
end

function tide.profile(fn, ...)
  if type(fn) ~= "function" then error("profile: expected a function to run, got " .. type(fn), 2) end
  local prev = C.tide_profile_set(1)
  if prev ~= 0 then
    C.tide_profile_set(prev)
    error("profile: a profile is already running (tide.profile does not nest)", 2)
  end
  C.tide_profile_reset()
  local t0 = tide.time()
  local res = { n = 0 }
  local function keep(ok, ...)
    res.ok, res.n = ok, select("#", ...)
    for i = 1, res.n do res[i] = select(i, ...) end
  end
  keep(pcall(fn, ...))
  local wall = tide.time() - t0
  C.tide_profile_set(0)
  if not res.ok then error(res[1], 0) end
  local secs, calls = ffi.new("double[3]"), ffi.new("int64_t[3]")
  local ops, sum = {}, 0
  for i = 0, C.tide_op_count() - 1 do
    C.tide_profile_read(i, secs, calls)
    local c0, c1, c2 = tonumber(calls[0]), tonumber(calls[1]), tonumber(calls[2])
    if c0 + c1 + c2 > 0 then
      local e = { name = ffi.string(C.tide_op_name(i)), fwd_s = secs[0], fwd_calls = c0, bwd_s = secs[1],
        bwd_calls = c1, replay_s = secs[2], replay_calls = c2 }
      e.total_s = e.fwd_s + e.bwd_s + e.replay_s
      sum = sum + e.total_s
      ops[#ops + 1] = e
    end
  end
  table.sort(ops, function(a, b)
    if a.total_s ~= b.total_s then return a.total_s > b.total_s end
    return a.name < b.name
  end)
  return setmetatable({ ops = ops, ops_s = sum, wall_s = wall }, ProfileReport), unpack(res, 1, res.n)
end

-- ---- lazily loaded submodules ------------------------------------------------------------------------
-- (a module that is missing or broken raises its require error on first access, not at require "tide")
local lazy = {
  nn = "tide.nn", optim = "tide.optim", schedule = "tide.schedule", data = "tide.data",
  train = "tide.train", json = "tide.json", log = "tide.log", checkpoint = "tide.checkpoint",
  curriculum = "tide.curriculum", Curriculum = "tide.curriculum", evals = "tide.evals", testing = "tide.testing",
  cli = "tide.cli", repl = "tide.repl", step = "tide.step", options = "tide.options", defaults = "tide.defaults",
  rl = "tide.rl", dist = "tide.dist",
}
tide.submodules = lazy
setmetatable(tide, {
  __index = function(t, k)
    local name = lazy[k]
    if not name then return nil end
    local m = require(name)
    rawset(t, k, m)
    return m
  end,
})

return tide
