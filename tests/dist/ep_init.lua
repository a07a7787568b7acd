-- ep_init.lua — a model built with one rank's slice of the experts (nn.build's opts.experts, what tide.train and
-- curricula do under dist.ep) against the whole build sharded afterwards (MoE:shard_experts), under mpirun
-- (tests/dist/ep_check.sh: 2 and 4 ranks, ep = the world): every parameter bitwise equal, the random stream at the
-- same place after the build (the draws that follow are the same), and the build's engine peak below the whole
-- build's by at least 90% of the other ranks' expert bytes; the forward of a sliced layer not yet sharded is one
-- clear error.
local tide = require "tide"
local dist = require "tide.dist"
local nn = require "tide.nn"
local ffi = require "ffi"

local cfg = {
  kind = "hybrid", vocab_size = 320, dim = 32, n_layers = 2, mixers = "KM", ffn_dim = 48, dtype = "f64",
  recompute = "none",
  kda = { heads = 2, head_dim = 16 }, mla = { heads = 2, q_rank = 16, kv_rank = 16, nope_dim = 8, rope_dim = 8, v_dim = 8 },
  moe = { n_experts = 16, top_k = 2, expert_dim = 64, n_shared = 1, first_dense = false, balance = "quantile" },
}

local function rng()
  local s, o = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  tide.C.tide_rng_get(s, o)
  return tostring(s[0]) .. ":" .. tostring(o[0])
end

local function build(opts)
  tide.collect()
  local base = tide.memory().current
  tide.reset_peak()
  tide.manual_seed(5)
  local m = nn.build(cfg, opts)
  local peak = tide.memory().peak - base
  return m, peak, rng()
end

local function run()
  local world, rank = dist.world(), dist.rank()
  local ep = dist.split(0)
  local fmt = string.format
  local whole, peak_whole, rng_whole = build(nil)
  local expert_bytes = 0
  for name, p in whole:named_parameters() do if name:match("experts%.") then expert_bytes = expert_bytes + p:nbytes() end end
  dist.shard_model(whole, { ep_group = ep, ep_dp = { size = 1 }, ep = world })
  local sliced, peak_sliced, rng_sliced = build({ experts = { rank = ep.rank, size = ep.size } })
  -- a sliced layer cannot run before it is sharded
  local ok, err = pcall(function() sliced:forward(tide.tensor({ { 1, 2, 3 } }, { dtype = "i32" })) end)
  if ok or not tostring(err):match("shard it over its expert%-parallel group first") then
    error("the forward of an unsharded sliced build: " .. tostring(err), 0)
  end
  dist.shard_model(sliced, { ep_group = ep, ep_dp = { size = 1 }, ep = world })
  local a = {}
  for name, p in whole:named_parameters() do a[name] = p end
  local n = 0
  for name, p in sliced:named_parameters() do
    local q = a[name]
    if not q then error("the sliced build has " .. name .. ", the whole build does not", 0) end
    if table.concat(p:shape(), "x") ~= table.concat(q:shape(), "x") then error(name .. ": shapes differ", 0) end
    local d = (p - q):abs():max():item()
    if d ~= 0 then error(fmt("%s differs by %g between the sliced and the sharded whole build", name, d), 0) end
    n = n + 1
    a[name] = nil
  end
  if next(a) then error("the whole build has " .. next(a) .. ", the sliced build does not", 0) end
  if rng_whole ~= rng_sliced then error(fmt("the random stream after the build: %s vs %s", rng_whole, rng_sliced), 0) end
  local saved = expert_bytes * (1 - 1 / world)
  if not (peak_sliced <= peak_whole - 0.9 * saved) then
    error(fmt("the sliced build's peak %.0f B is not below the whole build's %.0f B by 90%% of the other ranks' "
      .. "expert bytes (%.0f B)", peak_sliced, peak_whole, saved), 0)
  end
  if rank == 0 then
    print(fmt("ok   ep %d: a build with this rank's experts == the whole build sharded (%d parameters bitwise, the "
      .. "random stream at the same place); build peak %.2f MB against %.2f MB (the others' experts: %.2f MB)", world,
      n, peak_sliced / 2 ^ 20, peak_whole / 2 ^ 20, saved / 2 ^ 20))
  end
  return 0
end

return { run = run }
