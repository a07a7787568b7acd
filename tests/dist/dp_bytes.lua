-- dp_bytes.lua — the bytes a data-parallel run's ranks sent per step (metrics.jsonl: dist/bytes_sent_mean, the process
-- group's count) against dist.step_bytes, the formula --dry-run and bench/dist plan with, for the run's model (its
-- config.json), rank count and ZeRO level: within --tol relative (the step's scalar sums are the rest).
--   tide run tests/dist/dp_bytes.lua --dir=RUN --ranks=N [--tol=0.01]
local tide = require "tide"
local json = require "tide.json"
local dist = require "tide.dist"

local function run(cfg)
  local c = json.decode(assert(tide.read_file(cfg.dir .. "/config.json")))
  local model = tide.nn.build(c.model)
  local bytes = 0
  for _, t in model:named_parameters() do bytes = bytes + t:nbytes() end
  local n, zero = tonumber(cfg.ranks), (c.dist and c.dist.zero) or 0
  local want = dist.step_bytes(bytes, n, zero)
  local got, steps = {}, 0
  for line in assert(tide.read_file(cfg.dir .. "/metrics.jsonl")):gmatch("[^\n]+") do
    local r = json.decode(line)
    if r.step and r["dist/bytes_sent_mean"] then got[#got + 1] = r["dist/bytes_sent_mean"]; steps = steps + 1 end
  end
  if steps == 0 then error(cfg.dir .. ": no dist/bytes_sent_mean in metrics.jsonl", 0) end
  local tol = tonumber(cfg.tol)
  for i, b in ipairs(got) do
    if math.abs(b - want) > tol * want then
      error(string.format("%s: step %d sent %.0f bytes a rank, dist.step_bytes(%d, %d, %d) = %.0f (off by %.2f%%)",
        cfg.dir, i, b, bytes, n, zero, want, 100 * math.abs(b - want) / want), 0)
    end
  end
  print(string.format("ok   dp %d ZeRO-%d: %d steps sent %.0f bytes a rank (mean), dist.step_bytes = %.0f (%.2f%% apart)",
    n, zero, steps, got[#got], want, 100 * math.abs(got[#got] - want) / want))
  return 0
end

return { run = run, dir = "", ranks = 2, tol = 0.01 }
