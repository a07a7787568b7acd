-- nn/plan.lua — model planning without tensors: exact parameter counts (README test oracle 1), the activation memory of one training step per
-- recompute mode (long_context.md §4, test oracle 6), the static bytes of weights, gradients and AdamW moments, and
-- the start-up summary a training run prints. Nothing here allocates a tensor: k3 has 2.8 T parameters.
--
--   plan.configs.tiny, plan.configs.k3     the shipped configs (nn/configs.lua): a fresh deep copy on every access
--   plan.config(name)                      the same, by name; plan.config_names() lists them
--   plan.count(cfg)                        {total, active, per_layer, embedding, head, norms, residual}
--   plan.activation_bytes(cfg, T, opts)    {per_token, total, breakdown, recompute, stored, allocated, ...}
--   plan.static_bytes(cfg, opts)           {weights, grads, moments, buffers, total, ...}
--   plan.describe(cfg, opts)               the multi-line start-up summary
--   plan.human_bytes(n), plan.human_count(n)   3 significant figures, decimal units (KB = 1000 B)
--
-- cfg is an nn.HybridLM config (nn/hybrid.lua); absent fields take nn.HybridLM's and the sublayers' defaults.
local hybrid = require "tide.nn.hybrid"
local MoE = require "tide.nn.moe"
local configs = require "tide.nn.configs"
local options = require "tide.options"
local defaults = require "tide.defaults"

local fmt, floor, ceil, max = string.format, math.floor, math.ceil, math.max

local plan = {}

-- errors point at the first caller outside lua/tide (the line that asked for the plan)
local WHO = "plan"
local function bad(msg) options.fail(WHO, msg) end

-- the shipped configs live in nn/configs.lua; plan.configs, plan.config and plan.config_names are kept as
-- their names here (recipes and tests read them)
plan.configs, plan.config, plan.config_names = configs.all, configs.get, configs.names

-- ---- reading a config -------------------------------------------------------------------------------------------
-- nn.HybridLM's defaults and keys (nn/hybrid.lua) and the sublayers' (tide.defaults, nn.MoE)
local DEFAULTS, KEYS = hybrid.HybridLM.DEFAULTS, hybrid.HybridLM.KEYS
local MOE_DEFAULTS, MOE_CHOICES = MoE.DEFAULTS, MoE.CHOICES

local function pos_int(v, name, zero_ok)
  if zero_ok then return options.nonneg_int(v, name, WHO) end
  return options.pos_int(v, name, WHO)
end
local function one_of(v, name, set) return options.one_of(v, set, name, WHO) end

-- the resolved shape of a config: every size plan needs, defaults filled in, checked
local function resolve(cfg)
  if type(cfg) ~= "table" then bad("cfg must be an nn.HybridLM config table, got " .. type(cfg)) end
  local c = options.with_defaults(cfg, DEFAULTS, KEYS, "config", WHO)     -- the keys nn.HybridLM accepts
  if cfg.kind ~= nil and cfg.kind ~= "hybrid" then bad(fmt("kind must be \"hybrid\", got %s", tostring(cfg.kind))) end
  if c.residual == "attnres_block" and not c.attnres then c.attnres = { block_layers = 2 } end   -- as nn.HybridLM
  local r = {
    V = pos_int(c.vocab_size, "vocab_size"), d = pos_int(c.dim, "dim"), L = pos_int(c.n_layers, "n_layers"),
    activation = one_of(c.activation, "activation", { swiglu = true, situ = true }),
  }
  local ok, sched = pcall(hybrid.mixer_schedule, { n_layers = r.L, mixers = c.mixers, last_mla = c.last_mla })
  if not ok then bad((tostring(sched):gsub("^.-nn%.HybridLM: ", "mixers: "))) end
  r.schedule = sched
  for _, m in ipairs(sched) do
    if m == "kda" and not r.kda then
      local k = c.kda
      if type(k) ~= "table" then bad("a KDA layer needs kda = {heads, head_dim, ...}") end
      r.kda = { H = pos_int(k.heads, "kda.heads"), dk = pos_int(k.head_dim, "kda.head_dim"),
                conv = pos_int(k.conv_size or defaults.kda.conv_size, "kda.conv_size"),
                chunk = pos_int(k.chunk or defaults.kda.chunk, "kda.chunk") }
    elseif m == "mla" and not r.mla then
      local a = c.mla
      if type(a) ~= "table" then bad("an MLA layer needs mla = {heads, kv_rank, nope_dim, ...}") end
      local dn = pos_int(a.nope_dim, "mla.nope_dim")
      r.mla = { H = pos_int(a.heads, "mla.heads"), dq = a.q_rank and pos_int(a.q_rank, "mla.q_rank") or nil,
                dc = pos_int(a.kv_rank, "mla.kv_rank"), dn = dn, dr = pos_int(a.rope_dim or 0, "mla.rope_dim", true),
                dv = pos_int(a.v_dim or dn, "mla.v_dim"), gate = a.gate == nil and true or a.gate }
      if type(r.mla.gate) ~= "boolean" then bad("mla.gate must be a boolean, got " .. type(r.mla.gate)) end
    end
  end
  r.ffn_dim = pos_int(c.ffn_dim, "ffn_dim")
  if c.moe then
    local o = c.moe
    if type(o) ~= "table" then bad("moe must be a table of nn.MoE options, got " .. type(o)) end
    local e = { n = pos_int(o.n_experts, "moe.n_experts"), k = pos_int(o.top_k, "moe.top_k"),
                de = pos_int(o.expert_dim, "moe.expert_dim"),
                lat = o.latent_dim and pos_int(o.latent_dim, "moe.latent_dim") or nil,
                router = one_of(o.router or MOE_DEFAULTS.router, "moe.router", MOE_CHOICES.router),
                balance = one_of(o.balance or MOE_DEFAULTS.balance, "moe.balance", MOE_CHOICES.balance),
                activation = one_of(o.activation or r.activation, "moe.activation", MOE_CHOICES.activation),
                first_dense = o.first_dense ~= false }
    if e.k >= e.n then bad(fmt("moe.top_k = %d must be < moe.n_experts = %d", e.k, e.n)) end
    e.shared = pos_int(o.shared_dim or pos_int(o.n_shared or MOE_DEFAULTS.n_shared, "moe.n_shared", true) * e.de, "moe.shared_dim", true)
    if e.router == "latent" then
      e.rank = pos_int(o.router_rank or MOE_DEFAULTS.router_rank, "moe.router_rank")
      e.similarity = one_of(o.similarity or MOE_DEFAULTS.similarity, "moe.similarity", MOE_CHOICES.similarity)
    end
    r.moe = e
  end
  local ok2, rc = pcall(require("tide.nn.attnres").residual_config, c)
  if not ok2 then bad((tostring(rc):gsub("^.-residual: ", "residual: "))) end
  r.residual, r.B = rc.kind, rc.block_layers
  r.gamma_mode, r.gamma_range = rc.gamma_mode, rc.gamma_range
  if r.gamma_range then
    local g = r.gamma_range
    if type(g) ~= "table" or type(g[1]) ~= "number" or type(g[2]) ~= "number" or g[1] < 1 or g[2] < g[1] or g[2] > r.L then
      bad("gamma_chain.layers must be {first, last} with 1 <= first <= last <= n_layers")
    end
  end
  r.dtype, r.device = c.dtype, c.device
  return r
end

local function in_gamma_range(r, l)
  local g = r.gamma_range
  return not g or (l >= g[1] and l <= g[2])
end

local function is_moe(r, l) return r.moe ~= nil and (l > 1 or not r.moe.first_dense) end

-- ---- parameter counts (README oracle 1) ---------------------------------------------------------------------
local function kda_params(d, k)
  local i = k.H * k.dk
  -- q, k, v, g projections and o_proj; 3 depthwise convs; gate bottleneck f_a [dk, d], f_b [H·dk, dk];
  -- b_proj [H, d]; A_log [H]; dt_bias [H·dk]; o_norm [dk] (shared by the heads)
  return 5 * i * d + 3 * i * k.conv + d * k.dk + k.dk * i + d * k.H + k.H + i + k.dk
end

local function mla_params(d, a)
  local H, q = a.H, a.H * (a.dn + a.dr)
  local n = a.dq and (d * a.dq + a.dq + a.dq * q) or d * q    -- q_a_proj, q_a_layernorm, q_b_proj | q_proj
  n = n + d * (a.dc + a.dr) + a.dc + a.dc * H * (a.dn + a.dv)  -- kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
  if a.gate then n = n + d * H * a.dv end                     -- g_proj
  return n + H * a.dv * d                                     -- o_proj
end

-- a MoE layer: total, active, one routed expert's parameters
local function moe_params(d, e)
  local din = e.lat or d
  local expert = 2 * e.de * din + din * e.de                 -- gate_up_proj [2·d_e, d_in] + down_proj [d_out, d_e]
  local router
  if e.router == "latent" then
    router = e.rank * d + e.n * e.rank + (e.similarity == "cosine" and 1 or 0)   -- latent_proj, expert_vectors, log_scale
  else
    router = e.n * d                                          -- gate.weight; e_score_correction_bias is a buffer
  end
  local fixed = router + (e.lat and (d * e.lat + e.lat + e.lat * d) or 0) + 3 * d * e.shared
  return fixed + e.n * expert, fixed + e.k * expert, expert
end

-- count(cfg) -> {total, active, embedding, head, final (final norm + final AttnRes mix), per_layer = {[l] =
-- {index (0-based), mixer, ffn, mixer_params, ffn_params, ffn_active, norms, residual, total, active}}}
function plan.count(cfg)
  local r = resolve(cfg)
  local d = r.d
  local out = { embedding = r.V * d, head = r.V * d, per_layer = {} }
  local res_layer = (r.residual == "attnres_block" or r.residual == "attnres_full") and 4 * d or 0
  out.final = d + ((r.residual == "attnres_block" or r.residual == "attnres_full") and 2 * d or 0)
  local total, active = out.embedding + out.head + out.final, out.embedding + out.head + out.final
  for l = 1, r.L do
    local p = { index = l - 1, mixer = r.schedule[l], norms = 2 * d, residual = res_layer }
    p.mixer_params = p.mixer == "kda" and kda_params(d, r.kda) or mla_params(d, r.mla)
    if is_moe(r, l) then
      p.ffn = "moe"
      p.ffn_params, p.ffn_active = moe_params(d, r.moe)
    else
      p.ffn = "dense"
      p.ffn_params = 3 * d * r.ffn_dim
      p.ffn_active = p.ffn_params
    end
    if r.residual == "gamma_chain" and in_gamma_range(r, l) then
      p.residual = r.gamma_mode == "scalar" and 1 or d       -- attn_gamma [1] | [d], or attn_gamma_proj [1, d]
    end
    p.total = p.mixer_params + p.ffn_params + p.norms + p.residual
    p.active = p.total - p.ffn_params + p.ffn_active
    out.per_layer[l] = p
    total, active = total + p.total, active + p.active
  end
  if cfg.vision then
    -- the vision encoder and projector (vision.md §9): active for image tokens, counted in both totals
    local vc = require("tide.nn.vision").config(cfg.vision, d)
    local dv, P = vc.dim, 3 * vc.patch * vc.patch
    local block = 4 * dv + (dv * 3 * dv + 3 * dv) + (dv * dv + dv) + (dv * vc.mlp_dim + vc.mlp_dim) + (vc.mlp_dim * dv + dv)
    out.vision = (P * dv + dv) + vc.grid * vc.grid * dv + vc.layers * block + 2 * dv
    out.projector = 2 * dv + (4 * dv * vc.proj_dim + vc.proj_dim) + (vc.proj_dim * d + d)
    total, active = total + out.vision + out.projector, active + out.vision + out.projector
  end
  out.total, out.active = total, active
  return out
end

-- ---- activation memory (long_context.md §4, oracle 6) ---------------------------------------------------------
-- What tide keeps is decided per op (engine/ops/*.c): a node saves views of the tensors its backward reads, and a
-- storage lives while any saved view, Lua variable or later input refers to it; a recompute region (DESIGN.md §4,
-- tide.recompute) keeps only its nodes' external inputs. Each sublayer is therefore listed as the tensors it
-- creates, per token (an "item"), with what keeps each one:
--   none  kept after the forward with recompute = "none" (saved by some node)
--   sel   kept with recompute = "selective" as nn/hybrid.lua implements it: the residual mix + RMSNorm of both
--         PreNorm sites are regions, so the mixed norm inputs and their stats go, and a region keeps its external
--         inputs instead (the mixer output m). long_context.md §4 also lists the MLA up-projections and the LatentMoE down-projection; the
--         engine cannot drop those yet (nn/hybrid.lua says why), so they count as kept.
--   ckpt  kept with recompute = "layer" (every layer a region): what enters a later layer from outside it — the
--         residual stream at each layer boundary (Block AttnRes: the `prefix`; the block sources are those same
--         tensors, kept once), Full AttnRes' sublayer outputs, the gamma chain's ā, and the MoE selection ids (an
--         integer tensor made inside the region, so an external input of the nodes that read it)
-- Items not kept are garbage once the forward moves on, but a layer-mode backward replays the whole layer, so the
-- working set of the layer being recomputed is every item of that layer.
--
-- Sizes per token (values; f32 = 4 B, bf16 = 2 B; "acc" items are fp32 when the activations are bf16, i64 8 B):
--   residual, Block AttnRes layer l: mix output h and stats 2·n₁ (l > 1), input RMSNorm rstd 1 and output xn d,
--     the new prefix d (= m at a block start, else prefix + m), mix h₂ d + stats 2·n₂, post RMSNorm 1 + xn₂ d,
--     the FFN output f d (garbage) and prefix + f d (the next layer's input)              ≈ 6d + 2(n₁ + n₂) + 2
--   KDA (i = H·dk): q/k/v projections 3i, conv+SiLU outputs 3i, L2-normed q, k 2i + rstd 2H, β logits + σ 2H,
--     gate bottleneck dk + z i, gate g i, kernel output o i, o_norm rstd H + output i, output-gate logits +
--     σ 2i, gated product i                                                               = 15i + dk + 5H
--     plus the CPU kernel's chunk-start states (one [H, dk, dv] fp32 every 16 chunks: H·dk·dv/(16·C) per token)
--   MLA: q_a d_q + rstd 1 + normed d_q, q H(d_n+d_r), latent copy d_c + rstd 1 + ĉ d_c, k_r copy d_r, k_n H·d_n and
--     v H·dv copies, o H·dv, lse H (acc), output gate logits + σ + product 3·H·dv; kv_a and kv_b outputs garbage
--   FFN of width h: SiTU-GLU and SwiGLU (one fused node each) keep g, u, h: 3h
--   MoE: router scores (sigmoid: logits + s = 2n, acc; bf16 adds the router's fp32 copy of x, d), ids k (i64),
--     ρ·s_sel k + denominator 1 + p k (acc),
--     LatentMoE input z d_lat, dispatch records 2k (i64), expert pre-activations 2·k·d_e, expert outputs k·d_out,
--     combined u d_lat + rstd 1 + normed d_lat (latent), shared experts as an FFN of width n_s·d_e
--   head: embedding d, final mix d + stats, final RMSNorm 1 + d, logits V, CE lse 1
-- The peak of one step is found by walking the backward from the head to layer 1: with every item kept by the
-- mode live after the forward, the head's backward adds the logits' gradient (V + d); layer l's backward adds
-- two gradients of its widest differentiable tensor (an op's output gradient and an input gradient; statistics,
-- ids and the experts' dispatch buffers never get one) and one gradient d per residual source it reads, and in
-- "layer" mode the replayed layer (all its items) on top of the checkpoints of the layers below it. A layer's
-- backward runs its FFN site first, then its mixer site; each site's items leave when it is done.
-- per_token = peak / T.
-- Not counted: parameters, their gradients and optimiser state (plan.static_bytes), the temporary gradient of
-- one weight tensor, Lua garbage awaiting collection (tide collects under pressure: up to 32 MiB), the MoE
-- routing statistics (Lua arrays). The CPU caching allocator rounds blocks ≥ 1 MiB up by 0–25% (engine/alloc.c):
-- `allocated` repeats the walk with every tensor rounded to its size class.

-- item(list, category, name, values per token, kind "act" | "acc" | "i64", keep, ckpt): keep "ns" = kept by
-- none and selective, "n" = none only, "s" = selective only, "" = neither; ckpt = kept by layer mode
local function item(list, cat, name, w, kind, keep, ckpt)
  list[#list + 1] = { cat = cat, name = name, w = w, kind = kind or "act", none = keep == "ns" or keep == "n",
                      sel = keep == "ns" or keep == "s", ckpt = ckpt or false }
end

-- a tensor whose size per sequence is not a multiple of T (chunk checkpoints, dispatch offsets)
local function seq_item(list, cat, name, f, kind, keep)
  item(list, cat, name, 0, kind, keep)
  list[#list].per_seq = f
  list[#list].nograd = true
end

-- marks the last item as read only inside a fused op's backward (statistics, ids, dispatch buffers): no gradient
-- tensor of its size is ever made
local function nograd(list) list[#list].nograd = true end

-- an FFN of width h (SiTU-GLU or SwiGLU: one fused node that saves g and u), input already counted
local function ffn_items(list, cat, h)
  item(list, cat, "gate", h, "act", "ns")
  item(list, cat, "up", h, "act", "ns")
  item(list, cat, "h", h, "act", "ns")
end

local function kda_items(list, r, ckpt_chunks)
  local k = r.kda
  local i, H = k.H * k.dk, k.H
  for _, name in ipairs({ "q_proj", "k_proj", "v_proj", "q conv", "k conv", "v conv", "q l2", "k l2" }) do
    item(list, "kda", name, i, "act", "ns")
  end
  item(list, "kda", "l2 rstd", 2 * H, "act", "ns"); nograd(list)
  item(list, "kda", "b_proj", H, "act", "ns")
  item(list, "kda", "beta", H, "act", "ns")
  item(list, "kda", "f_a", k.dk, "act", "ns")
  for _, name in ipairs({ "z", "g", "o" }) do item(list, "kda", name, i, "act", "ns") end
  item(list, "kda", "o_norm rstd", H, "act", "ns"); nograd(list)
  for _, name in ipairs({ "o_norm", "g_proj", "σ(g_proj)", "gated" }) do item(list, "kda", name, i, "act", "ns") end
  local state = H * k.dk * k.dk
  seq_item(list, "kda", "final state", function() return state end, "acc", "")
  if ckpt_chunks > 0 then
    seq_item(list, "kda", "chunk states", function(T) return ceil(ceil(T / k.chunk) / ckpt_chunks) * state end, "acc", "ns")
  end
end

local function mla_items(list, r)
  local a = r.mla
  local H = a.H
  if a.dq then
    item(list, "mla", "q_a", a.dq, "act", "ns")
    item(list, "mla", "q_a rstd", 1, "act", "ns"); nograd(list)
    item(list, "mla", "q_a norm", a.dq, "act", "ns")
  end
  item(list, "mla", "q", H * (a.dn + a.dr), "act", "ns")
  if a.dr > 0 then
    item(list, "mla", "kv_a", a.dc + a.dr, "act", "")          -- read through narrow views, then garbage
    item(list, "mla", "c copy", a.dc, "act", "ns")             -- RMSNorm's contiguous copy of the narrow
    item(list, "mla", "k_r", a.dr, "act", "ns")
  else
    item(list, "mla", "kv_a", a.dc, "act", "ns")
  end
  item(list, "mla", "kv rstd", 1, "act", "ns"); nograd(list)
  item(list, "mla", "c", a.dc, "act", "ns")
  item(list, "mla", "kv_b", H * (a.dn + a.dv), "act", "")
  item(list, "mla", "k_n", H * a.dn, "act", "ns")
  item(list, "mla", "v", H * a.dv, "act", "ns")
  item(list, "mla", "o", H * a.dv, "act", "ns")
  item(list, "mla", "lse", H, "acc", "ns"); nograd(list)
  if a.gate then
    for _, name in ipairs({ "g_proj", "σ(g_proj)", "gated" }) do item(list, "mla", name, H * a.dv, "act", "ns") end
  end
end

local function moe_items(list, r, d, bf16)
  local e = r.moe
  local n, k = e.n, e.k
  if bf16 then item(list, "moe", "router x (fp32)", d, "acc", "ns") end
  if e.router == "sigmoid" then
    item(list, "moe", "logits", n, "acc", "ns")
    item(list, "moe", "scores", n, "acc", "ns")
  elseif e.router == "softmax" then
    item(list, "moe", "logits", n, "acc", "")
    item(list, "moe", "scores", n, "acc", "ns")
  else
    item(list, "moe", "router z", e.rank, "acc", "ns")
    item(list, "moe", "logits", n, "acc", "ns")
    if e.similarity == "cosine" then
      item(list, "moe", "z²", e.rank, "acc", "")
      item(list, "moe", "Σz²", 1, "acc", "ns")
      item(list, "moe", "|z|", 1, "acc", "ns")
      for _, name in ipairs({ "scaled", "denominator", "cosine" }) do item(list, "moe", name, n, "acc", "ns") end
      item(list, "moe", "|z||e|", n, "acc", "")
    end
    item(list, "moe", "scores", n, "acc", "ns")
  end
  item(list, "moe", "ids", k, "i64", "ns", true); nograd(list)
  item(list, "moe", "s_sel", k, "acc", "")
  item(list, "moe", "ρ·s_sel", k, "acc", "ns")
  item(list, "moe", "Σs_sel", 1, "acc", "")
  item(list, "moe", "Σs_sel + ε", 1, "acc", "ns")
  item(list, "moe", "p", k, "acc", "ns")
  if bf16 then item(list, "moe", "p (bf16)", k, "act", "ns") end
  if e.balance == "aux" then
    item(list, "moe", "aux Σs", 1, "acc", "ns")
    item(list, "moe", "aux s/Σs", n, "acc", "")
  end
  local dout = e.lat or d
  if e.lat then item(list, "moe", "z", e.lat, "act", "ns") end
  item(list, "moe", "dispatch", 2 * k, "i64", "ns"); nograd(list)
  seq_item(list, "moe", "dispatch offsets", function() return n + 1 end, "i64", "ns")
  item(list, "moe", "expert gate|up", 2 * k * e.de, "act", "ns"); nograd(list)   -- inside F.moe_experts
  item(list, "moe", "expert out", k * dout, "act", "ns"); nograd(list)
  if e.lat then
    item(list, "moe", "u", e.lat, "act", "ns")
    item(list, "moe", "u rstd", 1, "act", "ns"); nograd(list)
    item(list, "moe", "u norm", e.lat, "act", "ns")
    item(list, "moe", "up", d, "act", "")
  else
    item(list, "moe", "u", d, "act", "")
  end
  if e.shared > 0 then
    ffn_items(list, "moe", e.shared)
    item(list, "moe", "shared out", d, "act", "")
  end
end

-- the layers' item lists and each layer's residual sources (the gradients the backward accumulates for them)
local function layer_lists(r, bf16, ckpt_chunks)
  local d, L = r.d, r.L
  local layers, sources, head = {}, {}, {}
  item(head, "embedding", "embedding", d, "act", "ns", true)
  local nb, prefix = 0, true                 -- Block AttnRes bookkeeping: closed blocks, a running prefix exists
  for l = 1, L do
    local list, ns = {}, 1
    local res = r.residual
    -- the mixer-input site
    if res == "attnres_block" then
      if nb > 0 then
        item(list, "residual", "mix", d, "act", "n")
        item(list, "residual", "mix stats", 2 * (nb + 1), "acc", "n"); nograd(list)
        ns = nb + 1
      end
      if (l - 1) % r.B == 0 then nb, prefix = nb + 1, false end
    elseif res == "attnres_full" and l > 1 then
      item(list, "residual", "mix", d, "act", "n")
      item(list, "residual", "mix stats", 2 * (2 * l - 1), "acc", "n"); nograd(list)
      ns = 2 * l - 1
    end
    item(list, "residual", "norm rstd", 1, "act", "n"); nograd(list)
    item(list, "residual", "xn", d, "act", "ns")
    -- the mixer
    if r.schedule[l] == "kda" then kda_items(list, r, ckpt_chunks) else mla_items(list, r) end
    local split = #list + 1                                   -- part 1: the mixer site; part 2: the FFN site
    -- the FFN-input site
    if res == "attnres_block" then
      item(list, "residual", "prefix + m", d, "act", "ns")      -- (selective keeps m instead: same size)
      if prefix then item(list, "residual", "m", d, "act", "") end
      prefix = true
      item(list, "residual", "mix", d, "act", "n")
      item(list, "residual", "mix stats", 2 * (nb + 1), "acc", "n"); nograd(list)
      ns = max(ns, nb + 1)
    elseif res == "attnres_full" then
      item(list, "residual", "m", d, "act", "ns", true)
      item(list, "residual", "mix", d, "act", "n")
      item(list, "residual", "mix stats", 2 * 2 * l, "acc", "n"); nograd(list)
      ns = 2 * l
    else                                                      -- prenorm, gamma chain: x' = x + (chained) m
      local chain = res == "gamma_chain" and in_gamma_range(r, l)
      item(list, "residual", "x + m", d, "act", "ns")
      item(list, "residual", "m", d, "act", "")
      if chain then
        local prev = l > 1 and in_gamma_range(r, l - 1)
        local next_in = l < L and in_gamma_range(r, l + 1)
        if r.gamma_mode == "token" then
          item(list, "residual", "γ logit", 1, "act", "n")
          item(list, "residual", "γ", 1, "act", "n")
        end
        if prev then item(list, "residual", "γ·ā", d, "act", "") end
        -- ā_l: saved by the next layer's γ product (and a checkpoint of the next layer's region)
        item(list, "residual", "ā", d, "act", next_in and "ns" or "", next_in)
        ns = 2
      end
    end
    item(list, "residual", "post norm rstd", 1, "act", "n"); nograd(list)
    item(list, "residual", "xn₂", d, "act", "ns")
    -- the FFN
    if is_moe(r, l) then moe_items(list, r, d, bf16) else ffn_items(list, "ffn", r.ffn_dim) end
    -- the FFN output joins the stream
    if res == "attnres_full" then
      item(list, "residual", "f", d, "act", "ns", true)
    else
      item(list, "residual", "f", d, "act", "")
      item(list, "residual", res == "attnres_block" and "prefix + f" or "x + f", d, "act", "ns", true)
    end
    for i, it in ipairs(list) do it.part = i < split and 1 or 2 end
    layers[l], sources[l] = list, ns
  end
  -- the head: final mix (AttnRes), final RMSNorm, lm_head, cross-entropy; no region in any mode
  if r.residual == "attnres_block" or r.residual == "attnres_full" then
    local n = r.residual == "attnres_block" and nb + 1 or 2 * L + 1
    item(head, "head", "final mix", d, "act", "ns", true)
    item(head, "head", "final stats", 2 * n, "acc", "ns", true)
  end
  item(head, "head", "final rstd", 1, "act", "ns", true)
  item(head, "head", "final norm", d, "act", "ns", true)
  item(head, "head", "logits", r.V, "act", "ns", true)
  item(head, "head", "lse", 1, "act", "ns", true)
  return layers, sources, head
end

-- the CPU allocator's size classes (engine/alloc.c): 64 B doubling to 4 KiB, then + 4 KiB·(s/16 KiB + 1) to
-- 1 MiB, then × 1.25, each rounded up to 64 B
local CLASSES = {}
do
  local s = 64
  for c = 1, 160 do
    CLASSES[c] = s
    if s < 2 ^ 20 then s = s < 4096 and s * 2 or s + 4096 * (floor(s / 16384) + 1) else s = s + floor(s / 4) end
    s = ceil(s / 64) * 64
  end
end
local function size_class(n)
  if n <= 0 then return 0 end
  local lo, hi = 1, #CLASSES
  if n > CLASSES[hi] then return ceil(n / 64) * 64 end
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if CLASSES[mid] >= n then hi = mid else lo = mid + 1 end
  end
  return CLASSES[lo]
end

local DTYPE_BYTES = { f32 = 4, bf16 = 2, f64 = 8 }
local MODES = { layer = true, selective = true, none = true, auto = true }

-- activation_bytes(cfg, T, opts) -> {per_token = total / T, total = the peak bytes of one training step on one
--   sequence of T tokens, breakdown = {category = bytes per token live at that peak: residual, kda, mla, ffn, moe,
--   embedding, head, checkpoints, recompute (the replayed layer), backward (gradients in flight)}, recompute, dtype,
--   device, T, stored (bytes the forward keeps for the backward), allocated and stored_allocated (the same with
--   the CPU allocator's size classes)}
--   T: tokens in the sequence (batch 1); opts.recompute "layer" (default: cfg.recompute or "layer") | "selective" |
--   "none"; opts.dtype "f32" (CPU, default) | "bf16" (CUDA) | "f64"; opts.device (default cpu, cuda for bf16)
function plan.activation_bytes(cfg, T, opts)
  opts = opts or {}
  if type(opts) ~= "table" then bad("opts must be a table, got " .. type(opts)) end
  local r = resolve(cfg)
  pos_int(T, "T")
  local mode = opts.recompute or cfg.recompute or defaults.recompute.mode
  if not MODES[mode] then
    bad(fmt("recompute must be \"auto\", \"layer\", \"selective\" or \"none\", got %s", tostring(mode)))
  end
  local dtype = opts.dtype or "f32"
  local act = DTYPE_BYTES[dtype]
  if not act then bad(fmt("dtype must be \"f32\", \"bf16\" or \"f64\", got %s", tostring(dtype))) end
  local device = opts.device or (dtype == "bf16" and "cuda" or "cpu")
  if device ~= "cpu" and device ~= "cuda" then bad(fmt("device must be \"cpu\" or \"cuda\", got %s", tostring(device))) end
  if mode == "auto" then
    local resolved, auto = plan.auto_recompute(cfg, opts.rows or 1, T, opts)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.recompute = resolved
    local a = plan.activation_bytes(cfg, T, o)
    a.auto = auto
    return a
  end
  local bf16 = dtype == "bf16"
  local size = { act = act, acc = bf16 and 4 or act, i64 = 8 }
  -- CPU KDA keeps a chunk-start state every 16 chunks; the CUDA backward keeps its own (kernels/backend.h)
  local layers, sources, head = layer_lists(r, bf16, device == "cpu" and 16 or 0)

  local function walk(round)
    local function bytes(it)
      local b = (it.per_seq and it.per_seq(T) or it.w * T) * size[it.kind]
      return round and size_class(b) or b
    end
    local function kept(it, in_region)
      if mode == "none" then return it.none end
      if mode == "selective" then return it.sel end
      if in_region then return it.ckpt end
      return it.none
    end
    local d = r.d
    local live, stored = {}, 0
    local function put(cat, b) live[cat] = (live[cat] or 0) + b end
    local function cat_of(it, in_region) return (mode == "layer" and in_region) and "checkpoints" or it.cat end
    for _, it in ipairs(head) do
      if kept(it, false) then put(cat_of(it, false), bytes(it)); stored = stored + bytes(it) end
    end
    local layer_kept, layer_all, layer_wide = {}, {}, {}     -- [l][part]
    for l, list in ipairs(layers) do
      local k, all, wide = { 0, 0 }, { 0, 0 }, { 0, 0 }
      for _, it in ipairs(list) do
        local b, p = bytes(it), it.part
        all[p] = all[p] + b
        if not it.nograd then wide[p] = max(wide[p], b) end
        if kept(it, true) then put(cat_of(it, true), b); k[p] = k[p] + b; stored = stored + b end
      end
      layer_kept[l], layer_all[l], layer_wide[l] = k, all, wide
    end
    local function snapshot(extra)
      local s, sum = {}, 0
      for c, b in pairs(live) do s[c] = b; sum = sum + b end
      for c, b in pairs(extra) do s[c] = (s[c] or 0) + b; sum = sum + b end
      return sum, s
    end
    -- the head's backward: the logits' gradient and the final norm's input gradient
    local function grad(n) local b = n * T * act; return round and size_class(b) or b end
    local peak, at = snapshot({ backward = grad(r.V) + grad(d) })
    local function consider(extra)
      local p, s = snapshot(extra)
      if p > peak then peak, at = p, s end
    end
    for _, it in ipairs(head) do
      if it.cat ~= "embedding" and kept(it, false) then put(cat_of(it, false), -bytes(it)) end
    end
    -- each layer backward: the FFN site (part 2) first, then the mixer site (part 1)
    for l = r.L, 1, -1 do
      local function transient(p) return 2 * layer_wide[l][p] + sources[l] * grad(d) end
      if mode == "layer" then
        -- the layer's own checkpoints are replayed with the rest of it
        put("checkpoints", -(layer_kept[l][1] + layer_kept[l][2]))
        consider({ recompute = layer_all[l][1] + layer_all[l][2], backward = transient(2) })
        consider({ recompute = layer_all[l][1], backward = transient(1) })
      else
        for p = 2, 1, -1 do
          consider({ backward = transient(p) })
          for _, it in ipairs(layers[l]) do if it.part == p and kept(it, true) then put(it.cat, -bytes(it)) end end
        end
      end
    end
    return peak, at, stored
  end

  local total, at, stored = walk(false)
  local allocated, _, stored_alloc = walk(true)
  local breakdown = {}
  for c, b in pairs(at) do if b ~= 0 then breakdown[c] = b / T end end
  return { per_token = total / T, total = total, breakdown = breakdown, recompute = mode, dtype = dtype, device = device,
           T = T, stored = stored, allocated = allocated, stored_allocated = stored_alloc }
end

-- memory_budget(device) -> the bytes recompute = "auto" lets a micro-batch's activations take on `device` ("cpu",
-- "cuda", "cuda:N"): tide.defaults.recompute.auto_fraction of what the device has free plus the engine's cached
-- blocks (reusable), capped by what tide.set_memory_limit leaves; nil where the system reports no figure
function plan.memory_budget(device)
  local tide = require "tide"
  local ok, m = pcall(tide.device_memory, device)
  if not ok then return nil end
  local st = tide.memory(device)
  local b = m.free + st.cached
  if st.limit > 0 then b = math.min(b, st.limit - st.current) end
  return math.max(b, 0) * defaults.recompute.auto_fraction
end

-- auto_recompute(cfg, rows, T, opts) -> mode, {need, budget}: recompute = "auto" for a micro-batch of `rows`
-- sequences of T tokens: "none" when its activations without recompute (the allocator's classes included) fit in
-- opts.budget (bytes; default plan.memory_budget of opts.device or cfg.device), "layer" otherwise (also when the
-- budget is unknown); opts.dtype and opts.device as activation_bytes
function plan.auto_recompute(cfg, rows, T, opts)
  opts = opts or {}
  pos_int(rows, "rows")
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.recompute, o.rows, o.budget = "none", nil, nil
  local need = plan.activation_bytes(cfg, T, o).allocated * rows
  local budget = opts.budget
  if budget == nil then budget = plan.memory_budget(opts.device or (type(cfg) == "table" and cfg.device) or "cpu") end
  if budget ~= nil and (type(budget) ~= "number" or budget ~= budget) then
    bad("budget must be a number of bytes, got " .. tostring(budget))
  end
  return (budget and need <= budget) and "none" or "layer", { need = need, budget = budget }
end

-- static_bytes(cfg, opts) -> {weights (fp32 master), weights_bf16 (the bf16 GEMM copy, bf16 only), grads (fp32),
--   moments (AdamW m and v, fp32), buffers (the QB selection bias, fp32), total, params}
function plan.static_bytes(cfg, opts)
  opts = opts or {}
  if type(opts) ~= "table" then bad("opts must be a table, got " .. type(opts)) end
  local dtype = opts.dtype or "f32"
  if not DTYPE_BYTES[dtype] then bad(fmt("dtype must be \"f32\", \"bf16\" or \"f64\", got %s", tostring(dtype))) end
  local c = plan.count(cfg)
  local r = resolve(cfg)
  local P = c.total
  local master = dtype == "f64" and 8 or 4
  local out = { params = P, weights = master * P, grads = master * P, moments = 2 * master * P, buffers = 0 }
  if dtype == "bf16" then out.weights_bf16 = 2 * P end
  if r.moe then
    local n_moe = 0
    for l = 1, r.L do if is_moe(r, l) then n_moe = n_moe + 1 end end
    out.buffers = 4 * r.moe.n * n_moe
  end
  out.total = out.weights + (out.weights_bf16 or 0) + out.grads + out.moments + out.buffers
  return out
end

-- ---- human units ------------------------------------------------------------------------------------------------
local function sig3(x, units, step)
  local i = 1
  while i < #units and math.abs(x) >= step ^ i * 0.9995 do i = i + 1 end
  local v = x / step ^ (i - 1)
  local s
  if math.abs(v) >= 99.95 or i == 1 and v == floor(v) then s = fmt("%.0f", v)
  elseif math.abs(v) >= 9.995 then s = fmt("%.1f", v)
  else s = fmt("%.2f", v) end
  return s .. units[i]
end

-- 3 significant figures in decimal units: 1234 -> "1.23 KB", 2.9e6 -> "2.90 MB"
function plan.human_bytes(n) return sig3(n, { " B", " KB", " MB", " GB", " TB", " PB" }, 1000) end
-- 2864908 -> "2.86 M"; 2.78e12 -> "2.78 T"
function plan.human_count(n) return sig3(n, { "", " K", " M", " B", " T" }, 1000) end

local function thousands(n)
  local s = fmt("%d", n)
  while true do
    local t = s:gsub("^(-?%d+)(%d%d%d)", "%1,%2")
    if t == s then return s end
    s = t
  end
end

-- describe(cfg, {seq_len, tokens_per_step, dtype, recompute, budget}) -> the start-up summary (a multi-line string;
-- recompute = "auto" is resolved for the step's sequences against `budget` bytes, default plan.memory_budget)
function plan.describe(cfg, opts)
  opts = opts or {}
  if type(opts) ~= "table" then bad("opts must be a table, got " .. type(opts)) end
  local r = resolve(cfg)
  local T = pos_int(opts.seq_len or cfg.max_seq_len or 4096, "seq_len")
  local tokens = pos_int(opts.tokens_per_step or T, "tokens_per_step")
  if tokens % T ~= 0 then bad(fmt("tokens_per_step = %d must be a multiple of seq_len = %d", tokens, T)) end
  local dtype = opts.dtype or cfg.dtype or "f32"
  local mode = opts.recompute or cfg.recompute or defaults.recompute.mode
  local c = plan.count(cfg)
  local n = { kda = 0, mla = 0, moe = 0 }
  for l = 1, r.L do
    n[r.schedule[l]] = n[r.schedule[l]] + 1
    if is_moe(r, l) then n.moe = n.moe + 1 end
  end
  local lines = {}
  local function line(...) lines[#lines + 1] = fmt(...) end
  local res = r.residual .. (r.B and fmt(" (B = %d)", r.B) or "")
  line("model: HybridLM V %s, d %s, L %d (%d KDA, %d MLA%s), residual %s", thousands(r.V), thousands(r.d), r.L, n.kda,
    n.mla, r.moe and fmt("; %d MoE, %d experts top-%d", n.moe, r.moe.n, r.moe.k) or "", res)
  line("parameters: %s total, %s active per token (%s / %s)", plan.human_count(c.total), plan.human_count(c.active),
    thousands(c.total), thousands(c.active))
  local st = plan.static_bytes(cfg, { dtype = dtype })
  line("static: %s (fp32 weights %s%s, grads %s, AdamW m+v %s)", plan.human_bytes(st.total), plan.human_bytes(st.weights),
    st.weights_bf16 and (", bf16 copy " .. plan.human_bytes(st.weights_bf16)) or "", plan.human_bytes(st.grads),
    plan.human_bytes(st.moments))
  local parts = {}
  for _, m in ipairs({ "layer", "selective", "none" }) do
    local a = plan.activation_bytes(cfg, T, { recompute = m, dtype = dtype })
    parts[#parts + 1] = fmt("%s %s", m, plan.human_bytes(a.per_token))
  end
  line("activations per token at T = %s (%s): %s", thousands(T), dtype, table.concat(parts, ", "))
  local seqs = tokens / T
  local a = plan.activation_bytes(cfg, T, { recompute = mode, dtype = dtype, rows = seqs, budget = opts.budget })
  local shown = mode == "auto" and fmt("auto (%s)", a.recompute) or mode
  line("per step: %s tokens = %d x %s, recompute = %s: activations %s + static %s = %s", thousands(tokens), seqs,
    thousands(T), shown, plan.human_bytes(a.total * seqs), plan.human_bytes(st.total), plan.human_bytes(a.total * seqs + st.total))
  return table.concat(lines, "\n")
end

return plan
