-- rl updates: trajectories -> batch -> objective through the one step (rl.md oracles 2 and 3 on a model, an fp64
-- finite-difference check of a weight, TIS and the reference, the SFT batch).
local T = require "tide.testing"
local tide = require "tide"
local rl = require "tide.rl"
local rollout = require "tide.rl.rollout"
local update = require "tide.rl.update"
local step = require "tide.step"
local optim = require "tide.optim"
local tokenizer = require "tide.data.tokenizer"

local nn, F = tide.nn, tide.F
local tok = tokenizer.byte_level()
local V = tok.vocab_size

local function model(dtype)
  tide.manual_seed(11)
  return nn.HybridLM({ vocab_size = V, dim = 16, n_layers = 2, mixers = "KM", ffn_dim = 24, init_std = 0.2,
    dtype = dtype or "f64", kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 8, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 } })
end

-- two groups of countdown rollouts with rewards set by hand (a random model writes no answers)
local function trajectories(m, G)
  local trajs = rollout.run(m, tok, { env = "countdown", prompts = { { seed = 1 }, { seed = 2 } }, G = G or 3,
    max_new = 6, temperature = 1, seed = 3 })
  for i, t in ipairs(trajs) do t.reward_terminal = ({ 1, 0, 0.1, 0, 1, 0.5 })[(i - 1) % 6 + 1] end
  return trajs
end

local function grads(m)
  local out = {}
  for name, p in m:named_parameters() do out[name] = p:grad() and p:grad():tolist() or nil end
  return out
end

T.test("oracle 2: labels at loss_mask = 0 positions change neither loss nor gradients (bitwise); their logit gradient is 0", function()
  local m = model()
  local trajs = trajectories(m)
  local b = update.batch(trajs)
  T.eq(b.n_targets, (function() local n = 0 for _, t in ipairs(trajs) do n = n + t:n_policy() end return n end)())
  local obj = update.objective("grpo", { beta_kl = 0 })
  local function run(batch)
    for _, p in ipairs(m:parameters()) do p:zero_grad() end
    local l = obj(m, batch)
    l:backward()
    return l:item(), grads(m)
  end
  local l1, g1 = run(b)
  -- the same batch with every non-policy target replaced
  local tg = b.targets:tolist()
  local policy = {}
  for r, rp in ipairs(b.positions) do for _, i in ipairs(rp) do policy[(r - 1) * b.L + i] = true end end
  local changed = 0
  for k = 1, #tg do if not policy[k] and tg[k] >= 0 then tg[k] = (tg[k] + 37) % V; changed = changed + 1 end end
  T.ok(changed > 50, "labels changed: " .. changed)
  local b2 = {}
  for k, v in pairs(b) do b2[k] = v end
  b2.targets = tide.tensor(tg, { dtype = "i32" }):reshape(#b.positions, b.L)
  local l2, g2 = run(b2)
  T.eq(l2, l1, "loss bitwise")
  for name, g in pairs(g1) do T.eq(g2[name], g, name .. " bitwise") end
  -- the logit gradient: a model whose logits are a leaf
  local logits = tide.randn({ #b.positions, b.L, V }, { dtype = "f64" }):requires_grad_()
  local fake = { forward = function() return logits end, training = false, eval = function() end, train = function() end }
  obj(fake, b):backward()
  local lg = logits:grad():tolist()
  local zero_rows, nonzero = 0, 0
  for r = 1, #b.positions do
    for i = 1, b.L do
      local s = 0
      for v = 1, V do s = s + math.abs(lg[((r - 1) * b.L + (i - 1)) * V + v]) end
      if policy[(r - 1) * b.L + i] then
        if s > 0 then nonzero = nonzero + 1 end
      else
        T.eq(s, 0, "row " .. r .. " position " .. i)
        zero_rows = zero_rows + 1
      end
    end
  end
  T.ok(zero_rows > 0 and nonzero > 0, "both kinds of positions seen")
end)

T.test("oracle 3 on a model: on-policy GRPO's weight gradient = -(1/G) Σ A_i/|o_i| Σ_t ∇logp (fp64 1e-12)", function()
  local m = model()
  local trajs = trajectories(m)
  local b = update.batch(trajs)
  -- on-policy: logp_old and the reference are the model's own log-probs
  local flat = update.score(m, b)
  local k = 0
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do
      for t = 1, #s.logp_old do k = k + 1; s.logp_old[t] = flat[k] end
    end
  end
  update.set_ref(b, flat)
  for _, p in ipairs(m:parameters()) do p:zero_grad() end
  update.objective("grpo", { beta_kl = 0.04 })(m, b):backward()
  local g_obj = grads(m)
  T.eq(b.stats.kl, 0)
  -- the entropy metric (from the fused op) against -Σ p ln p of a plain log-softmax, at the policy tokens
  local lsm = tide.no_grad(function() return F.log_softmax(m:forward(b.ids), 3):tolist() end)
  local V_, sum, n = V, 0, 0
  for rr, rp in ipairs(b.positions) do
    for _, i in ipairs(rp) do
      local base = ((rr - 1) * b.L + (i - 1)) * V_
      for v = 1, V_ do local lp = lsm[base + v]; sum = sum - math.exp(lp) * lp end
      n = n + 1
    end
  end
  T.near(b.stats.entropy, sum / n, 1e-10)
  -- by hand: Σ_rows c_r Σ_t logp_t with c_r = -A_i / (G |o_i|)
  local coef = {}
  local r = 0
  for _, g in ipairs(b.groups) do
    local rw = {}
    for i, s in ipairs(g.samples) do rw[i] = s.reward end
    local A = rl.objectives.advantages(rw)
    for i, s in ipairs(g.samples) do r = r + 1; coef[r] = -A[i] / (#rw * #s.logp_old) end
  end
  for _, p in ipairs(m:parameters()) do p:zero_grad() end
  local logp = -F.cross_entropy(m:forward(b.ids), b.targets, { reduction = "none" })
  local w = {}
  for rr = 1, #b.positions do for i = 1, b.L do w[(rr - 1) * b.L + i] = 0 end end
  for rr, rp in ipairs(b.positions) do for _, i in ipairs(rp) do w[(rr - 1) * b.L + i] = coef[rr] end end
  ;(logp * tide.tensor(w, { dtype = "f64" }):reshape(#b.positions, b.L)):sum():backward()
  local g_ref = grads(m)
  local worst = 0
  for name, g in pairs(g_ref) do worst = math.max(worst, T.max_abs_diff(g_obj[name], g)) end
  T.ok(worst <= 1e-12, "max |diff| " .. worst)
end)

T.test("the objective's value and weight gradient agree with central differences (fp64, off-policy, DAPO and Kimi)", function()
  local m = model()
  local trajs = trajectories(m)
  -- off-policy: the sampler's log-probs moved a little
  for _, t in ipairs(trajs) do
    for i = 1, #t.tokens do if t.loss_mask[i] == 1 then t.logp_old[i] = t.logp_old[i] + 0.05 * math.sin(i) end end
  end
  for _, name in ipairs { "dapo", "kimi" } do
    local b = update.batch(trajs)
    local obj = update.objective(name, { entropy = false })
    for _, p in ipairs(m:parameters()) do p:zero_grad() end
    obj(m, b):backward()
    local named = {}
    for n_, p in m:named_parameters() do named[n_] = p end
    for _, pname in ipairs { "model.embed_tokens.weight", "lm_head.weight" } do
      local p = named[pname]
      local g = p:grad():tolist()
      local flat = p:tolist()
      local h, worst = 1e-6, 0
      for _, idx in ipairs { 7, 101, 333 } do
        local x = flat[idx]
        local function at(v)
          flat[idx] = v
          tide.no_grad(function() p:copy_(tide.tensor(flat, { dtype = "f64" }):reshape(p:shape())) end)
          return tide.no_grad(function() return obj(m, b):item() end)
        end
        local fd = (at(x + h) - at(x - h)) / (2 * h)
        at(x)
        worst = math.max(worst, math.abs(fd - g[idx]))
      end
      T.ok(worst <= 1e-7, string.format("%s %s: max |fd - grad| = %.3g", name, pname, worst))
    end
  end
end)

T.test("the sampler's log-probs are the trainer's (TIS weights near 1); the reference and TIS plumbing", function()
  local m = model("f32")
  local trajs = trajectories(m)
  local b = update.batch(trajs)
  local train = update.score(m, b)
  local worst, k = 0, 0
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do
      for t = 1, #s.logp_old do k = k + 1; worst = math.max(worst, math.abs(s.logp_old[t] - train[k])) end
    end
  end
  T.ok(worst < 1e-4, "incremental decode vs one forward: " .. worst)
  local rate = update.set_tis(b, train, 2)
  T.eq(rate, 0)
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do for _, w in ipairs(s.tis) do T.ok(math.abs(w - 1) < 1e-3, "w " .. w) end end
  end
end)

T.test("one GRPO update through the shared step raises the rewarded sample's log-probs and lowers the others'", function()
  local m = model("f32")
  local trajs = trajectories(m, 2)
  -- group 1: sample 1 rewarded; group 2: sample 2 rewarded
  trajs[1].reward_terminal, trajs[2].reward_terminal, trajs[3].reward_terminal, trajs[4].reward_terminal = 1, 0, 0, 1
  local b = update.batch(trajs)
  local before = update.score(m, b)
  local opt = optim.AdamW(m, { lr = 1e-3, weight_decay = 0 })
  local stepper = step.stepper({ model = m, optim = opt, objective = update.objective("grpo", { beta_kl = 0 }) })
  local rec = stepper:run({ b }, 1e-3)
  T.ok(rec.loss == rec.loss and not rec.skipped, "a finite step")
  T.ok(b.stats and b.stats.entropy > 0 and b.stats.clip_frac == 0, "statistics")
  local after = update.score(m, update.batch(trajs))
  local function mean_delta(lo, hi)
    local s = 0
    for i = lo, hi do s = s + after[i] - before[i] end
    return s / (hi - lo + 1)
  end
  local n1, n2, n3 = trajs[1]:n_policy(), trajs[2]:n_policy(), trajs[3]:n_policy()
  T.ok(mean_delta(1, n1) > 0, "rewarded sample up")
  T.ok(mean_delta(n1 + 1, n1 + n2) < 0, "unrewarded sample down")
  T.ok(mean_delta(n1 + n2 + n3 + 1, #after) > 0, "group 2's rewarded sample up")
end)

T.test("sft_batch: cross-entropy targets only at the policy tokens", function()
  local m = model("f32")
  local trajs = trajectories(m, 1)
  local b = update.sft_batch(trajs)
  local tg = b.targets:tolist()
  local n = 0
  for _, v in ipairs(tg) do if v ~= -100 then n = n + 1 end end
  local want = 0
  for _, t in ipairs(trajs) do want = want + t:n_policy() end
  T.eq({ n, b.n_targets }, { want, want })
  T.raises(function() update.batch({}) end, "rl.update.batch: no trajectories")
  T.raises(function() update.batch(trajs, { credit = "step" }) end, "credit must be one of")
end)

T.test("PTX: the objective plus λ times the SFT batch's mean cross-entropy, value and gradient", function()
  local m = model()
  local trajs = trajectories(m)
  local b = update.batch(trajs)
  local obj = update.objective("grpo", { beta_kl = 0, entropy = false })
  local base = tide.no_grad(function() return obj(m, b):item() end)
  local p = update.sft_batch({ trajs[1], trajs[2] })
  local ce = tide.no_grad(function()
    return F.cross_entropy(m:forward(p.ids), p.targets, { reduction = "sum" }):item() / p.n_targets
  end)
  p.weight = 0.3
  b.ptx = p
  local with = tide.no_grad(function() return obj(m, b):item() end)
  T.near(with, base + 0.3 * ce, 1e-12)
  T.near(b.stats.ptx_loss, ce, 1e-12)
  -- the gradient: that of the objective plus 0.3 times that of the mean cross-entropy
  for _, q in ipairs(m:parameters()) do q:zero_grad() end
  obj(m, b):backward()
  local g_with = grads(m)
  b.ptx = nil
  for _, q in ipairs(m:parameters()) do q:zero_grad() end
  obj(m, b):backward()
  local g_base = grads(m)
  for _, q in ipairs(m:parameters()) do q:zero_grad() end
  (F.cross_entropy(m:forward(p.ids), p.targets, { reduction = "sum" }) * (0.3 / p.n_targets)):backward()
  local g_ce = grads(m)
  local worst = 0
  for name, g in pairs(g_with) do
    local a, c = g_base[name], g_ce[name]
    for i = 1, #g do worst = math.max(worst, math.abs(g[i] - a[i] - c[i])) end
  end
  T.ok(worst < 1e-12, "max |diff| " .. worst)
end)

T.run()
