-- log.lua — metrics as JSONL (one object per line, flushed), the same scalars in a TensorBoard event file beside it,
-- and a human progress display: a live one-line status on a terminal, plain lines otherwise (formats.md §5, §7,
-- DESIGN.md §7).
local ffi = require "ffi"
local json = require "tide.json"
local tfevents = require "tide.tfevents"

local log = {}

pcall(ffi.cdef, "int isatty(int fd);")
pcall(ffi.cdef, "int close(int fd);")
pcall(ffi.cdef, "struct tide_log_winsize { unsigned short rows, cols, xpixel, ypixel; };")
pcall(ffi.cdef, "int ioctl(int fd, unsigned long request, ...);")

-- is_tty(fd): true when fd (default 1, stdout) is a terminal; TIDE_NO_TTY=1 forces plain lines
function log.is_tty(fd)
  if os.getenv("TIDE_NO_TTY") == "1" then return false end
  local ok, r = pcall(function() return ffi.C.isatty(fd or 1) end)
  return ok and r == 1
end

-- the terminal's width in columns (stdout's, else $COLUMNS, else 80): the live line is cut to fit, since a wrapped
-- line cannot be rewritten with \r
function log.term_width()
  local ok, cols = pcall(function()
    local ws = ffi.new("struct tide_log_winsize")
    if ffi.C.ioctl(1, 0x5413, ws) == 0 then return ws.cols end   -- TIOCGWINSZ
  end)
  if ok and cols and cols > 0 then return cols end
  return tonumber(os.getenv("COLUMNS") or "") or 80
end

-- "1h02m", "3m07s", "12s"
function log.duration(s)
  if s ~= s or s == math.huge or s < 0 then return "?" end
  s = math.floor(s + 0.5)
  if s >= 3600 then return string.format("%dh%02dm", math.floor(s / 3600), math.floor(s % 3600 / 60)) end
  if s >= 60 then return string.format("%dm%02ds", math.floor(s / 60), s % 60) end
  return string.format("%ds", s)
end

-- 12345 -> "12.3k"
function log.si(x)
  if x ~= x then return "nan" end
  local a = math.abs(x)
  if a >= 1e9 then return string.format("%.1fG", x / 1e9) end
  if a >= 1e6 then return string.format("%.1fM", x / 1e6) end
  if a >= 1e3 then return string.format("%.1fk", x / 1e3) end
  return string.format("%.0f", x)
end

local Logger = {}
Logger.__index = Logger

-- the largest step of the records at the end of a metrics file (0 when it has none): where a reopened log goes on
local function last_step(path)
  local f = io.open(path, "rb")
  if not f then return 0 end
  local size = f:seek("end")
  f:seek("set", math.max(0, size - 1048576))      -- records are a few KB: the last MiB holds the last ones
  local tail = f:read("*a") or ""
  f:close()
  local last = 0
  for line in tail:gmatch("[^\n]+") do
    local s = tonumber(line:match('^{"step":(%d+)'))
    if s and s > last then last = s end
  end
  return last
end

-- open{path = "run/metrics.jsonl" or nil, tty = auto, out = io.stdout, quiet = false, tensorboard = true}
-- With a path, the scalars of every record also go to a new TensorBoard event file in the same directory
-- (tfevents.lua) unless tensorboard = false or TIDE_TENSORBOARD=0. A reopened metrics file (a resumed run, which
-- truncated it after its step) gets a new event file that starts a session at the step after its last record, so
-- TensorBoard drops what an earlier file logged beyond it.
function log.open(opts)
  opts = opts or {}
  local self = setmetatable({ out = opts.out or io.stdout, quiet = opts.quiet, live = false }, Logger)
  if opts.tty == nil then self.tty = log.is_tty(1) else self.tty = opts.tty end
  if opts.path then
    -- appending to a FIFO would block and to a device or directory makes no sense: refuse anything but a regular
    -- file in one line (the engine's check, which never blocks)
    local C = require("tide").C
    if C.tide_path_exists(opts.path) == 1 then
      local fd = C.tide_open_regular(opts.path, "metrics file", nil)
      if fd < 0 then error("log: " .. ffi.string(C.tide_last_error()), 2) end
      ffi.C.close(fd)
    end
    local f, err = io.open(opts.path, "ab")
    if not f then error("log: cannot open metrics file '" .. opts.path .. "': " .. tostring(err), 2) end
    self.file = f
    self.path = opts.path
    if opts.tensorboard ~= false and os.getenv("TIDE_TENSORBOARD") ~= "0" then
      local dir = opts.path:match("^(.*)/[^/]*$") or "."
      local last = last_step(opts.path)
      local ok, w = pcall(tfevents.open, dir, { start_step = last + 1 })
      if not ok then f:close(); error("log: " .. tostring(w):gsub("^tfevents: ", ""), 2) end
      self.events, self.events_path, self.events_step = w, w.path, last
    end
  end
  return self
end

local FIRST = { "step", "time", "stage", "tokens", "loss", "val_loss", "lr", "grad_norm", "tok_per_s" }

-- the TensorBoard scalars of a record: every number but step and time (the event's own fields); strings,
-- booleans and lists (moe/load/<layer>) stay in the JSONL
local function scalars_of(rec)
  local list = {}
  for k, v in pairs(rec) do
    if type(v) == "number" and k ~= "step" and k ~= "time" then list[#list + 1] = { k, v } end
  end
  return list
end

-- metrics(record, scalars): append one JSONL line (non-finite values -> null + "nonfinite"), then one TensorBoard
-- event per scalar at the record's step: `scalars` ({tag = value}) when given, else every number of the record.
-- A step record (no "event") at or before the last one (the run rolled back to a checkpoint) first starts a new
-- TensorBoard session there, so the abandoned points are dropped as a reader of the JSONL keeps the last record.
function Logger:metrics(rec, scalars)
  if not self.file then return end
  -- a full disk or a file-size limit is an error naming the file, never a silently shortened history
  local ok, err = self.file:write(json.record(rec, FIRST), "\n")
  if ok then ok, err = self.file:flush() end
  if not ok then error("log: cannot append to '" .. tostring(self.path) .. "': " .. tostring(err), 2) end
  if self.events and type(rec.step) == "number" then
    local list = {}
    if scalars then
      for tag, v in pairs(scalars) do if type(v) == "number" then list[#list + 1] = { tag, v } end end
    else
      list = scalars_of(rec)
    end
    table.sort(list, function(a, b) return a[1] < b[1] end)
    local now = tfevents.now()
    local wok, werr = pcall(function()
      if rec.event == nil then
        if rec.step <= self.events_step then self.events:session_start(rec.step, now) end
        self.events_step = rec.step
      end
      self.events:scalars(rec.step, now, list)
    end)
    if not wok then error("log: " .. tostring(werr):gsub("^tfevents: ", ""), 2) end
  end
end

-- the progress text for one step
function log.progress_text(p)
  local parts = { string.format("%sstep %d/%d", p.stage and ("[" .. p.stage .. "] ") or "", p.step, p.steps) }
  if p.loss then parts[#parts + 1] = string.format("loss %.4f", p.loss) end
  if p.val_loss then parts[#parts + 1] = string.format("val %.4f", p.val_loss) end
  if p.lr then parts[#parts + 1] = string.format("lr %.2e", p.lr) end
  if p.tok_per_s then parts[#parts + 1] = log.si(p.tok_per_s) .. " tok/s" end
  if p.elapsed then parts[#parts + 1] = "elapsed " .. log.duration(p.elapsed) end
  if p.eta then parts[#parts + 1] = "ETA " .. log.duration(p.eta) end
  if p.note then parts[#parts + 1] = p.note end
  return table.concat(parts, " | ")
end

-- progress(p, plain): on a terminal rewrite the live line every call; otherwise print a line when plain
function Logger:progress(p, plain)
  if self.quiet then return end
  local text = log.progress_text(p)
  if self.tty then
    self.width = self.width or log.term_width()
    if #text >= self.width then text = text:sub(1, self.width - 1) end
    self.out:write("\r\27[K", text)
    self.out:flush()
    self.live = true
  elseif plain then
    self.out:write(text, "\n")
    self.out:flush()
  end
end

-- line(msg): a message on its own line (ends the live line first)
function Logger:line(msg)
  if self.quiet then return end
  if self.live then self.out:write("\r\27[K"); self.live = false end
  self.out:write(msg, "\n")
  self.out:flush()
end

-- finish the live line so later output starts on a fresh line
function Logger:done()
  if self.live and not self.quiet then self.out:write("\n"); self.out:flush() end
  self.live = false
end

function Logger:close()
  self:done()
  if self.file then self.file:close(); self.file = nil end
  if self.events then self.events:close(); self.events = nil end
end

return log
