-- data/synthetic.lua — synthetic long-range tasks as DOCUMENT SOURCES for the packer (spec/long_context.md §2–§3:
-- "long" data includes synthetic retrieval; every document begins with the end-of-text separator) over the
-- generators of spec/evals.md §1–§3, all in the shared byte-level vocabulary (formats.md §4, V = 320):
--
--   local src = synthetic.source{ task = "passkey" | "copy" | "mqar", seed = 1, length = "stage" | N | {N1, N2, ...},
--                                 tokenizer = tok, split = "train" | "eval", ...task options }
--   src.name                               -- the task name
--   local ids, targets, n = src:doc(i, T)  -- document i (0-based) for stage length T: ffi int32_t[n] (0-based)
--   src:describe()                         -- one line
--
-- ids[0] is always <|endoftext|>; the example (length n − 1) follows. targets[t] labels position t (the token it
-- must predict) or is -100; targets[0] and targets[n−1] are -100 (the packer owns a segment's last label).
-- length = "stage": n = T (the document fills one row); a number: that document length whatever T (a longer one
-- is cut by the packer); a list: document i takes list[⌊#list·u_i⌋ + 1], u_i from the Philox stream keyed by
-- ("synt", seed) at counter 4·index.
--
-- Tasks and their options:
--   passkey  (evals.md §2, data/passkey.lua)  depth = "uniform" (training) | δ ∈ [0, 1] (eval grid);
--            filler = "sentence" | "random" | "text".  n ≥ 14 (12 needle/query tokens + ≥ 1 filler).  5 labels.
--   copy     (evals.md §3, data/copy.lua)     N = (n − 2)/2 inputs, so n must be even and ≥ 4.  N labels.
--   mqar     (evals.md §1, data/mqar.lua)     vocab_size = V_task (even, ≤ 128; default 128), num_pairs = D
--            (default 16), power (0.01), filler = "zero" | "random" | "text", filler_range = {lo, hi} (random
--            filler from the bytes [lo, hi) instead of the task's own ids; they must not overlap the task's
--            128 .. 127 + V_task, e.g. {160, 256} for V_task = 32). The mqar generator's example at
--            seq_len = n − 1 rounded down to even, every id and label v mapped to byte 128 + v (so it never
--            collides with ASCII text); when n − 1 is odd one more query-region filler token follows it
--            (128 for zero filler, a random filler id from u, the first kept token of the text from ⌊u·N⌋ for
--            text; u at counter 4·index + 1 of the "synt" stream), never labelled. n ≥ 4D + 1.  D labels.
-- Fillers that are not one repeated token, and never an answer (tide additions to evals.md's filler kinds):
-- mqar's random filler over a filler_range outside the task's ids, and filler = "text" with filler_text = a text
-- document source (pack.text_source; in a curriculum's sources, filler_source = its name): a contiguous span of
-- that text without the ids the task scores (passkey: the digits; mqar: its ids 128 .. 127 + V_task) and without
-- <|endoftext|>, so a recall document reads like text with the task in it. MoE routers can split either filler
-- over experts, which they cannot do with a document that is mostly one token (zero filler).
--
-- Determinism: doc(i, T) is a pure function of (task, seed, split, i, T, options). split = "eval" reads the
-- generators' example index 2^31 + i, training documents the index i < 2^31, so evaluation examples are disjoint
-- from training ones whatever the two seeds are.
local ffi = require "ffi"
local tide = require "tide"
local passkey = require "tide.data.passkey"
local copy = require "tide.data.copy"
local mqar = require "tide.data.mqar"
local options = require "tide.options"
local C = tide.C

local synthetic = {}

synthetic.IGNORE = -100
synthetic.TASKS = { "passkey", "copy", "mqar" }
synthetic.MQAR_BASE = 128               -- MQAR id v ↦ byte id 128 + v
synthetic.MQAR_MAX_VOCAB = 128
synthetic.EVAL_BASE = 2 ^ 31            -- the eval split's example indices start here
synthetic.MAX_DOCS = 2 ^ 31             -- documents per split
synthetic.MQAR_DEFAULTS = { vocab_size = 128, num_pairs = 16, power = 0.01, filler = "zero" }

local AUX = 0x73796e74ULL               -- "synt": length choices and the MQAR pad token
local STRIDE = 4294967296ULL

local fmt = string.format
local COMMON = { task = true, length = true, split = true }
local TASK_KEYS = {
  passkey = { seed = true, tokenizer = true, depth = true, filler = true, filler_text = true },
  copy = { seed = true, tokenizer = true },
  mqar = { seed = true, tokenizer = true, vocab_size = true, num_pairs = true, power = true, filler = true,
    filler_text = true, filler_range = true },
}

local is_int = options.is_int

-- the filler kind for describe(): text names the source it draws from
function synthetic.filler_name(c)
  if c.filler == "random" and c.filler_range then return fmt("random in [%d, %d)", c.filler_range[1], c.filler_range[2]) end
  if c.filler ~= "text" then return c.filler end
  return fmt("text (%s)", tostring(c.filler_text and c.filler_text.name or "?"))
end

-- the keys source(opts) accepts for each task: COMMON and the task's own
local SOURCE_KEYS = {}
for task, keys in pairs(TASK_KEYS) do
  local all = {}
  for k in pairs(COMMON) do all[k] = true end
  for k in pairs(keys) do all[k] = true end
  SOURCE_KEYS[task] = all
end
synthetic.KEYS = { common = COMMON, tasks = TASK_KEYS }   -- tide.schema: the keys of a source and of a task eval

local aux_buf = ffi.new("double[1]")
local function aux_uniform(seed, index, k)
  C.tide_philox_uniform(AUX * STRIDE + seed, ffi.cast("uint64_t", index) * 4 + k, aux_buf, 1)
  return aux_buf[0]
end

-- ---- per-task document length checks and fills -------------------------------------------------------
-- check_length(self, n, where) errors when a document of n tokens cannot hold the task; `where` names the
-- option the length came from. fill(self, index, L, x, y) writes the example of length L at x[1 ..], y[1 ..].

local Task = {}

Task.passkey = {
  check_length = function(self, n, where)
    if n < passkey.MIN_LENGTH + 1 then
      error(fmt("passkey: %s is too short: a document is <|endoftext|> + 12 needle/query tokens + at least 1 "
        .. "filler token (>= %d)", where, passkey.MIN_LENGTH + 1), 4)
    end
  end,
  fill = function(self, index, L, x, y) passkey.fill(self.cfg, index, L, x, y, 1) end,
  labels = function(self, n) return passkey.DIGITS end,
  describe = function(self)
    local c = self.cfg
    return fmt("depth %s, filler %s", type(c.depth) == "number" and fmt("%g", c.depth) or c.depth,
      synthetic.filler_name(c))
  end,
}

Task.copy = {
  check_length = function(self, n, where)
    if n % 2 ~= 0 or n < 4 then
      error(fmt("copy: %s must be even and >= 4: a document is <|endoftext|> + N inputs + <|sep|> + N outputs "
        .. "= 2N + 2 tokens", where), 4)
    end
  end,
  fill = function(self, index, L, x, y) copy.fill(self.cfg, index, (L - 1) / 2, x, y, 1) end,
  labels = function(self, n) return (n - 2) / 2 end,
  describe = function(self) return "alphabet 64" end,
}

Task.mqar = {
  check_length = function(self, n, where)
    local D = self.cfg.num_pairs
    if n < 4 * D + 1 then
      error(fmt("mqar: %s is too short for num_pairs = %d: a document is <|endoftext|> + an example of "
        .. ">= 4·num_pairs = %d tokens (>= %d)", where, D, 4 * D, 4 * D + 1), 4)
    end
  end,
  fill = function(self, index, L, x, y)
    local S = L - L % 2                                   -- the mqar generator needs an even seq_len
    local mc = self.mqar_cfgs[S]
    if not mc then
      local c = self.cfg
      mc = mqar.check({ vocab_size = c.vocab_size, seq_len = S, num_pairs = c.num_pairs, power = c.power,
        filler = c.filler, seed = c.seed, filler_text = c.filler_text, filler_range = c.filler_range,
        id_base = synthetic.MQAR_BASE })
      self.mqar_cfgs[S] = mc
    end
    mqar.fill(mc, index, x, y, 1)
    if S < L then                                         -- one more unlabelled query-region filler slot
      local u = aux_uniform(mc.seed, index, 1)
      if mc.filler == "text" then
        x[L] = mc.filler_text:span(u, 1, mqar.text_keep(mc.id_base, mc.vocab_size))[0]
      elseif mc.filler == "random" then
        x[L] = mqar.filler_id(mc, u)
      else
        x[L] = mc.id_base
      end
      y[L] = synthetic.IGNORE
    end
  end,
  labels = function(self, n) return self.cfg.num_pairs end,
  describe = function(self)
    local c = self.cfg
    return fmt("vocab_size %d (ids 128..%d), num_pairs %d, power %g, filler %s", c.vocab_size,
      127 + c.vocab_size, c.num_pairs, c.power, synthetic.filler_name(c))
  end,
}

local function check_mqar(t)
  local c = {}
  for k, v in pairs(synthetic.MQAR_DEFAULTS) do c[k] = v end
  for k, v in pairs(t) do c[k] = v end
  c.seed = c.seed or 0
  local V = c.vocab_size
  if not is_int(V) or V % 2 ~= 0 or V < 4 or V > synthetic.MQAR_MAX_VOCAB then
    error(fmt("mqar: vocab_size (V_task) must be an even integer in [4, %d] so that ids 128 + v stay bytes "
      .. "128..255, got %s", synthetic.MQAR_MAX_VOCAB, tostring(V)), 4)
  end
  if not is_int(c.num_pairs) or c.num_pairs < 1 then
    error(fmt("mqar: num_pairs must be an integer >= 1, got %s", tostring(c.num_pairs)), 4)
  end
  -- the generator's own checks (distinct keys, power, filler, seed) at the shortest valid seq_len
  local fr = c.filler_range
  if fr ~= nil and type(fr) == "table" and options.is_int(fr[2]) and fr[2] > 256 then
    error(fmt("mqar: filler_range must lie in the bytes [0, 256) (ids from 256 on are special tokens), got {%s, %d}",
      tostring(fr[1]), fr[2]), 4)
  end
  mqar.check({ vocab_size = V, seq_len = 4 * c.num_pairs, num_pairs = c.num_pairs, power = c.power,
    filler = c.filler, seed = c.seed, filler_text = c.filler_text, filler_range = fr, id_base = synthetic.MQAR_BASE })
  return c
end

-- ---- the source ----------------------------------------------------------------------------------------

local Source = {}
Source.__index = Source

-- source(opts) -> a document source (see the header)
function synthetic.source(opts)
  if type(opts) ~= "table" then error("synthetic.source: expected an options table, got " .. type(opts), 2) end
  local task = opts.task
  if not TASK_KEYS[task] then
    error(fmt("synthetic.source: task must be one of %s, got %s", table.concat(synthetic.TASKS, ", "),
      tostring(task)), 2)
  end
  local split = opts.split or "train"
  if split ~= "train" and split ~= "eval" then
    error(fmt("%s: split must be \"train\" or \"eval\", got %s", task, tostring(split)), 2)
  end
  options.check(opts, SOURCE_KEYS[task], nil, task)
  local task_opts = {}
  for k, v in pairs(opts) do
    if not COMMON[k] then task_opts[k] = v end
  end
  local tok = opts.tokenizer or require("tide.data.tokenizer").byte_level({ vocab_size = 320 })
  if type(tok) ~= "table" or tok.kind ~= "byte" then
    error(fmt("%s: tokenizer must be a byte-level tokenizer (the tasks use byte ids), got %s", task,
      type(tok) == "table" and tostring(tok.kind) or type(tok)), 2)
  end
  task_opts.tokenizer = tok
  local self = setmetatable({ name = task, task = task, split = split, tokenizer = tok,
    eot = tok:id("<|endoftext|>"), impl = Task[task], mqar_cfgs = {} }, Source)
  if task == "passkey" then self.cfg = passkey.check(task_opts)
  elseif task == "copy" then self.cfg = copy.check(task_opts)
  else
    task_opts.tokenizer = nil
    self.cfg = check_mqar(task_opts)
  end
  self.seed = self.cfg.seed

  local length = opts.length or "stage"
  if length == "stage" then
    self.length = "stage"
  elseif is_int(length) then
    if length < 1 then error(fmt("%s: length must be >= 1, got %d", task, length), 2) end
    self.impl.check_length(self, length, fmt("length %d", length))
    self.length = length
  elseif type(length) == "table" then
    if #length == 0 then error(task .. ": length list is empty", 2) end
    local list = {}
    for k = 1, #length do
      local n = length[k]
      if not is_int(n) or n < 1 then
        error(fmt("%s: length[%d] must be an integer >= 1, got %s", task, k, tostring(n)), 2)
      end
      self.impl.check_length(self, n, fmt("length[%d] = %d", k, n))
      list[k] = n
    end
    self.length = list
  else
    error(fmt("%s: length must be \"stage\", an integer or a list of integers, got %s", task, tostring(length)), 2)
  end
  return self
end

-- the generators' example index of document i of this split
function Source:index(i)
  if not is_int(i) or i < 0 or i >= synthetic.MAX_DOCS then
    error(fmt("%s: document index must be an integer in [0, 2^31), got %s", self.name, tostring(i)), 3)
  end
  return self.split == "eval" and synthetic.EVAL_BASE + i or i
end

-- doc_length(i, T) -> n, the length of document i at stage length T (T may be nil unless length = "stage")
function Source:doc_length(i, T)
  local index = self:index(i)
  if T ~= nil and (not is_int(T) or T < 1) then
    error(fmt("%s: stage length T must be an integer >= 1, got %s", self.name, tostring(T)), 2)
  end
  if self.length == "stage" then
    if T == nil then error(self.name .. ": length = \"stage\" needs the stage length T in doc(i, T)", 2) end
    self.impl.check_length(self, T, fmt("stage length T = %d (length = \"stage\")", T))
    return T
  elseif type(self.length) == "number" then
    return self.length
  end
  local list = self.length
  return list[math.min(#list, math.floor(aux_uniform(self.seed, index, 0) * #list) + 1)]
end

-- doc(i, T) -> ids, targets (ffi int32_t[n], 0-based), n
function Source:doc(i, T)
  local n = self:doc_length(i, T)
  local ids, targets = ffi.new("int32_t[?]", n), ffi.new("int32_t[?]", n)
  ids[0], targets[0] = self.eot, synthetic.IGNORE
  self.impl.fill(self, self:index(i), n - 1, ids, targets)
  return ids, targets, n
end

-- labels(n) -> the number of labelled positions in a document of n tokens
function Source:labels(n) return self.impl.labels(self, n) end

function Source:describe()
  local len = self.length
  if type(len) == "table" then len = "{" .. table.concat(len, ", ") .. "}" end
  return fmt("%s: seed %d, %s split, length %s, %s; documents start with <|endoftext|>", self.name, self.seed,
    self.split, tostring(len), self.impl.describe(self))
end

return synthetic
