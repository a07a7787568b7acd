-- step: the one training step under both drivers — tide.train and a one-stage curriculum over the same packed data
-- give the same losses bit for bit; tide.train's micro-batches change nothing but memory; the checkpoint state has
-- one shape with a format version, an older format loads and a newer one is refused by name.
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local checkpoint = require "tide.checkpoint"
local train = require "tide.train"
local curriculum = require "tide.curriculum"
local step = require "tide.step"

local FIXTURE = "tests/fixtures/tiny_corpus.txt"
local tmpdir = T.tmpdir     -- removed when T.run ends

-- a 2-layer hybrid (KDA then MLA) with MoE FFNs (Quantile Balancing) and Block AttnRes
local function model(dtype)
  return {
    kind = "hybrid", vocab_size = 320, dim = 16, n_layers = 2, mixers = "3:1", ffn_dim = 32, activation = "situ",
    kda = { heads = 2, head_dim = 8 }, mla = { heads = 2, q_rank = 16, kv_rank = 8, nope_dim = 8, rope_dim = 4, v_dim = 8 },
    moe = { n_experts = 4, top_k = 2, expert_dim = 16, n_shared = 1, first_dense = false },
    residual = "attnres_block", attnres = { block_layers = 1 }, dtype = dtype,
  }
end
local SOURCES = { text = { kind = "text", path = FIXTURE, doc_separator = "%", val_fraction = 0.1 } }
local OPTIM = { lr = 3e-3, weight_decay = 0.1, clip = 1.0 }

local function train_cfg(over)
  local cfg = {
    model = model(), optim = { lr = OPTIM.lr, weight_decay = OPTIM.weight_decay, clip = OPTIM.clip },
    schedule = { kind = "constant" }, data = { sources = SOURCES, seq_len = 32, batch_size = 8 },
    train = { steps = 8, seed = 5, quiet = true, log_every = 1000, micro_batches = 2 },
  }
  for k, v in pairs(over or {}) do
    if type(v) == "table" and type(cfg[k]) == "table" then
      for kk, vv in pairs(v) do cfg[k][kk] = vv end
    else
      cfg[k] = v
    end
  end
  return cfg
end

T.test("a recipe's own loss over packed documents runs the batch as the default objective does (document boundaries)", function()
  -- f64, one micro-batch: the default objective's Σ/N and the model's mean cross-entropy differ only in rounding; a
  -- loss whose forward saw no document boundaries (attention across documents) is off by far more
  local base = { model = model("f64"), train = { steps = 3, seed = 5, quiet = true, log_every = 1000, micro_batches = 1 } }
  local a = train(train_cfg(base))
  local seen
  local own = train_cfg(base)
  own.loss = function(m, x, y, t, ctx)
    seen = ctx
    return m:loss(x, y)
  end
  local b = train(own)
  for s = 1, 3 do
    T.ok(math.abs(a.losses[s] - b.losses[s]) <= 1e-12 * a.losses[s],
      string.format("step %d: default %.17g vs own loss %.17g", s, a.losses[s], b.losses[s]))
  end
  T.eq(seen.micro, 1)
  T.ok(seen.targets > 0, "the step's target count reaches the loss")
  -- the same loss on the model itself (no boundaries): the packed rows' documents attend to each other
  local cross = train_cfg(base)
  cross.loss = function(m, x, y) return rawget(m, "forward") and getmetatable(m).__index:loss(x, y) or m:loss(x, y) end
  local c = train(cross)
  T.ok(math.abs(a.losses[2] - c.losses[2]) > 1e-6 * a.losses[2],
    string.format("attention across the documents changes the loss: %.17g vs %.17g", a.losses[2], c.losses[2]))
end)

T.test("tide.train and a one-stage curriculum over the same data: the same losses bit for bit", function()
  local a = train(train_cfg())
  local c = curriculum.train(curriculum.new({
    model = model(), optim = OPTIM, tokens_per_step = 256, micro_tokens = 128, sources = SOURCES,
    stages = { { name = "only", seq_len = 32, steps = 8, mix = { text = 1 }, lr = { kind = "constant", from = 3e-3 } } },
    train = { seed = 5, quiet = true, log_every = 1000 },
  }))
  T.eq(a.steps, 8)
  T.eq(c.steps, 8)
  for s = 1, 8 do
    T.ok(a.losses[s] == c.losses[s], string.format("step %d: tide.train %.17g vs curriculum %.17g", s, a.losses[s],
      c.losses[s]))
  end
  T.ok(a.losses[8] < a.losses[1], "the loss falls")
  -- the models end equal: every weight and the MoE selection bias (a balancer ran the same way under both)
  local sa, sc = a.model:state_dict(), c.model:state_dict()
  for name, t in pairs(sa) do T.eq(t:tolist(), sc[name]:tolist(), name) end
end)

T.test("train.micro_batches = 1, 2, 4 give the same losses (f64, 1e-12) and a clear error when it does not divide", function()
  local losses = {}
  for _, micro in ipairs({ 1, 2, 4 }) do
    local r = train(train_cfg({ model = model("f64"), train = { steps = 4, micro_batches = micro } }))
    losses[micro] = r.losses
  end
  for _, micro in ipairs({ 2, 4 }) do
    for s = 1, 4 do
      T.near(losses[micro][s], losses[1][s], 1e-12 * (1 + math.abs(losses[1][s])), string.format("micro %d step %d", micro, s))
    end
  end
  -- a plain text stream splits its batch into micro-batches the same way
  local plain = { model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 320, dtype = "f64" },
    data = { path = FIXTURE, seq_len = 16, batch_size = 4 }, optim = OPTIM,
    train = { steps = 3, seed = 2, quiet = true, log_every = 1000 } }
  local p1 = train(plain)
  plain.train.micro_batches = 4
  local p4 = train(plain)
  for s = 1, 3 do T.near(p4.losses[s], p1.losses[s], 1e-12 * (1 + p1.losses[s]), "text stream step " .. s) end
  -- a synthetic task labels only some positions: the step counts each micro-batch's targets, so the split still
  -- divides by the whole step's labels (MQAR: num_pairs of 64 positions per row)
  local task = { model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 64, dtype = "f64" },
    data = { task = "mqar", seq_len = 64, num_pairs = 4, batch_size = 4, seed = 5 }, optim = OPTIM,
    train = { steps = 3, seed = 2, quiet = true, log_every = 1000 } }
  local q1 = train(task)
  task.train.micro_batches = 2
  local q2 = train(task)
  for s = 1, 3 do T.near(q2.losses[s], q1.losses[s], 1e-12 * (1 + q1.losses[s]), "mqar step " .. s) end
  -- per labelled target: near ln 64 = 4.16 at the start (dividing by every position would give about a 16th of it)
  T.ok(q1.losses[1] > 3.5 and q1.losses[1] < 5, "first MQAR loss " .. q1.losses[1])
  -- the shared preflight refuses a model on a device this machine lacks before anything is allocated
  if not tide.cuda_available() then
    local m = model()
    m.device = "cuda"
    T.raises(function() train(train_cfg({ model = m })) end,
      "tide.train: the model runs on cuda, but this build or machine has no CUDA device")
  end
  T.raises(function() train(train_cfg({ train = { micro_batches = 3 } })) end,
    "tide.train: train.micro_batches 3 does not divide the batch of 8 rows")
end)

T.test("checkpoint state: one shape with a format version; format 1 loads, a newer format is refused by name", function()
  local out = tmpdir("fmt")
  local a = train(train_cfg({ train = { steps = 6, ckpt_every = 3, keep_ckpts = 5, out = out } }))
  local ck = out .. "/ckpt/" .. checkpoint.dir_name(3)
  local rd = checkpoint.open(ck)
  local st = rd.state
  T.eq({ st.format, st.driver, st.step, st.schedule.step }, { step.FORMAT, "train", 3, 3 })
  T.ok(st.data.train and st.rng.seed and st.rng.offset and st.optim.t == 3 and #st.moe == 2, "cursors, rng, optim, moe")
  T.eq(rd:metadata("model.safetensors")["tide.format"], tostring(step.FORMAT))
  rd:close()

  -- rewrite the state in format 1 (no format, no driver, no schedule): the run resumes bit-identically
  local path = ck .. "/state.json"
  local function rewrite(fn)
    local f = assert(io.open(path, "rb"))
    local s = json.decode(f:read("*a"))
    f:close()
    fn(s)
    f = assert(io.open(path, "wb"))
    f:write(json.encode(s))
    f:close()
  end
  rewrite(function(s) s.format, s.driver, s.schedule = nil, nil, nil end)
  local b = train(train_cfg({ resume = ck, train = { steps = 6, out = tmpdir("fmt1") } }))
  for s = 4, 6 do T.ok(b.losses[s] == a.losses[s], string.format("step %d after a format-1 resume", s)) end

  rewrite(function(s) s.format = 99 end)
  T.raises(function() train(train_cfg({ resume = ck, train = { steps = 6, out = tmpdir("fmt99") } })) end,
    "has state format 99; this build reads formats 1 to " .. step.FORMAT)

  -- a curriculum refuses a tide.train checkpoint (and names both)
  rewrite(function(s) s.format, s.driver, s.schedule = step.FORMAT, "train", { step = s.step } end)
  T.raises(function()
    curriculum.train(curriculum.new({ model = model(), optim = OPTIM, tokens_per_step = 256, sources = SOURCES,
      stages = { { seq_len = 32, steps = 6, mix = { text = 1 } } }, train = { quiet = true }, resume = ck }))
  end, "was written by tide.train, not a curriculum")
end)

T.test("numeric config fields: integers are integers, counts positive, rates finite, each refused by name", function()
  local inf, nan = math.huge, 0 / 0
  local cases = {
    { { train = { steps = -5 } }, "train.steps must be a positive integer, got -5" },
    { { train = { steps = 0 } }, "train.steps must be a positive integer, got 0" },
    { { train = { steps = nan } }, "train.steps must be a positive integer, got nan" },
    { { train = { steps = inf } }, "train.steps must be a positive integer, got inf" },
    { { train = { steps = 2.5 } }, "train.steps must be a positive integer, got 2.5" },
    { { train = { ckpt_every = 1.5 } }, "train.ckpt_every must be a non-negative integer, got 1.5" },
    { { train = { log_every = -1 } }, "train.log_every must be a positive integer, got -1" },
    { { train = { threads = 0 } }, "train.threads must be a positive integer, got 0" },
    { { threads = 0 }, "threads must be a positive integer, got 0" },
    { { train = { seed = -1 } }, "train.seed must be an integer in [0, 2^32), got -1" },
    { { optim = { lr = inf } }, "optim.lr must be a finite number > 0, got inf" },
    { { optim = { lr = nan } }, "optim.lr must be a finite number > 0, got nan" },
    { { optim = { eps = inf } }, "optim.eps must be a finite number > 0, got inf" },
    { { optim = { clip = inf } }, "optim.clip must be a finite number >= 0, got inf" },
    { { optim = { weight_decay = -inf } }, "optim.weight_decay must be a finite number >= 0, got -inf" },
    { { optim = { betas = { 0.9, 1 } } }, "optim.betas[2] must be a number in [0, 1), got 1" },
    { { sample = { top_k = -inf } }, "sample.top_k must be a non-negative integer, got -inf" },
    { { sample = { top_p = 0 } }, "sample.top_p must be a number in (0, 1], got 0" },
    { { expect = { final_loss_below = nan } }, "expect.final_loss_below must be a finite number, got nan" },
  }
  for _, case in ipairs(cases) do
    T.raises(function() train(train_cfg(case[1])) end, "tide.train: " .. case[2])
  end
  -- the shared part every driver calls with its own name
  T.raises(function() step.check_numbers({ train = { ckpt_every = 1.5 } }, "curriculum") end,
    "curriculum: train.ckpt_every must be a non-negative integer, got 1.5")
  T.raises(function() step.check_numbers({ optim = { lr = math.huge } }, "curriculum") end,
    "curriculum: optim.lr must be a finite number > 0, got inf")
  step.check_numbers({ train = { log_every = 5 }, optim = { lr = 1e-3, clip = false } }, "curriculum")
end)

T.test("resuming a finished run: one line, exit 0, the checkpoint left as it was", function()
  local out = tmpdir("finished")
  local cfg = train_cfg({ train = { steps = 3, out = out }, expect = { final_loss_below = 100 } })
  T.eq(train.run(cfg), 0)
  local latest = checkpoint.latest(out)
  cfg.resume = true
  local r = train(cfg)
  T.eq({ r.steps, r.steps_run, r.expect_met }, { 3, 0, nil })
  T.eq(train.run(cfg), 0, "exit 0")
  T.eq(checkpoint.latest(out), latest)
  T.eq(checkpoint.list(out), { checkpoint.dir_name(3) })
end)

local _, failed = T.run({ exit = false })
os.exit(failed > 0 and 1 or 0)
