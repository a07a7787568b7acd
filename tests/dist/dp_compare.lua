-- dp_compare.lua — compares two runs of tests/dist/dp_check.sh: every tensor of the final checkpoints (the model and
-- AdamW's moments) and every step's loss (and held-out loss), bitwise, or within --rel (relative to the tensor's max |value|).
--   tide run tests/dist/dp_compare.lua --a=RUN_A --b=RUN_B [--rel=0] [--what=TEXT] [--moe=true] [--rl=true] [--losses=false]
-- (RUN_A / RUN_B: run directories, or step directories with --losses=false: the tensors alone)
local tide = require "tide"
local checkpoint = require "tide.checkpoint"
local json = require "tide.json"

local function losses(run)
  local out = {}
  local text = assert(tide.read_file(run .. "/metrics.jsonl"))
  for line in text:gmatch("[^\n]+") do
    local r = json.decode(line)
    -- a step record's loss; a non-finite one is written as null: NaN here (json.null is its decoded value); a
    -- held-out loss (the eval steps' val_loss) as step + 0.5; an RL iteration's record (phase "rl") by its step
    if r.step and (r.step_time or r.phase == "rl") then
      out[r.step] = type(r.loss) == "number" and r.loss or 0 / 0
      if type(r.val_loss) == "number" then out[r.step + 0.5] = r.val_loss end
    end
  end
  return out
end

local function run(cfg)
  local rel = tonumber(cfg.rel) or 0
  -- --wrel: the bound for the tensors (weights and AdamW moments) when it differs from the losses' --rel
  local wrel = (tonumber(cfg.wrel) or 0) > 0 and tonumber(cfg.wrel) or rel
  local what = (cfg.what and cfg.what ~= "") and cfg.what or (cfg.a .. " vs " .. cfg.b)
  local A, B = checkpoint.open(checkpoint.resolve(cfg.a)), checkpoint.open(checkpoint.resolve(cfg.b))
  if A.state.step ~= B.state.step then error(string.format("%s: steps differ (%d, %d)", what, A.state.step, B.state.step), 0) end
  local worst, n = 0, 0
  for _, file in ipairs({ "model.safetensors", "optim.safetensors" }) do
    local ta, tb = checkpoint.fuse_experts(A:tensors(file)), checkpoint.fuse_experts(B:tensors(file))   -- (per-expert tensors of an ep run fused)
    for name, x in pairs(ta) do
      local y = tb[name]
      if not y then error(string.format("%s: %s has no %s", what, cfg.b, name), 0) end
      local d = (x:to("f64") - y:to("f64")):abs():max():item()
      local m = x:to("f64"):abs():max():item()
      local r = m > 0 and d / m or d
      if r > wrel then error(string.format("%s: %s %s differs by %.3g relative (limit %g)", what, file, name, r, wrel), 0) end
      worst, n = math.max(worst, r), n + 1
    end
  end
  local no_losses = cfg.losses == false or cfg.losses == "false"
  local la, lb = no_losses and {} or losses(cfg.a), no_losses and {} or losses(cfg.b)
  local steps = 0
  for s in pairs(lb) do
    if la[s] == nil then error(string.format("%s: %s has no loss for step %s", what, cfg.a, tostring(s)), 0) end
  end
  for s, v in pairs(la) do
    local w = lb[s]
    if w == nil then error(string.format("%s: %s has no loss for step %s", what, cfg.b, tostring(s)), 0) end
    local nan_v, nan_w = v ~= v, w ~= w
    local r = (nan_v or nan_w) and ((nan_v and nan_w) and 0 or math.huge) or math.abs(v - w) / math.max(math.abs(v), 1e-30)
    if r > rel then
      error(string.format("%s: step %s %s %.17g vs %.17g", what, tostring(math.floor(s)), s % 1 == 0 and "loss" or "val_loss",
        v, w), 0)
    end
    if s % 1 == 0 then steps = steps + 1 end
  end
  if (steps == 0 and not no_losses) or n == 0 then error(what .. ": nothing compared", 0) end
  -- --moe=true: the MoE metrics of every step too (the routing batch's: the loads' metrics exactly, the routing
  -- entropy, a mean summed in another order across ranks, to 1e-12 (or --rel), the bias statistics to --rel)
  local n_moe = 0
  if cfg.moe == true or cfg.moe == "true" then
    local function recs(run)
      local out = {}
      for line in assert(tide.read_file(run .. "/metrics.jsonl")):gmatch("[^\n]+") do
        local r = json.decode(line)
        if r.step and r.step_time then out[r.step] = r end
      end
      return out
    end
    local ra, rb = recs(cfg.a), recs(cfg.b)
    for st, r in pairs(ra) do
      for key, v in pairs(r) do
        if type(key) == "string" and key:match("^moe/") and type(v) == "number" then
          local w = rb[st] and rb[st][key]
          -- (the selection bias's statistics follow the weights: --rel bounds them too, e.g. expert parallelism,
          -- whose combine adds in another order)
          local tol = key:match("route_entropy") and math.max(1e-12, rel)
            or ((key:match("^moe/b_") or key:match("aux_loss")) and rel) or 0
          if type(w) ~= "number" or math.abs(v - w) > tol * math.max(1, math.abs(v)) then
            error(string.format("%s: step %d %s: %s vs %s", what, st, key, tostring(v), tostring(w)), 0)
          end
          n_moe = n_moe + 1
        end
      end
    end
    if n_moe == 0 then error(what .. ": no MoE metrics to compare", 0) end
  end
  -- --rl=true: every RL iteration's statistics too (rewards, format rate, lengths, tool calls, the objective's
  -- token means, staleness, paused samples, the gradient norm), within --rel; both runs must have them (not the step's
  -- tokens: each rank pads its rows to its own longest)
  local n_rl = 0
  if cfg.rl == true or cfg.rl == "true" then
    local KEYS = { "reward_mean", "reward_std", "format_rate", "accuracy", "response_len", "tool_calls_per_sample",
      "truncated_rate", "zero_var_groups", "entropy", "clip_frac", "kl", "ratio", "tis_mean", "tis_clip_rate",
      "ptx_loss", "staleness", "paused", "updates", "malformed_calls", "tool_errors", "grad_norm" }
    local function recs(run)
      local out = {}
      for line in assert(tide.read_file(run .. "/metrics.jsonl")):gmatch("[^\n]+") do
        local r = json.decode(line)
        if r.phase == "rl" and r.iteration then out[r.iteration] = r end
      end
      return out
    end
    local ra, rb = recs(cfg.a), recs(cfg.b)
    for it, r in pairs(ra) do
      local q = rb[it]
      if not q then error(string.format("%s: %s has no record of iteration %d", what, cfg.b, it), 0) end
      for _, key in ipairs(KEYS) do
        local v, w = r[key], q[key]
        if (v == nil) ~= (w == nil) then
          error(string.format("%s: iteration %d %s: %s vs %s", what, it, key, tostring(v), tostring(w)), 0)
        end
        if v ~= nil then
          if math.abs(v - w) > rel * math.max(1, math.abs(v)) then
            error(string.format("%s: iteration %d %s: %.17g vs %.17g", what, it, key, v, w), 0)
          end
          n_rl = n_rl + 1
        end
      end
    end
    for it in pairs(rb) do if not ra[it] then error(string.format("%s: %s has no record of iteration %d", what, cfg.a, it), 0) end end
    if n_rl == 0 then error(what .. ": no RL statistics to compare", 0) end
  end
  print(string.format("ok   %s: %d tensors and %d step losses %s%s%s", what, n, steps,
    worst == 0 and "bitwise equal" or string.format("within %.3g relative", worst),
    n_moe > 0 and string.format("; %d MoE metrics equal", n_moe) or "",
    n_rl > 0 and string.format("; %d RL statistics equal", n_rl) or ""))
  return 0
end

return { a = "", b = "", rel = 0, wrel = 0, what = "", moe = false, rl = false, losses = true, run = run }
