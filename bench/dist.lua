-- bench/dist.lua — data parallelism over MPI on this machine (DESIGN.md §9): recipes/dense.lua trained for `steps`
-- steps at dp = 1, 2, 4 (mpirun --oversubscribe: 2 and 4 ranks share the machine's cores), unsharded, with ZeRO-1
-- and with ZeRO-2, one thread per rank. Per step (the median over the steps after the first): the bytes each rank
-- handed to the network (measured by the process group: tide_dist_bytes_sent), against the analytic volume of each
-- layout (analytic() below: the all-reduce's 2(N−1)/N · params · 4 bytes, ZeRO's weight broadcasts, ZeRO-2's
-- reduce-scatter); the step time, as a ratio to dp = 1; the gradient all-reduce's share of the step (it
-- runs after the backward: nothing overlaps yet). Then the same formula at the K3 config on 4,096 ranks (the layout
-- of recipes/long_context_1m.lua), scaled by the measured/analytic ratio. Writes <results>/dist.json and dist.md.
--
--   tide run bench/dist.lua [--ranks=1,2,4] [--steps=8] [--results=DIR]
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local fmt = string.format

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
      variants[#variants + 1] = { n = n, zero = 0, threads = 1 }
      variants[#variants + 1] = { n = n, zero = 1, threads = 1 }
      variants[#variants + 1] = { n = n, zero = 2, threads = 1 }
    end
  end
  for _, v in ipairs(variants) do
    local n, zero = v.n, v.zero
    do
      local out = fmt("%s/dp%d_z%d_t%d", tmp, n, zero, v.threads)
      local cmd = fmt("%s %s run recipes/dense.lua %s --train.threads=%d --out=%s%s > %s/log_%d_%d_%d 2>&1",
        n > 1 and fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np %d", n) or "",
        cli.shell_quote(tide_bin), common, v.threads, cli.shell_quote(out), zero > 0 and (" --dist.zero=" .. zero) or "", tmp,
        n, zero, v.threads)
      io.stderr:write("dist: " .. cmd .. "\n")
      if os.execute(cmd) ~= 0 then error("dist bench: the run failed: " .. cmd, 0) end
      local recs = records(out)
      rows[#rows + 1] = { ranks = n, zero = zero, threads = v.threads, step_s = median_of(recs, "step_time"),
        bytes = median_of(recs, "dist/bytes_sent") or 0, bytes_mean = median_of(recs, "dist/bytes_sent_mean") or 0,
        allreduce_s = median_of(recs, "dist/allreduce_s") or 0,
        analytic = analytic(n, zero, P * 4) }
    end
  end
  os.execute("rm -rf " .. cli.shell_quote(tmp))
  local base = rows[1].step_s
  -- K3 projection: the parameters a dp group all-reduces (every dense parameter; an expert's only within its ep
  -- group, 1/ep of the experts per rank), bf16 gradients, at each stage's dp = 4096 / (ep · cp)
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
    local bytes = 2 * (dp - 1) / dp * params_rank * 2 * measured_ratio
    proj[#proj + 1] = { stage = name, cp = cp, dp = dp, params_per_rank = params_rank, bytes_per_step = bytes }
  end
  local record = { benchmark = "dist", date = os.date("!%Y-%m-%d %H:%M UTC"), params = P, steps = steps, rows = rows,
    k3 = { total_params = c.total, expert_params = experts, gpus = par.gpus, ep = par.ep, measured_ratio = measured_ratio,
      stages = proj }, loadavg = results.loadavg() }
  local L = { "# bench/dist — data parallelism over MPI (CPU, this machine)", "",
    fmt("%s. recipes/dense.lua (%d parameters, f32, batch %d x %d), %d steps, medians over steps 2-%d; one thread per "
      .. "rank; 2 and 4 ranks share this machine's 2 cores (mpirun --oversubscribe), so the step times measure the "
      .. "extra work and waiting, not a speed-up. Load average %s at the end.", record.date, P, dense.data.batch_size,
      dense.data.seq_len, steps, steps, tostring(record.loadavg)), "",
    "| ranks | threads per rank | ZeRO | bytes sent per rank per step (rank 0) | mean over ranks | analytic mean (below) | measured / analytic | step s | step / dp 1 (1 thread) | gradient reduction share of the step |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" }
  for _, r in ipairs(rows) do
    L[#L + 1] = fmt("| %d | %d | %d | %d | %.0f | %.0f | %s | %.3f | %.2f | %s |", r.ranks, r.threads, r.zero, r.bytes, r.bytes_mean,
      r.analytic, r.analytic > 0 and fmt("%.3f", r.bytes_mean / r.analytic) or "-", r.step_s, r.step_s / base,
      r.ranks > 1 and fmt("%.0f%%", 100 * r.allreduce_s / r.step_s) or "-")
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
    .. "(tests/dist/dp_check.sh). Overlap of the reduction with the backward: 0 (it starts after the backward; "
    .. "buckets are not built yet)."
  L[#L + 1] = ""
  L[#L + 1] = fmt("K3 projection (%s parameters, %s of them routed experts; %d GPUs, ep %d, bf16 gradients; a dp group "
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

return { ranks = "1,2,4", steps = 8, results = "bench/results", run = run }
