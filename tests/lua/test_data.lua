-- data: byte-level tokenizer, text/shard loading, deterministic batch streams; JSON and the JSONL log.
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local tokenizer = require "tide.data.tokenizer"
local text = require "tide.data.text"
local data = require "tide.data"
local json = require "tide.json"
local log = require "tide.log"

local FIXTURE = "tests/fixtures/tiny_corpus.txt"
local function tmpdir(name) return T.tmpdir("data-" .. name, { create = true }) end

T.test("byte-level tokenizer: bytes round trip, specials by name (formats.md §4)", function()
  local tok = tokenizer.byte_level({ vocab_size = 320 })
  local all = {}
  for b = 0, 255 do all[#all + 1] = string.char(b) end
  local s = table.concat(all)
  local ids = tok:encode(s)
  T.eq(#ids, 256)
  T.eq(ids[1], 0)
  T.eq(ids[256], 255)
  T.eq(tok:decode(ids), s)
  T.eq(tok:id("<|endoftext|>"), 256)
  T.eq(tok:id("<|pad|>"), 257)
  T.eq(tok:id("<|im_end|>"), 263)
  T.eq(tok:id("<|media_end|>"), 271)
  T.eq(tok:id("<pop>"), 275)
  T.eq(tok:id("<|reserved_0|>"), 276)
  T.eq(tok:id("<|reserved_43|>"), 319)
  T.eq(tok:decode({ 72, 105, 256, 33 }), "Hi<|endoftext|>!")
  T.eq(tok:decode({ 72, 105, 256, 33 }, true), "Hi!")
  T.eq(#tok:encode("<|endoftext|>"), 13, "text never encodes to a special id")
  T.raises(function() tok:id("<|nope|>") end, "no special token '<|nope|>'")
  T.raises(function() tok:decode({ 320 }) end, "id 320 at position 1 is outside the vocabulary of 320")
  T.raises(function() tokenizer.byte_level({ vocab_size = 200 }) end, "vocab_size must be an integer in [257, 65536]")
end)

T.test("text loading: documents split at separator lines, each after <|endoftext|>; val split per file", function()
  local tok = tokenizer.byte_level()
  local ds = text.load({ path = FIXTURE, doc_separator = "%", val_fraction = 0.1 }, tok)
  local f = io.open(FIXTURE, "rb")
  local raw = f:read("*a")
  f:close()
  local n_docs = 1
  for _ in raw:gmatch("\n%%\n") do n_docs = n_docs + 1 end
  T.eq(n_docs, 30)
  local total = ds.train.n + ds.val.n
  -- the "%\n" separator lines (2 bytes each) go; every document gains a leading <|endoftext|>
  T.eq(total, #raw - 2 * (n_docs - 1) + n_docs)
  T.eq(ds.val.n, math.floor(total * 0.1))
  T.eq(ds.train.buf[0], 256)
  local eots, first = 0, nil
  for i = 0, ds.train.n - 1 do
    if ds.train.buf[i] == 256 then eots = eots + 1 end
  end
  for i = 0, ds.val.n - 1 do
    if ds.val.buf[i] == 256 then eots = eots + 1 end
  end
  T.eq(eots, n_docs)
  -- the first document comes back byte for byte
  local doc = {}
  for i = 1, 200 do
    local id = ds.train.buf[i]
    if id == 256 then break end
    doc[#doc + 1] = string.char(id)
  end
  first = table.concat(doc)
  T.eq(first, raw:sub(1, #first))
  T.ok(first:sub(-1) == "\n" and not first:find("%%"))
  T.raises(function() text.load({ path = "tests/fixtures/no_such_file.txt" }, tok) end, "does not exist")
end)

T.test("directories are read in sorted order with exclude patterns", function()
  local dir = tmpdir("dir")
  local function write(name, s)
    local f = assert(io.open(dir .. "/" .. name, "wb"))
    f:write(s)
    f:close()
  end
  write("b.txt", "bbbb")
  write("a.txt", "aa")
  write("a.dat", "\1\2\3")
  local ds = text.load({ path = dir, exclude = { "%.dat$" } }, tokenizer.byte_level())
  T.eq(ds.files, { dir .. "/a.txt", dir .. "/b.txt" })
  local got = {}
  for i = 0, ds.train.n - 1 do got[#got + 1] = ds.train.buf[i] end
  T.eq(got, { 256, 97, 97, 256, 98, 98, 98, 98 })
  tide.C.tide_remove_tree(dir)
end)

T.test("token shards (llm.c layout) load as stored", function()
  local dir = tmpdir("shard")
  local toks = {}
  for i = 1, 500 do toks[i] = (i * 37) % 320 end   -- some ids >= 300
  local buf = ffi.new("uint32_t[?]", #toks)
  for i = 1, #toks do buf[i - 1] = toks[i] end
  T.eq(tide.C.tide_shard_write(dir .. "/s.bin", buf, #toks, 2), 0)
  local ds = text.load({ path = dir .. "/s.bin" }, tokenizer.byte_level())
  T.eq(ds.train.n, 500)
  for i = 1, 500 do
    if ds.train.buf[i - 1] ~= toks[i] then T.eq(ds.train.buf[i - 1], toks[i], "token " .. i) end
  end
  T.raises(function() text.load({ path = dir .. "/s.bin" }, tokenizer.byte_level({ vocab_size = 300 })) end,
    "is >= the vocabulary size 300")
  tide.C.tide_remove_tree(dir)
end)

T.test("batch streams: targets are inputs shifted by one; batch k depends only on (seed, k)", function()
  local ds = text.load({ path = FIXTURE, doc_separator = "%" }, tokenizer.byte_level())
  local s1 = text.stream(ds.train, { batch_size = 4, seq_len = 32, seed = 7 })
  local x, y = s1:next()
  T.eq(x:shape(), { 4, 32 })
  T.eq(x:dtype(), "i32")
  local xs, ys = x:tolist(), y:tolist()
  for b = 0, 3 do
    for t = 1, 31 do
      if ys[b * 32 + t] ~= xs[b * 32 + t + 1] then T.eq(ys[b * 32 + t], xs[b * 32 + t + 1]) end
    end
  end
  local seen = {}
  for k = 2, 10 do seen[k] = s1:next():tolist() end
  -- a fresh stream put at cursor 5 continues exactly like the first one
  local s2 = text.stream(ds.train, { batch_size = 4, seq_len = 32, seed = 7 })
  s2:set_state({ seed = 7, cursor = 5, order = "random" })
  for k = 6, 10 do T.eq(s2:next():tolist(), seen[k], "batch " .. k) end
  T.eq(s2:state(), { seed = 7, cursor = 10, order = "random" })
  local s3 = text.stream(ds.train, { batch_size = 4, seq_len = 32, seed = 8 })
  local differ = false
  local a, b = s3:next():tolist(), xs
  for i = 1, #a do if a[i] ~= b[i] then differ = true end end
  T.ok(differ, "another seed gives other batches")
  T.raises(function() s2:set_state({ seed = 9, cursor = 1 }) end, "differs from the configured one")
  -- every window start stays inside the data: the last target is a real token
  for k = 0, 200 do
    for _, st in ipairs(s1:starts(k)) do
      if st < 0 or st + 32 >= ds.train.n + 0 then T.ok(false, "start " .. st .. " out of range") end
    end
  end
end)

T.test("rows(lo, hi) of a batch (a data-parallel rank's share) are bitwise those rows of next(), random and sequential", function()
  local ds = text.load({ path = FIXTURE, doc_separator = "%" }, tokenizer.byte_level())
  for _, order in ipairs({ "random", "sequential" }) do
    local full = text.stream(ds.train, { batch_size = 8, seq_len = 16, seed = 3, order = order })
    local part = text.stream(ds.train, { batch_size = 8, seq_len = 16, seed = 3, order = order })
    for k = 1, 4 do
      local x, y = full:next()
      local lo, hi = (k % 4) * 2, (k % 4) * 2 + 2          -- rows 2-3, 4-5, 6-7, 0-1: one rank of 4 each batch
      local px, py = part:rows(lo, hi)
      T.eq(px:shape(), { 2, 16 })
      T.eq(px:tolist(), x:narrow(1, lo + 1, 2):contiguous():tolist(), order .. " batch " .. k .. " ids")
      T.eq(py:tolist(), y:narrow(1, lo + 1, 2):contiguous():tolist(), order .. " batch " .. k .. " targets")
    end
    T.eq(part:state().cursor, 4, "one batch per call")
  end
  local s = text.stream(ds.train, { batch_size = 4, seq_len = 16, seed = 3 })
  T.raises(function() s:rows(2, 5) end, "data: rows 2 .. 5 of a batch of 4")
  T.raises(function() s:rows(3, 3) end, "data: rows 3 .. 3 of a batch of 4")
end)

T.test("sequential streams walk non-overlapping windows; data.build validates keys", function()
  local ds = { buf = ffi.new("int32_t[?]", 41), n = 41 }
  for i = 0, 40 do ds.buf[i] = i end
  local s = text.stream(ds, { batch_size = 2, seq_len = 10, order = "sequential" })
  local x, y = s:next()
  T.eq(x:tolist()[1], 0)
  T.eq(x:tolist()[11], 10)
  T.eq(y:tolist()[20], 20)
  x = s:next()
  T.eq(x:tolist()[1], 20)
  T.eq(x:tolist()[11], 30)
  x = s:next()
  T.eq(x:tolist()[1], 0, "wraps after the last full window")
  T.raises(function() text.stream(ds, { batch_size = 1, seq_len = 41 }) end, "41 tokens cannot fill one window of seq_len 41 + 1")
  T.raises(function() data.build({ path = FIXTURE, seq_len = 8, batch_size = 2, shuffle = true }) end,
    "unknown key 'shuffle'; known keys: batch_size, doc_separator")
end)

T.test("json: shortest round-trip numbers, escapes, nonfinite -> null + list, errors with positions", function()
  T.eq(json.encode(0.1), "0.1")
  T.eq(json.encode(1 / 3), "0.3333333333333333")
  T.eq(json.encode(3e-4), "0.0003")
  T.eq(json.encode(1e300), "1e+300")
  T.eq(json.encode(123456789), "123456789")
  T.eq(json.encode(-2.5), "-2.5")
  local ffi = require "ffi"
  local f = ffi.new("float[1]", 2.5287)
  T.eq(json.record({ loss = f[0] }), '{"loss":2.5287}', "a float32 metric prints with float32's shortest digits")
  T.eq(json.encode(f[0]), "2.528700113296509")
  f[0] = json.decode(json.record({ loss = f[0] })).loss
  T.eq(f[0], ffi.new("float[1]", 2.5287)[0])
  for _, v in ipairs({ 0.1, 1 / 3, math.pi, 2 ^ -40, 6.02214076e23, 1 - 2 ^ -53, 5e-324 }) do
    T.eq(json.decode(json.encode(v)), v)
  end
  T.eq(json.encode({ b = 1, a = { true, false, "x\n\"\1" } }), '{"a":[true,false,"x\\n\\"\\u0001"],"b":1}')
  T.eq(json.encode(json.array()), "[]")
  T.eq(json.encode({}), "{}")
  T.eq(json.encode({ step = 3, a = 1, loss = 2 }, { first = { "step", "loss" } }), '{"step":3,"loss":2,"a":1}')
  T.eq(json.record({ step = 1, loss = 0 / 0, lr = 1 / 0 }, { "step" }),
    '{"step":1,"loss":null,"lr":null,"nonfinite":["loss","lr"]}')
  local v = json.decode(' {"a": [1, 2.5e3, -0.25, null, "\\u00e9\\ud83d\\ude00"], "b": {"c": false}} ')
  T.eq(v.a[2], 2500)
  T.ok(v.a[4] == json.null)
  T.eq(v.a[5], "\195\169\240\159\152\128")
  T.eq(v.b.c, false)
  T.raises(function() json.decode('{"a": 1,\n "b": }') end, "line 2 column 7")
  T.raises(function() json.decode('{"a": 1} x') end, "trailing characters")
  T.raises(function() json.decode('{"a": 1, "a": 2}') end, "duplicate key 'a'")
  T.raises(function() json.decode("01") end, "")
  T.raises(function() json.decode(string.rep("[", 70) .. string.rep("]", 70)) end, "nesting deeper than 64")
  T.raises(function() json.encode({ f = print }) end, "cannot encode a function at f")
end)

T.test("log: JSONL lines decode back, progress text, durations", function()
  local dir = tmpdir("log")
  local path = dir .. "/m.jsonl"
  local out = io.open(dir .. "/out.txt", "wb")
  local lg = log.open({ path = path, tty = false, out = out })
  lg:metrics({ step = 1, loss = 2.5, lr = 1e-3 })
  lg:metrics({ step = 2, loss = 0 / 0, lr = 1e-3 })
  lg:progress({ step = 2, steps = 10, loss = 2.25, lr = 1e-3, tok_per_s = 12345, eta = 75 }, true)
  lg:close()
  out:close()
  local lines = {}
  for line in io.lines(path) do lines[#lines + 1] = json.decode(line) end
  T.eq(#lines, 2)
  T.eq(lines[1].loss, 2.5)
  T.ok(lines[2].loss == json.null)
  T.eq(lines[2].nonfinite, { "loss" })
  local shown = io.open(dir .. "/out.txt"):read("*a")
  T.eq(shown, "step 2/10 | loss 2.2500 | lr 1.00e-03 | 12.3k tok/s | ETA 1m15s\n")
  T.eq(log.duration(3725), "1h02m")
  T.eq(log.duration(9.6), "10s")
  tide.C.tide_remove_tree(dir)
end)

T.run()
