-- schema.lua — which keys a config may hold at a path, whether or not the recipe spells them out.
--
-- The command line (`tide run R --a.b=v`) may set any key of the config schema: a recipe need not list `train.quiet`
-- or `model.norm_eps` for them to be settable. The key sets are the drivers' and modules' own (tide.train,
-- tide.Curriculum, the model classes, AdamW, the schedule, the data builder), so this file adds no list of its own;
-- the drivers still validate every value when they run.
local schema = {}

local function set_of(t)
  if not t then return nil end
  local out = {}
  for k in pairs(t) do out[k] = true end
  return out
end

-- the model's key sets by kind; sub-tables moe / kda / mla have their modules' keys
local function model_keys(model, rest)
  local nn = require "tide.nn"
  local kind = type(model) == "table" and model.kind or "dense"
  if #rest == 0 then
    if kind == "hybrid" then return set_of(nn.HybridLM.KEYS) end
    return set_of(nn.TransformerLM.DEFAULTS)
  end
  if #rest == 1 then
    local sub = rest[1]
    if sub == "moe" then return set_of(nn.MoE.KEYS) end
    if sub == "kda" then return set_of(nn.KDA.KEYS) end
    if sub == "mla" and kind == "hybrid" then return set_of(nn.MLA.KEYS) end
    if sub == "vision" and kind == "hybrid" then return set_of(nn.vision.KEYS) end
  end
  return nil
end

-- the keys of a named source of an image kind (data/multimodal.lua); other kinds: nil (the recipe's own keys)
local function source_keys(cfg, name)
  local sc = (cfg.sources or {})[name]
  local kind = type(sc) == "table" and sc.kind or nil
  local K = require("tide.data.multimodal").KEYS[kind or ""]
  if not K then return nil end
  local out = set_of(K)
  out.kind = true
  return out
end

-- keys(cfg, parts) -> the set of keys the schema allows in the table at path parts (an array of keys, {} = the top),
-- or nil when the schema does not describe that table
function schema.keys(cfg, parts)
  local head = parts[1]
  if head == "model" then
    local rest = {}
    for i = 2, #parts do rest[#rest + 1] = parts[i] end
    return model_keys(cfg.model, rest)
  end
  if cfg.kind == "curriculum" then
    local K = require("tide.curriculum").KEYS
    if #parts == 0 then return set_of(K.top) end
    if head == "train" and #parts == 1 then return set_of(K.train) end
    if head == "val" and #parts == 1 then return set_of(K.val) end
    if head == "optim" and #parts == 1 then return set_of(require("tide.optim").KEYS) end
    if head == "stages" and #parts == 2 then return set_of(K.stage) end
    if head == "stages" and #parts == 3 and parts[3] == "lr" then return set_of(K.lr) end
    if head == "stages" and #parts == 3 and parts[3] == "eval" then return set_of(K.eval) end
    if head == "sources" and #parts == 2 then return source_keys(cfg, parts[2]) end
    return nil
  end
  local K = require("tide.train").KEYS
  if #parts == 0 then return set_of(K.top) end
  if #parts == 1 then
    if head == "data" then return set_of(require("tide.data").KEYS) end
    if head == "schedule" then return set_of(require("tide.schedule").KEYS) end
    return set_of(K.sections[head] or nil)
  end
  return nil
end

-- the tables the command line may create when a recipe leaves them out (their keys come from keys())
schema.TABLES = { sample = true, expect = true, moe = false, kda = false, mla = false, lr = true, eval = true, val = true }

return schema
