-- tide.rl.objectives: the policy objectives of rl.md §4 as functions of the per-token log-probs under θ.
--
--   local loss, grad, stats = objectives.grpo(batch, logp, {eps = 0.2, beta_kl = 0.04})
--
-- batch = {groups = {{samples = {{reward = r, logp_old = {...}, logp_ref = {...}?, tis = {...}?,
--                                  returns = {...}?}, ...}}, ...}}
-- One entry per masked-in (policy-sampled) token: logp_old is the sampler's (or, with TIS, the trainer's recomputed)
-- log-prob; logp_ref the frozen reference's (needed when beta_kl > 0); tis the stop-gradient weights w_t; returns the
-- per-token returns of `credit = "turn"` (rewards.returns). `logp` is the flat list of log-probs under θ for the
-- batch's tokens in order (group by group, sample by sample). Every objective returns the loss (to minimise), its
-- gradient with respect to each logp entry (the same layout), and statistics (rl.md §7). The model's backward takes
-- that gradient (the surrogate loss Σ_t grad_t · logp_t has it), so one data path serves all three objectives.
-- GRPO and Kimi sum over the batch's groups; DAPO's token-level mean divides by batch.norm_tokens when it is set (the
-- policy tokens of the whole step when a step's groups are split over ranks), else by the batch's own count.
local options = require "tide.options"

local objectives = {}
local exp, min, max, sqrt, fmt = math.exp, math.min, math.max, math.sqrt, string.format

local function n_tokens(s) return #s.logp_old end

-- group advantages from values v (rewards, or per-token returns against the group's rewards):
-- (v - mean) / (std + 1e-6) with the population std; exactly 0 when every reward of the group is the same
local function group_stats(rewards)
  local G, lo, hi, sum = #rewards, math.huge, -math.huge, 0
  for _, r in ipairs(rewards) do lo, hi, sum = min(lo, r), max(hi, r), sum + r end
  local mean = sum / G
  local var = 0
  for _, r in ipairs(rewards) do var = var + (r - mean) ^ 2 end
  return mean, sqrt(var / G), lo == hi
end

-- GRPO advantages of one group's rewards (rl.md §4)
function objectives.advantages(rewards)
  local mean, std, flat = group_stats(rewards)
  local A = {}
  for i, r in ipairs(rewards) do A[i] = flat and 0 or (r - mean) / (std + 1e-6) end
  return A, flat
end

-- DAPO's dynamic sampling: keep a group unless all of its total rewards are equal
function objectives.keep_group(rewards)
  local _, _, flat = group_stats(rewards)
  return not flat
end

-- DAPO's resampling target (rl.md §4): the batch is drawn until it holds enough groups with 0 < #correct < G. A
-- kept group counts when its samples' verdicts (correct[i]: the environment's true / false; nil, no verdict: a
-- truncated sample, not correct) are mixed; a group of an environment that gives no verdicts at all (every entry
-- nil) has only its rewards, and counts when it is kept
function objectives.mixed_group(rewards, correct)
  local n, judged = 0, false
  for i = 1, #rewards do
    if correct[i] ~= nil then judged = true end
    if correct[i] == true then n = n + 1 end
  end
  if not judged then return objectives.keep_group(rewards) end
  return n > 0 and n < #rewards
end

-- truncated importance sampling (Kimi Linear): w_t = min(exp(logp_train - logp_rollout), C) -> list, clipped count
function objectives.tis_weights(logp_train, logp_rollout, C)
  C = C or 2
  local w, clipped = {}, 0
  for t = 1, #logp_train do
    local v = exp(logp_train[t] - logp_rollout[t])
    if v > C then v, clipped = C, clipped + 1 end
    w[t] = v
  end
  return w, clipped
end

local function rewards_of(group)
  local r = {}
  for i, s in ipairs(group.samples) do
    if type(s.reward) ~= "number" then error(fmt("rl.objectives: sample %d has no numeric reward", i), 3) end
    r[i] = s.reward
  end
  return r
end

local function check_logp(batch, logp, who)
  local n = 0
  for _, g in ipairs(batch.groups) do
    for _, s in ipairs(g.samples) do n = n + n_tokens(s) end
  end
  if #logp ~= n then
    error(fmt("rl.%s: logp has %d entries but the batch has %d masked-in tokens", who, #logp, n), 3)
  end
  return n
end

-- the clipped policy gradient of GRPO and DAPO; o = {eps_lo, eps_hi, beta, norm = "sample" | "token"}
local function clipped(batch, logp, o, who)
  local total = check_logp(batch, logp, who)
  local loss, grad, k = 0, {}, 0
  local st = { tokens = total, clipped = 0, kl = 0, ratio = 0, zero_groups = 0, groups = #batch.groups,
               tis = 0, tis_tokens = 0 }
  for _, g in ipairs(batch.groups) do
    local rewards = rewards_of(g)
    local G = #rewards
    local mean, std, flat = group_stats(rewards)
    if flat then st.zero_groups = st.zero_groups + 1 end
    for _, s in ipairs(g.samples) do
      local n = n_tokens(s)
      local denom = o.norm == "token" and (batch.norm_tokens or total) or G * n
      local A_s = flat and 0 or (s.reward - mean) / (std + 1e-6)
      for t = 1, n do
        k = k + 1
        local lp, old = logp[k], s.logp_old[t]
        local A = A_s
        if s.returns and not flat then A = (s.returns[t] - mean) / (std + 1e-6) end
        local w = s.tis and s.tis[t] or 1
        local rho = exp(lp - old)
        local c = min(max(rho, 1 - o.eps_lo), 1 + o.eps_hi)
        local active = (A >= 0 and rho <= 1 + o.eps_hi) or (A < 0 and rho >= 1 - o.eps_lo)
        local surr = min(rho * A, c * A)
        local term, dterm = surr, active and rho * A or 0
        if not active and A ~= 0 then st.clipped = st.clipped + 1 end
        if o.beta > 0 then
          local x = s.logp_ref[t] - lp
          local ex = exp(x)
          local kl = ex - x - 1
          term = term - o.beta * kl
          dterm = dterm - o.beta * (1 - ex)
          st.kl = st.kl + kl
        end
        loss = loss - w * term / denom
        grad[k] = -w * dterm / denom
        st.ratio = st.ratio + rho
        st.tis = st.tis + w
      end
    end
  end
  local N = math.max(total, 1)
  st.clip_frac, st.kl, st.ratio, st.tis_mean = st.clipped / N, st.kl / N, st.ratio / N, st.tis / N
  st.zero_group_frac = #batch.groups > 0 and st.zero_groups / #batch.groups or 0
  st.tis, st.tis_tokens = nil, nil
  return loss, grad, st
end

local GRPO_KEYS = { eps = true, beta_kl = true }
local DAPO_KEYS = { eps_lo = true, eps_hi = true }
local KIMI_KEYS = { tau = true }

-- GRPO (DeepSeekMath): per-sample means, symmetric clip ε, the k3 KL to the reference with weight beta_kl
function objectives.grpo(batch, logp, opts)
  opts = opts or {}
  options.check(opts, GRPO_KEYS, "grpo options", "rl.grpo")
  local eps = opts.eps == nil and 0.2 or options.number_in(opts.eps, 0, 1, "eps", "rl.grpo")
  local beta = opts.beta_kl == nil and 0.04 or options.finite_number(opts.beta_kl, "beta_kl", "rl.grpo", nil, 0)
  return clipped(batch, logp, { eps_lo = eps, eps_hi = eps, beta = beta, norm = "sample" }, "grpo")
end

-- DAPO: clip-higher (ε_lo, ε_hi), the token-level normaliser over the batch, no KL (dynamic sampling and overlong
-- shaping act on the batch and the rewards before this: objectives.keep_group, rewards.overlong)
function objectives.dapo(batch, logp, opts)
  opts = opts or {}
  options.check(opts, DAPO_KEYS, "dapo options", "rl.dapo")
  local lo = opts.eps_lo == nil and 0.2 or options.number_in(opts.eps_lo, 0, 1, "eps_lo", "rl.dapo")
  local hi = opts.eps_hi == nil and 0.28 or options.finite_number(opts.eps_hi, "eps_hi", "rl.dapo", nil, 0)
  return clipped(batch, logp, { eps_lo = lo, eps_hi = hi, beta = 0, norm = "token" }, "dapo")
end

-- Kimi (K1.5 online mirror descent, squared surrogate): per prompt L = (1/k) Σ_j (r_j - r̄ - τ s_j)^2 with the
-- sequence log-ratio s_j = Σ_t w_t (logp - logp_old); prompts sum
function objectives.kimi(batch, logp, opts)
  opts = opts or {}
  options.check(opts, KIMI_KEYS, "kimi options", "rl.kimi")
  local tau = opts.tau == nil and 0.1 or options.positive_number(opts.tau, "tau", "rl.kimi")
  local total = check_logp(batch, logp, "kimi")
  local loss, grad, k = 0, {}, 0
  local st = { tokens = total, zero_groups = 0, groups = #batch.groups, ratio = 0, tis_mean = 0 }
  for _, g in ipairs(batch.groups) do
    local rewards = rewards_of(g)
    local K = #rewards
    local mean, _, flat = group_stats(rewards)
    if flat then mean, st.zero_groups = rewards[1], st.zero_groups + 1 end  -- r_j - r̄ exactly 0
    for j, s in ipairs(g.samples) do
      local n, first, sj = n_tokens(s), k, 0
      for t = 1, n do
        local w = s.tis and s.tis[t] or 1
        sj = sj + w * (logp[first + t] - s.logp_old[t])
      end
      local e = rewards[j] - mean - tau * sj
      loss = loss + e * e / K
      for t = 1, n do
        k = k + 1
        local w = s.tis and s.tis[t] or 1
        grad[k] = -(2 * tau / K) * e * w
        st.ratio = st.ratio + exp(logp[k] - s.logp_old[t])
        st.tis_mean = st.tis_mean + w
      end
    end
  end
  local N = math.max(total, 1)
  st.ratio, st.tis_mean, st.clip_frac, st.kl = st.ratio / N, st.tis_mean / N, 0, 0
  st.zero_group_frac = #batch.groups > 0 and st.zero_groups / #batch.groups or 0
  return loss, grad, st
end

objectives.NAMES = { grpo = true, dapo = true, kimi = true }

function objectives.get(name)
  options.one_of(name, objectives.NAMES, "rl.objective", "rl")
  return objectives[name]
end

return objectives
