-- dp_nan.lua — recipes/dense.lua with a loss that is NaN on one micro-batch of step 3: the second of the step on one
-- rank, rank 1's under data parallelism (the same micro-batch). The step is skipped on every rank (one decision),
-- and the run goes on: the case of tests/dist/dp_check.sh.
local tide = require "tide"
local dist = require "tide.dist"
local cfg = dofile("recipes/dense.lua")
local calls = {}
cfg.name = "dp_nan"
cfg.loss = function(model, ids, targets, t)
  local l = tide.F.cross_entropy(model:forward(ids), targets)
  calls[t] = (calls[t] or 0) + 1
  local hit = t == 2 and ((dist.world() == 1 and calls[t] == 2) or (dist.world() > 1 and dist.rank() == 1))
  if hit then l = l * (0 / 0) end
  return l
end
return cfg
