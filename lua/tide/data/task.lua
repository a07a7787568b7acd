-- data/task.lua — what the passkey and copy generators share: option checking, the byte-level tokenizer check,
-- a reusable buffer of Philox uniforms and the example(cfg, i, n) wrapper. `who` is the generator's name in
-- error messages ("passkey: ..."); errors point at the first line outside lua/tide (tide.options).
local ffi = require "ffi"
local options = require "tide.options"

local task = {}

local fmt = string.format

task.MAX_INDEX = 2 ^ 32

-- options(cfg, defaults, keys, who) -> a copy of cfg with defaults filled; an unknown key or a seed outside
-- [0, 2^32) is an error naming it (called from a generator's check(cfg))
function task.options(cfg, defaults, keys, who)
  if cfg ~= nil and type(cfg) ~= "table" then options.fail(who, "config must be a table, got " .. type(cfg)) end
  local c = options.with_defaults(cfg or {}, defaults, keys, nil, who)
  options.seed(c.seed, "seed", who)
  return c
end

-- byte_tokenizer(tok, why, who) -> tok, or a byte-level tokenizer of V = 320 when tok is nil; anything else that
-- is not byte-level is an error (`why` says what needs byte ids)
function task.byte_tokenizer(tok, why, who)
  tok = tok or require("tide.data.tokenizer").byte_level({ vocab_size = 320 })
  if type(tok) ~= "table" or tok.kind ~= "byte" then
    options.fail(who, fmt("tokenizer must be a byte-level tokenizer (%s), got %s", why,
      type(tok) == "table" and tostring(tok.kind) or type(tok)))
  end
  return tok
end

-- check_filler_text(c, who): filler = "text" needs c.filler_text, a text document source (with :span); any other
-- filler takes none
function task.check_filler_text(c, who)
  if c.filler == "text" then
    local ft = c.filler_text
    if (type(ft) ~= "table" and type(ft) ~= "userdata") or type(ft.span) ~= "function" then
      options.fail(who, fmt("filler = \"text\" needs filler_text, a text document source to draw from (in a "
        .. "curriculum: filler_source = the name of a text source), got %s", tostring(ft)))
    end
  elseif c.filler_text ~= nil then
    options.fail(who, fmt("filler_text is used only with filler = \"text\", got filler = %q", c.filler))
  end
end

-- uniforms(n) -> a double[>= n] buffer, reused across calls (fill it and read it before the next call)
local ubuf, ubuf_n = nil, 0
function task.uniforms(n)
  if n > ubuf_n then ubuf, ubuf_n = ffi.new("double[?]", n), n end
  return ubuf
end

-- example(c, i, n, T, fill, what, who) -> ids, labels (Lua lists of T, 1-based) and fill's result:
-- fill(c, i, n, x, y, 0) writes example i (0-based) of size n, T tokens, into int32 arrays x, y
function task.example(c, i, n, T, fill, what, who)
  if type(i) ~= "number" or i ~= math.floor(i) or i < 0 or i >= task.MAX_INDEX then
    options.fail(who, fmt("example index must be an integer in [0, 2^32), got %s", tostring(i)))
  end
  if type(n) ~= "number" or n ~= math.floor(n) then options.fail(who, fmt("%s must be an integer, got %s", what, tostring(n))) end
  local x, y = ffi.new("int32_t[?]", T), ffi.new("int32_t[?]", T)
  local info = fill(c, i, n, x, y, 0)
  local ids, labels = {}, {}
  for t = 0, T - 1 do ids[t + 1], labels[t + 1] = x[t], y[t] end
  return ids, labels, info
end

return task
