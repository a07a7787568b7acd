-- results.lua — benchmark and study results on disk: one JSON record and one Markdown table per run,
-- written atomically under a results directory (bench/results by default).
local ffi = require "ffi"
local tide = require "tide"
local json = require "tide.json"

local results = {}

-- write(dir, name, record, md, first): <dir>/<name>.json (keys `first` first) and <dir>/<name>.md; dir "" writes
-- nothing. Errors name the path.
function results.write(dir, name, record, md, first)
  if dir == "" then return end
  if tide.C.tide_mkdir_p(dir) ~= 0 then
    error(name .. ": cannot create '" .. dir .. "': " .. ffi.string(tide.C.tide_last_error()), 0)
  end
  local text = json.encode(record, { first = first or { "benchmark", "date" } }) .. "\n"
  for _, f in ipairs({ { dir .. "/" .. name .. ".json", text }, { dir .. "/" .. name .. ".md", md } }) do
    if tide.C.tide_file_write_text_atomic(f[1], f[2]) ~= 0 then
      error(name .. ": cannot write '" .. f[1] .. "': " .. ffi.string(tide.C.tide_last_error()), 0)
    end
  end
  io.stderr:write(name .. ": wrote " .. dir .. "/" .. name .. ".json and " .. name .. ".md\n")
end

-- numbers(s) -> the integers in s ("8192,32768" or a number) as a list: the size lists of benchmark options
function results.numbers(s)
  local out = {}
  for n in tostring(s):gmatch("%d+") do out[#out + 1] = tonumber(n) end
  return out
end

-- the 1-minute load average (nil where /proc is absent): benchmarks record it beside their timings
function results.loadavg()
  local f = io.open("/proc/loadavg")
  if not f then return nil end
  local line = f:read("*l")
  f:close()
  return line and tonumber(line:match("^(%S+)"))
end

-- sync(device): waits for the work queued on a GPU (a one-element read back is ordered after it); nothing on the cpu
function results.sync(device)
  if device ~= "cpu" then require("tide").zeros({ 1 }, { device = device }):item() end
end

-- median(xs) of a list of numbers (the list is not changed)
function results.median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

return results
