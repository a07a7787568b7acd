-- tide.options: checking the option tables and arguments users hand to tide, with one error style.
--
--   local options = require "tide.options"
--   options.check(opts, KEYS, "options", "nn.KDA")        -- unknown keys are errors naming the known ones
--   local H = options.pos_int(opts.heads, "heads", "nn.KDA")
--
-- Every error is one line "<who>: <what went wrong>", raised at the user's line: by default the first
-- stack frame outside lua/tide (the recipe, test or REPL line that called into tide), so a mistake in a
-- config built three calls deep still points at the line that wrote it. A number `level` instead counts
-- as error() does, from the function that called the options function (1: that function, 2: its caller).
local options = {}

local fmt, floor = string.format, math.floor

-- the directory of this file: frames whose source lies under it are inside tide
local TIDE_DIR = debug.getinfo(1, "S").source:match("^@(.*[/\\])[^/\\]*$")

local function inside_tide(source)
  return TIDE_DIR ~= nil and source:sub(1, 1) == "@" and source:sub(2, #TIDE_DIR + 1) == TIDE_DIR
end

-- the error() level (counted from the caller of this function's caller) of the first frame outside tide;
-- 0 (no position) when every frame is inside tide or C
local function user_level(skip)
  local level = skip + 1
  while true do
    local info = debug.getinfo(level, "S")
    if not info then return 0 end
    if info.what ~= "C" and info.what ~= "tail" and not inside_tide(info.source) then return level - skip end
    level = level + 1
  end
end

-- fail(who, msg, level): raises "<who>: <msg>" at the user's line (or `level` above the function that called fail)
function options.fail(who, msg, level)
  local text = (who and who ~= "") and (tostring(who) .. ": " .. tostring(msg)) or tostring(msg)
  if level == nil then
    local l = user_level(2)
    error(text, l == 0 and 0 or l + 1)
  end
  error(text, level == 0 and 0 or level + 1)
end

-- the level to hand on to fail from a helper called by the function named by `level` (nil stays nil)
local function up(level) return level and (level == 0 and 0 or level + 1) end

-- sorted_keys(t) -> the keys of t as strings, sorted
function options.sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  return keys
end

-- check(t, known, where, who, level) -> t; every key of t must be a key of `known` (a set of key -> true, or a
-- table of defaults: a key whose default is false is known too). `where` names the
-- table in the message ("unknown key 'x' in sources[2]; ..."); nil leaves it out (the table is who's own options)
function options.check(t, known, where, who, level)
  if type(t) ~= "table" then
    options.fail(who, fmt("%s must be a table, got a %s", where or "options", type(t)), up(level))
  end
  for k in pairs(t) do
    if known[k] == nil then
      options.fail(who, fmt("unknown key '%s'%s; known keys: %s", tostring(k), where and (" in " .. where) or "",
                            table.concat(options.sorted_keys(known), ", ")), up(level))
    end
  end
  return t
end

-- with_defaults(t, defaults, known, where, who, level) -> a new table: defaults, then t's keys (checked) over them
function options.with_defaults(t, defaults, known, where, who, level)
  options.check(t, known, where, who, up(level))
  local out = {}
  for k, v in pairs(defaults) do out[k] = v end
  for k, v in pairs(t) do out[k] = v end
  return out
end

local function is_int(v) return type(v) == "number" and v == floor(v) and v > -math.huge and v < math.huge end
options.is_int = is_int

-- pos_int(v, what, who, level) -> v, an integer >= 1
function options.pos_int(v, what, who, level)
  if not is_int(v) or v < 1 then options.fail(who, fmt("%s must be a positive integer, got %s", what, tostring(v)), up(level)) end
  return v
end

-- nonneg_int(v, what, who, level) -> v, an integer >= 0
function options.nonneg_int(v, what, who, level)
  if not is_int(v) or v < 0 then
    options.fail(who, fmt("%s must be a non-negative integer, got %s", what, tostring(v)), up(level))
  end
  return v
end

-- int_at_least(v, lo, what, who, level) -> v, an integer >= lo
function options.int_at_least(v, lo, what, who, level)
  if not is_int(v) or v < lo then options.fail(who, fmt("%s must be an integer >= %d, got %s", what, lo, tostring(v)), up(level)) end
  return v
end

-- seed(v, what, who, level) -> v, an integer in [0, 2^32) (the key half of a Philox stream)
function options.seed(v, what, who, level)
  if not is_int(v) or v < 0 or v >= 2 ^ 32 then
    options.fail(who, fmt("%s must be an integer in [0, 2^32), got %s", what, tostring(v)), up(level))
  end
  return v
end

-- number_in(v, lo, hi, what, who, level) -> v, a number with lo <= v <= hi (NaN never is)
function options.number_in(v, lo, hi, what, who, level)
  if type(v) ~= "number" or not (v >= lo and v <= hi) then
    options.fail(who, fmt("%s must be a number in [%s, %s], got %s", what, tostring(lo), tostring(hi), tostring(v)), up(level))
  end
  return v
end

-- finite_number(v, what, who, level, lo) -> v, a finite number (>= lo when given; NaN and ±inf never are)
function options.finite_number(v, what, who, level, lo)
  if type(v) ~= "number" or not (v > -math.huge and v < math.huge) or (lo and not (v >= lo)) then
    options.fail(who, fmt("%s must be a finite number%s, got %s", what, lo and fmt(" >= %s", tostring(lo)) or "",
      tostring(v)), up(level))
  end
  return v
end

-- positive_number(v, what, who, level) -> v, a finite number > 0
function options.positive_number(v, what, who, level)
  if type(v) ~= "number" or not (v > 0 and v < math.huge) then
    options.fail(who, fmt("%s must be a finite number > 0, got %s", what, tostring(v)), up(level))
  end
  return v
end

-- fields(t, spec, where, who, level) -> t; spec: key -> checker (one of the functions above taking (v, what, who,
-- level)); each present key is checked under the name "<where>.<key>". One place for the numeric fields of a driver.
function options.fields(t, spec, where, who, level)
  if type(t) ~= "table" then return t end
  for _, k in ipairs(options.sorted_keys(spec)) do
    if t[k] ~= nil then spec[k](t[k], where and (where .. "." .. k) or k, who, up(level)) end
  end
  return t
end

-- one_of(v, set, what, who, level) -> v, a key of the set `set` (strings are quoted in the message)
function options.one_of(v, set, what, who, level)
  if v == nil or not set[v] then
    local names = {}
    for _, k in ipairs(options.sorted_keys(set)) do names[#names + 1] = fmt("%q", k) end
    local got = type(v) == "string" and fmt("%q", v) or tostring(v)
    options.fail(who, fmt("%s must be one of %s, got %s", what, table.concat(names, ", "), got), up(level))
  end
  return v
end

-- deep_copy(v) -> a copy of v with every nested table copied (a config a caller may edit without touching the original)
function options.deep_copy(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = options.deep_copy(x) end
  return out
end

-- the config keys the command line sets for every driver (tide run --resume, --dry-run, --out, --seed, --threads,
-- --overwrite, --check, --profile): with_run_flags(keys) adds them to a driver's top-level keys and returns it
options.RUN_FLAGS = { resume = true, dry_run = true, out = true, seed = true, threads = true, overwrite = true,
  check = true, profile = true }
function options.with_run_flags(keys)
  for k in pairs(options.RUN_FLAGS) do keys[k] = true end
  return keys
end

return options
