-- tide export CKPT DIR: a checkpoint as a HuggingFace model directory (lua/tide/hf.lua). The directory is written
-- into DIR.tmp and renamed into place, so DIR is either absent, the old one or complete.
local cli = require "tide.cli"
local hf = require "tide.hf"
local json = require "tide.json"

local M = {}

M.USAGE = [[
usage: tide export CKPT DIR [--overwrite]

Writes the checkpoint CKPT (a run directory, its latest checkpoint, or a step directory) as a HuggingFace model
directory DIR:
  config.json             dense model: LlamaForCausalLM (transformers loads and runs it); hybrid model: the
                          Kimi/DeepSeek-style fields, each explained under "_doc", and the tide model config
                          under "tide" (no transformers class runs a hybrid model)
  model.safetensors       the weights as stored (fp32 masters), HF names (formats.md §2); a hybrid model's fused
                          routed experts are written per expert (block_sparse_moe.experts.{j}.{gate,up,down}_proj)
  tokenizer.json          the run's BPE tokenizer.json; for the byte-level vocabulary, the same vocabulary as a
                          tokenizers BPE model without merges (id b = byte b, specials from 256 as added tokens)
  tokenizer_config.json   PreTrainedTokenizerFast, eos/bos <|endoftext|>, pad <|pad|> when the vocabulary has them

  --overwrite   replace an existing non-empty DIR (refused otherwise)]]

local SPEC = { overwrite = { kind = "boolean", default = false } }

local function special(tok, name)
  local ok, id = pcall(tok.id, tok, name)
  return ok and id and name or nil
end

-- the tokenizer files: the run's tokenizer.json as it is, or the byte-level vocabulary written as one
local function tokenizer_files(tmp, info, mc)
  local C = require("tide").C
  local tok = info.tokenizer
  local src = info.dir .. "/tokenizer.json"
  if C.tide_path_exists(src) == 1 then
    local text, err = require("tide").read_file(src, 1024 * 1024 * 1024)
    if not text then error("export: " .. err, 0) end
    hf.write_text(tmp .. "/tokenizer.json", text)
  elseif tok.kind == "byte" then
    hf.write_text(tmp .. "/tokenizer.json", hf.byte_tokenizer_json(tok))
  else
    error("export: the checkpoint's tokenizer (" .. tostring(tok.kind) .. ") has no tokenizer.json to export", 0)
  end
  local eos, pad = special(tok, "<|endoftext|>"), special(tok, "<|pad|>")
  local tc = { tokenizer_class = "PreTrainedTokenizerFast", model_max_length = mc.max_seq_len,
    bos_token = eos or json.null, eos_token = eos or json.null, pad_token = pad or json.null,
    clean_up_tokenization_spaces = false }
  hf.write_text(tmp .. "/tokenizer_config.json", hf.pretty(tc, { "tokenizer_class" }) .. "\n")
end

-- export(ckpt, dir, {overwrite}) -> info (checkpoint.load_model's), the config.json table
function M.export(ckpt, dir, opts)
  opts = opts or {}
  local checkpoint = require "tide.checkpoint"
  local model, info = checkpoint.load_model(ckpt)
  local mc = model.cfg
  local config, names, tensors
  if info.kind == "dense" then
    config = hf.llama_config(mc, info.tokenizer)
    names, tensors = hf.dense_tensors(model)
  elseif info.kind == "hybrid" then
    config = hf.hybrid_config(model, info.tokenizer)
    names, tensors = hf.hybrid_tensors(model)
  else
    error("export: the checkpoint's model kind '" .. tostring(info.kind) .. "' has no HuggingFace form here", 0)
  end
  local order = info.kind == "dense" and hf.LLAMA_KEY_ORDER or hf.HYBRID_KEY_ORDER
  hf.write_dir(dir, opts.overwrite, "export", function(tmp)
    hf.write_text(tmp .. "/config.json", hf.pretty(config, order) .. "\n")
    hf.save_safetensors(tmp .. "/model.safetensors", names, tensors,
      { format = "pt", ["tide.step"] = tostring(info.step) })
    tokenizer_files(tmp, info, mc)
  end)
  return info, config
end

function M.main(args)
  local pos, flags = cli.parse_flags(args, SPEC, "tide export")
  if #pos ~= 2 then cli.usage_error("tide export: expected CKPT DIR, got " .. #pos .. " argument(s) (tide export --help)") end
  local info, config = M.export(pos[1], pos[2], flags)
  if config.head_dim and config.head_dim * config.num_attention_heads ~= config.hidden_size then
    io.stderr:write(string.format("export: note: head_dim %d x %d heads ~= hidden_size %d; transformers versions that "
      .. "ignore config.head_dim (4.40 among them) cannot load this model\n", config.head_dim,
      config.num_attention_heads, config.hidden_size))
  end
  print(string.format("export: %s (step %d, %s, %s) -> %s", info.dir, info.step or 0, info.kind,
    config.architectures[1], pos[2]))
  return 0
end

return M
