-- bench/generate.lua — decoding speed with caches (spec/mla.md §6, kda.md §7): three models of the same
-- width and depth — pure KDA, pure MLA, and the 3:1 hybrid (nn.HybridLM) — prefill a prompt of 1K, 8K or 32K
-- tokens, then decode one token at a time. A KDA layer's cache is a fixed-size state, so its cost per token
-- does not depend on the prompt; an MLA layer attends over its latent cache [ĉ | k_r] (d_c + d_r values per
-- token). Cache bytes per token per layer are printed beside a standard multi-head attention cache of the
-- same heads (K and V per head). f32 on the CPU, greedy. Writes <results>/generate.{json,md}.
--
--   tide run bench/generate.lua [--prompts=1024,8192,32768] [--new_tokens=32] [--results=DIR]
local ffi = require "ffi"
local tide = require "tide"
local results = require "tide.results"

local WIDTH = {
  vocab_size = 320, dim = 128, n_layers = 4, ffn_dim = 384, residual = "attnres_block", attnres = { block_layers = 2 },
  kda = { heads = 2, head_dim = 64 },
  mla = { heads = 2, q_rank = 96, kv_rank = 64, nope_dim = 64, rope_dim = 32, v_dim = 64 },
}
local MODELS = { { name = "kda", mixers = "K" }, { name = "mla", mixers = "M" }, { name = "hybrid", mixers = "3:1" } }

local function build(mixers)
  local cfg = {}
  for k, v in pairs(WIDTH) do cfg[k] = v end
  cfg.mixers = mixers
  tide.manual_seed(1)
  local m = tide.nn.HybridLM(cfg)
  m:eval()
  return m
end

-- bytes held by a model's caches (all layers) and the numbers per layer kind
local function cache_bytes(caches)
  local total = 0
  local function add(t) if t then total = total + t:numel() * t:element_size() end end
  for _, c in ipairs(caches) do
    add(c.state); add(c.c); add(c.k_r)
    if c.conv then add(c.conv.q); add(c.conv.k); add(c.conv.v) end
  end
  return total
end

local function argmax_last(logits)
  local last = logits:narrow(2, logits:size(2), 1):tolist()
  local best = 1
  for v = 2, #last do if last[v] > last[best] then best = v end end
  return best - 1
end

local function run(cfg)
  local prompts = results.numbers(cfg.prompts)
  local record = {
    benchmark = "generate", date = os.date("!%Y-%m-%d %H:%M UTC"), threads = tide.num_threads(),
    blas = ffi.string(tide.C.tide_blas_info()), new_tokens = cfg.new_tokens, width = WIDTH, runs = {},
  }
  -- per token per layer: the MLA latent (d_c + d_r) vs K and V of every head; KDA: a fixed state per sequence
  local mla, kda, es = WIDTH.mla, WIDTH.kda, 4
  record.cache = {
    mla_latent_bytes_per_token_layer = (mla.kv_rank + mla.rope_dim) * es,
    mha_bytes_per_token_layer = mla.heads * (mla.nope_dim + mla.rope_dim + mla.v_dim) * es,
    kda_state_bytes_per_layer = kda.heads * kda.head_dim * kda.head_dim * es + 3 * 3 * kda.heads * kda.head_dim * es,
  }
  io.stderr:write("generate: prefill then greedy decode, per model and prompt length\n")
  for _, spec in ipairs(MODELS) do
    local m = build(spec.mixers)
    for _, P in ipairs(prompts) do
      tide.manual_seed(P)
      local ids = tide.rand({ 1, P }, { lo = 0, hi = WIDTH.vocab_size }):to("i32")
      collectgarbage()
      local r = tide.no_grad(function()
        -- warm up (first allocations, traces), untimed
        local warm = m:new_cache()
        m:forward(tide.tensor({ { 1, 2, 3, 4 } }, { dtype = "i32" }), warm)
        for _ = 1, 4 do m:forward(tide.tensor({ { 5 } }, { dtype = "i32" }), warm) end
        warm = nil
        collectgarbage()
        local caches = m:new_cache()
        local t0 = tide.time()
        local logits = m:forward(ids, caches)
        local id = argmax_last(logits)
        logits = nil
        collectgarbage()             -- the prefill's activations, as generate.ids does
        local t1 = tide.time()
        for _ = 1, cfg.new_tokens do
          id = argmax_last(m:forward(tide.tensor({ { id } }, { dtype = "i32" }), caches))
        end
        local t2 = tide.time()
        return { model = spec.name, prompt = P, prefill_seconds = t1 - t0, decode_seconds = t2 - t1,
          decode_tokens_per_s = cfg.new_tokens / (t2 - t1), cache_bytes = cache_bytes(caches) }
      end)
      io.stderr:write(string.format("  %-6s prompt %-6d prefill %.2f s, decode %.1f tok/s, cache %.2f MB\n", spec.name, P,
        r.prefill_seconds, r.decode_tokens_per_s, r.cache_bytes / 2 ^ 20))
      record.runs[#record.runs + 1] = r
    end
    m = nil
    collectgarbage()
  end
  local c = record.cache
  local L = {
    "# bench/generate — decoding with KDA state and MLA latent caches on the CPU", "",
    string.format("%s, %d threads, %s. Models of the same width: d %d, %d layers, FFN %d, Block AttnRes (B = 2); KDA "
      .. "H %d x %d; MLA H %d, d_q %d, d_c %d, d_n %d, d_r %d (NoPE), dv %d. f32, batch 1, greedy, %d new tokens "
      .. "after the prompt.", record.date, record.threads, record.blas, WIDTH.dim, WIDTH.n_layers, WIDTH.ffn_dim,
      kda.heads, kda.head_dim, mla.heads, mla.q_rank, mla.kv_rank, mla.nope_dim, mla.rope_dim, mla.v_dim, cfg.new_tokens), "",
    "| model | prompt | prefill s | decode tok/s | cache MB |",
    "|---|---:|---:|---:|---:|",
  }
  for _, r in ipairs(record.runs) do
    L[#L + 1] = string.format("| %s | %d | %.2f | %.1f | %.2f |", r.model, r.prompt, r.prefill_seconds, r.decode_tokens_per_s,
      r.cache_bytes / 2 ^ 20)
  end
  L[#L + 1] = ""
  L[#L + 1] = string.format("Cache per token per MLA layer: %d bytes (the latent [ĉ | k_r], %d values) against %d bytes for "
    .. "multi-head K and V of the same heads (%.1fx less). A KDA layer holds %d bytes per sequence whatever its length.",
    c.mla_latent_bytes_per_token_layer, mla.kv_rank + mla.rope_dim, c.mha_bytes_per_token_layer,
    c.mha_bytes_per_token_layer / c.mla_latent_bytes_per_token_layer, c.kda_state_bytes_per_layer)
  L[#L + 1] = ""
  local md = table.concat(L, "\n")
  io.write(md)
  results.write(cfg.results, "generate", record, md)
  return 0
end

return {
  prompts = "1024,8192,32768",
  new_tokens = 32,
  results = "bench/results",
  run = run,
}
