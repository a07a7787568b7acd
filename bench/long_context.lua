-- bench/long_context.lua — one training step (forward + backward) of a small 3:1 hybrid on one long sequence on the
-- CPU (spec/long_context.md §4): time, peak engine bytes, and where the time goes — the KDA layers (linear in T) and
-- the MLA layer (quadratic in T) — at T = 8K, 32K and 128K, batch 1, recompute = "layer".
--
-- Model: nn.HybridLM d 64, 4 layers K K K M (3 KDA: 2 heads x 32; 1 gated NoPE MLA: 1 head, q_rank 32, kv_rank 32,
-- nope 16, rope 8, v 16), dense SwiGLU FFN 192, Block AttnRes (B = 2), byte vocabulary, f32. The MLA layer has one
-- head so that its T² work at 128K fits the bench's few minutes on two cores; the point is the scaling.
--
-- Method (the per-layer shares without a profiler, measured inside the step itself): the forward runs layer by
-- layer through HybridLM's own layer step (Body:forward_layer, each layer a recompute region), each layer timed;
-- every layer's inputs (the residual state's tensors) enter it as detached leaves, so the backward runs stage by
-- stage — the head and loss, then each layer from the last — and each stage's backward (its region's replay plus
-- its gradients) is one timed call, the gradients of its input leaves handed to the stage that made them. A layer's
-- time = its forward + its backward; "other" = embedding, final mix, head, loss and the hand-overs. The work is
-- that of the plain step (model:loss + backward); at T <= `check_max` the plain step also runs, and its time and
-- peak are printed beside the staged one; at the warm-up size (1K) the staged step's gradients are checked against
-- the plain step's (the bench stops if they differ beyond f32 rounding).
--
-- Writes <results>/long_context.json and .md (the step table; further tables — the tiny curriculum's tokens/s per
-- stage — are further entries of SECTIONS below, fed by their own record fields) and prints the Markdown.
--
--   tide run bench/long_context.lua [--sizes=8192,32768,131072] [--reps=2] [--reps_max_T=32768] [--check_max=8192]
--                                   [--results=DIR]
local ffi = require "ffi"
local tide = require "tide"
local results = require "tide.results"
local F = tide.F

local CFG = {
  vocab_size = 256, dim = 64, n_layers = 4, mixers = "KKKM", ffn_dim = 192, activation = "swiglu", dtype = "f32",
  kda = { heads = 2, head_dim = 32 },
  mla = { heads = 1, q_rank = 32, kv_rank = 32, nope_dim = 16, rope_dim = 8, v_dim = 16 },
  residual = "attnres_block", attnres = { block_layers = 2 }, recompute = "layer",
}

-- the residual state's tensors (fields and lists of tensors), replaced in place by detached leaves that require
-- grad; returns {leaf = , orig = } pairs. A tensor that is itself an earlier stage's leaf (a block source carried
-- on) maps to that leaf's original, through `origin` (leaf -> original, shared by the step's stages).
local function leafify(st, origin)
  local pairs_out = {}
  local function leaf(t)
    local l = t:detach():requires_grad_(true)
    local orig = origin[t] or t
    origin[l] = orig
    pairs_out[#pairs_out + 1] = { leaf = l, orig = orig }
    return l
  end
  for k, v in pairs(st) do
    if tide.is_tensor(v) then
      st[k] = leaf(v)
    elseif type(v) == "table" then
      for i, t in ipairs(v) do if tide.is_tensor(t) then v[i] = leaf(t) end end
    end
  end
  return pairs_out
end

-- the tensors of st that are not among `leaves` (what the stage made)
local function outputs(st, leaves)
  local known, out = {}, {}
  for _, p in ipairs(leaves) do known[p.leaf] = true end
  local function see(t) if tide.is_tensor(t) and not known[t] then known[t] = true; out[#out + 1] = t end end
  for _, v in pairs(st) do
    if type(v) == "table" and not tide.is_tensor(v) then for _, t in ipairs(v) do see(t) end else see(v) end
  end
  return out
end

-- adds each leaf's gradient to acc[its original tensor]
local function hand_over(acc, leaves)
  for _, p in ipairs(leaves) do
    local g = p.leaf:grad()
    if g then acc[p.orig] = acc[p.orig] and acc[p.orig] + g or g end
    p.leaf:zero_grad()
    p.leaf = nil
  end
  tide.collect()      -- the stage's replayed activations and spent gradients go now, as in the plain backward
end

-- backward of a stage's outputs with their accumulated gradients (one call; Σ <o, g> when there are several)
local function backward_outputs(outs, acc)
  local live = {}
  for _, o in ipairs(outs) do if acc[o] then live[#live + 1] = o end end
  if #live == 1 then
    live[1]:backward(acc[live[1]])
  elseif #live > 1 then
    local s
    for _, o in ipairs(live) do
      local d = (o * acc[o]):sum()
      s = s and s + d or d
    end
    s:backward()
  end
  for _, o in ipairs(outs) do acc[o] = nil end
end

-- the parameter gradients as flat lists, by name
local function grad_lists(model)
  local out = {}
  for name, t in model:named_parameters() do
    local g = t:grad()
    out[name] = g and g:tolist() or false
  end
  return out
end

-- one staged training step: per-layer forward and backward seconds, total seconds, peak bytes, loss (and the
-- parameter gradients when keep_grads)
local function staged_step(model, ids, tgt, keep_grads)
  local body = model.model
  local L, N = body.layers.n, ids:numel()
  model:zero_grad()
  tide.collect()
  local base = tide.memory().current
  tide.reset_peak()
  local t_start = tide.time()
  local fwd, bwd = {}, {}
  local x0 = body.embed_tokens:forward(ids)
  local st = body.res:begin(x0)
  local stages, origin = {}, setmetatable({}, { __mode = "k" })
  for l = 1, L do
    local leaves = leafify(st, origin)
    local t0 = tide.time()
    body:forward_layer(st, l, nil, nil, "layer")
    fwd[l] = tide.time() - t0
    stages[l] = { leaves = leaves, outs = outputs(st, leaves) }
  end
  local head_leaves = leafify(st, origin)
  local logits = model.lm_head:forward(body.norm:forward(body.res:final(st)))
  local loss = F.cross_entropy(logits:reshape(N, CFG.vocab_size), tgt:reshape(N))
  st, logits = nil, nil
  loss:backward()
  local acc = {}
  tide.no_grad(function()
    hand_over(acc, head_leaves)
    head_leaves = nil
    for l = L, 1, -1 do
      local t0 = tide.time()
      tide.enable_grad(backward_outputs, stages[l].outs, acc)
      bwd[l] = tide.time() - t0
      hand_over(acc, stages[l].leaves)
      stages[l] = nil
    end
  end)
  if acc[x0] then x0:backward(acc[x0]) end
  local seconds = tide.time() - t_start
  local peak = tide.memory().peak - base
  local r = { seconds = seconds, peak_bytes = peak, loss = loss:item(), layers = {} }
  for l = 1, L do r.layers[l] = { forward = fwd[l], backward = bwd[l], seconds = fwd[l] + bwd[l] } end
  if keep_grads then r.grads = grad_lists(model) end
  model:zero_grad()
  return r
end

-- the plain step model:loss + backward: seconds, peak bytes, loss (and the gradients when keep_grads)
local function plain_step(model, ids, tgt, keep_grads)
  model:zero_grad()
  tide.collect()
  local base = tide.memory().current
  tide.reset_peak()
  local t0 = tide.time()
  local loss = model:loss(ids, tgt)
  loss:backward()
  local r = { seconds = tide.time() - t0, peak_bytes = tide.memory().peak - base, loss = loss:item() }
  if keep_grads then r.grads = grad_lists(model) end
  model:zero_grad()
  return r
end

local function tokens(Tn)
  tide.manual_seed(Tn)
  local seq = tide.rand({ 1, Tn + 1 }, { lo = 0, hi = CFG.vocab_size }):to("i64")
  return seq:narrow(2, 1, Tn), seq:narrow(2, 2, Tn)
end

-- the staging must do the plain step's work: every parameter gradient equal to f32 rounding (max |Δ| / max |g|
-- per tensor); returns the largest such error
local function check_staging(model, Tn)
  local ids, tgt = tokens(Tn)
  local a, b = staged_step(model, ids, tgt, true), plain_step(model, ids, tgt, true)
  local worst, n = 0, 0
  for name, g in pairs(b.grads) do
    local s = a.grads[name]
    if (g == false) ~= (s == false) then error("long_context: staged and plain steps disagree on whether " .. name .. " has a gradient", 0) end
    if g then
      local d, m = 0, 0
      for i = 1, #g do d, m = math.max(d, math.abs(s[i] - g[i])), math.max(m, math.abs(g[i])) end
      worst, n = math.max(worst, d / math.max(m, 1e-30)), n + 1
    end
  end
  if not (worst <= 1e-4) then
    error(string.format("long_context: the staged step's gradients differ from the plain step's by %.3g (> 1e-4)", worst), 0)
  end
  io.stderr:write(string.format("  staged == plain at T = %d: %d gradients, max rel err %.2g\n", Tn, n, worst))
  return worst
end

local function run_size(model, Tn, cfg)
  local ids, tgt = tokens(Tn)
  -- the best of `reps` staged steps up to reps_max_T (the machine is shared), one step above
  local r
  for _ = 1, Tn <= cfg.reps_max_T and cfg.reps or 1 do
    local s = staged_step(model, ids, tgt)
    if not r or s.seconds < r.seconds then r = s end
    collectgarbage()
  end
  r.T, r.reps = Tn, Tn <= cfg.reps_max_T and cfg.reps or 1
  local kda, mla, n_kda, n_mla = 0, 0, 0, 0
  for l, m in ipairs(model.schedule) do
    if m == "kda" then kda, n_kda = kda + r.layers[l].seconds, n_kda + 1 else mla, n_mla = mla + r.layers[l].seconds, n_mla + 1 end
    r.layers[l].mixer = m
  end
  r.kda_seconds, r.mla_seconds = kda, mla
  r.other_seconds = r.seconds - kda - mla
  r.kda_share, r.mla_share = kda / r.seconds, mla / r.seconds
  r.kda_us_per_token_layer = 1e6 * kda / n_kda / Tn
  r.mla_us_per_token_layer = 1e6 * mla / n_mla / Tn
  r.tokens_per_s = Tn / r.seconds
  io.stderr:write(string.format("  T=%-7d staged step %.2f s (KDA %.2f s, MLA %.2f s, other %.2f s), peak %.1f MB, loss %.4f\n",
    Tn, r.seconds, kda, mla, r.other_seconds, r.peak_bytes / 2 ^ 20, r.loss))
  if Tn <= cfg.check_max then
    r.plain = plain_step(model, ids, tgt)
    io.stderr:write(string.format("  T=%-7d plain step  %.2f s, peak %.1f MB, loss %.4f\n", Tn, r.plain.seconds,
      r.plain.peak_bytes / 2 ^ 20, r.plain.loss))
  end
  return r
end

-- per-token time ratios of consecutive sizes: KDA ≈ 1 (linear), MLA ≈ the length ratio (quadratic)
local function ratios(rows)
  local out = {}
  for i = 2, #rows do
    local a, b = rows[i - 1], rows[i]
    out[#out + 1] = { from = a.T, to = b.T, length = b.T / a.T,
      kda = b.kda_us_per_token_layer / a.kda_us_per_token_layer, mla = b.mla_us_per_token_layer / a.mla_us_per_token_layer }
  end
  return out
end

local function kb(n) return string.format("%dK", math.floor(n / 1024 + 0.5)) end

local function step_section(record)
  local L = {}
  local m = record.model
  L[#L + 1] = "## One training step (forward + backward), recompute = \"layer\""
  L[#L + 1] = ""
  L[#L + 1] = string.format("nn.HybridLM d %d, %d layers %s (KDA %d x %d; MLA %d head, kv_rank %d, nope %d, rope %d, v %d), "
    .. "SwiGLU FFN %d, Block AttnRes B = %d, V %d, f32, %d parameters; batch 1, one sequence; the best of %d steps at "
    .. "T <= %s, one step above.", m.dim, m.n_layers, m.mixers, m.kda.heads, m.kda.head_dim, m.mla.heads, m.mla.kv_rank,
    m.mla.nope_dim, m.mla.rope_dim, m.mla.v_dim, m.ffn_dim, m.attnres.block_layers, m.vocab_size, record.params,
    record.reps, kb(record.reps_max_T))
  L[#L + 1] = ""
  L[#L + 1] = "| T | step s | tok/s | peak MB | 3 KDA layers s (share) | 1 MLA layer s (share) | other s | KDA µs/token/layer | MLA µs/token/layer |"
  L[#L + 1] = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for _, r in ipairs(record.steps) do
    L[#L + 1] = string.format("| %s | %.2f | %.0f | %.1f | %.2f (%.0f%%) | %.2f (%.0f%%) | %.2f | %.2f | %.2f |", kb(r.T),
      r.seconds, r.tokens_per_s, r.peak_bytes / 2 ^ 20, r.kda_seconds, 100 * r.kda_share, r.mla_seconds, 100 * r.mla_share,
      r.other_seconds, r.kda_us_per_token_layer, r.mla_us_per_token_layer)
  end
  L[#L + 1] = ""
  local parts = {}
  for _, q in ipairs(record.ratios) do
    parts[#parts + 1] = string.format("%s → %s (x%g): KDA %.2fx, MLA %.2fx", kb(q.from), kb(q.to), q.length, q.kda, q.mla)
  end
  L[#L + 1] = "Per-token time per layer between sizes (linear = 1x, quadratic = the length ratio): " .. table.concat(parts, "; ")
    .. ". The MLA layer's per-token time also holds its T-independent part (projections, FFN, norms), so its ratio "
    .. "approaches the length ratio as the attention's T² term takes over."
  local checks = {}
  for _, r in ipairs(record.steps) do
    if r.plain then
      checks[#checks + 1] = string.format("%s %.2f s / %.1f MB (staged %.2f s / %.1f MB)", kb(r.T), r.plain.seconds,
        r.plain.peak_bytes / 2 ^ 20, r.seconds, r.peak_bytes / 2 ^ 20)
    end
  end
  if #checks > 0 then
    L[#L + 1] = ""
    L[#L + 1] = "The plain step (model:loss + backward, no staging) at the same sizes: " .. table.concat(checks, "; ") .. "."
  end
  L[#L + 1] = ""
  L[#L + 1] = "Shares are measured inside the step: each layer's forward is timed, and the backward runs stage by stage "
    .. "(every layer's inputs are detached leaves; each stage's backward — its recompute region's replay and its "
    .. "gradients — is one timed call). \"other\" = embedding, final mix, head, loss and the gradient hand-overs. "
    .. string.format("At T = %d the staged step's parameter gradients equal the plain step's to %.2g (max |Δ| / max |g| "
    .. "per tensor, f32).", record.staging_check.T, record.staging_check.max_rel_grad_err)
  return table.concat(L, "\n")
end

-- the Markdown sections in order; each takes the record and returns its text
local SECTIONS = { step_section }

local function markdown(record)
  local sizes = {}
  for _, r in ipairs(record.steps) do sizes[#sizes + 1] = kb(r.T) end
  local L = { "# bench/long_context — one training step of a 3:1 hybrid at " .. table.concat(sizes, ", ") .. " tokens (CPU)", "" }
  L[#L + 1] = string.format("%s, %d threads, %s; load average %s at the start, %s at the end (the machine is shared: "
    .. "times carry that noise).", record.date, record.threads, record.blas, tostring(record.loadavg_start),
    tostring(record.loadavg_end))
  for _, section in ipairs(SECTIONS) do
    L[#L + 1] = ""
    L[#L + 1] = section(record)
  end
  L[#L + 1] = ""
  return table.concat(L, "\n")
end

local function run(cfg)
  local record = {
    benchmark = "long_context", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(),
    blas = ffi.string(tide.C.tide_blas_info()), loadavg_start = results.loadavg(), model = CFG, steps = {},
    reps = cfg.reps, reps_max_T = cfg.reps_max_T,
  }
  tide.manual_seed(1)
  local model = tide.nn.HybridLM(CFG)
  record.params = model:num_parameters()
  io.stderr:write("long_context: warm-up at T = 1024, and the staged step checked against the plain step\n")
  record.staging_check = { T = 1024, max_rel_grad_err = check_staging(model, 1024) }
  io.stderr:write("long_context: one staged training step per size\n")
  for _, Tn in ipairs(results.numbers(cfg.sizes)) do
    record.steps[#record.steps + 1] = run_size(model, Tn, cfg)
    collectgarbage()
  end
  record.ratios = ratios(record.steps)
  record.loadavg_end = results.loadavg()
  local md = markdown(record)
  io.write(md)
  results.write(cfg.results, "long_context", record, md)
  return 0
end

return {
  sizes = "8192,32768,131072",   -- sequence lengths
  reps = 2,                      -- staged steps per size up to reps_max_T; the fastest counts
  reps_max_T = 32768,            -- above it one step (the 128K step alone takes minutes)
  check_max = 8192,              -- the plain step also runs at sizes up to this (0: never)
  results = "bench/results",     -- where long_context.json / .md go; "" writes nothing
  run = run,
}
