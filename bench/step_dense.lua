-- bench/step_dense.lua — tokens/s and achieved GFLOP/s of one dense training step (forward, backward,
-- AdamW, zero_grad) of nn.TransformerLM, beside two baselines measured in the same run:
--   * the sgemm ceiling: bench-sgemm-ceiling times tide_matmul at this model's GEMM shapes (forward,
--     input gradient and weight gradient of every Linear), best of `ceiling_reps`;
--   * PyTorch CPU eager running the same model (bench/torch_dense.py, one process per build and OpenMP setting: every
--     interpreter of `python` (a comma-separated list: Debian's python3-torch, a PyPI build made by
--     scripts/torch_pypi.sh) that imports torch, each with libgomp's default waiting and OMP_WAIT_POLICY=PASSIVE;
--     the fastest is quoted, all are recorded).
-- The method (tide.results): each config is measured in `rounds` rounds; a round waits for an idle machine, then
-- times `steps` steps of every engine, the order rotating from round to round; an engine's figure for a round is
-- its median step. A ratio is the median (and range) over the rounds of the per-round ratios, so a slow moment of
-- a shared machine falls on both sides of a pair instead of on one engine.
-- Writes <results>/step_dense.json and <results>/step_dense.md and prints the table. It reports; it
-- asserts nothing about speed. With --device=cuda the tide step runs on the GPU and the two CPU baselines
-- are not run.
--
--   tide run bench/step_dense.lua [--only=gpt2-small] [--steps=5] [--rounds=5] [--baseline=false]
--                                 [--device=cpu|cuda] [--batch=B] [--seq=T] [--results=DIR]
--
-- FLOPs of a step: 6 · P · N + 6 · L · d · T · N, with N = B · T tokens and P the parameters outside the
-- embedding table (the lm_head matrix counts: it is a GEMM); the second term is attention's QKᵀ and AV,
-- 12 · L · d · T per token forward + backward, halved by the causal mask.
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"

local CONFIGS = {
  { name = "d256-L4", vocab_size = 50304, dim = 256, n_layers = 4, n_heads = 4, seq = 256, batch = 4, steps = 8 },
  { name = "gpt2-small", vocab_size = 50304, dim = 768, n_layers = 12, n_heads = 12, seq = 64, batch = 4, steps = 5 },
}
-- the shape whose numbers the targets speak of
local TARGETS = { ["gpt2-small"] = { pct_of_ceiling = 75, vs_torch = 1.5 }, ["d256-L4"] = { pct_of_ceiling = 65 } }

local FLOP_FORMULA = "6*P*N + 6*L*d*T*N; N = B*T tokens per step, P = parameters outside the embedding table "
  .. "(lm_head counted), attention 12*L*d*T per token halved by the causal mask"

local bench_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "bench"

local cli = require "tide.cli"
local shell_quote, file_exists = cli.shell_quote, cli.file_exists

-- runs a command; returns the JSON object it printed on stdout (from the first line opening '{'), or
-- nil and why (with the end of its stderr)
local function run_json(cmd)
  local errpath = os.tmpname()
  local p = io.popen(cmd .. " 2>" .. shell_quote(errpath))
  local text = p and p:read("*a") or ""
  local ok, _, code = true, nil, 0
  if p then ok, _, code = p:close() end
  local ef = io.open(errpath, "r")
  local err = ef and ef:read("*a") or ""
  if ef then ef:close() end
  os.remove(errpath)
  if not p or not ok or (code and code ~= 0) then
    return nil, string.format("'%s' failed (exit %s): %s", cmd, tostring(code), err:sub(-800))
  end
  local start = text:sub(1, 1) == "{" and 1 or text:find("\n{")
  if not start then return nil, string.format("'%s' printed no JSON: %s %s", cmd, text:sub(-400), err:sub(-400)) end
  local okd, obj = pcall(json.decode, text:sub(start))
  if not okd then return nil, string.format("'%s' printed bad JSON (%s)", cmd, tostring(obj)) end
  return obj
end

local function loadavg()
  local f = io.open("/proc/loadavg", "r")
  if not f then return nil end
  local s = f:read("*l")
  f:close()
  return tonumber(s:match("^(%S+)"))
end

-- the deterministic ids torch_dense.py uses as well: (i · mult) mod V for i = 1..n
local function token_ids(n, mult, vocab, B, T)
  local t = {}
  for i = 1, n do t[i] = (i * mult) % vocab end
  return tide.tensor(t, { dtype = "i64" }):reshape(B, T)
end

local function mean(xs)
  local s = 0
  for _, x in ipairs(xs) do s = s + x end
  return s / #xs
end

local median = results.median

local function step_flops(c, n_nonembed)
  local N = c.batch * c.seq
  return 6 * n_nonembed * N + 6 * c.n_layers * c.dim * c.seq * N
end

local sync = results.sync

-- the tide side of a config: the model, its optimiser and the batch, `warmup` untimed steps run; returns an object
-- whose :steps(n) times n more training steps (their median, the phases kept) and :finish() the tide record
local function tide_engine(c, warmup, device)
  tide.manual_seed(1)
  local model = tide.nn.TransformerLM({ vocab_size = c.vocab_size, dim = c.dim, n_layers = c.n_layers,
    n_heads = c.n_heads, max_seq_len = c.seq, device = device })
  local opt = tide.optim.AdamW(model, { lr = 1e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
  local N = c.batch * c.seq
  local ids = token_ids(N, 7919, c.vocab_size, c.batch, c.seq)
  local targets = token_ids(N, 104729, c.vocab_size, c.batch, c.seq)
  if device ~= "cpu" then ids, targets = ids:to(device), targets:to(device) end
  local r = { step_s = {}, forward_s = {}, backward_s = {}, optimizer_s = {}, losses = {}, round_s = {} }
  local done = 0
  local function one(timed)
    sync(device)
    local t0 = tide.time()
    local loss = model:loss(ids, targets)
    sync(device)
    local t1 = tide.time()
    loss:backward()
    sync(device)
    local t2 = tide.time()
    opt:step()
    opt:zero_grad()
    sync(device)
    local t3 = tide.time()
    done = done + 1
    r.losses[done] = loss:item()
    if timed then
      r.step_s[#r.step_s + 1] = t3 - t0
      r.forward_s[#r.forward_s + 1] = t1 - t0
      r.backward_s[#r.backward_s + 1] = t2 - t1
      r.optimizer_s[#r.optimizer_s + 1] = t3 - t2
    end
    io.stderr:write(string.format("  tide %s step %d: %.3f s (fwd %.3f, bwd %.3f, opt %.3f), loss %.4f\n",
      c.name, done, t3 - t0, t1 - t0, t2 - t1, t3 - t2, r.losses[done]))
    return t3 - t0
  end
  for _ = 1, warmup do one(false) end
  local e = {}
  function e.steps(n)
    local ts = {}
    for i = 1, n do ts[i] = one(true) end
    local m = median(ts)
    r.round_s[#r.round_s + 1] = m
    return m
  end
  function e.finish()
    r.params = model:num_parameters()
    r.params_embedding = model.model.embed_tokens.weight:numel()
    r.ffn_dim = model.cfg.ffn_dim
    r.step_s_mean, r.step_s_median = mean(r.step_s), median(r.round_s)
    r.tok_per_s = N / r.step_s_median
    r.forward_s_median, r.backward_s_median = median(r.forward_s), median(r.backward_s)
    r.optimizer_s_median = median(r.optimizer_s)
    r.memory_peak = tide.memory(device).peak
    model, opt = nil, nil
    tide.collect()
    return r
  end
  e.ffn_dim = model.cfg.ffn_dim
  return e
end

local function ceiling_exe(cfg)
  if cfg.ceiling_exe ~= "" then return cfg.ceiling_exe end
  local exe = tide.cli.exe_path()
  local dir = exe and exe:match("^(.*)/[^/]*$")
  return (dir or ".") .. "/bench-sgemm-ceiling"
end

local function fmt_num(x, f) return x and string.format(f, x) or "-" end

-- "met (61.2%)", "missed (0.84x)", "not measured"
local function verdict(met, value, f)
  if value == nil then return "not measured" end
  return (met and "met" or "missed") .. " (" .. string.format(f, value) .. ")"
end

local function markdown(rec)
  local L = {}
  L[#L + 1] = "# step_dense: one dense training step (forward, backward, AdamW, zero_grad)"
  L[#L + 1] = ""
  if rec.device == "cpu" then
    L[#L + 1] = string.format("tide %s, %d threads, %s; PyTorch: %s (same thread count; each build with libgomp's "
      .. "default waiting and with OMP_WAIT_POLICY=PASSIVE, the fastest quoted). Load average %s at start, %s at the end.", rec.tide_version,
      rec.threads, rec.blas, rec.torch_version or "not run", fmt_num(rec.loadavg_start, "%.2f"),
      fmt_num(rec.loadavg_end, "%.2f"))
    L[#L + 1] = ""
    L[#L + 1] = string.format("Method: %d interleaved rounds per config, each after a wait for an idle machine (cores "
      .. "at most %.0f%% busy over 1 s; measured busy %s, host steal %s, median over the rounds), %d timed steps per "
      .. "engine per round, the order rotating; an engine's figure is the median over rounds of its per-round median "
      .. "step; tide / torch is the median (min-max) of the per-round ratios.", rec.rounds, 100 * rec.max_busy,
      fmt_num(rec.idle_busy and 100 * rec.idle_busy, "%.1f%%"), fmt_num(rec.idle_steal and 100 * rec.idle_steal, "%.1f%%"),
      rec.steps_per_round or 0)
  else
    L[#L + 1] = string.format("tide %s on %s (%s); the sgemm ceiling and the PyTorch baseline are CPU measurements and "
      .. "were not run.", rec.tide_version, rec.device, rec.device_info)
  end
  L[#L + 1] = ""
  L[#L + 1] = "- tok/s: B x T over the median step (after " .. rec.warmup .. " warmup steps), for both engines."
  L[#L + 1] = "- FLOPs per step: " .. rec.flop_formula .. "."
  L[#L + 1] = "- sgemm ceiling: the best f32 GEMM rate through tide_matmul over the model's GEMM shapes (forward, "
    .. "input and weight gradient of each Linear; best of " .. rec.ceiling_reps .. "). GEMM mix: a step's GEMM FLOPs "
    .. "over the sum of their best standalone times."
  L[#L + 1] = ""
  L[#L + 1] = "| config | tide tok/s | tide GFLOP/s | sgemm ceiling GFLOP/s | % of ceiling | GEMM mix GFLOP/s | % of mix "
    .. "| torch tok/s (setting) | tide / torch |"
  L[#L + 1] = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  for _, r in ipairs(rec.configs) do
    L[#L + 1] = string.format("| %s | %.1f | %.1f | %s | %s | %s | %s | %s | %s |", r.name, r.tide.tok_per_s,
      r.tide_gflops, fmt_num(r.ceiling_gflops, "%.1f"), fmt_num(r.pct_of_ceiling, "%.1f"),
      fmt_num(r.step_gemm_gflops, "%.1f"), fmt_num(r.pct_of_gemm_mix, "%.1f"),
      r.torch and string.format("%.1f (%s)", r.torch.tok_per_s, r.torch_best) or "-",
      r.torch and results.ratio_str(r.tide_over_torch_paired) or "-")
  end
  local any = false
  for _, r in ipairs(rec.configs) do any = any or r.torch_settings ~= nil end
  if any then
    L[#L + 1] = ""
    L[#L + 1] = "| config | PyTorch build and setting | torch tok/s | torch step s per round | tide / torch per round |"
    L[#L + 1] = "|---|---|---:|---|---|"
    for _, r in ipairs(rec.configs) do
      for _, t in ipairs(r.torch_settings or {}) do
        local per = {}
        for i, x in ipairs(t.round_s) do per[i] = string.format("%.3f", x) end
        local rat = {}
        for i, x in ipairs(t.paired.ratios) do rat[i] = string.format("%.2f", x) end
        L[#L + 1] = string.format("| %s | %s | %.1f | %s | %s |", r.name, t.setting, t.tok_per_s,
          table.concat(per, ", "), table.concat(rat, ", "))
      end
    end
  end
  L[#L + 1] = ""
  L[#L + 1] = "| config | V | d | L | H | ffn | B x T | params (embedding) | GFLOP/step | tide step s: fwd / bwd / opt "
    .. "| torch step s |"
  L[#L + 1] = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
  for _, r in ipairs(rec.configs) do
    local t = r.tide
    L[#L + 1] = string.format("| %s | %d | %d | %d | %d | %d | %d x %d | %d (%d) | %.1f | %.3f: %.3f / %.3f / %.3f | %s |",
      r.name, r.vocab_size, r.dim, r.n_layers, r.n_heads, t.ffn_dim, r.batch, r.seq, t.params, t.params_embedding,
      r.flops_per_step / 1e9, t.step_s_median, t.forward_s_median, t.backward_s_median, t.optimizer_s_median,
      fmt_num(r.torch and r.torch.step_s_median, "%.3f"))
  end
  for _, t in ipairs(rec.targets or {}) do
    L[#L + 1] = ""
    L[#L + 1] = string.format("Targets at %s: >= %d%% of the sgemm ceiling: %s%s.", t.config, t.pct_of_ceiling,
      verdict(t.ceiling_met, t.pct_measured, "%.1f%%"), t.vs_torch and string.format("; >= %.1fx PyTorch tok/s at its "
      .. "fastest setting (the median paired ratio): %s", t.vs_torch, verdict(t.torch_met, t.ratio_measured, "%.2fx")) or "")
  end
  return table.concat(L, "\n") .. "\n"
end

local function run(cfg)
  local record = {
    benchmark = "step_dense", date = os.date("!%Y-%m-%dT%H:%M:%SZ"), tide_version = tide.version,
    threads = tide.num_threads(), blas = ffi.string(tide.C.tide_blas_info()), loadavg_start = loadavg(),
    flop_formula = FLOP_FORMULA, ceiling_reps = cfg.ceiling_reps, warmup = cfg.warmup,
    omp_wait_policy = os.getenv("OMP_WAIT_POLICY") or "", configs = {}, device = cfg.device,
    rounds = cfg.rounds, max_busy = cfg.max_busy,
  }
  local busy, steal = {}, {}
  tide.device(cfg.device, "step_dense --device")
  local on_cpu = cfg.device == "cpu"
  if not on_cpu then record.device_info = ffi.string(tide.C.tide_cuda_info()) end
  -- every PyTorch build of --python (a comma-separated list) under both OpenMP settings (tide.results.torch_engines)
  local engines = {}
  if cfg.baseline and on_cpu then
    local builds, skipped
    engines, builds, skipped = results.torch_engines(cfg.python)
    for _, sk in ipairs(skipped) do
      io.stderr:write("step_dense: " .. sk.python .. " cannot import torch (" .. sk.why .. "): left out\n")
    end
    local vs = {}
    for i, b in ipairs(builds) do vs[i] = "pytorch " .. b.version end
    if #vs > 0 then record.torch_version, record.torch_builds = table.concat(vs, ", "), builds
    else io.stderr:write("step_dense: no interpreter of --python imports torch; the PyTorch column stays empty\n") end
    record.torch_skipped = skipped
  end
  local cexe = ceiling_exe(cfg)
  local have_ceiling = on_cpu and file_exists(cexe)
  if on_cpu and not have_ceiling then
    io.stderr:write("step_dense: no sgemm ceiling executable at " .. cexe .. " (build bench-sgemm-ceiling, or set --ceiling_exe)\n")
  end

  for _, c0 in ipairs(CONFIGS) do
    if cfg.only == "" or cfg.only == c0.name then
      local c = {}
      for k, v in pairs(c0) do c[k] = v end
      if cfg.batch > 0 then c.batch = cfg.batch end
      if cfg.seq > 0 then c.seq = cfg.seq end
      local steps = cfg.steps > 0 and cfg.steps or c.steps
      io.stderr:write(string.format("step_dense: %s (V=%d, d=%d, L=%d, H=%d, B=%d, T=%d), %d warmup + %d timed steps\n",
        c.name, c.vocab_size, c.dim, c.n_layers, c.n_heads, c.batch, c.seq, cfg.warmup, steps))
      local r = { name = c.name, vocab_size = c.vocab_size, dim = c.dim, n_layers = c.n_layers, n_heads = c.n_heads,
        seq = c.seq, batch = c.batch }
      local eng = tide_engine(c, cfg.warmup, cfg.device)
      record.steps_per_round = steps
      local runners = { { "tide", function() return eng.steps(steps) end } }
      local servers = {}
      for ei, st in ipairs(engines) do
        local cmd = string.format("%s %s %s --vocab %d --dim %d --layers %d --heads %d --ffn %d --seq %d --batch %d "
          .. "--warmup %d --steps 1 --threads %d --serve {fifo}", st.env, shell_quote(st.python),
          shell_quote(bench_dir .. "/torch_dense.py"), c.vocab_size, c.dim, c.n_layers, c.n_heads, eng.ffn_dim,
          c.seq, c.batch, cfg.warmup, tide.num_threads())
        local ok, sv = pcall(results.server, cmd, os.getenv("TMPDIR") or "/tmp", "torch_dense_" .. ei)
        if ok then
          local okq, info = pcall(sv.ask, sv, { cmd = "info" })
          if okq then
            servers[#servers + 1] = { setting = st.label, sv = sv, info = info, steps = {} }
            local entry = servers[#servers]
            runners[#runners + 1] = { "torch " .. st.label, function()
              local a = sv:ask({ cmd = "steps", n = steps })
              for _, x in ipairs(a.step_s) do entry.steps[#entry.steps + 1] = x end
              entry.losses = a.losses
              return median(a.step_s)
            end }
          else
            io.stderr:write("step_dense: PyTorch baseline (" .. st.label .. "): " .. tostring(info) .. "\n")
            sv:close()
          end
        else
          io.stderr:write("step_dense: PyTorch baseline (" .. st.label .. "): " .. tostring(sv) .. "\n")
        end
      end
      io.stderr:write(string.format("step_dense: %s: %d rounds of %d steps per engine (%d engines)\n", c.name,
        cfg.rounds, steps, #runners))
      local got = results.interleave(cfg.rounds, runners, { max_busy = cfg.max_busy, timeout = cfg.idle_timeout })
      for _, w in ipairs(got.idle) do busy[#busy + 1] = w.busy; steal[#steal + 1] = w.steal end
      r.tide = eng.finish()
      r.order = got.order
      r.flops_per_step = step_flops(c, r.tide.params - r.tide.params_embedding)
      r.tide_gflops = r.flops_per_step / r.tide.step_s_median / 1e9
      if have_ceiling then
        results.wait_idle({ max_busy = cfg.max_busy, timeout = cfg.idle_timeout })
        local cmd = string.format("%s --tokens %d --dim %d --ffn %d --vocab %d --layers %d --reps %d --label %s",
          shell_quote(cexe), c.batch * c.seq, c.dim, r.tide.ffn_dim, c.vocab_size, c.n_layers, cfg.ceiling_reps, c.name)
        local ceil, why = run_json(cmd)
        if ceil then
          r.ceiling = ceil
          r.ceiling_gflops, r.step_gemm_gflops = ceil.ceiling_gflops, ceil.step_gemm_gflops
          r.pct_of_ceiling = 100 * r.tide_gflops / ceil.ceiling_gflops
          r.pct_of_gemm_mix = 100 * r.tide_gflops / ceil.step_gemm_gflops
        else
          io.stderr:write("step_dense: sgemm ceiling: " .. why .. "\n")
        end
      end
      -- every PyTorch setting recorded; the fastest (lowest median step over the rounds) quoted
      local N = c.batch * c.seq
      for _, e in ipairs(servers) do
        local vals = got.values["torch " .. e.setting]
        local t = { setting = e.setting, framework = e.info.framework, threads = e.info.threads,
          omp_wait_policy = e.info.omp_wait_policy, params = e.info.params, round_s = vals, step_s = e.steps,
          step_s_median = median(vals), losses = e.losses }
        t.tok_per_s = N / t.step_s_median
        t.paired = results.paired(vals, got.values.tide)
        r.torch_settings = r.torch_settings or {}
        r.torch_settings[#r.torch_settings + 1] = t
        if not r.torch or t.step_s_median < r.torch.step_s_median then r.torch, r.torch_best = t, e.setting end
        if t.params ~= r.tide.params then
          r.params_mismatch = string.format("tide %d parameters, torch %d", r.tide.params, t.params)
          io.stderr:write("step_dense: " .. c.name .. ": the models differ: " .. r.params_mismatch .. "\n")
        end
        e.sv:close()
      end
      if r.torch then
        r.tide_over_torch_paired = r.torch.paired
        r.tide_over_torch = r.torch.paired.median
        r.torch_gflops = r.flops_per_step / r.torch.step_s_median / 1e9
      end
      record.configs[#record.configs + 1] = r
      local T = TARGETS[c.name]
      if T then
        record.targets = record.targets or {}
        record.targets[#record.targets + 1] = {
          config = c.name, pct_of_ceiling = T.pct_of_ceiling, vs_torch = T.vs_torch,
          pct_measured = r.pct_of_ceiling, ratio_measured = r.tide_over_torch,
          ceiling_met = r.pct_of_ceiling and r.pct_of_ceiling >= T.pct_of_ceiling,
          torch_met = T.vs_torch and r.tide_over_torch and r.tide_over_torch >= T.vs_torch,
        }
      end
    end
  end
  if #record.configs == 0 then
    local names = {}
    for _, c in ipairs(CONFIGS) do names[#names + 1] = c.name end
    error("step_dense: --only='" .. cfg.only .. "' names no config (known: " .. table.concat(names, ", ") .. ")", 0)
  end
  record.loadavg_end = loadavg()
  if #busy > 0 then record.idle_busy, record.idle_steal = median(busy), median(steal) end

  local md = markdown(record)
  io.write(md)
  results.write(cfg.results, "step_dense", record, md, { "benchmark", "date", "name", "tide", "torch", "ceiling" })
  return 0
end

return {
  only = "",                 -- a config name to run alone ("d256-L4", "gpt2-small"); "" runs both
  warmup = 2,                -- untimed steps first (allocator caches, BLAS buffers)
  steps = 0,                 -- timed steps per engine per round; 0 takes each config's own count
  rounds = 5,                -- interleaved rounds per config (tide.results.interleave)
  max_busy = 0.15,           -- a round starts once the cores are at most this busy over 1 s ...
  idle_timeout = 60,         -- ... or after this many seconds of waiting
  batch = 0, seq = 0,        -- B and T of every config; 0 keeps each config's own
  baseline = true,           -- time PyTorch on the same model when `python` imports torch
  python = "/usr/bin/python3,build/torch-pypi/bin/python",   -- the PyTorch builds (missing ones left out)
  ceiling_reps = 5,
  ceiling_exe = "",          -- "" = bench-sgemm-ceiling beside the tide executable
  device = "cpu",            -- "cuda" times the step on the GPU (without the two CPU baselines)
  results = "bench/results", -- where step_dense.json / step_dense.md go; "" writes nothing
  run = run,
}
