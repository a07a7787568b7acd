-- tide import DIR OUT: a HuggingFace Llama directory as a tide run directory with one checkpoint (step 0) that
-- checkpoint.load_model, tide sample, tide eval and tide export read. Weights are copied as stored (F32 stays
-- bit for bit; BF16 widens exactly to f32).
local cli = require "tide.cli"
local hf = require "tide.hf"
local json = require "tide.json"

local M = {}

M.USAGE = [[
usage: tide import DIR OUT [--tokenizer PATH|byte] [--overwrite]

Reads the HuggingFace LlamaForCausalLM directory DIR (config.json and model.safetensors, or the shards named by
model.safetensors.index.json) into OUT, a tide run directory holding one checkpoint, OUT/ckpt/step_00000000.
Every setting tide cannot reproduce (grouped-query attention, rope_scaling, biases, another activation) is
refused, and so is a missing or unexpected tensor.

  --tokenizer PATH|byte   the tokenizer.json to use (default DIR/tokenizer.json); the byte-level vocabulary
                          that tide export writes is recognised as tide's byte-level tokenizer; "byte" uses
                          the byte-level vocabulary without a file
  --overwrite             replace an existing non-empty OUT (refused otherwise)]]

local SPEC = { tokenizer = { kind = "string" }, overwrite = { kind = "boolean", default = false } }

local fmt = string.format

-- the checkpoint's tokenizer: {tok (byte-level) | nil, text (tokenizer.json to copy) | nil}
local function read_tokenizer(dir, choice, V)
  local tide = require "tide"
  local tokenizer = require "tide.data.tokenizer"
  if choice == "byte" then return { tok = tokenizer.byte_level({ vocab_size = V }) } end
  local path = choice or (dir .. "/tokenizer.json")
  if tide.C.tide_path_exists(path) ~= 1 then
    error(fmt("import: %s is missing (pass --tokenizer PATH, or --tokenizer byte for the byte-level vocabulary)", path), 0)
  end
  local text, err = tide.read_file(path, 1024 * 1024 * 1024)
  if not text then error("import: " .. err, 0) end
  local ok, t = pcall(json.decode, text)
  if not ok then error("import: " .. path .. ": " .. tostring(t), 0) end
  local bv = hf.byte_level_vocab_size(t)
  if bv then
    if bv ~= V then error(fmt("import: %s is the byte-level vocabulary of %d ids but vocab_size is %d", path, bv, V), 0) end
    return { tok = tokenizer.byte_level({ vocab_size = V }) }
  end
  if tokenizer.load then
    local tok = tokenizer.load(path)
    if tok.vocab_size > V then
      error(fmt("import: %s has %d ids but the model's vocab_size is %d", path, tok.vocab_size, V), 0)
    end
    return { tok = tok, text = text }
  end
  return { text = text, describe = { kind = "bpe", vocab_size = V } }
end

-- import(dir, out, {tokenizer, overwrite}) -> the step directory written, the model
function M.import(dir, out, opts)
  opts = opts or {}
  local tide = require "tide"
  local C = tide.C
  dir = dir:gsub("/+$", "")
  if C.tide_is_dir(dir) ~= 1 then error(fmt("import: '%s' is not a directory (a HuggingFace model directory)", dir), 0) end
  local cpath = dir .. "/config.json"
  if C.tide_path_exists(cpath) ~= 1 then error(fmt("import: %s is missing", cpath), 0) end
  local ok, hc = pcall(json.read, cpath, 16 * 1024 * 1024)
  if not ok then error("import: " .. tostring(hc), 0) end
  if type(hc) ~= "table" then error("import: " .. cpath .. " is not a JSON object", 0) end
  local mc = hf.llama_model_config(hc, cpath)
  local tk = read_tokenizer(dir, opts.tokenizer, mc.vocab_size)
  local weights = hf.read_weights(dir)
  local nn = require "tide.nn"
  local model = nn.build(mc)
  -- every tensor the model has must be there, and nothing else (a tied head may carry lm_head.weight; older
  -- checkpoints store the rotary table)
  local sd = model:state_dict()
  local missing, unexpected = {}, {}
  for _, name in ipairs(model:state_names()) do if not weights[name] then missing[#missing + 1] = name end end
  for name, t in pairs(weights) do
    local expected = sd[name]
    if not expected then
      if not (name == "lm_head.weight" and mc.tie_embeddings) and not name:match("%.rotary_emb%.inv_freq$") then
        unexpected[#unexpected + 1] = name
      end
      weights[name] = nil
    else
      local a, b = table.concat(t:shape(), "x"), table.concat(expected:shape(), "x")
      if a ~= b then error(fmt("import: tensor '%s' has shape [%s], the model expects [%s]", name, a, b), 0) end
      if not (t:dtype() == "f32" or t:dtype() == "bf16" or t:dtype() == "f64") then
        error(fmt("import: tensor '%s' is %s, expected a float tensor (F32, BF16 or F64)", name, t:dtype()), 0)
      end
    end
  end
  table.sort(missing); table.sort(unexpected)
  if #missing > 0 then
    error(fmt("import: %s lacks %d tensor(s) the model needs: %s", dir, #missing, table.concat(missing, ", ", 1, math.min(#missing, 5))
      .. (#missing > 5 and ", ..." or "")), 0)
  end
  if #unexpected > 0 then
    error(fmt("import: %s holds %d tensor(s) a Llama of this config does not have: %s", dir, #unexpected,
      table.concat(unexpected, ", ", 1, math.min(#unexpected, 5)) .. (#unexpected > 5 and ", ..." or "")), 0)
  end
  model:load_state_dict(weights)
  local checkpoint = require "tide.checkpoint"
  local step = require "tide.step"
  local meta = checkpoint.describe(model, tk.tok, nil, step.plain)
  if tk.describe then meta["tide.tokenizer"] = json.encode(tk.describe) end
  meta["tide.format"] = step.FORMAT
  meta["tide.imported_from"] = hc.architectures and hc.architectures[1] or "LlamaForCausalLM"
  local written
  out = out:gsub("/+$", "")
  hf.write_dir(out, opts.overwrite, "import", function(tmp)
    local d = checkpoint.save(tmp, 0, { model = model, metadata = meta,
      state = { driver = "import", tokens = 0 },
      files = tk.text and function(sd_dir) hf.write_text(sd_dir .. "/tokenizer.json", tk.text) end or nil })
    written = out .. d:sub(#tmp + 1)
  end)
  return written, model
end

function M.main(args)
  local pos, flags = cli.parse_flags(args, SPEC, "tide import")
  if #pos ~= 2 then cli.usage_error("tide import: expected DIR OUT, got " .. #pos .. " argument(s) (tide import --help)") end
  local dir, model = M.import(pos[1], pos[2], flags)
  print(fmt("import: %s -> %s (%s)", pos[1], dir, model:extra_repr()))
  return 0
end

return M
