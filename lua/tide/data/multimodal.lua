-- data/multimodal.lua — image-text documents for the packer (spec/vision.md §7, §8; formats.md §5) and the image
-- sources of the vision recipes: kind = "squares" (synthetic, oracle 9), "digits" (sklearn's 8x8 digits) and
-- "image_text" (JSONL documents with images).
--
-- A document is <|endoftext|>, then its parts in order: text (tok:encode) and images, each image as
-- <|media_start|>image<|media_content|> <|media_pad|> x n <|media_end|> with n = h·w/4 (image.prepare). Targets are
-- ids shifted left by one, -100 where the target is a placeholder and, unless vision.loss_on_wrappers, where it is
-- a wrapper token (<|media_start|>, the word "image", <|media_content|>, <|media_end|>). Special ids are resolved by
-- name from the tokenizer. doc(i, T) returns ids, targets, n and the images {patches, h, w, pos, n} (pack.lua).
-- Chat documents (formats.md §4, §5) render each message as <|im_ROLE|>ROLE<|im_middle|>content<|im_end|> (the
-- tool role as <|im_system|>tool<|im_middle|>, as Kimi's template does); only assistant contents and their
-- <|im_end|> are targets.
local ffi = require "ffi"
local tide = require "tide"
local image = require "tide.data.image"
local options = require "tide.options"
local tokenizer = require "tide.data.tokenizer"
local C = tide.C

local mm = {}
local fmt = string.format
local IGNORE = -100
local STRIDE = 4294967296ULL
local SQUARES_KEY = 0x73717561ULL      -- "squa"
local SQUARES_EVAL_KEY = 0x73716576ULL -- "sqev": the eval split's stream, disjoint from training
local DIGITS_KEY = 0x64696769ULL       -- "digi"
local SHIFT_KEY = 0x73686674ULL        -- "shft": the digits' translation jitter

local function bad(who, msg) options.fail(who, msg) end

-- the special ids a document needs, by name
function mm.specials(tok)
  return { eot = tok:id("<|endoftext|>"), pad = tok:id("<|pad|>"), media_start = tok:id("<|media_start|>"),
           media_content = tok:id("<|media_content|>"), media_pad = tok:id("<|media_pad|>"),
           media_end = tok:id("<|media_end|>") }
end

-- document(tok, parts, vision, sp) -> ids, targets, n, images. parts: a list of text strings, images (a u8 tensor
-- [H, W, 3], prepared here with vision, or {patches, h, w} already prepared) and tables {text = s, loss = bool} or
-- {special = name, loss = bool} (SFT: loss only on assistant turns). A plain string or image is a target
-- (loss = true); placeholders never are, wrapper tokens only with vision.loss_on_wrappers.
function mm.document(tok, parts, vision, sp)
  sp = sp or mm.specials(tok)
  vision = vision or image.vision_config(nil)
  local list, loss = { sp.eot }, { false }
  local images = {}
  local function push(id, l) list[#list + 1] = id; loss[#list] = l end
  local wraps = vision.loss_on_wrappers
  for _, part in ipairs(parts) do
    if type(part) == "string" then
      for _, id in ipairs(tok:encode(part)) do push(id, true) end
    elseif type(part) == "table" and part.text ~= nil then
      for _, id in ipairs(tok:encode(part.text)) do push(id, part.loss ~= false) end
    elseif type(part) == "table" and part.special ~= nil then
      push(tok:id(part.special), part.loss ~= false)
    else
      local patches, h, w, n
      if tide.is_tensor(part) then
        patches, h, w, n = image.prepare(part, vision)
      else
        patches, h, w, n = part.patches, part.h, part.w, part.h * part.w / 4
      end
      local wl = wraps and (type(part) ~= "table" or part.loss ~= false)
      push(sp.media_start, wl)
      for _, id in ipairs(tok:encode("image")) do push(id, wl) end
      push(sp.media_content, wl)
      images[#images + 1] = { patches = patches, h = h, w = w, pos = #list, n = n }
      for _ = 1, n do push(sp.media_pad, false) end
      push(sp.media_end, wl)
    end
  end
  local n = #list
  local ids, targets = ffi.new("int32_t[?]", n), ffi.new("int32_t[?]", n)
  for t = 0, n - 1 do ids[t] = list[t + 1] end
  for t = 0, n - 2 do targets[t] = loss[t + 2] and list[t + 2] or IGNORE end
  targets[n - 1] = IGNORE
  return ids, targets, n, images
end

-- the vision options of a source: its own `vision` table over image.VISION_DEFAULTS (sources.build hands a
-- model's vision config to sources that do not give their own)
local function vision_of(cfg, who)
  return image.vision_config(cfg.vision, who)
end

local function tokenizer_of(cfg, who)
  local tok = cfg.tokenizer or tokenizer.byte_level()
  if type(tok) ~= "table" or type(tok.id) ~= "function" then bad(who, "tokenizer must be a tokenizer object (with :id(name))") end
  return tok
end

local function u8_image(buf, H, W)
  local shape = ffi.new("int64_t[3]", H, W, 3)
  return tide.check(C.tide_from_bytes(C.tide_dtype_from_name("u8"), 3, shape, 0, buf, H * W * 3))
end

local function check_index(self, i)
  if not options.is_int(i) or i < 0 then bad(self.name, fmt("document index must be an integer >= 0, got %s", tostring(i))) end
end

---------------------------------------------------------------------------------------------------
-- squares: one solid square on a dark background, caption "<colour> <quadrant>" (vision.md oracle 9)

mm.COLOURS = {
  { "red", 230, 25, 25 }, { "green", 30, 200, 30 }, { "blue", 40, 60, 230 }, { "yellow", 240, 230, 30 },
  { "cyan", 30, 220, 230 }, { "magenta", 220, 40, 220 }, { "white", 250, 250, 250 }, { "orange", 250, 140, 20 },
}
mm.QUADRANTS = { "top-left", "top-right", "bottom-left", "bottom-right" }

local Squares = {}
Squares.__index = Squares
local SQUARES_KEYS = { split = true, seed = true, name = true, vision = true, size = true, tokenizer = true,
                       text_only = true }

-- the 0-based positions of a document whose targets are the caption's label tokens: the tokens that cover the
-- caption's characters at `chars` (1-based offsets), found by decoding the caption's tokens one by one (any
-- tokenizer: a byte of byte-level, a piece of BPE). The caption is the document's tail (it ends at n - 1).
local function label_positions(tok, caption, n, chars)
  local ids = tok:encode(caption)
  local first = n - #ids                 -- position of the caption's first token in the document
  local out, at, c = {}, 0, 1
  for k = 1, #ids do
    local len = #tok:decode({ ids[k] })
    while c <= #chars and chars[c] <= at + len do
      if chars[c] > at and (out[#out] ~= first + k - 2) then out[#out + 1] = first + k - 2 end
      c = c + 1
    end
    at = at + len
  end
  return out
end

local function check_text_only(v, who)
  if v ~= nil and type(v) ~= "boolean" then bad(who, "text_only must be true or false, got " .. tostring(v)) end
  return v == true
end

-- squares{split = "train" | "eval" ("val"), seed, size = 32, vision, tokenizer, name, text_only = false}: image i
-- (any i >= 0) is a
-- pure function of (seed, split, i): 5 Philox uniforms at [8i, 8i + 5) pick the class (colour = class mod 8,
-- quadrant = ⌊class/8⌋ of 32), the background grey (0..47), the side (size/4 .. size/2 - 2) and the position
-- inside the quadrant. The eval split draws another stream. text_only: the caption alone, without its image
-- (the baseline that shows what the captions give without the pixels).
function mm.squares_source(cfg)
  local who = "squares"
  options.check(cfg, SQUARES_KEYS, "squares source config", who)
  local split = cfg.split or "train"
  if split ~= "train" and split ~= "eval" and split ~= "val" then
    bad(who, fmt("split must be 'train' or 'eval', got '%s'", tostring(split)))
  end
  local seed = options.seed(cfg.seed or 0, "squares seed", who)
  local size = cfg.size or 32
  if not options.is_int(size) or size < 8 or size % 4 ~= 0 or size > 1024 then
    bad(who, fmt("size must be a multiple of 4 in [8, 1024], got %s", tostring(size)))
  end
  local tok = tokenizer_of(cfg, who)
  local sp = mm.specials(tok)
  local key = (split == "train" and SQUARES_KEY or SQUARES_EVAL_KEY) * STRIDE + seed
  return setmetatable({ name = cfg.name or ("squares:" .. split), split = split, seed = seed, size = size,
    key = key, vision = vision_of(cfg, who), tokenizer = tok, sp = sp, pad_id = sp.pad, media_pad_id = sp.media_pad,
    u = ffi.new("double[5]"), text_only = check_text_only(cfg.text_only, who) }, Squares)
end

-- sample(i) -> img u8 [size, size, 3], caption, {colour, quadrant, x0, y0, side, background}
function Squares:sample(i)
  check_index(self, i)
  C.tide_philox_uniform(self.key, 8 * i, self.u, 5)
  local u, S = self.u, self.size
  local class = math.min(31, math.floor(u[0] * 32))
  local colour, quadrant = class % 8 + 1, math.floor(class / 8) + 1
  local bg = math.min(47, math.floor(u[1] * 48))
  local half = S / 2
  local lo, hi = S / 4, half - 2
  local side = lo + math.min(hi - lo, math.floor(u[2] * (hi - lo + 1)))
  local qx, qy = (quadrant - 1) % 2, math.floor((quadrant - 1) / 2)
  local x0 = qx * half + math.min(half - side, math.floor(u[3] * (half - side + 1)))
  local y0 = qy * half + math.min(half - side, math.floor(u[4] * (half - side + 1)))
  local buf = ffi.new("uint8_t[?]", S * S * 3)
  ffi.fill(buf, S * S * 3, bg)
  local c = mm.COLOURS[colour]
  for y = y0, y0 + side - 1 do
    for x = x0, x0 + side - 1 do
      local k = (y * S + x) * 3
      buf[k], buf[k + 1], buf[k + 2] = c[2], c[3], c[4]
    end
  end
  local caption = c[1] .. " " .. mm.QUADRANTS[quadrant]
  return u8_image(buf, S, S), caption,
         { colour = c[1], quadrant = mm.QUADRANTS[quadrant], x0 = x0, y0 = y0, side = side, background = bg }
end

-- doc(i, T): <|endoftext|> [image] caption (T is not used)
function Squares:doc(i, T)
  local img, caption = self:sample(i)
  return mm.document(self.tokenizer, self.text_only and { caption } or { img, caption }, self.vision, self.sp)
end

-- label_positions(i): the positions predicting the caption's content: the colour word's first character, the
-- quadrant's first character (top / bottom) and the one after its '-' (left / right)
function Squares:label_positions(i)
  local _, caption = self:sample(i)
  local _, _, n = self:doc(i)
  local space, dash = caption:find(" ", 1, true), caption:find("-", 1, true)
  return label_positions(self.tokenizer, caption, n, { 1, space + 1, dash + 1 })
end

---------------------------------------------------------------------------------------------------
-- digits: the 1,797 8x8 handwritten digits of sklearn (Debian python3-sklearn), read with the engine's gunzip

mm.DIGITS_PATH = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
local DIGITS_MAX_BYTES = 16 * 1024 * 1024
local digits_cache = {}

-- gunzip(path, max_bytes) -> the decompressed file as a Lua string (engine/io/gunzip.c; one-line errors)
function mm.gunzip(path, max_bytes)
  local n = ffi.new("size_t[1]")
  local p = C.tide_gunzip_file(path, max_bytes or 0, n)
  if p == nil then error(ffi.string(C.tide_last_error()), 0) end
  local s = ffi.string(p, n[0])
  C.tide_free(p)
  return s
end

-- load_digits(path) -> {pixels = uint8_t[n·64] (values 0..16), labels = {0-based index -> digit}, n}: every line is
-- 64 pixel values 0..16 and the label 0..9, comma-separated; an error names path:line
function mm.load_digits(path, who)
  path = path or mm.DIGITS_PATH
  if digits_cache[path] then return digits_cache[path] end
  local ok, text = pcall(mm.gunzip, path, DIGITS_MAX_BYTES)
  if not ok then bad(who or "digits", text) end
  local rows, labels = {}, {}
  local line = 0
  for l in text:gmatch("([^\n]*)\n?") do
    line = line + 1
    if l ~= "" then
      local vals = {}
      for v in l:gmatch("[^,]+") do vals[#vals + 1] = tonumber(v) end
      local count = select(2, l:gsub(",", "")) + 1
      if count ~= 65 or #vals ~= 65 then
        bad(who or "digits", fmt("%s:%d: expected 65 comma-separated numbers (64 pixels, the label), got %d fields", path, line, count))
      end
      for k = 1, 64 do
        local v = vals[k]
        if v ~= math.floor(v) or v < 0 or v > 16 then
          bad(who or "digits", fmt("%s:%d: pixel %d is %s, expected an integer 0..16", path, line, k, tostring(v)))
        end
      end
      local lab = vals[65]
      if lab ~= math.floor(lab) or lab < 0 or lab > 9 then
        bad(who or "digits", fmt("%s:%d: the label is %s, expected an integer 0..9", path, line, tostring(lab)))
      end
      rows[#rows + 1] = vals
      labels[#rows - 1] = lab
    end
  end
  if #rows == 0 then bad(who or "digits", fmt("%s holds no digits", path)) end
  local pixels = ffi.new("uint8_t[?]", #rows * 64)
  for j, vals in ipairs(rows) do for k = 1, 64 do pixels[(j - 1) * 64 + k - 1] = vals[k] end end
  local d = { pixels = pixels, labels = labels, n = #rows, path = path }
  digits_cache[path] = d
  return d
end

local Digits = {}
Digits.__index = Digits
local DIGITS_KEYS = { path = true, split = true, val_fraction = true, order = true, seed = true, name = true,
                      vision = true, tokenizer = true, text_only = true, shift = true }

-- digits{path = mm.DIGITS_PATH, split = "train" | "val" ("eval"), val_fraction = 0.1, order = "shuffle" |
-- "sequential", seed, vision, tokenizer, name}: the last ⌊n·val_fraction⌋ digits (by file index) are the val split,
-- the rest train. Document i is the split's digit perm_e[i mod m] (a Philox permutation per epoch e = ⌊i/m⌋, or
-- file order): the 8x8 image scaled to 32x32 (nearest, x4; grey v·255/16 rounded, on all 3 channels), then the
-- caption "a handwritten D". text_only: the caption alone, without its image. shift = s (pixels of the 32x32 image,
-- default 0): document i's image is translated by (dx, dy) uniform in [-s, s]² (Philox at (seed, 2i), zeros
-- shifted in), an augmentation of the train split only (the val split, its held-out twin, is never shifted).
function mm.digits_source(cfg)
  local who = "digits"
  options.check(cfg, DIGITS_KEYS, "digits source config", who)
  local split = cfg.split or "train"
  if split == "eval" then split = "val" end
  if split ~= "train" and split ~= "val" then bad(who, fmt("split must be 'train' or 'val', got '%s'", tostring(cfg.split))) end
  local vf = cfg.val_fraction or 0.1
  if type(vf) ~= "number" or not (vf >= 0 and vf < 1) then bad(who, fmt("val_fraction must be in [0, 1), got %s", tostring(vf))) end
  local order = cfg.order or "shuffle"
  if order ~= "shuffle" and order ~= "sequential" then bad(who, fmt("order must be 'shuffle' or 'sequential', got '%s'", tostring(order))) end
  local seed = options.seed(cfg.seed or 0, "digits seed", who)
  if cfg.shift ~= nil and not (options.is_int(cfg.shift) and cfg.shift >= 0 and cfg.shift <= 8) then
    bad(who, fmt("shift must be an integer in [0, 8] (pixels of the 32x32 image), got %s", tostring(cfg.shift)))
  end
  local d = mm.load_digits(cfg.path, who)
  local n_val = math.floor(d.n * vf)
  local first, count = 0, d.n - n_val
  if split == "val" then first, count = d.n - n_val, n_val end
  if count == 0 then bad(who, fmt("split '%s' of %s is empty (%d digits, val_fraction %s)", split, d.path, d.n, tostring(vf))) end
  local tok = tokenizer_of(cfg, who)
  local sp = mm.specials(tok)
  return setmetatable({ name = cfg.name or ("digits:" .. split), split = split, order = order, seed = seed, data = d,
    first = first, n_docs = count, key = DIGITS_KEY * STRIDE + seed, vision = vision_of(cfg, who), tokenizer = tok,
    sp = sp, pad_id = sp.pad, media_pad_id = sp.media_pad, text_only = check_text_only(cfg.text_only, who),
    shift = split == "train" and cfg.shift or 0, shift_key = SHIFT_KEY * STRIDE + seed }, Digits)
end

function Digits:count() return self.n_docs end

-- the file index (0-based) of document i
function Digits:index(i)
  check_index(self, i)
  local m = self.n_docs
  if self.order == "sequential" then return self.first + i % m end
  local e = math.floor(i / m)
  if self.perm_epoch ~= e then
    local perm = self.perm or ffi.new("int32_t[?]", m)
    local u = ffi.new("double[?]", m)
    C.tide_philox_uniform(self.key, e * m, u, m)
    for j = 0, m - 1 do perm[j] = j end
    for j = m - 1, 1, -1 do
      local r = math.min(j, math.floor(u[j] * (j + 1)))
      perm[j], perm[r] = perm[r], perm[j]
    end
    self.perm, self.perm_epoch = perm, e
  end
  return self.first + self.perm[i % m]
end

-- digit(k, dx, dy) -> img u8 [32, 32, 3], label of file index k (0-based), translated by (dx, dy) pixels
function Digits:digit(k, dx, dy)
  local d = self.data
  if not options.is_int(k) or k < 0 or k >= d.n then bad(self.name, fmt("digit index must be in [0, %d), got %s", d.n, tostring(k))) end
  local buf = ffi.new("uint8_t[?]", 32 * 32 * 3)
  local src = d.pixels + k * 64
  dx, dy = dx or 0, dy or 0
  for y = 0, 31 do
    for x = 0, 31 do
      local sx, sy = x - dx, y - dy
      local g = 0
      if sx >= 0 and sx < 32 and sy >= 0 and sy < 32 then
        g = math.floor(src[math.floor(sy / 4) * 8 + math.floor(sx / 4)] * 255 / 16 + 0.5)
      end
      local o = (y * 32 + x) * 3
      buf[o], buf[o + 1], buf[o + 2] = g, g, g
    end
  end
  return u8_image(buf, 32, 32), d.labels[k]
end

-- the translation of document i (0, 0 without shift)
function Digits:offset(i)
  local s = self.shift
  if s == 0 then return 0, 0 end
  local u = ffi.new("double[2]")
  C.tide_philox_uniform(self.shift_key, 2 * i, u, 2)
  return math.min(s, math.floor(u[0] * (2 * s + 1)) - s), math.min(s, math.floor(u[1] * (2 * s + 1)) - s)
end

function Digits:doc(i, T)
  local img, label = self:digit(self:index(i), self:offset(i))
  local caption = "a handwritten " .. label
  return mm.document(self.tokenizer, self.text_only and { caption } or { img, caption }, self.vision, self.sp)
end

-- label_positions(i): the position predicting the digit (the caption's last character)
function Digits:label_positions(i)
  local _, label = self:digit(self:index(i))
  local caption = "a handwritten " .. label
  local _, _, n = self:doc(i)
  return label_positions(self.tokenizer, caption, n, { #caption })
end

---------------------------------------------------------------------------------------------------
-- image_text: JSONL documents with images (formats.md §5)
--   {"text": "... <|media_pad|> ...", "images": [{"path": "a.png"} | {"b64": "..."}]}
--   {"messages": [{"role": "user", "content": "<|media_pad|> what is this?"}, {"role": "assistant", ...}], "images": [...]}
-- one literal <|media_pad|> per image, in order (a literal <|media_start|>image<|media_content|><|media_pad|>
-- <|media_end|> counts as one too); relative paths are resolved against the JSONL file's directory.

local B64 = {}
do
  local alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
  for k = 1, 64 do B64[alphabet:byte(k)] = k - 1 end
end

-- b64decode(s) -> bytes, or nil and the reason: the standard alphabet, '=' padding, whitespace ignored
function mm.b64decode(s)
  local out, acc, bits, pad = {}, 0, 0, 0
  local buf = ffi.new("uint8_t[?]", math.floor(#s * 3 / 4) + 3)
  local n = 0
  for k = 1, #s do
    local c = s:byte(k)
    local v = B64[c]
    if v then
      if pad > 0 then return nil, fmt("data after '=' padding at offset %d", k - 1) end
      acc = acc * 64 + v
      bits = bits + 6
      if bits >= 8 then
        bits = bits - 8
        local byte = math.floor(acc / 2 ^ bits)
        buf[n] = byte
        n = n + 1
        acc = acc - byte * 2 ^ bits
      end
    elseif c == 61 then
      pad = pad + 1
      if pad > 2 then return nil, fmt("too much '=' padding at offset %d", k - 1) end
    elseif c == 32 or c == 10 or c == 13 or c == 9 then
    else
      return nil, fmt("invalid base64 character %q at offset %d", string.char(c), k - 1)
    end
  end
  if bits >= 6 then return nil, "truncated base64 (a final group of one character)" end
  return ffi.string(buf, n), nil
end

local PAD_LITERAL = "<|media_pad|>"
local WRAPPED_LITERAL = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"

-- text pieces around the image markers: {"a", IMAGE, "b", ...} as {pieces = {...}, count = images}
local function split_markers(text)
  local pieces, count, pos = {}, 0, 1
  while true do
    local a, b = text:find(WRAPPED_LITERAL, pos, true)
    local c, d = text:find(PAD_LITERAL, pos, true)
    if c and (not a or c < a) then a, b = c, d end
    if not a then break end
    pieces[#pieces + 1] = text:sub(pos, a - 1)
    count = count + 1
    pieces[#pieces + 1] = count          -- the image's 1-based number
    pos = b + 1
  end
  pieces[#pieces + 1] = text:sub(pos)
  return pieces, count
end

local function count_markers(text) return select(2, split_markers(text)) end

local ImageText = {}
ImageText.__index = ImageText
local IMAGE_TEXT_KEYS = { path = true, paths = true, split = true, val_fraction = true, order = true, seed = true,
                          name = true, vision = true, tokenizer = true, max_side = true }
local ROLES = { system = "<|im_system|>", user = "<|im_user|>", assistant = "<|im_assistant|>", tool = "<|im_system|>" }
local IMAGE_TEXT_KEY = 0x696d7478ULL   -- "imtx"

-- one JSONL line -> a document record {where, text | messages, images = {{path} | {b64}}}; errors name file:line
local function parse_line(json, file, dir, lineno, line, who)
  local where = fmt("%s:%d", file, lineno)
  local ok, obj = pcall(json.decode, line)
  if not ok then bad(who, fmt("%s: %s", where, tostring(obj):gsub("^json%.decode: ", ""))) end
  if type(obj) ~= "table" or obj[1] ~= nil then bad(who, where .. ": expected a JSON object") end
  local markers
  if obj.text ~= nil then
    if type(obj.text) ~= "string" then bad(who, where .. ": \"text\" must be a string") end
    markers = count_markers(obj.text)
  elseif obj.messages ~= nil then
    if type(obj.messages) ~= "table" or #obj.messages == 0 then bad(who, where .. ": \"messages\" must be a non-empty array") end
    markers = 0
    for k, m in ipairs(obj.messages) do
      if type(m) ~= "table" or not ROLES[m.role] then
        bad(who, fmt("%s: messages[%d].role must be system, user, assistant or tool, got %s", where, k - 1,
          tostring(type(m) == "table" and m.role)))
      end
      if type(m.content) ~= "string" then bad(who, fmt("%s: messages[%d].content must be a string", where, k - 1)) end
      markers = markers + count_markers(m.content)
    end
  else
    bad(who, where .. ": a document needs \"text\" or \"messages\"")
  end
  local images = obj.images
  if images == nil then images = {} end
  if type(images) ~= "table" then bad(who, where .. ": \"images\" must be an array") end
  if #images ~= markers then
    bad(who, fmt("%s: the text holds %d <|media_pad|> but \"images\" lists %d image%s", where, markers, #images,
      #images == 1 and "" or "s"))
  end
  local refs = {}
  for k, im in ipairs(images) do
    local what = fmt("%s: images[%d]", where, k - 1)
    if type(im) ~= "table" then bad(who, what .. " must be an object {\"path\": ...} or {\"b64\": ...}") end
    if type(im.path) == "string" and im.b64 == nil then
      local p = im.path:sub(1, 1) == "/" and im.path or (dir .. im.path)
      if C.tide_path_exists(p) ~= 1 then bad(who, fmt("%s: no such image file '%s'", what, p)) end
      refs[k] = { path = p }
    elseif type(im.b64) == "string" and im.path == nil then
      local bytes, why = mm.b64decode(im.b64)
      if not bytes then bad(who, fmt("%s: bad base64: %s", what, why)) end
      refs[k] = { b64 = im.b64 }
    else
      bad(who, what .. " must hold exactly one of \"path\" (a string) or \"b64\" (a string)")
    end
  end
  return { where = where, text = obj.text, messages = obj.messages, images = refs }
end

-- image_text{path | paths, split = "train" | "val" ("eval"), val_fraction = 0, order = "shuffle" | "sequential",
-- seed, vision, tokenizer, max_side, name}: every line of the JSONL files is parsed and checked when the source is
-- made (JSON, the marker count, image files present, base64 well-formed); images are decoded in doc(i, T). The last
-- ⌊n·val_fraction⌋ documents of each file are its val split.
function mm.image_text_source(cfg)
  local who = "image_text"
  options.check(cfg, IMAGE_TEXT_KEYS, "image_text source config", who)
  local json = require "tide.json"
  local files = {}
  if cfg.path ~= nil then files[#files + 1] = cfg.path end
  if cfg.paths ~= nil then
    if type(cfg.paths) ~= "table" then bad(who, "paths must be a list of JSONL files") end
    for _, f in ipairs(cfg.paths) do files[#files + 1] = f end
  end
  if #files == 0 then bad(who, "path (or paths) must name a JSONL file") end
  local split = cfg.split or "train"
  if split == "eval" then split = "val" end
  if split ~= "train" and split ~= "val" then bad(who, fmt("split must be 'train' or 'val', got '%s'", tostring(cfg.split))) end
  local vf = cfg.val_fraction or 0
  if type(vf) ~= "number" or not (vf >= 0 and vf < 1) then bad(who, fmt("val_fraction must be in [0, 1), got %s", tostring(vf))) end
  if split == "val" and vf == 0 then bad(who, "split 'val' needs val_fraction > 0") end
  local order = cfg.order or "shuffle"
  if order ~= "shuffle" and order ~= "sequential" then bad(who, fmt("order must be 'shuffle' or 'sequential', got '%s'", tostring(order))) end
  local seed = options.seed(cfg.seed or 0, "image_text seed", who)
  if cfg.max_side ~= nil then options.pos_int(cfg.max_side, "max_side", who) end
  local docs = {}
  for _, file in ipairs(files) do
    if type(file) ~= "string" then bad(who, "a JSONL path must be a string, got " .. type(file)) end
    local f, err = io.open(file, "rb")
    if not f then bad(who, fmt("cannot open '%s': %s", file, tostring(err))) end
    local dir = file:match("^(.*/)[^/]*$") or ""
    local mine, lineno = {}, 0
    for line in f:lines() do
      lineno = lineno + 1
      if #line > 64 * 1024 * 1024 then f:close(); bad(who, fmt("%s:%d: the line is over 64 MiB", file, lineno)) end
      if line:find("%S") then mine[#mine + 1] = parse_line(json, file, dir, lineno, line, who) end
    end
    f:close()
    local n_val = math.floor(#mine * vf)
    local lo, hi = 1, #mine - n_val
    if split == "val" then lo, hi = #mine - n_val + 1, #mine end
    for k = lo, hi do docs[#docs + 1] = mine[k] end
  end
  if #docs == 0 then bad(who, fmt("no documents in split '%s' of %s", split, table.concat(files, ", "))) end
  local tok = tokenizer_of(cfg, who)
  local sp = mm.specials(tok)
  return setmetatable({ name = cfg.name or ("image_text:" .. split), split = split, order = order, docs = docs,
    n_docs = #docs, first = 0, key = IMAGE_TEXT_KEY * STRIDE + seed, vision = vision_of(cfg, who), tokenizer = tok,
    sp = sp, pad_id = sp.pad, media_pad_id = sp.media_pad, max_side = cfg.max_side }, ImageText)
end

-- each kind's config keys (sources.build checks them; a recipe writes sources = {NAME = {kind = KIND, ...}})
mm.KEYS = { squares = SQUARES_KEYS, digits = DIGITS_KEYS, image_text = IMAGE_TEXT_KEYS }

ImageText.count = Digits.count
ImageText.index = Digits.index

-- the u8 image of reference ref (document where, image k); a decoding error names file:line
function ImageText:load_image(ref, where, k)
  local ok, img = pcall(function()
    if ref.path then return image.read(ref.path, self.max_side) end
    return image.decode(assert(mm.b64decode(ref.b64)), fmt("%s images[%d]", where, k - 1), self.max_side)
  end)
  if not ok then bad(self.name, fmt("%s: images[%d]: %s", where, k - 1, tostring(img):gsub("^.-image%.[a-z]+: ", ""))) end
  return img
end

-- the parts of a text (pieces around markers) with its images, loss flag l
local function text_parts(self, rec, text, parts, loss, next_image)
  local pieces = split_markers(text)
  for _, piece in ipairs(pieces) do
    if type(piece) == "string" then
      if piece ~= "" then parts[#parts + 1] = { text = piece, loss = loss } end
    else
      local k = next_image()
      local img = self:load_image(rec.images[k], rec.where, k)
      local patches, h, w = image.prepare(img, self.vision)
      parts[#parts + 1] = { patches = patches, h = h, w = w, loss = loss }
    end
  end
end

function ImageText:doc(i, T)
  local rec = self.docs[self:index(i) + 1]
  local parts, used = {}, 0
  local function next_image() used = used + 1; return used end
  if rec.text then
    text_parts(self, rec, rec.text, parts, true, next_image)
  else
    for _, m in ipairs(rec.messages) do
      local is_assistant = m.role == "assistant"
      parts[#parts + 1] = { special = ROLES[m.role], loss = false }
      parts[#parts + 1] = { text = m.role, loss = false }
      parts[#parts + 1] = { special = "<|im_middle|>", loss = false }
      text_parts(self, rec, m.content, parts, is_assistant, next_image)
      parts[#parts + 1] = { special = "<|im_end|>", loss = is_assistant }
    end
  end
  return mm.document(self.tokenizer, parts, self.vision, self.sp)
end

return mm
