-- json.lua — JSON encode/decode in plain Lua (formats.md §5).
--
-- Numbers are written as the shortest text that reads back to the same double (%.17g at worst);
-- with the float32 option, values that are exactly float32 (losses read from f32 tensors) get the
-- shortest text that reads back to the same float32 (at most 9 digits). Integers in the exact range
-- print without an exponent. Non-finite numbers become null; when
-- encoding a record (json.record) their keys are listed in "nonfinite". Objects are written with
-- sorted keys (a `first` list puts chosen keys in front) so output is deterministic.
local json = {}

json.null = setmetatable({}, { __tostring = function() return "null" end })

local array_mt = { __json_array = true }
-- mark a table as an array so an empty one encodes as [] rather than {}
function json.array(t)
  return setmetatable(t or {}, array_mt)
end

local function is_finite(x) return x == x and x ~= math.huge and x ~= -math.huge end

local ffi = require "ffi"
local f32 = ffi.new("float[1]")

local function format_number(x, float32)
  if x == math.floor(x) and math.abs(x) < 2^53 then
    return string.format("%d", x)
  end
  f32[0] = x
  if float32 and f32[0] == x then
    -- a float32 value (a loss read from an f32 tensor): the shortest text that reads back to the same
    -- float32, at most 9 significant digits
    for prec = 1, 9 do
      local s = string.format("%." .. prec .. "g", x)
      f32[0] = tonumber(s)
      if f32[0] == x then return s end
    end
  end
  for prec = 1, 17 do
    local s = string.format("%." .. prec .. "g", x)
    if tonumber(s) == x then return s end
  end
  return string.format("%.17g", x)
end
json.format_number = format_number

local escapes = {
  ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f',
  ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
}
local function escape_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return escapes[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

-- array when every key is an integer 1..n with no holes (n >= 1), or when marked with json.array
local function array_length(t)
  local n = 0
  for k in pairs(t) do
    if type(k) ~= "number" or k < 1 or k ~= math.floor(k) then return nil end
    if k > n then n = k end
  end
  if n == 0 then
    return getmetatable(t) == array_mt and 0 or nil
  end
  for i = 1, n do if t[i] == nil then return nil end end
  return n
end

local function encode_value(v, out, opts, path, depth)
  local tv = type(v)
  if v == nil or v == json.null then
    out[#out + 1] = "null"
  elseif tv == "boolean" then
    out[#out + 1] = v and "true" or "false"
  elseif tv == "number" then
    if is_finite(v) then
      out[#out + 1] = format_number(v, opts.float32)
    else
      out[#out + 1] = "null"
      if opts.nonfinite then opts.nonfinite[#opts.nonfinite + 1] = path end
    end
  elseif tv == "string" then
    out[#out + 1] = escape_string(v)
  elseif tv == "cdata" and tonumber(v) then
    encode_value(tonumber(v), out, opts, path, depth)
  elseif tv == "table" then
    if depth > 64 then error("json.encode: nesting deeper than 64 at " .. path, 0) end
    local n = array_length(v)
    if n then
      out[#out + 1] = "["
      for i = 1, n do
        if i > 1 then out[#out + 1] = "," end
        encode_value(v[i], out, opts, path .. "[" .. (i - 1) .. "]", depth + 1)
      end
      out[#out + 1] = "]"
    else
      local keys, first_rank = {}, {}
      for i, k in ipairs(opts.first or {}) do first_rank[k] = i end
      for k in pairs(v) do
        if type(k) ~= "string" then
          error("json.encode: object key " .. tostring(k) .. " at " .. path .. " is a " .. type(k) .. ", expected a string", 0)
        end
        keys[#keys + 1] = k
      end
      table.sort(keys, function(a, b)
        local ra, rb = first_rank[a], first_rank[b]
        if ra and rb then return ra < rb end
        if ra or rb then return ra ~= nil end
        return a < b
      end)
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = "," end
        out[#out + 1] = escape_string(k)
        out[#out + 1] = ":"
        encode_value(v[k], out, opts, path == "" and k or (path .. "." .. k), depth + 1)
      end
      out[#out + 1] = "}"
    end
  else
    error("json.encode: cannot encode a " .. tv .. " at " .. (path == "" and "top level" or path), 0)
  end
end

-- encode(value, {first = {"step", ...}, float32 = false}) -> string; non-finite numbers become null
function json.encode(v, opts)
  opts = opts or {}
  local out = {}
  encode_value(v, out, { first = opts.first, nonfinite = opts.nonfinite, float32 = opts.float32 }, "", 0)
  return table.concat(out)
end

-- one JSONL record: an object whose non-finite values are null and listed in "nonfinite";
-- float32-exact values print with float32's shortest digits (metrics come from f32 tensors)
function json.record(obj, first)
  local bad = {}
  local body = json.encode(obj, { first = first, nonfinite = bad, float32 = true })
  if #bad == 0 then return body end
  local list = {}
  for i, k in ipairs(bad) do list[i] = escape_string(k) end
  if body == "{}" then return '{"nonfinite":[' .. table.concat(list, ",") .. "]}" end
  return body:sub(1, -2) .. ',"nonfinite":[' .. table.concat(list, ",") .. "]}"
end

---------------------------------------------------------------------------------------------------
-- decoding

local function decode_error(s, pos, what)
  local line, col = 1, 1
  for i = 1, math.min(pos - 1, #s) do
    if s:byte(i) == 10 then line, col = line + 1, 1 else col = col + 1 end
  end
  -- one line: control characters quoted from the input (a raw newline after a backslash) are shown escaped
  what = what:gsub("%c", function(c) return string.format("\\%03d", c:byte()) end)
  error(string.format("json.decode: %s at line %d column %d (byte %d)", what, line, col, pos), 0)
end

local function skip_ws(s, pos)
  return s:find("[^ \t\r\n]", pos) or (#s + 1)
end

local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 0x40), 0x80 + cp % 0x40) end
  if cp < 0x10000 then
    return string.char(0xE0 + math.floor(cp / 0x1000), 0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
  end
  return string.char(0xF0 + math.floor(cp / 0x40000), 0x80 + math.floor(cp / 0x1000) % 0x40,
                     0x80 + math.floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
end

local simple_escapes = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

local function parse_string(s, pos)
  -- pos at the opening quote
  local parts, i = {}, pos + 1
  while true do
    local j = s:find('["\\%c]', i)
    if not j then decode_error(s, pos, "unterminated string") end
    local c = s:sub(j, j)
    parts[#parts + 1] = s:sub(i, j - 1)
    if c == '"' then return table.concat(parts), j + 1 end
    if c ~= "\\" then decode_error(s, j, "control character in string") end
    local e = s:sub(j + 1, j + 1)
    if simple_escapes[e] then
      parts[#parts + 1] = simple_escapes[e]
      i = j + 2
    elseif e == "u" then
      local hex = s:match("^%x%x%x%x", j + 2)
      if not hex then decode_error(s, j, "bad \\u escape") end
      local cp = tonumber(hex, 16)
      i = j + 6
      if cp >= 0xD800 and cp <= 0xDBFF then
        local lo = s:match("^\\u(%x%x%x%x)", i)
        local lo_cp = lo and tonumber(lo, 16)
        if not lo_cp or lo_cp < 0xDC00 or lo_cp > 0xDFFF then decode_error(s, j, "unpaired surrogate") end
        cp = 0x10000 + (cp - 0xD800) * 0x400 + (lo_cp - 0xDC00)
        i = i + 6
      elseif cp >= 0xDC00 and cp <= 0xDFFF then
        decode_error(s, j, "unpaired surrogate")
      end
      parts[#parts + 1] = utf8_char(cp)
    else
      decode_error(s, j, "bad escape '\\" .. e .. "'")
    end
  end
end

local parse_value

local function parse_array(s, pos, depth)
  local arr, n = json.array({}), 0
  pos = skip_ws(s, pos + 1)
  if s:sub(pos, pos) == "]" then return arr, pos + 1 end
  while true do
    local v
    v, pos = parse_value(s, pos, depth + 1)
    n = n + 1
    arr[n] = v
    pos = skip_ws(s, pos)
    local c = s:sub(pos, pos)
    if c == "]" then return arr, pos + 1 end
    if c ~= "," then decode_error(s, pos, "expected ',' or ']' in array") end
    pos = skip_ws(s, pos + 1)
  end
end

local function parse_object(s, pos, depth)
  local obj = {}
  pos = skip_ws(s, pos + 1)
  if s:sub(pos, pos) == "}" then return obj, pos + 1 end
  while true do
    if s:sub(pos, pos) ~= '"' then decode_error(s, pos, "expected a string key in object") end
    local k
    k, pos = parse_string(s, pos)
    if obj[k] ~= nil then decode_error(s, pos, "duplicate key '" .. k .. "'") end
    pos = skip_ws(s, pos)
    if s:sub(pos, pos) ~= ":" then decode_error(s, pos, "expected ':' after key") end
    local v
    v, pos = parse_value(s, skip_ws(s, pos + 1), depth + 1)
    obj[k] = v
    pos = skip_ws(s, pos)
    local c = s:sub(pos, pos)
    if c == "}" then return obj, pos + 1 end
    if c ~= "," then decode_error(s, pos, "expected ',' or '}' in object") end
    pos = skip_ws(s, pos + 1)
  end
end

function parse_value(s, pos, depth)
  if depth > 64 then decode_error(s, pos, "nesting deeper than 64") end
  local c = s:sub(pos, pos)
  if c == "{" then return parse_object(s, pos, depth) end
  if c == "[" then return parse_array(s, pos, depth) end
  if c == '"' then return parse_string(s, pos) end
  if s:sub(pos, pos + 3) == "true" then return true, pos + 4 end
  if s:sub(pos, pos + 4) == "false" then return false, pos + 5 end
  if s:sub(pos, pos + 3) == "null" then return json.null, pos + 4 end
  local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
  if num and num ~= "" and num ~= "-" then
    if not num:match("^-?0%d") and not num:match("%.$") and not num:match("%.[eE]")
      and not num:match("[eE][-+]?$") then
      local v = tonumber(num)
      if v then return v, pos + #num end
    end
  end
  if c == "" then decode_error(s, pos, "unexpected end of input") end
  decode_error(s, pos, "unexpected character '" .. c .. "'")
end

-- decode(text) -> value; null decodes to json.null. Errors name line and column.
function json.decode(s)
  if type(s) ~= "string" then error("json.decode: expected a string, got a " .. type(s), 2) end
  local v, pos = parse_value(s, skip_ws(s, 1), 0)
  pos = skip_ws(s, pos)
  if pos <= #s then decode_error(s, pos, "trailing characters after the value") end
  return v
end

-- read(path, max_bytes) -> the decoded file; errors name the file. A regular file of at most max_bytes
-- (tide.STATE_FILE_LIMIT, 64 MiB, by default): a FIFO, a device or an endless file is refused, not read.
function json.read(path, max_bytes)
  local tide = require "tide"
  local text, err = tide.read_file(path, max_bytes or tide.STATE_FILE_LIMIT)
  if not text then error("json: " .. err, 2) end
  local ok, v = pcall(json.decode, text)
  if not ok then error(path .. ": " .. tostring(v), 2) end
  return v
end

-- each_line(path, fn, max_bytes): fn(value, where) for each non-blank line of a JSONL file (formats.md §5) in
-- order, where = "PATH:LINE". A file that cannot be read (a regular file of at most max_bytes, 1 GiB by default) or a
-- line that is not JSON raises one line naming it ("PATH:LINE: json.decode: ..."); fn raises as it likes.
function json.each_line(path, fn, max_bytes)
  local tide = require "tide"
  local text, err = tide.read_file(path, max_bytes or 1024 * 1024 * 1024)
  if not text then error(err, 0) end
  local lineno = 0
  for line in text:gmatch("([^\n]*)\n?") do
    lineno = lineno + 1
    if line:find("%S") then
      local where = path .. ":" .. lineno
      local ok, v = pcall(json.decode, line)
      if not ok then error(where .. ": " .. tostring(v), 0) end
      fn(v, where)
    end
  end
end

return json
