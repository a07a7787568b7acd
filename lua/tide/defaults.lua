-- tide.defaults: the defaults that several modules read (the op wrappers in tide.F, the nn layers, nn.plan's
-- counting and the shipped configs), each written once here beside the spec section that sets it.
local defaults = {}

-- initialisation and norms (spec/README.md, Initialisation): weights N(0, init_std²); RMSNorm / LayerNorm eps
-- (K3's rms_norm_eps), also the AttnRes key norm's (attnres.md §1)
defaults.init_std = 0.02
defaults.norm_eps = 1e-5

-- Kimi Delta Attention (spec/kda.md)
defaults.kda = {
  gate_form = "bounded",      -- §2: the lower-bounded decay gate ("softplus": Kimi Linear's unbounded one)
  gate_lower_bound = -5,      -- §2: lb; chunk·|lb| <= 80 keeps the chunk path's exponents normal (§5)
  chunk = 16,                 -- §4: tokens per chunk
  conv_size = 4,              -- §1: the short causal convolution's taps
}

-- SiTU-GLU caps (spec/moe.md §6): φ_g(g) = k_gate·tanh(g/k_gate)·σ(g), φ_u(u) = k_lin·tanh(u/k_lin)
defaults.situ = { k_gate = 4, k_lin = 25 }

-- activation memory (long_context.md §4; nn/hybrid.lua): "auto" trains without recompute when a micro-batch's
-- activations with none (nn.plan's estimate, allocator classes included) fit in `auto_fraction` of what the device
-- has free (its free memory plus the engine's cached blocks, under tide.set_memory_limit's cap when one is set),
-- and with "layer" recompute otherwise. Half leaves room for the estimate's error and whatever else runs.
defaults.recompute = { mode = "auto", auto_fraction = 0.5 }

-- partial rollouts (spec/rl.md §5): how a paused sample resumes ("prefill": one exact forward over its prefix,
-- bit-identical to an uninterrupted run; "replay": its forward calls again; "state": its saved caches)
defaults.rl = { resume_mode = "prefill" }

return defaults
