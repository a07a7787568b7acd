-- data/text.lua — text files, JSONL documents or token shards -> a deterministic stream of [B, T] batches with
-- targets.
--
-- Loading: every file becomes token ids (through the run's tokenizer for text and JSONL, as stored for llm.c
-- shards). A text file may be split into documents by separator lines (e.g. "%" in fortune files); a JSONL file
-- (format "jsonl", or a .jsonl name) holds one document per line, the string in its `field` ("text" by default;
-- formats.md §5); each document is preceded by <|endoftext|> (the llm.c convention). A directory stands for its
-- files in sorted order. The last `val_fraction` of each file's tokens form the validation split, so both splits
-- sample every file.
-- Streams: batch k (0-based) is a pure function of (seed, k): random mode draws its B window starts
-- from the Philox stream at offset k*B, sequential mode walks non-overlapping windows. The cursor k is
-- the whole stream state, so a checkpoint that stores it resumes bit-for-bit.
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local C = tide.C

local text = {}

local raw = tide.raw

local function last_error() return ffi.string(C.tide_last_error()) end

-- token buffer: {buf = int32_t[n], n = n}
local function new_tokens(n)
  return { buf = ffi.new("int32_t[?]", math.max(n, 1)), n = n }
end

local function list_files(path)
  if C.tide_is_dir(path) ~= 1 then return { path } end
  local n = ffi.new("size_t[1]")
  local buf = C.tide_list_dir(path, n)
  if buf == nil then error("data: cannot list directory '" .. path .. "': " .. last_error(), 3) end
  local names = ffi.string(buf, n[0])
  C.tide_free(buf)
  local files = {}
  for name in names:gmatch("([^%z]+)%z") do
    local full = path:gsub("/$", "") .. "/" .. name
    if C.tide_is_dir(full) ~= 1 then files[#files + 1] = full end
  end
  return files
end

-- expand cfg.path / cfg.paths (files or directories, directories in sorted order) minus cfg.exclude
-- (Lua patterns matched against the file name)
local function resolve_paths(cfg)
  local inputs = {}
  if cfg.path then inputs[#inputs + 1] = cfg.path end
  for _, p in ipairs(cfg.paths or {}) do inputs[#inputs + 1] = p end
  if #inputs == 0 then error("data: give `path` (a file or directory) or `paths` (a list)", 3) end
  local files = {}
  for _, p in ipairs(inputs) do
    if C.tide_path_exists(p) ~= 1 then error("data: '" .. p .. "' does not exist", 3) end
    for _, f in ipairs(list_files(p)) do
      local name = f:match("[^/]+$")
      local skip = false
      for _, pat in ipairs(cfg.exclude or {}) do
        if name:find(pat) then skip = true break end
      end
      if not skip then files[#files + 1] = f end
    end
  end
  if #files == 0 then error("data: no input files left after `exclude`", 3) end
  return files
end

-- files(cfg) -> the input files cfg.path / cfg.paths name, minus cfg.exclude, in the order text.load reads them
function text.files(cfg) return resolve_paths(cfg) end

-- split text into documents at lines that equal `sep` exactly
local function split_documents(s, sep)
  if not sep then return { s } end
  local docs, pos = {}, 1
  local marker = "\n" .. sep .. "\n"
  if s:sub(1, #sep + 1) == sep .. "\n" then pos = #sep + 2 end
  while true do
    local a, b = s:find(marker, pos, true)
    if not a then
      local tail = s:sub(pos)
      if tail == sep or tail == sep .. "\n" then tail = "" end
      if tail:sub(-(#sep + 1)) == "\n" .. sep then tail = tail:sub(1, -(#sep + 2)) end
      if #tail > 0 then docs[#docs + 1] = tail end
      return docs
    end
    if a > pos then docs[#docs + 1] = s:sub(pos, a) end   -- keep the document's final newline
    pos = b + 1
  end
end

-- a text file must fit one Lua string (LuaJIT's limit); a FIFO or a device is refused by tide.read_file
local TEXT_LIMIT = 0x7fffff00
local function read_text(f)
  local s, err = tide.read_file(f, TEXT_LIMIT)
  if not s then
    if err:find("over the limit", 1, true) then err = err .. " (larger text: write it as token shards)" end
    error("data: " .. err, 4)
  end
  return s
end

-- the format of file f under cfg.format ("auto" by default: .bin is a shard, .jsonl JSONL, anything else text)
local FORMATS = { auto = true, text = true, jsonl = true, shard = true }
function text.format_of(f, format)
  format = format or "auto"
  if not FORMATS[format] then
    error("data: format must be 'auto', 'text', 'jsonl' or 'shard', got '" .. tostring(format) .. "'", 3)
  end
  if format ~= "auto" then return format end
  if f:match("%.bin$") then return "shard" end
  if f:match("%.jsonl$") then return "jsonl" end
  return "text"
end

-- documents(f, cfg) -> {text = string or char pointer, offsets = int64[n + 1], n = n_docs, bytes}: the documents of
-- a text or JSONL file; document d is text[offsets[d], offsets[d + 1]). cfg: format, doc_separator (text),
-- field (JSONL, default "text").
function text.documents(f, cfg)
  local format = text.format_of(f, cfg.format)
  if format == "shard" then error("data: '" .. f .. "' is a token shard, not text", 2) end
  local s = read_text(f)
  if format == "jsonl" then
    local field = cfg.field or "text"
    if type(field) ~= "string" or field == "" then error("data: field must be a non-empty string, got " .. tostring(field), 2) end
    local offs, n = ffi.new("int64_t *[1]"), ffi.new("int64_t[1]")
    local p = C.tide_jsonl_texts(s, #s, field, f, offs, n)
    if p == nil then error("data: " .. last_error(), 0) end
    local nd = tonumber(n[0])
    local o = ffi.gc(offs[0], C.tide_free)
    return { text = ffi.gc(p, C.tide_free), offsets = o, n = nd, bytes = tonumber(o[nd]) }
  end
  local docs = split_documents(s, cfg.doc_separator)
  local offsets = ffi.new("int64_t[?]", #docs + 1)
  local at = 0
  for i, d in ipairs(docs) do
    offsets[i - 1] = at
    at = at + #d
  end
  offsets[#docs] = at
  local joined = #docs == 1 and docs[1] or table.concat(docs)
  return { text = joined, offsets = offsets, n = #docs, bytes = at }
end

-- the tokens of one file as {buf, n}
local function file_tokens(f, cfg, tok)
  local format = text.format_of(f, cfg.format)
  if format == "shard" then
    local p = C.tide_shard_read(f, tok.vocab_size)
    if p == nil then error("data: " .. last_error(), 4) end   -- the engine names file, index and rule
    local t = tide.wrap(p)
    local n = t:numel()
    local out = new_tokens(n)
    if C.tide_read_bytes(raw(t), out.buf, n * 4) ~= 0 then error("data: shard '" .. f .. "': " .. last_error(), 4) end
    return out
  end
  local docs = text.documents(f, cfg)
  return tok:encode_docs(docs.text, docs.offsets, docs.n, tok:id("<|endoftext|>"))
end

local function concat_tokens(pieces)
  local total = 0
  for _, p in ipairs(pieces) do total = total + p.n end
  local out = new_tokens(total)
  local pos = 0
  for _, p in ipairs(pieces) do
    ffi.copy(out.buf + pos, p.buf + p.offset, p.n * 4)
    pos = pos + p.n
  end
  return out
end

-- load{path|paths, exclude, format, doc_separator, field, val_fraction} with a tokenizer ->
-- {train = tokens, val = tokens|nil, files = {...}}
function text.load(cfg, tok)
  local files = resolve_paths(cfg)
  local vf = cfg.val_fraction or 0
  if type(vf) ~= "number" or vf < 0 or vf >= 1 then
    error("data: val_fraction must be in [0, 1), got " .. tostring(vf), 2)
  end
  local train, val = {}, {}
  for _, f in ipairs(files) do
    local t = file_tokens(f, cfg, tok)
    local n_val = math.floor(t.n * vf)
    train[#train + 1] = { buf = t.buf, offset = 0, n = t.n - n_val }
    if n_val > 0 then val[#val + 1] = { buf = t.buf, offset = t.n - n_val, n = n_val } end
  end
  local ds = { train = concat_tokens(train), files = files }
  if #val > 0 then ds.val = concat_tokens(val) end
  return ds
end

-- a dataset from an in-memory Lua list of ids (tests, synthetic tasks)
function text.from_ids(ids)
  local t = new_tokens(#ids)
  for i = 1, #ids do t.buf[i - 1] = ids[i] end
  return t
end

---------------------------------------------------------------------------------------------------
-- batch streams

local Stream = {}
Stream.__index = Stream

-- stream(tokens, {batch_size, seq_len, seed, order = "random"|"sequential", dtype = "i32"|"i64"})
function text.stream(tokens, opts)
  local B, T = opts.batch_size, opts.seq_len
  options.pos_int(B, "batch_size", "data")
  options.pos_int(T, "seq_len", "data")
  if tokens.n < T + 1 then
    error(string.format("data: %d tokens cannot fill one window of seq_len %d + 1", tokens.n, T), 2)
  end
  local order = opts.order or "random"
  if order ~= "random" and order ~= "sequential" then
    error("data: order must be 'random' or 'sequential', got '" .. tostring(order) .. "'", 2)
  end
  local dtype = opts.dtype or "i32"
  local self = setmetatable({
    tokens = tokens, B = B, T = T, seed = opts.seed or 0, order = order, cursor = 0,
    n_windows = math.floor((tokens.n - 1) / T),
    dtype = dtype, dtype_id = C.tide_dtype_from_name(dtype),
    ctype = dtype == "i64" and "int64_t[?]" or "int32_t[?]",
    esize = dtype == "i64" and 8 or 4,
    u = ffi.new("double[?]", B),
    shape = ffi.new("int64_t[2]", B, T),
  }, Stream)
  if dtype ~= "i32" and dtype ~= "i64" then error("data: dtype must be i32 or i64, got " .. tostring(dtype), 2) end
  self.xbuf = ffi.new(self.ctype, B * T)
  self.ybuf = ffi.new(self.ctype, B * T)
  return self
end

-- 0-based window starts of rows lo .. hi - 1 of batch k (default: all B): row b's start is a pure function of
-- (seed, k, b), Philox at counter k·B + b, so any range of rows is drawn alone
function Stream:starts(k, lo, hi)
  lo, hi = lo or 0, hi or self.B
  local starts = {}
  if self.order == "random" then
    C.tide_philox_uniform(self.seed, k * self.B + lo, self.u, hi - lo)
    local span = self.tokens.n - self.T   -- valid starts: 0 .. n - T - 1
    for b = 0, hi - lo - 1 do starts[b + 1] = math.floor(self.u[b] * span) end
  else
    for b = lo, hi - 1 do
      starts[b - lo + 1] = ((k * self.B + b) % self.n_windows) * self.T
    end
  end
  return starts
end

-- rows(lo, hi) -> x [hi − lo, T], y: rows lo .. hi − 1 of the next batch, bitwise those rows of next(), the others
-- not read at all (a data-parallel rank takes its own rows this way); advances the cursor by one batch like next()
function Stream:rows(lo, hi)
  if not (lo >= 0 and hi <= self.B and lo < hi) then
    error(string.format("data: rows %s .. %s of a batch of %d", tostring(lo), tostring(hi), self.B), 2)
  end
  local starts = self:starts(self.cursor, lo, hi)
  self.cursor = self.cursor + 1
  local src, T, xb, yb = self.tokens.buf, self.T, self.xbuf, self.ybuf
  local R = hi - lo
  for b = 0, R - 1 do
    local s = starts[b + 1]
    for t = 0, T - 1 do
      xb[b * T + t] = src[s + t]
      yb[b * T + t] = src[s + t + 1]
    end
  end
  local nbytes = R * T * self.esize
  local shape = ffi.new("int64_t[2]", R, T)
  local x = tide.check(C.tide_from_bytes(self.dtype_id, 2, shape, 0, xb, nbytes))
  local y = tide.check(C.tide_from_bytes(self.dtype_id, 2, shape, 0, yb, nbytes))
  return x, y
end

-- next() -> x [B, T], y [B, T] (y = x shifted by one token); advances the cursor
function Stream:next() return self:rows(0, self.B) end

function Stream:state()
  return { seed = self.seed, cursor = self.cursor, order = self.order }
end

function Stream:set_state(s)
  if s.seed ~= self.seed or (s.order and s.order ~= self.order) then
    error(string.format("data: checkpoint stream (seed %s, order %s) differs from the configured one (seed %s, order %s)",
      tostring(s.seed), tostring(s.order), tostring(self.seed), self.order), 2)
  end
  self.cursor = s.cursor
end

function Stream:reset() self.cursor = 0 end

return text
