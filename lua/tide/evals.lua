-- evals.lua — scorers for the synthetic long-context probes (spec/evals.md §1–§3, test oracle 4): token accuracy
-- and exact match per context length and, for passkey, per needle depth.
--
--   local rows = evals.run(model, { task = "passkey", lengths = {256, 1024}, depths = {0, 0.25, 0.5, 0.75, 1},
--                                   examples = 20, batch = 4, seed = 1234, tokenizer = tok, ...task options })
--   rows[k] = { task, length, depth (passkey only), accuracy, exact, examples, labelled, seed }
--   evals.table(rows) -> a markdown table
--
-- The example scored at length L is exactly the training document src:doc(i, L) of data/synthetic.lua (it starts
-- with <|endoftext|>, n = L), one per row of a [B, L] batch, from the source's "eval" split: example indices from
-- 2^31 on, disjoint from every training document whatever the seeds. Scoring is teacher-forced: argmax of the
-- logits at every labelled position. accuracy = hits / labelled positions; exact = share of examples with every
-- label right.
local ffi = require "ffi"
local tide = require "tide"
local synthetic = require "tide.data.synthetic"
local options = require "tide.options"
local C = tide.C

local evals = {}

evals.DEFAULTS = { depths = { 0, 0.25, 0.5, 0.75, 1 }, examples = 20, batch = 4, seed = 1234 }
local RUN_KEYS = { task = true, lengths = true, depths = true, examples = true, batch = true, seed = true, device = true }
evals.RUN_KEYS = RUN_KEYS   -- tide.schema: the keys of a curriculum's eval entry (with the task's options)

local fmt = string.format
local function bad(msg) options.fail("evals", msg) end      -- at the first line outside lua/tide
local is_int = options.is_int

-- the device of the model's first parameter ("cpu" for a model without parameters)
local function model_device(model)
  if type(model.named_parameters) == "function" then
    for _, t in model:named_parameters() do return t:device() end
  end
  return "cpu"
end

-- scores examples 0 .. n−1 of src at length L; returns hits, labelled, exact (examples all right)
local function score(model, src, L, n, B, device)
  local hits, labelled, exact = 0, 0, 0
  local i32, i64 = C.tide_dtype_from_name("i32"), C.tide_dtype_from_name("i64")
  for first = 0, n - 1, B do
    local nb = math.min(B, n - first)
    local x = ffi.new("int32_t[?]", nb * L)
    local targets = {}
    for b = 0, nb - 1 do
      local ids, tg, len = src:doc(first + b, L)
      if len ~= L then bad(fmt("%s document %d has %d tokens at length %d", src.name, first + b, len, L)) end
      ffi.copy(x + b * L, ids, L * 4)
      targets[b] = tg
    end
    local shape = ffi.new("int64_t[2]", nb, L)
    local ids = tide.check(C.tide_from_bytes(i32, 2, shape, 0, x, nb * L * 4))
    if device ~= "cpu" then ids = ids:to(device) end
    local logits = model:forward(ids)
    local s = logits:shape()
    if #s ~= 3 or s[1] ~= nb or s[2] ~= L then
      bad(fmt("model:forward(ids [%d, %d]) returned logits of shape [%s], expected [%d, %d, V]", nb, L,
        table.concat(s, ", "), nb, L))
    end
    local pred = logits:argmax(-1):to("i64")
    if pred:device() ~= "cpu" then pred = pred:to("cpu") end
    local p = ffi.new("int64_t[?]", nb * L)
    tide.check_status(C.tide_read_bytes(tide.raw(pred), p, nb * L * 8))
    for b = 0, nb - 1 do
      local tg, all = targets[b], true
      -- the last position's label belongs to the packer (data/synthetic.lua); the generators leave it -100
      for t = 0, L - 2 do
        local y = tg[t]
        if y ~= synthetic.IGNORE then
          labelled = labelled + 1
          if p[b * L + t] == y then hits = hits + 1 else all = false end
        end
      end
      if all then exact = exact + 1 end
    end
  end
  return hits, labelled, exact
end

-- run(model, opts) -> rows (see the header). model is any LM with model:forward(ids [B, T] i32) -> logits
-- [B, T, V]. It runs under tide.no_grad with the model in eval mode; each module's training flag is restored
-- afterwards, also when scoring fails.
--
-- For passkey, "all 5 digits right under teacher forcing" is exactly "exact match under greedy decoding after
-- <Q>": if every teacher-forced argmax is right, greedy decoding feeds back the true digits and reproduces them;
-- if one is wrong, greedy decoding has the true prefix up to the first wrong digit and makes the same mistake.
-- (Per-digit accuracy is the teacher-forced one.)
function evals.run(model, opts)
  if type(model) ~= "table" or type(model.forward) ~= "function" then
    bad("model must have a forward(ids) method, got " .. type(model))
  end
  if type(opts) ~= "table" then bad("options must be a table, got " .. type(opts)) end
  local task = opts.task
  if task == nil then bad("task is required (" .. table.concat(synthetic.TASKS, ", ") .. ")") end
  if opts.length ~= nil then bad("use lengths = {L1, L2, ...} (a list), not length") end
  if opts.depth ~= nil then bad("use depths = {δ1, δ2, ...} (a list), not depth") end
  if opts.split ~= nil then bad("split is always \"eval\" here (disjoint from training documents)") end
  local lengths = opts.lengths
  if type(lengths) ~= "table" or #lengths == 0 then
    bad("lengths must be a non-empty list of integers, got " .. tostring(lengths))
  end
  for k, L in ipairs(lengths) do
    if not is_int(L) or L < 2 then bad(fmt("lengths[%d] must be an integer >= 2, got %s", k, tostring(L))) end
  end
  local examples = opts.examples or evals.DEFAULTS.examples
  if not is_int(examples) or examples < 1 then bad("examples must be an integer >= 1, got " .. tostring(examples)) end
  local B = opts.batch or evals.DEFAULTS.batch
  if not is_int(B) or B < 1 then bad("batch must be an integer >= 1, got " .. tostring(B)) end
  local depths = { false }                                   -- one pass without a depth for copy / mqar
  if task == "passkey" then
    depths = opts.depths or evals.DEFAULTS.depths
    if type(depths) ~= "table" or #depths == 0 then bad("depths must be a non-empty list, got " .. tostring(depths)) end
    for k, d in ipairs(depths) do
      if type(d) ~= "number" or d < 0 or d > 1 then
        bad(fmt("depths[%d] must be a number in [0, 1], got %s", k, tostring(d)))
      end
    end
  elseif opts.depths ~= nil then
    bad("depths applies to task passkey only, not " .. tostring(task))
  end
  local src_opts = { task = task, seed = opts.seed or evals.DEFAULTS.seed, length = "stage", split = "eval" }
  for k, v in pairs(opts) do
    if not RUN_KEYS[k] then src_opts[k] = v end              -- task options: synthetic.source checks them
  end
  local sources = {}
  for k, d in ipairs(depths) do
    if d then src_opts.depth = d end
    sources[k] = synthetic.source(src_opts)
  end
  local device = opts.device or model_device(model)

  -- eval mode for the run; every module's own flag comes back afterwards
  local flags = {}
  if type(model.walk) == "function" then
    model:walk(function(m) flags[#flags + 1] = { m, m.training } end)
  end
  if type(model.eval) == "function" then model:eval() end
  local rows = {}
  local ok, err = pcall(tide.no_grad, function()
    for _, L in ipairs(lengths) do
      for k, d in ipairs(depths) do
        local hits, labelled, exact = score(model, sources[k], L, examples, B, device)
        rows[#rows + 1] = { task = task, length = L, depth = d or nil, accuracy = hits / labelled,
          exact = exact / examples, examples = examples, labelled = labelled, seed = src_opts.seed }
      end
    end
  end)
  for _, f in ipairs(flags) do f[1].training = f[2] end
  if not ok then error(err, 0) end
  return rows
end

-- captions(model, src, {examples = 200, batch = 16, device}) -> {source, examples, accuracy, label_accuracy, exact,
-- labelled, labels}: teacher-forced scoring of documents 0 .. examples−1 of an image-text source (a held-out split:
-- data/multimodal.lua), images spliced at their placeholders. accuracy = caption-token accuracy over every labelled
-- position (placeholders and wrappers are not labels, vision.md §8; the document's last position, whose label the
-- packer sets, is skipped); exact = share of documents with every caption token right; label_accuracy (when the
-- source has label_positions(i), the positions whose targets carry the content: the digit of "a handwritten 7",
-- the two words of "red top-left") = accuracy on those alone. A text-only model is scored on the same source with
-- the images left out (the source's text_only option).
-- opts.samples = k adds r.samples: greedy captions of the first k documents, each {expected, generated}: the prompt is
-- the document up to its last <|media_end|> (its images spliced in), the expected text the rest.
local CAPTION_KEYS = { examples = true, batch = true, device = true, samples = true }

-- greedy captions of documents 0 .. k-1 of src (see captions)
local function caption_samples(model, src, k)
  local generate = require "tide.generate"
  local tok = src.tokenizer
  local media_end = tok:id("<|media_end|>")
  local out = {}
  for i = 0, k - 1 do
    local ids, _, n, images = src:doc(i, 1048576)
    local cut = 1                                  -- prompt = ids[0 .. cut-1]
    for t = 0, n - 1 do if ids[t] == media_end then cut = t + 1 end end
    local prompt, rest = {}, {}
    for t = 0, cut - 1 do prompt[#prompt + 1] = ids[t] end
    for t = cut, n - 1 do rest[#rest + 1] = ids[t] end
    local im
    if images and #images > 0 then
      local patches, grids = {}, {}
      for _, x in ipairs(images) do patches[#patches + 1] = x.patches; grids[#grids + 1] = { x.h, x.w } end
      im = { patches = #patches == 1 and patches[1] or tide.F.concat(patches, 1), grids = grids, pad_id = src.media_pad_id }
    end
    -- greedy, up to the caption's length plus its end: the text before <|endoftext|>
    local eot = tok:id("<|endoftext|>")
    local gen = generate.ids(model, prompt, { max_new = #rest + 1, temperature = 0, images = im, stop = eot })
    if gen[#gen] == eot then gen[#gen] = nil end
    out[#out + 1] = { expected = tok:decode(rest), generated = tok:decode(gen) }
  end
  return out
end

function evals.captions(model, src, opts)
  opts = options.check(opts or {}, CAPTION_KEYS, "captions options", "evals")
  if type(src) ~= "table" or type(src.doc) ~= "function" then bad("captions: src must be a document source") end
  local n = opts.examples or 200
  local B = opts.batch or 16
  if not is_int(n) or n < 1 then bad("captions: examples must be an integer >= 1, got " .. tostring(n)) end
  if not is_int(B) or B < 1 then bad("captions: batch must be an integer >= 1, got " .. tostring(B)) end
  local device = opts.device or model_device(model)
  local i32 = C.tide_dtype_from_name("i32")
  local r = { source = src.name, examples = n, hits = 0, labelled = 0, label_hits = 0, labels = 0, exact = 0 }
  -- documents grouped by length (one [b, L] batch per group of up to B)
  local docs, by_len, order = {}, {}, {}
  for i = 0, n - 1 do
    local ids, tg, len, images = src:doc(i, 1048576)
    docs[i] = { ids = ids, tg = tg, n = len, images = images,
      labels = src.label_positions and src:label_positions(i) or nil }
    if not by_len[len] then by_len[len] = {}; order[#order + 1] = len end
    local g = by_len[len]
    g[#g + 1] = i
  end
  local function run(group)
    local nb, L = #group, docs[group[1]].n
    local x = ffi.new("int32_t[?]", nb * L)
    local patches, grids = {}, {}
    for b, i in ipairs(group) do
      local d = docs[i]
      ffi.copy(x + (b - 1) * L, d.ids, L * 4)
      for _, im in ipairs(d.images or {}) do
        patches[#patches + 1] = im.patches
        grids[#grids + 1] = { im.h, im.w }
      end
    end
    local shape = ffi.new("int64_t[2]", nb, L)
    local ids = tide.check(C.tide_from_bytes(i32, 2, shape, 0, x, nb * L * 4))
    if device ~= "cpu" then ids = ids:to(device) end
    local fo
    if #patches > 0 then
      fo = { images = { patches = #patches == 1 and patches[1] or tide.F.concat(patches, 1), grids = grids,
        pad_id = src.media_pad_id } }
    end
    local pred = model:forward(ids, nil, fo):argmax(-1):to("i64")
    if pred:device() ~= "cpu" then pred = pred:to("cpu") end
    local p = ffi.new("int64_t[?]", nb * L)
    tide.check_status(C.tide_read_bytes(tide.raw(pred), p, nb * L * 8))
    for b, i in ipairs(group) do
      local d, all = docs[i], true
      for t = 0, L - 2 do
        local y = d.tg[t]
        if y ~= synthetic.IGNORE then
          r.labelled = r.labelled + 1
          if p[(b - 1) * L + t] == y then r.hits = r.hits + 1 else all = false end
        end
      end
      for _, t in ipairs(d.labels or {}) do
        r.labels = r.labels + 1
        if p[(b - 1) * L + t] == d.tg[t] then r.label_hits = r.label_hits + 1 end
      end
      if all then r.exact = r.exact + 1 end
    end
  end
  local was = model.training
  if type(model.eval) == "function" then model:eval() end
  local ok, err = pcall(tide.no_grad, function()
    for _, len in ipairs(order) do
      local g = by_len[len]
      for first = 1, #g, B do
        local part = {}
        for k = first, math.min(first + B - 1, #g) do part[#part + 1] = g[k] end
        run(part)
      end
    end
  end)
  if ok and (opts.samples or 0) > 0 then
    ok, err = pcall(function() r.samples = caption_samples(model, src, math.min(opts.samples, n)) end)
  end
  if type(model.train) == "function" then model:train(was) end
  if not ok then error(err, 0) end
  r.accuracy = r.labelled > 0 and r.hits / r.labelled or 0
  r.label_accuracy = r.labels > 0 and r.label_hits / r.labels or nil
  r.exact = r.exact / n
  return r
end

-- table(rows) -> markdown: one line per (task, length[, depth])
local function caption_table(rows)
  local out = { "| source | caption-token accuracy | label accuracy | exact caption | examples |", "|---|---:|---:|---:|---:|" }
  for _, r in ipairs(rows) do
    out[#out + 1] = fmt("| %s | %.1f%% | %s | %.1f%% | %d |", r.source, 100 * r.accuracy,
      r.label_accuracy and fmt("%.1f%%", 100 * r.label_accuracy) or "–", 100 * r.exact, r.examples)
  end
  for _, r in ipairs(rows) do
    for k, smp in ipairs(r.samples or {}) do
      if k == 1 then out[#out + 1] = "" ; out[#out + 1] = fmt("greedy captions of held-out %s images:", r.source) end
      out[#out + 1] = fmt("  %-24s expected %q", fmt("%q", smp.generated), smp.expected)
    end
  end
  return table.concat(out, "\n") .. "\n"
end

function evals.table(rows)
  local caps, rest = {}, {}
  for _, r in ipairs(rows) do
    if r.task == "caption" then caps[#caps + 1] = r else rest[#rest + 1] = r end
  end
  if #caps > 0 then
    local t = caption_table(caps)
    if #rest == 0 then return t end
    return t .. "\n" .. evals.table(rest)
  end
  local with_depth = false
  for _, r in ipairs(rows) do if r.depth ~= nil then with_depth = true end end
  local out = {}
  if with_depth then
    out[1] = "| task | length | depth | token accuracy | exact match | examples |"
    out[2] = "|---|---:|---:|---:|---:|---:|"
  else
    out[1] = "| task | length | token accuracy | exact match | examples |"
    out[2] = "|---|---:|---:|---:|---:|"
  end
  for _, r in ipairs(rows) do
    local depth = with_depth and (r.depth and fmt(" %g |", r.depth) or " – |") or ""
    out[#out + 1] = fmt("| %s | %d |%s %.1f%% | %.1f%% | %d |", r.task, r.length, depth, 100 * r.accuracy,
      100 * r.exact, r.examples)
  end
  return table.concat(out, "\n") .. "\n"
end

return evals
