-- tide.rl.countdown: the countdown environment of rl.md §6 (tools "none" or "calc").
--
--   local env = countdown.new{tools = "calc"}
--   local obs = env:reset(17)            -- {prompt = "Using the numbers [...] make T. ...", tools = {calc = ...}}
--   env:step{call = {name = "calc", args = "3*5"}}   -- {result = "15", reward = 0, done = false}
--   env:step{text = "... <answer>3*5+7</answer>"}    -- {terminal = 1.0, done = true}
--
-- countdown.task(seed) is the task alone ({nums, target, solution}); countdown.score(task, text) the verifier;
-- countdown.eval(expr) the exact value the calc tool prints. Arithmetic is in exact rationals of integers below 2^53;
-- a value beyond that is an error ("too large"), never a rounded number.
local options = require "tide.options"
local stream = require "tide.rl.stream"

local countdown = {}
local fmt, floor, abs = string.format, math.floor, math.abs

local BIG = 2 ^ 53
local MAX_CALLS = 8

---------------------------------------------------------------------------------------------------
-- exact rationals {p, q}, q > 0, gcd(p, q) = 1

local function gcd(a, b)
  a, b = abs(a), abs(b)
  while b ~= 0 do a, b = b, a % b end
  return a
end

local function rat(p, q)
  if q < 0 then p, q = -p, -q end
  local g = gcd(p, q)
  if g > 1 then p, q = p / g, q / g end
  return { p, q }
end

-- a * b without leaving the exact integers, or nil
local function mul_int(a, b)
  if a ~= 0 and abs(b) >= BIG / abs(a) then return nil end
  return a * b
end

local function add_int(a, b)
  local s = a + b
  if abs(s) >= BIG then return nil end
  return s
end

local ARITH = {}
function ARITH.add(x, y)
  local a, b, d = mul_int(x[1], y[2]), mul_int(y[1], x[2]), mul_int(x[2], y[2])
  local n = a and b and add_int(a, b)
  if not (n and d) then return nil, "too large" end
  return rat(n, d)
end
function ARITH.sub(x, y) return ARITH.add(x, { -y[1], y[2] }) end
function ARITH.mul(x, y)
  local n, d = mul_int(x[1], y[1]), mul_int(x[2], y[2])
  if not (n and d) then return nil, "too large" end
  return rat(n, d)
end
function ARITH.div(x, y)
  if y[1] == 0 then return nil, "division by zero" end
  return ARITH.mul(x, { y[2], y[1] })
end

---------------------------------------------------------------------------------------------------
-- the grammar of rl.md §6: expr := term (('+'|'-') term)*, term := factor (('*'|'/') factor)*,
-- factor := INT | '(' expr ')'; spaces allowed. parse(s) -> tree, literals | nil, reason

local OPS = { ["+"] = "add", ["-"] = "sub", ["*"] = "mul", ["/"] = "div" }

local function parse(s)
  local pos, n, literals = 1, #s, {}
  local function skip() pos = s:find("[^ ]", pos) or (n + 1) end
  local expr
  local function factor()
    skip()
    local c = s:sub(pos, pos)
    if c == "(" then
      pos = pos + 1
      local e, why = expr()
      if not e then return nil, why end
      skip()
      if s:sub(pos, pos) ~= ")" then return nil, fmt("expected ')' at character %d", pos) end
      pos = pos + 1
      return e
    end
    local digits = s:match("^%d+", pos)
    if not digits then return nil, fmt("expected a number or '(' at character %d", pos) end
    pos = pos + #digits
    local v = tonumber(digits)
    if v >= BIG then return nil, "a number is too large" end
    literals[#literals + 1] = v
    return { v = rat(v, 1) }
  end
  local function chain(sub, ops)
    return function()
      local left, why = sub()
      if not left then return nil, why end
      while true do
        skip()
        local c = s:sub(pos, pos)
        if not ops[c] then return left end
        pos = pos + 1
        local right
        right, why = sub()
        if not right then return nil, why end
        left = { op = OPS[c], left, right }
      end
    end
  end
  local term = chain(factor, { ["*"] = true, ["/"] = true })
  expr = chain(term, { ["+"] = true, ["-"] = true })
  local tree, why = expr()
  if not tree then return nil, why end
  skip()
  if pos <= n then return nil, fmt("unexpected '%s' at character %d", s:sub(pos, pos), pos) end
  return tree, literals
end

local function evaluate(t)
  if t.v then return t.v end
  local a, why = evaluate(t[1])
  if not a then return nil, why end
  local b
  b, why = evaluate(t[2])
  if not b then return nil, why end
  return ARITH[t.op](a, b)
end

local function rat_text(v) return v[2] == 1 and fmt("%d", v[1]) or fmt("%d/%d", v[1], v[2]) end

-- eval(expr) -> the exact value as text ("22", "7/3") | nil, reason
function countdown.eval(s)
  if type(s) ~= "string" then return nil, "expected an expression" end
  local tree, why = parse(s)
  if not tree then return nil, why end
  local v
  v, why = evaluate(tree)
  if not v then return nil, why end
  return rat_text(v), v
end

-- the text of the last closed <answer>...</answer> (case-sensitive; an unclosed tag is no tag), or nil
function countdown.last_answer(text)
  local pos, last = 1, nil
  while true do
    local a = text:find("<answer>", pos, true)
    if not a then return last end
    local b = text:find("</answer>", a + 8, true)
    if not b then return last end
    last, pos = text:sub(a + 8, b - 1), b + 9
  end
end

local function same_multiset(a, b)
  if #a ~= #b then return false end
  local count = {}
  for _, x in ipairs(a) do count[x] = (count[x] or 0) + 1 end
  for _, x in ipairs(b) do
    if not count[x] or count[x] == 0 then return false end
    count[x] = count[x] - 1
  end
  return true
end

-- score(task, text) -> reward (1.0 | 0.1 | 0), why: 1.0 when the literals are exactly the multiset nums and the value is
-- the target; 0.1 when an answer tag is present but anything else fails; 0 without a tag
function countdown.score(task, text)
  local ans = countdown.last_answer(text)
  if not ans then return 0, "no answer tag" end
  local tree, literals = parse(ans)
  if not tree then return 0.1, "parse: " .. literals end
  if not same_multiset(literals, task.nums) then return 0.1, "the numbers are not each used exactly once" end
  local v, why = evaluate(tree)
  if not v then return 0.1, why end
  if v[2] ~= 1 or v[1] ~= task.target then return 0.1, "the value is " .. rat_text(v) end
  return 1.0, "correct"
end

---------------------------------------------------------------------------------------------------
-- generation: n in {3, 4}; nums uniform in [1, 20]; shuffled; folded left to right with random ops keeping every
-- intermediate a positive integer (÷ only when exact); retried until the target is in [1, 100]

local PREC = { ["+"] = 1, ["-"] = 1, ["*"] = 2, ["/"] = 2 }

function countdown.task(seed)
  local s = stream.new("countdown", seed)
  local n = s:int(3, 4)
  for _ = 1, 100 do
    local nums = {}
    for i = 1, n do nums[i] = s:int(1, 20) end
    s:shuffle(nums)
    local acc, expr, top = nums[1], tostring(nums[1]), 3
    for i = 2, n do
      local x = nums[i]
      local ops = { "+" }
      if acc > x then ops[#ops + 1] = "-" end
      ops[#ops + 1] = "*"
      if acc % x == 0 then ops[#ops + 1] = "/" end
      local op = ops[s:int(1, #ops)]
      if PREC[op] > top then expr = "(" .. expr .. ")" end
      expr, top = expr .. op .. x, PREC[op]
      if op == "+" then acc = acc + x elseif op == "-" then acc = acc - x
      elseif op == "*" then acc = acc * x else acc = acc / x end
    end
    if acc >= 1 and acc <= 100 then return { nums = nums, target = acc, solution = expr, seed = seed } end
  end
  error(fmt("rl.countdown: no task with a target in [1, 100] after 100 tries (seed %d)", seed), 2)
end

function countdown.prompt(task)
  local parts = {}
  for i, v in ipairs(task.nums) do parts[i] = tostring(v) end
  return fmt("Using the numbers [%s] make %d. Use each number exactly once with + - * / and parentheses. "
    .. "Answer as <answer>EXPR</answer>.", table.concat(parts, ", "), task.target)
end

---------------------------------------------------------------------------------------------------
-- the environment protocol (tide.rl): reset(seed) -> observation; step(action) -> result

local Env = {}
Env.__index = Env
local KEYS = { tools = true, max_calls = true }

function countdown.new(cfg)
  cfg = cfg or {}
  options.check(cfg, KEYS, "countdown options", "rl.countdown")
  local tools = cfg.tools or "none"
  options.one_of(tools, { none = true, calc = true }, "tools", "rl.countdown")
  local max_calls = cfg.max_calls == nil and MAX_CALLS or options.nonneg_int(cfg.max_calls, "max_calls", "rl.countdown")
  return setmetatable({ name = "countdown", tools = tools, max_calls = max_calls }, Env)
end

function Env:reset(seed)
  self.task, self.calls = countdown.task(seed), 0
  local obs = { prompt = countdown.prompt(self.task) }
  if self.tools == "calc" then
    obs.tools = { calc = "calc: EXPR returns the exact value of EXPR (an integer, a reduced fraction p/q, or error)" }
    obs.prompt = obs.prompt .. " You may call calc."
  end
  return obs
end

-- the actions of a correct episode after reset (SFT warm-up data): the solution through calc when there is a calc
-- tool, then the answer
function Env:demo()
  local sol = self.task.solution
  local a = {}
  if self.tools == "calc" then a[1] = { call = { name = "calc", args = sol } } end
  a[#a + 1] = { text = "<answer>" .. sol .. "</answer>" }
  return a
end

-- {call = {name, args}} -> {result, reward = 0, done = false, invalid}; {text} -> {terminal, done = true}
function Env:step(action)
  if action.call then
    local c = action.call
    if self.tools ~= "calc" or c.name ~= "calc" then
      return { result = fmt("error: unknown tool '%s'", tostring(c.name)), reward = 0, done = false, invalid = true }
    end
    self.calls = self.calls + 1
    if self.calls > self.max_calls then
      return { result = fmt("error: at most %d calc calls", self.max_calls), reward = 0, done = false, invalid = true }
    end
    local v = countdown.eval(c.args)
    return { result = v or "error", reward = 0, done = false }
  end
  local r, why = countdown.score(self.task, action.text or "")
  return { terminal = r, done = true, correct = r == 1.0, formatted = r > 0, why = why }
end

return countdown
