-- run directories: a fresh run never writes into another run's directory (it stops with one line naming what is
-- there) unless --overwrite; --resume continues the run that is there; nothing of another run is deleted or pruned,
-- not even by keep_ckpts after resuming from an earlier checkpoint.
local T = require "tide.testing"
local tide = require "tide"
local checkpoint = require "tide.checkpoint"
local train = require "tide.train"

local FIXTURE = "tests/fixtures/tiny_corpus.txt"

local function cfg(out, over)
  local c = {
    model = { dim = 16, n_layers = 1, n_heads = 2, vocab_size = 320 },
    data = { path = FIXTURE, doc_separator = "%", val_fraction = 0.1, seq_len = 16, batch_size = 2 },
    optim = { lr = 3e-3 },
    schedule = { kind = "cosine", warmup = 1 },
    train = { steps = 6, ckpt_every = 2, keep_ckpts = 5, log_every = 1000, seed = 1, quiet = true, eval_batches = 1,
      out = out },
  }
  for k, v in pairs(over or {}) do
    if type(v) == "table" and type(c[k]) == "table" then for kk, vv in pairs(v) do c[k][kk] = vv end else c[k] = v end
  end
  return c
end

local read = T.read

-- every file of a run directory (checkpoint files included) -> its bytes
local function snapshot(dir)
  local files = {}
  local p = io.popen("cd '" .. dir .. "' && find . -type f | sort")
  for name in p:lines() do files[name] = read(dir .. "/" .. name) end
  p:close()
  return files
end

local function same(a, b, what)
  local n = 0
  for name, bytes in pairs(a) do
    n = n + 1
    T.ok(b[name] == bytes, what .. ": " .. name .. " unchanged")
  end
  for name in pairs(b) do T.ok(a[name] ~= nil, what .. ": no new file " .. name) end
  return n
end

T.test("a second fresh run into the same directory refuses in one line; both runs' files are intact", function()
  local a, b = T.tmpdir("a"), T.tmpdir("b")
  train(cfg(a))
  train(cfg(b, { train = { steps = 4 } }))
  local before_a, before_b = snapshot(a), snapshot(b)
  T.ok(before_a["./metrics.jsonl"] and before_a["./ckpt/step_00000006/model.safetensors"], "run a wrote its files")
  local ok, e = pcall(train, cfg(a, { train = { steps = 2 } }))
  T.ok(not ok, "refused")
  e = tostring(e)
  T.ok(e:find("'" .. a .. "' holds another run (ckpt/ with 3 checkpoints, config.json, ", 1, true), e)
  T.ok(e:find("metrics.jsonl", 1, true), e)
  T.ok(e:find("--resume", 1, true) and e:find("--overwrite", 1, true), e)
  T.ok(not e:find("\n"), "one line")
  -- resuming a's checkpoint into b (which holds its own run) is refused as well
  ok, e = pcall(train, cfg(b, { resume = a .. "/ckpt/step_00000004", train = { steps = 6 } }))
  T.ok(not ok and tostring(e):find("holds another run", 1, true) and tostring(e):find("is not one of its checkpoints", 1,
    true), tostring(e))
  T.ok(same(before_a, snapshot(a), "run a") >= 10, "run a's files compared")
  same(before_b, snapshot(b), "run b")
end)

T.test("--overwrite replaces the run that is there; --resume continues it", function()
  local d = T.tmpdir("ow")
  train(cfg(d))
  T.write(d .. "/notes.txt", "mine\n")      -- not a run's file: --overwrite leaves it
  local r = train(cfg(d, { overwrite = true, train = { steps = 4 } }))
  T.eq(read(d .. "/notes.txt"), "mine\n", "a file that is not the run's stays")
  T.eq(r.steps, 4)
  T.eq(checkpoint.list(d), { "step_00000002", "step_00000004" }, "only the new run's checkpoints")
  local steps = {}
  for line in io.lines(d .. "/metrics.jsonl") do
    local s = line:match('"step":(%d+)')
    if s and not line:find('"event"', 1, true) then steps[#steps + 1] = tonumber(s) end
  end
  T.eq(steps[1], 1, "the new history starts at step 1")
  T.eq(steps[#steps], 4)
  local r2 = train(cfg(d, { resume = true, train = { steps = 6 } }))
  T.eq(r2.steps, 6)
  T.eq(checkpoint.list(d), { "step_00000002", "step_00000004", "step_00000006" })
end)

T.test("resuming from an earlier checkpoint: the later ones stay until this run reaches their steps", function()
  local d = T.tmpdir("later")
  train(cfg(d, { train = { steps = 8 } }))
  T.eq(checkpoint.list(d), { "step_00000002", "step_00000004", "step_00000006", "step_00000008" })
  local later = snapshot(d)["./ckpt/step_00000008/model.safetensors"]
  -- keep_ckpts = 1 used to prune the newest checkpoints of the resumed run and keep the abandoned later ones
  train(cfg(d, { resume = d .. "/ckpt/step_00000002", train = { steps = 4, keep_ckpts = 1 } }))
  T.eq(checkpoint.list(d), { "step_00000004", "step_00000006", "step_00000008" },
    "step 2 pruned (keep 1 up to step 4); 6 and 8 kept")
  T.eq(read(d .. "/ckpt/latest"), "step_00000004\n", "latest names this run's newest")
  T.eq(read(d .. "/ckpt/step_00000008/model.safetensors"), later, "the later checkpoint is untouched")
end)

T.test("the run's config: config.json in the run directory and tide.config in every checkpoint; tide.model resolved", function()
  local json = require "tide.json"
  local d = T.tmpdir("config")
  train(cfg(d))
  local written = json.decode(read(d .. "/config.json"))
  T.eq(written.train.steps, 6); T.eq(written.model.dim, 16); T.eq(written.train.out, d)
  local list = checkpoint.list(d)
  T.eq(#list, 3)
  for _, name in ipairs(list) do
    local meta = checkpoint.open(d .. "/ckpt/" .. name):metadata("model.safetensors")
    T.eq(json.encode(json.decode(meta["tide.config"])), json.encode(written), name .. ": tide.config is config.json")
    local m = json.decode(meta["tide.model"])
    T.eq(m.kind, "dense")
    -- the model's config with every default filled in, so a changed default cannot change a rebuilt model
    T.eq({ m.config.ffn_dim, m.config.head_dim, m.config.norm_eps, m.config.rope_theta, m.config.tie_embeddings },
      { 64, 8, 1e-5, 10000, false }, name)
  end
  local _, info = checkpoint.load_model(d .. "/ckpt/" .. list[1])
  T.eq({ info.step, info.config.train.steps, info.model_config.ffn_dim }, { 2, 6, 64 }, "rebuilt from the checkpoint alone")
end)

T.test("train.tensorboard = false: no events file beside metrics.jsonl (on by default)", function()
  local on, off = T.tmpdir("tb-on"), T.tmpdir("tb-off")
  train(cfg(on, { train = { steps = 2, ckpt_every = 0 } }))
  train(cfg(off, { train = { steps = 2, ckpt_every = 0, tensorboard = false } }))
  local function events(d)
    local n = 0
    local p = io.popen("ls -1 '" .. d .. "'")
    for name in p:lines() do if name:match("^events%.out%.tfevents%.") then n = n + 1 end end
    p:close()
    return n
  end
  T.eq({ events(on), events(off) }, { 1, 0 })
  T.ok(read(off .. "/metrics.jsonl"):find('"step":2', 1, true), "metrics still written")
end)

T.run()
