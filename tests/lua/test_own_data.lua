-- your own data, end to end through the command line as the README shows it: a JSONL corpus, a byte-level BPE
-- tokenizer trained by `tide tokenizer train`, a short run on the JSONL with it, then `tide sample` (readable text:
-- valid UTF-8, words of the corpus, no reserved tokens), `tide eval` (its table and results JSON), and
-- `tide plot` (the page, drawn by headless Chromium).
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local cli = require "tide.cli"

local exe = cli.exe_path()
local q = cli.shell_quote
local dir = T.tmpdir("own", { create = true })

local function sh(args)
  local p = io.popen(q(exe) .. " " .. args .. " 2>&1; echo \"__exit=$?\"")
  local out = p:read("*a")
  p:close()
  local code = tonumber(out:match("__exit=(%d+)%s*$"))
  return (out:gsub("__exit=%d+%s*$", "")), code
end

local read = T.read

-- the sanitizer lane (TIDE_SANITIZED, CMakeLists.txt) runs every command of the test on a run of 120 steps, ~10x
-- slower under ASan; what 600 steps must have learned (readable words of the corpus, the held-out loss) is asserted
-- in the main lane
local sanitized = os.getenv("TIDE_SANITIZED") == "1"
local STEPS = sanitized and 120 or 600

-- the corpus: fortunes of two files as JSONL documents (one per fortune, `text` field)
local function corpus()
  local path, words = dir .. "/corpus.jsonl", {}
  local out = assert(io.open(path, "wb"))
  local n = 0
  for _, name in ipairs({ "fortunes", "wisdom" }) do
    local text = assert(read("/usr/share/games/fortunes/" .. name), "the fortunes package is missing")
    for doc in (text .. "\n%\n"):gmatch("(.-)\n%%\n") do
      if #doc > 20 and #doc < 600 then
        out:write(json.encode({ text = doc }), "\n")
        n = n + 1
        for w in doc:lower():gmatch("%a%a+") do words[w] = true end
      end
    end
  end
  out:close()
  return path, words, n
end

local function valid_utf8(s)
  local i = 1
  while i <= #s do
    local c = s:byte(i)
    local n = c < 0x80 and 0 or (c >= 0xC2 and c <= 0xDF) and 1 or (c >= 0xE0 and c <= 0xEF) and 2 or
      (c >= 0xF0 and c <= 0xF4) and 3 or -1
    if n < 0 then return false end
    for k = 1, n do
      local d = s:byte(i + k)
      if not d or d < 0x80 or d > 0xBF then return false end
    end
    i = i + n + 1
  end
  return true
end

T.test("JSONL + a trained BPE tokenizer -> a run -> tide sample, tide eval, tide plot", function()
  local data, vocab, ndocs = corpus()
  T.ok(ndocs > 300, ndocs .. " documents")
  local tok = dir .. "/tokenizer.json"
  local out, code = sh("tokenizer train --vocab 600 --quiet " .. q(data) .. " -o " .. q(tok))
  T.eq(code, 0, out)
  local recipe = dir .. "/recipe.lua"
  local f = assert(io.open(recipe, "w"))
  f:write(string.format([[
return {
  name = "own-data",
  model = { dim = 96, n_layers = 2, n_heads = 4, vocab_size = 600, max_seq_len = 128 },
  data = { path = %q, tokenizer = %q, seq_len = 64, batch_size = 8, val_fraction = 0.05 },
  optim = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 },
  schedule = { kind = "cosine", warmup = 20 },
  train = { steps = %d, eval_every = %d, eval_batches = 4, ckpt_every = %d, log_every = 100, seed = 1,
    out = %q, quiet = true },
}
]], data, tok, STEPS, STEPS / 2, STEPS / 2, dir .. "/run"))
  f:close()
  out, code = sh("run " .. q(recipe))
  T.eq(code, 0, out)
  local run = dir .. "/run"
  T.ok(read(run .. string.format("/ckpt/step_%08d/tokenizer.json", STEPS)) == read(tok), "the checkpoint carries the tokenizer")

  -- sample: readable text from the words of the corpus
  out, code = sh("sample " .. q(run) .. " --prompt 'The ' --max-new 80 --temperature 0.5 --top-k 20 --seed 3 --stop none")
  T.eq(code, 0, out)
  T.ok(valid_utf8(out), "valid UTF-8: " .. out)
  T.ok(not out:find("<|reserved", 1, true), "no reserved tokens: " .. out)
  out = out:gsub("<|endoftext|>", "\n")   -- --stop none: documents follow one another
  local letters = select(2, out:gsub("[%a%s%p]", ""))
  T.ok(sanitized or letters / #out > 0.95, string.format("%.2f of the characters are letters, spaces or punctuation: %s",
    letters / #out, out))
  local known, total = 0, 0
  for w in out:lower():gmatch("%a%a+") do
    total = total + 1
    if vocab[w] then known = known + 1 end
  end
  T.ok(sanitized or (total >= 8 and known / total >= 0.6), string.format("%d of %d words are the corpus's: %s", known, total, out))
  print("  sample: " .. out:gsub("\n", " "):sub(1, 160))

  -- eval: the held-out loss, as a table and a results JSON
  out, code = sh("eval " .. q(run) .. " --task val -o " .. q(dir .. "/eval.json"))
  T.eq(code, 0, out)
  local res = json.decode(assert(read(dir .. "/eval.json")))
  local val = res.results[1]
  T.eq(val.task, "val")
  T.ok(val.loss and val.loss < (sanitized and 6.0 or 5.0) and val.loss > 0.5, "held-out loss " .. tostring(val.loss) .. " (ln 600 = 6.40)")
  T.ok(out:find(string.format("%.4f", val.loss), 1, true), "the table prints the loss:\n" .. out)

  -- plot: the page, drawn
  out, code = sh("plot " .. q(run))
  T.eq(code, 0, out)
  local html = assert(read(run .. "/report.html"), "report.html")
  T.ok(select(2, html:gsub("<svg", "")) >= 4, "charts on the page")
  local shot = T.screenshot(run .. "/report.html", 1000, 1400)
  if shot then
    local w, h, rgb = T.png(shot)
    local drawn, colours, distinct = 0, {}, 0
    for y = 0, h - 1, 4 do
      for x = 0, w - 1, 4 do
        local r, g, b = rgb(x, y)
        if r + g + b < 720 then drawn = drawn + 1 end
        local key = (r * 256 + g) * 256 + b
        if not colours[key] then colours[key] = true; distinct = distinct + 1 end
      end
    end
    local n = (w / 4) * (h / 4)
    T.ok(drawn / n > 0.03 and distinct >= 50, string.format("screenshot: %.3f drawn, %d colours", drawn / n, distinct))
  end
end)

T.run()
