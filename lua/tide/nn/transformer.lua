-- nn/transformer.lua — the dense Transformer language model, the baseline every later architecture is
-- compared with: pre-norm blocks x += attn(norm(x)); x += mlp(norm(x)), RoPE, causal attention,
-- SwiGLU MLP, final norm, tied or untied head. Names follow HuggingFace Llama (formats.md §2).
-- cfg.mixer swaps the token mixer: "attention" (default), "kda" (Kimi Delta Attention, nn.KDA, spec/kda.md)
-- or a list naming the mixer of each layer; the KDA layer keeps the self_attn prefix (formats.md §2).
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local Embedding = require "tide.nn.embedding"
local norms = require "tide.nn.norm"
local MLP = require "tide.nn.mlp"
local Attention = require "tide.nn.attention"
local KDA = require "tide.nn.kda"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F

local Block = M.Module:extend("Block")

local function make_norm(cfg)
  local opts = { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device }
  if cfg.norm == "layernorm" then return norms.LayerNorm(cfg.dim, opts) end
  return norms.RMSNorm(cfg.dim, opts)
end

-- the mixer of layer l (1-based): cfg.mixer is a name or a list of names
local function mixer_of(cfg, l)
  if type(cfg.mixer) == "table" then return cfg.mixer[l] end
  return cfg.mixer
end

-- Block(cfg, mixer = "attention" | "kda")
function Block:init(cfg, mixer)
  -- output projections N(0, 0.02² / (2L)) (spec/README.md, Initialisation)
  local out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
  local common = { std = cfg.init_std, out_std = out_std, dtype = cfg.dtype, device = cfg.device }
  self.mixer = mixer or "attention"
  self:child("input_layernorm", make_norm(cfg))
  if self.mixer == "kda" then
    local k = cfg.kda
    self:child("self_attn", KDA(cfg.dim, {
      heads = k.heads, head_dim = k.head_dim, conv_size = k.conv_size, gate_form = k.gate_form,
      gate_lower_bound = k.gate_lower_bound,
      chunk = k.chunk, norm_eps = cfg.norm_eps, std = common.std, out_std = out_std, dtype = cfg.dtype,
      device = cfg.device }))
  else
    self:child("self_attn", Attention(cfg.dim, cfg.n_heads, {
      head_dim = cfg.head_dim, rope_theta = cfg.rope_theta, std = common.std, out_std = out_std,
      dtype = cfg.dtype, device = cfg.device }))
  end
  self:child("post_attention_layernorm", make_norm(cfg))
  self:child("mlp", MLP(cfg.dim, cfg.ffn_dim, common))
end

-- forward(x [B, T, d], cache, opts): cache is this layer's decoding cache (or nil); opts.cu_seqlens packs
-- documents and opts.reset restarts rows at this call (KDA layers only: the attention here has no
-- document mask; see nn.KDA:forward)
function Block:forward(x, cache, opts)
  local cu = opts and opts.cu_seqlens
  local xn = self.input_layernorm:forward(x)
  local h
  if self.mixer == "kda" then
    if cache and x:size(2) == 1 then
      h = self.self_attn:step(xn, cache)        -- decode: the token recurrence (kda.md §3)
    else
      h = self.self_attn:forward(xn, { cache = cache, cu_seqlens = cu, reset = opts and opts.reset })
    end
  else
    if cu ~= nil then error("Block: cu_seqlens (packed documents) needs KDA layers; attention layers have no document mask", 3) end
    h = self.self_attn:forward(xn, cache)
  end
  x = x + h
  h = self.mlp:forward(self.post_attention_layernorm:forward(x))
  return x + h
end

-- the inner "model": embed_tokens, layers, norm
local Body = M.Module:extend("TransformerBody")

function Body:init(cfg)
  self:child("embed_tokens", Embedding(cfg.vocab_size, cfg.dim, { std = cfg.init_std, dtype = cfg.dtype, device = cfg.device }))
  local layers = M.ModuleList()
  for l = 1, cfg.n_layers do layers:append(Block(cfg, mixer_of(cfg, l))) end
  self:child("layers", layers)
  self:child("norm", make_norm(cfg))
end

function Body:forward(ids, caches, opts)
  local x = self.embed_tokens:forward(ids)
  for l = 1, self.layers.n do
    x = self.layers:get(l):forward(x, caches and caches[l], opts)
  end
  return self.norm:forward(x)
end

local TransformerLM = M.Module:extend("TransformerLM")

local DEFAULTS = {
  kind = "dense", vocab_size = 320, dim = 128, n_layers = 4, n_heads = 4, head_dim = false, ffn_dim = false,
  norm = "rmsnorm", norm_eps = defaults.norm_eps, rope_theta = 10000, tie_embeddings = false,
  init_std = defaults.init_std,
  max_seq_len = 1024, dtype = "f32", device = "cpu", mixer = "attention", kda = false,
}
TransformerLM.DEFAULTS = DEFAULTS
-- cfg.kda: the KDA layer's options; heads defaults to n_heads, head_dim to dim / heads
local KDA_DEFAULTS = { heads = false, head_dim = false, conv_size = defaults.kda.conv_size, gate_form = defaults.kda.gate_form,
                       gate_lower_bound = defaults.kda.gate_lower_bound, chunk = defaults.kda.chunk }
TransformerLM.KDA_DEFAULTS = KDA_DEFAULTS

-- the SwiGLU width: 8/3 · d rounded up to a multiple of 32 (keeps the parameter count of a 4d GELU MLP)
local function default_ffn(dim) return math.ceil(8 * dim / 3 / 32) * 32 end

-- complete a model config with defaults; unknown keys are errors naming the known ones. Errors point at the
-- first line outside lua/tide (the recipe or test that wrote the config).
local WHO = "model"
local function bad(msg) options.fail(WHO, msg) end

-- dim / heads, which must divide exactly (`what` names the heads option, `set` the option that avoids the division)
local function per_head(dim, heads, what, set)
  if dim % heads ~= 0 then bad(string.format("dim %d is not divisible by %s %d (set %s)", dim, what, heads, set)) end
  return dim / heads
end

function TransformerLM.config(cfg)
  local out = options.with_defaults(cfg or {}, DEFAULTS, DEFAULTS, nil, WHO)
  if out.kind ~= "dense" then bad("TransformerLM builds kind 'dense', got '" .. tostring(out.kind) .. "'") end
  for _, k in ipairs({ "vocab_size", "dim", "n_layers", "n_heads" }) do options.pos_int(out[k], k, WHO) end
  if not out.head_dim then out.head_dim = per_head(out.dim, out.n_heads, "n_heads", "head_dim") end
  if not out.ffn_dim then out.ffn_dim = default_ffn(out.dim) end
  if out.norm ~= "rmsnorm" and out.norm ~= "layernorm" then
    bad("norm must be 'rmsnorm' or 'layernorm', got '" .. tostring(out.norm) .. "'")
  end
  local function known_mixer(m, where)
    if m ~= "attention" and m ~= "kda" then bad(where .. " must be 'attention' or 'kda', got '" .. tostring(m) .. "'") end
  end
  local any_kda = false
  if type(out.mixer) == "table" then
    if #out.mixer ~= out.n_layers then
      bad(string.format("mixer lists %d layers but n_layers is %d", #out.mixer, out.n_layers))
    end
    local copy = {}
    for l, m in ipairs(out.mixer) do known_mixer(m, "mixer[" .. l .. "]"); copy[l] = m; any_kda = any_kda or m == "kda" end
    out.mixer = copy
  else
    known_mixer(out.mixer, "mixer")
    any_kda = out.mixer == "kda"
  end
  if out.kda and type(out.kda) ~= "table" then bad("kda must be a table of KDA options, got " .. type(out.kda)) end
  if any_kda or out.kda then
    local k = options.with_defaults(out.kda or {}, KDA_DEFAULTS, KDA_DEFAULTS, "kda", WHO)
    if not k.heads then k.heads = out.n_heads end
    if not k.head_dim then k.head_dim = per_head(out.dim, k.heads, "kda.heads", "kda.head_dim") end
    out.kda = k
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

-- forward(ids [B, T] int, caches, opts) -> logits [B, T, V]; opts.cu_seqlens: packed documents, opts.reset:
-- rows starting a new document at this call (KDA layers, nn.KDA:forward)
function TransformerLM:forward(ids, caches, opts)
  local h = self.model:forward(ids, caches, opts)
  local w = self.lm_head and self.lm_head.weight or self.model.embed_tokens.weight
  return h:matmul(w, false, true)
end

-- loss(ids, targets) -> mean cross-entropy over all B·T tokens (targets of -100 are ignored)
function TransformerLM:loss(ids, targets, opts)
  local logits = self:forward(ids, nil, opts)
  return F.cross_entropy(logits, targets)
end

-- one decoding cache per layer; pass the same table to successive forward calls. An attention layer's
-- cache grows with every token (keys and values); a KDA layer's holds a fixed-size state and conv history.
function TransformerLM:new_cache()
  local caches = {}
  for l = 1, self.cfg.n_layers do caches[l] = { pos = 0 } end
  return caches
end

-- true when some layer's cache grows with the context (attention), false for a KDA-only model
function TransformerLM:cache_grows()
  for l = 1, self.model.layers.n do
    if self.model.layers:get(l).mixer ~= "kda" then return true end
  end
  return false
end

-- generate(prompts, opts) -> new ids (generate.ids: one list or a batch of lists; max_new, temperature, top_k,
-- top_p, stop, seed), decoding on the per-layer caches
function TransformerLM:generate(prompts, opts)
  return require("tide.generate").ids(self, prompts, opts)
end

function TransformerLM:extra_repr()
  local c = self.cfg
  local mixer = type(c.mixer) == "table" and table.concat(c.mixer, ",") or c.mixer
  return string.format("V=%d, d=%d, L=%d, H=%d, ffn=%d, %s, %s head, %s%d params", c.vocab_size, c.dim, c.n_layers,
    c.n_heads, c.ffn_dim, c.norm, c.tie_embeddings and "tied" or "untied",
    mixer ~= "attention" and ("mixer " .. mixer .. ", ") or "", self:num_parameters())
end

return { TransformerLM = TransformerLM, Block = Block }
