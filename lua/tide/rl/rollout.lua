-- tide.rl.rollout: multi-turn sampling with tool calls on the model's caches (rl.md §1-§3, §5).
--
--   local trajs, stats = rollout.run(model, tok, {
--     env = "countdown" | table | function() -> env, env_cfg = {...},
--     prompts = {{seed = 17, prompt_id = 0, index = nil | k}, ...}, G = 8,
--     max_new = 256, max_turns = 16, temperature = 1, top_k, top_p, seed = 0, policy_version = 0,
--     tool_timeout = 10, slots = 64, budget = nil | tokens, resume = entries, resume_mode = "prefill"})
--
-- Every (prompt, sample) is a row with its own caches. The prompt is prefilled once per prompt and its caches are
-- copied to the G rows. Every forward is schedule-invariant (the model's `exact` forward, when it has one): a
-- token's logits are the same bits whether it went in with a prefill, a decoding step or a tool result, so the
-- continuation after a tool call equals a re-prefill of the whole context, and a paused row re-prefilled in one call
-- resumes exactly where it stopped. A row samples until <|tool_call_end|> (the environment runs the call; its result is fed into
-- the caches and sampling resumes: the prefix is never re-run), <|im_end|> (the turn ends: the environment scores it
-- or answers with an observation) or its budget. Tools run as Lua coroutines: a tool may coroutine.yield() while it
-- waits (rollout.wait(seconds) does), and the other rows keep decoding; a row whose call takes longer than
-- tool_timeout gets an error result. At most `slots` rows are live; a finished row's slot takes the next sample.
-- Each row draws from its own Philox stream (seed, row), so a row's tokens do not depend on the others. Row g of
-- prompt k is row (k - 1) G + g - 1, k the prompt's place in the list or its `index` (a call given a share of a
-- larger list: its rows draw what they would in one call of the whole list).
--
-- What goes wrong is recorded, never raised: an environment that raises, a tool that raises or returns non-text, a
-- malformed call, a non-finite reward — each lands in the trajectory's errors and in the counts of stats. A malformed
-- call still reaches the environment, as {call = {malformed = why, text = text}}: its reward (a process cost) counts.
-- The policy's log-prob of each sampled token (temperature 1, whatever the sampling temperature) is logp_old.
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local defaults = require "tide.defaults"
local generate = require "tide.generate"
local traj_m = require "tide.rl.traj"
local markup = require "tide.rl.markup"
local rewards = require "tide.rl.rewards"

local C = tide.C
local rollout = {}
local fmt, exp, log = string.format, math.exp, math.log
local ROLE = traj_m.ROLE

ffi.cdef [[ int usleep(unsigned int usec); ]]

local KEYS = { env = true, env_cfg = true, prompts = true, G = true, max_new = true, max_turns = true,
  temperature = true, top_k = true, top_p = true, seed = true, policy_version = true, tool_timeout = true,
  slots = true, repetition = true, budget = true, resume = true, resume_mode = true }

-- wait(seconds): inside a tool, yield to the sampler until `seconds` have passed
function rollout.wait(seconds)
  local t_end = tide.time() + seconds
  while tide.time() < t_end do coroutine.yield() end
end

local function link_key(k) return type(k) == "string" and (k:sub(-4) == "_buf" or k == "stack" or k == "stack_i") end

local function copy_cache(c)
  if tide.is_tensor(c) then return c:clone() end
  if type(c) ~= "table" then return c end
  local out = {}
  for k, v in pairs(c) do
    -- the MLA append buffers are rebuilt from the filled views on the next append; a KDA row's link to the stack
    -- of its last batched step is dropped (the copy's views are its own)
    if not link_key(k) then out[k] = copy_cache(v) end
  end
  return out
end
rollout.copy_cache = copy_cache

-- the caches of B rows at one length as one cache of B rows (tensors stacked on dim 1; buffers and stack links
-- left out: the next append rebuilds them), and back (each row's views of the stacked tensors)
local function stack_caches(list)
  local first, out = list[1], {}
  for k, v in pairs(first) do
    if not link_key(k) then
      if tide.is_tensor(v) then
        local parts = {}
        for i, c in ipairs(list) do parts[i] = c[k] end
        out[k] = tide.F.concat(parts, 1)
      elseif type(v) == "table" then
        local parts = {}
        for i, c in ipairs(list) do parts[i] = c[k] end
        out[k] = stack_caches(parts)
      else
        for _, c in ipairs(list) do
          if c[k] ~= v then error(fmt("rl.rollout: caches to stack differ in %s (%s, %s)", tostring(k), tostring(v), tostring(c[k])), 0) end
        end
        out[k] = v
      end
    end
  end
  return out
end

local function split_cache(c, b)
  if tide.is_tensor(c) then return c:narrow(1, b, 1) end
  if type(c) ~= "table" then return c end
  local out = {}
  for k, v in pairs(c) do if k ~= "stack" and k ~= "stack_i" then out[k] = split_cache(v, b) end end
  return out
end

-- a row's logits: {a = double[] (an FFI array), o = offset, V = V} — the values of one position read straight from
-- the forward's output, no Lua table per step
local function logits_at(a, o, V) return { a = a, o = o, V = V } end
local function logits_of_list(l)
  local a = ffi.new("double[?]", #l)
  for i = 1, #l do a[i - 1] = l[i] end
  return logits_at(a, 0, #l)
end
local function logits_list(L)
  local l, a, o = {}, L.a, L.o
  for i = 1, L.V do l[i] = a[o + i - 1] end
  return l
end
rollout.logits_list = logits_list

-- the log-softmax value of entry id (0-based) of a list of logits
local function logp_of(lg, id)
  local m = -math.huge
  for i = 1, #lg do if lg[i] > m then m = lg[i] end end
  local s = 0
  for i = 1, #lg do s = s + exp(lg[i] - m) end
  return lg[id + 1] - m - log(s)
end

-- sample from the whole distribution at temperature 1 (no top-k / top-p) -> id, its log-prob: the same id as
-- generate.sample and the same log-prob as logp_of, from one exp per entry instead of three
local scratch = ffi.new("double[?]", 1)
local scratch_n = 1
local function sample_t1(L, u)
  local V, a, o, m = L.V, L.a, L.o, -math.huge
  if V > scratch_n then scratch, scratch_n = ffi.new("double[?]", V), V end
  for i = 0, V - 1 do if a[o + i] > m then m = a[o + i] end end
  local total = 0
  for i = 0, V - 1 do
    local p = exp(a[o + i] - m)
    scratch[i] = p
    total = total + p
  end
  local target, acc, last, id = u * total, 0, 0, nil
  for i = 0, V - 1 do
    local p = scratch[i]
    acc = acc + p
    if p > 0 then last = i end
    if target < acc then id = i break end
  end
  id = id or last
  return id, a[o + id] - m - log(total)
end

-- the forward options of a rollout: exact (schedule-invariant) where the model has it (nn.HybridLM), and the last
-- position's logits alone (a rollout samples from those)
local EXACT = { exact = true, last = true }
local function forward_opts(model) return model.schedule_invariant and EXACT or nil end
rollout.forward_opts = forward_opts

-- forward ids (a Lua list) through the caches -> the last position's logits (a row's logits, above)
local function feed_logits(model, cache, ids)
  local logits = model:forward(tide.tensor({ ids }, { dtype = "i32" }), cache, forward_opts(model))
  local a, n = logits:narrow(2, logits:size(2), 1):f64_array()
  return logits_at(a, 0, n)
end
-- the same as a Lua list
function rollout.feed(model, cache, ids) return logits_list(feed_logits(model, cache, ids)) end

local function make_env(spec, cfg)
  local rl = require "tide.rl"
  if type(spec) == "function" then return rl.env(spec()) end
  if type(spec) == "table" then
    -- a user table: each row gets its own instance (a shallow copy keeps its methods)
    local inst = setmetatable({}, { __index = spec })
    return rl.env(inst)
  end
  return rl.env(spec, cfg)
end

rollout.make_env = make_env

local function finite(x) return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge end

function rollout.run(model, tok, o)
  options.check(o, KEYS, "rollout options", "rl.rollout")
  local who = "rl.rollout"
  if type(o.prompts) ~= "table" or (#o.prompts == 0 and not (o.resume and #o.resume > 0)) then
    options.fail(who, "prompts must be a non-empty list of {seed = ...}")
  end
  local budget = o.budget ~= nil and options.pos_int(o.budget, "budget", who) or nil
  local resume_mode = o.resume_mode or defaults.rl.resume_mode
  options.one_of(resume_mode, { replay = true, prefill = true, state = true }, "resume_mode", who)
  local G = o.G == nil and 1 or options.pos_int(o.G, "G", who)
  local max_new = o.max_new == nil and 256 or options.pos_int(o.max_new, "max_new", who)
  local max_turns = o.max_turns == nil and 16 or options.pos_int(o.max_turns, "max_turns", who)
  local timeout = o.tool_timeout == nil and 10 or options.positive_number(o.tool_timeout, "tool_timeout", who)
  local slots = o.slots == nil and 64 or options.pos_int(o.slots, "slots", who)
  local seed = o.seed == nil and 0 or options.seed(o.seed, "seed", who)
  local version = o.policy_version or 0
  local sample_opts = { temperature = o.temperature == nil and 1 or o.temperature, top_k = o.top_k, top_p = o.top_p }
  local plain_t1 = sample_opts.temperature == 1 and (not o.top_k or o.top_k <= 0) and (not o.top_p or o.top_p >= 1)
  local check_rep = o.repetition ~= false
  local mk = markup.new(tok)
  local sp = mk.sp
  local eos = tok.specials["<|endoftext|>"]
  local u = ffi.new("double[1]")
  local st = { samples = 0, tokens = 0, tool_calls = 0, tool_errors = 0, tool_timeouts = 0, malformed_calls = 0,
    env_errors = 0, nonfinite_rewards = 0, truncated = 0, finished = 0, forwards = 0, t_forward = 0, t_tools = 0,
    paused = 0, resumed = 0, t_resume_prompts = 0 }
  local out = {}

  local function timed_feed(cache, ids)
    local t0 = tide.time()
    local lg = feed_logits(model, cache, ids)
    st.forwards, st.t_forward = st.forwards + 1, st.t_forward + (tide.time() - t0)
    return lg
  end
  -- a row's forward: its schedule (the token counts of its forward calls) is what a re-prefill replays
  local function row_feed(row, ids)
    row.schedule[#row.schedule + 1] = #ids
    row.logits = timed_feed(row.cache, ids)
  end
  -- rows (or prompts) that stand at one length, their next tokens ids[i] (all of one length) as one [#c, L] forward
  -- over their caches stacked; each gets its views of the stacked caches and its last logits
  local function stacked_forward(c, ids)
    if #c == 1 then
      c[1].logits = timed_feed(c[1].cache, ids[1])
      return
    end
    local caches = {}
    for i, row in ipairs(c) do caches[i] = row.cache end
    local batch = stack_caches(caches)
    local t0 = tide.time()
    local logits = model:forward(tide.tensor(ids, { dtype = "i32" }), batch, forward_opts(model))
    local a, nv = logits:narrow(2, logits:size(2), 1):f64_array()
    st.forwards, st.t_forward = st.forwards + 1, st.t_forward + (tide.time() - t0)
    local V = nv / #c
    for i, row in ipairs(c) do row.cache, row.logits = split_cache(batch, i), logits_at(a, (i - 1) * V, V) end
  end
  -- stages(items, tokens_of): the items' token lists run from their caches (all at one length) as few stacked
  -- forwards as their lengths allow: every item's next L tokens, L the shortest remainder, the finished items leaving
  -- the batch. With a schedule-invariant model each item's caches and logits are the bits of one call over its tokens.
  -- calls(item, L) notes each call
  local function stages(items, tokens_of, calls)
    local active = {}
    for i, it in ipairs(items) do active[i] = { it = it, n = #tokens_of(it), i = i } end
    table.sort(active, function(a, b) if a.n ~= b.n then return a.n < b.n end return a.i < b.i end)
    local pos, first = 0, 1
    while first <= #active do
      local L = active[first].n - pos
      local part, ids = {}, {}
      for i = first, #active do
        local it, tk, row = active[i].it, tokens_of(active[i].it), {}
        for j = 1, L do row[j] = tk[pos + j] end
        part[#part + 1], ids[#ids + 1] = it, row
        if calls then calls(it, L) end
      end
      stacked_forward(part, ids)
      pos = pos + L
      while first <= #active and active[first].n == pos do first = first + 1 end
    end
  end

  -- prompt prefills: a prompt runs once and its caches are copied to its rows. The prompts that rows start with in
  -- one pass wait for one batched prefill (run_prefills: in stages on a schedule-invariant model, whose bits do not
  -- depend on the batch, else one forward per prompt); a row started later takes the caches kept for it
  local waiting = {}
  local function attach(pf, row)
    if pf.shared then
      row.cache = copy_cache(pf.cache)
    else
      pf.users = pf.users - 1
      row.cache = pf.users > 0 and copy_cache(pf.cache) or pf.cache
      if pf.users == 0 and pf.done then pf.done(pf) end
    end
    row.logits = pf.logits
  end
  local function want_prefill(pf, row)
    if pf.cache then attach(pf, row) return end
    if not pf.rows then
      pf.rows = {}
      waiting[#waiting + 1] = pf
    end
    pf.rows[#pf.rows + 1] = row
  end
  local function run_prefills()
    if #waiting == 0 then return 0 end
    local t0, list = tide.time(), waiting
    waiting = {}
    for _, pf in ipairs(list) do pf.cache = model:new_cache() end
    if model.schedule_invariant and #list > 1 then
      stages(list, function(pf) return pf.tokens end)
    else
      for _, pf in ipairs(list) do pf.logits = timed_feed(pf.cache, pf.tokens) end
    end
    for _, pf in ipairs(list) do
      local rows = pf.rows
      pf.rows = nil
      for _, row in ipairs(rows) do attach(pf, row) end
    end
    return tide.time() - t0
  end
  -- one decoding step of the rows that each sampled a token (row.next_id): one batched forward over their own
  -- caches (model:decode_rows), whose logits are bitwise each row's step alone, so the batch a row decodes in
  -- does not change its tokens; models without decode_rows step row by row
  local batched = type(model.decode_rows) == "function"
  local function feed_rows(rows)
    if #rows == 0 then return end
    if not batched or #rows == 1 then
      for _, row in ipairs(rows) do row_feed(row, { row.next_id }) end
      return
    end
    local ids, caches = {}, {}
    for i, row in ipairs(rows) do
      ids[i], caches[i] = row.next_id, row.cache
      row.schedule[#row.schedule + 1] = 1
    end
    local t0 = tide.time()
    local a, n = model:decode_rows(tide.tensor(ids, { dtype = "i32", shape = { #rows, 1 } }), caches):f64_array()
    st.forwards, st.t_forward = st.forwards + 1, st.t_forward + (tide.time() - t0)
    local V = n / #rows
    for i, row in ipairs(rows) do row.logits = logits_at(a, (i - 1) * V, V) end
  end
  local stepping = {}   -- the rows whose sampled token waits for this pass's batched step

  local function fail_row(row, what)
    row.traj.errors[#row.traj.errors + 1] = what
    row.done = true
  end

  -- the rows of prompt p: one prefill, its caches copied to each row
  local pending, next_pending = {}, 1
  for p, pr in ipairs(o.prompts) do
    for g = 1, G do pending[#pending + 1] = { p = p, g = g, pr = pr } end
  end
  local prefills = {}

  local function start(item)
    local pr = item.pr
    local t = traj_m.new { prompt_id = pr.prompt_id or (item.p - 1), group_id = pr.group_id or (item.p - 1),
      env = type(o.env) == "string" and o.env or "custom", seed = pr.seed or 0 }
    local row = { traj = t, uid = item.uid or (((pr.index or item.p) - 1) * G + (item.g - 1)), draws = 0, n_new = 0, turn = 0,
      calls = 0, seed = item.seed or seed, env_seed = pr.seed or 0, prompt = pr, schedule = {}, actions = {} }
    t.uid = row.uid
    out[#out + 1] = t
    st.samples = st.samples + 1
    local okm, env = pcall(make_env, o.env, o.env_cfg)
    if not okm then error(env, 0) end   -- a bad environment spec is the recipe's error, not a row's
    row.env = env
    local ok, obs = pcall(env.reset, env, pr.seed or 0)
    if not ok or type(obs) ~= "table" or type(obs.prompt) ~= "string" then
      st.env_errors = st.env_errors + 1
      fail_row(row, ok and "env.reset did not return {prompt = string}" or ("env.reset raised: " .. tostring(obs)))
      return row
    end
    mk:prompt(t, obs)
    local key = item.key or item.p
    local pf = prefills[key]
    if not pf then
      local ids = {}
      for j = 1, t:len() do ids[j] = t.tokens[j] end
      pf = { tokens = ids, users = item.users or G, done = function() prefills[key] = nil end }
      prefills[key] = pf
    end
    row.schedule[1] = t:len()
    want_prefill(pf, row)
    return row
  end

  local function add_reward(row, r, what)
    if r == nil then return 0 end
    if not finite(r) then
      st.nonfinite_rewards = st.nonfinite_rewards + 1
      row.traj.errors[#row.traj.errors + 1] = fmt("%s reward is %s (counted as 0)", what, tostring(r))
      return 0
    end
    return r
  end

  local function finish(row, terminal, truncated, res)
    local t = row.traj
    t.calls = row.calls
    -- the verdict: true / false as the environment gives it; nil when it gives none (DAPO's resampling counts
    -- such groups by their rewards alone)
    if res then
      t.formatted = res.formatted == true
      if res.correct ~= nil then t.correct = res.correct == true end
    end
    t.reward_terminal = add_reward(row, terminal, "terminal")
    t.truncated, t.finished = truncated or false, not truncated
    if truncated then st.truncated = st.truncated + 1; t.reward_terminal = 0 else st.finished = st.finished + 1 end
    row.done, row.cache = true, nil
  end

  local function turn_reward(row, r)
    local t = row.traj
    t.rewards_turn[row.turn + 1] = (t.rewards_turn[row.turn + 1] or 0) + add_reward(row, r, "process")
  end

  -- the environment's answer to a call: its result fed into the caches with the call's end token
  local function deliver(row, ok, res)
    local t = row.traj
    local text
    if not ok then
      st.tool_errors = st.tool_errors + 1
      text = "error: the tool failed"
      t.errors[#t.errors + 1] = "tool raised: " .. tostring(res)
    elseif type(res) ~= "table" or type(res.result) ~= "string" then
      st.tool_errors = st.tool_errors + 1
      text = "error: the tool returned no text"
      t.errors[#t.errors + 1] = fmt("tool returned %s", type(res) == "table" and ("a " .. type(res.result) .. " result") or ("a " .. type(res)))
    else
      text = res.result
      turn_reward(row, res.reward)
      if res.invalid then st.tool_errors = st.tool_errors + 1 end
    end
    local before = t:len()
    mk:tool_result(t, text, row.turn)
    local ids = { sp.call_end }
    for i = before + 1, t:len() do ids[#ids + 1] = t.tokens[i] end
    row.turn = row.turn + 1
    row_feed(row, ids)
    row.co = nil
  end

  local function call_tool(row)
    local t = row.traj
    st.tool_calls = st.tool_calls + 1
    row.calls = row.calls + 1
    local text, why = mk:call_text(t)
    local name, args
    if text then name, args = markup.parse_call(text) if not name then why = args end end
    if not name then
      st.malformed_calls = st.malformed_calls + 1
      t.errors[#t.errors + 1] = why
      -- the environment still sees the attempt (a process cost counts every call, rl.md §6): a call without a
      -- name, {call = {malformed = why, text = text}}; its reward counts, the result is the parser's error
      local action = { call = { malformed = why, text = text } }
      row.actions[#row.actions + 1] = action
      local ok, res = pcall(row.env.step, row.env, action)
      if not ok then
        st.env_errors = st.env_errors + 1
        t.errors[#t.errors + 1] = "env.step raised on a malformed call: " .. tostring(res)
      end
      deliver(row, true, { result = "error: " .. why, reward = ok and type(res) == "table" and res.reward or 0 })
      return
    end
    local env = row.env
    row.actions[#row.actions + 1] = { call = { name = name, args = args } }
    local co = coroutine.create(function() return env:step { call = { name = name, args = args } } end)
    local t0 = tide.time()
    local ok, res = coroutine.resume(co)
    st.t_tools = st.t_tools + (tide.time() - t0)
    if coroutine.status(co) == "dead" then deliver(row, ok, res) return end
    row.co, row.t_call = co, t0
  end

  local function end_turn(row)
    local t = row.traj
    local text = mk:turn_text(t)
    row.actions[#row.actions + 1] = { text = text }
    local ok, res = pcall(row.env.step, row.env, { text = text })
    if not ok or type(res) ~= "table" then
      st.env_errors = st.env_errors + 1
      t.errors[#t.errors + 1] = ok and "env.step did not return a table" or ("env.step raised: " .. tostring(res))
      finish(row, 0, false)
      return
    end
    turn_reward(row, res.reward)
    if res.done then finish(row, res.terminal or 0, false, res) return end
    row.turn = row.turn + 1
    if row.turn >= max_turns then finish(row, 0, true) return end
    local before = t:len()
    if type(res.observation) == "string" then
      mk:observation(t, res.observation, row.turn)
    else
      mk:assistant_header(t, row.turn)
    end
    local ids = { t.tokens[before] }   -- the <|im_end|> the policy wrote
    for i = before + 1, t:len() do ids[#ids + 1] = t.tokens[i] end
    row_feed(row, ids)
  end

  local function decode(row)
    local t = row.traj
    C.tide_philox_uniform(row.seed, ffi.cast("uint64_t", row.uid) * 1048576 + row.draws, u, 1)
    row.draws = row.draws + 1
    local id, logp
    if plain_t1 then
      id, logp = sample_t1(row.logits, u[0])
    else
      local l = logits_list(row.logits)
      id = generate.sample(l, sample_opts, u[0])
      logp = logp_of(l, id)
    end
    t:push(id, ROLE.assistant, 1, logp, version, row.turn)
    row.n_new = row.n_new + 1
    st.tokens = st.tokens + 1
    if id == sp.call_end then
      if row.calls >= max_turns or row.n_new >= max_new then finish(row, 0, true) return end
      call_tool(row)
    elseif id == sp.im_end or id == eos then
      end_turn(row)
    elseif row.n_new >= max_new or (check_rep and rewards.repeated(t.tokens)) then
      finish(row, 0, true)
    else
      row.next_id = id
      stepping[#stepping + 1] = row
    end
  end

  -- a paused row as a replay-buffer entry (JSON-safe but for `state`, the caches of the saved-state path)
  local function pause(row)
    st.paused = st.paused + 1
    row.traj.paused = true
    return { traj = row.traj:record(), seed = row.seed, uid = row.uid, draws = row.draws, n_new = row.n_new,
      turn = row.turn, calls = row.calls, env_seed = row.env_seed, prompt = row.prompt, schedule = row.schedule,
      actions = row.actions, state = { cache = row.cache, logits = logits_list(row.logits) } }
  end

  -- a replay-buffer entry back to a live row: the environment rebuilt by replaying its actions (environments are
  -- deterministic given their seed), then the caches:
  --   "state"    the saved caches (in memory; bit-identical, no compute)
  --   "prefill"  the prompt, then one forward over the rest of the prefix (the default, and the path after a
  --              checkpoint: caches are not saved): bit-identical with a schedule-invariant model (nn.HybridLM's
  --              exact forward), to f32 rounding with others, at a fraction of the original forwards' cost
  --   "replay"   the row's forward schedule replayed on fresh caches: the same calls, so the same bits with any
  --              model, at the cost of the original forwards
  -- (replay and prefill run each prompt once and copy its caches to the rows of its group that resume)
  local resumed_prompts = {}
  local function restore(e)
    local t = traj_m.from_record(e.traj, "rl.rollout: a paused trajectory")
    local row = { traj = t, uid = e.uid, draws = e.draws, n_new = e.n_new, turn = e.turn, calls = e.calls,
      seed = e.seed, env_seed = e.env_seed, prompt = e.prompt, schedule = {}, actions = e.actions }
    t.uid = e.uid
    out[#out + 1] = t
    local env = make_env(o.env, o.env_cfg)
    row.env = env
    env:reset(e.env_seed)
    for _, a in ipairs(e.actions) do env:step(a) end
    if resume_mode == "state" and e.state and e.state.cache then
      row.cache, row.logits = e.state.cache, logits_of_list(e.state.logits)
      for i, n in ipairs(e.schedule) do row.schedule[i] = n end
    else
      -- the prompt (the schedule's first call) is run once per prompt and its caches copied to the group's rows,
      -- as when they were first sampled; then the rest of the prefix: its calls one by one (replay) or one chunk
      local n1 = e.schedule[1]
      if type(n1) ~= "number" or n1 < 1 or n1 > t:len() then
        error(fmt("rl.rollout: a paused trajectory's schedule does not start with its prompt (%s)", tostring(n1)), 0)
      end
      local key = fmt("%s|%d", tostring(t.prompt_id), n1)
      local shared = resumed_prompts[key]
      if shared then
        for j = 1, n1 do
          if t.tokens[j] ~= shared.tokens[j] then shared = nil break end
        end
      end
      if not shared then
        local ids = {}
        for j = 1, n1 do ids[j] = t.tokens[j] end
        shared = { tokens = ids, shared = true }
        resumed_prompts[key] = shared
      end
      row.schedule[1] = n1
      want_prefill(shared, row)
      local pos = n1
      if resume_mode == "prefill" then
        if pos < t:len() then
          local ids = {}
          for j = pos + 1, t:len() do ids[#ids + 1] = t.tokens[j] end
          -- run with the other resumed rows of its prompt (prefill_all)
          row.prefill_ids, row.prefill_key, row.prefill_prompt = ids, fmt("%s|%d", key, #ids), key
          pos = t:len()
        end
      else
        -- the calls after the prompt, replayed with the other resumed rows' (replay_all): single tokens as batched
        -- steps, the rest row by row; a row's bits do not depend on the batch it steps in
        local n_rest = 0
        for k = 2, #e.schedule do n_rest = n_rest + e.schedule[k] end
        row.replay, row.replay_k, row.replay_pos = e.schedule, 2, pos
        pos = pos + n_rest
      end
      if pos ~= t:len() then error(fmt("rl.rollout: a paused trajectory's schedule covers %d of its %d tokens", pos, t:len()), 0) end
    end
    st.resumed = st.resumed + 1
    return row
  end

  -- replay the restored rows' schedules in step: each round, every row's next call
  local function replay_all(rows)
    while true do
      local step_rows = {}
      for _, row in ipairs(rows) do
        local sch = row.replay
        if sch and row.replay_k <= #sch then
          local n, t, pos = sch[row.replay_k], row.traj, row.replay_pos
          row.replay_k, row.replay_pos = row.replay_k + 1, pos + n
          if n == 1 then
            row.next_id = t.tokens[pos + 1]
            step_rows[#step_rows + 1] = row
          else
            local ids = {}
            for j = 1, n do ids[j] = t.tokens[pos + j] end
            row_feed(row, ids)
          end
        end
      end
      if #step_rows == 0 then
        local left = false
        for _, row in ipairs(rows) do if row.replay and row.replay_k <= #row.replay then left = true end end
        if not left then break end
      end
      feed_rows(step_rows)
    end
    for _, row in ipairs(rows) do row.replay, row.replay_k, row.replay_pos = nil, nil, nil end
  end

  -- the "prefill" resumption of the restored rows: the rest of each row's prefix in as few batched forwards as the
  -- rows' lengths allow. The rows of one prompt all stand at its end, so they stack into one batch; with a
  -- schedule-invariant model (exact forwards: a row's bits depend neither on the rows beside it nor on how its
  -- tokens are split into calls) the rows run in stages: every row's next L tokens as one [rows, L] forward, L the
  -- shortest remainder, the rows that have finished leaving the batch. Other models run one forward per cohort of
  -- rows with the same prompt and suffix length (each row's whole suffix in one call, as the `schedule` records).
  local function prefill_all(rows)
    local staged = model.schedule_invariant
    local groups, order = {}, {}
    for _, row in ipairs(rows) do
      if row.prefill_ids then
        local k = staged and row.prefill_prompt or row.prefill_key
        if not groups[k] then groups[k] = {}; order[#order + 1] = k end
        local c = groups[k]
        c[#c + 1] = row
      end
    end
    local function note(row, L) row.schedule[#row.schedule + 1] = L end
    for _, k in ipairs(order) do
      local c = groups[k]
      if staged then
        stages(c, function(row) return row.prefill_ids end, note)
      else
        local ids = {}
        for i, row in ipairs(c) do
          ids[i] = row.prefill_ids
          note(row, #row.prefill_ids)
        end
        stacked_forward(c, ids)
      end
      for _, row in ipairs(c) do row.prefill_ids, row.prefill_key, row.prefill_prompt = nil, nil, nil end
    end
  end

  local live, paused = {}, {}
  local was_training = model.training
  model:eval()
  local prev = C.tide_set_grad_enabled(0)
  local ok, err = pcall(function()
    -- the replay buffer's rows first: they resume before any new prompt starts (samples the budget left unstarted
    -- start now, from their own prompt and sampler stream)
    for k, e in ipairs(o.resume or {}) do
      local row
      if e.fresh then
        row = start({ pr = e.prompt, p = e.p, g = e.g, uid = e.uid, seed = e.seed, key = "resumed " .. k, users = 1 })
      else
        row = restore(e)
      end
      if not row.done then live[#live + 1] = row end
    end
    st.t_resume_prompts = st.t_resume_prompts + run_prefills()
    replay_all(live)
    prefill_all(live)
    local pausing = false
    while true do
      if budget and st.tokens >= budget then pausing = true end
      while not pausing and #live < slots and next_pending <= #pending do
        local row = start(pending[next_pending])
        next_pending = next_pending + 1
        if not row.done then live[#live + 1] = row end
      end
      run_prefills()
      if #live == 0 then break end
      local progressed = false
      for _, row in ipairs(live) do
        if row.co then
          local t0 = tide.time()
          if t0 - row.t_call > timeout then
            st.tool_timeouts, st.tool_errors = st.tool_timeouts + 1, st.tool_errors + 1
            row.traj.errors[#row.traj.errors + 1] = fmt("tool timed out after %gs", timeout)
            deliver(row, true, { result = fmt("error: the tool timed out after %gs", timeout), reward = 0 })
            progressed = true
          else
            local okr, res = coroutine.resume(row.co)
            st.t_tools = st.t_tools + (tide.time() - t0)
            if coroutine.status(row.co) == "dead" then deliver(row, okr, res); progressed = true end
          end
        elseif pausing then
          paused[#paused + 1] = pause(row)
          row.done, progressed = true, true
        else
          decode(row)
          progressed = true
        end
      end
      feed_rows(stepping)
      stepping = {}
      local keep = {}
      for _, row in ipairs(live) do if not row.done then keep[#keep + 1] = row end end
      live = keep
      if not progressed then C.usleep(1000) end   -- every live row waits on a tool
    end
  end)
  C.tide_set_grad_enabled(prev)
  model:train(was_training)
  if not ok then error(err, 0) end
  -- samples the budget left unstarted: entries that start afresh
  for k = next_pending, #pending do
    local it = pending[k]
    paused[#paused + 1] = { fresh = true, prompt = it.pr, p = it.p, g = it.g, uid = ((it.pr.index or it.p) - 1) * G + (it.g - 1),
      seed = seed }
  end
  -- the samples that ended (finished, truncated or failed); the paused ones are entries of `paused`
  local done = {}
  for _, t in ipairs(out) do if not t.paused then done[#done + 1] = t end end
  return done, st, paused
end

return rollout
