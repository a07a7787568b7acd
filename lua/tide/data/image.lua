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

return image
