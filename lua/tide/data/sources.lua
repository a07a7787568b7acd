-- data.sources — named document sources and the packer over them, shared by tide.Curriculum and by tide.train's
-- packed data (spec/long_context.md §3): sources = {text = {kind = "text", path = ...}, recall = {kind = "mqar", ...}}.
local options = require "tide.options"

local sources = {}
local fmt = string.format

local SYNTHETIC = { mqar = true, passkey = true, copy = true }
sources.KINDS = "text, mqar, passkey or copy"

local deep_copy = options.deep_copy

-- build(spec, tokenizer, seed, who) -> {name = source}: each entry {kind = "text" | "mqar" | "passkey" | "copy", ...}
-- with the kind's own options; a source without a seed takes the run's
function sources.build(spec, tok, seed, who)
  local data = require "tide.data"
  local out = {}
  for name, sc in pairs(spec or {}) do
    if type(sc) ~= "table" then options.fail(who, fmt("sources.%s must be a table", tostring(name))) end
    local o = deep_copy(sc)
    local kind = o.kind or "text"
    o.kind = nil
    o.tokenizer = tok
    if o.seed == nil then o.seed = seed end
    if kind == "text" then
      out[name] = data.pack.text_source(o)
    elseif SYNTHETIC[kind] then
      o.task = kind
      out[name] = data.synthetic.source(o)
    else
      options.fail(who, fmt("sources.%s: kind must be %s, got %s", tostring(name), sources.KINDS, tostring(kind)))
    end
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
function sources.packer(names, built, T, seed, eot)
  local data = require "tide.data"
  local entries = {}
  for _, name in ipairs(names) do entries[#entries + 1] = { source = built[name], weight = 1, name = name } end
  return data.pack.Packer{ sources = entries, seq_len = T, seed = seed, eot = eot }
end

return sources
