-- nn — modules: a constructor, a forward, parameters (DESIGN.md §2).
local M = require "tide.nn.module"
local norms = require "tide.nn.norm"
local transformer = require "tide.nn.transformer"

local nn = {
  Module = M.Module,
  ModuleList = M.ModuleList,
  Linear = require "tide.nn.linear",
  Embedding = require "tide.nn.embedding",
  RMSNorm = norms.RMSNorm,
  LayerNorm = norms.LayerNorm,
  MLP = require "tide.nn.mlp",
  Attention = require "tide.nn.attention",
  KDA = require "tide.nn.kda",
  Block = transformer.Block,
  TransformerLM = transformer.TransformerLM,
}

-- build(cfg) -> a model from a recipe's `model` table (kind "dense" for now)
function nn.build(cfg)
  local kind = cfg and cfg.kind or "dense"
  if kind == "dense" then return nn.TransformerLM(cfg) end
  error("nn.build: unknown model kind '" .. tostring(kind) .. "' (known: dense)", 2)
end

return nn
