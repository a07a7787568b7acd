-- log.lua — metrics as JSONL (one object per line, flushed) and a human progress display:
-- a live one-line status on a terminal, plain lines otherwise (formats.md §5, DESIGN.md §7).
local ffi = require "ffi"
local json = require "tide.json"

local log = {}

pcall(ffi.cdef, "int isatty(int fd);")
pcall(ffi.cdef, "int close(int fd);")

-- is_tty(fd): true when fd (default 1, stdout) is a terminal; TIDE_NO_TTY=1 forces plain lines
function log.is_tty(fd)
  if os.getenv("TIDE_NO_TTY") == "1" then return false end
  local ok, r = pcall(function() return ffi.C.isatty(fd or 1) end)
  return ok and r == 1
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

-- open{path = "run/metrics.jsonl" or nil, tty = auto, out = io.stdout, quiet = false}
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
  end
  return self
end

local FIRST = { "step", "time", "stage", "tokens", "loss", "val_loss", "lr", "grad_norm", "tok_per_s" }

-- metrics(record): append one JSONL line (non-finite values -> null + "nonfinite")
function Logger:metrics(rec)
  if not self.file then return end
  -- a full disk or a file-size limit is an error naming the file, never a silently shortened history
  local ok, err = self.file:write(json.record(rec, FIRST), "\n")
  if ok then ok, err = self.file:flush() end
  if not ok then error("log: cannot append to '" .. tostring(self.path) .. "': " .. tostring(err), 2) end
end

-- the progress text for one step
function log.progress_text(p)
  local parts = { string.format("step %d/%d", p.step, p.steps) }
  if p.loss then parts[#parts + 1] = string.format("loss %.4f", p.loss) end
  if p.val_loss then parts[#parts + 1] = string.format("val %.4f", p.val_loss) end
  if p.lr then parts[#parts + 1] = string.format("lr %.2e", p.lr) end
  if p.tok_per_s then parts[#parts + 1] = log.si(p.tok_per_s) .. " tok/s" end
  if p.eta then parts[#parts + 1] = "ETA " .. log.duration(p.eta) end
  if p.note then parts[#parts + 1] = p.note end
  return table.concat(parts, " | ")
end

-- progress(p, plain): on a terminal rewrite the live line every call; otherwise print a line when plain
function Logger:progress(p, plain)
  if self.quiet then return end
  local text = log.progress_text(p)
  if self.tty then
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
end

return log
