-- fuzz_overrides.lua — a deterministic mutation fuzzer for the command line's override parser
-- (lua/tide/cli.lua: parse_run_args, parse_value, patch; overrides are parsed in Lua only, so there is no
-- C entry point for libFuzzer) and for the JSON reader of state.json (lua/tide/json.lua: decode).
--
--   luajit tests/fuzz/fuzz_overrides.lua [ITERATIONS] [SEED]      (scripts/lane_fuzz.sh runs it)
--
-- Each iteration mutates strings from the seed corpus (tests/fuzz/corpus/overrides/seeds.txt, one argument per
-- line; tests/fuzz/corpus/json/* and checkpoint state files for JSON) with a seeded xorshift generator, so a
-- failure is reproduced by the same ITERATIONS and SEED. The contract checked:
--   - parse_run_args and patch either succeed or raise a usage error (cli.usage_error) whose message is one
--     line; any other error (a raw Lua runtime error, a string error, a traceback) is a failure;
--   - a patched key keeps the type it had in the recipe (a number stays a number, a string a string);
--   - json.decode either returns a value or raises "json.decode: ..." in one line; a decoded value encodes
--     and decodes again to the same value (when all its numbers are finite).
local script_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or ".")
local root = script_dir .. "/../.."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path

local cli = require "tide.cli"
local json = require "tide.json"

local iterations = tonumber(arg[1]) or 100000
local seed = tonumber(arg[2]) or 1

-- xorshift32: the same sequence on every LuaJIT (math.random's generator is not specified across versions)
local bit = require "bit"
local state = bit.tobit(seed * 2654435761 % 2^32)
if state == 0 then state = 1 end
local function rnd(n)                       -- 0 .. n-1
  state = bit.bxor(state, bit.lshift(state, 13))
  state = bit.bxor(state, bit.rshift(state, 17))
  state = bit.bxor(state, bit.lshift(state, 5))
  return (state % 2^32) % n
end

local function read_lines(path)
  local out = {}
  local f = assert(io.open(path, "rb"))
  for line in f:lines() do out[#out + 1] = line end
  f:close()
  return out
end

local function read_dir(dir)
  local out = {}
  local p = io.popen("ls -1 '" .. dir .. "' 2>/dev/null")
  for name in p:lines() do
    local f = io.open(dir .. "/" .. name, "rb")
    if f then out[#out + 1] = f:read("*a"); f:close() end
  end
  p:close()
  return out
end

-- a recipe's shape: nested tables, arrays of tables, numbers, booleans, strings, a function
local function recipe()
  return {
    name = "quickstart", steps = 40, log_every = 10, ckpt_every = 100, seed = 1, threads = 2,
    model = { kind = "hybrid", vocab_size = 320, dim = 64, n_layers = 4, mixers = "3:1", device = "cpu",
              kda = { heads = 2, head_dim = 32 }, moe = { n_experts = 8, top_k = 2, balance = "quantile" },
              tie = false },
    optim = { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1, clip = 1.0 },
    sources = { text = { kind = "text", path = "/usr/share/games/fortunes", exclude = { "%.dat$", "%.u8$" } } },
    stages = { { name = "s128", seq_len = 128, steps = 150, lr = { kind = "constant", warmup = 20 },
                 mix = { text = 0.1, recall = 0.9 } },
               { name = "s256", seq_len = 256, steps = 90, lr = { kind = "cosine" } } },
    eval = { every = 75 },
    expect = { final_loss_below = 5.5 },
    run = function() end,
  }
end

local ALPHABET = { "-", "-", ".", ".", "=", "=", "_", "'", '"', "1", "0", "9", "e", "x", "a", "z", " ", "\0",
                   "\n", "\t", "\\", "%", "$", "/", "[", "]", "{", "}", "\xc3\xa9", "\xff", "nan", "inf", "1e309",
                   "-0", "0x", "..", "stages", "model", "optim", "lr", "1", "2", "99" }
local JSON_ALPHABET = { "{", "}", "[", "]", ":", ",", '"', "\\", "u", "0", "9", "-", ".", "e", "E", "+", " ",
                        "\n", "true", "false", "null", "\\u00", "\\ud83d", "\\ude00", "\xc3", "\xa9", "\0", "1e400",
                        '"step"', '"optim"', "[[[[", "}}}}" }

local function mutate(s, corpus, alphabet)
  local edits = 1 + rnd(4)
  for _ = 1, edits do
    local n = #s
    local op = rnd(7)
    local at = n > 0 and rnd(n) + 1 or 1
    if op == 0 and n > 0 then                                  -- delete a run
      s = s:sub(1, at - 1) .. s:sub(at + 1 + rnd(4))
    elseif op == 1 then                                        -- insert a token
      s = s:sub(1, at - 1) .. alphabet[rnd(#alphabet) + 1] .. s:sub(at)
    elseif op == 2 and n > 0 then                              -- replace a byte
      s = s:sub(1, at - 1) .. string.char(rnd(256)) .. s:sub(at + 1)
    elseif op == 3 then                                        -- splice with another corpus entry
      local o = corpus[rnd(#corpus) + 1]
      local cut = #o > 0 and rnd(#o) + 1 or 1
      s = s:sub(1, at) .. o:sub(cut)
    elseif op == 4 and n > 0 then                              -- duplicate a run
      local len = 1 + rnd(8)
      s = s:sub(1, at + len) .. s:sub(at, at + len) .. s:sub(at + len + 1)
    elseif op == 5 then                                        -- truncate
      s = s:sub(1, at)
    else                                                       -- a digit run or a key replaced
      s = s:gsub("%d+", function(d) return rnd(3) == 0 and tostring(rnd(100)) or d end, 1)
    end
  end
  return s
end

local failures = 0
local function fail(what, input, detail)
  failures = failures + 1
  io.stderr:write(string.format("fuzz_overrides: FAIL %s\n  input: %q\n  %s\n", what, input, tostring(detail)))
  if failures >= 10 then os.exit(1) end
end

-- an error is a usage error with a one-line message
local function check_error(what, input, e)
  if getmetatable(e) == nil or type(e) ~= "table" or type(e.msg) ~= "string" then
    fail(what .. ": not a usage error", input, e)
  elseif e.msg:find("\n", 1, true) then
    fail(what .. ": a usage error of more than one line", input, e.msg)
  end
end

local function get(cfg, key)
  local node = cfg
  for p in key:gmatch("[^.]+") do
    if type(node) ~= "table" then return nil end
    local v = node[p]
    if v == nil and tonumber(p) then v = node[tonumber(p)] end
    node = v
  end
  return node
end

local arg_corpus = read_lines(script_dir .. "/corpus/overrides/seeds.txt")
local json_corpus = read_dir(script_dir .. "/corpus/json")
for _, c in ipairs(read_dir(script_dir .. "/corpus/checkpoint")) do
  json_corpus[#json_corpus + 1] = c:match("^(.-)\n%-%-tide%-ckpt%-%-\n") or c
end

local function deep_eq(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then return a == b end
  for k, v in pairs(a) do if not deep_eq(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function all_finite(v)
  if type(v) == "number" then return v == v and v ~= math.huge and v ~= -math.huge end
  if type(v) == "table" then
    for k, x in pairs(v) do if not all_finite(x) then return false end end
  end
  return true
end

-- regressions first: what this fuzzer found, as fixed inputs (each failed before its fix)
--  - a newline typed inside an option made a usage error of two lines (cli.lua now shows it escaped)
--  - a backslash before a raw newline in state.json made a decode error of two lines (json.lua likewise)
for _, o in ipairs({ { "s\ncale", "tiny" }, { "optim.lr", "\"\n3e-" }, { "a\0b\1", nil } }) do
  local ok, e = pcall(cli.patch, recipe(), o[1], o[2])
  if ok then fail("patch accepted a malformed key", o[1], "") else check_error("patch", o[1], e) end
end
for _, input in ipairs({ '{"a":"\\\n"}', '{"a\\n":1,"a\\n":2}', "\1" }) do
  local ok, e = pcall(json.decode, input)
  if ok or e:find("\n", 1, true) then fail("json.decode: not a one-line decode error", input, e) end
end

local t0 = os.clock()
local n_args, n_patched, n_refused, n_json, n_decoded = 0, 0, 0, 0, 0
for it = 1, iterations do
  if it % 4 ~= 0 then
    -- 1-4 mutated arguments through parse_run_args, then each override through patch
    local args = {}
    for k = 1, 1 + rnd(4) do args[k] = mutate(arg_corpus[rnd(#arg_corpus) + 1], arg_corpus, ALPHABET) end
    n_args = n_args + #args
    local input = table.concat(args, " ")
    local ok, recipe_path, overrides = pcall(cli.parse_run_args, args)
    if not ok then
      check_error("parse_run_args", input, recipe_path)
      n_refused = n_refused + 1
    else
      for _, o in ipairs(overrides) do
        local cfg = recipe()
        local old = get(cfg, o.key)
        local pok, e = pcall(cli.patch, cfg, o.key, o.text)
        if not pok then
          check_error("patch", "--" .. o.key .. "=" .. tostring(o.text), e)
          n_refused = n_refused + 1
        else
          n_patched = n_patched + 1
          local new = get(cfg, o.key)
          if old ~= nil and type(new) ~= type(old) then
            fail("patch changed a type", "--" .. o.key .. "=" .. tostring(o.text), type(old) .. " -> " .. type(new))
          end
        end
      end
    end
  else
    n_json = n_json + 1
    local input = mutate(json_corpus[rnd(#json_corpus) + 1], json_corpus, JSON_ALPHABET)
    local ok, v = pcall(json.decode, input)
    if not ok then
      if type(v) ~= "string" or not v:match("^json%.decode: ") or v:find("\n", 1, true) then
        fail("json.decode: not a one-line decode error", input, v)
      end
    else
      n_decoded = n_decoded + 1
      if all_finite(v) then
        local eok, text = pcall(json.encode, v)
        if not eok then fail("json.encode of a decoded value", input, text)
        else
          local dok, back = pcall(json.decode, text)
          if not dok or not deep_eq(back, v) then fail("json round trip", input, dok and text or back) end
        end
      end
    end
  end
end
print(string.format("fuzz_overrides: %d iterations (seed %d) in %.1f s: %d arguments, %d overrides patched, "
  .. "%d refused with a usage error; %d JSON inputs, %d decoded; %d failures", iterations, seed, os.clock() - t0,
  n_args, n_patched, n_refused, n_json, n_decoded, failures))
os.exit(failures > 0 and 1 or 0)
