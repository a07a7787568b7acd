-- data/image.lua — PNG and JPEG images as u8 tensors [H, W, 3] (vision.md §2; engine/io/image.c).
--
-- image.read(path[, max_side]) reads a file, image.decode(bytes, label[, max_side]) a Lua string of file bytes
-- (a base64-decoded JSONL image, say). Both treat the input as hostile: regular files only, at most 64 MiB,
-- each side <= max_side (default and hard cap 16,384) and <= 64 Mi pixels, checked from the header before any
-- decoding; the result is always 8-bit RGB. Errors are one line naming the file (or label) and the reason.
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

return image
