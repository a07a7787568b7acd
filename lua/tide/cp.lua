-- cp.lua — context parallelism (spec/long_context.md §5): the zig-zag layout of a row over P ranks and what the
-- token mixers need to run on it. The row of T tokens is cut into 2P equal segments; rank p holds segments p and
-- 2P−1−p (equal causal work), side by side: its slice of a [B, T, ·] tensor is [B, 2·Tc, ·], Tc = T / 2P.
--
-- A context describes one step's rows (their document starts) and which ranks' slices this process holds:
--   real (under mpirun): one, its own, exchanged with the others of the cp group (`group`: a dist.split group);
--   fake (one process, tests and the reference): all P slices stacked on the batch dim, [P·B, 2·Tc, ·], rank
--   order, so the same layer code runs the layout with the exchanges as identities.
-- Everything except the token mixers is token-local and runs on the slices unchanged. The mixers read:
--   KDA: local_cu (documents inside the slice's segments), the halo map of the short convolutions and the state
--     fold over the 2P segments (kda.lua, forward_cp);
--   MLA: the latent gather into global order (to_global) and the keys' documents of each segment's prefix (key_cu).
-- gather(t) is an op of the graph: its gradient sums each rank's rows back to it (a reduce-scatter).
-- ctx.ablate = {fold = true} / {halo = true} drops the carried state / the conv history (the tests' negative
-- controls: each part is needed for the result to equal the unsplit run).
local tide = require "tide"
local options = require "tide.options"
local F = tide.F

local fmt = string.format
local WHO = "cp"

local cp = {}
local Ctx = {}
Ctx.__index = Ctx

local function bad(msg) options.fail(WHO, msg) end

-- the document starts strictly inside each row (0 < t < T), row-relative and sorted, from cu over B·T (a list of
-- 0-based offsets or an integer tensor); nil cu: one document per row
local function row_starts(cu, B, T)
  local rows = {}
  for b = 1, B do rows[b] = {} end
  if cu == nil then return rows end
  if tide.is_tensor(cu) then cu = cu:tolist() end
  if type(cu) ~= "table" then bad("cu_seqlens must be a list of offsets or an integer tensor, got " .. type(cu)) end
  if cu[1] ~= 0 or cu[#cu] ~= B * T then
    bad(fmt("cu_seqlens must run from 0 to B·T = %d, got %s .. %s", B * T, tostring(cu[1]), tostring(cu[#cu])))
  end
  for i = 2, #cu do
    if not (cu[i] > cu[i - 1]) then bad(fmt("cu_seqlens must increase, got %s then %s", tostring(cu[i - 1]), tostring(cu[i]))) end
    local b, t = math.floor(cu[i] / T), cu[i] % T
    if t ~= 0 then table.insert(rows[b + 1], t) end
  end
  return rows
end

-- call_documents(cu, B, T, Tcall, i) -> cu_i, reset_i: the documents of a long row (cu over B·T: what the unsplit
-- forward takes; nil: one per row) for call i (0-based) of the T / Tcall calls through the caches: cu_i the offsets
-- over B·Tcall of the documents starting strictly inside the call (a context's cu_seqlens), reset_i the list of B
-- booleans of rows whose document starts exactly at the call (the forward's reset), nil when there is none
function cp.call_documents(cu, B, T, Tcall, i)
  options.pos_int(Tcall, "Tcall", WHO)
  if T % Tcall ~= 0 then bad(fmt("calls of %d tokens do not cut a row of %d", Tcall, T)) end
  if not (options.is_int(i) and i >= 0 and i < T / Tcall) then
    bad(fmt("call %s is not one of the %d calls (0-based)", tostring(i), T / Tcall))
  end
  local rows = row_starts(cu, B, T)
  local out, reset, any = { 0 }, {}, false
  for b = 1, B do
    reset[b] = false
    for _, t in ipairs(rows[b]) do
      if t == i * Tcall then reset[b], any = true, true
      elseif t > i * Tcall and t < (i + 1) * Tcall then out[#out + 1] = (b - 1) * Tcall + t - i * Tcall end
    end
    out[#out + 1] = b * Tcall
  end
  return out, any and reset or nil
end

-- context{P, B, T, cu_seqlens = nil | offsets over B·T, group = nil (fake: this process holds every slice) |
--   a dist group of the P cp ranks (real: this process holds group.rank's slice)}
function cp.context(o)
  if type(o) ~= "table" then bad("context needs a table {P, B, T, cu_seqlens, group}") end
  local P = options.pos_int(o.P, "P", WHO)
  local B = options.pos_int(o.B, "B", WHO)
  local T = options.pos_int(o.T, "T", WHO)
  if T % (2 * P) ~= 0 then
    bad(fmt("a row of T = %d tokens does not cut into 2·cp = %d equal segments (T must be a multiple of %d)", T, 2 * P, 2 * P))
  end
  local self = setmetatable({ P = P, B = B, T = T, Tc = math.floor(T / (2 * P)), group = o.group }, Ctx)
  if o.group then
    if o.group.size ~= P then bad(fmt("the cp group has %d ranks but P = %d", o.group.size, P)) end
    self.ranks = { o.group.rank }
  else
    self.ranks = {}
    for p = 0, P - 1 do self.ranks[p + 1] = p end
  end
  self.R = #self.ranks
  self.starts = row_starts(o.cu_seqlens, B, T)
  self:build()
  return self
end

-- the global segment of slot s (0, 1) of rank p, and the owner (rank, slot) of segment c
function Ctx:seg(p, s) return s == 0 and p or 2 * self.P - 1 - p end
function Ctx:owner(c)
  if c < self.P then return c, 0 end
  return 2 * self.P - 1 - c, 1
end

-- index of (rank p, row b, slot s) in a gathered [P·B·2, ·] tensor of row-segments (0-based)
function Ctx:gathered_row(p, b, s) return (p * self.B + b) * 2 + s end

-- the bookkeeping of one step, from the rows' document starts
function Ctx:build()
  local P, B, Tc = self.P, self.B, self.Tc
  -- reset[c][b]: a document starts exactly at segment c's first token (c >= 1); inside[c][b]: the starts strictly
  -- inside segment c, segment-relative
  self.reset, self.inside = {}, {}
  for c = 0, 2 * P - 1 do
    self.reset[c], self.inside[c] = {}, {}
    for b = 1, B do
      self.reset[c][b] = false
      self.inside[c][b] = {}
      for _, t in ipairs(self.starts[b]) do
        if t == c * Tc then self.reset[c][b] = true
        elseif t > c * Tc and t < (c + 1) * Tc then table.insert(self.inside[c][b], t - c * Tc) end
      end
    end
  end
  -- the local row-segments [R·B·2, Tc]: their documents (over R·B·2·Tc; the row starts are every segment start)
  local cu, n = { 0 }, 0
  for ri = 1, self.R do
    for b = 1, B do
      for s = 0, 1 do
        local c = self:seg(self.ranks[ri], s)
        for _, t in ipairs(self.inside[c][b]) do cu[#cu + 1] = n + t end
        n = n + Tc
        cu[#cu + 1] = n
      end
    end
  end
  self.local_cu = cu
end

-- the local slice(s) of a full [B, T, ·] tensor: [R·B, 2·Tc, ·] (tests, the reference run, and each rank's batch)
function Ctx:split(x)
  local Tc, B = self.Tc, self.B
  if x:size(1) ~= B or x:size(2) ~= self.T then
    bad(fmt("split: expected [B, T, ...] = [%d, %d, ...], got [%s]", B, self.T, table.concat(x:shape(), ", ")))
  end
  local parts = {}
  for ri, p in ipairs(self.ranks) do
    local a = x:narrow(2, self:seg(p, 0) * Tc + 1, Tc)
    local z = x:narrow(2, self:seg(p, 1) * Tc + 1, Tc)
    parts[ri] = F.concat({ a, z }, 2)
  end
  return #parts == 1 and parts[1] or F.concat(parts, 1)
end

-- the full [B, T, ·] from every slice (fake layout only: [P·B, 2·Tc, ·])
function Ctx:unsplit(y)
  if self.R ~= self.P then bad("unsplit needs every rank's slice (a fake context)") end
  local Tc, B = self.Tc, self.B
  local segs = {}
  for c = 0, 2 * self.P - 1 do
    local p, s = self:owner(c)
    segs[c + 1] = y:narrow(1, p * B + 1, B):narrow(2, s * Tc + 1, Tc)
  end
  return F.concat(segs, 2)
end

-- gather(t [R·n, ·]) -> [P·n, ·]: every rank's rows in rank order, as an op of the graph (its gradient sums each
-- rank's part over the ranks and hands it back: a reduce-scatter); the fake layout holds them already
function Ctx:gather(t)
  if not self.group then return t end
  local P, n = self.P, t:size(1)
  local copies, counts = {}, {}
  for r = 1, P do copies[r], counts[r] = t, n end
  return self.group.exchange(F.concat(copies, 1), counts, counts)
end

local function index(list, device) return tide.tensor(list, { dtype = "i64", device = device }) end

-- the halo map of the short convolutions: for each local row-segment, the gathered row-segment before it (the
-- previous global segment, same row) and a mask [R·B·2, K−1, 1] that zeroes what the row-segment must not read:
-- everything at a row start or a document start exactly at its first token, and the previous segment's tokens
-- before a document start in the last K−1 (kda.md §8: a document's conv history begins at zero).
-- carry = true: the rows continue from an earlier call (a cache): segment 0 reads row b's carried history, the
-- (P·B·2 + b)-th row of the source (the gathered tails with the B carried tails appended).
function Ctx:halo(K1, dtype, device, carry)
  local key = fmt("%d %s %s %s", K1, dtype, device, carry and "carry" or "")
  self.halos = self.halos or {}
  if self.halos[key] then return self.halos[key][1], self.halos[key][2] end
  local Tc, B, P = self.Tc, self.B, self.P
  if Tc < K1 then
    bad(fmt("a segment of Tc = %d tokens is shorter than the short convolution's history (%d): use fewer cp ranks or longer rows",
      Tc, K1))
  end
  local ablated = self.ablate and self.ablate.halo
  local idx, mask = {}, {}
  for ri = 1, self.R do
    for b = 1, B do
      for s = 0, 1 do
        local c = self:seg(self.ranks[ri], s)
        local pp, ps = 0, 0
        if c > 0 then pp, ps = self:owner(c - 1) end
        idx[#idx + 1] = (c == 0 and carry) and P * B * 2 + b - 1 or self:gathered_row(pp, b - 1, ps)
        -- the last document start at or before the segment start (segment-relative to c − 1's end)
        for j = 1, K1 do
          local t = c * Tc - K1 + j - 1          -- the global position this halo slot holds
          local keep = (c > 0 or carry) and not ablated
          if keep then
            for _, st in ipairs(self.starts[b]) do
              if st > t and st <= c * Tc then keep = false end
            end
          end
          mask[#mask + 1] = keep and 1 or 0
        end
      end
    end
  end
  local r = { index(idx, device), tide.tensor(mask, { shape = { self.R * B * 2, K1, 1 }, dtype = dtype, device = device }) }
  self.halos[key] = r
  return r[1], r[2]
end

-- the short convolutions' history a later call continues from: the gathered rows of the row's last segment
-- (2P − 1, rank 0's second slot) [B] and the mask [B, K−1, 1] of its last K−1 tokens that belong to the row's
-- last document
function Ctx:row_tail(K1, dtype, device)
  local key = fmt("%d %s %s", K1, dtype, device)
  self.tails = self.tails or {}
  if self.tails[key] then return self.tails[key][1], self.tails[key][2] end
  local rows, mask = {}, {}
  for b = 1, self.B do
    rows[b] = self:gathered_row(0, b - 1, 1)
    for j = 1, K1 do
      local t, keep = self.T - K1 + j - 1, true
      for _, st in ipairs(self.starts[b]) do if st > t then keep = false end end
      mask[#mask + 1] = keep and 1 or 0
    end
  end
  local r = { index(rows, device), tide.tensor(mask, { shape = { self.B, K1, 1 }, dtype = dtype, device = device }) }
  self.tails[key] = r
  return r[1], r[2]
end

-- the fold of the KDA segment states (long_context.md §5): pairs = the gathered [P·B·2, H, dk, dv + dk] end states
-- from zero, h_ext (the first dv columns), and transitions M (the last dk); returns the start states of the local
-- row-segments [R·B·2, H, dk, dv] in pairs' dtype: S0 of segment 0 is `init` ([B, H, dk, dv], the state carried
-- from an earlier call) or zero; S0_{c+1} = M_c S0_c + h_c, zero where a document starts at segment c+1's first
-- token. With `want_end`, also the rows' end state [B, H, dk, dv] (every rank folds the whole chain: the pairs are
-- gathered anyway). An op of the graph: the gradient reaches every M, h_ext and init.
-- the start of each row's last document after this call, for a cache of Tp earlier tokens whose rows' last
-- documents started at doc (nil: 0): 0-based positions in the Tp + T tokens
function Ctx:last_starts(Tp, doc)
  local out = {}
  for b = 1, self.B do
    local st = self.starts[b]
    out[b] = #st > 0 and Tp + st[#st] or (doc and doc[b] or 0)
  end
  return out
end

function Ctx:fold(pairs, dv, init, want_end)
  local P, B = self.P, self.B
  local H, dk = pairs:size(2), pairs:size(3)
  local dev, dt = pairs:device(), pairs:dtype()
  local need = 0
  for _, p in ipairs(self.ranks) do need = math.max(need, self:seg(p, 1)) end
  if want_end then need = 2 * P end
  local S = {}
  local h = init and init:reshape(B * H, dk, dv) or nil       -- nil = zero
  for c = 0, need do
    S[c] = not (self.ablate and self.ablate.fold) and h or nil
    if c == need then break end
    local p, s = self:owner(c)
    local rows = {}
    for b = 0, B - 1 do rows[b + 1] = self:gathered_row(p, b, s) end
    local pc = pairs:index_select(1, index(rows, dev))                  -- [B, H, dk, dv + dk]
    local he = pc:narrow(4, 1, dv):reshape(B * H, dk, dv)
    if h then
      local Mc = pc:narrow(4, dv + 1, dk):reshape(B * H, dk, dk)
      h = Mc:matmul(h) + he
    else
      h = he
    end
    -- a document starting at segment c + 1 begins from zero
    local keep, any = {}, false
    for b = 1, B do
      local r = c + 1 < 2 * P and self.reset[c + 1][b]
      keep[b] = r and 0 or 1
      any = any or r
    end
    if any then
      h = (h:reshape(B, H, dk, dv) * tide.tensor(keep, { shape = { B, 1, 1, 1 }, dtype = dt, device = dev })):reshape(B * H, dk, dv)
    end
  end
  local zero
  local out = {}
  for _, p in ipairs(self.ranks) do
    local two = {}
    for s = 0, 1 do
      local st = S[self:seg(p, s)]
      if not st then
        zero = zero or tide.zeros({ B, 1, H, dk, dv }, { dtype = dt, device = dev })
        two[s + 1] = zero
      else
        two[s + 1] = st:reshape(B, 1, H, dk, dv)
      end
    end
    out[#out + 1] = F.concat(two, 2):reshape(B * 2, H, dk, dv)
  end
  local starts = #out == 1 and out[1] or F.concat(out, 1)
  if not want_end then return starts end
  return starts, h:reshape(B, H, dk, dv)
end

-- the 0-based ordinals (row-major over the full [B, T]) of the positions where ids == value that this process's
-- slices hold, in slice order (the images of a batch: which image tokens the rank's placeholders take), and the
-- count over the full tensor
function Ctx:local_ordinals(ids, value)
  local flat = ids:to("cpu"):reshape(-1):tolist()
  local ord, k = {}, 0
  for t = 1, #flat do
    if flat[t] == value then ord[t] = k; k = k + 1 else ord[t] = -1 end
  end
  local rows = {}
  for _, v in ipairs(self:split(tide.tensor(ord, { shape = ids:shape(), dtype = "i64" })):reshape(-1):tolist()) do
    if v >= 0 then rows[#rows + 1] = v end
  end
  return rows, k
end

-- MLA: the gathered latents [P·B, 2·Tc, n] in global order [B, T, n]
function Ctx:to_global(all)
  local P, B, Tc, T = self.P, self.B, self.Tc, self.T
  if not self.global_index then
    local idx = {}
    for b = 0, B - 1 do
      for t = 0, T - 1 do
        local c = math.floor(t / Tc)
        local p, s = self:owner(c)
        idx[#idx + 1] = self:gathered_row(p, b, s) * Tc + (t - c * Tc)
      end
    end
    self.global_index = index(idx, all:device())
  end
  local n = all:size(3)
  return all:reshape(P * B * 2 * Tc, n):index_select(1, self.global_index):reshape(B, T, n)
end

-- MLA: the documents of the keys of segment c's queries, the prefix [0, (c + 1)·Tc) of every row, over B·(c + 1)·Tc;
-- Tp > 0: behind Tp cached keys of an earlier call, over B·(Tp + (c + 1)·Tc); doc[b] (0-based, in the cached keys):
-- where row b's last cached document starts, which the row's first document here continues
function Ctx:key_cu(c, Tp, doc)
  Tp = Tp or 0
  local key = c .. " " .. Tp .. " " .. (doc and table.concat(doc, ",") or "")
  self.key_cus = self.key_cus or {}
  if self.key_cus[key] then return self.key_cus[key] end
  local K = (c + 1) * self.Tc
  local Kc = Tp + K
  local cu = { 0 }
  for b = 1, self.B do
    if doc and doc[b] > 0 then cu[#cu + 1] = (b - 1) * Kc + doc[b] end
    for _, t in ipairs(self.starts[b]) do
      if t < K then cu[#cu + 1] = (b - 1) * Kc + Tp + t end
    end
    cu[#cu + 1] = b * Kc
  end
  self.key_cus[key] = cu
  return cu
end

return cp
