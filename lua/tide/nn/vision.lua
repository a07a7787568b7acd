-- nn/vision.lua — the native-resolution vision encoder (spec/vision.md): MoonViT-style ViT over packed images,
-- the 2×2 patch merge, the projector into the language model's width, and the splice of the image embeddings into
-- the token embeddings at the <|media_pad|> placeholders.
--
--   patches [Σ L_i, 3p²] ─ patch_embed (Linear, bias) ─ + pos_emb (bicubic per grid) ─ N blocks ─ final LayerNorm
--   ─ pre_norm (per patch) ─ 2×2 merge gather [Σ N_i, 4 d_v] ─ linear_1 ─ GELU (erf) ─ linear_2 ─ [Σ N_i, d]
--
-- A block (§5): x ← x + wo(Attn(RoPE2D(split(wqkv(norm0(x)))), cu_seqlens)); x ← x + fc1(gelu_tanh(fc0(norm1(x)))),
-- attention bidirectional inside each image (F.varlen_attention, block-diagonal by cu_seqlens). Images keep raster
-- patch order; RoPE positions and the merge read the same order (§6).
--
-- Names (formats.md §2, as the Kimi-VL checkpoints): vision_tower.patch_embed.proj.{weight,bias} (the Linear form
-- [d_v, 3p²] of the Conv2d weight [d_v, 3, p, p], same values, (c, ky, kx) order), vision_tower.patch_embed.
-- pos_emb.weight [G, G, d_v], vision_tower.encoder.blocks.{i}.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1},
-- vision_tower.encoder.final_layernorm, multi_modal_projector.{pre_norm, linear_1, linear_2}.
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local norms = require "tide.nn.norm"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F

local fmt = string.format
local WHO = "nn.VisionEncoder"
local function bad(msg) options.fail(WHO, msg) end
local function pos_int(v, name) return options.pos_int(v, name, WHO) end

local vision = {}

-- the model config's `vision` table: the encoder's shape (tiny-vlm of vision.md §9 by default) and the
-- preprocessing the data pipeline reads (patch, mean, std, token_limit)
-- (the preprocessing defaults are the data pipeline's: image.VISION_DEFAULTS)
local PRE = require("tide.data.image").VISION_DEFAULTS
vision.DEFAULTS = {
  patch = PRE.patch, dim = 64, heads = 4, layers = 2, mlp_dim = 256, grid = 8, theta = 10000, eps = 1e-5,
  proj_dim = nil, mean = PRE.mean, std = PRE.std, token_limit = PRE.token_limit, media_pad = nil, init_std = nil,
  table_std = nil,
  loss_on_wrappers = PRE.loss_on_wrappers,
}

-- the preprocessing part of a vision config (what image.prepare and the image sources read)
function vision.preprocessing(c)
  return { patch = c.patch, mean = c.mean, std = c.std, token_limit = c.token_limit, loss_on_wrappers = c.loss_on_wrappers }
end
vision.KEYS = {
  patch = true, dim = true, heads = true, layers = true, mlp_dim = true, grid = true, theta = true, eps = true,
  proj_dim = true, mean = true, std = true, token_limit = true, media_pad = true, init_std = true, table_std = true,
  loss_on_wrappers = true,
}

-- the checked config (defaults filled in); lm_dim = the language model's width
function vision.config(v, lm_dim)
  local c = options.with_defaults(v or {}, vision.DEFAULTS, vision.KEYS, "vision", WHO)
  for _, k in ipairs({ "patch", "dim", "heads", "layers", "mlp_dim", "grid", "token_limit" }) do pos_int(c[k], "vision." .. k) end
  if c.dim % c.heads ~= 0 then bad(fmt("vision.dim = %d is not a multiple of vision.heads = %d", c.dim, c.heads)) end
  local hd = c.dim / c.heads
  if hd % 4 ~= 0 then bad(fmt("vision head_dim = dim / heads = %d must be a multiple of 4 (2D RoPE, vision.md §4)", hd)) end
  c.head_dim = hd
  c.proj_dim = c.proj_dim and pos_int(c.proj_dim, "vision.proj_dim") or 4 * c.dim
  if not (type(c.theta) == "number" and c.theta > 0) then bad("vision.theta must be a number > 0, got " .. tostring(c.theta)) end
  if not (type(c.eps) == "number" and c.eps >= 0) then bad("vision.eps must be a number >= 0, got " .. tostring(c.eps)) end
  for _, k in ipairs({ "mean", "std" }) do
    local t = c[k]
    if type(t) ~= "table" or #t ~= 3 then bad(fmt("vision.%s must be a list of 3 numbers (R, G, B)", k)) end
    for i = 1, 3 do
      if type(t[i]) ~= "number" or (k == "std" and not (t[i] > 0)) then
        bad(fmt("vision.%s[%d] must be a number%s, got %s", k, i, k == "std" and " > 0" or "", tostring(t[i])))
      end
    end
  end
  if c.media_pad ~= nil and not (options.is_int(c.media_pad) and c.media_pad >= 0) then
    bad("vision.media_pad must be a token id (an integer >= 0), got " .. tostring(c.media_pad))
  end
  c.lm_dim = lm_dim
  return c
end

---------------------------------------------------------------------------------------------------
-- the 2×2 merge (§6): output cell (r, c) of an image with grid (h, w) gathers patches (2r+ih)·w + (2c+iw) in the
-- order (ih, iw) = (0,0), (0,1), (1,0), (1,1). merge_index(grids) -> 0-based patch indices over the packed images
-- (image i's patches start at Σ_{j<i} h_j w_j), 4 per output token, images in order.
function vision.merge_index(grids)
  local idx, base = {}, 0
  for i, g in ipairs(grids) do
    local h, w = g[1], g[2]
    if h % 2 ~= 0 or w % 2 ~= 0 then bad(fmt("image %d: the patch grid %d x %d is not even (pad to 2p, vision.md §2)", i, h, w)) end
    for r = 0, h / 2 - 1 do
      for c = 0, w / 2 - 1 do
        for ih = 0, 1 do
          for iw = 0, 1 do idx[#idx + 1] = base + (2 * r + ih) * w + (2 * c + iw) end
        end
      end
    end
    base = base + h * w
  end
  return idx
end

-- cu_seqlens of the packed images: {0, L_1, L_1 + L_2, ...}
function vision.cu_seqlens(grids)
  local cu = { 0 }
  for i, g in ipairs(grids) do cu[i + 1] = cu[i] + g[1] * g[2] end
  return cu
end

---------------------------------------------------------------------------------------------------
local MLP = M.Module:extend("VisionMLP")

function MLP:init(d, hidden, o)
  self:child("fc0", Linear(d, hidden, { bias = true, std = o.std, dtype = o.dtype, device = o.device }))
  self:child("fc1", Linear(hidden, d, { bias = true, std = o.out_std, dtype = o.dtype, device = o.device }))
end

function MLP:forward(x) return self.fc1:forward(F.gelu(self.fc0:forward(x))) end

local Block = M.Module:extend("VisionBlock")

function Block:init(c, o)
  local po = { eps = c.eps, dtype = o.dtype, device = o.device }
  self.dim, self.heads, self.head_dim, self.theta = c.dim, c.heads, c.head_dim, c.theta
  self.scale = 1 / math.sqrt(c.head_dim)
  self:child("norm0", norms.LayerNorm(c.dim, po))
  self:child("wqkv", Linear(c.dim, 3 * c.dim, { bias = true, std = o.std, dtype = o.dtype, device = o.device }))
  self:child("wo", Linear(c.dim, c.dim, { bias = true, std = o.out_std, dtype = o.dtype, device = o.device }))
  self:child("norm1", norms.LayerNorm(c.dim, po))
  self:child("mlp", MLP(c.dim, c.mlp_dim, o))
end

-- x [L, d_v] (packed patches), pos [L, 2] int (row, col), cu = cu_seqlens (a list or an int tensor)
function Block:forward(x, pos, cu)
  local L, d, H, hd = x:size(1), self.dim, self.heads, self.head_dim
  local qkv = self.wqkv:forward(self.norm0:forward(x))
  -- one split node: its backward writes the [L, 3d] gradient once (three narrows would each zero-fill and add one)
  local q, k, v = unpack(F.split(qkv, { d, d, d }, 2))
  q, k, v = q:contiguous():reshape(L, H, hd), k:contiguous():reshape(L, H, hd), v:contiguous():reshape(L, H, hd)
  q, k = F.rope2d(q, pos, { theta = self.theta }), F.rope2d(k, pos, { theta = self.theta })
  local o = F.varlen_attention(q, k, v, { cu_seqlens = cu, scale = self.scale })
  x = x + self.wo:forward(o:reshape(L, d))
  return x + self.mlp:forward(self.norm1:forward(x))
end

-- the learnable absolute position table [G, G, d_v] (§4), resampled to each image's grid by F.pos_interp
local PosEmb = M.Module:extend("VisionPosEmb")

function PosEmb:init(c, o)
  self:param("weight", M.Module.new_param({ c.grid, c.grid, c.dim }, { "normal", c.table_std or o.std }, o),
    { decay = false })
end

local PatchEmbed = M.Module:extend("VisionPatchEmbed")

function PatchEmbed:init(c, o)
  self:child("proj", Linear(3 * c.patch * c.patch, c.dim, { bias = true, std = o.std, dtype = o.dtype, device = o.device }))
  self:child("pos_emb", PosEmb(c, o))
end

-- patches [Σ L, 3p²], grids {{h, w}, ...} -> [Σ L, d_v]
function PatchEmbed:forward(patches, grids)
  return self.proj:forward(patches) + F.pos_interp(self.pos_emb.weight, grids)
end

local Encoder = M.Module:extend("VisionBlocks")

function Encoder:init(c, o)
  local blocks = M.ModuleList()
  for _ = 1, c.layers do blocks:append(Block(c, o)) end
  self:child("blocks", blocks)
  self:child("final_layernorm", norms.LayerNorm(c.dim, { eps = c.eps, dtype = o.dtype, device = o.device }))
end

local Tower = M.Module:extend("VisionEncoder")

-- VisionEncoder(c, {dtype, device}) with c = vision.config(...): patch_embed + encoder (blocks, final_layernorm)
function Tower:init(c, o)
  self.c = c
  local std = c.init_std or defaults.init_std
  local oo = { std = std, out_std = std / math.sqrt(2 * c.layers), dtype = o.dtype, device = o.device }
  self:child("patch_embed", PatchEmbed(c, oo))
  self:child("encoder", Encoder(c, oo))
end

-- the packed images' geometry, checked: grids {{h, w}, ...} -> positions [Σ L, 2], cu_seqlens
local function geometry(self, patches, grids)
  if type(grids) ~= "table" or #grids == 0 then bad("images.grids must be a non-empty list of {h, w} patch grids") end
  local n = 0
  for i, g in ipairs(grids) do
    if type(g) ~= "table" or not (options.is_int(g[1]) and g[1] > 0 and options.is_int(g[2]) and g[2] > 0) then
      bad(fmt("images.grids[%d] must be {h, w} with positive integers", i))
    end
    n = n + g[1] * g[2]
  end
  local c = self.c
  local pd = 3 * c.patch * c.patch
  if not tide.is_tensor(patches) or patches:dim() ~= 2 or patches:size(1) ~= n or patches:size(2) ~= pd then
    bad(fmt("images.patches must be [%d, %d] (the grids hold %d patches of 3·%d² values), got %s", n, pd, n, c.patch,
      tide.is_tensor(patches) and ("[" .. table.concat(patches:shape(), ", ") .. "]") or type(patches)))
  end
  return F.grid_positions(grids), vision.cu_seqlens(grids)
end

-- forward(patches [Σ L, 3p²], grids) -> [Σ L, d_v] (after the final LayerNorm); `region` wraps each block (recompute)
function Tower:forward(patches, grids, region)
  local pos, cu = geometry(self, patches, grids)
  local dev = self.patch_embed.proj.weight:device()
  if patches:device() ~= dev then patches = patches:to(dev) end
  if pos:device() ~= dev then pos = pos:to(dev) end
  local x = self.patch_embed:forward(patches:to(self.patch_embed.proj.weight:dtype()), grids)
  local blocks = self.encoder.blocks
  for i = 1, blocks.n do
    local b = blocks:get(i)
    if region then x = region(function(y) return b:forward(y, pos, cu) end, x) else x = b:forward(x, pos, cu) end
  end
  return self.encoder.final_layernorm:forward(x)
end

function Tower:extra_repr()
  local c = self.c
  return fmt("p=%d, d=%d, heads=%d, layers=%d, mlp=%d, table %dx%d, %d params", c.patch, c.dim, c.heads, c.layers,
    c.mlp_dim, c.grid, c.grid, self:num_parameters())
end

---------------------------------------------------------------------------------------------------
local Projector = M.Module:extend("VisionProjector")

-- Projector(c, {dtype, device}): pre_norm (LayerNorm d_v per patch) → 2×2 merge → linear_1 (4d_v → proj_dim) →
-- GELU (erf) → linear_2 (proj_dim → lm_dim)
function Projector:init(c, o)
  local std = c.init_std or defaults.init_std
  self.c = c
  self:child("pre_norm", norms.LayerNorm(c.dim, { eps = c.eps, dtype = o.dtype, device = o.device }))
  self:child("linear_1", Linear(4 * c.dim, c.proj_dim, { bias = true, std = std, dtype = o.dtype, device = o.device }))
  self:child("linear_2", Linear(c.proj_dim, c.lm_dim, { bias = true, std = std, dtype = o.dtype, device = o.device }))
end

-- forward(x [Σ L, d_v], grids) -> [Σ N, lm_dim], N_i = h_i w_i / 4, images in order
function Projector:forward(x, grids)
  local idx = vision.merge_index(grids)
  local y = F.index_select(self.pre_norm:forward(x), 1, idx):reshape(#idx / 4, 4 * self.c.dim)
  return self.linear_2:forward(F.gelu_erf(self.linear_1:forward(y)))
end

---------------------------------------------------------------------------------------------------
-- splice(E [B, T, d], ids [B, T] int, img [M, d], pad_id) -> E with the rows of the <|media_pad|> placeholders
-- replaced by img, in row-major order (§7). One concat and one gather: the backward sends the gradient of every
-- placeholder row to img and none to E (so the media_pad embedding row gets no gradient). A count mismatch is an
-- error naming both counts.
function vision.splice(E, ids, img, pad_id)
  if not options.is_int(pad_id) then bad("splice: the <|media_pad|> id is not known (set vision.media_pad or batch images.pad_id)") end
  local B, T, d = E:size(1), E:size(2), E:size(3)
  local flat = ids:to("cpu"):tolist()
  local perm, k = {}, 0
  local M_ = img:size(1)
  for t = 1, B * T do
    if flat[t] == pad_id then
      perm[t] = B * T + k
      k = k + 1
    else
      perm[t] = t - 1
    end
  end
  if k ~= M_ then
    bad(fmt("splice: the batch holds %d <|media_pad|> placeholders (id %d) but the images give %d image tokens", k,
      pad_id, M_))
  end
  if img:size(2) ~= d then bad(fmt("splice: the image embeddings are %d wide, the token embeddings %d", img:size(2), d)) end
  if k == 0 then return E end
  local all = F.concat({ E:reshape(B * T, d), img:to(E:dtype()) }, 1)
  return F.index_select(all, 1, perm):reshape(B, T, d)
end

vision.VisionEncoder, vision.Projector, vision.Block = Tower, Projector, Block
return vision
