-- options: the option-table and argument checks every tide module uses (messages, and the line they point at).
local T = require "tide.testing"
local options = require "tide.options"

local THIS = "test_options.lua:"

-- the line of the call in `fn`'s body: errors must carry it
local function line_of(fn) return debug.getinfo(fn, "S").linedefined end

T.test("check: an unknown key names the table, the key and the sorted known keys", function()
  local known = { heads = true, dim = true, chunk = true }
  T.eq(options.check({ heads = 2, dim = 8 }, known, "options", "nn.KDA"), { heads = 2, dim = 8 })
  local e = T.raises(function() options.check({ heads = 2, headz = 1 }, known, "options", "nn.KDA") end,
    "nn.KDA: unknown key 'headz' in options; known keys: chunk, dim, heads")
  T.ok(not e:find("\n", 1, true), "one line: " .. e)
  -- without `where` the table is who's own: the message leaves the "in ..." out
  T.raises(function() options.check({ widht = 1 }, known, nil, "model") end,
    "model: unknown key 'widht'; known keys: chunk, dim, heads")
  T.raises(function() options.check(false, known, nil, "model") end, "model: options must be a table, got a boolean")
end)

T.test("check: a non-table is an error naming its type", function()
  T.raises(function() options.check(3, {}, "config", "pack") end, "pack: config must be a table, got a number")
  T.raises(function() options.check(nil, {}, "sources[2]", "pack") end, "pack: sources[2] must be a table, got a nil")
end)

T.test("errors point at the caller's line outside tide, even through tide frames", function()
  local fn = function() options.check({ x = 1 }, {}, "options", "who") end
  local e = T.raises(fn, "who: unknown key 'x'")
  T.ok(e:find(THIS .. line_of(fn) .. ":", 1, true), "location: " .. e)
  -- a function inside lua/tide that validates on behalf of its caller: the error skips its frame
  local dir = debug.getinfo(options.check, "S").source:match("^@(.*[/\\])")
  local inner = assert(load("local o = ...; return function(t) o.check(t, {}, 'options', 'inner') end",
                            "@" .. dir .. "fake_module.lua"))(options)
  local l0 = debug.getinfo(1, "l").currentline
  local ok, err = pcall(function()
    inner({ y = 1 })
  end)
  T.ok(not ok, "an unknown key was accepted")
  T.ok(err:find(THIS .. (l0 + 2) .. ": inner: unknown key 'y'", 1, true), "location: " .. err)
end)

T.test("fail: an explicit level counts from the function that called fail, as error() does", function()
  local function callee() options.fail("op", "bad thing", 2) end
  local l = debug.getinfo(1, "l").currentline
  local ok, e = pcall(function() callee() end)
  T.ok(not ok)
  T.ok(e:find(THIS .. (l + 1) .. ": op: bad thing", 1, true), "location: " .. e)
  local ok0, e0 = pcall(function() options.fail("op", "no position", 0) end)
  T.eq(ok0, false)
  T.eq(e0, "op: no position")
end)

T.test("pos_int, nonneg_int, int_at_least: integers in range pass, the rest name the value", function()
  T.eq(options.pos_int(3, "heads", "nn.KDA"), 3)
  T.raises(function() options.pos_int(0, "heads", "nn.KDA") end, "nn.KDA: heads must be a positive integer, got 0")
  T.raises(function() options.pos_int(2.5, "heads", "nn.KDA") end, "heads must be a positive integer, got 2.5")
  T.raises(function() options.pos_int("2", "heads", "nn.KDA") end, "heads must be a positive integer, got 2")
  T.raises(function() options.pos_int(nil, "heads", "nn.KDA") end, "heads must be a positive integer, got nil")
  T.raises(function() options.pos_int(0 / 0, "heads", "x") end, "heads must be a positive integer")
  T.raises(function() options.pos_int(math.huge, "heads", "x") end, "heads must be a positive integer, got inf")
  T.eq(options.nonneg_int(0, "rope_dim", "nn.MLA"), 0)
  T.raises(function() options.nonneg_int(-1, "rope_dim", "nn.MLA") end,
    "nn.MLA: rope_dim must be a non-negative integer, got -1")
  T.eq(options.int_at_least(2, 2, "conv_size", "nn.KDA"), 2)
  T.raises(function() options.int_at_least(1, 2, "conv_size", "nn.KDA") end,
    "nn.KDA: conv_size must be an integer >= 2, got 1")
end)

T.test("seed: an integer in [0, 2^32)", function()
  T.eq(options.seed(0, "seed", "pack"), 0)
  T.eq(options.seed(2 ^ 32 - 1, "seed", "pack"), 2 ^ 32 - 1)
  T.raises(function() options.seed(2 ^ 32, "seed", "pack") end, "pack: seed must be an integer in [0, 2^32), got 4294967296")
  T.raises(function() options.seed(-1, "text_source seed", "pack") end, "text_source seed must be an integer in [0, 2^32)")
  T.raises(function() options.seed(0.5, "seed", "pack") end, "got 0.5")
end)

T.test("number_in: closed interval, NaN refused", function()
  T.eq(options.number_in(0.5, 0, 1, "rate", "nn.MoE"), 0.5)
  T.eq(options.number_in(1, 0, 1, "rate", "nn.MoE"), 1)
  T.raises(function() options.number_in(1.5, 0, 1, "rate", "nn.MoE") end, "nn.MoE: rate must be a number in [0, 1], got 1.5")
  T.raises(function() options.number_in(0 / 0, 0, 1, "rate", "nn.MoE") end, "rate must be a number in [0, 1]")
  T.raises(function() options.number_in("0.5", 0, 1, "rate", "nn.MoE") end, "rate must be a number in [0, 1], got 0.5")
end)

T.test("one_of: a key of the set, the message lists the choices quoted and sorted", function()
  local set = { sigmoid = true, softmax = true, latent = true }
  T.eq(options.one_of("softmax", set, "router", "nn.MoE"), "softmax")
  T.raises(function() options.one_of("relu", set, "router", "nn.MoE") end,
    'nn.MoE: router must be one of "latent", "sigmoid", "softmax", got "relu"')
  T.raises(function() options.one_of(nil, set, "router", "nn.MoE") end, "got nil")
end)

T.test("sorted_keys and with_defaults", function()
  T.eq(options.sorted_keys({ b = 1, a = 2, c = 3 }), { "a", "b", "c" })
  T.eq(options.sorted_keys({}), {})
  local known = { a = true, b = true }
  local out = options.with_defaults({ b = 5 }, { a = 1, b = 2 }, known, "cfg", "x")
  T.eq(out, { a = 1, b = 5 })
  T.raises(function() options.with_defaults({ c = 1 }, { a = 1 }, known, "cfg", "x") end,
    "x: unknown key 'c' in cfg; known keys: a, b")
end)

T.run()
