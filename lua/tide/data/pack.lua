-- data/pack.lua — document sources and the packer (spec/long_context.md §3 packing, §6 stage switches,
-- §7 exact resume; token layout after spec/formats.md §3: every document begins with <|endoftext|>).
--
-- A document source is any object with `src.name` (a string) and
--   local ids, targets, n = src:doc(i, T)
-- document i (0-based, any i >= 0) for stage row length T: int32 ffi arrays of length n, ids[0] = <|endoftext|>,
-- targets[t] = the label of position t or -100; targets[n-1] is replaced by the packer. doc(i, T) is a pure
-- function of (source config, i, T). pack.text_source makes one from text files or token shards.
--
-- pack.Packer draws each new document's source by weight from the Philox stream at (seed, draw counter), takes
-- the next document of that source at its own cursor, and fills rows of T tokens contiguously: a document that
-- does not fit is cut and its remainder starts the next row as a new segment (no padding). The last label of a
-- segment is <|endoftext|> when the segment ends its document (it predicts the next document's separator) and
-- -100 at a cut. Draw counter, cursors and the carried-over remainder are the whole state, so state() /
-- set_state() resume bit-for-bit and set_seq_len() switches stage without losing a document.
--
-- Images (vision.md §7, §8): doc(i, T) may return a fourth value, a list of images in document order, each
-- {patches = f32 [L, 3p²], h, w (patch grid, L = h·w), pos (0-based position of its first <|media_pad|>), n = h·w/4}
-- whose placeholder span ids[pos, pos + n) is all <|media_pad|> (data/multimodal.lua builds such documents, with
-- the targets §8 masks; the packer masks every target that is a placeholder in any case). The packer never cuts
-- a placeholder span: when a row's end falls inside one, the row ends before the span (its last label -100, as at
-- any cut) and the rest of the row is filled with <|pad|> ids (targets -100, a segment of its own in cu_seqlens);
-- the document continues on the next row at the span's first pad. A span longer than the row is an error. The
-- carry-over is still (source, doc, offset, seq_len): indices only. A batch holding an image carries `images` and
-- `image_spans` (next_rows); a batch without one is exactly the text-only batch.
local ffi = require "ffi"
local tide = require "tide"
local text = require "tide.data.text"
local tokenizer = require "tide.data.tokenizer"
local options = require "tide.options"
local C = tide.C

local pack = {}

pack.IGNORE = -100                    -- F.cross_entropy's default ignore_index
pack.MAX_REJECTIONS = 10000           -- consecutive documents a length filter may skip before it is an error

-- Philox keys: (domain << 32) + seed, so a packer and a text source given the same seed draw unrelated streams
local STRIDE = 4294967296ULL
local PACK_KEY = 0x7061636bULL        -- "pack"
local TEXT_KEY = 0x74657874ULL        -- "text"

local fmt = string.format

-- errors point at the first caller outside lua/tide (the recipe line that built the source or packer)
local WHO = "pack"
local function bad(msg) options.fail(WHO, msg) end
-- every key of cfg must be in known; the error names the key, the table and the known keys
local function check_keys(cfg, known, what) options.check(cfg, known, what, WHO) end
local is_int = options.is_int
local function check_seed(seed, what) return options.seed(seed, what, WHO) end
local function positive_int(v, what) return options.pos_int(v, what, WHO) end

---------------------------------------------------------------------------------------------------
-- text source: the documents of text files or token shards (text.load), in shuffled or file order

local TextSource = {}
TextSource.__index = TextSource

local TEXT_KEYS = {
  path = true, paths = true, exclude = true, format = true, doc_separator = true, field = true, val_fraction = true,
  split = true, order = true, seed = true, tokenizer = true, name = true,
}
pack.TEXT_KEYS = TEXT_KEYS   -- tide.schema: the keys of a text source

-- append the documents of one token piece {buf, offset, n}: spans that begin at an <|endoftext|> id and run to
-- the next one. A span before the first separator is the tail of a document cut by the split (or a shard that
-- does not begin at a document) and is dropped; so is the last span when `cut_at_end` (the split cut it short).
-- Documents are kept as three flat lists (piece, start, length), not a table each: corpora hold millions.
local function add_documents(self, piece, eot, cut_at_end)
  local buf, first, last = piece.buf, piece.offset, piece.offset + piece.n
  self.pieces[#self.pieces + 1] = piece
  local k = #self.pieces
  local dp, ds, dn = self.doc_piece, self.doc_start, self.doc_len
  local function add(start, n)
    local j = #dn + 1
    dp[j], ds[j], dn[j] = k, start, n
  end
  local start = nil
  for p = first, last - 1 do
    if buf[p] == eot then
      if start then add(start, p - start) end
      start = p
    end
  end
  if start and not cut_at_end then add(start, last - start) end
end

-- text_source{path | paths, exclude, format, doc_separator, field, val_fraction, split = "train" | "val",
--             order = "shuffle" | "sequential", seed, tokenizer, name} -> a document source
-- The last val_fraction of each file is its validation split (text.load). A document the split point cuts is
-- in neither split (its head ends the file's train part, its tail begins the val part), so both splits hold
-- whole documents only.
function pack.text_source(cfg)
  check_keys(cfg, TEXT_KEYS, "text_source config")
  local split = cfg.split or "train"
  if split ~= "train" and split ~= "val" then bad(fmt("split must be 'train' or 'val', got '%s'", tostring(split))) end
  local order = cfg.order or "shuffle"
  if order ~= "shuffle" and order ~= "sequential" then
    bad(fmt("order must be 'shuffle' or 'sequential', got '%s'", tostring(order)))
  end
  local seed = check_seed(cfg.seed or 0, "text_source seed")
  local vf = cfg.val_fraction or 0
  if split == "val" and not (type(vf) == "number" and vf > 0) then
    bad(fmt("split 'val' needs val_fraction > 0, got %s", tostring(cfg.val_fraction)))
  end
  local tok = cfg.tokenizer or tokenizer.byte_level()
  if type(tok) ~= "table" or type(tok.id) ~= "function" then bad("tokenizer must be a tokenizer object (with :id(name))") end
  local eot = tok:id("<|endoftext|>")
  if cfg.name ~= nil and type(cfg.name) ~= "string" then bad("name must be a string, got " .. type(cfg.name)) end

  local load_cfg = {
    path = cfg.path, paths = cfg.paths, exclude = cfg.exclude, format = cfg.format,
    doc_separator = cfg.doc_separator, field = cfg.field, val_fraction = vf,
  }
  -- text.load concatenates the files' splits, so a val part's partial first document would run on from the
  -- previous file's last document: each file is read on its own to keep file boundaries
  local files = text.files(load_cfg)
  local parts = {}
  for k, f in ipairs(files) do
    parts[k] = text.load({ path = f, format = cfg.format, doc_separator = cfg.doc_separator, field = cfg.field,
      val_fraction = vf }, tok)
  end
  local ds = { files = files }
  local self = setmetatable({
    name = cfg.name or ("text:" .. split), split = split, order = order, seed = seed, eot = eot,
    tokenizer = tok, files = ds.files, pieces = {}, doc_piece = {}, doc_start = {}, doc_len = {}, key = TEXT_KEY * STRIDE + seed,
    perm = nil, perm_epoch = nil,
  }, TextSource)
  for _, part in ipairs(parts) do
    local toks = part[split]
    local cut = split == "train" and part.val ~= nil and part.val.n > 0 and part.val.buf[0] ~= eot
    if toks and toks.n > 0 then add_documents(self, { buf = toks.buf, offset = 0, n = toks.n }, eot, cut) end
  end
  self.n_docs = #self.doc_len
  if self.n_docs == 0 then
    bad(fmt("text source has no documents in split '%s' (%d files; every document must begin with <|endoftext|>)",
      split, #ds.files))
  end
  if self.n_docs >= 2 ^ 31 then bad(fmt("text source has %d documents, more than 2^31 - 1", self.n_docs)) end
  return self
end

function TextSource:count() return self.n_docs end

-- the Philox-seeded permutation of epoch e (Fisher–Yates over uniforms at [e·n, e·n + n)), the latest one cached
function TextSource:permutation(e)
  if self.perm_epoch ~= e then
    local n = self.n_docs
    local perm = self.perm or ffi.new("int32_t[?]", n)
    local u = ffi.new("double[?]", n)
    C.tide_philox_uniform(self.key, e * n, u, n)
    for j = 0, n - 1 do perm[j] = j end
    for j = n - 1, 1, -1 do
      local r = math.floor(u[j] * (j + 1))
      if r > j then r = j end
      perm[j], perm[r] = perm[r], perm[j]
    end
    self.perm, self.perm_epoch = perm, e
  end
  return self.perm
end

-- the 0-based document number (into doc_piece, doc_start, doc_len) of stream document i
function TextSource:index(i)
  if not is_int(i) or i < 0 then bad(fmt("%s: document index must be an integer >= 0, got %s", self.name, tostring(i))) end
  local n = self.n_docs
  if self.order == "sequential" then return i % n end
  return self:permutation(math.floor(i / n))[i % n]
end

-- doc(i, T) -> ids, targets, n (T is not used: a text document is the same at every row length)
function TextSource:doc(i, T)
  local j = self:index(i) + 1
  local n = self.doc_len[j]
  local ids, targets = ffi.new("int32_t[?]", n), ffi.new("int32_t[?]", n)
  ffi.copy(ids, self.pieces[self.doc_piece[j]].buf + self.doc_start[j], n * 4)
  for t = 0, n - 2 do targets[t] = ids[t + 1] end
  targets[n - 1] = pack.IGNORE
  return ids, targets, n
end

-- span(u, n, keep) -> int32_t[n] (0-based): the filler text of the synthetic generators (filler = "text",
-- data/synthetic.lua). The split's documents in stored order form one stream of N tokens; the span reads it from
-- token ⌊u·N⌋ on, wrapping at the end, and keeps the ids for which keep(id) is true (<|endoftext|> never), so the
-- generators leave out the ids they score. A pure function of (the source's files and split, u, n, keep).
function TextSource:span(u, n, keep)
  local cum = self.doc_cum
  if not cum then
    cum = { [1] = 0 }
    for j = 1, self.n_docs do cum[j + 1] = cum[j] + self.doc_len[j] end
    self.doc_cum = cum
  end
  local N = cum[self.n_docs + 1]
  if type(u) ~= "number" or not (u >= 0 and u < 1) then bad(fmt("%s: span start u must be in [0, 1), got %s", self.name, tostring(u))) end
  local pos = math.floor(u * N)
  local lo, hi = 1, self.n_docs                    -- the document j with cum[j] <= pos < cum[j + 1]
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if cum[mid] <= pos then lo = mid else hi = mid - 1 end
  end
  local out = ffi.new("int32_t[?]", math.max(n, 1))
  local j, off, got, scanned, eot = lo, pos - cum[lo], 0, 0, self.eot
  while got < n do
    local buf, len = self.pieces[self.doc_piece[j]].buf + self.doc_start[j], self.doc_len[j]
    for t = off, len - 1 do
      local id = buf[t]
      if id ~= eot and keep(id) then
        out[got] = id
        got = got + 1
        if got == n then break end
      end
    end
    scanned = scanned + len - off
    if got == 0 and scanned >= N then bad(fmt("%s: no token of the text is usable as filler (all are excluded)", self.name)) end
    j, off = j % self.n_docs + 1, 0
  end
  return out
end

---------------------------------------------------------------------------------------------------
-- the packer

local Packer = {}
Packer.__index = Packer

local PACKER_KEYS = { sources = true, seq_len = true, seed = true, eot = true, pad = true, media_pad = true,
  lane = true, lanes = true }
local ENTRY_KEYS = { source = true, weight = true, min_len = true, max_len = true, name = true }

-- Packer{sources = {{source, weight, min_len, max_len, name}, ...}, seq_len, seed, eot, pad, media_pad}
-- pad, media_pad: the ids of <|pad|> and <|media_pad|> (tok:id by name) for sources with images; a source's own
-- src.pad_id / src.media_pad_id take precedence (the image sources of data/multimodal.lua carry them)
function pack.Packer(cfg)
  check_keys(cfg, PACKER_KEYS, "Packer config")
  local list = cfg.sources
  if type(list) ~= "table" or #list == 0 then bad("sources must be a non-empty list of {source = ..., weight = ...}") end
  for k in pairs(list) do
    if not is_int(k) or k < 1 or k > #list then bad(fmt("sources must be a list (1 .. %d), got key '%s'", #list, tostring(k))) end
  end
  local T = positive_int(cfg.seq_len, "seq_len")
  local seed = check_seed(cfg.seed or 0, "seed")
  if not is_int(cfg.eot) or cfg.eot < 0 then
    bad(fmt("eot must be the integer id of <|endoftext|> (tok:id(\"<|endoftext|>\")), got %s", tostring(cfg.eot)))
  end
  for _, k in ipairs({ "pad", "media_pad" }) do
    if cfg[k] ~= nil and (not is_int(cfg[k]) or cfg[k] < 0) then bad(fmt("%s must be an integer token id, got %s", k, tostring(cfg[k]))) end
  end
  -- lane `lane` of `lanes` (data parallelism, pack.Lanes): its draws are the stream's counters lane, lane + lanes, ...
  -- and its documents of each source the indices lane, lane + lanes, ...: lanes read disjoint documents, and lane 0
  -- of 1 is the packer itself
  local lanes, lane = cfg.lanes or 1, cfg.lane or 0
  if not is_int(lanes) or lanes < 1 then bad(fmt("lanes must be an integer >= 1, got %s", tostring(cfg.lanes))) end
  if not is_int(lane) or lane < 0 or lane >= lanes then
    bad(fmt("lane must be an integer in [0, %d), got %s", lanes, tostring(cfg.lane)))
  end
  local self = setmetatable({
    lanes = lanes, lane = lane,
    seq_len = T, seed = seed, eot = cfg.eot, key = PACK_KEY * STRIDE + seed, pad = cfg.pad, media_pad = cfg.media_pad,
    sources = {}, by_name = {}, total_weight = 0, draws = 0, carry = nil,
    u = ffi.new("double[1]"), shape = ffi.new("int64_t[2]"), i32 = C.tide_dtype_from_name("i32"),
  }, Packer)
  for j, e in ipairs(list) do
    local what = fmt("sources[%d]", j)
    check_keys(e, ENTRY_KEYS, what)
    local src = e.source
    if type(src) ~= "table" and type(src) ~= "userdata" then bad(fmt("%s.source must be a document source, got %s", what, type(src))) end
    if type(src.doc) ~= "function" then bad(fmt("%s.source has no doc(i, T) method", what)) end
    local name = e.name or src.name
    if type(name) ~= "string" or name == "" then bad(fmt("%s needs a name (entry.name or source.name), got %s", what, tostring(name))) end
    if self.by_name[name] then bad(fmt("%s: source name '%s' is used twice; give each entry its own name", what, name)) end
    local w = e.weight
    if type(w) ~= "number" or not (w > 0) or w == math.huge then
      bad(fmt("%s ('%s'): weight must be a finite number > 0, got %s", what, name, tostring(w)))
    end
    local lo = e.min_len or 1
    local hi = e.max_len or math.huge
    if not is_int(lo) or lo < 1 then bad(fmt("%s ('%s'): min_len must be an integer >= 1, got %s", what, name, tostring(lo))) end
    if hi ~= math.huge and (not is_int(hi) or hi < lo) then
      bad(fmt("%s ('%s'): max_len must be an integer >= min_len (%d), got %s", what, name, lo, tostring(hi)))
    end
    self.total_weight = self.total_weight + w
    local s = { index = j, name = name, source = src, weight = w, min_len = lo, max_len = hi, cursor = 0, tokens = 0 }
    self.sources[j] = s
    self.by_name[name] = s
  end
  local acc = 0
  for _, s in ipairs(self.sources) do
    acc = acc + s.weight
    s.cum = acc / self.total_weight
  end
  return self
end

-- set_mix({{name, weight, min_len, max_len}, ...}): a stage switch that changes the mixture. Every name must be
-- one of the packer's sources; sources left out get weight 0 (not drawn) but keep their cursors, so a later stage
-- that lists them again continues where they stopped. The state (draws, cursors, carry-over) is untouched.
function Packer:set_mix(entries)
  if type(entries) ~= "table" or #entries == 0 then bad("set_mix: expected a non-empty list of {name, weight, ...}") end
  local seen = {}
  for j, e in ipairs(entries) do
    local what = fmt("set_mix[%d]", j)
    local s = type(e) == "table" and self.by_name[e.name]
    if not s then bad(fmt("%s: no source named '%s' in this packer", what, tostring(type(e) == "table" and e.name))) end
    if seen[e.name] then bad(fmt("%s: source '%s' is listed twice", what, e.name)) end
    seen[e.name] = true
    if type(e.weight) ~= "number" or not (e.weight > 0) or e.weight == math.huge then
      bad(fmt("%s ('%s'): weight must be a finite number > 0, got %s", what, e.name, tostring(e.weight)))
    end
    local lo, hi = e.min_len or 1, e.max_len or math.huge
    if not is_int(lo) or lo < 1 then bad(fmt("%s ('%s'): min_len must be an integer >= 1, got %s", what, e.name, tostring(lo))) end
    if hi ~= math.huge and (not is_int(hi) or hi < lo) then
      bad(fmt("%s ('%s'): max_len must be an integer >= min_len (%d), got %s", what, e.name, lo, tostring(hi)))
    end
  end
  local total = 0
  for _, s in ipairs(self.sources) do
    s.weight, s.min_len, s.max_len = 0, 1, math.huge
  end
  for _, e in ipairs(entries) do
    local s = self.by_name[e.name]
    s.weight, s.min_len, s.max_len = e.weight, e.min_len or 1, e.max_len or math.huge
    total = total + e.weight
  end
  self.total_weight = total
  local acc = 0
  for _, s in ipairs(self.sources) do
    acc = acc + s.weight
    s.cum = acc / total
  end
end

-- document i of source s at row length T, checked against the source contract
-- the images a document returned, checked: grids, spans in order inside the document, all <|media_pad|>
local function check_images(self, s, i, ids, targets, n, images)
  if images == nil or #images == 0 then return nil end
  local src = s.source
  local mp = src.media_pad_id or self.media_pad
  local last = 0
  for k, im in ipairs(images) do
    local what = fmt("source '%s': document %d image %d", s.name, i, k)
    if type(im) ~= "table" then bad(what .. " must be a table {patches, h, w, pos, n}") end
    if not (is_int(im.h) and is_int(im.w) and im.h >= 2 and im.w >= 2 and im.h % 2 == 0 and im.w % 2 == 0) then
      bad(fmt("%s: the grid h x w must be even integers >= 2, got %s x %s", what, tostring(im.h), tostring(im.w)))
    end
    if im.n ~= im.h * im.w / 4 then bad(fmt("%s: n = %s, expected h·w/4 = %d", what, tostring(im.n), im.h * im.w / 4)) end
    if not is_int(im.pos) or im.pos < last or im.pos + im.n > n then
      bad(fmt("%s: the span at pos %s of %d tokens must lie in the document (length %d) after the previous image (ending at %d)",
        what, tostring(im.pos), im.n, n, last))
    end
    local ps = tide.is_tensor(im.patches) and im.patches:shape()
    if not ps or #ps ~= 2 or ps[1] ~= im.h * im.w or im.patches:dtype() ~= "f32" then
      bad(fmt("%s: patches must be an f32 tensor [h·w = %d, 3p²], got %s", what, im.h * im.w,
        ps and (im.patches:dtype() .. " [" .. table.concat(ps, ", ") .. "]") or type(im.patches)))
    end
    if mp then
      for t = im.pos, im.pos + im.n - 1 do
        if ids[t] ~= mp then bad(fmt("%s: position %d of its span holds id %d, not <|media_pad|> (%d)", what, t, ids[t], mp)) end
      end
    end
    -- a placeholder is never a target (vision.md §8), whatever the source wrote
    for t = math.max(0, im.pos - 1), im.pos + im.n - 2 do targets[t] = pack.IGNORE end
    last = im.pos + im.n
  end
  if mp then
    local count, want = 0, 0
    for t = 0, n - 1 do if ids[t] == mp then count = count + 1 end end
    for _, im in ipairs(images) do want = want + im.n end
    if count ~= want then
      bad(fmt("source '%s': document %d holds %d <|media_pad|> ids but its images need %d", s.name, i, count, want))
    end
  end
  return images
end

local function fetch(self, s, i, T)
  local ids, targets, n, images = s.source:doc(i, T)
  if not is_int(n) or n < 1 then bad(fmt("source '%s': doc(%d, %d) returned length %s", s.name, i, T, tostring(n))) end
  if ids[0] ~= self.eot then
    bad(fmt("source '%s': document %d begins with id %d, not <|endoftext|> (%d)", s.name, i, ids[0], self.eot))
  end
  return ids, targets, n, check_images(self, s, i, ids, targets, n, images)
end

-- the next document of the mixture: one draw picks the source, its cursor walks past filtered documents
local function next_document(self)
  C.tide_philox_uniform(self.key, self.draws * self.lanes + self.lane, self.u, 1)
  self.draws = self.draws + 1
  local u, s = self.u[0], nil
  for _, c in ipairs(self.sources) do
    if u < c.cum then s = c break end
    if c.weight > 0 then s = c end   -- (u at the rounding edge of the last cumulative weight: the last live source)
  end
  local T = self.seq_len
  for _ = 1, pack.MAX_REJECTIONS do
    local i = s.cursor * self.lanes + self.lane
    s.cursor = s.cursor + 1
    local ids, targets, n, images = fetch(self, s, i, T)
    if n >= s.min_len and n <= s.max_len then
      return { s = s, doc = i, ids = ids, targets = targets, n = n, offset = 0, seq_len = T, images = images }
    end
  end
  bad(fmt("source '%s': %d consecutive documents (up to index %d) fell outside min_len %d .. max_len %s at seq_len %d",
    s.name, pack.MAX_REJECTIONS, (s.cursor - 1) * self.lanes + self.lane, s.min_len, tostring(s.max_len), T))
end

-- the batch's images, concatenated in flattened-row order (vision.md §3): {patches [Σ L, 3p²], grids, cu_seqlens,
-- pad_id}
local function batch_images(placed)
  local width = placed[1].im.patches:shape()[2]
  local total = 0
  for _, e in ipairs(placed) do
    local ps = e.im.patches:shape()
    if ps[2] ~= width then
      bad(fmt("source '%s': document %d has patches of width %d, but the batch's first image has %d (one patch size per batch)",
        e.source, e.doc, ps[2], width))
    end
    total = total + ps[1]
  end
  local buf = ffi.new("float[?]", total * width)
  local grids, cu, at = {}, { 0 }, 0
  for k, e in ipairs(placed) do
    local L = e.im.h * e.im.w
    local pt = e.im.patches:contiguous()
    tide.check_status(C.tide_read_bytes(tide.raw(pt), buf + at * width, L * width * 4))
    at = at + L
    grids[k], cu[k + 1] = { e.im.h, e.im.w }, at
  end
  local shape = ffi.new("int64_t[2]", total, width)
  -- pad_id: the <|media_pad|> id the model splices at (one per batch: every source of it uses the same tokenizer)
  local pad_id = placed[1].media_pad
  for _, e in ipairs(placed) do
    if e.media_pad ~= pad_id then
      bad(fmt("source '%s' marks images with id %s, another source of the batch with %s (one <|media_pad|> per batch)",
        e.source, tostring(e.media_pad), tostring(pad_id)))
    end
  end
  return { patches = tide.check(C.tide_from_bytes(C.tide_dtype_from_name("f32"), 2, shape, 0, buf, total * width * 4)),
           grids = grids, cu_seqlens = cu, pad_id = pad_id }
end

-- next_rows(R) -> {ids [R, T] i32, targets [R, T] i32, cu_seqlens, max_seqlen, n_targets, segments, per_source
--                  [, images, image_spans]}
-- cu_seqlens: 0-based offsets over the R·T flattened tokens of every segment start (each row start, each
-- document start, each <|pad|> run that closes a row before an image span) and R·T at the end.
-- Only when the batch holds an image: images = {patches = f32 [Σ L, 3p²] (images in flattened-row order),
-- grids = {{h, w}, ...}, cu_seqlens = {0, L1, L1 + L2, ...}} and image_spans = {{row, pos, n, h, w, doc, source},
-- ...} in the same order (row 0-based, pos the 0-based flattened position of the first placeholder, doc the
-- source's document index, source its name): the <|media_pad|> ids of `ids` (row-major) are exactly these spans.
function Packer:next_rows(R)
  positive_int(R, "next_rows: R")
  local T, eot, IGNORE = self.seq_len, self.eot, pack.IGNORE
  local N = R * T
  local ibuf, tbuf = ffi.new("int32_t[?]", N), ffi.new("int32_t[?]", N)
  local cu, per_source, max_seqlen = { 0 }, {}, 0
  local placed, spans = {}, {}
  local cur = self.carry
  for r = 0, R - 1 do
    local p = 0
    while p < T do
      if not cur then cur = next_document(self) end
      local base, off = r * T + p, cur.offset
      local take = math.min(cur.n - off, T - p)
      local close = false            -- the row ends before an image span: <|pad|> fills the rest
      if cur.images and take < cur.n - off then
        local c = off + take
        for _, im in ipairs(cur.images) do
          if im.pos < c and c < im.pos + im.n then
            if im.n > T then
              bad(fmt("source '%s': document %d has an image of %d tokens (grid %d x %d), more than seq_len %d: "
                .. "an image span is never cut", cur.s.name, cur.doc, im.n, im.h, im.w, T))
            end
            take, close = im.pos - off, true
            break
          end
        end
      end
      if take > 0 then
        ffi.copy(ibuf + base, cur.ids + off, take * 4)
        ffi.copy(tbuf + base, cur.targets + off, take * 4)
        cur.offset = off + take
        local ends = cur.offset == cur.n
        tbuf[base + take - 1] = ends and eot or IGNORE   -- only a document's end predicts across a boundary
        if base > 0 then cu[#cu + 1] = base end
        if take > max_seqlen then max_seqlen = take end
        local s = cur.s
        s.tokens = s.tokens + take
        per_source[s.name] = (per_source[s.name] or 0) + take
        p = p + take
        if cur.images then
          for _, im in ipairs(cur.images) do
            if im.pos >= off and im.pos < off + take then
              placed[#placed + 1] = { im = im, doc = cur.doc, source = s.name,
                                      media_pad = s.source.media_pad_id or self.media_pad }
              spans[#spans + 1] = { row = r, pos = base + im.pos - off, n = im.n, h = im.h, w = im.w, doc = cur.doc,
                                    source = s.name }
            end
          end
        end
        if ends then cur = nil end
      end
      if close then
        local pad = cur.s.source.pad_id or self.pad
        if not pad then bad(fmt("source '%s': closing a row before an image span needs the <|pad|> id (Packer pad = tok:id(\"<|pad|>\"))", cur.s.name)) end
        local b = r * T + p
        for k = b, r * T + T - 1 do ibuf[k], tbuf[k] = pad, IGNORE end
        if b > r * T then cu[#cu + 1] = b end
        if T - p > max_seqlen then max_seqlen = T - p end
        p = T
      end
    end
  end
  cu[#cu + 1] = N
  self.carry = cur
  local n_targets = 0
  for k = 0, N - 1 do
    if tbuf[k] ~= IGNORE then n_targets = n_targets + 1 end
  end
  self.shape[0], self.shape[1] = R, T
  local out = {
    ids = tide.check(C.tide_from_bytes(self.i32, 2, self.shape, 0, ibuf, N * 4)),
    targets = tide.check(C.tide_from_bytes(self.i32, 2, self.shape, 0, tbuf, N * 4)),
    cu_seqlens = cu, max_seqlen = max_seqlen, n_targets = n_targets, segments = #cu - 1, per_source = per_source,
  }
  if #placed > 0 then out.images, out.image_spans = batch_images(placed), spans end
  return out
end

-- a stage switch (long_context.md §6): cursors, draws and the carried-over remainder stay; the next rows have T2
function Packer:set_seq_len(T2)
  self.seq_len = positive_int(T2, "set_seq_len: seq_len")
end

-- tokens packed per source name since construction (or since the state that was restored)
function Packer:tokens_per_source()
  local out = {}
  for _, s in ipairs(self.sources) do out[s.name] = s.tokens end
  return out
end

-- state() -> {seed, sources = {names in order}, draws, cursors = {name = n}, tokens = {name = n},
--             carry = {source = name, doc = i, offset = tokens already packed, seq_len = T the doc was made at} | nil}
function Packer:state()
  local names, cursors = {}, {}
  for j, s in ipairs(self.sources) do
    names[j] = s.name
    cursors[s.name] = s.cursor
  end
  local st = { seed = self.seed, sources = names, draws = self.draws, cursors = cursors, tokens = self:tokens_per_source() }
  if self.lanes > 1 then st.lane, st.lanes = self.lane, self.lanes end   -- (one lane: the plain packer's state)
  local c = self.carry
  if c then st.carry = { source = c.s.name, doc = c.doc, offset = c.offset, seq_len = c.seq_len } end
  return st
end

local function names_str(list) return "{" .. table.concat(list, ", ") .. "}" end

-- set_state(st): the next rows equal those of the packer that wrote st; a state of other sources or another
-- seed is an error. Weights and length filters may differ (a stage may change the mixture).
function Packer:set_state(st)
  if type(st) ~= "table" then bad("set_state: expected a state table, got " .. type(st)) end
  if st.seed ~= self.seed then
    bad(fmt("set_state: the state's seed %s differs from the packer's seed %d", tostring(st.seed), self.seed))
  end
  if (st.lanes or 1) ~= self.lanes or (st.lane or 0) ~= self.lane then
    bad(fmt("set_state: the state is lane %s of %s, the packer lane %d of %d", tostring(st.lane or 0),
      tostring(st.lanes or 1), self.lane, self.lanes))
  end
  local mine = {}
  for j, s in ipairs(self.sources) do mine[j] = s.name end
  local theirs = type(st.sources) == "table" and st.sources or {}
  local same = #theirs == #mine
  for j = 1, #mine do if theirs[j] ~= mine[j] then same = false end end
  if not same then
    bad(fmt("set_state: the state's sources %s differ from the packer's sources %s (names, in order)",
      names_str(theirs), names_str(mine)))
  end
  if not is_int(st.draws) or st.draws < 0 then bad("set_state: draws must be an integer >= 0, got " .. tostring(st.draws)) end
  for _, s in ipairs(self.sources) do
    local c = type(st.cursors) == "table" and st.cursors[s.name]
    if not is_int(c) or c < 0 then bad(fmt("set_state: cursor of source '%s' must be an integer >= 0, got %s", s.name, tostring(c))) end
    local t = type(st.tokens) == "table" and st.tokens[s.name] or 0
    if not is_int(t) or t < 0 then bad(fmt("set_state: tokens of source '%s' must be an integer >= 0, got %s", s.name, tostring(t))) end
  end
  local carry = nil
  if st.carry ~= nil then
    local c = st.carry
    local s = type(c) == "table" and self.by_name[c.source]
    if not s then bad(fmt("set_state: carry-over names source '%s', which the packer does not have", tostring(type(c) == "table" and c.source))) end
    local L = self.lanes
    if not is_int(c.doc) or c.doc < 0 or c.doc >= st.cursors[s.name] * L or (c.doc - self.lane) % L ~= 0 then
      bad(fmt("set_state: carry-over document %s of source '%s' is not below its cursor %d%s", tostring(c.doc), s.name,
        st.cursors[s.name], L > 1 and fmt(" (or not one of lane %d's documents)", self.lane) or ""))
    end
    positive_int(c.seq_len, "set_state: carry-over seq_len")
    local ids, targets, n, images = fetch(self, s, c.doc, c.seq_len)
    if not is_int(c.offset) or c.offset < 1 or c.offset >= n then
      bad(fmt("set_state: carry-over offset %s must lie inside document %d of source '%s' (length %d)",
        tostring(c.offset), c.doc, s.name, n))
    end
    carry = { s = s, doc = c.doc, ids = ids, targets = targets, n = n, offset = c.offset, seq_len = c.seq_len, images = images }
  end
  self.draws = st.draws
  for _, s in ipairs(self.sources) do
    s.cursor = st.cursors[s.name]
    s.tokens = type(st.tokens) == "table" and st.tokens[s.name] or 0
  end
  self.carry = carry
end

-- ---- lanes (data parallelism): L packers, lane j reading the documents j, j + L, ... of each source -----------------
-- pack.Lanes{make = function(lane, lanes) -> a Packer, lanes = L, first = j0, count = k}: the lanes j0 .. j0 + k − 1
-- of L that one rank hosts. A step's n micro-batches are n / k from each hosted lane, lane by lane, so rank r of dp = L
-- (hosting lane r) reads only its own documents, and one rank hosting all L lanes trains on what the L ranks train
-- on, in the same order (gradient accumulation == the rank-order sum). One lane of one is the plain packer (its
-- batches and its state are the Packer's).
local Lanes = {}
Lanes.__index = Lanes

function pack.Lanes(o)
  local L, first, k = o.lanes or 1, o.first or 0, o.count or (o.lanes or 1)
  if not is_int(L) or L < 1 then bad(fmt("lanes must be an integer >= 1, got %s", tostring(o.lanes))) end
  if not is_int(k) or k < 1 or not is_int(first) or first < 0 or first + k > L then
    bad(fmt("lanes %s .. %s are not lanes of %d", tostring(first), tostring(first + (k or 0) - 1), L))
  end
  local self = setmetatable({ lanes = L, first = first, count = k, packers = {} }, Lanes)
  for j = first, first + k - 1 do self.packers[#self.packers + 1] = o.make(j, L) end
  return self
end

-- next_step(n, R) -> n batches of R rows: n / count from each hosted lane in lane order
function Lanes:next_step(n, R)
  if n % self.count ~= 0 then
    bad(fmt("a step's %d micro-batches on this rank do not split over its %d data lanes", n, self.count))
  end
  local out, per = {}, n / self.count
  for _, p in ipairs(self.packers) do
    for _ = 1, per do out[#out + 1] = p:next_rows(R) end
  end
  return out
end

-- next_rows(R): the one hosted lane's next rows (recipe hooks and tests that draw rows themselves)
function Lanes:next_rows(R)
  if self.count ~= 1 then bad(fmt("next_rows: %d lanes are hosted here; draw a step with next_step", self.count)) end
  return self.packers[1]:next_rows(R)
end

function Lanes:set_seq_len(T) for _, p in ipairs(self.packers) do p:set_seq_len(T) end end
function Lanes:set_mix(entries) for _, p in ipairs(self.packers) do p:set_mix(entries) end end

function Lanes:tokens_per_source()
  local out = {}
  for _, p in ipairs(self.packers) do
    for name, n in pairs(p:tokens_per_source()) do out[name] = (out[name] or 0) + n end
  end
  return out
end

-- state() -> one lane of one: the Packer's state; else {lanes = L, states = {["j"] = lane j's state}} of the hosted
-- lanes, keyed by the 0-based lane index as a string (a data-parallel checkpoint merges every rank's: merge_states)
function Lanes:state()
  if self.lanes == 1 then return self.packers[1]:state() end
  local states = {}
  for i, p in ipairs(self.packers) do states[tostring(self.first + i - 1)] = p:state() end
  return { lanes = self.lanes, states = states }
end

-- merge_states(list) -> one lanes state from several ranks' (each holding some lanes)
function pack.merge_lane_states(list)
  local out
  for _, st in ipairs(list) do
    if st.lanes == nil then return st end                 -- one lane of one
    out = out or { lanes = st.lanes, states = {} }
    for j, s in pairs(st.states) do out.states[j] = s end
  end
  return out
end

-- set_state(st): the state of the same lane count (a data-parallel run resumes under any rank count that divides
-- its lanes; one rank hosts them all with dist.lanes = L); every hosted lane's state must be there
function Lanes:set_state(st)
  if type(st) ~= "table" then bad("set_state: expected a state table, got " .. type(st)) end
  local theirs = st.lanes or 1
  if theirs ~= self.lanes then
    bad(fmt("set_state: the checkpoint's data is in %d lane%s, this run reads %d (set dist.lanes = %d to resume it)",
      theirs, theirs == 1 and "" or "s", self.lanes, theirs))
  end
  if self.lanes == 1 then return self.packers[1]:set_state(st) end
  for i, p in ipairs(self.packers) do
    local s = type(st.states) == "table" and st.states[tostring(self.first + i - 1)]
    if type(s) ~= "table" then bad(fmt("set_state: the state of data lane %d is missing", self.first + i - 1)) end
    p:set_state(s)
  end
end

return pack
