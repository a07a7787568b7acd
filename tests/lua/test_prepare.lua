-- Bring your own data: JSONL documents and directories as text sources (formats.md §5), training on them with a BPE
-- tokenizer, and `tide data prepare` (formats.md §3 shards: round trip, documents behind <|endoftext|>, shard cuts at
-- documents, uint32 when V > 65,536), its one-line errors.
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local cli = require "tide.cli"
local json = require "tide.json"
local tokenizer = require "tide.data.tokenizer"
local text = require "tide.data.text"
local pack = require "tide.data.pack"
local C = tide.C

local FIX = "tests/fixtures/tokenizers"
local fmt = string.format
local exe = cli.exe_path()
local q = cli.shell_quote

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
local function read(path) return assert(tide.read_file(path)) end

local function tide_cmd(args)
  local p = io.popen(q(exe) .. " " .. args .. " 2>&1; echo \"__exit=$?\"")
  local out = p:read("*a")
  p:close()
  local code = tonumber(out:match("__exit=(%d+)%s*$"))
  return (out:gsub("__exit=%d+%s*$", "")), code
end

-- the ids of one training document (a special's name in it is text)
local function doc_ids(tok, d)
  local r = tok:encode_docs(d, ffi.new("int64_t[2]", 0, #d), 1, -1)
  local out = {}
  for i = 0, r.n - 1 do out[i + 1] = r.buf[i] end
  return out
end

-- documents of a text source in stored order, decoded (without their leading <|endoftext|>)
local function source_docs(src, tok)
  local out = {}
  for i = 0, src:count() - 1 do
    local ids, _, n = src:doc(i, 1048576)
    T.eq(ids[0], tok:id("<|endoftext|>"), "each document begins with <|endoftext|>")
    local l = {}
    for t = 1, n - 1 do l[t] = ids[t] end
    out[#out + 1] = tok:decode(l)
  end
  return out
end

-- a corpus directory: a text file of %-separated documents and two JSONL files (one with blank lines)
local DOCS_TXT = { "first text document\n", "second one, with ünïcödé\n", "third\n" }
local DOCS_A = { "JSONL one: \"quoted\", tab\t, newline\n inside", "", "two 😀 emoji" }
local DOCS_B = { "b-1 <|endoftext|> inside", "b-2 last" }
local function corpus(dir)
  C.tide_mkdir_p(dir)
  write(dir .. "/a.txt", table.concat(DOCS_TXT, "%\n"))
  local lines = {}
  for i, d in ipairs(DOCS_A) do lines[i] = json.encode({ text = d, id = "a" .. i }) end
  write(dir .. "/b.jsonl", table.concat(lines, "\n") .. "\n")
  write(dir .. "/c.jsonl", "\n" .. json.encode({ id = 1, text = DOCS_B[1] }) .. "\n  \n" .. json.encode({ text = DOCS_B[2], x = { 1, { 2 } } }) .. "\n")
  local all = {}
  for _, l in ipairs({ DOCS_TXT, DOCS_A, DOCS_B }) do for _, d in ipairs(l) do all[#all + 1] = d end end
  return all
end

T.test("a directory of text and JSONL files is a text source: files in sorted order, JSONL documents from their field", function()
  local dir = T.tmpdir("prep-src", { create = true })
  local want = corpus(dir .. "/corpus")
  for _, tok in ipairs({ tokenizer.byte_level(), tokenizer.load(FIX .. "/hf_bpe.json") }) do
    local src = pack.text_source({ path = dir .. "/corpus", doc_separator = "%", order = "sequential", tokenizer = tok })
    T.eq(src.files, { dir .. "/corpus/a.txt", dir .. "/corpus/b.jsonl", dir .. "/corpus/c.jsonl" })
    T.eq(source_docs(src, tok), want, tok.kind)
  end
  -- format = "jsonl" reads any name as JSONL; field names another string field
  write(dir .. "/docs.data", json.encode({ body = "alpha", text = 1 }) .. "\n" .. json.encode({ body = "beta" }) .. "\n")
  local tok = tokenizer.byte_level()
  local src = pack.text_source({ path = dir .. "/docs.data", format = "jsonl", field = "body", order = "sequential", tokenizer = tok })
  T.eq(source_docs(src, tok), { "alpha", "beta" })
  local d = text.documents(dir .. "/docs.data", { format = "jsonl", field = "body" })
  T.eq(d.n, 2)
  T.eq(d.bytes, 9)
  T.raises(function() text.documents(dir .. "/docs.data", { format = "xml" }) end,
    "format must be 'auto', 'text', 'jsonl' or 'shard', got 'xml'")
end)

T.test("malformed JSONL is an error naming file:line (formats.md §5 limits)", function()
  local dir = T.tmpdir("prep-jsonl", { create = true })
  local ok = json.encode({ text = "fine" })
  local cases = {
    { ok .. "\n" .. '{"text": "x"' .. "\n", ":2: malformed JSON (at column" },
    { ok .. "\n\n" .. ok .. "\n" .. '{"body": "x"}' .. "\n", ":4: no \"text\" field" },
    { '{"text": 17}' .. "\n", ":1: \"text\" must be a string, got a number" },
    { "[1, 2]\n", ":1: expected a JSON object, got an array" },
    { ok .. " trailing\n", ":1: text after the JSON value" },
    { "\xEF\xBB\xBF" .. ok .. "\n", ":1: the file starts with a byte order mark" },
    { '{"text": "a\\u0000b"}' .. "\n", ":1: the line holds \\u0000" },
    { '{"text": "x", "d": ' .. string.rep("[", 65) .. string.rep("]", 65) .. "}\n", ":1: JSON nested deeper than 64" },
  }
  for i, c in ipairs(cases) do
    local path = fmt("%s/case%d.jsonl", dir, i)
    write(path, c[1])
    local e = T.raises(function() text.documents(path, {}) end, path .. c[2], fmt("case %d", i))
    T.ok(not e:find("\n"), "one line: " .. e)
  end
  -- depth 64 is fine, an escaped backslash before u0000 is text, the last line may lack its LF
  write(dir .. "/okay.jsonl", '{"text": "a\\\\u0000", "d": ' .. string.rep("[", 63) .. string.rep("]", 63) .. "}\n" .. ok)
  local d = text.documents(dir .. "/okay.jsonl", {})
  T.eq(d.n, 2)
  T.eq(ffi.string(ffi.cast("const char *", d.text) + d.offsets[0], d.offsets[1] - d.offsets[0]), "a\\u0000")
  -- a line over 64 MiB
  local f = assert(io.open(dir .. "/long.jsonl", "wb"))
  f:write(ok, "\n", '{"text": "', string.rep("x", 64 * 2 ^ 20), '"}\n')
  f:close()
  T.raises(function() text.documents(dir .. "/long.jsonl", {}) end, ":2: the line is 67108876 bytes, over the limit of 67108864")
end)

-- the shards of a prepare directory, concatenated: ids (Lua list), widths, per-shard counts
local function read_shards(dir, V)
  local info = json.decode(read(dir .. "/prepare.json"))
  local ids, counts = {}, {}
  for _, s in ipairs(info.shards) do
    local t = tide.wrap(C.tide_shard_read(dir .. "/" .. s.file, V)):tolist()
    counts[#counts + 1] = #t
    for _, v in ipairs(t) do ids[#ids + 1] = v end
  end
  return ids, counts, info
end

T.test("tide data prepare: shards hold every document behind <|endoftext|>, cut at documents; prepare.json", function()
  local dir = T.tmpdir("prep-cli", { create = true })
  local docs = corpus(dir .. "/corpus")
  local tok = tokenizer.load(FIX .. "/hf_bpe.json")
  local eot = tok:id("<|endoftext|>")
  local want, doc_len = {}, {}
  for i, d in ipairs(docs) do
    want[#want + 1] = eot
    local ids = doc_ids(tok, d)
    for _, v in ipairs(ids) do want[#want + 1] = v end
    doc_len[i] = #ids + 1
  end
  local out, code = tide_cmd(fmt("data prepare --tokenizer %s %s --doc-separator %% -o %s --shard-tokens 12",
    q(FIX .. "/hf_bpe.json"), q(dir .. "/corpus"), q(dir .. "/out")))
  T.eq(code, 0, out)
  T.ok(out:find(fmt("data prepare: %d documents, %d ids (uint16)", #docs, #want), 1, true), out)
  local ids, counts, info = read_shards(dir .. "/out", 1024)
  T.eq(ids, want)
  T.eq(info.documents, #docs)
  T.eq(info.tokens, #want)
  T.eq(info.width, 2)
  T.eq(info.tokenizer, tok:describe())
  T.eq(read(dir .. "/out/tokenizer.json"), read(FIX .. "/hf_bpe.json"))
  -- a shard ends before the document that would overflow 12 ids; a longer document fills shards of its own
  local expect, fill, starts_doc = {}, 0, {}
  for _, n in ipairs(doc_len) do
    if fill > 0 and fill + n > 12 then expect[#expect + 1], fill = fill, 0 end
    local first = true
    while n > 0 do
      if fill == 12 then expect[#expect + 1], fill = fill, 0 end
      if fill == 0 then starts_doc[#expect + 1] = first end
      local k = math.min(n, 12 - fill)
      fill, n, first = fill + k, n - k, false
    end
  end
  if fill > 0 then expect[#expect + 1] = fill end
  T.eq(counts, expect)
  T.ok(#counts > 4, #counts .. " shards")
  local at = 1
  for k, n in ipairs(counts) do
    T.eq(ids[at] == eot, starts_doc[k], fmt("shard %d begins a document: %s", k, tostring(starts_doc[k])))
    at = at + n
  end
  -- the shards train: a text source over the directory (the .json files left out) gives the same documents
  local src = pack.text_source({ path = dir .. "/out", exclude = { "%.json$" }, order = "sequential",
    tokenizer = tokenizer.load(dir .. "/out/tokenizer.json") })
  T.eq(src:count() >= #docs, true)
  -- byte level: the bytes themselves
  out, code = tide_cmd(fmt("data prepare --tokenizer byte --quiet %s -o %s", q(dir .. "/corpus/b.jsonl"), q(dir .. "/byte")))
  T.eq(code, 0, out)
  T.eq(out, "")
  ids = read_shards(dir .. "/byte", 320)
  local bytes = {}
  for _, d in ipairs(DOCS_A) do
    bytes[#bytes + 1] = 256
    for i = 1, #d do bytes[#bytes + 1] = d:byte(i) end
  end
  T.eq(ids, bytes)
  T.eq(C.tide_path_exists(dir .. "/byte/tokenizer.json"), 0, "no tokenizer.json for the byte level")
  -- one-line errors
  local errs = {
    { "data prepare --tokenizer byte " .. q(dir .. "/corpus") .. " -o " .. q(dir .. "/out"), "is not empty (13 entries); give --overwrite" },
    { "data prepare --tokenizer byte " .. q(dir .. "/nope") .. " -o " .. q(dir .. "/x"), "does not exist" },
    { "data prepare --tokenizer " .. q(dir .. "/corpus/a.txt") .. " " .. q(dir .. "/corpus") .. " -o " .. q(dir .. "/x"), "tokenizer '" },
    { "data prepare " .. q(dir .. "/corpus") .. " -o " .. q(dir .. "/x"), "--tokenizer byte|PATH is required" },
    { "data prepare --tokenizer byte --shard-tokens 0 " .. q(dir .. "/corpus") .. " -o " .. q(dir .. "/x"), "--shard_tokens must be in [1," },
    { "data prepare --tokenizer byte --format jsonl " .. q(dir .. "/corpus/a.txt") .. " -o " .. q(dir .. "/x"), "a.txt:1: malformed JSON" },
    { "data frobnicate", "expected prepare, got 'frobnicate'" },
  }
  for _, c in ipairs(errs) do
    local o, rc = tide_cmd(c[1])
    T.eq(rc, 1, c[1])
    T.ok(o:find(c[2], 1, true), fmt("%s: expected '%s' in: %s", c[1], c[2], o))
    T.eq(select(2, o:gsub("\n", "")), 1, "one line: " .. o)
  end
  out, code = tide_cmd(fmt("data prepare --tokenizer byte --overwrite %s -o %s", q(dir .. "/corpus/b.jsonl"), q(dir .. "/out")))
  T.eq(code, 0, out)
  T.eq(C.tide_path_exists(dir .. "/out/tokenizer.json"), 0, "--overwrite replaced the earlier prepare")
end)

T.test("a vocabulary over 65,536 ids gives uint32 shards (formats.md §3)", function()
  local dir = T.tmpdir("prep-u32", { create = true })
  local t = json.decode(read(FIX .. "/hf_bpe.json"))
  -- the specials move to ids 69998 and 69999 (still in model.vocab, so tokenizers keeps those ids)
  t.model.vocab["<|endoftext|>"], t.model.vocab["<|pad|>"] = 69998, 69999
  t.added_tokens[1].id, t.added_tokens[2].id = 69998, 69999
  write(dir .. "/big.json", json.encode(t))
  local tok = tokenizer.load(dir .. "/big.json")
  T.eq(tok.vocab_size, 70000)
  T.eq(tok:id("<|endoftext|>"), 69998)
  write(dir .. "/docs.jsonl", json.encode({ text = "hello world" }) .. "\n" .. json.encode({ text = "x<|pad|>y" }) .. "\n")
  local out, code = tide_cmd(fmt("data prepare --tokenizer %s %s -o %s", q(dir .. "/big.json"), q(dir .. "/docs.jsonl"),
    q(dir .. "/out")))
  T.eq(code, 0, out)
  T.ok(out:find("(uint32)", 1, true), out)
  local raw = read(dir .. "/out/shard_000000.bin")
  local h = ffi.cast("const int32_t *", raw)
  T.eq(h[0], 20240801, "Llama-3 magic")
  T.eq(h[1], 7)
  local want = { 69998 }
  for _, v in ipairs(doc_ids(tok, "hello world")) do want[#want + 1] = v end
  want[#want + 1] = 69998
  T.eq(#tok:encode("x<|pad|>y"), 3, "encode splits the special out")
  for _, v in ipairs(doc_ids(tok, "x<|pad|>y")) do want[#want + 1] = v end
  T.ok(#want > 9, "a document reads it as text")
  T.eq(h[2], #want)
  T.eq(#raw, 1024 + 4 * #want)
  T.eq((read_shards(dir .. "/out", 70000)), want)
  T.ok(C.tide_shard_read(dir .. "/out/shard_000000.bin", 69998) == nil, "an id >= V is refused")
end)

T.test("training on JSONL documents, a directory and prepared shards with a BPE tokenizer (data.tokenizer)", function()
  local dir = T.tmpdir("prep-train", { create = true })
  corpus(dir .. "/corpus")
  local lines = {}
  for i = 1, 200 do lines[i] = json.encode({ text = fmt("document %d: the quick brown fox jumps over the lazy dog %d times.", i, i * 7) }) end
  write(dir .. "/corpus/d.jsonl", table.concat(lines, "\n") .. "\n")
  local train = require "tide.train"
  local function cfg(data)
    data.seq_len, data.batch_size = 16, 2
    -- KDA layers: packed documents (data.sources) need their document resets
    return { model = { dim = 32, n_layers = 1, n_heads = 2, vocab_size = 1024, mixer = "kda" }, data = data,
      optim = { lr = 1e-3 }, train = { steps = 3, log_every = 1000, seed = 1, quiet = true } }
  end
  local bpe = FIX .. "/hf_bpe.json"
  local runs = {
    { path = dir .. "/corpus/d.jsonl", tokenizer = bpe },
    { path = dir .. "/corpus", doc_separator = "%", tokenizer = bpe },
    { sources = { docs = { kind = "text", path = dir .. "/corpus", doc_separator = "%" } }, tokenizer = bpe },
  }
  for i, d in ipairs(runs) do
    local r = train(cfg(d))
    T.eq(#r.losses, 3, "run " .. i)
    for _, l in ipairs(r.losses) do T.ok(l == l and l > 0 and l < 20, fmt("run %d: loss %s", i, tostring(l))) end
    T.eq(r.model.cfg.vocab_size, 1024)
  end
  local out, code = tide_cmd(fmt("data prepare --tokenizer %s %s --doc-separator %% -o %s --quiet", q(bpe), q(dir .. "/corpus"),
    q(dir .. "/shards")))
  T.eq(code, 0, out)
  local c2 = cfg({ path = dir .. "/shards", exclude = { "%.json$" }, tokenizer = dir .. "/shards/tokenizer.json" })
  c2.train.out = dir .. "/run"
  local r = train(c2)
  T.eq(#r.losses, 3)
  -- the checkpoint carries the tokenizer: load_model gives the same BPE back (checkpoint.lua, tokenizer.json)
  local _, info = require("tide.checkpoint").load_model(dir .. "/run")
  T.eq(info.tokenizer.kind, "bpe")
  T.eq(info.tokenizer.sha256, tokenizer.load(bpe).sha256)
  T.eq(info.tokenizer:encode("hello there"), tokenizer.load(bpe):encode("hello there"))
  T.raises(function() train(cfg({ path = dir .. "/corpus/d.jsonl", tokenizer = 7 })) end,
    "data.tokenizer must be \"byte\" or the path of a tokenizer.json, got 7")
  local c = cfg({ path = dir .. "/corpus/d.jsonl", tokenizer = bpe })
  c.model.vocab_size = 320
  T.raises(function() train(c) end, "data.tokenizer has 1024 ids but the model's vocab_size is 320")
end)

T.run()
