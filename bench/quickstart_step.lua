-- bench/quickstart_step.lua — training steps of the quickstart model (recipes/quickstart.lua: the hybrid 3 KDA : 1
-- MLA model with MoE FFNs, Quantile Balancing and Block AttnRes) at each curriculum stage's row length, on the CPU or
-- a GPU (--device=cuda): loss, backward, gradient clip, AdamW, the balancer update, over the recipe's tokens per step
-- of deterministic token ids; `warmup` untimed steps, then the median of `steps` timed ones per stage. The recipe's
-- data pipeline, evals and checkpoints are not part of it (tests/lua runs the recipe itself). Writes
-- <results>/quickstart_step.json and quickstart_step.md and prints the table. It reports; it asserts nothing, except
-- that every loss is finite.
--
--   tide run bench/quickstart_step.lua [--device=cpu|cuda] [--stages=s128,s1024] [--steps=3] [--warmup=1]
--                                      [--recompute=auto|layer|selective|none] [--results=DIR]
-- --recompute overrides the recipe's mode (default: the model's own, "auto"); the table says which mode each stage
-- ran in. OMP_WAIT_POLICY=PASSIVE in the environment turns off the tide executable's short OpenMP spin (README:
-- Threads), for comparing the two.
local ffi = require "ffi"
local tide = require "tide"
local results = require "tide.results"

local bench_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "bench"

local sync = results.sync

local median = results.median

local copy = require("tide.options").deep_copy

local function run(cfg)
  tide.device(cfg.device, "quickstart_step --device")
  local recipe = dofile(cfg.recipe)
  local mcfg = copy(recipe.model)
  mcfg.device = cfg.device
  if cfg.recompute ~= "" then mcfg.recompute = cfg.recompute end
  local want = {}
  for name in tostring(cfg.stages):gmatch("[^,%s]+") do want[name] = true end
  local record = {
    benchmark = "quickstart_step", date = os.date("!%Y-%m-%d %H:%M UTC"), device = cfg.device,
    omp_wait_policy = os.getenv("OMP_WAIT_POLICY") or "", gomp_spincount = os.getenv("GOMP_SPINCOUNT") or "",
    device_info = cfg.device == "cpu" and string.format("%d threads", tide.num_threads())
      or ffi.string(tide.C.tide_cuda_info()),
    tokens_per_step = recipe.tokens_per_step, warmup = cfg.warmup, steps = cfg.steps, rows = {},
  }
  tide.manual_seed(1)
  local model = tide.nn.build(mcfg)
  record.params = model:num_parameters()
  local o = recipe.optim
  local opt = tide.optim.AdamW(model, { lr = o.lr, betas = o.betas, eps = o.eps, weight_decay = o.weight_decay })
  local V = mcfg.vocab_size
  for _, st in ipairs(recipe.stages) do
    if cfg.stages == "" or want[st.name] then
      local T = st.seq_len
      local B = math.max(1, math.floor(recipe.tokens_per_step / T))
      local n = B * T
      local ids, tgt = {}, {}
      for i = 1, n do ids[i], tgt[i] = (i * 7919) % V, (i * 104729) % V end
      ids = tide.tensor(ids, { dtype = "i64", device = cfg.device }):reshape(B, T)
      tgt = tide.tensor(tgt, { dtype = "i64", device = cfg.device }):reshape(B, T)
      local times, losses = {}, {}
      sync(cfg.device)
      tide.reset_peak(cfg.device)
      for s = 1, cfg.warmup + cfg.steps do
        sync(cfg.device)
        local t0 = tide.time()
        local loss = model:loss(ids, tgt)
        loss:backward()
        if o.clip then tide.optim.clip_grad_norm(model:parameters(), o.clip) end
        opt:step()
        opt:zero_grad()
        model:balance_step()
        losses[s] = loss:item()   -- a read back: the step's work is done
        local t1 = tide.time()
        if s > cfg.warmup then times[#times + 1] = t1 - t0 end
        if losses[s] ~= losses[s] or math.abs(losses[s]) == math.huge then
          error(string.format("quickstart_step: stage %s step %d: loss %s is not finite", st.name, s, tostring(losses[s])), 0)
        end
        io.stderr:write(string.format("  %s (B %d x T %d) step %d/%d: %.3f s, loss %.4f\n", st.name, B, T, s,
          cfg.warmup + cfg.steps, t1 - t0, losses[s]))
      end
      local sec = median(times)
      record.rows[#record.rows + 1] = { stage = st.name, batch = B, seq = T, recompute = (model:recompute_for(B, T)),
        step_s = sec, tok_per_s = n / sec,
        losses = losses, memory_peak = tide.memory(cfg.device).peak }
      ids, tgt = nil, nil
      collectgarbage()
    end
  end
  if #record.rows == 0 then error("quickstart_step: --stages='" .. cfg.stages .. "' names no stage of the recipe", 0) end
  local L = {
    "# bench/quickstart_step — training steps of the quickstart model", "",
    string.format("%s on %s (%s). %d parameters; %d tokens per step; loss, backward, clip, AdamW, balancer update; "
      .. "median of %d timed steps after %d untimed.", record.date, record.device, record.device_info, record.params,
      record.tokens_per_step, cfg.steps, cfg.warmup), "",
    "| stage | B x T | recompute | step s | tok/s | peak MB | first / last loss |",
    "|---|---:|---|---:|---:|---:|---|",
  }
  for _, r in ipairs(record.rows) do
    L[#L + 1] = string.format("| %s | %d x %d | %s | %.4f | %.0f | %.1f | %.4f / %.4f |", r.stage, r.batch, r.seq, r.recompute, r.step_s,
      r.tok_per_s, r.memory_peak / 2 ^ 20, r.losses[1], r.losses[#r.losses])
  end
  L[#L + 1] = ""
  local md = table.concat(L, "\n")
  io.write(md)
  results.write(cfg.results, "quickstart_step", record, md)
  return 0
end

return {
  recipe = bench_dir .. "/../recipes/quickstart.lua",
  device = "cpu",             -- "cuda" runs the model on the GPU
  stages = "",                -- stage names to run, comma-separated; "" runs every stage
  warmup = 1,
  steps = 3,
  recompute = "",             -- "" keeps the recipe's mode; "auto", "layer", "selective" or "none" overrides it
  results = "bench/results",  -- where quickstart_step.json / .md go; "" writes nothing
  run = run,
}
