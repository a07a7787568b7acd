-- data/tokenizer.lua — the tokenizers (spec/formats.md §4): tide's byte-level vocabulary and HuggingFace
-- tokenizer.json byte-level BPE (engine/io/bpe.c), with one interface:
--   tok.kind ("byte" | "bpe"), tok.vocab_size, tok.specials (name -> id), tok.names (id -> name),
--   tok:id(name), tok:encode(text), tok:encode_into(text, buf, pos), tok:encode_docs(text, offsets, n, sep),
--   tok:decode(ids, skip_special), tok:describe(), and for BPE tok:save(path).
-- Byte level: ids 0-255 are the bytes themselves; the special tokens follow from 256. Text never encodes to a
-- special id (a literal "<|endoftext|>" in text stays bytes); specials are inserted by name.
-- BPE: the ids the tokenizers library gives (a literal added token in the text is that token, as there).
-- Code resolves specials by name: a vocabulary without one is an error only when that name is asked for.
local ffi = require "ffi"
local options = require "tide.options"

local tokenizer = {}
local fmt = string.format

-- the engine, loaded when a BPE tokenizer or a document batch first needs it (plain `require` of this module
-- stays cheap)
local function engine()
  local tide = require "tide"
  return tide.C, tide
end
local function last_error(C) return ffi.string(C.tide_last_error()) end

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

-- encode_docs(text, offsets, n_docs, sep, with_starts) -> {buf = int32 ids, n = count, starts}: documents
-- text[offsets[d], offsets[d + 1]) (text a Lua string or a pointer, offsets an int64 array of n_docs + 1), each
-- preceded by the id sep when sep >= 0; with_starts: starts (int64[n_docs + 1]) says where each document begins
function ByteTokenizer:encode_docs(text, offsets, n_docs, sep, with_starts)
  local src = ffi.cast("const uint8_t *", text)
  local total = tonumber(offsets[n_docs] - offsets[0]) + (sep and sep >= 0 and n_docs or 0)
  local out = ffi.new("int32_t[?]", math.max(total, 1))
  local starts = with_starts and ffi.new("int64_t[?]", n_docs + 1) or nil
  local pos = 0
  for d = 0, n_docs - 1 do
    if starts then starts[d] = pos end
    if sep and sep >= 0 then out[pos] = sep; pos = pos + 1 end
    local a, b = tonumber(offsets[d]), tonumber(offsets[d + 1])
    for i = a, b - 1 do out[pos + i - a] = src[i] end
    pos = pos + b - a
  end
  if starts then starts[n_docs] = pos end
  return { buf = out, n = total, starts = starts }
end

-- describe() -> what rebuilds this tokenizer (checkpoint metadata): {kind = "byte", vocab_size}
function ByteTokenizer:describe() return { kind = "byte", vocab_size = self.vocab_size } end

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

---------------------------------------------------------------------------------------------------
-- HuggingFace tokenizer.json byte-level BPE

local BpeTokenizer = {}
BpeTokenizer.__index = BpeTokenizer

-- bpe(path) -> the tokenizer of a tokenizer.json file; every problem with the file is one line naming it
function tokenizer.bpe(path)
  if type(path) ~= "string" then error("tokenizer.bpe: expected a path, got a " .. type(path), 2) end
  local C = engine()
  local h = C.tide_bpe_load(path)
  if h == nil then error(last_error(C), 0) end
  h = ffi.gc(h, C.tide_bpe_free)
  local self = setmetatable({ kind = "bpe", path = path, handle = h, vocab_size = tonumber(C.tide_bpe_vocab_size(h)),
    sha256 = ffi.string(C.tide_bpe_sha256(h)), pretokenizer = ffi.string(C.tide_bpe_pretokenizer(h)),
    specials = {}, names = {}, scratch = ffi.new("int32_t[?]", 4096), scratch_n = 4096 }, BpeTokenizer)
  local special, n = ffi.new("int[1]"), ffi.new("size_t[1]")
  for i = 0, C.tide_bpe_added_count(h) - 1 do
    local id = C.tide_bpe_added(h, i, special)
    if special[0] ~= 0 then
      local name = ffi.string(C.tide_bpe_token(h, id, n), n[0])
      self.specials[name] = id
      self.names[id] = name
    end
  end
  return self
end

-- the id of a token by name (an added token, else a model.vocab token); an error names the token and the file
function BpeTokenizer:id(name)
  local id = type(name) == "string" and engine().tide_bpe_token_id(self.handle, name, #name) or -1
  if id < 0 then
    error(fmt("tokenizer: no token '%s' in %s (a BPE vocabulary of %d ids)", tostring(name), self.path,
      self.vocab_size), 2)
  end
  return id
end

-- the ids of text in self.scratch (grown as needed); returns their count
local function encode_scratch(self, text)
  local C = engine()
  local n = C.tide_bpe_encode(self.handle, text, #text, self.scratch, self.scratch_n)
  if n < 0 then error(last_error(C), 3) end
  if n > self.scratch_n then
    self.scratch_n = tonumber(n)
    self.scratch = ffi.new("int32_t[?]", self.scratch_n)
    n = C.tide_bpe_encode(self.handle, text, #text, self.scratch, self.scratch_n)
  end
  return tonumber(n)
end

function BpeTokenizer:encode(text)
  if type(text) ~= "string" then error("tokenizer.encode: expected a string, got a " .. type(text), 2) end
  local n = encode_scratch(self, text)
  local ids, buf = {}, self.scratch
  for i = 1, n do ids[i] = buf[i - 1] end
  return ids
end

-- encode text into buf at 0-based pos; returns the next position. buf needs room for the ids: at most #text + 1
-- (a BPE token covers at least one byte; the ByteLevel prefix space adds one per piece). cap, when given, is the
-- buffer's size and is checked.
function BpeTokenizer:encode_into(text, buf, pos, cap)
  local n = encode_scratch(self, text)
  if cap and pos + n > cap then
    error(fmt("tokenizer.encode_into: %d ids do not fit at position %d of a buffer of %d", n, pos, cap), 2)
  end
  ffi.copy(buf + pos, self.scratch, n * 4)
  return pos + n
end

-- with_starts: the result's `starts` (int64[n_docs + 1]) says where each document's ids begin. Documents are text:
-- a special token's name in them stays text (as for the byte level, and as training data needs: a literal
-- "<|endoftext|>" must not cut a document) unless split_special, which splits them out as encode does.
function BpeTokenizer:encode_docs(text, offsets, n_docs, sep, with_starts, split_special)
  local C = engine()
  local count = ffi.new("int64_t[1]")
  local starts = with_starts and ffi.new("int64_t[?]", n_docs + 1) or nil
  local p = C.tide_bpe_encode_docs(self.handle, ffi.cast("const char *", text), offsets, n_docs, sep or -1,
    split_special and 1 or 0, starts, count)
  if p == nil then error(last_error(C), 2) end
  return { buf = ffi.gc(p, C.tide_free), n = tonumber(count[0]), starts = starts }
end

-- decode(ids, skip_special) -> the bytes of the ids (a Lua array of 0-based ids); specials print as their names
-- unless skip_special
function BpeTokenizer:decode(ids, skip_special)
  local n = #ids
  local buf = ffi.new("int32_t[?]", math.max(n, 1))
  for i = 1, n do buf[i - 1] = ids[i] end
  return self:decode_buf(buf, n, skip_special)
end

-- decode_buf(buf, n, skip_special): the same from n ids in an int32 (or uint32) array
function BpeTokenizer:decode_buf(buf, n, skip_special)
  local C = engine()
  buf = ffi.cast("const int32_t *", buf)
  local cap = n * 8 + 16
  local out = ffi.new("char[?]", cap)
  local k = C.tide_bpe_decode(self.handle, buf, n, skip_special and 1 or 0, out, cap)
  if k < 0 then error(last_error(C), 2) end
  if k > cap then
    cap = tonumber(k)
    out = ffi.new("char[?]", cap)
    k = C.tide_bpe_decode(self.handle, buf, n, skip_special and 1 or 0, out, cap)
  end
  return ffi.string(out, k)
end

-- describe() -> {kind = "bpe", vocab_size, sha256 (of the tokenizer.json bytes), pretokenizer}
function BpeTokenizer:describe()
  return { kind = "bpe", vocab_size = self.vocab_size, sha256 = self.sha256, pretokenizer = self.pretokenizer }
end

-- save(path): the tokenizer.json it was loaded from, written atomically
function BpeTokenizer:save(path)
  local C = engine()
  local n = ffi.new("size_t[1]")
  local p = C.tide_bpe_json(self.handle, n)
  if C.tide_file_write_atomic(path, p, n[0]) ~= 0 then error("tokenizer.save: " .. last_error(C), 2) end
end

---------------------------------------------------------------------------------------------------
-- training a byte-level BPE

-- train{files = {...}, vocab_size = N, min_frequency = 2, format, field, doc_separator, batch = 200,
--       progress = function(event, info)} -> the tokenizer.json text (engine/io/bpe_train.c)
-- files: text or JSONL files (text.documents reads them); the tide specials (formats.md §4) are added tokens with
-- ids 256..275, so every name tide code asks for resolves. progress("count", {file, files, index, bytes, words})
-- after each file, progress("merge", {vocab_size, target, merges, words}) every `batch` merges.
function tokenizer.train(o)
  local C = engine()
  local text = require "tide.data.text"
  local V = o.vocab_size
  if type(V) ~= "number" or V ~= math.floor(V) or V < 256 + #SPECIALS or V > 4194304 then
    error(fmt("tokenizer.train: vocab_size must be an integer in [%d, 4194304] (256 bytes and %d specials first), "
      .. "got %s", 256 + #SPECIALS, #SPECIALS, tostring(V)), 2)
  end
  local minf = o.min_frequency or 2
  if type(minf) ~= "number" or minf < 1 or minf ~= math.floor(minf) then
    error("tokenizer.train: min_frequency must be an integer >= 1, got " .. tostring(minf), 2)
  end
  if type(o.files) ~= "table" or #o.files == 0 then error("tokenizer.train: no input files", 2) end
  local names = ffi.new("const char *[?]", #SPECIALS)
  for i, name in ipairs(SPECIALS) do names[i - 1] = name end
  local tr = C.tide_bpe_trainer_new(names, #SPECIALS)
  if tr == nil then error(last_error(C), 2) end
  tr = ffi.gc(tr, C.tide_bpe_trainer_free)
  local progress = o.progress or function() end
  local bytes = 0
  for i, f in ipairs(o.files) do
    local docs = text.documents(f, o)
    if C.tide_bpe_trainer_add_docs(tr, ffi.cast("const char *", docs.text), docs.offsets, docs.n) ~= 0 then
      error("tokenizer.train: " .. f .. ": " .. last_error(C), 2)
    end
    bytes = bytes + docs.bytes
    progress("count", { file = f, index = i, files = #o.files, bytes = bytes,
      words = tonumber(C.tide_bpe_trainer_words(tr)) })
  end
  local merges = 0
  while true do
    local made = C.tide_bpe_trainer_merge(tr, V, minf, o.batch or 200)
    if made < 0 then error("tokenizer.train: " .. last_error(C), 2) end
    merges = merges + tonumber(made)
    progress("merge", { vocab_size = tonumber(C.tide_bpe_trainer_vocab_size(tr)), target = V, merges = merges,
      words = tonumber(C.tide_bpe_trainer_words(tr)) })
    if made == 0 then break end
  end
  local n = ffi.new("size_t[1]")
  local p = C.tide_bpe_trainer_json(tr, n)
  if p == nil then error("tokenizer.train: " .. last_error(C), 2) end
  local out = ffi.string(p, n[0])
  C.tide_free(p)
  return out, tonumber(C.tide_bpe_trainer_vocab_size(tr))
end

---------------------------------------------------------------------------------------------------
-- choosing a tokenizer

-- load(spec) -> a tokenizer: "byte" (tide's byte-level vocabulary of 320), {kind = "byte", vocab_size = V}, a path
-- to a tokenizer.json, or {kind = "bpe", path = P}
function tokenizer.load(spec, level)
  if spec == "byte" then return tokenizer.byte_level() end
  if type(spec) == "table" then
    if spec.kind == "byte" then return tokenizer.byte_level({ vocab_size = spec.vocab_size }) end
    if spec.kind == "bpe" and type(spec.path) == "string" then return tokenizer.bpe(spec.path) end
    error(fmt("tokenizer.load: a table spec is {kind = \"byte\", vocab_size = V} or {kind = \"bpe\", path = P}, "
      .. "got kind %s", tostring(spec.kind)), level or 2)
  end
  if type(spec) ~= "string" or spec == "" then
    error("tokenizer.load: expected \"byte\" or the path of a tokenizer.json, got " .. tostring(spec), level or 2)
  end
  return tokenizer.bpe(spec)
end

-- check_option(v, what, who) -> v: the `tokenizer` option of a recipe (data.tokenizer, a curriculum's tokenizer)
-- is nil, "byte", a path to a tokenizer.json, or a spec table for load
function tokenizer.check_option(v, what, who, level)
  if v == nil or v == "byte" then return v end
  if type(v) == "string" and v ~= "" then return v end
  if type(v) == "table" and (v.kind == "byte" or (v.kind == "bpe" and type(v.path) == "string")) then return v end
  options.fail(who, fmt("%s must be \"byte\" or the path of a tokenizer.json, got %s", what,
    type(v) == "string" and fmt("%q", v) or tostring(v)), level)
end

-- for_model(spec, vocab_size, what, who) -> the run's tokenizer: byte level with the model's vocab_size when spec
-- is nil or "byte", else load(spec), whose vocabulary must be the model's
function tokenizer.for_model(spec, V, what, who)
  tokenizer.check_option(spec, what, who)
  if spec == nil or spec == "byte" then return tokenizer.byte_level({ vocab_size = V }) end
  local ok, tok = pcall(tokenizer.load, spec)
  if not ok then options.fail(who, fmt("%s: %s", what, tostring(tok))) end
  if V and tok.vocab_size ~= V then
    options.fail(who, fmt("%s has %d ids but the model's vocab_size is %d (set model.vocab_size = %d)", what,
      tok.vocab_size, V, tok.vocab_size))
  end
  return tok
end

tokenizer.SPECIALS = SPECIALS
return tokenizer
