-- tide tokenizer train | encode | decode: byte-level BPE tokenizers (HuggingFace tokenizer.json; formats.md §4).
local ffi = require "ffi"
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide tokenizer train --vocab N FILES... -o tokenizer.json
       tide tokenizer encode TOKENIZER FILE [-o OUT]
       tide tokenizer decode TOKENIZER FILE [-o OUT]

train: learns a byte-level BPE (GPT-2 pre-tokenizer, ByteLevel decoder) from text and JSONL files (a directory
stands for its files, in sorted order) and writes a HuggingFace tokenizer.json, atomically: ids 0-255 are the
bytes, 256-275 tide's special tokens (<|endoftext|>, <|pad|>, ..., <pop>; formats.md §4) as added tokens, then
one id per merge, most frequent pair first, until N ids or no pair occurs --min-frequency times. Pre-tokens are
counted on all threads (TIDE_THREADS). The file loads in the tokenizers library and encodes as tide does.
  --vocab N               ids in the vocabulary (276 or more)
  --min-frequency K       merge only pairs seen at least K times (default 2)
  --format F              auto (default: .jsonl files are JSONL, others text), text or jsonl
  --field NAME            the text field of JSONL documents (default "text")
  --doc-separator S       text files: a line equal to S separates documents (e.g. % for fortune files)
  --exclude P1,P2         skip files whose name matches a Lua pattern (e.g. '%.dat$,%.u8$')
  -o, --out PATH          where to write the tokenizer.json (required)
  --quiet                 no progress line

encode: one line of space-separated ids for each line of FILE (its LF removed; a CR stays), through TOKENIZER:
a tokenizer.json or "byte" (tide's byte-level vocabulary); the ids are those of the tokenizers library (a special
token's name in the text is that token; tide data prepare reads it as text). decode: the reverse, one text line
per line of ids.
  -o, --out PATH          write there instead of the standard output]]

local fmt = string.format

local TRAIN = {
  vocab = { kind = "integer", min = 1 }, min_frequency = { kind = "integer", min = 1, default = 2 },
  format = { kind = "string" }, field = { kind = "string" }, doc_separator = { kind = "string" },
  exclude = { kind = "string" }, out = { kind = "string" }, quiet = { kind = "boolean", default = false },
}
local CODE = { out = { kind = "string" } }

-- a one-line progress display on a terminal's standard error (nothing elsewhere)
local function progress_writer(quiet)
  local log = require "tide.log"
  local live = not quiet and log.is_tty(2)
  local shown = false
  return function(msg, final)
    if live then
      io.stderr:write("\r", msg, "\027[K")
      shown = true
      if final then io.stderr:write("\n"); shown = false end
    elseif final and not quiet then
      io.stderr:write(msg, "\n")
    end
    io.stderr:flush()
  end, function() if shown then io.stderr:write("\n") end end
end

-- the files named by inputs (directories: their files, sorted), minus the exclude patterns
local function input_files(inputs, exclude, who)
  local text = require "tide.data.text"
  local pats = {}
  for p in (exclude or ""):gmatch("[^,]+") do pats[#pats + 1] = p end
  local ok, files = pcall(text.files, { paths = inputs, exclude = pats })
  if not ok then error(who .. ": " .. tostring(files):gsub("^data: ", ""), 0) end
  return files
end
M.input_files = input_files

local function train(args)
  local pos, f = cli.parse_flags(args, TRAIN, "tide tokenizer train", { o = "out" })
  if not f.vocab then cli.usage_error("tide tokenizer train: --vocab N is required (tide tokenizer --help)") end
  if not f.out then cli.usage_error("tide tokenizer train: -o tokenizer.json is required") end
  local first = 256 + #require("tide.data.tokenizer").SPECIALS
  if f.vocab < first then
    cli.usage_error(fmt("tide tokenizer train: --vocab must be at least %d (256 bytes and %d special tokens), got %d",
      first, first - 256, f.vocab))
  end
  if #pos == 0 then cli.usage_error("tide tokenizer train: which files? (tide tokenizer train --vocab N FILES... -o OUT)") end
  local tide = require "tide"
  local tokenizer = require "tide.data.tokenizer"
  local files = input_files(pos, f.exclude, "tokenizer train")
  local show, finish = progress_writer(f.quiet)
  local t0 = tide.time()
  local counted = 0
  local ok, json_text, V = pcall(tokenizer.train, {
    files = files, vocab_size = f.vocab, min_frequency = f.min_frequency, format = f.format, field = f.field,
    doc_separator = f.doc_separator,
    progress = function(ev, i)
      local dt = math.max(tide.time() - t0, 1e-9)
      if ev == "count" then
        counted = i.bytes
        show(fmt("tokenizer train: counting %d/%d files, %.1f MB, %d distinct words (%.1f MB/s)", i.index, i.files,
          i.bytes / 1e6, i.words, i.bytes / 1e6 / dt), i.index == i.files)
      else
        show(fmt("tokenizer train: merging, vocabulary %d/%d (%d merges over %d words, %.1f s)", i.vocab_size, i.target,
          i.merges, i.words, dt))
      end
    end })
  finish()
  if not ok then error((tostring(json_text):gsub("^tokenizer%.train: ", "tokenizer train: ")), 0) end
  local C = tide.C
  if C.tide_file_write_text_atomic(f.out, json_text) ~= 0 then
    error("tokenizer train: " .. ffi.string(C.tide_last_error()), 0)
  end
  local stop = V < f.vocab and fmt(" (no pair occurs %d times any more; asked for %d)", f.min_frequency, f.vocab) or ""
  if not f.quiet then
    io.stderr:write(fmt("tokenizer train: %d ids%s from %d files (%.1f MB) in %.1f s -> %s\n", V, stop, #files,
      counted / 1e6, tide.time() - t0, f.out))
  end
  return 0
end

local function open_out(path, who)
  if not path then return io.stdout end
  local h, err = io.open(path, "wb")
  if not h then error(fmt("%s: cannot write '%s': %s", who, path, tostring(err)), 0) end
  return h
end

local function load_input(args, who)
  local pos, f = cli.parse_flags(args, CODE, "tide " .. who, { o = "out" })
  if #pos ~= 2 then
    cli.usage_error(fmt("tide %s: expected TOKENIZER FILE, got %d argument(s) (tide tokenizer --help)", who, #pos))
  end
  local tide = require "tide"
  local tokenizer = require "tide.data.tokenizer"
  local ok, tok = pcall(tokenizer.load, pos[1])
  if not ok then error(who .. ": " .. tostring(tok), 0) end
  local text, err = tide.read_file(pos[2])
  if not text then error(who .. ": " .. err, 0) end
  return tok, text, pos[2], f
end

-- the lines of text: their offsets (int64, n + 1) without the LF; a last LF ends the last line
local function line_offsets(text)
  local starts, stops = {}, {}
  local at = 1
  while at <= #text do
    local nl = text:find("\n", at, true)
    starts[#starts + 1] = at - 1
    stops[#stops + 1] = (nl or #text + 1) - 1
    at = (nl or #text) + 1
  end
  return starts, stops
end

local function encode(args)
  local who = "tokenizer encode"
  local tok, text, _, f = load_input(args, who)
  local starts, stops = line_offsets(text)
  local n = #starts
  -- the lines without their LFs, one after another
  local parts = {}
  for i = 1, n do parts[i] = text:sub(starts[i] + 1, stops[i]) end
  local joined = table.concat(parts)
  local offs = ffi.new("int64_t[?]", n + 1)
  for i = 1, n do offs[i] = offs[i - 1] + #parts[i] end
  local ids = tok:encode_docs(joined, offs, n, -1, true, true)   -- as tokenizers encodes each line
  local out = open_out(f.out, who)
  local line = {}
  for d = 0, n - 1 do
    local a, b = tonumber(ids.starts[d]), tonumber(ids.starts[d + 1])
    for i = a, b - 1 do line[i - a + 1] = tostring(ids.buf[i]) end
    for i = b - a + 1, #line do line[i] = nil end
    out:write(table.concat(line, " "), "\n")
  end
  if out ~= io.stdout then out:close() end
  return 0
end

local function decode(args)
  local who = "tokenizer decode"
  local tok, text, path, f = load_input(args, who)
  local starts, stops = line_offsets(text)
  local lines = {}   -- every line decodes before anything is written (an error leaves no partial output)
  for i = 1, #starts do
    local ids = {}
    for w in text:sub(starts[i] + 1, stops[i]):gmatch("%S+") do
      local v = tonumber(w)
      if not v or v ~= math.floor(v) or v < 0 then
        error(fmt("%s: %s:%d: '%s' is not a token id", who, path, i, w:sub(1, 40)), 0)
      end
      ids[#ids + 1] = v
    end
    local ok, s = pcall(tok.decode, tok, ids)
    if not ok then error(fmt("%s: %s:%d: %s", who, path, i, (tostring(s):gsub("^[^:]*decode: ", ""))), 0) end
    lines[i] = s
  end
  local out = open_out(f.out, who)
  for i = 1, #lines do out:write(lines[i], "\n") end
  if out ~= io.stdout then out:close() end
  return 0
end

function M.main(args)
  return cli.subcommand(args, { train = train, encode = encode, decode = decode }, { "train", "encode", "decode" },
    "tide tokenizer", M.USAGE)
end

return M
