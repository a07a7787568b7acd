-- mqar: the MQAR generator (spec/evals.md §1; test oracle 1), its scorer (oracle 4), determinism by example
-- index across batchings and streams, parameter errors, and a smoke run of recipes/recall.lua (every model
-- builds, trains two steps and is scored; parameter counts within 10% of each other).
local T = require "tide.testing"
local ffi = require "ffi"
local tide = require "tide"
local mqar = require "tide.data.mqar"
local data = require "tide.data"

local C = tide.C
local IGN = -100

-- examples first .. first+n−1 into ffi buffers (the generator's own fill, no tensors)
local function examples(cfg, first, n)
  local c = mqar.check(cfg)
  local x, y = ffi.new("int64_t[?]", n * c.seq_len), ffi.new("int64_t[?]", n * c.seq_len)
  for b = 0, n - 1 do mqar.fill(c, first + b, x, y, b * c.seq_len) end
  return x, y, c
end

T.test("oracle 1: 10,000 examples (V 1,024, T 256, D 16): ranges, distinctness, twice-seen keys, D labels", function()
  local N, V, L, D = 10000, 1024, 256, 16
  local x, y = examples({ vocab_size = V, seq_len = L, num_pairs = D, seed = 7 }, 0, N)
  local g0, g1 = 0, 0
  for e = 0, N - 1 do
    local o = e * L
    local key_of, value_of, count = {}, {}, {}
    for j = 0, D - 1 do
      local k, v = tonumber(x[o + 2 * j]), tonumber(x[o + 2 * j + 1])
      if not (k >= 1 and k < V / 2) then T.ok(false, string.format("example %d: key %d outside [1, 512)", e, k)) end
      if not (v >= V / 2 and v < V) then T.ok(false, string.format("example %d: value %d outside [512, 1024)", e, v)) end
      if key_of[k] or value_of[v] then T.ok(false, string.format("example %d: key %d or value %d repeats", e, k, v)) end
      key_of[k], value_of[v] = v, true
      if y[o + 2 * j] ~= IGN or y[o + 2 * j + 1] ~= IGN then T.ok(false, "example " .. e .. ": a context label is set") end
    end
    for t = 0, L - 1 do
      local tok = tonumber(x[o + t])
      count[tok] = (count[tok] or 0) + 1
    end
    local labelled, first_gap = 0, nil
    for t = 2 * D, L - 1 do
      local tok, lab = tonumber(x[o + t]), tonumber(y[o + t])
      if lab ~= IGN then
        labelled = labelled + 1
        if (t - 2 * D) % 2 ~= 0 then T.ok(false, string.format("example %d: label at odd query offset %d", e, t)) end
        if key_of[tok] ~= lab then
          T.ok(false, string.format("example %d: position %d holds %d labelled %d, its paired value is %s", e, t, tok, lab,
            tostring(key_of[tok])))
        end
        if tok == tonumber(x[o]) then first_gap = (t - 2 * D) / 2 end
      elseif tok ~= 0 then
        T.ok(false, string.format("example %d: unlabelled query position %d holds %d, filler is zero", e, t, tok))
      end
    end
    if labelled ~= D then T.ok(false, string.format("example %d: %d labelled positions, expected %d", e, labelled, D)) end
    for k in pairs(key_of) do
      if count[k] ~= 2 then T.ok(false, string.format("example %d: key %d appears %d times", e, k, count[k])) end
    end
    if first_gap == 0 then g0 = g0 + 1 elseif first_gap == 1 then g1 = g1 + 1 end
  end
  -- the first key's gap is the first draw: P(g) = w_g / Σw, w_g = a·(g+1)^(a−1), a = 0.01, S = 112 slots
  local S, a, sum = (L - 2 * D) / 2, 0.01, 0
  for g = 0, S - 1 do sum = sum + a * (g + 1) ^ (a - 1) end
  for g, hits in pairs({ [0] = g0, [1] = g1 }) do
    local p = a * (g + 1) ^ (a - 1) / sum
    local sigma = math.sqrt(p * (1 - p) / N)
    T.ok(math.abs(hits / N - p) <= 3 * sigma,
      string.format("gap %d frequency %.4f, expected %.4f ± %.4f (3σ)", g, hits / N, p, 3 * sigma))
  end
end)

T.test("random filler: query-region ids in [0, V), labels unchanged by the filler choice", function()
  local cz = { vocab_size = 64, seq_len = 64, num_pairs = 4, seed = 3 }
  local cr = { vocab_size = 64, seq_len = 64, num_pairs = 4, seed = 3, filler = "random" }
  local xz, yz = examples(cz, 0, 200)
  local xr, yr = examples(cr, 0, 200)
  local nonzero = 0
  for k = 0, 200 * 64 - 1 do
    T.ok(xr[k] >= 0 and xr[k] < 64, "random filler id in range")
    if yz[k] ~= yr[k] then T.ok(false, "labels differ at " .. k) end
    if yz[k] ~= IGN or k % 64 < 8 then
      if xz[k] ~= xr[k] then T.ok(false, "context or query token differs at " .. k) end
    elseif xr[k] ~= 0 then
      nonzero = nonzero + 1
    end
  end
  -- 200 examples x (56 − 4) filler slots, P(0) = 1/64
  T.ok(nonzero > 0.9 * 200 * 52, "random filler is mostly nonzero: " .. nonzero)
end)

-- one-hot logits [n, T, V] (f32) whose argmax is pred[k] at flat position k
local function one_hot(pred, n, L, V)
  local buf = ffi.new("float[?]", n * L * V)
  for k = 0, n * L - 1 do buf[k * V + pred[k]] = 1 end
  local shape = ffi.new("int64_t[3]", n, L, V)
  return tide.check(C.tide_from_bytes(C.tide_dtype_from_name("f32"), 3, shape, 0, buf, n * L * V * 4))
end

T.test("text filler: the non-query slots of the query region take one span of filler_text, never an id < V", function()
  -- a stand-in text source: token k of its stream is k mod 300, so a span is a run of consecutive ids
  local calls = {}
  local fake = { name = "fake", span = function(self, u, n, keep)
    calls[#calls + 1] = u
    local out, k, pos = ffi.new("int32_t[?]", n), 0, math.floor(u * 300)
    while k < n do
      local id = pos % 300
      if keep(id) then out[k] = id; k = k + 1 end
      pos = pos + 1
    end
    return out
  end }
  local V, Tn, D = 64, 128, 8
  local ct = { vocab_size = V, seq_len = Tn, num_pairs = D, seed = 3, filler = "text", filler_text = fake }
  local cz = { vocab_size = V, seq_len = Tn, num_pairs = D, seed = 3 }
  for i = 0, 19 do
    local x, y = mqar.example(ct, i)
    local xz, yz = mqar.example(cz, i)
    T.eq(y, yz, "labels are the zero filler's")
    local prev
    for t = 1, Tn do
      if t > 2 * D and yz[t] == IGN then
        T.ok(x[t] >= V, string.format("example %d: filler id %d at %d is outside the task's [0, %d)", i, x[t], t, V))
        if prev then T.eq(x[t], prev == 299 and V or prev + 1, "one contiguous span, the task ids left out") end
        prev = x[t]
      else
        T.eq(x[t], xz[t], "keys, values and queries as with zero filler")
      end
    end
  end
  T.eq(#calls, 20, "one span per example")
  local again = mqar.example(ct, 7)
  T.eq(again, (mqar.example(ct, 7)), "deterministic")
  T.ok(calls[#calls] == calls[8], "example 7's span starts where it did the first time")
end)

T.test("id_base and filler_range: task ids at id_base + v, random filler uniform in the range, labels unchanged", function()
  local c0 = { vocab_size = 64, seq_len = 128, num_pairs = 8, seed = 4 }
  local cr = { vocab_size = 64, seq_len = 128, num_pairs = 8, seed = 4, id_base = 100, filler = "random",
    filler_range = { 10, 42 } }
  local seen = {}
  for i = 0, 49 do
    local x0, y0 = mqar.example(c0, i)
    local x, y = mqar.example(cr, i)
    for t = 1, 128 do
      T.eq(y[t], y0[t] == IGN and IGN or y0[t] + 100, "labels shifted by id_base")
      if t > 16 and y0[t] == IGN then
        T.ok(x[t] >= 10 and x[t] < 42, "filler id in [10, 42): " .. x[t])
        seen[x[t]] = true
      else
        T.eq(x[t], x0[t] + 100, "task ids shifted by id_base")
      end
    end
  end
  local nd = 0
  for _ in pairs(seen) do nd = nd + 1 end
  T.eq(nd, 32, "every id of the range is drawn")
end)

T.test("oracle 4: an exact solver scores 100%, random value tokens score 2/V within 3σ", function()
  local V, L, D, chunk, n_chunks = 1024, 64, 16, 64, 16
  local cfg = mqar.check({ vocab_size = V, seq_len = L, num_pairs = D, seed = 11 })
  local u = ffi.new("double[?]", chunk * L)
  local hits, total = 0, 0
  for ci = 0, n_chunks - 1 do
    local ids, targets = mqar.batch(cfg, ci * chunk, chunk)
    local x = ffi.new("int32_t[?]", chunk * L)
    tide.check_status(C.tide_read_bytes(tide.raw(ids), x, chunk * L * 4))
    -- the solver sees only the ids: a token seen before, at an even context position, recalls its successor
    local pred = ffi.new("int32_t[?]", chunk * L)
    for b = 0, chunk - 1 do
      local o, succ = b * L, {}
      for t = 0, L - 1 do
        local tok = x[o + t]
        if succ[tok] then pred[o + t] = succ[tok] end
        if t < 2 * D and t % 2 == 0 then succ[tok] = x[o + t + 1] end
      end
    end
    if ci < 2 then
      local acc, n = mqar.accuracy(one_hot(pred, chunk, L, V), targets)
      T.eq(n, chunk * D, "labelled positions")
      T.eq(acc, 1, "oracle accuracy")
    end
    C.tide_philox_uniform(99, ci * chunk * L, u, chunk * L)
    for k = 0, chunk * L - 1 do pred[k] = V / 2 + math.floor(u[k] * V / 2) end
    local acc, n = mqar.accuracy(one_hot(pred, chunk, L, V), targets)
    hits, total = hits + acc * n, total + n
  end
  local p = 2 / V
  local sigma = math.sqrt(p * (1 - p) / total)
  T.ok(math.abs(hits / total - p) <= 3 * sigma,
    string.format("random accuracy %.5f over %d queries, expected %.5f ± %.5f (3σ)", hits / total, total, p, 3 * sigma))
end)

T.test("accuracy counts only labelled positions; mismatched shapes are errors", function()
  local V = 8
  local pred = ffi.new("int32_t[6]", 1, 5, 2, 6, 7, 0)
  local targets = tide.tensor({ { IGN, 5, IGN, 4, 7, IGN } }, { dtype = "i64" })
  local acc, n = mqar.accuracy(one_hot(pred, 1, 6, V), targets)
  T.eq(n, 3)
  T.near(acc, 2 / 3, 1e-12)
  T.raises(function() mqar.accuracy(one_hot(pred, 1, 6, V), tide.tensor({ { 1, 2 } }, { dtype = "i64" })) end,
    "logits hold 6 positions but targets 2")
  T.raises(function() mqar.accuracy(one_hot(pred, 1, 6, V), tide.full({ 1, 6 }, IGN, { dtype = "i64" })) end,
    "no labelled positions")
end)

T.test("determinism: example i is the same in every batching, stream and call; seeds give other examples", function()
  local cfg = { vocab_size = 128, seq_len = 64, num_pairs = 8, seed = 5, filler = "random" }
  local ids8, tg8 = mqar.batch(cfg, 0, 8)
  local ids2, tg2 = mqar.batch(cfg, 3, 2)
  T.eq(ids2, ids8:narrow(1, 4, 2):contiguous(), "ids of examples 3, 4")
  T.eq(tg2, tg8:narrow(1, 4, 2):contiguous(), "targets of examples 3, 4")
  local ex, lab = mqar.example(cfg, 4)
  T.eq(ex, ids8:narrow(1, 5, 1):reshape(64):tolist(), "example(4) ids")
  T.eq(lab, tg8:narrow(1, 5, 1):reshape(64):tolist(), "example(4) labels")
  T.eq(ids8:dtype(), "i32")
  T.eq(tg8:dtype(), "i64")
  -- a stream of batch 2 at cursor 2 serves examples 4, 5; state round trip resumes it
  local s = mqar.stream(cfg, { batch_size = 2 })
  s:next(); s:next()
  local st = s:state()
  local x = s:next()
  T.eq(x, ids8:narrow(1, 5, 2):contiguous(), "stream batch 2")
  local s2 = mqar.stream(cfg, { batch_size = 2 })
  s2:set_state(st)
  T.eq(s2:next(), x, "resumed stream")
  T.raises(function() mqar.stream({ seed = 6 }, { batch_size = 2 }):set_state(st) end, "differs from the configured one")
  -- a finite set of 5 examples wraps: batch 2 of size 2 is examples 4, 0
  local w = mqar.stream(cfg, { batch_size = 2, examples = 5 })
  w:next(); w:next()
  local wrap = w:next()
  T.eq(wrap:narrow(1, 1, 1), ids8:narrow(1, 5, 1), "example 4")
  T.eq(wrap:narrow(1, 2, 1), ids8:narrow(1, 1, 1), "then example 0")
  -- another seed, another example
  local other = mqar.example({ vocab_size = 128, seq_len = 64, num_pairs = 8, seed = 6, filler = "random" }, 4)
  T.ok(table.concat(other, ",") ~= table.concat(ex, ","), "seed 6 differs from seed 5")
  -- through data.build (the tide.train path): train from `seed`, validation from seed + 1
  local d = data.build({ task = "mqar", seq_len = 64, num_pairs = 8, batch_size = 4, seed = 5, filler = "random" }, 128)
  T.eq(d.tokenizer.vocab_size, 128)
  T.eq(d.train:next(), ids8:narrow(1, 1, 4):contiguous(), "data.build train stream")
  local v = d.val():next()
  T.eq(v, mqar.batch({ vocab_size = 128, seq_len = 64, num_pairs = 8, seed = 6, filler = "random" }, 0, 4), "val stream")
end)

T.test("bad parameters are errors that name the parameter and the values", function()
  local function cfg(over)
    local c = { vocab_size = 1024, seq_len = 256, num_pairs = 16 }
    for k, v in pairs(over) do c[k] = v end
    return c
  end
  T.raises(function() mqar.example(cfg({ num_pairs = 65 }), 0) end, "num_pairs D = 65 needs 4D <= seq_len, got 4D = 260 > 256")
  T.raises(function() mqar.example(cfg({ vocab_size = 1023 }), 0) end, "vocab_size must be even")
  T.raises(function() mqar.example(cfg({ seq_len = 255 }), 0) end, "seq_len must be even")
  T.raises(function() mqar.example(cfg({ vocab_size = 16, num_pairs = 8, seq_len = 64 }), 0) end,
    "num_pairs D = 8 exceeds the 7 distinct keys of [1, 8)")
  T.raises(function() mqar.example(cfg({ num_pairs = 0 }), 0) end, "num_pairs must be an integer >= 1, got 0")
  T.raises(function() mqar.example(cfg({ power = 0 }), 0) end, "power must be in (0, 1], got 0")
  T.raises(function() mqar.example(cfg({ filler = "noise" }), 0) end,
    'mqar: filler must be one of "random", "text", "zero", got "noise"')
  T.raises(function() mqar.example(cfg({ filler = "text" }), 0) end, 'mqar: filler = "text" needs filler_text, a text')
  T.raises(function() mqar.example(cfg({ filler = "text", filler_text = {} }), 0) end, 'filler = "text" needs filler_text')
  T.raises(function() mqar.example(cfg({ filler = "random", filler_text = {} }), 0) end,
    'mqar: filler_text is used only with filler = "text", got filler = "random"')
  T.raises(function() mqar.example(cfg({ filler = "random", filler_range = { 1000, 1100 } }), 0) end,
    "mqar: filler_range [1000, 1100) overlaps the task's ids [0, 1024)")
  T.ok(pcall(mqar.example, cfg({ filler = "random", filler_range = { 0, 10 }, id_base = 10 }), 0),
    "a range just below the task's ids is fine")
  T.raises(function() mqar.example(cfg({ id_base = -1 }), 0) end, "id_base must be a non-negative integer, got -1")
  T.raises(function() mqar.example(cfg({ seed = -1 }), 0) end, "seed must be an integer >= 0")
  T.raises(function() mqar.example(cfg({ pairs = 4 }), 0) end, "unknown key 'pairs'")
  T.raises(function() mqar.example(cfg({}), -1) end, "example index must be an integer >= 0, got -1")
  T.raises(function() mqar.example(cfg({}), 2 ^ 32) end, "example index must be < 2^32")
  T.raises(function() mqar.batch(cfg({}), 0, 0) end, "n must be an integer >= 1, got 0")
  T.raises(function() data.build({ task = "copy", seq_len = 8, batch_size = 1 }, 16) end, "unknown task 'copy'")
end)

T.test("recipes/recall.lua: the three models build with parameter counts within 10%, train 2 steps, are scored", function()
  local cli = require "tide.cli"
  local dir = string.format("%s/tide-test-mqar-%d", os.getenv("TMPDIR") or "/tmp", math.floor(tide.time() * 1e6) % 1e9)
  local cfg = cli.load_recipe("recipes/recall.lua", {
    { key = "lengths", text = "32" }, { key = "num_pairs", text = "2" }, { key = "queries", text = "4" }, { key = "batch_size", text = "1" },
    { key = "eval_queries", text = "6" }, { key = "results", text = dir }, { key = "out", text = "" },
    { key = "quiet", text = "true" },
  })
  local t0 = tide.time()
  local record = cfg.run(cfg)
  local lo, hi = math.huge, 0
  for _, kind in ipairs({ "kda", "mla", "hybrid" }) do
    local r = record.results[kind .. "-32"]
    T.ok(r, kind .. " ran")
    T.eq(r.steps, 2, kind .. " steps")
    T.eq(r.pairs, 2, "D")
    T.eq(r.labelled, 3 * 2, kind .. " scored 3 examples x D queries")
    T.ok(r.accuracy >= 0 and r.accuracy <= 1, kind .. " accuracy")
    T.ok(r.final_loss == r.final_loss and r.final_loss > 0, kind .. " loss is finite")
    lo, hi = math.min(lo, r.params), math.max(hi, r.params)
  end
  T.ok(hi <= 1.1 * lo, string.format("parameter counts %d .. %d differ by more than 10%%", lo, hi))
  T.eq(#record.claims, 1, "the hybrid-vs-MLA comparison is recorded")
  -- the results files: JSON that reads back, markdown with one row per model
  local json = require "tide.json"
  local f = assert(io.open(dir .. "/recall.json"))
  local back = json.decode(f:read("*a"))
  f:close()
  T.eq(back.results["hybrid-32"].params, record.results["hybrid-32"].params, "recall.json round trip")
  f = assert(io.open(dir .. "/recall.md"))
  local md = f:read("*a")
  f:close()
  T.ok(md:find("| hybrid 3:1 (KM) |", 1, true), "recall.md has the hybrid row")
  C.tide_remove_tree(dir)
  local bad = cli.load_recipe("recipes/recall.lua", { { key = "lengths", text = "32,64" }, { key = "num_pairs", text = "2,2,2" } })
  T.raises(function() bad.run(bad) end, "num_pairs lists 3 values for 2 lengths")
  io.stderr:write(string.format("  recipe smoke run %.1f s\n", tide.time() - t0))
end)

T.run()
