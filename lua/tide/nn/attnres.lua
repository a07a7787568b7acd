-- nn/attnres.lua — Attention Residuals (spec/attnres.md) and the residual strategies a layer loop drives.
--
--   nn.AttnRes(d, {eps})     one mixing site: `proj` [1, d] (its row is the pseudo-query w, init 0) and `norm` ν [d]
--                            (init 1), neither decayed (optim.md §1); forward({v_1, ..., v_N}) = F.attnres (§1).
--   nn.Residual(kind, opts)  how a stack's sublayers are connected: "prenorm", "attnres_block" (§3, the main
--                            method), "attnres_full" (§2) or "gamma_chain" (§6, an ablation). One interface:
--
--     res:attach_layer(layer, l)   put layer l's parameters on the layer module (checkpoint names, formats.md §2)
--     res:attach_model(model)      put the final mix's on the model body (model.output_attn_res_{norm,proj})
--     local st = res:begin(x0)     x0 = the embedding
--     for l = 1, L do
--       local h = res:before_mixer(st, l)          -- the mix before the mixer
--       local xn = layer.input_layernorm(h)
--       h = res:before_ffn(st, l, mixer(xn), xn)   -- adds the mixer output, then the mix before the FFN
--       res:after_ffn(st, l, ffn(layer.post_attention_layernorm(h)))
--     end
--     local h_out = res:final(st)                  -- the final mix, before the final norm
--
-- xn (the layer's PreNorm'd input) is read only by the gamma chain's token mode. l is 1-based; the spec's layer
-- index is l − 1. The state `st` is per forward: `blocks` + `prefix` (Block), `ys` (Full), `x` (+ `abar`, gamma).
local tide = require "tide"
local M = require "tide.nn.module"
local norms = require "tide.nn.norm"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F

local fmt = string.format

-- errors point at the first caller outside lua/tide
local bad = options.fail
local function pos_int(who, v, name) return options.pos_int(v, name, who) end

-- opts (nil: none) checked against known; `where` names a sub-table in the message
local function check_opts(who, opts, known, where)
  if opts == nil then return {} end
  return options.check(opts, known, where, who)
end

-- ---- AttnRes: one mixing site ------------------------------------------------------------------------------
-- a Linear-style [1, d] row (the checkpoint stores w as nn.Linear(d, 1).weight); zero init, no decay
local Row = M.Module:extend("AttnResProj")

function Row:init(d, opts)
  self.dim = d
  self:param("weight", tide.zeros({ 1, d }, { dtype = opts.dtype or "f32", device = opts.device }), { decay = false })
end

function Row:forward(x) return F.linear(x, self.weight) end
function Row:extra_repr() return fmt("%d -> 1, zero init", self.dim) end

local AttnRes = M.Module:extend("AttnRes")
local ATTNRES_KEYS = { eps = true, dtype = true, device = true }

-- AttnRes(d, {eps = 1e-5, dtype, device}); eps is the key-RMSNorm eps (K3: rms_norm_eps = 1e-5, §1)
function AttnRes:init(d, opts)
  opts = check_opts("nn.AttnRes", opts, ATTNRES_KEYS)
  self.dim, self.eps = pos_int("nn.AttnRes", d, "d"), opts.eps or defaults.norm_eps
  if type(self.eps) ~= "number" or not (self.eps >= 0) then bad("nn.AttnRes", "eps must be a number >= 0, got " .. tostring(opts.eps)) end
  self:child("proj", Row(d, opts))
  self:child("norm", norms.RMSNorm(d, { eps = self.eps, dtype = opts.dtype, device = opts.device }))
end

-- forward({v_1, ..., v_N}) -> Σ_i p_i v_i over sources of one shape [..., d]
function AttnRes:forward(sources)
  return F.attnres(sources, self.proj.weight, self.norm.weight, { eps = self.eps })
end

function AttnRes:extra_repr() return fmt("%d, eps=%g", self.dim, self.eps) end

-- AttnRes.attach(parent, site, d, opts): a site whose two modules are children of parent named <site>_proj and
-- <site>_norm (model.layers.3.self_attention_res_proj.weight, formats.md §2); parent[site] is the AttnRes
-- (a plain field, so each parameter has one name)
function AttnRes.attach(parent, site, d, opts)
  local ar = AttnRes(d, opts)
  parent:child(site .. "_proj", ar.proj)
  parent:child(site .. "_norm", ar.norm)
  parent[site] = ar
  return ar
end

-- ---- residual strategies ---------------------------------------------------------------------------------------
local KINDS = { prenorm = true, attnres_block = true, attnres_full = true, gamma_chain = true }
local GAMMA_MODES = { scalar = true, channel = true, token = true }
local RESIDUAL_KEYS = { dim = true, n_layers = true, block_layers = true, gamma_mode = true, gamma_range = true,
                        eps = true, dtype = true, device = true }

local function kinds_list() return "\"prenorm\", \"attnres_block\", \"attnres_full\" or \"gamma_chain\"" end

-- Residual.config(cfg): the residual part of a model config, checked (attnres.md §7). cfg.residual is the
-- kind (default "attnres_block"); cfg.attnres = {block_layers = B, eps} and cfg.gamma_chain = {mode} are the
-- options of each (false or nil = none). The gamma chain is an ablation OF AttnRes, so combining them is an
-- error (§6). Returns {kind, block_layers, gamma_mode, eps}.
local function config(cfg)
  local who = "residual"
  cfg = cfg or {}
  local kind = cfg.residual
  if kind == nil then kind = "attnres_block" end
  if type(kind) == "table" then
    local parts = {}
    for _, v in ipairs(kind) do parts[#parts + 1] = tostring(v) end
    local has_gamma, has_ar = false, false
    for _, v in ipairs(kind) do
      has_gamma = has_gamma or v == "gamma_chain"
      has_ar = has_ar or v == "attnres_block" or v == "attnres_full"
    end
    if has_gamma and has_ar then
      bad(who, fmt("{%s}: the gamma chain cannot be combined with AttnRes (attnres.md §6); pick one", table.concat(parts, ", ")))
    end
    bad(who, fmt("must be one of %s, got the list {%s}", kinds_list(), table.concat(parts, ", ")))
  end
  if not KINDS[kind] then bad(who, fmt("must be one of %s, got %s", kinds_list(), tostring(kind))) end
  local ar, gc = cfg.attnres or nil, cfg.gamma_chain or nil
  if ar and type(ar) ~= "table" then bad(who, "attnres must be a table {block_layers, eps}, got " .. type(ar)) end
  if gc and type(gc) ~= "table" then bad(who, "gamma_chain must be a table {mode}, got " .. type(gc)) end
  if kind == "gamma_chain" and ar then
    bad(who, "residual = \"gamma_chain\" cannot be combined with attnres options (attnres.md §6); remove attnres or pick an AttnRes kind")
  end
  if (kind == "attnres_block" or kind == "attnres_full") and gc then
    bad(who, fmt("residual = \"%s\" cannot be combined with gamma_chain options (attnres.md §6)", kind))
  end
  check_opts(who, ar, { block_layers = true, eps = true }, "attnres")
  check_opts(who, gc, { mode = true, layers = true }, "gamma_chain")
  local out = { kind = kind, eps = (ar and ar.eps) or defaults.norm_eps }
  if kind == "attnres_block" then
    local B = ar and ar.block_layers
    if B == nil then bad(who, "attnres_block needs attnres.block_layers (B, in layers; K3 12, tiny 2)") end
    out.block_layers = pos_int(who, B, "attnres.block_layers")
  end
  if kind == "gamma_chain" then
    out.gamma_mode = (gc and gc.mode) or "scalar"
    if not GAMMA_MODES[out.gamma_mode] then
      bad(who, fmt("gamma_chain.mode must be \"scalar\", \"channel\" or \"token\", got %s", tostring(out.gamma_mode)))
    end
    out.gamma_range = gc and gc.layers
  end
  return out
end

local function cat(list, x)
  local out = {}
  for i, v in ipairs(list) do out[i] = v end
  out[#out + 1] = x
  return out
end

-- the AttnRes sites of one layer: self_attention_res (before the mixer), mlp_res (before the FFN)
local function attach_sites(self, layer, l)
  local o = { eps = self.eps, dtype = self.dtype, device = self.device }
  self.sites[l] = { attn = AttnRes.attach(layer, "self_attention_res", self.dim, o),
                    mlp = AttnRes.attach(layer, "mlp_res", self.dim, o) }
end

local function attach_output(self, model)
  self.out = AttnRes.attach(model, "output_attn_res", self.dim, { eps = self.eps, dtype = self.dtype, device = self.device })
end

local function site(self, l, which)
  local s = self.sites[l]
  if not s then bad("nn.Residual", fmt("layer %d has no AttnRes parameters: call attach_layer(layer, %d) first", l, l)) end
  return s[which]
end

local function final_site(self)
  if not self.out then bad("nn.Residual", "the final mix has no parameters: call attach_model(model) first") end
  return self.out
end

-- prenorm: x += mixer(norm(x)); x += ffn(norm(x))
local Prenorm = {}
Prenorm.__index = Prenorm
function Prenorm:attach_layer() end
function Prenorm:attach_model() end
function Prenorm:begin(x0) return { x = x0 } end
function Prenorm:before_mixer(st) return st.x end
function Prenorm:before_ffn(st, _, m) st.x = st.x + m; return st.x end
function Prenorm:after_ffn(st, _, f) st.x = st.x + f end
function Prenorm:final(st) return st.x end

-- Block AttnRes (§3): blocks = {embedding, one plain sum per completed block of B layers}, prefix = the running
-- sum of the current block's sublayer outputs; every sublayer reads the mix of blocks ++ {prefix}
local Block = {}
Block.__index = Block
Block.attach_layer, Block.attach_model = attach_sites, attach_output
function Block:begin(x0) return { blocks = {}, prefix = x0 } end
-- the sources the next mix reads
function Block:sources(st) return cat(st.blocks, st.prefix) end
function Block:before_mixer(st, l)
  local h = #st.blocks > 0 and site(self, l, "attn"):forward(self:sources(st)) or st.prefix
  if (l - 1) % self.block_layers == 0 then        -- close a block (l = 1: the embedding becomes block 0)
    st.blocks[#st.blocks + 1] = st.prefix
    st.prefix = nil
  end
  return h
end
function Block:before_ffn(st, l, m)
  st.prefix = st.prefix and st.prefix + m or m
  return site(self, l, "mlp"):forward(self:sources(st))   -- always >= 2 sources
end
function Block:after_ffn(st, _, f) st.prefix = st.prefix + f end
function Block:final(st) return final_site(self):forward(self:sources(st)) end

-- Full AttnRes (§2): sublayer k reads the mix of y_0 (embedding), ..., y_{k−1}
local Full = {}
Full.__index = Full
Full.attach_layer, Full.attach_model = attach_sites, attach_output
function Full:begin(x0) return { ys = { x0 } } end
function Full:sources(st) return st.ys end
function Full:before_mixer(st, l)
  if #st.ys == 1 then return st.ys[1] end           -- one source: the mix is the identity
  return site(self, l, "attn"):forward(st.ys)
end
function Full:before_ffn(st, l, m)
  st.ys[#st.ys + 1] = m
  return site(self, l, "mlp"):forward(st.ys)
end
function Full:after_ffn(st, _, f) st.ys[#st.ys + 1] = f end
function Full:final(st) return final_site(self):forward(st.ys) end

-- the gamma chain (§6): ā_l = m_l + γ_l ⊙ ā_{l−1} (ā before the first layer is 0), x += ā_l; γ = 0 at init is
-- PreNorm exactly. γ_l per mode: `scalar` [1], `channel` [d] (param attn_gamma), `token` γ_t = tanh(ψᵀ x̂_t) with
-- ψ in attn_gamma_proj.weight [1, d]. No weight decay on γ or ψ (optim.md §1).
local Gamma = {}
Gamma.__index = Gamma
-- the chain runs over layers gamma_range = {first, last} (1-based, inclusive; default all): outside it a layer
-- is plain PreNorm and carries nothing, and the chain restarts (ā = m) at `first`
function Gamma:in_range(l)
  local r = self.gamma_range
  return not r or (l >= r[1] and l <= r[2])
end
function Gamma:attach_layer(layer, l)
  if not self:in_range(l) then return end
  local o = { dtype = self.dtype or "f32", device = self.device }
  if self.gamma_mode == "token" then
    local row = Row(self.dim, o)
    layer:child("attn_gamma_proj", row)
    self.sites[l] = row
  else
    local g = tide.zeros({ self.gamma_mode == "scalar" and 1 or self.dim }, o)
    layer:param("attn_gamma", g, { decay = false })
    self.sites[l] = layer
  end
end
function Gamma:attach_model() end
function Gamma:begin(x0) return { x = x0 } end
function Gamma:before_mixer(st) return st.x end
-- γ_l for this call: [1], [d] or [..., 1] (token: from the layer's PreNorm'd input xn)
function Gamma:gamma(l, xn)
  local s = self.sites[l]
  if not s then bad("nn.Residual", fmt("layer %d has no gamma parameter: call attach_layer(layer, %d) first", l, l)) end
  if self.gamma_mode ~= "token" then return s.attn_gamma end
  if xn == nil then bad("nn.Residual", "gamma_chain mode \"token\" needs the layer's PreNorm'd input: before_ffn(st, l, m, xn)") end
  return s:forward(xn):tanh()
end
function Gamma:before_ffn(st, l, m, xn)
  if not self:in_range(l) then
    st.abar = nil
    st.x = st.x + m
    return st.x
  end
  st.abar = st.abar and m + st.abar * self:gamma(l, xn) or m
  st.x = st.x + st.abar
  return st.x
end
function Gamma:after_ffn(st, _, f) st.x = st.x + f end
function Gamma:final(st) return st.x end

local CLASSES = { prenorm = Prenorm, attnres_block = Block, attnres_full = Full, gamma_chain = Gamma }

-- Residual(kind, {dim, n_layers, block_layers (attnres_block), gamma_mode = "scalar" (gamma_chain), eps = 1e-5,
-- dtype, device}) -> a strategy with the interface at the top of this file
local function Residual(kind, opts)
  local who = "nn.Residual"
  opts = check_opts(who, opts, RESIDUAL_KEYS)
  if not KINDS[kind] then bad(who, fmt("kind must be one of %s, got %s", kinds_list(), tostring(kind))) end
  local self = setmetatable({ kind = kind, sites = {}, eps = opts.eps or defaults.norm_eps, dtype = opts.dtype, device = opts.device },
                            CLASSES[kind])
  if kind ~= "prenorm" then self.dim = pos_int(who, opts.dim, "dim") end
  if opts.n_layers ~= nil then self.n_layers = pos_int(who, opts.n_layers, "n_layers") end
  if kind == "attnres_block" then
    if opts.block_layers == nil then bad(who, "attnres_block needs block_layers (B, in layers)") end
    self.block_layers = pos_int(who, opts.block_layers, "block_layers")
  elseif opts.block_layers ~= nil then
    bad(who, fmt("block_layers is an option of attnres_block, not of %s", kind))
  end
  if kind == "gamma_chain" then
    self.gamma_mode = opts.gamma_mode or "scalar"
    if not GAMMA_MODES[self.gamma_mode] then
      bad(who, fmt("gamma_mode must be \"scalar\", \"channel\" or \"token\", got %s", tostring(self.gamma_mode)))
    end
  elseif opts.gamma_mode ~= nil then
    bad(who, fmt("gamma_mode is an option of gamma_chain; it cannot be combined with %s (attnres.md §6)", kind))
  end
  if opts.gamma_range ~= nil then
    local r = opts.gamma_range
    if kind ~= "gamma_chain" then bad(who, fmt("gamma_range is an option of gamma_chain, not of %s", kind)) end
    if type(r) ~= "table" or type(r[1]) ~= "number" or type(r[2]) ~= "number" or r[1] < 1 or r[2] < r[1] or
       r[1] ~= math.floor(r[1]) or r[2] ~= math.floor(r[2]) or (self.n_layers and r[2] > self.n_layers) then
      bad(who, fmt("gamma_range must be {first, last} with 1 <= first <= last <= n_layers (1-based layers), got %s",
        type(r) == "table" and ("{" .. tostring(r[1]) .. ", " .. tostring(r[2]) .. "}") or tostring(r)))
    end
    self.gamma_range = { r[1], r[2] }
  end
  return self
end

return { AttnRes = AttnRes, Residual = Residual, residual_config = config }
