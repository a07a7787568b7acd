-- data/image.lua — PNG and JPEG images as u8 tensors [H, W, 3] (vision.md §2; engine/io/image.c).
--
-- image.read(path[, max_side]) reads a file, image.decode(bytes, label[, max_side]) a Lua string of file bytes
-- (a base64-decoded JSONL image, say). Both treat the input as hostile: regular files only, at most 64 MiB,
-- each side <= max_side (default and hard cap 16,384) and <= 64 Mi pixels, checked from the header before any
-- decoding; the result is always 8-bit RGB. Errors are one line naming the file (or label) and the reason.
-- image.patchify turns such an image into normalised patch vectors (vision.md §2).
local ffi = require "ffi"
local tide = require "tide"
local C = tide.C

local image = {}

local function last_error() return ffi.string(C.tide_last_error()) end

local function side_arg(max_side, what)
  if max_side == nil then return 0 end
  if type(max_side) ~= "number" or max_side ~= math.floor(max_side) or max_side < 1 then
    error(string.format("%s: max_side must be a positive integer, got %s", what, tostring(max_side)), 3)
  end
  return max_side
end

function image.read(path, max_side)
  if type(path) ~= "string" or path == "" then
    error("image.read: the path must be a non-empty string, got " .. tostring(path), 2)
  end
  local p = C.tide_image_read(path, side_arg(max_side, "image.read"))
  if p == nil then error("image.read: " .. last_error(), 2) end
  return tide.wrap(p)
end

function image.decode(bytes, label, max_side)
  if type(bytes) ~= "string" then error("image.decode: bytes must be a string, got " .. type(bytes), 2) end
  label = label or "<memory>"
  local p = C.tide_image_decode_memory(bytes, #bytes, tostring(label), side_arg(max_side, "image.decode"))
  if p == nil then error("image.decode: " .. last_error(), 2) end
  return tide.wrap(p)
end

-- image.patchify(img, p, mean, std) -> patches f32 [h*w, 3p²], h, w (vision.md §2): img, a u8 [H, W, 3] tensor, is
-- padded right and bottom with pixel value 0 to a multiple of 2p per side (before normalisation, as MoonViT's image
-- processor pads), normalised per channel, x = (pixel/255 − mean_c)/std_c, and cut into p×p patches in raster
-- order, each a vector in (c, ky, kx) order (a Conv2d(3, d_v, p, p) weight [d_v, 3, p, p] reshapes to the patch
-- embed's [d_v, 3p²]). The LM sees h·w/4 tokens after the 2×2 merge. No resizing: an image over a patch budget is
-- the caller's to scale first.
function image.patchify(img, p, mean, std)
  local what = "image.patchify"
  if type(p) ~= "number" or p ~= math.floor(p) or p < 1 then
    error(string.format("%s: the patch size must be a positive integer, got %s", what, tostring(p)), 2)
  end
  local shape = img:shape()
  if img:dtype() ~= "u8" or #shape ~= 3 or shape[3] ~= 3 then
    error(string.format("%s: expected a u8 image [H, W, 3], got %s [%s]", what, img:dtype(), table.concat(shape, ", ")), 2)
  end
  for _, v in ipairs({ { mean, "mean" }, { std, "std" } }) do
    local t = v[1]
    if type(t) ~= "table" or #t ~= 3 then
      error(string.format("%s: %s must be 3 numbers (one per channel), got %s", what, v[2], tostring(t)), 2)
    end
    for c = 1, 3 do
      if type(t[c]) ~= "number" or (v[2] == "std" and not (t[c] > 0)) then
        error(string.format("%s: %s[%d] = %s, expected a number%s", what, v[2], c, tostring(t[c]),
                            v[2] == "std" and " > 0" or ""), 2)
      end
    end
  end
  local H, W, m = shape[1], shape[2], 2 * p
  local Hp, Wp = math.ceil(H / m) * m, math.ceil(W / m) * m
  local x = tide.zeros({ Hp, Wp, 3 })
  x:narrow(1, 1, H):narrow(2, 1, W):copy_(img:to("f32"))
  x = (x * (1 / 255) - tide.tensor(mean)) / tide.tensor(std)
  local h, w = Hp / p, Wp / p
  -- [h, ky, w, kx, c] -> [h, w, c, ky, kx]
  local patches = x:reshape(h, p, w, p, 3):permute(1, 3, 5, 2, 4):contiguous():reshape(h * w, 3 * p * p)
  return patches, h, w
end

---------------------------------------------------------------------------------------------------
-- resizing to the patch budget (vision.md §2) and the whole preprocessing of one image

-- the vision preprocessing options and their defaults, in this one place (tiny-vlm, vision.md §9): patch size p,
-- per-channel mean and std, token_limit = the most p×p patches before padding (MoonViT's in_token_limit, 4096 at
-- p = 14), loss_on_wrappers = whether the media wrapper tokens are loss targets (vision.md §8)
image.VISION_DEFAULTS = { patch = 4, mean = { 0.5, 0.5, 0.5 }, std = { 0.5, 0.5, 0.5 }, token_limit = 4096,
                          loss_on_wrappers = false }

-- Pillow's bicubic kernel (libImaging/Resample.c: a = -0.5, support 2), not PyTorch's a = -0.75
local function bicubic(x)
  local a = -0.5
  x = math.abs(x)
  if x < 1 then return ((a + 2) * x - (a + 3)) * x * x + 1 end
  if x < 2 then return (((x - 5) * x + 8) * x - 4) * a end
  return 0
end

local PRECISION_BITS = 32 - 8 - 2          -- Pillow's fixed-point coefficients for 8-bit images
local ONE = 2 ^ PRECISION_BITS

-- Pillow's precompute_coeffs + normalize_coeffs_8bpc: for each output index, the first input index, the count and
-- the integer weights (the support widens with the scale when downscaling: antialiasing)
local function coeffs(in_size, out_size)
  local scale = in_size / out_size
  local fscale = math.max(scale, 1)
  local support = 2 * fscale
  local ksize = math.ceil(support) * 2 + 1
  local xmins, counts, k = {}, {}, ffi.new("double[?]", out_size * ksize)
  for xx = 0, out_size - 1 do
    local center = (xx + 0.5) * scale
    local ss = 1 / fscale
    local lo = center - support + 0.5          -- C's (int) truncation, then clamped at 0
    local xmin = lo < 0 and 0 or math.floor(lo)
    local hi = center + support + 0.5
    local xmax = math.min(in_size, math.floor(hi)) - xmin
    local ww = 0
    for x = 0, xmax - 1 do
      local w = bicubic((x + xmin - center + 0.5) * ss)
      k[xx * ksize + x] = w
      ww = ww + w
    end
    for x = 0, xmax - 1 do
      local w = ww ~= 0 and k[xx * ksize + x] / ww or k[xx * ksize + x]
      -- C's (int) truncation of w·2^22 ± 0.5
      local v = w < 0 and -0.5 + w * ONE or 0.5 + w * ONE
      k[xx * ksize + x] = v < 0 and math.ceil(v) or math.floor(v)
    end
    xmins[xx], counts[xx] = xmin, xmax
  end
  return xmins, counts, k, ksize
end

-- one separable pass over a u8 buffer [rows, cols, 3]: resamples the axis `axis` (1 = rows, 2 = cols) to out_n
local function pass(src, rows, cols, axis, out_n)
  local in_n = axis == 1 and rows or cols
  local xmins, counts, k, ksize = coeffs(in_n, out_n)
  local orows, ocols = axis == 1 and out_n or rows, axis == 1 and cols or out_n
  local dst = ffi.new("uint8_t[?]", orows * ocols * 3)
  local half = 2 ^ (PRECISION_BITS - 1)
  local floor = math.floor
  for o = 0, out_n - 1 do
    local xmin, cnt, kb = xmins[o], counts[o], o * ksize
    local other = axis == 1 and cols or rows
    for q = 0, other - 1 do
      for c = 0, 2 do
        local ss = half
        for x = 0, cnt - 1 do
          local i = xmin + x
          local idx = axis == 1 and ((i * cols + q) * 3 + c) or ((q * cols + i) * 3 + c)
          ss = ss + src[idx] * k[kb + x]
        end
        local v = floor(ss / ONE)
        if v < 0 then v = 0 elseif v > 255 then v = 255 end
        local didx = axis == 1 and ((o * ocols + q) * 3 + c) or ((q * ocols + o) * 3 + c)
        dst[didx] = v
      end
    end
  end
  return dst
end

local function check_image(img, what)
  local shape = img:shape()
  if img:dtype() ~= "u8" or #shape ~= 3 or shape[3] ~= 3 then
    error(string.format("%s: expected a u8 image [H, W, 3], got %s [%s]", what, img:dtype(), table.concat(shape, ", ")), 3)
  end
  return shape[1], shape[2]
end

-- image.resize(img, H2, W2) -> u8 [H2, W2, 3]: Pillow's Image.resize((W2, H2), Image.BICUBIC) for an RGB image,
-- step by step as libImaging/Resample.c does it (horizontal pass, then vertical, each rounded to 8 bits; kernel
-- a = -0.5; support scaled by the downscale factor, i.e. antialiased; 22-bit fixed-point weights). Measured against
-- Pillow 9.4 in tests/lua/test_vision_data.lua.
function image.resize(img, H2, W2)
  local H, W = check_image(img, "image.resize")
  for _, v in ipairs({ { H2, "height" }, { W2, "width" } }) do
    if type(v[1]) ~= "number" or v[1] ~= math.floor(v[1]) or v[1] < 1 or v[1] > 16384 then
      error(string.format("image.resize: the new %s must be an integer in [1, 16384], got %s", v[2], tostring(v[1])), 2)
    end
  end
  local buf = ffi.new("uint8_t[?]", H * W * 3)
  tide.check_status(C.tide_read_bytes(tide.raw(img), buf, H * W * 3))
  local rows, cols = H, W
  if W2 ~= W then buf, cols = pass(buf, rows, cols, 2, W2), W2 end
  if H2 ~= H then buf, rows = pass(buf, rows, cols, 1, H2), H2 end
  local shape = ffi.new("int64_t[3]", H2, W2, 3)
  return tide.check(C.tide_from_bytes(C.tide_dtype_from_name("u8"), 3, shape, 0, buf, H2 * W2 * 3))
end

-- image.fit_size(H, W, p, token_limit) -> H2, W2: the size within the patch budget (vision.md §2): unchanged when
-- ⌊W/p⌋·⌊H/p⌋ <= token_limit, else both sides scaled by sqrt(token_limit / patches) with floor rounding (at least 1)
function image.fit_size(H, W, p, token_limit)
  local patches = math.floor(W / p) * math.floor(H / p)
  if patches <= token_limit then return H, W end
  local s = math.sqrt(token_limit / patches)
  return math.max(1, math.floor(H * s)), math.max(1, math.floor(W * s))
end

-- image.fit(img, p, token_limit) -> img resized (bicubic, as Pillow) to the patch budget, or img itself when within it
function image.fit(img, p, token_limit)
  local H, W = check_image(img, "image.fit")
  if type(p) ~= "number" or p ~= math.floor(p) or p < 1 then
    error(string.format("image.fit: the patch size must be a positive integer, got %s", tostring(p)), 2)
  end
  if type(token_limit) ~= "number" or token_limit ~= math.floor(token_limit) or token_limit < 1 then
    error(string.format("image.fit: token_limit must be a positive integer (patches), got %s", tostring(token_limit)), 2)
  end
  local H2, W2 = image.fit_size(H, W, p, token_limit)
  if H2 == H and W2 == W then return img end
  return image.resize(img, H2, W2)
end

local VISION_KEYS = { patch = true, mean = true, std = true, token_limit = true, loss_on_wrappers = true }

-- image.vision_config(v, who) -> v over image.VISION_DEFAULTS, checked (unknown keys, types)
function image.vision_config(v, who)
  who = who or "vision"
  local options = require "tide.options"
  local out = options.with_defaults(v or {}, image.VISION_DEFAULTS, VISION_KEYS, "vision", who)
  options.pos_int(out.patch, "vision.patch", who)
  options.pos_int(out.token_limit, "vision.token_limit", who)
  for _, key in ipairs({ "mean", "std" }) do
    local t = out[key]
    if type(t) ~= "table" or #t ~= 3 then options.fail(who, string.format("vision.%s must be 3 numbers, got %s", key, tostring(t))) end
  end
  if type(out.loss_on_wrappers) ~= "boolean" then
    options.fail(who, "vision.loss_on_wrappers must be a boolean, got " .. tostring(out.loss_on_wrappers))
  end
  return out
end

-- image.prepare(img, vision) -> patches f32 [h·w, 3p²], h, w, n_tokens = h·w/4: fit to vision.token_limit, then
-- patchify with vision.patch, mean and std (vision = nil or a partial table: image.VISION_DEFAULTS fill the rest)
function image.prepare(img, vision)
  local v = image.vision_config(vision, "image.prepare")
  local patches, h, w = image.patchify(image.fit(img, v.patch, v.token_limit), v.patch, v.mean, v.std)
  return patches, h, w, h * w / 4
end

return image
