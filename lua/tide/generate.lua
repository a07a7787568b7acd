-- generate.lua — autoregressive sampling from a language model with per-layer caches (attention: keys
-- and values; KDA: state and conv history, a fixed size): greedy (temperature 0), temperature, top-k and
-- top-p (nucleus) sampling. The sampler draws from its
-- own Philox stream (seed, draw index), so samples are reproducible and leave the training RNG alone.
local ffi = require "ffi"
local tide = require "tide"
local options = require "tide.options"
local C = tide.C
local fmt = string.format
local exp = math.exp

local generate = {}

local function ids_tensor(ids)
  return tide.tensor({ ids }, { dtype = "i32" })
end

-- logits of the last position as a Lua array of V numbers (index = id + 1)
local function last_logits(logits)
  return logits:narrow(2, logits:size(2), 1):tolist()
end

-- sample(logits, opts, u) -> 0-based id. logits: Lua array (index = id + 1); u: a uniform in [0, 1)
function generate.sample(logits, opts, u)
  local V = #logits
  local temperature = opts.temperature or 1
  if temperature <= 0 then
    local best = 1
    for i = 2, V do if logits[i] > logits[best] then best = i end end
    return best - 1
  end
  local top_k, top_p = opts.top_k, opts.top_p
  if (not top_k or top_k <= 0 or top_k >= V) and (not top_p or top_p >= 1) then
    -- the whole distribution: walk the ids in order (no sort; a sort per token dominated the sampling)
    local maxl = logits[1]
    for i = 2, V do if logits[i] > maxl then maxl = logits[i] end end
    local total = 0
    for i = 1, V do total = total + exp((logits[i] - maxl) / temperature) end
    local target, acc, last = u * total, 0, 1
    for i = 1, V do
      local p = exp((logits[i] - maxl) / temperature)
      acc = acc + p
      if p > 0 then last = i end
      if target < acc then return i - 1 end
    end
    return last - 1   -- rounding left target at the total: the last id that can be drawn
  end
  local order = {}
  for i = 1, V do order[i] = i end
  table.sort(order, function(a, b)
    if logits[a] ~= logits[b] then return logits[a] > logits[b] end
    return a < b
  end)
  local k = V
  if opts.top_k and opts.top_k > 0 and opts.top_k < V then k = opts.top_k end
  local maxl = logits[order[1]]
  local probs, total = {}, 0
  for j = 1, k do
    local p = math.exp((logits[order[j]] - maxl) / temperature)
    probs[j] = p
    total = total + p
  end
  if opts.top_p and opts.top_p < 1 then
    -- the smallest prefix whose probability reaches top_p (always at least one token)
    local acc, cut = 0, k
    for j = 1, k do
      acc = acc + probs[j] / total
      if acc >= opts.top_p then cut = j break end
    end
    k, total = cut, 0
    for j = 1, k do total = total + probs[j] end
  end
  local target, acc = u * total, 0
  for j = 1, k do
    acc = acc + probs[j]
    if target < acc then return order[j] - 1 end
  end
  return order[k] - 1
end

-- text_stream(tok) -> push(id) -> text, finish() -> text: incremental decoding for printing tokens as they come.
-- push returns the new text that ends on a whole UTF-8 character; bytes of a character still incomplete (a
-- byte-level token holds one byte of a multi-byte character) wait for the next push, and finish returns what is
-- left. Only the tokens not yet fully printed are decoded again, so each push costs O(1) tokens. Relies on
-- decode(a .. b) = decode(a) .. decode(b), true of byte-level vocabularies and byte-level BPE.
local function utf8_complete(s)
  -- the length of the prefix of s that does not end inside a multi-byte character
  local n = #s
  for back = 1, math.min(3, n) do
    local c = s:byte(n - back + 1)
    if c < 0x80 then return n end                            -- ASCII: complete
    if c >= 0xC0 then                                        -- a lead byte: how many bytes does it need?
      local need = c >= 0xF0 and 4 or c >= 0xE0 and 3 or 2
      if c >= 0xF8 then return n end                         -- not UTF-8: nothing to wait for
      return back < need and n - back or n
    end
  end
  return n                                                   -- only continuation bytes: print them as they are
end

function generate.text_stream(tok)
  local pending, printed = {}, 0                             -- ids not fully printed; bytes of them printed
  local function push(id)
    pending[#pending + 1] = id
    local text = tok:decode(pending)
    local upto = utf8_complete(text)
    local out = text:sub(printed + 1, upto)
    if upto == #text then pending, printed = {}, 0 else printed = upto end
    return out
  end
  local function finish()
    if #pending == 0 then return "" end
    local text = tok:decode(pending):sub(printed + 1)
    pending, printed = {}, 0
    return text
  end
  return push, finish
end

-- generate(model, tok, {prompt = "text" | {ids}, images = nil | {patches, grids, pad_id} (the prompt's images, in
--   the order of its <|media_pad|> runs; the prefill runs them through the vision encoder), max_new_tokens = 100, temperature = 1, top_k, top_p,
--   seed = 0, stop = "<|endoftext|>" | false, window = model.cfg.max_seq_len, on_token = function(id) end})
-- on_token sees every new id as soon as it is drawn (the stop id is not passed), for streaming output.
-- window bounds a growing (attention) cache; a model whose caches do not grow (model:cache_grows() is
-- false: KDA only) keeps its whole context unless a window is given, at a per-token cost independent of it.
-- -> text of the new tokens, the full id list
function generate.generate(model, tok, opts)
  opts = opts or {}
  local ids
  if type(opts.prompt) == "table" then
    ids = {}
    for i, v in ipairs(opts.prompt) do ids[i] = v end
  else
    ids = tok:encode(opts.prompt or "")
  end
  if #ids == 0 then ids = { tok:id("<|endoftext|>") } end
  local stop = opts.stop
  if stop == nil then stop = "<|endoftext|>" end
  local stop_id = stop and tok:id(stop) or nil
  local bounded = model.cache_grows ~= nil and not model:cache_grows()
  local window = opts.window or (bounded and math.huge) or (model.cfg and model.cfg.max_seq_len) or 1024
  local n_new = opts.max_new_tokens or 100
  local seed = opts.seed or 0
  local u = ffi.new("double[1]")
  local n_prompt = #ids
  local was_training = model.training
  model:eval()
  local prev = C.tide_set_grad_enabled(0)
  local ok, err = pcall(function()
    local cache, logits
    local function prefill()
      -- (re)start the cache from the last window/2 tokens when the context is full
      local start = math.max(1, #ids - math.floor(window / 2) + 1)
      if #ids <= window then start = 1 end
      local ctx = {}
      for i = start, #ids do ctx[#ctx + 1] = ids[i] end
      cache = model:new_cache()
      local fo
      if opts.images then
        -- the images are read once, by the prefill; a restart from the window's tail would drop them
        if start > 1 then error(fmt("generate: the prompt with images has %d tokens, over the window of %d", #ids, window), 0) end
        fo = { images = opts.images }
      end
      logits = last_logits(model:forward(ids_tensor(ctx), cache, fo))
    end
    prefill()
    for step = 1, n_new do
      C.tide_philox_uniform(seed, step - 1, u, 1)
      local id = generate.sample(logits, opts, u[0])
      ids[#ids + 1] = id
      if stop_id and id == stop_id then break end
      if opts.on_token then opts.on_token(id) end
      if step == n_new then break end
      if cache[1].pos >= window then
        prefill()
      else
        logits = last_logits(model:forward(ids_tensor({ id }), cache))
      end
    end
  end)
  C.tide_set_grad_enabled(prev)
  model:train(was_training)
  if not ok then error(err, 2) end
  local new = {}
  for i = n_prompt + 1, #ids do
    if not (stop_id and ids[i] == stop_id) then new[#new + 1] = ids[i] end
  end
  return tok:decode(new), ids
end

-- ids(model, prompts, opts) -> the new ids: prompts is one list of token ids (-> one list) or a list of
-- lists (-> a list of lists). Rows of equal length run together as one [B, T] batch on batched caches,
-- others row by row; every row draws from its own Philox stream (seed, row index), so a row samples the
-- same tokens alone or in a batch. opts: max_new (32), temperature (0: greedy), top_k, top_p, stop (an id or
-- a list of ids; a row ends after emitting one, which is kept), seed (0). No window: the caches keep the
-- whole context (KDA layers at a fixed size, attention/MLA layers growing).
-- opts.images: the prompt's images {patches, grids, pad_id} for one prompt, or for a list of prompts a list with
-- one such table (or false) per prompt; the prefill splices them at the prompts' <|media_pad|> placeholders.
local IDS_KEYS = { max_new = true, temperature = true, top_k = true, top_p = true, stop = true, seed = true,
  images = true }

-- the images of the rows idx (global row indices) as one packed set, or nil
local function group_images(per_row, idx)
  if not per_row then return nil end
  local patches, grids, pad_id = {}, {}, nil
  for _, r in ipairs(idx) do
    local im = per_row[r]
    if im then
      patches[#patches + 1] = im.patches
      for _, g in ipairs(im.grids) do grids[#grids + 1] = g end
      pad_id = pad_id or im.pad_id
    end
  end
  if #patches == 0 then return nil end
  return { patches = #patches == 1 and patches[1] or tide.F.concat(patches, 1), grids = grids, pad_id = pad_id }
end

function generate.ids(model, prompts, opts)
  opts = options.check(opts or {}, IDS_KEYS, nil, "generate")
  if type(prompts) ~= "table" or #prompts == 0 then error("generate: prompts must be a non-empty list of ids or of lists", 2) end
  local batch = type(prompts[1]) == "table"
  local rows = batch and prompts or { prompts }
  for r, row in ipairs(rows) do
    if type(row) ~= "table" or #row == 0 then error(string.format("generate: prompt %d is empty or not a list of ids", r), 2) end
  end
  local stops = {}
  if type(opts.stop) == "number" then stops[opts.stop] = true
  elseif type(opts.stop) == "table" then for _, s in ipairs(opts.stop) do stops[s] = true end end
  local n_new, seed = opts.max_new or 32, opts.seed or 0
  local sample_opts = { temperature = opts.temperature or 0, top_k = opts.top_k, top_p = opts.top_p }
  local u = ffi.new("double[1]")
  local out = {}
  -- a group of rows of one length, at global indices idx
  local function run(idx)
    local B, T = #idx, #rows[idx[1]]
    local flat = {}
    for b = 1, B do flat[b] = rows[idx[b]] end
    local cache = model:new_cache()
    local im = group_images(opts.images and (batch and opts.images or { opts.images }), idx)
    local logits = model:forward(tide.tensor(flat, { dtype = "i32" }), cache, im and { images = im } or nil)
    local last = logits:narrow(2, T, 1):tolist()
    local V = #last / B
    -- the prefill's activations are garbage now: free them before decoding (the Lua collector does not see
    -- their bytes and would otherwise run full collections again and again while they are still held)
    logits = nil
    collectgarbage()
    local done, n_done = {}, 0
    for b = 1, B do out[idx[b]] = {} end
    for step = 1, n_new do
      local next_ids = {}
      for b = 1, B do
        local id = 0
        if not done[b] then
          local lg = {}
          for v = 1, V do lg[v] = last[(b - 1) * V + v] end
          C.tide_philox_uniform(seed, (idx[b] - 1) * 1048576 + step - 1, u, 1)
          id = generate.sample(lg, sample_opts, u[0])
          local o = out[idx[b]]
          o[#o + 1] = id
          if stops[id] then done[b] = true; n_done = n_done + 1 end
        end
        next_ids[b] = { id }
      end
      if n_done == B or step == n_new then break end
      last = model:forward(tide.tensor(next_ids, { dtype = "i32" }), cache):tolist()
    end
  end
  local was_training = model.training
  model:eval()
  local prev = C.tide_set_grad_enabled(0)
  local ok, err = pcall(function()
    local groups, order = {}, {}
    for r, row in ipairs(rows) do
      local n = #row
      if not groups[n] then groups[n] = {}; order[#order + 1] = n end
      groups[n][#groups[n] + 1] = r
    end
    for _, n in ipairs(order) do run(groups[n]) end
  end)
  C.tide_set_grad_enabled(prev)
  model:train(was_training)
  if not ok then error(err, 2) end
  return batch and out or out[1]
end

setmetatable(generate, { __call = function(_, ...) return generate.generate(...) end })
return generate
