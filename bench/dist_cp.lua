-- bench/dist_cp.lua — context parallelism over MPI on this machine (spec/long_context.md §5, tide.cp): ranks
-- oversubscribed on the cores, so the times say what the exchanges and the split cost here, not what devices do.
--   bytes: one forward + backward of one KDA layer and of one MLA layer of the `tiny` config (d 128, f32, one row) at
--     T = 4K, 16K, 64K under cp 2 and cp 4: the bytes a rank sent (tide_dist_bytes_sent, averaged over the ranks)
--     against dist.cp_bytes; KDA's are independent of T (the conv halo and the (h_ext | M) pairs), MLA's linear in T
--     (the latent of the rank's T/cp tokens);
--   memory: one training step (forward + backward of the summed cross-entropy, recompute = "layer") of the `tiny`
--     hybrid MoE model on one 64K-token row at cp 1, 2, 4: each rank's engine peak, and what is above the weights and
--     gradients (the activations and the working set), as a ratio to cp 1.
-- Writes <results>/dist_cp.json and dist_cp.md.
--
--     The MLA layers under cp read the gathered latent (F.mla_latent_attention, CPU and CUDA); the rows marked
--     "expanded" expand its keys and values for the whole row first (cp_latent = false on the layers).
--   tide run bench/dist_cp.lua [--results=DIR] [--T=65536]   (the workers: --worker=bytes|memory, started by mpirun)
--   tide run bench/dist_cp.lua --part=memory      the memory rows only (the bytes table from <results>/dist_cp.json)
--   tide run bench/dist_cp.lua --reuse=bench/results/dist_cp.json   the tables again from a recorded run
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local dist = require "tide.dist"
local cp = require "tide.cp"
local configs = require "tide.nn.configs"
local nn, F = tide.nn, tide.F
local fmt = string.format

local function write(path, text)
  if tide.C.tide_file_write_text_atomic(path, text) ~= 0 then error("dist_cp: cannot write " .. path, 0) end
end

local function tiny()
  local c = {}
  for k, v in pairs(configs.all.tiny) do c[k] = v end
  return c
end

-- one layer of the tiny shapes, one row of T tokens, forward + backward under cp (world = the cp group)
local function worker_bytes(cfg)
  local c, T = tiny(), tonumber(cfg.T)
  local P = dist.world()
  local group = dist.split(0)
  tide.manual_seed(1)
  local layer = cfg.layer == "kda" and nn.KDA(c.dim, c.kda) or nn.MLA(c.dim, c.mla)
  local ctx = cp.context({ P = P, B = 1, T = T, group = group })
  local x = ctx:split(tide.randn({ 1, T, c.dim }) * 0.5)
  x:requires_grad_(true)
  dist.barrier()
  local b0, t0 = dist.bytes_sent(), tide.time()
  local y = layer:forward(x, { cp = ctx })
  y:sum():backward()
  local secs, sent = tide.time() - t0, dist.bytes_sent() - b0
  local s = dist.sums({ sent, secs })
  local shape = cfg.layer == "kda" and { kda = { layers = 1, heads = c.kda.heads, head_dim = c.kda.head_dim,
    conv_size = c.kda.conv_size } } or { mla = { layers = 1, kv_rank = c.mla.kv_rank, rope_dim = c.mla.rope_dim } }
  local want = dist.cp_bytes({ P = P, B = 1, T = T, kda = shape.kda, mla = shape.mla, es = 4, state_es = 4 }).total
  if dist.rank() == 0 then
    write(cfg.out, json.encode({ layer = cfg.layer, T = T, cp = P, bytes = s[1] / P, formula = want,
      seconds = s[2] / P }))
  end
  return 0
end

-- one training step of the tiny model on one row of T tokens (cp = the world, 1 without mpirun)
local function worker_memory(cfg)
  local c, T = tiny(), tonumber(cfg.T)
  c.max_seq_len, c.recompute = math.max(T, c.max_seq_len), "layer"
  local P, rank = dist.world(), dist.rank()
  tide.manual_seed(1)
  local model = nn.build(c)
  local expanded = cfg.mla == "expanded"
  if expanded then for _, m in ipairs(model:modules()) do if m.forward_cp and m.kv_b_proj then m.cp_latent = false end end end
  local ids = tide.rand({ 1, T }, { lo = 0, hi = c.vocab_size }):to("i32")
  local targets = tide.rand({ 1, T }, { lo = 0, hi = c.vocab_size }):to("i32")
  local static = 0
  for _, p in pairs(model:state_dict()) do static = static + 2 * p:nbytes() end   -- each weight and its gradient
  local ctx = P > 1 and cp.context({ P = P, B = 1, T = T, group = dist.split(0) }) or nil
  if ctx then ids, targets = ctx:split(ids), ctx:split(targets) end
  tide.collect()
  tide.reset_peak()
  local t0 = tide.time()
  local logits = model:forward(ids, nil, ctx and { cp = ctx } or nil)
  local loss = F.cross_entropy(logits, targets, { reduction = "sum" })
  logits = nil
  loss:backward()
  local secs = tide.time() - t0
  local slots = {}
  for k = 1, P do slots[k] = 0 end
  slots[rank + 1] = tide.memory().peak
  if P > 1 then slots = dist.sums(slots) end
  local total = P > 1 and dist.sums({ loss:item(), secs }) or { loss:item(), secs }
  if rank == 0 then
    local top = 0
    for _, v in ipairs(slots) do top = math.max(top, v) end
    write(cfg.out, json.encode({ cp = P, T = T, peaks = slots, peak = top, static = static,
      loss_per_token = total[1] / T, seconds = total[2] / P, mla = P > 1 and (expanded and "expanded" or "latent") or "-" }))
  end
  return 0
end

-- the k3 config at the shipped long-context recipe's cp layouts: bytes one rank sends per sequence (bf16 activations,
-- fp32 KDA state, recompute = layer), from the formula the runtime's count is held to
local function k3_projection()
  local k3 = configs.all.k3
  local recipe = dofile("recipes/long_context_1m.lua")
  local cps = recipe.dist.cp
  local n_kda, n_mla = 0, 0
  for _, m in ipairs(require("tide.nn.hybrid").mixer_schedule(k3)) do
    if m == "kda" then n_kda = n_kda + 1 else n_mla = n_mla + 1 end
  end
  local rows = {}
  for _, st in ipairs(recipe.stages) do
    local P = cps[st.name] or 1
    local one_kda = dist.cp_bytes({ P = P, B = 1, T = st.seq_len, kda = { layers = 1, heads = k3.kda.heads,
      head_dim = k3.kda.head_dim, conv_size = k3.kda.conv_size }, es = 2, state_es = 4, recompute = true }).total
    local one_mla = dist.cp_bytes({ P = P, B = 1, T = st.seq_len, mla = { layers = 1, kv_rank = k3.mla.kv_rank,
      rope_dim = k3.mla.rope_dim }, es = 2, recompute = true }).total
    rows[#rows + 1] = { stage = st.name, T = st.seq_len, cp = P, kda_layer = one_kda, mla_layer = one_mla,
      total = n_kda * one_kda + n_mla * one_mla, n_kda = n_kda, n_mla = n_mla }
  end
  return rows
end

local render

local function run(cfg)
  if cfg.worker == "bytes" then return worker_bytes(cfg) end
  if cfg.worker == "memory" then return worker_memory(cfg) end
  if cfg.reuse ~= "" then
    -- re-render the tables from a recorded dist_cp.json (no measuring)
    local rec = json.decode(assert(tide.read_file(cfg.reuse)))
    return render(cfg, rec.bytes, rec.memory, rec.date)
  end
  local exe, self = cli.exe_path(), "bench/dist_cp.lua"
  local tmp = os.tmpname()
  local function launch(np, args)
    local mp = np > 1 and fmt("mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=%d -np %d ", np >= 2 and 1 or 2, np)
      or ""
    local cmd = fmt("%s%s run %s %s --out=%s > %s.log 2>&1", mp, cli.shell_quote(exe), self, args, tmp, tmp)
    io.stderr:write("dist_cp: " .. cmd .. "\n")
    if not os.execute(cmd) then error("dist_cp: the run failed: " .. (tide.read_file(tmp .. ".log") or ""):sub(-800), 0) end
    return json.decode(assert(tide.read_file(tmp)))
  end
  local bytes = {}
  if cfg.part == "memory" then
    bytes = json.decode(assert(tide.read_file(cfg.results .. "/dist_cp.json"))).bytes
  elseif cfg.part ~= "all" then
    error("dist_cp: --part must be all or memory, got " .. tostring(cfg.part), 0)
  else
    for _, layer in ipairs({ "kda", "mla" }) do
      for _, P in ipairs({ 2, 4 }) do
        for _, T in ipairs({ 4096, 16384, 65536 }) do
          bytes[#bytes + 1] = launch(P, fmt("--worker=bytes --layer=%s --T=%d", layer, T))
        end
      end
    end
  end
  local mem = {}
  for _, P in ipairs({ 1, 2, 4 }) do mem[#mem + 1] = launch(P, fmt("--worker=memory --T=%d", tonumber(cfg.T))) end
  for _, P in ipairs({ 2, 4 }) do mem[#mem + 1] = launch(P, fmt("--worker=memory --mla=expanded --T=%d", tonumber(cfg.T))) end
  os.remove(tmp)
  os.remove(tmp .. ".log")
  return render(cfg, bytes, mem)
end

render = function(cfg, bytes, mem, date)
  local function mb(x) return fmt("%.1f", x / 2 ^ 20) end
  local L = {}
  L[#L + 1] = "# context parallelism on this machine (tiny shapes, f32; ranks oversubscribed on 2 cores)"
  L[#L + 1] = ""
  L[#L + 1] = "## Bytes a rank sends for one layer's forward + backward (one row)"
  L[#L + 1] = ""
  L[#L + 1] = "| layer | T | cp | bytes sent per rank (measured) | dist.cp_bytes | measured / formula | seconds |"
  L[#L + 1] = "|---|---:|---:|---:|---:|---:|---:|"
  for _, r in ipairs(bytes) do
    L[#L + 1] = fmt("| %s | %d | %d | %.0f | %.0f | %.3f | %.3f |", r.layer, r.T, r.cp, r.bytes, r.formula,
      r.bytes / r.formula, r.seconds)
  end
  L[#L + 1] = ""
  L[#L + 1] = "KDA's traffic is the conv halo (K − 1 = 3 tokens of q, k, v per segment) and the fp32 (h_ext | M) pairs of "
    .. "the rank's two segments, the same at every T; MLA's is the latent [ĉ | k_r] (96 values per token here) of the "
    .. "rank's T/cp tokens, linear in T. Each is gathered to the other cp − 1 ranks in the forward and its gradient "
    .. "comes back the same way in the backward."
  L[#L + 1] = ""
  L[#L + 1] = fmt("## One training step of the tiny model on one %d-token row (recompute = layer)", tonumber(cfg.T))
  L[#L + 1] = ""
  L[#L + 1] = "| cp | MLA attention | engine peak per rank (MB, max over ranks) | weights + gradients (MB) | above them (MB) | above / cp 1 | 1/cp | loss per token | seconds |"
  L[#L + 1] = "|---:|---|---:|---:|---:|---:|---:|---:|---:|"
  local base = mem[1].peak - mem[1].static
  for _, r in ipairs(mem) do
    local above = r.peak - r.static
    L[#L + 1] = fmt("| %d | %s | %s | %s | %s | %.3f | %.3f | %.6f | %.1f |", r.cp, r.mla or (r.cp > 1 and "expanded" or "-"),
      mb(r.peak), mb(r.static), mb(above), above / base, 1 / r.cp, r.loss_per_token, r.seconds)
  end
  L[#L + 1] = ""
  L[#L + 1] = "Above the weights and gradients a rank holds its layer-input checkpoints (its T/cp tokens) and one "
    .. "layer's working set during the recompute. MLA attention \"latent\" (the path under cp): the attention reads "
    .. "the gathered latent and expands keys and values a chunk of keys at a time (F.mla_latent_attention), so a rank "
    .. "holds the row's latent (d_c + d_r values per token) but never its expansion; \"expanded\" (cp_latent = false on the "
    .. "layers): keys and values expanded for the whole row on every rank (T · H · (d_n + d_v) values), "
    .. "which does not fall with cp. cp 1 runs the layer without cp (its keys and values expanded, as in any "
    .. "single-rank step). The KDA layers' working set and every token-local layer fall as 1/cp. The loss per token "
    .. "is the same at every cp (one row, the same weights)."
  L[#L + 1] = ""
  L[#L + 1] = "## Projected: the k3 config at recipes/long_context_1m.lua's cp layouts (dist.cp_bytes)"
  L[#L + 1] = ""
  local k3 = k3_projection()
  L[#L + 1] = fmt("Bytes one rank sends per sequence (bf16 activations, fp32 KDA pairs, recompute = layer), %d KDA and %d "
    .. "MLA layers; `--dry-run` of the recipe multiplies them by each stage's sequences per rank.", k3[1].n_kda, k3[1].n_mla)
  L[#L + 1] = ""
  L[#L + 1] = "| stage | T | cp | per KDA layer | per MLA layer | all layers | MLA share |"
  L[#L + 1] = "|---|---:|---:|---:|---:|---:|---:|"
  local function human(x)
    for _, u in ipairs({ { 2 ^ 40, "TB" }, { 2 ^ 30, "GB" }, { 2 ^ 20, "MB" }, { 2 ^ 10, "KB" } }) do
      if x >= u[1] then return fmt("%.2f %s", x / u[1], u[2]) end
    end
    return fmt("%d B", x)
  end
  for _, r in ipairs(k3) do
    L[#L + 1] = fmt("| %s | %d | %d | %s | %s | %s | %s |", r.stage, r.T, r.cp, human(r.kda_layer), human(r.mla_layer),
      human(r.total), r.total > 0 and fmt("%.3f", r.n_mla * r.mla_layer / r.total) or "-")
  end
  L[#L + 1] = ""
  L[#L + 1] = "A KDA layer's exchange does not depend on T (96 heads × a 128 × 256 fp32 pair per segment, 12.6 MB) but "
    .. "each rank sends its pairs to the other cp − 1, so it grows with cp; at K3's widths it is most of the bytes (an "
    .. "MLA layer's latent is 1,152 B per token, its gather grows with T/cp per rank and cp − 1). A scan over the "
    .. "ranks in place of the all-gather would send each pair once or twice (log cp rounds), the next step if the "
    .. "pairs' bytes matter on a real network."
  local md = table.concat(L, "\n") .. "\n"
  io.write(md)
  results.write(cfg.results, "dist_cp", { benchmark = "dist_cp", date = date or os.date("!%Y-%m-%dT%H:%M:%SZ"), bytes = bytes,
    memory = mem, k3 = k3 }, md, { "benchmark", "date", "bytes", "memory", "k3" })
  return 0
end

return { worker = "", layer = "kda", T = 65536, out = "", reuse = "", results = "bench/results", part = "all", mla = "latent",
  run = run }
