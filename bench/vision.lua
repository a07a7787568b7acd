-- bench/vision.lua — the vision encoder (spec/vision.md: nn.VisionEncoder + nn.VisionProjector) forward + backward
-- on the CPU, f32: patches/s and peak bytes of tide beside the same encoder in PyTorch eager (bench/torch_vision.py;
-- every PyTorch build of --python, a comma-separated list: Debian's python3-torch, a PyPI build made by
-- scripts/torch_pypi.sh) measured in the same run. Per config:
--   1. correctness first: tide's weights, patches and R go to a safetensors file; PyTorch loads them, runs the step
--      and compares its output y and every parameter gradient with tide's (max |delta| over max |torch value|, per
--      tensor); the bench fails when the worst relative delta is over 1e-3;
--   2. timing: loss = sum(y * R) (R fixed random), forward + backward, warm-up first, then `rounds` interleaved rounds
--      of one tide step at each thread count of --tide_threads and one PyTorch step at each of --torch_threads
--      (PyTorch in one long-lived process per build and OpenMP setting, fed by a FIFO: libgomp's default waiting and
--      OMP_WAIT_POLICY=PASSIVE); medians; each engine's fastest variant (threads; for PyTorch also build and setting)
--      is its number (on a shared 2-core machine the 2-thread runs suffer most from other jobs);
--   3. memory: tide's engine peak (tide.reset_peak, tide.memory().peak, above what exists before the step) at 1x,
--      2x, 4x the packed images, as bytes per patch (must be flat: memory linear in the patch count); PyTorch's
--      peak RSS growth (ru_maxrss after the step minus the RSS before it) in a fresh process per size;
--   4. where tide's time goes: each op of the step timed alone (forward, then backward from a ones gradient made
--      beforehand, same shapes), best of 5; and how
--      much of PyTorch's step is GEMM (torch.autograd.profiler self time of addmm/mm/bmm), which bounds the ratio a
--      faster non-GEMM side can reach while the GEMMs (the same OpenBLAS in both) cost the same.
-- Writes <results>/vision.json and <results>/vision.md and prints the table. It reports speed; it asserts only the
-- correctness check.
--
--   tide run bench/vision.lua [--only=tiny-vlm|moonvit-narrow] [--rounds=5] [--tide_threads=1,2] [--torch_threads=1,2]
--                             [--scales=1,2,4] [--baseline=false] [--profile=false] [--python=PATH[,PATH...]] [--results=DIR]
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local hf = require "tide.hf"
local results = require "tide.results"
local cli = require "tide.cli"
local nn, F = tide.nn, tide.F
local fmt = string.format

local TOLERANCE = 1e-3   -- max |tide - torch| / max |torch| per tensor (y and every gradient), f32
local TARGET = 1.5       -- the issue: tide >= 1.5x PyTorch eager patches/s at both configs
local PROFILE_REPS = 5   -- best of, per op of the profile (best of 2 was too noisy on a shared machine)

-- images as pixel sizes (h x w); the patch grid is size / p rounded to even (vision.md §2 pads to 2p)
local CONFIGS = {
  { name = "tiny-vlm", vision = { patch = 4, dim = 64, heads = 4, layers = 2, mlp_dim = 256, grid = 8 }, lm_dim = 128,
    images = { { 32, 32, n = 64 } } },
  { name = "moonvit-narrow", vision = { patch = 14, dim = 256, heads = 4, layers = 4, mlp_dim = 1024, grid = 64 },
    lm_dim = 1024, images = { { 224, 224 }, { 336, 448 }, { 280, 392 } } },
}

local bench_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "bench"
local shell_quote = cli.shell_quote
local median = results.median

local function even_grid(px, p)
  local g = math.floor(px / p + 0.5)
  if g % 2 == 1 then g = g + 1 end
  return g
end

local function grids_of(c, scale)
  local grids = {}
  for _ = 1, scale do
    for _, im in ipairs(c.images) do
      for _ = 1, im.n or 1 do grids[#grids + 1] = { even_grid(im[1], c.vision.patch), even_grid(im[2], c.vision.patch) } end
    end
  end
  return grids
end

local function grid_string(grids)
  local s = {}
  for i, g in ipairs(grids) do s[i] = g[1] .. "x" .. g[2] end
  return table.concat(s, ",")
end

local function count(grids)
  local n = 0
  for _, g in ipairs(grids) do n = n + g[1] * g[2] end
  return n
end

local function images_string(c)
  local s = {}
  for i, im in ipairs(c.images) do s[i] = (im.n and (im.n .. " x ") or "") .. im[1] .. "x" .. im[2] end
  return table.concat(s, ", ")
end

-- ---- tide -------------------------------------------------------------------------------------------------------
local function build(c)
  tide.manual_seed(1)
  local vc = nn.vision.config(c.vision, c.lm_dim)
  local m = { vc = vc, vit = nn.VisionEncoder(vc, { dtype = "f32" }), proj = nn.VisionProjector(vc, { dtype = "f32" }) }
  return m
end

local function inputs(m, grids, seed)
  tide.manual_seed(seed)
  local n = count(grids)
  return { grids = grids, n = n, patches = tide.randn({ n, 3 * m.vc.patch * m.vc.patch }),
    R = tide.randn({ n / 4, m.vc.lm_dim }) }
end

local function zero(m) m.vit:zero_grad(); m.proj:zero_grad() end

-- one forward + backward; returns y, seconds of the forward (with the loss) and of the backward, peak bytes above
-- what existed before it
local function step(m, x)
  zero(m)
  collectgarbage()
  local base = tide.memory().current
  tide.reset_peak()
  local t0 = tide.time()
  local y = m.proj:forward(m.vit:forward(x.patches, x.grids), x.grids)
  local loss = (y * x.R):sum()
  local t1 = tide.time()
  loss:backward()
  local t2 = tide.time()
  return y, t1 - t0, t2 - t1, tide.memory().peak - base
end

-- the weights, inputs, tide's output and gradients as one safetensors file for torch_vision.py
local function export(path, m, x, y)
  local names, ts = {}, {}
  local function add(n, t) names[#names + 1] = n; ts[#ts + 1] = t end
  local grads = {}
  for _, pre in ipairs({ "vit", "proj" }) do
    for n, t in m[pre]:named_parameters() do
      add(pre .. "." .. n, t:detach())
      grads[#grads + 1] = { "tide.grad." .. pre .. "." .. n, t:grad() }
    end
  end
  for _, g in ipairs(grads) do
    if not g[2] then error("vision bench: " .. g[1] .. " got no gradient from tide", 0) end
    add(g[1], g[2])
  end
  add("input.patches", x.patches)
  add("input.R", x.R)
  add("tide.y", y:detach())
  hf.save_safetensors(path, names, ts, { grids = grid_string(x.grids), heads = tostring(m.vc.heads),
    layers = tostring(m.vc.layers), theta = tostring(m.vc.theta), eps = tostring(m.vc.eps) })
end

-- ---- PyTorch: one process per config, build and OpenMP setting (tide.results.torch_engines), text commands through
-- a FIFO, one JSON line back each (tide.results.server) --------------------------------------------------------------
local Torch = {}

function Torch.start(e, dir, i)
  return results.server(fmt("%s %s %s --serve {fifo}", e.env, shell_quote(e.python),
    shell_quote(bench_dir .. "/torch_vision.py")), dir, "torch_vision_" .. i, "quit")
end

-- a fresh PyTorch process (build and setting e): one step at these grids; its peak RSS growth
local function torch_memory(e, path, grids, threads)
  local cmd = fmt("%s %s %s --memory %s --grids %s --threads %d 2>&1", e.env, shell_quote(e.python),
    shell_quote(bench_dir .. "/torch_vision.py"), shell_quote(path), grid_string(grids), threads)
  local p = io.popen(cmd, "r")
  local text = p:read("*a")
  p:close()
  local line = text:match("({.*})%s*$")
  local ok, obj = pcall(json.decode, line or "")
  if not ok or type(obj) ~= "table" then
    io.stderr:write("vision bench: torch memory run failed: " .. text:sub(-600) .. "\n")
    return nil
  end
  return obj
end

-- ---- where tide's time goes: each op of the step alone, forward + backward at the step's shapes -----------------
local function profile(m, x)
  local vc, grids = m.vc, x.grids
  local L, d, H, hd = x.n, vc.dim, vc.heads, vc.head_dim
  local blk = m.vit.encoder.blocks:get(1)
  local pos, cu = F.grid_positions(grids), nn.vision.cu_seqlens(grids)
  local idx = nn.vision.merge_index(grids)
  local function leaf(shape) return tide.randn(shape):requires_grad_(true) end
  local h = leaf({ L, d })
  local q, k, v = leaf({ L, H, hd }), leaf({ L, H, hd }), leaf({ L, H, hd })
  local hm = leaf({ L, vc.mlp_dim })
  local m4 = leaf({ L / 4, 4 * d })
  local mp = leaf({ L / 4, vc.proj_dim })
  local pieces = {
    { "patch_embed Linear", 1, function() return m.vit.patch_embed.proj:forward(x.patches) end },
    { "pos_interp", 1, function() return F.pos_interp(m.vit.patch_embed.pos_emb.weight, grids) end },
    { "LayerNorm", 2 * vc.layers + 2, function() return blk.norm0:forward(h) end },
    { "wqkv Linear", vc.layers, function() return blk.wqkv:forward(h) end },
    { "rope2d (q and k)", vc.layers, function() return F.rope2d(q, pos, { theta = vc.theta }) + F.rope2d(k, pos, { theta = vc.theta }) end },
    { "varlen_attention", vc.layers, function() return F.varlen_attention(q, k, v, { cu_seqlens = cu, scale = 1 / math.sqrt(hd) }) end },
    { "wo Linear", vc.layers, function() return blk.wo:forward(h) end },
    { "mlp fc0 Linear", vc.layers, function() return blk.mlp.fc0:forward(h) end },
    { "gelu (tanh)", vc.layers, function() return F.gelu(hm) end },
    { "mlp fc1 Linear", vc.layers, function() return blk.mlp.fc1:forward(hm) end },
    { "residual add", 2 * vc.layers, function() return h + h end },
    { "merge index_select", 1, function() return F.index_select(h, 1, idx) end },
    { "proj linear_1", 1, function() return m.proj.linear_1:forward(m4) end },
    { "gelu_erf", 1, function() return F.gelu_erf(mp) end },
    { "proj linear_2", 1, function() return m.proj.linear_2:forward(mp) end },
  }
  local rows, total = {}, 0
  for _, pc in ipairs(pieces) do
    local best_f, best_b = math.huge, math.huge
    local g   -- the output's gradient, ones, made outside the timing (o:sum():backward() timed tide's sum kernel too)
    for _ = 1, PROFILE_REPS do
      collectgarbage()
      local t0 = tide.time()
      local o = pc[3]()
      local t1 = tide.time()
      if not g then
        g = tide.ones_like(o)
        t0 = tide.time()
        o = pc[3]()
        t1 = tide.time()
      end
      o:backward(g)
      local t2 = tide.time()
      best_f, best_b = math.min(best_f, t1 - t0), math.min(best_b, t2 - t1)
    end
    local r = { op = pc[1], count = pc[2], forward_s = best_f, backward_s = best_b, step_s = pc[2] * (best_f + best_b) }
    total = total + r.step_s
    rows[#rows + 1] = r
  end
  for _, r in ipairs(rows) do r.share = r.step_s / total end
  zero(m)
  return { ops = rows, sum_s = total }
end

-- ---- one config ---------------------------------------------------------------------------------------------------
local function bench_config(cfg, c, tmp)
  local m = build(c)
  local grids = grids_of(c, 1)
  local x = inputs(m, grids, 7)
  local r = { name = c.name, vision = c.vision, lm_dim = c.lm_dim, images = images_string(c), grids = grid_string(grids),
    n_images = #grids, patches = x.n, tokens = x.n / 4, params = m.vit:num_parameters() + m.proj:num_parameters() }
  io.stderr:write(fmt("vision: %s: %d images (%s), %d patches, %d params\n", c.name, #grids, r.images, x.n, r.params))

  -- the PyTorch side: every build and OpenMP setting of --python (one server each, each checked against tide), at
  -- every thread count of --torch_threads: the variants timed
  local servers, variants = {}, {}
  local path = tmp .. "/" .. c.name .. ".safetensors"
  local threads = cfg.baseline and results.numbers(cfg.torch_threads) or {}
  if cfg.baseline then
    local y = step(m, x)
    export(path, m, x, y)
    local engines, _, skipped = results.torch_engines(cfg.python)
    for _, sk in ipairs(skipped) do io.stderr:write(fmt("vision: %s cannot import torch (%s): left out\n", sk.python, sk.why)) end
    if #engines == 0 then error("vision bench: no interpreter of --python=" .. cfg.python .. " imports torch", 0) end
    local fw = {}
    r.checks = {}
    for i, e in ipairs(engines) do
      local sv = Torch.start(e, tmp, i)
      servers[#servers + 1] = sv
      local chk = sv:ask("load " .. path)
      chk.engine = e.label
      r.checks[#r.checks + 1] = chk
      if e.setting == results.TORCH_SETTINGS[1].name then fw[#fw + 1] = chk.framework end
      r.torch_attention = r.torch_attention or chk.attention
      io.stderr:write(fmt("  check (%s): y max |delta| %.3g (rel %.3g); worst over y and %d gradients: rel %.3g (%s), abs %.3g\n",
        e.label, chk.y_max_abs_delta, chk.y_max_rel_delta, chk.tensors_compared - 1, chk.max_rel_delta, chk.worst,
        chk.max_abs_delta))
      if chk.max_rel_delta > TOLERANCE then
        for _, s2 in ipairs(servers) do s2:close() end
        error(fmt("vision bench: %s: tide and PyTorch %s differ: %s max |delta| / max |torch| = %.3g > %g", c.name,
          e.label, chk.worst, chk.max_rel_delta, TOLERANCE), 0)
      end
      for _, n in ipairs(threads) do
        variants[#variants + 1] = { sv = sv, engine = e, threads = n, label = fmt("%s %dT", e.label, n) }
      end
    end
    r.check = r.checks[1]
    r.torch_version = table.concat(fw, ", ")
  end

  local tide_threads = results.numbers(cfg.tide_threads)
  local default_threads = tide.num_threads()
  if #tide_threads == 0 then tide_threads = { default_threads } end
  local tt, th = {}, {}
  for _, n in ipairs(tide_threads) do tt[n] = { step_s = {}, forward_s = {}, backward_s = {}, peak = 0 } end
  for k in ipairs(variants) do th[k] = {} end
  r.idle = {}
  for round = 0, cfg.rounds do        -- round 0 is the warm-up
    -- each timed round after a wait for an idle machine, tide and PyTorch first in turn (tide.results' method)
    if round > 0 then r.idle[round] = results.wait_idle({ max_busy = cfg.max_busy, timeout = cfg.idle_timeout }) end
    local line = fmt("  round %d%s:", round, round == 0 and " (warm-up)" or "")
    local function run_tide()
      for _, n in ipairs(tide_threads) do
        tide.set_num_threads(n)
        local _, f, b, peak = step(m, x)
        local e = tt[n]
        if round > 0 then
          e.step_s[#e.step_s + 1], e.forward_s[#e.forward_s + 1], e.backward_s[#e.backward_s + 1] = f + b, f, b
          e.peak = math.max(e.peak, peak)
        end
        line = line .. fmt(" tide %dT %.3f s (fwd %.3f, bwd %.3f),", n, f + b, f, b)
      end
      tide.set_num_threads(default_threads)
    end
    local function run_torch()
      for k, v in ipairs(variants) do
        local t = v.sv:ask(fmt("time %d 1", v.threads)).step_s[1]
        if round > 0 then th[k][#th[k] + 1] = t end
        line = line .. fmt(" torch %s %.3f s,", v.label, t)
      end
    end
    if round % 2 == 0 then run_torch(); run_tide() else run_tide(); run_torch() end
    io.stderr:write(line:sub(1, -2) .. "\n")
  end
  r.tide = { by_threads = {}, default_threads = default_threads }
  local best
  for _, n in ipairs(tide_threads) do
    local e = tt[n]
    local o = { threads = n, step_s = e.step_s, step_s_median = median(e.step_s), forward_s_median = median(e.forward_s),
      backward_s_median = median(e.backward_s), peak_bytes = e.peak }
    o.patches_per_s = x.n / o.step_s_median
    r.tide.by_threads[#r.tide.by_threads + 1] = o
    if n == default_threads then r.tide.default_threads_patches_per_s = o.patches_per_s end
    if not best or o.step_s_median < best.step_s_median then best = o end
  end
  for _, k in ipairs({ "threads", "step_s_median", "forward_s_median", "backward_s_median", "patches_per_s", "peak_bytes" }) do
    r.tide[k] = best[k]
  end
  local bestv
  if #variants > 0 then
    r.torch = { by_threads = {} }
    best = nil
    for k, v in ipairs(variants) do
      local e = { threads = v.threads, variant = v.label, step_s = th[k], step_s_median = median(th[k]) }
      e.patches_per_s = x.n / e.step_s_median
      r.torch.by_threads[#r.torch.by_threads + 1] = e
      if not best or e.step_s_median < best.step_s_median then best, bestv = e, v end
    end
    r.torch.threads, r.torch.step_s_median, r.torch.patches_per_s = best.threads, best.step_s_median, best.patches_per_s
    r.torch.variant = best.variant
    r.tide_over_torch_of_medians = r.tide.patches_per_s / r.torch.patches_per_s
    -- the ratio: round i pairs tide's and PyTorch's i-th steps (each at its fastest threads); the median of the
    -- per-round ratios is quoted, with their range
    local ts, ps = r.tide.by_threads, best.step_s
    for _, e in ipairs(ts) do if e.threads == r.tide.threads then ts = e.step_s end end
    local p = results.paired(ps, ts)
    r.tide_over_torch, r.ratio_min, r.ratio_max, r.ratios = p.median, p.min, p.max, p.ratios
    if cfg.profile then
      r.torch_profile = bestv.sv:ask(fmt("profile %d", r.torch.threads))
      r.torch_gemm = bestv.sv:ask(fmt("gemm %d 3", r.torch.threads))
    end
  end
  for _, sv in ipairs(servers) do sv:close() end

  -- memory against the patch count
  r.memory = {}
  tide.set_num_threads(r.tide.threads)
  for _, s in ipairs(results.numbers(cfg.scales)) do
    local gs = grids_of(c, s)
    local xs = s == 1 and x or inputs(m, gs, 7 + s)
    local _, f, b, peak = step(m, xs)
    local e = { scale = s, images = #gs, patches = xs.n, tide_peak_bytes = peak, tide_bytes_per_patch = peak / xs.n,
      tide_step_s = f + b }
    if bestv then
      local tm = torch_memory(bestv.engine, path, gs, r.torch.threads)
      if tm then
        e.torch_rss_growth = tm.growth
        e.torch_rss_bytes_per_patch = tm.growth / xs.n
        e.torch_rss_valid = tm.growth_valid
      end
    end
    io.stderr:write(fmt("  memory %dx: %d patches, tide peak %.1f MB (%.0f B/patch)%s\n", s, xs.n, peak / 1e6, peak / xs.n,
      e.torch_rss_growth and fmt(", torch RSS growth %.1f MB (%.0f B/patch)", e.torch_rss_growth / 1e6,
        e.torch_rss_bytes_per_patch) or ""))
    r.memory[#r.memory + 1] = e
    xs = nil
    zero(m)
  end

  if cfg.profile then
    r.profile = profile(m, x)
    local tp = r.torch_profile and r.torch_profile.ops
    if tp then
      for _, o in ipairs(r.profile.ops) do
        local e = tp[o.op]
        if e then o.torch_forward_s, o.torch_backward_s = e.forward_s, e.backward_s end
      end
    end
  end
  tide.set_num_threads(default_threads)
  m, x = nil, nil
  collectgarbage()
  return r
end

local function num(v, f) return v and fmt(f, v) or "-" end

local function markdown(rec)
  local L = {}
  L[#L + 1] = "# vision: ViT encoder + projector forward + backward (f32, CPU)"
  L[#L + 1] = ""
  L[#L + 1] = fmt("%s, tide %s (%s; default %d threads), its fastest of %s threads; PyTorch: %s eager, each build "
    .. "with libgomp's default waiting and with OMP_WAIT_POLICY=PASSIVE at %s threads, the fastest quoted; attention in "
    .. "PyTorch: %s. Load average %s at start, %s at the end (a shared 2-core machine).", rec.date, rec.tide_version, rec.blas, rec.threads, rec.tide_threads,
    rec.torch_version or "not run", rec.torch_threads, rec.torch_attention or "-", num(rec.loadavg_start, "%.2f"),
    num(rec.loadavg_end, "%.2f"))
  L[#L + 1] = ""
  L[#L + 1] = fmt("- step: y = projector(vit(patches, grids)); loss = sum(y * R); backward. Median of %d rounds after a "
    .. "warm-up, tide and PyTorch rounds interleaved (each round after a wait for an idle machine, cores at most %.0f%% "
    .. "busy over 1 s; the engine that goes first alternates). patches/s = packed patches / median step; tide / torch "
    .. "is the median of the per-round ratios (min-max).", rec.rounds, 100 * (rec.max_busy or 0.15))
  L[#L + 1] = fmt("- check before timing: PyTorch loads tide's weights and inputs; y and every parameter gradient compared, "
    .. "max |delta| / max |torch| per tensor, fail above %g.", TOLERANCE)
  L[#L + 1] = "- memory: tide's engine peak above what exists before the step; PyTorch: ru_maxrss after one step minus "
    .. "the RSS before it, fresh process per size (process RSS, not tensor bytes: not the same measure as tide's)."
  L[#L + 1] = ""
  L[#L + 1] = "| config | images | patches | tide patches/s | torch patches/s | tide / torch: median of paired rounds (min-max) | threads tide / torch "
    .. "| y max abs delta | worst rel delta (y, grads) | tide peak B/patch 1x / 2x / 4x | torch RSS B/patch 1x / 2x / 4x |"
  L[#L + 1] = "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"
  for _, r in ipairs(rec.configs) do
    local tp, rp = {}, {}
    for i, e in ipairs(r.memory) do
      tp[i] = fmt("%.0f", e.tide_bytes_per_patch)
      rp[i] = num(e.torch_rss_bytes_per_patch, "%.0f")
    end
    L[#L + 1] = fmt("| %s | %s | %d | %.1f | %s | %s | %d / %s | %s | %s | %s | %s |", r.name, r.images, r.patches,
      r.tide.patches_per_s, num(r.torch and r.torch.patches_per_s, "%.1f"), num(r.tide_over_torch, "%.2fx") .. (r.ratio_min and fmt(" (%.2fx-%.2fx)", r.ratio_min, r.ratio_max) or ""),
      r.tide.threads, r.torch and (r.torch.variant or fmt("%d", r.torch.threads)) or "-",
      num(r.check and r.check.y_max_abs_delta, "%.2e"),
      r.check and fmt("%.2e (%s)", r.check.max_rel_delta, r.check.worst) or "-", table.concat(tp, " / "),
      table.concat(rp, " / "))
  end
  L[#L + 1] = ""
  L[#L + 1] = "| config | grids | tide step s by threads: step (fwd / bwd) | torch step s by threads | tide peak MB 1x / 2x / 4x |"
  L[#L + 1] = "|---|---|---|---|---|"
  for _, r in ipairs(rec.configs) do
    local bt, mp, tb = {}, {}, {}
    for _, e in ipairs(r.tide.by_threads) do
      tb[#tb + 1] = fmt("%dT %.3f (%.3f / %.3f)", e.threads, e.step_s_median, e.forward_s_median, e.backward_s_median)
    end
    for _, e in ipairs(r.torch and r.torch.by_threads or {}) do
      bt[#bt + 1] = fmt("%s %.3f", e.variant or fmt("%dT", e.threads), e.step_s_median)
    end
    for i, e in ipairs(r.memory) do mp[i] = fmt("%.1f", e.tide_peak_bytes / 1e6) end
    local g = r.grids
    if #g > 40 then g = g:sub(1, 24) .. "... (" .. r.n_images .. " images)" end
    L[#L + 1] = fmt("| %s | %s | %s | %s | %s |", r.name, g, table.concat(tb, ", "), #bt > 0 and table.concat(bt, ", ") or "-", table.concat(mp, " / "))
  end
  for _, r in ipairs(rec.configs) do
    if r.profile then
      L[#L + 1] = ""
      L[#L + 1] = fmt("Where tide's time goes, %s (%d threads): each op alone at the step's shapes, forward + backward "
        .. "from a ones gradient made beforehand (best of %d) x its count per step; sum %.3f s against a measured step of %.3f s.", r.name, r.tide.threads,
        PROFILE_REPS, r.profile.sum_s, r.tide.step_s_median)
      L[#L + 1] = ""
      L[#L + 1] = fmt("PyTorch's column: the same op alone (%s threads), x the same count.",
        num(r.torch_profile and r.torch_profile.threads, "%d"))
      L[#L + 1] = ""
      L[#L + 1] = "| op | per step | tide fwd ms | tide bwd ms | tide ms per step | share | torch fwd ms | torch bwd ms "
        .. "| torch ms per step | tide / torch time |"
      L[#L + 1] = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      for _, o in ipairs(r.profile.ops) do
        local ts = o.torch_forward_s and o.count * (o.torch_forward_s + o.torch_backward_s)
        L[#L + 1] = fmt("| %s | %d | %.2f | %.2f | %.1f | %.1f%% | %s | %s | %s | %s |", o.op, o.count, 1e3 * o.forward_s,
          1e3 * o.backward_s, 1e3 * o.step_s, 100 * o.share, num(o.torch_forward_s and 1e3 * o.torch_forward_s, "%.2f"),
          num(o.torch_backward_s and 1e3 * o.torch_backward_s, "%.2f"), num(ts and 1e3 * ts, "%.1f"),
          num(ts and o.step_s / ts, "%.2f"))
      end
    end
  end
  L[#L + 1] = ""
  for _, r in ipairs(rec.configs) do
    local g = r.torch_gemm
    if g and g.share then
      L[#L + 1] = fmt("- %s: PyTorch's step (%d threads, %.3f s, median of 3 plain steps) spends %.3f s, %.0f%%, in BLAS "
        .. "products (self time of aten::addmm/mm/bmm under torch.autograd.profiler, median of 3 profiled steps, each "
        .. "after a plain one): with tide's GEMMs as fast as PyTorch's (the same OpenBLAS) and everything else free, "
        .. "tide / torch could reach at most %.2fx.", r.name, g.threads, g.step_s, g.gemm_s, 100 * g.share, 1 / g.share)
    end
  end
  L[#L + 1] = ""
  local v = {}
  for _, r in ipairs(rec.configs) do
    v[#v + 1] = r.tide_over_torch and fmt("%s %s (%.2fx)", r.name, r.tide_over_torch >= TARGET and "met" or "missed",
      r.tide_over_torch) or (r.name .. " not measured")
  end
  L[#L + 1] = fmt("Target: tide >= %.1fx PyTorch eager patches/s at both configs: %s.", TARGET, table.concat(v, "; "))
  return table.concat(L, "\n") .. "\n"
end

local function run(cfg)
  local record = {
    benchmark = "vision", date = os.date("!%Y-%m-%d %H:%M UTC"), tide_version = tide.version,
    threads = tide.num_threads(), blas = ffi.string(tide.C.tide_blas_info()), rounds = cfg.rounds, max_busy = cfg.max_busy,
    tide_threads = cfg.tide_threads, torch_threads = cfg.torch_threads, tolerance = TOLERANCE, target_vs_torch = TARGET, loadavg_start = results.loadavg(),
    configs = {},
  }
  local tmp = os.tmpname()
  os.remove(tmp)
  if tide.C.tide_mkdir_p(tmp) ~= 0 then error("vision bench: cannot create " .. tmp, 0) end
  local ok, err = pcall(function()
    for _, c in ipairs(CONFIGS) do
      if cfg.only == "" or cfg.only == c.name then
        local r = bench_config(cfg, c, tmp)
        record.configs[#record.configs + 1] = r
        record.torch_version = record.torch_version or r.torch_version
        record.torch_attention = record.torch_attention or r.torch_attention
      end
    end
  end)
  tide.C.tide_remove_tree(tmp)
  if not ok then error(err, 0) end
  if #record.configs == 0 then error("vision bench: --only='" .. cfg.only .. "' names no config (tiny-vlm, moonvit-narrow)", 0) end
  record.loadavg_end = results.loadavg()
  local md = markdown(record)
  io.write(md)
  results.write(cfg.results, "vision", record, md, { "benchmark", "date", "name", "tide", "torch", "check", "memory" })
  return 0
end

return {
  only = "",                    -- one config by name ("tiny-vlm", "moonvit-narrow"); "" runs both
  rounds = 5,                   -- timed interleaved rounds after one warm-up round
  max_busy = 0.15,              -- a round starts once the cores are at most this busy over 1 s ...
  idle_timeout = 60,            -- ... or after this many seconds of waiting
  tide_threads = "1,2",         -- tide's thread counts tried each round ("" = the engine's default); its fastest counts
  torch_threads = "1,2",        -- PyTorch's thread counts tried each round; its fastest median counts
  scales = "1,2,4",             -- the packed images repeated this many times for the memory column
  baseline = true,              -- run the PyTorch side (check, timing, memory)
  profile = true,               -- time each op of tide's step alone
  python = "/usr/bin/python3,build/torch-pypi/bin/python",   -- the PyTorch builds (missing ones left out)
  results = "bench/results",    -- where vision.json / vision.md go; "" writes nothing
  run = run,
}
