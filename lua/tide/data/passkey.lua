-- data/passkey.lua — passkey / needle-in-a-haystack retrieval, token-level form (spec/evals.md §2), in the
-- shared byte-level vocabulary (formats.md §4, V = 320):
--
--   needle = <KEY> d1 d2 d3 d4 d5        query = <Q> d1 d2 d3 d4 d5        (digits uniform, the bytes '0'..'9')
--   x = filler[0:p] ++ needle ++ filler[p:] ++ query,   |x| = T,   p = round(δ·(T − 12))   (round half up)
--   labels: the position of <Q> predicts d1, the position of d_i predicts d_{i+1} (i < 5); all else -100
--
-- Filler alphabet: the 64 printable bytes A–Z, a–z, space and . , ! ? ; : - ' ( ) " — disjoint from the digits
-- (bytes 48–57) and from the markers <KEY>, <Q> (specials, resolved by name). filler = "sentence" (default, like
-- the original passkey test) repeats the fixed 24-byte SENTENCE from filler index 0, so filler[p:] resumes the
-- sentence where filler[0:p] left it; filler = "random" draws every filler token uniformly from the alphabet.
-- filler = "text" (a tide addition to evals.md §2's two kinds) takes the filler from filler_text, a text document
-- source (pack.text_source; in a curriculum's sources, filler_source = its name): one contiguous span of its bytes
-- without the digits and without any special id, so the haystack is real text — disjoint from the digits and the
-- markers like the alphabet, but not one repeated pattern (a mixture with text routes its MoE tokens as text does).
-- depth = a number in [0, 1] fixes δ (the eval grid); depth = "uniform" draws δ uniform in [0, 1) per example.
--
-- Example i is a pure function of (seed, i, T, depth, filler) (and of filler_text's content): its uniforms come
-- from the Philox stream keyed by (task "pkey", seed) at counters [i·2^32, i·2^32 + 6 + filler draws): u[0..4]
-- the digits, u[5] the depth, u[6 + k] filler token k (random filler), u[6] the text span's start (text filler).
-- The digits of example i are therefore the same at every T and δ.
local ffi = require "ffi"
local tide = require "tide"
local C = tide.C
local task = require "tide.data.task"

local passkey = {}

passkey.IGNORE = -100
passkey.DIGITS = 5                      -- d1..d5
passkey.OVERHEAD = 12                   -- needle (6) + query (6): the tokens of x that are not filler
passkey.MIN_LENGTH = 13                 -- shortest example: the 12 needle/query tokens and one filler token
passkey.SENTENCE = "The grass is green here."   -- 24 bytes, all in the alphabet
passkey.ALPHABET_TEXT = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,!?;:-'()\""
passkey.DEFAULTS = { seed = 0, depth = "uniform", filler = "sentence" }
passkey.KEYS = { seed = true, depth = true, filler = true, tokenizer = true, filler_text = true }
passkey.FILLERS = { sentence = true, random = true, text = true }

-- ALPHABET[0..63]: the filler byte ids
passkey.ALPHABET = {}
for k = 1, #passkey.ALPHABET_TEXT do passkey.ALPHABET[k - 1] = passkey.ALPHABET_TEXT:byte(k) end
assert(#passkey.ALPHABET_TEXT == 64 and #passkey.SENTENCE == 24)

local TASK = 0x706b6579ULL              -- "pkey": the task half of the Philox key
local STRIDE = 4294967296ULL            -- counters per example
local DIGIT0 = string.byte("0")

local fmt = string.format
local options = require "tide.options"
local WHO = "passkey"
local function bad(msg) options.fail(WHO, msg) end      -- at the first line outside lua/tide

local Checked = {}

-- check(cfg) -> a full, validated copy (defaults filled, marker ids resolved by name from cfg.tokenizer, a
-- byte-level tokenizer of V = 320 when absent); errors name the option and the value
function passkey.check(cfg)
  if getmetatable(cfg) == Checked then return cfg end
  local c = task.options(cfg, passkey.DEFAULTS, passkey.KEYS, WHO)
  if c.depth ~= "uniform" and not (type(c.depth) == "number" and c.depth >= 0 and c.depth <= 1) then
    bad(fmt("depth must be a number in [0, 1] or \"uniform\", got %s", tostring(c.depth)))
  end
  options.one_of(c.filler, passkey.FILLERS, "filler", WHO)
  task.check_filler_text(c, WHO)
  local tok = task.byte_tokenizer(c.tokenizer, "digits and filler are byte ids", WHO)
  c.tokenizer = tok
  c.key_id, c.q_id = tok:id("<KEY>"), tok:id("<Q>")
  return setmetatable(c, Checked)
end

-- the text filler's rule: bytes only (no special id, so no marker) and no digit
function passkey.text_keep(id) return id < 256 and (id < DIGIT0 or id > DIGIT0 + 9) end

-- needle_position(δ, T) -> p = round(δ·(T − 12)), halves rounded up
function passkey.needle_position(depth, T)
  return math.floor(depth * (T - passkey.OVERHEAD) + 0.5)
end

-- fill(c, i, T, x, y, off): example i of length T into x[off .. off+T) (ids) and y[off .. off+T) (labels, -100
-- where unlabelled); x, y are ffi integer arrays, c a checked config. Returns {p, depth, digits} (digits a
-- 0-based Lua array of the 5 digit values 0..9).
function passkey.fill(c, i, T, x, y, off)
  if T < passkey.MIN_LENGTH then
    bad(fmt("example length %d is too short: 12 needle/query tokens and at least 1 filler token need >= %d",
      T, passkey.MIN_LENGTH))
  end
  local F = T - passkey.OVERHEAD                           -- filler tokens
  local random_filler, text_filler = c.filler == "random", c.filler == "text"
  local n_u = 6 + (random_filler and F or text_filler and 1 or 0)
  local u = task.uniforms(n_u)
  C.tide_philox_uniform(TASK * STRIDE + c.seed, ffi.cast("uint64_t", i) * STRIDE, u, n_u)
  local digits = {}
  for j = 0, passkey.DIGITS - 1 do digits[j] = math.min(9, math.floor(u[j] * 10)) end
  local depth = c.depth == "uniform" and u[5] or c.depth
  local p = passkey.needle_position(depth, T)
  local A, S = passkey.ALPHABET, passkey.SENTENCE
  local span = text_filler and c.filler_text:span(u[6], F, passkey.text_keep)
  -- filler index k sits at x position k (k < p) or k + 6 (k >= p)
  for k = 0, F - 1 do
    local tok
    if span then tok = span[k]
    elseif random_filler then tok = A[math.floor(u[6 + k] * 64)]
    else tok = S:byte(k % 24 + 1) end
    x[off + (k < p and k or k + 6)] = tok
  end
  for t = 0, T - 1 do y[off + t] = passkey.IGNORE end
  x[off + p] = c.key_id
  local q = T - 6                                          -- the query's first position
  x[off + q] = c.q_id
  for j = 0, passkey.DIGITS - 1 do
    local d = DIGIT0 + digits[j]
    x[off + p + 1 + j] = d
    x[off + q + 1 + j] = d
    y[off + q + j] = d                                     -- <Q> → d1, d_j → d_{j+1}
  end
  return { p = p, depth = depth, digits = digits }
end

-- example(cfg, i, T) -> ids, labels (Lua lists of T, 1-based), info {p, depth, digits}; i is 0-based
function passkey.example(cfg, i, T)
  local c = passkey.check(cfg)
  if type(T) ~= "number" then bad(fmt("length must be an integer, got %s", tostring(T))) end
  local ids, labels, info = task.example(c, i, T, T, passkey.fill, "length", WHO)
  return ids, labels, info
end

return passkey
