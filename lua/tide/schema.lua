-- schema.lua — which keys a config may hold at a path, whether or not the recipe spells them out.
--
-- The command line (`tide run R --a.b=v`) may set any key of the config schema: a recipe need not list `train.quiet`
-- or `model.norm_eps` for them to be settable. The key sets are the drivers' and modules' own (tide.train,
-- tide.Curriculum, tide.rl's Recipe, the model classes, AdamW, the schedule, the data builder, the data sources, the
-- evals), so this file adds no list of its own (only the keys that tie an entry to its module or another entry: a
-- source's kind and filler_source, an eval's source); the drivers still validate every value when they run.
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

-- the keys of the source `name` of a sources table, by its kind as data/sources.lua builds it: a text source's are
-- data/pack.lua's text_source keys, a synthetic task's data/synthetic.lua's (and filler_source, the text source its
-- filler = "text" draws from: sources.filler_text), an image kind's data/multimodal.lua's; nil for an unknown kind
local function source_keys(sources, name)
  local sc = type(sources) == "table" and sources[name] or nil
  if type(sc) ~= "table" then return nil end
  local kind = sc.kind or "text"
  local syn = require("tide.data.synthetic").KEYS
  local out
  if kind == "text" then
    out = set_of(require("tide.data.pack").TEXT_KEYS)
  elseif syn.tasks[kind] then
    out = set_of(syn.common)
    for k in pairs(syn.tasks[kind]) do out[k] = true end
    out.filler_source = true
  else
    out = set_of(require("tide.data.multimodal").KEYS[kind])
  end
  if not out then return nil end
  out.kind = true
  return out
end

-- the keys of a curriculum's eval entry evals[i], by the kind of the source it names: a synthetic task's are
-- tide.evals' run keys and the task's options (evals.run hands them to the source), an image kind's the curriculum's
-- caption eval keys; nil for an entry without a known source
local function eval_keys(cfg, i)
  local e = type(cfg.evals) == "table" and cfg.evals[tonumber(i)] or nil
  local sc = type(e) == "table" and type(cfg.sources) == "table" and cfg.sources[e.source] or nil
  if type(sc) ~= "table" then return nil end
  local kind = sc.kind or "text"
  if require("tide.data.multimodal").KEYS[kind] then return set_of(require("tide.curriculum").KEYS.caption_eval) end
  local task = require("tide.data.synthetic").KEYS.tasks[kind]
  if not task then return nil end
  local out = set_of(require("tide.evals").RUN_KEYS)
  for k in pairs(task) do out[k] = true end
  out.source = true
  return out
end

-- keys(cfg, parts) -> the set of keys the schema allows in the table at path parts (an array of keys, {} = the top),
-- or nil when the schema does not describe that table
function schema.keys(cfg, parts)
  local head = parts[1]
  if head == "dist" and #parts == 1 then return set_of(require("tide.dist").KEYS) end
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
    if head == "expect" and #parts == 1 then return set_of(K.expect) end
    if head == "optim" and #parts == 1 then return set_of(require("tide.optim").KEYS) end
    if head == "stages" and #parts == 2 then return set_of(K.stage) end
    if head == "stages" and #parts == 3 and parts[3] == "lr" then return set_of(K.lr) end
    if head == "stages" and #parts == 3 and parts[3] == "eval" then return set_of(K.eval) end
    if head == "sources" and #parts == 2 then return source_keys(cfg.sources, parts[2]) end
    if head == "evals" and #parts == 2 then return eval_keys(cfg, parts[2]) end
    return nil
  end
  if cfg.kind == "rl" then
    local K = require("tide.rl.loop").KEYS
    if #parts == 0 then return set_of(K.top) end
    if #parts == 1 and head == "optim" then return set_of(require("tide.optim").KEYS) end
    if #parts == 1 and head ~= "top" then return set_of(K[head]) end   -- sft, rl, train, expect
    return nil
  end
  local K = require("tide.train").KEYS
  if #parts == 0 then return set_of(K.top) end
  if #parts == 1 then
    -- packed data (data.sources) has its own keys; the packer's sources are curriculum sources
    if head == "data" then
      return set_of(type(cfg.data) == "table" and cfg.data.sources and K.packed or require("tide.data").KEYS)
    end
    if head == "schedule" then return set_of(require("tide.schedule").KEYS) end
    return set_of(K.sections[head] or nil)
  end
  if #parts == 3 and head == "data" and parts[2] == "sources" and type(cfg.data) == "table" then
    return source_keys(cfg.data.sources, parts[3])
  end
  return nil
end

-- the tables the command line may create when a recipe leaves them out (their keys come from keys())
schema.TABLES = { sample = true, expect = true, moe = false, kda = false, mla = false, lr = true, eval = true, val = true,
  optim = true, dist = true }

return schema
