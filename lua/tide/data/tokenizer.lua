-- data/tokenizer.lua — the byte-level tokenizer (spec/formats.md §4).
--
-- ids 0-255 are the bytes themselves; the special tokens follow from 256. Text never encodes to a
-- special id (a literal "<|endoftext|>" in text stays bytes); specials are inserted by name.
local ffi = require "ffi"

local tokenizer = {}

-- the tide specials in id order from 256; 276.. are <|reserved_0|>, <|reserved_1|>, ...
local SPECIALS = {
  "<|endoftext|>", "<|pad|>", "<|sep|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
  "<|im_middle|>", "<|im_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_result_begin|>",
  "<|tool_result_end|>", "<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
  "<KEY>", "<Q>", "<push>", "<pop>",
}
local FIRST_RESERVED = 256 + #SPECIALS   -- 276

local ByteTokenizer = {}
ByteTokenizer.__index = ByteTokenizer

-- byte_level{vocab_size = 320}: vocab_size must cover the bytes and <|endoftext|> (>= 257)
function tokenizer.byte_level(opts)
  opts = opts or {}
  local V = opts.vocab_size or 320
  if type(V) ~= "number" or V ~= math.floor(V) or V < 257 or V > 65536 then
    error("tokenizer.byte_level: vocab_size must be an integer in [257, 65536], got " .. tostring(V), 2)
  end
  local self = setmetatable({ kind = "byte", vocab_size = V, specials = {}, names = {} }, ByteTokenizer)
  for id = 256, V - 1 do
    local name = SPECIALS[id - 255] or string.format("<|reserved_%d|>", id - FIRST_RESERVED)
    self.specials[name] = id
    self.names[id] = name
  end
  return self
end

-- id of a special token by name; an error names the unknown token
function ByteTokenizer:id(name)
  local id = self.specials[name]
  if not id then
    error(string.format("tokenizer: no special token '%s' in a byte-level vocabulary of %d",
      tostring(name), self.vocab_size), 2)
  end
  return id
end

-- encode(text) -> Lua array of ids (0-based values)
function ByteTokenizer:encode(text)
  if type(text) ~= "string" then error("tokenizer.encode: expected a string, got a " .. type(text), 2) end
  local ids = {}
  for i = 1, #text do ids[i] = text:byte(i) end
  return ids
end

-- encode text straight into an ffi int32 buffer at 0-based position pos; returns the next position
function ByteTokenizer:encode_into(text, buf, pos)
  local n = #text
  local src = ffi.cast("const uint8_t *", text)
  for i = 0, n - 1 do buf[pos + i] = src[i] end
  return pos + n
end

-- decode(ids) -> string. Specials print as their names unless skip_special is true.
-- ids is a Lua array (1-based positions) of 0-based id values.
function ByteTokenizer:decode(ids, skip_special)
  local out, run = {}, {}
  local function flush()
    if #run > 0 then out[#out + 1] = string.char(unpack(run)); run = {} end
  end
  for i = 1, #ids do
    local id = ids[i]
    if id >= 0 and id < 256 then
      run[#run + 1] = id
      if #run >= 4096 then flush() end
    else
      flush()
      if not skip_special then
        local name = self.names[id]
        if not name then
          error(string.format("tokenizer.decode: id %s at position %d is outside the vocabulary of %d",
            tostring(id), i, self.vocab_size), 2)
        end
        out[#out + 1] = name
      end
    end
  end
  flush()
  return table.concat(out)
end

tokenizer.SPECIALS = SPECIALS
return tokenizer
