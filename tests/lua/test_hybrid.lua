-- hybrid: nn.HybridLM (spec/mla.md §7, attnres.md §3, §7) — the mixer schedule, parameter counts of the
-- tiny config's mixers, every residual kind, decode with KDA + latent MLA caches == the full forward,
-- greedy generation == argmax of the full forward, batched == row by row, packed documents, and a
-- float64 gradient check of a 4-layer hybrid end to end.
local T = require "tide.testing"
local tide = require "tide"
local nn, F = tide.nn, tide.F
local hybrid = require "tide.nn.hybrid"

local max_abs_diff = T.max_abs_diff

-- a small hybrid in f64; weights scaled up so every path matters
local function small(opts)
  local cfg = {
    vocab_size = 23, dim = 16, n_layers = 4, ffn_dim = 24, dtype = "f64", init_std = 0.2,
    kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 12, kv_rank = 8, nope_dim = 4, rope_dim = 2, v_dim = 4 },
    residual = "attnres_block", attnres = { block_layers = 2 },
  }
  for k, v in pairs(opts or {}) do cfg[k] = v end
  if cfg.residual ~= "attnres_block" and opts and opts.attnres == nil then cfg.attnres = nil end
  local m = nn.HybridLM(cfg)
  -- AttnRes pseudo-queries start at 0 (uniform mixes); give them values so the mixes are not trivial
  for name, t in m:named_parameters() do
    if name:find("_res_proj") or name:find("gamma") then tide.no_grad(function() t:copy_(tide.randn(t:shape(), { dtype = "f64" }) * 0.5) end) end
  end
  return m
end

local function ids(B, Tn, V) return tide.rand({ B, Tn }, { lo = 0, hi = V }):to("i32") end

T.test("mixer schedule: 3:1 with the last layer MLA (mla.md §7) for L = 4, 8, 27, 93; patterns and lists", function()
  local function mla_set(L, mixers, last)
    local s = hybrid.mixer_schedule({ n_layers = L, mixers = mixers, last_mla = last })
    local out = {}
    for l, m in ipairs(s) do if m == "mla" then out[#out + 1] = l - 1 end end
    return out
  end
  T.eq(mla_set(4), { 3 })
  T.eq(mla_set(8), { 3, 7 })                                  -- tiny: 0-based {3, 7}
  local k27 = mla_set(27)                                     -- Kimi Linear: 1-based {4, 8, ..., 24, 27}
  T.eq(#k27, 7)
  T.eq(k27[7], 26)
  T.eq(k27[6], 23)
  local k93 = mla_set(93)                                     -- K3: 24 MLA, 1-based {4, ..., 92, 93}
  T.eq(#k93, 24)
  T.eq(k93[23], 91)
  T.eq(k93[24], 92)
  T.eq(#mla_set(6, "K"), 0, "pure KDA")
  T.eq(#mla_set(5, "M"), 5, "pure MLA")
  T.eq(mla_set(4, "KM", false), { 1, 3 })
  T.eq(mla_set(3, { "mla", "kda", "kda" }), { 0 })
  T.raises(function() hybrid.mixer_schedule({ n_layers = 3, mixers = "KXM" }) end, "letters K and M")
  T.raises(function() hybrid.mixer_schedule({ n_layers = 3, mixers = { "kda" } }) end, "lists 1 layers")
end)

T.test("tiny config mixers: KDA layer 100,290 and MLA layer 92,320 parameters (spec README oracle 1)", function()
  local m = nn.HybridLM({
    vocab_size = 320, dim = 128, n_layers = 4, ffn_dim = 384,
    kda = { heads = 2, head_dim = 64 }, mla = { heads = 2, q_rank = 96, kv_rank = 64, nope_dim = 64, rope_dim = 32, v_dim = 64 },
  })
  T.eq(m.model.layers:get(1).self_attn:num_parameters(), 100290)
  T.eq(m.model.layers:get(4).self_attn:num_parameters(), 92320)
  T.eq(m.model.layers:get(4).mixer, "mla")
  T.ok(m.model.layers:get(1).self_attention_res_proj, "Block AttnRes sites on the layers")
  T.ok(m.model.output_attn_res_proj, "and the final mix on the body")
end)

T.test("decode with KDA + latent MLA caches == the full forward, every residual kind (f64 1e-11)", function()
  for _, res in ipairs({ "attnres_block", "prenorm", "attnres_full", "gamma_chain" }) do
    tide.manual_seed(21)
    local m = small({ residual = res })
    local x = ids(2, 9, 23)
    local full = m:forward(x)
    local cache, outs = m:new_cache(), {}
    tide.no_grad(function()
      outs[1] = m:forward(x:narrow(2, 1, 5), cache)
      for t = 6, 9 do outs[#outs + 1] = m:forward(x:narrow(2, t, 1), cache) end
    end)
    T.near(max_abs_diff(F.concat(outs, 2), full), 0, 1e-11, res)
  end
end)

T.test("greedy generation with caches == argmax of the full forward at every step; batched == row by row", function()
  tide.manual_seed(22)
  local m = small()
  local prompt = { 3, 7, 1, 12, 5 }
  local gen = m:generate(prompt, { max_new = 10 })
  T.eq(#gen, 10)
  local seq = {}
  for i, v in ipairs(prompt) do seq[i] = v end
  for step = 1, 10 do
    local logits = tide.no_grad(function() return m:forward(tide.tensor({ seq }, { dtype = "i32" })) end)
    local last = logits:narrow(2, #seq, 1):tolist()
    local best = 1
    for v = 2, #last do if last[v] > last[best] then best = v end end
    T.eq(gen[step], best - 1, "step " .. step)
    seq[#seq + 1] = best - 1
  end
  -- a batch of equal-length prompts and one of another length: greedy rows match their runs alone; sampled
  -- rows are reproducible and draw from the stream of their index in the call
  local prompts = { { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8 } }
  local batch = m:generate(prompts, { max_new = 6 })
  for r = 1, 3 do T.eq(m:generate(prompts[r], { max_new = 6 }), batch[r], "greedy row " .. r) end
  local opts = { max_new = 6, temperature = 0.8, top_k = 5, seed = 9 }
  local s1, s2 = m:generate(prompts, opts), m:generate({ prompts[1], prompts[2] }, opts)
  T.eq(m:generate(prompts, opts), s1, "same seed, same samples")
  T.eq(s2[1], s1[1], "row 1 in a smaller batch")
  T.eq(s2[2], s1[2], "row 2 in a smaller batch")
  -- a stop id ends a row and is kept
  local stopped = m:generate(prompt, { max_new = 10, stop = gen[3] })
  T.eq(stopped[#stopped], gen[3])
  T.ok(#stopped <= 3)
end)

T.test("TransformerLM:generate (attention KV cache) == argmax of the full forward", function()
  tide.manual_seed(25)
  local m = nn.TransformerLM({ vocab_size = 31, dim = 16, n_layers = 2, n_heads = 2, ffn_dim = 32, dtype = "f64", init_std = 0.3 })
  local seq = { 4, 9, 2 }
  local gen = m:generate(seq, { max_new = 6 })
  for step = 1, 6 do
    local last = tide.no_grad(function() return m:forward(tide.tensor({ seq }, { dtype = "i32" })) end)
    last = last:narrow(2, #seq, 1):tolist()
    local best = 1
    for v = 2, #last do if last[v] > last[best] then best = v end end
    T.eq(gen[step], best - 1, "step " .. step)
    seq[#seq + 1] = best - 1
  end
end)

T.test("packed documents through every layer == separate runs (f64 1e-12)", function()
  tide.manual_seed(23)
  local m = small()
  local a, b = ids(1, 6, 23), ids(1, 7, 23)
  local packed = m:forward(F.concat({ a, b }, 2), nil, { cu_seqlens = { 0, 6, 13 } })
  T.near(max_abs_diff(packed:narrow(2, 1, 6), m:forward(a)), 0, 1e-12, "doc A")
  T.near(max_abs_diff(packed:narrow(2, 7, 7), m:forward(b)), 0, 1e-12, "doc B")
end)

T.test("gradient check of a 4-layer hybrid end to end (f64; embedding, mixers, FFNs, AttnRes, head)", function()
  tide.manual_seed(24)
  local m = small({ vocab_size = 11, dim = 8, ffn_dim = 12, kda = { heads = 2, head_dim = 4, chunk = 4 },
    mla = { heads = 2, q_rank = 6, kv_rank = 4, nope_dim = 2, rope_dim = 2, v_dim = 3 } })
  local x, y = ids(2, 6, 11), ids(2, 6, 11)
  local inputs = {}
  for _, t in m:named_parameters() do inputs[#inputs + 1] = t end
  T.gradcheck(function() return F.cross_entropy(m:forward(x):reshape(12, 11), y:reshape(12)) end, inputs,
    { atol = 1e-8, rtol = 1e-6, max_checks = 6 })
end)

T.test("gamma chain over a range of layers == the full chain with γ = 0 at the range start and outside", function()
  tide.manual_seed(26)
  local ranged = small({ residual = "gamma_chain", gamma_chain = { layers = { 2, 3 } } })
  local full = small({ residual = "gamma_chain" })
  local names = {}
  for name in ranged:named_parameters() do if name:find("attn_gamma") then names[#names + 1] = name end end
  -- checkpoint names count layers from 0 (formats.md): Lua layers 2 and 3 are model.layers.1 and .2
  T.eq(names, { "model.layers.1.attn_gamma", "model.layers.2.attn_gamma" }, "γ only inside the range")
  local src = ranged:state_dict()
  tide.no_grad(function()
    for name, t in full:named_parameters() do
      if name:find("attn_gamma") then
        if name == "model.layers.2.attn_gamma" then t:copy_(src[name]) else t:zero_() end
      else
        t:copy_(src[name])
      end
    end
  end)
  local x = ids(2, 7, 23)
  T.eq(ranged:forward(x):tolist(), full:forward(x):tolist(), "bitwise")
  T.raises(function() small({ residual = "gamma_chain", gamma_chain = { layers = { 3, 9 } } }) end, "gamma_range must be")
end)

T.test("decode_rows: R rows on their own caches (different lengths) == each row's own step, bitwise; errors", function()
  -- f32 and both thread counts: batch-invariant products make row r of an R-row step its one-row step's bits
  local m = small({ dtype = "f32", n_layers = 4, mixers = "KMKM" })
  m:eval()
  local R, V = 4, 23
  local threads = tide.num_threads()
  tide.no_grad(function()
    for _, nt in ipairs({ 1, 2 }) do
      tide.set_num_threads(nt)
      local a, b = {}, {}
      for r = 1, R do
        local p = ids(1, 3 + 4 * r, V)
        a[r], b[r] = m:new_cache(), m:new_cache()
        m:forward(p, a[r])
        m:forward(p, b[r])
      end
      for step = 1, 4 do
        local x = ids(R, 1, V)
        local lb = m:decode_rows(x, b)
        T.eq(lb:shape(), { R, 1, V })
        for r = 1, R do
          local la = m:forward(x:narrow(1, r, 1), a[r])
          T.eq(lb:narrow(1, r, 1):tolist(), la:tolist(), "bitwise")
        end
      end
      -- the caches advanced alike: one more token, then the rows' states and latents agree
      local function agree(r)
        for l = 1, 4 do T.eq(b[r][l].pos, a[r][l].pos) end
        T.eq(b[r][1].state:tolist(), a[r][1].state:tolist())
        for _, name in ipairs({ "q", "k", "v" }) do T.eq(b[r][3].conv[name]:tolist(), a[r][3].conv[name]:tolist()) end
        T.eq(b[r][2].c:shape(), a[r][2].c:shape())
        T.eq(b[r][2].c:tolist(), a[r][2].c:tolist())
        T.eq(b[r][4].k_r:tolist(), a[r][4].k_r:tolist())
      end
      for r = 1, R do agree(r) end
      -- a row leaves (a new stack of the others), then steps on that stack: the conv tails written into it in
      -- place and the latent views grown in place still give each row its own step's bits
      local keep = { b[1], b[3], b[4] }
      for _ = 1, 3 do
        local x = ids(3, 1, V)
        local lb = m:decode_rows(x, keep)
        for i, r in ipairs({ 1, 3, 4 }) do
          T.eq(lb:narrow(1, i, 1):tolist(), m:forward(x:narrow(1, i, 1), a[r]):tolist(), "bitwise after a row left")
        end
      end
      for _, r in ipairs({ 1, 3, 4 }) do agree(r) end
      agree(2)   -- the row that left kept its own caches
    end
  end)
  tide.set_num_threads(threads)
  T.eq(tide.C.tide_batch_invariant(), 0, "the decode step restores the mode")
  T.raises(function() tide.no_grad(function() m:decode_rows(ids(2, 1, V), { m:new_cache() }) end) end,
    "caches must list one cache per row of ids (2), got 1")
  T.raises(function()
    local c = { m:new_cache(), m:new_cache() }
    tide.no_grad(function() m:forward(ids(2, 3, V), c[1]) end)
    tide.no_grad(function() m:decode_rows(ids(2, 1, V), c) end)
  end, "mixes started and empty caches")
  T.raises(function()
    local c = m:new_cache()
    m:forward(ids(1, 3, V), c)
    m:decode_rows(ids(1, 1, V), { c })
  end, "decodes without gradients")
end)

T.test("exact forward: any split of a sequence into calls (prefill, decode steps, chunks) gives the same bits", function()
  -- f32 with MoE and AttnRes, B = 2 rows, both thread counts; the chunked forward agrees to f32 rounding only
  local V = 23
  local m = small({ dtype = "f32", n_layers = 4, mixers = "KMKM", moe = { n_experts = 4, top_k = 2, expert_dim = 8 } })
  m:eval()
  local threads = tide.num_threads()
  local x = ids(2, 19, V)
  tide.no_grad(function()
    for _, nt in ipairs({ 1, 2 }) do
      tide.set_num_threads(nt)
      local whole = m:forward(x, m:new_cache(), { exact = true })
      for _, split in ipairs({ { 19 }, { 1, 18 }, { 7, 1, 1, 1, 9 }, { 5, 5, 5, 4 } }) do
        local c, pos, parts = m:new_cache(), 0, {}
        for _, n in ipairs(split) do
          -- single tokens as plain decode steps, longer parts as exact calls
          local o = n > 1 and { exact = true } or nil
          parts[#parts + 1] = m:forward(x:narrow(2, pos + 1, n), c, o)
          pos = pos + n
        end
        T.eq(tide.F.concat(parts, 2):tolist(), whole:tolist(), "split " .. table.concat(split, "+") .. " bitwise")
      end
      -- last = true: the last position's logits alone, the same bits, and the same caches after it
      local c1, c2 = m:new_cache(), m:new_cache()
      local last = m:forward(x, c1, { exact = true, last = true })
      T.eq(last:shape(), { 2, 1, V }, "last = true gives [B, 1, V]")
      T.eq(last:tolist(), whole:narrow(2, 19, 1):tolist(), "last = true: the last position's bits")
      m:forward(x, c2, { exact = true })
      local nxt = x:narrow(2, 1, 1)
      T.eq(m:forward(nxt, c1):tolist(), m:forward(nxt, c2):tolist(), "last = true: the same caches")
      local chunked = m:forward(x)
      local d = (chunked - whole):abs():max():item()
      T.ok(d > 0 and d < 1e-4, "chunked vs exact " .. d)
    end
  end)
  tide.set_num_threads(threads)
  T.eq(tide.C.tide_batch_invariant(), 0, "the exact forward restores the mode")
  T.raises(function() tide.no_grad(function() m:forward(x, nil, { exact = true }) end) end, "exact = true runs on caches")
  T.raises(function() m:forward(x, m:new_cache(), { exact = true }) end, "exact = true runs without gradients")
  T.raises(function() tide.no_grad(function() m:forward(x, m:new_cache(), { exact = true, cu_seqlens = { 0, 19, 38 } }) end) end,
    "one document per row")
end)

T.test("config errors name the problem", function()
  T.raises(function() nn.HybridLM({ vocab_size = 10, dim = 8, n_layers = 2, mla = { heads = 1, kv_rank = 4, nope_dim = 2 } }) end,
    "needs cfg.kda")
  T.raises(function() nn.HybridLM({ dim = 8, n_layers = 2, mixers = "K", kda = { heads = 2, head_dim = 4 }, bogus = 1 }) end,
    "nn.HybridLM: unknown key 'bogus' in config")
  T.raises(function()
    nn.HybridLM({ dim = 8, n_layers = 2, mixers = "K", kda = { heads = 2, head_dim = 4 }, residual = "gamma_chain",
      attnres = { block_layers = 2 } })
  end, "cannot be combined")
end)

T.run()
