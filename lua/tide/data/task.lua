-- data/task.lua — what the passkey and copy generators share: option checking, the byte-level tokenizer check,
-- a reusable buffer of Philox uniforms and the example(cfg, i, n) wrapper. `bad(msg, level)` is the generator's
-- error function; levels are chosen so errors point at the line that called the generator's public function.
local ffi = require "ffi"

local task = {}

local fmt = string.format

task.MAX_INDEX = 2 ^ 32

-- options(cfg, defaults, keys, bad) -> a copy of cfg with defaults filled; an unknown key or a seed outside
-- [0, 2^32) is an error naming it (called from a generator's check(cfg))
function task.options(cfg, defaults, keys, bad)
  if cfg ~= nil and type(cfg) ~= "table" then bad("config must be a table, got " .. type(cfg), 5) end
  local c = {}
  for k, v in pairs(defaults) do c[k] = v end
  for k, v in pairs(cfg or {}) do
    if not keys[k] then
      local known = {}
      for name in pairs(keys) do known[#known + 1] = name end
      table.sort(known)
      bad(fmt("unknown option '%s' (known: %s)", tostring(k), table.concat(known, ", ")), 5)
    end
    c[k] = v
  end
  if type(c.seed) ~= "number" or c.seed ~= math.floor(c.seed) or c.seed < 0 or c.seed >= 2 ^ 32 then
    bad(fmt("seed must be an integer in [0, 2^32), got %s", tostring(c.seed)), 5)
  end
  return c
end

-- byte_tokenizer(tok, why, bad) -> tok, or a byte-level tokenizer of V = 320 when tok is nil; anything else that
-- is not byte-level is an error (`why` says what needs byte ids)
function task.byte_tokenizer(tok, why, bad)
  tok = tok or require("tide.data.tokenizer").byte_level({ vocab_size = 320 })
  if type(tok) ~= "table" or tok.kind ~= "byte" then
    bad(fmt("tokenizer must be a byte-level tokenizer (%s), got %s", why,
      type(tok) == "table" and tostring(tok.kind) or type(tok)), 5)
  end
  return tok
end

-- uniforms(n) -> a double[>= n] buffer, reused across calls (fill it and read it before the next call)
local ubuf, ubuf_n = nil, 0
function task.uniforms(n)
  if n > ubuf_n then ubuf, ubuf_n = ffi.new("double[?]", n), n end
  return ubuf
end

-- example(c, i, n, T, fill, what, bad) -> ids, labels (Lua lists of T, 1-based) and fill's result:
-- fill(c, i, n, x, y, 0) writes example i (0-based) of size n, T tokens, into int32 arrays x, y
function task.example(c, i, n, T, fill, what, bad)
  if type(i) ~= "number" or i ~= math.floor(i) or i < 0 or i >= task.MAX_INDEX then
    bad(fmt("example index must be an integer in [0, 2^32), got %s", tostring(i)), 4)
  end
  if type(n) ~= "number" or n ~= math.floor(n) then bad(fmt("%s must be an integer, got %s", what, tostring(n)), 4) end
  local x, y = ffi.new("int32_t[?]", T), ffi.new("int32_t[?]", T)
  local info = fill(c, i, n, x, y, 0)
  local ids, labels = {}, {}
  for t = 0, T - 1 do ids[t + 1], labels[t + 1] = x[t], y[t] end
  return ids, labels, info
end

return task
