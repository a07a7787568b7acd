-- rl: the environments, verifiers, objectives, rewards, trajectory records and markup of rl.md (oracles 1, 3-8).
local T = require "tide.testing"
local rl = require "tide.rl"
local tokenizer = require "tide.data.tokenizer"

local countdown, kv, grid = rl.envs.countdown, rl.envs.kv_search, rl.envs.grid
local obj, rewards = rl.objectives, rl.rewards

---------------------------------------------------------------------------------------------------
-- countdown (oracle 6)

T.test("countdown verifier: the table of rl.md oracle 6", function()
  local task = { nums = { 3, 5, 7 }, target = 22 }
  local function s(text) return (countdown.score(task, text)) end
  T.eq(s("<answer>3*5+7</answer>"), 1.0)
  T.eq(s("<answer>3*7+5</answer>"), 0.1)              -- 26
  T.eq(s("<answer>3*5+7+7</answer>"), 0.1)            -- 7 reused
  T.eq(s("<answer>(3+5)/0+7</answer>"), 0.1)          -- 0 is not a number of the task (and divides by zero)
  T.eq(s("3*5+7"), 0)                                  -- no tag
  -- the grammar's corners
  T.eq(s("think <answer>1</answer> then <answer> 7 + 3 * 5 </answer>"), 1.0)   -- the last tag, spaces
  T.eq(s("<answer>3*5+7"), 0)                          -- an unclosed tag is no tag
  T.eq(s("<Answer>3*5+7</Answer>"), 0)                 -- case-sensitive
  T.eq(s("<answer>3*5+<answer>7</answer></answer>"), 0.1)   -- nested: fails to parse
  T.eq(s("<answer>03*5+7</answer>"), 1.0)              -- leading zeros allowed
  T.eq(s("<answer>3 5+7</answer>"), 0.1)               -- "3 5" is two literals
  T.eq(s("<answer>-3+5*7</answer>"), 0.1)              -- no unary minus
  T.eq(s("<answer>(7*(5-3)+3)+5</answer>"), 0.1)       -- 5 twice
  T.eq(s("<answer>(3*5)+7</answer>"), 1.0)
  T.eq(s("<answer>7/(5-3)*3+...</answer>"), 0.1)
  -- division by zero inside a valid multiset
  T.eq(countdown.score({ nums = { 2, 2, 1 }, target = 5 }, "<answer>1/(2-2)</answer>"), 0.1)
  -- exact rationals: 7/3*3 = 7 exactly
  T.eq(countdown.score({ nums = { 7, 3, 3 }, target = 7 }, "<answer>7/3*3</answer>"), 1.0)
end)

T.test("calc: exact values as integers or reduced fractions, errors as text", function()
  T.eq(countdown.eval("3*5+7"), "22")
  T.eq(countdown.eval("7/3"), "7/3")
  T.eq(countdown.eval("6/4"), "3/2")
  T.eq(countdown.eval("1-5"), "-4")
  T.eq(countdown.eval("(2-6)/(1-3)"), "2")
  T.eq(countdown.eval("(1-3)/6"), "-1/3")
  T.eq(countdown.eval("1/0"), nil)
  T.eq(select(2, countdown.eval("1/0")), "division by zero")
  T.eq(countdown.eval("1+"), nil)
  T.eq(countdown.eval("99999999999*99999999999"), nil)     -- beyond 2^53: an error, not a rounded value
  T.eq(select(2, countdown.eval("99999999999*99999999999")), "too large")
  T.eq(countdown.eval("9007199254740993"), nil)
end)

-- every value reachable from a multiset of rationals by combining two at a time (all parenthesisations, orders, ops)
local function solvable(nums, target)
  local function rat(p, q) local a, b = math.abs(p), math.abs(q); while b ~= 0 do a, b = b, a % b end; return { p / a, q / a } end
  local vals = {}
  for i, v in ipairs(nums) do vals[i] = { v, 1 } end
  local function search(vs)
    if #vs == 1 then return vs[1][2] == 1 and vs[1][1] == target end
    for i = 1, #vs do
      for j = 1, #vs do
        if i ~= j then
          local a, b = vs[i], vs[j]
          local rest = {}
          for k = 1, #vs do if k ~= i and k ~= j then rest[#rest + 1] = vs[k] end end
          local cands = { rat(a[1] * b[2] + b[1] * a[2], a[2] * b[2]), rat(a[1] * b[2] - b[1] * a[2], a[2] * b[2]),
                          rat(a[1] * b[1], a[2] * b[2]) }
          if b[1] ~= 0 then
            local p, q = a[1] * b[2], a[2] * b[1]
            if q < 0 then p, q = -p, -q end
            cands[4] = rat(p, q)
          end
          for _, c in ipairs(cands) do
            rest[#rest + 1] = c
            if search(rest) then return true end
            rest[#rest] = nil
          end
        end
      end
    end
    return false
  end
  return search(vals)
end

T.test("countdown: 10,000 generated tasks are solvable by exhaustive search and their own solution scores 1.0", function()
  local n3, n4, lo, hi = 0, 0, math.huge, -math.huge
  for seed = 0, 9999 do
    local task = countdown.task(seed)
    local n = #task.nums
    if n == 3 then n3 = n3 + 1 elseif n == 4 then n4 = n4 + 1 else error("size " .. n) end
    for _, v in ipairs(task.nums) do T.ok(v >= 1 and v <= 20 and v % 1 == 0, "num " .. v) end
    T.ok(task.target >= 1 and task.target <= 100 and task.target % 1 == 0, "target " .. task.target)
    lo, hi = math.min(lo, task.target), math.max(hi, task.target)
    if countdown.score(task, "<answer>" .. task.solution .. "</answer>") ~= 1.0 then
      error(string.format("seed %d: the solution %s of %s -> %d does not verify", seed, task.solution,
        table.concat(task.nums, ","), task.target))
    end
    if not solvable(task.nums, task.target) then error("seed " .. seed .. " is not solvable") end
  end
  -- n is uniform over {3, 4}: 5,000 ± 4.5σ
  T.ok(math.abs(n3 - 5000) < 225 and n3 + n4 == 10000, "n = 3 in " .. n3 .. " tasks")
  T.ok(lo == 1 and hi >= 95, string.format("targets span [%d, %d]", lo, hi))
  -- the search itself can fail: 1, 1, 1 cannot make 100
  T.ok(not solvable({ 1, 1, 1 }, 100) and solvable({ 3, 5, 7 }, 22), "the exhaustive search")
end)

T.test("countdown env: prompt text, calc tool, call budget, final answer", function()
  local env = rl.env("countdown", { tools = "calc" })
  local obs = env:reset(17)
  local task = countdown.task(17)
  T.ok(obs.prompt:find("Using the numbers [" .. table.concat(task.nums, ", ") .. "] make " .. task.target
    .. ". Use each number exactly once with + - * / and parentheses. Answer as <answer>EXPR</answer>.", 1, true),
    obs.prompt)
  T.ok(obs.tools and obs.tools.calc, "calc declared")
  T.eq(env:step { call = { name = "calc", args = "6/4" } }.result, "3/2")
  T.eq(env:step { call = { name = "calc", args = "1/0" } }.result, "error")
  local r = env:step { call = { name = "search", args = "x" } }
  T.ok(r.invalid and r.result == "error: unknown tool 'search'", r.result)
  for _ = 3, 8 do T.ok(not env:step { call = { name = "calc", args = "1" } }.invalid) end
  T.ok(env:step { call = { name = "calc", args = "1" } }.invalid, "a ninth call is refused")
  local fin = env:step { text = "<answer>" .. task.solution .. "</answer>" }
  T.eq({ fin.terminal, fin.done, fin.correct }, { 1.0, true, true })
  local plain = rl.env("countdown")
  T.eq(plain:reset(17).tools, nil)
  T.ok(plain:step { call = { name = "calc", args = "1" } }.invalid, "no tools without tools = calc")
  T.raises(function() rl.env("countdown", { tools = "python" }) end, "tools must be one of \"calc\", \"none\"")
  T.raises(function() rl.env("chess") end, "rl.env: environment must be one of")
end)

---------------------------------------------------------------------------------------------------
-- kv_search and grid (oracle 7)

T.test("kv_search: the oracle policy gets exactly 1.0, swapped answers 0; extra calls cost 0.02 each, malformed ones too", function()
  for seed = 0, 199 do
    local env = rl.env("kv_search")
    local obs = env:reset(seed)
    local keys = env.task.keys
    T.eq(#keys, 2)
    T.ok(obs.prompt == string.format("Find the values for keys: %s %s. Use search. Answer as <answer>V1 V2</answer>.",
      keys[1], keys[2]), obs.prompt)
    local vals, R = {}, 0
    for i, k in ipairs(keys) do
      local r = env:step { call = { name = "search", args = k } }
      vals[i], R = r.result, R + r.reward
    end
    T.ok(vals[1]:match("^%d%d%d%d$") and vals[1] ~= vals[2], "values " .. vals[1] .. " " .. vals[2])
    local fin = env:step { text = "<answer>" .. vals[1] .. " " .. vals[2] .. "</answer>" }
    T.eq(fin.terminal + R, 1.0)
    env:reset(seed)
    T.eq(env:step { text = "<answer>" .. vals[2] .. " " .. vals[1] .. "</answer>" }.terminal, 0)
  end
  local env = rl.env("kv_search")
  env:reset(5)
  local costs = {}
  for i = 1, 7 do costs[i] = env:step { call = { name = "search", args = "zzzz" } } end
  T.eq({ costs[1].reward, costs[2].reward, costs[3].reward, costs[6].reward }, { 0, 0, -0.02, -0.02 })
  T.ok(not costs[6].invalid and costs[7].invalid, "at most 2Q + 2 = 6 calls")
  T.eq(costs[1].result, "none")
  T.eq(env:step { text = "no tag" }.terminal, 0)
  -- a malformed call or one to an unknown tool is a call too: it costs beyond Q like a search (not free)
  env:reset(5)
  local m1 = env:step { call = { malformed = "expected NAME: ARGS", text = "" } }
  local m2 = env:step { call = { name = "lookup", args = "x" } }
  local m3 = env:step { call = { malformed = "expected NAME: ARGS", text = "zz" } }
  T.eq({ m1.reward, m2.reward, m3.reward }, { 0, 0, -0.02 })
  T.ok(m1.invalid and m2.invalid and m3.result:find("error: ", 1, true), "errors, marked invalid")
  -- distractors: absent keys whose answer is none
  local d = rl.env("kv_search", { pairs = 8, queries = 3, distractors = 1 })
  d:reset(11)
  local nones = 0
  for i, k in ipairs(d.task.keys) do
    local r = d:step { call = { name = "search", args = k } }
    T.eq(r.result, d.task.answers[i])
    if r.result == "none" then nones = nones + 1 end
  end
  T.eq(nones, 1)
  T.eq(d:step { text = "<answer>" .. table.concat(d.task.answers, " ") .. "</answer>" }.terminal, 1.0)
end)

T.test("grid: every generated grid is solvable; the BFS policy's return is 1 - 0.01 l*", function()
  for seed = 0, 499 do
    local env = rl.env("grid")
    local obs = env:reset(seed)
    local l = env.task.shortest
    T.ok(l >= 1, "start and goal are distinct")
    T.ok(obs.observation:find("A", 1, true) and obs.observation:find("G", 1, true)
      and obs.observation:find("\nsteps left: 20$"), obs.observation)
    local _, path = grid.bfs(env.task)
    local R, fin = 0, nil
    for _, m in ipairs(path) do
      fin = env:step { text = "<action>" .. m .. "</action>" }
      R = R + fin.reward + (fin.terminal or 0)
    end
    if l <= 20 then
      T.ok(fin.done and fin.correct, "reached the goal")
      T.near(R, 1 - 0.01 * l, 1e-12, "seed " .. seed)
    end
  end
  -- walls and edges leave the agent in place; a malformed action costs 0.1 and moves nothing
  local env = rl.env("grid", { width = 3, height = 1, density = 0 })
  env:reset(0)
  env.x, env.task.gx, env.task.gy = 0, 2, 0
  local r = env:step { text = "<action>L</action>" }
  T.eq({ env.x, r.reward, r.done }, { 0, -0.01, false })
  r = env:step { text = "go left" }
  T.eq({ env.x, r.reward, r.invalid }, { 0, -0.1, true })
  r = env:step { text = "<action>R</action>" }
  T.eq({ env.x, r.reward }, { 1, -0.01 })
  r = env:step { text = "<action> R </action>" }
  T.eq({ r.terminal, r.done }, { 1, true })
  -- the turn budget ends the episode
  local b = rl.env("grid", { max_turns = 2 })
  b:reset(1)
  b:step { text = "x" }
  local last = b:step { text = "x" }
  T.eq({ last.done, last.terminal }, { true, 0 })
end)

T.test("grid with p_slip: deterministic by seed, and slips happen at about the rate", function()
  local function run(seed)
    local env = rl.env("grid", { p_slip = 0.5, max_turns = 200, density = 0 })
    env:reset(seed)
    local trace = {}
    for i = 1, 40 do
      local r = env:step { text = "<action>" .. ({ "U", "R", "D", "L" })[i % 4 + 1] .. "</action>" }
      trace[#trace + 1] = env.x .. "," .. env.y
      if r.done then break end
    end
    return table.concat(trace, " ")
  end
  T.eq(run(3), run(3))
  T.ok(run(3) ~= run(4), "a different seed slips differently")
end)

-- a 32-bit polynomial hash of a string (exact in doubles), for the golden bytes below
local function fnv(s)
  local h = 0
  for i = 1, #s do h = (h * 31 + s:byte(i)) % 4294967296 end
  return h
end

local function env_bytes(name, cfg, seeds)
  local parts = {}
  for seed = 0, seeds - 1 do
    local env = rl.env(name, cfg)
    local obs = env:reset(seed)
    parts[#parts + 1] = obs.prompt .. "|" .. (obs.observation or "")
    if name == "countdown" then
      parts[#parts + 1] = env:step { call = { name = "calc", args = table.concat(env.task.nums, "/") } }.result
    elseif name == "kv_search" then
      parts[#parts + 1] = env:step { call = { name = "search", args = env.task.keys[1] } }.result
    else
      parts[#parts + 1] = env:step { text = "<action>D</action>" }.observation or "done"
    end
  end
  return table.concat(parts, "\n")
end

T.test("determinism (oracle 8): the same (env, seed) gives the same prompt bytes and tool responses", function()
  for _, e in ipairs { { "countdown", { tools = "calc" } }, { "kv_search" }, { "grid", { p_slip = 0.3 } } } do
    local a, b = env_bytes(e[1], e[2], 64), env_bytes(e[1], e[2], 64)
    T.ok(a == b, e[1] .. " differs between two runs")
  end
  -- golden hashes: the bytes of seeds 0-63 do not depend on the platform, the thread count or the build
  T.eq(string.format("%08x", fnv(env_bytes("countdown", { tools = "calc" }, 64))), "bfe76c3d")
  T.eq(string.format("%08x", fnv(env_bytes("kv_search", nil, 64))), "c8981860")
  T.eq(string.format("%08x", fnv(env_bytes("grid", { p_slip = 0.3 }, 64))), "88d7b139")
  T.eq(countdown.task(0).nums, countdown.task(0).nums)
  T.ok(countdown.prompt(countdown.task(0)) ~= countdown.prompt(countdown.task(1)), "seeds differ")
end)

---------------------------------------------------------------------------------------------------
-- objectives (oracles 1, 3, 4, 5)

local function sample(reward, n, base, ref)
  local s = { reward = reward, logp_old = {}, logp_ref = ref and {} or nil }
  for t = 1, n do
    s.logp_old[t] = base - 0.1 * t
    if ref then s.logp_ref[t] = base - 0.13 * t + 0.05 end
  end
  return s
end

-- a batch of two prompts (G = 4 and G = 3) with ragged lengths
local function batch_of(rewards_a, rewards_b)
  local g1, g2 = { samples = {} }, { samples = {} }
  for i, r in ipairs(rewards_a) do g1.samples[i] = sample(r, 2 + i, -0.5 - 0.1 * i, true) end
  for i, r in ipairs(rewards_b) do g2.samples[i] = sample(r, 5 - i, -1.0 - 0.07 * i, true) end
  return { groups = { g1, g2 } }
end

local function flat_old(batch, shift)
  local out = {}
  for _, g in ipairs(batch.groups) do
    for _, s in ipairs(g.samples) do
      for t, v in ipairs(s.logp_old) do out[#out + 1] = v + (shift and shift(#out + 1, t) or 0) end
    end
  end
  return out
end

local function fd_check(f, batch, logp, tol, what)
  local _, grad = f(batch, logp)
  local h, worst = 1e-6, 0
  for k = 1, #logp do
    local x = logp[k]
    logp[k] = x + h
    local lp = f(batch, logp)
    logp[k] = x - h
    local lm = f(batch, logp)
    logp[k] = x
    worst = math.max(worst, math.abs((lp - lm) / (2 * h) - grad[k]))
  end
  T.ok(worst <= tol, string.format("%s: max |fd - analytic| = %.3g (tol %.0e)", what, worst, tol))
  return worst
end

T.test("oracle 1: a group with equal rewards has advantages exactly 0, DAPO drops it, Kimi's gradient is 0", function()
  local A, flat = obj.advantages { 0.1, 0.1, 0.1, 0.1 }
  T.eq(A, { 0, 0, 0, 0 })
  T.ok(flat, "flat")
  -- the formula alone would leave residue: (0.1 - mean) is 1.4e-17 here
  local m = (0.1 + 0.1 + 0.1) / 3
  T.ok(0.1 - m ~= 0, "the residue the rule removes exists")
  T.eq(obj.advantages { 0.1, 0.1, 0.1 }, { 0, 0, 0 })
  T.ok(not obj.keep_group { 0.1, 0.1, 0.1 }, "DAPO drops an all-equal group")
  T.ok(obj.keep_group { 0.1, 0, 0, 0 }, "[0.1, 0, 0, 0] is kept (format bonus counts)")
  -- ... but only a group with 0 < #correct < G counts toward the batch DAPO resamples for
  T.ok(not obj.mixed_group({ 0.1, 0, 0, 0 }, { false, false, false, false }), "kept for the format bonus: not counted")
  T.ok(obj.mixed_group({ 1, 0.1, 0, 0 }, { true, false, false, false }), "one of four correct: counted")
  T.ok(not obj.mixed_group({ 1, 1.1, 1, 1 }, { true, true, true, true }), "all correct: not counted")
  T.ok(obj.mixed_group({ 1, 0, 0 }, { true, nil, false }), "a truncated sample (no verdict) is not correct")
  T.ok(obj.mixed_group({ 1, 1, 0 }, { true, true, nil }), "two of three correct: counted")
  -- an environment without verdicts: its rewards decide, as for keeping
  T.ok(obj.mixed_group({ 0.1, 0, 0, 0 }, {}), "no verdicts: a kept group counts")
  T.ok(not obj.mixed_group({ 0.1, 0.1, 0.1 }, {}), "no verdicts: a flat group does not")
  local b = batch_of({ 0.1, 0.1, 0.1, 0.1 }, { 1, 1, 1 })
  for _, name in ipairs { "grpo", "dapo", "kimi" } do
    local opts = name == "grpo" and { beta_kl = 0 } or nil
    local loss, grad, st = obj[name](b, flat_old(b), opts)
    for k, g in ipairs(grad) do if g ~= 0 then error(name .. ": gradient " .. g .. " at " .. k) end end
    T.eq(loss, 0, name .. " loss")
    T.eq(st.zero_group_frac, 1)
  end
end)

T.test("oracle 3: on-policy GRPO gradient is -(1/G) A_i/|o_i| per token; KL and its gradient are 0", function()
  local b = batch_of({ 1, 0, 0.1, 1 }, { 0, 1, 0 })
  -- reference = θ: the KL term vanishes
  for _, g in ipairs(b.groups) do for _, s in ipairs(g.samples) do s.logp_ref = s.logp_old end end
  local logp = flat_old(b)
  local _, grad, st = obj.grpo(b, logp, { beta_kl = 0.04 })
  T.eq(st.kl, 0)
  local k = 0
  for _, g in ipairs(b.groups) do
    local r = {}
    for i, s in ipairs(g.samples) do r[i] = s.reward end
    local A = obj.advantages(r)
    for i, s in ipairs(g.samples) do
      for _ = 1, #s.logp_old do
        k = k + 1
        T.near(grad[k], -A[i] / (#r * #s.logp_old), 1e-15, "token " .. k)
      end
    end
  end
  T.eq(st.clip_frac, 0)
end)

T.test("fp64 central differences of each objective w.r.t. per-token logp (≤ 1e-8; Kimi ≤ 1e-10)", function()
  local b = batch_of({ 1, 0, 0.1, 1 }, { 0, 1, 0.5 })
  -- off-policy, inside the trust region (no clip boundary within h), with TIS weights
  local logp = flat_old(b, function(k) return 0.03 * math.sin(k) end)
  for _, g in ipairs(b.groups) do
    for _, s in ipairs(g.samples) do
      s.tis = {}
      for t = 1, #s.logp_old do s.tis[t] = 0.5 + 0.1 * t end
    end
  end
  fd_check(function(bb, lp) return obj.grpo(bb, lp, { beta_kl = 0.04 }) end, b, logp, 1e-8, "grpo")
  fd_check(obj.dapo, b, logp, 1e-8, "dapo")
  fd_check(obj.kimi, b, logp, 1e-10, "kimi")
  -- and far off-policy, where clipping is active for some tokens
  local far = flat_old(b, function(k) return 0.6 * math.sin(3 * k) end)
  local _, _, st = obj.dapo(b, far)
  T.ok(st.clip_frac > 0.1, "clipping active: " .. st.clip_frac)
  fd_check(function(bb, lp) return obj.grpo(bb, lp, { beta_kl = 0.04 }) end, b, far, 1e-8, "grpo (clipped)")
  fd_check(obj.dapo, b, far, 1e-8, "dapo (clipped)")
  fd_check(obj.kimi, b, far, 1e-10, "kimi (far)")
end)

T.test("oracle 4: a clipped token's surrogate gradient is exactly 0 (DAPO), only the KL part remains (GRPO)", function()
  local s_pos = { reward = 1, logp_old = { -1, -1 }, logp_ref = { -0.9, -1.2 } }
  local s_neg = { reward = 0, logp_old = { -1, -1 }, logp_ref = { -0.9, -1.2 } }
  local b = { groups = { { samples = { s_pos, s_neg } } } }
  -- A > 0 with ρ above 1 + ε_hi, and A < 0 with ρ below 1 - ε_lo; the second token of each stays inside
  local logp = { -1 + math.log(1.5), -1, -1 + math.log(0.5), -1 }
  local _, g = obj.dapo(b, logp)
  T.eq({ g[1], g[3] }, { 0, 0 })
  T.ok(g[2] ~= 0 and g[4] ~= 0, "unclipped tokens keep their gradient")
  local beta = 0.04
  local _, gg = obj.grpo(b, logp, { beta_kl = beta })
  for _, k in ipairs { 1, 3 } do
    local x = (k == 1 and -0.9 or -0.9) - logp[k]
    T.near(gg[k], beta * (1 - math.exp(x)) / (2 * 2), 1e-16, "KL part only at token " .. k)
  end
  -- DAPO's clip-higher: ρ = 1.25 is inside [0.8, 1.28] for DAPO but clipped in GRPO (ε = 0.2)
  local up = { -1 + math.log(1.25), -1, -1, -1 }
  T.ok(obj.dapo(b, up) ~= nil and select(2, obj.dapo(b, up))[1] ~= 0, "DAPO keeps ρ = 1.25 for A > 0")
  T.eq(select(2, obj.grpo(b, up, { beta_kl = 0 }))[1], 0)
end)

T.test("oracle 5: Kimi's analytic gradient; TIS weights never exceed C_tis", function()
  local b = batch_of({ 1, 0, 0.1, 1 }, { 0, 1, 0.5 })
  local logp = flat_old(b, function(k) return 0.2 * math.cos(k) end)
  local tau = 0.1
  local _, grad = obj.kimi(b, logp, { tau = tau })
  -- by hand: -(2τ/k)(r_j - r̄ - τ s_j) on every token of sample j
  local k = 0
  for _, g in ipairs(b.groups) do
    local K, mean = #g.samples, 0
    for _, s in ipairs(g.samples) do mean = mean + s.reward / K end
    for _, s in ipairs(g.samples) do
      local sj, first = 0, k
      for t = 1, #s.logp_old do sj = sj + logp[first + t] - s.logp_old[t] end
      for _ = 1, #s.logp_old do
        k = k + 1
        T.near(grad[k], -(2 * tau / K) * (s.reward - mean - tau * sj), 1e-15, "token " .. k)
      end
    end
  end
  local w, clipped = obj.tis_weights({ 0, 1, -1, 3 }, { 0, 0, 0, 0 }, 2)
  T.eq(clipped, 2)
  T.eq({ w[1], w[2], w[4] }, { 1, 2, 2 })
  T.near(w[3], math.exp(-1), 1e-16)
  for _, v in ipairs(w) do T.ok(v <= 2, "w <= C") end
  T.raises(function() obj.grpo(b, { 1, 2 }) end, "logp has 2 entries but the batch has")
  T.raises(function() obj.kimi(b, logp, { tau = 0 }) end, "tau must be a finite number > 0")
  T.raises(function() obj.get("ppo") end, "rl.objective must be one of \"dapo\", \"grpo\", \"kimi\"")
end)

T.test("DAPO's normaliser is over the batch's tokens; GRPO's per sample; prompts add", function()
  local one = { groups = { { samples = { { reward = 1, logp_old = { -1 } }, { reward = 0, logp_old = { -1, -1, -1 } } } } } }
  local _, gd = obj.dapo(one, { -1, -1, -1, -1 })
  local A = obj.advantages { 1, 0 }
  T.near(gd[1], -A[1] / 4, 1e-15)
  T.near(gd[2], -A[2] / 4, 1e-15)
  local _, gg = obj.grpo(one, { -1, -1, -1, -1 }, { beta_kl = 0 })
  T.near(gg[1], -A[1] / (2 * 1), 1e-15)
  T.near(gg[2], -A[2] / (2 * 3), 1e-15)
  local two = { groups = { one.groups[1], one.groups[1] } }
  local l1 = obj.grpo(one, { -0.9, -1.1, -1, -0.95 }, { beta_kl = 0 })
  local l2 = obj.grpo(two, { -0.9, -1.1, -1, -0.95, -0.9, -1.1, -1, -0.95 }, { beta_kl = 0 })
  T.near(l2, 2 * l1, 1e-15)
end)

---------------------------------------------------------------------------------------------------
-- rewards

T.test("rewards: K1.5 length reward, overlong shaping, the repetition stop, credit per trajectory or turn", function()
  local lr = rewards.length({ 10, 20, 30 }, { true, false, true })
  T.eq(lr, { 0.5, 0, -0.5 })
  T.eq(rewards.length({ 7, 7 }, { true, false }), { 0, 0 })
  T.eq(rewards.overlong(80, 100, 20), 0)
  T.near(rewards.overlong(90, 100, 20), -0.5, 1e-15)
  T.eq(rewards.overlong(101, 100, 20), -1)
  T.raises(function() rewards.overlong(1, 10, 0) end, "L_cache must be in (0, L_max = 10]")
  local ids = {}
  for i = 1, 10 do ids[i] = 1000 + i end
  for r = 0, 2 do for j = 1, 32 do ids[10 + r * 32 + j] = j % 7 end end
  T.ok(rewards.repeated(ids), "a 32-token window three times")
  ids[#ids] = 99
  T.ok(not rewards.repeated(ids), "broken in its last token")
  T.ok(not rewards.repeated({ 1, 1, 1 }), "too short")
  local t = rl.traj.new {}
  local R = rl.traj.ROLE
  t:push(1, R.user, 0)
  t:push(2, R.assistant, 1, -0.5, 0, 0)
  t:push(3, R.tool_result, 0, 0, 0, 0)
  t:push(4, R.assistant, 1, -0.5, 0, 1)
  t:push(5, R.assistant, 1, -0.5, 0, 2)
  t.reward_terminal, t.rewards_turn = 1, { -0.1, 0.2, 0.05 }
  for _, v in ipairs(rewards.returns(t)) do T.near(v, 1.15, 1e-15) end
  T.eq(#rewards.returns(t), 3)
  local turn = rewards.returns(t, "turn")
  T.near(turn[1], 1.15, 1e-15); T.near(turn[2], 1.25, 1e-15); T.near(turn[3], 1.05, 1e-15)
end)

---------------------------------------------------------------------------------------------------
-- records and markup

T.test("trajectories: JSONL round trip (formats.md §5 keys), fp32 log-probs, segments, errors name file:line", function()
  local tok = tokenizer.byte_level()
  local mk = rl.markup.new(tok)
  local env = rl.env("countdown", { tools = "calc" })
  local t = rl.traj.new { prompt_id = 3, group_id = 1, env = "countdown", seed = 17 }
  mk:prompt(t, env:reset(17))
  local n_prompt = t:len()
  T.eq(t:n_policy(), 0)
  for i, id in ipairs(tok:encode("<answer>1</answer>")) do t:push(id, rl.traj.ROLE.assistant, 1, -0.1 * i, i > 3 and 1 or 0, 0) end
  t:push(tok:id("<|im_end|>"), rl.traj.ROLE.assistant, 1, -0.01, 1, 0)
  t.reward_terminal = 0.1
  T.eq(t.segments, { { n_prompt, 0 }, { n_prompt + 3, 1 } })
  T.ok(t.logp_old[n_prompt + 1] ~= -0.1 and math.abs(t.logp_old[n_prompt + 1] + 0.1) < 1e-8, "rounded to fp32")
  local dir = T.tmpdir("rl_traj", { create = true })
  local path = dir .. "/traj.jsonl"
  rl.traj.write(path, { t, t })
  local text = T.read(path)
  T.ok(text:sub(1, 80):find('^{"prompt_id":3,"group_id":1,"env":"countdown","seed":17,"tokens":%['), text:sub(1, 80))
  local back = rl.traj.read(path)
  T.eq(#back, 2)
  for _, k in ipairs { "tokens", "roles", "loss_mask", "logp_old", "policy_version", "turn", "segments" } do
    T.eq(back[1][k], t[k], k)
  end
  T.eq(back[2].reward_terminal, 0.1)
  -- hostile lines
  local function refuse(line, want)
    T.write(path, text .. line .. "\n")
    T.raises(function() rl.traj.read(path) end, path .. ":3: " .. want)
  end
  refuse('{"env":"x","tokens":[1],"roles":[2],"loss_mask":[1],"logp_old":[0],"policy_version":[0,1],"reward_terminal":0}',
    '"policy_version" has 2 entries, "tokens" 1')
  refuse('{"env":"x","tokens":[1],"roles":[9],"loss_mask":[1],"logp_old":[0],"policy_version":[0],"reward_terminal":0}',
    "roles[0] must be 0-5, got 9")
  refuse('{"env":"x","tokens":[1],"roles":[1],"loss_mask":[2],"logp_old":[0],"policy_version":[0],"reward_terminal":0}',
    "loss_mask[0] must be 0 or 1, got 2")
  refuse('{"env":"x","tokens":[1.5],"roles":[1],"loss_mask":[1],"logp_old":[0],"policy_version":[0],"reward_terminal":0}',
    "tokens[0] must be a token id, got 1.5")
  refuse('{"env":"x","tokens":[1],"roles":[1],"loss_mask":[1],"logp_old":[0],"policy_version":[0]}',
    '"reward_terminal" must be a number')
  refuse("[1, 2", "json.decode")
end)

T.test("markup: specials by name, prompt tokens masked out, tool results masked, calls parsed", function()
  local tok = tokenizer.byte_level()
  local mk = rl.markup.new(tok)
  local t = rl.traj.new {}
  mk:prompt(t, { prompt = "hi", tools = { calc = "calc: EXPR" }, system = "be brief" })
  T.eq(t:n_policy(), 0)
  local text = tok:decode(t.tokens)
  T.ok(text:find("^<|im_system|>system<|im_middle|>be brief<|im_end|><|im_system|>tools<|im_middle|>You can call tools%."),
    text)
  T.ok(text:find("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>$"), text)
  local R = rl.traj.ROLE
  T.eq(t.roles[1], R.system)
  -- the assistant writes a call: sampled tokens, mask 1
  for _, id in ipairs(tok:encode("let me check ")) do t:push(id, R.assistant, 1, -1, 0, 0) end
  t:push(tok:id("<|tool_call_begin|>"), R.assistant, 1, -1, 0, 0)
  for _, id in ipairs(tok:encode("calc: 3*5")) do t:push(id, R.assistant, 1, -1, 0, 0) end
  t:push(tok:id("<|tool_call_end|>"), R.assistant, 1, -1, 0, 0)
  T.eq({ mk:parse_call(mk:call_text(t)) }, { "calc", "3*5" })
  T.eq(mk:turn_text(t), "let me check calc: 3*5")
  local before = t:len()
  mk:tool_result(t, "15", 0)
  T.eq(t:len(), before + 4)
  for i = before + 1, t:len() do T.eq({ t.loss_mask[i], t.roles[i] }, { 0, R.tool_result }) end
  T.eq(mk:call_text(t), nil)
  T.eq({ rl.markup.parse_call("  search : abcd ") }, { "search", "abcd" })
  T.eq(rl.markup.parse_call("no colon here"), nil)
  T.ok(select(2, rl.markup.parse_call("no colon here")):find("malformed tool call", 1, true), "why")
  -- a user environment table: reset and step are checked
  T.raises(function() rl.env({ reset = function() end }) end, "rl.env: an environment table needs a function 'step'")
  local mine = rl.env({ reset = function() return { prompt = "p" } end, step = function() return { done = true } end })
  T.eq(mine.name, "custom")
end)

T.run()
