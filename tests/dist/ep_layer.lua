-- ep_layer.lua — expert parallelism of one MoE layer (spec/moe.md §9) against the unsharded layer, under mpirun
-- (tests/dist/dp_check.sh: 2 and 4 ranks, --ep=2 and --ep=4). Every rank builds the same layer and the same global
-- batch; the reference is the whole layer run by this process on the rows of its expert-parallel group (their
-- concatenation: what one rank routes), the test is the layer with 1/ep of the experts run by each rank on its own
-- rows. Asserted: the outputs of this rank's rows, the input gradient, the gradients of this rank's experts, and the
-- gradients of the replicated parameters summed over the group (router, shared expert, latent projections), for
--   f64 SiTU (≤ 1e-12 relative to the largest entry), f32 LatentMoE SwiGLU (≤ 1e-6 rel), capacity factor 0.5 (the
--   same rows dropped: the dropped counts summed over the group equal the reference's), uneven loads with one expert
--   that no token selects; the bytes this rank sent equal dist.ep_bytes of the rows that left and reached it.
local tide = require "tide"
local dist = require "tide.dist"
local MoE = require "tide.nn.moe"
local F = tide.F

local fmt = string.format

local function max_abs(t)
  local a = t:to("f64"):abs():reshape(-1)
  if a:numel() == 0 then return 0 end
  return a:max(1):item()
end

local function rel_diff(a, b)
  local scale = math.max(max_abs(b), 1e-30)
  return max_abs(a:to("f64") - b:to("f64")) / scale
end

local function layer(o)
  tide.manual_seed(17)
  return MoE(16, { n_experts = 8, top_k = 2, expert_dim = 8, n_shared = 1, dtype = o.dtype, latent_dim = o.latent_dim,
    activation = o.activation, capacity_factor = o.capacity_factor, balance = "none" })
end

local function run_case(name, o, ep, tol)
  local world, rank = dist.world(), dist.rank()
  local P = ep.size
  local m = 6 + rank % 3            -- uneven rows per rank
  local rows = {}
  for r = 0, world - 1 do rows[r + 1] = 6 + r % 3 end
  -- the global batch and the loss weights, the same on every rank
  tide.manual_seed(99)
  local all = {}
  for r = 1, world do all[r] = tide.randn({ rows[r], 16 }, { dtype = o.dtype }) end
  local c = {}
  for r = 1, world do c[r] = tide.randn({ rows[r], 16 }, { dtype = o.dtype }) end
  local function prep(mod)
    -- uneven loads: a bias that favours experts 1 and 6 and keeps every token away from expert 3
    local b = { 0.3, 0, 0, -1e3, 0, 0, 0.2, 0 }
    tide.no_grad(function() mod.gate.e_score_correction_bias:copy_(tide.tensor(b, { dtype = "f64" })) end)
    mod:train(true)
  end
  -- the reference: the group's rows, concatenated in rank order, through the whole layer
  local ref = layer(o)
  prep(ref)
  local gx, gc = {}, {}
  local first_row, my_off = 0, 0
  for i, wr in ipairs(ep.members) do
    gx[i], gc[i] = all[wr + 1], c[wr + 1]
    if wr == rank then my_off = first_row end
    first_row = first_row + rows[wr + 1]
  end
  local X = F.concat(gx, 1):detach():requires_grad_(true)
  local Y = ref:forward(X)
  local ref_dropped = ref._records[#ref._records].dropped
  ;(Y * F.concat(gc, 1)):sum():backward()
  -- the test: this rank's rows through the sharded layer
  local test = layer(o)
  prep(test)
  test:shard_experts(ep)
  local x = all[rank + 1]:detach():requires_grad_(true)
  local b0 = dist.bytes_sent()
  local y = test:forward(x)
  local dropped = test._records[#test._records].dropped
  ;(y * c[rank + 1]):sum():backward()
  local sent = dist.bytes_sent() - b0
  -- the bytes of the exchanges, against dist.ep_bytes of the rows that left and reached this rank
  local nl0 = 8 / P
  local rows_out, rows_in = 0, 0
  local my_first = ep.rank * nl0
  for _, e in ipairs(test.gate:route(test.gate:scores(x)):reshape(-1):tolist()) do
    if e < my_first or e >= my_first + nl0 then rows_out = rows_out + 1 end
  end
  local gsel = ref.gate:route(ref.gate:scores(X:detach())):reshape(-1):tolist()
  for i, e in ipairs(gsel) do
    local row = math.floor((i - 1) / 2)
    local mine = row >= my_off and row < my_off + m
    if not mine and e >= my_first and e < my_first + nl0 then rows_in = rows_in + 1 end
  end
  local d_in = o.latent_dim or 16
  local es = o.dtype == "f64" and 8 or 4
  local want = dist.ep_bytes(rows_out, rows_in, d_in, d_in, es, P)
  if o.capacity_factor and P > 1 then want = want + (P - 1) / P * 2 * 8 end   -- the batch size summed (one f64)
  local errs = {}
  local function cmp(what, a, b)
    local d = rel_diff(a, b)
    if not (d <= tol) then errs[#errs + 1] = fmt("%s differs by %.3g (rel, tol %g)", what, d, tol) end
  end
  cmp("output", y, Y:narrow(1, my_off + 1, m))
  cmp("input gradient", x:grad(), X:grad():narrow(1, my_off + 1, m))
  local nl = 8 / P
  cmp("expert gate_up gradient", test.experts.gate_up_proj:grad(), ref.experts.gate_up_proj:grad():narrow(1, ep.rank * nl + 1, nl))
  cmp("expert down gradient", test.experts.down_proj:grad(), ref.experts.down_proj:grad():narrow(1, ep.rank * nl + 1, nl))
  local refp = {}
  for pname, t in ref:named_parameters() do refp[pname] = t end
  for pname, t in test:named_parameters() do
    if not pname:match("^experts%.") then
      local g = t:grad()
      g = g and g:clone() or tide.zeros(t:shape(), { dtype = t:dtype() })
      ep.allreduce_(g)
      cmp(pname .. " gradient (summed over the group)", g, refp[pname]:grad())
    end
  end
  if P > 1 and math.abs(sent - want) > 16 then
    errs[#errs + 1] = fmt("sent %d bytes, dist.ep_bytes of %d rows out and %d in: %d", sent, rows_out, rows_in, want)
  end
  if o.capacity_factor then
    local total = ep.sums({ dropped })[1]
    if total ~= ref_dropped or ref_dropped == 0 then
      errs[#errs + 1] = fmt("dropped %d over the group, the reference %d (must be equal and > 0)", total, ref_dropped)
    end
  end
  -- expert 3 received nothing and still has a (zero) gradient where it lives
  local owner3 = math.floor(3 / nl)
  if ep.rank == owner3 then
    local g3 = test.experts.gate_up_proj:grad():narrow(1, 3 - owner3 * nl + 1, 1)
    if max_abs(g3) ~= 0 then errs[#errs + 1] = "expert 3 (no tokens) has a nonzero gradient" end
  end
  local bad = dist.sum(#errs)
  if #errs > 0 then print(fmt("FAIL rank %d %s: %s", rank, name, table.concat(errs, "; "))) end
  if rank == 0 and bad == 0 then
    print(fmt("ok   ep %d of %d ranks: %s (outputs, input and expert gradients, replicated gradients summed)", P, world,
      name))
  end
  return bad
end

local function run(args)
  local P = (args.ep or 0) > 0 and args.ep or dist.world()
  local world, rank = dist.world(), dist.rank()
  if world % P ~= 0 then error(fmt("ep_layer: --ep=%d must divide the %d ranks", P, world), 0) end
  local ep = dist.split(math.floor(rank / P))          -- consecutive ranks share their experts' tokens
  if ep.size ~= P then error("ep_layer: the group has " .. ep.size .. " ranks", 0) end
  local bad = 0
  bad = bad + run_case("f64 SiTU", { dtype = "f64", activation = "situ" }, ep, 1e-12)
  bad = bad + run_case("f32 LatentMoE SwiGLU", { dtype = "f32", activation = "swiglu", latent_dim = 12 }, ep, 1e-6)
  bad = bad + run_case("f64 capacity factor 0.5", { dtype = "f64", capacity_factor = 0.5 }, ep, 1e-12)
  return bad == 0 and 0 or 1
end

return { ep = 0, run = run }
