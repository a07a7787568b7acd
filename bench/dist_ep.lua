-- bench/dist_ep.lua — expert parallelism over MPI on this machine (spec/moe.md §9, DESIGN.md §9): the tiny hybrid MoE
-- model of the tests (tests/dist/dp_moe.lua: 2 MoE layers of 8 experts, top-2, d 32; f32; QB with the histogram
-- estimator) trained for `steps` steps on 2 and 4 ranks (mpirun --oversubscribe) as dp N (ep 1) and with expert
-- parallelism (ep 2, ep 4, dp 2 x ep 2). Per step (the median over the steps after the first): the bytes a rank sent
-- (tide_dist_bytes_sent, averaged over the ranks), split into the parts the formulas give — the replicated gradients'
-- all-reduce over every rank and the experts' over their replicas (dist.step_bytes), the balancer's and the step's
-- scalar sums (what the dp N run sends beyond its all-reduce: the same routing batch), and the rest, the expert-parallel
-- exchanges — against dist.ep_bytes with uniform routing (rows = tokens · k · (ep − 1)/ep per rank); the step time as a
-- ratio to dp N. Writes <results>/dist_ep.json and dist_ep.md.
--
--   tide run bench/dist_ep.lua [--steps=8] [--results=DIR]
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local dist = require "tide.dist"
local fmt = string.format

local RECIPE = "tests/dist/dp_moe.lua"
local COMMON = { "--model.dtype=f32", "--model.moe.estimator=histogram", "--train.ckpt_every=0", "--train.log_every=1",
  "--train.quiet=true" }

local function median_of(recs, key)
  local xs = {}
  for i = 2, #recs do if recs[i][key] then xs[#xs + 1] = recs[i][key] end end
  return #xs > 0 and results.median(xs) or nil
end

local function records(run)
  local out = {}
  for line in assert(tide.read_file(run .. "/metrics.jsonl")):gmatch("[^\n]+") do
    local r = json.decode(line)
    if r.step and r.step_time then out[#out + 1] = r end
  end
  return out
end

local function run(cfg)
  local tide_bin = cli.exe_path()
  local tmp = os.tmpname()
  os.remove(tmp)
  assert(tide.C.tide_mkdir_p(tmp) == 0)
  local recipe = dofile(RECIPE)
  local mc = recipe.model
  local model = tide.nn.build(mc)
  -- parameter counts: every routed expert's, the rest
  local p_exp, p_all = 0, 0
  for name, t in model:named_parameters() do
    p_all = p_all + t:numel()
    if name:match("%.experts%.") then p_exp = p_exp + t:numel() end
  end
  local n_moe, k, d = mc.n_layers, mc.moe.top_k, mc.moe.latent_dim or mc.dim
  local tokens = recipe.data.batch_size * recipe.data.seq_len
  local variants = { { n = 2, ep = 1 }, { n = 2, ep = 2 }, { n = 4, ep = 1 }, { n = 4, ep = 4 }, { n = 4, ep = 2 } }
  local rows, base = {}, {}
  for _, v in ipairs(variants) do
    local out = fmt("%s/n%d_ep%d", tmp, v.n, v.ep)
    local cmd = fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np %d %s run %s %s "
      .. "--train.steps=%d --dist.ep=%d --out=%s > %s.log 2>&1", v.n, cli.shell_quote(tide_bin), RECIPE,
      table.concat(COMMON, " "), tonumber(cfg.steps), v.ep, cli.shell_quote(out), cli.shell_quote(out))
    io.stderr:write("dist_ep: " .. cmd .. "\n")
    if not os.execute(cmd) then error("dist_ep: the run failed: " .. (tide.read_file(out .. ".log") or ""):sub(-600), 0) end
    local recs = records(out)
    local dp = v.n / v.ep
    local bytes = median_of(recs, "dist/bytes_sent_mean")
    local step_s = median_of(recs, "step_time")
    -- the gradients' sums, as the runtime sends them (f32): replicated parameters over every rank, each rank's experts
    -- over their dp replicas
    local grads = dist.step_bytes(4 * (p_all - p_exp), v.n, 0) + dist.step_bytes(4 * p_exp / v.ep, dp, 0)
    if v.ep == 1 then grads = dist.step_bytes(4 * p_all, v.n, 0) end
    local r = { ranks = v.n, dp = dp, ep = v.ep, bytes = bytes, step_s = step_s, grads = grads }
    if v.ep == 1 then
      base[v.n] = r
      r.other = bytes - grads
    else
      local per_rank = tokens / v.n * k * (v.ep - 1) / v.ep
      r.other = base[v.n].other
      r.exchange = bytes - grads - r.other
      r.exchange_formula = n_moe * dist.ep_bytes(per_rank, per_rank, d, d, 4, v.ep)
      r.time_ratio = step_s / base[v.n].step_s
      r.bytes_ratio = bytes / base[v.n].bytes
    end
    rows[#rows + 1] = r
  end
  os.execute("rm -rf " .. cli.shell_quote(tmp))
  local L = {}
  L[#L + 1] = fmt("# expert parallelism on this machine (%s, f32, %d MoE layers of %d experts top-%d, d %d; %d tokens "
    .. "per step; %s steps)", RECIPE, n_moe, mc.moe.n_experts, k, d, tokens, cfg.steps)
  L[#L + 1] = ""
  L[#L + 1] = "| ranks | dp | ep | bytes sent per rank per step | gradient sums (formula) | balancer and scalars | "
    .. "expert exchanges (measured) | expert exchanges (dist.ep_bytes, uniform routing) | measured / formula | step s | "
    .. "step time / dp N | bytes / dp N |"
  L[#L + 1] = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for _, r in ipairs(rows) do
    L[#L + 1] = fmt("| %d | %d | %d | %.0f | %.0f | %.0f | %s | %s | %s | %.4f | %s | %s |", r.ranks, r.dp, r.ep, r.bytes,
      r.grads, r.other, r.exchange and fmt("%.0f", r.exchange) or "-",
      r.exchange_formula and fmt("%.0f", r.exchange_formula) or "-",
      r.exchange and fmt("%.3f", r.exchange / r.exchange_formula) or "-", r.step_s,
      r.time_ratio and fmt("%.2f", r.time_ratio) or "1", r.bytes_ratio and fmt("%.2f", r.bytes_ratio) or "1")
  end
  L[#L + 1] = ""
  L[#L + 1] = "The exchanges' measured bytes depend on where the router sends the rank's rows: the formula assumes "
    .. "uniform routing ((ep − 1)/ep of the rows leave the rank and as many arrive); tests/dist/ep_layer.lua holds "
    .. "dist.ep_bytes of the actual rows to the runtime's count exactly. The ranks share 2 cores (oversubscribed), so "
    .. "the step times say how the exchanges' copies and waits add up here, not what devices would do. Expert "
    .. "parallelism sends less for the gradients (each rank sums only its experts', over their replicas) and more for "
    .. "the rows (last column: the total against dp N on as many ranks); the rows grow with the tokens per rank, the "
    .. "gradients saved with the experts' size."
  local md = table.concat(L, "\n") .. "\n"
  io.write(md)
  results.write(cfg.results, "dist_ep", { benchmark = "dist_ep", date = os.date("!%Y-%m-%dT%H:%M:%SZ"), rows = rows }, md,
    { "benchmark", "date", "rows" })
  return 0
end

return { steps = 8, results = "bench/results", run = run }
