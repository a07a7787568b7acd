-- nn/transformer.lua — the dense Transformer language model, the baseline every later architecture is
-- compared with: pre-norm blocks x += attn(norm(x)); x += mlp(norm(x)), RoPE, causal attention,
-- SwiGLU MLP, final norm, tied or untied head. Names follow HuggingFace Llama (formats.md §2).
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local Embedding = require "tide.nn.embedding"
local norms = require "tide.nn.norm"
local MLP = require "tide.nn.mlp"
local Attention = require "tide.nn.attention"
local F = tide.F

local Block = M.Module:extend("Block")

local function make_norm(cfg)
  local opts = { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device }
  if cfg.norm == "layernorm" then return norms.LayerNorm(cfg.dim, opts) end
  return norms.RMSNorm(cfg.dim, opts)
end

function Block:init(cfg)
  -- output projections N(0, 0.02² / (2L)) (spec/README.md, Initialisation)
  local out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
  local common = { std = cfg.init_std, out_std = out_std, dtype = cfg.dtype, device = cfg.device }
  self:child("input_layernorm", make_norm(cfg))
  self:child("self_attn", Attention(cfg.dim, cfg.n_heads, {
    head_dim = cfg.head_dim, rope_theta = cfg.rope_theta, std = common.std, out_std = out_std,
    dtype = cfg.dtype, device = cfg.device }))
  self:child("post_attention_layernorm", make_norm(cfg))
  self:child("mlp", MLP(cfg.dim, cfg.ffn_dim, common))
end

function Block:forward(x, cache)
  local h = self.self_attn:forward(self.input_layernorm:forward(x), cache)
  x = x + h
  h = self.mlp:forward(self.post_attention_layernorm:forward(x))
  return x + h
end

-- the inner "model": embed_tokens, layers, norm
local Body = M.Module:extend("TransformerBody")

function Body:init(cfg)
  self:child("embed_tokens", Embedding(cfg.vocab_size, cfg.dim, { std = cfg.init_std, dtype = cfg.dtype, device = cfg.device }))
  local layers = M.ModuleList()
  for _ = 1, cfg.n_layers do layers:append(Block(cfg)) end
  self:child("layers", layers)
  self:child("norm", make_norm(cfg))
end

function Body:forward(ids, caches)
  local x = self.embed_tokens:forward(ids)
  for l = 1, self.layers.n do
    x = self.layers:get(l):forward(x, caches and caches[l])
  end
  return self.norm:forward(x)
end

local TransformerLM = M.Module:extend("TransformerLM")

local DEFAULTS = {
  kind = "dense", vocab_size = 320, dim = 128, n_layers = 4, n_heads = 4, head_dim = false, ffn_dim = false,
  norm = "rmsnorm", norm_eps = 1e-5, rope_theta = 10000, tie_embeddings = false, init_std = 0.02,
  max_seq_len = 1024, dtype = "f32", device = "cpu",
}
TransformerLM.DEFAULTS = DEFAULTS

-- the SwiGLU width: 8/3 · d rounded up to a multiple of 32 (keeps the parameter count of a 4d GELU MLP)
local function default_ffn(dim) return math.ceil(8 * dim / 3 / 32) * 32 end

-- complete a model config with defaults; unknown keys are errors naming the known ones
function TransformerLM.config(cfg)
  local out = {}
  for k, v in pairs(cfg or {}) do
    if DEFAULTS[k] == nil then
      local known = {}
      for name in pairs(DEFAULTS) do known[#known + 1] = name end
      table.sort(known)
      error("model: unknown key '" .. tostring(k) .. "'; known keys: " .. table.concat(known, ", "), 3)
    end
    out[k] = v
  end
  for k, v in pairs(DEFAULTS) do if out[k] == nil then out[k] = v end end
  if out.kind ~= "dense" then error("model: TransformerLM builds kind 'dense', got '" .. tostring(out.kind) .. "'", 3) end
  for _, k in ipairs({ "vocab_size", "dim", "n_layers", "n_heads" }) do
    local v = out[k]
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error("model: " .. k .. " must be a positive integer, got " .. tostring(v), 3)
    end
  end
  if not out.head_dim then
    if out.dim % out.n_heads ~= 0 then
      error(string.format("model: dim %d is not divisible by n_heads %d (set head_dim)", out.dim, out.n_heads), 3)
    end
    out.head_dim = out.dim / out.n_heads
  end
  if not out.ffn_dim then out.ffn_dim = default_ffn(out.dim) end
  if out.norm ~= "rmsnorm" and out.norm ~= "layernorm" then
    error("model: norm must be 'rmsnorm' or 'layernorm', got '" .. tostring(out.norm) .. "'", 3)
  end
  return out
end

-- TransformerLM(cfg): see DEFAULTS for the keys
function TransformerLM:init(cfg)
  cfg = TransformerLM.config(cfg)
  self.cfg = cfg
  self:child("model", Body(cfg))
  if cfg.tie_embeddings then
    -- the head reads the embedding table; HF checkpoints of tied models may still carry lm_head.weight
    self.ignored_state_keys = { ["lm_head.weight"] = true }
  else
    self:child("lm_head", Linear(cfg.dim, cfg.vocab_size, { std = cfg.init_std, dtype = cfg.dtype, device = cfg.device }))
  end
end

-- forward(ids [B, T] int, caches) -> logits [B, T, V]
function TransformerLM:forward(ids, caches)
  local h = self.model:forward(ids, caches)
  local w = self.lm_head and self.lm_head.weight or self.model.embed_tokens.weight
  return h:matmul(w, false, true)
end

-- loss(ids, targets) -> mean cross-entropy over all B·T tokens (targets of -100 are ignored)
function TransformerLM:loss(ids, targets)
  local logits = self:forward(ids)
  return F.cross_entropy(logits, targets)
end

-- one decoding cache per layer; pass the same table to successive forward calls
function TransformerLM:new_cache()
  local caches = {}
  for l = 1, self.cfg.n_layers do caches[l] = { pos = 0 } end
  return caches
end

function TransformerLM:extra_repr()
  local c = self.cfg
  return string.format("V=%d, d=%d, L=%d, H=%d, ffn=%d, %s, %s head, %d params", c.vocab_size, c.dim, c.n_layers,
    c.n_heads, c.ffn_dim, c.norm, c.tie_embeddings and "tied" or "untied", self:num_parameters())
end

return { TransformerLM = TransformerLM, Block = Block }
