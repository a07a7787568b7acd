-- tide.rl.stream: the deterministic random stream of one (environment, seed) (rl.md §6).
--
--   local s = stream.new("countdown", 17)
--   s:int(1, 20); s:uniform(); s:shuffle(list)
--
-- Philox 4x32-10 at key = tag(env) * 2^32 + seed, one counter per draw: the draws are exact binary fractions, and
-- every integer is floor(lo + u * n), so the same (env, seed) gives the same numbers on every platform.
local ffi = require "ffi"
local C = require("tide").C
local options = require "tide.options"

local stream = {}
local Stream = {}
Stream.__index = Stream

local STRIDE = 4294967296ULL

-- a 31-bit tag of the environment's name (a polynomial hash, exact in doubles), so environments never share a stream
local function tag(name)
  local h = 7
  for i = 1, #name do h = (h * 131 + name:byte(i)) % 2147483647 end
  return ffi.cast("uint64_t", h)
end

function stream.new(name, seed)
  if type(name) ~= "string" or name == "" then error("rl.stream: an environment name (a string) is needed", 2) end
  seed = options.seed(seed, "seed", "rl." .. name)
  return setmetatable({ key = tag(name) * STRIDE + seed, draws = 0ULL, u = ffi.new("double[1]") }, Stream)
end

function Stream:uniform()
  C.tide_philox_uniform(self.key, self.draws, self.u, 1)
  self.draws = self.draws + 1
  return self.u[0]
end

-- a uniform integer in [lo, hi]
function Stream:int(lo, hi)
  local k = lo + math.floor(self:uniform() * (hi - lo + 1))
  return k > hi and hi or k
end

-- Fisher-Yates, in place
function Stream:shuffle(t)
  for i = #t, 2, -1 do
    local j = self:int(1, i)
    t[i], t[j] = t[j], t[i]
  end
  return t
end

return stream
