-- tide data prepare: text, JSONL or directories of them -> llm.c token shards (formats.md §3, §5).
local ffi = require "ffi"
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide data prepare --tokenizer T INPUTS... -o OUTDIR [options]

Tokenizes documents into llm.c token shards OUTDIR/shard_000000.bin, shard_000001.bin, ... (formats.md §3: uint16
ids when the vocabulary has at most 65,536, else uint32), each document preceded by the end-of-text id
(<|endoftext|>). INPUTS are text files, JSONL files (one document per line, formats.md §5) and directories of them
(their files in sorted order). A shard ends before the document that would overflow it (a longer document fills
shards of its own). Documents are tokenized on all threads (TIDE_THREADS). OUTDIR also gets prepare.json (the
tokenizer's description, inputs, counts and shards) and, for a BPE, its tokenizer.json; train on the shards with
data = {path = OUTDIR, exclude = {"%.json$"}, tokenizer = OUTDIR .. "/tokenizer.json"}.
  --tokenizer T           "byte" (tide's byte-level vocabulary) or a HuggingFace tokenizer.json (byte-level BPE)
  --vocab-size V          with --tokenizer byte: its size (default 320)
  --format F              auto (default: .jsonl files are JSONL, others text), text or jsonl
  --field NAME            the text field of JSONL documents (default "text")
  --doc-separator S       text files: a line equal to S separates documents (e.g. % for fortune files); without it
                          a text file is one document
  --exclude P1,P2         skip files whose name matches a Lua pattern (e.g. '%.dat$,%.u8$')
  --shard-tokens N        ids per shard at most (default 100,000,000)
  -o, --out OUTDIR        the output directory: new, or empty, or give --overwrite
  --overwrite             replace the shards of an earlier prepare in OUTDIR
  --quiet                 no progress bar]]

local fmt = string.format

local SPEC = {
  tokenizer = { kind = "string" }, vocab_size = { kind = "integer", min = 257, max = 65536 },
  format = { kind = "string" }, field = { kind = "string" }, doc_separator = { kind = "string" },
  exclude = { kind = "string" }, shard_tokens = { kind = "integer", min = 1, max = 2147483647, default = 100000000 },
  out = { kind = "string" }, overwrite = { kind = "boolean", default = false }, quiet = { kind = "boolean", default = false },
}
M.SPEC = SPEC

local BATCH_BYTES = 64 * 2 ^ 20   -- documents tokenized per call (the progress bar moves between calls)

local function fail(msg) error("data prepare: " .. msg, 0) end

local function bar(frac, width)
  local n = math.floor(frac * width + 0.5)
  return "[" .. string.rep("#", n) .. string.rep(".", width - n) .. "]"
end

-- names in dir (the directory exists)
local function dir_names(C, dir)
  local n = ffi.new("size_t[1]")
  local p = C.tide_list_dir(dir, n)
  if p == nil then fail(ffi.string(C.tide_last_error())) end
  local s = ffi.string(p, n[0])
  C.tide_free(p)
  local out = {}
  for name in s:gmatch("([^%z]+)%z") do out[#out + 1] = name end
  return out
end

-- the output directory: made, or checked to hold nothing but an earlier prepare's files (removed with --overwrite)
local function prepare_outdir(C, out, overwrite)
  if C.tide_path_exists(out) == 1 then
    if C.tide_is_dir(out) ~= 1 then fail(fmt("-o '%s' exists and is not a directory", out)) end
    local names = dir_names(C, out)
    if #names > 0 and not overwrite then
      fail(fmt("'%s' is not empty (%d entries); give --overwrite to replace an earlier prepare there", out, #names))
    end
    for _, name in ipairs(names) do
      if not (name:match("^shard_%d+%.bin$") or name == "prepare.json" or name == "tokenizer.json") then
        fail(fmt("'%s' holds '%s', which tide data prepare did not write; choose another -o", out, name))
      end
    end
    for _, name in ipairs(names) do C.tide_remove_tree(out .. "/" .. name) end
  elseif C.tide_mkdir_p(out) ~= 0 then
    fail(ffi.string(C.tide_last_error()))
  end
end

local function prepare(args)
  local pos, f = cli.parse_flags(args, SPEC, "tide data prepare", { o = "out" })
  if not f.tokenizer then cli.usage_error("tide data prepare: --tokenizer byte|PATH is required (tide data --help)") end
  if not f.out then cli.usage_error("tide data prepare: -o OUTDIR is required") end
  if #pos == 0 then cli.usage_error("tide data prepare: which inputs? (tide data prepare --tokenizer T INPUTS... -o OUTDIR)") end
  if f.vocab_size and f.tokenizer ~= "byte" then
    cli.usage_error("tide data prepare: --vocab-size is for --tokenizer byte (a tokenizer.json has its own)")
  end
  local tide = require "tide"
  local json = require "tide.json"
  local text = require "tide.data.text"
  local tokenizer = require "tide.data.tokenizer"
  local log = require "tide.log"
  local C = tide.C
  local ok, tok = pcall(tokenizer.load, f.tokenizer == "byte" and { kind = "byte", vocab_size = f.vocab_size or 320 }
    or f.tokenizer)
  if not ok then fail(tostring(tok)) end
  local eot_ok, eot = pcall(tok.id, tok, "<|endoftext|>")
  if not eot_ok then fail(tostring(eot)) end
  local files = require("tide.cmd.tokenizer").input_files(pos, f.exclude, "data prepare")
  prepare_outdir(C, f.out, f.overwrite)

  local width = tok.vocab_size <= 65536 and 2 or 4
  local cap = f.shard_tokens
  local shard = ffi.new("uint32_t[?]", math.min(cap, 1 + 16 * 2 ^ 20))   -- grows to cap as needed
  local shard_cap = math.min(cap, 1 + 16 * 2 ^ 20)
  local in_shard, shards, total_tokens, total_docs = 0, {}, 0, 0
  local function flush()
    if in_shard == 0 then return end
    local name = fmt("shard_%06d.bin", #shards)
    if C.tide_shard_write(f.out .. "/" .. name, shard, in_shard, width) ~= 0 then fail(ffi.string(C.tide_last_error())) end
    shards[#shards + 1] = { file = name, tokens = in_shard }
    in_shard = 0
  end
  local function append(buf, a, n)
    while n > 0 do
      if in_shard == cap then flush() end
      local k = math.min(n, cap - in_shard)
      if in_shard + k > shard_cap then
        local nc = math.min(cap, math.max(in_shard + k, shard_cap * 2))
        local grown = ffi.new("uint32_t[?]", nc)
        ffi.copy(grown, shard, in_shard * 4)
        shard, shard_cap = grown, nc
      end
      ffi.copy(shard + in_shard, buf + a, k * 4)
      in_shard, a, n = in_shard + k, a + k, n - k
    end
  end

  local sizes, all_bytes = {}, 0
  for i, file in ipairs(files) do
    sizes[i] = math.max(tonumber(C.tide_file_size(file)), 0)
    all_bytes = all_bytes + sizes[i]
  end
  local live = not f.quiet and log.is_tty(2)
  local t0, done_bytes, text_bytes = tide.time(), 0, 0
  local function show(i, final)
    if not live then return end
    local dt = math.max(tide.time() - t0, 1e-9)
    local line = fmt("data prepare %s %3d%% %d/%d files, %d docs, %s ids, %.1f MB/s", bar(done_bytes / math.max(all_bytes, 1), 24),
      math.floor(100 * done_bytes / math.max(all_bytes, 1)), i, #files, total_docs, log.si(total_tokens), text_bytes / 1e6 / dt)
    io.stderr:write("\r", line, "\027[K", final and "\n" or "")
    io.stderr:flush()
  end
  local opts = { format = f.format, field = f.field, doc_separator = f.doc_separator }
  for i, file in ipairs(files) do
    local dok, docs = pcall(text.documents, file, opts)
    if not dok then fail((tostring(docs):gsub("^data: ", ""))) end
    -- batches of documents of about BATCH_BYTES
    local d = 0
    while d < docs.n do
      local e, start = d, docs.offsets[d]
      repeat e = e + 1 until e == docs.n or docs.offsets[e] - start >= BATCH_BYTES
      local sub = docs.offsets + d
      local eok, ids = pcall(tok.encode_docs, tok, docs.text, sub, e - d, eot, true)
      if not eok then fail(fmt("%s: %s", file, tostring(ids))) end
      -- a document that would overflow the shard starts the next one (unless the shard is empty)
      for k = 0, e - d - 1 do
        local a, b = tonumber(ids.starts[k]), tonumber(ids.starts[k + 1])
        if in_shard > 0 and in_shard + (b - a) > cap then flush() end
        append(ffi.cast("const uint32_t *", ids.buf), a, b - a)
      end
      total_tokens = total_tokens + ids.n
      total_docs = total_docs + (e - d)
      text_bytes = text_bytes + tonumber(docs.offsets[e] - docs.offsets[d])
      d = e
      show(i - 1, false)
    end
    done_bytes = done_bytes + sizes[i]
    show(i, false)
  end
  flush()
  if total_docs == 0 then fail(fmt("no documents in the %d input file(s)", #files)) end
  if tok.save then tok:save(f.out .. "/tokenizer.json") end
  local summary = {
    tokenizer = tok:describe(), inputs = json.array(files), documents = total_docs, tokens = total_tokens,
    text_bytes = text_bytes, width = width, shard_tokens = cap, shards = json.array(shards),
    format = f.format or "auto", field = f.field or json.null, doc_separator = f.doc_separator or json.null,
  }
  if C.tide_file_write_text_atomic(f.out .. "/prepare.json", json.encode(summary) .. "\n") ~= 0 then
    fail(ffi.string(C.tide_last_error()))
  end
  show(#files, true)
  if not f.quiet then
    io.stderr:write(fmt("data prepare: %d documents, %d ids (uint%d) in %d shard(s) from %d file(s), %.1f MB of text in "
      .. "%.1f s -> %s\n", total_docs, total_tokens, width * 8, #shards, #files, text_bytes / 1e6, tide.time() - t0, f.out))
  end
  return 0
end

function M.main(args)
  return cli.subcommand(args, { prepare = prepare }, { "prepare" }, "tide data", M.USAGE)
end

return M
