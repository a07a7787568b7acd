-- the data half of native vision (spec/vision.md §2, §7, §8; formats.md §5): resizing to the patch budget against
-- Pillow's BICUBIC, image.prepare's shapes (oracle 5), image-text documents and their loss masks, the packer's image
-- spans, batches and exact resume, the squares and digits sources, gunzip, and JSONL documents with images.
-- Needs /usr/bin/python3 with python3-pil and python3-sklearn (scripts/test_deps.sh).
local T = require "tide.testing"
local tide = require "tide"
local ffi = require "ffi"
local cli = require "tide.cli"
local image = require "tide.data.image"

local fmt = string.format
local PY = "/usr/bin/python3"
local SK_IMAGES = "/usr/lib/python3/dist-packages/sklearn/datasets/images"

local function write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end
local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end
local function bytes_of(t)
  local n = t:numel()
  local buf = ffi.new("uint8_t[?]", n)
  tide.check_status(tide.C.tide_read_bytes(tide.raw(t), buf, n))
  return buf, n
end
local function floats_of(t)
  local n = t:numel()
  local buf = ffi.new("float[?]", n)
  tide.check_status(tide.C.tide_read_bytes(tide.raw(t), buf, 4 * n))
  return buf, n
end

-- "resize IN.rgb H W H2 W2 OUT.rgb": Pillow's Image.resize((W2, H2), BICUBIC) of raw RGB bytes
local SCRIPT = [[
import sys
import numpy as np
from PIL import Image
if sys.argv[1] == "resize":
    src, H, W, H2, W2, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    a = np.frombuffer(open(src, "rb").read(), np.uint8).reshape(H, W, 3)
    b = np.asarray(Image.fromarray(a, "RGB").resize((W2, H2), Image.BICUBIC), dtype=np.uint8)
    open(out, "wb").write(np.ascontiguousarray(b).tobytes())
    print(b.shape[0], b.shape[1])
]]

local state = {}
local function python()
  if state.script then return state end
  local deps = io.popen(PY .. " -c 'import PIL, numpy' 2>&1")
  local out = deps:read("*a")
  if not deps:close() then
    error(fmt("test_vision_data needs %s with python3-pil (%s): run scripts/test_deps.sh", PY, out:gsub("\n", " "):sub(1, 200)), 0)
  end
  state.dir = T.tmpdir("vision-data", { create = true })
  state.script = state.dir .. "/pillow_resize.py"
  write(state.script, SCRIPT)
  return state
end
local function run_py(args)
  local st = python()
  local p = io.popen(fmt("%s %s %s 2>&1", PY, cli.shell_quote(st.script), args))
  local out = p:read("*a")
  if not p:close() then error("pillow_resize.py " .. args .. " failed: " .. out, 2) end
  return out
end

-- max |Δ| of image.resize(img, H2, W2) against Pillow's
local function resize_delta(img, H2, W2)
  local st = python()
  local buf, n = bytes_of(img)
  local s = img:shape()
  write(st.dir .. "/in.rgb", ffi.string(buf, n))
  T.eq(run_py(fmt("resize %s %d %d %d %d %s", cli.shell_quote(st.dir .. "/in.rgb"), s[1], s[2], H2, W2,
                  cli.shell_quote(st.dir .. "/out.rgb"))):match("(%d+ %d+)"), H2 .. " " .. W2)
  local ref = slurp(st.dir .. "/out.rgb")
  local got = image.resize(img, H2, W2)
  T.eq(got:shape(), { H2, W2, 3 })
  local gb, gn = bytes_of(got)
  T.eq(gn, #ref)
  local maxd = 0
  for i = 0, gn - 1 do maxd = math.max(maxd, math.abs(gb[i] - ref:byte(i + 1))) end
  return maxd
end

local function noise_image(H, W, seed)
  local n = H * W * 3
  local u = ffi.new("double[?]", n)
  tide.C.tide_philox_uniform(seed, 0, u, n)
  local b = ffi.new("uint8_t[?]", n)
  for i = 0, n - 1 do b[i] = math.floor(u[i] * 256) end
  local shape = ffi.new("int64_t[3]", H, W, 3)
  return tide.check(tide.C.tide_from_bytes(tide.C.tide_dtype_from_name("u8"), 3, shape, 0, b, n))
end

T.test("image.resize == Pillow's Image.resize(BICUBIC), antialiased downscale and upscale: max |Δ| = 0", function()
  python()
  local china = image.read(SK_IMAGES .. "/china.jpg")          -- 427 x 640
  local cases = {
    { china, 300, 450, "china.jpg down to 300 x 450" },
    { china, 123, 77, "china.jpg down to 123 x 77 (factor 8)" },
    { noise_image(17, 23, 5), 40, 31, "noise 17 x 23 up to 40 x 31" },
    { noise_image(50, 60, 6), 50, 13, "noise 50 x 60, width only" },
    { noise_image(31, 29, 7), 9, 29, "noise 31 x 29, height only" },
  }
  for _, c in ipairs(cases) do
    local d = resize_delta(c[1], c[2], c[3])
    print(fmt("    %s: max |Δ| = %d vs Pillow BICUBIC", c[4], d))
    T.eq(d, 0, c[4] .. ": max |Δ| vs Pillow")
  end
end)

T.test("image.fit: the patch budget of vision.md §2 (floor of sqrt(limit / patches)); 1000 x 1000 vs Pillow", function()
  T.eq({ image.fit_size(896, 896, 14, 4096) }, { 896, 896 })         -- 64 x 64 = 4096 patches: within the budget
  T.eq({ image.fit_size(1000, 1000, 14, 4096) }, { 901, 901 })       -- 71 x 71 = 5041 > 4096: x 64/71
  T.eq({ image.fit_size(427, 640, 14, 100) }, { 116, 174 })   -- 30 x 45 = 1350 patches: x 0.272
  local img = noise_image(1000, 1000, 9)
  local fitted = image.fit(img, 14, 4096)
  T.eq(fitted:shape(), { 901, 901, 3 })
  T.ok(image.fit(noise_image(40, 40, 1), 14, 4096):shape()[1] == 40)
  local d = resize_delta(noise_image(200, 300, 11), 163, 245)
  T.eq(d, 0, "noise 200 x 300 -> 163 x 245")
  T.raises(function() image.fit(img, 0, 4096) end, "the patch size must be a positive integer")
  T.raises(function() image.fit(img, 14, 0) end, "token_limit must be a positive integer")
  T.raises(function() image.resize(img, 0, 3) end, "the new height must be an integer in [1, 16384], got 0")
end)

T.test("image.prepare: oracle 5 shapes (32x32 p4 -> 16, 896 p14 -> 1024, 32 p14 -> 4, 1000 p14 -> 1,089 tokens)", function()
  local function shape(H, W, v)
    local patches, h, w, n = image.prepare(tide.zeros({ H, W, 3 }, { dtype = "u8" }), v)
    T.eq(patches:shape(), { h * w, 3 * v.patch * v.patch })
    return { h, w, n }
  end
  T.eq(shape(32, 32, { patch = 4 }), { 8, 8, 16 })
  T.eq(shape(896, 896, { patch = 14 }), { 64, 64, 1024 })
  T.eq(shape(32, 32, { patch = 14 }), { 4, 4, 4 })
  T.eq(shape(1000, 1000, { patch = 14 }), { 66, 66, 1089 })
  T.eq(image.VISION_DEFAULTS.patch, 4)
  T.eq(image.VISION_DEFAULTS.mean, { 0.5, 0.5, 0.5 })
  -- mean = std = 0.5: pixel 255 -> 1, pixel 0 -> -1
  local img = tide.full({ 4, 8, 3 }, 255, { dtype = "u8" })
  local patches = image.prepare(img, {})
  local b, n = floats_of(patches)
  T.eq(patches:shape(), { 4, 48 })
  T.eq({ b[0], b[n - 1] }, { 1, -1 })     -- the first patch is pixels, the last one padding
  T.raises(function() image.prepare(img, { patch = 4, colour = 1 }) end, "unknown key 'colour' in vision")
end)

T.run()
