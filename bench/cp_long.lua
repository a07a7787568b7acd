-- bench/cp_long.lua — the long-row claim of context parallelism made concrete on this machine (spec/long_context.md §5):
-- one training step's forward + backward on ONE row with cp = 4 ranks (mpirun, oversubscribed: time is not the point)
-- against cp = 1 on the same row, weights and tokens:
--   --model=kda     a KDA-only model of the `tiny` width (d 128, 2 KDA layers of 2 heads × 64, dense SiTU FFN, Block
--                   AttnRes, recompute = layer, f32) on a 1,048,576-token row;
--   --model=hybrid  the `tiny` hybrid's layers (KDA and MLA, whose cost is quadratic in the row) on a 131,072-token row.
-- A row longer than 256K tokens runs in calls of 128K (--calls=N to choose) through the layers' caches, in both runs:
-- each call is split over the 4 ranks, the KDA state and conv history are carried from call to call with their graph
-- (nn.KDA:forward_cp with a cache), and the one backward runs through all calls; so the peak is what the calls keep
-- for the backward plus one layer of one call (recompute = layer), and cp 1 is the segment-by-segment run of the row.
-- Printed and written: each rank's engine peak, the step's seconds, the loss and the largest gradient difference
-- (each parameter's gradient summed over the ranks, against cp 1's, relative to its largest entry).
-- Writes <results>/cp_long_<model>.json and .md.
--
--   tide run bench/cp_long.lua --model=kda [--T=1048576] [--calls=N] [--results=DIR]
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local dist = require "tide.dist"
local cp = require "tide.cp"
local hf = require "tide.hf"
local configs = require "tide.nn.configs"
local nn, F = tide.nn, tide.F
local fmt = string.format

local function model_cfg(kind, T)
  local c = {}
  for k, v in pairs(configs.all.tiny) do c[k] = v end
  c.max_seq_len, c.recompute, c.dtype = T, "layer", "f32"
  if kind == "kda" then
    c.n_layers, c.mixers, c.last_mla, c.moe = 2, { "kda", "kda" }, false, nil
  else
    c.n_layers, c.mixers, c.moe = 4, { "kda", "mla", "kda", "mla" }, nil
  end
  c.attnres = { block_layers = 2 }
  return c
end

local function worker(cfg)
  local T, P, rank = tonumber(cfg.T), dist.world(), dist.rank()
  tide.manual_seed(5)
  local model = nn.build(model_cfg(cfg.model, T))
  local ids = tide.rand({ 1, T + 1 }, { lo = 0, hi = 256 }):to("i32")
  local x, y = ids:narrow(2, 1, T):contiguous(), ids:narrow(2, 2, T):contiguous()
  -- the row in `calls` calls of Tcall tokens through the layers' caches (the KDA state and conv history carried
  -- from call to call with their graph); each call split over the P ranks
  local calls = math.max(1, tonumber(cfg.calls) or 1)
  local Tcall = math.floor(T / calls)
  local group = P > 1 and dist.split(0) or nil
  local ctx = P > 1 and cp.context({ P = P, B = 1, T = Tcall, group = group }) or nil
  local xs, ys = {}, {}
  for i = 1, calls do
    xs[i], ys[i] = x:narrow(2, (i - 1) * Tcall + 1, Tcall), y:narrow(2, (i - 1) * Tcall + 1, Tcall)
    if ctx then xs[i], ys[i] = ctx:split(xs[i]), ctx:split(ys[i]) else xs[i], ys[i] = xs[i]:contiguous(), ys[i]:contiguous() end
  end
  x, y, ids = nil, nil, nil
  tide.collect()
  tide.reset_peak()
  local t0 = tide.time()
  local caches = calls > 1 and model:new_cache() or nil
  local loss
  for i = 1, calls do
    local logits = model:forward(xs[i], caches, ctx and { cp = ctx } or nil)
    local l = F.cross_entropy(logits, ys[i], { reduction = "sum" }) * (1 / T)
    loss = loss and loss + l or l
    logits = nil
    tide.collect()
  end
  caches = nil
  loss:backward()
  local secs = tide.time() - t0
  local slots = {}
  for k = 1, P do slots[k] = 0 end
  slots[rank + 1] = tide.memory().peak
  local tot = { loss:item(), secs }
  if P > 1 then slots, tot = dist.sums(slots), dist.sums(tot) end
  local names, grads = {}, {}
  for name, p in model:named_parameters() do
    local g = p:grad() and p:grad():to("f64"):contiguous() or tide.zeros(p:shape(), { dtype = "f64" })
    if P > 1 then dist.allreduce_(g) end
    names[#names + 1], grads[#grads + 1] = name, g
  end
  local rec = { model = cfg.model, T = T, cp = P, calls = calls, loss = tot[1], seconds = tot[2] / P, peaks = slots }
  if rank == 0 then
    if P == 1 then
      tide.C.tide_mkdir_p(cfg.ref)
      hf.save_safetensors(cfg.ref .. "/model.safetensors", names, grads)
    else
      local ref = hf.read_weights(cfg.ref)
      local worst, at = 0, ""
      for i, name in ipairs(names) do
        local r = ref[name]
        local scale = math.max(r:abs():reshape(-1):max(1):item(), 1e-30)
        local d = (grads[i] - r):abs():reshape(-1):max(1):item() / scale
        if d > worst then worst, at = d, name end
      end
      rec.grad_rel, rec.grad_worst = worst, at
    end
    if tide.C.tide_file_write_text_atomic(cfg.out, json.encode(rec)) ~= 0 then error("cp_long: cannot write " .. cfg.out, 0) end
  end
  return 0
end

local function run(cfg)
  if cfg.worker then return worker(cfg) end
  local T = tonumber(cfg.T) or 0
  if T <= 0 then T = cfg.model == "kda" and 1048576 or 131072 end
  -- rows longer than 256K run in calls of 128K tokens (the layers' caches carry the state): the backward's peak is
  -- then what the calls keep for it plus one layer of one call, not one layer of the whole row
  local calls = tonumber(cfg.calls) or 0
  if calls <= 0 then calls = T > 262144 and math.floor(T / 131072) or 1 end
  if T % calls ~= 0 or (T / calls) % 8 ~= 0 then error(string.format("cp_long: %d calls do not cut a row of %d tokens into multiples of 8", calls, T), 0) end
  local exe = cli.shell_quote(cli.exe_path())
  local tmp = os.tmpname()
  os.remove(tmp)
  assert(tide.C.tide_mkdir_p(tmp) == 0)
  local function launch(np)
    local pre = np > 1 and fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np %d ", np) or ""
    local out = fmt("%s/cp%d.json", tmp, np)
    local cmd = fmt("%s%s run bench/cp_long.lua --worker=true --model=%s --T=%d --calls=%d --ref=%s/ref --out=%s > %s.log 2>&1",
      pre, exe, cfg.model, T, calls, tmp, out, out)
    io.stderr:write("cp_long: " .. cmd .. "\n")
    if not os.execute(cmd) then error("cp_long: the run failed: " .. (tide.read_file(out .. ".log") or ""):sub(-800), 0) end
    return json.decode(assert(tide.read_file(out)))
  end
  local one = launch(1)
  local four = launch(4)
  os.execute("rm -rf " .. cli.shell_quote(tmp))
  local function mb(x) return fmt("%.0f", x / 2 ^ 20) end
  local function peaks(r)
    local p = {}
    for i, v in ipairs(r.peaks) do p[i] = mb(v) end
    return table.concat(p, " / ")
  end
  local L = {}
  L[#L + 1] = fmt("# one %d-token row, cp 4 against cp 1 (%s; f32, recompute = layer; ranks oversubscribed on 2 cores)%s",
    T, cfg.model == "kda" and "a KDA-only model of the tiny width, 2 layers" or "the tiny hybrid's layers: KDA, MLA, KDA, MLA",
    calls > 1 and fmt("; the row in %d calls of %d tokens through the caches, each call split over the ranks", calls, T / calls) or "")
  L[#L + 1] = ""
  L[#L + 1] = "| cp | engine peak per rank (MB) | seconds | loss per token | gradients vs cp 1 (max relative) |"
  L[#L + 1] = "|---:|---|---:|---:|---:|"
  L[#L + 1] = fmt("| 1 | %s | %.0f | %.7f | - |", peaks(one), one.seconds, one.loss)
  L[#L + 1] = fmt("| 4 | %s | %.0f | %.7f (%.2g relative) | %.2g (%s) |", peaks(four), four.seconds, four.loss,
    math.abs(four.loss - one.loss) / math.abs(one.loss), four.grad_rel, four.grad_worst)
  L[#L + 1] = ""
  L[#L + 1] = "Each parameter's gradient is summed over the 4 ranks and compared with the cp 1 run's, relative to its "
    .. "largest entry; the loss is the row's summed cross-entropy over T. The differences are f32 rounding: the fold "
    .. "composes the segment states in another order than one chunk chain, and every sum over the row is split."
  local md = table.concat(L, "\n") .. "\n"
  io.write(md)
  results.write(cfg.results, "cp_long_" .. cfg.model, { benchmark = "cp_long", date = os.date("!%Y-%m-%dT%H:%M:%SZ"),
    cp1 = one, cp4 = four }, md, { "benchmark", "date", "cp1", "cp4" })
  return 0
end

return { model = "kda", T = 0, calls = 0, worker = false, ref = "", out = "", results = "bench/results", run = run }
