-- tide.rl.traj: trajectory records (rl.md §1) and their JSONL form (formats.md §5).
--
--   local t = traj.new{prompt_id = 3, group_id = 0, env = "countdown", seed = 17}
--   t:push(id, traj.ROLE.assistant, 1, logp, version, turn)    -- one token
--   traj.write(path, list); traj.read(path) -> list
--
-- One entry per token, in parallel arrays: tokens (ids), roles (ROLE codes), loss_mask (1 only for tokens the policy
-- sampled), logp_old (the sampler's log-prob, fp32-rounded; 0 where the mask is 0), logp_ref (optional),
-- policy_version and turn (0-based). segments lists (first_token, policy_version) where the sampling weights change
-- (partial rollouts). errors records what went wrong along the way (a raising tool, a malformed call, ...).
local ffi = require "ffi"
local json = require "tide.json"

local traj = {}
local fmt = string.format

traj.ROLE = { system = 0, user = 1, assistant = 2, tool_result = 3, tool_declare = 4, env_observation = 5 }
traj.ROLE_NAME = {}
for k, v in pairs(traj.ROLE) do traj.ROLE_NAME[v] = k end

local Traj = {}
Traj.__index = Traj
traj.Traj = Traj

local f32 = ffi.new("float[1]")
local function round32(x) f32[0] = x; return f32[0] end

function traj.new(meta)
  meta = meta or {}
  return setmetatable({ prompt_id = meta.prompt_id or 0, group_id = meta.group_id or 0, env = meta.env or "",
    seed = meta.seed or 0, tokens = {}, roles = {}, loss_mask = {}, logp_old = {}, policy_version = {}, turn = {},
    reward_terminal = 0, rewards_turn = {}, truncated = false, finished = false, segments = {}, errors = {} }, Traj)
end

function Traj:push(id, role, mask, logp, version, turn)
  local n = #self.tokens + 1
  version = version or 0
  self.tokens[n], self.roles[n], self.loss_mask[n] = id, role, mask
  self.logp_old[n] = mask == 1 and round32(logp or 0) or 0
  self.policy_version[n], self.turn[n] = version, turn or 0
  local seg = self.segments[#self.segments]
  if mask == 1 and (not seg or seg[2] ~= version) then self.segments[#self.segments + 1] = { n - 1, version } end
end

-- push a list of ids that the policy did not sample (mask 0)
function Traj:extend(ids, role, version, turn)
  for _, id in ipairs(ids) do self:push(id, role, 0, 0, version, turn) end
end

function Traj:len() return #self.tokens end

-- the number of policy tokens
function Traj:n_policy()
  local n = 0
  for _, m in ipairs(self.loss_mask) do n = n + m end
  return n
end

-- the total return r_T + Σ_u r_u
function Traj:total_reward()
  local R = self.reward_terminal
  for _, r in ipairs(self.rewards_turn) do R = R + r end
  return R
end

function Traj:record()
  local r = { prompt_id = self.prompt_id, group_id = self.group_id, env = self.env, seed = self.seed,
    tokens = json.array(self.tokens), roles = json.array(self.roles), loss_mask = json.array(self.loss_mask),
    logp_old = json.array(self.logp_old), policy_version = json.array(self.policy_version),
    turn = json.array(self.turn), reward_terminal = self.reward_terminal,
    rewards_turn = json.array(self.rewards_turn), truncated = self.truncated, finished = self.finished,
    segments = json.array(self.segments), errors = json.array(self.errors) }
  if self.logp_ref then r.logp_ref = json.array(self.logp_ref) end
  r.uid = self.uid           -- the sample's place in its rollout call (its sampler stream), when known
  return r
end

local FIRST = { "prompt_id", "group_id", "env", "seed", "tokens", "roles", "loss_mask", "logp_old", "policy_version",
                "turn", "reward_terminal", "rewards_turn", "truncated", "finished" }

function Traj:jsonl() return json.record(self:record(), FIRST) end

-- write(path, list): the trajectories as JSONL, one per line, atomically (a temporary file renamed into place)
function traj.write(path, list)
  local lines = {}
  for i, t in ipairs(list) do lines[i] = t:jsonl() end
  local tide = require "tide"
  local body = table.concat(lines, "\n") .. (#lines > 0 and "\n" or "")
  if tide.C.tide_file_write_atomic(path, body, #body) ~= 0 then
    error(fmt("rl.traj: cannot write %s: %s", path, ffi.string(tide.C.tide_last_error())), 2)
  end
end

local ARRAYS = { "tokens", "roles", "loss_mask", "logp_old", "policy_version", "turn" }

-- from_record(obj, where) -> a Traj; errors name `where` (file:line) and the field
function traj.from_record(o, where)
  local function bad(msg) error(fmt("%s: %s", where, msg), 0) end
  if type(o) ~= "table" then bad("expected a JSON object") end
  local t = traj.new { prompt_id = o.prompt_id, group_id = o.group_id, env = o.env, seed = o.seed }
  if type(o.env) ~= "string" then bad("\"env\" must be a string") end
  for _, k in ipairs { "prompt_id", "group_id", "seed" } do
    if o[k] ~= nil and type(o[k]) ~= "number" then bad(fmt("\"%s\" must be a number", k)) end
  end
  local n
  for _, k in ipairs(ARRAYS) do
    local a = o[k]
    if k == "turn" and a == nil then a = {} for i = 1, n do a[i] = 0 end end
    if type(a) ~= "table" then bad(fmt("\"%s\" must be an array", k)) end
    if n == nil then n = #a elseif #a ~= n then bad(fmt("\"%s\" has %d entries, \"tokens\" %d", k, #a, n)) end
    for i, v in ipairs(a) do
      if type(v) ~= "number" or v ~= v then bad(fmt("%s[%d] must be a number", k, i - 1)) end
    end
    t[k] = a
  end
  -- the log-probs are fp32 values written with fp32's shortest digits: read them back as those fp32 values
  for i = 1, n do t.logp_old[i] = round32(t.logp_old[i]) end
  for i = 1, n do
    if t.roles[i] % 1 ~= 0 or t.roles[i] < 0 or t.roles[i] > 5 then bad(fmt("roles[%d] must be 0-5, got %s", i - 1, t.roles[i])) end
    if t.loss_mask[i] ~= 0 and t.loss_mask[i] ~= 1 then bad(fmt("loss_mask[%d] must be 0 or 1, got %s", i - 1, t.loss_mask[i])) end
    if t.tokens[i] % 1 ~= 0 or t.tokens[i] < 0 then bad(fmt("tokens[%d] must be a token id, got %s", i - 1, t.tokens[i])) end
  end
  if o.logp_ref ~= nil then
    if type(o.logp_ref) ~= "table" or #o.logp_ref ~= n then bad("\"logp_ref\" must be an array as long as \"tokens\"") end
    t.logp_ref = {}
    for i, v in ipairs(o.logp_ref) do t.logp_ref[i] = round32(v) end
  end
  if type(o.reward_terminal) ~= "number" then bad("\"reward_terminal\" must be a number") end
  t.reward_terminal = o.reward_terminal
  t.rewards_turn = o.rewards_turn or {}
  if type(t.rewards_turn) ~= "table" then bad("\"rewards_turn\" must be an array") end
  t.truncated, t.finished = o.truncated == true, o.finished == true
  t.segments, t.errors = o.segments or {}, o.errors or {}
  if type(o.uid) == "number" then t.uid = o.uid end
  return t
end

-- read(path) -> list of Traj; errors name file:line
function traj.read(path)
  local out = {}
  local ok, err = pcall(json.each_line, path, function(o, where) out[#out + 1] = traj.from_record(o, where) end)
  if not ok then error("rl.traj: " .. tostring(err), 2) end
  return out
end

return traj
