-- testing: the helpers tide.testing shares with every test file (max_abs_diff, max_abs, tmpdir).
local T = require "tide.testing"
local tide = require "tide"

T.test("max_abs_diff and max_abs: tensors or lists; NaN is math.huge; unequal counts are an error", function()
  local a = tide.tensor({ 1, -2, 3.5 }, { dtype = "f64" })
  local b = tide.tensor({ 1.25, -2, 3 }, { dtype = "f64" })
  T.eq(T.max_abs_diff(a, b), 0.5)
  T.eq(T.max_abs_diff({ 1, 2 }, { 1, 2 }), 0)
  T.eq(T.max_abs_diff({ 0, 0 / 0 }, { 0, 1 }), math.huge)
  T.raises(function() T.max_abs_diff({ 1, 2 }, { 1 }) end, "max_abs_diff: 2 elements vs 1")
  T.eq(T.max_abs(a), 3.5)
  T.eq(T.max_abs({ -7, 2 }), 7)
end)

T.test("tmpdir: a fresh path per call, created on request", function()
  local a = T.tmpdir("helpers", { create = true })
  T.eq(tide.C.tide_path_exists(a), 1)
  local f = assert(io.open(a .. "/x.txt", "w")); f:write("x"); f:close()
  local b = T.tmpdir("helpers-bare")
  T.eq(tide.C.tide_path_exists(b), 0, "not created without create = true")
  T.ok(a ~= b)
end)

T.run()
