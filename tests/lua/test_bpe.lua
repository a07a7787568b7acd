-- HuggingFace tokenizer.json byte-level BPE (formats.md §4, oracle 4): the byte map, string and pair merges, the
-- round trip on random bytes, the tokenizers library's ids (committed fixtures, and the live package for the GPT-2
-- and Llama-3 pre-tokenizers, added-token options and the prefix space), specials by name, save, hostile files.
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local tokenizer = require "tide.data.tokenizer"
local json = require "tide.json"
local C = tide.C

local FIX = "tests/fixtures/tokenizers"
local FORTUNES = "/usr/share/games/fortunes"
local PYTHON = "build/pyenv/bin/python"
local fmt = string.format

local function read(path)
  local s, err = tide.read_file(path)
  if not s then error(err, 2) end
  return s
end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- GPT-2 bytes_to_unicode, written out from the rule in formats.md §4 (independent of the engine's table)
local function byte_cp(b)
  if (b >= 0x21 and b <= 0x7E) or (b >= 0xA1 and b <= 0xAC) or (b >= 0xAE and b <= 0xFF) then return b end
  local k = 0
  for c = 0, b - 1 do
    if not ((c >= 0x21 and c <= 0x7E) or (c >= 0xA1 and c <= 0xAC) or (c >= 0xAE and c <= 0xFF)) then k = k + 1 end
  end
  return 256 + k
end
local function utf8(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  return string.char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- a merge-free byte-level tokenizer.json whose id of byte b's symbol is that symbol's code point
local function codepoint_tokenizer()
  local vocab = {}
  for b = 0, 255 do vocab[#vocab + 1] = fmt("%s: %d", json.encode(utf8(byte_cp(b))), byte_cp(b)) end
  return '{"version": "1.0", "added_tokens": [], "normalizer": null, ' ..
    '"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}, ' ..
    '"decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {' .. table.concat(vocab, ", ") ..
    '}, "merges": []}}'
end

local function eq_ids(got, want, what)
  local n = math.max(#got, #want)
  for i = 1, n do
    if got[i] ~= want[i] then
      T.ok(false, fmt("%s: %d ids vs %d; first difference at %d: %s vs %s", what, #got, #want, i, tostring(got[i]),
        tostring(want[i])))
    end
  end
end

local function fortune_files()
  local n = ffi.new("size_t[1]")
  local p = C.tide_list_dir(FORTUNES, n)
  T.ok(p ~= nil, "the fortunes corpus (Debian package fortunes) is installed in " .. FORTUNES)
  local names = ffi.string(p, n[0])
  C.tide_free(p)
  local files = {}
  for name in names:gmatch("([^%z]+)%z") do
    if not name:match("%.dat$") and not name:match("%.u8$") then files[#files + 1] = FORTUNES .. "/" .. name end
  end
  return files
end

local function sha256(s)
  local out = ffi.new("char[65]")
  C.tide_sha256_hex(s, #s, out)
  return ffi.string(out)
end

T.test("byte map: 188 identity bytes, 0x20 -> U+0120, 0x0A -> U+010A, the rest from 256 in byte order (oracle 4)", function()
  local dir = T.tmpdir("bpe-map", { create = true })
  write(dir .. "/tokenizer.json", codepoint_tokenizer())
  local tok = tokenizer.load(dir .. "/tokenizer.json")
  local identity, others = 0, {}
  for b = 0, 255 do
    local ids = tok:encode(string.char(b))
    T.eq(#ids, 1)
    if ids[1] == b then identity = identity + 1 else others[#others + 1] = ids[1] end
    T.eq(tok:decode(ids), string.char(b))
  end
  T.eq(identity, 188)
  T.eq(tok:encode(" ")[1], 0x120)
  T.eq(tok:encode("\n")[1], 0x10A)
  T.eq(#others, 68)
  for i = 1, 68 do T.eq(others[i], 255 + i, "non-printable bytes take 256, 257, ... in byte order") end
  T.eq(tok:encode("Hi there")[3], 0x120)
end)

T.test("the tokenizers library's ids: the committed fixtures (multilingual text, a fortunes file)", function()
  local tok = tokenizer.load(FIX .. "/hf_bpe.json")
  local exp = json.decode(read(FIX .. "/expected.json"))
  T.eq(#exp.cases, 2)
  for _, c in ipairs(exp.cases) do
    local name = c.text:match("^fortunes:(.*)$")
    local path = name and (FORTUNES .. "/" .. name) or (FIX .. "/" .. c.text)
    local text = read(path)
    T.ok(sha256(text) == c.sha256, fmt("%s is not the text the fixture was made from (SHA-256 %s, want %s): run "
      .. "tests/scripts/make_tokenizer_fixtures.py", path, sha256(text), c.sha256))
    local want = tide.wrap(C.tide_shard_read(FIX .. "/" .. c.ids, tok.vocab_size)):tolist()
    T.eq(#want, c.count)
    eq_ids(tok:encode(text), want, c.text)
    T.eq(tok:decode(want), text, c.text .. ": decode")
  end
end)

T.test("string merges and pair merges encode identically (oracle 4)", function()
  local src = read(FIX .. "/hf_bpe.json")
  local t = json.decode(src)
  local pairs_form = {}
  for i, m in ipairs(t.model.merges) do
    local a, b = m:match("^(%S+) (%S+)$")
    pairs_form[i] = json.array and json.array({ a, b }) or { a, b }
  end
  t.model.merges = pairs_form
  local dir = T.tmpdir("bpe-pairs", { create = true })
  write(dir .. "/pairs.json", json.encode(t))
  T.ok(read(dir .. "/pairs.json"):find('"merges":%[%["'), "the merges are written as pairs")
  local a, b = tokenizer.load(FIX .. "/hf_bpe.json"), tokenizer.load(dir .. "/pairs.json")
  for _, path in ipairs({ FIX .. "/multilingual.txt", FORTUNES .. "/science", FORTUNES .. "/linux" }) do
    local text = read(path)
    local x, y = a:encode(text), b:encode(text)
    T.ok(#x > 1000 or path:find("multilingual"), path)
    eq_ids(y, x, path)
  end
end)

-- a deterministic stream of numbers in [0, 1)
local function lcg(seed)
  local s = seed
  return function()
    s = (s * 1103515245 + 12345) % 2147483648
    return s / 2147483648
  end
end

T.test("encode then decode is the identity on 10^4 random byte strings (oracle 4)", function()
  local tok = tokenizer.load(FIX .. "/hf_bpe.json")
  local r = lcg(7)
  local pieces = { "<|endoftext|>", "<|pad|>", " the", "'s", "\r\n", "\xF0\x9F\x98\x80", "\xE2\x80\xA8", "  " }
  for k = 1, 10000 do
    local out = {}
    for i = 1, math.floor(r() * 48) do
      local u = r()
      if u < 0.5 then out[i] = string.char(math.floor(r() * 256))          -- any byte, UTF-8 or not
      elseif u < 0.8 then out[i] = string.char(32 + math.floor(r() * 95))  -- ASCII
      else out[i] = pieces[1 + math.floor(r() * #pieces)] end
    end
    local s = table.concat(out)
    local ids = tok:encode(s)
    if tok:decode(ids) ~= s then T.ok(false, fmt("string %d (%q) does not round trip", k, s)) end
  end
end)

T.test("specials by name: found in the vocabulary or a clear error when asked for; describe; save", function()
  local tok = tokenizer.load(FIX .. "/hf_bpe.json")
  T.eq(tok.kind, "bpe")
  T.eq(tok.vocab_size, 1024)
  T.eq(tok:id("<|endoftext|>"), 0)
  T.eq(tok:id("<|pad|>"), 1)
  T.eq(tok.specials["<|endoftext|>"], 0)
  T.eq(tok.names[1], "<|pad|>")
  local e = T.raises(function() tok:id("<|im_end|>") end, "no token '<|im_end|>' in " .. FIX .. "/hf_bpe.json")
  T.ok(not e:find("\n"), "one line")
  -- a literal special in text is that token (as in tokenizers); decode prints it unless skip_special
  local ids = tok:encode("a<|endoftext|>b")
  T.eq(#ids, 3)
  T.eq(ids[2], 0)
  T.eq(tok:decode(ids), "a<|endoftext|>b")
  T.eq(tok:decode(ids, true), "ab")
  T.raises(function() tok:decode({ 1024 }) end, "id 1024 at position 1 is not in the vocabulary of 1024")
  local d = tok:describe()
  T.eq(d.kind, "bpe")
  T.eq(d.vocab_size, 1024)
  T.eq(d.sha256, sha256(read(FIX .. "/hf_bpe.json")))
  T.eq(d.pretokenizer, "gpt2")
  T.eq(json.decode(json.encode(d)), d, "describe() is JSON")
  T.eq(tokenizer.byte_level({ vocab_size = 512 }):describe(), { kind = "byte", vocab_size = 512 })
  local dir = T.tmpdir("bpe-save", { create = true })
  tok:save(dir .. "/tokenizer.json")
  T.eq(read(dir .. "/tokenizer.json"), read(FIX .. "/hf_bpe.json"))
  T.eq(tokenizer.load(dir .. "/tokenizer.json").sha256, tok.sha256)
  T.eq(C.tide_path_exists(dir .. "/tokenizer.json.tmp"), 0, "saved atomically")
  -- encode_into and encode_docs give the same ids as encode
  local text = "Hello, world! It's 2024.\n\tTabs and  spaces."
  local buf = ffi.new("int32_t[?]", #text + 2)
  local n = tok:encode_into(text, buf, 1, #text + 2)
  local want = tok:encode(text)
  T.eq(n, 1 + #want)
  for i = 1, #want do T.eq(buf[i], want[i]) end
  T.raises(function() tok:encode_into(text, buf, 1, 3) end, "do not fit")
  local offs = ffi.new("int64_t[3]", 0, 5, #text)
  local docs = tok:encode_docs(text, offs, 2, 0)
  local w1, w2 = tok:encode(text:sub(1, 5)), tok:encode(text:sub(6))
  -- documents read a special's name as text (training data); split_special reads it as encode does
  local lit = "a<|endoftext|>b"
  local o1 = ffi.new("int64_t[2]", 0, #lit)
  T.ok(tok:encode_docs(lit, o1, 1, -1).n > 3, "a literal special name in a document stays text")
  T.eq(tok:encode_docs(lit, o1, 1, -1, false, true).n, 3)
  T.eq(docs.n, 2 + #w1 + #w2)
  T.eq(docs.buf[0], 0)
  T.eq(docs.buf[1 + #w1], 0)
  for i = 1, #w2 do T.eq(docs.buf[1 + #w1 + i], w2[i]) end
end)

T.test("tokenizer.load: \"byte\", spec tables, paths; bad specs are one-line errors", function()
  T.eq(tokenizer.load("byte").kind, "byte")
  T.eq(tokenizer.load("byte").vocab_size, 320)
  T.eq(tokenizer.load({ kind = "byte", vocab_size = 400 }).vocab_size, 400)
  T.eq(tokenizer.load({ kind = "bpe", path = FIX .. "/hf_bpe.json" }).vocab_size, 1024)
  T.raises(function() tokenizer.load(42) end, "expected \"byte\" or the path of a tokenizer.json, got 42")
  T.raises(function() tokenizer.load({ kind = "wordpiece" }) end, "got kind wordpiece")
  T.raises(function() tokenizer.load("/nonexistent/tokenizer.json") end, "tokenizer: ")
  local e = T.raises(function() tokenizer.load(FIX) end, FIX)
  T.ok(e:find("not a regular file") or e:find("directory"), e)
  local tok = tokenizer.for_model(nil, 512, "data.tokenizer", "tide.train")
  T.eq(tok.vocab_size, 512)
  T.raises(function() tokenizer.for_model(FIX .. "/hf_bpe.json", 320, "data.tokenizer", "tide.train") end,
    "data.tokenizer has 1024 ids but the model's vocab_size is 320")
  T.raises(function() tokenizer.for_model(true, 320, "data.tokenizer", "tide.train") end,
    "data.tokenizer must be \"byte\" or the path of a tokenizer.json, got true")
end)

T.test("a long document is encoded in chunks on all threads with the ids of one encode", function()
  local C2 = C
  for _, path in ipairs({ FIX .. "/hf_bpe.json", "llama3" }) do
    local tok
    if path == "llama3" then
      local t = json.decode(read(FIX .. "/hf_bpe.json"))
      t.pre_tokenizer = { type = "Sequence", pretokenizers = {
        { type = "Split", pattern = { Regex = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
          .. "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" }, behavior = "Isolated", invert = false },
        { type = "ByteLevel", add_prefix_space = false, use_regex = false } } }
      local dir = T.tmpdir("bpe-chunks", { create = true })
      write(dir .. "/l3.json", json.encode(t))
      tok = tokenizer.load(dir .. "/l3.json")
      T.eq(tok.pretokenizer, "llama3")
    else
      tok = tokenizer.load(path)
    end
    -- over 2 MiB: cut after lone newlines between printable bytes, encoded on all threads
    local parts = { read(FORTUNES .. "/linux"), "<|endoftext|>\n<|pad|>x\n", read(FIX .. "/multilingual.txt") }
    local text = string.rep(table.concat(parts), 80)
    T.ok(#text > 4 * 2 ^ 20, #text .. " bytes")
    local one = C2.tide_bpe_encode(tok.handle, text, #text, nil, 0)
    for _, split in ipairs({ false, true }) do
      local got = tok:encode_docs(text, ffi.new("int64_t[2]", 0, #text), 1, -1, false, split)
      if split then
        local want = ffi.new("int32_t[?]", one)
        T.eq(C2.tide_bpe_encode(tok.handle, text, #text, want, one), one)
        T.eq(got.n, tonumber(one))
        for i = 0, got.n - 1 do
          if got.buf[i] ~= want[i] then T.ok(false, fmt("id %d: %d vs %d", i, got.buf[i], want[i])) end
        end
      end
      T.ok(tok:decode_buf(got.buf, got.n) == text, "decodes back")
    end
  end
end)

-- ---- hostile files ---------------------------------------------------------------------------------------------
T.test("hostile tokenizer.json files: truncated, wrong types, bad ids, unsupported parts, huge: one-line errors", function()
  local good = read(FIX .. "/hf_bpe.json")
  local dir = T.tmpdir("bpe-hostile", { create = true })
  local base = json.decode(good)
  local function variant(edit)
    local t = json.decode(good)
    edit(t)
    return json.encode(t)
  end
  local cases = {
    { "", "the file is empty" },
    { good:sub(1, math.floor(#good / 2)), "not valid JSON (at byte" },
    { "[1, 2]", "the top level must be an object, got an array" },
    { variant(function(t) t.model = nil end), "model must be an object, got missing" },
    { variant(function(t) t.model.type = "WordPiece" end), "model.type must be \"BPE\", got 'WordPiece'" },
    { variant(function(t) t.model.vocab = { 1, 2 } end), "model.vocab must be an object of token: id, got an array" },
    { variant(function(t) t.model.vocab["Ġthe"] = "7" end), "model.vocab['Ġthe'] must be an integer id in [0, 4194304), got a string" },
    { variant(function(t) t.model.vocab["Ġthe"] = -1 end), "got a number outside it" },
    { variant(function(t) t.model.vocab["Ġthe"] = 1e9 end), "got a number outside it" },
    { variant(function(t) t.model.vocab["Ġthe"] = 2.5 end), "got a number outside it" },
    { variant(function(t) t.model.vocab["zzzz"] = 5 end), "model.vocab gives id 5 to both" },
    { variant(function(t) t.model.vocab["Ā"] = nil end), "model.vocab lacks the symbol U+0100 of byte 0x00" },
    { variant(function(t) t.model.merges = "a b" end), "model.merges must be an array, got a string" },
    { variant(function(t) t.model.merges[3] = "a b c" end), "model.merges[2] 'a b c' must be two tokens separated by one space" },
    { variant(function(t) t.model.merges[3] = 17 end), "model.merges[2] must be \"a b\" or [\"a\", \"b\"], got a number" },
    { variant(function(t) t.model.merges[3] = "Ġ qqqq" end), "model.merges[2] ('Ġ' 'qqqq'): 'qqqq' is not in model.vocab" },
    { variant(function(t) t.model.merges[3] = "q q" end), "model.merges[2] ('q' 'q'): 'qq' is not in model.vocab" },
    { variant(function(t) t.model.dropout = 0.1 end), "model.dropout must be null" },
    { variant(function(t) t.model.byte_fallback = true end), "model.byte_fallback must be false" },
    { variant(function(t) t.model.ignore_merges = "yes" end), "model.ignore_merges must be a boolean, got a string" },
    { variant(function(t) t.added_tokens = "x" end), "added_tokens must be an array, got a string" },
    { variant(function(t) t.added_tokens[1].content = "" end), "added_tokens[0].content must be a non-empty string" },
    { variant(function(t) t.added_tokens[1].id = 5 end), "added_tokens[0] '<|endoftext|>' has id 5, but tokenizers gives it id 0" },
    { variant(function(t) t.added_tokens[1].special = "yes" end), "added_tokens[0].special must be a boolean, got a string" },
    { variant(function(t)
        t.added_tokens[#t.added_tokens + 1] = { id = 1030, content = "<new>", special = true }
      end), "added_tokens[2] '<new>' has id 1030, but tokenizers gives it id 1024" },
    { variant(function(t) t.added_tokens[2].content = "<|endoftext|>" end), "added_tokens[1]: '<|endoftext|>' is listed twice" },
    { variant(function(t) t.normalizer = { type = "NFC" } end), "normalizer 'NFC' is not supported" },
    { variant(function(t) t.pre_tokenizer = nil end), "pre_tokenizer is missing" },
    { variant(function(t) t.pre_tokenizer = { type = "Whitespace" } end), "pre_tokenizer.type 'Whitespace' is not supported" },
    { variant(function(t)
        t.pre_tokenizer = { type = "Sequence", pretokenizers = {
          { type = "Split", pattern = { Regex = "\\w+|[^\\w\\s]+" }, behavior = "Isolated", invert = false },
          { type = "ByteLevel", add_prefix_space = false, use_regex = false } } }
      end), "pre_tokenizer Split regex '\\w+|[^\\w\\s]+' is not supported" },
    { variant(function(t)
        t.pre_tokenizer = { type = "Sequence", pretokenizers = {
          { type = "Split", pattern = { Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+" },
            behavior = "Removed", invert = false },
          { type = "ByteLevel", add_prefix_space = false, use_regex = false } } }
      end), "pre_tokenizer Split behavior must be \"Isolated\", got 'Removed'" },
    { variant(function(t) t.decoder = nil end), "decoder must be {\"type\": \"ByteLevel\"}, got missing" },
    { variant(function(t) t.decoder = { type = "WordPiece" } end), "decoder must be {\"type\": \"ByteLevel\"}, got 'WordPiece'" },
  }
  T.ok(base.model.merges[3] ~= nil)
  for i, c in ipairs(cases) do
    local path = fmt("%s/case%02d.json", dir, i)
    write(path, c[1])
    local e = T.raises(function() tokenizer.load(path) end, c[2], fmt("case %d", i))
    T.ok(not e:find("\n"), fmt("case %d: one line: %s", i, e))
    T.ok(e:find(path, 1, true), fmt("case %d names the file: %s", i, e))
  end
  -- over the size limit, as a sparse file: refused before it is read
  local big = dir .. "/big.json"
  local f = assert(io.open(big, "wb"))
  f:seek("set", 256 * 2 ^ 20)
  f:write("}")
  f:close()
  T.raises(function() tokenizer.load(big) end, "over the limit of 268435456 bytes")
  -- every truncation of a small valid file is an error, never a crash
  local small = codepoint_tokenizer()
  for k = 0, #small - 1, 7 do
    write(dir .. "/trunc.json", small:sub(1, k))
    T.raises(function() tokenizer.load(dir .. "/trunc.json") end, "tokenizer '")
  end
end)

-- ---- the live tokenizers package -------------------------------------------------------------------------------
local function need_python()
  T.ok(C.tide_path_exists(PYTHON) == 1, "build/pyenv is missing: run scripts/test_deps.sh (the tokenizers package "
    .. "is the reference these tests compare with)")
end

-- runs the tokenizers library on jobs {tokenizer, input, split}; each result: {ids (uint32 array), n, counts
-- (uint32 array, one per document), text (its decode)}
local function hf_run(jobs, dir)
  local out = dir .. "/hf"
  C.tide_remove_tree(out)
  C.tide_mkdir_p(out)
  local list = {}
  for i, j in ipairs(jobs) do list[i] = { tokenizer = j.tokenizer, input = j.input, split = j.split or json.null } end
  write(dir .. "/jobs.json", json.encode(json.array(list)))
  local q = require("tide.cli").shell_quote
  local p = io.popen(fmt("%s tests/scripts/hf_tokenize.py encode %s %s 2>&1", PYTHON, q(dir .. "/jobs.json"), q(out)))
  local log = p:read("*a")
  p:close()
  T.ok(log:find("ok tokenizers 0.19.1", 1, true), "tokenizers ran: " .. log)
  local res = {}
  for k = 0, #jobs - 1 do
    local ids, counts = read(fmt("%s/%d.ids", out, k)), read(fmt("%s/%d.counts", out, k))
    res[k + 1] = { raw = { ids, counts }, ids = ffi.cast("const uint32_t *", ids), n = #ids / 4,
      counts = ffi.cast("const uint32_t *", counts), n_docs = #counts / 4, text = read(fmt("%s/%d.txt", out, k)) }
  end
  return res
end

-- tide's ids for a job (documents split like Python's str.split) against the tokenizers library's
local function compare(tok, job, hf, what)
  local text = read(job.input)
  local pieces = {}
  if job.split then
    local at = 1
    while true do
      local a, b = text:find(job.split, at, true)
      pieces[#pieces + 1] = text:sub(at, (a or #text + 1) - 1)
      if not a then break end
      at = b + 1
    end
  else
    pieces[1] = text
  end
  local offs = ffi.new("int64_t[?]", #pieces + 1)
  for i, p in ipairs(pieces) do offs[i] = offs[i - 1] + #p end
  local got = tok:encode_docs(table.concat(pieces), offs, #pieces, -1, true, true)
  T.eq(#pieces, hf.n_docs, what .. ": documents")
  local at = 0
  for d = 0, #pieces - 1 do
    local n = tonumber(got.starts[d + 1] - got.starts[d])
    if n ~= hf.counts[d] then
      T.ok(false, fmt("%s: document %d has %d ids, tokenizers gives %d", what, d + 1, n, hf.counts[d]))
    end
    at = at + n
  end
  T.eq(got.n, hf.n, what .. ": ids")
  for i = 0, got.n - 1 do
    if got.buf[i] ~= hf.ids[i] then
      T.ok(false, fmt("%s: id %d of %d is %d, tokenizers gives %d", what, i + 1, got.n, got.buf[i], hf.ids[i]))
    end
  end
  T.ok(tok:decode_buf(hf.ids, hf.n) == hf.text, what .. ": decode byte for byte")
  return got.n
end

-- random valid UTF-8 from the characters the pre-tokenizers treat differently
local function tricky_text(seed, lines)
  local alphabet = { "a", "Z", "é", "ß", "Ω", "я", "日", "本", "한", "ก", "\u{0301}", "٣", "7", "0", "½", "Ⅻ", " ", " ",
    "  ", "\t", "\n", "\r\n", "\r", "\u{00A0}", "\u{3000}", "\u{2028}", "\u{0085}", "'", "'s", "'S", "'ll", "'LL",
    "'ſ", "'Re", "!", "?", ".", ",", "-", "_", "(", "\"", "😀", "👍🏽", "\u{200D}", "𝐀", "ⓐ", "#", "$" }
  local r = lcg(seed)
  local out = {}
  for l = 1, lines do
    local parts = {}
    for i = 1, math.floor(r() * 24) do parts[i] = alphabet[1 + math.floor(r() * #alphabet)] end
    out[l] = table.concat(parts)
  end
  return table.concat(out, "\n")
end

-- the pre_tokenizer of the Llama-3 tokenizer.json: Split with its regex, then ByteLevel without one
local LLAMA3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
  .. "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

T.test("the live tokenizers package: the same ids and decoded bytes for GPT-2 and Llama-3 pre-tokenizers, "
  .. "added-token options and the prefix space", function()
  need_python()
  local dir = T.tmpdir("bpe-live", { create = true })
  local base = read(FIX .. "/hf_bpe.json")
  local function variant(name, edit)
    local t = json.decode(base)
    edit(t)
    local path = dir .. "/" .. name .. ".json"
    write(path, json.encode(t))
    return path
  end
  local corpus = {}
  for _, f in ipairs(fortune_files()) do corpus[#corpus + 1] = read(f) end
  write(dir .. "/fortunes.txt", table.concat(corpus))
  write(dir .. "/tricky.txt", tricky_text(11, 3000))
  write(dir .. "/added.txt", table.concat({
    "x <mask> y\t<mask>\n<mask>  end <mask>", "Anthony ony ony, tony ony_ (ony) ony", "a<|endoftext|> b <|pad|>  <|pad|>c",
    " the the  the\u{3000}the", "<mask><mask> <mask>ony ony<mask>", "ſony İony ony\u{0301} ony𝐀 ony", "" }, "\n"))
  local llama = variant("llama3", function(t)
    t.pre_tokenizer = { type = "Sequence", pretokenizers = {
      { type = "Split", pattern = { Regex = LLAMA3 }, behavior = "Isolated", invert = false },
      { type = "ByteLevel", add_prefix_space = false, trim_offsets = true, use_regex = false } } }
    t.model.ignore_merges = true
  end)
  local gpt2_split = variant("gpt2_split", function(t)
    t.pre_tokenizer = { type = "Sequence", pretokenizers = {
      { type = "Split", pattern = { Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+" },
        behavior = "Isolated", invert = false },
      { type = "ByteLevel", add_prefix_space = false, trim_offsets = true, use_regex = false } } }
  end)
  local added = variant("added", function(t)
    local a = t.added_tokens
    a[#a + 1] = { id = 1024, content = "<mask>", single_word = false, lstrip = true, rstrip = true, normalized = false, special = true }
    a[#a + 1] = { id = 1025, content = "ony", single_word = true, lstrip = false, rstrip = false, normalized = true, special = false }
    a[#a + 1] = { id = 1026, content = " the", single_word = false, lstrip = false, rstrip = false, normalized = true, special = false }
    -- a token of model.vocab added again keeps its id
    a[#a + 1] = { id = t.model.vocab.the, content = "the", single_word = false, lstrip = false, rstrip = true,
      normalized = false, special = false }
  end)
  local prefix = variant("prefix", function(t) t.pre_tokenizer.add_prefix_space = true end)
  -- a tokenizer trained by tide (tokenizer.train, what `tide tokenizer train` runs)
  local trained = dir .. "/tide_trained.json"
  write(trained, (tokenizer.train({ files = fortune_files(), vocab_size = 1500 })))
  local some = {}
  for _, n in ipairs({ "computers", "linux", "science" }) do some[#some + 1] = read(FORTUNES .. "/" .. n) end
  write(dir .. "/some_fortunes.txt", table.concat(some))
  local F, M, R = dir .. "/fortunes.txt", FIX .. "/multilingual.txt", dir .. "/tricky.txt"
  local D = "\n%\n"   -- fortunes: one document per fortune, as `tide data prepare --doc-separator %` reads them
  local jobs = {
    { tokenizer = FIX .. "/hf_bpe.json", input = F, split = D }, { tokenizer = FIX .. "/hf_bpe.json", input = M },
    { tokenizer = FIX .. "/hf_bpe.json", input = R },
    { tokenizer = trained, input = F, split = D }, { tokenizer = trained, input = M }, { tokenizer = trained, input = R },
    { tokenizer = llama, input = dir .. "/some_fortunes.txt" }, { tokenizer = llama, input = M },
    { tokenizer = llama, input = R },
    { tokenizer = gpt2_split, input = M }, { tokenizer = gpt2_split, input = R },
    { tokenizer = added, input = dir .. "/added.txt" }, { tokenizer = added, input = M },
    { tokenizer = prefix, input = dir .. "/added.txt" }, { tokenizer = prefix, input = M }, { tokenizer = prefix, input = R },
  }
  local hf = hf_run(jobs, dir)
  local toks, n_fortune = {}, 0
  for k, j in ipairs(jobs) do
    toks[j.tokenizer] = toks[j.tokenizer] or tokenizer.load(j.tokenizer)
    local n = compare(toks[j.tokenizer], j, hf[k], fmt("%s on %s", j.tokenizer:match("[^/]+$"), j.input:match("[^/]+$")))
    if j.input == F then n_fortune = n_fortune + n end
  end
  T.ok(n_fortune > 1500000, "the whole fortunes corpus, twice: " .. n_fortune .. " ids")
  T.eq(tokenizer.load(llama).pretokenizer, "llama3")
end)

T.run()
