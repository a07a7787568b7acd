-- nn/configs.lua — the nn.HybridLM configs the engine ships (spec/README.md "Model configs the engine ships"):
-- tiny (CPU, trains in minutes, every feature of the large model on) and k3 (the reference scale, counted and
-- planned by nn.plan, never instantiated here).
--
--   configs.get(name)       a fresh deep copy (callers may modify it); configs.names() lists them
--   configs.all.tiny        the same as a read-only table (nn.plan.configs is this table)
local defaults = require "tide.defaults"
local options = require "tide.options"

local fmt = string.format

local configs = {}
local WHO = "configs"

local CONFIGS = {}

-- tiny: CPU, 2 cores, trains in minutes; every feature of the large model on
CONFIGS.tiny = {
  kind = "hybrid",
  vocab_size = 320,           -- V: 256 bytes + 64 reserved specials (formats.md §4)
  dim = 128,                  -- d
  n_layers = 8,               -- L
  mixers = "3:1",             -- 3 KDA : 1 MLA (mla.md §7): MLA at 0-based {3, 7}, KDA at {0, 1, 2, 4, 5, 6}
  last_mla = true,            -- the last layer is MLA (already so for L = 8)
  kda = {                     -- Kimi Delta Attention (kda.md)
    heads = 2,                -- H
    head_dim = 64,            -- dk = dv = 64; the gate bottleneck rank is dk = 64 (nn.KDA's f_a_proj [dk, d])
    conv_size = 4,            -- short causal conv
    gate_form = "bounded",    -- lower-bounded decay gate, lb below
    gate_lower_bound = defaults.kda.gate_lower_bound,   -- lb = -5
    chunk = 16,               -- C
  },                          -- full-rank sigmoid output gate: nn.KDA's g_proj [H·dv, d], always on
  mla = {                     -- gated NoPE MLA (mla.md); cache d_c + d_r = 96 values per token
    heads = 2,                -- H
    q_rank = 96,              -- d_q
    kv_rank = 64,             -- d_c
    nope_dim = 64,            -- d_n
    rope_dim = 32,            -- d_r, the unrotated rope slot
    v_dim = 64,               -- dv
    gate = true,              -- sigmoid output gate
  },
  ffn_dim = 384,              -- layer 0: dense SiTU-GLU FFN of width 384
  activation = "situ",        -- SiTU-GLU, κ1 = 4, κ2 = 25 (moe.md §6) in the dense, shared and routed FFNs
  moe = {                     -- layers 1–7 (moe.md)
    first_dense = true,       -- layer 0 keeps the dense ffn_dim FFN
    n_experts = 8,            -- n
    top_k = 2,                -- k
    n_shared = 1,             -- n_s: one shared expert of width d_e = 128 at full d
    expert_dim = 128,         -- d_e
    latent_dim = 64,          -- d_lat (LatentMoE, moe.md §7)
    routed_scaling = 1.0,     -- ρ
    router = "sigmoid",       -- sigmoid scores on the full x (moe.md §2)
    balance = "quantile",     -- Quantile Balancing (moe.md §4.1)
    estimator = "auto",       -- exact on one rank, histogram when the routing batch spans ranks (moe.md §4.1)
  },
  residual = "attnres_block", -- PreNorm + Block AttnRes (attnres.md §3)
  attnres = { block_layers = 2 },   -- B = 2 layers: ≤ 5 sources per mix
  norm_eps = 1e-5,            -- RMSNorm eps; embedding and lm_head are untied (always, in nn.HybridLM)
  init_std = 0.02,
  max_seq_len = 4096,         -- tiny-long's last stage (long_context.md §2)
  recompute = "layer",        -- layer-input checkpoints (long_context.md §4)
  dtype = "f32",
  device = "cpu",
}

-- k3: reference scale (Kimi K3 as released); counted and planned, never instantiated here
CONFIGS.k3 = {
  kind = "hybrid",
  vocab_size = 163840,        -- V
  dim = 7168,                 -- d
  n_layers = 93,              -- L
  mixers = "3:1",             -- 69 KDA + 24 MLA: MLA at 1-based {4, 8, ..., 92} ∪ {93}
  last_mla = true,            -- layers 92 and 93 (1-based) both MLA
  kda = {
    heads = 96,               -- H
    head_dim = 128,           -- dk = dv = 128 (width 12,288); gate bottleneck rank = dk = 128
    conv_size = 4,
    gate_form = "bounded",
    gate_lower_bound = defaults.kda.gate_lower_bound,   -- lb = -5; chunk·|lb| = 80 (kda.md §5)
    chunk = 16,               -- C
  },                          -- full-rank output gate (g_proj)
  mla = {                     -- cache 576 values per token
    heads = 96,
    q_rank = 1536,            -- d_q
    kv_rank = 512,            -- d_c
    nope_dim = 128,           -- d_n
    rope_dim = 64,            -- d_r (NoPE: never rotated)
    v_dim = 128,              -- dv
    gate = true,              -- sigmoid output gate
  },
  ffn_dim = 33792,            -- layer 0 dense SiTU-GLU width
  activation = "situ",        -- κ1 = 4, κ2 = 25 everywhere (dense, shared, routed)
  moe = {                     -- layers 1–92
    first_dense = true,
    n_experts = 896,          -- n
    top_k = 16,               -- k
    n_shared = 2,             -- n_s, fused as one width-6,144 MLP at full d (shared_dim = n_s·d_e)
    expert_dim = 3072,        -- d_e
    latent_dim = 3584,        -- d_lat = d/2
    routed_scaling = 1.0,     -- ρ
    router = "sigmoid",       -- router on the full x: gate.weight [896, 7168]
    balance = "quantile",
    estimator = "histogram",  -- moe.md §4.1: K3's estimator (dp×ep > 1)
  },
  residual = "attnres_block",
  attnres = { block_layers = 12 },  -- B = 12 layers: ≤ 9 sources per mix
  norm_eps = 1e-5,
  init_std = 0.02,
  max_seq_len = 1048576,      -- 1M context (curriculum 8K → 64K → 256K → 1M, long_context.md §2)
  recompute = "layer",
  dtype = "bf16",             -- bf16 storage and GEMM inputs, fp32 master weights (DESIGN.md §8)
  device = "cuda",
}

function configs.names() return options.sorted_keys(CONFIGS) end

function configs.get(name)
  local c = CONFIGS[name]
  if not c then
    options.fail(WHO, fmt("unknown config '%s' (known: %s)", tostring(name), table.concat(configs.names(), ", ")))
  end
  return options.deep_copy(c)
end

-- configs.all.tiny: each access returns a new deep copy, so a caller's edits never reach the shipped table
configs.all = setmetatable({}, {
  __index = function(_, name) return configs.get(name) end,
  __newindex = function(_, name)
    options.fail(WHO, fmt("the shipped configs are read-only (tried to set '%s')", tostring(name)))
  end,
})

return configs
