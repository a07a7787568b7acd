-- tide tokenizer train | encode | decode: the trained file is tokenizer.train's, the same on any thread count, with
-- tide's specials at 256...; encode gives tok:encode per line, decode reverses it; usage mistakes are one line;
-- train's and data prepare's progress is one live line on a terminal (script(1)), plain lines in a pipe.
local T = require "tide.testing"
local tide = require "tide"
local cli = require "tide.cli"
local json = require "tide.json"
local tokenizer = require "tide.data.tokenizer"
local C = tide.C

local FIX = "tests/fixtures/tokenizers"
local FORTUNES = "/usr/share/games/fortunes"
local fmt = string.format
local exe = cli.exe_path()
local q = cli.shell_quote

local function read(path) return assert(tide.read_file(path)) end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end
local function tide_cmd(args, env)
  local p = io.popen((env or "") .. " " .. q(exe) .. " " .. args .. " 2>&1; echo \"__exit=$?\"")
  local out = p:read("*a")
  p:close()
  local code = tonumber(out:match("__exit=(%d+)%s*$"))
  return (out:gsub("__exit=%d+%s*$", "")), code
end

T.test("tide tokenizer train: tokenizer.train's file, identical on 1 and 2 threads, tide specials at 256...", function()
  local dir = T.tmpdir("bpecmd-train", { create = true })
  local files = { FORTUNES .. "/computers", FORTUNES .. "/science" }
  local args = fmt("tokenizer train --vocab 700 %s %s -o %s", q(files[1]), q(files[2]), q(dir .. "/t1.json"))
  local out, code = tide_cmd(args, "TIDE_THREADS=1")
  T.eq(code, 0, out)
  T.ok(out:find("tokenizer train: 700 ids from 2 files", 1, true), out)
  out, code = tide_cmd(args:gsub("t1%.json", "t2.json"), "TIDE_THREADS=2")
  T.eq(code, 0, out)
  T.eq(read(dir .. "/t1.json"), read(dir .. "/t2.json"), "the thread count changes nothing")
  T.eq(read(dir .. "/t1.json"), (tokenizer.train({ files = files, vocab_size = 700 })))
  local tok = tokenizer.load(dir .. "/t1.json")
  T.eq(tok.vocab_size, 700)
  for i, name in ipairs(tokenizer.SPECIALS) do T.eq(tok:id(name), 255 + i, name) end
  local t = json.decode(read(dir .. "/t1.json"))
  T.eq(#t.model.merges, 700 - 276)
  T.eq(#t.added_tokens, 20)
  T.eq(t.pre_tokenizer.type, "ByteLevel")
  -- a directory, with exclude patterns; --min-frequency stops early on a tiny corpus
  C.tide_mkdir_p(dir .. "/small")
  write(dir .. "/small/a.txt", "aaa bbb aaa bbb ccc\n")
  write(dir .. "/small/a.dat", "\0\1\2")
  out, code = tide_cmd(fmt("tokenizer train --vocab 400 --exclude '%%.dat$' %s -o %s", q(dir .. "/small"), q(dir .. "/s.json")))
  T.eq(code, 0, out)
  T.ok(out:find("(no pair occurs 2 times any more; asked for 400)", 1, true), out)
  T.eq(tokenizer.load(dir .. "/s.json"):encode("aaa bbb"), { tokenizer.load(dir .. "/s.json"):id("aaa"),
    tokenizer.load(dir .. "/s.json"):id("Ġbbb") })
end)

T.test("progress on a terminal: tide tokenizer train and tide data prepare redraw one live line; none in a pipe", function()
  local dir = T.tmpdir("bpecmd-progress", { create = true })
  local files = q(FORTUNES .. "/computers") .. " " .. q(FORTUNES .. "/science")
  local train = fmt("%s tokenizer train --vocab 700 %s -o %s", q(exe), files, q(dir .. "/t.json"))
  local prepare = fmt("%s data prepare --tokenizer %s %s -o %s", q(exe), q(dir .. "/t.json"), files, q(dir .. "/shards"))
  local function on_tty(cmd)
    local p = io.popen(fmt("script -qec %s /dev/null 2>&1", q(cmd)))
    local out = p:read("*a")
    p:close()
    return out
  end
  local out = on_tty(train)
  local counting = select(2, out:gsub("\rtokenizer train: counting %d/2 files", ""))
  local merging = select(2, out:gsub("\rtokenizer train: merging, vocabulary %d+/700 ", ""))
  T.ok(counting == 2 and merging >= 2 and out:find("\27[K", 1, true), out)
  T.ok(out:find("tokenizer train: 700 ids from 2 files", 1, true), out)
  out = on_tty(prepare)
  T.ok(out:find("\rdata prepare %[#+%] 100%% 2/2 files"), out)
  T.ok(out:find("data prepare: 2 documents", 1, true), out)
  -- a pipe: no live line, the count and the summary as plain lines
  out = tide_cmd(fmt("tokenizer train --vocab 700 %s -o %s", files, q(dir .. "/t2.json")))
  T.ok(not out:find("\r", 1, true) and select(2, out:gsub("\n", "")) == 2, out)
  T.ok(out:match("^tokenizer train: counting 2/2 files, [%d.]+ MB, %d+ distinct words %([%d.]+ MB/s%)\n"
    .. "tokenizer train: 700 ids from 2 files %([%d.]+ MB%) in [%d.]+ s %-> [^\n]+t2%.json\n$"), out)
end)

T.test("tide tokenizer encode / decode: per line, as tok:encode; decode gives the lines back", function()
  local dir = T.tmpdir("bpecmd-code", { create = true })
  local lines = { "Hello, world!", "", "  indented\tand tabbed  ", "ünïcödé 日本語 😀", "a<|endoftext|>b", "last line" }
  write(dir .. "/in.txt", table.concat(lines, "\n") .. "\n")
  local tok = tokenizer.load(FIX .. "/hf_bpe.json")
  local out, code = tide_cmd(fmt("tokenizer encode %s %s -o %s", q(FIX .. "/hf_bpe.json"), q(dir .. "/in.txt"), q(dir .. "/ids.txt")))
  T.eq(code, 0, out)
  local got = {}
  for l in (read(dir .. "/ids.txt")):gmatch("([^\n]*)\n") do got[#got + 1] = l end
  T.eq(#got, #lines)
  for i, l in ipairs(lines) do
    local ids = {}
    for w in got[i]:gmatch("%S+") do ids[#ids + 1] = tonumber(w) end
    T.eq(ids, tok:encode(l), "line " .. i)
  end
  out, code = tide_cmd(fmt("tokenizer decode %s %s", q(FIX .. "/hf_bpe.json"), q(dir .. "/ids.txt")))
  T.eq(code, 0, out)
  T.eq(out, read(dir .. "/in.txt"))
  -- the byte level
  out, code = tide_cmd(fmt("tokenizer encode byte %s", q(dir .. "/in.txt")))
  T.eq(code, 0, out)
  T.eq(out:match("^([^\n]*)"), "72 101 108 108 111 44 32 119 111 114 108 100 33")
  -- errors, one line each
  write(dir .. "/bad.txt", "1 2 3\n4 x 5\n")
  write(dir .. "/range.txt", "1 2\n3 99999\n")
  local errs = {
    { fmt("tokenizer decode %s %s", q(FIX .. "/hf_bpe.json"), q(dir .. "/bad.txt")), "bad.txt:2: 'x' is not a token id" },
    { fmt("tokenizer decode %s %s", q(FIX .. "/hf_bpe.json"), q(dir .. "/range.txt")),
      "range.txt:2: id 99999 at position 2 is not in the vocabulary of 1024" },
    { fmt("tokenizer encode %s", q(dir .. "/in.txt")), "expected TOKENIZER FILE, got 1 argument(s)" },
    { fmt("tokenizer encode %s %s", q(dir .. "/in.txt"), q(dir .. "/in.txt")), "tokenizer '" },
    { "tokenizer train --vocab 300 x", "-o tokenizer.json is required" },
    { "tokenizer train --vocab 100 x -o y", "--vocab must be at least 276" },
    { "tokenizer train -o y x", "--vocab N is required" },
    { "tokenizer train --vocab 300 --bogus 1 x -o y", "unknown option '--bogus'" },
    { fmt("tokenizer train --vocab 300 %s -o y", q(dir .. "/missing")), "does not exist" },
    { "tokenizer frob", "expected train, encode or decode, got 'frob'" },
  }
  for _, c in ipairs(errs) do
    local o, rc = tide_cmd(c[1])
    T.eq(rc, 1, c[1] .. ": " .. o)
    T.ok(o:find(c[2], 1, true), fmt("%s: expected '%s' in: %s", c[1], c[2], o))
    T.eq(select(2, o:gsub("\n", "")), 1, "one line: " .. o)
  end
  local o = tide_cmd("help")
  T.ok(o:find("tokenizer", 1, true) and o:find("data", 1, true), "tide help lists the commands")
  o = tide_cmd("tokenizer --help")
  T.ok(o:find("usage: tide tokenizer train --vocab N FILES... -o tokenizer.json", 1, true), o)
  o = tide_cmd("data --help")
  T.ok(o:find("usage: tide data prepare --tokenizer T INPUTS... -o OUTDIR", 1, true), o)
end)

T.run()
