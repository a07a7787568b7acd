-- data/mqar.lua — multi-query associative recall (spec/evals.md §1, after Zoology's associative_recall.py):
-- D key–value pairs as context, then every key queried once at a power-law-distributed gap; the label at a
-- query is its key's value (the token after the query), every other label is ignored (F.cross_entropy's -100).
--
-- Ids: every task id and label v is written as id_base + v (default 0; data/synthetic.lua puts the task at bytes
-- 128 + v). Filler (the query-region positions that are not queries), evals.md §1 and two tide additions that keep
-- the answers well defined while the filler is not one repeated token:
--   "zero"    id_base + 0 everywhere (evals.md);
--   "random"  uniform over the task's ids id_base + [0, V) (evals.md: it may collide with keys), or, with
--             filler_range = {lo, hi}, uniform over the ids [lo, hi), which must not overlap the task's
--             [id_base, id_base + V): no key, value or 0 is ever filler;
--   "text"    a contiguous span of a text document source (filler_text, any object with pack.lua's span(u, n,
--             keep)), read in order around the queries, leaving out every id of [id_base, id_base + V): the
--             documents look like text to the layers that see them.
--
-- Example i is a pure function of (V, T, D, power, filler, filler_range, id_base, seed, i) (and of filler_text's
-- content): its uniforms come from the Philox stream keyed by (task "mqar", seed) at counters [i·2^32, i·2^32 +
-- 3D + T), so it is the same whatever batch, stream or machine draws it. u[3D + t] is the random filler at
-- position t; u[3D] is the start of the text span.
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local task = require "tide.data.task"
local C = tide.C

local mqar = {}

mqar.IGNORE = -100                      -- F.cross_entropy's default ignore_index
mqar.DEFAULTS = { vocab_size = 1024, seq_len = 256, num_pairs = 16, power = 0.01, filler = "zero", seed = 0,
  id_base = 0 }
mqar.KEYS = { vocab_size = true, seq_len = true, num_pairs = true, power = true, filler = true, seed = true,
  filler_text = true, filler_range = true, id_base = true }
mqar.FILLERS = { zero = true, random = true, text = true }

local TASK = 0x6d717172ULL              -- "mqar": the task half of the Philox key
local STRIDE = 4294967296ULL            -- counters per example (2^32 >= 3D + T for any T that fits in memory)

local fmt = string.format

-- errors point at the first line outside lua/tide (tide.options)
local WHO = "mqar"
local function bad(msg) options.fail(WHO, msg) end
local function int_at_least(v, lo, name) return options.int_at_least(v, lo, name, WHO) end

-- checked configs carry this metatable, so batch() and stream() skip re-checking them
local Checked = {}

-- check(cfg) -> a full, validated copy of cfg (defaults filled); errors name the parameter and the values
function mqar.check(cfg)
  if getmetatable(cfg) == Checked then return cfg end
  if cfg ~= nil and type(cfg) ~= "table" then bad("config must be a table, got " .. type(cfg)) end
  local c = options.with_defaults(cfg or {}, mqar.DEFAULTS, mqar.KEYS, nil, WHO)
  local V = int_at_least(c.vocab_size, 4, "vocab_size")
  local T = int_at_least(c.seq_len, 4, "seq_len")
  local D = int_at_least(c.num_pairs, 1, "num_pairs")
  if V % 2 ~= 0 then bad(fmt("vocab_size must be even (keys from [1, V/2), values from [V/2, V)), got %d", V)) end
  if T % 2 ~= 0 then bad(fmt("seq_len must be even (pairs and query slots are 2 tokens), got %d", T)) end
  if 4 * D > T then bad(fmt("num_pairs D = %d needs 4D <= seq_len, got 4D = %d > %d", D, 4 * D, T)) end
  if D > V / 2 - 1 then bad(fmt("num_pairs D = %d exceeds the %d distinct keys of [1, %d)", D, V / 2 - 1, V / 2)) end
  if type(c.power) ~= "number" or not (c.power > 0) or c.power > 1 then
    bad(fmt("power must be in (0, 1], got %s", tostring(c.power)))
  end
  local base = options.nonneg_int(c.id_base, "id_base", WHO)
  options.one_of(c.filler, mqar.FILLERS, "filler", WHO)
  local fr = c.filler_range
  if fr ~= nil then
    if c.filler ~= "random" then bad(fmt("filler_range is used only with filler = \"random\", got filler = %q", c.filler)) end
    if type(fr) ~= "table" or not (options.is_int(fr[1]) and options.is_int(fr[2]) and fr[1] >= 0 and fr[1] < fr[2]) then
      bad(fmt("filler_range must be {lo, hi}, integers with 0 <= lo < hi, got %s", type(fr) == "table" and
        fmt("{%s, %s}", tostring(fr[1]), tostring(fr[2])) or tostring(fr)))
    end
    if fr[1] < base + V and fr[2] > base then
      bad(fmt("filler_range [%d, %d) overlaps the task's ids [%d, %d) (keys, values and 0): filler must never be "
        .. "an answer", fr[1], fr[2], base, base + V))
    end
    c.filler_range = { fr[1], fr[2] }
  end
  task.check_filler_text(c, WHO)
  int_at_least(c.seed, 0, "seed")
  if c.seed >= 2 ^ 32 then bad(fmt("seed must be < 2^32, got %d", c.seed)) end
  c.slots = (T - 2 * D) / 2
  return setmetatable(c, Checked)
end

-- the gap weights w_g = a·(g+1)^(a−1), g ∈ [0, S) (evals.md §1), cached per (S, a)
local weight_cache = {}
function mqar.gap_weights(S, a)
  local key = S .. ":" .. a
  local w = weight_cache[key]
  if not w then
    w = { n = S, total = 0 }
    for g = 0, S - 1 do
      w[g] = a * (g + 1) ^ (a - 1)
      w.total = w.total + w[g]
    end
    weight_cache[key] = w
  end
  return w
end

-- D distinct integers uniform in [lo, hi) from u[at .. at+D): a partial Fisher–Yates shuffle of the range,
-- touching only the swapped entries
local function distinct(u, at, D, lo, hi, out)
  local n, swap = hi - lo, {}
  for j = 0, D - 1 do
    local r = j + math.floor(u[at + j] * (n - j))
    local pick = swap[r] or r
    swap[r] = swap[j] or j
    out[j] = lo + pick
  end
end

-- example indices stay below 2^32 so their counter ranges never overlap
local MAX_INDEX = 2 ^ 32

local ubuf, ubuf_n = nil, 0
local function uniforms(n)
  if n > ubuf_n then ubuf, ubuf_n = ffi.new("double[?]", n), n end
  return ubuf
end

-- the text filler's rule: any id outside the task's range [base, base + V)
local function text_keep(base, V) return function(id) return id < base or id >= base + V end end
mqar.text_keep = text_keep

-- filler_id(c, u) -> the random filler id for the uniform u: id_base + ⌊V·u⌋, or lo + ⌊(hi − lo)·u⌋ in filler_range
function mqar.filler_id(c, u)
  local fr = c.filler_range
  if fr then return fr[1] + math.floor(u * (fr[2] - fr[1])) end
  return c.id_base + math.floor(u * c.vocab_size)
end

-- fill(c, i, x, y, off): example i of the checked config c into x[off .. off+T) (ids) and y[off .. off+T)
-- (labels); x, y are ffi integer arrays. Returns keys, values, gaps (0-based Lua arrays of D) for tests.
function mqar.fill(c, i, x, y, off)
  local base = c.id_base
  local V, T, D, S = c.vocab_size, c.seq_len, c.num_pairs, c.slots
  local random_filler, text_filler = c.filler == "random", c.filler == "text"
  local n_u = 3 * D + (random_filler and T or text_filler and 1 or 0)
  local u = uniforms(n_u)
  C.tide_philox_uniform(TASK * STRIDE + c.seed, ffi.cast("uint64_t", i) * STRIDE, u, n_u)
  local keys, values, gaps = {}, {}, {}
  distinct(u, 0, D, 1, V / 2, keys)
  distinct(u, D, D, V / 2, V, values)
  -- gaps one at a time without replacement, P ∝ w over the remaining ones
  local w, used = mqar.gap_weights(S, c.power), {}
  local total = w.total
  for j = 0, D - 1 do
    local r, acc, pick, last = u[2 * D + j] * total, 0, nil, nil
    for g = 0, S - 1 do
      if not used[g] then
        acc = acc + w[g]
        last = g
        if r < acc then pick = g break end
      end
    end
    pick = pick or last           -- r ≥ the running sum only through rounding of `total`
    used[pick] = true
    total = total - w[pick]
    gaps[j] = pick
  end
  for t = 0, T - 1 do y[off + t] = mqar.IGNORE end
  for j = 0, D - 1 do
    x[off + 2 * j] = base + keys[j]
    x[off + 2 * j + 1] = base + values[j]
  end
  if text_filler then
    -- the T − 3D non-query positions of the query region, in order, take one span of text
    local query = {}
    for j = 0, D - 1 do query[2 * D + 2 * gaps[j]] = true end
    local span, k = c.filler_text:span(u[3 * D], T - 3 * D, text_keep(base, V)), 0
    for t = 2 * D, T - 1 do
      if not query[t] then x[off + t] = span[k]; k = k + 1 end
    end
  else
    for t = 2 * D, T - 1 do
      x[off + t] = random_filler and mqar.filler_id(c, u[3 * D + t]) or base
    end
  end
  for j = 0, D - 1 do
    local p = 2 * D + 2 * gaps[j]
    x[off + p] = base + keys[j]
    y[off + p] = base + values[j]
  end
  return keys, values, gaps
end

-- example(cfg, i) -> ids, labels (Lua lists of T, 1-based), info {keys, values, gaps} (0-based arrays of D);
-- i is the 0-based example index
function mqar.example(cfg, i)
  local c = mqar.check(cfg)
  int_at_least(i, 0, "example index")
  if i >= MAX_INDEX then bad(fmt("example index must be < 2^32, got %d", i)) end
  local x, y = ffi.new("int64_t[?]", c.seq_len), ffi.new("int64_t[?]", c.seq_len)
  local keys, values, gaps = mqar.fill(c, i, x, y, 0)
  local ids, labels = {}, {}
  for t = 0, c.seq_len - 1 do ids[t + 1], labels[t + 1] = tonumber(x[t]), tonumber(y[t]) end
  return ids, labels, { keys = keys, values = values, gaps = gaps }
end

-- batch(cfg, first, n) -> ids [n, T] i32, targets [n, T] i64: examples first .. first+n−1
function mqar.batch(cfg, first, n)
  local c = mqar.check(cfg)
  int_at_least(first, 0, "first")
  int_at_least(n, 1, "n")
  if first + n > MAX_INDEX then bad(fmt("examples %d .. %d reach past index 2^32", first, first + n - 1)) end
  local T = c.seq_len
  local x, y = ffi.new("int32_t[?]", n * T), ffi.new("int64_t[?]", n * T)
  for b = 0, n - 1 do mqar.fill(c, first + b, x, y, b * T) end
  local shape = ffi.new("int64_t[2]", n, T)
  local ids = tide.check(C.tide_from_bytes(C.tide_dtype_from_name("i32"), 2, shape, 0, x, n * T * 4))
  local targets = tide.check(C.tide_from_bytes(C.tide_dtype_from_name("i64"), 2, shape, 0, y, n * T * 8))
  return ids, targets
end

-- accuracy(logits [B, T, V], targets [B, T]) -> mean over labelled positions of 1[argmax = label], and the
-- number of labelled positions (evals.md §1)
function mqar.accuracy(logits, targets)
  local pred = logits:argmax(-1):to("i64")
  local n = pred:numel()
  if targets:numel() ~= n then
    bad(fmt("accuracy: logits hold %d positions but targets %d", n, targets:numel()))
  end
  targets = targets:to("i64")
  local p, t = ffi.new("int64_t[?]", n), ffi.new("int64_t[?]", n)
  tide.check_status(C.tide_read_bytes(tide.raw(pred), p, n * 8))
  tide.check_status(C.tide_read_bytes(tide.raw(targets), t, n * 8))
  local hit, labelled = 0, 0
  for k = 0, n - 1 do
    if t[k] ~= mqar.IGNORE then
      labelled = labelled + 1
      if p[k] == t[k] then hit = hit + 1 end
    end
  end
  if labelled == 0 then bad("accuracy: no labelled positions in targets") end
  return hit / labelled, labelled
end

-- a batch stream for tide.train: batch k holds examples (k·B + b) mod `examples`, b < B; the cursor is the
-- whole state, so a checkpoint resumes it exactly
local Stream = {}
Stream.__index = Stream

function mqar.stream(cfg, opts)
  local c = mqar.check(cfg)
  local B = int_at_least(opts.batch_size, 1, "batch_size")
  local N = int_at_least(opts.examples or MAX_INDEX, B, "examples")
  if N > MAX_INDEX then bad(fmt("examples must be <= 2^32, got %d", N)) end
  return setmetatable({ cfg = c, B = B, T = c.seq_len, examples = N, cursor = 0 }, Stream)
end

function Stream:next()
  local first = (self.cursor * self.B) % self.examples
  self.cursor = self.cursor + 1
  if first + self.B <= self.examples then return mqar.batch(self.cfg, first, self.B) end
  -- a batch that wraps around the end of the set: build it example by example
  local T, B = self.T, self.B
  local x, y = ffi.new("int32_t[?]", B * T), ffi.new("int64_t[?]", B * T)
  for b = 0, B - 1 do mqar.fill(self.cfg, (first + b) % self.examples, x, y, b * T) end
  local shape = ffi.new("int64_t[2]", B, T)
  return tide.check(C.tide_from_bytes(C.tide_dtype_from_name("i32"), 2, shape, 0, x, B * T * 4)),
    tide.check(C.tide_from_bytes(C.tide_dtype_from_name("i64"), 2, shape, 0, y, B * T * 8))
end

function Stream:state() return { task = "mqar", seed = self.cfg.seed, cursor = self.cursor } end

function Stream:set_state(s)
  if s.task ~= "mqar" or s.seed ~= self.cfg.seed then
    bad(fmt("checkpoint stream (task %s, seed %s) differs from the configured one (mqar, seed %d)",
      tostring(s.task), tostring(s.seed), self.cfg.seed))
  end
  self.cursor = s.cursor
end

function Stream:reset() self.cursor = 0 end

-- build(dcfg, vocab_size) -> the data.build result for `data = {task = "mqar", ...}`: train examples from
-- `seed`, validation examples from `val_seed` (default seed + 1) so the two sets are disjoint streams;
-- sizes after Zoology (100k train, 3k test)
function mqar.build(dcfg, vocab_size)
  local c = {
    vocab_size = dcfg.vocab_size or vocab_size or mqar.DEFAULTS.vocab_size, seq_len = dcfg.seq_len,
    num_pairs = dcfg.num_pairs, power = dcfg.power, filler = dcfg.filler, seed = dcfg.seed or 0,
  }
  local train_n = dcfg.examples or 100000
  local val_n = dcfg.val_examples or 3000
  local B = dcfg.batch_size
  local train_cfg = mqar.check(c)
  c.seed = dcfg.val_seed or (train_cfg.seed + 1)
  local val_cfg = mqar.check(c)
  local T = train_cfg.seq_len
  return {
    tokenizer = { kind = "mqar", vocab_size = train_cfg.vocab_size },
    dataset = { train = { n = train_n * T }, val = { n = val_n * T }, files = {} },
    train = mqar.stream(train_cfg, { batch_size = B, examples = train_n }),
    val = function() return mqar.stream(val_cfg, { batch_size = B, examples = val_n }) end,
    cfg = train_cfg, val_cfg = val_cfg,
  }
end

return mqar
