-- tide plot RUN: the run's metrics.jsonl drawn as one self-contained HTML page (tide.plot: inline SVG, nothing
-- fetched), written atomically to RUN/report.html or -o PATH.
local ffi = require "ffi"
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide plot RUN [-o report.html]

Draws the metrics of the run directory RUN (its metrics.jsonl) as one HTML page that needs nothing else to open:
loss and validation loss, learning rate, gradient norm, tokens/s, memory, the MaxVio of every MoE layer (last batch
and validation), a heatmap of the per-expert loads of each MoE layer over the steps, the stage boundaries, and the
tables of the stage ends, the final task evals and the expert loads.

  -o, --out PATH      where to write the page (default RUN/report.html; written atomically)]]

local SPEC = { out = { kind = "string" } }
M.SPEC = SPEC

local fmt = string.format
local LINE_LIMIT = 64 * 2 ^ 20          -- formats.md §5: at most 64 MiB per JSONL line

local function fail(msg) error("plot: " .. msg, 0) end

-- read_records(path) -> the decoded records (blank lines skipped); a malformed line fails as path:line: why. A last
-- line without its LF that does not parse is a record being written (a run in progress) and is left out.
function M.read_records(path)
  local tide = require "tide"
  local json = require "tide.json"
  local text, err = tide.read_file(path)          -- regular files only: a FIFO or a directory is refused, never read
  if not text then fail(err) end
  local out, n, pos = {}, 0, 1
  while pos <= #text do
    local nl = text:find("\n", pos, true)
    local line = text:sub(pos, (nl or #text + 1) - 1)
    pos = (nl or #text) + 1
    n = n + 1
    if #line > LINE_LIMIT then fail(fmt("%s:%d: a line of %d bytes (at most 64 MiB)", path, n, #line)) end
    if line:find("[^ \t\r]") then
      local ok, r = pcall(json.decode, line)
      if not ok then
        if not nl then break end
        local why = tostring(r):gsub("^json%.decode: ", ""):gsub(" at line 1 column (%d+) %(byte %d+%)$", " at column %1")
        fail(fmt("%s:%d: %s", path, n, why))
      end
      if type(r) ~= "table" or r[1] ~= nil then fail(fmt("%s:%d: a record must be a JSON object", path, n)) end
      out[#out + 1] = r
    end
  end
  return out
end

function M.main(args)
  local pos, flags = cli.parse_flags(args, SPEC, "tide plot", { o = "out" })
  if #pos ~= 1 then
    cli.usage_error(fmt("tide plot: expected one run directory, got %d argument(s) (tide plot --help)", #pos))
  end
  local tide = require "tide"
  local C = tide.C
  local run = pos[1]:gsub("(.)/+$", "%1")
  if C.tide_path_exists(run) ~= 1 then fail(fmt("'%s' does not exist (a run directory with a metrics.jsonl)", run)) end
  if C.tide_is_dir(run) ~= 1 then fail(fmt("'%s' is not a directory (a run directory with a metrics.jsonl)", run)) end
  local path = run .. "/metrics.jsonl"
  if C.tide_path_exists(path) ~= 1 then fail(fmt("'%s' has no metrics.jsonl: not a run directory, or no step was logged", run)) end
  local records = M.read_records(path)
  local title = run:match("([^/]+)$") or run
  if C.tide_path_exists(run .. "/config.json") == 1 then
    local ok, cfg = pcall(require("tide.json").read, run .. "/config.json")
    if ok and type(cfg) == "table" and type(cfg.name) == "string" then title = cfg.name .. " (" .. title .. ")" end
  end
  local plot = require "tide.plot"
  local ok, html, info = pcall(plot.report, records, { title = title, source = path })
  if not ok then
    if tostring(html):match("^plot: no step records") then fail(fmt("%s holds no step records to draw", path)) end
    error(html, 0)
  end
  local out = flags.out or (run .. "/report.html")
  if C.tide_file_write_text_atomic(out, html) ~= 0 then fail(fmt("cannot write '%s': %s", out, ffi.string(C.tide_last_error()))) end
  print(fmt("plot: wrote %s (%d charts, %d expert-load cells, %d step records)", out, info.charts, info.heatmap_cells,
    #plot.collect(records).steps))
  return 0
end

return M
