-- nn/mla.lua — gated NoPE Multi-head Latent Attention (spec/mla.md §1-§3, §6): low-rank q (or full rank),
-- a kv down-projection to the latent c_kv plus one shared rope-slot key k_r (scored, never rotated),
-- up-projection to per-head keys and values, causal attention with document masks, a sigmoid output gate
-- from the layer input, output projection. Names are the checkpoint names of formats.md §2.
--
-- Cache (decoding and prefill continuation): {c = [B, Tc, d_c] (the NORMED latent ĉ), k_r = [B, Tc, d_r],
-- pos = Tc}: d_c + d_r values per token and layer (mla.md §6). A one-token step attends in the latent space
-- with the up-projection absorbed (q̃ = W_UKᵀ q_n, o = W_UV Σ p ĉ); longer calls expand keys and values
-- (the MHA mode) over the cached prefix and the new tokens.
local tide = require "tide"
local M = require "tide.nn.module"
local Linear = require "tide.nn.linear"
local norms = require "tide.nn.norm"
local options = require "tide.options"
local defaults = require "tide.defaults"
local F = tide.F

local fmt = string.format

local MLA = M.Module:extend("MLA")

local KEYS = {
  heads = true, q_rank = true, kv_rank = true, nope_dim = true, rope_dim = true, v_dim = true, gate = true,
  norm_eps = true, std = true, out_std = true, dtype = true, device = true,
}
MLA.KEYS = KEYS

-- errors point at the first caller outside lua/tide (the line that built or called the layer)
local WHO = "nn.MLA"
local function bad(msg) options.fail(WHO, msg) end
local function pos_int(v, name) return options.pos_int(v, name, WHO) end

-- MLA(dim, {heads, q_rank (nil: full-rank q), kv_rank, nope_dim, rope_dim, v_dim, gate = true,
--   norm_eps = 1e-5, std = 0.02, out_std = std, dtype, device})
function MLA:init(dim, opts)
  opts = options.check(opts or {}, KEYS, nil, WHO)
  self.dim = pos_int(dim, "dim")
  local H = pos_int(opts.heads, "heads")
  local dn, dr = pos_int(opts.nope_dim, "nope_dim"), options.nonneg_int(opts.rope_dim or 0, "rope_dim", WHO)
  local dc, dv = pos_int(opts.kv_rank, "kv_rank"), pos_int(opts.v_dim or dn, "v_dim")
  self.heads, self.nope_dim, self.rope_dim, self.kv_rank, self.v_dim = H, dn, dr, dc, dv
  self.q_rank = opts.q_rank and pos_int(opts.q_rank, "q_rank") or nil
  self.gate = opts.gate == nil and true or opts.gate
  if type(self.gate) ~= "boolean" then bad("gate must be a boolean, got " .. type(self.gate)) end
  self.norm_eps = opts.norm_eps or defaults.norm_eps
  self.scale = 1 / math.sqrt(dn + dr)                      -- the rope slot counts in the scale (mla.md §2)
  local std = opts.std or defaults.init_std
  local po = { eps = self.norm_eps, dtype = opts.dtype, device = opts.device }
  local function lin(i, o, s) return Linear(i, o, { std = s, dtype = opts.dtype, device = opts.device }) end
  if self.q_rank then
    self:child("q_a_proj", lin(dim, self.q_rank, std))
    self:child("q_a_layernorm", norms.RMSNorm(self.q_rank, po))
    self:child("q_b_proj", lin(self.q_rank, H * (dn + dr), std))
  else
    self:child("q_proj", lin(dim, H * (dn + dr), std))
  end
  self:child("kv_a_proj_with_mqa", lin(dim, dc + dr, std))
  self:child("kv_a_layernorm", norms.RMSNorm(dc, po))
  self:child("kv_b_proj", lin(dc, H * (dn + dv), std))
  if self.gate then self:child("g_proj", lin(dim, H * dv, std)) end
  self:child("o_proj", lin(H * dv, dim, opts.out_std or std))
end

-- the per-head queries [B, T, H, dn + dr]
function MLA:queries(x)
  local B, T = x:size(1), x:size(2)
  local q
  if self.q_rank then
    q = self.q_b_proj:forward(self.q_a_layernorm:forward(self.q_a_proj:forward(x)))
  else
    q = self.q_proj:forward(x)
  end
  return q:reshape(B, T, self.heads, self.nope_dim + self.rope_dim)
end

-- the latent ĉ [B, T, d_c] (normed) and the rope-slot key k_r [B, T, d_r] (not normed, not rotated)
function MLA:latent(x)
  local kv = self.kv_a_proj_with_mqa:forward(x)
  local dc, dr = self.kv_rank, self.rope_dim
  local c = self.kv_a_layernorm:forward(kv:narrow(3, 1, dc))
  local kr = dr > 0 and kv:narrow(3, dc + 1, dr):contiguous() or nil
  return c, kr
end

-- gate (σ(W_G x) ⊙ o, mla.md §3) and output projection; o [B, T, H, dv]
function MLA:output(x, o)
  local B, T = x:size(1), x:size(2)
  o = o:reshape(B, T, self.heads * self.v_dim)
  if self.gate then o = o * self.g_proj:forward(x):sigmoid() end
  return self.o_proj:forward(o)
end

-- expanded (MHA-mode) attention of queries q [B, Tq, H, dn + dr] over latents c [B, Tk, d_c], k_r [B, Tk, d_r]
function MLA:attend_expanded(q, c, kr, cu)
  local B, Tk, H, dn, dv = c:size(1), c:size(2), self.heads, self.nope_dim, self.v_dim
  local kvb = self.kv_b_proj:forward(c):reshape(B, Tk, H, dn + dv)
  local kn, v = kvb:narrow(4, 1, dn):contiguous(), kvb:narrow(4, dn + 1, dv):contiguous()
  return F.mla_attention(q, kn, kr, v, { cu_seqlens = cu, scale = self.scale })
end

-- absorbed (MQA-mode) attention of one new token per row, q [B, 1, H, dn + dr], over the whole latent cache
-- (mla.md §6): one shared key [ĉ | k_r] of d_c + d_r values and one shared value ĉ per cached token.
-- Three parts, so that rows with caches of different lengths share the two products with the weights:
-- absorb (q̃ and q_r of every row), the core (per cache), unabsorb (o from õ of every row).
function MLA:absorb(q)
  local B, H, dn, dr, dc = q:size(1), self.heads, self.nope_dim, self.rope_dim, self.kv_rank
  -- W_UKV^h = [W_UK^h (dn x dc) ; W_UV^h (dv x dc)]
  local w_uk = self.kv_b_proj.weight:reshape(H, dn + self.v_dim, dc):narrow(2, 1, dn)
  -- q̃^h = W_UK^hᵀ q_n^h: [H, B, dn] x [H, dn, dc] -> [H, B, dc]
  local qn = q:narrow(4, 1, dn):reshape(B, H, dn):permute(2, 1, 3)
  local qt = qn:matmul(w_uk):permute(2, 1, 3)                          -- [B, H, dc]
  local qr = dr > 0 and q:narrow(4, dn + 1, dr):reshape(B, H, dr) or nil
  return qt, qr
end

-- õ [B, H, dc] of queries qt [B, H, dc], qr [B, H, dr] over latents c [B, Tc, dc], k_r [B, Tc, d_r]
function MLA:attend_core(qt, qr, c, kr)
  local s = qt:matmul(c, false, true)                                  -- [B, H, Tc]
  if qr then s = s + qr:matmul(kr, false, true) end
  local p = (s * self.scale):softmax(3)
  return p:matmul(c)
end

-- o [B, 1, H, dv] from õ [B, H, dc]: o^h = W_UV^h õ^h, [H, B, dc] x [H, dc, dv] -> [H, B, dv]
function MLA:unabsorb(ot)
  local B, H, dn, dv, dc = ot:size(1), self.heads, self.nope_dim, self.v_dim, self.kv_rank
  local w_uv = self.kv_b_proj.weight:reshape(H, dn + dv, dc):narrow(2, dn + 1, dv)
  local o = ot:permute(2, 1, 3):matmul(w_uv, false, true)
  return o:permute(2, 1, 3):reshape(B, 1, H, dv)
end

function MLA:attend_absorbed(q, c, kr)
  local qt, qr = self:absorb(q)
  return self:unabsorb(self:attend_core(qt, qr, c, kr))
end

-- append [B, T, n] rows to the cache buffer `name` (capacity doubling); returns the view of the filled part
-- room for T more tokens in the cache buffer `name` [B, cap, n] (capacity doubling, the filled part copied over);
-- returns the buffer and the tokens it holds
local function reserve(cache, name, B, T, n, like)
  local used = cache[name] and cache[name]:size(2) or 0
  local buf = cache[name .. "_buf"]
  if not buf or buf:size(2) < used + T then
    local cap = math.max(16, 2 * (used + T))
    local nb = tide.empty({ B, cap, n }, { dtype = like:dtype(), device = like:device() })
    if used > 0 then nb:narrow(2, 1, used):copy_(cache[name]) end
    buf = nb
    cache[name .. "_buf"] = buf
    cache[name .. "_view_buf"] = nil
  end
  return buf, used
end

-- the view of the first n tokens of cache[name .. "_buf"] (a row's step of MLA:decode): the view the previous step
-- made, grown in place while it is still the cache's own (nothing replaced cache[name], the buffer is the same, no
-- other engine object holds it), else a new one. A rollout's step of R rows then makes no views for the caches.
-- `name .. "_view_buf"` ends in _buf, so copies of the cache (rl.rollout's copy_cache) leave it out
local function filled_view(cache, name, n)
  local key = name .. "_view_buf"
  local v = cache[key]
  if v ~= nil and cache[name] == v and tide.C.tide_view_set_length(tide.raw(v), 1, n) == 0 then return v end
  v = cache[name .. "_buf"]:narrow(2, 1, n)
  cache[key] = v
  return v
end

local function append_rows(cache, name, x)
  local T = x:size(2)
  local buf, used = reserve(cache, name, x:size(1), T, x:size(3), x)
  buf:narrow(2, used + 1, T):copy_(x)
  cache[name] = buf:narrow(2, 1, used + T)
  return cache[name]
end

local function append_latent(cache, c, kr)
  c = append_rows(cache, "c", c)
  if kr then kr = append_rows(cache, "k_r", kr) end
  return c, kr
end

local FORWARD_KEYS = { cache = true, cu_seqlens = true, absorbed = true, exact = true, cp = true }

-- forward(x [B, T, d], opts) -> [B, T, d]
--   opts.cu_seqlens: packed documents (a token attends only within its document, mla.md §5); no cache
--   opts.cache: {c, k_r, pos} or {}: attend over the cached prefix too, then append this call's latents
--   opts.absorbed: force (true) or forbid (false) the absorbed path; default: absorbed for one token with a cache
--   opts.exact: with a cache, no gradients: the T tokens as T decoding steps would compute them (MLA:exact_prefill)
function MLA:forward(x, opts)
  opts = options.check(opts or {}, FORWARD_KEYS, "forward options", WHO)
  if not tide.is_tensor(x) or x:dim() ~= 3 or x:size(3) ~= self.dim then
    bad(fmt("x must be [B, T, %d], got %s", self.dim,
      tide.is_tensor(x) and ("[" .. table.concat(x:shape(), ", ") .. "]") or type(x)))
  end
  local cache = opts.cache
  if cache ~= nil and type(cache) ~= "table" then bad("forward: cache must be a table, got " .. type(cache)) end
  if cache and opts.cu_seqlens then bad("forward: cu_seqlens (packed documents) cannot be combined with a cache") end
  local T = x:size(2)
  if opts.cp then
    if opts.cu_seqlens or opts.exact or (cache and cache.rows) then
      bad("forward: cp (context parallelism) carries the documents itself and takes no cu_seqlens, exact or row caches")
    end
    return self:forward_cp(x, opts.cp, cache)
  end
  if cache and cache.rows then return self:forward_rows(x, cache.rows) end
  if opts.exact then
    if not cache then bad("forward: exact = true runs on a cache (the decode path's arithmetic)") end
    return self:exact_prefill(x, cache)
  end
  if cache and T == 1 and opts.absorbed ~= false and not tide.grad_enabled() then return self:decode(x, cache) end
  local q = self:queries(x)
  local c, kr = self:latent(x)
  if cache then
    if tide.grad_enabled() then
      -- training through a cache (segments): concatenation keeps the graph
      if cache.c then
        c = F.concat({ cache.c, c }, 2)
        if kr then kr = F.concat({ cache.k_r, kr }, 2) end
      end
      cache.c, cache.k_r = c, kr
    else
      -- decoding: append in place into buffers that double when full, so a step costs O(1) to cache
      -- instead of copying the whole prefix; cache.c / cache.k_r are views of the filled part
      c, kr = append_latent(cache, c, kr)
    end
    cache.pos = (cache.pos or 0) + T
  end
  local absorbed = opts.absorbed
  if absorbed == nil then absorbed = cache ~= nil and T == 1 end
  if absorbed and T ~= 1 then bad(fmt("forward: the absorbed path takes one token per row, got T = %d", T)) end
  local o = absorbed and self:attend_absorbed(q, c, kr) or self:attend_expanded(q, c, kr, opts.cu_seqlens)
  return self:output(x, o)
end

-- forward_cp(x [R·B, 2·Tc, d], ctx): the layer on context-parallel slices (cp.lua; long_context.md §5): the latent
-- [ĉ | k_r] of every rank is gathered (d_c + d_r values per token; its gradient goes back to the owner, summed: the
-- reduce-scatter) and put in global order, and each local segment's queries attend over its row's prefix up to the
-- segment's end with the global document mask (F.mla_latent_attention with Tq < Tk: the keys and values expanded
-- from the latent a chunk at a time; cp_latent = false: expanded whole for F.mla_attention). Queries, gate and
-- output projection stay local.
-- cache ({} or one this call filled before, the same on every rank): the rows continue from it (a long row call by
-- call): the queries also attend over the cached latents of the row's last cached document (cache.doc_start: where
-- it starts), which the row's first document of this call continues (a document starting inside the call does not
-- see them), and the call appends its global latents, so the cache stays the same on every rank.
function MLA:forward_cp(x, ctx, cache)
  local RB, T2, Tc, B = x:size(1), x:size(2), ctx.Tc, ctx.B
  if RB ~= ctx.R * B or T2 ~= 2 * Tc then
    bad(fmt("forward: a cp slice must be [R·B, 2·Tc, d] = [%d, %d, %d], got [%s]", ctx.R * B, 2 * Tc, self.dim,
      table.concat(x:shape(), ", ")))
  end
  local H, dn, dr, dc, dv = self.heads, self.nope_dim, self.rope_dim, self.kv_rank, self.v_dim
  local q = self:queries(x)
  local c, kr = self:latent(x)
  local lat = kr and F.concat({ c, kr }, 3) or c
  local glob = ctx:to_global(ctx:gather(lat))                          -- [B, T, d_c + d_r]
  local Tp = 0
  if cache and cache.c then
    -- the cached latents in front: [B, Tp + T, d_c + d_r]
    Tp = cache.c:size(2)
    glob = F.concat({ kr and F.concat({ cache.c, cache.k_r }, 3) or cache.c, glob }, 2)
  end
  local cg = dr > 0 and glob:narrow(3, 1, dc):contiguous() or glob
  local krg = dr > 0 and glob:narrow(3, dc + 1, dr):contiguous() or nil
  local doc = cache and cache.doc_start
  if cache then
    cache.c, cache.k_r, cache.pos = cg, krg, (cache.pos or 0) + ctx.T
    cache.doc_start = ctx:last_starts(Tp, doc)
  end
  local W = self.kv_b_proj.weight:reshape(H, dn + dv, dc)
  local Tk = Tp + ctx.T
  -- the attention reads the gathered latent itself (F.mla_latent_attention, CPU and CUDA): the keys and values are
  -- expanded a chunk of keys at a time, forward and backward, so a rank holds the row's latent (d_c + d_r values per
  -- token) and never its expansion (H·(d_n + d_v) per token). With cp_latent = false they are expanded as two
  -- products, each contiguous: a segment's key prefix of one row (B = 1, the long rows cp is for) is then a view,
  -- not a copy the attention makes and keeps for its backward.
  local latent = self.cp_latent ~= false
  local kn, v
  if not latent then
    kn = F.linear(cg, W:narrow(2, 1, dn):contiguous():reshape(H * dn, dc)):reshape(B, Tk, H, dn)
    v = F.linear(cg, W:narrow(2, dn + 1, dv):contiguous():reshape(H * dv, dc)):reshape(B, Tk, H, dv)
  end
  local rows = {}
  for ri, p in ipairs(ctx.ranks) do
    local two = {}
    for s = 0, 1 do
      local seg = ctx:seg(p, s)
      local Kc = Tp + (seg + 1) * Tc
      local qs = q:narrow(1, (ri - 1) * B + 1, B):narrow(2, s * Tc + 1, Tc)
      local o = { cu_seqlens = ctx:key_cu(seg, Tp, doc), scale = self.scale }
      if latent then
        o.chunk = self.cp_chunk
        two[s + 1] = F.mla_latent_attention(qs, cg:narrow(2, 1, Kc), krg and krg:narrow(2, 1, Kc), W, o)
      else
        two[s + 1] = F.mla_attention(qs, kn:narrow(2, 1, Kc), krg and krg:narrow(2, 1, Kc), v:narrow(2, 1, Kc), o)
      end
    end
    rows[ri] = F.concat(two, 2)
  end
  return self:output(x, #rows == 1 and rows[1] or F.concat(rows, 1))
end

-- one decoding step without gradients (F.mla_decode_rows): the products with the weights run for the B rows at
-- once, the attention over each row's own latents; `rows` lists B row caches of any lengths (cache.rows, the
-- rows of a rollout), or nil for one cache shared by the B rows (all at one length). Row b's output is bitwise its
-- step alone (B = 1) when the products are batch-invariant (decode steps run so).
function MLA:decode(x, cache, rows)
  local B = x:size(1)
  if x:size(2) ~= 1 then bad(fmt("forward: a decoding step takes one token per row, got T = %d", x:size(2))) end
  if tide.grad_enabled() then bad("forward: a batch of row caches decodes without gradients (under no_grad)") end
  local q = self:queries(x)
  local c, kr = self:latent(x)
  local qt, qr = self:absorb(q)
  local dc, dr = self.kv_rank, self.rope_dim
  local cbufs, kbufs, lens = {}, kr and {} or nil, {}
  if rows then
    for r = 1, B do
      local rc = rows[r]
      cbufs[r], lens[r] = reserve(rc, "c", 1, 1, dc, c)
      if kr then kbufs[r] = reserve(rc, "k_r", 1, 1, dr, kr) end
    end
  else
    local cb, used = reserve(cache, "c", B, 1, dc, c)
    local kb = kr and reserve(cache, "k_r", B, 1, dr, kr) or nil
    for r = 1, B do
      cbufs[r], lens[r] = B == 1 and cb or cb:narrow(1, r, 1), used
      if kb then kbufs[r] = B == 1 and kb or kb:narrow(1, r, 1) end
    end
  end
  local ot = F.mla_decode_rows(qt, qr, c, kr, cbufs, kbufs, lens, self.scale)
  if rows then
    for r = 1, B do
      local rc = rows[r]
      rc.c = filled_view(rc, "c", lens[r] + 1)
      if kr then rc.k_r = filled_view(rc, "k_r", lens[r] + 1) end
      rc.pos = (rc.pos or 0) + 1
    end
  else
    cache.c = cache.c_buf:narrow(2, 1, lens[1] + 1)
    if kr then cache.k_r = cache.k_r_buf:narrow(2, 1, lens[1] + 1) end
    cache.pos = (cache.pos or 0) + 1
  end
  return self:output(x, self:unabsorb(ot))
end

-- exact_prefill(x [B, T, d], cache): the T tokens of each row through the cache with the arithmetic of T decoding
-- steps (MLA:decode), no gradients: the latents appended, then query t of row b attends absorbed over the row's
-- first pos + t tokens, the T queries of a row sharing its buffer (F.mla_decode_rows without new tokens). Row b's
-- outputs and cache are then bitwise what T one-token steps give when the products are batch-invariant, so a
-- continuation after a prefill of any split equals the one after a prefill of the whole (the rollout's re-prefill).
function MLA:exact_prefill(x, cache)
  if tide.grad_enabled() then bad("forward: exact = true runs without gradients (under no_grad)") end
  local B, T = x:size(1), x:size(2)
  local H, dc, dr = self.heads, self.kv_rank, self.rope_dim
  local q = self:queries(x)
  local c, kr = self:latent(x)
  local cb, used = reserve(cache, "c", B, T, dc, c)
  cb:narrow(2, used + 1, T):copy_(c)
  local kb
  if kr then
    kb = reserve(cache, "k_r", B, T, dr, kr)
    kb:narrow(2, used + 1, T):copy_(kr)
  end
  local qt, qr = self:absorb(q:reshape(B * T, 1, H, self.nope_dim + dr))
  local cbufs, kbufs, lens = {}, kr and {} or nil, {}
  for b = 1, B do
    local crow = B == 1 and cb or cb:narrow(1, b, 1)
    local krow = kb and (B == 1 and kb or kb:narrow(1, b, 1)) or nil
    for t = 1, T do
      local r = (b - 1) * T + t
      cbufs[r], lens[r] = crow, used + t - 1
      if krow then kbufs[r] = krow end
    end
  end
  local ot = F.mla_decode_rows(qt, qr, nil, nil, cbufs, kbufs, lens, self.scale)
  cache.c = cb:narrow(2, 1, used + T)
  if kr then cache.k_r = kb:narrow(2, 1, used + T) end
  cache.pos = (cache.pos or 0) + T
  return self:output(x, self:unabsorb(ot):reshape(B, T, H, self.v_dim))
end

function MLA:forward_rows(x, rows)
  local B = x:size(1)
  if type(rows) ~= "table" or #rows ~= B then
    bad(fmt("forward: cache.rows must list one cache per row of x (%d), got %s", B,
      type(rows) == "table" and tostring(#rows) or type(rows)))
  end
  return self:decode(x, nil, rows)
end

-- step(x [B, 1, d], cache) -> [B, 1, d]: one decoding step in the latent space
function MLA:step(x, cache)
  if type(cache) ~= "table" then bad("step: cache must be a table ({} to start empty), got " .. type(cache)) end
  return self:forward(x, { cache = cache })
end

-- prefill(x [B, T, d], cache): expanded attention over the cached prefix and x, appending to the cache
function MLA:prefill(x, cache)
  if type(cache) ~= "table" then bad("prefill: cache must be a table ({} to start empty), got " .. type(cache)) end
  return self:forward(x, { cache = cache, absorbed = false })
end

function MLA:new_cache() return { pos = 0 } end

-- values cached per token (d_c + d_r) and what a standard MHA cache of the same heads would hold
function MLA:cache_values_per_token()
  return self.kv_rank + self.rope_dim, self.heads * (self.nope_dim + self.rope_dim + self.v_dim)
end

function MLA:extra_repr()
  return fmt("%d, heads=%d, q_rank=%s, kv_rank=%d, nope=%d, rope=%d (NoPE), v=%d, gate=%s", self.dim, self.heads,
    tostring(self.q_rank or "full"), self.kv_rank, self.nope_dim, self.rope_dim, self.v_dim, tostring(self.gate))
end

return MLA
