-- tide.rl.grid: a grid world with an observation every turn (rl.md §6).
--
--   local env = grid.new{width = 5, height = 5, density = 0.2, max_turns = 20, p_slip = 0}
--   env:reset(9)                        -- {observation = "#..A.\n...\nsteps left: 20", prompt = ...}
--   env:step{text = "<action>R</action>"}   -- {observation, reward = -0.01, done, terminal = 1 on the goal}
--
-- Walls with probability `density` per cell; start and goal distinct and open; solvable by BFS (regenerated
-- otherwise). A move into a wall or the edge leaves the agent in place; a malformed action moves nothing and costs
-- 0.1; each move costs 0.01; +1 (terminal) on reaching G; at most max_turns turns. With p_slip a move goes, with that
-- probability, to a random perpendicular direction instead. BFS return: 1 - 0.01 * shortest path length.
local options = require "tide.options"
local stream = require "tide.rl.stream"

local grid = {}
local fmt = string.format

local KEYS = { width = true, height = true, density = true, max_turns = true, p_slip = true }
local MOVES = { U = { 0, -1 }, D = { 0, 1 }, L = { -1, 0 }, R = { 1, 0 } }
local PERP = { U = { "L", "R" }, D = { "L", "R" }, L = { "U", "D" }, R = { "U", "D" } }

-- bfs(g) -> the shortest path length from start to goal and its first moves (a list of U/D/L/R), or nil
function grid.bfs(g)
  local W, H = g.width, g.height
  local function id(x, y) return y * W + x end
  local prev, queue, head = { [id(g.sx, g.sy)] = false }, { { g.sx, g.sy } }, 1
  while head <= #queue do
    local x, y = queue[head][1], queue[head][2]
    head = head + 1
    if x == g.gx and y == g.gy then
      local path, c = {}, id(x, y)
      while prev[c] do
        table.insert(path, 1, prev[c][2])
        c = prev[c][1]
      end
      return #path, path
    end
    for _, m in ipairs { "U", "D", "L", "R" } do
      local nx, ny = x + MOVES[m][1], y + MOVES[m][2]
      if nx >= 0 and nx < W and ny >= 0 and ny < H and not g.wall[id(nx, ny)] and prev[id(nx, ny)] == nil then
        prev[id(nx, ny)] = { id(x, y), m }
        queue[#queue + 1] = { nx, ny }
      end
    end
  end
  return nil
end

-- task(seed, cfg) -> {width, height, wall = {[y*W+x] = true}, sx, sy, gx, gy, shortest}
function grid.task(seed, cfg)
  cfg = cfg or {}
  local W, H, p = cfg.width or 5, cfg.height or 5, cfg.density or 0.2
  local s = stream.new("grid", seed)
  for _ = 1, 1000 do
    local g = { width = W, height = H, wall = {}, seed = seed }
    for c = 0, W * H - 1 do g.wall[c] = s:uniform() < p end
    local a = s:int(0, W * H - 1)
    local b = s:int(0, W * H - 2)
    if b >= a then b = b + 1 end
    g.sx, g.sy, g.gx, g.gy = a % W, math.floor(a / W), b % W, math.floor(b / W)
    g.wall[a], g.wall[b] = false, false
    local n = grid.bfs(g)
    if n then g.shortest = n; return g end
  end
  error(fmt("rl.grid: no solvable %dx%d grid in 1000 tries (seed %d, density %g)", W, H, seed, p), 2)
end

local Env = {}
Env.__index = Env

function grid.new(cfg)
  cfg = cfg or {}
  local who = "rl.grid"
  options.check(cfg, KEYS, "grid options", who)
  local W = cfg.width == nil and 5 or options.int_at_least(cfg.width, 2, "width", who)
  local H = cfg.height == nil and 5 or options.int_at_least(cfg.height, 1, "height", who)
  local d = cfg.density == nil and 0.2 or options.number_in(cfg.density, 0, 0.9, "density", who)
  local T = cfg.max_turns == nil and 20 or options.pos_int(cfg.max_turns, "max_turns", who)
  local slip = cfg.p_slip == nil and 0 or options.number_in(cfg.p_slip, 0, 1, "p_slip", who)
  return setmetatable({ name = "grid", cfg = { width = W, height = H, density = d }, max_turns = T, p_slip = slip },
    Env)
end

function Env:render()
  local g, rows = self.task, {}
  for y = 0, g.height - 1 do
    local r = {}
    for x = 0, g.width - 1 do
      local c = g.wall[y * g.width + x] and "#" or "."
      if x == g.gx and y == g.gy then c = "G" end
      if x == self.x and y == self.y then c = "A" end
      r[#r + 1] = c
    end
    rows[#rows + 1] = table.concat(r)
  end
  return table.concat(rows, "\n") .. fmt("\nsteps left: %d", self.max_turns - self.turns)
end

function Env:reset(seed)
  self.task = grid.task(seed, self.cfg)
  self.x, self.y, self.turns = self.task.sx, self.task.sy, 0
  self.slip = stream.new("grid_slip", seed)
  local obs = self:render()
  return { prompt = "Reach G. Each turn answer with one move as <action>U</action>, D, L or R.", observation = obs }
end

-- the BFS policy's actions after reset: one move a turn along a shortest path
function Env:demo()
  local _, path = grid.bfs(self.task)
  local a = {}
  for i, m in ipairs(path) do a[i] = { text = "<action>" .. m .. "</action>" } end
  return a
end

function Env:step(action)
  if action.call then
    return { result = "error: this environment has no tools", reward = -0.1, done = false, invalid = true }
  end
  self.turns = self.turns + 1
  local m = (action.text or ""):match("<action>%s*(.-)%s*</action>")
  local r, invalid = 0, nil
  if not MOVES[m or ""] then
    r, invalid = -0.1, true
  else
    if self.p_slip > 0 and self.slip:uniform() < self.p_slip then m = PERP[m][self.slip:int(1, 2)] end
    local g = self.task
    local nx, ny = self.x + MOVES[m][1], self.y + MOVES[m][2]
    if nx >= 0 and nx < g.width and ny >= 0 and ny < g.height and not g.wall[ny * g.width + nx] then
      self.x, self.y = nx, ny
    end
    r = -0.01
    if self.x == g.gx and self.y == g.gy then
      return { reward = r, terminal = 1, done = true, correct = true, formatted = true }
    end
  end
  if self.turns >= self.max_turns then
    return { reward = r, terminal = 0, done = true, correct = false, formatted = not invalid, invalid = invalid }
  end
  return { observation = self:render(), reward = r, done = false, invalid = invalid, formatted = not invalid }
end

return grid
