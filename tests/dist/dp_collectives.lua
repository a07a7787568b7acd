-- dp_collectives.lua — the process group's all-gather and all-to-all-v from Lua (lua/tide/dist.lua), under mpirun
-- (tests/dist/dp_check.sh runs it on 2 and 4 ranks): rank r's rows concatenated in rank order on every rank; rows
-- exchanged with uneven counts, empty parts included (rank r sends (r + q) % 3 rows to rank q), landing in rank order;
-- gather_strings of uneven strings with NUL bytes.
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
  -- process groups: the even and the odd ranks; sums, gathers and exchanges stay inside each
  local g = dist.split(r % 2)
  local members = {}
  for q = r % 2, w - 1, 2 do members[#members + 1] = q end
  if #g.members ~= #members or g.size ~= #members or g.members[g.rank + 1] ~= r then
    error(string.format("rank %d: group members %s", r, table.concat(g.members, ",")), 0)
  end
  local want = 0
  for _, q in ipairs(members) do want = want + q + 0.25 end
  local s = g.allreduce_(tide.tensor({ r + 0.25, 1 }, { dtype = "f64" })):tolist()
  if s[1] ~= want or s[2] ~= #members then error(string.format("rank %d: group sum %g, want %g", r, s[1], want), 0) end
  local ga = g.allgather(tide.tensor({ { r } }, { dtype = "f32" })):tolist()
  for i, q in ipairs(members) do
    if ga[i] ~= q then error(string.format("rank %d: group allgather entry %d is %g", r, i, ga[i]), 0) end
  end
  -- the differentiable exchange: one row to each member, the gradient comes back by the reverse exchange
  local ones = {}
  local xr = {}
  for i = 1, g.size do ones[i] = 1; xr[i] = { 10 * r + i } end
  local x = tide.tensor(xr, { dtype = "f64" }):requires_grad_(true)
  local y = g.exchange(x, ones, ones)
  for i, q in ipairs(members) do
    if y:tolist()[i] ~= 10 * q + g.rank + 1 then error(string.format("rank %d: exchange row %d wrong", r, i), 0) end
  end
  local wts = {}
  for i, q in ipairs(members) do wts[i] = { q + 1 } end
  (y * tide.tensor(wts, { dtype = "f64" })):sum():backward()
  -- d/dx[i] (sent to member i) = the weight member i gives what this rank sent: this rank's own weight
  for i = 1, g.size do
    if x:grad():tolist()[i] ~= r + 1 then error(string.format("rank %d: exchange gradient %d wrong", r, i), 0) end
  end
  -- gather_strings: strings of every length (rank 0's empty), NUL bytes inside, in rank order on every rank
  local function str(q) return q == 0 and "" or (string.rep("ab\0c", 997 * q) .. tostring(q)) end
  local all = dist.gather_strings(str(r))
  for q = 0, w - 1 do
    if all[q + 1] ~= str(q) then error(string.format("rank %d: gather_strings: rank %d's string differs", r, q), 0) end
  end
  if r == 0 then
    print(string.format("ok   %d ranks: allgather in rank order; alltoallv of uneven parts (%d rows here); groups of "
      .. "the even and odd ranks (sum, gather, differentiable exchange); gather_strings (uneven, NUL bytes)", w, o))
  end
  return 0
end

return { run = run }
