-- nn/norm.lua — RMSNorm and LayerNorm over the last dim (gains start at 1, no weight decay).
local tide = require "tide"
local M = require "tide.nn.module"
local defaults = require "tide.defaults"
local F = tide.F

local RMSNorm = M.Module:extend("RMSNorm")

-- RMSNorm(dim, {eps = 1e-5}): x / sqrt(mean(x²) + eps) ⊙ weight
function RMSNorm:init(dim, opts)
  opts = opts or {}
  self.dim, self.eps = dim, opts.eps or defaults.norm_eps
  self:param("weight", M.Module.new_param({ dim }, { "ones" }, opts), { decay = false })
end

function RMSNorm:forward(x)
  return F.rmsnorm(x, self.weight, self.eps)
end

function RMSNorm:extra_repr() return string.format("%d, eps=%g", self.dim, self.eps) end

local LayerNorm = M.Module:extend("LayerNorm")

-- LayerNorm(dim, {eps = 1e-5, bias = true})
function LayerNorm:init(dim, opts)
  opts = opts or {}
  self.dim, self.eps = dim, opts.eps or defaults.norm_eps
  self:param("weight", M.Module.new_param({ dim }, { "ones" }, opts), { decay = false })
  if opts.bias ~= false then
    self:param("bias", M.Module.new_param({ dim }, { "zeros" }, opts), { decay = false })
  end
end

function LayerNorm:forward(x)
  return F.layernorm(x, self.weight, self.bias, self.eps)
end

function LayerNorm:extra_repr() return string.format("%d, eps=%g%s", self.dim, self.eps, self.bias and "" or ", no bias") end

return { RMSNorm = RMSNorm, LayerNorm = LayerNorm }
