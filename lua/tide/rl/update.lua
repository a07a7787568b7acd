-- tide.rl.update: trajectories -> a training batch, and the policy objective as the shared step's objective hook.
--
--   local b = update.batch(trajs, {credit = "trajectory"})    -- ids/targets [B, L], the objective's groups
--   update.score(model, b)                                      -- logp of every policy token under a model (no grad)
--   local stepper = step.stepper{model, optim, objective = update.objective("grpo", {eps = 0.2})}
--   stepper:run({b}, lr)                                        -- one policy update through the one step
--
-- Row r of the batch is trajectory r: ids = tokens[1 .. n-1], targets = tokens[2 .. n], padded to the longest row
-- (targets -100 there). The policy tokens are the targets whose loss_mask is 1. The log-prob of each comes from
-- F.token_logprobs (log-softmax + gather + entropy fused, with its backward); the objective's
-- gradient with respect to those log-probs (rl.objectives) reaches the model through that op alone, so the logit
-- gradient of every other position is exactly 0 (rl.md oracle 2). sft_batch builds the same rows with the targets of
-- the non-policy tokens ignored: the warm-up's cross-entropy on assistant turns only.
local tide = require "tide"
local options = require "tide.options"
local objectives = require "tide.rl.objectives"
local rewards = require "tide.rl.rewards"

local F = tide.F
local update = {}
local fmt = string.format
local IGNORE = -100

-- rows(trajs) -> ids, targets (Lua [B][L] lists), L, and per row the 1-based positions of its policy targets;
-- keep(t, i) (optional) drops policy token i of t (staleness masking)
local function rows(trajs, who, sft, keep)
  if type(trajs) ~= "table" or #trajs == 0 then error(fmt("rl.%s: no trajectories", who), 3) end
  local L = 1
  for _, t in ipairs(trajs) do L = math.max(L, #t.tokens - 1) end
  local ids, targets, pos = {}, {}, {}
  for r, t in ipairs(trajs) do
    local n = #t.tokens
    if n < 2 then error(fmt("rl.%s: trajectory %d has %d token(s); a row needs at least 2", who, r, n), 3) end
    local ri, rt, rp = {}, {}, {}
    for i = 1, L do
      if i < n then
        ri[i] = t.tokens[i]
        local policy = t.loss_mask[i + 1] == 1 and (keep == nil or keep(t, i + 1))
        rt[i] = (policy or not sft) and t.tokens[i + 1] or IGNORE
        if policy then rp[#rp + 1] = i end
      else
        ri[i], rt[i] = 0, IGNORE
      end
    end
    ids[r], targets[r], pos[r] = ri, rt, rp
  end
  return ids, targets, L, pos
end

local BATCH_KEYS = { credit = true, stale = true, max_staleness = true, version = true }

-- batch(trajs, {credit = "trajectory" | "turn", stale = "include" | "mask", max_staleness = 4, version = current})
--   -> {ids, targets, n_targets, positions, groups, trajs, staleness}
-- stale = "mask" leaves out the tokens sampled by weights older than version - max_staleness (partial rollouts);
-- staleness is the mean of version - policy_version over the policy tokens kept.
-- Trajectories group by group_id (in order of first appearance); a group's samples keep the list's order, which is
-- also the order of the objective's flat log-prob list.
function update.batch(trajs, opts)
  opts = opts or {}
  options.check(opts, BATCH_KEYS, "batch options", "rl.update")
  local credit = opts.credit or "trajectory"
  options.one_of(credit, { trajectory = true, turn = true }, "credit", "rl.update")
  -- order rows group by group so the flat layout is the objective's
  local order, by_group, ordered = {}, {}, {}
  for _, t in ipairs(trajs) do
    local g = t.group_id
    if not by_group[g] then by_group[g] = {}; order[#order + 1] = g end
    by_group[g][#by_group[g] + 1] = t
  end
  for _, g in ipairs(order) do for _, t in ipairs(by_group[g]) do ordered[#ordered + 1] = t end end
  local stale = opts.stale or "include"
  options.one_of(stale, { include = true, mask = true }, "stale", "rl.update")
  local version = opts.version or 0
  local max_stale = opts.max_staleness == nil and 4 or options.nonneg_int(opts.max_staleness, "max_staleness", "rl.update")
  local keep = stale == "mask" and function(t, i) return t.policy_version[i] >= version - max_stale end or nil
  local ids, targets, L, pos = rows(ordered, "update.batch", false, keep)
  local groups, r, total, age = {}, 0, 0, 0
  for _, g in ipairs(order) do
    local samples = {}
    for _, t in ipairs(by_group[g]) do
      r = r + 1
      local old = {}
      for k, i in ipairs(pos[r]) do old[k] = t.logp_old[i + 1]; age = age + (version - t.policy_version[i + 1]) end
      local s = { reward = t:total_reward(), logp_old = old }
      if credit == "turn" then
        -- the return of each policy token, at the positions kept
        local all, at, j = rewards.returns(t, "turn"), {}, 0
        for i = 1, #t.tokens do if t.loss_mask[i] == 1 then j = j + 1; at[i] = all[j] end end
        s.returns = {}
        for k, i in ipairs(pos[r]) do s.returns[k] = at[i + 1] end
      end
      if t.logp_ref then
        s.logp_ref = {}
        for k, i in ipairs(pos[r]) do s.logp_ref[k] = t.logp_ref[i + 1] end
      end
      samples[#samples + 1] = s
      total = total + #old
    end
    groups[#groups + 1] = { samples = samples }
  end
  return { ids = tide.tensor(ids, { dtype = "i32" }), targets = tide.tensor(targets, { dtype = "i32" }), L = L,
    positions = pos, groups = groups, trajs = ordered, n_targets = total, staleness = total > 0 and age / total or 0 }
end

-- sft_batch(trajs) -> {ids, targets}: cross-entropy on the policy tokens only (the other targets are ignored)
function update.sft_batch(trajs)
  local ids, targets = rows(trajs, "update.sft_batch", true)
  local n = 0
  for _, row in ipairs(targets) do for _, v in ipairs(row) do if v ~= IGNORE then n = n + 1 end end end
  return { ids = tide.tensor(ids, { dtype = "i32" }), targets = tide.tensor(targets, { dtype = "i32" }), n_targets = n }
end

-- the per-token log-probs [B, L] of the targets (0 at ignored ones), the flat list of the policy tokens' values, and
-- the policy's entropy at each position [B, L]: one fused op (F.token_logprobs), no [B, L, V] probabilities kept
local function policy_logp(model, b)
  local logits = model:forward(b.ids)
  local logp, ent = F.token_logprobs(logits, b.targets)
  local all = logp:tolist()
  local flat, L = {}, b.L
  for r, rp in ipairs(b.positions) do
    for _, i in ipairs(rp) do flat[#flat + 1] = all[(r - 1) * L + i] end
  end
  return logp, flat, ent
end

-- score(model, b) -> the flat list of the policy tokens' log-probs under `model` (eval mode, no grad: MoE balancers
-- and their statistics stay untouched)
function update.score(model, b)
  local was = model.training
  model:eval()
  local flat = tide.no_grad(function() return select(2, policy_logp(model, b)) end)
  model:train(was)
  return flat
end

-- set each sample's logp_ref from a flat list (a frozen reference model's score)
function update.set_ref(b, flat)
  local k = 0
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do
      s.logp_ref = {}
      for t = 1, #s.logp_old do k = k + 1; s.logp_ref[t] = flat[k] end
    end
  end
end

-- truncated importance sampling (Kimi Linear): logp_train (the trainer's recomputation under θ_old) against the
-- sampler's logp_old: w_t = min(exp(train - rollout), C) on each sample, then logp_old := logp_train
function update.set_tis(b, flat_train, C)
  local k, clipped, n = 0, 0, 0
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do
      local train = {}
      for t = 1, #s.logp_old do k = k + 1; train[t] = flat_train[k] end
      local w, c = objectives.tis_weights(train, s.logp_old, C)
      s.tis, s.logp_old = w, train
      clipped, n = clipped + c, n + #w
    end
  end
  return n > 0 and clipped / n or 0
end

-- the entropy -Σ p ln p of the policy at the policy tokens, averaged (a metric)
local function entropy(ent, b)
  local h = ent:tolist()
  local sum, n = 0, 0
  for r, rp in ipairs(b.positions) do
    for _, i in ipairs(rp) do sum, n = sum + h[(r - 1) * b.L + i], n + 1 end
  end
  return n > 0 and sum / n or 0
end

-- objective(name, opts) -> function(model, b) -> loss tensor for step.stepper: its value is the objective's loss,
-- its gradient the objective's. The statistics of the last call are in b.stats.
function update.objective(name, opts)
  local f = objectives.get(name)
  local with_entropy = not (opts and opts.entropy == false)
  local o = {}
  for k, v in pairs(opts or {}) do if k ~= "entropy" then o[k] = v end end
  return function(model, b, _, ctx)
    local logp, flat, ent = policy_logp(model, b)
    -- a step whose groups are split over micro-batches or ranks (ctx: the shared step's): the objective is the one
    -- of the whole step's batch. GRPO and Kimi sum over groups, so each part's sum counts whole; DAPO's token mean
    -- divides by the step's policy tokens. The step divides each part by ctx.micro: the part is scaled back by it.
    local micro = ctx and ctx.micro or 1
    if micro > 1 then b.norm_tokens = ctx.targets end
    local loss, grad, st = f(b, flat, o)
    if micro > 1 then
      loss = loss * micro
      for i = 1, #grad do grad[i] = grad[i] * micro end
    end
    local g = {}
    local B, L = #b.positions, b.L
    for i = 1, B * L do g[i] = 0 end
    local k = 0
    for r, rp in ipairs(b.positions) do
      for _, i in ipairs(rp) do k = k + 1; g[(r - 1) * L + i] = grad[k] end
    end
    local gt = tide.tensor(g, { dtype = logp:dtype() }):reshape(B, L)
    local surrogate = (logp * gt):sum()
    if with_entropy then st.entropy = entropy(ent, b) end
    b.stats = st
    -- the surrogate carries the gradient; the constant makes its value the objective's loss
    local l = surrogate + (loss - surrogate:item())
    -- the PTX term (K2): + λ · cross-entropy of an SFT batch (mean over its targets: p.n_targets, the whole PTX
    -- batch's count when its rows are split over ranks)
    if b.ptx then
      local p = b.ptx
      local ce = F.cross_entropy(model:forward(p.ids), p.targets, { reduction = "sum" }) * (p.weight / math.max(p.n_targets, 1))
      st.ptx_loss = ce:item() / p.weight
      l = l + (micro > 1 and ce * micro or ce)
    end
    return l
  end
end

return update
