-- data/copy.lua — the palindrome (copy) task of spec/evals.md §3 (Kimi Linear §5.1 style), in the shared
-- byte-level vocabulary (formats.md §4):
--
--   x = x_1 .. x_N  <|sep|>  x_N .. x_1          |x| = T = 2N + 1, x_k uniform from a 64-token alphabet
--   labels only on the output half: the position before each output token predicts it (the <|sep|> position
--   predicts x_N, the position of output token j predicts output token j + 1): N labels, all else -100
--
-- The alphabet is the passkey filler alphabet (data/passkey.lua): the 64 printable bytes A–Z, a–z, space and
-- . , ! ? ; : - ' ( ) "; <|sep|> is the special resolved by name.
-- Example i is a pure function of (seed, i, N): x_k = ALPHABET[⌊64·u_k⌋] with u the Philox stream keyed by
-- (task "copy", seed) at counters [i·2^32, i·2^32 + N).
local ffi = require "ffi"
local tide = require "tide"
local passkey = require "tide.data.passkey"
local C = tide.C
local task = require "tide.data.task"

local copy = {}

copy.IGNORE = -100
copy.ALPHABET = passkey.ALPHABET        -- 0-based array of 64 byte ids
copy.DEFAULTS = { seed = 0 }
copy.KEYS = { seed = true, tokenizer = true }

local TASK = 0x636f7079ULL              -- "copy": the task half of the Philox key
local STRIDE = 4294967296ULL

local fmt = string.format
local options = require "tide.options"
local WHO = "copy"
local function bad(msg) options.fail(WHO, msg) end      -- at the first line outside lua/tide

local Checked = {}

-- check(cfg) -> a full, validated copy (defaults filled, <|sep|> resolved by name from cfg.tokenizer, a
-- byte-level tokenizer of V = 320 when absent)
function copy.check(cfg)
  if getmetatable(cfg) == Checked then return cfg end
  local c = task.options(cfg, copy.DEFAULTS, copy.KEYS, WHO)
  local tok = task.byte_tokenizer(c.tokenizer, "the alphabet is byte ids", WHO)
  c.tokenizer = tok
  c.sep_id = tok:id("<|sep|>")
  return setmetatable(c, Checked)
end

-- fill(c, i, N, x, y, off): example i with N inputs (2N + 1 tokens) into x[off .. off+2N+1) (ids) and
-- y[off .. off+2N+1) (labels); x, y are ffi integer arrays, c a checked config
function copy.fill(c, i, N, x, y, off)
  if N < 1 then bad(fmt("N must be >= 1 input token, got %d", N)) end
  local u = task.uniforms(N)
  C.tide_philox_uniform(TASK * STRIDE + c.seed, ffi.cast("uint64_t", i) * STRIDE, u, N)
  local A = copy.ALPHABET
  for k = 0, N - 1 do
    local tok = A[math.floor(u[k] * 64)]
    x[off + k] = tok                                      -- x_{k+1}
    x[off + 2 * N - k] = tok                              -- the output half, reversed
  end
  x[off + N] = c.sep_id
  for t = 0, N - 1 do y[off + t] = copy.IGNORE end
  for t = N, 2 * N - 1 do y[off + t] = x[off + t + 1] end  -- <|sep|> .. second-to-last output predict the next
  y[off + 2 * N] = copy.IGNORE
end

-- example(cfg, i, N) -> ids, labels (Lua lists of 2N + 1, 1-based); i is 0-based
function copy.example(cfg, i, N)
  local c = copy.check(cfg)
  if type(N) ~= "number" then bad(fmt("N must be an integer, got %s", tostring(N))) end
  local ids, labels = task.example(c, i, N, 2 * N + 1, copy.fill, "N", WHO)
  return ids, labels
end

return copy
