-- bench/mla.lua — MLA attention on the CPU (spec/mla.md §4): forward + backward time and peak bytes of the
-- tiled online-softmax op `mla_attention` against T, beside the engine's plain attention op (`attention`,
-- which materialises the [T, T] scores per head) measured in the same run on the same inputs (the k_r slot
-- broadcast to every head for it). The tiled op's memory must grow linearly in T, the plain one's
-- quadratically. Shape: the tiny config's MLA (H = 2, d_n = 64, d_r = 32, dv = 64), f32, one sequence.
-- With --device=cuda both run on the GPU, where the plain op is tiled too (kernels/cuda/attention.cu runs on
-- the MLA kernels). Writes <results>/mla.json and <results>/mla.md and prints the table. It reports; it asserts
-- nothing.
--
--   tide run bench/mla.lua [--sizes=1024,2048,4096,8192,16384] [--baseline_max=8192] [--reps=2] [--device=cpu|cuda]
--                          [--results=DIR]
local ffi = require "ffi"
local tide = require "tide"
local results = require "tide.results"
local F = tide.F

local H, DN, DR, DV = 2, 64, 32, 64

local sync = results.sync

local function inputs(T, device)
  tide.manual_seed(T)
  local on = { device = device }
  local x = {
    q = tide.randn({ 1, T, H, DN + DR }, on), kn = tide.randn({ 1, T, H, DN }, on), kr = tide.randn({ 1, T, DR }, on),
    v = tide.randn({ 1, T, H, DV }, on), gout = tide.randn({ 1, T, H, DV }, on),
  }
  for _, k in ipairs({ "q", "kn", "kr", "v" }) do x[k]:requires_grad_(true) end
  return x
end

-- best of reps: seconds of forward + backward and peak bytes above what existed before
local function time_it(reps, device, fn)
  local best, fwd, peak = math.huge, math.huge, 0
  for _ = 1, reps do
    collectgarbage()
    sync(device)
    local base = tide.memory(device).current
    tide.reset_peak(device)
    local t0 = tide.time()
    local o, leaves = fn()
    sync(device)
    local t1 = tide.time()
    o:backward(leaves.gout)
    sync(device)
    local t2 = tide.time()
    peak = math.max(peak, tide.memory(device).peak - base)
    best, fwd = math.min(best, t2 - t0), math.min(fwd, t1 - t0)
    for _, k in ipairs({ "q", "kn", "kr", "v" }) do leaves[k]:zero_grad() end
    o = nil
  end
  return { seconds = best, forward_seconds = fwd, peak_bytes = peak }
end

local function run(cfg)
  local sizes = results.numbers(cfg.sizes)
  local record = {
    benchmark = "mla", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(),
    blas = ffi.string(tide.C.tide_blas_info()), reps = cfg.reps, heads = H, nope_dim = DN, rope_dim = DR, v_dim = DV,
    rows = {}, device = cfg.device,
  }
  tide.device(cfg.device, "mla bench --device")
  local on_cpu = cfg.device == "cpu"
  io.stderr:write("mla: attention forward + backward, tiled mla_attention vs the plain attention op\n")
  for _, T in ipairs(sizes) do
    local x = inputs(T, cfg.device)
    local scale = 1 / math.sqrt(DN + DR)
    local row = { T = T }
    row.tiled = time_it(cfg.reps, cfg.device, function()
      return F.mla_attention(x.q, x.kn, x.kr, x.v, { scale = scale }), x
    end)
    if T <= cfg.baseline_max then
      row.plain = time_it(cfg.reps, cfg.device, function()
        -- the same scores through [B, H, T, D] attention: k = [k_n | k_r broadcast to the heads]; that op
        -- wants one head width, so v is zero-padded from dv to d_n + d_r and the output cut back
        local k = F.concat({ x.kn, x.kr:reshape(1, T, 1, DR):expand(1, T, H, DR) }, 4)
        local v = F.concat({ x.v, tide.zeros({ 1, T, H, DN + DR - DV }, { device = cfg.device }) }, 4)
        local o = F.attention(x.q:permute(1, 3, 2, 4), k:permute(1, 3, 2, 4), v:permute(1, 3, 2, 4),
          { causal = true, scale = scale })
        return o:permute(1, 3, 2, 4):narrow(4, 1, DV), x
      end)
    end
    if row.plain and on_cpu then
      -- the plain kernel's score scratch is malloc'd outside the engine allocator: 2 [T, T] f32 buffers in
      -- its backward (kernels/cpu/attention.c), added here
      row.plain.scratch_bytes = 2 * T * T * 4
      row.plain.peak_bytes = row.plain.peak_bytes + row.plain.scratch_bytes
    end
    row.bytes_per_token = row.tiled.peak_bytes / T
    io.stderr:write(string.format("  T=%-6d tiled %.3f s, peak %.1f MB%s\n", T, row.tiled.seconds, row.tiled.peak_bytes / 2 ^ 20,
      row.plain and string.format("; plain %.3f s, peak %.1f MB", row.plain.seconds, row.plain.peak_bytes / 2 ^ 20) or ""))
    record.rows[#record.rows + 1] = row
    x = nil
    collectgarbage()
  end
  local L = {
    "# bench/mla — MLA attention on " .. (on_cpu and "the CPU" or cfg.device), "",
    string.format("%s, %s. H = %d, d_n = %d, d_r = %d (NoPE), dv = %d, f32, one sequence, causal; best of "
      .. "%d forward + backward passes. Baseline: the engine's plain attention op on the same scores (its v "
      .. "zero-padded to d_n + d_r: one head width)%s.", record.date,
      on_cpu and string.format("%d threads, %s", record.threads, record.blas) or ffi.string(tide.C.tide_cuda_info()),
      H, DN, DR, DV, record.reps, on_cpu and ", which keeps the [T, T] probabilities per head (its peak includes "
      .. "the 2 [T, T] f32 scratch buffers its kernel allocates outside the engine allocator)"
      or ", tiled on the GPU as well (kernels/cuda/attention.cu)"), "",
    "| T | tiled s | tiled peak MB | tiled peak bytes/token | plain s | plain peak MB | plain / tiled time |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  }
  for _, r in ipairs(record.rows) do
    L[#L + 1] = string.format("| %d | %.3f | %.1f | %.0f | %s | %s | %s |", r.T, r.tiled.seconds, r.tiled.peak_bytes / 2 ^ 20,
      r.bytes_per_token, r.plain and string.format("%.3f", r.plain.seconds) or "—",
      r.plain and string.format("%.1f", r.plain.peak_bytes / 2 ^ 20) or "—",
      r.plain and string.format("%.2fx", r.plain.seconds / r.tiled.seconds) or "—")
  end
  local first, last = record.rows[1], record.rows[#record.rows]
  if first and last and last.T > first.T then
    record.peak_growth = (last.tiled.peak_bytes / first.tiled.peak_bytes) / (last.T / first.T)
    L[#L + 1] = ""
    L[#L + 1] = string.format("Tiled peak bytes from T = %d to %d grew %.2fx as fast as T (1 = linear).", first.T, last.T,
      record.peak_growth)
  end
  L[#L + 1] = ""
  local md = table.concat(L, "\n")
  io.write(md)
  results.write(cfg.results, "mla", record, md)
  return 0
end

return {
  sizes = "1024,2048,4096,8192,16384",  -- sequence lengths
  baseline_max = 8192,                   -- the plain op's [T, T] buffers grow fast: not beyond this T
  device = "cpu",                        -- "cuda" runs both on the GPU
  reps = 2,
  results = "bench/results",
  run = run,
}
