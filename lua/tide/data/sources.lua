-- data.sources — named document sources and the packer over them, shared by tide.Curriculum and by tide.train's
-- packed data (spec/long_context.md §3): sources = {text = {kind = "text", path = ...}, recall = {kind = "mqar", ...}}.
local options = require "tide.options"

local sources = {}
local fmt = string.format

local SYNTHETIC = { mqar = true, passkey = true, copy = true }
-- the image-text kinds (data/multimodal.lua): their images are prepared with the source's own `vision` table
-- (patch, mean, std, token_limit, loss_on_wrappers), or else the `vision` handed to build (a recipe passes its
-- model's vision config), over image.VISION_DEFAULTS (tiny-vlm)
local IMAGE = { squares = "squares_source", digits = "digits_source", image_text = "image_text_source" }
sources.KINDS = "text, mqar, passkey, copy, squares, digits or image_text"

local deep_copy = options.deep_copy

-- the preprocessing keys of a model's vision config (the rest, widths and depths, is the encoder's)
local function preprocessing(v)
  if v == nil then return nil end
  local out = {}
  for k in pairs(require("tide.data.image").VISION_DEFAULTS) do out[k] = deep_copy(v[k]) end
  return out
end

-- filler_text(o, name, spec, built, who): a synthetic source's `filler_source = NAME` (with filler = "text") becomes
-- filler_text = the built text source NAME, the text its filler is drawn from (data/synthetic.lua); o is edited
local function text_names(spec)
  local names = {}
  for n, sc in pairs(spec or {}) do
    if type(sc) == "table" and (sc.kind or "text") == "text" then names[#names + 1] = tostring(n) end
  end
  table.sort(names)
  return #names > 0 and table.concat(names, ", ") or "none"
end

function sources.filler_text(o, name, spec, built, who)
  local fs = o.filler_source
  o.filler_source = nil
  if o.filler == "text" then
    local sc = type(fs) == "string" and (spec or {})[fs]
    if not (type(sc) == "table" and (sc.kind or "text") == "text" and built[fs]) then
      options.fail(who, fmt("sources.%s: filler = \"text\" needs filler_source = the name of a text source "
        .. "(text sources: %s), got %s", tostring(name), text_names(spec), tostring(fs)))
    end
    o.filler_text = built[fs]
  elseif fs ~= nil then
    options.fail(who, fmt("sources.%s: filler_source is used only with filler = \"text\", got filler = %s",
      tostring(name), tostring(o.filler)))
  end
  return o
end

-- build(spec, tokenizer, seed, who, vision) -> {name = source}: each entry {kind = "text" | "mqar" | "passkey" |
-- "copy" | "squares" | "digits" | "image_text", ...} with the kind's own options; a source without a seed takes the
-- run's, an image source without `vision` takes `vision` (the model's). Text sources are built first, so a
-- synthetic source can draw its filler from one (filler = "text", filler_source = NAME).
function sources.build(spec, tok, seed, who, vision)
  local data = require "tide.data"
  local out, names = {}, {}
  for name in pairs(spec or {}) do names[#names + 1] = name end
  table.sort(names, function(a, b) return tostring(a) < tostring(b) end)
  for _, pass in ipairs({ "text", "synthetic" }) do
    for _, name in ipairs(names) do
      local sc = spec[name]
      if type(sc) ~= "table" then options.fail(who, fmt("sources.%s must be a table", tostring(name))) end
      local kind = sc.kind or "text"
      if (kind == "text") == (pass == "text") then
        local o = deep_copy(sc)
        o.kind = nil
        o.tokenizer = tok
        if o.seed == nil then o.seed = seed end
        if kind == "text" then
          out[name] = data.pack.text_source(o)
        elseif SYNTHETIC[kind] then
          o.task = kind
          out[name] = data.synthetic.source(sources.filler_text(o, name, spec, out, who))
        elseif IMAGE[kind] then
          if o.vision == nil then o.vision = preprocessing(vision) end
          if o.name == nil then o.name = tostring(name) end
          out[name] = require("tide.data.multimodal")[IMAGE[kind]](o)
        else
          options.fail(who, fmt("sources.%s: kind must be %s, got %s", tostring(name), sources.KINDS, tostring(kind)))
        end
      end
    end
  end
  return out
end

-- held_out(spec) -> the sources' held-out twins, under the same names: a text source's val split (same files,
-- val_fraction and order: shuffled by its seed unless it says otherwise, so a few batches sample every file rather
-- than the first ones), a synthetic source's eval split (generator examples disjoint from the training ones); a
-- text source without a val split (val_fraction = 0) has no twin and is an error naming it
function sources.held_out(spec, who)
  local out = {}
  for name, sc in pairs(spec or {}) do
    if type(sc) ~= "table" then options.fail(who, fmt("sources.%s must be a table", tostring(name))) end
    local o = deep_copy(sc)
    if (o.kind or "text") == "text" or o.kind == "image_text" then
      if not (type(o.val_fraction) == "number" and o.val_fraction > 0) then
        options.fail(who, fmt("sources.%s has no held-out split for val.mix = \"stage\" (val_fraction = %s; give it "
          .. "val_fraction > 0)", tostring(name), tostring(o.val_fraction)))
      end
      o.split = "val"
    else
      o.split = "eval"
    end
    out[name] = o
  end
  return out
end

-- a mixture list {name, weight, min_len, max_len} in name order from {name = weight | {weight =, min_len =, max_len =}}
local MIX = { weight = true, min_len = true, max_len = true }
function sources.mix(spec, defined, where, who)
  if type(spec) ~= "table" or next(spec) == nil then options.fail(who, where .. ": `mix` must name at least one source") end
  local mix = {}
  for src, w in pairs(spec) do
    if defined and not defined[src] then
      options.fail(who, fmt("%s: mix names the source '%s', which `sources` does not define (known: %s)", where,
        tostring(src), table.concat(options.sorted_keys(defined), ", ")))
    end
    local e = type(w) == "table" and deep_copy(w) or { weight = w }
    options.check(e, MIX, fmt("%s: mix.%s", where, tostring(src)), who)
    if type(e.weight) ~= "number" or not (e.weight > 0) then
      options.fail(who, fmt("%s: the weight of source '%s' must be a number > 0, got %s", where, tostring(src),
        tostring(e.weight)))
    end
    e.name = src
    mix[#mix + 1] = e
  end
  table.sort(mix, function(a, b) return a.name < b.name end)
  return mix
end

-- the packer's mixture entries for a resolved mix
function sources.mix_entries(mix)
  local out = {}
  for _, e in ipairs(mix) do
    out[#out + 1] = { name = e.name, weight = e.weight, min_len = e.min_len, max_len = e.max_len }
  end
  return out
end

-- one packer over the named sources, in the given order; set_mix and set_seq_len then steer it, so every cursor and
-- the cut-document carry-over continue across changes
-- packer(names, built, T, seed, eot[, lanes = {lanes, first, count}]) -> pack.Lanes over the built sources: the
-- lanes this rank hosts (default: the one lane of one, the plain packer)
function sources.packer(names, built, T, seed, eot, lanes)
  local pack = require "tide.data.pack"
  local entries = {}
  for _, name in ipairs(names) do entries[#entries + 1] = { source = built[name], weight = 1, name = name } end
  lanes = lanes or {}
  return pack.Lanes{ lanes = lanes.lanes, first = lanes.first, count = lanes.count, make = function(lane, L)
    return pack.Packer{ sources = entries, seq_len = T, seed = seed, eot = eot, lane = lane, lanes = L }
  end }
end

return sources
