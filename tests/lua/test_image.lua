-- image: PNG and JPEG decoding (engine/io/image.c, vision.md §2) against Pillow, and hostile files. The two photos
-- of Debian's python3-sklearn (china.jpg, flower.jpg) decode within a measured bound of Pillow's libjpeg pixels;
-- PNGs written here (RGB, RGBA, grey, palette, 16-bit RGB and grey) decode exactly as Pillow's convert("RGB")
-- (16-bit grey: Pillow's "I;16" values' high byte, which is what 8-bit output keeps); truncated, corrupt, huge,
-- FIFO, directory and empty inputs fail in one line naming the file; image.patchify matches a numpy loop. Needs
-- /usr/bin/python3 with python3-pil and python3-sklearn (scripts/test_deps.sh).
local T = require "tide.testing"
local tide = require "tide"
local ffi = require "ffi"
local cli = require "tide.cli"
local image = require "tide.data.image"

local fmt = string.format
local PY = "/usr/bin/python3"
local SK_IMAGES = "/usr/lib/python3/dist-packages/sklearn/datasets/images"

local write, bytes_of = T.write, T.bytes_of
local function slurp(path) return assert(T.read(path), "cannot read " .. path) end


-- the Python side: "gen DIR" writes the test PNGs (and a tiny JPEG), "ref IN OUT" writes Pillow's RGB pixels of IN
-- as raw bytes to OUT and prints "W H"
local SCRIPT = [[
import sys, struct, zlib
import numpy as np
from PIL import Image

def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

def png16(path, w, h, colour_type, channels, rng):
    vals = rng.integers(0, 65536, size=(h, w * channels), dtype=np.uint16).astype(">u2")
    raw = b"".join(b"\x00" + vals[y].tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))

if sys.argv[1] == "gen":
    d = sys.argv[2]
    rng = np.random.default_rng(7)
    rgb = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    Image.fromarray(rgb, "RGB").save(d + "/rgb.png")
    Image.fromarray(rng.integers(0, 256, size=(6, 3, 4), dtype=np.uint8), "RGBA").save(d + "/rgba.png")
    Image.fromarray(rng.integers(0, 256, size=(4, 9), dtype=np.uint8), "L").save(d + "/gray.png")
    Image.fromarray(rgb, "RGB").quantize(colors=6).save(d + "/palette.png")
    png16(d + "/rgb16.png", 4, 3, 2, 3, rng)
    png16(d + "/gray16.png", 3, 5, 0, 1, rng)
    Image.fromarray(np.kron(rgb, np.ones((4, 4, 1), dtype=np.uint8)), "RGB").save(d + "/small.jpg", quality=90)
    big = np.zeros((40, 56, 3), dtype=np.uint8)
    big[:, :, 0] = np.arange(56)[None, :] * 4
    big[:, :, 1] = np.arange(40)[:, None] * 6
    Image.fromarray(big, "RGB").save(d + "/big.png")
    Image.fromarray(big, "RGB").save(d + "/big.jpg", quality=85)
    # a zlib bomb: an 8 x 8 grey PNG (72 bytes of scanlines) whose IDAT inflates to 64 MiB of zeros
    with open(d + "/bomb.png", "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(bytes(64 << 20), 9)) + chunk(b"IEND", b""))
    print("ok")
elif sys.argv[1] == "patch":
    src, H, W, p, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    mean = np.array([0.48145466, 0.4578275, 0.40821073])
    std = np.array([0.26862954, 0.26130258, 0.27577711])
    a = np.frombuffer(open(src, "rb").read(), np.uint8).reshape(H, W, 3)
    m = 2 * p
    Hp, Wp = -(-H // m) * m, -(-W // m) * m
    x = np.zeros((Hp, Wp, 3))
    x[:H, :W] = a
    x = (x / 255 - mean) / std
    h, w = Hp // p, Wp // p
    ref = np.empty((h * w, 3 * p * p))
    for r in range(h):
        for c in range(w):
            for ch in range(3):
                ref[r * w + c, ch * p * p:(ch + 1) * p * p] = x[r * p:(r + 1) * p, c * p:(c + 1) * p, ch].reshape(-1)
    ref.astype(np.float32).tofile(out)
    print(h, w)
else:
    img = Image.open(sys.argv[2])
    if img.mode in ("I;16", "I;16B", "I"):
        a = (np.asarray(img).astype(np.uint32) >> 8).astype(np.uint8)
        a = np.stack([a, a, a], axis=-1)
    else:
        a = np.asarray(img.convert("RGB"), dtype=np.uint8)
    open(sys.argv[3], "wb").write(np.ascontiguousarray(a).tobytes())
    print(a.shape[1], a.shape[0])
]]

local state = {}
local function python()
  if state.script then return state end
  local deps = io.popen(PY .. " -c 'import PIL, sklearn, numpy' 2>&1")
  local out = deps:read("*a")
  local ok = deps:close()
  local sk = tide.C.tide_path_exists(SK_IMAGES .. "/china.jpg") == 1
  if not ok or not sk then
    error(fmt("test_image needs %s with python3-pil and python3-sklearn (%s): run scripts/test_deps.sh", PY,
              ok and ("no " .. SK_IMAGES .. "/china.jpg") or out:gsub("\n", " "):sub(1, 200)), 0)
  end
  state.dir = T.tmpdir("image", { create = true })
  state.script = state.dir .. "/pillow_ref.py"
  write(state.script, SCRIPT)
  return state
end

local function run_py(args)
  local st = python()
  local p = io.popen(fmt("%s %s %s 2>&1", PY, cli.shell_quote(st.script), args))
  local out = p:read("*a")
  local ok = p:close()
  if not ok then error("pillow_ref.py " .. args .. " failed: " .. out, 2) end
  return out
end

local function generated()
  local st = python()
  if not st.generated then
    T.eq(run_py("gen " .. cli.shell_quote(st.dir)):match("^%s*(.-)%s*$"), "ok")
    st.generated = true
  end
  return st.dir
end

-- Pillow's pixels of path: a Lua string of H*W*3 bytes, W, H
local function pillow(path)
  local st = python()
  local out_path = st.dir .. "/ref.rgb"
  local out = run_py("ref " .. cli.shell_quote(path) .. " " .. cli.shell_quote(out_path))
  local w, h = out:match("(%d+) (%d+)")
  return slurp(out_path), tonumber(w), tonumber(h)
end

-- max and mean |Δ| of tide's decode of path against Pillow's; checks the shape
local function compare(path)
  local ref, w, h = pillow(path)
  local t = image.read(path)
  T.eq(t:dtype(), "u8", path)
  T.eq(t:shape(), { h, w, 3 }, path)
  local buf, n = bytes_of(t)
  T.eq(n, #ref, path)
  local maxd, sum = 0, 0
  for i = 0, n - 1 do
    local d = math.abs(buf[i] - ref:byte(i + 1))
    sum = sum + d
    if d > maxd then maxd = d end
  end
  return maxd, sum / n, t
end

T.test("the sklearn photos (JPEG) decode within max |Δ| <= 3, mean |Δ| <= 0.05 of Pillow", function()
  for _, name in ipairs({ "china.jpg", "flower.jpg" }) do
    python()
    local maxd, mean, t = compare(SK_IMAGES .. "/" .. name)
    T.eq(t:shape(), { 427, 640, 3 }, name)
    print(fmt("    %s: 427 x 640, max |Δ| = %d, mean |Δ| = %.4f vs Pillow", name, maxd, mean))
    T.ok(maxd <= 3, fmt("%s: max |Δ| = %d, expected <= 3", name, maxd))
    T.ok(mean <= 0.05, fmt("%s: mean |Δ| = %.4f, expected <= 0.05", name, mean))
  end
end)

T.test("PNGs (RGB, RGBA, grey, palette, 16-bit RGB and grey) decode exactly as Pillow's convert('RGB')", function()
  local dir = generated()
  local shapes = { rgb = { 5, 7, 3 }, rgba = { 6, 3, 3 }, gray = { 4, 9, 3 }, palette = { 5, 7, 3 },
                   rgb16 = { 3, 4, 3 }, gray16 = { 5, 3, 3 }, big = { 40, 56, 3 } }
  for _, name in ipairs({ "rgb", "rgba", "gray", "palette", "rgb16", "gray16", "big" }) do
    local maxd, _, t = compare(dir .. "/" .. name .. ".png")
    T.eq(t:shape(), shapes[name], name)
    T.eq(maxd, 0, name .. ".png: max |Δ| vs Pillow")
  end
  -- the JPEGs Pillow wrote (4:2:0 chroma): the same bound as the photos
  for _, name in ipairs({ "small.jpg", "big.jpg" }) do
    local maxd = compare(dir .. "/" .. name)
    T.ok(maxd <= 3, fmt("%s: max |Δ| = %d, expected <= 3", name, maxd))
  end
end)

T.test("image.decode of the file's bytes equals image.read; the label names the source in errors", function()
  local dir = generated()
  for _, name in ipairs({ "rgb.png", "small.jpg" }) do
    local a = image.read(dir .. "/" .. name)
    local b = image.decode(slurp(dir .. "/" .. name), "doc 3 image 0")
    T.eq(b:shape(), a:shape(), name)
    local ba, n = bytes_of(a)
    local bb = bytes_of(b)
    T.eq(ffi.string(bb, n), ffi.string(ba, n), name)
  end
  local err = T.raises(function() image.decode("not an image", "doc 3 image 0") end, "image 'doc 3 image 0': not a PNG or JPEG")
  T.ok(not err:find("\n"), "one line: " .. err)
end)

-- a PNG that is only a signature and an IHDR chunk (valid CRC) declaring w x h, 8-bit RGB
local crc_table
local function crc32(s)
  if not crc_table then
    crc_table = {}
    for i = 0, 255 do
      local c = i
      for _ = 1, 8 do c = (c % 2 == 1) and bit.bxor(0xEDB88320, bit.rshift(c, 1)) or bit.rshift(c, 1) end
      crc_table[i] = c
    end
  end
  local c = 0xFFFFFFFF
  for i = 1, #s do c = bit.bxor(crc_table[bit.band(bit.bxor(c, s:byte(i)), 0xFF)], bit.rshift(c, 8)) end
  return bit.bnot(c)
end
local function be32(v)
  return string.char(bit.band(bit.rshift(v, 24), 255), bit.band(bit.rshift(v, 16), 255),
                     bit.band(bit.rshift(v, 8), 255), bit.band(v, 255))
end
local function png_header(w, h)
  local ihdr = "IHDR" .. be32(w) .. be32(h) .. "\8\2\0\0\0"
  return "\137PNG\r\n\26\n" .. be32(13) .. ihdr .. be32(crc32(ihdr))
end

T.test("the size caps apply to the header before decoding: 100000 x 100000, 16384 x 16384, max_side", function()
  T.eq(string.format("%08x", crc32("IEND") % 2^32), "ae426082")   -- the CRC every PNG's IEND chunk carries
  local dir = T.tmpdir("image-caps", { create = true })
  local huge = dir .. "/huge.png"
  write(huge, png_header(100000, 100000))
  local t0 = os.clock()
  local err = T.raises(function() image.read(huge) end,
                       "image '" .. huge .. "' is 100000 x 100000 pixels (W x H), over the limit of 16384 per side")
  -- 30 GB if decoded: the header check answers at once, and with the cap's message, not an allocation failure
  T.ok(os.clock() - t0 < 0.5, fmt("the huge header took %.3f s", os.clock() - t0))
  T.ok(not err:find("\n"), "one line: " .. err)
  write(dir .. "/wide.png", png_header(16384, 16384))
  T.raises(function() image.read(dir .. "/wide.png") end,
           "is 16384 x 16384 = 268435456 pixels, over the limit of 67108864")
  write(dir .. "/tall.png", png_header(3, 40000))
  T.raises(function() image.read(dir .. "/tall.png") end, "is 3 x 40000 pixels (W x H), over the limit of 16384")
  -- within the caps, a header without pixel data is the decoder's error (it names the image and its size)
  write(dir .. "/nodata.png", png_header(64, 32) .. be32(0) .. "IEND" .. be32(crc32("IEND")))
  T.raises(function() image.read(dir .. "/nodata.png") end, "image '" .. dir .. "/nodata.png' (64 x 32): cannot decode")
  -- a caller's max_side: the 5 x 7 test PNG passes at 7, fails at 6
  local gdir = generated()
  T.eq(image.read(gdir .. "/rgb.png", 7):shape(), { 5, 7, 3 })
  T.raises(function() image.read(gdir .. "/rgb.png", 6) end, "is 7 x 5 pixels (W x H), over the limit of 6 per side")
  T.raises(function() image.read(gdir .. "/rgb.png", 0) end, "max_side must be a positive integer, got 0")
  T.raises(function() tide.check(tide.C.tide_image_read(gdir .. "/rgb.png", 20000)) end,
           "max_side = 20000, expected 0 (the default 16384) up to 16384")
end)

T.test("hostile files: truncated, corrupt, FIFO, directory, empty, missing, too big; one line naming the file", function()
  local gdir = generated()
  local dir = T.tmpdir("image-hostile", { create = true })
  local png = slurp(gdir .. "/big.png")
  local jpg = slurp(SK_IMAGES .. "/china.jpg")
  local cases = {}
  local function case(name, bytes, expect)
    local path = dir .. "/" .. name
    if bytes then write(path, bytes) end
    cases[#cases + 1] = { path, expect }
  end
  case("trunc_sig.png", png:sub(1, 5), "not a PNG or JPEG (neither signature at byte 0)")
  case("trunc_ihdr.png", png:sub(1, 20), "truncated PNG header (20 bytes; the IHDR chunk ends at 33)")
  case("trunc_idat.png", png:sub(1, #png - 40), "cannot decode")
  case("trunc_header.jpg", jpg:sub(1, 100), "not a readable JPEG header")
  -- a JPEG cut inside its entropy-coded data is still read by stb_image (the rest decodes as zeros, as libjpeg
  -- does with a warning); cut before its first scan it is an error
  local sos = jpg:find("\255\218", 1, true)
  case("trunc_scan.jpg", jpg:sub(1, sos + 1), "cannot decode")
  case("text.png", "hello, this is not an image\n", "not a PNG or JPEG (neither signature at byte 0)")
  -- the zlib stream of the IDAT chunk overwritten with garbage
  local idat = png:find("IDAT", 1, true)
  case("corrupt_zlib.png", png:sub(1, idat + 3) .. string.rep("\255", 64) .. png:sub(idat + 68), "cannot decode")
  -- a JPEG whose Huffman table marker is overwritten
  local dht = jpg:find("\255\196", 1, true)
  case("corrupt_dht.jpg", jpg:sub(1, dht - 1) .. string.rep("\0", 32) .. jpg:sub(dht + 32), "cannot decode")
  -- a Huffman table whose 16 counts sum to 4080 codes (JPEG allows 256): refused before stb_image 2.27, which
  -- would write past its 257-entry tables
  case("dht_overflow.jpg", jpg:sub(1, dht + 4) .. string.rep("\255", 16) .. jpg:sub(dht + 21),
       fmt("corrupt JPEG: the Huffman table at byte %d declares more than 256 codes", dht + 3))
  -- an IDAT chunk whose length field claims 2 GiB in a file of a few hundred bytes (found by the fuzz lane: the
  -- decoder grew its buffer to the claimed length before reading), and a zlib bomb: both refused by the cap
  case("idat_length.png", slurp("tests/fuzz/corpus/image/idat_length_2gib.png"),
       "(5 x 3): corrupt PNG: decoding it asks for 2147483648 bytes, more than a valid 199-byte file of this size")
  os.rename(gdir .. "/bomb.png", dir .. "/bomb.png")
  case("bomb.png", nil, "(8 x 8): corrupt PNG: decoding it asks for")
  case("empty.png", "", "is empty (0 bytes)")
  local fifo = dir .. "/pipe.png"
  T.eq(os.execute("mkfifo " .. cli.shell_quote(fifo)), 0, "mkfifo")
  case("pipe.png", nil, "is a FIFO (named pipe), not a regular file")
  tide.C.tide_mkdir_p(dir .. "/folder.jpg")
  case("folder.jpg", nil, "is a directory, not a regular file")
  case("missing.png", nil, "No such file or directory")
  -- one byte over 64 MiB (a sparse file: nothing is written)
  local f = assert(io.open(dir .. "/big.jpg", "wb"))
  f:seek("set", 64 * 1024 * 1024)
  f:write("\0")
  f:close()
  case("big.jpg", nil, "is 67108865 bytes, over the limit of 67108864 bytes")
  for _, c in ipairs(cases) do
    local err = T.raises(function() image.read(c[1]) end, c[2], c[1])
    T.ok(err:find(c[1], 1, true), "the error names the file: " .. err)
    T.ok(not err:find("\n"), "one line: " .. err)
  end
end)

local CLIP_MEAN = { 0.48145466, 0.4578275, 0.40821073 }
local CLIP_STD = { 0.26862954, 0.26130258, 0.27577711 }

T.test("patchify: pad to 2p with 0, normalise, (c, ky, kx) patches == numpy (f32 1e-6); shapes of oracle 5", function()
  local gdir = generated()
  for _, c in ipairs({ { SK_IMAGES .. "/china.jpg", 14, 32, 46 }, { gdir .. "/rgb.png", 2, 4, 4 },
                       { gdir .. "/big.png", 3, 14, 20 } }) do
    local img = image.read(c[1])
    local patches, h, w = image.patchify(img, c[2], CLIP_MEAN, CLIP_STD)
    T.eq({ h, w }, { c[3], c[4] }, c[1])
    T.eq(patches:shape(), { h * w, 3 * c[2] * c[2] }, c[1])
    local buf, n = bytes_of(img)
    local raw = python().dir .. "/img.rgb"
    write(raw, ffi.string(buf, n))
    local out = python().dir .. "/patches.f32"
    local s = img:shape()
    T.eq(run_py(fmt("patch %s %d %d %d %s", cli.shell_quote(raw), s[1], s[2], c[2], cli.shell_quote(out)))
           :match("(%d+ %d+)"), h .. " " .. w)
    local ref = slurp(out)
    local k = patches:numel()
    T.eq(#ref, 4 * k, c[1])
    local got = ffi.new("float[?]", k)
    tide.check_status(tide.C.tide_read_bytes(tide.raw(patches), got, 4 * k))
    local want = ffi.cast("const float *", ref)
    local maxd = 0
    for i = 0, k - 1 do maxd = math.max(maxd, math.abs(got[i] - want[i])) end
    print(fmt("    %s at p = %d: %d x %d patches, max |Δ| = %.2g vs numpy", c[1]:match("[^/]+$"), c[2], h, w, maxd))
    T.ok(maxd <= 1e-6, fmt("%s: max |Δ| = %.3g vs numpy, expected <= 1e-6", c[1], maxd))
  end
  -- oracle 5: tiny-vlm 32 x 32 at p = 4 -> 8 x 8 patches (16 tokens); at p = 14 -> padded to 56 x 56, 4 x 4 patches
  -- (4 tokens); the padding is pixel 0, so a patch wholly in it is -mean/std
  local img = tide.zeros({ 32, 32, 3 }, { dtype = "u8" })
  local p4, h4, w4 = image.patchify(img, 4, { 0.5, 0.5, 0.5 }, { 0.5, 0.5, 0.5 })
  T.eq({ h4, w4, h4 * w4 / 4 }, { 8, 8, 16 })
  T.eq(p4:shape(), { 64, 48 })
  local p14, h14, w14 = image.patchify(img, 14, CLIP_MEAN, CLIP_STD)
  T.eq({ h14, w14, h14 * w14 / 4 }, { 4, 4, 4 })
  local last = p14:narrow(1, 16, 1):reshape(3, 196)
  for ch = 1, 3 do
    T.near(last:narrow(1, ch, 1), tide.full({ 1, 196 }, -CLIP_MEAN[ch] / CLIP_STD[ch]), 1e-6, "pad channel " .. ch)
  end
  T.raises(function() image.patchify(img:to("f32"), 14, CLIP_MEAN, CLIP_STD) end, "expected a u8 image [H, W, 3]")
  T.raises(function() image.patchify(img, 14, CLIP_MEAN, { 1, 0, 1 }) end, "std[2] = 0, expected a number > 0")
  T.raises(function() image.patchify(img, 0, CLIP_MEAN, CLIP_STD) end, "the patch size must be a positive integer")
end)

T.run()
