-- bench/cp_long.lua — the long-row claim of context parallelism made concrete on this machine (spec/long_context.md §5):
-- one training step's forward + backward on ONE row with cp = 4 ranks (mpirun, oversubscribed: time is not the point)
-- against cp = 1 on the same row, weights and tokens:
--   --model=kda     a KDA-only model of the `tiny` width (d 128, 2 KDA layers of 2 heads × 64, dense SiTU FFN, Block
--                   AttnRes, recompute = layer, f32) on a 1,048,576-token row;
--   --model=hybrid  the `tiny` hybrid's layers (KDA and MLA, whose cost is quadratic in the row) on a 131,072-token row.
-- Printed and written: each rank's engine peak, the step's seconds, the loss and the largest gradient difference
-- (each parameter's gradient summed over the ranks, against cp 1's, relative to its largest entry).
-- Writes <results>/cp_long_<model>.json and .md.
--
--   tide run bench/cp_long.lua --model=kda [--T=1048576] [--results=DIR]
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
  local ctx = P > 1 and cp.context({ P = P, B = 1, T = T, group = dist.split(0) }) or nil
  if ctx then x, y = ctx:split(x), ctx:split(y) end
  tide.collect()
  tide.reset_peak()
  local t0 = tide.time()
  local logits = model:forward(x, nil, ctx and { cp = ctx } or nil)
  local loss = F.cross_entropy(logits, y, { reduction = "sum" }) * (1 / T)
  logits = nil
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
  local rec = { model = cfg.model, T = T, cp = P, loss = tot[1], seconds = tot[2] / P, peaks = slots }
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
  local T = tonumber(cfg.T) or (cfg.model == "kda" and 1048576 or 131072)
  local exe = cli.shell_quote(cli.exe_path())
  local tmp = os.tmpname()
  os.remove(tmp)
  assert(tide.C.tide_mkdir_p(tmp) == 0)
  local function launch(np)
    local pre = np > 1 and fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1 -np %d ", np) or ""
    local out = fmt("%s/cp%d.json", tmp, np)
    local cmd = fmt("%s%s run bench/cp_long.lua --worker=true --model=%s --T=%d --ref=%s/ref --out=%s > %s.log 2>&1", pre,
      exe, cfg.model, T, tmp, out, out)
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
  L[#L + 1] = fmt("# one %d-token row, cp 4 against cp 1 (%s; f32, recompute = layer; ranks oversubscribed on 2 cores)",
    T, cfg.model == "kda" and "a KDA-only model of the tiny width, 2 layers" or "the tiny hybrid's layers: KDA, MLA, KDA, MLA")
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

return { model = "kda", T = 0, worker = false, ref = "", out = "", results = "bench/results", run = run }
