-- schedule.lua — learning-rate schedules (spec/optim.md §6). t = updates done, 0-based.
--
--   wsd:     linear warmup to lr over `warmup` steps, stable until `decay_start`, then decay to
--            `min_lr` by `decay_end` ("cosine" or "linear"), min_lr afterwards.
--   cosine:  linear warmup then cosine from lr to min_lr ending at `decay_end` (wsd with decay_start = warmup).
--   constant: linear warmup then lr.
-- A schedule is a pure function of t, so a resumed run follows the same curve.
local options = require "tide.options"

local schedule = {}

local KINDS = { wsd = true, cosine = true, constant = true }
local KEYS = { kind = true, warmup = true, decay_start = true, decay_end = true, min_lr = true, decay = true }
schedule.KEYS = KEYS

local function check_int(name, v, lo) options.int_at_least(v, lo, name, "schedule") end

-- new(cfg, lr, total_steps) -> function(t) -> learning rate
-- cfg: {kind=, warmup=, decay_start=, decay_end=, min_lr=, decay=}; decay_end defaults to total_steps,
-- decay_start (wsd) to 80% of decay_end, min_lr to lr / 10.
function schedule.new(cfg, lr, total_steps)
  cfg = options.check(cfg or {}, KEYS, nil, "schedule")
  local kind = cfg.kind or "wsd"
  if not KINDS[kind] then
    error("schedule: kind must be one of wsd, cosine, constant; got '" .. tostring(kind) .. "'", 2)
  end
  if type(lr) ~= "number" or not (lr > 0) then
    error("schedule: lr must be a positive number, got " .. tostring(lr), 2)
  end
  local warmup = cfg.warmup or 0
  check_int("warmup", warmup, 0)
  if kind == "constant" then
    return function(t)
      if t < warmup then return lr * (t + 1) / warmup end
      return lr
    end
  end
  local decay_end = cfg.decay_end or total_steps
  check_int("decay_end", decay_end, 1)
  local decay_start
  if kind == "cosine" then
    if cfg.decay_start and cfg.decay_start ~= warmup then
      error("schedule: kind 'cosine' decays right after warmup; use kind 'wsd' to set decay_start", 2)
    end
    decay_start = warmup
  else
    decay_start = cfg.decay_start or math.floor(0.8 * decay_end)
  end
  check_int("decay_start", decay_start, 0)
  if not (warmup <= decay_start and decay_start < decay_end) then
    error(string.format("schedule: need warmup <= decay_start < decay_end, got %d, %d, %d",
      warmup, decay_start, decay_end), 2)
  end
  local min_lr = cfg.min_lr or lr / 10
  if type(min_lr) ~= "number" or min_lr < 0 or min_lr > lr then
    error("schedule: min_lr must be in [0, lr], got " .. tostring(min_lr), 2)
  end
  local decay = cfg.decay or "cosine"
  if decay ~= "cosine" and decay ~= "linear" then
    error("schedule: decay must be 'cosine' or 'linear', got '" .. tostring(decay) .. "'", 2)
  end
  local span = decay_end - decay_start
  return function(t)
    if t < warmup then return lr * (t + 1) / warmup end
    if t < decay_start then return lr end
    if t < decay_end then
      local x = (t - decay_start) / span
      if decay == "cosine" then
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * x))
      end
      return lr - (lr - min_lr) * x
    end
    return min_lr
  end
end

return schedule
