-- nn/mlp.lua — the SwiGLU feed-forward: down(silu(gate(x)) ⊙ up(x)).
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local F = tide.F

local MLP = M.Module:extend("MLP")

-- MLP(dim, hidden, {std = 0.02, out_std = std, dtype, device}); out_std initialises down_proj
function MLP:init(dim, hidden, opts)
  opts = opts or {}
  local std = opts.std or 0.02
  local function lin(i, o, s)
    return Linear(i, o, { std = s, dtype = opts.dtype, device = opts.device })
  end
  self.dim, self.hidden = dim, hidden
  self:child("gate_proj", lin(dim, hidden, std))
  self:child("up_proj", lin(dim, hidden, std))
  self:child("down_proj", lin(hidden, dim, opts.out_std or std))
end

function MLP:forward(x)
  local h = F.swiglu(self.gate_proj:forward(x), self.up_proj:forward(x))
  return self.down_proj:forward(h)
end

function MLP:extra_repr() return string.format("%d -> %d -> %d, swiglu", self.dim, self.hidden, self.dim) end

return MLP
