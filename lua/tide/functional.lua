-- tide.F: functional forms of the engine's ops (tide.h), with argument checks that name the op and
-- the argument. Dims are 1-based like everywhere in Lua; index VALUES (ids, gather/scatter indices)
-- are data and stay 0-based. Index arguments may be given as Lua tables; they become i64 tensors.
local ffi = require "ffi"
local tide = require "tide"
local T = require "tide.tensor"
local options = require "tide.options"
local defaults = require "tide.defaults"
local C = tide.C

local raw, check, check_status, raise = T.raw, T.check, T.check_status, T.raise
local is_tensor, cdim = T.is_tensor, T.cdim
local fmt = string.format

local F = {}

local function tname(x)
  return type(x) == "cdata" and tostring(ffi.typeof(x)) or type(x)
end

local function want_tensor(x, op, arg)
  if not is_tensor(x) then raise(fmt("%s: %s must be a tensor, got %s", op, arg, tname(x))) end
  return raw(x)
end

local function opt_tensor(x, op, arg)
  if x == nil then return nil end
  return want_tensor(x, op, arg)
end

local function want_number(x, op, arg)
  if type(x) ~= "number" then raise(fmt("%s: %s must be a number, got %s", op, arg, tname(x))) end
  return x
end

local function want_opts(o, op)
  if o ~= nil and type(o) ~= "table" then raise(fmt("%s: options must be a table, got %s", op, tname(o))) end
  return o or {}
end

-- index arguments: tensors as they are; Lua tables of 0-based integers become i64 tensors on x's device
local function index_tensor(idx, x, op, arg)
  if type(idx) == "table" then
    return T.from_table(idx, { dtype = "i64", device = x and x:device() or "cpu" })
  end
  want_tensor(idx, op, arg)
  return idx
end

local function bool_int(x, op, arg)
  if x == nil or x == false or x == 0 then return 0 end
  if x == true or x == 1 then return 1 end
  raise(fmt("%s: %s must be a boolean, got %s", op, arg, tname(x)))
end

-- F.matmul(a, b[, ta, tb]): a @ b; ta/tb take a or b transposed (last two dims)
function F.matmul(a, b, ta, tb)
  return check(C.tide_matmul(want_tensor(a, "matmul", "a"), want_tensor(b, "matmul", "b"),
                             bool_int(ta, "matmul", "ta"), bool_int(tb, "matmul", "tb")))
end

-- F.linear(x, weight[, bias]): x @ weight^T + bias, weight [out, in]
function F.linear(x, w, b)
  return check(C.tide_linear(want_tensor(x, "linear", "x"), want_tensor(w, "linear", "weight"),
                             opt_tensor(b, "linear", "bias")))
end

-- F.embedding(weight [V, d], ids int [...]) -> [..., d]; ids are 0-based token ids
function F.embedding(weight, ids)
  want_tensor(weight, "embedding", "weight")
  ids = index_tensor(ids, weight, "embedding", "ids")
  return check(C.tide_embedding(raw(weight), raw(ids)))
end

-- F.rmsnorm(x, weight[, eps=1e-5]) over the last dim
function F.rmsnorm(x, w, eps)
  return check(C.tide_rmsnorm(want_tensor(x, "rmsnorm", "x"), want_tensor(w, "rmsnorm", "weight"),
                              eps == nil and defaults.norm_eps or want_number(eps, "rmsnorm", "eps")))
end

-- F.layernorm(x, weight, bias[, eps=1e-5]) over the last dim (weight/bias may be nil where the engine allows)
function F.layernorm(x, w, b, eps)
  return check(C.tide_layernorm(want_tensor(x, "layernorm", "x"), opt_tensor(w, "layernorm", "weight"),
                                opt_tensor(b, "layernorm", "bias"),
                                eps == nil and defaults.norm_eps or want_number(eps, "layernorm", "eps")))
end

-- F.softmax(x[, dim=-1]), F.log_softmax(x[, dim=-1])
function F.softmax(x, dim)
  want_tensor(x, "softmax", "x")
  return check(C.tide_softmax(raw(x), cdim(x, dim or -1, "softmax")))
end
function F.log_softmax(x, dim)
  want_tensor(x, "log_softmax", "x")
  return check(C.tide_log_softmax(raw(x), cdim(x, dim or -1, "log_softmax")))
end

local REDUCTIONS = { mean = 0, sum = 1, none = 2 }

-- F.cross_entropy(logits [N, V] or [..., V], targets int [N] or [...], opts)
--   opts.ignore_index (-100): targets equal to it contribute nothing
--   opts.weights: float [N] (or targets' shape) per-token weights
--   opts.reduction: "mean" (weighted mean over non-ignored tokens), "sum" or "none" (targets' shape)
function F.cross_entropy(logits, targets, opts)
  local op = "cross_entropy"
  want_tensor(logits, op, "logits")
  targets = index_tensor(targets, logits, op, "targets")
  opts = want_opts(opts, op)
  local reduction = REDUCTIONS[opts.reduction or "mean"]
  if not reduction then
    raise(fmt("%s: reduction must be \"mean\", \"sum\" or \"none\", got %s", op, tostring(opts.reduction)))
  end
  local ignore = opts.ignore_index == nil and -100 or want_number(opts.ignore_index, op, "ignore_index")
  local weights = opts.weights
  if weights ~= nil then want_tensor(weights, op, "weights") end
  local tshape = targets:shape()
  -- [..., V] logits with [...] targets: flatten the leading dims
  if logits:dim() > 2 then
    logits = logits:reshape(-1, logits:size(-1))
    targets = targets:reshape(-1)
    if weights ~= nil then weights = weights:reshape(-1) end
  end
  local out = check(C.tide_cross_entropy(raw(logits), raw(targets), weights and raw(weights) or nil, ignore, reduction))
  if reduction == 2 and #tshape ~= 1 then out = out:reshape(tshape) end
  return out
end

-- F.token_logprobs(logits [..., V], targets int [...] (or a Lua table), opts) -> logp [...], entropy [...]
--   logp = logits[t] - logsumexp(logits), entropy = -Σ p log p (p = softmax(logits)), fused: no [N, V] tensor is made;
--   opts.ignore_index (-100): those targets give logp 0, entropy 0 and no gradient. Both outputs are differentiable
--   (f32 for bf16 logits, else the logits' dtype).
function F.token_logprobs(logits, targets, opts)
  local op = "token_logprobs"
  want_tensor(logits, op, "logits")
  targets = index_tensor(targets, logits, op, "targets")
  opts = want_opts(opts, op)
  for k in pairs(opts) do
    if k ~= "ignore_index" then raise(fmt("%s: unknown option %s (expected ignore_index)", op, tostring(k))) end
  end
  local ignore = opts.ignore_index == nil and -100 or want_number(opts.ignore_index, op, "ignore_index")
  local lp, h = ffi.new("tide_tensor *[1]"), ffi.new("tide_tensor *[1]")
  check_status(C.tide_token_logprobs(raw(logits), raw(targets), ignore, lp, h))
  return T.wrap(lp[0]), T.wrap(h[0])
end

-- F.rope(x [B, T, H, D][, theta=10000][, pos0=0]): rotary embedding at positions pos0 + t
function F.rope(x, theta, pos0)
  return check(C.tide_rope(want_tensor(x, "rope", "x"), theta == nil and 10000 or want_number(theta, "rope", "theta"),
                           pos0 == nil and 0 or want_number(pos0, "rope", "pos0")))
end

-- F.attention(q [B, H, Tq, D], k, v [B, H, Tk, D][, opts]) ; opts.causal (false), opts.scale (1/sqrt(D)).
-- A boolean in place of opts sets causal.
function F.attention(q, k, v, opts)
  local op = "attention"
  want_tensor(q, op, "q"); want_tensor(k, op, "k"); want_tensor(v, op, "v")
  if type(opts) == "boolean" then opts = { causal = opts } end
  opts = want_opts(opts, op)
  local scale = opts.scale
  if scale == nil then scale = 1 / math.sqrt(q:size(-1)) else want_number(scale, op, "scale") end
  return check(C.tide_attention(raw(q), raw(k), raw(v), bool_int(opts.causal, op, "causal"), scale))
end

-- F.swiglu(gate, up) = silu(gate) * up
function F.swiglu(gate, up)
  return check(C.tide_swiglu(want_tensor(gate, "swiglu", "gate"), want_tensor(up, "swiglu", "up")))
end

-- F.concat({a, b, ...}[, dim=1])
function F.concat(xs, dim)
  local op = "concat"
  if type(xs) ~= "table" or #xs == 0 then raise(op .. ": expected a non-empty table of tensors") end
  local n = #xs
  local arr = ffi.new("tide_tensor *[?]", n)
  for i = 1, n do arr[i - 1] = want_tensor(xs[i], op, "tensor " .. i) end
  return check(C.tide_concat(n, arr, cdim(xs[1], dim or 1, op)))
end
F.cat = F.concat

-- F.split(x, sizes, dim=1): sizes is a table of sizes summing to the dim's size, or one number
-- (pieces of that size, the last one shorter). Returns a Lua array of tensors.
function F.split(x, sizes, dim)
  local op = "split"
  want_tensor(x, op, "x")
  local cd = cdim(x, dim or 1, op)
  local total = tonumber(raw(x).shape[cd])
  if type(sizes) == "number" then
    if sizes < 1 or sizes ~= math.floor(sizes) then raise(fmt("%s: piece size must be a positive integer, got %s", op, sizes)) end
    local list, left = {}, total
    while left > 0 do list[#list + 1] = math.min(sizes, left); left = left - sizes end
    sizes = list
  elseif type(sizes) ~= "table" then
    raise(fmt("%s: sizes must be a table or a number, got %s", op, tname(sizes)))
  end
  local n = #sizes
  if n == 0 then raise(op .. ": sizes is empty") end
  local sbuf = ffi.new("int64_t[?]", n)
  for i = 1, n do sbuf[i - 1] = want_number(sizes[i], op, "size " .. i) end
  local outs = ffi.new("tide_tensor *[?]", n)
  check_status(C.tide_split(raw(x), cd, n, sbuf, outs))
  local r = {}
  for i = 1, n do r[i] = T.wrap(outs[i - 1]) end
  return r
end

-- F.chunk(x, n, dim=1): n nearly equal pieces
function F.chunk(x, n, dim)
  want_tensor(x, "chunk", "x")
  local size = x:size(dim or 1)
  return F.split(x, math.ceil(size / want_number(n, "chunk", "n")), dim)
end

-- F.index_select(x, dim, index int 1-D (0-based values))
function F.index_select(x, dim, index)
  local op = "index_select"
  want_tensor(x, op, "x")
  index = index_tensor(index, x, op, "index")
  return check(C.tide_index_select(raw(x), cdim(x, dim, op), raw(index)))
end

-- F.gather(x, dim, index): out[i][j] = x[i][index[i][j]] along dim; index has x's ndim
function F.gather(x, dim, index)
  local op = "gather"
  want_tensor(x, op, "x")
  index = index_tensor(index, x, op, "index")
  return check(C.tide_gather(raw(x), cdim(x, dim, op), raw(index)))
end

-- F.scatter_add(x, dim, index, src): a copy of x with src added at index along dim
function F.scatter_add(x, dim, index, src)
  local op = "scatter_add"
  want_tensor(x, op, "x")
  index = index_tensor(index, x, op, "index")
  return check(C.tide_scatter_add(raw(x), cdim(x, dim, op), raw(index), want_tensor(src, op, "src")))
end

-- elementwise and reductions, for symmetry with the methods
-- gelu is the tanh form (GPT-2, the ViT MLP); gelu_erf the exact 0.5 x (1 + erf(x/√2)) (vision.md §6: the projector)
for _, name in ipairs { "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "gelu_erf", "softplus", "relu",
                        "abs" } do
  local f = C["tide_" .. name]
  F[name] = function(x) return check(f(want_tensor(x, name, "x"))) end
end

-- ---- Kimi Delta Attention (spec/kda.md) ------------------------------------------------------------------
-- options are checked by name, so a misspelt key is an error rather than a silently ignored default
local function check_keys(o, op, known) options.check(o, known, nil, op) end

-- the engine id of the name v in map (name -> C enum value); another name is an error listing the names
local function choice(v, map, op, arg)
  local id = map[v]
  if id == nil then
    local names = {}
    for _, k in ipairs(options.sorted_keys(map)) do names[#names + 1] = "\"" .. k .. "\"" end
    local list = #names > 1 and (table.concat(names, ", ", 1, #names - 1) .. " or " .. names[#names]) or names[1]
    raise(fmt("%s: %s must be %s, got %s", op, arg, list, type(v) == "string" and ("\"" .. v .. "\"") or tostring(v)))
  end
  return id
end

local function want_int(x, op, arg)
  if type(x) ~= "number" or x ~= math.floor(x) then raise(fmt("%s: %s must be an integer, got %s", op, arg, tostring(x))) end
  return x
end

-- cu_seqlens: document boundaries over the flattened B·T tokens, as a Lua table of 0-based offsets
-- {0, e1, ..., B·T} or an integer tensor (kda.md §8); nil means none
local function cu_tensor(cu, x, op)
  if cu == nil then return nil end
  if type(cu) == "table" then return T.from_table(cu, { dtype = "i64", device = x:device() }) end
  want_tensor(cu, op, "cu_seqlens")
  return cu
end

local KDA_PATHS = { chunk = C.TIDE_KDA_CHUNK, chunk_safe = C.TIDE_KDA_CHUNK_SAFE, recurrent = C.TIDE_KDA_RECURRENT }
local KDA_KEYS = { s0 = true, cu_seqlens = true, path = true, chunk = true, gate_lower_bound = true }

-- F.kda(q, k, v, g, beta, opts) -> o [B, T, H, dv], state [B, H, dk, dv]
--   q, k, g [B, T, H, dk] (q, k L2-normalised, q scaled by dk^-1/2), v [B, T, H, dv], beta [B, T, H]
--   opts.s0: initial state [B, H, dk, dv] of the FIRST document of each row (nil = zeros)
--   opts.cu_seqlens: document boundaries (table or int tensor) over B·T; the state restarts at each
--   opts.path: "chunk" (default; needs gate_lower_bound <= g <= 0 and chunk·|gate_lower_bound| <= 80, kda.md §5),
--              "chunk_safe" (any g <= 0: the softplus gate) or "recurrent" (the token recurrence, §3)
--   opts.chunk (16), opts.gate_lower_bound (-5) (tide.defaults.kda)
-- the options both KDA kernel ops take: opts checked, the path id, the chunk, the gate's lower bound and the
-- document boundaries as an int tensor (or nil)
local function kda_opts(op, q, opts)
  opts = want_opts(opts, op)
  check_keys(opts, op, KDA_KEYS)
  local pid = choice(opts.path or "chunk", KDA_PATHS, op, "path")
  local chunk = want_int(opts.chunk or defaults.kda.chunk, op, "chunk")
  local lb = opts.gate_lower_bound == nil and defaults.kda.gate_lower_bound
             or want_number(opts.gate_lower_bound, op, "gate_lower_bound")
  want_tensor(q, op, "q")
  return opts, pid, chunk, lb, cu_tensor(opts.cu_seqlens, q, op)
end

function F.kda(q, k, v, g, beta, opts)
  local op = "kda"
  local pid, chunk, lb, cu
  opts, pid, chunk, lb, cu = kda_opts(op, q, opts)
  local o, s = ffi.new("tide_tensor *[1]"), ffi.new("tide_tensor *[1]")
  check_status(C.tide_kda(raw(q), want_tensor(k, op, "k"), want_tensor(v, op, "v"), want_tensor(g, op, "g"),
                          want_tensor(beta, op, "beta"), opt_tensor(opts.s0, op, "s0"), cu and raw(cu) or nil,
                          pid, chunk, lb, o, s))
  return T.wrap(o[0]), T.wrap(s[0])
end

-- F.kda_pairs(q, k, v, g, beta, opts) -> [B, H, dk, dv + dk]: each row's (h_ext | M) (long_context.md §5): F.kda's
--   final state on [v | 0] from s0 = [0 | I], the options as F.kda's (no s0); only the inputs are kept for the backward
function F.kda_pairs(q, k, v, g, beta, opts)
  local op = "kda_pairs"
  local o, pid, chunk, lb, cu = kda_opts(op, q, opts)
  if o.s0 ~= nil then error(op .. ": the pairs start from [0 | I]; s0 is not an option here", 2) end
  return check(C.tide_kda_pairs(raw(q), want_tensor(k, op, "k"), want_tensor(v, op, "v"), want_tensor(g, op, "g"),
                                want_tensor(beta, op, "beta"), cu and raw(cu) or nil, pid, chunk, lb))
end

local GATE_FORMS = { bounded = C.TIDE_KDA_GATE_BOUNDED, softplus = C.TIDE_KDA_GATE_SOFTPLUS }
local GATE_KEYS = { gate_form = true, gate_lower_bound = true }

-- F.kda_gate(z [..., H, D], A_log [H], dt_bias [H·D] or [H, D], opts) -> g (kda.md §2)
--   opts.gate_form: "bounded" (default): g = lb·σ(e^{A_log}(z + dt_bias)); "softplus": g = −e^{A_log}·softplus(z + dt_bias)
--   opts.gate_lower_bound (-5): lb of the bounded form (defaults: tide.defaults.kda)
function F.kda_gate(z, A_log, dt_bias, opts)
  local op = "kda_gate"
  opts = want_opts(opts, op)
  check_keys(opts, op, GATE_KEYS)
  local fid = choice(opts.gate_form or defaults.kda.gate_form, GATE_FORMS, op, "gate_form")
  local lb = opts.gate_lower_bound == nil and defaults.kda.gate_lower_bound
             or want_number(opts.gate_lower_bound, op, "gate_lower_bound")
  return check(C.tide_kda_gate(want_tensor(z, op, "z"), want_tensor(A_log, op, "A_log"),
                               want_tensor(dt_bias, op, "dt_bias"), lb, fid))
end

local CONV_KEYS = { cache = true, cu_seqlens = true, silu = true }

-- a conv weight as [C, K]: the checkpoint layout [C, 1, K] viewed so
local function conv_weight(w, op)
  if w:dim() ~= 3 then return w end
  if w:size(2) ~= 1 then raise(fmt("%s: a 3-d w must be [C, 1, K], got %s", op, T.shape_str(w:shape()))) end
  return w:reshape(w:size(1), w:size(3))
end

-- F.causal_conv1d(x [B, T, C], w [C, K] or [C, 1, K] (the checkpoint layout), opts) -> [B, T, C]
--   y[t] = Σ_j w[:, j]·x[t−K+1+j]; positions before a document start read 0, except in the first document
--   of a row, which reads opts.cache [B, K−1, C] (the previous K−1 inputs; nil = zeros)
--   opts.cu_seqlens: document boundaries over B·T; opts.silu (false): SiLU fused on the output
function F.causal_conv1d(x, w, opts)
  local op = "causal_conv1d"
  opts = want_opts(opts, op)
  check_keys(opts, op, CONV_KEYS)
  want_tensor(x, op, "x")
  want_tensor(w, op, "w")
  w = conv_weight(w, op)
  local cu = cu_tensor(opts.cu_seqlens, x, op)
  return check(C.tide_causal_conv1d(raw(x), raw(w), opt_tensor(opts.cache, op, "cache"), cu and raw(cu) or nil,
                                    bool_int(opts.silu, op, "silu")))
end

-- F.conv_decode_rows(x [R, 1, C] or [R, C], w [C, K] or [C, 1, K], caches, opts) -> shaped as x: one causal-conv
-- decoding step of R rows over their own histories, no gradient. caches: a list of R tensors [1, K−1, C] (each
-- row's previous K−1 inputs; contiguous, each row's own memory) advanced IN PLACE (shifted by one token, x's row
-- appended). opts.silu (false) as for F.causal_conv1d; row r's bits are what F.causal_conv1d gives for its token
-- alone with caches[r] as the cache.
local CONV_ROWS_KEYS = { silu = true }
function F.conv_decode_rows(x, w, caches, opts)
  local op = "conv_decode_rows"
  opts = want_opts(opts, op)
  check_keys(opts, op, CONV_ROWS_KEYS)
  want_tensor(x, op, "x")
  want_tensor(w, op, "w")
  if type(caches) ~= "table" or #caches == 0 then raise(fmt("%s: caches must be a non-empty list of tensors", op)) end
  w = conv_weight(w, op)
  local R = #caches
  local hp = ffi.new("tide_tensor *[?]", R)
  for r = 1, R do hp[r - 1] = want_tensor(caches[r], op, "caches") end
  return check(C.tide_conv_decode_rows(raw(x), raw(w), R, hp, bool_int(opts.silu, op, "silu")))
end

local L2_KEYS = { eps = true, scale = true }

-- F.l2norm(x, {eps = 1e-6, scale = 1}) = scale·x / sqrt(Σx² + eps) over the last dim (eps on the SUM, kda.md §1.3)
function F.l2norm(x, opts)
  local op = "l2norm"
  opts = want_opts(opts, op)
  check_keys(opts, op, L2_KEYS)
  return check(C.tide_l2norm(want_tensor(x, op, "x"), opts.eps == nil and 1e-6 or want_number(opts.eps, op, "eps"),
                             opts.scale == nil and 1 or want_number(opts.scale, op, "scale")))
end

-- ---- ViT positions (spec/vision.md §4) ------------------------------------------------------------------------
-- a Lua list of image grids {{h1, w1}, {h2, w2}, ...} checked: positive integers
local function grid_list(grids, op)
  if type(grids) ~= "table" then raise(fmt("%s: grids must be a list of {h, w} or an int tensor, got %s", op, tname(grids))) end
  for i, g in ipairs(grids) do
    if type(g) ~= "table" or #g ~= 2 then raise(fmt("%s: grids[%d] must be {h, w}, got %s", op, i, tname(g))) end
    for k = 1, 2 do
      local v = g[k]
      if type(v) ~= "number" or v ~= math.floor(v) or v < 1 then
        raise(fmt("%s: grids[%d] must be {h, w} with positive integers, got {%s, %s}", op, i, tostring(g[1]), tostring(g[2])))
      end
    end
  end
  return grids
end

-- F.grid_positions({{h1, w1}, {h2, w2}, ...}) -> i32 [Σ h·w, 2]: (row, col) of every patch, raster order per image,
-- images one after the other (the positions of F.rope2d for a packed batch)
function F.grid_positions(grids)
  local op = "grid_positions"
  grid_list(grids, op)
  local flat = {}
  for _, g in ipairs(grids) do
    for r = 0, g[1] - 1 do
      for c = 0, g[2] - 1 do flat[#flat + 1] = r; flat[#flat + 1] = c end
    end
  end
  return T.from_table(flat, { dtype = "i32", shape = { #flat / 2, 2 } })
end

local ROPE2D_KEYS = { theta = true }

-- F.rope2d(x [T, H, head_dim], pos [T, 2], {theta = 10000}): 2D RoPE, MoonViT's adjacent-pair layout (vision.md §4):
--   slot j rotates (x[2j], x[2j+1]) by p·theta^(−4⌊j/2⌋/head_dim), p = col (even j) or row (odd j); pos an int tensor of
--   (row, col) in [0, 512) per token (F.grid_positions), on any device; head_dim % 4 == 0
function F.rope2d(x, pos, opts)
  local op = "rope2d"
  opts = want_opts(opts, op)
  check_keys(opts, op, ROPE2D_KEYS)
  local theta = opts.theta == nil and 10000 or want_number(opts.theta, op, "theta")
  return check(C.tide_rope2d(want_tensor(x, op, "x"), want_tensor(pos, op, "pos"), theta))
end

-- F.pos_interp(table [G, G, d], grids) -> [Σ h·w, d]: the position table resampled bicubically to every image's grid
--   (PyTorch's interpolate(mode = "bicubic", align_corners = false)), raster order, images concatenated; the table
--   itself where (h, w) = (G, G). grids: a Lua list {{h, w}, ...} or an int tensor [n, 2].
function F.pos_interp(tbl, grids)
  local op = "pos_interp"
  want_tensor(tbl, op, "table")
  if not is_tensor(grids) then
    grid_list(grids, op)
    local flat = {}
    for _, g in ipairs(grids) do flat[#flat + 1] = g[1]; flat[#flat + 1] = g[2] end
    grids = T.from_table(flat, { dtype = "i64", shape = { #grids, 2 } })
  end
  return check(C.tide_pos_interp(raw(tbl), raw(grids)))
end

-- ---- MLA attention (spec/mla.md) ------------------------------------------------------------------------
local MLA_KEYS = { cu_seqlens = true, scale = true }

-- F.mla_attention(q, k_n, k_r, v, opts) -> o [B, Tq, H, dv]
--   q [B, Tq, H, dn + dr] (rope slot last, never rotated: NoPE), k_n [B, Tk, H, dn], k_r [B, Tk, dr] (one
--   rope-slot key for every head; nil when dr = 0), v [B, Tk, H, dv]; causal with the last query on the last
--   key. opts.cu_seqlens: document boundaries over the keys, B·Tk (table or int tensor); with Tq < Tk the queries
--   are each row's last Tq tokens (a context-parallel slice against its gathered prefix); opts.scale
--   (default (dn + dr)^-1/2, mla.md §1). Tiled with an online softmax: memory linear in T.
-- the options both MLA attention ops take: opts checked against keys, the scale (default (dn + dr)^-1/2) and the
-- document boundaries as an int tensor (or nil)
local function mla_opts(op, q, opts, keys)
  opts = want_opts(opts, op)
  check_keys(opts, op, keys)
  want_tensor(q, op, "q")
  local scale = opts.scale == nil and 1 / math.sqrt(q:size(-1)) or want_number(opts.scale, op, "scale")
  return opts, scale, cu_tensor(opts.cu_seqlens, q, op)
end

function F.mla_attention(q, k_n, k_r, v, opts)
  local op = "mla_attention"
  local _, scale, cu = mla_opts(op, q, opts, MLA_KEYS)
  return check(C.tide_mla_attention(raw(q), want_tensor(k_n, op, "k_n"), opt_tensor(k_r, op, "k_r"),
                                    want_tensor(v, op, "v"), cu and raw(cu) or nil, scale))
end

local MLA_LATENT_KEYS = { cu_seqlens = true, scale = true, chunk = true }
F.MLA_LATENT_CHUNK = 1024   -- keys expanded at a time by default

-- F.mla_latent_attention(q, c, k_r, w, opts) -> o [B, Tq, H, dv]: F.mla_attention of the keys and values expanded
--   from the latent c [B, Tk, dc] (k_n^h = W_UK^h c, v^h = W_UV^h c) with w [H, dn + dv, dc] (the kv
--   up-projection's weight as [H, dn + dv, dc]), q and k_r as there; opts.cu_seqlens, opts.scale as there;
--   opts.chunk: keys expanded at a time (default F.MLA_LATENT_CHUNK). The expansion never exists whole, forward or
--   backward; gradients reach q, c, k_r and w. CPU (f32, f64) and CUDA (f32, bf16) backends.
function F.mla_latent_attention(q, c, k_r, w, opts)
  local op = "mla_latent_attention"
  local o, scale, cu = mla_opts(op, q, opts, MLA_LATENT_KEYS)
  local chunk = o.chunk == nil and F.MLA_LATENT_CHUNK or want_number(o.chunk, op, "chunk")
  if chunk % 1 ~= 0 then error(op .. ": chunk must be a whole number of keys, got " .. tostring(chunk), 2) end
  return check(C.tide_mla_latent_attention(raw(q), want_tensor(c, op, "c"), opt_tensor(k_r, op, "k_r"),
                                           want_tensor(w, op, "w"), cu and raw(cu) or nil, scale, chunk))
end

-- F.kda_decode_rows(q, k, v, g, beta, states) -> o [R, H, dv]: one KDA decoding step of R rows over their own
-- states (kda.md §3, §7), no gradient. q, k, g [R, H, dk], v [R, H, dv], beta [R, H]; states: a list of R tensors
-- [1, H, dk, dv] (contiguous, each row's own memory, the state dtype) advanced IN PLACE. Row r's bits are what
-- F.kda's recurrent path gives for its token alone.
function F.kda_decode_rows(q, k, v, g, beta, states)
  local op = "kda_decode_rows"
  if type(states) ~= "table" or #states == 0 then raise(fmt("%s: states must be a non-empty list of tensors", op)) end
  local R = #states
  local sp = ffi.new("tide_tensor *[?]", R)
  for r = 1, R do sp[r - 1] = want_tensor(states[r], op, "states") end
  return check(C.tide_kda_decode_rows(want_tensor(q, op, "q"), want_tensor(k, op, "k"), want_tensor(v, op, "v"),
    want_tensor(g, op, "g"), want_tensor(beta, op, "beta"), R, sp))
end

-- F.mla_decode_rows(qt, qr, c_new, kr_new, c_bufs, kr_bufs, lens, scale) -> õ [R, H, dc]: one absorbed decoding
-- step of R rows over their own latent caches (mla.md §6), no gradient. Row r's new latent c_new[r] (k_r:
-- kr_new[r]) is written at 0-based position lens[r] of its buffers c_bufs[r], kr_bufs[r] ([1, cap, dc] and
-- [1, cap, dr], contiguous, cap > lens[r]), then qt[r] [H, dc], qr[r] [H, dr] attend over its lens[r] + 1 tokens.
-- qr, kr_new and kr_bufs are nil together (no rope slot). A row's result is its own alone, whatever R.
-- c_new and kr_new nil: the buffers hold each row's new token at lens[r] already (nothing is written, and rows may
-- share a buffer: the T queries of one sequence over its own latents, the exact prefill of nn.MLA).
function F.mla_decode_rows(qt, qr, c_new, kr_new, c_bufs, kr_bufs, lens, scale)
  local op = "mla_decode_rows"
  if type(c_bufs) ~= "table" or type(lens) ~= "table" or #lens ~= #c_bufs then
    raise(fmt("%s: c_bufs and lens must be lists of one entry per row", op))
  end
  local R = #c_bufs
  local cb, kb, ln = ffi.new("tide_tensor *[?]", R), kr_bufs and ffi.new("tide_tensor *[?]", R) or nil, ffi.new("int64_t[?]", R)
  for r = 1, R do
    cb[r - 1] = want_tensor(c_bufs[r], op, "c_bufs")
    if kb then kb[r - 1] = want_tensor(kr_bufs[r], op, "kr_bufs") end
    ln[r - 1] = want_number(lens[r], op, "lens")
  end
  return check(C.tide_mla_decode_rows(want_tensor(qt, op, "qt"), opt_tensor(qr, op, "qr"), opt_tensor(c_new, op, "c_new"),
    opt_tensor(kr_new, op, "kr_new"), R, cb, kb, ln, want_number(scale, op, "scale")))
end

-- ---- varlen attention (spec/vision.md §3, §5) ------------------------------------------------------------
local VARLEN_KEYS = { cu_seqlens = true, scale = true }

-- F.varlen_attention(q, k, v, {cu_seqlens = ..., scale = D^-1/2}) -> o [T, H, D]
--   q, k, v [T, H, D]: packed images, bidirectional (not causal) attention inside each image. opts.cu_seqlens
--   (required): the boundaries [0, L_1, L_1 + L_2, ..., T] (table of ints or int tensor; non-decreasing).
--   Tiled with an online softmax (the MLA kernels): no [T, T] buffer, memory linear in T.
function F.varlen_attention(q, k, v, opts)
  local op = "varlen_attention"
  opts = want_opts(opts, op)
  check_keys(opts, op, VARLEN_KEYS)
  want_tensor(q, op, "q")
  if opts.cu_seqlens == nil then
    raise(fmt("%s: opts.cu_seqlens is required (the image boundaries [0, L_1, ..., T])", op))
  end
  local scale = opts.scale == nil and 1 / math.sqrt(q:size(-1)) or want_number(opts.scale, op, "scale")
  local cu = cu_tensor(opts.cu_seqlens, q, op)
  return check(C.tide_varlen_attention(raw(q), want_tensor(k, op, "k"), want_tensor(v, op, "v"), raw(cu), scale))
end

-- ---- Attention Residuals (spec/attnres.md) -----------------------------------------------------------------
local ATTNRES_KEYS = { eps = true }

-- F.attnres({v_1, ..., v_N}, w, nu, {eps = 1e-5}) -> Σ_i p_i v_i, p = softmax_i(r_i (w ⊙ nu)·v_i),
--   r_i = (mean v_i² + eps)^-1/2 (attnres.md §1): sources of one shape [..., d], w [d] or [1, d] (the checkpoint's
--   `proj` layout), nu [d]. One fused op; the values are the raw sources.
function F.attnres(sources, w, nu, opts)
  local op = "attnres"
  opts = want_opts(opts, op)
  check_keys(opts, op, ATTNRES_KEYS)
  if type(sources) ~= "table" or #sources == 0 then
    raise(fmt("%s: sources must be a non-empty table of tensors, got %s", op,
              type(sources) == "table" and "an empty table" or tname(sources)))
  end
  local n = #sources
  local arr = ffi.new("tide_tensor *[?]", n)
  for i = 1, n do arr[i - 1] = want_tensor(sources[i], op, "source " .. i) end
  -- the engine counts sources from 0; name them 1-based here, like the Lua table
  local s1 = T.shape_str(sources[1]:shape())
  for i = 2, n do
    local si = T.shape_str(sources[i]:shape())
    if si ~= s1 then raise(fmt("%s: source %d is %s but source 1 is %s: all sources need one shape", op, i, si, s1)) end
  end
  want_tensor(w, op, "w")
  if w:dim() == 2 then
    if w:size(1) ~= 1 then raise(fmt("%s: a 2-d w must be [1, d], got %s", op, T.shape_str(w:shape()))) end
    w = w:reshape(w:size(2))
  end
  local eps = opts.eps == nil and defaults.norm_eps or want_number(opts.eps, op, "eps")
  return check(C.tide_attnres(n, arr, raw(w), want_tensor(nu, op, "nu"), eps))
end

-- ---- sparse MoE (spec/moe.md) -----------------------------------------------------------------------------
local SITU_KEYS = { k_gate = true, k_lin = true }

-- F.situ_glu(g, u, opts) = k_gate tanh(g/k_gate) σ(g) ⊙ k_lin tanh(u/k_lin) (moe.md §6); opts.k_gate (4), opts.k_lin (25)
-- (tide.defaults.situ)
function F.situ_glu(g, u, opts)
  local op = "situ_glu"
  opts = want_opts(opts, op)
  check_keys(opts, op, SITU_KEYS)
  local kg = opts.k_gate == nil and defaults.situ.k_gate or want_number(opts.k_gate, op, "k_gate")
  local kl = opts.k_lin == nil and defaults.situ.k_lin or want_number(opts.k_lin, op, "k_lin")
  return check(C.tide_situ_glu(want_tensor(g, op, "g"), want_tensor(u, op, "u"), kg, kl))
end

-- F.topk(x, k) -> values, indices over the last dim: descending, ties to the lowest index (moe.md §2);
-- indices are i64 and 0-based (data, like every index value); values carry the gradient
function F.topk(x, k)
  local op = "topk"
  want_tensor(x, op, "x")
  k = want_int(k, op, "k")
  local v, i = ffi.new("tide_tensor *[1]"), ffi.new("tide_tensor *[1]")
  check_status(C.tide_topk(raw(x), k, v, i))
  return T.wrap(v[0]), T.wrap(i[0])
end

local MOE_ACTS = { situ = C.TIDE_MOE_SITU, swiglu = C.TIDE_MOE_SWIGLU }
local MOE_KEYS = { activation = true, k_gate = true, k_lin = true, capacity_factor = true, capacity = true }

-- F.moe_experts(x, sel, p, w_gate_up, w_down, opts) -> u [m, d_out], dropped (moe.md §7, §8)
--   x [m, d_in], sel [m, k] 0-based expert ids (int tensor or Lua table of rows), p [m, k] routing weights,
--   w_gate_up [n, 2·d_e, d_in] (gate rows, then up rows), w_down [n, d_out, d_e]
--   opts.activation "situ" (default) | "swiglu"; opts.k_gate (4), opts.k_lin (25);
--   opts.capacity_factor (0 = dropless; > 0 keeps ceil(cf·m·k/n) assignments per expert), or opts.capacity (that
--   count given directly); dropped = the count lost
function F.moe_experts(x, sel, p, w_gate_up, w_down, opts)
  local op = "moe_experts"
  opts = want_opts(opts, op)
  check_keys(opts, op, MOE_KEYS)
  local act = choice(opts.activation or "situ", MOE_ACTS, op, "activation")
  local kg = opts.k_gate == nil and defaults.situ.k_gate or want_number(opts.k_gate, op, "k_gate")
  local kl = opts.k_lin == nil and defaults.situ.k_lin or want_number(opts.k_lin, op, "k_lin")
  local cf = opts.capacity_factor == nil and 0 or want_number(opts.capacity_factor, op, "capacity_factor")
  want_tensor(x, op, "x")
  sel = index_tensor(sel, x, op, "sel")
  local dropped = ffi.new("int64_t[1]")
  local u
  if opts.capacity ~= nil and opts.capacity ~= 0 then
    if opts.capacity_factor ~= nil then raise(op .. ": give capacity or capacity_factor, not both") end
    local cap = want_number(opts.capacity, op, "capacity")
    u = check(C.tide_moe_experts_capacity(raw(x), raw(sel), want_tensor(p, op, "p"), want_tensor(w_gate_up, op,
      "w_gate_up"), want_tensor(w_down, op, "w_down"), act, kg, kl, cap, dropped))
  else
    u = check(C.tide_moe_experts(raw(x), raw(sel), want_tensor(p, op, "p"), want_tensor(w_gate_up, op, "w_gate_up"),
                                 want_tensor(w_down, op, "w_down"), act, kg, kl, cf, dropped))
  end
  return u, tonumber(dropped[0])
end

-- F.adamw_step_(param, grad, m, v, opts): one in-place AdamW update (optim.md §2)
--   opts: lr, beta1 (0.9), beta2 (0.95), eps (1e-8), weight_decay (0.1), step (updates done before, 0-based)
--   (defaults from optim.md)
function F.adamw_step_(param, grad, m, v, opts)
  local op = "adamw_step_"
  opts = want_opts(opts, op)
  local lr = want_number(opts.lr, op, "lr")
  local step = want_number(opts.step or 0, op, "step")
  check_status(C.tide_adamw_step_(want_tensor(param, op, "param"), want_tensor(grad, op, "grad"),
                                  want_tensor(m, op, "m"), want_tensor(v, op, "v"), lr,
                                  opts.beta1 or 0.9, opts.beta2 or 0.95, opts.eps or 1e-8,
                                  opts.weight_decay or 0.1, step))
  return param
end

return F
