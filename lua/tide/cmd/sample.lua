-- tide sample CKPT --prompt TEXT: text from a checkpoint, printed token by token as it is generated
-- (generate.generate with its on_token hook; generate.text_stream keeps multi-byte characters whole).
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide sample CKPT [--prompt TEXT] [--image PATH] [--max-new N] [--temperature T] [--top-k K] [--top-p P]
                        [--seed S]

Generates a continuation of TEXT with the model of checkpoint CKPT (a run directory, its latest checkpoint, or a
step directory) and prints it to stdout as it is generated. The same seed gives the same text.

  --prompt TEXT       the start of the text (default: empty, the model starts a new document)
  --image PATH        a PNG or JPEG read by the model's vision encoder (a model trained with vision): the prompt is
                      <|media_start|>image<|media_content|> its tokens <|media_end|>, then TEXT
  --max-new N         tokens to generate (default 200); stops earlier at --stop
  --temperature T     0 = greedy (the argmax of every step's logits); default 1
  --top-k K           sample among the K likeliest tokens only (default 0: all)
  --top-p P           sample among the smallest set of likeliest tokens whose probability reaches P (default 1)
  --seed S            the sampler's seed (default 0; its Philox stream leaves the training RNG alone)
  --stop NAME         the special token that ends the text (default <|endoftext|>; "none" never stops)
  --echo              print the prompt before the continuation
  --window N          context kept for attention layers (default: the model's max_seq_len); when it is full
                      decoding restarts from the last N/2 tokens
  --device DEV        cpu (default) or cuda:0]]

local SPEC = {
  prompt = { kind = "string", default = "" },
  image = { kind = "string" },
  max_new = { kind = "integer", default = 200, min = 0 },
  temperature = { kind = "number", default = 1, min = 0 },
  top_k = { kind = "integer", default = 0, min = 0 },
  top_p = { kind = "number", default = 1, min = 1e-9, max = 1 },
  seed = { kind = "integer", default = 0, min = 0 },
  stop = { kind = "string", default = "<|endoftext|>" },
  echo = { kind = "boolean", default = false },
  window = { kind = "integer", min = 2 },
  device = { kind = "string", default = "cpu" },
}

M.SPEC = SPEC

-- sample(ckpt, flags, out) -> text, new ids, info: flags as parse_flags returns them (SPEC's defaults for any left
-- out); out has write(self, s) and flush(self) (io.stdout by default) and receives the text piece by piece
function M.sample(ckpt, flags, out)
  out = out or io.stdout
  local f = {}
  for k, s in pairs(SPEC) do f[k] = s.default end
  for k, v in pairs(flags or {}) do f[k] = v end
  local checkpoint = require "tide.checkpoint"
  local generate = require "tide.generate"
  local model, info = checkpoint.load_model(ckpt, { device = f.device ~= "cpu" and f.device or nil })
  local tok = info.tokenizer
  local stop = f.stop
  if stop == "none" then stop = false
  else
    local ok, err = pcall(tok.id, tok, stop)
    if not ok then cli.usage_error("tide sample: --stop: " .. tostring(err):gsub("^.-: ", "", 1)) end
  end
  local push, finish = generate.text_stream(tok)
  local ids = {}
  local prompt, images = f.prompt, nil
  if f.image then
    if not model.vision_cfg then
      cli.usage_error(string.format("tide sample: --image: the model of '%s' has no vision encoder (model.vision)", ckpt))
    end
    local image = require "tide.data.image"
    local mm = require "tide.data.multimodal"
    local ok, img = pcall(image.read, f.image)
    if not ok then cli.usage_error("tide sample: --image: " .. tostring(img):gsub("^image.read: ", "", 1)) end
    local vc = require("tide.nn.vision").preprocessing(model.vision_cfg)
    local pids, _, n, ims = mm.document(tok, { img, f.prompt }, vc)
    prompt = {}
    for t = 0, n - 1 do prompt[t + 1] = pids[t] end
    local im = ims[1]
    images = { patches = im.patches, grids = { { im.h, im.w } }, pad_id = tok:id("<|media_pad|>") }
  end
  if f.echo then out:write(f.prompt); out:flush() end
  local text = generate.generate(model, tok, {
    prompt = prompt, images = images, max_new_tokens = f.max_new, temperature = f.temperature, top_k = f.top_k, top_p = f.top_p,
    seed = f.seed, stop = stop, window = f.window,
    on_token = function(id)
      ids[#ids + 1] = id
      local piece = push(id)
      if piece ~= "" then out:write(piece); out:flush() end
    end,
  })
  local rest = finish()
  out:write(rest, "\n")
  out:flush()
  return text, ids, info
end

function M.main(args)
  local pos, flags = cli.parse_flags(args, SPEC, "tide sample")
  if #pos ~= 1 then cli.usage_error("tide sample: expected one checkpoint, got " .. #pos .. " argument(s) (tide sample --help)") end
  M.sample(pos[1], flags)
  return 0
end

return M
