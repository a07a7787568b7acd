-- tide.dist — the process group of a multi-process run (DESIGN.md §9): the ranks started by `mpirun -np N tide run
-- recipe.lua`, and the collectives the drivers need, over MPI for CPU tensors. Without MPI, or in a process that
-- mpirun did not start, there is one rank and every collective is the identity.
--
-- Sums run in rank order (((x_0 + x_1) + x_2) + ...; engine/dist/comm.c), so N ranks reproduce themselves bit for bit
-- whatever the message timing, and equal one process that accumulates the same N parts in order: data parallelism
-- over N ranks gives the gradients of one rank with N micro-batches.
--
--   dist.rank(), dist.world(), dist.is_root()
--   dist.layout(cfg.dist, who)    the data-parallel layout of a recipe's `dist = {dp = N, zero = 0 | 1}` (checked)
--   dist.send_(t, dst), dist.recv_(t, src)
--   dist.allreduce_(t)            t summed over the ranks, in place (a contiguous CPU f32/f64 tensor)
--   dist.sum(x), dist.any(flag)   a Lua number summed over the ranks (f64); a boolean true on any rank
--   dist.sums(list)               several numbers summed at once (one all-reduce)
--   dist.broadcast_(t, root)      root's t on every rank
--   dist.allgather(t)             every rank's t concatenated in rank order along dim 1 (a new tensor)
--   dist.alltoallv(t, send, recv) rows of t to each rank (send[r] rows to rank r, in rank order), recv[r] rows from r
--   dist.allreduce_grads(params[, group])  the gradients of params (optim's list) summed over the ranks (or a group's):
--                                 one flat buffer per dtype
--   dist.reduce_scatter_grads(params, owners)  each rank gets the sums of the gradients it owns, drops the rest
--   dist.reducer(params, bytes)   gradient buckets summed while the backward runs (arm before it, finish after)
--   dist.balance_group()          the ranks as the MoE balancers read them (summed counts, gathered margins)
--   dist.owners(sizes, world)     the rank that owns each of a list of tensors (ZeRO-1, checkpoint shards)
--   dist.step_bytes(g, n, zero, w) the bytes a rank sends per step for the gradients and ZeRO's weights (the plan's
--                                 and bench/dist's formula; tests/dist/dp_check.sh holds the runtime's count to it)
--   dist.ep_bytes(...)            the bytes of one MoE layer's expert-parallel exchanges per step (plan and tests)
--   dist.agree(ok, what)          one decision from every rank's ok (a collective): raises on all ranks, naming the failed
--   dist.barrier(), dist.bytes_sent()
--   dist.split(color)             a process group: the ranks passing the same color (a collective), in world order;
--                                 g.rank, g.size, g.members, g.allreduce_(t), g.sum_f64(list), g.allgather(t),
--                                 g.alltoallv(t, send, recv) and g.exchange(x, send, recv) (the differentiable one)
local ffi = require "ffi"
local tide = require "tide"

local C = tide.C
local raw = tide.raw
local dist = {}

local function check(rc, what)
  if rc ~= 0 then error("dist: " .. what .. ": " .. ffi.string(C.tide_last_error()), 0) end
end

local inited = false
local function init()
  if not inited then
    check(C.tide_dist_init(), "init")
    inited = true
  end
end

function dist.rank() init(); return C.tide_dist_rank() end
function dist.world() init(); return C.tide_dist_world_size() end
function dist.is_root() return dist.rank() == 0 end

function dist.allreduce_(t)
  init()
  check(C.tide_dist_allreduce_sum_(raw(t)), "allreduce")
  return t
end

function dist.broadcast_(t, root)
  init()
  check(C.tide_dist_broadcast_(raw(t), root or 0), "broadcast")
  return t
end

function dist.barrier() init(); check(C.tide_dist_barrier(), "barrier") end

-- allgather(t) -> [world · t:shape()[1], ...]: every rank's contiguous t, in rank order
function dist.allgather(t)
  init()
  local shape = t:shape()
  local out_shape = { (shape[1] or 1) * dist.world() }
  for i = 2, #shape do out_shape[i] = shape[i] end
  local out = tide.empty(out_shape, { dtype = t:dtype(), device = t:device() })
  check(C.tide_dist_allgather_(raw(out), raw(t:contiguous())), "allgather")
  return out
end

-- alltoallv(t, send, recv) -> the rows received: send[r] rows of t (rows in rank order) go to rank r, recv[r] rows come
-- from rank r, stacked in rank order (rows: t's first dim; expert parallelism's dispatch and combine)
function dist.alltoallv(t, send, recv)
  init()
  local w = dist.world()
  local shape = t:shape()
  local row = 1
  for i = 2, #shape do row = row * shape[i] end
  local sc, rc = ffi.new("int64_t[?]", w), ffi.new("int64_t[?]", w)
  local n_recv = 0
  for r = 1, w do
    sc[r - 1], rc[r - 1] = send[r] * row, recv[r] * row
    n_recv = n_recv + recv[r]
  end
  local out_shape = { n_recv }
  for i = 2, #shape do out_shape[i] = shape[i] end
  local out = tide.empty(out_shape, { dtype = t:dtype(), device = t:device() })
  check(C.tide_dist_alltoallv_(raw(t:contiguous()), sc, raw(out), rc), "alltoallv")
  return out
end

-- ---- process groups ----------------------------------------------------------------------------------------------
-- split(color) -> a group of the ranks that pass the same color (every rank calls it: a collective). Fields: id (the
-- engine's), rank (this rank's in the group), size, members ({world rank of group rank 0, ...}); collectives over the
-- group only: allreduce_(t) (rank order, as dist.allreduce_), sums(list), allgather(t), alltoallv(t, send, recv)
-- (counts in rows, as dist.alltoallv) and exchange(x, send, recv), the all-to-all as an op of the graph (its gradient
-- the reverse exchange: expert parallelism's dispatch and combine). One rank: a group of one.
local groups = {}
function dist.split(color)
  init()
  local id = C.tide_dist_group_split(color)
  if id < 0 then error("dist: " .. ffi.string(C.tide_last_error()), 0) end
  local g = { id = id, rank = C.tide_dist_group_rank(id), size = C.tide_dist_group_size(id), members = {} }
  for r = 0, g.size - 1 do g.members[r + 1] = C.tide_dist_group_member(id, r) end
  function g.allreduce_(t)
    check(C.tide_dist_allreduce_sum_group_(id, raw(t)), "allreduce")
    return t
  end
  function g.sums(list)
    if g.size == 1 then return list end
    local a = g.allreduce_(tide.tensor(list, { dtype = "f64" })):f64_array()
    local out = {}
    for i = 1, #list do out[i] = a[i - 1] end
    return out
  end
  function g.allgather(t)
    local shape = t:shape()
    local out_shape = { (shape[1] or 1) * g.size }
    for i = 2, #shape do out_shape[i] = shape[i] end
    local out = tide.empty(out_shape, { dtype = t:dtype(), device = t:device() })
    check(C.tide_dist_allgather_group_(id, raw(out), raw(t:contiguous())), "allgather")
    return out
  end
  local function counts(send, recv, row)
    local sc, rc = ffi.new("int64_t[?]", g.size), ffi.new("int64_t[?]", g.size)
    local n_recv = 0
    for r = 1, g.size do
      sc[r - 1], rc[r - 1] = send[r] * row, recv[r] * row
      n_recv = n_recv + recv[r]
    end
    return sc, rc, n_recv
  end
  function g.alltoallv(t, send, recv)
    local shape = t:shape()
    local row = 1
    for i = 2, #shape do row = row * shape[i] end
    local sc, rc, n_recv = counts(send, recv, row)
    local out_shape = { n_recv }
    for i = 2, #shape do out_shape[i] = shape[i] end
    local out = tide.empty(out_shape, { dtype = t:dtype(), device = t:device() })
    check(C.tide_dist_alltoallv_group_(id, raw(t:contiguous()), sc, raw(out), rc), "alltoallv")
    return out
  end
  function g.exchange(x, send, recv)
    local sc, rc = counts(send, recv, 1)
    return require("tide.tensor").check(C.tide_alltoallv(raw(x), id, g.size, sc, rc))
  end
  groups[#groups + 1] = g
  return g
end

-- point to point: t to rank dst; rank src's values into t (contiguous CPU tensors of one size)
function dist.send_(t, dst) init(); check(C.tide_dist_send_(raw(t), dst), "send"); return t end
function dist.recv_(t, src) init(); check(C.tide_dist_recv_(raw(t), src), "recv"); return t end

function dist.bytes_sent() return tonumber(C.tide_dist_bytes_sent()) end

-- x (a Lua number) summed over the ranks, in rank order
function dist.sum(x)
  if dist.world() == 1 then return x end
  local t = tide.tensor({ x }, { dtype = "f64" })
  return dist.allreduce_(t):item()
end

function dist.any(flag) return dist.sum(flag and 1 or 0) > 0 end

-- sums(list) -> the Lua numbers of list, each summed over the ranks in rank order: one all-reduce for all of them
function dist.sums(list)
  if dist.world() == 1 then return list end
  local a = dist.allreduce_(tide.tensor(list, { dtype = "f64" })):f64_array()
  local out = {}
  for i = 1, #list do out[i] = a[i - 1] end
  return out
end

-- t's gradient, a zero one set first when it has none (a rank whose tokens did not reach a parameter)
local function grad_or_zeros(t)
  local g = t:grad()
  if g then return g end
  t:set_grad(tide.zeros(t:shape(), { dtype = t:dtype(), device = t:device() }))
  return t:grad()
end

-- the gradients of params ({param = tensor} entries or tensors) by dtype, in order of first appearance: order =
-- {dtype, ...}, by[dtype] = {{t = the parameter, g = its gradient, i = its index}, ...} (a missing gradient: zeros)
local function grads_by_dtype(params)
  local by, order = {}, {}
  for i, p in ipairs(params) do
    local t = p.param or p
    local g = grad_or_zeros(t)
    local dt = g:dtype()
    if not by[dt] then by[dt] = {}; order[#order + 1] = dt end
    local l = by[dt]
    l[#l + 1] = { t = t, g = g, i = i }
  end
  return order, by
end

-- the gradients of params ({param = tensor} entries or tensors) summed over the ranks: one flat buffer per dtype (a
-- parameter without a gradient on this rank contributes zeros and gets the sum), summed in rank order, copied back
function dist.allreduce_grads(params, group)
  local size = group and group.size or dist.world()
  local allreduce_ = group and group.allreduce_ or dist.allreduce_
  if size == 1 then return end
  tide.no_grad(function()
    local order, by = grads_by_dtype(params)
    for _, dt in ipairs(order) do
      local flat = {}
      for k, e in ipairs(by[dt]) do flat[k] = e.g:reshape(e.g:numel()) end
      local buf = #flat == 1 and flat[1]:clone() or tide.F.concat(flat, 1)
      allreduce_(buf)
      local off = 0
      for _, e in ipairs(by[dt]) do
        local n = e.g:numel()
        e.g:copy_(buf:narrow(1, off + 1, n):reshape(e.g:shape()))
        off = off + n
      end
    end
  end)
end

-- ensure_grads(params): a zero gradient for every parameter of params without one (a rank whose experts no token
-- reached: AdamW then updates them as one rank updates an idle expert)
function dist.ensure_grads(params)
  for _, p in ipairs(params) do grad_or_zeros(p.param or p) end
end

-- owners(sizes, world) -> {rank of entry 1, ...}: entries by size, largest first, each to the least loaded rank (the
-- lower rank on ties), so every rank computes the same map and each holds about 1/world of the elements
function dist.owners(sizes, world)
  local order = {}
  for i = 1, #sizes do order[i] = i end
  table.sort(order, function(a, b)
    if sizes[a] ~= sizes[b] then return sizes[a] > sizes[b] end
    return a < b
  end)
  local load, out = {}, {}
  for r = 0, world - 1 do load[r] = 0 end
  for _, i in ipairs(order) do
    local best = 0
    for r = 1, world - 1 do if load[r] < load[best] then best = r end end
    out[i] = best
    load[best] = load[best] + sizes[i]
  end
  return out
end

-- step_bytes(g, n, zero[, w]) -> the mean over the n ranks of a data-parallel group of the bytes one rank sends per
-- step, as tide_dist_bytes_sent counts them (sends, and a broadcast's payload at its root), for g bytes of gradients
-- and w bytes of weights (default g):
--   zero 0: the rank-order all-reduce (a chain to rank n−1 and back): 2(n−1)/n · g
--   zero 1: the same, plus each owner's broadcast of its updated weights: + w/n
--   zero 2: the reduce-scatter (the chain to rank n−1, which sends each owner its part): (n−1)/n · g + (n−1)/n² · g,
--           plus the broadcasts: + w/n
--   zero 3: (planned by --dry-run, not run: FSDP) zero 2's reduce-scatter, the weights gathered for the forward and
--           again for the recomputed backward: + 2 w/n
-- The step's scalar sums (targets, losses, the non-finite decision) add a few hundred bytes.
function dist.step_bytes(g, n, zero, w)
  w = w or g
  if n <= 1 then return 0 end
  if zero == 0 then return 2 * (n - 1) / n * g end
  local rs = ((n - 1) / n + (n - 1) / (n * n)) * g
  if zero == 1 then return 2 * (n - 1) / n * g + w / n end
  if zero == 2 then return rs + w / n end
  return rs + 2 * w / n
end

-- ep_bytes(rows_out, rows_in, d_in, d_out, es, P) -> the bytes one rank sends for one MoE layer's expert-parallel
-- exchanges in a training step (forward and backward; spec/moe.md §9), as tide_dist_bytes_sent counts them: rows_out of
-- its (token, slot) rows go to other ranks (d_in values each, and an int64 expert id), rows_in arrive from them and go
-- back as expert outputs (d_out values); the backward returns the gradients the same ways (rows_out · d_out to the
-- owners, rows_in · d_in to the sources); plus the count matrix's P − 1 int64 counts. es: bytes per value. With
-- tokens routed uniformly, rows_out = rows_in = tokens · k · (P − 1)/P (the plan's estimate).
function dist.ep_bytes(rows_out, rows_in, d_in, d_out, es, P)
  if P <= 1 then return 0 end
  return rows_out * (d_in * es + 8) + rows_in * d_out * es + rows_out * d_out * es + rows_in * d_in * es + (P - 1) * 8
end

-- cp_bytes{P, B (rows per micro-batch), T (the row's tokens), kda = nil | {layers, heads, head_dim, conv_size},
--   mla = nil | {layers, kv_rank, rope_dim}, es (activation bytes: 4 f32, 2 bf16, 8 f64), state_es (the KDA state's:
--   4 unless f64), recompute (true: the layer-input checkpoints rerun each layer's forward, and its gathers, in the
--   backward)} -> {kda =, mla =, total =}: the bytes one rank sends for one micro-batch's forward and backward under
--   context parallelism (long_context.md §5; tide.cp's gathers, each (P − 1) copies of the rank's part, and their
--   gradients' reverse exchange the same again). Per KDA layer the conv halo (2 segments · B rows · K−1 tokens · 3·H·dk
--   values) and the (h_ext | M) pairs (2 · B · H · dk · 2·dk state values): independent of T. Per MLA layer the latent
--   [ĉ | k_r] of the rank's T/P tokens: linear in T. The same numbers as the runtime's count (tests/dist/cp_layer.lua).
function dist.cp_bytes(o)
  local P = o.P
  local out = { kda = 0, mla = 0, total = 0 }
  if P <= 1 then return out end
  local passes = (o.recompute and 3 or 2) * (P - 1)
  local es, ses = o.es or 4, o.state_es or 4
  if o.kda and (o.kda.layers or 0) > 0 then
    local H, dk, K1 = o.kda.heads, o.kda.head_dim, (o.kda.conv_size or 4) - 1
    local per = 2 * o.B * K1 * 3 * H * dk * es + 2 * o.B * H * dk * 2 * dk * ses
    out.kda = o.kda.layers * passes * per
  end
  if o.mla and (o.mla.layers or 0) > 0 then
    out.mla = o.mla.layers * passes * (o.T / P) * o.B * (o.mla.kv_rank + (o.mla.rope_dim or 0)) * es
  end
  out.total = out.kda + out.mla
  return out
end

-- agree(ok, what[, err]) -> true when ok on every rank; otherwise raises on every rank (a collective): the failed
-- rank with its own error err, the others naming the failed ranks
function dist.agree(ok, what, err)
  local world, rank = dist.world(), dist.rank()
  local flags = {}
  for r = 1, world do flags[r] = 0 end
  if not ok then flags[rank + 1] = 1 end
  local all = world == 1 and flags or dist.sums(flags)
  local bad = {}
  for r = 1, world do if all[r] > 0 then bad[#bad + 1] = tostring(r - 1) end end
  if #bad == 0 then return true end
  if not ok and err then error(err, 0) end
  error(string.format("%s: rank%s %s failed%s", what, #bad > 1 and "s" or "", table.concat(bad, ", "),
    ok and " (its error is shown with its rank)" or ""), 0)
end

-- reducer(params, bucket_bytes[, owners[, concurrent]]) -> {arm(), finish() -> {comm_s, overlap_s, buckets, threaded}}: the engine's bucketed
-- all-reduce (engine/dist/reducer.c): armed before the step's last backward, each bucket of about bucket_bytes (in
-- reverse parameter order) is summed over the ranks on a helper thread (CPU tensors; a GPU's: queued on its side
-- stream) as soon as its gradients are final; finish()
-- sums what is left, waits and writes the sums into the gradients. The sums are allreduce_grads' bit for bit. Every
-- rank calls arm and finish once per step (one whose loss was not finite too: it sends zeros). owners (ZeRO-2): each
-- bucket is reduced to the last rank instead, which sends every owner its parameters' sums at finish
-- (reduce_scatter_grads' result: only owners keep gradients).
-- concurrent = true: the backward itself exchanges with the ep / cp groups (the helper thread then needs MPI's
-- MPI_THREAD_MULTIPLE; without it finish sums every bucket: the same sums, no overlap).
function dist.reducer(params, bucket_bytes, owners, concurrent)
  local n = #params
  local arr = ffi.new("tide_tensor *[?]", n)
  for i, p in ipairs(params) do arr[i - 1] = raw(p.param or p) end
  local h = C.tide_reducer_new(n, arr, bucket_bytes)
  if h == nil then error("dist: " .. ffi.string(C.tide_last_error()), 0) end
  h = ffi.gc(h, C.tide_reducer_free)
  if concurrent then check(C.tide_reducer_set_concurrent(h, 1), "reducer") end
  if owners then
    local o = ffi.new("int[?]", n)
    for i = 1, n do o[i - 1] = owners[i] end
    check(C.tide_reducer_set_owners(h, o), "reducer")
  end
  local r = { armed = false, params = params }
  local stats = ffi.new("double[5]")
  function r.arm()
    check(C.tide_reducer_arm(h), "reducer")
    r.armed = true
  end
  function r.finish()
    r.armed = false
    check(C.tide_reducer_finish(h, stats), "reducer")
    return { comm_s = stats[0], overlap_s = stats[1], buckets = stats[2], threaded = stats[3] == 1, early = stats[4] }
  end
  return r
end

-- reduce_scatter_grads(params, owners): the gradients summed over the ranks in rank order, each sum kept only by the
-- rank that owns its parameter (owners[i]: the rank of params[i]; ZeRO-2). Per dtype one flat buffer, the gradients
-- grouped by owner: the chain sum of the all-reduce's first half leaves the whole sum on the last rank
-- (tide_dist_reduce_to_last_), which sends every other owner its one contiguous part. The sums are the all-reduce's
-- bit for bit; every rank but the last sends the buffer once, the last (N−1)/N of it, against 2(N−1)/N on average for
-- the all-reduce. A rank's gradients of parameters it does not own are dropped (their memory freed).
function dist.reduce_scatter_grads(params, owners)
  local world, rank = dist.world(), dist.rank()
  if world == 1 then return end
  local last = world - 1
  tide.no_grad(function()
    local order, by = grads_by_dtype(params)
    for _, dt in ipairs(order) do
      local groups = {}                    -- this dtype's gradients grouped by owner, in order within each
      for r = 0, last do groups[r] = {} end
      for _, e in ipairs(by[dt]) do
        local l = groups[owners[e.i]]
        l[#l + 1] = e
      end
      local flat, off, len = {}, {}, {}
      local n = 0
      for r = 0, last do
        off[r], len[r] = n, 0
        for _, e in ipairs(groups[r]) do
          flat[#flat + 1] = e.g:reshape(e.g:numel())
          len[r] = len[r] + e.g:numel()
        end
        n = n + len[r]
      end
      local buf = #flat == 1 and flat[1]:clone() or tide.F.concat(flat, 1)
      check(C.tide_dist_reduce_to_last_(raw(buf)), "reduce")
      if rank == last then
        for r = 0, last - 1 do
          if len[r] > 0 then dist.send_(buf:narrow(1, off[r] + 1, len[r]), r) end
        end
      elseif len[rank] > 0 then
        dist.recv_(buf:narrow(1, off[rank] + 1, len[rank]), last)
      end
      for r = 0, last do
        local o = off[r]
        for _, e in ipairs(groups[r]) do
          local m = e.g:numel()
          if r == rank then e.g:copy_(buf:narrow(1, o + 1, m):reshape(e.g:shape())) else C.tide_zero_grad(raw(e.t)) end
          o = o + m
        end
      end
    end
  end)
end

-- the keys of a recipe's `dist` table: the runtime's (dp, ep, zero = 0 | 1 | 2, bucket_mb, lanes) and the plan's (gpus,
-- gpu_memory, cp = {stage = ranks}, dtype: what `--dry-run` lays out for a larger job; cp is planned, not run yet)
dist.KEYS = { dp = true, zero = true, bucket_mb = true, lanes = true, gpus = true, gpu_memory = true, ep = true, cp = true,
  dtype = true }
-- the default bucket of the gradient sum overlapped with the backward: 0, one sum after the backward. The buckets
-- pay off where a rank has a core (or a network) idle during its backward; on a machine whose cores all compute,
-- bench/dist measured them slower (their copies, and the helper thread's share of a core): dist.bucket_mb = 25 opts in.
-- A GPU's buckets (CUDA: NCCL on a side stream, queued as they fill; engine/dist/reducer.c) take no core from the
-- backward: 25 MB there, PyTorch DDP's default. dist.bucket_mb set in a recipe is used on either.
dist.BUCKET_MB = 0
dist.BUCKET_MB_DEVICE = 25

-- layout(dcfg, who) -> {n = the ranks that read data (dp x ep), dp, ep, cp, rank, data_rank (rank / cp), group =
-- tide.dist or nil, ep_group and ep_dp (ep > 1: the rank's expert-parallel group and the ranks holding its experts),
-- cp_group (cp > 1: the ranks holding the slices of the same rows), rank_map}: the layout of a recipe's `dist` table
-- (DESIGN.md §9). dist.dp x dist.ep x dist.cp (dp default: the job's ranks / (ep·cp)) must equal the ranks mpirun
-- started: one clear error otherwise.
function dist.layout(dcfg, who)
  local options = require "tide.options"
  if dcfg ~= nil and type(dcfg) ~= "table" then options.fail(who, "dist must be a table ({dp = N}), got " .. type(dcfg)) end
  options.check(dcfg or {}, dist.KEYS, "dist", who)
  local zero = (dcfg and dcfg.zero) or 0
  if zero ~= 0 and zero ~= 1 and zero ~= 2 and zero ~= 3 then
    options.fail(who, "dist.zero must be 0 (replicated AdamW state), 1 (ZeRO-1: each rank owns 1/dp of it), 2 "
      .. "(ZeRO-2: and of the summed gradients, a reduce-scatter in place of the all-reduce) or 3 (FSDP: planned by "
      .. "--dry-run, not run), got " .. tostring(zero))
  end
  local world, rank = dist.world(), dist.rank()
  if world > 1 and dcfg then
    -- the plan's keys describe the job this run is: they must agree with it
    if type(dcfg.cp) == "table" then
      options.fail(who, "dist.cp is a table of stages (the plan of --dry-run); a job runs one context-parallel size "
        .. "for all its stages: set --dist.cp=N")
    end
    if zero == 3 then
      options.fail(who, "dist.zero = 3 (FSDP: the weights sharded too) is planned by --dry-run but not run yet; "
        .. "this job runs dist.zero = 0, 1 or 2")
    end
    if dcfg.gpus and dcfg.gpus ~= world then
      options.fail(who, string.format("dist.gpus = %s but the job has %d ranks", tostring(dcfg.gpus), world))
    end
  end
  local bucket_mb = dcfg and dcfg.bucket_mb
  if bucket_mb ~= nil then
    options.finite_number(bucket_mb, "dist.bucket_mb (MB per gradient bucket summed during the backward; 0: none)",
      who, nil, 0)
  end
  local ep = (dcfg and dcfg.ep) or 1
  options.pos_int(ep, "dist.ep", who)
  if dcfg and dcfg.cp ~= nil and type(dcfg.cp) ~= "number" and type(dcfg.cp) ~= "table" then
    options.fail(who, "dist.cp must be a count of ranks (or, for --dry-run, a table of stages), got " .. type(dcfg.cp))
  end
  local cp = dcfg and type(dcfg.cp) == "number" and dcfg.cp or 1
  options.pos_int(cp, "dist.cp", who)
  -- one process given a plan for a larger job (dist.gpus set): its ep and cp are the plan's, this run has one rank
  if world == 1 and dcfg and dcfg.gpus then ep, cp = 1, 1 end
  if world % (ep * cp) ~= 0 then
    local what = cp == 1 and string.format("dist.ep = %d", ep) or ep == 1 and string.format("dist.cp = %d", cp)
      or string.format("dist.ep x dist.cp = %d x %d", ep, cp)
    options.fail(who, string.format("%s does not divide the job's %d rank%s (the ranks are dist.dp x dist.ep x dist.cp)",
      what, world, world == 1 and "" or "s"))
  end
  local dp = (dcfg and dcfg.dp) or world / (ep * cp)
  options.pos_int(dp, "dist.dp", who)
  -- every rank reads its own data (dp x ep of them: the expert-parallel ranks route different tokens; the cp ranks of
  -- one group read the same rows and each keeps its slices)
  local n = dp * ep
  -- the data lanes of a packed stream (pack.Lanes): default one per rank; one rank with dist.lanes = L reads what
  -- L ranks read
  local lanes = (dcfg and dcfg.lanes) or n
  options.pos_int(lanes, "dist.lanes", who)
  if lanes % n ~= 0 then
    options.fail(who, string.format("dist.lanes = %d must be a multiple of the %d ranks that read data (dist.dp x "
      .. "dist.ep; each rank hosts lanes / ranks of the data lanes)", lanes, n))
  end
  if n * cp ~= world then
    local what = (ep == 1 and cp == 1) and string.format("dist.dp = %d", dp)
      or string.format("dist.dp x dist.ep x dist.cp = %d x %d x %d = %d", dp, ep, cp, n * cp)
    options.fail(who, string.format("%s but the job has %d rank%s: start it with `mpirun -np %d tide run ...`%s", what,
      world, world == 1 and "" or "s", n * cp, world > 1 and world % (ep * cp) == 0
        and string.format(" or set --dist.dp=%d", world / (ep * cp)) or ""))
  end
  -- the rank map: rank = (d·ep + e)·cp + c. The cp consecutive ranks of one (d, e) hold the zig-zag slices of the same
  -- rows (they read the same data: data rank = rank / cp); the ranks of one (d, c) exchange their tokens' rows for
  -- the experts; the ranks of one e hold the same experts
  local data_rank = math.floor(rank / cp)
  local L = { n = n, dp = dp, ep = ep, cp = cp, rank = rank, data_rank = data_rank, zero = world > 1 and zero or 0,
    group = world > 1 and dist or nil, bucket_bytes = bucket_mb and math.floor(bucket_mb * 2 ^ 20), lanes = lanes,
    lane_opts = { lanes = lanes, first = (n > 1 and data_rank or 0) * (lanes / n), count = lanes / n } }
  local function set(list) return "{" .. table.concat(list, ",") .. "}" end
  local function rank_of(d, e, c) return (d * ep + e) * cp + c end
  local parts = {}
  if cp > 1 then
    L.cp_group = dist.split(data_rank)
    local groups = {}
    for r = 0, n - 1 do
      local g = {}
      for c = 0, cp - 1 do g[#g + 1] = r * cp + c end
      groups[#groups + 1] = set(g)
    end
    parts[#parts + 1] = string.format("the context-parallel groups %s hold the zig-zag slices of the same rows",
      table.concat(groups, " "))
  end
  if ep > 1 then
    local d, e, c = math.floor(rank / (ep * cp)), math.floor(rank / cp) % ep, rank % cp
    L.ep_group = dist.split(d * cp + c)
    L.ep_dp = dist.split(e)
    local groups, reps = {}, {}
    for dd = 0, dp - 1 do
      for cc = 0, cp - 1 do
        local g = {}
        for ee = 0, ep - 1 do g[#g + 1] = rank_of(dd, ee, cc) end
        groups[#groups + 1] = set(g)
      end
    end
    for ee = 0, ep - 1 do
      local g = {}
      for dd = 0, dp - 1 do
        for cc = 0, cp - 1 do g[#g + 1] = rank_of(dd, ee, cc) end
      end
      table.sort(g)
      reps[#reps + 1] = set(g)
    end
    parts[#parts + 1] = string.format("the expert-parallel groups %s exchange their tokens' rows; the ranks of %s hold "
      .. "the same experts", table.concat(groups, " "), table.concat(reps, " "))
  end
  if #parts > 0 then
    local dims, formula = { "dp " .. dp }, "d"
    if ep > 1 then dims[#dims + 1] = "ep " .. ep; formula = "d·" .. ep .. " + e" end
    if cp > 1 then
      dims[#dims + 1] = "cp " .. cp
      formula = (ep > 1 and "(" .. formula .. ")" or formula) .. "·" .. cp .. " + c"
    end
    L.rank_map = string.format("ranks: %d = %s (rank = %s); %s", world, table.concat(dims, " x "), formula,
      table.concat(parts, "; "))
  end
  return L
end

-- build_opts(layout) -> nn.build's opts for this rank: under expert parallelism its slice of the experts (the
-- model never holds the others' experts), else nil
function dist.build_opts(L)
  if not L.ep_group then return nil end
  return { experts = { rank = L.ep_group.rank, size = L.ep_group.size } }
end

-- shard_model(model, layout): expert parallelism (layout.ep > 1): every MoE layer keeps this rank's experts
-- (MoE:shard_experts); call it before the optimiser is built. Returns the count of layers sharded.
function dist.shard_model(model, L)
  if not L.ep_group then return 0 end
  local n = 0
  for _, m in ipairs(model:modules()) do
    if m.shard_experts then
      m:shard_experts(L.ep_group, L.ep_dp.size > 1 and L.ep_dp or nil)
      n = n + 1
    end
  end
  if n == 0 then
    require("tide.options").fail("dist", string.format("dist.ep = %d but the model has no MoE layer to shard", L.ep))
  end
  return n
end

-- the memory line of a run's start: what one rank holds of the weights, the gradients and the AdamW moments
function dist.memory_line(opt, dp)
  local w = 0
  for _, p in ipairs(opt.params) do w = w + p.param:nbytes() end
  local function mb(x) return string.format("%.2f MB", x / 2 ^ 20) end
  local g = w
  if dp.zero == 2 then
    -- after the step's reduce-scatter a rank keeps the gradients it owns (backward still makes all of them)
    local owners = opt:shard_owners(dp.n)
    g = 0
    for i, p in ipairs(opt.params) do if owners[i] == dp.rank then g = g + p.param:nbytes() end end
  end
  return string.format("memory per rank: weights %s, gradients %s%s, AdamW moments %s%s", mb(w), mb(g),
    dp.zero == 2 and string.format(" after the reduce-scatter (%s during backward)", mb(w)) or "", mb(opt:moment_bytes()),
    (dp.zero >= 1 and string.format(" (ZeRO-%d: this rank's share of %d)", dp.zero, dp.n)) or "")
end

-- the ranks sharing an MoE routing batch, as the balancers read them (nn/balance.lua, qb.update_arrays): size;
-- sum_i64(int64 array, len) summed in place over the ranks (counts: exact through f64 below 2^53); gather_f64(double
-- array, len) -> the concatenation over the ranks in rank order and its length (each rank's values at its offset of
-- a zero buffer, summed: exact, one all-reduce)
local function from_array(a, n)
  local t = tide.wrap(C.tide_from_f64(C.TIDE_F64, 1, ffi.new("int64_t[1]", n), 0, a))
  return t
end

-- gather_strings(s) -> {rank 0's s, rank 1's, ...} on every rank (a collective: the lengths summed, then one
-- all-gather of the bytes, each rank's padded to the longest)
function dist.gather_strings(s)
  local world, rank = dist.world(), dist.rank()
  if world == 1 then return { s } end
  local lens = {}
  for r = 1, world do lens[r] = 0 end
  lens[rank + 1] = #s
  lens = dist.sums(lens)
  local L = 1
  for r = 1, world do L = math.max(L, lens[r]) end
  local padded = #s < L and (s .. string.rep("\0", L - #s)) or s
  local mine = tide.wrap(C.tide_from_bytes(C.TIDE_U8, 1, ffi.new("int64_t[1]", L), 0, padded, L))
  local all = dist.allgather(mine)
  local buf = ffi.new("uint8_t[?]", world * L)
  check(C.tide_read_bytes(raw(all), buf, world * L), "gather_strings")
  local out = {}
  for r = 1, world do out[r] = ffi.string(buf + (r - 1) * L, lens[r]) end
  return out
end

-- the data state of every lane (pack.Lanes) on every rank: each rank's hosted lanes' states merged (a collective)
function dist.lane_states(lanes_obj)
  local st = lanes_obj:state()
  if dist.world() == 1 or st.lanes == nil then return st end
  local json = require "tide.json"
  local list = {}
  for r, text in ipairs(dist.gather_strings(json.encode(st))) do list[r] = json.decode(text) end
  return require("tide.data.pack").merge_lane_states(list)
end

function dist.balance_group()
  local world, rank = dist.world(), dist.rank()
  if world == 1 then return nil end
  local g = { size = world }
  function g.sum_i64(arr, len)
    local d = ffi.new("double[?]", math.max(len, 1))
    for i = 0, len - 1 do d[i] = tonumber(arr[i]) end
    local t = dist.allreduce_(from_array(d, len))
    local out = t:f64_array()
    for i = 0, len - 1 do arr[i] = out[i] end
  end
  function g.gather_f64(arr, len)
    local lens = ffi.new("double[?]", world)
    lens[rank] = len
    local lt = dist.allreduce_(from_array(lens, world)):f64_array()
    local off, total = 0, 0
    for r = 0, world - 1 do
      if r < rank then off = off + lt[r] end
      total = total + lt[r]
    end
    local buf = ffi.new("double[?]", math.max(total, 1))
    for i = 0, len - 1 do buf[off + i] = arr[i] end
    local out = dist.allreduce_(from_array(buf, total)):f64_array()
    return out, total
  end
  return g
end

return dist
