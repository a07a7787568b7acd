-- tfevents.lua — TensorBoard event files (formats.md §7, test oracle 5): the record framing with masked CRC32C,
-- the few protobuf messages a scalar log needs (Event, Summary, Value, SessionLog) encoded by hand, a writer that
-- appends one record per scalar and hands each metrics record to the kernel at once (TensorBoard tails growing
-- files), and a reader that checks every CRC (the tests parse back what was written).
--
--   local w = tfevents.open("runs/x", { start_step = 1 })  -- events.out.tfevents.<unix_seconds>.<hostname>
--   w:scalars(12, tfevents.now(), { { "loss", 2.31 }, { "moe/maxvio_batch/3", 0.2 } })
--   w:close()
--   local events = tfevents.read(w.path)   -- { {wall_time, step, file_version | values = {{tag, value}} | ...} }
--
-- Values are float32 (simple_value): NaN and ±Inf are written as such (TensorBoard accepts them; the JSONL beside
-- writes null and lists the key in "nonfinite"), magnitudes beyond float32 become ±Inf.
-- Restarts: every file starts with file_version, then SessionLog{START} at `start_step`; TensorBoard's reader drops
-- the points of earlier files at steps >= start_step, so a resumed run (a new file) replaces what the crashed run
-- had logged after its checkpoint, as the truncated metrics.jsonl does. Writer:session_start does the same within a
-- file (the logger calls it when a run goes back to an earlier step: a rollback).
local ffi = require "ffi"
local bit = require "bit"

local band, bor, bxor, rshift, ror = bit.band, bit.bor, bit.bxor, bit.rshift, bit.ror
local byte, char, fmt = string.byte, string.char, string.format

local tfevents = {}

-- ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78) -----------------------------------------------------
local CRC_TABLE = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) ~= 0 then c = bxor(rshift(c, 1), 0x82F63B78) else c = rshift(c, 1) end
  end
  CRC_TABLE[i] = c
end

local U32 = 4294967296
local function u32(x) return x % U32 end          -- bit ops return signed 32-bit numbers

-- crc32c(s) -> the checksum of the bytes of s as a number in [0, 2^32)
function tfevents.crc32c(s)
  local c = -1                                        -- init 0xFFFFFFFF
  for i = 1, #s do c = bxor(rshift(c, 8), CRC_TABLE[band(bxor(c, byte(s, i)), 0xFF)]) end
  return u32(bxor(c, -1))                             -- final xor 0xFFFFFFFF
end

-- masked(c) = ((c >> 15) | (c << 17)) + 0xA282EAD8 (mod 2^32): a rotation right by 15, then the constant
function tfevents.masked_crc(c) return u32(u32(ror(c, 15)) + 0xA282EAD8) end

-- ---- little-endian fixed-width encodings ---------------------------------------------------------------------
local LE = ffi.abi("le")
local f64, f32 = ffi.new("double[1]"), ffi.new("float[1]")
local function fixed(buf, n)
  local s = ffi.string(buf, n)
  return LE and s or s:reverse()
end
local function le_u32(x)
  return char(band(x, 0xFF), band(rshift(x, 8), 0xFF), band(rshift(x, 16), 0xFF), band(rshift(x, 24), 0xFF))
end
local function le_u64(x)       -- 0 <= x < 2^53
  local lo, hi = x % U32, math.floor(x / U32)
  return le_u32(lo) .. le_u32(hi)
end
local function double(x) f64[0] = x; return fixed(f64, 8) end
local function float(x) f32[0] = x; return fixed(f32, 4) end

-- ---- protobuf wire format: key = (field << 3) | type; 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32 -------
local function varint(v)
  if v < 0 or v >= 2^53 then
    -- an int64 outside the exact double range (a negative step): its two's complement as uint64, 10 bytes at most
    local u, out = ffi.new("uint64_t", ffi.new("int64_t", v)), {}
    repeat
      local b = tonumber(u % 128)
      u = u / 128
      out[#out + 1] = char(u ~= 0 and b + 128 or b)
    until u == 0
    return table.concat(out)
  end
  local out = {}
  repeat
    local b = v % 128
    v = (v - b) / 128
    out[#out + 1] = char(v > 0 and b + 128 or b)
  until v == 0
  return table.concat(out)
end
local function key(field, wire) return char(field * 8 + wire) end     -- every field here is < 16
local function len_field(field, s) return key(field, 2) .. varint(#s) .. s end

-- event{wall_time, step, file_version | values = {{tag, value}, ...} | session_start = true} -> the Event bytes.
-- Fields at their proto3 default (step 0) are left out, as protobuf's own serialiser does.
function tfevents.event(e)
  local parts = { key(1, 1), double(e.wall_time) }
  if e.step and e.step ~= 0 then parts[#parts + 1] = key(2, 0) .. varint(e.step) end
  if e.file_version then
    parts[#parts + 1] = len_field(3, e.file_version)
  elseif e.values then
    local vals = {}
    for i, v in ipairs(e.values) do
      -- Value { string tag = 1; float simple_value = 2 } (a oneof member: written even when 0)
      vals[i] = len_field(1, len_field(1, v[1]) .. key(2, 5) .. float(v[2]))
    end
    parts[#parts + 1] = len_field(5, table.concat(vals))                 -- Summary summary = 5
  elseif e.session_start then
    parts[#parts + 1] = len_field(7, key(1, 0) .. varint(1))             -- SessionLog { status = START (1) }
  end
  return table.concat(parts)
end

-- record(data) -> uint64 length | masked crc of the length | data | masked crc of the data (all little-endian)
function tfevents.record(data)
  local len = le_u64(#data)
  return len .. le_u32(tfevents.masked_crc(tfevents.crc32c(len))) .. data
    .. le_u32(tfevents.masked_crc(tfevents.crc32c(data)))
end

-- ---- reading -----------------------------------------------------------------------------------------------
local function rd_u32(s, i) return byte(s, i) + byte(s, i + 1) * 256 + byte(s, i + 2) * 65536 + byte(s, i + 3) * 16777216 end
local function rd_varint(s, i, limit, what)
  local v, mul = 0, 1
  for j = i, math.min(limit, i + 9) do
    local b = byte(s, j)
    v = v + (b % 128) * mul
    if b < 128 then return v, j + 1 end
    mul = mul * 128
  end
  error(fmt("tfevents: %s: a varint at byte %d runs past its message", what, i - 1), 0)
end

-- fields(s, i, j, what) -> iterator over (field, wire, value, start) of the message s[i..j]; a length-delimited
-- value is returned as its (first, last) byte positions
local function fields(s, i, j, what)
  return function()
    if i > j then return nil end
    local k, p = rd_varint(s, i, j, what)
    local field, wire = math.floor(k / 8), k % 8
    local v, w
    if wire == 0 then v, p = rd_varint(s, p, j, what)
    elseif wire == 1 then
      if p + 7 > j then error(fmt("tfevents: %s: a fixed64 field at byte %d runs past its message", what, p - 1), 0) end
      v = s:sub(p, p + 7); p = p + 8
    elseif wire == 5 then
      if p + 3 > j then error(fmt("tfevents: %s: a fixed32 field at byte %d runs past its message", what, p - 1), 0) end
      v = s:sub(p, p + 3); p = p + 4
    elseif wire == 2 then
      local n
      n, p = rd_varint(s, p, j, what)
      if p + n - 1 > j then error(fmt("tfevents: %s: a field of %d bytes at byte %d runs past its message", what, n, p - 1), 0) end
      v, w = p, p + n - 1
      p = p + n
    else
      error(fmt("tfevents: %s: wire type %d at byte %d", what, wire, i - 1), 0)
    end
    i = p
    return field, wire, v, w
  end
end

local function get_double(s) ffi.copy(f64, LE and s or s:reverse(), 8); return f64[0] end
local function get_float(s) ffi.copy(f32, LE and s or s:reverse(), 4); return f32[0] end

-- decode_event(data, what) -> {wall_time, step, file_version, values = {{tag, value}}, session_status}
function tfevents.decode_event(data, what)
  what = what or "event"
  local e = { step = 0 }
  for f, wire, v, w in fields(data, 1, #data, what) do
    if f == 1 and wire == 1 then e.wall_time = get_double(v)
    elseif f == 2 and wire == 0 then e.step = v
    elseif f == 3 and wire == 2 then e.file_version = data:sub(v, w)
    elseif f == 5 and wire == 2 then
      e.values = {}
      for vf, vw, a, b in fields(data, v, w, what) do
        if vf == 1 and vw == 2 then
          local val = {}
          for tf, tw, x, y in fields(data, a, b, what) do
            if tf == 1 and tw == 2 then val[1] = data:sub(x, y)
            elseif tf == 2 and tw == 5 then val[2] = get_float(x) end
          end
          e.values[#e.values + 1] = val
        end
      end
    elseif f == 7 and wire == 2 then
      e.session_status = 0
      for sf, sw, x in fields(data, v, w, what) do
        if sf == 1 and sw == 0 then e.session_status = x end
      end
    end
  end
  return e
end

-- parse(bytes, name) -> the list of decoded events; every length and data CRC is checked, errors name the record
function tfevents.parse(s, name)
  name = name or "events"
  local out, i = {}, 1
  while i <= #s do
    local at = i - 1
    if i + 11 > #s then error(fmt("tfevents: %s: a truncated record header at byte %d", name, at), 0) end
    local lenb = s:sub(i, i + 7)
    local n = rd_u32(s, i) + rd_u32(s, i + 4) * U32
    if rd_u32(s, i + 8) ~= tfevents.masked_crc(tfevents.crc32c(lenb)) then
      error(fmt("tfevents: %s: record %d at byte %d: the length CRC does not match", name, #out + 1, at), 0)
    end
    if i + 12 + n + 3 > #s then
      error(fmt("tfevents: %s: record %d at byte %d: %d data bytes announced, the file ends first", name, #out + 1, at, n), 0)
    end
    local data = s:sub(i + 12, i + 11 + n)
    if rd_u32(s, i + 12 + n) ~= tfevents.masked_crc(tfevents.crc32c(data)) then
      error(fmt("tfevents: %s: record %d at byte %d: the data CRC does not match", name, #out + 1, at), 0)
    end
    out[#out + 1] = tfevents.decode_event(data, fmt("%s record %d", name, #out + 1))
    i = i + 16 + n
  end
  return out
end

-- read(path) -> parse of the whole file
function tfevents.read(path)
  local text, err = require("tide").read_file(path)
  if not text then error("tfevents: " .. err, 0) end
  return tfevents.parse(text, path)
end

-- ---- writing -----------------------------------------------------------------------------------------------
-- one declaration per cdef: another module may have declared some of them already
for _, decl in ipairs({ "int open(const char *path, int flags, ...);", "int64_t write(int fd, const void *buf, size_t n);",
  "int close(int fd);", "int gethostname(char *name, size_t len);", "char *strerror(int errnum);" }) do
  pcall(ffi.cdef, decl)
end
pcall(ffi.cdef, "struct tide_tfevents_timespec { long tv_sec; long tv_nsec; };")
pcall(ffi.cdef, "int clock_gettime(int clk, struct tide_tfevents_timespec *ts);")

-- Linux open(2) flags
local O_WRONLY, O_CREAT, O_EXCL, O_CLOEXEC = 1, 64, 128, 524288
local EINTR, EEXIST = 4, 17

local ts = ffi.new("struct tide_tfevents_timespec")
-- now() -> seconds since the Unix epoch with sub-second precision (CLOCK_REALTIME): an event's wall_time
function tfevents.now()
  if ffi.C.clock_gettime(0, ts) ~= 0 then return os.time() end
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

local function hostname()
  local buf = ffi.new("char[256]")
  if ffi.C.gethostname(buf, 255) ~= 0 then return "localhost" end
  local h = ffi.string(buf):gsub("[^%w%.%-_]", "_")
  return h ~= "" and h or "localhost"
end
tfevents.hostname = hostname

local Writer = {}
Writer.__index = Writer

-- write_all(fd, bytes): one write(2) per call in the usual case; a short write continues, an error is raised
local function write_all(self, s)
  local buf, n, off = s, #s, 0
  while off < n do
    local w = ffi.C.write(self.fd, ffi.cast("const char *", buf) + off, n - off)
    if w < 0 then
      local e = ffi.errno()
      if e ~= EINTR then
        error(fmt("tfevents: cannot append to '%s': %s", self.path, ffi.string(ffi.C.strerror(e))), 0)
      end
    else
      off = off + tonumber(w)
    end
  end
end

-- open(dir, {start_step = 1, wall_time = now()}) -> a writer on a new file events.out.tfevents.<unix_seconds>.
-- <hostname> in dir (".<n>" appended when that name exists: a file is never reopened, so nothing already saved is
-- touched, and a FIFO or device planted there is never written). Writes file_version and SessionLog START.
function tfevents.open(dir, o)
  o = o or {}
  local base = fmt("%s/events.out.tfevents.%d.%s", dir, os.time(), hostname())
  local path, fd
  for n = 0, 99 do
    path = n == 0 and base or fmt("%s.%d", base, n)
    fd = ffi.C.open(path, bor(O_WRONLY, O_CREAT, O_EXCL, O_CLOEXEC), ffi.cast("int", 420))   -- 0644
    if fd >= 0 then break end
    local e = ffi.errno()
    if e ~= EEXIST then
      error(fmt("tfevents: cannot create '%s': %s", path, ffi.string(ffi.C.strerror(e))), 0)
    end
  end
  if fd < 0 then error(fmt("tfevents: cannot create '%s': 100 files of that name exist", base), 0) end
  local self = setmetatable({ fd = fd, path = path }, Writer)
  local t = o.wall_time or tfevents.now()
  write_all(self, tfevents.record(tfevents.event({ wall_time = t, file_version = "brain.Event:2" }))
    .. tfevents.record(tfevents.event({ wall_time = t, step = o.start_step or 1, session_start = true })))
  return self
end

-- session_start(step, wall_time): a SessionLog START at step: TensorBoard drops the points logged before it at steps
-- >= step (a run that went back, as after a rollback to a checkpoint)
function Writer:session_start(step, wall_time)
  if not self.fd then error(fmt("tfevents: '%s' is closed", self.path), 2) end
  write_all(self, tfevents.record(tfevents.event({ wall_time = wall_time or tfevents.now(), step = step,
    session_start = true })))
end

-- scalars(step, wall_time, {{tag, value}, ...}): one Event per scalar, all handed to the kernel in one write
function Writer:scalars(step, wall_time, list)
  if not self.fd then error(fmt("tfevents: '%s' is closed", self.path), 2) end
  if #list == 0 then return end
  local recs = {}
  for i, tv in ipairs(list) do
    recs[i] = tfevents.record(tfevents.event({ wall_time = wall_time, step = step, values = { tv } }))
  end
  write_all(self, table.concat(recs))
end

function Writer:close()
  if self.fd then ffi.C.close(self.fd); self.fd = nil end
end

return tfevents
