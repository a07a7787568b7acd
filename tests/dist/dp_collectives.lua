-- dp_collectives.lua — the process group's all-gather and all-to-all-v from Lua (lua/tide/dist.lua), under mpirun
-- (tests/dist/dp_check.sh runs it on 2 and 4 ranks): rank r's rows concatenated in rank order on every rank; rows
-- exchanged with uneven counts, empty parts included (rank r sends (r + q) % 3 rows to rank q), landing in rank order.
local tide = require "tide"
local dist = require "tide.dist"

local function run()
  local w, r = dist.world(), dist.rank()
  local g = dist.allgather(tide.tensor({ { r, r + 0.5 }, { -r, 7 } }, { dtype = "f64" })):tolist()
  for q = 0, w - 1 do
    local want = { q, q + 0.5, -q, 7 }
    for k = 1, 4 do
      if g[4 * q + k] ~= want[k] then error(string.format("rank %d: allgather row of rank %d wrong", r, q), 0) end
    end
  end
  local send, recv, rows = {}, {}, {}
  for q = 0, w - 1 do
    send[q + 1], recv[q + 1] = (r + q) % 3, (q + r) % 3
    for k = 1, send[q + 1] do rows[#rows + 1] = { 1000 * r + 10 * q + k, -k } end
  end
  local t = #rows > 0 and tide.tensor(rows, { dtype = "f32" }) or tide.zeros({ 0, 2 }, { dtype = "f32" })
  local out = dist.alltoallv(t, send, recv)
  local got, o = out:tolist(), 0
  for q = 0, w - 1 do
    for k = 1, recv[q + 1] do
      if got[2 * o + 1] ~= 1000 * q + 10 * r + k or got[2 * o + 2] ~= -k then
        error(string.format("rank %d: alltoallv row %d from rank %d wrong", r, k, q), 0)
      end
      o = o + 1
    end
  end
  if r == 0 then
    print(string.format("ok   %d ranks: allgather in rank order; alltoallv of uneven parts (%d rows here)", w, o))
  end
  return 0
end

return { run = run }
