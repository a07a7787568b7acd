-- tide.rl: agentic RL post-training (rl.md): environments, trajectories, markup, rewards and objectives.
--
--   local rl = require "tide.rl"
--   local env = rl.env("countdown", {tools = "calc"})      -- or rl.env(my_env_table)
--   return rl.Recipe{model = ..., sft = ..., rl = {env = "countdown", objective = "grpo", ...}}   (tide.rl.loop)
--
-- An environment is a Lua table with reset(self, seed) -> {prompt, system?, tools?, observation?} and
-- step(self, action) -> {result? | observation?, reward? (process), terminal? (r_T, when done), done, correct?,
-- formatted?}, where action is {call = {name, args}} (a tool call the policy wrote) or {text = "..."} (a turn that
-- ended without a call). correct and formatted are the verdicts of a done step (accuracy and format rate; correct
-- also decides which groups DAPO's resampling counts); without them the sample has no verdict.
-- Environments are deterministic given (env, seed): rl.stream gives each its own Philox stream.
local options = require "tide.options"

local rl = {}

rl.traj = require "tide.rl.traj"
rl.markup = require "tide.rl.markup"
rl.rewards = require "tide.rl.rewards"
rl.objectives = require "tide.rl.objectives"
rl.stream = require "tide.rl.stream"
rl.rollout = require "tide.rl.rollout"
rl.update = require "tide.rl.update"
rl.loop = require "tide.rl.loop"
rl.Recipe = rl.loop.new

rl.envs = {
  countdown = require "tide.rl.countdown",
  kv_search = require "tide.rl.kv_search",
  grid = require "tide.rl.grid",
}

-- env(name, cfg) -> a shipped environment; env(table) -> the user's own, checked for reset and step
function rl.env(spec, cfg)
  if type(spec) == "string" then
    local m = rl.envs[spec]
    if not m then options.one_of(spec, rl.envs, "environment", "rl.env") end
    return m.new(cfg)
  end
  if type(spec) ~= "table" then options.fail("rl.env", "an environment is a name or a table, got a " .. type(spec)) end
  for _, k in ipairs { "reset", "step" } do
    if type(spec[k]) ~= "function" then options.fail("rl.env", "an environment table needs a function '" .. k .. "'") end
  end
  spec.name = spec.name or "custom"
  return spec
end

return rl
