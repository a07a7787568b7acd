-- rl_recipe.lua — recipes/agent_rl.lua for tests/dist/rl_check.sh: float64 weights (so the runs compared sample
-- the same tokens at every iteration), and a reward that varies within every group from the first iteration (the
-- share of the answer's bytes divisible by 3, plus the verifier's reward), so the policy gradient is not zero; a
-- PTX term of 3 demonstration rows in every update
local recipe = dofile("recipes/agent_rl.lua")
recipe.name = "rl_check"
recipe.model.dtype = "f64"
recipe.rl.reward = function(_, info)
  local n = 0
  for i = 1, #info.text do if info.text:byte(i) % 3 == 0 then n = n + 1 end end
  return info.env_reward + n / math.max(#info.text, 1)
end
recipe.rl.ptx = { weight = 0.1, rows = 3 }
return recipe
