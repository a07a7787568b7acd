-- tide.testing: the small test framework of tests/lua.
--
--   local T = require "tide.testing"
--   T.test("adds", function() T.near(1 + 1, 2, 0) end)
--   T.run()    -- one line per case, then "N passed, M failed"; exits 1 when something failed
--
-- Assertions raise errors located at the test's line. T.gradcheck compares backward with float64
-- central differences. TIDE_TEST_FILTER (plain text) runs only the cases whose name contains it.
local ffi = require "ffi"

local T = {}
local cases = {}

-- registers a test case
function T.test(name, fn)
  if type(name) ~= "string" or type(fn) ~= "function" then
    error("T.test(name, fn): expected a string and a function", 2)
  end
  cases[#cases + 1] = { name = name, fn = fn }
end

local function tide() return require "tide" end

local function is_tensor(x)
  return type(x) == "cdata" and tide().is_tensor(x)
end

local function fail(msg, level) error(msg, (level or 2) + 1) end

local function now()
  local ok, td = pcall(tide)
  if ok then return td.time() end
  return os.clock()
end

local function describe(x)
  if is_tensor(x) then return x:describe() end
  if type(x) == "string" then return string.format("%q", x) end
  return tostring(x)
end

-- flattens numbers / nested tables / tensors into (flat list, shape)
local function flatten(x)
  if type(x) == "number" then return { x }, {} end
  if is_tensor(x) then return x:tolist(), x:shape() end
  if type(x) == "table" then
    local flat, shape = {}, {}
    local node = x
    while type(node) == "table" do shape[#shape + 1] = #node; node = node[1] end
    local function walk(v)
      if type(v) == "table" then for i = 1, #v do walk(v[i]) end else flat[#flat + 1] = v end
    end
    walk(x)
    return flat, shape
  end
  return nil
end

local function shape_str(s)
  local p = {}
  for i, v in ipairs(s) do p[i] = tostring(v) end
  return "[" .. table.concat(p, ", ") .. "]"
end

local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- T.near(a, b, tol, msg): a and b are numbers, (nested) tables or tensors of equal shape; each element
-- must satisfy |a - b| <= tol * max(1, |b|) (absolute below 1, relative above). NaN never passes.
-- A tensor compared with a number checks every element against it.
function T.near(a, b, tol, msg)
  tol = tol or 1e-6
  local fa, sa = flatten(a)
  local fb, sb = flatten(b)
  if not fa or not fb then fail(string.format("%snear: cannot compare %s with %s", msg and (msg .. ": ") or "", type(a), type(b))) end
  if #fb == 1 and #sb == 0 and #fa ~= 1 then
    for i = 2, #fa do fb[i] = fb[1] end
    sb = sa
  end
  if #fa ~= #fb or (#sa > 0 and #sb > 0 and not same_shape(sa, sb)) then
    fail(string.format("%sshapes differ: %s vs %s", msg and (msg .. ": ") or "", shape_str(sa), shape_str(sb)))
  end
  for i = 1, #fa do
    local x, y = fa[i], fb[i]
    local bound = tol * math.max(1, math.abs(y))
    if not (math.abs(x - y) <= bound) then
      fail(string.format("%selement %d: got %.10g, expected %.10g (|diff| %.3g > %.3g)", msg and (msg .. ": ") or "",
                         i, x, y, math.abs(x - y), bound))
    end
  end
  return true
end

local function deep_eq(a, b)
  if is_tensor(a) or is_tensor(b) then
    if not (is_tensor(a) and is_tensor(b)) then return false end
    if a:dtype() ~= b:dtype() or not same_shape(a:shape(), b:shape()) then return false end
    local la, lb = a:tolist(), b:tolist()
    for i = 1, #la do if la[i] ~= lb[i] then return false end end
    return true
  end
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then return a == b end
  for k, v in pairs(a) do if not deep_eq(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

-- T.eq(a, b, msg): equality; tables compare deeply, tensors by dtype, shape and exact values
function T.eq(a, b, msg)
  if not deep_eq(a, b) then
    local da, db = describe(a), describe(b)
    if type(a) == "table" and type(b) == "table" then
      local ok, json = pcall(require, "tide.json")
      if ok and type(json) == "table" and json.encode then
        da, db = tostring(json.encode(a)), tostring(json.encode(b))
      end
    end
    fail(string.format("%sexpected %s, got %s", msg and (msg .. ": ") or "", db, da))
  end
  return true
end

-- T.ok(cond, msg): cond must be truthy
function T.ok(cond, msg)
  if not cond then fail(msg or "expected a true value") end
  return cond
end

-- T.raises(fn, text): fn() must raise an error whose message contains text (plain, not a pattern).
-- Returns the message.
function T.raises(fn, text, msg)
  local ok, err = pcall(fn)
  if ok then fail(string.format("%sexpected an error%s, but none was raised", msg and (msg .. ": ") or "",
                                text and (" containing '" .. text .. "'") or "")) end
  err = tostring(err)
  if text and not err:find(text, 1, true) then
    fail(string.format("%sexpected an error containing '%s', got: %s", msg and (msg .. ": ") or "", text, err))
  end
  return err
end

-- ---- helpers the test files share -------------------------------------------------------------------------
-- T.max_abs_diff(a, b) -> max |a_i − b_i| over two tensors (or flat lists) of equal element count; math.huge when
-- some difference is NaN, so a "< tol" assertion fails on it
function T.max_abs_diff(a, b)
  local x = is_tensor(a) and a:tolist() or a
  local y = is_tensor(b) and b:tolist() or b
  if #x ~= #y then fail(string.format("max_abs_diff: %d elements vs %d", #x, #y)) end
  local m = 0
  for i = 1, #x do
    local d = math.abs(x[i] - y[i])
    if d ~= d then return math.huge end
    if d > m then m = d end
  end
  return m
end

-- T.max_abs(a) -> max |a_i| over a tensor (or flat list)
function T.max_abs(a)
  local m = 0
  for _, v in ipairs(is_tensor(a) and a:tolist() or a) do m = math.max(m, math.abs(v)) end
  return m
end

-- T.tmpdir(name, opts) -> a fresh directory path under $TMPDIR (or /tmp), unique to this run; anything at that path
-- is removed first, opts.create = true makes the directory. T.run removes every such directory when it ends.
local tmpdirs = {}
function T.tmpdir(name, opts)
  local C = tide().C
  local dir = string.format("%s/tide-test-%d-%s", os.getenv("TMPDIR") or "/tmp", math.floor(now() * 1e6) % 1e9, name)
  C.tide_remove_tree(dir)
  if opts and opts.create and C.tide_mkdir_p(dir) ~= 0 then fail("tmpdir: cannot create " .. dir) end
  tmpdirs[#tmpdirs + 1] = dir
  return dir
end

-- ---- gradient check ----------------------------------------------------------------------------------
-- T.gradcheck(fn, inputs, opts): fn(unpack(inputs)) -> tensor; inputs are f64 tensors requiring grad.
-- Compares d(sum(out * R))/d(input) from backward with central differences, R a fixed pseudo-random
-- weighting (Philox, independent of the global RNG, whose state is restored before each evaluation so
-- stochastic ops repeat). opts: eps (1e-6), atol (1e-6), rtol (1e-4), max_checks per input (100,
-- evenly spaced elements beyond that). An element passes when |a - n| <= atol + rtol * |n|.
-- Returns the largest |analytic - numeric|; raises with the worst elements otherwise.
function T.gradcheck(fn, inputs, opts)
  local td = tide()
  local C = td.C
  opts = opts or {}
  local eps, atol, rtol = opts.eps or 1e-6, opts.atol or 1e-6, opts.rtol or 1e-4
  local max_checks = opts.max_checks or 100
  for i, x in ipairs(inputs) do
    if not is_tensor(x) then fail("gradcheck: input " .. i .. " is not a tensor") end
    if x:dtype() ~= "f64" then fail("gradcheck: input " .. i .. " is " .. x:dtype() .. "; use f64 inputs") end
    if not x:requires_grad() then fail("gradcheck: input " .. i .. " does not require grad") end
    if not x:is_contiguous() then fail("gradcheck: input " .. i .. " must be contiguous") end
  end
  local seed, offset = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  C.tide_rng_get(seed, offset)
  local function restore_rng() C.tide_rng_set(seed[0], offset[0]) end
  local unpack = unpack or table.unpack

  restore_rng()
  local out = fn(unpack(inputs))
  if not is_tensor(out) then fail("gradcheck: fn must return a tensor, got " .. type(out)) end
  local n_out = out:numel()
  local rv = ffi.new("double[?]", math.max(n_out, 1))
  C.tide_philox_uniform(20250101, 0, rv, n_out)
  for i = 0, n_out - 1 do rv[i] = 2 * rv[i] - 1 end
  local rshape = ffi.new("int64_t[8]")
  for i, s in ipairs(out:shape()) do rshape[i - 1] = s end
  local R = td.check(C.tide_from_f64(td.dtype("f64"), out:dim(), rshape, td.device(out:device()), rv))
  local function objective(o) return (o:to("f64") * R):sum() end

  for _, x in ipairs(inputs) do x:zero_grad() end
  objective(out):backward()
  local analytic = {}
  for i, x in ipairs(inputs) do
    local g = x:grad()
    analytic[i] = g and g:tolist() or nil
  end

  local worst, failures = 0, {}
  for i, x in ipairs(inputs) do
    local n = x:numel()
    local vals = x:tolist()
    local buf = ffi.new("double[?]", math.max(n, 1))
    for k = 1, n do buf[k - 1] = vals[k] end
    local function eval_at(k, v)
      buf[k - 1] = v
      if C.tide_write_bytes(td.raw(x), buf, n * 8) ~= 0 then error(ffi.string(C.tide_last_error())) end
      restore_rng()
      local r = td.no_grad(function() return objective(fn(unpack(inputs))):item() end)
      buf[k - 1] = vals[k]
      return r
    end
    local step = n > max_checks and n / max_checks or 1
    local k = 1
    while k <= n do
      local idx = math.floor(k)
      local fp = eval_at(idx, vals[idx] + eps)
      local fm = eval_at(idx, vals[idx] - eps)
      local numeric = (fp - fm) / (2 * eps)
      local a = analytic[i] and analytic[i][idx] or 0
      local d = math.abs(a - numeric)
      if d > worst or d ~= d then worst = d end
      if not (d <= atol + rtol * math.abs(numeric)) then
        failures[#failures + 1] = string.format("input %d element %d: analytic %.10g, numeric %.10g (|diff| %.3g)",
                                                i, idx, a, numeric, d)
      end
      k = k + step
    end
    if C.tide_write_bytes(td.raw(x), buf, n * 8) ~= 0 then error(ffi.string(C.tide_last_error())) end
  end
  restore_rng()
  if #failures > 0 then
    local shown = {}
    for j = 1, math.min(#failures, 8) do shown[j] = "  " .. failures[j] end
    fail(string.format("gradcheck: %d element(s) differ (atol %g, rtol %g):\n%s", #failures, atol, rtol,
                       table.concat(shown, "\n")))
  end
  return worst
end

-- ---- running ----------------------------------------------------------------------------------------------

-- T.run(opts): runs the registered cases in order; opts.exit = false returns (passed, failed) instead
-- of exiting. The summary line "N passed, M failed" is what `tide test` reads.
-- read(path) -> the file's bytes, or nil when it cannot be opened
function T.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

-- write(path, bytes): the file holds exactly bytes (raises when it cannot be written)
function T.write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

-- bytes_of(t) -> uint8_t[n], n: the raw bytes of a u8 tensor (any device)
function T.bytes_of(t)
  local td = tide()
  local n = t:numel()
  local buf = require("ffi").new("uint8_t[?]", math.max(n, 1))
  td.check_status(td.C.tide_read_bytes(td.raw(t), buf, n))
  return buf, n
end

-- ---- pictures (tide plot's page, checked as a browser draws it) ---------------------------------------------
local ffi = require "ffi"
pcall(ffi.cdef, "int uncompress(uint8_t *dest, unsigned long *dest_len, const uint8_t *src, unsigned long src_len);")

-- png(path) -> width, height, rgb(x, y) for an 8-bit RGB or RGBA non-interlaced PNG (what Chromium writes)
function T.png(path)
  local s = assert(T.read(path), "cannot read " .. path)
  T.eq(s:sub(1, 8), "\137PNG\r\n\26\n", "PNG signature")
  local function u32(i) return ((s:byte(i) * 256 + s:byte(i + 1)) * 256 + s:byte(i + 2)) * 256 + s:byte(i + 3) end
  local pos, idat, w, h, depth, ctype, interlace = 9, {}, nil, nil, nil, nil, nil
  while pos <= #s do
    local n, typ = u32(pos), s:sub(pos + 4, pos + 7)
    local body = s:sub(pos + 8, pos + 7 + n)
    if typ == "IHDR" then
      w, h, depth, ctype, interlace = u32(pos + 8), u32(pos + 12), body:byte(9), body:byte(10), body:byte(13)
    elseif typ == "IDAT" then idat[#idat + 1] = body
    elseif typ == "IEND" then break end
    pos = pos + 12 + n
  end
  T.ok(depth == 8 and (ctype == 2 or ctype == 6) and interlace == 0, string.format("PNG depth %s colour type %s", depth, ctype))
  local bpp = ctype == 2 and 3 or 4
  local stride = w * bpp
  local z = table.concat(idat)
  local raw = ffi.new("uint8_t[?]", h * (stride + 1))
  local len = ffi.new("unsigned long[1]", h * (stride + 1))
  local zlib = ffi.load("libz.so.1")
  T.eq(zlib.uncompress(raw, len, z, #z), 0, "zlib uncompress")
  -- undo the row filters in place (PNG spec §9): none, sub, up, average, paeth
  local px = ffi.new("uint8_t[?]", h * stride)
  for y = 0, h - 1 do
    local f, src, dst = raw[y * (stride + 1)], raw + y * (stride + 1) + 1, px + y * stride
    local up = y > 0 and px + (y - 1) * stride or nil
    for i = 0, stride - 1 do
      local a = i >= bpp and dst[i - bpp] or 0
      local b = up and up[i] or 0
      local c = (up and i >= bpp) and up[i - bpp] or 0
      local v = src[i]
      if f == 1 then v = v + a
      elseif f == 2 then v = v + b
      elseif f == 3 then v = v + math.floor((a + b) / 2)
      elseif f == 4 then
        local p = a + b - c
        local pa, pb, pc = math.abs(p - a), math.abs(p - b), math.abs(p - c)
        v = v + ((pa <= pb and pa <= pc) and a or (pb <= pc and b or c))
      end
      dst[i] = v % 256
    end
  end
  return w, h, function(x, y)
    local o = y * stride + x * bpp
    return px[o], px[o + 1], px[o + 2]
  end
end


-- screenshot(html_path, width, height) -> the path of a PNG of the page drawn by headless Chromium, or nil (with a
-- line saying why) when this machine cannot install Chromium; Chromium missing where apt has it is an error
function T.screenshot(html, width, height)
  local exe
  for _, name in ipairs({ "chromium", "chromium-browser" }) do
    if os.execute("command -v " .. name .. " >/dev/null 2>&1") == 0 then exe = name break end
  end
  if not exe then
    local p = io.popen("apt-cache policy chromium 2>/dev/null")
    local policy = p:read("*a")
    p:close()
    if policy:match("Candidate: [^%(]") and not policy:match("Candidate: %(none%)") then
      error("chromium is not installed: run scripts/test_deps.sh (it installs the Debian chromium package)", 0)
    end
    print("  skipped: chromium cannot be installed on this machine (no apt candidate), so the page is not rendered")
    return nil
  end
  local dir = T.tmpdir("shot", { create = true })
  local shot = dir .. "/page.png"
  local q = function(v) return "'" .. tostring(v):gsub("'", "'\\''") .. "'" end
  local cmdline = string.format("timeout 120 %s --headless --no-sandbox --disable-gpu --hide-scrollbars "
    .. "--user-data-dir=%s --window-size=%d,%d --screenshot=%s file://%s 2>&1", exe, q(dir .. "/profile"), width,
    height, q(shot), html)
  local p = io.popen(cmdline)
  local log_text = p:read("*a")
  p:close()
  local f = io.open(shot, "rb")
  T.ok(f ~= nil, "chromium wrote no screenshot: " .. log_text)
  if f then f:close() end
  return shot
end

function T.run(opts)
  opts = opts or {}
  local filter = os.getenv("TIDE_TEST_FILTER")
  local passed, failed = 0, 0
  for _, c in ipairs(cases) do
    if not filter or filter == "" or c.name:find(filter, 1, true) then
      local t0 = now()
      local ok, err = xpcall(c.fn, function(e)
        -- the traceback of the test itself: no frames of this file, nothing below the test function
        local lines = {}
        for line in debug.traceback(tostring(e), 2):gmatch("[^\n]+") do
          if line:find("in function 'xpcall'", 1, true) then break end
          if not line:find("tide/testing.lua:", 1, true) then lines[#lines + 1] = line end
        end
        return table.concat(lines, "\n")
      end)
      local dt = now() - t0
      if ok then
        passed = passed + 1
        print(string.format("ok    %s (%.2f s)", c.name, dt))
      else
        failed = failed + 1
        print(string.format("FAIL  %s (%.2f s)", c.name, dt))
        for line in tostring(err):gmatch("[^\n]+") do print("      " .. line) end
      end
      io.stdout:flush()
    end
  end
  cases = {}
  for _, d in ipairs(tmpdirs) do tide().C.tide_remove_tree(d) end
  tmpdirs = {}
  print(string.format("%d passed, %d failed", passed, failed))
  io.stdout:flush()
  if opts.exit == false then return passed, failed end
  os.exit(failed > 0 and 1 or 0)
end

return T
