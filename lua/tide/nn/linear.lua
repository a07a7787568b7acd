-- nn/linear.lua — y = x Wᵀ + b with W stored [out, in] (HuggingFace layout).
local tide = require "tide"
local M = require "tide.nn.module"
local defaults = require "tide.defaults"
local F = tide.F

local Linear = M.Module:extend("Linear")

-- Linear(in_features, out_features, {bias = false, std = 0.02, dtype = "f32", device = "cpu"})
function Linear:init(in_features, out_features, opts)
  opts = opts or {}
  for _, v in ipairs({ in_features, out_features }) do
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error("nn.Linear: sizes must be positive integers, got " .. tostring(in_features) .. ", " .. tostring(out_features), 3)
    end
  end
  self.in_features, self.out_features = in_features, out_features
  self:param("weight", M.Module.new_param({ out_features, in_features }, { "normal", opts.std or defaults.init_std }, opts))
  if opts.bias then
    self:param("bias", M.Module.new_param({ out_features }, { "zeros" }, opts), { decay = false })
  end
end

function Linear:forward(x)
  return F.linear(x, self.weight, self.bias)
end

function Linear:extra_repr()
  return string.format("%d -> %d%s", self.in_features, self.out_features, self.bias and ", bias" or "")
end

return Linear
