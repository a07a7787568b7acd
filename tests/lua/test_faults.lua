-- faults: what a hostile disk or user hands the engine must end in a clear line, never a crash or a hang.
-- NaNs of every payload class read back into Lua as numbers (LuaJIT keeps its values in the NaN space of a
-- double: an uncanonicalised payload read as nil or a pointer crashed --resume), and the non-finite guard fires
-- on them in weights, gradients and checkpoints; readers refuse FIFOs, devices and directories without blocking;
-- integer tensors are refused for float weights on load.
local ffi = require "ffi"
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local checkpoint = require "tide.checkpoint"
local optim = require "tide.optim"
local step = require "tide.step"
local train = require "tide.train"
local C = tide.C

local FIXTURE = "tests/fixtures/tiny_corpus.txt"
local tmpdir = T.tmpdir     -- removed when T.run ends

-- the payload classes as bits in f64, f32 and bf16, and what they are
local CLASSES = {
  { name = "+quiet NaN", f64 = 0x7FF8000000000000ULL, f32 = 0x7FC00000, bf16 = 0x7FC0, kind = "nan" },
  { name = "-quiet NaN", f64 = 0xFFF8000000000000ULL, f32 = 0xFFC00000, bf16 = 0xFFC0, kind = "nan" },
  { name = "+signalling NaN", f64 = 0x7FF0000000000001ULL, f32 = 0x7F800001, bf16 = 0x7F81, kind = "nan" },
  { name = "-signalling NaN", f64 = 0xFFF4000000000000ULL, f32 = 0xFFA00000, bf16 = 0xFFA0, kind = "nan" },
  -- (0xFFEC0001FFEC0001 is a finite double: as f64 the class is the f32 NaN widened, a payload in LuaJIT's tag range)
  { name = "0xFFEC0001 words", f64 = 0xFFFD800020000000ULL, f32 = 0xFFEC0001, bf16 = 0xFFEC, kind = "nan" },
  { name = "all ones", f64 = 0xFFFFFFFFFFFFFFFFULL, f32 = 0xFFFFFFFF, bf16 = 0xFFFF, kind = "nan" },
  { name = "0x7FFFFFFF words", f64 = 0x7FFFFFFF7FFFFFFFULL, f32 = 0x7FFFFFFF, bf16 = 0x7FFF, kind = "nan" },
  { name = "+inf", f64 = 0x7FF0000000000000ULL, f32 = 0x7F800000, bf16 = 0x7F80, kind = "inf" },
  { name = "-inf", f64 = 0xFFF0000000000000ULL, f32 = 0xFF800000, bf16 = 0xFF80, kind = "-inf" },
}
local BITS = { f64 = "uint64_t[?]", f32 = "uint32_t[?]", bf16 = "uint16_t[?]" }

local function find_class(name)
  for _, c in ipairs(CLASSES) do if c.name == name then return c end end
end

-- writes the class's bits into the elements of t (a contiguous float tensor) for which pick(i) holds (0-based)
local function plant(t, class, pick)
  local dt = t:dtype()
  local n = t:numel()
  local buf = ffi.new(BITS[dt], math.max(n, 1))
  tide.check_status(C.tide_read_bytes(tide.raw(t), buf, t:nbytes()))
  for i = 0, n - 1 do
    if not pick or pick(i) then buf[i] = class[dt] end
  end
  tide.check_status(C.tide_write_bytes(tide.raw(t), buf, t:nbytes()))
  return t
end

-- v is a Lua number of the class's kind, and every finite check says no
local function check_value(v, kind, where)
  T.ok(type(v) == "number", string.format("%s: read as a %s, expected a number", where, type(v)))
  if kind == "nan" then T.ok(v ~= v, where .. ": NaN")
  elseif kind == "inf" then T.ok(v == math.huge, where .. ": +inf")
  else T.ok(v == -math.huge, where .. ": -inf") end
  T.ok(not step.is_finite(v), where .. ": step.is_finite rejects it")
  T.ok(not step.is_finite(v * 2 + 1), where .. ": arithmetic on it stays non-finite")
end

T.test("every NaN payload class and ±inf read back as numbers through item, tolist, totable, reductions", function()
  for _, dt in ipairs({ "f32", "f64", "bf16" }) do
    for _, c in ipairs(CLASSES) do
      local where = dt .. " " .. c.name
      local x = plant(tide.tensor({ 1, 2, 3 }, { dtype = dt }), c, function(i) return i == 1 end)
      check_value(x[2]:item(), c.kind, where .. " item")
      check_value(x:narrow(1, 2, 1):item(), c.kind, where .. " narrow:item")
      check_value(x:tolist()[2], c.kind, where .. " tolist")
      check_value(x:totable()[2], c.kind, where .. " totable")
      T.eq(x:tolist()[1], 1, where .. " the finite neighbours are untouched")
      T.eq(x:tolist()[3], 3, where)
      local r = dt == "bf16" and x:to("f32") or x     -- the CPU reduces f32 and f64
      check_value(r:sum():item(), c.kind, where .. " sum")
      check_value(r:mean():item(), c.kind, where .. " mean")
      check_value(x:to("f64"):sum():item(), c.kind, where .. " to(f64):sum")
      check_value(x:sum_squares(), c.kind == "nan" and "nan" or "inf", where .. " sum_squares")
      T.ok(type(r:max():item()) == "number", where .. " max reads as a number")
      T.ok(type(r:logsumexp():item()) == "number", where .. " logsumexp reads as a number")
      T.eq(x:all_finite(), false, where .. " all_finite")
      local s = tostring(x)
      T.ok(s:find(c.kind == "nan" and "nan" or "inf", 1, true), where .. " prints: " .. s)
      -- a gradient of this class: the grad-norm read, the clip and the finder of the step's guard
      local p = tide.zeros({ 3 }, { dtype = dt })
      p:set_grad(x)
      local params = { { name = "w", param = p } }
      check_value(optim.grad_norm(params), c.kind == "nan" and "nan" or "inf", where .. " grad_norm")
      check_value(optim.clip_grad_norm(params, 1.0), c.kind == "nan" and "nan" or "inf", where .. " clip_grad_norm")
      T.eq(optim.first_nonfinite(params), "w", where .. " first_nonfinite")
    end
  end
end)

T.test("the fused finite check (tide_first_nonfinite): the first bad weight of many, views, skipped gradients", function()
  -- 9 weights of mixed dtypes and sizes (one spans several 65,536-element chunks, one is a strided view);
  -- each round plants one class in one of them; the fused pass must name what a per-tensor check names
  local function weights()
    local ps = {}
    local shapes = { { 3 }, { 300, 500 }, { 7 }, { 70000 }, { 1 }, { 40, 40 }, { 2, 3 }, { 131073 }, { 5 } }
    local dts = { "f32", "f64", "bf16", "f32", "f64", "f32", "bf16", "f64", "f32" }
    for i, sh in ipairs(shapes) do ps[i] = { name = "p" .. i, param = tide.zeros(sh, { dtype = dts[i] }) } end
    ps[6].param = tide.zeros({ 40, 80 }):narrow(2, 11, 40)   -- a strided view: read through a copy
    return ps
  end
  local ps = weights()
  T.eq(step.first_nonfinite_param(ps), nil, "all zeros: finite")
  local rounds = 0
  for w = 1, #ps, 2 do
    for _, c in ipairs(CLASSES) do
      ps = weights()
      local n = ps[w].param:numel()
      local at = (w * 7919 + #c.name) % n
      if w == 6 then
        ps[w].param:copy_(plant(tide.zeros({ 40, 40 }), c, function(i) return i == at end))
      else
        plant(ps[w].param, c, function(i) return i == at end)
      end
      if w < #ps then plant(ps[#ps].param, c) end          -- a later bad weight never wins
      T.eq(step.first_nonfinite_param(ps), ps[w].name, c.name .. " in " .. ps[w].name)
      T.eq(ps[w].param:all_finite(), false, "per-tensor reference agrees for " .. ps[w].name)
      rounds = rounds + 1
    end
  end
  T.ok(rounds >= 10, "rounds run: " .. rounds)
  -- gradients: parameters without one are skipped; the first bad gradient is named
  ps = weights()
  ps[4].param:set_grad(tide.zeros({ 70000 }))
  ps[8].param:set_grad(plant(tide.zeros({ 131073 }, { dtype = "f64" }), CLASSES[1], function(i) return i == 131072 end))
  T.eq(optim.first_nonfinite(ps), "p8", "the one bad gradient, at the last element of the last chunk")
  T.eq(optim.first_nonfinite({}), nil, "no parameters")
end)

T.test("raw buffers: tide_canon_f64 / tide_canon_f32 and to_f64_buffer give canonical doubles", function()
  for _, c in ipairs(CLASSES) do
    local b64 = ffi.new("uint64_t[1]", c.f64)
    check_value(C.tide_canon_f64(ffi.cast("const double *", b64), 0), c.kind, c.name .. " canon_f64")
    local b32 = ffi.new("uint32_t[1]", c.f32)
    check_value(C.tide_canon_f32(ffi.cast("const float *", b32), 0), c.kind, c.name .. " canon_f32")
    local x = plant(tide.zeros({ 4 }, { dtype = "f64" }), c)
    local out = ffi.new("double[4]")
    tide.check_status(C.tide_to_f64_buffer(tide.raw(x), out, 4))
    local bits = ffi.cast("uint64_t *", out)
    for i = 0, 3 do
      if c.kind == "nan" then
        T.ok(bits[i] == 0x7FF8000000000000ULL, c.name .. ": the NaN is +NaN, got 0x" .. bit.tohex(bits[i]))
      else
        T.ok(bits[i] == c.f64, c.name .. ": infinities pass unchanged")
      end
    end
    -- the buffer form
    local raw = ffi.new("uint64_t[2]", c.f64, 0x3FF0000000000000ULL)
    C.tide_canon_f64_buffer(ffi.cast("double *", raw), 2)
    check_value(ffi.cast("double *", raw)[0], c.kind, c.name .. " canon_f64_buffer")
    T.eq(ffi.cast("double *", raw)[1], 1)
  end
end)

-- a tiny dense model on the fixture; `over` patches sections
local function fixture_cfg(over)
  local cfg = {
    model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 320 },
    data = { path = FIXTURE, doc_separator = "%", seq_len = 16, batch_size = 2 },
    optim = { lr = 3e-3 },
    train = { steps = 2, log_every = 1000, seed = 1, quiet = true },
  }
  for section, t in pairs(over or {}) do
    if type(t) == "table" and type(cfg[section]) == "table" then
      for k, v in pairs(t) do cfg[section][k] = v end
    else
      cfg[section] = t
    end
  end
  return cfg
end

-- every float tensor of the model's state planted with the class (at the first step's forward)
local function plant_weights(class)
  return function(m, x, y, t)
    if t == 0 then
      for _, p in pairs(m:state_dict()) do if p:is_float() then plant(p, class) end end
    end
    return m:loss(x, y)
  end
end

local function metrics(out)
  local recs = {}
  for line in io.lines(out .. "/metrics.jsonl") do
    local v = json.decode(line)
    if v.step then recs[v.step] = v end
  end
  return recs
end

T.test("weights planted with each class: the step's guard skips (or stops), no crash", function()
  for _, c in ipairs(CLASSES) do
    local out = tmpdir("w-" .. c.f32)
    local r = train(fixture_cfg({ loss = plant_weights(c), train = { out = out } }))
    T.eq(r.skipped, 2, c.name .. ": both steps skipped")
    T.ok(type(r.losses[1]) == "number" and not step.is_finite(r.losses[1]), c.name .. ": the loss is non-finite")
    local rec = metrics(out)[1]
    T.ok(rec.skipped == true and rec.loss == json.null, c.name .. ": metrics record the skip")
  end
  for _, name in ipairs({ "0xFFEC0001 words", "all ones" }) do
    local c = find_class(name)
    local r = train(fixture_cfg({ loss = plant_weights(c), on_nonfinite = "stop", train = { steps = 4 } }))
    T.eq(r.steps, 1, name)
    T.ok(r.stopped and r.stopped:find("stopped at step 1: non-finite loss", 1, true), tostring(r.stopped))
    -- f64 weights
    r = train(fixture_cfg({ loss = plant_weights(c), model = { dtype = "f64" } }))
    T.eq(r.skipped, 2, name .. " in an f64 model")
  end
end)

T.test("a gradient of each class (the loss stays finite): the guard names the parameter and skips", function()
  for _, c in ipairs(CLASSES) do
    local out = tmpdir("g-" .. c.f32)
    local name
    local r = train(fixture_cfg({ train = { out = out }, loss = function(m, x, y, t)
      if t == 0 then
        -- backward adds into a gradient already there: the planted payload reaches the norm read
        local w = m.model.norm.weight
        w:set_grad(plant(tide.zeros_like(w), c, function(i) return i == 0 end))
      end
      return m:loss(x, y)
    end }))
    T.eq(r.skipped, 1, c.name .. ": the first step is skipped")
    T.ok(step.is_finite(r.losses[1]) and step.is_finite(r.losses[2]), c.name .. ": the losses are finite")
    local rec = metrics(out)[1]
    T.ok(rec.skipped == true and rec.grad_norm == json.null, c.name .. ": the norm is non-finite")
    name = rec.nonfinite_tensor
    T.ok(type(name) == "string" and name:find("norm.weight", 1, true), c.name .. ": names " .. tostring(name))
  end
end)

-- rewrites the model file of checkpoint dir with every float tensor planted (metadata kept)
local function poison_checkpoint(dir, class)
  local r = checkpoint.open(dir)
  local tensors = r:tensors("model.safetensors")
  local meta = ffi.string(C.tide_safetensors_metadata(r:file("model.safetensors")))
  r:close()
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  local cn, ct = ffi.new("const char *[?]", #names), ffi.new("tide_tensor *[?]", #names)
  for i, name in ipairs(names) do
    local t = tensors[name]
    if t:is_float() then plant(t, class) end
    cn[i - 1], ct[i - 1] = name, tide.raw(t)
  end
  tide.check_status(C.tide_safetensors_save(dir .. "/model.safetensors", #names, cn, ct, meta))
end

T.test("resuming from a checkpoint whose weights are NaNs of any payload: the guard fires, no crash", function()
  for _, name in ipairs({ "0xFFEC0001 words", "all ones", "-signalling NaN", "-inf" }) do
    local c = find_class(name)
    local out = tmpdir("ck-" .. c.f32)
    train(fixture_cfg({ train = { out = out, ckpt_every = 2 } }))
    local ck = checkpoint.latest(out)
    poison_checkpoint(ck, c)
    local r = train(fixture_cfg({ resume = true, train = { out = out, steps = 4 } }))
    T.eq(r.skipped, 2, name .. ": both resumed steps skipped")
    local stop = train(fixture_cfg({ resume = ck, on_nonfinite = "stop",
      train = { out = tmpdir("ck-stop-" .. c.f32), steps = 4 } }))
    T.ok(stop.stopped and stop.stopped:find("non-finite loss", 1, true), name .. ": " .. tostring(stop.stopped))
  end
end)

-- ---- dtypes on load ------------------------------------------------------------------------------------------

-- a checkpoint of the fixture model whose tensor `name` is replaced by `repl(t)`
local function rewrite_checkpoint(dir, fn)
  local r = checkpoint.open(dir)
  local tensors = r:tensors("model.safetensors")
  local meta = ffi.string(C.tide_safetensors_metadata(r:file("model.safetensors")))
  r:close()
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  local keep, cn, ct = {}, ffi.new("const char *[?]", #names), ffi.new("tide_tensor *[?]", #names)
  for i, name in ipairs(names) do
    keep[i] = fn(name, tensors[name])
    cn[i - 1], ct[i - 1] = name, tide.raw(keep[i])
  end
  tide.check_status(C.tide_safetensors_save(dir .. "/model.safetensors", #names, cn, ct, meta))
end

T.test("an I32 or U8 tensor in place of a float weight is refused by name, dtype and the expected kind", function()
  local out = tmpdir("dtype")
  train(fixture_cfg({ train = { out = out, ckpt_every = 2 } }))
  local dir = checkpoint.latest(out)
  local victim = "model.norm.weight"
  for _, stored in ipairs({ { "i32", "I32" }, { "u8", "U8" } }) do
    rewrite_checkpoint(dir, function(name, t)
      if name == victim then return tide.ones(t:shape(), { dtype = stored[1] }) end
      return t
    end)
    T.raises(function() train(fixture_cfg({ resume = dir, train = { out = tmpdir("dtype-r"), steps = 3 } })) end,
      "model.safetensors: tensor '" .. victim .. "' is stored as " .. stored[2] ..
      ", expected a float tensor (F32, F64 or BF16): the model's tensor is f32")
  end
end)

T.test("an F64 (and a BF16) checkpoint loads into an f32 model: f64 -> f32 rounds to nearest, bf16 -> f32 is exact", function()
  local out = tmpdir("f64ck")
  local a = train(fixture_cfg({ train = { out = out, ckpt_every = 2 } }))
  local dir = checkpoint.latest(out)
  local want = {}
  for name, t in pairs(a.model:state_dict()) do want[name] = t:tolist() end
  for _, dt in ipairs({ "f64", "bf16" }) do
    rewrite_checkpoint(dir, function(_, t) return t:is_float() and t:to(dt) or t end)
    local model = require("tide.nn").build(fixture_cfg().model)
    checkpoint.load(dir, { model = model })
    for name, t in pairs(model:state_dict()) do
      local src = want[name]
      if dt == "f64" then
        T.eq(t:tolist(), src, name .. ": f32 -> f64 -> f32 is the identity")
      else
        T.eq(t:tolist(), tide.tensor(src):to("bf16"):to("f32"):tolist(), name .. ": bf16 -> f32 exactly")
      end
    end
  end
end)

T.test("the MoE selection bias: F64 in a checkpoint, and an older F32 one still loads (float -> float)", function()
  local cfg = {
    kind = "hybrid", vocab_size = 320, dim = 16, n_layers = 1, mixers = "0:1", ffn_dim = 32,
    mla = { heads = 2, q_rank = 16, kv_rank = 8, nope_dim = 8, rope_dim = 4, v_dim = 8 },
    moe = { n_experts = 4, top_k = 2, expert_dim = 16, n_shared = 1, first_dense = false },
  }
  local nn = require "tide.nn"
  local a = nn.build(cfg)
  local bias_name
  for name, t in pairs(a:state_dict()) do
    if name:find("e_score_correction_bias", 1, true) then
      bias_name = name
      t:copy_({ 0.25, -0.5, 0.125, 1 / 3 })
    end
  end
  T.ok(bias_name, "the model has a selection bias")
  local out = tmpdir("moe-bias")
  local dir = checkpoint.save(out, 1, { model = a })
  local r = checkpoint.open(dir)
  local h = r:file("model.safetensors")
  T.eq(ffi.string(C.tide_safetensors_dtype(h, C.tide_safetensors_find(h, bias_name))), "F64")
  r:close()
  rewrite_checkpoint(dir, function(name, t) return name == bias_name and t:to("f32") or t end)
  local b = nn.build(cfg)
  checkpoint.load(dir, { model = b })
  local want = tide.tensor({ 0.25, -0.5, 0.125, 1 / 3 }, { dtype = "f64" }):to("f32"):to("f64"):tolist()
  T.eq(b:state_dict()[bias_name]:tolist(), want, "the F32 bias, widened exactly")
  T.eq(b:state_dict()[bias_name]:dtype(), "f64")
end)

-- ---- files that are not regular files ---------------------------------------------------------------------
-- run `code` in a fresh `tide` process under timeout: a reader that blocks fails the test instead of hanging it.
-- Returns the probe's output line and the seconds the code took.
local cli = require "tide.cli"
local function probe(code)
  local dir = tmpdir("probe", { create = true })
  local recipe = dir .. "/probe.lua"
  local f = assert(io.open(recipe, "wb"))
  f:write("return { run = function()\n  local tide = require 'tide'\n  local t0 = tide.time()\n",
    "  local ok, err = pcall(function()\n", code, "\n  end)\n",
    "  io.write(string.format('PROBE %.3f ', tide.time() - t0), ok and 'no error' or tostring(err), '\\n')\n",
    "  return 0\nend }\n")
  f:close()
  local p = io.popen("timeout 10 '" .. cli.exe_path() .. "' run '" .. recipe .. "' 2>&1; echo \"__exit=$?\"")
  local text = p:read("*a")
  p:close()
  T.ok(not text:find("__exit=124", 1, true), "the probe timed out (a reader blocked):\n" .. text)
  local secs, line = text:match("PROBE ([%d.]+) ([^\n]*)")
  T.ok(line, "the probe printed no result:\n" .. text)
  return line, tonumber(secs)
end

local function train_code(data_path, extra)
  return string.format([[require("tide.train")({ model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 320 },
    data = { path = %q, seq_len = 16, batch_size = 2 }, train = { steps = 1, quiet = true, log_every = 1000 }%s })]],
    data_path, extra or "")
end

local function mkfifo(path)
  T.ok(os.execute("mkfifo '" .. path .. "'") == 0, "mkfifo " .. path)
end

T.test("a FIFO as the data path (text or shard): one line naming the file, at once", function()
  local dir = tmpdir("fifo-data", { create = true })
  for _, name in ipairs({ "corpus.txt", "tokens.bin" }) do
    local fifo = dir .. "/" .. name
    mkfifo(fifo)
    local line, secs = probe(train_code(fifo))
    T.ok(line:find("'" .. fifo .. "' is a FIFO (named pipe), not a regular file", 1, true), line)
    T.ok(secs < 1, string.format("refused in %.3f s", secs))
  end
  -- a FIFO inside a data directory
  local line = probe(train_code(dir))
  T.ok(line:find("is a FIFO (named pipe)", 1, true), line)
end)

T.test("/dev/zero and a character device as the data path: a clear error, no read until memory runs out", function()
  if C.tide_path_exists("/dev/zero") ~= 1 then return end
  for _, dev in ipairs({ "/dev/zero", "/dev/null" }) do
    local line, secs = probe(train_code(dev))
    T.ok(line:find("data: file '" .. dev .. "' is a character device, not a regular file", 1, true), line)
    T.ok(secs < 1, string.format("refused in %.3f s", secs))
  end
end)

T.test("a FIFO or a directory in place of model.safetensors, state.json or latest: the resume names it", function()
  local out = tmpdir("fifo-ck")
  train(fixture_cfg({ train = { out = out, ckpt_every = 2 } }))
  local dir = checkpoint.latest(out)
  local cases = {
    { file = dir .. "/model.safetensors", what = "safetensors file" },
    { file = dir .. "/state.json", what = "file" },
    { file = out .. "/ckpt/latest", what = "file" },
  }
  for _, case in ipairs(cases) do
    local saved = case.file .. ".saved"
    T.ok(os.rename(case.file, saved))
    for _, kind in ipairs({ "FIFO", "directory" }) do
      if kind == "FIFO" then mkfifo(case.file) else T.eq(C.tide_mkdir_p(case.file), 0) end
      local line, secs = probe(train_code(FIXTURE, string.format(", resume = %q", out)))
      local what = kind == "FIFO" and "a FIFO (named pipe)" or "a directory"
      T.ok(line:find(case.what .. " '" .. case.file .. "' is " .. what .. ", not a regular file", 1, true), line)
      T.ok(secs < 1, string.format("refused in %.3f s", secs))
      T.eq(C.tide_remove_tree(case.file), 0)
    end
    T.ok(os.rename(saved, case.file))
  end
end)

T.test("state files are read up to a cap: tide.read_file and json.read name the file and the limit", function()
  local dir = tmpdir("cap", { create = true })
  local path = dir .. "/state.json"
  local text = '{"step": 1, "pad": "' .. string.rep("x", 100) .. '"}'
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  T.eq(json.read(path).step, 1)
  T.raises(function() json.read(path, 64) end,
    string.format("json: file '%s' is %d bytes, over the limit of 64 bytes", path, #text))
  local none, err = tide.read_file(path, 64)
  T.ok(none == nil and err:find("over the limit", 1, true), tostring(err))
  T.eq(tide.STATE_FILE_LIMIT, 64 * 2 ^ 20)
  T.raises(function() json.read(dir .. "/missing.json") end, "No such file or directory")
end)

-- optim.safetensors of checkpoint dir: its tensors by name, and a writer of such a table (metadata kept)
local function read_optim(dir)
  local r = checkpoint.open(dir)
  local tensors = r:tensors("optim.safetensors")
  local meta = ffi.string(C.tide_safetensors_metadata(r:file("optim.safetensors")))
  r:close()
  return tensors, meta
end
local function write_optim(dir, tensors, meta)
  local names = {}
  for name in pairs(tensors) do names[#names + 1] = name end
  table.sort(names)
  local cn, ct = ffi.new("const char *[?]", #names), ffi.new("tide_tensor *[?]", #names)
  for i, name in ipairs(names) do cn[i - 1], ct[i - 1] = name, tide.raw(tensors[name]) end
  tide.check_status(C.tide_safetensors_save(dir .. "/optim.safetensors", #names, cn, ct, meta))
end

T.test("AdamW state on resume: an I32 moment is refused by name; NaN payloads or inf in it stop the run", function()
  local out = tmpdir("optim-state")
  train(fixture_cfg({ train = { out = out, ckpt_every = 2 } }))
  local dir = checkpoint.latest(out)
  local orig, meta = read_optim(dir)
  local function with(name, t)
    local ts = {}
    for k, v in pairs(orig) do ts[k] = v end
    ts[name] = t
    write_optim(dir, ts, meta)
  end
  local w = "model.norm.weight"
  with(w .. ".adam_v", tide.ones(orig[w .. ".adam_v"]:shape(), { dtype = "i32" }))
  T.raises(function() train(fixture_cfg({ resume = dir, train = { out = tmpdir("optim-i32"), steps = 3 } })) end,
    "optim.safetensors: tensor '" .. w .. ".adam_v' is stored as I32, expected a float tensor (F32, F64 or BF16): " ..
    "optimiser state is float")
  -- the update's own flag: a bad m makes the weight bad; a NaN v too; an infinite v leaves the weight finite (the
  -- step is 0) and only the state is named, which a check of the weights alone would miss
  for _, name in ipairs({ "0xFFEC0001 words", "all ones", "+inf" }) do
    local c = find_class(name)
    for _, slot in ipairs({ "adam_m", "adam_v" }) do
      local key = w .. "." .. slot
      with(key, plant(orig[key]:clone(), c, function(i) return i == 0 end))
      local r = train(fixture_cfg({ resume = dir, on_nonfinite = "stop",
        train = { out = tmpdir("optim-nan"), steps = 4 } }))
      local want = (slot == "adam_v" and c.kind == "inf") and ("AdamW state " .. key) or ("weight " .. w)
      T.ok(r.stopped and r.stopped:find("stopped at step 3: non-finite " .. want .. " after the update", 1, true),
        name .. " in " .. slot .. ": " .. tostring(r.stopped))
    end
  end
  write_optim(dir, orig, meta)
end)

-- ---- errors ---------------------------------------------------------------------------------------------------

T.test("a run-time error is one line; the Lua traceback only under TIDE_TRACEBACK=1 or --debug", function()
  local cli = require "tide.cli"
  local dir = tmpdir("tb", { create = true })
  local recipe = dir .. "/recipe.lua"
  local f = assert(io.open(recipe, "wb"))
  f:write("return { run = function() error('the disk said no') end }\n")
  f:close()
  local function run(env, flag)
    local p = io.popen(env .. " '" .. cli.exe_path() .. "' run '" .. recipe .. "'" .. flag .. " 2>&1; echo \"__exit=$?\"")
    local out = p:read("*a")
    p:close()
    return out:gsub("__exit=%d+%s*$", ""), tonumber(out:match("__exit=(%d+)%s*$"))
  end
  local out, code = run("TIDE_TRACEBACK=", "")
  T.eq(code, 1, out)
  T.ok(out:find(recipe .. ":1: the disk said no", 1, true), out)
  T.ok(not out:find("stack traceback", 1, true), "no traceback by default:\n" .. out)
  local _, lines = out:gsub("\n", "")
  T.eq(lines, 1, "one line:\n" .. out)
  for _, how in ipairs({ { "TIDE_TRACEBACK=1", "" }, { "TIDE_TRACEBACK=", " --debug" } }) do
    out, code = run(how[1], how[2])
    T.eq(code, 1, out)
    T.ok(out:find("the disk said no", 1, true) and out:find("stack traceback", 1, true), how[1] .. how[2] .. ":\n" .. out)
  end
end)

T.run()
