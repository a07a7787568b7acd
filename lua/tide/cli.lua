-- tide.cli: the command line of the `tide` executable (engine/host/main.c calls main(argv)).
--
--   tide run RECIPE [--a.b=value ...] [--resume] [--dry-run]   train (or run) a recipe
--   tide repl                                                   interactive prompt
--   tide test [PATTERN]                                         run tests/lua/test_*.lua
--   tide info                                                   build and machine summary
--   tide help                                                   this text
--
-- main returns the process exit code. Usage mistakes raise a UsageError (shown without a traceback);
-- everything else raised by a recipe keeps its file:line; the host adds a traceback only when asked (TIDE_TRACEBACK=1,
-- --debug).
local ffi = require "ffi"

local M = {}

M.USAGE = [[
usage: tide <command> [arguments]

  run RECIPE [--key=value ...]  load RECIPE (a Lua file returning a config table), apply the overrides,
                                then call cfg.run(cfg) if the recipe defines it, else tide.train(cfg)
      --a.b=value               set field b of table a: a key of the recipe or of the config schema
                                (--train.quiet=true, --model.norm_eps=1e-6); array elements by position or
                                by name (--stages.s128.steps=20; that stage's warmup scales with its steps);
                                the value is read as a number, true/false, or else a string ("quotes" keep it)
      --help                    list the recipe's keys with their values (tide run alone lists the recipes)
      --resume[=DIR]            cfg.resume = true (continue from the last checkpoint) or a checkpoint/run dir
      --overwrite               start afresh in an output directory that holds another run (its files are
                                removed first); without it such a run is refused
      --check                   fail (exit 1) when the recipe's `expect` bounds are missed (else a warning)
      --dry-run                 load and patch the recipe, print its plan (a curriculum) or the resulting
                                config, run nothing
      --profile[=N]             at the end, the N (25) ops that took the most time (tide.profile: calls and self
                                time as forward, backward and recompute, and what the ops left to Lua)
      --stage=NAME              (curricula) start at stage NAME, from the --resume checkpoint if given
      --scale=NAME              (curricula) a recipe-defined scale, e.g. --scale=tiny
      --out=DIR --seed=N --threads=N   cfg.out / cfg.seed / cfg.threads (seed and threads act at once)
  repl                          interactive prompt (help() inside it)
  test [PATTERN]                run tests/lua/test_*.lua whose name contains PATTERN, each in its own
                                process; prints "N passed, M failed"; exit code 1 on failure
  info                          version, build type and commit, threads, BLAS, CUDA, MPI, LuaJIT, memory
  help                          this text

environment: TIDE_LUA_DIR (Lua library), TIDE_HEADER (engine/tide.h), TIDE_THREADS,
             TIDE_TEST_FILTER (test case names), TIDE_TRACEBACK=1 or --debug (errors with a Lua traceback)]]

-- the usage text with the registered commands' lines
function M.usage()
  local lines = {}
  for _, name in ipairs(M.command_names()) do
    lines[#lines + 1] = string.format("  %-29s %s", name, M.COMMANDS[name].summary)
  end
  if #lines == 0 then return M.USAGE end
  return (M.USAGE:gsub("\n\nenvironment:", "\n" .. table.concat(lines, "\n") .. "\n  (tide CMD --help for one command's options)\n\nenvironment:", 1))
end

-- top-level keys a flag may set even when the recipe does not define them
M.TOP_LEVEL_FLAGS = require("tide.options").with_run_flags({ stage = true, scale = true })

local UsageError = { __tostring = function(e) return e.msg end }
-- one line whatever the user typed: control characters echoed from an argument are shown escaped
local CONTROL_ESCAPES = { ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t", ["\0"] = "\\0" }
local function usage_error(msg)
  msg = tostring(msg):gsub("%c", function(c) return CONTROL_ESCAPES[c] or string.format("\\%03d", c:byte()) end)
  error(setmetatable({ msg = msg }, UsageError), 0)
end
M.usage_error = usage_error

-- ---- helpers ---------------------------------------------------------------------------------------------
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local root = (here:match("^(.*)/[^/]*$") or ".")
root = root:match("^(.*)/[^/]*$") or "."          -- <repo>/lua/tide -> <repo>

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function file_exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return false
end

if not pcall(function() return ffi.C.readlink end) then
  pcall(ffi.cdef, "long readlink(const char *path, char *buf, size_t bufsiz);")
end

-- the path of the running executable (the `tide` binary when run by it)
function M.exe_path()
  local env = os.getenv("TIDE_EXE")
  if env and env ~= "" then return env end
  local buf = ffi.new("char[4096]")
  local n = ffi.C.readlink("/proc/self/exe", buf, 4095)
  if n <= 0 then return nil end
  return ffi.string(buf, n)
end

-- "512" -> 512, "true" -> true, "'x'" / "\"x\"" -> "x", else the string
function M.parse_value(s)
  if s == "true" then return true elseif s == "false" then return false end
  local q = s:match('^"(.*)"$') or s:match("^'(.*)'$")
  if q then return q end
  local n = tonumber(s)
  if n then return n end
  return s
end

local function sorted_keys(t)
  local strs, n_int = {}, 0
  for k in pairs(t) do
    if type(k) == "string" then strs[#strs + 1] = k
    elseif type(k) == "number" then n_int = n_int + 1 end
  end
  table.sort(strs)
  if n_int > 0 then table.insert(strs, 1, "1.." .. n_int) end
  return strs
end

-- edit distance, for "did you mean"
local function distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

local function unknown_key(path, node, where, key)
  local keys = sorted_keys(node)
  local best, bestd = nil, 3
  for _, k in ipairs(keys) do
    local d = distance(k, key)
    if d < bestd then best, bestd = k, d end
  end
  local at = where == "" and "known keys" or ("known keys at " .. where)
  usage_error(string.format("unknown recipe key '%s'%s (%s: %s)", path,
    best and (", did you mean '" .. (where == "" and "" or where .. ".") .. best .. "'?") or "",
    at, #keys > 0 and table.concat(keys, ", ") or "none"))
end

-- node's key for the text s: the key itself, its number (array index), or the index of the element named s
-- (--stages.s128.steps: stages are addressed by their name as well as by their position)
local function existing_key(node, s)
  if node[s] ~= nil then return s end
  local n = tonumber(s)
  if n and node[n] ~= nil then return n end
  for i, v in ipairs(node) do
    if type(v) == "table" and v.name == s then return i end
  end
  return nil
end

local function unknown_key_with(path, node, where, key, allowed)
  local merged = {}
  for k, v in pairs(node) do merged[k] = v end
  for k in pairs(allowed or {}) do if merged[k] == nil then merged[k] = true end end
  unknown_key(path, merged, where, key)
end

-- the key path with array elements named by position (stages.s128.lr.warmup -> stages.1.lr.warmup)
function M.canonical_key(cfg, path)
  local parts, node = {}, cfg
  for p in path:gmatch("[^.]+") do
    local k = type(node) == "table" and existing_key(node, p) or nil
    parts[#parts + 1] = k and tostring(k) or p
    node = k and node[k] or nil
  end
  return table.concat(parts, ".")
end

-- warmups that a shortened (or lengthened) run scales with its steps, unless the command line sets them too:
-- a curriculum stage's lr.warmup, tide.train's schedule.warmup / decay_start / decay_end
local function scale_with_steps(cfg, node, parts, old, new, explicit, notes)
  -- steps that are not a positive integer scale nothing: the driver's own error names the key
  if type(old) ~= "number" or old <= 0 or type(new) ~= "number" or new < 1 or new % 1 ~= 0 or new == old then return end
  local prefix = table.concat(parts, ".", 1, #parts - 1)
  local targets = {}
  if type(node.lr) == "table" then
    targets[#targets + 1] = { t = node.lr, k = "warmup", path = prefix .. ".lr.warmup", below = new }
  elseif #parts == 2 and parts[1] == "train" and type(cfg.schedule) == "table" then
    for _, k in ipairs({ "warmup", "decay_start", "decay_end" }) do
      targets[#targets + 1] = { t = cfg.schedule, k = k, path = "schedule." .. k, below = k == "warmup" and new or new + 1 }
    end
  end
  local by = {}
  for _, x in ipairs(targets) do
    local v = x.t[x.k]
    if type(v) == "number" and not explicit[M.canonical_key(cfg, x.path)] then
      x.v, x.scaled = v, math.floor(v * new / old + 0.5)
      if x.scaled >= x.below then x.scaled = math.max(x.below - 1, 0) end
    end
    by[x.k] = x
  end
  -- the schedule's order survives the rounding (warmup <= decay_start < decay_end: 480 and 600 of 600 steps are
  -- both 2 of 2): a scaled decay_start moves below decay_end, then a scaled warmup down to decay_start
  local function val(x) return x and (x.scaled or x.t[x.k]) end
  local w, st, en = by.warmup, by.decay_start, by.decay_end
  if st and st.scaled and type(val(en)) == "number" and st.scaled >= val(en) then
    st.scaled = math.max(val(en) - 1, 0)
  end
  if w and w.scaled and type(val(st)) == "number" and w.scaled > val(st) then w.scaled = val(st) end
  for _, x in ipairs(targets) do
    if x.scaled and x.scaled ~= x.v then
      x.t[x.k] = x.scaled
      notes[#notes + 1] = string.format("note: %s %d -> %d (scaled with %s %d -> %d; set --%s to choose)", x.path, x.v,
        x.scaled, table.concat(parts, "."), old, new, x.path)
    end
  end
end

-- cfg[path] = value for "a.b.c"; the key must exist in the recipe or in the config schema (tide.schema), or be a
-- top-level flag; the new value must have the old value's type (a string field takes the text as it is).
-- opts = {explicit = set of the paths the command line sets, notes = array the scaling notes go to}
function M.patch(cfg, path, text, opts)
  opts = opts or {}
  local schema = require "tide.schema"
  local value = text == nil and true or M.parse_value(text)
  local parts = {}
  for p in path:gmatch("[^.]+") do parts[#parts + 1] = p end
  if #parts == 0 or path:sub(1, 1) == "." or path:sub(-1) == "." or path:find("..", 1, true) then
    usage_error(string.format("malformed recipe key '%s'", path))
  end
  local node, where = cfg, ""
  for i = 1, #parts - 1 do
    local k = existing_key(node, parts[i])
    if k == nil then
      local allowed = schema.keys(cfg, { unpack(parts, 1, i - 1) })
      if allowed and allowed[parts[i]] and schema.TABLES[parts[i]] ~= nil then
        node[parts[i]] = {}
        k = parts[i]
      else
        unknown_key_with(path, node, where, parts[i], allowed)
      end
    end
    where = where == "" and parts[i] or (where .. "." .. parts[i])
    if type(node[k]) ~= "table" then
      usage_error(string.format("recipe key '%s' is a %s, not a table, so '%s' cannot be set", where, type(node[k]), path))
    end
    node = node[k]
  end
  local last = parts[#parts]
  local k = existing_key(node, last)
  if k == nil then
    if #parts == 1 and M.TOP_LEVEL_FLAGS[last] then
      cfg[last] = value
      return
    end
    local allowed = schema.keys(cfg, { unpack(parts, 1, #parts - 1) })
    if allowed and allowed[last] then
      node[last] = value     -- a schema key the recipe leaves at its default; the driver checks the value
      return
    end
    unknown_key_with(path, node, where, last, allowed)
  end
  local old = node[k]
  local t = type(old)
  if t == "number" then
    if text == nil then
      usage_error(string.format("recipe key '%s' is a number: give it a value (--%s=N)", path, path))
    elseif type(value) ~= "number" then
      usage_error(string.format("recipe key '%s' is a number, got '%s'", path, tostring(text)))
    end
  elseif t == "boolean" then
    if type(value) ~= "boolean" then
      usage_error(string.format("recipe key '%s' is a boolean (true/false), got '%s'", path, tostring(text)))
    end
  elseif t == "string" then
    value = text == nil and "true" or (text:match('^"(.*)"$') or text:match("^'(.*)'$") or text)
  elseif t == "table" then
    usage_error(string.format("recipe key '%s' is a table; set its fields instead (--%s.<key>=value)", path, path))
  else
    usage_error(string.format("recipe key '%s' is a %s and cannot be set from the command line", path, t))
  end
  node[k] = value
  if last == "steps" then scale_with_steps(cfg, node, parts, old, value, opts.explicit or {}, opts.notes or {}) end
end

-- a readable Lua rendering of a config table (sorted keys), for --dry-run
function M.dump(v, indent, seen)
  indent, seen = indent or "", seen or {}
  if type(v) == "string" then return string.format("%q", v) end
  if type(v) ~= "table" then
    if type(v) == "function" or type(v) == "userdata" or type(v) == "cdata" then return "<" .. type(v) .. ">" end
    return tostring(v)
  end
  if seen[v] then return "<cycle>" end
  seen[v] = true
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    if type(a) == type(b) and (type(a) == "number" or type(a) == "string") then return a < b end
    return type(a) == "number"
  end)
  if #keys == 0 then seen[v] = nil return "{}" end
  local lines = {}
  local inner = indent .. "  "
  local n = #v
  for _, k in ipairs(keys) do
    local val = M.dump(v[k], inner, seen)
    if type(k) == "number" and k >= 1 and k <= n and k == math.floor(k) then
      lines[#lines + 1] = inner .. val .. ","          -- the array part, in order
    else
      local ks = type(k) == "string" and k:match("^[%a_][%w_]*$") and k or ("[" .. M.dump(k) .. "]")
      lines[#lines + 1] = inner .. ks .. " = " .. val .. ","
    end
  end
  seen[v] = nil
  return "{\n" .. table.concat(lines, "\n") .. "\n" .. indent .. "}"
end

-- ---- commands --------------------------------------------------------------------------------------------
-- The commands beyond run/repl/test/info: each is a module returning { USAGE = text, main = function(args) ->
-- exit code }; `tide CMD --help` prints its USAGE. `summary` is the line `tide help` shows.
M.COMMANDS = {}
function M.register(name, module, summary)
  M.COMMANDS[name] = { module = module, summary = summary }
end
-- the commands whose module is installed (a command is listed and dispatched only then)
function M.command_names()
  local names = {}
  for k, c in pairs(M.COMMANDS) do
    if package.searchpath(c.module, package.path) then names[#names + 1] = k end
  end
  table.sort(names)
  return names
end

M.register("tokenizer", "tide.cmd.tokenizer", "train / encode / decode a byte-level BPE tokenizer.json")
M.register("data", "tide.cmd.data", "prepare: tokenize text, JSONL or directories into token shards")
M.register("sample", "tide.cmd.sample", "CKPT --prompt TEXT: generate text from a checkpoint")
M.register("eval", "tide.cmd.eval", "CKPT [--task ...]: evaluate a checkpoint (tables + results JSON)")
M.register("export", "tide.cmd.export", "CKPT DIR: write a HuggingFace model directory")
M.register("import", "tide.cmd.import", "DIR OUT: read a HuggingFace Llama directory into a tide checkpoint")
M.register("ckpt", "tide.cmd.ckpt", "info | consolidate CKPT: a checkpoint's layout; shards as one file")
M.register("plot", "tide.cmd.plot", "RUN [-o report.html]: one self-contained HTML page of a run's metrics")

-- subcommand(args, handlers, who): runs handlers[args[1]] on the remaining arguments (tide data prepare ...,
-- tide tokenizer train ...); names = the handlers' names in the order the usage error lists them; usage (the
-- command's USAGE) is printed for `CMD SUB --help`
function M.subcommand(args, handlers, names, who, usage)
  local sub = args[1]
  local rest = {}
  for i = 2, #args do rest[#rest + 1] = args[i] end
  if sub and handlers[sub] then
    if usage and (rest[1] == "--help" or rest[1] == "-h") then
      print(usage)
      return 0
    end
    return handlers[sub](rest)
  end
  local list = #names == 1 and names[1] or (table.concat(names, ", ", 1, #names - 1) .. " or " .. names[#names])
  usage_error(string.format("%s: expected %s, got %s (%s --help)", who, list, sub and ("'" .. sub .. "'") or "nothing",
    who))
end

-- parse_flags(args, spec, who) -> positional (array), flags (table): the one parser of the commands' options.
-- spec[name] = { kind = "number" | "integer" | "string" | "boolean" | "list", default = v, min = x, max = x }
-- (name with underscores; --max-new and --max_new are the same flag). Unknown flags, missing or ill-typed values
-- are usage errors naming the flag and, for unknown ones, the known flags. short = { o = "out" } maps -o VALUE.
function M.parse_flags(args, spec, who, short)
  local pos, flags = {}, {}
  for k, s in pairs(spec) do flags[k] = s.default end
  local i = 1
  while i <= #args do
    local a = args[i]
    local letter = a:match("^%-(%a)$")
    if letter and short and short[letter] then a = "--" .. short[letter] end
    if a:sub(1, 2) == "--" and #a > 2 then
      local key, text = a:sub(3):match("^([^=]+)=(.*)$")
      key = (key or a:sub(3)):gsub("-", "_")
      local s = spec[key]
      if not s then
        local known = {}
        for k in pairs(spec) do known[#known + 1] = "--" .. k end
        table.sort(known)
        usage_error(string.format("%s: unknown option '--%s' (known: %s)", who, key,
          #known > 0 and table.concat(known, ", ") or "none"))
      end
      if s.kind == "boolean" then
        if text == nil or text == "true" then flags[key] = true
        elseif text == "false" then flags[key] = false
        else usage_error(string.format("%s: --%s is true or false, got '%s'", who, key, text)) end
      else
        if text == nil then
          i = i + 1
          text = args[i]
          if text == nil then usage_error(string.format("%s: --%s needs a value", who, key)) end
        end
        if s.kind == "number" or s.kind == "integer" then
          local v = tonumber(text)
          if v == nil or v ~= v or v == math.huge or v == -math.huge then
            usage_error(string.format("%s: --%s must be a finite number, got '%s'", who, key, text))
          end
          if s.kind == "integer" and v ~= math.floor(v) then
            usage_error(string.format("%s: --%s must be an integer, got '%s'", who, key, text))
          end
          if (s.min and v < s.min) or (s.max and v > s.max) then
            usage_error(string.format("%s: --%s must be in [%s, %s], got %s", who, key,
              tostring(s.min or "-inf"), tostring(s.max or "inf"), text))
          end
          flags[key] = v
        elseif s.kind == "list" then
          local l = {}
          for piece in text:gmatch("[^,]+") do l[#l + 1] = tonumber(piece) or piece end
          flags[key] = l
        else
          flags[key] = text
        end
      end
    else
      pos[#pos + 1] = a
    end
    i = i + 1
  end
  return pos, flags
end

-- ---- run -------------------------------------------------------------------------------------------------
-- splits run arguments into the recipe path and the list of {key, text} overrides
function M.parse_run_args(args)
  local recipe, overrides = nil, {}
  for _, a in ipairs(args) do
    if a:sub(1, 2) == "--" then
      local key, text = a:sub(3):match("^([^=]+)=(.*)$")
      if not key then key = a:sub(3) end
      if key == "" then usage_error("empty option '" .. a .. "'") end
      -- flags are written with dashes (--dry-run); recipe keys use underscores
      if not key:find(".", 1, true) then key = key:gsub("-", "_") end
      overrides[#overrides + 1] = { key = key, text = text }
    elseif recipe == nil then
      recipe = a
    else
      usage_error(string.format("unexpected argument '%s' (one recipe per run; options look like --key=value)", a))
    end
  end
  return recipe, overrides
end

-- loads RECIPE and applies the overrides; returns the config table
function M.load_recipe(path, overrides)
  if not file_exists(path) then
    local f, err = io.open(path, "r")
    usage_error(string.format("cannot open recipe '%s': %s", path, f and "unknown error" or tostring(err):gsub("^.-: ", "")))
  end
  local chunk, err = loadfile(path)
  if not chunk then usage_error(err) end   -- "recipe.lua:LINE: message"
  local cfg = chunk(path)
  if type(cfg) ~= "table" then
    usage_error(string.format("recipe '%s' must return a config table, got %s", path, type(cfg)))
  end
  -- --scale=NAME first (a curriculum's recipe-defined scale rewrites stages, data and dist): the other overrides then
  -- edit the scaled config, so `--scale=tiny --dist.cp=4` or `--stages.S1_1k.steps=5` set what the run uses
  local rest = {}
  for _, o in ipairs(overrides or {}) do
    if o.key == "scale" and type(cfg.scales) == "table" and type(cfg.scales[o.text]) == "function" then
      M.patch(cfg, o.key, o.text, {})
      cfg = require("tide.curriculum").apply_scale(cfg)
    else
      rest[#rest + 1] = o
    end
  end
  -- the paths the command line names (by position: --stages.s128.lr.warmup names stages.<i>.lr.warmup)
  local explicit, notes = {}, {}
  for _, o in ipairs(rest) do explicit[M.canonical_key(cfg, o.key)] = true end
  for _, o in ipairs(rest) do M.patch(cfg, o.key, o.text, { explicit = explicit, notes = notes }) end
  return cfg, notes
end

-- the shipped recipes (recipes/*.lua) with the first sentence of each one's header comment
function M.recipe_list()
  local dir = root .. "/recipes"
  local p = io.popen("ls -1 " .. shell_quote(dir) .. " 2>/dev/null")
  local rows = {}
  for name in (p and p:lines() or function() end) do
    if name:match("%.lua$") then
      local f = io.open(dir .. "/" .. name, "r")
      local text = {}
      for line in (f and f:lines() or function() end) do
        local c = line:match("^%-%-%s?(.*)$")
        if not c or c == "" then break end
        text[#text + 1] = c
      end
      if f then f:close() end
      local about = table.concat(text, " "):gsub("^[%w_]+%.lua%s+—%s+", "")
      about = about:match("^(.-%.)%s") or about
      if #about > 96 then about = about:sub(1, 96):gsub("%s+%S*$", "") .. " …" end
      rows[#rows + 1] = { name = "recipes/" .. name, about = about }
    end
  end
  if p then p:close() end
  return rows
end

-- tide run R --help: every key the recipe sets, with its value, as the --key=value that would set it
function M.recipe_help(path, cfg)
  local lines = { "tide run " .. path .. " [--key=value ...]; the recipe's keys and their values:" }
  local function walk(v, prefix, seen)
    if type(v) ~= "table" or seen[v] then
      if type(v) ~= "function" and type(v) ~= "table" then
        lines[#lines + 1] = string.format("  --%s=%s", prefix, type(v) == "string" and v or tostring(v))
      end
      return
    end
    seen[v] = true
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    table.sort(keys, function(a, b)
      if type(a) == type(b) then return a < b end
      return type(a) == "number"
    end)
    for _, k in ipairs(keys) do
      local name = (type(v[k]) == "table" and v[k].name and type(k) == "number") and v[k].name or tostring(k)
      walk(v[k], prefix == "" and name or (prefix .. "." .. name), seen)
    end
  end
  walk(cfg, "", {})
  lines[#lines + 1] = "  (any other key of the config schema may be set too, e.g. --train.quiet=true; flags: --resume[=DIR]"
  lines[#lines + 1] = "   --overwrite --check --dry-run --profile[=N] --out=DIR --seed=N --threads=N; curricula: --stage=NAME"
  lines[#lines + 1] = "   --scale=NAME)"
  return table.concat(lines, "\n")
end

function M.run(args)
  local path, overrides = M.parse_run_args(args)
  if not path then
    local rows = M.recipe_list()
    local out = { "usage: tide run RECIPE [--key=value ...]   (tide run RECIPE --help lists a recipe's keys)", "",
      "shipped recipes:" }
    for _, r in ipairs(rows) do out[#out + 1] = string.format("  %-28s %s", r.name, r.about) end
    print(table.concat(out, "\n"))
    return 0
  end
  local help = false
  for i = #overrides, 1, -1 do
    if overrides[i].key == "help" or overrides[i].key == "h" then help = true; table.remove(overrides, i) end
  end
  local cfg, notes = M.load_recipe(path, overrides)
  if help then
    print(M.recipe_help(path, cfg))
    return 0
  end
  for _, n in ipairs(notes or {}) do print(n) end
  io.stdout:flush()   -- the notes before anything the run writes to stderr (its first error, say)
  local tide = require "tide"
  local options = require "tide.options"
  local function flag(name, check)
    local ok, err = pcall(check, cfg[name], "--" .. name, nil, 0)
    if not ok then usage_error(tostring(err)) end
  end
  if cfg.threads ~= nil then flag("threads", options.pos_int) end
  if cfg.seed ~= nil then flag("seed", options.seed) end
  if cfg.threads then tide.set_num_threads(cfg.threads) end
  if cfg.seed then tide.manual_seed(cfg.seed) end
  if cfg.dry_run and type(cfg.plan) == "function" then
    -- a recipe with a plan (tide.Curriculum) prints it: stages, parameters, memory, parallel layout
    print(cfg.plan(cfg))
    return 0
  elseif cfg.dry_run then
    print("-- " .. path .. " (dry run: nothing was executed)")
    print("return " .. M.dump(cfg))
    return 0
  end
  local function go()
    if type(cfg.run) == "function" then return cfg.run(cfg) end
    local train = require "tide.train"
    if type(train) == "table" and type(train.run) == "function" then return train.run(cfg) end
    return train(cfg)
  end
  local r
  if cfg.profile ~= nil and cfg.profile ~= false then
    if cfg.profile ~= true then flag("profile", options.pos_int) end
    local report
    report, r = tide.profile(go)
    -- one table per job: rank 0's
    if tide.C.tide_dist_active() == 0 or tide.C.tide_dist_rank() == 0 then
      print(string.format("profile (--profile): the %d ops that took the most time", cfg.profile == true and 25 or cfg.profile))
      print(report:table(cfg.profile == true and 25 or cfg.profile))
    end
  else
    r = go()
  end
  return type(r) == "number" and r or 0
end

-- ---- test ------------------------------------------------------------------------------------------------
function M.test_dir()
  local env = os.getenv("TIDE_TEST_DIR")
  if env and env ~= "" then return env end
  if file_exists(root .. "/tests/lua") or os.execute("test -d " .. shell_quote(root .. "/tests/lua")) == 0 then
    return root .. "/tests/lua"
  end
  return "tests/lua"
end

function M.test_files(dir, pattern)
  local files = {}
  local p = io.popen("ls -1 " .. shell_quote(dir) .. " 2>/dev/null")
  if p then
    for name in p:lines() do
      if name:match("^test_.*%.lua$") and (not pattern or name:find(pattern, 1, true)) then
        files[#files + 1] = dir .. "/" .. name
      end
    end
    p:close()
  end
  table.sort(files)
  return files
end

-- runs one file in a child process; returns passed, failed, exit code
local function run_child(exe, path)
  local p = io.popen(shell_quote(exe) .. " test-file " .. shell_quote(path) .. " 2>&1; echo \"__tide_exit=$?\"")
  local passed, failed, code = nil, nil, nil
  for line in p:lines() do
    local c = line:match("^__tide_exit=(%d+)$")
    if c then code = tonumber(c)
    else
      local a, b = line:match("^(%d+) passed, (%d+) failed$")
      if a then passed, failed = tonumber(a), tonumber(b) end
      io.write("  ", line, "\n")
      io.stdout:flush()
    end
  end
  p:close()
  return passed, failed, code or -1
end

function M.test(args)
  local pattern = args[1]
  local exe = M.exe_path()
  if not exe then usage_error("tide test: cannot find the tide executable (set TIDE_EXE)") end
  local dir = M.test_dir()
  local files = M.test_files(dir, pattern)
  if #files == 0 then
    usage_error(string.format("tide test: no test files in %s%s", dir, pattern and (" matching '" .. pattern .. "'") or ""))
  end
  local clock = os.time
  local ok_t, tide = pcall(require, "tide")
  if ok_t then clock = tide.time end
  local total_pass, total_fail, bad_files = 0, 0, {}
  for _, f in ipairs(files) do
    print("== " .. f)
    io.stdout:flush()
    local t0 = clock()
    local passed, failed, code = run_child(exe, f)
    if passed == nil then
      -- no summary line: the file crashed before finishing; count it as one failure
      passed, failed = 0, 1
      print(string.format("  (no summary line; exit code %d)", code))
    elseif code ~= 0 and failed == 0 then
      failed = 1
      print(string.format("  (exit code %d)", code))
    end
    total_pass, total_fail = total_pass + passed, total_fail + failed
    if failed > 0 then bad_files[#bad_files + 1] = f end
    print(string.format("-- %s: %d passed, %d failed (%.1f s)", f, passed, failed, clock() - t0))
    io.stdout:flush()
  end
  if #bad_files > 0 then print("failed files: " .. table.concat(bad_files, ", ")) end
  print(string.format("%d passed, %d failed", total_pass, total_fail))
  return total_fail > 0 and 1 or 0
end

-- runs one test file in this process (the child side of `tide test`)
function M.test_file(args)
  local path = args[1]
  if not path then usage_error("tide test-file: which file?") end
  local chunk, err = loadfile(path)
  if not chunk then
    print("FAIL  (load) " .. tostring(err))
    print("0 passed, 1 failed")
    return 1
  end
  local ok, e = xpcall(chunk, function(m) return debug.traceback(tostring(m), 2) end)
  if not ok then
    print("FAIL  (top level) " .. tostring(e))
    print("0 passed, 1 failed")
    return 1
  end
  -- a file that registered cases without calling T.run
  local _, failed = require("tide.testing").run { exit = false }
  return failed > 0 and 1 or 0
end

-- ---- info ------------------------------------------------------------------------------------------------
-- "24.0 GiB RAM (21.3 GiB available); engine 0 B in use (peak 0 B)[; cuda:0 ...]"
function M.memory_line(tide)
  local total, avail
  local f = io.open("/proc/meminfo", "r")
  if f then
    for line in f:lines() do
      local k, v = line:match("^(%w+):%s+(%d+) kB")
      if k == "MemTotal" then total = tonumber(v) * 1024 elseif k == "MemAvailable" then avail = tonumber(v) * 1024 end
    end
    f:close()
  end
  local function gib(b) return string.format("%.1f GiB", b / 2 ^ 30) end
  local function bytes(b)
    if b >= 2 ^ 30 then return gib(b) end
    if b >= 2 ^ 20 then return string.format("%.1f MiB", b / 2 ^ 20) end
    return string.format("%d B", b)
  end
  local m = tide.memory()
  local parts = {}
  if total then parts[#parts + 1] = gib(total) .. " RAM" .. (avail and (" (" .. gib(avail) .. " available)") or "") end
  parts[#parts + 1] = string.format("engine %s in use (peak %s)", bytes(m.current), bytes(m.peak))
  return table.concat(parts, "; ")
end
function M.info()
  local tide = require "tide"
  local i = tide.info()
  print("tide " .. i.version)
  print("  build     " .. i.build)
  print(string.format("  threads   %d", i.threads))
  local fallback = os.getenv("TIDE_BLAS_FALLBACK")
  print("  blas      " .. i.blas .. (fallback and fallback ~= "" and os.getenv("OPENBLAS_CORETYPE")
    and string.format(" (OPENBLAS_CORETYPE=%s set at start: OpenBLAS had fallen back to %s on this CPU)",
      os.getenv("OPENBLAS_CORETYPE"), fallback) or ""))
  print(string.format("  cuda      %s (%d device%s) %s", i.cuda and "available" or "not available",
                      i.cuda_devices, i.cuda_devices == 1 and "" or "s", i.cuda_info))
  print("  mpi       " .. (i.mpi and "available" or "not available"))
  print("  luajit    " .. i.luajit .. (i.gc64 and " (GC64)" or " (no GC64)"))
  print("  memory    " .. M.memory_line(tide))
  print(string.format("  ops       %d", #i.ops))
  print("  lua dir   " .. tide.lua_dir)
  return 0
end

-- ---- entry -----------------------------------------------------------------------------------------------
function M.main(argv)
  argv = argv or {}
  local cmd = argv[1]
  local rest = {}
  for i = 2, #argv do rest[#rest + 1] = argv[i] end
  local threads = os.getenv("TIDE_THREADS")
  if threads and tonumber(threads) and cmd ~= "help" then require("tide").set_num_threads(tonumber(threads)) end
  if cmd == nil or cmd == "help" or cmd == "--help" or cmd == "-h" then
    print(M.usage())
    return 0
  elseif cmd == "run" then
    return M.run(rest)
  elseif cmd == "repl" then
    return require("tide.repl").start() or 0
  elseif cmd == "test" then
    return M.test(rest)
  elseif cmd == "test-file" then
    return M.test_file(rest)
  elseif cmd == "info" then
    return M.info()
  elseif cmd == "version" or cmd == "--version" then
    print(require("tide").version)
    return 0
  elseif M.COMMANDS[cmd] and package.searchpath(M.COMMANDS[cmd].module, package.path) then
    local mod = require(M.COMMANDS[cmd].module)
    if rest[1] == "--help" or rest[1] == "-h" or rest[1] == "help" then
      print(mod.USAGE)
      return 0
    end
    return mod.main(rest) or 0
  end
  if cmd:match("%.lua$") then
    usage_error(string.format("unknown command '%s' (to run a recipe: tide run %s)", cmd, cmd))
  end
  local names = { "run", "repl", "test", "info", "help" }
  for _, c in ipairs(M.command_names()) do names[#names + 1] = c end
  usage_error(string.format("unknown command '%s' (commands: %s)", cmd, table.concat(names, ", ")))
end

M.shell_quote = shell_quote   -- shared with scripts that spawn commands (bench/)
M.file_exists = file_exists
return M
