-- nn/hybrid.lua — the hybrid language model (spec/mla.md §7, attnres.md §3): an embedding, L layers whose
-- token mixer is KDA or gated NoPE MLA by a layer pattern (3 KDA : 1 MLA, last layer MLA, by default), each
-- followed by a gated FFN (SwiGLU or SiTU-GLU) or, with cfg.moe, a MoE FFN (nn/moe.lua), the sublayers connected by a
-- residual strategy (prenorm, Block or Full Attention Residuals, gamma chain: nn/attnres.lua), a final
-- RMSNorm and an untied head. Names follow formats.md §2 (model.layers.{l}.self_attn..., mlp..., ...).
--
-- Activation memory (long_context.md §4): cfg.recompute says what a training forward keeps for the backward.
--   "layer" (default)  every layer (residual mixes, both norms, mixer, FFN, the residual bookkeeping) is one
--                      recompute region (tide.recompute): the backward keeps only what enters a layer from outside
--                      it — the layer input (Block AttnRes: the current `prefix`; PreNorm / gamma chain: the stream
--                      x and ā; Full AttnRes: the earlier sublayer outputs) and the shared block sources, each
--                      tensor once — and replays the layer's forward in C just before its backward.
--   "selective"        only cheap, memory-heavy pieces are regions: (a) each of the layer's two PreNorm sites —
--                      the residual mix (AttnRes mix / prefix add / gamma update) together with the RMSNorm that
--                      reads it, so the mixed [T, d] input of each norm is not kept (two per layer with AttnRes;
--                      with PreNorm or the gamma chain it is the stream itself, kept anyway: nothing saved). Not
--                      covered, because an engine region replays whole graph nodes: SwiGLU and SiTU-GLU (each one
--                      fused node that saves only its inputs: nothing to drop), the routed experts' activation
--                      (F.moe_experts already recomputes it), the MLA up-projection (its K/V are saved by the
--                      attention node, so dropping them replays the O(T²) attention forward: that is "layer"), the
--                      LatentMoE down-projection (its output is saved by the experts node: dropping it replays the
--                      expert GEMMs). Those need op-level recompute in the engine (an attention op that takes the
--                      latent and W_UKV, mla.md §5).
--   "none"             every op keeps what its backward needs.
-- Recompute applies only while gradients are recorded: under tide.no_grad and for one-token decode steps through
-- caches the forward runs plainly. Lua code runs once per forward in every mode (the engine replays the graph,
-- not the Lua), so caches are written once and the MoE routing statistics are recorded once per forward.
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local Embedding = require "tide.nn.embedding"
local norms = require "tide.nn.norm"
local MLP = require "tide.nn.mlp"
local MoE = require "tide.nn.moe"
local KDA = require "tide.nn.kda"
local MLA = require "tide.nn.mla"
local attnres = require "tide.nn.attnres"
local vision = require "tide.nn.vision"
local generate = require "tide.generate"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F
local C = tide.C

local fmt = string.format

-- errors point at the first caller outside lua/tide (the line that built the model)
local WHO = "nn.HybridLM"
local function bad(msg) options.fail(WHO, msg) end

-- the mixer of every layer (1-based list of "kda" / "mla") from cfg.mixers:
--   "3:1" (default): layer l (0-based) is MLA iff (l + 1) mod 4 = 0 or l = L − 1 (mla.md §7);
--   a pattern of letters K (KDA) and M (MLA) repeated over the layers, e.g. "KKKM", "K", "M"; with
--   cfg.last_mla (default true for "3:1" and patterns containing M) the last layer is MLA;
--   an explicit list {"kda", "mla", ...} of L names.
local function mixer_schedule(cfg)
  local L, spec = cfg.n_layers, cfg.mixers or "3:1"
  local out = {}
  if type(spec) == "table" then
    if #spec ~= L then bad(fmt("mixers lists %d layers but n_layers is %d", #spec, L)) end
    for l, m in ipairs(spec) do
      if m ~= "kda" and m ~= "mla" then bad(fmt("mixers[%d] must be \"kda\" or \"mla\", got %s", l, tostring(m))) end
      out[l] = m
    end
    return out
  end
  if type(spec) ~= "string" then bad("mixers must be \"3:1\", a K/M pattern or a list, got " .. type(spec)) end
  local ratio_k, ratio_m = spec:match("^(%d+):(%d+)$")
  local pattern
  if ratio_k then
    pattern = string.rep("K", tonumber(ratio_k)) .. string.rep("M", tonumber(ratio_m))
  else
    if not spec:match("^[KM]+$") then bad(fmt("mixers pattern must be letters K and M (or \"3:1\"), got \"%s\"", spec)) end
    pattern = spec
  end
  if #pattern == 0 then bad("mixers pattern is empty") end
  for l = 1, L do
    local c = pattern:sub((l - 1) % #pattern + 1, (l - 1) % #pattern + 1)
    out[l] = c == "M" and "mla" or "kda"
  end
  local last_mla = cfg.last_mla
  if last_mla == nil then last_mla = pattern:find("M", 1, true) ~= nil end
  if last_mla then out[L] = "mla" end
  return out
end

local Layer = M.Module:extend("HybridLayer")

function Layer:init(cfg, mixer, l)
  local out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
  local po = { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device }
  self.mixer, self.index = mixer, l
  self:child("input_layernorm", norms.RMSNorm(cfg.dim, po))
  if mixer == "kda" then
    local o = { std = cfg.init_std, out_std = out_std, dtype = cfg.dtype, device = cfg.device, norm_eps = cfg.norm_eps }
    for k, v in pairs(cfg.kda or {}) do o[k] = v end
    self:child("self_attn", KDA(cfg.dim, o))
  else
    local o = { std = cfg.init_std, out_std = out_std, dtype = cfg.dtype, device = cfg.device, norm_eps = cfg.norm_eps }
    for k, v in pairs(cfg.mla or {}) do o[k] = v end
    self:child("self_attn", MLA(cfg.dim, o))
  end
  self:child("post_attention_layernorm", norms.RMSNorm(cfg.dim, po))
  local moe = cfg.moe
  if moe and (l > 1 or moe.first_dense == false) then
    -- a MoE FFN (moe.md §1: layer 0 dense unless first_dense = false); names per formats.md §2
    local o = { std = cfg.init_std, out_std = out_std, activation = cfg.activation, norm_eps = cfg.norm_eps,
      dtype = cfg.dtype, device = cfg.device }
    for k, v in pairs(moe) do if k ~= "first_dense" then o[k] = v end end
    self.ffn = self:child("block_sparse_moe", MoE(cfg.dim, o))
  else
    self.ffn = self:child("mlp", MLP(cfg.dim, cfg.ffn_dim, { activation = cfg.activation, std = cfg.init_std,
      out_std = out_std, dtype = cfg.dtype, device = cfg.device }))
  end
end

-- the token mixer on the PreNorm'd xn; with a cache, one token goes through the decode path
function Layer:mix(xn, cache, opts)
  local a = self.self_attn
  if self.mixer == "kda" then
    local o = { cache = cache, cu_seqlens = opts and opts.cu_seqlens, reset = opts and opts.reset, cp = opts and opts.cp }
    if cache and (xn:size(2) == 1 or (opts and opts.exact)) then o.path = "recurrent" end
    return a:forward(xn, o)
  end
  if opts and opts.reset then bad("reset applies to KDA caches; an MLA layer's cache cannot restart a row") end
  return a:forward(xn, { cache = cache, cu_seqlens = opts and opts.cu_seqlens, exact = opts and opts.exact,
    cp = opts and opts.cp })
end

local Body = M.Module:extend("HybridBody")

function Body:init(cfg, schedule, res)
  self.cfg, self.auto_modes = cfg, {}
  self:child("embed_tokens", Embedding(cfg.vocab_size, cfg.dim, { std = cfg.init_std, dtype = cfg.dtype, device = cfg.device }))
  local layers = M.ModuleList()
  for l = 1, cfg.n_layers do
    local layer = Layer(cfg, schedule[l], l)
    res:attach_layer(layer, l)
    layers:append(layer)
  end
  self:child("layers", layers)
  res:attach_model(self)
  self:child("norm", norms.RMSNorm(cfg.dim, { eps = cfg.norm_eps, dtype = cfg.dtype, device = cfg.device }))
  self.res = res
end

-- runs fn(...) as a recompute region when `on`, plainly otherwise
local function region(on, fn, ...)
  if on then return tide.recompute(fn, ...) end
  return fn(...)
end

-- the two PreNorm sites: the residual mix and the norm that reads it (one region each in "selective")
local function mixer_input(res, st, l, layer) return layer.input_layernorm:forward(res:before_mixer(st, l)) end
local function ffn_input(res, st, l, layer, m, xn)
  return layer.post_attention_layernorm:forward(res:before_ffn(st, l, m, xn))
end

-- one layer on the residual state st: the whole layer is a region in "layer" mode (the caller wraps it)
local function layer_step(layer, res, st, l, cache, opts, selective)
  local xn = region(selective, mixer_input, res, st, l, layer)
  local m = layer:mix(xn, cache, opts)
  res:after_ffn(st, l, layer.ffn:forward(region(selective, ffn_input, res, st, l, layer, m, xn)))
end

-- the recompute mode a forward of ids [B, T] runs in: recompute only matters while the graph is recorded, and a
-- decode step (caches, one token per row) runs plainly
function Body:recompute_mode(ids, caches)
  if not tide.grad_enabled() or (caches and ids:size(2) == 1) then return "none" end
  if self.recompute == "auto" then return (self:auto_mode(ids:size(1), ids:size(2))) end
  return self.recompute
end

-- auto_mode(B, T) -> mode, {need, budget}: recompute = "auto" resolved for micro-batches of B rows of T tokens
-- (nn.plan.auto_recompute against the device's budget now), decided once per shape so that every step of a stage
-- runs in the mode it started with (and the one the start-up line printed)
function Body:auto_mode(B, T)
  local key = B .. "x" .. T
  local got = self.auto_modes[key]
  if not got then
    local c = self.cfg
    local dtype = (c.dtype == "f64" or c.dtype == "bf16") and c.dtype or "f32"
    local device = tostring(c.device or "cpu"):match("^cuda") and "cuda" or "cpu"
    local mode, info = require("tide.nn.plan").auto_recompute(c, B, T,
      { dtype = dtype, device = device, budget = self.auto_budget })
    -- several ranks: one decision for all of them (a recompute replays the layer's exchanges: with ep or cp, ranks
    -- in different modes would wait on different collectives); "layer" when any rank's budget is short
    if self.auto_group then
      local short = self.auto_group.sums({ mode == "none" and 0 or 1 })[1]
      mode = short > 0 and "layer" or "none"
    end
    got = { mode = mode, info = info }
    self.auto_modes[key] = got
  end
  return got.mode, got.info
end

-- forward_layer(st, l, cache, opts, mode): layer l (1-based) on the residual state st = res:begin(embedding), in
-- `mode` (from recompute_mode); the loop body of forward, public for benchmarks that time the layers one by one
function Body:forward_layer(st, l, cache, opts, mode)
  region(mode == "layer", layer_step, self.layers:get(l), self.res, st, l, cache, opts, mode == "selective")
  -- what a region dropped is Lua garbage now, but the collector cannot see tensor bytes: collect at the layer
  -- boundary (a full collection of the small Lua heap takes ~0.1 ms) so the forward's peak is the checkpoints
  -- plus one layer's working set, not whatever the allocation-pressure collector lets pile up
  if mode ~= "none" then tide.collect() end
end

function Body:forward(ids, caches, opts)
  local mode = self:recompute_mode(ids, caches)
  local E = self.embed_tokens:forward(ids)
  -- the image tokens replace the embeddings of their <|media_pad|> placeholders (vision.md §7)
  if opts and opts.image_embeds then E = vision.splice(E, ids, opts.image_embeds, opts.pad_id) end
  local st = self.res:begin(E)
  for l = 1, self.layers.n do self:forward_layer(st, l, caches and caches[l], opts, mode) end
  return self.norm:forward(self.res:final(st))
end

local HybridLM = M.Module:extend("HybridLM")

local DEFAULTS = {
  vocab_size = 320, dim = 128, n_layers = 8, mixers = "3:1", ffn_dim = 384, activation = "swiglu",
  norm_eps = defaults.norm_eps, init_std = defaults.init_std, max_seq_len = 1048576, residual = "attnres_block", dtype = "f32", device = "cpu",
  recompute = defaults.recompute.mode,
}
local KEYS = {
  vocab_size = true, dim = true, n_layers = true, mixers = true, last_mla = true, kda = true, mla = true, ffn_dim = true,
  activation = true, norm_eps = true, init_std = true, max_seq_len = true, residual = true, attnres = true,
  gamma_chain = true, dtype = true, device = true, kind = true, moe = true, recompute = true, vision = true,
}
HybridLM.DEFAULTS, HybridLM.KEYS = DEFAULTS, KEYS
local RECOMPUTE = { auto = true, layer = true, selective = true, none = true }

local function check_recompute(mode)
  if not RECOMPUTE[mode] then
    bad(fmt("recompute must be \"auto\", \"layer\", \"selective\" or \"none\", got %s", type(mode) == "string"
      and ("\"" .. mode .. "\"") or tostring(mode)))
  end
  return mode
end

-- HybridLM(cfg): cfg fields above; kda = nn.KDA options (heads, head_dim, ...), mla = nn.MLA options
-- (heads, q_rank, kv_rank, nope_dim, rope_dim, v_dim, gate); residual = "prenorm" | "attnres_block" (default,
-- attnres = {block_layers = B}) | "attnres_full" | "gamma_chain" (gamma_chain = {mode, layers = {first, last}}:
-- the chain over a 1-based inclusive range of layers, the others plain PreNorm); moe = nn.MoE options (n_experts,
-- top_k, expert_dim, latent_dim, ...; first_dense = true keeps layer 0 a dense cfg.ffn_dim FFN, moe.md §1);
-- recompute = "auto" (default) | "layer" | "selective" | "none" (activation memory, the top of this file).
function HybridLM:init(cfg)
  local c = options.with_defaults(cfg or {}, DEFAULTS, KEYS, "config", WHO)
  if c.residual == "attnres_block" and not c.attnres then c.attnres = { block_layers = 2 } end
  self.cfg = c
  self.schedule = mixer_schedule(c)
  local need = {}
  for _, m in ipairs(self.schedule) do need[m] = true end
  if need.kda and not c.kda then bad("a KDA layer needs cfg.kda = {heads, head_dim, ...}") end
  if need.mla and not c.mla then bad("an MLA layer needs cfg.mla = {heads, kv_rank, nope_dim, rope_dim, v_dim, ...}") end
  local rc = attnres.residual_config(c)
  local res = attnres.Residual(rc.kind, { dim = c.dim, n_layers = c.n_layers, block_layers = rc.block_layers,
    gamma_mode = rc.gamma_mode, gamma_range = rc.gamma_range, eps = rc.eps, dtype = c.dtype, device = c.device })
  check_recompute(c.recompute)
  self:child("model", Body(c, self.schedule, res))
  self:child("lm_head", Linear(c.dim, c.vocab_size, { std = c.init_std, dtype = c.dtype, device = c.device }))
  if c.vision then
    -- the vision encoder and projector (vision.md): images in the batch become tokens of the same sequence
    local vc = vision.config(c.vision, c.dim)
    if vc.init_std == nil then vc.init_std = c.init_std end
    self.vision_cfg = vc
    self:child("vision_tower", vision.VisionEncoder(vc, { dtype = c.dtype, device = c.device }))
    self:child("multi_modal_projector", vision.Projector(vc, { dtype = c.dtype, device = c.device }))
  end
  self:set_recompute(c.recompute)
end

-- the parameter groups a curriculum stage may freeze (vision.md §10): "vit" (vision_tower.*), "projector"
-- (multi_modal_projector.*), "lm" (everything else)
local FREEZE_GROUPS = { vit = "vision_tower.", projector = "multi_modal_projector.", lm = true }

local function group_of(name)
  for g, prefix in pairs(FREEZE_GROUPS) do
    if prefix ~= true and name:sub(1, #prefix) == prefix then return g end
  end
  return "lm"
end

-- set_frozen(list) -> the number of frozen parameters: the parameters of every named group stop requiring
-- gradients (no gradient, so the optimiser leaves them and their moments alone); every other parameter trains.
-- set_frozen({}) or nil unfreezes everything.
function HybridLM:set_frozen(list)
  local frozen = {}
  if list ~= nil and type(list) ~= "table" then bad("freeze must be a list of \"vit\", \"projector\", \"lm\", got " .. type(list)) end
  for i, g in ipairs(list or {}) do
    if not FREEZE_GROUPS[g] then
      bad(fmt("freeze[%d] = %s: the groups are \"vit\", \"projector\" and \"lm\"", i, tostring(g)))
    end
    if g ~= "lm" and not self.vision_tower then bad(fmt("freeze[%d] = \"%s\" needs a model with vision", i, g)) end
    frozen[g] = true
  end
  local n = 0
  for name, t in self:named_parameters() do
    local f = frozen[group_of(name)] == true
    if f then n = n + 1 end
    if t:requires_grad() == f then t:requires_grad_(not f) end
  end
  self.frozen = list or {}
  return n
end

-- encode_images(images) -> [Σ N_i, dim]: images = {patches [Σ L, 3p²], grids = {{h, w}, ...}} through the encoder,
-- merge and projector
-- (mode: the recompute mode of the batch's language-model forward, which forward passes; by default the model's,
-- "auto" counting as "layer")
function HybridLM:encode_images(images, mode)
  if not self.vision_tower then bad("the batch holds images but the model has no vision encoder (model.vision)") end
  if type(images) ~= "table" then bad("images must be a table {patches, grids}, got " .. type(images)) end
  mode = tide.grad_enabled() and (mode or self.cfg.recompute) or "none"
  local x = self.vision_tower:forward(images.patches, images.grids, mode ~= "none" and tide.recompute or nil)
  return self.multi_modal_projector:forward(x, images.grids)
end

-- set_recompute(mode, budget): switch the activation-memory mode ("auto", "layer", "selective", "none") of this model;
-- the weights and every result stay the same, only what the backward keeps changes. budget (bytes, "auto" only):
-- what a micro-batch's activations may take instead of nn.plan.memory_budget's share of the device
function HybridLM:set_recompute(mode, budget)
  check_recompute(mode)
  if budget ~= nil then options.positive_number(budget, "recompute budget", WHO) end
  self.cfg.recompute, self.model.recompute = mode, mode
  self.model.auto_modes, self.model.auto_budget = {}, budget
end

-- forward(ids [B, T] int, caches, opts) -> logits [B, T, V]; opts.cu_seqlens packs documents (every layer
-- masks or resets at the boundaries), opts.reset restarts KDA rows (nn.KDA:forward)
-- opts.exact (with caches, under no_grad): schedule-invariant: each token's logits and the caches are bitwise
-- what one-token decode steps give, whatever the split of the sequence into calls (prefill T tokens, then decode
-- one at a time, then feed a tool result == one call over all of it); slower than the chunked prefill
-- opts.last: the logits of the last position only ([B, 1, V]; under exact, the same bits as that position of the whole)
-- opts.images = {patches, grids, pad_id, rows}: the batch's packed images (vision.md §3, §7), spliced at the
-- <|media_pad|> placeholders of ids (pad_id, else model.vision.media_pad); rows (0-based, optional): only these image
-- tokens, in this order (a cp rank's slices: step.cp_slice)
function HybridLM:forward(ids, caches, opts)
  if opts and opts.images then
    local im = opts.images
    local o = {}
    for k, v in pairs(opts) do if k ~= "images" then o[k] = v end end
    local mode = self.model:recompute_mode(ids, caches)
    if not im.rows then o.image_embeds = self:encode_images(im, mode)
    elseif #im.rows > 0 then
      -- context parallelism (step.cp_slice): the image tokens this rank's slices hold, in slice order (none: no
      -- placeholder here, nothing to encode)
      local e = self:encode_images(im, mode)
      o.image_embeds = e:index_select(1, tide.tensor(im.rows, { dtype = "i64", device = e:device() }))
    end
    o.pad_id = im.pad_id or (self.vision_cfg and self.vision_cfg.media_pad)
    opts = o
  end
  local exact = opts and opts.exact
  if exact then
    if not caches then bad("forward: exact = true runs on caches (new_cache())") end
    if tide.grad_enabled() then bad("forward: exact = true runs without gradients (under no_grad)") end
    if opts.cu_seqlens then bad("forward: exact = true takes one document per row (no cu_seqlens)") end
  end
  if caches and (exact or ids:size(2) == 1) then
    -- a decode step: batch-invariant products, so a row's logits do not depend on the rows that share its step;
    -- exact: the T tokens with a decode step's arithmetic (KDA's token recurrence, MLA absorbed over the latents),
    -- so each token's bits do not depend on how a sequence is split into calls
    local prev = C.tide_set_batch_invariant(1)
    local ok, out = pcall(self.logits_of, self, ids, caches, opts)
    C.tide_set_batch_invariant(prev)
    if not ok then error(out, 0) end
    return out
  end
  return self:logits_of(ids, caches, opts)
end

-- forward(ids, caches, {exact = true}) is schedule-invariant (rl.rollout runs every forward so)
HybridLM.schedule_invariant = true

function HybridLM:logits_of(ids, caches, opts)
  local h = self.model:forward(ids, caches, opts)
  if opts and opts.last and h:size(2) > 1 then h = h:narrow(2, h:size(2), 1) end
  return self.lm_head:forward(h)
end

-- decode_rows(ids [R, 1] int, caches = {R caches of new_cache()}) -> logits [R, 1, V]: one decoding step of R rows
-- that each carry their own caches, of any lengths (the rows of a rollout); row r's logits and caches are bitwise
-- what its own step (R = 1) gives
function HybridLM:decode_rows(ids, caches)
  if type(caches) ~= "table" or #caches ~= ids:size(1) then
    bad(fmt("decode_rows: caches must list one cache per row of ids (%d), got %s", ids:size(1),
      type(caches) == "table" and tostring(#caches) or type(caches)))
  end
  local layers = {}
  for l = 1, self.cfg.n_layers do
    local rows = {}
    for r = 1, #caches do rows[r] = caches[r][l] end
    layers[l] = { rows = rows }
  end
  return self:forward(ids, layers)
end

function HybridLM:loss(ids, targets, opts)
  local logits = self:forward(ids, nil, opts)
  local loss = F.cross_entropy(logits, targets)
  for _, m in ipairs(self:moe_layers()) do
    if m.aux_loss then loss = loss + m.aux_loss end      -- balance = "aux" (moe.md §4.2)
  end
  return loss
end

-- the MoE FFNs, in layer order (empty for a dense model)
function HybridLM:moe_layers()
  local out = {}
  for l = 1, self.cfg.n_layers do
    local f = self.model.layers:get(l).block_sparse_moe
    if f then out[#out + 1] = f end
  end
  return out
end

-- balance_step(opts): every MoE layer's balancer, after the optimiser step (moe.md §4); opts.discard for a skipped step
function HybridLM:balance_step(opts)
  for _, m in ipairs(self:moe_layers()) do m:balance_step(opts) end
end

-- moe_metrics() -> {[layer index, 0-based] = that layer's MoE metrics (moe.md §5)}
function HybridLM:moe_metrics()
  local out = {}
  for l = 1, self.cfg.n_layers do
    local f = self.model.layers:get(l).block_sparse_moe
    if f then out[l - 1] = f:metrics() end
  end
  return out
end

-- one cache per layer: KDA {state, conv} (fixed size), MLA {c, k_r} (the latent, d_c + d_r values a token)
function HybridLM:new_cache()
  local caches = {}
  for l = 1, self.cfg.n_layers do caches[l] = { pos = 0 } end
  return caches
end

function HybridLM:cache_grows()
  for _, m in ipairs(self.schedule) do if m == "mla" then return true end end
  return false
end

-- generate(prompts, opts) -> the generated ids: prompts is one list of token ids, or a list of lists (a
-- batch: rows of equal length run as one [B, T] batch, otherwise row by row); opts: max_new (32),
-- temperature (0 = greedy), top_k, top_p, stop (an id or a list of ids), seed (0). Decoding runs on the
-- caches: KDA layers cost the same per token whatever the prompt length, MLA layers attend in the latent.
-- set_recompute_group(group): the job's dist group (step.stepper sets it with several ranks): recompute = "auto" is
-- then decided for all ranks at once, a collective at the first training forward of each micro-batch shape
function HybridLM:set_recompute_group(group)
  self.model.auto_group = group
  self.model.auto_modes = {}
end

-- recompute_for(B, T) -> mode, info: the mode a training forward of B rows of T tokens runs in; for recompute =
-- "auto" the decision (made once per shape) and info = {need = the activation bytes without recompute, budget}
function HybridLM:recompute_for(B, T)
  if self.cfg.recompute == "auto" then return self.model:auto_mode(B, T) end
  return self.cfg.recompute
end

function HybridLM:generate(prompts, opts)
  return generate.ids(self, prompts, opts)
end

function HybridLM:extra_repr()
  local c, n = self.cfg, { kda = 0, mla = 0 }
  for _, m in ipairs(self.schedule) do n[m] = n[m] + 1 end
  return fmt("V=%d, d=%d, L=%d (%d KDA, %d MLA), ffn=%d %s, residual=%s, recompute=%s, %d params", c.vocab_size, c.dim,
    c.n_layers, n.kda, n.mla, c.ffn_dim, c.activation, c.residual, c.recompute, self:num_parameters())
end

return { HybridLM = HybridLM, mixer_schedule = mixer_schedule }
