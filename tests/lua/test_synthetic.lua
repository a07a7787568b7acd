-- synthetic: the long-context synthetic documents (data/passkey.lua, data/copy.lua, data/synthetic.lua) and their
-- scorers (evals.lua): spec/evals.md §2 test oracle 2 (passkey layout), §3 oracle 3 (palindrome targets), the MQAR
-- adapter into bytes 128.., the document-source contract of the packer (every document starts with <|endoftext|>,
-- n by length mode, label counts, determinism by (seed, i, T), eval split disjoint from training), oracle 4 for
-- the scorer (an exact solver scores 100%; random digits score 1/10 within 3σ; random MQAR values 2/V), and the
-- errors that name the bad option.
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local nn = tide.nn
local tokenizer = require "tide.data.tokenizer"
local passkey = require "tide.data.passkey"
local copy = require "tide.data.copy"
local mqar = require "tide.data.mqar"
local synthetic = require "tide.data.synthetic"
local evals = require "tide.evals"
local data = require "tide.data"

local C = tide.C
local IGN = -100
local tok = tokenizer.byte_level({ vocab_size = 320 })
local EOT, KEY, Q, SEP = tok:id("<|endoftext|>"), tok:id("<KEY>"), tok:id("<Q>"), tok:id("<|sep|>")
local D0 = string.byte("0")
local fmt = string.format

local in_alphabet = {}
for k = 0, 63 do in_alphabet[passkey.ALPHABET[k]] = true end

local function same(a, b, n)
  for t = 0, n - 1 do if a[t] ~= b[t] then return false end end
  return true
end

T.test("registration: tide.data holds passkey, copy, synthetic", function()
  T.ok(data.passkey == passkey and data.copy == copy and data.synthetic == synthetic)
end)

T.test("filler alphabet: 64 distinct bytes, no digits, no markers; the sentence is 24 of them", function()
  local seen, n = {}, 0
  for k = 0, 63 do
    local b = passkey.ALPHABET[k]
    T.ok(b >= 0 and b < 256 and not seen[b], "distinct byte " .. tostring(b))
    T.ok(b < D0 or b > D0 + 9, "no digit in the alphabet")
    seen[b], n = true, n + 1
  end
  T.eq(n, 64)
  T.eq(#passkey.SENTENCE, 24)
  for k = 1, 24 do T.ok(in_alphabet[passkey.SENTENCE:byte(k)], "sentence byte in the alphabet") end
end)

-- oracle 2, checked from the tokens alone (the needle and query are found by scanning)
local function check_passkey(x, y, Tx, depth, where)
  local keys, qs = {}, {}
  for t = 0, Tx - 1 do
    if x[t] == KEY then keys[#keys + 1] = t elseif x[t] == Q then qs[#qs + 1] = t end
  end
  if #keys ~= 1 or #qs ~= 1 then T.ok(false, fmt("%s: %d <KEY> and %d <Q>", where, #keys, #qs)) end
  local p, q = keys[1], qs[1]
  if q ~= Tx - 6 then T.ok(false, fmt("%s: query at %d, expected T − 6 = %d", where, q, Tx - 6)) end
  if depth and p ~= math.floor(depth * (Tx - 12) + 0.5) then
    T.ok(false, fmt("%s: needle at %d, expected round(%g·(%d − 12))", where, p, depth, Tx))
  end
  local labelled = 0
  for j = 1, 5 do
    local d = x[p + j]
    if not (d >= D0 and d <= D0 + 9) then T.ok(false, fmt("%s: needle token %d is %d, not a digit", where, j, d)) end
    if x[q + j] ~= d then T.ok(false, fmt("%s: answer digit %d is %d, needle has %d", where, j, x[q + j], d)) end
    if y[q + j - 1] ~= d then T.ok(false, fmt("%s: label at %d is %d, expected digit %d", where, q + j - 1, y[q + j - 1], d)) end
  end
  for t = 0, Tx - 1 do
    if y[t] ~= IGN then labelled = labelled + 1 end
    local inside = (t >= p and t <= p + 5) or t >= q
    if not inside and not in_alphabet[x[t]] then T.ok(false, fmt("%s: filler token %d at %d", where, x[t], t)) end
  end
  if labelled ~= 5 then T.ok(false, fmt("%s: %d labels, expected 5", where, labelled)) end
  return p
end

T.test("oracle 2: passkey |x| = T, needle at round(δ(T − 12)), answers = needle digits (2,000 examples)", function()
  local c = passkey.check({ seed = 11, tokenizer = tok })
  local cr = passkey.check({ seed = 11, tokenizer = tok, filler = "random" })
  local counts, depth_sum, N = {}, 0, 2000
  for d = 0, 9 do counts[d] = 0 end
  for i = 0, N - 1 do
    local Tx = 13 + (i * 37) % 300
    local x, y = ffi.new("int32_t[?]", Tx + 2), ffi.new("int32_t[?]", Tx + 2)
    x[Tx], x[Tx + 1] = 999, 999                                  -- guards: nothing is written past T
    local info = passkey.fill(i % 2 == 0 and c or cr, i, Tx, x, y, 0)
    T.eq(x[Tx] == 999 and x[Tx + 1] == 999, true, "guard after the example")
    check_passkey(x, y, Tx, info.depth, "example " .. i)
    T.eq(info.p, math.floor(info.depth * (Tx - 12) + 0.5))
    for j = 0, 4 do counts[info.digits[j]] = counts[info.digits[j]] + 1 end
    depth_sum = depth_sum + info.depth
    if i % 2 == 0 then                                            -- the default filler is the sentence, resumed after the needle
      local k = 0
      for t = 0, Tx - 7 do
        if t < info.p or t > info.p + 5 then
          if x[t] ~= passkey.SENTENCE:byte(k % 24 + 1) then T.ok(false, fmt("example %d: filler %d off the sentence", i, k)) end
          k = k + 1
        end
      end
      T.eq(k, Tx - 12, "filler length")
    end
  end
  -- digits uniform on 0..9 and δ uniform on [0, 1): within 3σ
  for d = 0, 9 do
    local p, n = 0.1, 5 * N
    T.ok(math.abs(counts[d] / n - p) <= 3 * math.sqrt(p * (1 - p) / n), fmt("digit %d frequency %.4f", d, counts[d] / n))
  end
  T.ok(math.abs(depth_sum / N - 0.5) <= 3 * math.sqrt(1 / 12 / N), fmt("mean depth %.4f", depth_sum / N))
end)

T.test("oracle 2 on the eval grid: documents of n = T, needle at round(δ(T − 13)) of the example", function()
  -- the example after <|endoftext|> has T − 1 tokens: T = 257 → 244·δ = 0, 61, 122, 183, 244; T = 256 → 243·δ
  -- rounds half up: 60.75 → 61, 121.5 → 122, 182.25 → 182
  local expect = { [257] = { 0, 61, 122, 183, 244 }, [256] = { 0, 61, 122, 182, 243 } }
  for L, ps in pairs(expect) do
    for k, depth in ipairs({ 0, 0.25, 0.5, 0.75, 1 }) do
      local src = synthetic.source({ task = "passkey", seed = 5, depth = depth, tokenizer = tok })
      for i = 0, 19 do
        local ids, tg, n = src:doc(i, L)
        T.eq(n, L)
        T.eq(ids[0], EOT)
        local p = check_passkey(ids + 1, tg + 1, L - 1, depth, fmt("T %d δ %g doc %d", L, depth, i))
        T.eq(p, ps[k], fmt("needle position at T %d, δ %g", L, depth))
        T.eq(tg[0], IGN)
        T.eq(tg[n - 1], IGN)
      end
    end
  end
end)

T.test("oracle 3: copy targets are the reversed input; N labels; symbols uniform on the alphabet", function()
  local src = synthetic.source({ task = "copy", seed = 3, tokenizer = tok })
  local hist, total = {}, 0
  for i = 0, 199 do
    local L = 4 + 2 * (i % 70)
    local ids, tg, n = src:doc(i, L)
    T.eq(n, L)
    T.eq(ids[0], EOT)
    local N = (n - 2) / 2
    T.eq(ids[N + 1], SEP, "separator after the N inputs")
    local labelled = 0
    for t = 0, n - 1 do if tg[t] ~= IGN then labelled = labelled + 1 end end
    T.eq(labelled, N, "copy labels")
    for k = 1, N do
      local xk = ids[k]
      T.ok(in_alphabet[xk], "input in the alphabet")
      hist[xk] = (hist[xk] or 0) + 1
      total = total + 1
      -- output token j (1-based) is x_{N−j+1}, at position N + 1 + j, predicted from position N + j
      T.eq(ids[N + 1 + k], ids[N + 1 - k], "output half reverses the input")
      T.eq(tg[N + k], ids[N + 1 - k], "label = reversed input")
    end
    T.eq(tg[n - 1], IGN)
  end
  local p = 1 / 64
  for k = 0, 63 do
    local f = (hist[passkey.ALPHABET[k]] or 0) / total
    T.ok(math.abs(f - p) <= 3 * math.sqrt(p * (1 - p) / total), fmt("symbol %d frequency %.4f", k, f))
  end
end)

T.test("MQAR adapter: the mqar generator's example + 128, ids in [128, 128 + V_task), D labels", function()
  for _, filler in ipairs({ "zero", "random" }) do
    local V, D = 64, 8
    local src = synthetic.source({ task = "mqar", seed = 9, vocab_size = V, num_pairs = D, filler = filler, tokenizer = tok })
    for i = 0, 49 do
      local L = 64 + (i % 2)                               -- n − 1 = 63 (odd: one pad slot) or 64
      local ids, tg, n = src:doc(i, L)
      T.eq(n, L)
      T.eq(ids[0], EOT)
      local S = (n - 1) - (n - 1) % 2
      local ref_ids, ref_lab, info = mqar.example({ vocab_size = V, seq_len = S, num_pairs = D, filler = filler, seed = 9 }, i)
      local labelled = 0
      for t = 1, n - 1 do
        T.ok(ids[t] >= 128 and ids[t] < 128 + V, "id in [128, 128 + V_task)")
        if t <= S then
          T.eq(ids[t], ref_ids[t] + 128, "adapter id = mqar id + 128")
          T.eq(tg[t], ref_lab[t] == IGN and IGN or ref_lab[t] + 128, "adapter label = mqar label + 128")
        else
          T.eq(tg[t], IGN, "the pad slot is unlabelled")
          if filler == "zero" then T.eq(ids[t], 128, "zero filler pads with 128 + 0") end
        end
        if tg[t] ~= IGN then
          labelled = labelled + 1
          T.ok(tg[t] >= 128 + V / 2 and tg[t] < 128 + V, "label is a value")
        end
      end
      T.eq(labelled, D, "mqar labels")
      T.eq(info.keys[0] + 128, ids[1], "first context key")
    end
  end
end)

-- text filler (filler = "text"): the test corpus with digits and bytes 128-199 sprinkled after its letters (so the
-- generators have ids to leave out) as the text source, and the bytes it holds once the documents are read in
-- stored order without <|endoftext|>, for checking that a filler is one contiguous span of it
local pack = require "tide.data.pack"
local text_src
do
  local f = assert(io.open("tests/fixtures/tiny_corpus.txt", "rb"))
  local raw = f:read("*a")
  f:close()
  local extra, k = {}, 0
  for b = 48, 57 do extra[#extra + 1] = string.char(b) end
  for b = 128, 199 do extra[#extra + 1] = string.char(b) end
  local mixed = raw:gsub("%l", function(c)
    k = k + 1
    return k % 3 == 0 and c .. extra[k / 3 % #extra + 1] or c
  end)
  local path = T.tmpdir("synthetic-text", { create = true }) .. "/corpus.txt"
  f = assert(io.open(path, "wb"))
  f:write(mixed)
  f:close()
  text_src = pack.text_source({ path = path, doc_separator = "%", val_fraction = 0.1, tokenizer = tok })
end
local function corpus_without(drop)
  local parts = {}
  for j = 1, text_src.n_docs do
    local buf = text_src.pieces[text_src.doc_piece[j]].buf + text_src.doc_start[j]
    for t = 0, text_src.doc_len[j] - 1 do
      local id = buf[t]
      if id ~= EOT and not drop(id) then parts[#parts + 1] = string.char(id) end
    end
  end
  local s = table.concat(parts)
  return s .. s                                            -- a span may wrap around the end
end

T.test("MQAR text filler: a span of the text around the queries, no task id in it; all else as zero filler", function()
  local V, D = 32, 4
  local in_task = function(id) return id >= 128 and id < 128 + V end
  local corpus = corpus_without(in_task)
  local o = { task = "mqar", seed = 9, vocab_size = V, num_pairs = D, tokenizer = tok }
  local zero = synthetic.source(o)
  o.filler, o.filler_text = "text", text_src
  local a, b = synthetic.source(o), synthetic.source(o)
  T.ok(a:describe():find("filler text (text:train)", 1, true), a:describe())
  local distinct, starts = {}, {}
  for i = 0, 39 do
    local L = 256 + (i % 2)                                -- n − 1 odd: one pad slot from the text as well
    local ids, tg, n = a:doc(i, L)
    local zids, ztg = zero:doc(i, L)
    local ids2, tg2 = b:doc(i, L)
    T.ok(same(ids, ids2, n) and same(tg, tg2, n), "same (seed, i, T) → identical arrays")
    T.ok(same(tg, ztg, n), "labels are those of the zero filler")
    local filler = {}
    for t = 1, n - 1 do
      if zids[t] == 128 and tg[t] == IGN then              -- a zero-filler slot: text here
        T.ok(not in_task(ids[t]) and ids[t] ~= EOT and ids[t] < 256, fmt("filler id %d at %d is a text byte", ids[t], t))
        filler[#filler + 1] = string.char(ids[t])
        distinct[ids[t]] = true
      elseif ids[t] ~= zids[t] then
        T.ok(false, fmt("doc %d position %d: %d, the zero-filler document has %d", i, t, ids[t], zids[t]))
      end
    end
    T.eq(#filler, n - 1 - 3 * D, "the query region less its D queries (and the pad slot)")
    local f = table.concat(filler)
    if (n - 1) % 2 == 0 then T.ok(corpus:find(f, 1, true), "doc " .. i .. ": the filler is one span of the text") end
    starts[f:sub(1, 16)] = true
  end
  local nd, ns = 0, 0
  for _ in pairs(distinct) do nd = nd + 1 end
  for _ in pairs(starts) do ns = ns + 1 end
  T.ok(nd >= 40, "the filler is text, not one repeated token: " .. nd .. " distinct ids")
  T.ok(ns >= 38, "documents start their spans at different places: " .. ns .. " of 40")
  -- the eval split and another seed draw other spans
  o.split = "eval"
  local ev = synthetic.source(o)
  T.ok(not same(ev:doc(0, 256), a:doc(0, 256), 256), "eval document 0 differs from training document 0")
end)

T.test("MQAR random filler over a filler_range: ids from it only, never a key, value or 0; all else as zero", function()
  local V, D = 32, 4
  local o = { task = "mqar", seed = 9, vocab_size = V, num_pairs = D, tokenizer = tok }
  local zero = synthetic.source(o)
  o.filler, o.filler_range = "random", { 160, 256 }
  local a, b = synthetic.source(o), synthetic.source(o)
  T.ok(a:describe():find("filler random in [160, 256)", 1, true), a:describe())
  local count, slots = {}, 0
  for i = 0, 39 do
    local L = 512 + (i % 2)
    local ids, tg, n = a:doc(i, L)
    local zids, ztg = zero:doc(i, L)
    T.ok(same(ids, b:doc(i, L), n), "same (seed, i, T) → identical arrays")
    T.ok(same(tg, ztg, n), "labels are those of the zero filler")
    for t = 1, n - 1 do
      if zids[t] == 128 and tg[t] == IGN then
        T.ok(ids[t] >= 160 and ids[t] < 256, fmt("filler id %d at %d in [160, 256)", ids[t], t))
        count[ids[t]] = (count[ids[t]] or 0) + 1
        slots = slots + 1
      elseif ids[t] ~= zids[t] then
        T.ok(false, fmt("doc %d position %d: %d, the zero-filler document has %d", i, t, ids[t], zids[t]))
      end
    end
  end
  -- uniform over 96 ids: every id drawn, none more than 3σ above its share
  local nd, top = 0, 0
  for _, c in pairs(count) do nd = nd + 1; top = math.max(top, c) end
  local p = 1 / 96
  T.eq(nd, 96, "every id of the range is drawn")
  T.ok(top <= slots * p + 4 * math.sqrt(slots * p * (1 - p)), fmt("no id dominates: %d of %d slots", top, slots))
end)

T.test("passkey text filler: text bytes without digits or specials; needle, query and labels as the sentence's", function()
  local drop = function(id) return id >= 48 and id <= 57 end
  local corpus = corpus_without(drop)
  local ref = synthetic.source({ task = "passkey", seed = 5, tokenizer = tok })
  local a = synthetic.source({ task = "passkey", seed = 5, tokenizer = tok, filler = "text", filler_text = text_src })
  local b = synthetic.source({ task = "passkey", seed = 5, tokenizer = tok, filler = "text", filler_text = text_src })
  local distinct = {}
  for i = 0, 39 do
    local ids, tg, n = a:doc(i, 300)
    local rids, rtg = ref:doc(i, 300)
    T.ok(same(ids, b:doc(i, 300), n), "same (seed, i, T) → identical arrays")
    T.ok(same(tg, rtg, n), "labels are the sentence filler's")
    local filler = {}
    for t = 1, n - 1 do
      if in_alphabet[rids[t]] then                         -- a sentence-filler slot: text here
        T.ok(ids[t] < 256 and not drop(ids[t]) and ids[t] ~= EOT, fmt("filler id %d at %d", ids[t], t))
        filler[#filler + 1] = string.char(ids[t])
        distinct[ids[t]] = true
      elseif ids[t] ~= rids[t] then
        T.ok(false, fmt("doc %d position %d: %d, the sentence document has %d", i, t, ids[t], rids[t]))
      end
    end
    T.eq(#filler, 299 - 12, "filler length")
    T.ok(corpus:find(table.concat(filler), 1, true), "doc " .. i .. ": the filler is one span of the text")
  end
  local nd = 0
  for _ in pairs(distinct) do nd = nd + 1 end
  T.ok(nd >= 40, "the filler is text, not one repeated token: " .. nd .. " distinct ids")
end)

T.test("document sources: <|endoftext|> first, n by length mode, label counts, determinism by (seed, i, T)", function()
  local cases = {
    { task = "passkey", labels = function(n) return 5 end },
    { task = "passkey", filler = "random", labels = function(n) return 5 end },
    { task = "copy", labels = function(n) return (n - 2) / 2 end },
    { task = "mqar", num_pairs = 16, labels = function(n) return 16 end },
  }
  for _, cs in ipairs(cases) do
    local labels = cs.labels
    cs.labels = nil
    for _, length in ipairs({ "stage", 200, { 100, 160, 256 } }) do
      local o = { seed = 21, length = length, tokenizer = tok }
      for k, v in pairs(cs) do o[k] = v end
      local a, b = synthetic.source(o), synthetic.source(o)
      o.seed = 22
      local other_seed = synthetic.source(o)
      o.seed, o.split = 21, "eval"
      local eval = synthetic.source(o)
      T.ok(a.name == cs.task and type(a:describe()) == "string" and a:describe():find(cs.task, 1, true), "name, describe")
      local seen_len = {}
      for i = 0, 29 do
        local ids, tg, n = a:doc(i, 256)
        if length == "stage" then T.eq(n, 256)
        elseif type(length) == "number" then T.eq(n, length)
        else
          T.ok(n == 100 or n == 160 or n == 256, "length from the list")
          seen_len[n] = true
        end
        T.eq(ids[0], EOT, "document starts with <|endoftext|>")
        T.eq(tg[0], IGN)
        local labelled = 0
        for t = 0, n - 1 do
          if tg[t] ~= IGN then labelled = labelled + 1 end
          if t > 0 and (ids[t] == EOT or ids[t] < 0 or ids[t] >= 320) then T.ok(false, "id " .. ids[t] .. " inside a document") end
        end
        T.eq(labelled, labels(n), cs.task .. " label count")
        T.eq(labelled, a:labels(n), "src:labels(n)")
        local ids2, tg2, n2 = b:doc(i, 256)
        T.ok(n2 == n and same(ids, ids2, n) and same(tg, tg2, n), "same (seed, i, T) → identical arrays")
        local ids3, _, n3 = a:doc(i + 1, 256)
        T.ok(n3 ~= n or not same(ids, ids3, n), "documents i and i + 1 differ")
        local ids4, _, n4 = other_seed:doc(i, 256)
        T.ok(n4 ~= n or not same(ids, ids4, n), "seeds 21 and 22 differ")
        local ids5, _, n5 = eval:doc(i, 256)
        T.ok(n5 ~= n or not same(ids, ids5, n), "eval document differs from the training one")
      end
      if type(length) == "table" then
        T.ok(seen_len[100] and seen_len[160] and seen_len[256], "every listed length is drawn")
      end
    end
  end
end)

T.test("eval split: document i is generator example 2^31 + i", function()
  local src = synthetic.source({ task = "passkey", seed = 4, split = "eval", tokenizer = tok })
  local ids, tg, n = src:doc(7, 100)
  local ref, lab = passkey.example({ seed = 4, tokenizer = tok }, 2 ^ 31 + 7, 99)
  for t = 1, 99 do
    T.eq(ids[t], ref[t])
    T.eq(tg[t], lab[t])
  end
  local cs = synthetic.source({ task = "copy", seed = 4, split = "eval", tokenizer = tok })
  local cids = cs:doc(3, 20)
  local cref = copy.example({ seed = 4, tokenizer = tok }, 2 ^ 31 + 3, 9)
  for t = 1, 19 do T.eq(cids[t], cref[t]) end
end)

T.test("errors name the option and the value", function()
  local function src(o) o.tokenizer = tok; return synthetic.source(o) end
  T.raises(function() src({ task = "passkey", length = 13 }) end, "passkey: length 13 is too short")
  T.raises(function() src({ task = "passkey" }):doc(0, 10) end, "passkey: stage length T = 10")
  T.raises(function() src({ task = "passkey", length = { 64, 8 } }) end, "length[2] = 8 is too short")
  T.raises(function() src({ task = "passkey", depth = 1.5 }) end, "passkey: depth must be a number in [0, 1]")
  T.raises(function() src({ task = "passkey", filler = "zero" }) end, "passkey: filler must be")
  T.raises(function() src({ task = "passkey", num_pairs = 4 }) end, "passkey: unknown key 'num_pairs'")
  T.raises(function() src({ task = "copy", length = 255 }) end, "copy: length 255 must be even")
  T.raises(function() src({ task = "copy" }):doc(0, 255) end, "copy: stage length T = 255")
  T.raises(function() src({ task = "copy", depth = 0.5 }) end, "copy: unknown key 'depth'")
  T.raises(function() src({ task = "mqar", length = 64, num_pairs = 16 }) end, "mqar: length 64 is too short for num_pairs = 16")
  T.raises(function() src({ task = "mqar", vocab_size = 200 }) end, "mqar: vocab_size (V_task) must be an even integer in [4, 128]")
  T.raises(function() src({ task = "mqar", num_pairs = 70 }) end, "num_pairs D = 70 exceeds")
  T.raises(function() src({ task = "mqar", filler = "sentence" }) end,
    'mqar: filler must be one of "random", "text", "zero", got "sentence"')
  T.raises(function() src({ task = "passkey", filler = "noise" }) end,
    'passkey: filler must be one of "random", "sentence", "text", got "noise"')
  T.raises(function() src({ task = "mqar", filler = "text" }) end, 'mqar: filler = "text" needs filler_text')
  T.raises(function() src({ task = "passkey", filler = "text" }) end, 'passkey: filler = "text" needs filler_text')
  T.raises(function() src({ task = "mqar", filler_text = text_src }) end, 'filler_text is used only with filler = "text"')
  T.raises(function() src({ task = "mqar", vocab_size = 32, num_pairs = 4, filler = "random", filler_range = { 150, 200 } }) end,
    "mqar: filler_range [150, 200) overlaps the task's ids [128, 160) (keys, values and 0)")
  T.raises(function() src({ task = "mqar", vocab_size = 32, num_pairs = 4, filler_range = { 160, 256 } }) end,
    'mqar: filler_range is used only with filler = "random", got filler = "zero"')
  T.raises(function() src({ task = "mqar", vocab_size = 32, num_pairs = 4, filler = "random", filler_range = { 200 } }) end,
    "mqar: filler_range must be {lo, hi}, integers with 0 <= lo < hi, got {200, nil}")
  T.raises(function() src({ task = "mqar", vocab_size = 32, num_pairs = 4, filler = "random", filler_range = { 200, 300 } }) end,
    "mqar: filler_range must lie in the bytes [0, 256)")
  local sources = require "tide.data.sources"
  local spec = { text = { kind = "text", path = "tests/fixtures/tiny_corpus.txt", doc_separator = "%" },
    copy = { kind = "copy" }, recall = { kind = "mqar", vocab_size = 16, num_pairs = 4, filler = "text" } }
  T.raises(function() sources.build(spec, tok, 0, "curriculum") end,
    'curriculum: sources.recall: filler = "text" needs filler_source = the name of a text source (text sources: text), got nil')
  spec.recall.filler_source = "copy"
  T.raises(function() sources.build(spec, tok, 0, "curriculum") end, "(text sources: text), got copy")
  spec.recall.filler = "zero"
  T.raises(function() sources.build(spec, tok, 0, "curriculum") end,
    'sources.recall: filler_source is used only with filler = "text", got filler = zero')
  spec.recall.filler, spec.recall.filler_source = "text", "text"
  T.ok(sources.build(spec, tok, 0, "curriculum").recall.cfg.filler_text.name == "text:train", "filler_source resolved")
  T.raises(function() src({ task = "stack" }) end, "synthetic.source: task must be one of passkey, copy, mqar, got stack")
  T.raises(function() src({ task = "copy", length = "long" }) end, "copy: length must be \"stage\"")
  T.raises(function() src({ task = "copy", split = "test" }) end, "copy: split must be")
  T.raises(function() src({ task = "copy" }):doc(-1, 64) end, "copy: document index must be an integer in [0, 2^31)")
  T.raises(function() src({ task = "copy" }):doc(0) end, "needs the stage length T")
  T.raises(function() synthetic.source({ task = "copy", tokenizer = { kind = "bpe" } }) end, "tokenizer must be a byte-level")
  local model = { forward = function() error("not reached") end }
  T.raises(function() evals.run(model, { lengths = { 64 } }) end, "evals: task is required")
  T.raises(function() evals.run(model, { task = "copy", lengths = {} }) end, "evals: lengths must be")
  T.raises(function() evals.run(model, { task = "copy", lengths = { 64 }, depths = { 0 } }) end, "depths applies to task passkey only")
  T.raises(function() evals.run(model, { task = "passkey", lengths = { 64 }, depths = { 2 } }) end, "depths[1] must be")
  T.raises(function() evals.run(model, { task = "passkey", lengths = { 64 }, depth = 0.5 }) end, "use depths")
  T.raises(function() evals.run(model, { task = "passkey", lengths = { 64 }, examples = 0 }) end, "examples must be")
end)

-- ---- scorer (oracle 4) ------------------------------------------------------------------------------------

-- a fake LM: forward(ids [B, L]) -> one-hot logits [B, L, 320] of predict(row, L, out) (0-based arrays)
local Fake = nn.Module:extend("FakeLM")
function Fake:init(predict) self.predict, self.calls = predict, 0 end
function Fake:forward(ids)
  T.ok(not self.training, "scored in eval mode")
  T.ok(not tide.grad_enabled(), "scored under no_grad")
  local s = ids:shape()
  local B, L, V = s[1], s[2], 320
  local x = ffi.new("int32_t[?]", B * L)
  tide.check_status(C.tide_read_bytes(tide.raw(ids), x, B * L * 4))
  local logits = ffi.new("float[?]", B * L * V)
  local out = ffi.new("int32_t[?]", L)
  for b = 0, B - 1 do
    ffi.fill(out, L * 4)
    self.calls = self.calls + 1
    self.predict(x + b * L, L, out, self.calls)
    for t = 0, L - 1 do logits[(b * L + t) * V + out[t]] = 1 end
  end
  local shape = ffi.new("int64_t[3]", B, L, V)
  return tide.check(C.tide_from_bytes(C.tide_dtype_from_name("f32"), 3, shape, 0, logits, B * L * V * 4))
end

-- exact solvers, reading the tokens only
local function solve_passkey(x, L, out)
  local p, q
  for t = 0, L - 1 do if x[t] == KEY then p = t elseif x[t] == Q then q = t end end
  for j = 0, 4 do out[q + j] = x[p + 1 + j] end
end
local function solve_copy(x, L, out)
  local s
  for t = 0, L - 1 do if x[t] == SEP then s = t end end
  local N = s - 1
  for k = 0, N - 1 do out[s + k] = x[N - k] end
end
local function mqar_solver(D)
  return function(x, L, out)
    local value = {}
    for j = 0, D - 1 do value[x[1 + 2 * j]] = x[2 + 2 * j] end
    for t = 1 + 2 * D, L - 1 do if value[x[t]] then out[t] = value[x[t]] end end
  end
end

T.test("oracle 4: exact solvers score 100% exact on passkey, copy and mqar; flags restored", function()
  local m = Fake(solve_passkey)
  T.ok(m.training)
  local rows = evals.run(m, { task = "passkey", lengths = { 64, 100 }, examples = 6, batch = 4, tokenizer = tok })
  T.ok(m.training, "training flag restored")
  T.ok(tide.grad_enabled(), "grad recording restored")
  T.eq(#rows, 10, "2 lengths × 5 depths")
  local k = 0
  for _, L in ipairs({ 64, 100 }) do
    for _, d in ipairs({ 0, 0.25, 0.5, 0.75, 1 }) do
      k = k + 1
      local r = rows[k]
      T.eq({ r.task, r.length, r.depth, r.accuracy, r.exact, r.examples, r.labelled }, { "passkey", L, d, 1, 1, 6, 30 })
    end
  end
  m:eval()
  m.predict = solve_copy
  local r = evals.run(m, { task = "copy", lengths = { 64 }, examples = 5, batch = 2 })
  T.ok(not m.training, "eval flag kept")
  T.eq({ r[1].accuracy, r[1].exact, r[1].labelled, r[1].depth }, { 1, 1, 5 * 31 })
  m.predict = mqar_solver(8)
  r = evals.run(m, { task = "mqar", lengths = { 64, 65 }, num_pairs = 8, vocab_size = 64, examples = 5 })
  T.eq({ r[1].accuracy, r[1].exact, r[2].accuracy, r[2].exact, r[2].labelled }, { 1, 1, 1, 1, 40 })
  local md = evals.table(rows)
  T.ok(md:find("| task | length | depth | token accuracy | exact match | examples |", 1, true), md)
  T.ok(md:find("| passkey | 100 | 0.75 | 100.0% | 100.0% | 6 |", 1, true), md)
  T.ok(evals.table(r):find("| mqar | 65 | 100.0% | 100.0% | 5 |", 1, true), evals.table(r))
end)

T.test("oracle 4: uniformly random digits score 1/10 per digit within 3σ; random MQAR values 2/V", function()
  local u = ffi.new("double[?]", 4096)
  local function random_digits(x, L, out, call)
    C.tide_philox_uniform(777, call * 4096, u, L)
    for t = 0, L - 1 do out[t] = D0 + math.floor(u[t] * 10) end
  end
  local rows = evals.run(Fake(random_digits), { task = "passkey", lengths = { 48, 64 }, examples = 40, batch = 8 })
  local hits, n, exact = 0, 0, 0
  for _, r in ipairs(rows) do
    hits, n, exact = hits + r.accuracy * r.labelled, n + r.labelled, exact + r.exact * r.examples
  end
  T.eq(n, 2 * 5 * 40 * 5)
  local p = 0.1
  T.ok(math.abs(hits / n - p) <= 3 * math.sqrt(p * (1 - p) / n), fmt("random digit accuracy %.4f", hits / n))
  T.ok(exact <= 2, "exact matches by chance: " .. exact)        -- expected 400·1e-5
  -- MQAR: V_task 64, a random value token (bytes 128 + [32, 64)) is right with probability 1/32 = 2/V
  local function random_values(x, L, out, call)
    C.tide_philox_uniform(778, call * 4096, u, L)
    for t = 0, L - 1 do out[t] = 128 + 32 + math.floor(u[t] * 32) end
  end
  local r = evals.run(Fake(random_values), { task = "mqar", lengths = { 128 }, num_pairs = 16, vocab_size = 64,
    examples = 200, batch = 8 })[1]
  T.eq(r.labelled, 3200)
  p = 2 / 64
  T.ok(math.abs(r.accuracy - p) <= 3 * math.sqrt(p * (1 - p) / r.labelled), fmt("random value accuracy %.4f", r.accuracy))
end)

T.test("evals.run on a tiny nn.HybridLM: scores in [0, 1], training flag and grad mode restored", function()
  local m = nn.HybridLM({
    vocab_size = 320, dim = 16, n_layers = 2, ffn_dim = 32, mixers = "KM",
    kda = { heads = 2, head_dim = 8 }, mla = { heads = 2, q_rank = 16, kv_rank = 8, nope_dim = 8, rope_dim = 4, v_dim = 8 },
  })
  local rows = evals.run(m, { task = "passkey", lengths = { 32 }, depths = { 0, 1 }, examples = 3, batch = 2, tokenizer = tok })
  T.eq(#rows, 2)
  for _, r in ipairs(rows) do T.ok(r.accuracy >= 0 and r.accuracy <= 1 and r.exact >= 0 and r.exact <= 1) end
  T.ok(m.training and m.lm_head.training, "every module back in training mode")
  T.ok(tide.grad_enabled())
end)

T.run()
