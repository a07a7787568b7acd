-- bench/tokenizer.lua — byte-level BPE encoding speed, tide against the tokenizers library (formats.md §4), in the
-- same run, on the same machine and the same text: MB of input text per second on one core, the text as one string
-- and as its lines (tokenizers' encode_batch on one thread; tide's encode_docs on one thread), then tide on all
-- threads. Both use their word caches warm (the best of `repeats` passes after one untimed pass); tide's first pass
-- on a freshly loaded tokenizer is shown too. (That the ids are equal is tests/lua/test_bpe.lua's.) Tokenizers: the
-- tokenizers-trained fixture (GPT-2 pre-tokenizer, 1,024 ids), a tide-trained one of 8,192 ids on the same text,
-- and the fixture with the Llama-3 pre-tokenizer. Writes <results>/tokenizer.{json,md}.
--
--   tide run bench/tokenizer.lua [--repeats=3] [--results=DIR]      (needs build/pyenv: scripts/test_deps.sh)
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local tokenizer = require "tide.data.tokenizer"
local cli = require "tide.cli"
local C = tide.C

local PYTHON = "build/pyenv/bin/python"
local FORTUNES = "/usr/share/games/fortunes"
local fmt = string.format

local function read(path) return assert(tide.read_file(path)) end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function fortune_files()
  local n = ffi.new("size_t[1]")
  local p = C.tide_list_dir(FORTUNES, n)
  assert(p ~= nil, "the fortunes corpus (Debian package fortunes) is not installed in " .. FORTUNES)
  local s = ffi.string(p, n[0])
  C.tide_free(p)
  local files = {}
  for name in s:gmatch("([^%z]+)%z") do
    if not name:match("%.dat$") and not name:match("%.u8$") then files[#files + 1] = FORTUNES .. "/" .. name end
  end
  return files
end

local function best_of(repeats, fn)
  local best = math.huge
  for _ = 1, repeats do
    local t0 = tide.time()
    fn()
    best = math.min(best, tide.time() - t0)
  end
  return best
end

-- the lines of text as documents (offsets into the text without the LFs, as Python's str.split("\n"))
local function lines_of(text)
  local parts, at = {}, 1
  while true do
    local nl = text:find("\n", at, true)
    parts[#parts + 1] = text:sub(at, (nl or #text + 1) - 1)
    if not nl then break end
    at = nl + 1
  end
  local offs = ffi.new("int64_t[?]", #parts + 1)
  for i, p in ipairs(parts) do offs[i] = offs[i - 1] + #p end
  return table.concat(parts), offs, #parts
end

local function hf_bench(tok_path, input, repeats)
  local q = cli.shell_quote
  local p = io.popen(fmt("%s tests/scripts/hf_tokenize.py bench %s %s %d 2>&1", PYTHON, q(tok_path), q(input), repeats))
  local out = p:read("*a")
  p:close()
  local bytes, whole, by_line = out:match("^(%d+) ([%d.e+-]+) ([%d.e+-]+)\n")
  assert(bytes and out:find("ok tokenizers"), "tokenizers bench failed: " .. out)
  return tonumber(whole), tonumber(by_line), out:match("ok tokenizers (%S+)")
end

local function run(cfg)
  assert(C.tide_path_exists(PYTHON) == 1, "build/pyenv is missing: run scripts/test_deps.sh")
  local repeats = cfg.repeats
  local dir = os.getenv("TMPDIR") or "/tmp"
  dir = fmt("%s/tide-bench-tokenizer-%d", dir, math.floor(tide.time() * 1000) % 1e9)
  C.tide_mkdir_p(dir)
  local files = fortune_files()
  local parts = {}
  for i, f in ipairs(files) do parts[i] = read(f) end
  local text = table.concat(parts)
  write(dir .. "/fortunes.txt", text)
  local joined, offs, n_lines = lines_of(text)

  local trained = dir .. "/tide_8192.json"
  write(trained, (tokenizer.train({ files = files, vocab_size = 8192 })))
  local base = json.decode(read("tests/fixtures/tokenizers/hf_bpe.json"))
  base.pre_tokenizer = { type = "Sequence", pretokenizers = {
    { type = "Split", pattern = { Regex = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
      .. "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+" }, behavior = "Isolated", invert = false },
    { type = "ByteLevel", add_prefix_space = false, trim_offsets = true, use_regex = false } } }
  write(dir .. "/llama3.json", json.encode(base))
  local cases = {
    { name = "tokenizers-trained, GPT-2 regex, 1024 ids", path = "tests/fixtures/tokenizers/hf_bpe.json" },
    { name = "tide-trained, GPT-2 regex, 8192 ids", path = trained },
    { name = "tokenizers-trained, Llama-3 regex, 1024 ids", path = dir .. "/llama3.json" },
  }
  local threads = tide.num_threads()
  local record = { benchmark = "tokenizer", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = threads,
    loadavg = results.loadavg(), text = { what = fmt("the fortunes corpus, %d files", #files), bytes = #text,
    lines = n_lines }, repeats = repeats, runs = {} }
  io.stderr:write(fmt("tokenizer: %d bytes of text, %d lines; best of %d warm passes\n", #text, n_lines, repeats))
  for _, c in ipairs(cases) do
    tide.set_num_threads(1)
    local tok = tokenizer.load(c.path)
    local h = tok.handle
    local t0 = tide.time()
    local n_ids = tonumber(C.tide_bpe_encode(h, text, #text, nil, 0))
    local cold = tide.time() - t0
    local ids = tok:encode_docs(joined, offs, n_lines, -1, false, true)
    local whole = best_of(repeats, function() C.tide_bpe_encode(h, text, #text, nil, 0) end)
    local by_line = best_of(repeats, function() tok:encode_docs(joined, offs, n_lines, -1, false, true) end)
    tide.set_num_threads(threads)
    local all = best_of(repeats, function() tok:encode_docs(joined, offs, n_lines, -1, false, true) end)
    local hf_whole, hf_lines, version = hf_bench(c.path, dir .. "/fortunes.txt", repeats)
    local r = { tokenizer = c.name, ids = n_ids, line_ids = ids.n, tide_cold_mb_s = #text / cold / 1e6,
      tide_mb_s = #text / whole / 1e6, tide_lines_mb_s = #joined / by_line / 1e6, tide_all_threads_mb_s = #joined / all / 1e6,
      tokenizers_mb_s = #text / hf_whole / 1e6, tokenizers_lines_mb_s = #joined / hf_lines / 1e6, tokenizers = version }
    r.ratio = r.tide_mb_s / r.tokenizers_mb_s
    r.ratio_lines = r.tide_lines_mb_s / r.tokenizers_lines_mb_s
    io.stderr:write(fmt("  %-44s tide %.1f MB/s (lines %.1f, cold %.1f, %d threads %.1f), tokenizers %.2f MB/s "
      .. "(lines %.2f): %.1fx\n", c.name, r.tide_mb_s, r.tide_lines_mb_s, r.tide_cold_mb_s, threads,
      r.tide_all_threads_mb_s, r.tokenizers_mb_s, r.tokenizers_lines_mb_s, r.ratio))
    record.runs[#record.runs + 1] = r
  end
  C.tide_remove_tree(dir)
  local L = {
    "# bench/tokenizer — byte-level BPE encoding, tide against the tokenizers library", "",
    fmt("%s, load average %s, the fortunes corpus (%d files, %.2f MB, %d lines). MB of input per second on one core "
      .. "(best of %d passes with warm word caches; \"cold\": tide's first pass on a freshly loaded tokenizer), the text "
      .. "as one string and as its lines (tokenizers encode_batch with RAYON_NUM_THREADS=1; tide encode_docs on one "
      .. "thread); the last column is tide's lines on all %d threads. tokenizers %s.", record.date,
      tostring(record.loadavg), #files, #text / 1e6, n_lines, repeats, threads, record.runs[1].tokenizers), "",
    "| tokenizer | ids | tide MB/s | tokenizers MB/s | ratio | tide lines | tokenizers lines | ratio | tide cold | tide all threads |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  }
  for _, r in ipairs(record.runs) do
    L[#L + 1] = fmt("| %s | %d | %.1f | %.2f | %.1fx | %.1f | %.2f | %.1fx | %.1f | %.1f |", r.tokenizer, r.ids, r.tide_mb_s,
      r.tokenizers_mb_s, r.ratio, r.tide_lines_mb_s, r.tokenizers_lines_mb_s, r.ratio_lines, r.tide_cold_mb_s,
      r.tide_all_threads_mb_s)
  end
  L[#L + 1] = ""
  local md = table.concat(L, "\n")
  io.write(md, "\n")
  results.write(cfg.results, "tokenizer", record, md)
  return 0
end

return {
  repeats = 3,
  results = "bench/results",
  run = run,
}
