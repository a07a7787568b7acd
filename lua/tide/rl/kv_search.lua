-- tide.rl.kv_search: multi-turn key lookup through a search tool (rl.md §6), an agentic MQAR.
--
--   local env = kv_search.new{pairs = 16, queries = 2, distractors = 0}
--   env:reset(3)                                   -- {prompt = "Find the values for keys: abcd wxyz. ...", tools}
--   env:step{call = {name = "search", args = "abcd"}}   -- {result = "4821", reward = 0}
--   env:step{text = "<answer>4821 1093</answer>"}     -- {terminal = 1.0, done = true}
--
-- A hidden table of N pairs (distinct 4-letter lowercase keys, distinct 4-digit values 1000-9999), Q keys queried
-- without replacement; `distractors` of them are absent from the table and their answer is "none". search: KEY
-- returns the value or "none"; at most 2Q + 2 calls; each call beyond Q costs 0.02 (a process reward).
-- r_T = (# positions answered exactly) / Q; no answer tag -> 0.
local options = require "tide.options"
local stream = require "tide.rl.stream"
local countdown = require "tide.rl.countdown"

local kv = {}
local fmt = string.format

local KEYS = { pairs = true, queries = true, distractors = true, call_cost = true }

local function key_of(s)
  local c = {}
  for i = 1, 4 do c[i] = string.char(96 + s:int(1, 26)) end
  return table.concat(c)
end

-- task(seed, cfg) -> {table = {key = value}, keys = {k1, ...}, answers = {"v1" | "none", ...}}
function kv.task(seed, cfg)
  cfg = cfg or {}
  local N, Q, D = cfg.pairs or 16, cfg.queries or 2, cfg.distractors or 0
  local s = stream.new("kv_search", seed)
  local tab, keys, used_v = {}, {}, {}
  while #keys < N do
    local k = key_of(s)
    if not tab[k] then
      local v
      repeat v = s:int(1000, 9999) until not used_v[v]
      used_v[v], tab[k] = true, v
      keys[#keys + 1] = k
    end
  end
  s:shuffle(keys)
  local q, answers = {}, {}
  for i = 1, Q - D do q[i], answers[i] = keys[i], tostring(tab[keys[i]]) end
  while #q < Q do
    local k = key_of(s)
    local fresh = not tab[k]
    for _, x in ipairs(q) do if x == k then fresh = false end end
    if fresh then q[#q + 1], answers[#answers + 1] = k, "none" end
  end
  -- distractors take random places among the queried keys
  local order = {}
  for i = 1, Q do order[i] = i end
  s:shuffle(order)
  local qk, qa = {}, {}
  for i, j in ipairs(order) do qk[i], qa[i] = q[j], answers[j] end
  return { table = tab, keys = qk, answers = qa, seed = seed }
end

local Env = {}
Env.__index = Env

function kv.new(cfg)
  cfg = cfg or {}
  local who = "rl.kv_search"
  options.check(cfg, KEYS, "kv_search options", who)
  local N = cfg.pairs == nil and 16 or options.pos_int(cfg.pairs, "pairs", who)
  local Q = cfg.queries == nil and 2 or options.pos_int(cfg.queries, "queries", who)
  local D = cfg.distractors == nil and 0 or options.nonneg_int(cfg.distractors, "distractors", who)
  if Q - D > N then options.fail(who, fmt("queries - distractors (%d) is more than the table's %d pairs", Q - D, N)) end
  if N > 9000 then options.fail(who, fmt("pairs must be at most 9000 (distinct 4-digit values), got %d", N)) end
  local cost = cfg.call_cost == nil and 0.02 or options.finite_number(cfg.call_cost, "call_cost", who)
  return setmetatable({ name = "kv_search", cfg = { pairs = N, queries = Q, distractors = D }, cost = cost,
    max_calls = 2 * Q + 2 }, Env)
end

function Env:reset(seed)
  self.task, self.calls = kv.task(seed, self.cfg), 0
  return { prompt = fmt("Find the values for keys: %s. Use search. Answer as <answer>%s</answer>.",
      table.concat(self.task.keys, " "), self.cfg.queries == 2 and "V1 V2" or "V1 ... V" .. self.cfg.queries),
    tools = { search = "search: KEY returns the value stored under KEY, or none" } }
end

-- the oracle policy's actions after reset: one search per key, then the answers
function Env:demo()
  local a = {}
  for i, k in ipairs(self.task.keys) do a[i] = { call = { name = "search", args = k } } end
  a[#a + 1] = { text = "<answer>" .. table.concat(self.task.answers, " ") .. "</answer>" }
  return a
end

function Env:step(action)
  if action.call then
    local c = action.call
    -- every call counts toward the process cost, a malformed one or one to an unknown tool included (else such
    -- calls are free, and a policy learns to make them instead of searching)
    self.calls = self.calls + 1
    local cost = self.calls > self.cfg.queries and -self.cost or 0
    if c.malformed then
      return { result = "error: " .. tostring(c.malformed), reward = cost, done = false, invalid = true }
    end
    if c.name ~= "search" then
      return { result = fmt("error: unknown tool '%s'", tostring(c.name)), reward = cost, done = false, invalid = true }
    end
    if self.calls > self.max_calls then
      return { result = fmt("error: at most %d search calls", self.max_calls), reward = cost, done = false, invalid = true }
    end
    local key = tostring(c.args or ""):match("^%s*(.-)%s*$")
    local v = self.task.table[key]
    return { result = v and tostring(v) or "none", reward = cost, done = false }
  end
  local ans = countdown.last_answer(action.text or "")
  if not ans then return { terminal = 0, done = true, formatted = false, why = "no answer tag" } end
  local got = {}
  for w in ans:gmatch("%S+") do got[#got + 1] = w end
  local hit = 0
  for i, want in ipairs(self.task.answers) do if got[i] == want then hit = hit + 1 end end
  local Q = self.cfg.queries
  return { terminal = hit / Q, done = true, formatted = true, correct = hit == Q, why = fmt("%d of %d", hit, Q) }
end

return kv
