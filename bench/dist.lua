-- bench/dist.lua — data parallelism over MPI on this machine (DESIGN.md §9): recipes/dense.lua trained for `steps`
-- steps at dp = 1, 2, 4 (mpirun --oversubscribe: 2 and 4 ranks share the machine's cores), unsharded, with ZeRO-1
-- and with ZeRO-2, one thread per rank. Per step (the median over the steps after the first): the bytes each rank
-- handed to the network (measured by the process group: tide_dist_bytes_sent), against the analytic volume of each
-- layout (analytic() below: the all-reduce's 2(N−1)/N · params · 4 bytes, ZeRO's weight broadcasts, ZeRO-2's
-- reduce-scatter); the step time, as a ratio to dp = 1; the gradient all-reduce's share of the step (it
-- runs after the backward: nothing overlaps yet). Then the same formula at the K3 config on 4,096 ranks (the layout
-- of recipes/long_context_1m.lua), scaled by the measured/analytic ratio. The baseline, in the same run: the same
-- model in PyTorch eager (bench/torch_dense.py) on one process and under DistributedDataParallel on gloo at
-- dp = 2, 4 (one thread per rank, the same rows per rank, DDP's buckets of the same size), its step time beside
-- tide's. Writes <results>/dist.json and dist.md.
--
--   tide run bench/dist.lua [--ranks=1,2,4] [--steps=8] [--baseline=true] [--rounds=3] [--python=/usr/bin/python3]
--                           [--results=DIR]
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local fmt = string.format

-- buckets of 0.5 MB cut the dense model's 3.5 MB of gradients into 7, summed while the backward runs
local BUCKET_MB = 0.5
local SMALL = { "--train.eval_every=0", "--train.ckpt_every=0", "--train.log_every=1", "--sample.max_new_tokens=0",
  "--schedule.warmup=2", "--train.quiet=true" }

local function records(run)
  local out = {}
  local text = assert(tide.read_file(run .. "/metrics.jsonl"))
  for line in text:gmatch("[^\n]+") do
    local r = json.decode(line)
    if r.step and r.step_time then out[#out + 1] = r end
  end
  return out
end

local function median_of(recs, key)
  local xs = {}
  for i = 2, #recs do if recs[i][key] then xs[#xs + 1] = recs[i][key] end end
  return #xs > 0 and results.median(xs) or nil
end

-- the bytes a rank sends per step, averaged over the ranks, for a gradient of `bytes` (dist.step_bytes: the formula
-- --dry-run plans with)
local function analytic(n, zero, bytes) return require("tide.dist").step_bytes(bytes, n, zero) end

local function run(cfg)
  local tide_bin = cli.exe_path()
  local tmp = os.tmpname()
  os.remove(tmp)
  assert(tide.C.tide_mkdir_p(tmp) == 0)
  local steps = tonumber(cfg.steps)
  local common = table.concat(SMALL, " ") .. " --train.steps=" .. steps
  -- the model's parameter count (the recipe's model)
  local dense = dofile("recipes/dense.lua")
  local P = tide.nn.build(dense.model):num_parameters()
  local rows = {}
  local variants = {}
  for _, n in ipairs(results.numbers(cfg.ranks)) do
    if n == 1 then
      variants[#variants + 1] = { n = 1, zero = 0, threads = 1 }
      variants[#variants + 1] = { n = 1, zero = 0, threads = 2 }   -- one rank on both cores
    else
      variants[#variants + 1] = { n = n, zero = 0, threads = 1, bucket_mb = 0 }
      variants[#variants + 1] = { n = n, zero = 0, threads = 1, bucket_mb = BUCKET_MB }
      variants[#variants + 1] = { n = n, zero = 1, threads = 1, bucket_mb = BUCKET_MB }
      variants[#variants + 1] = { n = n, zero = 2, threads = 1, bucket_mb = 0 }
    end
  end
  local runs = 0
  local function run_tide(v)
    local n, zero = v.n, v.zero
    runs = runs + 1
    do
      local out = fmt("%s/dp%d_z%d_t%d_b%s_%d", tmp, n, zero, v.threads, tostring(v.bucket_mb or 0), runs)
      local cmd = fmt("%s %s run recipes/dense.lua %s --train.threads=%d --out=%s%s%s > %s.log 2>&1",
        n > 1 and fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np %d", n) or "",
        cli.shell_quote(tide_bin), common, v.threads, cli.shell_quote(out), zero > 0 and (" --dist.zero=" .. zero) or "",
        n > 1 and (" --dist.bucket_mb=" .. tostring(v.bucket_mb)) or "", out)
      io.stderr:write("dist: " .. cmd .. "\n")
      if os.execute(cmd) ~= 0 then error("dist bench: the run failed: " .. cmd, 0) end
      local recs = records(out)
      return { ranks = n, zero = zero, threads = v.threads, bucket_mb = n > 1 and v.bucket_mb or nil,
        step_s = median_of(recs, "step_time"),
        bytes = median_of(recs, "dist/bytes_sent") or 0, bytes_mean = median_of(recs, "dist/bytes_sent_mean") or 0,
        allreduce_s = median_of(recs, "dist/allreduce_s") or 0, overlap = median_of(recs, "dist/overlap"),
        backward_overlapped = median_of(recs, "dist/backward_overlapped"),
        buckets = median_of(recs, "dist/buckets"), mem_current = median_of(recs, "mem_current"),
        mem_peak = median_of(recs, "mem_peak"),
        analytic = analytic(n, zero, P * 4) }
    end
  end
  for _, v in ipairs(variants) do rows[#rows + 1] = run_tide(v) end
  -- PyTorch: the same model and rows per rank, one process and DDP (gloo) at each rank count, in `rounds` rounds,
  -- each a tide run (one thread per rank, ZeRO 0, the same buckets) and then PyTorch's: the ratio per round paired
  local torch_rows = {}
  if cfg.baseline == true or cfg.baseline == "true" then
    local m = tide.nn.build(dense.model)
    for _, n in ipairs(results.numbers(cfg.ranks)) do
      local rows_per_rank = dense.data.batch_size / n
      local pairs_, framework = {}, nil
      for _ = 1, tonumber(cfg.rounds) do
      local tr = run_tide({ n = n, zero = 0, threads = 1, bucket_mb = n > 1 and BUCKET_MB or nil })
      local cmd = fmt("OMP_WAIT_POLICY=PASSIVE %s %s --vocab %d --dim %d --layers %d --heads %d --ffn %d --seq %d "
        .. "--batch %d --threads 1 --warmup 1 --steps %d%s 2> %s/torch_%d.err", cli.shell_quote(cfg.python),
        cli.shell_quote("bench/torch_dense.py"), dense.model.vocab_size, dense.model.dim, dense.model.n_layers,
        dense.model.n_heads, m.cfg.ffn_dim, dense.data.seq_len, rows_per_rank, steps - 1,
        n > 1 and fmt(" --ddp %d --bucket-mb %g", n, BUCKET_MB) or "", tmp, n)
      io.stderr:write("dist: " .. cmd .. "\n")
      local p = io.popen(cmd)
      local text = p:read("*a")
      p:close()
      local ok, obj = pcall(json.decode, text:match("(%b{})%s*$") or "")
      if ok and type(obj) == "table" and obj.step_s_median then
        pairs_[#pairs_ + 1] = { torch = obj.step_s_median, tide = tr.step_s }
        framework = obj.framework
      else
        io.stderr:write(fmt("dist bench: the PyTorch run for %d rank(s) failed: %s\n", n,
          (tide.read_file(fmt("%s/torch_%d.err", tmp, n)) or ""):sub(-400)))
      end
      end
      if #pairs_ > 0 then
        local t_s, d_s, ratio = {}, {}, {}
        for k, pr in ipairs(pairs_) do t_s[k], d_s[k], ratio[k] = pr.torch, pr.tide, pr.torch / pr.tide end
        table.sort(ratio)
        torch_rows[#torch_rows + 1] = { ranks = n, step_s = results.median(t_s), tide_step_s = results.median(d_s),
          ratio = results.median(ratio), ratio_min = ratio[1], ratio_max = ratio[#ratio], rounds = #pairs_,
          framework = framework }
      end
    end
  end
  os.execute("rm -rf " .. cli.shell_quote(tmp))
  local base = rows[1].step_s
  -- K3 projection: the parameters a dp group all-reduces (every dense parameter; an expert's only within its ep
  -- group, 1/ep of the experts per rank), fp32 gradients (the masters' dtype, as the runtime sends them), at each
  -- stage's dp = 4096 / (ep · cp): dist.step_bytes of the all-reduce, as --dry-run plans it
  local plan = require "tide.nn.plan"
  local k3 = plan.configs.k3
  local c = plan.count(k3)
  local experts = 0
  for _, pl in ipairs(c.per_layer) do if pl.ffn == "moe" then experts = experts + pl.ffn_params end end
  local lc = dofile("recipes/long_context_1m.lua")
  local par = lc.dist
  local measured_ratio = 1
  for _, r in ipairs(rows) do
    if r.ranks > 1 and r.zero == 0 and r.analytic > 0 then measured_ratio = r.bytes_mean / r.analytic end
  end
  local proj = {}
  local stage_names = {}
  for name in pairs(par.cp) do stage_names[#stage_names + 1] = name end
  table.sort(stage_names)
  for _, name in ipairs(stage_names) do
    local cp = par.cp[name]
    local dp = par.gpus / (par.ep * cp)
    local params_rank = (c.total - experts) + experts / par.ep
    local bytes = require("tide.dist").step_bytes(4 * params_rank, dp, 0) * measured_ratio
    proj[#proj + 1] = { stage = name, cp = cp, dp = dp, params_per_rank = params_rank, bytes_per_step = bytes }
  end
  local record = { benchmark = "dist", date = os.date("!%Y-%m-%d %H:%M UTC"), params = P, steps = steps, rows = rows,
    torch = torch_rows,
    k3 = { total_params = c.total, expert_params = experts, gpus = par.gpus, ep = par.ep, measured_ratio = measured_ratio,
      stages = proj }, loadavg = results.loadavg() }
  local L = { "# bench/dist — data parallelism over MPI (CPU, this machine)", "",
    fmt("%s. recipes/dense.lua (%d parameters, f32, batch %d x %d), %d steps, medians over steps 2-%d; one thread per "
      .. "rank; 2 and 4 ranks share this machine's 2 cores (mpirun --oversubscribe), so the step times measure the "
      .. "extra work and waiting, not a speed-up. Load average %s at the end.", record.date, P, dense.data.batch_size,
      dense.data.seq_len, steps, steps, tostring(record.loadavg)), "",
    "| ranks | threads per rank | ZeRO | buckets (MB) | bytes sent per rank per step (rank 0) | mean over ranks | analytic mean (below) | measured / analytic | step s | step / dp 1 (1 thread) | gradient sum s (share of the step) | share of the sum during the backward | share of the backward with a sum running | rank 0 memory after the step / peak MB |",
    "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" }
  for _, r in ipairs(rows) do
    L[#L + 1] = fmt("| %d | %d | %d | %s | %d | %.0f | %.0f | %s | %.3f | %.2f | %s | %s | %s | %.2f / %.2f |", r.ranks, r.threads, r.zero,
      r.ranks == 1 and "-" or ((r.buckets and r.buckets > 0) and fmt("%d x %g", r.buckets, r.bucket_mb) or "after the backward"),
      r.bytes, r.bytes_mean, r.analytic, r.analytic > 0 and fmt("%.3f", r.bytes_mean / r.analytic) or "-", r.step_s,
      r.step_s / base, r.ranks > 1 and fmt("%.4f (%.0f%%)", r.allreduce_s, 100 * r.allreduce_s / r.step_s) or "-",
      r.overlap and fmt("%.0f%%", 100 * r.overlap) or "-",
      r.backward_overlapped and fmt("%.0f%%", 100 * r.backward_overlapped) or "-", (r.mem_current or 0) / 2 ^ 20,
      (r.mem_peak or 0) / 2 ^ 20)
  end
  if #torch_rows > 0 then
    L[#L + 1] = ""
    L[#L + 1] = fmt("PyTorch in the same run (%s; one thread per rank on both sides, OMP_WAIT_POLICY=PASSIVE, %d/N "
      .. "rows of %d per rank at dp N as tide, DDP (gloo) buckets of %g MB), in %d rounds, each a tide run (ZeRO 0, the "
      .. "same buckets) then PyTorch's; step times are the medians over the rounds of each run's median step, the "
      .. "ratio the median (min-max) of the rounds' paired ratios:", torch_rows[1].framework or "?",
      dense.data.batch_size, dense.data.seq_len, BUCKET_MB, torch_rows[1].rounds)
    L[#L + 1] = ""
    L[#L + 1] = "| ranks | PyTorch step s | tide step s (ZeRO 0, buckets) | PyTorch / tide step time: median (min-max) |"
    L[#L + 1] = "|---:|---:|---:|---:|"
    for _, t in ipairs(torch_rows) do
      L[#L + 1] = fmt("| %d | %.3f | %.3f | %.2fx (%.2fx-%.2fx) |", t.ranks, t.step_s, t.tide_step_s, t.ratio,
        t.ratio_min, t.ratio_max)
    end
  end
  L[#L + 1] = ""
  L[#L + 1] = "Oversubscription: this machine has 2 cores, so dp 2 (one thread per rank) uses the cores one rank with two "
    .. "threads uses, and dp 4 puts two ranks on each core: its step time includes the ranks waiting for the core they "
    .. "share, and says nothing about 4 real devices. The like-for-like comparison on this machine is dp 2 against one "
    .. "rank with 2 threads."
  L[#L + 1] = ""
  L[#L + 1] = "The gradient sum is a chain in rank order (0 → 1 → … → N−1, then the sum on from N−1 through 0 … N−2), "
    .. "so its volume per rank averages the ring's 2(N−1)/N·P·4 bytes (the ranks differ: the two chain ends send "
    .. "once, the others twice); the rest are the step's scalar sums (targets, losses, the non-finite decision). "
    .. "ZeRO-1 adds the owners' weight broadcasts (counted at the root: P·4/N a rank; MPI_Bcast's own forwarding "
    .. "between ranks is not counted). ZeRO-2 reduce-scatters instead of all-reducing: the same chain to rank N−1, "
    .. "which then sends each owner only its part, (N−1)/N + (N−1)/N² of P·4 on average, so its total is about the "
    .. "plain all-reduce's and ~2/3 of ZeRO-1's at large N; the sums are the all-reduce's bit for bit "
    .. "(tests/dist/dp_check.sh). With buckets the sum runs on a helper thread as the backward finishes each bucket's "
    .. "parameters (its MPI waits sleep between tests instead of spinning, which took a core from the backward and "
    .. "cost 35% of the dp 2 step); the sum-seconds column then counts the waits for the other ranks' buckets, and "
    .. "the next column is the median share of them that fell before the backward ended, the one after it the share "
    .. "of the last backward's seconds during which a bucket was being summed. On this machine the "
    .. "ranks' main threads already take both cores, so the overlap has nothing to hide the sum behind: the bucketed "
    .. "and unbucketed step times differ by no more than this machine's run-to-run noise (about ±20% between runs "
    .. "of this bench), and the buckets cost their copies in and out of the bucket buffers (the extra memory in the "
    .. "last column); the gain needs a core, or a network, that is idle during the backward."
  L[#L + 1] = ""
  L[#L + 1] = fmt("K3 projection (%s parameters, %s of them routed experts; %d GPUs, ep %d, fp32 gradients; a dp group "
    .. "all-reduces the dense parameters and its ep-shard of the experts; scaled by the measured/analytic ratio %.3f):",
    plan.human_count and plan.human_count(c.total) or tostring(c.total), plan.human_count and plan.human_count(experts)
    or tostring(experts), par.gpus, par.ep, measured_ratio)
  L[#L + 1] = ""
  L[#L + 1] = "| stage | cp | dp | parameters per rank | bytes per rank per step |"
  L[#L + 1] = "|---|---:|---:|---:|---:|"
  for _, p in ipairs(proj) do
    L[#L + 1] = fmt("| %s | %d | %d | %.3g | %.3g GB |", p.stage, p.cp, p.dp, p.params_per_rank, p.bytes_per_step / 1e9)
  end
  local md = table.concat(L, "\n") .. "\n"
  io.write(md)
  results.write(cfg.results, "dist", record, md, { "benchmark", "date", "rows", "k3" })
  return 0
end

return { ranks = "1,2,4", steps = 8, baseline = true, rounds = 3, python = "/usr/bin/python3", results = "bench/results", run = run }
