-- nn — modules: a constructor, a forward, parameters (DESIGN.md §2).
local M = require "tide.nn.module"
local norms = require "tide.nn.norm"
local transformer = require "tide.nn.transformer"
local hybrid = require "tide.nn.hybrid"
local attnres = require "tide.nn.attnres"
local vision = require "tide.nn.vision"

local nn = {
  Module = M.Module,
  ModuleList = M.ModuleList,
  Linear = require "tide.nn.linear",
  Embedding = require "tide.nn.embedding",
  RMSNorm = norms.RMSNorm,
  LayerNorm = norms.LayerNorm,
  MLP = require "tide.nn.mlp",
  MoE = require "tide.nn.moe",
  Attention = require "tide.nn.attention",
  KDA = require "tide.nn.kda",
  MLA = require "tide.nn.mla",
  AttnRes = attnres.AttnRes,
  Residual = attnres.Residual,             -- residual strategies: prenorm, attnres_block, attnres_full, gamma_chain
  residual_config = attnres.residual_config,
  Block = transformer.Block,
  TransformerLM = transformer.TransformerLM,
  HybridLM = hybrid.HybridLM,
  VisionEncoder = vision.VisionEncoder,    -- the ViT of vision.md (patch embed, table, blocks, final LayerNorm)
  VisionProjector = vision.Projector,      -- pre-norm, 2×2 merge, Linear-GELU(erf)-Linear into the LM width
  vision = vision,                         -- vision.config, merge_index, cu_seqlens, splice
  plan = require "tide.nn.plan",           -- shipped configs, parameter counts, memory estimates (no tensors)
}

-- build(cfg) -> a model from a recipe's `model` table (kind "dense" for now)
-- opts.experts = {rank = r, size = P} (expert parallelism): every MoE layer allocates only the routed experts of
-- rank r of P, with the weights a whole build gives them (nn.MoE.with_expert_slice); dist.shard_model then names
-- their groups
function nn.build(cfg, opts)
  local kind = cfg and cfg.kind or "dense"
  local function make()
    if kind == "dense" then return nn.TransformerLM(cfg) end
    if kind == "hybrid" then return nn.HybridLM(cfg) end
    error("nn.build: unknown model kind '" .. tostring(kind) .. "' (known: dense, hybrid)", 0)
  end
  local ex = opts and opts.experts
  if ex and ex.size > 1 then return nn.MoE.with_expert_slice(ex, make) end
  return make()
end

return nn
