-- bench/torch_hybrid.py, the PyTorch baseline of bench/hybrid.lua, against tide: at tide's weights on tide's batch
-- (B 2 x T 40: the last KDA chunk ragged) it computes the same loss and the same gradient for every parameter, and
-- two training steps from there (clip, AdamW, the Quantile Balancing bias update) give the same losses and biases —
-- in f64, for both benchmark models (tiny-hybrid: the latent router; quickstart: the sigmoid router), and the same
-- loss in f32. Needs Python with torch (build/pyenv, scripts/test_deps.sh); skipped, saying so, without it.
local T = require "tide.testing"
local tide = require "tide"
local json = require "tide.json"
local cli = require "tide.cli"

local PYTHON = "build/pyenv/bin/python"
local bench = dofile("bench/hybrid.lua")
local TOL = bench.tolerances

local function torch_version()
  local p = io.popen(cli.shell_quote(PYTHON) .. " -c 'import torch; print(torch.__version__)' 2>/dev/null")
  local v = p and p:read("*l")
  if p then p:close() end
  return v ~= nil and v ~= "" and v or nil
end

local function ask(path, steps)
  local cmd = string.format("%s bench/torch_hybrid.py --check %s --steps %d --threads 1 2>&1", cli.shell_quote(PYTHON),
    cli.shell_quote(path), steps)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local line = out:match("({.*})%s*$")
  T.ok(line ~= nil, "torch_hybrid.py --check printed no JSON: " .. out:sub(-600))
  return json.decode(line)
end

local VERSION = torch_version()

local function each_model(fn)
  if not VERSION then
    print("    skipped: " .. PYTHON .. " cannot import torch (scripts/test_deps.sh makes build/pyenv over Debian's python3-torch)")
    return
  end
  local tmp = T.tmpdir("torch_hybrid", { create = true })
  for _, c in ipairs(bench.configs) do fn(c, tmp) end
end

T.test("torch_hybrid.py == tide in f64: loss, every gradient, two training steps (AdamW, QB), the no-decay group", function()
  each_model(function(c, tmp)
    local r = bench.compare(c.model, "f64", 2, 40, 2, ask, tmp, c.name)
    T.ok(r.loss_rel_delta <= TOL.f64_loss, string.format("%s: loss %.15g vs tide %.15g (rel %.3g)", c.name, r.loss,
      r.tide_loss, r.loss_rel_delta))
    T.eq(r.grads_compared, r.tide_tensors, c.name .. ": every parameter's gradient compared")
    T.ok(r.grad_max_rel_delta <= TOL.f64_grad, string.format("%s: gradient of %s: rel delta %.3g", c.name,
      tostring(r.grad_worst), r.grad_max_rel_delta))
    T.ok(r.train_max_rel_delta <= TOL.f64_train, string.format("%s: training losses %s vs tide %s", c.name,
      json.encode(r.train_losses), json.encode(r.tide_train_losses)))
    T.ok(r.bias_max_abs_delta <= 1e-9, string.format("%s: QB biases differ by %.3g", c.name, r.bias_max_abs_delta))
    T.ok(r.no_decay_same, c.name .. ": AdamW's no-decay group")
    T.ok(r.train_losses[2] < r.train_losses[1], c.name .. ": the second step's loss is lower")
  end)
end)

T.test("torch_hybrid.py == tide in f32: loss within 1e-5, gradient norm within 1e-4 (relative)", function()
  each_model(function(c, tmp)
    local r = bench.compare(c.model, "f32", 2, 40, 0, ask, tmp, c.name)
    T.ok(r.loss_rel_delta <= TOL.f32_loss, string.format("%s: loss rel delta %.3g", c.name, r.loss_rel_delta))
    T.ok(r.grad_norm_rel_delta <= TOL.f32_grad_norm, string.format("%s: grad norm rel delta %.3g", c.name,
      r.grad_norm_rel_delta))
  end)
end)

T.run()
