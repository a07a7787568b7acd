-- nn/attention.lua — multi-head causal self-attention with RoPE (pairs (i, i + D/2), HuggingFace
-- rotate-half layout) and an optional key/value cache for decoding.
local tide = require "tide"
local M = require "tide.nn.module"
local defaults = require "tide.defaults"
local options = require "tide.options"
local Linear = require "tide.nn.linear"
local F = tide.F

local Attention = M.Module:extend("Attention")

-- Attention(dim, n_heads, {head_dim = dim / n_heads, rope_theta = 10000, std, out_std, dtype, device})
function Attention:init(dim, n_heads, opts)
  opts = opts or {}
  options.pos_int(n_heads, "n_heads", "nn.Attention")
  local head_dim = opts.head_dim or dim / n_heads
  if head_dim ~= math.floor(head_dim) or head_dim % 2 ~= 0 then
    error(string.format("nn.Attention: head_dim must be an even integer, got %s (dim %d, n_heads %d)",
      tostring(head_dim), dim, n_heads), 3)
  end
  self.dim, self.n_heads, self.head_dim = dim, n_heads, head_dim
  self.rope_theta = opts.rope_theta or 10000
  self.scale = 1 / math.sqrt(head_dim)
  local std = opts.std or defaults.init_std
  local function lin(i, o, s) return Linear(i, o, { std = s, dtype = opts.dtype, device = opts.device }) end
  local inner = n_heads * head_dim
  self:child("q_proj", lin(dim, inner, std))
  self:child("k_proj", lin(dim, inner, std))
  self:child("v_proj", lin(dim, inner, std))
  self:child("o_proj", lin(inner, dim, opts.out_std or std))
end

-- forward(x [B, T, d], cache) -> [B, T, d]. cache (decoding): {k =, v =, pos = tokens already seen};
-- new keys/values are appended and positions continue from cache.pos.
function Attention:forward(x, cache)
  local B, T = x:size(1), x:size(2)
  local H, D = self.n_heads, self.head_dim
  local pos0 = cache and cache.pos or 0
  local q = self.q_proj:forward(x):reshape(B, T, H, D)
  local k = self.k_proj:forward(x):reshape(B, T, H, D)
  local v = self.v_proj:forward(x):reshape(B, T, H, D)
  -- rope and attention on [B, T, H, D]: the tiled causal kernel of MLA's attention (F.mla_attention without a rope
  -- slot: plain multi-head attention, the last query on the last key), whose memory is linear in T and which
  -- runs small heads faster than F.attention's [T, T] scores per head; no transposes on either side
  q = F.rope(q, self.rope_theta, pos0)
  k = F.rope(k, self.rope_theta, pos0)
  if cache then
    if cache.k then
      k = F.concat({ cache.k, k }, 2)
      v = F.concat({ cache.v, v }, 2)
    end
    cache.k, cache.v, cache.pos = k, v, pos0 + T
  end
  local o = F.mla_attention(q, k, nil, v, { scale = self.scale })
  return self.o_proj:forward(o:reshape(B, T, H * D))
end

function Attention:extra_repr()
  return string.format("%d, heads=%d, head_dim=%d, rope_theta=%g", self.dim, self.n_heads, self.head_dim, self.rope_theta)
end

return Attention
