-- tide.rl.rewards: reward shaping and credit assignment (rl.md §3, §4).
--
--   rewards.length(lens, correct)          -- K1.5 length rewards over the k samples of one prompt
--   rewards.overlong(len, L_max, L_cache)  -- DAPO overlong shaping
--   rewards.repeated(ids, n)               -- the repetition stop: a 32-token window repeated 3 times in a row
--   rewards.returns(traj, credit)          -- per-token returns of the policy tokens ("trajectory" | "turn")
local rewards = {}
local min, fmt = math.min, string.format

-- λ_i = 0.5 - (len_i - min_len)/(max_len - min_len); λ_i if correct, else min(0, λ_i); all 0 when the lengths agree
function rewards.length(lens, correct)
  local lo, hi = math.huge, -math.huge
  for _, l in ipairs(lens) do lo, hi = math.min(lo, l), math.max(hi, l) end
  local out = {}
  for i, l in ipairs(lens) do
    if hi == lo then out[i] = 0
    else
      local lam = 0.5 - (l - lo) / (hi - lo)
      out[i] = correct[i] and lam or min(0, lam)
    end
  end
  return out
end

-- 0 up to L_max - L_cache, ((L_max - L_cache) - len)/L_cache inside the zone, -1 beyond L_max
function rewards.overlong(len, L_max, L_cache)
  if L_cache <= 0 or L_cache > L_max then
    error(fmt("rl.rewards.overlong: L_cache must be in (0, L_max = %d], got %s", L_max, tostring(L_cache)), 2)
  end
  if len <= L_max - L_cache then return 0 end
  if len > L_max then return -1 end
  return ((L_max - L_cache) - len) / L_cache
end

-- true when the last window * times ids of ids[1..n] are one window repeated `times` times (defaults 32 and 3)
function rewards.repeated(ids, n, window, times)
  window, times = window or 32, times or 3
  n = n or #ids
  if n < window * times then return false end
  local base = n - window * times
  for j = 1, window do
    local v = ids[base + j]
    for r = 1, times - 1 do
      if ids[base + r * window + j] ~= v then return false end
    end
  end
  return true
end

-- the return of each policy token (loss_mask = 1) of a trajectory, in order: R = r_T + Σ_u r_u on every token
-- ("trajectory", the default), or r_T + Σ_{u' >= u} r_u' on the tokens of turn u ("turn"). traj.turn[t] is 0-based.
function rewards.returns(traj, credit)
  credit = credit or "trajectory"
  local rT, rt = traj.reward_terminal or 0, traj.rewards_turn or {}
  local out = {}
  if credit == "trajectory" then
    local R = rT
    for _, r in ipairs(rt) do R = R + r end
    for t = 1, #traj.tokens do if traj.loss_mask[t] == 1 then out[#out + 1] = R end end
    return out
  end
  if credit ~= "turn" then error(fmt("rl.rewards.returns: credit must be \"trajectory\" or \"turn\", got %s", tostring(credit)), 2) end
  local tail, n_turns = {}, #rt
  local acc = rT
  for u = n_turns, 1, -1 do acc = acc + rt[u]; tail[u - 1] = acc end
  for t = 1, #traj.tokens do
    if traj.loss_mask[t] == 1 then out[#out + 1] = tail[traj.turn[t]] or rT end
  end
  return out
end

return rewards
