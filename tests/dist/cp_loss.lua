-- cp_loss.lua — tests/dist/dp_moe.lua with a recipe's own loss (tests/dist/cp_check.sh): the sum of the token
-- cross-entropies over the step's global target count (the loss's ctx), so under context parallelism, where each
-- rank's loss sees its zig-zag slices, the step is the one-rank step of the default objective
local tide = require "tide"
local recipe = dofile("tests/dist/dp_moe.lua")
recipe.name = "cp_loss"
recipe.loss = function(m, x, y, _, ctx)
  return tide.F.cross_entropy(m:forward(x), y, { reduction = "sum" }) * (ctx.micro / ctx.targets)
end
return recipe
