-- nn/mlp.lua — the gated feed-forward down(φ_g(gate(x)) ⊙ φ_u(up(x))): SwiGLU (φ_g = silu, φ_u = identity)
-- or SiTU-GLU (moe.md §6: φ_g(g) = κ1 tanh(g/κ1) σ(g), φ_u(u) = κ2 tanh(u/κ2), κ1 = 4, κ2 = 25, so |h| <= 100).
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local defaults = require "tide.defaults"
local F = tide.F

local MLP = M.Module:extend("MLP")

-- MLP(dim, hidden, {activation = "swiglu" | "situ", std = 0.02, out_std = std, dtype, device}); out_std
-- initialises down_proj
function MLP:init(dim, hidden, opts)
  opts = opts or {}
  self.activation = opts.activation or "swiglu"
  if self.activation ~= "swiglu" and self.activation ~= "situ" then
    error("nn.MLP: activation must be \"swiglu\" or \"situ\", got " .. tostring(self.activation), 3)
  end
  local std = opts.std or defaults.init_std
  local function lin(i, o, s)
    return Linear(i, o, { std = s, dtype = opts.dtype, device = opts.device })
  end
  self.dim, self.hidden = dim, hidden
  self:child("gate_proj", lin(dim, hidden, std))
  self:child("up_proj", lin(dim, hidden, std))
  self:child("down_proj", lin(hidden, dim, opts.out_std or std))
end

-- either activation is one fused node that keeps only g and u (F.situ_glu: σ takes the uncapped g, moe.md §6; on the
-- CPU it rounds as the unfused ((tanh(g/κ1)·κ1)·σ(g))·(tanh(u/κ2)·κ2) chain of ten ops did, its gradient too)
function MLP:forward(x)
  local g, u = self.gate_proj:forward(x), self.up_proj:forward(x)
  local h = self.activation == "situ" and F.situ_glu(g, u) or F.swiglu(g, u)
  return self.down_proj:forward(h)
end

function MLP:extra_repr()
  return string.format("%d -> %d -> %d, %s", self.dim, self.hidden, self.dim, self.activation)
end

return MLP
