-- tide.rl.loop: the RL recipe form (rl.md §5): an optional SFT warm-up on the environment's demonstrations, then
-- iterations of rollouts -> rewards -> batch -> U policy updates, every update one call of the shared training step.
--
--   return tide.rl.Recipe{
--     name = "agent_rl", model = {...} | init = "runs/x/ckpt/latest",
--     sft = {steps = 200, rows = 32, lr = 3e-3},
--     rl = {env = "countdown", env_cfg = {tools = "calc"}, objective = "grpo" | "dapo" | "kimi", iterations = 50,
--           prompts = 8, G = 8, max_new = 48, max_turns = 8, temperature = 1, lr = 1e-3, updates = 1,
--           eps = 0.2, beta_kl = 0, eps_lo = 0.2, eps_hi = 0.28, tau = 0.1, tis = false, C_tis = 2,
--           credit = "trajectory", length_weight = 0, dynamic = (dapo), max_resample = 3, prompt_seed = 0},
--     optim = {...}, train = {out = "runs/agent_rl", ckpt_every = 10, log_every = 1, seed = 0},
--     expect = {format_rate_above = 0.9, reward_rises = true}}
--
-- The run's step counter counts optimiser steps (SFT steps, then policy updates); checkpoints hold the weights, the
-- optimiser, the phase and the iteration. Prompt seeds and sampler seeds derive from (prompt_seed, iteration), so a
-- resumed run samples exactly what the uninterrupted one did. The reference model of the KL term is the weights at
-- the start of RL (after the warm-up), rebuilt from that checkpoint on resume (its path is in the state).
local tide = require "tide"
local options = require "tide.options"
local defaults = require "tide.defaults"
local step = require "tide.step"
local optim = require "tide.optim"
local log = require "tide.log"
local json = require "tide.json"
local nn = require "tide.nn"
local tokenizer = require "tide.data.tokenizer"
local checkpoint = require "tide.checkpoint"
local traj_m = require "tide.rl.traj"
local markup = require "tide.rl.markup"
local rollout = require "tide.rl.rollout"
local update = require "tide.rl.update"
local objectives = require "tide.rl.objectives"
local rewards = require "tide.rl.rewards"
local dist = require "tide.dist"

local loop = {}
local fmt = string.format
local WHO = "rl"
local function bad(msg, level) options.fail(WHO, msg, level) end

local TOP = options.with_run_flags { kind = true, run = true, plan = true, name = true, description = true,
  model = true, init = true, tokenizer = true, sft = true, rl = true, optim = true, train = true, expect = true,
  on_nonfinite = true, dist = true }
local SFT = { steps = true, rows = true, lr = true, seed = true, data = true }
local RL = { env = true, env_cfg = true, objective = true, iterations = true, prompts = true, G = true, max_new = true,
  max_turns = true, temperature = true, top_k = true, top_p = true, lr = true, updates = true, eps = true,
  beta_kl = true, eps_lo = true, eps_hi = true, tau = true, tis = true, C_tis = true, credit = true,
  length_weight = true, dynamic = true, max_resample = true, prompt_seed = true, tool_timeout = true, budget = true,
  resume_mode = true, stale = true, max_staleness = true, save_trajectories = true, ptx = true,
  reset_optimizer = true, pool = true, reward = true, overlong = true }
local TRAIN = { out = true, ckpt_every = true, log_every = true, seed = true, quiet = true, tensorboard = true,
  keep_ckpts = true, threads = true, collect_every = true }
local EXPECT = { format_rate_above = true, reward_rises = true, reward_above = true }
loop.KEYS = { top = TOP, sft = SFT, rl = RL, train = TRAIN, expect = EXPECT, dist = dist.KEYS }

---------------------------------------------------------------------------------------------------
-- demonstrations: an environment's demo() actions written as the policy would write them (SFT warm-up data)

function loop.demo_trajectory(env, tok, seed)
  local mk = markup.new(tok)
  local R = traj_m.ROLE
  local t = traj_m.new { env = env.name, seed = seed }
  mk:prompt(t, env:reset(seed))
  local turn = 0
  local function write(ids) for _, id in ipairs(ids) do t:push(id, R.assistant, 1, 0, 0, turn) end end
  for _, a in ipairs(env:demo()) do
    if a.call then
      write { mk.sp.call_begin }
      write(tok:encode(a.call.name .. ": " .. a.call.args))
      write { mk.sp.call_end }
      local res = env:step(a)
      mk:tool_result(t, res.result, turn)
      turn = turn + 1
    else
      write(tok:encode(a.text))
      write { mk.sp.im_end }
      local res = env:step(a)
      if res.done then
        t.reward_terminal, t.finished = res.terminal or 0, true
        break
      end
      turn = turn + 1
      if res.observation then mk:observation(t, res.observation, turn) else mk:assistant_header(t, turn) end
    end
  end
  return t
end

-- a chat/SFT record (formats.md §5: {"messages": [{role, content, tool_calls = {{name, arguments}}}]}) in the
-- rollout markup: system and user messages, tool results and observations mask 0; assistant content, its tool calls
-- and the <|im_end|> that closes its turn mask 1. An assistant message with tool calls stays open: the tool messages
-- after it are its results, and the next assistant message continues the same turn.
function loop.chat_trajectory(tok, messages, where)
  local mk = markup.new(tok)
  local R = traj_m.ROLE
  local t = traj_m.new { env = "sft" }
  local open, turn = false, 0
  local function bad_rec(msg) error(fmt("%s: %s", where or "chat record", msg), 0) end
  local function write(ids) for _, id in ipairs(ids) do t:push(id, R.assistant, 1, 0, 0, turn) end end
  if type(messages) ~= "table" or #messages == 0 then bad_rec("\"messages\" must be a non-empty array") end
  for k, m in ipairs(messages) do
    if type(m) ~= "table" or type(m.content) ~= "string" then bad_rec(fmt("messages[%d] needs a string content", k - 1)) end
    if m.role == "system" or m.role == "user" then
      if open then bad_rec(fmt("messages[%d]: a %s message while the assistant awaits tool results", k - 1, m.role)) end
      mk:message(t, m.role, m.role, m.content, m.role == "system" and R.system or R.user, turn)
    elseif m.role == "assistant" then
      if not open then mk:assistant_header(t, turn) end
      write(tok:encode(m.content))
      local calls = m.tool_calls or {}
      if type(calls) ~= "table" then bad_rec(fmt("messages[%d].tool_calls must be an array", k - 1)) end
      for j, c in ipairs(calls) do
        if type(c) ~= "table" or type(c.name) ~= "string" or type(c.arguments) ~= "string" then
          bad_rec(fmt("messages[%d].tool_calls[%d] needs string name and arguments", k - 1, j - 1))
        end
        write { mk.sp.call_begin }
        write(tok:encode(c.name .. ": " .. c.arguments))
        write { mk.sp.call_end }
      end
      if #calls == 0 then write { mk.sp.im_end }; open = false; turn = turn + 1 else open = true end
    elseif m.role == "tool" then
      if not open then bad_rec(fmt("messages[%d]: a tool message without an assistant call before it", k - 1)) end
      mk:tool_result(t, m.content, turn)
      turn = turn + 1
    else
      bad_rec(fmt("messages[%d].role must be system, user, assistant or tool, got %s", k - 1, tostring(m.role)))
    end
  end
  if t:n_policy() == 0 then bad_rec("no assistant message: nothing to learn from") end
  return t
end

-- the chat records of JSONL files, as trajectories; errors name file:line
function loop.read_chat(tok, files)
  if type(files) == "string" then files = { files } end
  local out = {}
  for _, file in ipairs(files) do
    local ok, err = pcall(json.each_line, file, function(obj, where)
      if type(obj) ~= "table" then error(where .. ": expected a JSON object", 0) end
      out[#out + 1] = loop.chat_trajectory(tok, obj.messages, where)
    end)
    if not ok then bad("sft.data: " .. tostring(err), 0) end
  end
  if #out == 0 then bad("sft.data: no chat records in " .. table.concat(files, ", "), 0) end
  return out
end

---------------------------------------------------------------------------------------------------
-- the config

local function resolve(cfg)
  options.check(cfg, TOP, "the RL recipe", WHO)
  local r = cfg.rl or {}
  options.check(r, RL, "rl", WHO)
  local s = cfg.sft
  if s ~= nil then options.check(s, SFT, "sft", WHO) end
  options.check(cfg.train or {}, TRAIN, "train", WHO)
  options.check(cfg.expect or {}, EXPECT, "expect", WHO)
  step.check_numbers(cfg, WHO)
  local o = {
    env = r.env or "countdown", env_cfg = r.env_cfg,
    objective = options.one_of(r.objective or "grpo", objectives.NAMES, "rl.objective", WHO),
    iterations = r.iterations == nil and 50 or options.nonneg_int(r.iterations, "rl.iterations", WHO),
    prompts = r.prompts == nil and 8 or options.pos_int(r.prompts, "rl.prompts", WHO),
    G = r.G == nil and 8 or options.pos_int(r.G, "rl.G", WHO),
    max_new = r.max_new == nil and 64 or options.pos_int(r.max_new, "rl.max_new", WHO),
    max_turns = r.max_turns == nil and 8 or options.pos_int(r.max_turns, "rl.max_turns", WHO),
    temperature = r.temperature == nil and 1 or r.temperature,
    top_k = r.top_k, top_p = r.top_p,
    lr = r.lr == nil and 1e-3 or options.positive_number(r.lr, "rl.lr", WHO),
    updates = r.updates == nil and 1 or options.pos_int(r.updates, "rl.updates", WHO),
    tis = r.tis == true, C_tis = r.C_tis == nil and 2 or options.positive_number(r.C_tis, "rl.C_tis", WHO),
    credit = options.one_of(r.credit or "trajectory", { trajectory = true, turn = true }, "rl.credit", WHO),
    length_weight = r.length_weight == nil and 0 or options.finite_number(r.length_weight, "rl.length_weight", WHO, nil, 0),
    max_resample = r.max_resample == nil and 3 or options.nonneg_int(r.max_resample, "rl.max_resample", WHO),
    prompt_seed = r.prompt_seed == nil and 0 or options.seed(r.prompt_seed, "rl.prompt_seed", WHO),
    tool_timeout = r.tool_timeout,
    budget = r.budget ~= nil and options.pos_int(r.budget, "rl.budget", WHO) or nil,
    resume_mode = options.one_of(r.resume_mode or defaults.rl.resume_mode, { replay = true, prefill = true, state = true },
      "rl.resume_mode", WHO),
    stale = options.one_of(r.stale or "include", { include = true, mask = true }, "rl.stale", WHO),
    max_staleness = r.max_staleness == nil and 4 or options.nonneg_int(r.max_staleness, "rl.max_staleness", WHO),
    save_trajectories = r.save_trajectories ~= false,
    reset_optimizer = r.reset_optimizer == true,
    pool = r.pool ~= nil and options.int_at_least(r.pool, r.prompts or 8, "rl.pool (at least rl.prompts)", WHO) or nil,
    reward = r.reward,
  }
  if r.reward ~= nil and type(r.reward) ~= "function" then
    bad("rl.reward must be a function(trajectory, info) -> number (info: text, env_reward, seed, env)")
  end
  -- DAPO's overlong shaping: {max = L_max, cache = L_cache} on the response length (policy tokens)
  if r.overlong ~= nil then
    options.check(r.overlong, { max = true, cache = true }, "rl.overlong", WHO)
    o.overlong = { max = options.pos_int(r.overlong.max, "rl.overlong.max", WHO),
      cache = options.pos_int(r.overlong.cache, "rl.overlong.cache", WHO) }
    if o.overlong.cache > o.overlong.max then bad("rl.overlong.cache must be at most rl.overlong.max") end
  end
  if r.budget ~= nil and r.dynamic then bad("rl.dynamic (resampling) and rl.budget (partial rollouts) do not combine") end
  -- the temperature: a number, or {from, to} linear over the iterations (high early, lower later; rl.md §5)
  local temp = o.temperature
  if type(temp) == "table" then
    options.check(temp, { from = true, to = true }, "rl.temperature", WHO)
    options.finite_number(temp.from, "rl.temperature.from", WHO, nil, 0)
    options.finite_number(temp.to, "rl.temperature.to", WHO, nil, 0)
  else
    options.finite_number(temp, "rl.temperature", WHO, nil, 0)
  end
  -- PTX (K2): {weight = λ, rows = 8, data = chat JSONL (default: the environment's demonstrations)}
  if r.ptx ~= nil then
    options.check(r.ptx, { weight = true, rows = true, data = true }, "rl.ptx", WHO)
    o.ptx = { weight = options.positive_number(r.ptx.weight, "rl.ptx.weight", WHO),
      rows = r.ptx.rows == nil and 8 or options.pos_int(r.ptx.rows, "rl.ptx.rows", WHO), data = r.ptx.data }
  end
  o.dynamic = r.dynamic
  if o.dynamic == nil then o.dynamic = o.objective == "dapo" end
  o.obj_opts = {}
  if o.objective == "grpo" then o.obj_opts = { eps = r.eps, beta_kl = r.beta_kl == nil and 0 or r.beta_kl }
  elseif o.objective == "dapo" then o.obj_opts = { eps_lo = r.eps_lo, eps_hi = r.eps_hi }
  else o.obj_opts = { tau = r.tau } end
  if (r.beta_kl or 0) > 0 and o.objective ~= "grpo" then bad("rl.beta_kl: the KL term is GRPO's (DAPO drops it; Kimi's trust region is its squared term)") end
  o.beta_kl = o.objective == "grpo" and o.obj_opts.beta_kl or 0
  local sft = nil
  if s then
    sft = { steps = s.steps == nil and 100 or options.nonneg_int(s.steps, "sft.steps", WHO),
            rows = s.rows == nil and 16 or options.pos_int(s.rows, "sft.rows", WHO),
            lr = s.lr == nil and 3e-3 or options.positive_number(s.lr, "sft.lr", WHO),
            seed = s.seed == nil and 1000000 or options.seed(s.seed, "sft.seed", WHO), data = s.data }
    if s.data ~= nil and type(s.data) ~= "string" and type(s.data) ~= "table" then
      bad("sft.data must be a JSONL file of chat records or a list of them")
    end
  end
  return o, sft
end

---------------------------------------------------------------------------------------------------
-- one iteration's statistics (rl.md §7)

local function traj_stats(trajs)
  local n, R, R2, fmt_n, correct, len, calls, trunc = #trajs, 0, 0, 0, 0, 0, 0, 0
  for _, t in ipairs(trajs) do
    local r = t:total_reward()
    R, R2 = R + r, R2 + r * r
    if t.formatted then fmt_n = fmt_n + 1 end
    if t.correct then correct = correct + 1 end
    len = len + t:n_policy()
    calls = calls + (t.calls or 0)
    if t.truncated then trunc = trunc + 1 end
  end
  local mean = R / math.max(n, 1)
  return { reward_mean = mean, reward_std = math.sqrt(math.max(R2 / math.max(n, 1) - mean * mean, 0)),
    format_rate = fmt_n / math.max(n, 1), accuracy = correct / math.max(n, 1), response_len = len / math.max(n, 1),
    tool_calls_per_sample = calls / math.max(n, 1), truncated_rate = trunc / math.max(n, 1) }
end

local function groups_of(trajs)
  local order, by = {}, {}
  for _, t in ipairs(trajs) do
    if not by[t.group_id] then by[t.group_id] = {}; order[#order + 1] = t.group_id end
    by[t.group_id][#by[t.group_id] + 1] = t
  end
  local out = {}
  for _, g in ipairs(order) do out[#out + 1] = by[g] end
  return out
end

---------------------------------------------------------------------------------------------------
-- the run

local complete_groups, pick_from_pool, update_stats, ptx_build

local function setup(cfg)
  local o, sft = resolve(cfg)
  local tcfg = cfg.train or {}
  local seed = cfg.seed or tcfg.seed or 0
  local threads = cfg.threads or tcfg.threads
  if threads then tide.set_num_threads(threads) end
  tide.manual_seed(seed)
  local model, tok
  if cfg.init then
    local info
    model, info = checkpoint.load_model(cfg.init)
    tok = cfg.tokenizer and tokenizer.for_model(cfg.tokenizer, model.cfg.vocab_size, "tokenizer", WHO) or info.tokenizer
  else
    step.preflight(cfg.model, WHO)
    model = nn.build(cfg.model or {})
    tok = tokenizer.for_model(cfg.tokenizer, model.cfg.vocab_size, "tokenizer", WHO)
  end
  -- data parallelism (dist.dp = N, under mpirun): each rank samples its share of every iteration's prompts, the
  -- ranks exchange the ended samples (so every rank holds the iteration's whole batch, its statistics and the
  -- state a checkpoint keeps, as one process would), and each trains on its share of the groups of every update,
  -- the gradients summed by the shared step
  local L = dist.layout(cfg.dist, WHO)
  if L.ep > 1 or L.cp > 1 then
    bad(fmt("an RL recipe runs data parallel only (dist.dp): dist.ep = %d and dist.cp = %d are the pretraining "
      .. "drivers' (tide.train, curricula)", L.ep, L.cp), 0)
  end
  local opt = optim.build(cfg.optim or {}, model)
  if L.zero >= 1 then opt:shard(dist, L.zero) end
  local S = { cfg = cfg, o = o, sft = sft, tcfg = tcfg, seed = seed, model = model, tok = tok, opt = opt,
    group = L.group, rank = L.group and L.rank or 0, world = L.n, layout = L,
    phase = (sft and sft.steps > 0) and "sft" or "rl", iteration = 0, rl_start = nil, history = {},
    replay = {}, held = {}, pool = { attempts = {}, correct = {} } }
  local function make_stepper(objective)
    return step.stepper({ model = model, optim = opt, clip = (cfg.optim or {}).clip, on_nonfinite = cfg.on_nonfinite,
      objective = objective, dist = L.group, bucket_bytes = L.group and L.bucket_bytes or nil })
  end
  S.sft_stepper = make_stepper(nil)
  S.rl_stepper = make_stepper(update.objective(o.objective, o.obj_opts))
  local out = cfg.out or tcfg.out
  if out == "" then out = nil end
  S.out = out
  S.run = step.run({ driver = "rl", name = cfg.name, cfg = cfg, out = out, quiet = tcfg.quiet,
    tensorboard = tcfg.tensorboard, keep_ckpts = tcfg.keep_ckpts, collect_every = tcfg.collect_every, model = model,
    optim = opt, stepper = S.phase == "sft" and S.sft_stepper or S.rl_stepper, tokenizer = tok, dist = L.group,
    -- the replay buffer (paused samples, without their caches: a resumed run re-prefills) and the ended samples
    -- waiting for their groups
    -- (several ranks: each holds its own paused samples; the checkpoint keeps every rank's, each with its rank, a
    -- collective like the save itself)
    get_data = function()
      local replay = {}
      for i, e in ipairs(S.replay) do
        local c = {}
        for k, v in pairs(e) do if k ~= "state" then c[k] = v end end
        c.rank = S.group and S.rank or nil
        replay[i] = c
      end
      if S.group then
        local all = {}
        for _, text in ipairs(dist.gather_strings(json.encode(json.array(replay)))) do
          for _, e in ipairs(json.decode(text)) do all[#all + 1] = e end
        end
        replay = all
      end
      local held = {}
      for _, g in ipairs(S.held) do
        local recs = {}
        for i, t in ipairs(g.trajs) do recs[i] = t:record() end
        held[#held + 1] = { group_id = g.group_id, trajs = recs }
      end
      return { replay = replay, held = held, pool = S.pool }
    end,
    set_data = function(d)
      -- each rank resumes the paused samples of its rank (of rank mod the job's ranks, when their count changed)
      S.replay, S.held = {}, {}
      for _, e in ipairs(d.replay or {}) do
        if ((e.rank or 0) % S.world) == S.rank then
          local c = {}
          for k, v in pairs(e) do if k ~= "rank" then c[k] = v end end
          S.replay[#S.replay + 1] = c
        end
      end
      S.pool = type(d.pool) == "table" and d.pool or { attempts = {}, correct = {} }
      S.pool.attempts, S.pool.correct = S.pool.attempts or {}, S.pool.correct or {}
      for _, g in ipairs(d.held or {}) do
        local ts = {}
        for i, rec in ipairs(g.trajs) do ts[i] = traj_m.from_record(rec, "rl: a held trajectory of the checkpoint") end
        S.held[#S.held + 1] = { group_id = g.group_id, trajs = ts }
      end
    end,
    get_position = function()
      return { phase = S.phase, iteration = S.iteration, rl_start = S.rl_start }
    end,
    set_position = function(pos)
      if type(pos) ~= "table" or (pos.phase ~= "sft" and pos.phase ~= "rl") or type(pos.iteration) ~= "number" then
        bad("the checkpoint holds no RL position (phase \"sft\" or \"rl\", iteration)", 0)
      end
      S.phase, S.iteration, S.rl_start = pos.phase, pos.iteration, pos.rl_start
    end })
  return S
end

local function sft_phase(S)
  local run, sft, o = S.run, S.sft, S.o
  local env = rollout.make_env(o.env, o.env_cfg)
  -- the warm-up rows: the chat records of sft.data in order (cycling), else the environment's demonstrations
  local records = sft.data and loop.read_chat(S.tok, sft.data) or nil
  local function row(k)
    if records then return records[k % #records + 1] end
    return loop.demo_trajectory(env, S.tok, sft.seed + k)
  end
  run.stepper = S.sft_stepper
  local logger = run.logger
  local log_every = S.tcfg.log_every or 10
  local ckpt_every = S.tcfg.ckpt_every or 0
  while run.step < sft.steps do
    -- several ranks: row i of the step trains on rank (i - 1) mod ranks (the loss is normalised by the step's
    -- targets over every rank)
    local rows = {}
    for i = 1, sft.rows do
      if (i - 1) % S.world == S.rank then rows[#rows + 1] = row(run.step * sft.rows + i - 1) end
    end
    local rec = run:train_step(#rows > 0 and { update.sft_batch(rows) } or {}, sft.lr)
    rec.phase = "sft"
    run:record(rec)
    if run.step % log_every == 0 or run.step == sft.steps then
      logger:line(fmt("sft %d/%d  loss %.4f  lr %.3g", run.step, sft.steps, rec.loss, sft.lr))
    end
    if run:after_step(rec, ckpt_every > 0 and run.step % ckpt_every == 0) then return false end
  end
  return true
end

-- the weights RL starts from, kept as the KL term's reference: <out>/reference (never pruned); its path goes into
-- every later checkpoint, so a resumed run rebuilds the same reference
local function save_reference(S)
  local run = S.run
  if not S.out then return end
  if not run.meta then run:save() end
  local dir = S.out .. "/reference"
  -- (several ranks: the weights are the same on every rank; rank 0 writes them, the others wait for the files)
  if run.writer then
    checkpoint.save(dir, run.step, { model = S.model, keep = 1, metadata = run.meta,
      state = { format = step.FORMAT, driver = "rl", note = "the reference model of the KL term" } })
  end
  if S.group then S.group.barrier() end
  S.rl_start = dir
end

-- the reference model for the KL term: a frozen copy of the weights RL starts from
local function reference(S)
  if S.o.beta_kl <= 0 then return nil end
  if not S.ref then
    if S.rl_start then
      S.ref = (checkpoint.load_model(S.rl_start))
    else
      S.ref = nn.build(S.model.cfg)
      tide.no_grad(function()
        local src = {}
        for name, p in S.model:named_parameters() do src[name] = p end
        for name, p in S.ref:named_parameters() do p:copy_(src[name]) end
      end)
    end
    S.ref:eval()
  end
  return S.ref
end

-- prioritised prompts (rl.md §5, rl.pool = N): n distinct seeds of the pool prompt_seed .. prompt_seed + N - 1,
-- drawn without replacement with probability ∝ 1 - success rate (+ 0.05, so a solved prompt still comes back);
-- the success counts are kept in the checkpoints, the draws come from the iteration's own Philox stream
pick_from_pool = function(S, it, n)
  local o, pool = S.o, S.pool
  local stream = require("tide.rl.stream").new("rl_pool", (o.prompt_seed * 7919 + it) % 4294967296)
  local w, total = {}, 0
  for i = 1, o.pool do
    local key = tostring(o.prompt_seed + i - 1)
    local a, c = pool.attempts[key] or 0, pool.correct[key] or 0
    w[i] = 1 - (a > 0 and c / a or 0) + 0.05
    total = total + w[i]
  end
  local out = {}
  for _ = 1, math.min(n, o.pool) do
    local u, acc, pick = stream:uniform() * total, 0, o.pool
    for i = 1, o.pool do
      acc = acc + w[i]
      if w[i] > 0 and u < acc then pick = i break end
    end
    while w[pick] == 0 do pick = pick % o.pool + 1 end
    out[#out + 1] = o.prompt_seed + pick - 1
    total, w[pick] = total - w[pick], 0
  end
  return out
end

loop.pick_from_pool = function(...) return pick_from_pool(...) end

-- the pool's success counts from an iteration's samples
local function count_success(S, trajs)
  if not S.o.pool then return end
  for _, t in ipairs(trajs) do
    local key = tostring(t.seed)
    S.pool.attempts[key] = (S.pool.attempts[key] or 0) + 1
    if t.correct then S.pool.correct[key] = (S.pool.correct[key] or 0) + 1 end
  end
end

-- a sample's reward beyond the environment's: the recipe's own reward function (rl.reward), then DAPO's overlong
-- shaping. A reward function that raises or returns a non-number or a non-finite number is recorded in the
-- trajectory's errors and counted (reward_errors); the sample's terminal reward is then 0. The function sees the
-- environment's verdict in t.correct (true / false; nil when it gives none) and may set it: the accuracy metric, the
-- prompt pool and DAPO's resampling read it.
local function score(S, t, st)
  local o = S.o
  st.reward_errors = st.reward_errors or 0
  if o.reward then
    local ids = {}
    for i = 1, #t.tokens do if t.loss_mask[i] == 1 then ids[#ids + 1] = t.tokens[i] end end
    local ok, r = pcall(o.reward, t, { text = S.tok:decode(ids, true), env_reward = t.reward_terminal, seed = t.seed,
      env = t.env })
    if not ok or type(r) ~= "number" or r ~= r or r == math.huge or r == -math.huge then
      st.reward_errors = st.reward_errors + 1
      t.errors[#t.errors + 1] = not ok and ("rl.reward raised: " .. tostring(r))
        or fmt("rl.reward returned %s (counted as 0)", tostring(r))
      r = 0
    end
    t.reward_terminal = r
  end
  if o.overlong then t.reward_terminal = t.reward_terminal + rewards.overlong(t:n_policy(), o.overlong.max, o.overlong.cache) end
end

-- the counts of a rollout call (rollout.run's stats), summed over the ranks under data parallelism
local ROLL_STATS = { "samples", "tokens", "tool_calls", "tool_errors", "tool_timeouts", "malformed_calls", "env_errors",
  "nonfinite_rewards", "truncated", "finished", "forwards", "t_forward", "t_tools", "paused", "resumed", "reward_errors" }

-- this rank's share of a call's prompts: prompt k (1-based) goes to rank (k - 1) mod ranks, and keeps k as its
-- index, so its rows draw from the sampler streams they would in one process
local function my_prompts(S, prompts)
  for k, pr in ipairs(prompts) do pr.index = k end
  if not S.group then return prompts end
  local mine = {}
  for k, pr in ipairs(prompts) do if (k - 1) % S.world == S.rank then mine[#mine + 1] = pr end end
  return mine
end

-- every rank's ended samples of a call, on every rank, in one process's order (by row: uid), and the call's counts
-- summed over the ranks. A sample travels as its record (formats.md §5: the log-probs are fp32 values, the rewards
-- doubles written exactly) with the verdict the statistics read (formatted, correct, tool calls).
local function gather(S, trajs, st)
  if not S.group then return trajs, st end
  local recs = {}
  for i, t in ipairs(trajs) do
    local r = t:record()
    r.formatted, r.correct, r.calls = t.formatted, t.correct, t.calls
    recs[i] = r
  end
  local all = {}
  for r, text in ipairs(dist.gather_strings(json.encode(json.array(recs)))) do
    for j, rec in ipairs(json.decode(text)) do
      local t = traj_m.from_record(rec, fmt("rl: a sample of rank %d", r - 1))
      t.formatted, t.correct, t.calls = rec.formatted, rec.correct, rec.calls
      all[#all + 1] = { t = t, key = { t.uid or 0, r, j } }
    end
  end
  table.sort(all, function(a, b)
    local x, y = a.key, b.key
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[2] ~= y[2] then return x[2] < y[2] end
    return x[3] < y[3]
  end)
  local out = {}
  for i, e in ipairs(all) do out[i] = e.t end
  local vals = {}
  for i, k in ipairs(ROLL_STATS) do vals[i] = st[k] or 0 end
  vals = S.group.sums(vals)
  local sum = {}
  for i, k in ipairs(ROLL_STATS) do sum[k] = vals[i] end
  return out, sum
end

-- the rollouts of one iteration. DAPO's dynamic sampling (rl.md §4) drops the groups whose total rewards are all
-- equal and draws more rounds, up to max_resample, until `prompts` of the kept groups have mixed verdicts
-- (0 < #correct < G, objectives.mixed_group): a group kept for its rewards alone (a format bonus) stays in the
-- batch but does not count toward it
local function sample(S, it)
  local o = S.o
  local base = o.prompt_seed + it * o.prompts * (o.max_resample + 1)
  local kept, drawn, st_all, mixed = {}, 0, nil, 0
  local picked = o.pool and pick_from_pool(S, it, o.prompts * ((o.dynamic and o.max_resample or 0) + 1)) or nil
  local function prompts_at(k)
    local seed = picked and picked[k + 1] or (base + k)
    return { seed = seed, prompt_id = it * 100000 + k, group_id = it * 100000 + k }
  end
  for round = 0, (o.dynamic and o.max_resample or 0) do
    local need = o.prompts - (o.dynamic and mixed or #kept)
    if need <= 0 then break end
    local prompts = {}
    for j = 1, need do prompts[j] = prompts_at(drawn + j - 1) end
    drawn = drawn + need
    if o.budget then prompts = {} for j = 1, o.prompts do prompts[j] = prompts_at(j - 1) end end
    -- several ranks: each samples its share; under partial rollouts each pauses at its share of the budget and
    -- resumes its own paused samples
    local mine = my_prompts(S, prompts)
    local resume = round == 0 and S.replay or nil
    local trajs, st, paused = {}, {}, {}
    if #mine > 0 or (resume and #resume > 0) then
      trajs, st, paused = rollout.run(S.model, S.tok, { env = o.env, env_cfg = o.env_cfg, prompts = mine,
        G = o.G, max_new = o.max_new, max_turns = o.max_turns, temperature = loop.temperature_at(o, it), top_k = o.top_k,
        top_p = o.top_p, seed = (S.seed * 1000003 + it * 7919 + round) % 4294967296, policy_version = it % 32768,
        tool_timeout = o.tool_timeout, budget = o.budget and math.ceil(o.budget / S.world), resume = resume,
        resume_mode = o.resume_mode })
    end
    for _, t in ipairs(trajs) do score(S, t, st) end
    trajs, st = gather(S, trajs, st)
    if st_all then
      for k, v in pairs(st) do if type(v) == "number" then st_all[k] = (st_all[k] or 0) + v end end
    else
      st_all = st
    end
    if o.budget then S.replay = paused end
    for _, g in ipairs(complete_groups(S, trajs, o.budget ~= nil)) do
      local r = {}
      for i, t in ipairs(g) do r[i] = t:total_reward() end
      if not o.dynamic then
        kept[#kept + 1] = g
      elseif objectives.keep_group(r) then
        kept[#kept + 1] = g
        local c = {}
        for i, t in ipairs(g) do c[i] = t.correct end
        if objectives.mixed_group(r, c) then mixed = mixed + 1 end
      end
    end
    st_all.all_trajs = st_all.all_trajs or {}
    for _, t in ipairs(trajs) do st_all.all_trajs[#st_all.all_trajs + 1] = t end
  end
  return kept, st_all
end

-- the groups whose G samples have all ended: with partial rollouts, samples of a group that paused wait in S.held
-- until their siblings end (in a later iteration); without, every group of the call is complete
complete_groups = function(S, trajs, partial)
  if not partial then return groups_of(trajs) end
  local by = {}
  for _, g in ipairs(S.held) do by[g.group_id] = g end
  for _, t in ipairs(trajs) do
    local g = by[t.group_id]
    if not g then g = { group_id = t.group_id, trajs = {} }; by[t.group_id] = g; S.held[#S.held + 1] = g end
    g.trajs[#g.trajs + 1] = t
  end
  local out, keep = {}, {}
  for _, g in ipairs(S.held) do
    if #g.trajs >= S.o.G then
      table.sort(g.trajs, function(a, b) return (a.uid or 0) < (b.uid or 0) end)
      out[#out + 1] = g.trajs
    else
      keep[#keep + 1] = g
    end
  end
  S.held = keep
  return out
end

-- the sampling temperature of iteration it (0-based)
function loop.temperature_at(o, it)
  local t = o.temperature
  if type(t) ~= "table" then return t end
  local n = math.max(o.iterations - 1, 1)
  return t.from + (t.to - t.from) * math.min(it / n, 1)
end

-- the PTX batch of iteration it: rows of the chat records or of the environment's demonstrations
-- (several ranks: the rows are dealt over the `active` ranks that train groups of the update, and each part keeps
-- the whole batch's target count as its normaliser)
local function ptx_batch(S, it, active)
  local p = S.o.ptx
  if not p then return nil end
  -- built once per iteration (and share of the ranks): the updates of an iteration take the same PTX batch
  if S.ptx_it ~= it then S.ptx_it, S.ptx_memo = it, {} end
  local key = S.group and active or 1
  if S.ptx_memo[key] ~= nil then return S.ptx_memo[key] or nil end
  S.ptx_memo[key] = ptx_build(S, it, active) or false
  return S.ptx_memo[key] or nil
end

ptx_build = function(S, it, active)
  local p = S.o.ptx
  S.ptx_records = S.ptx_records or (p.data and loop.read_chat(S.tok, p.data)) or false
  local env = S.ptx_records == false and rollout.make_env(S.o.env, S.o.env_cfg) or nil
  local rows = {}
  for i = 1, p.rows do
    local k = it * p.rows + i - 1
    rows[i] = S.ptx_records and S.ptx_records[k % #S.ptx_records + 1] or loop.demo_trajectory(env, S.tok, 2000000 + k)
  end
  local b = update.sft_batch(rows)
  b.weight = p.weight
  if S.group and active > 1 then
    local mine = {}
    for i, t in ipairs(rows) do if (i - 1) % active == S.rank then mine[#mine + 1] = t end end
    if #mine == 0 then return nil end
    local n = b.n_targets
    b = update.sft_batch(mine)
    b.weight, b.n_targets = p.weight, n
  end
  return b
end

-- an update's statistics over every rank's share (a collective): the policy-token means weighted by each rank's
-- tokens, the PTX loss summed (each rank's part already has the whole batch's normaliser)
local MEAN_STATS = { "entropy", "clip_frac", "kl", "tis_mean", "tis_clip_rate", "ratio" }
update_stats = function(S, b)
  local st = b and b.stats or {}
  local n = b and b.n_targets or 0
  local vals = { n, (b and b.ptx and st.ptx_loss) or 0, b and b.ptx and 1 or 0 }
  for i, k in ipairs(MEAN_STATS) do
    local v = k == "tis_clip_rate" and b and b.tis_clip_rate or st[k]
    vals[3 + 2 * i - 1], vals[3 + 2 * i] = (v or 0) * n, v ~= nil and 1 or 0
  end
  vals = S.group.sums(vals)
  local out = {}
  if vals[3] > 0 then out.ptx_loss = vals[2] end
  for i, k in ipairs(MEAN_STATS) do
    if vals[3 + 2 * i] > 0 then out[k] = vals[1] > 0 and vals[3 + 2 * i - 1] / vals[1] or 0 end
  end
  return out
end

-- the length reward (K1.5) added to each group's terminal rewards
local function shape_rewards(S, groups)
  local w = S.o.length_weight
  if w <= 0 then return end
  for _, g in ipairs(groups) do
    local lens, ok = {}, {}
    for i, t in ipairs(g) do lens[i], ok[i] = t:n_policy(), t.correct == true end
    local lr = rewards.length(lens, ok)
    for i, t in ipairs(g) do t.reward_terminal = t.reward_terminal + w * lr[i] end
  end
end

local function rl_iteration(S)
  local run, o, it = S.run, S.o, S.iteration
  local t0 = tide.time()
  local groups, st = sample(S, it)
  local t_sample = tide.time() - t0
  local rec = traj_stats(st.all_trajs)
  count_success(S, st.all_trajs)
  -- every sample of the iteration, as JSONL (formats.md §5): <run>/trajectories/iter_NNNNNN.jsonl
  if o.save_trajectories and S.out and S.run.writer then
    local dir = S.out .. "/trajectories"
    if tide.C.tide_mkdir_p(dir) ~= 0 then bad("cannot create " .. dir, 0) end
    traj_m.write(fmt("%s/iter_%06d.jsonl", dir, it + 1), st.all_trajs)
  end
  rec.phase, rec.iteration = "rl", it + 1
  rec.zero_var_groups = 1 - #groups / math.max(#groups_of(st.all_trajs), 1)
  rec.tool_errors, rec.malformed_calls, rec.env_errors = st.tool_errors, st.malformed_calls, st.env_errors
  rec.nonfinite_rewards, rec.tool_timeouts = st.nonfinite_rewards, st.tool_timeouts
  rec.reward_errors = st.reward_errors
  rec.staleness = 0
  rec.paused = S.group and S.group.sum(#S.replay) or #S.replay
  shape_rewards(S, groups)
  local t1 = tide.time()
  local loss_sum, n_up, stats = 0, 0, {}
  if #groups > 0 then
    -- the U minibatches: groups dealt round-robin; several ranks: the j-th group of a minibatch trains on rank
    -- (j - 1) mod ranks (a rank left without a group joins the step with no micro-batch)
    local mbs = {}
    for u = 1, math.min(o.updates, #groups) do mbs[u] = {} end
    for i, g in ipairs(groups) do
      local mb = mbs[(i - 1) % #mbs + 1]
      mb[#mb + 1] = g
    end
    local batches, age, age_n = {}, 0, 0
    for u, mb in ipairs(mbs) do
      local mine, all_n = {}, 0
      for j, g in ipairs(mb) do
        if (j - 1) % S.world == S.rank then for _, t in ipairs(g) do mine[#mine + 1] = t end end
        all_n = all_n + 1
      end
      if #mine > 0 then
        batches[u] = update.batch(mine, { credit = o.credit, stale = o.stale, max_staleness = o.max_staleness,
          version = it % 32768 })
        batches[u].active = math.min(all_n, S.world)   -- the ranks that hold groups of this update
        age, age_n = age + batches[u].staleness * batches[u].n_targets, age_n + batches[u].n_targets
      else
        batches[u] = false
      end
    end
    if S.group then local t = S.group.sums({ age, age_n }); age, age_n = t[1], t[2] end
    -- the mean age over the policy tokens (one process: the mean of the minibatches' means, as before)
    if S.group then
      rec.staleness = age_n > 0 and age / age_n or 0
    else
      local a = 0
      for _, b in ipairs(batches) do a = a + b.staleness / #batches end
      rec.staleness = a
    end
    local ref = reference(S)
    for _, b in ipairs(batches) do
      if b and ref then update.set_ref(b, update.score(ref, b)) end
      if b and o.tis then b.tis_clip_rate = update.set_tis(b, update.score(S.model, b), o.C_tis) end
    end
    run.stepper = S.rl_stepper
    -- K1.5 resets the optimiser every iteration (rl.reset_optimizer): AdamW's moments and step count start over
    if o.reset_optimizer and S.opt.params then
      for _, p in ipairs(S.opt.params) do
        if p.m then p.m:zero_() end
        if p.v then p.v:zero_() end
      end
      S.opt.t = 0
    end
    for _, b in ipairs(batches) do
      if b then b.ptx = ptx_batch(S, it, b.active) end
      local r = run:train_step(b and { b } or {}, o.lr)
      loss_sum, n_up = loss_sum + r.loss, n_up + 1
      if b then
        for k, v in pairs(b.stats or {}) do stats[k] = v end
        stats.tis_clip_rate = b.tis_clip_rate
      end
      if S.group then stats = update_stats(S, b) end
      rec.grad_norm, rec.lr, rec.step, rec.time, rec.tokens = r.grad_norm, r.lr, r.step, r.time, r.tokens
      rec.mem_current, rec.mem_peak, rec.skipped = r.mem_current, r.mem_peak, r.skipped
      rec.stop = r.stop
    end
  else
    rec.step, rec.time, rec.tokens = run.step, os.time(), run.tokens
  end
  rec.loss = n_up > 0 and loss_sum / n_up or 0
  rec.updates = n_up
  for _, k in ipairs { "entropy", "clip_frac", "kl", "tis_mean", "tis_clip_rate", "ratio", "ptx_loss" } do rec[k] = stats[k] end
  rec.temperature = loop.temperature_at(o, it)
  rec.t_sample, rec.t_update = t_sample, tide.time() - t1
  rec.sample_tok_per_s = st.tokens / math.max(t_sample, 1e-9)
  S.iteration = it + 1
  return rec
end

local function progress_line(S, rec)
  return fmt("iter %d/%d  reward %.3f ± %.3f  format %.2f  acc %.2f  len %.1f  loss %.4f  entropy %s  %s tok/s sampling",
    rec.iteration, S.o.iterations, rec.reward_mean, rec.reward_std, rec.format_rate, rec.accuracy, rec.response_len,
    rec.loss, rec.entropy and fmt("%.3f", rec.entropy) or "-", log.si(rec.sample_tok_per_s))
end

function loop.run(cfg)
  -- several ranks would each run the whole loop into the same run directory: refused before anything is written
  local S = setup(cfg)
  local run = S.run
  local st = run:open(cfg.resume, cfg.overwrite)
  local logger = run.logger
  if st then logger:line(fmt("resumed from %s at step %d (%s, iteration %d)", run.resumed_from, run.step, S.phase, S.iteration)) end
  logger:line(fmt("model: %s", S.model:extra_repr()))
  logger:line(fmt("rl: %s on %s, %d prompts x G %d per iteration, %d iterations%s", S.o.objective,
    type(S.o.env) == "string" and S.o.env or "a recipe environment", S.o.prompts, S.o.G, S.o.iterations,
    S.group and fmt("; data parallel over %d ranks (each samples and trains its share of the prompts)", S.world) or ""))
  if S.group then logger:line(dist.memory_line(S.opt, S.layout)) end
  local stopped = false
  if S.phase == "sft" then
    stopped = not sft_phase(S)
    if not stopped then
      S.phase = "rl"
      run:save()
    end
  end
  if not stopped and S.phase == "rl" and S.o.beta_kl > 0 and not S.rl_start then save_reference(S) end
  local ckpt_every = S.tcfg.ckpt_every or 0
  local log_every = S.tcfg.log_every or 1
  while not stopped and S.iteration < S.o.iterations do
    local rec = rl_iteration(S)
    run:record(rec)
    S.history[rec.iteration] = { reward = rec.reward_mean, format = rec.format_rate, accuracy = rec.accuracy }
    if rec.iteration % log_every == 0 or rec.iteration == S.o.iterations then logger:line(progress_line(S, rec)) end
    if rec.stop then stopped = true break end
    if run:after_step(rec, ckpt_every > 0 and rec.iteration % ckpt_every == 0 and rec.iteration < S.o.iterations) then
      stopped = true
    end
  end
  local r = run:finish()
  r.history, r.iterations = S.history, S.iteration
  r.model, r.tokenizer = S.model, S.tok
  return r, S
end

-- the recipe's expect bounds over the iteration history: {misses}
function loop.check(cfg, r)
  local e, miss, h = cfg.expect or {}, {}, r.history or {}
  local n = #h
  if e.format_rate_above and n > 0 then
    local best = 0
    for _, x in ipairs(h) do best = math.max(best, x.format) end
    if best < e.format_rate_above then miss[#miss + 1] = fmt("format rate reached %.3f, expected above %.3f", best, e.format_rate_above) end
  end
  if e.reward_rises and n >= 4 then
    -- the mean reward of the last 40% of iterations above the first 40%
    local k = math.max(1, math.floor(n * 0.4))
    local a, b = 0, 0
    for i = 1, k do a = a + h[i].reward / k end
    for i = n - k + 1, n do b = b + h[i].reward / k end
    r.reward_first, r.reward_last = a, b
    if not (b > a) then miss[#miss + 1] = fmt("mean reward of the last %d iterations %.4f is not above the first %d's %.4f", k, b, k, a) end
  end
  if e.reward_above and n > 0 and not (h[n].reward > e.reward_above) then
    miss[#miss + 1] = fmt("final mean reward %.4f, expected above %.4f", h[n].reward, e.reward_above)
  end
  return miss
end

-- Recipe(spec) -> the recipe table (kind = "rl", run)
function loop.new(spec)
  if type(spec) ~= "table" then bad("Recipe{...} takes a table", 2) end
  options.check(spec, TOP, "Recipe{...}", WHO)
  spec.kind = "rl"
  spec.run = function(cfg)
    local r = loop.run(cfg)
    if r.stopped then return 1 end
    local miss = loop.check(cfg, r)
    -- (every rank holds the same history: rank 0 alone says what was missed)
    if dist.is_root() then
      for _, line in ipairs(miss) do io.stderr:write(cfg.check and "" or "warning: ", line, "\n") end
    end
    return (#miss > 0 and cfg.check) and 1 or 0
  end
  return spec
end

return loop
