-- plot.lua — the report page of a run (`tide plot RUN`): its metrics.jsonl records drawn as one self-contained HTML
-- page of inline SVG charts (no scripts, no network): training and validation loss, learning rate, tokens/s, memory,
-- gradient norm, the MaxVio of every MoE layer (last batch per step, validation at evals), a heatmap of the
-- per-expert loads of each MoE layer over the steps (moe/load/<layer>: tokens per expert / their mean), stage
-- boundaries on every chart, and the tables of the stage ends, the final task evals and the expert loads.
--
--   local html = plot.report(records, { title = "quickstart", source = "runs/quickstart/metrics.jsonl" })
--
-- records: the decoded JSONL lines in file order. Step records (no "event") are drawn, the last one of each step
-- winning (a rollback repeats steps); "stage_end" records give the validation points and table of each stage,
-- "eval" and "moe" records the final tables. Non-finite values (null + "nonfinite") are gaps. Long runs are drawn
-- from at most MAX_POINTS averaged points per series and MAX_COLUMNS heatmap columns, fewer when the heatmaps of
-- all layers would exceed MAX_CELLS cells (24 layers of 64 experts: a page of 9 MB).
local json = require "tide.json"
local log = require "tide.log"

local fmt = string.format
local plot = {}

plot.MAX_POINTS, plot.MAX_COLUMNS, plot.MAX_CELLS = 1500, 300, 60000
local PALETTE = { "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
  "#17becf" }
plot.PALETTE = PALETTE

local function esc(s)
  return (tostring(s):gsub("[&<>\"']", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;",
    ["'"] = "&#39;" }))
end
plot.escape = esc

local function finite(v) return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end

-- ---- the records ------------------------------------------------------------------------------------------------

-- collect(records) -> {steps = sorted step records, stage_ends, evals (the last step's), moe (the last step's),
-- layers = {maxvio, maxvio_val, load} (sorted layer ids), stages = {{name, first, last}}, nonfinite = count}
function plot.collect(records)
  local by_step, stage_ends, evals, moe, nonfinite = {}, {}, {}, {}, 0
  local keys = { maxvio = {}, maxvio_val = {}, load = {} }
  for _, r in ipairs(records) do
    if type(r) == "table" and type(r.step) == "number" then
      if r.event == nil then
        by_step[r.step] = r
        if type(r.nonfinite) == "table" then nonfinite = nonfinite + #r.nonfinite end
      elseif r.event == "stage_end" then stage_ends[#stage_ends + 1] = r
      elseif r.event == "eval" then evals[#evals + 1] = r
      elseif r.event == "moe" then moe[#moe + 1] = r end
      for k in pairs(r) do
        local l = k:match("^moe/maxvio_batch/(%d+)$")
        if l then keys.maxvio[tonumber(l)] = true end
        l = k:match("^moe/maxvio_global/(%d+)$")
        if l then keys.maxvio_val[tonumber(l)] = true end
        l = k:match("^moe/load/(%d+)$")
        if l then keys.load[tonumber(l)] = true end
      end
    end
  end
  local steps = {}
  for _, r in pairs(by_step) do steps[#steps + 1] = r end
  table.sort(steps, function(a, b) return a.step < b.step end)
  -- the final tables: the rows logged at the last step that has any (a resumed run logs them again)
  local function last_only(list)
    local top = -math.huge
    for _, r in ipairs(list) do top = math.max(top, r.step) end
    local out = {}
    for _, r in ipairs(list) do if r.step == top then out[#out + 1] = r end end
    return out
  end
  -- the last stage_end of each stage name (in step order)
  local last_end = {}
  for _, r in ipairs(stage_ends) do last_end[tostring(r.stage)] = r end
  local ends = {}
  for _, r in pairs(last_end) do ends[#ends + 1] = r end
  table.sort(ends, function(a, b) return a.step < b.step end)
  local stages = {}
  for _, r in ipairs(steps) do
    local name = r.stage
    if type(name) == "string" then
      local cur = stages[#stages]
      if cur and cur.name == name then cur.last = r.step
      else stages[#stages + 1] = { name = name, first = r.step, last = r.step } end
    end
  end
  local layers = {}
  for what, set in pairs(keys) do
    local ls = {}
    for l in pairs(set) do ls[#ls + 1] = l end
    table.sort(ls)
    layers[what] = ls
  end
  return { steps = steps, stage_ends = ends, evals = last_only(evals), moe = last_only(moe), layers = layers,
    stages = stages, nonfinite = nonfinite }
end

-- series(steps, key) -> {{step, value}} of the finite values of key (nil for a gap)
local function series(steps, key)
  local pts = {}
  for _, r in ipairs(steps) do
    local v = r[key]
    if finite(v) then pts[#pts + 1] = { r.step, v }
    elseif v ~= nil then pts[#pts + 1] = { r.step, nil } end     -- null: a non-finite value
  end
  return pts
end

-- at most n points: consecutive points averaged in buckets (a gap inside a bucket is dropped)
local function thin(pts, n)
  if #pts <= n then return pts end
  local out, per = {}, #pts / n
  for b = 0, n - 1 do
    local lo, hi = math.floor(b * per) + 1, math.floor((b + 1) * per)
    local sx, sy, c = 0, 0, 0
    for i = lo, hi do
      if pts[i][2] ~= nil then sx, sy, c = sx + pts[i][1], sy + pts[i][2], c + 1 end
    end
    if c > 0 then out[#out + 1] = { sx / c, sy / c } end
  end
  return out
end

-- ---- axes -------------------------------------------------------------------------------------------------------

-- ticks(lo, hi, n) -> about n round values in [lo, hi] (1, 2, 5 x 10^k apart) and their spacing
local function ticks(lo, hi, n)
  local span = hi - lo
  local step = 10 ^ math.floor(math.log10(span / n))
  local e = span / n / step
  if e >= 7.5 then step = step * 10 elseif e >= 3.5 then step = step * 5 elseif e >= 1.5 then step = step * 2 end
  local out = {}
  local v = math.ceil(lo / step - 1e-9) * step
  while v <= hi + step * 1e-9 do
    out[#out + 1] = math.abs(v) < step * 1e-9 and 0 or v
    v = v + step
  end
  return out, step
end
plot.ticks = ticks

local function tick_text(v, unit)
  local a = math.abs(v)
  if unit == "B" then return log.si(v) .. "B" end
  if a >= 1e4 then return log.si(v) end
  if a ~= 0 and a < 1e-3 then return (fmt("%.1e", v):gsub("e%-0", "e-")) end
  return fmt("%.4g", v)
end

-- the value range of a chart's series, padded; zero = true starts it at 0
local function y_range(all, zero)
  local lo, hi = math.huge, -math.huge
  for _, s in ipairs(all) do
    for _, p in ipairs(s.points) do
      if p[2] ~= nil then lo, hi = math.min(lo, p[2]), math.max(hi, p[2]) end
    end
  end
  if lo > hi then return 0, 1 end
  if zero and lo > 0 then lo = 0 end
  if hi - lo < 1e-12 * math.max(1, math.abs(hi)) then
    local d = math.max(math.abs(hi) * 0.05, 1e-6)
    return lo - d, hi + d
  end
  local pad = (hi - lo) * 0.05
  return (zero and lo == 0) and 0 or lo - pad, hi + pad
end

-- the frame every chart shares: the step axis (x0..x1), the stage bands and their names
local W, ML, MR, MT, MB = 920, 64, 16, 28, 34
plot.WIDTH = W

local function frame(o, H, axis_y)
  axis_y = axis_y or H - MB
  local x0, x1 = o.x0, o.x1
  local pw = W - ML - MR
  local function X(s) return ML + (s - x0) / math.max(x1 - x0, 1e-9) * pw end
  local parts = {}
  local function add(s) parts[#parts + 1] = s end
  add(fmt('<text class="title" x="%d" y="16">%s</text>', ML, esc(o.title)))
  -- stage boundaries: a dashed line before each stage's first step but the first, its name at the top
  for i, st in ipairs(o.stages or {}) do
    local xs = X(st.first - 0.5)
    if i > 1 then
      add(fmt('<line class="stage" x1="%.1f" y1="%d" x2="%.1f" y2="%d"/>', xs, MT, xs, axis_y))
    end
    add(fmt('<text class="stagename" x="%.1f" y="%d">%s</text>', math.max(xs, ML) + 3, MT + 11, esc(st.name)))
  end
  -- the step axis
  local xt = ticks(x0, x1, 8)
  for _, t in ipairs(xt) do
    if t >= x0 and t <= x1 then
      local x = X(t)
      add(fmt('<line class="tick" x1="%.1f" y1="%d" x2="%.1f" y2="%d"/>', x, axis_y, x, axis_y + 4))
      add(fmt('<text class="xt" x="%.1f" y="%d">%s</text>', x, axis_y + 16, tick_text(t)))
    end
  end
  add(fmt('<text class="xl" x="%d" y="%d">step</text>', W - MR, axis_y + 30))
  return X, parts
end

-- line_chart{title, series = {{name, color, points, dots = false}}, stages, x0, x1, zero, unit, height} -> <svg>
function plot.line_chart(o)
  local H = o.height or 220
  local X, parts = frame(o, H)
  local function add(s) parts[#parts + 1] = s end
  local lo, hi = y_range(o.series, o.zero)
  local ph = H - MT - MB
  local function Y(v) return MT + (hi - v) / (hi - lo) * ph end
  local yt = ticks(lo, hi, 5)
  for _, t in ipairs(yt) do
    local y = Y(t)
    add(fmt('<line class="grid" x1="%d" y1="%.1f" x2="%d" y2="%.1f"/>', ML, y, W - MR, y))
    add(fmt('<text class="yt" x="%d" y="%.1f">%s</text>', ML - 6, y + 4, tick_text(t, o.unit)))
  end
  add(fmt('<rect class="plotarea" x="%d" y="%d" width="%d" height="%d"/>', ML, MT, W - ML - MR, ph))
  local legend_x = W - MR
  if #o.series > 10 then            -- many layers: one line of text instead of a legend wider than the chart
    add(fmt('<text class="legend" x="%d" y="14" text-anchor="end">%d series (%s … %s), colours cycle</text>', W - MR,
      #o.series, esc(o.series[1].name), esc(o.series[#o.series].name)))
  end
  for k = #o.series > 10 and 0 or #o.series, 1, -1 do
    local s = o.series[k]
    local label = esc(s.name)
    legend_x = legend_x - (#s.name * 6.5 + 22)
    add(fmt('<rect x="%.1f" y="8" width="12" height="4" fill="%s"/><text class="legend" x="%.1f" y="14">%s</text>',
      legend_x, s.color, legend_x + 15, label))
  end
  for _, s in ipairs(o.series) do
    local pts = thin(s.points, plot.MAX_POINTS)
    if s.dots then
      local d = {}
      for _, p in ipairs(pts) do
        if p[2] ~= nil then
          d[#d + 1] = fmt('<circle cx="%.1f" cy="%.1f" r="3.5"><title>step %s: %s</title></circle>', X(p[1]), Y(p[2]),
            tick_text(p[1]), fmt("%.5g", p[2]))
        end
      end
      add(fmt('<g class="dots" fill="%s">%s</g>', s.color, table.concat(d)))
    else
      local d, pen = {}, "M"
      for _, p in ipairs(pts) do
        if p[2] == nil then pen = "M"
        else
          d[#d + 1] = fmt("%s%.1f %.1f", pen, X(p[1]), Y(p[2]))
          pen = "L"
        end
      end
      add(fmt('<path class="line" stroke="%s" d="%s"><title>%s</title></path>', s.color, table.concat(d, " "),
        esc(s.name)))
    end
  end
  return fmt('<svg class="chart" width="%d" height="%d" viewBox="0 0 %d %d">%s</svg>', W, H, W, H,
    table.concat(parts, "\n"))
end

-- the heatmap colour of a load ratio r = load / mean load: white at 1, red above (x4 saturates), blue below
local function ratio_color(r)
  local t = r > 0 and math.log(r) / math.log(2) / 2 or -1
  t = math.max(-1, math.min(1, t))
  local c = t >= 0 and { 180, 4, 38 } or { 59, 76, 192 }
  local a = math.abs(t)
  return fmt("#%02x%02x%02x", math.floor(255 + (c[1] - 255) * a + 0.5), math.floor(255 + (c[2] - 255) * a + 0.5),
    math.floor(255 + (c[3] - 255) * a + 0.5))
end
plot.ratio_color = ratio_color

-- heatmap{title, steps, key, stages, x0, x1, columns} -> <svg>: one row per expert, one column per step (or per bin
-- of steps when there are more than `columns`, MAX_COLUMNS by default), colour = the expert's tokens / the mean over
-- experts, averaged over the bin
function plot.heatmap(o)
  local rows = {}
  for _, r in ipairs(o.steps) do
    local load = r[o.key]
    if type(load) == "table" and #load > 0 then rows[#rows + 1] = { r.step, load } end
  end
  local n = 0
  for _, r in ipairs(rows) do n = math.max(n, #r[2]) end
  local cell_h = math.max(8, math.min(22, math.floor(200 / math.max(n, 1))))
  local axis_y = MT + n * cell_h
  local H = axis_y + 54
  local X, parts = frame(o, H, axis_y)
  local function add(s) parts[#parts + 1] = s end
  local cols = math.min(#rows, o.columns or plot.MAX_COLUMNS)
  local per = #rows / math.max(cols, 1)
  local cells = {}
  for c = 0, cols - 1 do
    local lo, hi = math.floor(c * per) + 1, math.floor((c + 1) * per)
    local s_lo, s_hi = rows[lo][1], rows[hi][1]
    local xa, xb = X(s_lo - 0.5), X(s_hi + 0.5)
    for j = 1, n do
      local sum, cnt = 0, 0
      for i = lo, hi do
        local load = rows[i][2]
        local mean = 0
        for _, v in ipairs(load) do mean = mean + v / #load end
        if mean > 0 and load[j] then sum, cnt = sum + load[j] / mean, cnt + 1 end
      end
      local ratio = cnt > 0 and sum / cnt or 0
      cells[#cells + 1] = fmt('<rect class="cell" x="%.1f" y="%d" width="%.2f" height="%d" fill="%s"><title>%s, expert %d: '
        .. '%.2f x the mean load</title></rect>', xa, MT + (j - 1) * cell_h, math.max(xb - xa, 0.5), cell_h,
        ratio_color(ratio), s_lo == s_hi and fmt("step %d", s_lo) or fmt("steps %d-%d", s_lo, s_hi), j - 1, ratio)
    end
  end
  add('<g class="cells" shape-rendering="crispEdges">' .. table.concat(cells) .. "</g>")
  for j = 1, n do
    if n <= 16 or (j - 1) % math.ceil(n / 16) == 0 then
      add(fmt('<text class="yt" x="%d" y="%.1f">e%d</text>', ML - 6, MT + (j - 0.5) * cell_h + 4, j - 1))
    end
  end
  -- stage lines over the cells, and the colour scale
  for i, st in ipairs(o.stages or {}) do
    if i > 1 then
      local xs = X(st.first - 0.5)
      add(fmt('<line class="stage over" x1="%.1f" y1="%d" x2="%.1f" y2="%d"/>', xs, MT, xs, MT + n * cell_h))
    end
  end
  local sx = ML + 76
  add(fmt('<text class="legend" x="%d" y="%d">load / mean</text>', ML, axis_y + 32))
  for k = 0, 20 do
    local r = 2 ^ ((k - 10) / 5)
    add(fmt('<rect x="%.1f" y="%d" width="8" height="8" fill="%s"/>', sx + k * 8, axis_y + 24, ratio_color(r)))
  end
  for _, t in ipairs({ { 0, "1/4" }, { 10, "1" }, { 20, "4" } }) do
    add(fmt('<text class="legend" x="%.1f" y="%d" text-anchor="middle">%s</text>', sx + t[1] * 8 + 4, axis_y + 44, t[2]))
  end
  return fmt('<svg class="chart heatmap" width="%d" height="%d" viewBox="0 0 %d %d">%s</svg>', W, H, W, H,
    table.concat(parts, "\n")), cols * n
end

-- ---- tables -----------------------------------------------------------------------------------------------------
local function num(v, f)
  if v == nil or v == json.null then return "–" end
  if type(v) ~= "number" then return esc(v) end
  return fmt(f or "%.4g", v)
end

local function html_table(head, rows)
  local out = { "<table><tr>" }
  for _, h in ipairs(head) do out[#out + 1] = "<th>" .. esc(h) .. "</th>" end
  out[#out + 1] = "</tr>"
  for _, r in ipairs(rows) do
    out[#out + 1] = "<tr>"
    for _, c in ipairs(r) do out[#out + 1] = "<td>" .. c .. "</td>" end
    out[#out + 1] = "</tr>"
  end
  out[#out + 1] = "</table>"
  return table.concat(out)
end

local CSS = [[
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 960px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
p.meta { color: #555; font-size: 13px; margin: 0 0 12px; }
svg.chart { display: block; margin: 10px 0; background: #fff; }
svg .title { font-size: 14px; font-weight: 600; fill: #222; }
svg .legend, svg .xt, svg .yt, svg .xl, svg .stagename { font-size: 11px; fill: #444; }
svg .xt { text-anchor: middle; } svg .yt, svg .xl { text-anchor: end; }
svg .stagename { fill: #666; font-style: italic; }
svg .grid { stroke: #e6e6e6; } svg .tick { stroke: #888; }
svg .plotarea { fill: none; stroke: #bbb; }
svg .line { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
svg .stage { stroke: #555; stroke-dasharray: 4 3; } svg .stage.over { stroke: #000; stroke-width: 1.5; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; } th { background: #f2f2f2; }
td:first-child, th:first-child { text-align: left; }
]]

-- report(records, {title, source}) -> the HTML page, and a count {charts, heatmap_cells}
function plot.report(records, info)
  info = info or {}
  local c = plot.collect(records)
  local steps = c.steps
  if #steps == 0 then error("plot: no step records to draw", 0) end
  -- the step axis spans half a step beyond the first and the last: a heatmap column is one step wide
  local x0, x1 = steps[1].step - 0.5, steps[#steps].step + 0.5
  local base = { stages = c.stages, x0 = x0, x1 = x1 }
  local function chart(o)
    for k, v in pairs(base) do if o[k] == nil then o[k] = v end end
    return plot.line_chart(o)
  end
  local body, charts, cells = {}, 0, 0
  local function add(s) body[#body + 1] = s end
  local function add_chart(svg) add(svg); charts = charts + 1 end

  -- validation points: from step records (evals within a stage) and stage ends
  local function val_points(key)
    local pts, seen = {}, {}
    for _, r in ipairs(steps) do
      if finite(r[key]) then pts[#pts + 1] = { r.step, r[key] }; seen[r.step] = true end
    end
    for _, r in ipairs(c.stage_ends) do
      if finite(r[key]) and not seen[r.step] then pts[#pts + 1] = { r.step, r[key] } end
    end
    table.sort(pts, function(a, b) return a[1] < b[1] end)
    return pts
  end

  local last = steps[#steps]
  local tokens = last.tokens
  add(fmt("<h1>%s</h1>", esc(info.title or "run")))
  add(fmt('<p class="meta">%s: %d step records, steps %d–%d%s%s%s</p>', esc(info.source or "metrics.jsonl"), #steps,
    steps[1].step, last.step, finite(tokens) and (", " .. log.si(tokens) .. " tokens") or "",
    #c.stages > 0 and fmt(", %d stage%s", #c.stages, #c.stages == 1 and "" or "s") or "",
    c.nonfinite > 0 and fmt(", %d non-finite value%s (gaps)", c.nonfinite, c.nonfinite == 1 and "" or "s") or ""))

  add("<h2>Loss</h2>")
  local loss_series = { { name = "train loss", color = PALETTE[1], points = series(steps, "loss") } }
  local vl = val_points("val_loss")
  if #vl > 0 then
    loss_series[2] = { name = "validation loss", color = PALETTE[2], points = vl, dots = #vl < 200 }
  end
  add_chart(chart({ title = "loss (nats per target token)", series = loss_series }))
  add("<h2>Optimisation and throughput</h2>")
  add_chart(chart({ title = "learning rate", series = { { name = "lr", color = PALETTE[3], points = series(steps, "lr") } },
    zero = true, height = 180 }))
  local gn = series(steps, "grad_norm")
  if #gn > 0 then
    add_chart(chart({ title = "gradient norm (before clipping)", series = { { name = "grad norm", color = PALETTE[5],
      points = gn } }, zero = true, height = 180 }))
  end
  add_chart(chart({ title = "tokens / s", series = { { name = "tok/s", color = PALETTE[4],
    points = series(steps, "tok_per_s") } }, zero = true, height = 180 }))
  local mem = {}
  for i, k in ipairs({ "mem_peak", "mem_current" }) do
    local pts = series(steps, k)
    if #pts > 0 then mem[#mem + 1] = { name = k == "mem_peak" and "peak" or "current", color = PALETTE[5 + i], points = pts } end
  end
  if #mem > 0 then add_chart(chart({ title = "engine memory (bytes)", series = mem, zero = true, unit = "B", height = 180 })) end

  if #c.layers.maxvio > 0 or #c.layers.maxvio_val > 0 then
    add("<h2>Expert balance</h2>")
    local mv = {}
    for i, l in ipairs(c.layers.maxvio) do
      mv[#mv + 1] = { name = fmt("L%d batch", l), color = PALETTE[(i - 1) % #PALETTE + 1],
        points = series(steps, "moe/maxvio_batch/" .. l) }
    end
    add_chart(chart({ title = "MaxVio of the last batch, per MoE layer", series = mv, zero = true }))
    if #c.layers.maxvio_val > 0 then
      local vv = {}
      for i, l in ipairs(c.layers.maxvio_val) do
        local pts = val_points("moe/maxvio_global/" .. l)
        vv[#vv + 1] = { name = fmt("L%d validation", l), color = PALETTE[(i - 1) % #PALETTE + 1], points = pts,
          dots = #pts < 200 }
      end
      add_chart(chart({ title = "MaxVio over the validation tokens, per MoE layer", series = vv, zero = true }))
    end
  end
  if #c.layers.load > 0 then
    add("<h2>Expert loads</h2>")
    add('<p class="meta">Tokens routed to each expert in each step over the mean of the layer\'s experts (1 = '
      .. "balanced; blue below, red above).</p>")
    local experts = 0
    for _, r in ipairs(steps) do
      for _, l in ipairs(c.layers.load) do
        local load = r["moe/load/" .. l]
        if type(load) == "table" then experts = math.max(experts, #load) end
      end
    end
    local columns = math.max(20, math.min(plot.MAX_COLUMNS, math.floor(plot.MAX_CELLS / (experts * #c.layers.load))))
    for _, l in ipairs(c.layers.load) do
      local svg, n = plot.heatmap({ title = fmt("layer %d: load per expert", l), steps = steps,
        key = "moe/load/" .. l, stages = c.stages, x0 = x0, x1 = x1, columns = columns })
      add_chart(svg)
      cells = cells + n
    end
  end

  -- tables
  if #c.stage_ends > 0 then
    add("<h2>Stage ends</h2>")
    local ls = c.layers.maxvio_val
    local head = { "stage", "step", "T", "validation loss" }
    for _, l in ipairs(ls) do head[#head + 1] = fmt("val MaxVio L%d", l) end
    local seq = {}
    for _, r in ipairs(steps) do if r.stage then seq[r.stage] = r.seq_len end end
    local rows = {}
    for _, r in ipairs(c.stage_ends) do
      local row = { esc(r.stage), num(r.step, "%d"), num(seq[r.stage], "%d"), num(r.val_loss) }
      for _, l in ipairs(ls) do row[#row + 1] = num(r["moe/maxvio_global/" .. l], "%.3f") end
      rows[#rows + 1] = row
    end
    add(html_table(head, rows))
  end
  if #c.evals > 0 then
    add(fmt("<h2>Task evals (step %d)</h2>", c.evals[1].step))
    local rows = {}
    for _, r in ipairs(c.evals) do
      rows[#rows + 1] = { esc(r.task or "?") .. (r.source and r.source ~= r.task and (" (" .. esc(r.source) .. ")") or ""),
        num(r.T, "%d"), r.depth and num(r.depth, "%g") or "–", type(r.acc) == "number" and fmt("%.1f%%", 100 * r.acc) or "–",
        type(r.exact) == "number" and fmt("%.1f%%", 100 * r.exact) or "–", num(r.n, "%d") }
    end
    add(html_table({ "task", "length", "depth", "token accuracy", "exact match", "examples" }, rows))
  end
  if #c.moe > 0 then
    add(fmt("<h2>Expert loads at the end (step %d)</h2>", c.moe[1].step))
    local rows = {}
    for _, r in ipairs(c.moe) do
      rows[#rows + 1] = { num(r.layer, "%d"), num(r.maxvio_batch, "%.3f"), num(r.maxvio_val, "%.3f"),
        num(r.dead_experts, "%d"), num(r.b_std, "%.3f") }
    end
    add(html_table({ "MoE layer", "MaxVio last batch", "MaxVio validation", "dead experts", "bias std" }, rows))
  end
  local html = table.concat({
    "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
    fmt("<title>%s — tide report</title>", esc(info.title or "run")),
    "<style>" .. CSS .. "</style></head><body>", table.concat(body, "\n"), "</body></html>", "" }, "\n")
  return html, { charts = charts, heatmap_cells = cells, layers = c.layers, stages = #c.stages }
end

return plot
