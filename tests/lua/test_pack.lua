-- data/pack.lua: packing with document boundaries (spec/long_context.md §3), stage switches (§6) and exact
-- resume (§7); the text document source over the fortune files.
--
-- The fake sources below write their identity into every document (ids[1] = tag·10^6 + i), so the tests
-- rebuild the expected document stream from the packed tokens alone and compare every token and label.
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local pack = require "tide.data.pack"
local data = require "tide.data"
local text = require "tide.data.text"
local tokenizer = require "tide.data.tokenizer"
local json = require "tide.json"

local EOT = 256
local IGNORE = -100
local POISON = 77777       -- a fake document's targets[n-1]: the packer must never let it through
local FORTUNES = { path = "/usr/share/games/fortunes", exclude = { "%.dat$", "%.u8$" }, doc_separator = "%", val_fraction = 0.02 }

-- a fake source: document i has length lo + h(i) mod span (+ T/4 when t_dep, so it depends on the stage),
-- ids[0] = EOT, ids[1] = its identity, ids[t >= 2] = content in [0, 250); targets are not a shift of ids
-- (some are -100) so the test sees that the packer copies the document's own labels
local function fake_source(name, tag, lo, span, t_dep)
  local src = { name = name, tag = tag }
  function src:len(i, T_)
    return lo + ((i * 2654435761 + tag * 97) % 1048576) % span + (t_dep and math.floor(T_ / 4) or 0)
  end
  function src:doc(i, T_)
    local n = self:len(i, T_)
    local ids, targets = ffi.new("int32_t[?]", n), ffi.new("int32_t[?]", n)
    ids[0] = EOT
    if n > 1 then ids[1] = tag * 1000000 + i end
    for t = 2, n - 1 do ids[t] = (i * 31 + t * 7 + (t_dep and T_ or 0)) % 250 end
    for t = 0, n - 2 do targets[t] = (t % 5 == 3) and IGNORE or 1000 + (ids[t] * 3 + t) % 500 end
    targets[n - 1] = POISON
    return ids, targets, n
  end
  return src
end

-- runs `plan` = {{R, T}, ...} through packer p (set_seq_len before each) -> the batches and the flattened ids,
-- targets and row length of every position (1-based Lua lists)
local function run(p, plan)
  local out = { batches = {}, ids = {}, targets = {}, rowlen = {} }
  for _, step in ipairs(plan) do
    p:set_seq_len(step[2])
    local b = p:next_rows(step[1])
    b.ids_list, b.targets_list = b.ids:tolist(), b.targets:tolist()
    out.batches[#out.batches + 1] = b
    for k = 1, #b.ids_list do
      out.ids[#out.ids + 1] = b.ids_list[k]
      out.targets[#out.targets + 1] = b.targets_list[k]
      out.rowlen[#out.rowlen + 1] = step[2]
    end
  end
  return out
end

-- rebuilds the document stream from the identities in the packed ids: every position gets {src, i, t, n,
-- targets}; every document's tokens must match the source's document drawn at the row length where it began
local function rebuild(stream, by_tag)
  local info, order = {}, {}
  local pos, N = 1, #stream.ids
  while pos <= N do
    T.eq(stream.ids[pos], EOT, "a document starts at flattened position " .. pos)
    local id = stream.ids[pos + 1]
    if not id then   -- the stream ends right after a separator: its document is not identifiable yet
      info[pos] = { last_open = true }
      break
    end
    local tag, i = math.floor(id / 1000000), id % 1000000
    local src = T.ok(by_tag[tag], "unknown source tag " .. tag .. " at " .. pos)
    local ids, targets, n = src:doc(i, stream.rowlen[pos])
    for t = 0, n - 1 do
      local q = pos + t
      if q > N then break end
      if stream.ids[q] ~= ids[t] then T.eq(stream.ids[q], ids[t], string.format("token %d of %s doc %d", t, src.name, i)) end
      info[q] = { src = src, i = i, t = t, n = n, targets = targets }
    end
    order[#order + 1] = { src = src, i = i, n = n, T = stream.rowlen[pos] }
    pos = pos + n
  end
  return info, order
end

-- checks (b) and (c) on every batch: cu_seqlens = row starts ∪ document starts ∪ {R·T}; labels by the rule
local function check_batches(stream, info)
  local base = 0
  for bi, b in ipairs(stream.batches) do
    local R, Tb = b.ids:shape()[1], b.ids:shape()[2]
    local N = R * Tb
    local want, set = {}, {}
    for k = 0, N - 1 do
      if k % Tb == 0 or stream.ids[base + k + 1] == EOT then want[#want + 1] = k end
    end
    want[#want + 1] = N
    T.eq(b.cu_seqlens, want, "cu_seqlens of batch " .. bi)
    T.eq(b.segments, #want - 1)
    for _, k in ipairs(want) do set[k] = true end
    local labelled, maxlen = 0, 0
    for j = 1, #want - 1 do maxlen = math.max(maxlen, want[j + 1] - want[j]) end
    T.eq(b.max_seqlen, maxlen)
    for k = 0, N - 1 do
      local q = base + k + 1
      local got, d = stream.targets[q], info[q]
      local expect
      if set[k + 1] then                       -- the last position of a segment
        if d.last_open then   -- a document begun at the stream's last position: complete (n = 1) or cut
          expect = (got == EOT) and EOT or IGNORE
        else
          expect = (d.t == d.n - 1) and EOT or IGNORE
        end
      else
        T.ok(d.t < d.n - 1, "only a segment's last position may hold a document's last token")
        expect = d.targets[d.t]
      end
      if got ~= expect then T.eq(got, expect, string.format("label at batch %d position %d", bi, k)) end
      if got ~= IGNORE then labelled = labelled + 1 end
    end
    T.eq(b.n_targets, labelled, "n_targets of batch " .. bi)
    base = base + N
  end
end

local function tag_map(...)
  local m = {}
  for _, s in ipairs({ ... }) do m[s.tag] = s end
  return m
end

T.test("(a)(b)(c) the packed rows are the document stream; cu_seqlens and labels follow §3", function()
  local a = fake_source("a", 1, 2, 40)          -- short documents: several per row
  local b = fake_source("b", 2, 30, 200)        -- long ones: cut row after row (T = 64)
  local p = pack.Packer { sources = { { source = a, weight = 3 }, { source = b, weight = 1 } }, seq_len = 64, seed = 11, eot = EOT }
  local stream = run(p, { { 4, 64 }, { 3, 64 }, { 5, 64 }, { 1, 64 } })
  local info, order = rebuild(stream, tag_map(a, b))
  check_batches(stream, info)
  -- each source's documents arrive in cursor order 0, 1, 2, ... and both sources appear
  local next_i, seen = { a = 0, b = 0 }, { a = 0, b = 0 }
  for _, d in ipairs(order) do
    T.eq(d.i, next_i[d.src.name], "cursor order of " .. d.src.name)
    next_i[d.src.name] = d.i + 1
    seen[d.src.name] = seen[d.src.name] + 1
  end
  T.ok(seen.a > 10 and seen.b > 2, string.format("both sources drawn (a %d, b %d)", seen.a, seen.b))
  -- a document longer than a whole row (n > 64) was cut at least twice: some row has a single segment
  local single = false
  for _, bt in ipairs(stream.batches) do
    local cu, Tb = bt.cu_seqlens, 64
    for j = 1, #cu - 1 do if cu[j] % Tb == 0 and cu[j + 1] - cu[j] == Tb then single = true end end
  end
  T.ok(single, "a row filled by one segment of a long document")
  -- per-source token counts of the batches and the running totals
  local totals = { a = 0, b = 0 }
  for bi, bt in ipairs(stream.batches) do
    local cnt = { a = 0, b = 0 }
    local off = 0
    for k = 1, bi - 1 do off = off + #stream.batches[k].ids_list end
    for k = 1, #bt.ids_list do
      local name = info[off + k].src and info[off + k].src.name
      if name then cnt[name] = cnt[name] + 1 end
    end
    for name, c in pairs(cnt) do if c > 0 or bt.per_source[name] then T.eq(bt.per_source[name] or 0, c, "per_source " .. name) end end
    totals.a, totals.b = totals.a + (bt.per_source.a or 0), totals.b + (bt.per_source.b or 0)
  end
  T.eq(p:tokens_per_source(), totals)
  T.eq(totals.a + totals.b, 13 * 64)
  -- the state's cursors count the documents taken
  local st = p:state()
  T.eq(st.cursors, { a = next_i.a, b = next_i.b })
  T.eq(st.draws, next_i.a + next_i.b)
end)

T.test("labels at the edges: a one-token document, a document ending exactly at a row end", function()
  -- documents of lengths 1, 3, 4 (T = 4): rows [E] [E x x] | [E x x x] | ...
  local lens = { [0] = 1, 3, 4, 6 }
  local src = { name = "edges" }
  function src:doc(i, _)
    local n = lens[i % 4]
    local ids, targets = ffi.new("int32_t[?]", n), ffi.new("int32_t[?]", n)
    ids[0] = EOT
    for t = 1, n - 1 do ids[t] = 10 * (i % 4) + t end
    for t = 0, n - 1 do targets[t] = (t < n - 1) and ids[t + 1] or POISON end
    return ids, targets, n
  end
  local p = pack.Packer { sources = { { source = src, weight = 1 } }, seq_len = 4, seed = 0, eot = EOT }
  local b = p:next_rows(4)
  T.eq(b.ids:tolist(), { 256, 256, 11, 12, 256, 21, 22, 23, 256, 31, 32, 33, 34, 35, 256, 256 })
  T.eq(b.targets:tolist(), { 256, 11, 12, 256, 21, 22, 23, 256, 31, 32, 33, IGNORE, 35, 256, 256, IGNORE })
  T.eq(b.cu_seqlens, { 0, 1, 4, 8, 12, 14, 15, 16 })
  T.eq(b.n_targets, 14)
  T.eq(p:state().carry, { source = "edges", doc = 5, offset = 1, seq_len = 4 })
end)

T.test("(d) resume: state after k batches -> a fresh packer continues bit-identically, across set_seq_len", function()
  local function make(T0)
    local a = fake_source("a", 1, 2, 30, true)
    local b = fake_source("b", 2, 20, 300, true)
    local c = fake_source("c", 3, 5, 60)
    return pack.Packer {
      sources = { { source = a, weight = 2 }, { source = b, weight = 1, min_len = 40 }, { source = c, weight = 1, max_len = 50 } },
      seq_len = T0, seed = 5, eot = EOT,
    }, tag_map(a, b, c)
  end
  local plan = { { 3, 32 }, { 2, 32 }, { 4, 32 }, { 2, 128 }, { 3, 128 }, { 1, 512 }, { 2, 128 } }
  local ref, tags = make(32)
  local full = run(ref, plan)
  local info = rebuild(full, tags)          -- (a)-(c) also hold across the stage switches
  check_batches(full, info)
  local carried = 0
  for k = 1, #plan - 1 do
    local p = make(32)
    run(p, { unpack(plan, 1, k) })
    local st = p:state()
    if st.carry then carried = carried + 1 end
    if k == 3 then T.ok(st.carry and st.carry.seq_len == 32, "a T = 32 document in flight before the switch to 128") end
    local restored = json.decode(json.encode(st))   -- the state is plain JSON
    local q = make(plan[k + 1][2])
    q:set_state(restored)
    T.eq(q:state(), st, "state round trip after batch " .. k)
    local rest = { }
    for j = k + 1, #plan do rest[#rest + 1] = plan[j] end
    local cont = run(q, rest)
    for j, bt in ipairs(cont.batches) do
      local want = full.batches[k + j]
      T.eq(bt.ids_list, want.ids_list, string.format("ids of batch %d resumed after %d", k + j, k))
      T.eq(bt.targets_list, want.targets_list, string.format("targets of batch %d resumed after %d", k + j, k))
      T.eq(bt.cu_seqlens, want.cu_seqlens)
      T.eq(bt.per_source, want.per_source)
    end
    T.eq(q:state(), ref:state(), "final state resumed after " .. k)
  end
  T.ok(carried >= 4, "most cut points carry a document over (" .. carried .. " of " .. (#plan - 1) .. ")")
end)

T.test("(e) mixture: each source's share of documents is within 3 sigma of its weight", function()
  local ws = { 1, 2, 5 }
  local entries = {}
  for j, w in ipairs(ws) do entries[j] = { source = fake_source("s" .. j, j, 2, 3), weight = w } end
  local p = pack.Packer { sources = entries, seq_len = 1000, seed = 123, eot = EOT }
  p:next_rows(60)
  local st = p:state()
  local n = st.draws
  T.ok(n > 15000, "enough draws: " .. n)
  local sum = 0
  for j = 1, 3 do sum = sum + st.cursors["s" .. j] end
  T.eq(sum, n, "one draw per document")
  for j, w in ipairs(ws) do
    local pj = w / 8
    local share = st.cursors["s" .. j] / n
    local sigma = math.sqrt(pj * (1 - pj) / n)
    T.ok(math.abs(share - pj) <= 3 * sigma,
      string.format("source %d: share %.4f, weight %.4f, 3 sigma %.4f", j, share, pj, 3 * sigma))
  end
  -- another seed draws another order
  local x, y = pack.Packer { sources = entries, seq_len = 64, seed = 124, eot = EOT }:next_rows(2).ids:tolist(),
    pack.Packer { sources = entries, seq_len = 64, seed = 123, eot = EOT }:next_rows(2).ids:tolist()
  local differ = false
  for k = 1, #x do if x[k] ~= y[k] then differ = true end end
  T.ok(differ, "seeds 123 and 124 give other mixtures")
end)

T.test("(f) length filters: only documents with min_len <= n <= max_len, skipped in cursor order", function()
  local a = fake_source("a", 1, 1, 100)
  local b = fake_source("b", 2, 2, 100)       -- n >= 2: a document carries its identity (n = 1: the edge test)
  local p = pack.Packer {
    sources = { { source = a, weight = 1, min_len = 30, max_len = 60 }, { source = b, weight = 1, max_len = 10, name = "short" } },
    seq_len = 50, seed = 2, eot = EOT,
  }
  local stream = run(p, { { 20, 50 } })
  local info, order = rebuild(stream, tag_map(a, b))
  check_batches(stream, info)
  local bounds = { [1] = { 30, 60 }, [2] = { 2, 10 } }
  local expect_next = { [1] = 0, [2] = 0 }
  local counts = { [1] = 0, [2] = 0 }
  for _, d in ipairs(order) do
    local tag, lo, hi = d.src.tag, bounds[d.src.tag][1], bounds[d.src.tag][2]
    T.ok(d.n >= lo and d.n <= hi, string.format("%s doc %d has length %d outside [%d, %d]", d.src.name, d.i, d.n, lo, hi))
    -- every document between the previous accepted one and this one was outside the bounds
    for i = expect_next[tag], d.i - 1 do
      local n = d.src:len(i, 50)
      T.ok(n < lo or n > hi, string.format("%s doc %d (length %d) was skipped but fits [%d, %d]", d.src.name, i, n, lo, hi))
    end
    expect_next[tag] = d.i + 1
    counts[tag] = counts[tag] + 1
  end
  T.ok(counts[1] > 5 and counts[2] > 5, string.format("both filtered sources used (%d, %d)", counts[1], counts[2]))
  T.eq(p:state().sources, { "a", "short" }, "an entry name overrides the source's name")
  -- a filter nothing passes is an error after pack.MAX_REJECTIONS documents, naming the source
  local never = pack.Packer { sources = { { source = fake_source("tiny", 4, 2, 5), weight = 1, min_len = 100 } }, seq_len = 8, eot = EOT }
  T.raises(function() never:next_rows(1) end, "pack: source 'tiny': 10000 consecutive documents")
end)

-- the documents of a text source as byte strings (ids[1 .. n-1]; ids[0] is the separator)
local function doc_string(src, i)
  local ids, _, n = src:doc(i, 0)
  local bytes = ffi.new("uint8_t[?]", math.max(n - 1, 1))
  for t = 1, n - 1 do bytes[t - 1] = ids[t] end
  return ffi.string(bytes, n - 1), ids, n
end

local function with(base, extra)
  local t = {}
  for k, v in pairs(base) do t[k] = v end
  for k, v in pairs(extra) do t[k] = v end
  return t
end

T.test("(g) text source over the fortune files: separators, per-epoch shuffles, a clean val split", function()
  local train = pack.text_source(with(FORTUNES, { seed = 3 }))
  local n = train:count()
  T.ok(n > 1000, "fortune documents: " .. n)
  T.eq(train.name, "text:train")
  local ds = text.load(FORTUNES, tokenizer.byte_level())
  local seq = pack.text_source(with(FORTUNES, { order = "sequential" }))
  local total = 0
  for i = 0, n - 1 do
    local ids, targets, len = seq:doc(i, 64)
    if ids[0] ~= EOT then T.eq(ids[0], EOT, "document " .. i .. " starts with <|endoftext|>") end
    for t = 1, len - 1 do
      if ids[t] == EOT then T.ok(false, "separator inside document " .. i) end
      if targets[t - 1] ~= ids[t] then T.eq(targets[t - 1], ids[t], "target " .. (t - 1) .. " of document " .. i) end
    end
    total = total + len
  end
  -- the train documents tile the train split but for the head of each file's document the split point cuts
  -- (its tail begins the val part): at most one document's worth per file
  T.ok(total <= ds.train.n and total > ds.train.n - 43 * 2000,
    string.format("train documents hold %d of the split's %d tokens", total, ds.train.n))
  T.eq(seq:count(), n)
  T.eq(seq:index(n + 7), 7, "sequential order wraps around")
  -- shuffle: each epoch is a permutation, a new one per epoch, and doc(i) follows it
  local perms = {}
  for e = 0, 2 do
    local seen, moved = {}, 0
    perms[e] = {}
    for j = 0, n - 1 do
      local k = train:index(e * n + j)
      if seen[k] then T.ok(false, string.format("epoch %d repeats document %d", e, k)) end
      seen[k] = true
      perms[e][j] = k
      if k ~= j then moved = moved + 1 end
    end
    for k = 0, n - 1 do if not seen[k] then T.ok(false, string.format("epoch %d misses document %d", e, k)) end end
    T.ok(moved > 0.9 * n, string.format("epoch %d is shuffled (%d of %d moved)", e, moved, n))
  end
  local same01 = 0
  for j = 0, n - 1 do if perms[0][j] == perms[1][j] then same01 = same01 + 1 end end
  T.ok(same01 < 0.01 * n, "epochs 0 and 1 use other permutations (" .. same01 .. " positions agree)")
  T.eq(doc_string(train, n + 5), doc_string(seq, perms[1][5]), "doc(n + 5) is document perm_1[5]")
  T.eq(train:index(17), perms[0][17], "the cached epoch 2 does not change epoch 0")
  local again = pack.text_source(with(FORTUNES, { seed = 3 }))
  T.eq(again:index(n + 100), perms[1][100], "the permutation is a function of the seed")
  local other = pack.text_source(with(FORTUNES, { seed = 4 }))
  local agree = 0
  for j = 0, 99 do if other:index(j) == perms[0][j] then agree = agree + 1 end end
  T.ok(agree < 10, "another seed shuffles differently (" .. agree .. " of 100 agree)")
  -- both splits hold whole fortunes only: the document each file's split point cuts is in neither
  local whole = {}
  local all = pack.text_source(with(FORTUNES, { val_fraction = 0, order = "sequential" }))
  local n_all = all:count()
  T.eq(#all.files, 43, "fortune files")
  for i = 0, n_all - 1 do whole[doc_string(all, i)] = true end
  for i = 0, n - 1 do
    local s = doc_string(seq, i)
    if not whole[s] then T.ok(false, "train document " .. i .. " is not a whole fortune: " .. s:sub(-60)) end
  end
  local val = pack.text_source(with(FORTUNES, { split = "val", order = "sequential" }))
  T.eq(val.name, "text:val")
  local vtotal = 0
  for i = 0, val:count() - 1 do
    local s, ids, len = doc_string(val, i)
    T.eq(ids[0], EOT)
    if not whole[s] then T.ok(false, "val document " .. i .. " is not a whole fortune: " .. s:sub(1, 60)) end
    vtotal = vtotal + len
  end
  T.ok(val:count() > 20, "val documents: " .. val:count())
  T.ok(n + val:count() <= n_all and n + val:count() >= n_all - 43,
    string.format("train %d + val %d documents = all %d less at most one per file", n, val:count(), n_all))
  T.ok(vtotal < ds.val.n and vtotal > 0.5 * ds.val.n,
    string.format("val documents hold %d of the split's %d tokens (partial first documents dropped)", vtotal, ds.val.n))
  -- packed rows of fortunes: inside a segment the target is the next token; a segment's end predicts the
  -- separator only when its document ends there
  local p = data.pack.Packer { sources = { { source = train, weight = 1 } }, seq_len = 256, seed = 1, eot = EOT }
  local b1, b2 = p:next_rows(8), p:next_rows(1)
  local ids, tg = b1.ids:tolist(), b1.targets:tolist()
  ids[#ids + 1] = b2.ids:tolist()[1]
  local ends = {}
  for _, k in ipairs(b1.cu_seqlens) do ends[k] = true end
  for k = 1, 8 * 256 do
    local want
    if ends[k] then want = (ids[k + 1] == EOT) and EOT or IGNORE else want = ids[k + 1] end
    if tg[k] ~= want then T.eq(tg[k], want, "fortune label at " .. k) end
  end
  T.eq(b1.per_source, { ["text:train"] = 8 * 256 })
end)

T.test("(g2) text spans (the synthetic generators' text filler): contiguous, wrapping, filtered, deterministic", function()
  local seq = pack.text_source(with(FORTUNES, { order = "sequential" }))
  local shuffled = pack.text_source(with(FORTUNES, { seed = 9 }))
  -- the stream: the documents in stored order, <|endoftext|> left out
  local parts = {}
  for i = 0, seq:count() - 1 do
    local s = doc_string(seq, i)
    parts[#parts + 1] = s
  end
  local stream = table.concat(parts)
  local N = 0
  for j = 1, seq.n_docs do N = N + seq.doc_len[j] end
  local function str(a, n)
    local c = {}
    for k = 0, n - 1 do c[#c + 1] = string.char(a[k]) end
    return table.concat(c)
  end
  local all = function() return true end
  T.eq(str(seq:span(0, 100, all), 100), stream:sub(1, 100), "u = 0 starts at the first document")
  local a = seq:span(0.37, 500, all)
  T.eq(str(a, 500), str(shuffled:span(0.37, 500, all), 500), "the span ignores the shuffle (stored order)")
  T.ok(stream:find(str(a, 500), 1, true), "a span is a substring of the stream")
  T.eq(str(a, 500), str(seq:span(0.37, 500, all), 500), "deterministic in u")
  local wrap = str(seq:span((N - 3) / N, 200, all), 200)
  T.eq(wrap:sub(1, 3), stream:sub(-3), "a span from the last 3 tokens ...")
  T.eq(wrap:sub(4), stream:sub(1, 197), "... wraps to the start")
  local no_e = seq:span(0.5, 1000, function(id) return id ~= string.byte("e") end)
  for k = 0, 999 do
    if no_e[k] == string.byte("e") or no_e[k] == EOT then T.ok(false, "span id " .. no_e[k] .. " at " .. k) end
  end
  T.ok(stream:gsub("e", ""):find(str(no_e, 1000), 1, true), "a filtered span is the stream less those ids")
  T.raises(function() seq:span(0.5, 10, function() return false end) end,
    "pack: text:train: no token of the text is usable as filler")
  T.raises(function() seq:span(1, 10, all) end, "span start u must be in [0, 1), got 1")
end)

T.test("(h) errors name the problem", function()
  local a = fake_source("a", 1, 2, 10)
  local ok_entry = { source = a, weight = 1 }
  T.raises(function() pack.Packer { sources = {}, seq_len = 8, eot = EOT } end, "pack: sources must be a non-empty list")
  T.raises(function() pack.Packer { seq_len = 8, eot = EOT } end, "pack: sources must be a non-empty list")
  T.raises(function() pack.Packer { sources = { { source = a, weight = 0 } }, seq_len = 8, eot = EOT } end,
    "pack: sources[1] ('a'): weight must be a finite number > 0, got 0")
  T.raises(function() pack.Packer { sources = { ok_entry, { source = fake_source("b", 2, 2, 3), weight = -1 } }, seq_len = 8, eot = EOT } end,
    "pack: sources[2] ('b'): weight must be a finite number > 0, got -1")
  T.raises(function() pack.Packer { sources = { ok_entry }, seq_len = 8, eot = EOT, batch = 4 } end,
    "pack: unknown key 'batch' in Packer config; known keys: eot, lane, lanes, media_pad, pad, seed, seq_len, sources")
  T.raises(function() pack.Packer { sources = { { source = a, weight = 1, wieght = 2 } }, seq_len = 8, eot = EOT } end,
    "pack: unknown key 'wieght' in sources[1]")
  T.raises(function() pack.text_source(with(FORTUNES, { shuffle = true })) end, "pack: unknown key 'shuffle' in text_source config")
  T.raises(function() pack.Packer { sources = { ok_entry }, seq_len = 0, eot = EOT } end, "pack: seq_len must be a positive integer, got 0")
  T.raises(function() pack.Packer { sources = { ok_entry }, seq_len = 8 } end, "pack: eot must be the integer id of <|endoftext|>")
  T.raises(function() pack.Packer { sources = { ok_entry, ok_entry }, seq_len = 8, eot = EOT } end, "source name 'a' is used twice")
  T.raises(function() pack.Packer { sources = { { source = a, weight = 1, min_len = 5, max_len = 4 } }, seq_len = 8, eot = EOT } end,
    "max_len must be an integer >= min_len (5), got 4")
  T.raises(function() pack.Packer { sources = { { source = { name = "x" }, weight = 1 } }, seq_len = 8, eot = EOT } end,
    "pack: sources[1].source has no doc(i, T) method")
  local p = pack.Packer { sources = { ok_entry }, seq_len = 8, eot = EOT }
  T.raises(function() p:next_rows(0) end, "pack: next_rows: R must be a positive integer, got 0")
  T.raises(function() p:set_seq_len(2.5) end, "pack: set_seq_len: seq_len must be a positive integer, got 2.5")
  local wrong = { name = "wrong" }
  function wrong:doc(i, _) local ids = ffi.new("int32_t[2]", 5, 6); return ids, ffi.new("int32_t[2]"), 2 end
  T.raises(function() pack.Packer { sources = { { source = wrong, weight = 1 } }, seq_len = 8, eot = EOT }:next_rows(1) end,
    "pack: source 'wrong': document 0 begins with id 5, not <|endoftext|> (256)")
  -- set_state mismatches
  p:next_rows(3)
  local st = p:state()
  local q = pack.Packer { sources = { ok_entry }, seq_len = 8, seed = 1, eot = EOT }
  T.raises(function() q:set_state(st) end, "pack: set_state: the state's seed 0 differs from the packer's seed 1")
  local r = pack.Packer { sources = { ok_entry, { source = fake_source("b", 2, 2, 3), weight = 1 } }, seq_len = 8, eot = EOT }
  T.raises(function() r:set_state(st) end, "pack: set_state: the state's sources {a} differ from the packer's sources {a, b}")
  local s = pack.Packer { sources = { { source = a, weight = 1, name = "renamed" } }, seq_len = 8, eot = EOT }
  T.raises(function() s:set_state(st) end, "the state's sources {a} differ from the packer's sources {renamed}")
  local bad_carry = with(st, { carry = { source = "a", doc = 10 ^ 6, offset = 1, seq_len = 8 } })
  T.raises(function() p:set_state(bad_carry) end, "carry-over document 1000000 of source 'a' is not below its cursor")
  -- text source options
  T.raises(function() pack.text_source(with(FORTUNES, { split = "test" })) end, "pack: split must be 'train' or 'val', got 'test'")
  T.raises(function() pack.text_source(with(FORTUNES, { order = "random" })) end, "pack: order must be 'shuffle' or 'sequential', got 'random'")
  T.raises(function() pack.text_source(with(FORTUNES, { split = "val", val_fraction = 0 })) end, "pack: split 'val' needs val_fraction > 0, got 0")
  T.raises(function() pack.text_source(with(FORTUNES, { seed = -1 })) end, "pack: text_source seed must be an integer in [0, 2^32), got -1")
  local dir = string.format("%s/tide-test-pack-%d", os.getenv("TMPDIR") or "/tmp", math.floor(tide.time() * 1e6) % 1e9)
  assert(tide.C.tide_mkdir_p(dir) == 0)
  local toks = ffi.new("uint32_t[6]", 1, 2, 3, 4, 5, 6)    -- a shard with no <|endoftext|>: no document begins
  T.eq(tide.C.tide_shard_write(dir .. "/s.bin", toks, 6, 2), 0)
  T.raises(function() pack.text_source({ path = dir .. "/s.bin" }) end, "pack: text source has no documents in split 'train'")
  tide.C.tide_remove_tree(dir)
end)

T.test("(i) data lanes: lane 0 of 1 is the packer; lanes read disjoint documents; one rank hosting both == two", function()
  local a, b = fake_source("a", 1, 2, 40), fake_source("b", 2, 30, 200)
  local function entries() return { { source = a, weight = 3 }, { source = b, weight = 1 } } end
  local function packer(lane, lanes) return pack.Packer { sources = entries(), seq_len = 64, seed = 11, eot = EOT, lane = lane, lanes = lanes } end
  -- lane 0 of 1: the packer's own rows and state, bit for bit
  local plain, one = pack.Packer { sources = entries(), seq_len = 64, seed = 11, eot = EOT }, packer(0, 1)
  for k = 1, 3 do T.eq(one:next_rows(3).ids:tolist(), plain:next_rows(3).ids:tolist(), "batch " .. k) end
  T.eq(json.encode(one:state()), json.encode(plain:state()), "the same state, no lane fields")
  -- two lanes: lane j's documents are j, j + 2, ... of each source (ids[1] of a document is tag * 1e6 + its index)
  local lanes = { packer(0, 2), packer(1, 2) }
  for j = 0, 1 do
    local n = 0
    for _ = 1, 4 do
      for _, id in ipairs(lanes[j + 1]:next_rows(3).ids:tolist()) do
        if id >= 1000000 then
          T.eq((id % 1000000) % 2, j, "lane " .. j .. " read document " .. id)
          n = n + 1
        end
      end
    end
    T.ok(n > 10, "lane " .. j .. " read " .. n .. " documents")
  end
  -- pack.Lanes hosting both: a step of 4 micro-batches is lane 0's next 2, then lane 1's next 2
  local host = pack.Lanes { lanes = 2, make = packer }
  local sep = { packer(0, 2), packer(1, 2) }
  for k = 1, 2 do
    local got = host:next_step(4, 3)
    local want = { sep[1]:next_rows(3), sep[1]:next_rows(3), sep[2]:next_rows(3), sep[2]:next_rows(3) }
    for i = 1, 4 do T.eq(got[i].ids:tolist(), want[i].ids:tolist(), "step " .. k .. " micro-batch " .. i) end
  end
  -- its state through JSON (lane indices as keys), into a fresh host, and two half-hosts (two ranks) of it
  local st = json.decode(json.encode(host:state()))
  T.eq(st.lanes, 2)
  local again = pack.Lanes { lanes = 2, make = packer }
  again:set_state(st)
  local r0, r1 = pack.Lanes { lanes = 2, first = 0, count = 1, make = packer }, pack.Lanes { lanes = 2, first = 1, count = 1, make = packer }
  r0:set_state(st); r1:set_state(st)
  local merged = pack.merge_lane_states({ r0:state(), r1:state() })
  T.eq(json.encode(merged), json.encode(host:state()), "the two ranks' states merge into the host's")
  local g, h0, h1 = again:next_step(4, 3), r0:next_step(2, 3), r1:next_step(2, 3)
  local want = host:next_step(4, 3)
  for i = 1, 4 do T.eq(g[i].ids:tolist(), want[i].ids:tolist(), "resumed micro-batch " .. i) end
  T.eq({ h0[1].ids:tolist(), h0[2].ids:tolist(), h1[1].ids:tolist(), h1[2].ids:tolist() },
       { want[1].ids:tolist(), want[2].ids:tolist(), want[3].ids:tolist(), want[4].ids:tolist() }, "two ranks == one host")
  -- errors
  T.raises(function() pack.Lanes { lanes = 1, make = packer }:set_state(st) end,
    "the checkpoint's data is in 2 lanes, this run reads 1 (set dist.lanes = 2 to resume it)")
  T.raises(function() host:next_step(3, 3) end, "a step's 3 micro-batches on this rank do not split over its 2 data lanes")
  T.raises(function() packer(2, 2) end, "lane must be an integer in [0, 2), got 2")
  T.raises(function() sep[1]:set_state(sep[2]:state()) end, "the state is lane 1 of 2, the packer lane 0 of 2")
  T.raises(function() host:next_rows(3) end, "2 lanes are hosted here; draw a step with next_step")
end)

T.run()
