-- bench/rl.lua — agentic RL on the CPU (spec/rl.md): rollout tokens/s of tide.rl.rollout (countdown with the calc
-- tool) at G = 8 and G = 32, the split of one iteration between sampling, scoring and update, and the cost of resuming
-- paused rows, beside the same decode loop and update in PyTorch eager (bench/torch_rl.py; every PyTorch build of
-- --python, a comma-separated list: Debian's python3-torch, a PyPI build made by scripts/torch_pypi.sh) measured in the
-- same run. The model is recipes/agent_rl.lua's (hybrid KDA/MLA "KMKM", d 64), random init, f32.
--   1. rollouts: `prompts` countdown prompts x G samples, max_new sampled tokens, temperature 1; tokens/s = sampled
--      tokens / wall time of the call (the prompt prefills, tool calls and tool results included). `rounds`
--      interleaved rounds of tide at each of --tide_threads and PyTorch at each of --torch_threads (one long-lived
--      process per build and OpenMP setting, fed by a FIFO: libgomp's default waiting and OMP_WAIT_POLICY=PASSIVE)
--      after a warm-up round; medians; each engine's fastest variant (threads; for PyTorch also build and setting) is
--      its number. tide decodes the rows that sampled a token as one batch over their own caches
--      (model:decode_rows; tools overlapped as coroutines); PyTorch decodes the G rows of a prompt as one batch.
--   2. one iteration at G = 8: sampling (the rollout), scoring (update.batch, then two update.score passes: the
--      reference's log-probs and the TIS recomputation under the sampling weights), update (one stepper:run of GRPO
--      with the k3 KL and TIS weights: forward, backward, clip, AdamW). PyTorch: its own rollout, then the same two
--      scorings and the update on a batch of tide's shape (the same row lengths and prompt lengths).
--   3. pause/resume (tide only), at each prefix length of --pause_at: rows paused at a token budget (about
--      `pause_at` tokens each; max_new at least twice that), then resumed in each resume_mode ("prefill", "replay",
--      "state"); the resume cost is the resume call's wall time less the one token each resumed row samples before it
--      pauses again (the state path's forward time: one batched step of the resumed rows); ratio = resume cost / the time the paused
--      rows' prefixes took to sample (the budgeted call's wall time, pro rata of the paused rows' share of its
--      sampled tokens). Both sides include the prompt prefills (once per group), so short prefixes are bounded by them.
--      Each round waits for an idle machine first (a resume is one call of tens of milliseconds: a moment of other
--      load on a shared machine moved a round's ratio 3x).
-- Writes <results>/rl.json and <results>/rl.md and prints the table. It reports speed; it asserts nothing timed.
--
--   tide run bench/rl.lua [--rounds=2] [--Gs=8,32] [--prompts=2] [--max_new=48] [--tide_threads=1,2]
--                         [--torch_threads=1,2] [--pause_at=24,64] [--wait=true]
--                         [--baseline=false] [--python=PATH[,PATH...]] [--results=DIR]
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local results = require "tide.results"
local cli = require "tide.cli"
local rollout = require "tide.rl.rollout"
local update = require "tide.rl.update"
local markup = require "tide.rl.markup"
local traj_m = require "tide.rl.traj"
local step = require "tide.step"
local optim = require "tide.optim"
local tokenizer = require "tide.data.tokenizer"
local fmt = string.format

local TARGET_VS_TORCH = 3.0     -- the issue: rollouts >= 3x the PyTorch loop
local TARGET_RESUME = 0.10      -- the issue: a pause/resume costs less than 10% of re-sampling the prefix
local MODEL = { kind = "hybrid", vocab_size = 320, dim = 64, n_layers = 4, mixers = "KMKM", ffn_dim = 192,
  kda = { heads = 2, head_dim = 32 }, mla = { heads = 2, q_rank = 48, kv_rank = 32, nope_dim = 32, rope_dim = 16,
  v_dim = 32 } }
local ENV, ENV_CFG, MAX_TURNS, LR = "countdown", { tools = "calc" }, 4, 3e-4
local GRPO = { eps = 0.2, beta_kl = 0.04 }
local C_TIS = 2

local bench_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "bench"
local shell_quote = cli.shell_quote
local median = results.median

-- ---- PyTorch: one process per build and OpenMP setting (tide.results.torch_engines), JSON commands through a FIFO,
-- one JSON line back per command (tide.results.server); each runs at every thread count of --torch_threads
local function torch_variants(cfg, dir, threads, record)
  local engines, builds, skipped = results.torch_engines(cfg.python)
  for _, sk in ipairs(skipped) do io.stderr:write(fmt("rl: %s cannot import torch (%s): left out\n", sk.python, sk.why)) end
  if #engines == 0 then error("rl bench: no interpreter of --python=" .. cfg.python .. " imports torch (--baseline=false runs tide alone)", 0) end
  local servers, variants, fw = {}, {}, {}
  for i, e in ipairs(engines) do
    local sv = results.server(fmt("%s %s %s --serve {fifo}", e.env, shell_quote(e.python),
      shell_quote(bench_dir .. "/torch_rl.py")), dir, "torch_rl_" .. i)
    servers[#servers + 1] = sv
    if e.setting == results.TORCH_SETTINGS[1].name then fw[#fw + 1] = sv:ask({ cmd = "version" }).framework end
    for _, n in ipairs(threads) do
      variants[#variants + 1] = { sv = sv, threads = n, label = fmt("%s %dT", e.label, n) }
    end
  end
  record.torch_version, record.torch_builds, record.torch_skipped = table.concat(fw, ", "), builds, skipped
  return variants, servers
end

-- ---- tide ---------------------------------------------------------------------------------------------------------
local function prompts_of(n)
  local ps = {}
  for i = 1, n do ps[i] = { seed = 1000 + i, prompt_id = i - 1, group_id = i - 1 } end
  return ps
end

-- the prompt token ids of each prompt (system tools declaration, user message, assistant header), for PyTorch
local function prompt_ids(tok, prompts)
  local mk, out = markup.new(tok), {}
  for i, pr in ipairs(prompts) do
    local env = rollout.make_env(ENV, ENV_CFG)
    local t = traj_m.new {}
    mk:prompt(t, env:reset(pr.seed))
    out[i] = t.tokens
  end
  return out
end

local function run_rollout(m, tok, cfg, G, seed, extra)
  local o = { env = ENV, env_cfg = ENV_CFG, prompts = prompts_of(cfg.prompts), G = G, max_new = cfg.max_new,
    max_turns = MAX_TURNS, temperature = 1, seed = seed }
  for k, v in pairs(extra or {}) do o[k] = v end
  collectgarbage()
  local t0 = tide.time()
  local trajs, st, paused = rollout.run(m, tok, o)
  return trajs, st, paused, tide.time() - t0
end

-- the split of one iteration after its rollout: scoring (batch, reference score, TIS recomputation), update
local function score_and_update(m, stepper, trajs)
  collectgarbage()
  local t0 = tide.time()
  local b = update.batch(trajs)
  local t1 = tide.time()
  update.set_ref(b, update.score(m, b))
  update.set_tis(b, update.score(m, b), C_TIS)
  local t2 = tide.time()
  local r = stepper:run({ b }, LR)
  local t3 = tide.time()
  return { batch_s = t1 - t0, score_s = t2 - t1, update_s = t3 - t2, loss = r.loss }
end

-- the shape of a batch: each row's token count and prompt length (tokens before its first sampled one)
local function shape_of(trajs)
  local lengths, plens = {}, {}
  for i, t in ipairs(trajs) do
    lengths[i] = #t.tokens
    local p = #t.tokens
    for j = 1, #t.tokens do if t.loss_mask[j] == 1 then p = j - 1; break end end
    plens[i] = p
  end
  return lengths, plens
end

local function sum_n_new(entries)
  local n = 0
  for _, e in ipairs(entries) do n = n + e.n_new end
  return n
end

-- one pause/resume round: the budgeted rollout, then each resume mode on its paused rows ("state" last: it takes
-- over the saved caches)
local function pause_round(m, tok, cfg, seed, pause_at)
  local G = 8
  local rows = cfg.prompts * G
  local max_new = math.max(cfg.max_new, 2 * pause_at)
  local busy = cfg.wait ~= false and results.wait_idle().busy or nil
  local _, st, paused, wall = run_rollout(m, tok, cfg, G, seed, { budget = rows * pause_at, max_new = max_new })
  local entries = {}
  for _, e in ipairs(paused) do if not e.fresh then entries[#entries + 1] = e end end
  local R = #entries
  if R == 0 then
    error(fmt("rl bench: no row was still sampling at the pause budget (%d tokens a row, %d sampled in all): "
      .. "lower --pause_at", pause_at, st.tokens), 0)
  end
  local prefix_s = wall * sum_n_new(entries) / math.max(st.tokens, 1)
  local r = { rows = R, prefix_tokens = sum_n_new(entries), budget_tokens = st.tokens, budget_wall_s = wall,
    prefix_s = prefix_s, modes = {}, busy_before = busy }
  local raw = {}
  for _, mode in ipairs({ "replay", "prefill", "state" }) do
    local _, st2, _, w = run_rollout(m, tok, cfg, G, seed, { prompts = {}, resume = entries, resume_mode = mode,
      budget = 1, max_new = max_new })
    raw[mode] = { wall = w, forwards = st2.forwards, t_forward = st2.t_forward, resumed = st2.resumed,
      prompts = st2.t_resume_prompts }
  end
  -- the state path's forwards are the one token each row samples before it pauses again, and nothing else: those
  -- forwards' time (one batched step of the R rows; rl.rollout steps the rows that sampled a token together) is
  -- what every mode spends past its resume
  local d = raw.state.t_forward
  for mode, x in pairs(raw) do
    local cost = math.max(x.wall - d, 0)
    r.modes[mode] = { wall_s = x.wall, resume_s = cost, ratio = cost / prefix_s, forwards = x.forwards,
      resumed = x.resumed, prompts_s = x.prompts }
  end
  r.decode_s = d
  return r
end

-- the cost of one decode step of G rows: G separate B = 1 steps, one decode_rows step over the G rows' own caches
-- (the rollout's way: each row's logits bitwise its own step's) and one [G, 1] forward over one G-row cache (all
-- rows at one length; not what a rollout can use once rows diverge), after a prefill of the prompt
local function batched_probe(m, prompt, G, steps)
  local x1 = tide.tensor({ { 101 } }, { dtype = "i32" })
  local ids = {}
  for b = 1, G do ids[b] = { 100 + b } end
  local xG = tide.tensor(ids, { dtype = "i32" })
  local function prefilled(B)
    local cache, rows = m:new_cache(), {}
    for b = 1, B do rows[b] = prompt end
    m:forward(tide.tensor(rows, { dtype = "i32" }), cache)
    return cache
  end
  local function timed(f)
    local t0 = tide.time()
    for _ = 1, steps do f() end
    return (tide.time() - t0) / steps
  end
  local was = m.training
  m:eval()
  local one, rows, many = tide.no_grad(function()
    local c1 = prefilled(1)
    local one = timed(function() m:forward(x1, c1) end)
    local cs = {}
    for b = 1, G do cs[b] = rollout.copy_cache(c1) end
    local rows = timed(function() m:decode_rows(xG, cs) end)
    local cG = prefilled(G)
    return one, rows, timed(function() m:forward(xG, cG) end)
  end)
  m:train(was)
  return { G = G, b1_step_s = one, rows_step_s = rows, batched_step_s = many, speedup = G * one / rows,
    speedup_uniform = G * one / many }
end

-- ---- the benchmark ------------------------------------------------------------------------------------------------
local function best_of(by)
  local best
  for _, e in ipairs(by) do if not best or e.tok_per_s > best.tok_per_s then best = e end end
  return best
end

local function bench(cfg, tmp, record)
  tide.manual_seed(0)
  local m = tide.nn.build(MODEL)
  local tok = tokenizer.for_model(nil, MODEL.vocab_size)
  record.params = m:num_parameters()
  local opt = optim.build({ weight_decay = 0 }, m)
  local stepper = step.stepper({ model = m, optim = opt, clip = 1.0, objective = update.objective("grpo", GRPO) })
  local Gs = results.numbers(cfg.Gs)
  local tide_threads = results.numbers(cfg.tide_threads)
  local default_threads = tide.num_threads()
  if #tide_threads == 0 then tide_threads = { default_threads } end
  local torch_threads = cfg.baseline and results.numbers(cfg.torch_threads) or {}
  local variants, servers = {}, {}
  local sp = tok.specials
  local specials = { im_end = sp["<|im_end|>"], eos = sp["<|endoftext|>"], call_begin = sp["<|tool_call_begin|>"],
    call_end = sp["<|tool_call_end|>"], result_begin = sp["<|tool_result_begin|>"], result_end = sp["<|tool_result_end|>"] }
  local pids = prompt_ids(tok, prompts_of(cfg.prompts))
  record.prompt_tokens = {}
  for i, p in ipairs(pids) do record.prompt_tokens[i] = #p end
  if #torch_threads > 0 then variants, servers = torch_variants(cfg, tmp, torch_threads, record) end
  local function torch_rollout(v, G, seed)
    return v.sv:ask({ cmd = "rollout", prompts = pids, G = G, max_new = cfg.max_new, max_turns = MAX_TURNS,
      temperature = 1.0, seed = seed, threads = v.threads, specials = specials })
  end

  -- 1. rollouts, interleaved rounds
  local tt, th = {}, {}
  for _, G in ipairs(Gs) do
    tt[G], th[G] = {}, {}
    for _, n in ipairs(tide_threads) do tt[G][n] = { wall = {}, tokens = {}, calls = {}, fwd = {} } end
    for k in ipairs(variants) do th[G][k] = { wall = {}, tokens = {}, calls = {}, steps = {} } end
  end
  for round = 0, cfg.rounds do
    for _, G in ipairs(Gs) do
      local line = fmt("rl: round %d%s G=%d:", round, round == 0 and " (warm-up)" or "", G)
      for _, n in ipairs(tide_threads) do
        tide.set_num_threads(n)
        local _, st, _, w = run_rollout(m, tok, cfg, G, 17 + round)
        if round > 0 then
          local e = tt[G][n]
          e.wall[#e.wall + 1], e.tokens[#e.tokens + 1], e.calls[#e.calls + 1] = w, st.tokens, st.tool_calls
          e.fwd[#e.fwd + 1] = st.t_forward
        end
        line = line .. fmt(" tide %dT %d tok %.2f s (%.0f tok/s),", n, st.tokens, w, st.tokens / w)
      end
      tide.set_num_threads(default_threads)
      for k, v in ipairs(variants) do
        local r = torch_rollout(v, G, 17 + round)
        if round > 0 then
          local e = th[G][k]
          e.wall[#e.wall + 1], e.tokens[#e.tokens + 1], e.calls[#e.calls + 1] = r.wall_s, r.tokens, r.tool_calls
          e.steps[#e.steps + 1] = r.steps
        end
        line = line .. fmt(" torch %s %d tok %.2f s (%.0f tok/s),", v.label, r.tokens, r.wall_s, r.tokens / r.wall_s)
      end
      io.stderr:write(line:sub(1, -2) .. "\n")
    end
  end
  -- tokens/s of an engine at a thread count: the median of the rounds' tokens/s
  local function summarise(e, n, extra)
    local rates = {}
    for i = 1, #e.wall do rates[i] = e.tokens[i] / e.wall[i] end
    local lo, hi = math.huge, -math.huge
    for _, x in ipairs(rates) do lo, hi = math.min(lo, x), math.max(hi, x) end
    local o = { threads = n, tok_per_s = median(rates), tok_per_s_min = lo, tok_per_s_max = hi, wall_s = e.wall,
      tokens = e.tokens, tool_calls = e.calls }
    for k, v in pairs(extra or {}) do o[k] = v end
    return o
  end
  record.rollouts = {}
  for _, G in ipairs(Gs) do
    local r = { G = G, prompts = cfg.prompts, rows = G * cfg.prompts, max_new = cfg.max_new, tide = { by_threads = {} } }
    for _, n in ipairs(tide_threads) do
      local e = tt[G][n]
      local fw = {}
      for i = 1, #e.wall do fw[i] = e.fwd[i] / e.wall[i] end
      r.tide.by_threads[#r.tide.by_threads + 1] = summarise(e, n, { forward_share = median(fw) })
    end
    local b = best_of(r.tide.by_threads)
    r.tide.threads, r.tide.tok_per_s, r.tide.forward_share = b.threads, b.tok_per_s, b.forward_share
    r.tide.tok_per_s_min, r.tide.tok_per_s_max = b.tok_per_s_min, b.tok_per_s_max
    if #variants > 0 then
      r.torch = { by_threads = {} }
      for k, v in ipairs(variants) do r.torch.by_threads[#r.torch.by_threads + 1] = summarise(th[G][k], v.threads,
        { steps = th[G][k].steps, variant = v.label, index = k }) end
      b = best_of(r.torch.by_threads)
      r.torch.threads, r.torch.tok_per_s, r.torch.variant, r.torch.index = b.threads, b.tok_per_s, b.variant, b.index
      r.torch.tok_per_s_min, r.torch.tok_per_s_max = b.tok_per_s_min, b.tok_per_s_max
      r.tide_over_torch = r.tide.tok_per_s / r.torch.tok_per_s
      -- the ratio's range over the rounds: tide's slowest against PyTorch's fastest, and the reverse
      r.tide_over_torch_min = r.tide.tok_per_s_min / r.torch.tok_per_s_max
      r.tide_over_torch_max = r.tide.tok_per_s_max / r.torch.tok_per_s_min
    end
    record.rollouts[#record.rollouts + 1] = r
  end

  -- the batched-forward probe at each G, at tide's fastest thread count
  record.batched_probe = {}
  for _, r in ipairs(record.rollouts) do
    tide.set_num_threads(r.tide.threads)
    local pb = batched_probe(m, pids[1], r.G, cfg.probe_steps)
    record.batched_probe[#record.batched_probe + 1] = pb
    io.stderr:write(fmt("rl: probe G=%d: B = 1 decode step %.2f ms; decode_rows of %d rows %.2f ms (%.1fx the rows' "
      .. "B = 1 steps); one [%d, 1] step %.2f ms (%.1fx)\n", r.G, 1e3 * pb.b1_step_s, r.G, 1e3 * pb.rows_step_s,
      pb.speedup, r.G, 1e3 * pb.batched_step_s, pb.speedup_uniform))
  end
  tide.set_num_threads(default_threads)

  -- 2. one iteration's split at G = 8, each engine at its fastest rollout thread count
  local G8 = record.rollouts[1]
  for _, r in ipairs(record.rollouts) do if r.G == 8 then G8 = r end end
  local tn = G8.tide.threads
  local split = { G = G8.G, prompts = cfg.prompts, tide_threads = tn, tide = {}, torch = {} }
  for round = 1, cfg.rounds do
    tide.set_num_threads(tn)
    local trajs, st, _, w = run_rollout(m, tok, cfg, G8.G, 101 + round)
    local s = score_and_update(m, stepper, trajs)
    s.sample_s, s.tokens = w, st.tokens
    s.B, s.L = #trajs, 0
    for _, t in ipairs(trajs) do s.L = math.max(s.L, #t.tokens - 1) end
    split.tide[#split.tide + 1] = s
    local line = fmt("rl: split %d: tide %dT sample %.2f s, batch %.3f s, score %.3f s, update %.3f s (B %d, L %d)",
      round, tn, w, s.batch_s, s.score_s, s.update_s, s.B, s.L)
    tide.set_num_threads(default_threads)
    if G8.torch then
      -- PyTorch at its fastest rollout variant (build, setting, threads)
      local v = variants[G8.torch.index]
      local ro = torch_rollout(v, G8.G, 101 + round)
      local lengths, plens = shape_of(trajs)
      local u = v.sv:ask({ cmd = "update", lengths = lengths, prompt_lens = plens, G = G8.G, threads = v.threads,
        seed = round })
      u.sample_s, u.tokens = ro.wall_s, ro.tokens
      split.torch[#split.torch + 1] = u
      split.torch_threads, split.torch_variant = v.threads, v.label
      line = line .. fmt("; torch %s sample %.2f s, score %.3f s, update %.3f s", v.label, ro.wall_s, u.score_s, u.update_s)
    end
    io.stderr:write(line .. "\n")
  end
  local function med(list, k)
    local xs = {}
    for i, e in ipairs(list) do xs[i] = e[k] end
    return #xs > 0 and median(xs) or nil
  end
  for _, side in ipairs({ "tide", "torch" }) do
    local l = split[side]
    if #l > 0 then
      local sum = { sample_s = med(l, "sample_s"), score_s = med(l, "score_s") + (med(l, "batch_s") or 0),
        update_s = med(l, "update_s"), B = l[1].B, L = l[1].L }
      sum.total_s = sum.sample_s + sum.score_s + sum.update_s
      split[side .. "_median"] = sum
    end
  end
  record.split = split

  -- 3. pause/resume (tide)
  tide.set_num_threads(tn)
  local levels = {}
  for _, pause_at in ipairs(results.numbers(cfg.pause_at)) do
    local pr = { pause_at = pause_at, max_new = math.max(cfg.max_new, 2 * pause_at), rounds = {} }
    for round = 1, cfg.rounds do
      local r = pause_round(m, tok, cfg, 201 + round, pause_at)
      pr.rounds[#pr.rounds + 1] = r
      io.stderr:write(fmt("rl: pause at %d, round %d: %d rows paused, prefix %d tokens in %.2f s; resume replay %.3f s "
        .. "(%.2f), prefill %.3f s (%.3f), state %.4f s (%.4f)\n", pause_at, round, r.rows, r.prefix_tokens, r.prefix_s,
        r.modes.replay.resume_s, r.modes.replay.ratio, r.modes.prefill.resume_s, r.modes.prefill.ratio,
        r.modes.state.resume_s, r.modes.state.ratio))
    end
    pr.ratio = {}
    for _, mode in ipairs({ "replay", "prefill", "state" }) do
      local xs = {}
      for i, r in ipairs(pr.rounds) do xs[i] = r.modes[mode].ratio end
      pr.ratio[mode] = median(xs)
    end
    levels[#levels + 1] = pr
  end
  record.pause_resume = { levels = levels }
  tide.set_num_threads(default_threads)
  for _, sv in ipairs(servers) do sv:close() end
end

local function num(v, f) return v and fmt(f, v) or "-" end

local function markdown(rec)
  local L = {}
  L[#L + 1] = "# rl: rollouts with tool calls, one iteration's split, pause/resume (f32, CPU)"
  L[#L + 1] = ""
  L[#L + 1] = fmt("%s, tide %s (%s), its fastest of %s threads; PyTorch: %s eager, each build with libgomp's default "
    .. "waiting and with OMP_WAIT_POLICY=PASSIVE at %s threads, the fastest quoted. Load average %s at start, %s at "
    .. "the end (a shared 2-core machine). Model: "
    .. "recipes/agent_rl.lua's hybrid KDA/MLA (KMKM, d 64, %d parameters), random init; countdown with the calc "
    .. "tool, %d prompts (prompt %s tokens), max_new %d, temperature 1, median of %d rounds after a warm-up, tide "
    .. "and PyTorch interleaved.", rec.date, rec.tide_version, rec.blas, rec.tide_threads,
    rec.torch_version or "not run", rec.torch_threads, num(rec.loadavg_start, "%.2f"), num(rec.loadavg_end, "%.2f"),
    rec.params, rec.prompts, table.concat(rec.prompt_tokens, " / "), rec.max_new, rec.rounds)
  L[#L + 1] = ""
  L[#L + 1] = "- tokens/s = sampled tokens / wall time of the rollout (prompt prefills, tool calls and results included)."
    .. " tide decodes the rows that sampled a token as one batch over their own caches (model:decode_rows, each "
    .. "row's logits bitwise its own step's; up to `slots` = 64 rows, tools as coroutines, tool results and turn "
    .. "headers fed row by row); PyTorch decodes the G rows of a prompt as one batch (prompts one after another), tool "
    .. "results fed one token per step, ended rows dropped from the batch."
  L[#L + 1] = ""
  L[#L + 1] = "| G | rows | tide tok/s, median (min-max) | torch tok/s | tide / torch | threads tide / torch | tide: forward share of "
    .. "the wall | tool calls per round tide / torch | tide tok/s by threads | torch tok/s by threads |"
  L[#L + 1] = "|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
  for _, r in ipairs(rec.rollouts) do
    local bt, bh = {}, {}
    for _, e in ipairs(r.tide.by_threads) do bt[#bt + 1] = fmt("%dT %.0f", e.threads, e.tok_per_s) end
    for _, e in ipairs(r.torch and r.torch.by_threads or {}) do
      bh[#bh + 1] = fmt("%s %.0f", e.variant or fmt("%dT", e.threads), e.tok_per_s)
    end
    local function calls(side)
      if not side then return "-" end
      for _, e in ipairs(side.by_threads) do
        if (e.variant or e.threads) == (side.variant or side.threads) then return table.concat(e.tool_calls, ",") end
      end
    end
    local function range(x, lo, hi, f) return x and (fmt(f, x) .. " (" .. fmt(f, lo) .. "-" .. fmt(f, hi) .. ")") or "-" end
    L[#L + 1] = fmt("| %d | %d | %s | %s | %s | %d / %s | %.0f%% | %s / %s | %s | %s |", r.G, r.rows,
      range(r.tide.tok_per_s, r.tide.tok_per_s_min, r.tide.tok_per_s_max, "%.0f"),
      r.torch and range(r.torch.tok_per_s, r.torch.tok_per_s_min, r.torch.tok_per_s_max, "%.0f") or "-",
      r.torch and range(r.tide_over_torch, r.tide_over_torch_min, r.tide_over_torch_max, "%.2fx") or "-", r.tide.threads,
      r.torch and (r.torch.variant or fmt("%d", r.torch.threads)) or "-", 100 * r.tide.forward_share, calls(r.tide),
      calls(r.torch),
      table.concat(bt, ", "), #bh > 0 and table.concat(bh, ", ") or "-")
  end
  local pb1 = rec.batched_probe and rec.batched_probe[1]
  if pb1 then
    L[#L + 1] = ""
    L[#L + 1] = fmt("tide's rollouts spend %s of their wall inside the model's forwards (%d parameters, about %.1f "
      .. "MFLOP per token in its weights); the rest is the Lua sampler, bookkeeping and the tools.", (function()
        local t = {}
        for _, r in ipairs(rec.rollouts) do t[#t + 1] = fmt("%.0f%% (G = %d)", 100 * r.tide.forward_share, r.G) end
        return table.concat(t, ", ")
      end)(), rec.params, 2 * rec.params / 1e6)
  end
  local s = rec.split
  L[#L + 1] = ""
  L[#L + 1] = fmt("One iteration at G = %d (%d prompts): sampling = the rollout; scoring = update.batch and two no-grad "
    .. "scorings (the reference's log-probs and the TIS recomputation); update = one GRPO step (k3 KL 0.04, TIS "
    .. "weights, clip 1.0, AdamW; tide's objective also computes the entropy metric). PyTorch: its own rollout, then "
    .. "the scorings and the update on a batch of tide's shape; its training forward runs KDA as a naive per-token "
    .. "loop over L under autograd (a simple reference, not a chunked kernel).", s.G, s.prompts)
  L[#L + 1] = ""
  L[#L + 1] = "| engine | threads | batch B x L | sampling s | scoring s | update s | total s | sampling / scoring / update |"
  L[#L + 1] = "|---|---:|---|---:|---:|---:|---:|---|"
  for _, side in ipairs({ "tide", "torch" }) do
    local x = s[side .. "_median"]
    if x then
      L[#L + 1] = fmt("| %s | %s | %d x %d | %.3f | %.3f | %.3f | %.3f | %.0f%% / %.0f%% / %.0f%% |",
        side == "torch" and s.torch_variant and ("torch " .. s.torch_variant:gsub(" %d+T$", "")) or side,
        tostring(side == "tide" and s.tide_threads or s.torch_threads), x.B, x.L, x.sample_s, x.score_s, x.update_s, x.total_s,
        100 * x.sample_s / x.total_s, 100 * x.score_s / x.total_s, 100 * x.update_s / x.total_s)
    end
  end
  local tm, hm = s.tide_median, s.torch_median
  if tm and hm then
    L[#L + 1] = ""
    L[#L + 1] = fmt("tide / torch time: sampling %.2f, scoring %.2f, update %.2f (below 1: tide faster).",
      tm.sample_s / hm.sample_s, tm.score_s / hm.score_s, tm.update_s / hm.update_s)
  end
  L[#L + 1] = ""
  L[#L + 1] = "One decode step of G rows (tide; after a prefill of the first prompt; mean of " .. rec.probe_steps
    .. " steps): G separate B = 1 steps; one decode_rows step over the G rows' own caches (what the rollout runs); "
    .. "one [G, 1] forward over one G-row cache (all rows at one length, which rows that diverge cannot use)."
  L[#L + 1] = ""
  L[#L + 1] = "| G | B = 1 step ms | decode_rows step ms | G B = 1 steps / decode_rows | one [G, 1] step ms | G B = 1 steps / [G, 1] |"
  L[#L + 1] = "|---:|---:|---:|---:|---:|---:|"
  for _, pb in ipairs(rec.batched_probe or {}) do
    L[#L + 1] = fmt("| %d | %.2f | %.2f | %.1fx | %.2f | %.1fx |", pb.G, 1e3 * pb.b1_step_s, 1e3 * pb.rows_step_s,
      pb.speedup, 1e3 * pb.batched_step_s, pb.speedup_uniform)
  end
  L[#L + 1] = ""
  L[#L + 1] = fmt("Pause/resume (tide, G = 8, %d prompts): rows paused at a budget of about `pause_at` tokens each; a "
    .. "resume mode's cost = the resume call's wall time less the one token each resumed row samples before pausing "
    .. "again; ratio = that cost / the time the paused rows' prefixes took to sample (the budgeted call's wall time pro "
    .. "rata of their tokens). Both include the prompts' prefills (%s tokens, once per group). Each round after a wait "
    .. "for an idle machine (cores at most 15%% busy over 1 s, or 60 s). Median of the rounds.",
    rec.prompts, table.concat(rec.prompt_tokens, " / "))
  L[#L + 1] = ""
  L[#L + 1] = "| pause_at | max_new | round | cores busy before | rows paused | prefix tokens | prefix s | prefill s (ratio) | of it the prompts s | replay s (ratio) | state s (ratio) |"
  L[#L + 1] = "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"
  for _, p in ipairs(rec.pause_resume.levels) do
    for i, r in ipairs(p.rounds) do
      L[#L + 1] = fmt("| %d | %d | %d | %s | %d | %d | %.3f | %.3f (%.3f) | %.3f | %.3f (%.3f) | %.4f (%.4f) |", p.pause_at,
        p.max_new, i, r.busy_before and fmt("%.2f", r.busy_before) or "-", r.rows, r.prefix_tokens, r.prefix_s,
        r.modes.prefill.resume_s, r.modes.prefill.ratio,
        r.modes.prefill.prompts_s or 0, r.modes.replay.resume_s, r.modes.replay.ratio, r.modes.state.resume_s,
        r.modes.state.ratio)
    end
  end
  L[#L + 1] = ""
  L[#L + 1] = "\"prefill\" (the default) and \"replay\" run each paused group's prompt once (the prompts together, as one "
    .. "batched forward in stages) and copy its caches to the group's resumed rows, as the sampling did, then rebuild the rest of each row's prefix: prefill as exact "
    .. "forwards of the group's rows together in stages ([rows, L], L the shortest remainder; the rows that are done "
    .. "leave the batch), replay as the rows' forward schedules again (single tokens batched across the resumed rows); "
    .. "both are bit-identical to an uninterrupted run. \"state\" restores the saved caches (in memory). Both "
    .. "re-prefill paths pay the prompts' re-prefill under the new weights (\"of it the prompts\": the prefill path's "
    .. "share of them), which the sampling paid once too: a floor on their ratio that only a longer prefix lowers."
  L[#L + 1] = ""
  local v = {}
  for _, r in ipairs(rec.rollouts) do
    v[#v + 1] = r.tide_over_torch and fmt("G = %d %s (%.2fx: %.0f against %.0f tok/s)", r.G,
      r.tide_over_torch >= TARGET_VS_TORCH and "met" or "missed", r.tide_over_torch, r.tide.tok_per_s,
      r.torch.tok_per_s) or fmt("G = %d not measured", r.G)
  end
  L[#L + 1] = fmt("Target: rollouts >= %.0fx the PyTorch loop: %s.", TARGET_VS_TORCH, table.concat(v, "; "))
  for _, p in ipairs(rec.pause_resume.levels) do
    local w = {}
    for _, mode in ipairs({ "prefill", "replay", "state" }) do
      w[#w + 1] = fmt("%s %s (%.3f)", mode, p.ratio[mode] < TARGET_RESUME and "met" or "missed", p.ratio[mode])
    end
    L[#L + 1] = ""
    L[#L + 1] = fmt("Target: a pause/resume costs less than %.0f%% of re-sampling the prefix, pausing at about %d tokens "
      .. "a row: %s.", 100 * TARGET_RESUME, p.pause_at, table.concat(w, "; "))
  end
  return table.concat(L, "\n") .. "\n"
end

local function run(cfg)
  local record = {
    benchmark = "rl", date = os.date("!%Y-%m-%d %H:%M UTC"), tide_version = tide.version,
    threads = tide.num_threads(), blas = ffi.string(tide.C.tide_blas_info()), rounds = cfg.rounds,
    prompts = cfg.prompts, max_new = cfg.max_new, Gs = cfg.Gs, model = MODEL,
    tide_threads = cfg.tide_threads, torch_threads = cfg.baseline and cfg.torch_threads or "", pause_at = cfg.pause_at,
    probe_steps = cfg.probe_steps,
    target_vs_torch = TARGET_VS_TORCH, target_resume_ratio = TARGET_RESUME, loadavg_start = results.loadavg(),
  }
  local tmp = os.tmpname()
  os.remove(tmp)
  if tide.C.tide_mkdir_p(tmp) ~= 0 then error("rl bench: cannot create " .. tmp, 0) end
  local ok, err = pcall(bench, cfg, tmp, record)
  tide.C.tide_remove_tree(tmp)
  if not ok then error(err, 0) end
  record.loadavg_end = results.loadavg()
  local tv, pv = {}, {}
  for _, r in ipairs(record.rollouts) do
    tv[#tv + 1] = { G = r.G, ratio = r.tide_over_torch, met = r.tide_over_torch and r.tide_over_torch >= TARGET_VS_TORCH }
  end
  for _, p in ipairs(record.pause_resume.levels) do
    local lv = {}
    for mode, x in pairs(p.ratio) do lv[mode] = { ratio = x, met = x < TARGET_RESUME } end
    pv["pause_at_" .. p.pause_at] = lv
  end
  record.verdicts = { rollouts_vs_torch = tv, resume_vs_prefix = pv }
  local md = markdown(record)
  io.write(md)
  results.write(cfg.results, "rl", record, md, { "benchmark", "date", "verdicts", "rollouts", "split", "pause_resume" })
  return 0
end

return {
  rounds = 2,                   -- timed interleaved rounds after one warm-up round
  Gs = "8,32",                  -- samples per prompt
  prompts = 2,                  -- countdown prompts per rollout
  max_new = 48,                 -- sampled tokens per row at most
  pause_at = "24,64",           -- the pause budgets: about this many sampled tokens per row (one measurement each)
  wait = true,                  -- wait for an idle machine before each pause round
  probe_steps = 20,             -- decode steps timed by the batched-forward probe
  tide_threads = "1,2",         -- tide's thread counts tried each round ("" = the engine's default); its fastest counts
  torch_threads = "1,2",        -- PyTorch's thread counts tried each round; its fastest counts
  baseline = true,              -- run the PyTorch side
  python = "/usr/bin/python3,build/torch-pypi/bin/python",   -- the PyTorch builds (missing ones left out)
  results = "bench/results",    -- where rl.json / rl.md go; "" writes nothing
  run = run,
}
