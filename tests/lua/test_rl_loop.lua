-- rl recipes: SFT warm-up on demonstrations, then iterations of rollouts and policy updates through the one step;
-- the records of rl.md §7 in metrics.jsonl, exact resume (weights, optimiser, iteration, the KL reference), errors.
local T = require "tide.testing"
local tide = require "tide"
local rl = require "tide.rl"
local json = require "tide.json"
local checkpoint = require "tide.checkpoint"
local tokenizer = require "tide.data.tokenizer"

local function recipe(out, over)
  local cfg = {
    name = "rl_test",
    model = { kind = "hybrid", vocab_size = 320, dim = 16, n_layers = 2, mixers = "KM", ffn_dim = 24,
      kda = { heads = 2, head_dim = 8 }, mla = { heads = 2, q_rank = 8, kv_rank = 8, nope_dim = 8, rope_dim = 4, v_dim = 8 } },
    sft = { steps = 3, rows = 4, lr = 3e-3 },
    rl = { env = "countdown", objective = "grpo", beta_kl = 0.04, iterations = 4, prompts = 2, G = 3, max_new = 10,
      lr = 1e-3 },
    optim = { weight_decay = 0 },
    train = { out = out, log_every = 1, quiet = true, tensorboard = false },
  }
  for k, v in pairs(over or {}) do
    if type(v) == "table" and type(cfg[k]) == "table" then for kk, vv in pairs(v) do cfg[k][kk] = vv end
    else cfg[k] = v end
  end
  return rl.Recipe(cfg)
end

local function records(out)
  local recs = {}
  for line in T.read(out .. "/metrics.jsonl"):gmatch("[^\n]+") do recs[#recs + 1] = json.decode(line) end
  return recs
end

local function weights(dir)
  local m = checkpoint.load_model(dir)
  local w = {}
  for name, t in m:named_parameters() do w[name] = t:tolist() end
  return w
end

T.test("demonstrations: each environment's demo, written as the policy would, earns the full reward", function()
  local tok = tokenizer.byte_level()
  for _, e in ipairs { { "countdown" }, { "countdown", { tools = "calc" } }, { "kv_search" }, { "grid" } } do
    for seed = 0, 19 do
      local env = rl.env(e[1], e[2])
      local t = rl.loop.demo_trajectory(env, tok, seed)
      T.ok(t.finished, e[1] .. " finished")
      local want = e[1] == "grid" and 1 or 1.0
      T.eq(t.reward_terminal, want, e[1] .. " seed " .. seed)
      T.ok(t:n_policy() > 0, "policy tokens")
    end
  end
  local t = rl.loop.demo_trajectory(rl.env("countdown", { tools = "calc" }), tok, 3)
  local text = tok:decode(t.tokens)
  local sol = rl.envs.countdown.task(3).solution
  T.ok(text:find("<|tool_call_begin|>calc: " .. sol .. "<|tool_call_end|><|tool_result_begin|>", 1, true), text)
end)

T.test("an RL recipe: SFT steps, then iterations with the rl.md §7 metrics in metrics.jsonl", function()
  local out = T.tmpdir("rl_loop_a")
  local cfg = recipe(out)
  local r = rl.loop.run(cfg)
  T.eq({ r.steps, r.iterations, r.stopped }, { 3 + 4, 4, nil })
  local recs = records(out)
  local sft, it = 0, {}
  for _, rec in ipairs(recs) do
    if rec.phase == "sft" then sft = sft + 1 end
    if rec.phase == "rl" then it[#it + 1] = rec end
  end
  T.eq({ sft, #it }, { 3, 4 })
  for i, rec in ipairs(it) do
    T.eq(rec.iteration, i)
    for _, k in ipairs { "reward_mean", "reward_std", "format_rate", "accuracy", "response_len", "zero_var_groups",
      "tool_calls_per_sample", "t_sample", "t_update", "sample_tok_per_s", "loss", "step" } do
      T.ok(type(rec[k]) == "number", "iteration " .. i .. " has " .. k)
    end
    if rec.updates > 0 then
      for _, k in ipairs { "entropy", "clip_frac", "kl", "grad_norm" } do T.ok(type(rec[k]) == "number", k) end
      T.ok(rec.entropy > 0, "entropy")
    end
  end
  -- the run loads from its directory, its ckpt/latest pointer or its ckpt directory alike
  local w = weights(out)
  T.eq(weights(out .. "/ckpt/latest"), w)
  T.eq(weights(out .. "/ckpt/"), w)
  -- the KL reference is kept beside the checkpoints
  T.ok(tide.C.tide_is_dir(out .. "/reference") == 1, "reference saved")
  -- a second fresh run into the same directory is refused
  T.raises(function() rl.loop.run(recipe(out)) end, "holds another run")
end)

T.test("resume is exact: 2 iterations, then resumed to 4, equals 4 at once (weights bitwise, the records)", function()
  local a, b = T.tmpdir("rl_loop_full"), T.tmpdir("rl_loop_half")
  rl.loop.run(recipe(a))
  rl.loop.run(recipe(b, { rl = { iterations = 2 } }))
  local cfg = recipe(b)
  cfg.resume = true
  local r = rl.loop.run(cfg)
  T.eq(r.iterations, 4)
  local wa, wb = weights(a), weights(b)
  for name, w in pairs(wa) do T.eq(wb[name], w, name) end
  local ra, rb = records(a), records(b)
  local function rl_recs(recs)
    local out = {}
    for _, rec in ipairs(recs) do if rec.phase == "rl" then out[rec.iteration] = rec end end
    return out
  end
  local xa, xb = rl_recs(ra), rl_recs(rb)
  for i = 1, 4 do
    for _, k in ipairs { "reward_mean", "loss", "response_len", "kl", "grad_norm" } do
      T.eq(xb[i][k], xa[i][k], "iteration " .. i .. " " .. k)
    end
  end
  -- resuming a finished run trains nothing more
  local c2 = recipe(a)
  c2.resume = true
  c2.rl.iterations = 4
  T.eq(rl.loop.run(c2).iterations, 4)   -- already done: nothing more runs
end)

T.test("RL recipe errors: one line naming the key", function()
  T.raises(function() rl.loop.run(recipe(nil, { rl = { objective = "ppo" } })) end,
    "rl.objective must be one of \"dapo\", \"grpo\", \"kimi\"")
  T.raises(function() rl.loop.run(recipe(nil, { rl = { G = 0 } })) end, "rl.G must be a positive integer")
  T.raises(function() rl.loop.run(recipe(nil, { rl = { objective = "dapo", beta_kl = 0.1 } })) end,
    "the KL term is GRPO's")
  T.raises(function() rl.loop.run(recipe(nil, { rl = { iters = 3 } })) end, "unknown key 'iters' in rl")
  T.raises(function() rl.Recipe { modle = {} } end, "unknown key 'modle'")
end)

T.test("partial rollouts in the loop: paused samples resume next iteration; a checkpoint holds the replay buffer", function()
  local over = { rl = { budget = 50, max_new = 12, stale = "mask", max_staleness = 1 } }
  local a, b = T.tmpdir("rl_partial_full"), T.tmpdir("rl_partial_half")
  local ra = rl.loop.run(recipe(a, over))
  local recs = records(a)
  local paused, stale = 0, 0
  for _, rec in ipairs(recs) do
    if rec.phase == "rl" then paused, stale = paused + rec.paused, math.max(stale, rec.staleness) end
  end
  T.ok(paused > 0, "samples paused at the budget")
  T.ok(stale > 0, "resumed samples carry older policy versions: staleness " .. stale)
  local over2 = { rl = { budget = 50, max_new = 12, stale = "mask", max_staleness = 1, iterations = 2 } }
  rl.loop.run(recipe(b, over2))
  local ck = json.decode(T.read(b .. "/ckpt/" .. T.read(b .. "/ckpt/latest"):gsub("%s+$", "") .. "/state.json"))
  T.ok(#ck.data.replay > 0, "the checkpoint holds paused samples")
  local cfg = recipe(b, over)
  cfg.resume = true
  rl.loop.run(cfg)
  local wa, wb = weights(a), weights(b)
  for name, w in pairs(wa) do T.eq(wb[name], w, name) end
  T.eq(ra.iterations, 4)
  T.raises(function() rl.loop.run(recipe(nil, { rl = { budget = 10, objective = "dapo", dynamic = true } })) end,
    "rl.dynamic (resampling) and rl.budget (partial rollouts) do not combine")
end)

T.test("DAPO's dynamic sampling draws until enough kept groups have mixed verdicts (rl.md §4)", function()
  -- every reward distinct, so no group is flat and every one is kept; the verdicts are set by the reward function:
  -- none correct (kept for their rewards only: every round of max_resample is drawn), one per group (mixed: one
  -- round), or no verdict at all (the rewards decide: one round)
  local function run(verdict)
    local out = T.tmpdir("rl_dyn_" .. verdict)
    local n, seen = 0, {}
    local function reward(t)
      n = n + 1
      if verdict == "none" then t.correct = false
      elseif verdict == "mixed" then t.correct = not seen[t.group_id]; seen[t.group_id] = true
      else t.correct = nil end
      return n * 1e-3
    end
    rl.loop.run(recipe(out, { rl = { objective = "dapo", beta_kl = 0, iterations = 1, max_resample = 2,
      reward = reward } }))
    local lines = 0
    for _ in T.read(out .. "/trajectories/iter_000001.jsonl"):gmatch("[^\n]+") do lines = lines + 1 end
    local rec
    for _, r in ipairs(records(out)) do if r.phase == "rl" then rec = r end end
    return lines, rec
  end
  local lines, rec = run("none")
  T.eq(lines, 3 * 2 * 3, "none correct: 3 rounds of 2 prompts x 3 samples")
  T.eq(rec.zero_var_groups, 0, "every group kept")
  T.eq(rec.accuracy, 0)
  lines, rec = run("mixed")
  T.eq(lines, 2 * 3, "one correct sample per group: one round")
  T.eq(rec.accuracy, 1 / 3)
  lines = run("unjudged")
  T.eq(lines, 2 * 3, "no verdicts: the kept groups count, one round")
end)

T.test("the README's own-environment recipe runs as written (shortened)", function()
  local readme = T.read((debug.getinfo(1, "S").source:match("^@(.*)/tests/lua/") or ".") .. "/README.md")
  local code = readme:match("A user's environment, in a recipe.-```lua\n(.-)```")
  T.ok(code and #code > 200, "the README block")
  local out = T.tmpdir("rl_readme")
  code = code:gsub('out = "runs/word_length"', 'out = "' .. out .. '", quiet = true, tensorboard = false')
    :gsub("steps = 100, rows = 16", "steps = 4, rows = 4"):gsub("iterations = 20", "iterations = 2")
  local cfg = assert(load(code, "=README"))()
  T.eq(cfg.kind, "rl")
  local r = rl.loop.run(cfg)
  T.eq({ r.iterations, r.steps, r.stopped }, { 2, 6, nil })
  -- its demo earns the full reward
  local env = setmetatable({}, { __index = cfg.rl.env })
  local t = rl.loop.demo_trajectory(env, tokenizer.byte_level(), 3)
  T.eq(t.reward_terminal, 1)
end)

T.test("SFT from chat JSONL (formats.md §5): loss on assistant turns and calls only; errors name file:line", function()
  local tok = tokenizer.byte_level()
  local t = rl.loop.chat_trajectory(tok, {
    { role = "system", content = "be exact" }, { role = "user", content = "3*5?" },
    { role = "assistant", content = "let me check", tool_calls = { { name = "calc", arguments = "3*5" } } },
    { role = "tool", content = "15" },
    { role = "assistant", content = "<answer>15</answer>" } })
  local text = tok:decode(t.tokens)
  T.eq(text, "<|im_system|>system<|im_middle|>be exact<|im_end|><|im_user|>user<|im_middle|>3*5?<|im_end|>"
    .. "<|im_assistant|>assistant<|im_middle|>let me check<|tool_call_begin|>calc: 3*5<|tool_call_end|>"
    .. "<|tool_result_begin|>15<|tool_result_end|><answer>15</answer><|im_end|>")
  local policy = {}
  for i = 1, t:len() do if t.loss_mask[i] == 1 then policy[#policy + 1] = t.tokens[i] end end
  T.eq(tok:decode(policy), "let me check<|tool_call_begin|>calc: 3*5<|tool_call_end|><answer>15</answer><|im_end|>")
  local dir = T.tmpdir("rl_sft", { create = true })
  local file = dir .. "/chat.jsonl"
  T.write(file, json.encode({ messages = { { role = "user", content = "hi" }, { role = "assistant", content = "hello" } } })
    .. "\n\n" .. '{"messages": [{"role": "robot", "content": "x"}]}\n')
  T.raises(function() rl.loop.read_chat(tok, file) end, file .. ":3: messages[0].role must be system, user, assistant or tool")
  T.write(file, '{"messages": [{"role": "user", "content": "only a question"}]}\n')
  T.raises(function() rl.loop.read_chat(tok, file) end, file .. ":1: no assistant message")
  T.write(file, '{"messages": [{"role": "tool", "content": "15"}]}\n')
  T.raises(function() rl.loop.read_chat(tok, file) end, "a tool message without an assistant call before it")
  -- a recipe warms up on the file, and every iteration's samples are kept as JSONL
  local lines = {}
  for k = 1, 6 do
    local task = rl.envs.countdown.task(k)
    lines[k] = json.encode({ messages = { { role = "user", content = rl.envs.countdown.prompt(task) },
      { role = "assistant", content = "<answer>" .. task.solution .. "</answer>" } } })
  end
  T.write(file, table.concat(lines, "\n") .. "\n")
  local out = T.tmpdir("rl_sft_run")
  local r = rl.loop.run(recipe(out, { sft = { data = file, steps = 2, rows = 4 }, rl = { iterations = 1, beta_kl = 0 } }))
  T.eq({ r.steps, r.iterations }, { 3, 1 })
  local saved = rl.traj.read(out .. "/trajectories/iter_000001.jsonl")
  T.eq(#saved, 2 * 3)
  T.ok(saved[1]:n_policy() > 0 and saved[1].env == "countdown", "a sample of the iteration")
end)

T.test("a temperature schedule, the PTX term and the optimiser reset", function()
  local out = T.tmpdir("rl_ptx")
  rl.loop.run(recipe(out, { sft = { steps = 1 }, rl = { iterations = 3, beta_kl = 0,
    temperature = { from = 1.2, to = 0.6 }, ptx = { weight = 0.5, rows = 2 }, reset_optimizer = true } }))
  -- K1.5's optimiser reset: the last checkpoint's AdamW has made one step since the last iteration began
  local state = json.decode(T.read(out .. "/ckpt/" .. T.read(out .. "/ckpt/latest"):gsub("%s+$", "") .. "/state.json"))
  T.eq(state.optim.t, 1)
  local temps, ptx = {}, {}
  for _, rec in ipairs(records(out)) do
    if rec.phase == "rl" then temps[#temps + 1] = rec.temperature; ptx[#ptx + 1] = rec.ptx_loss end
  end
  T.near(temps[1], 1.2, 1e-12); T.near(temps[2], 0.9, 1e-12); T.near(temps[3], 0.6, 1e-12)
  for i = 1, 3 do T.ok(type(ptx[i]) == "number" and ptx[i] > 0, "ptx loss " .. tostring(ptx[i])) end
  T.raises(function() rl.loop.run(recipe(nil, { rl = { temperature = { from = 1 } } })) end,
    "rl.temperature.to must be a finite number >= 0")
  T.raises(function() rl.loop.run(recipe(nil, { rl = { ptx = { weight = 0 } } })) end,
    "rl.ptx.weight must be a finite number > 0")
end)

T.test("prioritised prompts: drawn from the pool by 1 - success rate, distinct, counted into the checkpoint", function()
  local S = { o = { prompt_seed = 10, pool = 4 }, pool = { attempts = { ["10"] = 50 }, correct = { ["10"] = 50 } } }
  local first = 0
  for it = 0, 1999 do
    local p = rl.loop.pick_from_pool(S, it, 1)
    T.ok(p[1] >= 10 and p[1] <= 13, "in the pool")
    if p[1] == 10 then first = first + 1 end
  end
  -- the solved seed's weight is 0.05 against 1.05 for each of the three others: 1.6% of draws
  T.ok(first > 5 and first < 80, "the solved prompt drawn " .. first .. " times in 2000")
  local two = rl.loop.pick_from_pool(S, 7, 3)
  T.ok(two[1] ~= two[2] and two[2] ~= two[3] and two[1] ~= two[3], "distinct")
  T.eq(rl.loop.pick_from_pool(S, 7, 3), two, "deterministic by iteration")
  local out = T.tmpdir("rl_pool")
  rl.loop.run(recipe(out, { rl = { iterations = 2, beta_kl = 0, pool = 3 } }))
  local state = json.decode(T.read(out .. "/ckpt/" .. T.read(out .. "/ckpt/latest"):gsub("%s+$", "") .. "/state.json"))
  local n = 0
  for seed, a in pairs(state.data.pool.attempts) do
    T.ok(tonumber(seed) >= 0 and tonumber(seed) <= 2, "seed " .. seed); n = n + a
  end
  T.eq(n, 2 * 2 * 3)
end)

T.test("a recipe's own reward function and overlong shaping; a reward that raises or is NaN is recorded, not fatal", function()
  local out = T.tmpdir("rl_reward")
  local calls = 0
  local r = rl.loop.run(recipe(out, { sft = { steps = 1 }, rl = { iterations = 2, beta_kl = 0, max_new = 8,
    overlong = { max = 6, cache = 2 },
    reward = function(t, info)
      calls = calls + 1
      if calls == 2 then error("scorer crashed") end
      if calls == 3 then return 0 / 0 end
      return #info.text / 100
    end } }))
  T.eq(r.iterations, 2)
  T.eq(calls, 2 * 2 * 3)
  local saved = rl.traj.read(out .. "/trajectories/iter_000001.jsonl")
  local errs = {}
  for _, t in ipairs(saved) do for _, e in ipairs(t.errors) do errs[#errs + 1] = e end end
  local all = table.concat(errs, " | ")
  T.ok(all:find("rl.reward raised: ", 1, true) and all:find("scorer crashed", 1, true), all)
  T.ok(all:find("rl.reward returned nan (counted as 0)", 1, true), all)
  local rec
  for _, x in ipairs(records(out)) do if x.phase == "rl" and x.iteration == 1 then rec = x end end
  T.eq(rec.reward_errors, 2)
  -- the reward of a sample: the function's value plus the overlong shaping of its length
  for k, t in ipairs(saved) do
    if k > 3 then
      local n = t:n_policy()
      local ids = {}
      for i = 1, #t.tokens do if t.loss_mask[i] == 1 then ids[#ids + 1] = t.tokens[i] end end
      local want = #tokenizer.byte_level():decode(ids, true) / 100 + rl.rewards.overlong(n, 6, 2)
      T.near(t.reward_terminal, want, 1e-12, "sample " .. k)
    end
  end
  T.raises(function() rl.loop.run(recipe(nil, { rl = { reward = 3 } })) end, "rl.reward must be a function")
end)

T.run()
