-- data — tokenizers, the text/shard batch streams and the synthetic tasks (task = "mqar").
local tokenizer = require "tide.data.tokenizer"
local text = require "tide.data.text"
local mqar = require "tide.data.mqar"
local pack = require "tide.data.pack"
local options = require "tide.options"

local data = { tokenizer = tokenizer, text = text, mqar = mqar, pack = pack, passkey = require "tide.data.passkey",
  copy = require "tide.data.copy", synthetic = require "tide.data.synthetic" }

-- the keys a recipe's `data` table may hold
data.KEYS = {
  path = true, paths = true, exclude = true, format = true, doc_separator = true, field = true, val_fraction = true,
  seq_len = true, batch_size = true, seed = true, order = true, vocab_size = true,
  -- "byte" (the default) or the path of a HuggingFace tokenizer.json (byte-level BPE)
  tokenizer = true,
  -- synthetic tasks (data/mqar.lua): task = "mqar" with num_pairs, power, filler, examples, val_examples, val_seed
  task = true, num_pairs = true, power = true, filler = true, examples = true, val_examples = true, val_seed = true,
}

local function check_keys(cfg) options.check(cfg, data.KEYS, nil, "data") end

-- build(cfg, vocab_size) -> {tokenizer, dataset, train = stream, val = stream factory or nil}
-- The validation stream walks its split in order from the start each time it is made, so every
-- evaluation sees the same batches.
function data.build(cfg, vocab_size)
  check_keys(cfg)
  if cfg.task == "mqar" then return mqar.build(cfg, vocab_size) end
  if cfg.task ~= nil then error("data: unknown task '" .. tostring(cfg.task) .. "' (known: mqar)", 2) end
  local tok = tokenizer.for_model(cfg.tokenizer, cfg.vocab_size or vocab_size or 320, "data.tokenizer", "data")
  local ds = text.load(cfg, tok)
  local opts = { batch_size = cfg.batch_size, seq_len = cfg.seq_len, seed = cfg.seed or 0, order = cfg.order or "random" }
  local out = { tokenizer = tok, dataset = ds, train = text.stream(ds.train, opts) }
  if ds.val and ds.val.n > cfg.seq_len then
    out.val = function()
      return text.stream(ds.val, { batch_size = cfg.batch_size, seq_len = cfg.seq_len, order = "sequential" })
    end
  end
  return out
end

return data
