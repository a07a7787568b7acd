-- hf.lua — HuggingFace model directories (formats.md §1, §2, §4): the config.json of a dense tide model as
-- LlamaForCausalLM and back, the documented config.json of the hybrid model, the tensors a directory holds (the
-- fused MoE experts split per expert), the byte-level vocabulary as a tokenizer.json, and reading a single-file or
-- sharded model.safetensors. Used by `tide export` and `tide import`.
--
-- Why a dense tide model is a Llama, term by term (lua/tide/nn/transformer.lua, attention.lua, norm.lua, mlp.lua,
-- kernels/cpu/rope.c): pre-norm blocks x += o_proj(attn(input_layernorm(x))), x += down(silu(gate(x')) · up(x'));
-- RMSNorm x / sqrt(mean(x²) + eps) · w (Llama's LlamaRMSNorm, eps inside the root); RoPE on pairs (i, i + D/2) at
-- angle pos · theta^(−2i/D) (Llama's rotate_half layout, not the interleaved one); scale 1/sqrt(D); no biases; a
-- final norm and an untied or tied head. tide has no grouped-query attention, so num_key_value_heads =
-- num_attention_heads. The tensor names are already Llama's (formats.md §2).
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"
local C = tide.C

local fmt = string.format
local hf = {}

local function fail(msg) error(msg, 0) end

-- ---- JSON with indentation (config.json is read by people) ---------------------------------------------------
-- pretty(v, order) -> text: two-space indent; object keys in order.first's order, then sorted, then order.last's
-- (an array order is order.first); an object of scalars below the second level is written on one line; a value
-- hf.raw(text) is written as the JSON text it holds
local RAW = {}
function hf.raw(text) return setmetatable({ text = text }, RAW) end

local function is_scalar(v) return type(v) ~= "table" or v == json.null end

function hf.pretty(v, order, indent)
  indent = indent or ""
  if order and order[1] then order = { first = order } end
  order = order or {}
  if getmetatable(v) == RAW then return v.text end
  if is_scalar(v) then return json.encode(v) end
  local inner = indent .. "  "
  local n = #v
  local is_array = n > 0 or (getmetatable(v) ~= nil and next(v) == nil)
  if n > 0 then for k in pairs(v) do if type(k) ~= "number" then is_array = false end end end
  if is_array then
    local simple = true
    for i = 1, n do if not is_scalar(v[i]) then simple = false end end
    if simple then return json.encode(v) end
    local parts = {}
    for i = 1, n do parts[i] = inner .. hf.pretty(v[i], order, inner) end
    return "[\n" .. table.concat(parts, ",\n") .. "\n" .. indent .. "]"
  end
  local keys, rank = {}, {}
  for i, k in ipairs(order.first or {}) do rank[k] = i - 1e6 end
  for i, k in ipairs(order.last or {}) do rank[k] = i + 1e6 end
  local flat = #indent >= 4
  for k, x in pairs(v) do
    keys[#keys + 1] = k
    if not is_scalar(x) or getmetatable(x) == RAW then flat = false end
  end
  if #keys == 0 then return "{}" end
  table.sort(keys, function(a, b)
    local ra, rb = rank[a] or 0, rank[b] or 0
    if ra ~= rb then return ra < rb end
    return a < b
  end)
  local parts = {}
  for i, k in ipairs(keys) do
    parts[i] = (flat and "" or inner) .. json.encode(k) .. ": " .. hf.pretty(v[k], order, inner)
  end
  if flat then return "{" .. table.concat(parts, ", ") .. "}" end
  return "{\n" .. table.concat(parts, ",\n") .. "\n" .. indent .. "}"
end

-- ---- the byte-level vocabulary as tokenizer.json (formats.md §4) --------------------------------------------------
-- GPT-2's byte map: bytes 0x21–0x7E, 0xA1–0xAC, 0xAE–0xFF are their own code point, the other 68 map to 256, 257, …
-- in ascending byte order
local function byte_map()
  local map, extra = {}, 0
  for b = 0, 255 do
    if (b >= 0x21 and b <= 0x7E) or (b >= 0xA1 and b <= 0xAC) or (b >= 0xAE and b <= 0xFF) then map[b] = b
    else map[b] = 256 + extra; extra = extra + 1 end
  end
  return map
end

local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) end
  return string.char(0xE0 + math.floor(cp / 4096), 0x80 + math.floor(cp / 64) % 64, 0x80 + cp % 64)
end

-- the 256 byte tokens: symbol (UTF-8 of the mapped code point) -> byte
local function byte_symbols()
  local out = {}
  for b, cp in pairs(byte_map()) do out[utf8_char(cp)] = b end
  return out
end

-- byte_tokenizer_json(tok) -> text: tide's byte-level vocabulary as a tokenizers BPE model with no merges, so token
-- id b is byte b (through the ByteLevel byte map) and ids 256 … V−1 are tide's specials as added tokens. Encoding
-- differs in one way: HF splits a literal special name out of the text, tide keeps it as bytes (formats.md §4).
function hf.byte_tokenizer_json(tok)
  local syms = {}
  for sym, b in pairs(byte_symbols()) do syms[b + 1] = sym end
  -- the vocabulary in id order (json.encode would sort the symbols)
  local lines = {}
  for b = 0, 255 do lines[b + 1] = "      " .. json.encode(syms[b + 1]) .. ": " .. b end
  local vocab = hf.raw("{\n" .. table.concat(lines, ",\n") .. "\n    }")
  local added = {}
  for id = 256, tok.vocab_size - 1 do
    added[#added + 1] = { id = id, content = tok.names[id], single_word = false, lstrip = false, rstrip = false,
      normalized = false, special = true }
  end
  local bl = { type = "ByteLevel", add_prefix_space = false, trim_offsets = true, use_regex = false }
  local t = {
    version = "1.0", truncation = json.null, padding = json.null, added_tokens = json.array(added),
    normalizer = json.null, pre_tokenizer = bl, post_processor = json.null, decoder = bl,
    model = { type = "BPE", dropout = json.null, unk_token = json.null, continuing_subword_prefix = json.null,
      end_of_word_suffix = json.null, fuse_unk = false, byte_fallback = false, vocab = vocab, merges = json.array({}) },
  }
  return hf.pretty(t, { "version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
    "post_processor", "decoder", "model", "type", "id", "content" }) .. "\n"
end

-- byte_level_vocab_size(t) -> V when the decoded tokenizer.json t is exactly the byte-level form written above
-- (256 byte tokens at their byte's id, no merges, tide's specials from 256 in order), else nil
function hf.byte_level_vocab_size(t)
  local m = type(t) == "table" and t.model
  if type(m) ~= "table" or m.type ~= "BPE" or type(m.vocab) ~= "table" then return nil end
  if type(m.merges) == "table" and #m.merges > 0 then return nil end
  local syms, n = byte_symbols(), 0
  for sym, id in pairs(m.vocab) do
    if syms[sym] ~= id then return nil end
    n = n + 1
  end
  if n ~= 256 then return nil end
  local tokenizer = require "tide.data.tokenizer"
  local added = t.added_tokens or {}
  local V = 256 + #added
  if V < 257 then return nil end
  local ref = tokenizer.byte_level({ vocab_size = V })
  for i, a in ipairs(added) do
    if type(a) ~= "table" or a.id ~= 255 + i or a.content ~= ref.names[255 + i] then return nil end
  end
  return V
end

-- ---- dense: LlamaForCausalLM -----------------------------------------------------------------------------------
local function special_id(tok, name)
  local ok, id = pcall(tok.id, tok, name)
  return ok and id or nil
end

local TORCH_DTYPE = { f32 = "float32", bf16 = "bfloat16", f64 = "float64" }

-- llama_config(mc, tok) -> the config.json table of a dense model config (refuses what Llama cannot express)
function hf.llama_config(mc, tok)
  if mc.kind ~= "dense" then fail(fmt("export: kind '%s' is not a dense model", tostring(mc.kind))) end
  if mc.norm ~= "rmsnorm" then
    fail(fmt("export: the model uses norm = '%s'; LlamaForCausalLM has RMSNorm only", tostring(mc.norm)))
  end
  if mc.mixer ~= "attention" then
    fail("export: the dense model has KDA layers (mixer); LlamaForCausalLM has attention layers only")
  end
  local eos = tok and special_id(tok, "<|endoftext|>")
  return {
    architectures = json.array({ "LlamaForCausalLM" }), model_type = "llama",
    vocab_size = mc.vocab_size, hidden_size = mc.dim, intermediate_size = mc.ffn_dim,
    num_hidden_layers = mc.n_layers, num_attention_heads = mc.n_heads, num_key_value_heads = mc.n_heads,
    head_dim = mc.head_dim, hidden_act = "silu", rms_norm_eps = mc.norm_eps, rope_theta = mc.rope_theta,
    rope_scaling = json.null, attention_bias = false, attention_dropout = 0, mlp_bias = false, pretraining_tp = 1,
    max_position_embeddings = mc.max_seq_len, initializer_range = mc.init_std,
    tie_word_embeddings = mc.tie_embeddings and true or false, torch_dtype = TORCH_DTYPE[mc.dtype] or "float32",
    bos_token_id = eos or json.null, eos_token_id = eos or json.null,
    pad_token_id = tok and special_id(tok, "<|pad|>") or json.null, use_cache = true,
  }
end
hf.LLAMA_KEY_ORDER = { "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim" }

-- llama_model_config(c, where) -> a tide dense model config from a LlamaForCausalLM config.json table; every
-- setting tide cannot reproduce is refused in one line naming the field
function hf.llama_model_config(c, where)
  local function bad(msg) fail(fmt("import: %s: %s", where, msg)) end
  local arch = type(c.architectures) == "table" and c.architectures[1]
  if c.model_type ~= "llama" and arch ~= "LlamaForCausalLM" then
    bad(fmt("model_type '%s' (architectures %s) is not a Llama model; tide imports LlamaForCausalLM only",
      tostring(c.model_type), tostring(arch)))
  end
  local function int(key, default)
    local v = c[key]
    if v == nil or v == json.null then v = default end
    if type(v) ~= "number" or v ~= math.floor(v) or v < 1 then bad(fmt("%s must be a positive integer, got %s", key, tostring(v))) end
    return v
  end
  local function num(key, default)
    local v = c[key]
    if v == nil or v == json.null then v = default end
    if type(v) ~= "number" or not (v > 0) or v == math.huge then bad(fmt("%s must be a positive number, got %s", key, tostring(v))) end
    return v
  end
  local function absent_or(key, ok)
    local v = c[key]
    if v ~= nil and v ~= json.null and v ~= ok then bad(fmt("%s = %s is not supported (tide needs %s)", key, tostring(v), tostring(ok))) end
  end
  local heads = int("num_attention_heads")
  local kv = int("num_key_value_heads", heads)
  if kv ~= heads then
    bad(fmt("num_key_value_heads %d differs from num_attention_heads %d: tide has no grouped-query attention", kv, heads))
  end
  local act = c.hidden_act or "silu"
  if act ~= "silu" then bad(fmt("hidden_act '%s' is not supported (tide's MLP is SwiGLU: silu)", tostring(act))) end
  if c.rope_scaling ~= nil and c.rope_scaling ~= json.null then bad("rope_scaling is not supported (plain RoPE only)") end
  absent_or("attention_bias", false)
  absent_or("mlp_bias", false)
  local dim = int("hidden_size")
  local mc = {
    kind = "dense", vocab_size = int("vocab_size"), dim = dim, n_layers = int("num_hidden_layers"), n_heads = heads,
    ffn_dim = int("intermediate_size"), norm = "rmsnorm", norm_eps = num("rms_norm_eps", 1e-6),
    rope_theta = num("rope_theta", 10000), tie_embeddings = c.tie_word_embeddings == true,
    max_seq_len = int("max_position_embeddings", 2048),
  }
  if c.head_dim ~= nil and c.head_dim ~= json.null then mc.head_dim = int("head_dim") end
  if type(c.initializer_range) == "number" then mc.init_std = c.initializer_range end
  return mc
end

-- ---- the tensors of a directory ----------------------------------------------------------------------------------
-- dense_tensors(model) -> names, tensors: the state dict in the model's order (the names are Llama's)
function hf.dense_tensors(model)
  local sd, names, tensors = model:state_dict(), model:state_names(), {}
  for i, n in ipairs(names) do tensors[i] = sd[n] end
  return names, tensors
end

-- hybrid_tensors(model) -> names, tensors: the state dict with the fused routed experts split into formats.md §2's
-- per-expert names (nn/moe.lua: gate_proj = gate_up_proj[j, 0:d_e], up_proj = gate_up_proj[j, d_e:2·d_e],
-- down_proj = down_proj[j])
function hf.hybrid_tensors(model)
  local sd, names, tensors = model:state_dict(), {}, {}
  local function add(n, t) names[#names + 1] = n; tensors[#tensors + 1] = t end
  for _, n in ipairs(model:state_names()) do
    local t = sd[n]
    local prefix = n:match("^(.*%.experts)%.gate_up_proj$")
    if prefix then
      local s = t:shape()
      local E, de = s[1], s[2] / 2
      for j = 1, E do
        local w = t:narrow(1, j, 1):reshape({ 2 * de, s[3] })
        add(fmt("%s.%d.gate_proj.weight", prefix, j - 1), w:narrow(1, 1, de))
        add(fmt("%s.%d.up_proj.weight", prefix, j - 1), w:narrow(1, de + 1, de))
      end
    else
      prefix = n:match("^(.*%.experts)%.down_proj$")
      if prefix then
        local s = t:shape()
        for j = 1, s[1] do add(fmt("%s.%d.down_proj.weight", prefix, j - 1), t:narrow(1, j, 1):reshape({ s[2], s[3] })) end
      else
        add(n, t)
      end
    end
  end
  return names, tensors
end

-- ---- hybrid: a documented config.json ------------------------------------------------------------------------------
-- hybrid_config(model, tok) -> the config.json table of a hybrid model: Kimi Linear / DeepSeek-V3 style field names
-- where such a field exists, read from the built layers, every field explained in `_doc`, and the exact tide model
-- config under `tide` (what `checkpoint.load_model` rebuilds the model from)
function hf.hybrid_config(model, tok)
  local mc = model.cfg
  local layer_types, kda_layers, mla_layers, moe_layers = {}, {}, {}, {}
  local kda, mla, moe
  for l = 1, model.model.layers.n do
    local layer = model.model.layers:get(l)
    layer_types[l] = layer.mixer
    if layer.mixer == "kda" then kda = kda or layer.self_attn; kda_layers[#kda_layers + 1] = l - 1
    else mla = mla or layer.self_attn; mla_layers[#mla_layers + 1] = l - 1 end
    if layer.block_sparse_moe then moe = moe or layer.block_sparse_moe; moe_layers[#moe_layers + 1] = l - 1 end
  end
  local eos = tok and special_id(tok, "<|endoftext|>")
  local c = {
    _comment = "A tide hybrid language model (KDA and gated NoPE MLA token mixers, optional MoE FFNs, attention "
      .. "residuals). No transformers class implements it: the tensor names follow Kimi Linear / DeepSeek-V3 "
      .. "(model.layers.{l}.self_attn..., block_sparse_moe...), but the architecture differs from both, so loading "
      .. "this directory with AutoModel will not run it. `_doc` explains every field; `tide` holds the exact tide "
      .. "model config that rebuilds it.",
    architectures = json.array({ "TideHybridForCausalLM" }), model_type = "tide_hybrid",
    vocab_size = mc.vocab_size, hidden_size = mc.dim, num_hidden_layers = mc.n_layers,
    intermediate_size = mc.ffn_dim, hidden_act = mc.activation, rms_norm_eps = mc.norm_eps,
    max_position_embeddings = mc.max_seq_len, tie_word_embeddings = false, torch_dtype = TORCH_DTYPE[mc.dtype] or "float32",
    initializer_range = mc.init_std, bos_token_id = eos or json.null, eos_token_id = eos or json.null,
    layer_types = json.array(layer_types), residual = mc.residual,
    tide = { kind = "hybrid", config = mc },
  }
  if kda then
    c.linear_attn_config = { kda_layers = json.array(kda_layers), num_heads = kda.heads, head_dim = kda.head_dim,
      short_conv_kernel_size = kda.conv_size, gate_form = kda.gate_form, gate_lower_bound = kda.gate_lower_bound }
  end
  if mla then
    c.mla_layers = json.array(mla_layers)
    c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank = mla.heads, mla.q_rank or json.null, mla.kv_rank
    c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim = mla.nope_dim, mla.rope_dim, mla.v_dim
    c.mla_output_gate = mla.gate
  end
  if moe then
    c.moe_layers = json.array(moe_layers)
    c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size = moe.n, moe.k, moe.d_e
    c.shared_experts_intermediate_size = moe.shared_dim
    c.first_k_dense_replace = moe_layers[1]
    c.routed_scaling_factor, c.scoring_func = moe.rho, moe.gate.kind
    c.moe_latent_dim = moe.latent_dim or json.null
    c.moe_balance = moe.balance
  end
  c._doc = {
    architectures = "no upstream class: a name for this family only",
    model_type = "tide_hybrid: not a transformers model type (AutoConfig does not know it)",
    vocab_size = "rows of model.embed_tokens.weight and lm_head.weight",
    hidden_size = "the residual width d",
    num_hidden_layers = "layers model.layers.0 … L−1",
    intermediate_size = "hidden width of the dense FFNs (mlp.{gate,up,down}_proj)",
    hidden_act = "FFN gate: swiglu = down(silu(gate)·up); situ = down(4·tanh(gate/4)·σ(gate) · 25·tanh(up/25))",
    rms_norm_eps = "eps of every RMSNorm: x / sqrt(mean(x²) + eps) · w",
    max_position_embeddings = "the longest context tide was configured for (KDA layers have no position limit)",
    tie_word_embeddings = "false: lm_head.weight is its own tensor",
    torch_dtype = "the dtype of the stored weights (the MoE selection bias is float64 in every model)",
    initializer_range = "std of the weight initialisation",
    bos_token_id = "<|endoftext|>, which also starts every document",
    eos_token_id = "<|endoftext|>, the document separator",
    layer_types = "the token mixer of each layer: kda (Kimi Delta Attention) or mla (gated NoPE Multi-head Latent Attention)",
    residual = "how sublayers join the stream: prenorm (x += f(norm(x))), attnres_block / attnres_full (Attention "
      .. "Residuals: *_res_norm / *_res_proj mix earlier outputs), gamma chain",
    linear_attn_config = "KDA: layers (0-based), heads, head dim (dk = dv), short causal conv taps "
      .. "(self_attn.{q,k,v}_conv1d [H·dk, 1, taps]), the decay gate form and its lower bound",
    mla_layers = "MLA layers (0-based)",
    num_attention_heads = "heads of the MLA layers (the KDA heads are in linear_attn_config)",
    q_lora_rank = "MLA query rank (q_a_proj → q_a_layernorm → q_b_proj); null: full-rank q_proj",
    kv_lora_rank = "MLA latent width d_c (kv_a_proj_with_mqa [d_c + d_r, d] → kv_a_layernorm → kv_b_proj)",
    qk_nope_head_dim = "MLA per-head key/query width without position",
    qk_rope_head_dim = "width d_r of the one shared key slot; scored, never rotated (NoPE)",
    v_head_dim = "MLA per-head value width",
    mla_output_gate = "sigmoid output gate g_proj on the layer input before o_proj",
    n_routed_experts = "routed experts per MoE layer: block_sparse_moe.experts.{j}.{gate,up,down}_proj",
    num_experts_per_tok = "experts chosen per token (top-k)",
    moe_intermediate_size = "hidden width of one expert",
    moe_layers = "layers (0-based) whose FFN is block_sparse_moe; the others have a dense mlp",
    shared_experts_intermediate_size = "hidden width of block_sparse_moe.shared_experts, the always-on experts "
      .. "stored as one MLP (0: none)",
    first_k_dense_replace = "layers before the first MoE layer that have a dense mlp instead",
    routed_scaling_factor = "scale of the routed experts' sum",
    scoring_func = "router: sigmoid or softmax over gate.weight, or latent (gate.latent_proj, gate.expert_vectors)",
    moe_latent_dim = "LatentMoE width: experts run on routed_expert_down_proj(x), then routed_expert_norm and "
      .. "routed_expert_up_proj; null: experts on x",
    moe_balance = "how the selection bias gate.e_score_correction_bias (float64, added to the scores for choosing "
      .. "experts only) was trained",
    tide = "the tide model config that rebuilds this model (nn.build), as in the checkpoint's tide.model metadata",
  }
  return c
end
hf.HYBRID_KEY_ORDER = { first = { "_comment", "architectures", "model_type", "vocab_size", "hidden_size",
  "num_hidden_layers", "intermediate_size", "hidden_act", "layer_types", "residual" }, last = { "tide", "_doc" } }

-- ---- reading a directory's weights ------------------------------------------------------------------------------
local function last_error() return ffi.string(C.tide_last_error()) end

-- read_weights(dir) -> {name = tensor (CPU)}, files: model.safetensors, or the shards that
-- model.safetensors.index.json's weight_map names (every name read from the shard the map gives)
function hf.read_weights(dir)
  local single, index = dir .. "/model.safetensors", dir .. "/model.safetensors.index.json"
  local files, want = {}, nil
  if C.tide_path_exists(single) == 1 then
    files = { "model.safetensors" }
  elseif C.tide_path_exists(index) == 1 then
    local ok, t = pcall(json.read, index, 64 * 1024 * 1024)
    if not ok then fail("import: " .. tostring(t)) end
    if type(t) ~= "table" or type(t.weight_map) ~= "table" then fail("import: " .. index .. " has no weight_map object") end
    want = {}
    local seen = {}
    for name, file in pairs(t.weight_map) do
      if type(file) ~= "string" or file:find("/", 1, true) or file:sub(1, 1) == "." then
        fail(fmt("import: %s: weight_map['%s'] = %s is not a file name in the directory", index, name, tostring(file)))
      end
      want[name] = file
      if not seen[file] then seen[file] = true; files[#files + 1] = file end
    end
    table.sort(files)
  else
    fail(fmt("import: %s has neither model.safetensors nor model.safetensors.index.json", dir))
  end
  local out = {}
  for _, file in ipairs(files) do
    local path = dir .. "/" .. file
    local h = C.tide_safetensors_open(path)
    if h == nil then fail("import: " .. last_error()) end
    h = ffi.gc(h, C.tide_safetensors_close)
    for i = 0, C.tide_safetensors_count(h) - 1 do
      local name = ffi.string(C.tide_safetensors_name(h, i))
      if want and want[name] ~= file then
        fail(fmt("import: %s holds '%s', which the index puts in %s", path, name, tostring(want[name])))
      end
      if out[name] then fail(fmt("import: tensor '%s' appears in more than one shard (again in %s)", name, path)) end
      local t = C.tide_safetensors_get(h, i, 0)
      if t == nil then fail(fmt("import: %s: tensor '%s': %s", path, name, last_error())) end
      out[name] = tide.wrap(t)
    end
    C.tide_safetensors_close(ffi.gc(h, nil))
  end
  if want then
    for name, file in pairs(want) do
      if not out[name] then fail(fmt("import: the index puts '%s' in %s, which does not hold it", name, file)) end
    end
  end
  return out, files
end

-- ---- directories -------------------------------------------------------------------------------------------------
-- is_empty_dir(path) -> true for an existing directory without entries
function hf.dir_entries(path)
  local n = ffi.new("size_t[1]")
  local raw = C.tide_list_dir(path, n)
  if raw == nil then fail(fmt("cannot list '%s': %s", path, last_error())) end
  local names = ffi.string(raw, n[0])
  C.tide_free(raw)
  local out = {}
  for name in names:gmatch("([^%z]+)%z") do out[#out + 1] = name end
  return out
end

-- write_dir(dir, overwrite, who, fill): fill(tmp) writes the directory's files into dir .. ".tmp", which then
-- replaces dir in one rename. An existing non-empty dir is refused unless overwrite (then it is moved to
-- dir .. ".old" first and removed after the rename); a failure removes the .tmp.
function hf.write_dir(dir, overwrite, who, fill)
  dir = dir:gsub("/+$", "")
  if dir == "" then fail(who .. ": the output directory name is empty") end
  local exists = C.tide_path_exists(dir) == 1
  if exists and C.tide_is_dir(dir) ~= 1 then fail(fmt("%s: '%s' exists and is not a directory", who, dir)) end
  local nonempty = exists and #hf.dir_entries(dir) > 0
  if nonempty and not overwrite then
    fail(fmt("%s: '%s' exists and is not empty (pass --overwrite to replace it)", who, dir))
  end
  local tmp, old = dir .. ".tmp", dir .. ".old"
  local function check(rc, what) if rc ~= 0 then fail(fmt("%s: %s: %s", who, what, last_error())) end end
  check(C.tide_remove_tree(tmp), "clearing " .. tmp)
  check(C.tide_mkdir_p(tmp), "creating " .. tmp)
  local ok, err = pcall(fill, tmp)
  if ok then ok, err = pcall(function() check(C.tide_fsync_dir(tmp), "syncing " .. tmp) end) end
  if not ok then
    C.tide_remove_tree(tmp)
    error(err, 0)
  end
  if exists then
    check(C.tide_remove_tree(old), "clearing " .. old)
    check(C.tide_rename_atomic(dir, old), "moving the old " .. dir .. " aside")
  end
  check(C.tide_rename_atomic(tmp, dir), "renaming " .. tmp)
  if exists then check(C.tide_remove_tree(old), "removing " .. old) end
end

-- save_safetensors(path, names, tensors, metadata)
function hf.save_safetensors(path, names, tensors, metadata)
  local n = #names
  local cnames = ffi.new("const char *[?]", math.max(n, 1))
  local ctensors = ffi.new("tide_tensor *[?]", math.max(n, 1))
  for i = 1, n do
    cnames[i - 1] = names[i]
    ctensors[i - 1] = tide.raw(tensors[i])
  end
  if C.tide_safetensors_save(path, n, cnames, ctensors, metadata and json.encode(metadata) or nil) ~= 0 then
    fail("cannot write " .. path .. ": " .. last_error())
  end
end

function hf.write_text(path, text)
  if C.tide_file_write_text_atomic(path, text) ~= 0 then fail("cannot write " .. path .. ": " .. last_error()) end
end

return hf
