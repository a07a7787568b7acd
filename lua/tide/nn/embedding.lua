-- nn/embedding.lua — token ids (0-based values) -> rows of a [V, d] table.
local tide = require "tide"
local M = require "tide.nn.module"
local defaults = require "tide.defaults"
local F = tide.F

local Embedding = M.Module:extend("Embedding")

-- Embedding(num_embeddings, dim, {std = 0.02, dtype, device}); the table is in the no-decay group
function Embedding:init(num_embeddings, dim, opts)
  opts = opts or {}
  if type(num_embeddings) ~= "number" or num_embeddings < 1 or type(dim) ~= "number" or dim < 1 then
    error("nn.Embedding: sizes must be positive integers, got " .. tostring(num_embeddings) .. ", " .. tostring(dim), 3)
  end
  self.num_embeddings, self.dim = num_embeddings, dim
  self:param("weight", M.Module.new_param({ num_embeddings, dim }, { "normal", opts.std or defaults.init_std }, opts), { decay = false })
end

function Embedding:forward(ids)
  return F.embedding(self.weight, ids)
end

function Embedding:extra_repr() return string.format("%d, %d", self.num_embeddings, self.dim) end

return Embedding
