-- tide.F: functional forms of the engine's ops (tide.h), with argument checks that name the op and
-- the argument. Dims are 1-based like everywhere in Lua; index VALUES (ids, gather/scatter indices)
-- are data and stay 0-based. Index arguments may be given as Lua tables; they become i64 tensors.
local ffi = require "ffi"
local tide = require "tide"
local T = require "tide.tensor"
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
  local y = check(C.tide_matmul(want_tensor(x, "linear", "x"), want_tensor(w, "linear", "weight"), 0, 1))
  if b ~= nil then y = check(C.tide_add(raw(y), want_tensor(b, "linear", "bias"))) end
  return y
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
                              eps == nil and 1e-5 or want_number(eps, "rmsnorm", "eps")))
end

-- F.layernorm(x, weight, bias[, eps=1e-5]) over the last dim (weight/bias may be nil where the engine allows)
function F.layernorm(x, w, b, eps)
  return check(C.tide_layernorm(want_tensor(x, "layernorm", "x"), opt_tensor(w, "layernorm", "weight"),
                                opt_tensor(b, "layernorm", "bias"),
                                eps == nil and 1e-5 or want_number(eps, "layernorm", "eps")))
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
for _, name in ipairs { "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "softplus", "relu", "abs" } do
  local f = C["tide_" .. name]
  F[name] = function(x) return check(f(want_tensor(x, name, "x"))) end
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
