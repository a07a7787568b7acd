-- rl rollouts: multi-turn sampling with tool calls on the caches (rl.md §1, §5), tools as coroutines that overlap,
-- and every kind of bad input recorded, not raised.
local T = require "tide.testing"
local tide = require "tide"
local rl = require "tide.rl"
local rollout = require "tide.rl.rollout"
local countdown = require "tide.rl.countdown"
local tokenizer = require "tide.data.tokenizer"

local nn = tide.nn
local tok = tokenizer.byte_level()
local V = tok.vocab_size

-- a tiny KDA + MLA hybrid in f32 (the rollout dtype), weights large enough that every layer matters
local function model()
  tide.manual_seed(7)
  return nn.HybridLM({ vocab_size = V, dim = 32, n_layers = 2, mixers = "KM", ffn_dim = 48, init_std = 0.1,
    kda = { heads = 2, head_dim = 8, chunk = 4 }, mla = { heads = 2, q_rank = 16, kv_rank = 8, nope_dim = 8,
    rope_dim = 4, v_dim = 8 } })
end

-- the model with a script: greedy decoding picks the script's next token (a bias on its logit), so the rows write
-- known text while the caches are the real model's. Every forward's input ids and raw last logits are recorded.
local function scripted(m, script_of)
  local w = { training = false, log = {}, schedule_invariant = m.schedule_invariant }
  function w:eval() m:eval() end
  function w:train(on) m:train(on) end
  function w:new_cache() return m:new_cache() end
  function w:forward(ids, cache, opts)
    local logits = m:forward(ids, cache, opts)
    local rows = ids:tolist()
    local T_ = logits:size(2)   -- the rollout asks for the last position's logits alone (opts.last)
    local raw = logits:narrow(2, T_, 1):tolist()
    w.log[#w.log + 1] = { ids = rows, logits = raw, cache = cache }
    local nxt = script_of(cache, rows)
    if not nxt then return logits end
    local bias = {}
    for v = 1, V do bias[v] = 0 end
    bias[nxt + 1] = 1e4
    local b = tide.zeros({ 1, T_, V })
    b:narrow(2, T_, 1):copy_(tide.tensor({ { bias } }))
    return logits + b
  end
  return w
end

-- a script: the ids to write in order. Its position lives in the cache table (copied with it when the rollout copies
-- a prompt's caches to its rows) and advances when the fed id is the one expected.
local function ids_of(texts)
  local ids = {}
  for _, part in ipairs(texts) do
    if type(part) == "string" then for _, id in ipairs(tok:encode(part)) do ids[#ids + 1] = id end
    else ids[#ids + 1] = tok:id(part.special) end
  end
  return ids
end

local function script_for(texts, variant)
  local base = ids_of(texts)
  local n = 0
  return function(cache, fed)
    local s = cache._script
    if not s then
      s = { k = 1, ids = base }
      cache._script = s
    elseif fed[1] == s.ids[s.k] then
      if s.k == 1 and variant then n = n + 1; s.ids = ids_of(variant(n)) end
      s.k = s.k + 1
    end
    return s.ids[s.k]
  end
end

local CALL = { { special = "<|tool_call_begin|>" }, "calc: 3*5", { special = "<|tool_call_end|>" } }

local function calc_env()
  return {
    reset = function(self) return { prompt = "make 22 from 3 5 7", tools = { calc = "calc: EXPR" } } end,
    step = function(self, a)
      if a.call then return { result = countdown.eval(a.call.args) or "error", reward = 0.05 } end
      return { done = true, terminal = countdown.score({ nums = { 3, 5, 7 }, target = 22 }, a.text) }
    end,
  }
end

T.test("a tool call mid-sample: result masked and fed into the caches; reward from the verifier", function()
  local m = model()
  local script = { "let me ", CALL[1], CALL[2], CALL[3], "<answer>3*5+7</answer>", { special = "<|im_end|>" } }
  local w = scripted(m, script_for(script))
  local trajs, st = rollout.run(w, tok, { env = calc_env(), prompts = { { seed = 1 } }, temperature = 0 })
  T.eq(#trajs, 1)
  local t = trajs[1]
  T.eq({ t.reward_terminal, t.rewards_turn[1], t.finished, t.truncated }, { 1.0, 0.05, true, false })
  T.eq({ st.tool_calls, st.tool_errors, st.samples }, { 1, 0, 1 })
  local text = tok:decode(t.tokens)
  local want = "<|im_middle|>let me <|tool_call_begin|>calc: 3*5<|tool_call_end|><|tool_result_begin|>15"
    .. "<|tool_result_end|><answer>3*5+7</answer><|im_end|>"
  T.eq(text:sub(-#want), want)
  -- masks: sampled tokens 1 (including the call's begin/end and the closing im_end), the result 0
  local R = rl.traj.ROLE
  for i = 1, t:len() do
    local want = t.roles[i] == R.assistant and t.loss_mask[i] or 0
    T.eq(t.loss_mask[i], want, "mask at " .. i)
    if t.roles[i] == R.tool_result then T.eq(t.loss_mask[i], 0) end
  end
  local n_policy = t:n_policy()
  T.eq(n_policy, #tok:encode("let me calc: 3*5<answer>3*5+7</answer>") + 3)
  -- the turn index: 0 up to the call's end, 1 after the result
  local last = t:len()
  T.eq({ t.turn[last], t.roles[last] }, { 1, R.assistant })
  -- the prompt ran once; then one forward per sampled token (the call's end goes in with its result, in one
  -- forward) except the final im_end (nothing more to feed): the prefix is never run again
  T.eq(st.forwards, 1 + n_policy - 1)
end)

T.test("the continuation after a tool result equals a full re-prefill of prompt + call + result, bitwise", function()
  local m = model()
  local script = { "abc", CALL[1], CALL[2], CALL[3], "xyz", { special = "<|im_end|>" } }
  local w = scripted(m, script_for(script))
  local trajs = rollout.run(w, tok, { env = calc_env(), prompts = { { seed = 1 } }, temperature = 0 })
  local t = trajs[1]
  local call_end, result_end = tok:id("<|tool_call_end|>"), tok:id("<|tool_result_end|>")
  -- the rollout's forwards: the prompt, one token per step, the call's end with its result in one call
  local pos, fed_result = 0, nil
  for k, call in ipairs(w.log) do
    for j, id in ipairs(call.ids) do T.eq(id, t.tokens[pos + j], "the forwards cover the trajectory") end
    pos = pos + #call.ids
    if call.ids[1] == call_end then
      T.eq(call.ids[#call.ids], result_end, "the call's end goes in with its result")
      fed_result = { k = k, pos = pos, logits = call.logits }
    end
  end
  T.ok(fed_result and fed_result.k > 3, "the call came after sampled tokens")
  -- prompt + call + result in ONE forward on fresh caches: the logits the continuation sampled from, bitwise
  local ctx = {}
  for i = 1, fed_result.pos do ctx[i] = t.tokens[i] end
  local one = tide.no_grad(function()
    m:eval()
    return m:forward(tide.tensor({ ctx }, { dtype = "i32" }), m:new_cache(), { exact = true }):narrow(2, #ctx, 1):tolist()
  end)
  T.eq(one, fed_result.logits, "one re-prefill == the incremental context (prefill, steps, result)")
  -- every position of the trajectory: one exact forward over all of it == the logits each forward saw
  local all = {}
  for i = 1, t:len() do all[i] = t.tokens[i] end
  local lg = tide.no_grad(function()
    return m:forward(tide.tensor({ all }, { dtype = "i32" }), m:new_cache(), { exact = true })
  end)
  pos = 0
  for k, call in ipairs(w.log) do
    pos = pos + #call.ids
    T.eq(lg:narrow(2, pos, 1):tolist(), call.logits, "forward " .. k .. " bitwise")
  end
  -- the chunked (training) forward is the same function to f32 rounding
  local chunked = tide.no_grad(function() return m:forward(tide.tensor({ ctx }, { dtype = "i32" })):narrow(2, #ctx, 1):tolist() end)
  local d = 0
  for v = 1, V do d = math.max(d, math.abs(chunked[v] - one[v])) end
  T.ok(d > 0 and d < 1e-4, "chunked vs exact " .. d)
end)

T.test("tools that wait overlap: 32 rows each waiting 1 s on a call are all pending at once", function()
  local m = model()
  local pending, max_pending, decoded_while_pending = 0, 0, 0
  local env = {
    reset = function(self) return { prompt = "q", tools = { slow = "slow: X" } } end,
    step = function(self, a)
      if a.call then
        pending = pending + 1
        max_pending = math.max(max_pending, pending)
        rollout.wait(1.0)
        pending = pending - 1
        return { result = "ok" }
      end
      return { done = true, terminal = 1 }
    end,
  }
  -- rows of different lengths before their call, so calls start at different rounds
  local script = script_for({ "a" }, function(n)
    return { "a" .. string.rep("b", n % 7), { special = "<|tool_call_begin|>" }, "slow: 1",
      { special = "<|tool_call_end|>" }, { special = "<|im_end|>" } }
  end)
  local w = scripted(m, function(cache, fed)
    if pending > 0 then decoded_while_pending = decoded_while_pending + 1 end
    return script(cache, fed)
  end)
  local t0 = tide.time()
  local trajs, st = rollout.run(w, tok, { env = env, prompts = { { seed = 0 } }, G = 32, temperature = 0 })
  local wall = tide.time() - t0
  T.eq(#trajs, 32)
  T.eq(st.tool_calls, 32)
  for _, t in ipairs(trajs) do T.eq({ t.reward_terminal, #t.errors }, { 1, 0 }) end
  T.eq(max_pending, 32, "every row's call was pending at the same time")
  T.ok(decoded_while_pending > 0, "rows decoded while others waited")
  io.write(string.format("        32 calls of 1 s each: the rollout took %.2f s\n", wall))
end)

T.test("bad input is recorded and counted, and the run goes on", function()
  local m = model()
  local kinds = { "raise", "number", "slow", "nan", "malformed", "ok" }
  local function env_for(kind)
    return {
      reset = function(self, seed)
        if kind == "reset" then error("no such task") end
        return { prompt = "p", tools = { t = "t: X" } }
      end,
      step = function(self, a)
        if a.call then
          self.saw_malformed = self.saw_malformed or a.call.malformed
          if kind == "raise" then error("tool exploded") end
          if kind == "number" then return { result = 42 } end
          if kind == "slow" then rollout.wait(10) end
          if kind == "nan" then return { result = "fine", reward = 0 / 0 } end
          return { result = "fine" }
        end
        return { done = true, terminal = kind == "nan" and 0 / 0 or 1 }
      end,
    }
  end
  local results, envs = {}, {}
  for _, kind in ipairs { "raise", "number", "slow", "nan", "malformed", "reset", "ok" } do
    local call = kind == "malformed" and "no colon" or "t: 1"
    local w = scripted(m, script_for({ { special = "<|tool_call_begin|>" }, call, { special = "<|tool_call_end|>" },
      "done", { special = "<|im_end|>" } }))
    local env = env_for(kind)
    envs[kind] = env
    local trajs, st = rollout.run(w, tok, { env = function() return env end, prompts = { { seed = 0 } },
      temperature = 0, tool_timeout = 0.2 })
    results[kind] = { t = trajs[1], st = st }
  end
  local function has(kind, text)
    local errs = table.concat(results[kind].t.errors, " | ")
    T.ok(errs:find(text, 1, true), kind .. ": " .. errs)
  end
  has("raise", "tool raised: ")
  has("raise", "tool exploded")
  has("number", "tool returned a number result")
  has("slow", "tool timed out after 0.2s")
  has("nan", "process reward is nan")
  has("nan", "terminal reward is nan")
  has("malformed", "malformed tool call \"no colon\"")
  has("reset", "env.reset raised: ")
  T.eq(results.raise.st.tool_errors, 1)
  T.eq(results.slow.st.tool_timeouts, 1)
  T.eq(results.nan.st.nonfinite_rewards, 2)
  T.eq(results.malformed.st.malformed_calls, 1)
  T.ok(envs.malformed.saw_malformed, "the environment saw the malformed call (its process cost counts it)")
  T.eq(results.reset.st.env_errors, 1)
  T.eq(#results.ok.t.errors, 0)
  -- the rows that went wrong still finished their sample and carry a finite reward
  for _, kind in ipairs { "raise", "number", "slow", "nan", "malformed" } do
    local t = results[kind].t
    T.ok(t.finished and t.reward_terminal == t.reward_terminal, kind .. " finished with a number")
    T.ok(tok:decode(t.tokens):find("<|tool_result_begin|>error: ", 1, true) or kind == "nan", kind .. " got an error result")
  end
end)

T.test("budgets and determinism: truncation, the repetition stop, per-row streams independent of the slots", function()
  local m = model()
  local env = rl.env("countdown", { tools = "calc" })
  local trajs, st = rollout.run(m, tok, { env = "countdown", env_cfg = { tools = "calc" },
    prompts = { { seed = 3 }, { seed = 4 } }, G = 3, max_new = 12, temperature = 1, seed = 5 })
  T.eq(#trajs, 6)
  for _, t in ipairs(trajs) do
    T.ok(t:n_policy() <= 12, "budget")
    if t.truncated then T.eq(t.reward_terminal, 0) end
  end
  T.eq(st.samples, 6)
  -- the same seed: the same rows; one slot at a time: the same rows again
  local again = rollout.run(m, tok, { env = "countdown", env_cfg = { tools = "calc" },
    prompts = { { seed = 3 }, { seed = 4 } }, G = 3, max_new = 12, temperature = 1, seed = 5, slots = 1 })
  for i = 1, 6 do T.eq(again[i].tokens, trajs[i].tokens, "row " .. i) end
  -- rows of one prompt share its prompt bytes but sample differently
  T.eq(trajs[1].tokens[5], trajs[2].tokens[5])
  local differ = false
  for i = 1, trajs[1]:len() do if trajs[1].tokens[i] ~= trajs[2].tokens[i] then differ = true end end
  T.ok(differ, "G rows of one prompt draw different samples")
  -- a 32-token window written three times ends the sample as truncated
  local rep = scripted(m, script_for({ string.rep("0123456789abcdefghijklmnopqrstuv", 5) }))
  local r = rollout.run(rep, tok, { env = calc_env(), prompts = { { seed = 0 } }, temperature = 0, max_new = 500 })
  T.eq({ r[1].truncated, r[1]:n_policy(), r[1].reward_terminal }, { true, 96, 0 })
  T.raises(function() rollout.run(m, tok, { env = "countdown", prompts = {} }) end, "prompts must be a non-empty list")
  T.raises(function() rollout.run(m, tok, { env = "countdown", prompts = { { seed = 1 } }, G = 0 }) end,
    "G must be a positive integer")
  T.raises(function() rollout.run(m, tok, { env = "nope", prompts = { { seed = 1 } } }) end, "environment must be one of")
  T.eq(env.name, "countdown")
end)

T.test("oracle 9: a rollout paused at a token budget and resumed (re-prefill or saved state) == uninterrupted, bitwise", function()
  local m = model()
  local base = { env = "countdown", env_cfg = { tools = "calc" }, prompts = { { seed = 3 }, { seed = 8 } }, G = 2,
    max_new = 30, seed = 4 }
  for _, temp in ipairs { 0, 1 } do
    base.temperature = temp
    local full = rollout.run(m, tok, base)
    local function key(t) return t.prompt_id .. "/" .. t.group_id .. "/" .. tok:decode(t.tokens):sub(1, 0) end
    for _, mode in ipairs { "prefill", "replay", "state" } do
      local o = {}
      for k, v in pairs(base) do o[k] = v end
      o.budget, o.policy_version = 25, 0
      local first, st1, paused = rollout.run(m, tok, o)
      T.ok(#paused > 0 and st1.paused > 0, "the budget paused rows")
      local o2 = {}
      for k, v in pairs(base) do o2[k] = v end
      o2.prompts, o2.resume, o2.resume_mode, o2.policy_version = {}, paused, mode, 1
      o2.seed = 99     -- resumed rows keep drawing from their own streams, whatever this call's seed
      local rest, st2 = rollout.run(m, tok, o2)
      T.eq(#first + #rest, #full, "every sample ends once")
      if mode ~= "state" then T.ok(st2.resumed > 0 and st2.forwards > 0, "re-prefilled") end
      -- match each resumed or first-pass sample to the uninterrupted one by its prompt and its place in the group
      local all = {}
      for _, t in ipairs(first) do all[#all + 1] = t end
      for _, t in ipairs(rest) do all[#all + 1] = t end
      local versions = { [0] = 0, [1] = 0 }
      for _, t in ipairs(all) do
        local match
        for _, f in ipairs(full) do
          if f.prompt_id == t.prompt_id and f:len() == t:len() then
            local same = true
            for i = 1, f:len() do if f.tokens[i] ~= t.tokens[i] then same = false break end end
            if same then match = f end
          end
        end
        T.ok(match ~= nil, string.format("temperature %g, %s: a sample of prompt %d has no uninterrupted twin", temp,
          mode, t.prompt_id))
        T.eq(t.logp_old, match.logp_old, "log-probs bitwise")
        T.eq({ t.reward_terminal, t.truncated }, { match.reward_terminal, match.truncated })
        for i = 1, t:len() do
          if t.loss_mask[i] == 1 then versions[t.policy_version[i]] = versions[t.policy_version[i]] + 1 end
        end
      end
      T.ok(versions[0] > 0 and versions[1] > 0, "tokens of both policy versions")
      -- a sample that crossed the pause records where its version changed
      local crossed = 0
      for _, t in ipairs(rest) do if #t.segments == 2 then crossed = crossed + 1 end end
      T.ok(crossed > 0, "segments mark the resumption")
    end
  end
end)

T.test("resume by one re-prefill (rows of a prompt and suffix length batched): few forwards, continuations == uninterrupted bitwise", function()
  local m = model()
  local o = { env = "countdown", prompts = { { seed = 3 } }, G = 2, max_new = 30, seed = 4, temperature = 0,
    budget = 20 }
  local _, _, paused = rollout.run(m, tok, o)
  local rows = 0
  for _, e in ipairs(paused) do if not e.fresh then rows = rows + 1 end end
  T.ok(rows > 0, "rows paused")
  -- the saved logits == those of one forward over each paused prefix
  for _, e in ipairs(paused) do
    if not e.fresh then
      local lg = tide.no_grad(function()
        m:eval()
        return rollout.feed(m, m:new_cache(), e.traj.tokens)
      end)
      T.eq(lg, e.state.logits, "one forward over the prefix == the sampled context, bitwise")
    end
  end
  local rest, st = rollout.run(m, tok, { env = "countdown", prompts = {}, G = 2, max_new = 30, seed = 4,
    temperature = 0, resume = paused, resume_mode = "prefill" })
  T.ok(st.resumed == rows, "resumed " .. st.resumed)
  T.ok(st.forwards < #paused * 31, "the paused rows' prefixes ran as one chunk each (or per cohort)")
  -- the greedy continuations and their log-probs equal the uninterrupted run's (the rows of one prompt and suffix
  -- length re-prefill as one batch)
  local full = rollout.run(m, tok, { env = "countdown", prompts = { { seed = 3 } }, G = 2, max_new = 30, seed = 4,
    temperature = 0 })
  local by_uid = {}
  for _, t in ipairs(full) do by_uid[t.uid] = t end
  for _, t in ipairs(rest) do
    local f = by_uid[t.uid]
    T.eq(t.tokens, f.tokens, "uid " .. t.uid .. " tokens")
    T.eq(t.logp_old, f.logp_old, "uid " .. t.uid .. " log-probs")
  end
end)

-- the model with tool calls at random places: after a byte id divisible by 5, <|tool_call_end|> (the calc tool
-- then runs on the text since the call's start, and its result is fed), so sampled rows grow at different rates.
-- Only the logits change; forwards of more than one token are logged as {rows, tokens}
local function calling(m)
  local call_end = tok:id("<|tool_call_end|>")
  local w = { training = false, schedule_invariant = m.schedule_invariant, log = {} }
  function w:eval() m:eval() end
  function w:train(on) m:train(on) end
  function w:new_cache() return m:new_cache() end
  function w:forward(ids, cache, opts)
    local logits = m:forward(ids, cache, opts)
    local flat, B, T_ = ids:reshape(-1):tolist(), ids:size(1), ids:size(2)
    if T_ > 1 then w.log[#w.log + 1] = { B, T_ } end
    local bias, any = {}, false
    for r = 1, B do
      local row = {}
      for v = 1, V do row[v] = 0 end
      local last = flat[r * T_]
      if last < 256 and last % 5 == 0 then row[call_end + 1], any = 1e4, true end
      bias[r] = { row }
    end
    if not any then return logits end
    local b = tide.zeros({ B, T_, V })
    b:narrow(2, T_, 1):copy_(tide.tensor(bias))
    return logits + b
  end
  return w
end

T.test("re-prefill in stages: the rows of a prompt with different suffix lengths share [rows, L] forwards, == uninterrupted bitwise", function()
  local w = calling(model())
  local base = { env = "countdown", env_cfg = { tools = "calc" }, prompts = { { seed = 3 } }, G = 6, max_new = 40,
    max_turns = 20, seed = 11, temperature = 1 }
  local full = rollout.run(w, tok, base)
  local o = {}
  for k, v in pairs(base) do o[k] = v end
  o.budget = 6 * 12
  local first, _, paused = rollout.run(w, tok, o)
  local lens, rows = {}, 0
  for _, e in ipairs(paused) do
    if not e.fresh then
      rows = rows + 1
      lens[#e.traj.tokens - e.schedule[1]] = true
    end
  end
  local distinct = 0
  for _ in pairs(lens) do distinct = distinct + 1 end
  T.ok(rows >= 3 and distinct >= 3, string.format("%d rows paused with %d distinct suffix lengths", rows, distinct))
  -- the resume's multi-token forwards: the prompt once, then one stage per distinct length, the first over all rows
  w.log = {}
  local o2 = {}
  for k, v in pairs(base) do o2[k] = v end
  o2.prompts, o2.resume, o2.resume_mode = {}, paused, "prefill"
  local rest = rollout.run(w, tok, o2)
  local shapes = {}
  for i = 1, 1 + distinct do shapes[i] = w.log[i] end
  T.eq(shapes[1][1], 1, "the prompt, once")
  T.eq(shapes[2][1], rows, "the first stage runs every paused row of the prompt")
  for i = 3, 1 + distinct do T.ok(shapes[i][1] < shapes[i - 1][1], "each later stage runs fewer rows") end
  local by_uid = {}
  for _, t in ipairs(full) do by_uid[t.uid] = t end
  T.eq(#first + #rest, #full, "every sample ends once")
  local calls = 0
  for _, t in ipairs(rest) do
    local f = by_uid[t.uid]
    T.eq(t.tokens, f.tokens, "uid " .. t.uid .. " tokens")
    T.eq(t.logp_old, f.logp_old, "uid " .. t.uid .. " log-probs")
    for i = 1, t:len() do if t.roles[i] == rl.traj.ROLE.tool_result then calls = calls + 1 end end
  end
  T.ok(calls > 0, "tool results in the resumed rows")
end)

T.test("the prompts that start together prefill as one batch (in stages), and each row's samples == its prompt run alone, bitwise", function()
  local w = calling(model())
  local prompts = { { seed = 3 }, { seed = 8 }, { seed = 21 } }
  local base = { env = "countdown", env_cfg = { tools = "calc" }, G = 2, max_new = 16, max_turns = 20, seed = 5,
    temperature = 1 }
  local o = {}
  for k, v in pairs(base) do o[k] = v end
  o.prompts = prompts
  w.log = {}
  local all = rollout.run(w, tok, o)
  T.eq(w.log[1][1], #prompts, "the first forward runs every prompt")
  T.eq(#all, #prompts * base.G)
  for k, pr in ipairs(prompts) do
    local one = {}
    for kk, v in pairs(base) do one[kk] = v end
    one.prompts = { { seed = pr.seed, index = k, prompt_id = k - 1, group_id = k - 1 } }
    w.log = {}
    local alone = rollout.run(w, tok, one)
    T.eq(w.log[1][1], 1, "one prompt, one row in its prefill")
    for _, t in ipairs(alone) do
      local twin
      for _, u in ipairs(all) do if u.uid == t.uid then twin = u end end
      T.ok(twin ~= nil, "uid " .. t.uid)
      T.eq(t.tokens, twin.tokens, "uid " .. t.uid .. " tokens")
      T.eq(t.logp_old, twin.logp_old, "uid " .. t.uid .. " log-probs")
    end
  end
end)

T.run()
