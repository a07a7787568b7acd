-- tide.tensor: the tensor type of the Lua front end.
--
-- A tensor is a small ffi struct `struct tide_lua_tensor { tide_tensor *handle; }` carrying the metatype.
-- Not a bare `tide_tensor *`: the engine struct's fields (shape, dtype, grad, ...) would hide the methods
-- of the same names, and a pointer's numeric index is pointer arithmetic, not t[i].
-- tide.raw(t) (= t.handle) gives the `tide_tensor *` for calling tide.C directly. Each Lua tensor owns
-- one engine reference, released by its ffi.gc finalizer.
--
-- Conventions: dims are 1-based (t:sum(2)); negative dims count from the end (-1 = last). Element
-- positions (t[i], t:narrow(dim, start, len)) are 1-based too. Both are converted to the engine's 0-based
-- numbering in exactly one place: cdim / cpos below. Values stored in tensors (token ids, indices) are
-- data and are never shifted.
local ffi = require "ffi"
local tide = require "tide"   -- the partially built package: tide.C is set
local C = tide.C

local floor, huge = math.floor, math.huge
local fmt, concat_strings = string.format, table.concat

if not pcall(ffi.typeof, "struct tide_lua_tensor") then ffi.cdef "struct tide_lua_tensor { tide_tensor *handle; };" end
local LT = ffi.typeof("struct tide_lua_tensor")
local TPA = ffi.typeof("tide_tensor *[?]")
local I64A = ffi.typeof("int64_t[?]")
local INTA = ffi.typeof("int[?]")
local F64A = ffi.typeof("double[?]")

local M = {}
local methods = {}
M.methods = methods
M.type = LT

local function raw(t) return t.handle end
local function is_tensor(x) return ffi.istype(LT, x) end
M.raw, M.is_tensor = raw, is_tensor

-- ---- errors -----------------------------------------------------------------------------------------
-- Errors point at the first caller outside the core files of the front end (this file, functional.lua,
-- init.lua), so a failing op reports the line of the recipe or module that called it.
local core_sources = {}
do
  local src = debug.getinfo(1, "S").source
  local dir = src:match("^(@.*/)[^/]*$") or "@"
  for _, f in ipairs { "tensor.lua", "functional.lua", "init.lua" } do core_sources[dir .. f] = true end
end

local function raise(msg)
  -- getinfo and error count levels alike: 1 = raise, 2 = its caller, ...
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if not info then error(msg, 0) end
    if info.what ~= "C" and info.what ~= "tail" and not core_sources[info.source] then error(msg, level) end
    level = level + 1
  end
end
M.raise = raise

local function last_error()
  local s = ffi.string(C.tide_last_error())
  return s ~= "" and s or "unknown engine error"
end

-- ---- memory pressure ----------------------------------------------------------------------------------
-- The Lua collector sees 8-byte pointers, not the engine bytes behind them. Every new tensor adds its
-- size to `pending`; past PRESSURE_BYTES (or PRESSURE_COUNT tensors) we read the engine's counters, and
-- when the bytes held grew by more than collect_threshold(base, Lua heap) since the last collection we
-- run a full collection, which finalizes every unreachable tensor.
local PRESSURE_BYTES, PRESSURE_COUNT = 16 * 2 ^ 20, 256
local MIN_GROW, MAX_GROW = 32 * 2 ^ 20, 256 * 2 ^ 20
local HEAP_GROW = 16

-- the engine bytes to let grow before a full collection: clamp(max(base, 16 · heap), 32 MiB, 256 MiB), base the
-- bytes held after the last one and heap the Lua heap's bytes. A full collection marks every live Lua object, so
-- its cost follows the heap: a large heap (a rollout's trajectories and per-row caches) waits for more garbage per
-- collection, which keeps the collections' cost per byte freed flat; a training step's small heap keeps the floor
local function collect_threshold(base, heap)
  local grow = base
  if HEAP_GROW * heap > grow then grow = HEAP_GROW * heap end
  if grow < MIN_GROW then grow = MIN_GROW elseif grow > MAX_GROW then grow = MAX_GROW end
  return grow
end
M._collect_threshold = collect_threshold
local stats = ffi.new("tide_memory_stats")
local pending_bytes, pending_count = 0, 0
local base_bytes = nil
local n_devices = nil   -- cpu + cuda devices, read once
-- dtypes as the header defines them (tide_dtype, tide_dtype_name, tide_dtype_size): id -> name, name -> id, id -> bytes
local DTYPE_NAMES, DTYPES, dtype_size = {}, {}, {}
for id = 0, C.TIDE_DTYPE_COUNT - 1 do
  local name = ffi.string(C.tide_dtype_name(id))
  DTYPE_NAMES[id], DTYPES[name], dtype_size[id] = name, id, tonumber(C.tide_dtype_size(id))
end
-- the long names, as PyTorch spells them
for long, short in pairs { float32 = "f32", float64 = "f64", bfloat16 = "bf16", int32 = "i32", int64 = "i64", uint8 = "u8" } do
  DTYPES[long] = DTYPES[short]
end
local FLOAT_DTYPES = { [C.TIDE_F32] = true, [C.TIDE_F64] = true, [C.TIDE_BF16] = true }

-- Under a memory limit (tide.set_memory_limit) the counters are read every eighth of the smallest limit (when that
-- is less than PRESSURE_BYTES), and a device with less than a quarter of its limit plus that interval left is
-- collected at every reading: unreachable tensors must not make an allocation fail.
local check_bytes = PRESSURE_BYTES

-- the engine bytes held on every device, and whether a device with a limit is near it (check_bytes updated)
local function engine_bytes()
  if not n_devices then
    n_devices = 1 + (C.tide_cuda_available() ~= 0 and C.tide_cuda_device_count() or 0)
  end
  local total, near_limit, every = 0, false, PRESSURE_BYTES
  for d = 0, n_devices - 1 do
    if C.tide_memory_stats_get(d, stats) == 0 then
      local cur, limit = tonumber(stats.current), tonumber(stats.limit)
      total = total + cur
      if limit > 0 then
        if limit / 8 < every then every = limit / 8 end
        if limit - cur < 0.25 * limit + every then near_limit = true end
      end
    end
  end
  check_bytes = every
  return total, near_limit
end

local function collect_full()
  collectgarbage("collect")
  base_bytes = engine_bytes()
  pending_bytes, pending_count = 0, 0
end

local function pressure_check()
  pending_bytes, pending_count = 0, 0
  local cur, near_limit = engine_bytes()
  if near_limit then collect_full() return end
  if not base_bytes or cur < base_bytes then base_bytes = cur; return end
  if cur > base_bytes + collect_threshold(base_bytes, collectgarbage("count") * 1024) then collect_full() end
end

local function release(t) C.tide_tensor_release(t.handle) end

-- owns a NEW reference returned by the engine (p must not be NULL)
local function wrap(p)
  pending_bytes = pending_bytes + tonumber(p.numel) * (dtype_size[p.dtype] or 8)
  pending_count = pending_count + 1
  if pending_bytes > check_bytes or pending_count > PRESSURE_COUNT then pressure_check() end
  return ffi.gc(LT(p), release)
end

-- wraps the result of an engine call, raising the engine's message when it is NULL
local function check(p)
  if p == nil then raise(last_error()) end
  return wrap(p)
end

local function check_status(rc)
  if rc ~= 0 then raise(last_error()) end
end
M.wrap, M.check, M.check_status = wrap, check, check_status

function M.memory(device)
  local d = M.device_id(device or "cpu")
  if C.tide_memory_stats_get(d, stats) ~= 0 then raise(last_error()) end
  return {
    current = tonumber(stats.current), peak = tonumber(stats.peak), cached = tonumber(stats.cached),
    limit = tonumber(stats.limit), n_alloc = tonumber(stats.n_alloc), n_cache_hits = tonumber(stats.n_cache_hits),
  }
end

-- the device's memory as the system reports it: {free = bytes a new allocation can get, total}
local mem_free, mem_total = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
function M.device_memory(device)
  local d = M.device_id(device or "cpu")
  if C.tide_device_memory(d, mem_free, mem_total) ~= 0 then raise(last_error()) end
  return { free = tonumber(mem_free[0]), total = tonumber(mem_total[0]) }
end

-- a memory limit changed (tide.set_memory_limit): read the counters at the next tensor, so the interval follows it
function M.limit_changed() check_bytes = 0 end

function M.collect(device)
  collect_full()
  return M.memory(device)
end

-- ---- dtypes and devices ---------------------------------------------------------------------------------
function M.dtype_id(x, fname)
  if x == nil then return 0 end
  local id = type(x) == "number" and (DTYPE_NAMES[x] and x) or DTYPES[x]
  if not id then
    raise(fmt("%s: unknown dtype %s (expected f32, f64, bf16, i32, i64 or u8)", fname or "dtype",
              type(x) == "string" and "'" .. x .. "'" or tostring(x)))
  end
  return id
end

function M.dtype_name(id) return DTYPE_NAMES[id] end

-- device ids as the header numbers them: TIDE_CPU, then TIDE_CUDA0 + n for cuda:n
local CPU, CUDA0 = C.TIDE_CPU, C.TIDE_CUDA0

function M.device_id(x, fname)
  if x == nil or x == "cpu" then return CPU end
  if type(x) == "number" and x >= 0 and x == floor(x) then return x end
  if x == "cuda" then return CUDA0 end
  if type(x) == "string" then
    local n = x:match("^cuda:(%d+)$")
    if n then return CUDA0 + tonumber(n) end
  end
  raise(fmt("%s: unknown device %s (expected \"cpu\", \"cuda\" or \"cuda:N\")", fname or "device",
            type(x) == "string" and "'" .. x .. "'" or tostring(x)))
end

function M.device_name(id) return id == CPU and "cpu" or ("cuda:" .. (id - CUDA0)) end

local function is_float_dtype(d) return FLOAT_DTYPES[d] == true end

-- ---- the one place where 1-based Lua dims/positions become 0-based C ones -----------------------------
-- dim d of an n-d tensor: 1..n or -n..-1
local function cdim_n(n, d, fname)
  if type(d) ~= "number" or d ~= floor(d) then
    raise(fmt("%s: dim must be an integer, got %s", fname, tostring(d)))
  end
  if d >= 1 and d <= n then return d - 1 end
  if d < 0 and d >= -n then return n + d end
  if d == 0 then
    raise(fmt("%s: dim 0 does not exist: dims are 1-based (1..%d, or -1 for the last)", fname, n))
  end
  raise(fmt("%s: dim %d is out of range for a %d-d tensor (valid: 1..%d or -%d..-1)", fname, d, n, n, n))
end
local function cdim(t, d, fname) return cdim_n(raw(t).ndim, d, fname) end
-- element position i along a dim of the given size: 1..size or -size..-1
local function cpos(i, size, fname)
  if type(i) ~= "number" or i ~= floor(i) then
    raise(fmt("%s: index must be an integer, got %s", fname, tostring(i)))
  end
  if i >= 1 and i <= size then return i - 1 end
  if i < 0 and i >= -size then return size + i end
  raise(fmt("%s: index %d is out of range for a dim of size %d (valid: 1..%d or -%d..-1)", fname, i, size, size, size))
end
M.cdim, M.cdim_n, M.cpos = cdim, cdim_n, cpos

-- ---- shapes -----------------------------------------------------------------------------------------------
local function shape_str(s)
  local parts = {}
  for i = 1, #s do parts[i] = tostring(s[i]) end
  return "[" .. concat_strings(parts, ", ") .. "]"
end
M.shape_str = shape_str

local function shape_of(t)
  local p = raw(t)
  local s = {}
  for i = 0, p.ndim - 1 do s[i + 1] = tonumber(p.shape[i]) end
  return s
end

-- a Lua shape table -> (ndim, int64_t[]) ; allow_neg lets one -1 through (reshape)
local function shape_arg(shape, fname, allow_neg)
  if type(shape) ~= "table" then
    raise(fmt("%s: shape must be a table of sizes like {2, 3}, got %s", fname, type(shape)))
  end
  local n = #shape
  if n > 8 then raise(fmt("%s: at most 8 dims, got %d", fname, n)) end
  local buf = I64A(n > 0 and n or 1)
  for i = 1, n do
    local v = shape[i]
    if type(v) ~= "number" or v ~= floor(v) or (v < 0 and not (allow_neg and v == -1)) then
      raise(fmt("%s: size %d must be a non-negative integer, got %s (shape %s)", fname, i, tostring(v),
                shape_str(shape)))
    end
    buf[i - 1] = v
  end
  return n, buf
end

-- f(2, 3, opts) or f({2, 3}, opts) -> shape, opts
local function shape_and_opts(fname, ...)
  local a = ...
  if type(a) == "table" then return a, select(2, ...) end
  if type(a) == "number" then
    local shape, n = {}, select("#", ...)
    for i = 1, n do
      local v = select(i, ...)
      if type(v) == "number" then shape[#shape + 1] = v
      else return shape, v end
    end
    return shape, nil
  end
  raise(fmt("%s: expected a shape like {2, 3}, got %s", fname, type(a)))
end

local function opts_arg(opts, fname)
  if opts ~= nil and type(opts) ~= "table" then
    raise(fmt("%s: options must be a table like {dtype=\"f32\", device=\"cpu\"}, got %s", fname, type(opts)))
  end
  opts = opts or {}
  return M.dtype_id(opts.dtype, fname), M.device_id(opts.device, fname), opts
end

local function finish(t, opts)
  if opts.requires_grad then check_status(C.tide_set_requires_grad(raw(t), 1)) end
  return t
end

-- ---- creation -------------------------------------------------------------------------------------------
-- tide.empty / zeros / ones(shape | d1, d2, ..., opts): the engine's tide_<kind>(dtype, ndim, shape, device)
local function constructor(kind)
  local name, make = "tide." .. kind, C["tide_" .. kind]
  return function(...)
    local shape, o = shape_and_opts(name, ...)
    local dt, dev, opts = opts_arg(o, name)
    local n, buf = shape_arg(shape, name)
    return finish(check(make(dt, n, buf, dev)), opts)
  end
end
M.empty, M.zeros, M.ones = constructor("empty"), constructor("zeros"), constructor("ones")

-- tide.full(shape, value, opts)
function M.full(shape, value, o)
  if type(value) ~= "number" then raise("tide.full: value must be a number, got " .. type(value)) end
  local dt, dev, opts = opts_arg(o, "tide.full")
  local n, buf = shape_arg(shape, "tide.full")
  return finish(check(C.tide_full(dt, n, buf, dev, value)), opts)
end

-- tide.arange(n) = 0..n-1 ; tide.arange(a, b[, step]) = [a, b) ; an options table may come last
function M.arange(a, b, step, o)
  if type(b) == "table" then o, b, step = b, nil, nil elseif type(step) == "table" then o, step = step, nil end
  if b == nil then a, b = 0, a end
  step = step or 1
  for _, v in ipairs { a, b, step } do
    if type(v) ~= "number" then raise("tide.arange: bounds and step must be numbers, got " .. type(v)) end
  end
  local dt, dev, opts = opts_arg(o, "tide.arange")
  return finish(check(C.tide_arange(dt, a, b, step, dev)), opts)
end

-- tide.randn(shape, {mean=0, std=1, dtype=, device=})
function M.randn(...)
  local shape, o = shape_and_opts("tide.randn", ...)
  local dt, dev, opts = opts_arg(o, "tide.randn")
  local n, buf = shape_arg(shape, "tide.randn")
  return finish(check(C.tide_randn(dt, n, buf, dev, opts.mean or 0, opts.std or 1)), opts)
end

-- tide.rand(shape, {lo=0, hi=1, dtype=, device=}): uniform in [lo, hi)
function M.rand(...)
  local shape, o = shape_and_opts("tide.rand", ...)
  local dt, dev, opts = opts_arg(o, "tide.rand")
  local n, buf = shape_arg(shape, "tide.rand")
  return finish(check(C.tide_rand(dt, n, buf, dev, opts.lo or 0, opts.hi or 1)), opts)
end

-- nested table -> shape and flat values (ragged tables and non-numbers are errors). The index path of an element
-- is only spelled out for an error message: building it per element made large tables slow.
local function flatten_table(data, fname)
  local shape, node = {}, data
  while type(node) == "table" do
    shape[#shape + 1] = #node
    if #node == 0 then break end
    node = node[1]
  end
  if #shape > 8 then raise(fmt("%s: at most 8 dims, got %d", fname, #shape)) end
  local flat, nd, n, idx = {}, #shape, 0, {}
  local function where(d)
    local w = ""
    for k = 1, d - 1 do w = w .. "[" .. idx[k] .. "]" end
    return w
  end
  local function number(x, d)
    if type(x) == "boolean" then return x and 1 or 0 end
    if type(x) ~= "number" then raise(fmt("%s: element %s must be a number, got %s", fname, where(d), type(x))) end
    return x
  end
  local function ragged(x, d)
    raise(fmt("%s: ragged nested table: element %s has %s, expected %d entries (shape %s)", fname, where(d),
              type(x) == "table" and (#x .. " entries") or ("a " .. type(x)), shape[d], shape_str(shape)))
  end
  if nd == 1 then
    for i = 1, shape[1] do idx[1] = i; n = n + 1; flat[n] = number(data[i], 2) end
    return shape, flat
  end
  local function walk(x, d)
    if d > nd then
      n = n + 1
      flat[n] = number(x, d)
      return
    end
    if type(x) ~= "table" or #x ~= shape[d] then ragged(x, d) end
    for i = 1, shape[d] do idx[d] = i; walk(x[i], d + 1) end
  end
  walk(data, 1)
  return shape, flat
end

-- tide.tensor(data, opts): data is a number (0-d), a flat or nested table of numbers, or a tensor (copied).
-- opts.shape reshapes a flat table. Default dtype f32.
function M.from_table(data, o)
  local fname = "tide.tensor"
  local dt, dev, opts = opts_arg(o, fname)
  if is_tensor(data) then
    local t = data:to(opts.dtype or data:dtype(), opts.device or data:device()):clone()
    return finish(t, opts)
  end
  local shape, flat
  if type(data) == "number" or type(data) == "boolean" then
    shape, flat = {}, { type(data) == "boolean" and (data and 1 or 0) or data }
  elseif type(data) == "table" then
    shape, flat = flatten_table(data, fname)
  else
    raise(fmt("%s: expected a number or a table of numbers, got %s", fname, type(data)))
  end
  if opts.shape then
    local n = 1
    for _, s in ipairs(opts.shape) do n = n * s end
    if n ~= #flat then
      raise(fmt("%s: shape %s holds %d elements but the data has %d", fname, shape_str(opts.shape), n, #flat))
    end
    shape = opts.shape
  end
  local n, sbuf = shape_arg(shape, fname)
  local vals = F64A(#flat > 0 and #flat or 1)
  for i = 1, #flat do vals[i - 1] = flat[i] end
  return finish(check(C.tide_from_f64(dt, n, sbuf, dev, vals)), opts)
end

function M.zeros_like(t, o)
  o = o or {}
  return M.zeros(shape_of(t), { dtype = o.dtype or t:dtype(), device = o.device or t:device(),
                                requires_grad = o.requires_grad })
end
function M.ones_like(t, o)
  o = o or {}
  return M.ones(shape_of(t), { dtype = o.dtype or t:dtype(), device = o.device or t:device(),
                               requires_grad = o.requires_grad })
end

-- ---- argument helpers for methods --------------------------------------------------------------------------
local function want_tensor(x, fname, arg)
  if not is_tensor(x) then
    raise(fmt("%s: %s must be a tensor, got %s", fname, arg, type(x) == "cdata" and tostring(ffi.typeof(x)) or type(x)))
  end
  return raw(x)
end
M.want_tensor = want_tensor

local function want_number(x, fname, arg)
  if type(x) ~= "number" then raise(fmt("%s: %s must be a number, got %s", fname, arg, type(x))) end
  return x
end

-- dims argument of reductions: nil (all), a number, or a table of dims -> n, int[]
local function dims_arg(t, dims, fname)
  if dims == nil then return 0, nil end
  if type(dims) == "number" then dims = { dims } end
  if type(dims) ~= "table" then raise(fmt("%s: dims must be a number or a table of numbers, got %s", fname, type(dims))) end
  local n = #dims
  local buf = INTA(n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = cdim(t, dims[i], fname) end
  return n, buf
end

-- varargs of numbers or one table -> Lua array
local function list_arg(fname, ...)
  local a = ...
  if type(a) == "table" then return a end
  local r = { ... }
  for i = 1, select("#", ...) do
    if type(r[i]) ~= "number" then raise(fmt("%s: argument %d must be a number, got %s", fname, i, type(r[i]))) end
  end
  return r
end

local function bool_int(x) return (x and x ~= 0) and 1 or 0 end

-- ---- metadata ----------------------------------------------------------------------------------------------
function methods.shape(t) return shape_of(t) end
-- size along one dim (1-based, negative from the end), or the shape when dim is nil
function methods.size(t, d)
  if d == nil then return shape_of(t) end
  return tonumber(raw(t).shape[cdim(t, d, "size")])
end
function methods.dim(t) return raw(t).ndim end
methods.ndim = methods.dim
function methods.numel(t) return tonumber(raw(t).numel) end
function methods.dtype(t) return DTYPE_NAMES[raw(t).dtype] end
function methods.device(t) return M.device_name(raw(t).device) end
function methods.is_cuda(t) return raw(t).device > 0 end
function methods.is_float(t) return is_float_dtype(raw(t).dtype) end
function methods.stride(t)
  local p, s = raw(t), {}
  for i = 0, p.ndim - 1 do s[i + 1] = tonumber(p.stride[i]) end
  return s
end
function methods.is_contiguous(t) return C.tide_is_contiguous(raw(t)) ~= 0 end
function methods.nbytes(t) return tonumber(C.tide_tensor_nbytes(raw(t))) end
function methods.element_size(t) return dtype_size[raw(t).dtype] end
-- identity of the underlying bytes: equal for tensors sharing storage
function methods.storage_id(t) return tonumber(ffi.cast("intptr_t", C.tide_tensor_storage_id(raw(t)))) end
function methods.ptr(t) return raw(t) end
function methods.requires_grad(t) return raw(t).requires_grad ~= 0 end
function methods.is_leaf(t) return raw(t).node == nil end

-- ---- reading values ----------------------------------------------------------------------------------------
local function read_f64(t)
  local p = raw(t)
  local n = tonumber(p.numel)
  local buf = F64A(n > 0 and n or 1)
  check_status(C.tide_to_f64_buffer(p, buf, n))
  return buf, n
end

-- the single value of a one-element tensor, as a Lua number
function methods.item(t)
  local p = raw(t)
  if p.numel ~= 1 then
    raise(fmt("item: tensor must have exactly one element, shape is %s", shape_str(shape_of(t))))
  end
  local buf = read_f64(t)
  return buf[0]
end

-- all values in row-major order as an FFI double[n] (0-based) and n: what tolist reads, without a Lua table
function methods.f64_array(t) return read_f64(t) end

-- all values in row-major order as a flat Lua array
function methods.tolist(t)
  local buf, n = read_f64(t)
  local r = {}
  for i = 1, n do r[i] = buf[i - 1] end
  return r
end

-- nested Lua tables following the shape (a number for a 0-d tensor)
function methods.totable(t)
  local buf = read_f64(t)
  local shape = shape_of(t)
  local nd = #shape
  if nd == 0 then return buf[0] end
  local pos = 0
  local function build(d)
    local r = {}
    if d == nd then
      for i = 1, shape[d] do r[i] = buf[pos]; pos = pos + 1 end
    else
      for i = 1, shape[d] do r[i] = build(d + 1) end
    end
    return r
  end
  return build(1)
end

-- ---- autograd -----------------------------------------------------------------------------------------------
-- t:backward([grad]) : t must have one element unless grad (same shape as t) is given
function methods.backward(t, grad)
  local g = nil
  if grad ~= nil then g = want_tensor(grad, "backward", "grad") end
  check_status(C.tide_backward(raw(t), g))
end
-- marks a leaf as requiring grad (flag defaults to true); returns t
function methods.requires_grad_(t, flag)
  if flag == nil then flag = true end
  check_status(C.tide_set_requires_grad(raw(t), flag and 1 or 0))
  return t
end
-- the accumulated gradient of a leaf, or nil
function methods.grad(t)
  local g = C.tide_grad(raw(t))
  if g == nil then return nil end
  return wrap(g)
end
function methods.set_grad(t, g)
  check_status(C.tide_set_grad(raw(t), g ~= nil and want_tensor(g, "set_grad", "grad") or nil))
  return t
end
function methods.zero_grad(t) C.tide_zero_grad(raw(t)); return t end
-- same storage, no history
function methods.detach(t) return check(C.tide_detach(raw(t))) end

-- ---- in-place (never recorded on the graph) -------------------------------------------------------------------
function methods.fill_(t, v) check_status(C.tide_fill_(raw(t), want_number(v, "fill_", "value"))); return t end
function methods.zero_(t) check_status(C.tide_fill_(raw(t), 0)); return t end
-- copies src (a tensor of the same shape, any dtype/device, a nested or flat table, or a number) into t
function methods.copy_(t, src)
  if type(src) == "number" then return methods.fill_(t, src) end
  if type(src) == "table" then
    src = M.from_table(src, { dtype = t:dtype() })
    if src:numel() == t:numel() then src = methods.reshape(src, shape_of(t)) end
  end
  check_status(C.tide_copy_(raw(t), want_tensor(src, "copy_", "src")))
  return t
end
function methods.randn_(t, mean, std) check_status(C.tide_randn_(raw(t), mean or 0, std or 1)); return t end
function methods.rand_(t, lo, hi) check_status(C.tide_rand_(raw(t), lo or 0, hi or 1)); return t end
function methods.scale_(t, s) check_status(C.tide_scale_(raw(t), want_number(s, "scale_", "s"))); return t end
-- t += a * x
function methods.axpy_(t, a, x)
  check_status(C.tide_axpy_(raw(t), want_number(a, "axpy_", "a"), want_tensor(x, "axpy_", "x")))
  return t
end
local sq = ffi.new("double[1]")
function methods.sum_squares(t)
  check_status(C.tide_sum_squares(raw(t), sq))
  return sq[0]
end
function methods.all_finite(t)
  local r = C.tide_all_finite(raw(t))
  if r < 0 then raise(last_error()) end
  return r == 1
end
-- a contiguous copy with no history (use t * 1 for a differentiable copy)
function methods.clone(t)
  local p = raw(t)
  local c = check(C.tide_empty(p.dtype, p.ndim, p.shape, p.device))
  check_status(C.tide_copy_(raw(c), p))
  return c
end

-- ---- layout (differentiable views) -------------------------------------------------------------------------
-- t:reshape(2, -1) or t:reshape{2, -1}
function methods.reshape(t, ...)
  local shape = list_arg("reshape", ...)
  local n, buf = shape_arg(shape, "reshape", true)
  return check(C.tide_reshape(raw(t), n, buf))
end
-- like reshape, but only for contiguous tensors (guaranteed to share storage)
function methods.view(t, ...)
  if C.tide_is_contiguous(raw(t)) == 0 then
    raise("view: tensor of shape " .. shape_str(shape_of(t)) .. " is not contiguous; use reshape or contiguous()")
  end
  return methods.reshape(t, ...)
end
function methods.permute(t, ...)
  local perm = list_arg("permute", ...)
  local n = #perm
  if n ~= raw(t).ndim then
    raise(fmt("permute: got %d dims for a %d-d tensor", n, raw(t).ndim))
  end
  local buf = INTA(n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = cdim(t, perm[i], "permute") end
  return check(C.tide_permute(raw(t), n, buf))
end
-- swaps two dims (default: the last two)
function methods.transpose(t, a, b)
  a, b = a or -2, b or -1
  return check(C.tide_transpose(raw(t), cdim(t, a, "transpose"), cdim(t, b, "transpose")))
end
-- elements start .. start+len-1 along dim (1-based start; negative counts from the end)
function methods.narrow(t, d, start, len)
  local cd = cdim(t, d, "narrow")
  local size = tonumber(raw(t).shape[cd])
  local s0 = cpos(start, size, "narrow")
  want_number(len, "narrow", "length")
  if len < 0 or s0 + len > size then
    raise(fmt("narrow: start %d with length %d runs past the end of dim %d (size %d)", start, len, d, size))
  end
  return check(C.tide_slice(raw(t), cd, s0, s0 + len, 1))
end
-- set_length_(d, len): dim d of this view set to len in place, inside its storage (a decoding cache's view of the
-- filled part of its buffer, grown a token a step); only a view without graph that no other engine object holds
function methods.set_length_(t, d, len)
  local cd = cdim(t, d, "set_length_")
  want_number(len, "set_length_", "length")
  check_status(C.tide_view_set_length(raw(t), cd, len))
  return t
end
-- elements i..j (inclusive, 1-based, negative from the end; j defaults to the last) with a step
function methods.slice(t, d, i, j, step)
  local cd = cdim(t, d, "slice")
  local size = tonumber(raw(t).shape[cd])
  local s0 = cpos(i or 1, size, "slice")
  local e0 = cpos(j or -1, size, "slice")
  step = step or 1
  if step < 1 or step ~= floor(step) then raise("slice: step must be a positive integer, got " .. tostring(step)) end
  if e0 < s0 then raise(fmt("slice: end %d comes before start %d", j, i)) end
  return check(C.tide_slice(raw(t), cd, s0, e0 + 1, step))
end
-- removes dim d (default: every dim of size 1); the removed dims must have size 1
function methods.squeeze(t, d)
  local shape = shape_of(t)
  local out = {}
  if d == nil then
    for _, s in ipairs(shape) do if s ~= 1 then out[#out + 1] = s end end
  else
    local cd = cdim(t, d, "squeeze") + 1
    if shape[cd] ~= 1 then raise(fmt("squeeze: dim %d has size %d, not 1 (shape %s)", d, shape[cd], shape_str(shape))) end
    for i, s in ipairs(shape) do if i ~= cd then out[#out + 1] = s end end
  end
  return methods.reshape(t, out)
end
-- inserts a dim of size 1 at position d (1..ndim+1; -1 appends)
function methods.unsqueeze(t, d)
  local shape = shape_of(t)
  local cd = cdim_n(#shape + 1, d, "unsqueeze") + 1
  table.insert(shape, cd, 1)
  return methods.reshape(t, shape)
end
-- the sub-tensor at position i of dim d (that dim removed)
function methods.select(t, d, i)
  local cd = cdim(t, d, "select")
  local size = tonumber(raw(t).shape[cd])
  local s0 = cpos(i, size, "select")
  local v = check(C.tide_slice(raw(t), cd, s0, s0 + 1, 1))
  local shape = shape_of(t)
  table.remove(shape, cd + 1)
  return methods.reshape(v, shape)
end
-- merges dims a..b (default all) into one
function methods.flatten(t, a, b)
  local shape = shape_of(t)
  if #shape == 0 then return methods.reshape(t, { 1 }) end
  local ca, cb = cdim(t, a or 1, "flatten") + 1, cdim(t, b or -1, "flatten") + 1
  local out, n = {}, 1
  for i = 1, ca - 1 do out[#out + 1] = shape[i] end
  for i = ca, cb do n = n * shape[i] end
  out[#out + 1] = n
  for i = cb + 1, #shape do out[#out + 1] = shape[i] end
  return methods.reshape(t, out)
end
-- broadcast view to shape (aligned from the right; -1 keeps a size)
function methods.expand(t, ...)
  local shape = list_arg("expand", ...)
  local own = shape_of(t)
  local target = {}
  for i = 1, #shape do
    local s = shape[i]
    if s == -1 then
      local j = i - (#shape - #own)
      if j < 1 then raise("expand: -1 is not allowed for a new leading dim") end
      s = own[j]
    end
    target[i] = s
  end
  local n, buf = shape_arg(target, "expand")
  return check(C.tide_expand(raw(t), n, buf))
end
function methods.expand_as(t, other) return methods.expand(t, shape_of(other)) end
-- a contiguous tensor (t itself when already contiguous)
function methods.contiguous(t)
  if C.tide_is_contiguous(raw(t)) ~= 0 then return t end
  return check(C.tide_contiguous(raw(t)))
end
-- t:to("f64"), t:to("cuda"), t:to{dtype=, device=}
function methods.to(t, x, y)
  local dtype, device
  if type(x) == "table" then dtype, device = x.dtype, x.device
  else
    for _, v in ipairs { x, y } do
      if v ~= nil then
        if type(v) == "string" and DTYPES[v] then dtype = v else device = v end
      end
    end
  end
  local r = t
  if dtype ~= nil then
    local id = M.dtype_id(dtype, "to")
    if id ~= raw(r).dtype then r = check(C.tide_to_dtype(raw(r), id)) end
  end
  if device ~= nil then
    local id = M.device_id(device, "to")
    if id ~= raw(r).device then r = check(C.tide_to_device(raw(r), id)) end
  end
  return r
end
function methods.cpu(t) return methods.to(t, "cpu") end
function methods.cuda(t, n) return methods.to(t, n and ("cuda:" .. n) or "cuda") end
for name in pairs { f32 = 1, f64 = 1, bf16 = 1, i32 = 1, i64 = 1, u8 = 1 } do
  methods[name] = function(t) return methods.to(t, name) end
end

-- ---- arithmetic ----------------------------------------------------------------------------------------------
local function operand_error(op, x)
  raise(fmt("%s: expected tensors or numbers, got %s", op, type(x) == "cdata" and tostring(ffi.typeof(x)) or type(x)))
end

local function add(a, b)
  if is_tensor(a) then
    if is_tensor(b) then return check(C.tide_add(raw(a), raw(b))) end
    if type(b) == "number" then return check(C.tide_add_scalar(raw(a), b)) end
    operand_error("add", b)
  elseif type(a) == "number" and is_tensor(b) then
    return check(C.tide_add_scalar(raw(b), a))
  end
  operand_error("add", a)
end

local function sub(a, b)
  if is_tensor(a) then
    if is_tensor(b) then return check(C.tide_sub(raw(a), raw(b))) end
    if type(b) == "number" then return check(C.tide_add_scalar(raw(a), -b)) end
    operand_error("sub", b)
  elseif type(a) == "number" and is_tensor(b) then
    local nb = check(C.tide_neg(raw(b)))
    return check(C.tide_add_scalar(raw(nb), a))
  end
  operand_error("sub", a)
end

local function mul(a, b)
  if is_tensor(a) then
    if is_tensor(b) then return check(C.tide_mul(raw(a), raw(b))) end
    if type(b) == "number" then return check(C.tide_mul_scalar(raw(a), b)) end
    operand_error("mul", b)
  elseif type(a) == "number" and is_tensor(b) then
    return check(C.tide_mul_scalar(raw(b), a))
  end
  operand_error("mul", a)
end

local function div(a, b)
  if is_tensor(a) then
    if is_tensor(b) then return check(C.tide_div(raw(a), raw(b))) end
    if type(b) == "number" then return check(C.tide_mul_scalar(raw(a), 1 / b)) end
    operand_error("div", b)
  elseif type(a) == "number" and is_tensor(b) then
    local inv = check(C.tide_pow_scalar(raw(b), -1))
    return check(C.tide_mul_scalar(raw(inv), a))
  end
  operand_error("div", a)
end

local function pow(a, b)
  if is_tensor(a) then
    if type(b) == "number" then return check(C.tide_pow_scalar(raw(a), b)) end
    operand_error("pow (exponent must be a number)", b)
  elseif type(a) == "number" and is_tensor(b) then
    if a <= 0 then raise(fmt("pow: base %s ^ tensor needs a positive base", tostring(a))) end
    return check(C.tide_exp(raw(check(C.tide_mul_scalar(raw(b), math.log(a))))))
  end
  operand_error("pow", a)
end

methods.add, methods.sub, methods.mul, methods.div, methods.pow = add, sub, mul, div, pow
function methods.neg(t) return check(C.tide_neg(raw(t))) end

-- unary elementwise ops
for _, name in ipairs { "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "softplus", "relu", "abs" } do
  local f = C["tide_" .. name]
  methods[name] = function(t) return check(f(raw(t))) end
end

-- t:matmul(b[, ta, tb]): ta/tb use a or b transposed (see tide.h)
function methods.matmul(a, b, ta, tb)
  return check(C.tide_matmul(raw(a), want_tensor(b, "matmul", "b"), bool_int(ta), bool_int(tb)))
end

-- ---- reductions ----------------------------------------------------------------------------------------------
-- t:sum() over everything; t:sum(2) or t:sum({1, 3}, true) over dims, keepdim optional
function methods.sum(t, dims, keepdim)
  local n, buf = dims_arg(t, dims, "sum")
  return check(C.tide_sum(raw(t), n, buf, bool_int(keepdim)))
end
function methods.mean(t, dims, keepdim)
  local n, buf = dims_arg(t, dims, "mean")
  return check(C.tide_mean(raw(t), n, buf, bool_int(keepdim)))
end
-- over one dim; without a dim, over all elements (a 0-d result)
local function flat_if_nil(t, d, fname)
  if d == nil then return methods.reshape(t, { -1 }), 0 end
  return t, cdim(t, d, fname)
end
function methods.max(t, d, keepdim)
  local x, cd = flat_if_nil(t, d, "max")
  return check(C.tide_max(raw(x), cd, bool_int(keepdim)))
end
-- i64 positions (0-based data, like every index tensor)
function methods.argmax(t, d, keepdim)
  local x, cd = flat_if_nil(t, d, "argmax")
  return check(C.tide_argmax(raw(x), cd, bool_int(keepdim)))
end
function methods.logsumexp(t, d, keepdim)
  local x, cd = flat_if_nil(t, d, "logsumexp")
  return check(C.tide_logsumexp(raw(x), cd, bool_int(keepdim)))
end
function methods.softmax(t, d) return check(C.tide_softmax(raw(t), cdim(t, d or -1, "softmax"))) end
function methods.log_softmax(t, d) return check(C.tide_log_softmax(raw(t), cdim(t, d or -1, "log_softmax"))) end

-- ops living in tide.F, offered as methods too
for _, name in ipairs { "index_select", "gather", "scatter_add", "split", "rmsnorm", "layernorm", "rope" } do
  methods[name] = function(t, ...) return require("tide.functional")[name](t, ...) end
end

-- ---- printing ----------------------------------------------------------------------------------------------
-- a dim longer than 2 * edge shows its first and last `edge` entries: 3 in the two innermost dims,
-- 1 in the outer ones (a [9, 9, 9, 9] tensor prints 2 x 2 blocks of 6 x 6)
local function edge_of(d, nd) return d >= nd - 1 and 3 or 1 end

local function header(t)
  local p = raw(t)
  local extra = ""
  if p.requires_grad ~= 0 then extra = p.node ~= nil and ", grad_fn" or ", requires_grad" end
  return fmt("tide.tensor(%s, %s, %s%s)", DTYPE_NAMES[p.dtype] or "?", shape_str(shape_of(t)),
             M.device_name(p.device), extra)
end

local function format_value(v, is_int)
  if is_int then return fmt("%d", v) end
  if v ~= v then return "nan" end
  if v == huge then return "inf" elseif v == -huge then return "-inf" end
  return fmt("%.4g", v)
end

local function body(t)
  local p = raw(t)
  local shape = shape_of(t)
  local nd = #shape
  if p.numel == 0 then return "[]" end
  -- cut long dims down to their edges, without history
  local x, cut = t, {}
  local prev = C.tide_set_grad_enabled(0)
  local ok, err = pcall(function()
    for d = 1, nd do
      local e = edge_of(d, nd)
      if shape[d] > 2 * e then
        cut[d] = e
        local a = check(C.tide_slice(raw(x), d - 1, 0, e, 1))
        local b = check(C.tide_slice(raw(x), d - 1, shape[d] - e, shape[d], 1))
        local pair = TPA(2, raw(a), raw(b))
        x = check(C.tide_concat(2, pair, d - 1))
      end
    end
  end)
  C.tide_set_grad_enabled(prev)
  if not ok then return "<values unavailable: " .. tostring(err) .. ">" end
  local buf = read_f64(x)
  local xs = shape_of(x)
  local is_int = not is_float_dtype(p.dtype)
  local strs, width = {}, 0
  for i = 0, tonumber(raw(x).numel) - 1 do
    local s = format_value(buf[i], is_int)
    strs[i] = s
    if #s > width then width = #s end
  end
  if nd == 0 then return strs[0] end
  local stride = {}
  stride[nd] = 1
  for d = nd - 1, 1, -1 do stride[d] = stride[d + 1] * xs[d + 1] end
  local function render(d, off, indent)
    local parts = {}
    for i = 1, xs[d] do
      if cut[d] and i == cut[d] + 1 then parts[#parts + 1] = "..." end
      local o = off + (i - 1) * stride[d]
      if d == nd then
        parts[#parts + 1] = fmt("%" .. width .. "s", strs[o])
      else
        parts[#parts + 1] = render(d + 1, o, indent .. " ")
      end
    end
    if d == nd then return "[" .. concat_strings(parts, ", ") .. "]" end
    local sep = "," .. string.rep("\n", nd - d) .. indent .. " "
    return "[" .. concat_strings(parts, sep) .. "]"
  end
  return render(1, 0, "")
end

local mt = {}
mt.__index = function(t, k)
  local m = methods[k]
  if m ~= nil then return m end
  if type(k) == "number" then return methods.select(t, 1, k) end
  return nil
end
-- t[i] = value (number or tensor/table shaped like t[i]) writes into row i of dim 1
mt.__newindex = function(t, k, v)
  if type(k) ~= "number" then raise(fmt("tensors have no settable field '%s'", tostring(k))) end
  if raw(t).ndim == 0 then raise("cannot index a 0-d tensor") end
  local row = methods.narrow(t, 1, k, 1)
  if type(v) == "number" then
    check_status(C.tide_fill_(raw(row), v))
  else
    if not is_tensor(v) then v = M.from_table(v, { dtype = t:dtype() }) end
    local s = shape_of(row)
    check_status(C.tide_copy_(raw(row), raw(methods.reshape(v, s))))
  end
end
mt.__len = function(t)
  local p = raw(t)
  if p.ndim == 0 then raise("#: a 0-d tensor has no length") end
  return tonumber(p.shape[0])
end
mt.__tostring = function(t) return header(t) .. "\n" .. body(t) end
mt.__add, mt.__sub, mt.__mul, mt.__div, mt.__pow = add, sub, mul, div, pow
mt.__unm = function(t) return check(C.tide_neg(raw(t))) end

-- short description without values
function methods.describe(t) return header(t) end

-- (a fresh copy of this module, loaded again by a test, keeps the first metatable: metatypes are permanent)
pcall(ffi.metatype, "struct tide_lua_tensor", mt)
M.metatable = mt

return M
