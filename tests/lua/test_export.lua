-- export / import (tide export, tide import; lua/tide/hf.lua): a dense checkpoint exported as a HuggingFace
-- directory loads in transformers' LlamaForCausalLM with no missing or unexpected keys, its logits within 1e-4 of
-- tide's and its greedy continuation the same; the byte-level tokenizer.json encodes as tide does; the directory
-- (and the sharded one transformers saves from it) imports back bit for bit; the hybrid export's names follow
-- formats.md §2 and its config.json documents every field; hostile inputs fail in one line.
local ffi = require "ffi"
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local checkpoint = require "tide.checkpoint"
local train = require "tide.train"
local cli = require "tide.cli"
local hf = require "tide.hf"
local export = require "tide.cmd.export"
local import = require "tide.cmd.import"

local C = tide.C
local tmpdir = T.tmpdir
local PYTHON = "build/pyenv/bin/python"

local function exists(path) return C.tide_path_exists(path) == 1 end

local function dense_run(over)
  local dir = tmpdir("dense")
  local model = { dim = 32, n_layers = 2, n_heads = 2, vocab_size = 320 }
  for k, v in pairs(over or {}) do model[k] = v end
  train({
    model = model,
    data = { path = "tests/fixtures/tiny_corpus.txt", doc_separator = "%", val_fraction = 0.1, seq_len = 32, batch_size = 4 },
    optim = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 },
    schedule = { kind = "cosine", warmup = 2 },
    train = { steps = 8, log_every = 1000, seed = 1, quiet = true, eval_batches = 1, out = dir },
  })
  return dir
end

local ESIZE = { f32 = 4, f64 = 8, bf16 = 2, i32 = 4, i64 = 8 }
local function bytes(t)
  local n = t:numel() * ESIZE[t:dtype()]
  local buf = ffi.new("uint8_t[?]", math.max(n, 1))
  tide.check_status(C.tide_read_bytes(tide.raw(t), buf, n))
  return ffi.string(buf, n)
end

-- every tensor of the two files (or name tables) has the same dtype, shape and bytes
local function same_weights(a, b, what)
  local n = 0
  for name, t in pairs(a) do
    local u = b[name]
    T.ok(u ~= nil, what .. ": " .. name .. " is missing")
    T.eq(u:dtype(), t:dtype(), what .. ": dtype of " .. name)
    T.eq(u:shape(), t:shape(), what .. ": shape of " .. name)
    T.ok(bytes(u) == bytes(t), what .. ": bytes of " .. name)
    n = n + 1
  end
  for name in pairs(b) do T.ok(a[name] ~= nil, what .. ": unexpected " .. name) end
  return n
end

local function file_tensors(dir, file)
  local r = checkpoint.open(dir)
  local t = r:tensors(file or "model.safetensors")
  r:close()
  return t
end

local function raw_tensors(path)
  local h = C.tide_safetensors_open(path)
  T.ok(h ~= nil, "open " .. path)
  local out = {}
  for i = 0, C.tide_safetensors_count(h) - 1 do
    out[ffi.string(C.tide_safetensors_name(h, i))] = tide.wrap(C.tide_safetensors_get(h, i, 0))
  end
  C.tide_safetensors_close(h)
  return out
end

local function python_ready()
  local f = io.open(PYTHON, "r")
  if f then f:close() return true end
  return false
end

-- runs the tide binary with args; returns exit code and the stderr lines
local function tide_cmd(args)
  local err = os.tmpname()
  local cmd = cli.shell_quote(cli.exe_path())
  for _, a in ipairs(args) do cmd = cmd .. " " .. cli.shell_quote(a) end
  local p = io.popen(cmd .. " 2>" .. cli.shell_quote(err) .. " >/dev/null; echo $?")
  local code = tonumber(p:read("*a"))
  p:close()
  local lines = {}
  for line in io.lines(err) do lines[#lines + 1] = line end
  os.remove(err)
  return code, lines
end

local function one_line_error(args, text)
  local code, lines = tide_cmd(args)
  T.ok(code ~= 0, table.concat(args, " ") .. ": exit code " .. tostring(code))
  T.eq(#lines, 1, table.concat(args, " ") .. ": one line on stderr, got: " .. table.concat(lines, " | "))
  T.ok((lines[1] or ""):find(text, 1, true), string.format("%s: '%s' in '%s'", table.concat(args, " "), text, lines[1] or ""))
end

T.test("dense export loads in transformers' LlamaForCausalLM: no missing/unexpected keys, logits within 1e-4, same greedy tokens, same tokenizer ids; the sharded save imports back bit for bit", function()
  T.ok(python_ready(), PYTHON .. " is missing: run scripts/test_deps.sh (it creates the Python environment of the interoperability tests)")
  local run = dense_run()
  local out = tmpdir("hf") .. "/llama"
  export.export(run, out)
  for _, f in ipairs({ "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json" }) do
    T.ok(exists(out .. "/" .. f), f)
  end
  T.ok(not exists(out .. ".tmp"), "no .tmp left")
  local cfg = json.read(out .. "/config.json")
  T.eq(cfg.architectures, { "LlamaForCausalLM" })
  T.eq(cfg.num_key_value_heads, cfg.num_attention_heads)
  T.eq(cfg.hidden_size, 32); T.eq(cfg.intermediate_size, 96); T.eq(cfg.rms_norm_eps, 1e-5)

  local model, info = checkpoint.load_model(run)
  model:eval()
  local ids = {}
  for b = 1, 2 do
    ids[b] = {}
    for t = 1, 40 do ids[b][t] = (b * 131 + t * 37) % 256 end
  end
  ids[1][1] = 256
  local x = tide.tensor(ids, { dtype = "i32" })
  local logits = tide.no_grad(function() return model:forward(x) end)
  local text = "Héllo, wörld ✓ 42\n<|pad|>"
  local prompt = info.tokenizer:encode("The ")
  local greedy = model:generate(prompt, { max_new = 12, temperature = 0 })
  local dir = tmpdir("py", { create = true })
  hf.save_safetensors(dir .. "/inputs.safetensors", { "ids", "logits", "prompt" },
    { x, logits, tide.tensor(prompt, { dtype = "i32" }) })
  local sharded = dir .. "/sharded"
  local spec = { cases = { { dir = out, inputs = dir .. "/inputs.safetensors", text = text, greedy_new = 12,
    save_sharded = sharded } } }
  local f = io.open(dir .. "/spec.json", "w"); f:write(json.encode(spec)); f:close()
  local p = io.popen(cli.shell_quote(PYTHON) .. " tests/scripts/hf_llama_check.py " .. cli.shell_quote(dir .. "/spec.json") .. " 2>&1")
  local reply = p:read("*a")
  p:close()
  local ok, r = pcall(json.decode, reply:match("(%b{})%s*$") or "")
  T.ok(ok and type(r) == "table" and r.cases, "hf_llama_check.py printed no result: " .. reply:sub(-2000))
  local c = r.cases[1]
  T.eq(#c.missing, 0, "missing keys: " .. table.concat(c.missing, ", "))
  T.eq(#c.unexpected, 0, "unexpected keys: " .. table.concat(c.unexpected, ", "))
  T.eq(#c.mismatched, 0, "mismatched keys")
  T.ok(c.max_abs_logit_diff <= 1e-4, string.format("max |logit diff| vs transformers %.3g > 1e-4", c.max_abs_logit_diff))
  io.stderr:write(string.format("  max |logit diff| tide vs transformers %s %s: %.3g\n", r.versions.transformers,
    r.versions.torch, c.max_abs_logit_diff))
  T.eq(c.greedy, greedy, "greedy continuation: transformers' generate vs tide's")
  local tide_ids = info.tokenizer:encode("Héllo, wörld ✓ 42\n")
  tide_ids[#tide_ids + 1] = info.tokenizer:id("<|pad|>")       -- HF splits out a literal special name; tide keeps bytes
  T.eq(c.tokenizer_ids, tide_ids, "tokenizer.json ids")
  T.eq(c.auto_tokenizer_ids, tide_ids, "AutoTokenizer ids")
  T.eq(c.tokenizer_decode, text)
  -- the sharded directory transformers wrote imports back to the same weights, bit for bit
  T.ok(exists(sharded .. "/model.safetensors.index.json"), "sharded: " .. table.concat(c.sharded, ", "))
  local back = tmpdir("back")
  local step_dir = import.import(sharded, back)
  local n = same_weights(file_tensors(info.dir), file_tensors(step_dir), "transformers' sharded save -> import")
  T.eq(n, 2 + 2 * 9 + 1, "every tensor compared")
  local m2, info2 = checkpoint.load_model(back)
  T.eq(info2.tokenizer.kind, "byte", "the tokenizer.json transformers re-saved is the byte-level vocabulary")
  T.eq((m2:forward(x) - logits):abs():max():item(), 0, "the imported model's logits")
end)

T.test("export -> import round trip: bit-identical weights, same logits, the model config back; tied embeddings", function()
  for _, tied in ipairs({ false, true }) do
    local run = dense_run({ tie_embeddings = tied, rope_theta = 5e5, norm_eps = 1e-6 })
    local out = tmpdir("rt") .. "/hf"
    export.export(run, out)
    local stored = raw_tensors(out .. "/model.safetensors")
    T.eq(stored["lm_head.weight"] ~= nil, not tied, "lm_head.weight stored only when untied")
    local cfg = json.read(out .. "/config.json")
    T.eq(cfg.tie_word_embeddings, tied); T.eq(cfg.rope_theta, 5e5); T.eq(cfg.rms_norm_eps, 1e-6)
    local back = tmpdir("rt_back")
    local step_dir = import.import(out, back)
    local _, info = checkpoint.load_model(run)
    same_weights(file_tensors(info.dir), file_tensors(step_dir), "round trip (tied " .. tostring(tied) .. ")")
    local m1 = checkpoint.load_model(run)
    local m2, info2 = checkpoint.load_model(back)
    for _, k in ipairs({ "vocab_size", "dim", "n_layers", "n_heads", "head_dim", "ffn_dim", "norm_eps", "rope_theta",
      "tie_embeddings", "max_seq_len", "norm", "mixer" }) do
      T.eq(info2.model_config[k], info.model_config[k], "model config " .. k)
    end
    T.eq(info2.step, 0); T.eq(info2.kind, "dense"); T.eq(info2.tokenizer.kind, "byte")
    local x = tide.tensor({ { 256, 72, 101, 108, 108, 111, 32, 119 } }, { dtype = "i32" })
    m1:eval(); m2:eval()
    T.eq((m1:forward(x) - m2:forward(x)):abs():max():item(), 0, "logits")
    -- tide sample reads the imported directory and writes what it writes for the original
    local sample = require "tide.cmd.sample"
    local quiet = { write = function() end, flush = function() end }
    local flags = { prompt = "The ", max_new = 16, seed = 3, stop = "none" }
    T.eq(select(2, sample.sample(back, flags, quiet)), select(2, sample.sample(run, flags, quiet)), "sampled ids")
  end
end)

-- formats.md §2 names of the hybrid model (the MoE experts per expert)
local HYBRID_PATTERNS = {
  "^model%.embed_tokens%.weight$", "^lm_head%.weight$", "^model%.norm%.weight$",
  "^model%.output_attn_res_norm%.weight$", "^model%.output_attn_res_proj%.weight$",
  "^model%.layers%.%d+%.input_layernorm%.weight$", "^model%.layers%.%d+%.post_attention_layernorm%.weight$",
  "^model%.layers%.%d+%.self_attn%.[qkvgo]_proj%.weight$", "^model%.layers%.%d+%.self_attn%.[qkv]_conv1d%.weight$",
  "^model%.layers%.%d+%.self_attn%.f_[ab]_proj%.weight$", "^model%.layers%.%d+%.self_attn%.b_proj%.weight$",
  "^model%.layers%.%d+%.self_attn%.A_log$", "^model%.layers%.%d+%.self_attn%.dt_bias$",
  "^model%.layers%.%d+%.self_attn%.o_norm%.weight$",
  "^model%.layers%.%d+%.self_attn%.q_a_proj%.weight$", "^model%.layers%.%d+%.self_attn%.q_a_layernorm%.weight$",
  "^model%.layers%.%d+%.self_attn%.q_b_proj%.weight$", "^model%.layers%.%d+%.self_attn%.kv_a_proj_with_mqa%.weight$",
  "^model%.layers%.%d+%.self_attn%.kv_a_layernorm%.weight$", "^model%.layers%.%d+%.self_attn%.kv_b_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.gate%.weight$", "^model%.layers%.%d+%.block_sparse_moe%.gate%.e_score_correction_bias$",
  "^model%.layers%.%d+%.block_sparse_moe%.experts%.%d+%.gate_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.experts%.%d+%.up_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.experts%.%d+%.down_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.shared_experts%.gate_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.shared_experts%.up_proj%.weight$",
  "^model%.layers%.%d+%.block_sparse_moe%.shared_experts%.down_proj%.weight$",
  "^model%.layers%.%d+%.self_attention_res_norm%.weight$", "^model%.layers%.%d+%.self_attention_res_proj%.weight$",
  "^model%.layers%.%d+%.mlp_res_norm%.weight$", "^model%.layers%.%d+%.mlp_res_proj%.weight$",
}

T.test("hybrid export: formats.md §2 names (experts split per expert, equal to the fused slices), config.json documents every field", function()
  local cfg = cli.load_recipe("tests/fixtures/curriculum_small.lua", {})
  local run = tmpdir("hyb")
  cfg.train.out = run
  for _, s in ipairs(cfg.stages) do s.steps = 3; s.eval = nil end
  cfg.evals = nil
  require("tide.curriculum").train(cfg)
  local out = tmpdir("hyb_hf") .. "/hf"
  export.export(run, out)
  local model, info = checkpoint.load_model(run)
  local stored = raw_tensors(out .. "/model.safetensors")
  local n = 0
  for name in pairs(stored) do
    n = n + 1
    local ok = false
    for _, p in ipairs(HYBRID_PATTERNS) do if name:match(p) then ok = true break end end
    T.ok(ok, "a formats.md §2 name: " .. name)
  end
  -- the experts: 2 layers x 4 experts x 3 matrices, equal to the fused tensors' slices
  local sd = model:state_dict()
  for l = 0, 1 do
    local p = "model.layers." .. l .. ".block_sparse_moe.experts"
    local gu, down = sd[p .. ".gate_up_proj"], sd[p .. ".down_proj"]
    T.ok(stored[p .. ".gate_up_proj"] == nil and stored[p .. ".down_proj"] == nil, "no fused expert tensors")
    for j = 0, 3 do
      local g, u, d = stored[p .. "." .. j .. ".gate_proj.weight"], stored[p .. "." .. j .. ".up_proj.weight"],
        stored[p .. "." .. j .. ".down_proj.weight"]
      T.eq(g:shape(), { 16, 16 }); T.eq(u:shape(), { 16, 16 }); T.eq(d:shape(), { 16, 16 })
      local w = gu:narrow(1, j + 1, 1):reshape({ 32, 16 })
      T.ok(bytes(g) == bytes(w:narrow(1, 1, 16):contiguous()), "gate_proj = gate_up_proj[j, 0:d_e]")
      T.ok(bytes(u) == bytes(w:narrow(1, 17, 16):contiguous()), "up_proj = gate_up_proj[j, d_e:2d_e]")
      T.ok(bytes(d) == bytes(down:narrow(1, j + 1, 1):reshape({ 16, 16 }):contiguous()), "down_proj = down_proj[j]")
    end
  end
  local fused = 0
  for _ in pairs(sd) do fused = fused + 1 end
  T.eq(n, fused - 4 + 2 * (4 * 3), "every other tensor once")
  for name, t in pairs(sd) do
    if not name:find("%.experts%.") then T.ok(bytes(stored[name]) == bytes(t), "as stored: " .. name) end
  end
  T.eq(stored["model.layers.0.block_sparse_moe.gate.e_score_correction_bias"]:dtype(), "f64")
  -- config.json: the fields, each documented, and the exact tide config
  local c = json.read(out .. "/config.json")
  T.eq(c.architectures, { "TideHybridForCausalLM" })
  T.ok(c._comment:find("No transformers class", 1, true), "says no upstream class runs it")
  T.eq(c.layer_types, { "kda", "mla" })
  T.eq(c.n_routed_experts, 4); T.eq(c.num_experts_per_tok, 2); T.eq(c.moe_intermediate_size, 16)
  T.eq(c.shared_experts_intermediate_size, 16); T.eq(c.first_k_dense_replace, 0); T.eq(c.moe_layers, { 0, 1 })
  T.eq(c.kv_lora_rank, 8); T.eq(c.q_lora_rank, 16); T.eq(c.qk_rope_head_dim, 4); T.eq(c.v_head_dim, 8)
  T.eq(c.linear_attn_config.num_heads, 2); T.eq(c.linear_attn_config.head_dim, 8)
  T.eq(c.linear_attn_config.short_conv_kernel_size, 4); T.eq(c.linear_attn_config.kda_layers, { 0 })
  T.eq(c.hidden_act, "situ"); T.eq(c.residual, "attnres_block"); T.eq(c.vocab_size, 320); T.eq(c.hidden_size, 16)
  for k in pairs(c) do
    if k ~= "_doc" and k ~= "_comment" then T.ok(type(c._doc[k]) == "string" and #c._doc[k] > 10, "_doc explains " .. k) end
  end
  for k in pairs(c._doc) do T.ok(c[k] ~= nil, "_doc entry for a field that exists: " .. k) end
  T.eq(c.tide.kind, "hybrid")
  T.eq(json.encode(c.tide.config), json.encode(info.model_config), "the tide block is the checkpoint's model config")
  -- that block rebuilds the model: same state names and shapes
  local rebuilt = require("tide.nn").build(c.tide.config)
  T.eq(rebuilt:state_names(), model:state_names())
  T.ok(exists(out .. "/tokenizer.json"), "tokenizer.json")
end)

T.test("hostile inputs: one line each (missing dir, no tide.model metadata, existing export dir, bad HF dirs)", function()
  local run = dense_run()
  local nope = tmpdir("nope")
  one_line_error({ "export", nope, tmpdir("x") }, "is not a directory")
  one_line_error({ "export" }, "expected CKPT DIR")
  one_line_error({ "export", run, tmpdir("x"), "--bogus" }, "unknown option '--bogus'")
  -- a checkpoint whose model.safetensors lacks the tide.model metadata (an older tide)
  local _, info = checkpoint.load_model(run)
  local old = tmpdir("old", { create = true })
  local names, tensors = {}, {}
  for name, t in pairs(file_tensors(info.dir)) do names[#names + 1] = name; tensors[#tensors + 1] = t end
  hf.save_safetensors(old .. "/model.safetensors", names, tensors, { format = "pt" })
  local f = io.open(old .. "/state.json", "w"); f:write('{"step": 3}\n'); f:close()
  one_line_error({ "export", old, tmpdir("x") }, "has no tide.model metadata")
  -- an existing non-empty export directory is refused and left alone; --overwrite replaces it
  local out = tmpdir("busy", { create = true })
  f = io.open(out .. "/keep.txt", "w"); f:write("mine"); f:close()
  one_line_error({ "export", run, out }, "exists and is not empty (pass --overwrite")
  T.ok(exists(out .. "/keep.txt") and not exists(out .. "/config.json"), "left alone")
  local code = tide_cmd({ "export", run, out, "--overwrite" })
  T.eq(code, 0)
  T.ok(exists(out .. "/config.json") and not exists(out .. "/keep.txt") and not exists(out .. ".old"), "replaced")
  -- an empty directory is fine
  local empty = tmpdir("empty", { create = true })
  T.eq(tide_cmd({ "export", run, empty }), 0)
  -- import: no directory, no config.json, grouped-query attention, a missing tensor, an existing OUT
  one_line_error({ "import", nope, tmpdir("x") }, "is not a directory")
  local bad = tmpdir("bad", { create = true })
  one_line_error({ "import", bad, tmpdir("x") }, "config.json is missing")
  local hc = json.read(out .. "/config.json")
  local function with_config(edit)
    local d = tmpdir("badcfg", { create = true })
    local c = json.read(out .. "/config.json")
    edit(c)
    hf.write_text(d .. "/config.json", json.encode(c))
    for _, file in ipairs({ "model.safetensors", "tokenizer.json" }) do
      local text = tide.read_file(out .. "/" .. file)
      local w = io.open(d .. "/" .. file, "wb"); w:write(text); w:close()
    end
    return d
  end
  one_line_error({ "import", with_config(function(c) c.num_key_value_heads = 1 end), tmpdir("x") },
    "tide has no grouped-query attention")
  one_line_error({ "import", with_config(function(c) c.rope_scaling = { type = "linear", factor = 2 } end), tmpdir("x") },
    "rope_scaling is not supported")
  one_line_error({ "import", with_config(function(c) c.num_hidden_layers = 3 end), tmpdir("x") },
    "lacks 9 tensor(s) the model needs: model.layers.2.")
  one_line_error({ "import", with_config(function(c) c.model_type = "gpt2"; c.architectures = { "GPT2LMHeadModel" } end),
    tmpdir("x") }, "is not a Llama model")
  T.ok(hc.num_hidden_layers == 2)
  local busy = tmpdir("busy_out", { create = true })
  f = io.open(busy .. "/x", "w"); f:write("x"); f:close()
  one_line_error({ "import", out, busy }, "exists and is not empty")
end)

T.run()
