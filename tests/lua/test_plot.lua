-- plot: `tide plot RUN` on a short curriculum run (tests/fixtures/curriculum_small.lua) — one SVG per chart, the
-- expert-load heatmap cells with the colours of their loads, stage boundaries, the tables, nothing fetched from a
-- network, the page written atomically (RUN/report.html or -o); headless Chromium's screenshot of the page decoded
-- (a small PNG reader over zlib) and checked for drawn pixels; a long run thinned; errors one line each.
local T = require "tide.testing"
local tide = require "tide"
local ffi = require "ffi"
local json = require "tide.json"
local cli = require "tide.cli"
local curriculum = require "tide.curriculum"
local plot = require "tide.plot"
local cmd = require "tide.cmd.plot"

local tmpdir = T.tmpdir
local fmt = string.format

local function count(s, pat)
  local n = 0
  for _ in s:gmatch(pat) do n = n + 1 end
  return n
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

-- one curriculum run shared by the cases
local run_dir
local function the_run()
  if run_dir then return run_dir end
  run_dir = tmpdir("run")
  local cfg = cli.load_recipe("tests/fixtures/curriculum_small.lua", { { key = "train.out", text = run_dir } })
  curriculum.train(cfg)
  return run_dir
end

local function quiet_main(args)
  local saved = print
  print = function() end
  local ok, r = pcall(cmd.main, args)
  print = saved
  if not ok then error(r, 0) end
  return r
end

T.test("the page: a chart per metric, a heatmap cell per expert and step, stage lines, tables, no network", function()
  local out = the_run()
  T.eq(quiet_main({ out }), 0)
  local html = read(out .. "/report.html")
  T.eq(tide.C.tide_path_exists(out .. "/report.html.tmp"), 0, "written atomically")
  -- loss, lr, grad norm, tok/s, memory, MaxVio batch, MaxVio validation, one heatmap per MoE layer (2)
  T.eq(count(html, "<svg"), 9)
  T.eq(count(html, "</svg>"), 9)
  T.eq(count(html, '<svg class="chart heatmap"'), 2)
  for _, t in ipairs({ "loss %(nats per target token%)", "learning rate", "tokens / s", "engine memory", "gradient norm",
    "MaxVio of the last batch", "MaxVio over the validation tokens", "layer 0: load per expert", "layer 1: load per expert" }) do
    T.eq(count(html, '<text class="title"[^>]*>' .. t), 1, t)
  end
  T.eq(count(html, '<rect class="cell"'), 2 * 4 * 18, "2 layers x 4 experts x 18 steps")
  -- stages a | b | c: two boundaries on each of the 9 charts, and over the cells of each heatmap
  T.eq(count(html, '<line class="stage"'), 9 * 2)
  T.eq(count(html, '<line class="stage over"'), 2 * 2)
  T.eq(count(html, '<text class="stagename"[^>]*>b</text>'), 9)
  -- validation points: steps 3, 6, 12, 18 on the loss chart and for each layer's validation MaxVio
  T.eq(count(html, "<circle"), 4 + 2 * 4)
  -- nothing from a network, nothing but the page itself
  T.ok(not html:find("http://", 1, true) and not html:find("https://", 1, true), "no http(s) reference")
  T.ok(not html:find("<script", 1, true) and not html:find("<link", 1, true) and not html:find("<img", 1, true))
  -- the tables: stage ends, the final task evals, the expert loads at the end
  T.ok(html:find("<h2>Stage ends</h2>", 1, true) and html:find("<h2>Task evals (step 18)</h2>", 1, true)
    and html:find("<h2>Expert loads at the end (step 18)</h2>", 1, true))
  T.eq(count(html, "<td>passkey</td>"), 2)
end)

T.test("heatmap cells: the colour and the text of each expert's load over the layer's mean", function()
  local out = the_run()
  local recs = cmd.read_records(out .. "/metrics.jsonl")
  local html = plot.report(recs, { title = "x" })
  local checked = 0
  for _, r in ipairs(recs) do
    if r.event == nil and (r.step == 1 or r.step == 18) then
      for l = 0, 1 do
        local load = r["moe/load/" .. l]
        local mean = 0
        for _, v in ipairs(load) do mean = mean + v / #load end
        for j, v in ipairs(load) do
          local ratio = v / mean
          local cell = html:match(fmt('fill="(#%%x+)"><title>step %d, expert %d: %.2f x the mean load</title>', r.step,
            j - 1, ratio))
          T.eq(cell, plot.ratio_color(ratio), fmt("step %d layer %d expert %d", r.step, l, j - 1))
          checked = checked + 1
        end
      end
    end
  end
  T.eq(checked, 16)
  -- the scale: white at the mean, red above, blue below, saturated at x4 and 1/4
  T.eq({ plot.ratio_color(1), plot.ratio_color(4), plot.ratio_color(8), plot.ratio_color(0.25), plot.ratio_color(0) },
    { "#ffffff", "#b40426", "#b40426", "#3b4cc0", "#3b4cc0" })
end)

-- ---- the screenshot -------------------------------------------------------------------------------------------
T.test("headless Chromium draws the page: many colours, the lines and the heatmap's reds and blues", function()
  local out = the_run()
  quiet_main({ out })
  local shot = T.screenshot(out .. "/report.html", 1000, 2400)
  if not shot then return end
  local w, h, rgb = T.png(shot)
  T.eq({ w, h }, { 1000, 2400 })
  local colours, distinct, drawn, reds, blues, line_blue = {}, 0, 0, 0, 0, 0
  for y = 0, h - 1, 2 do
    for x = 0, w - 1, 2 do
      local r, g, b = rgb(x, y)
      local key = (r * 256 + g) * 256 + b
      if not colours[key] then colours[key] = true; distinct = distinct + 1 end
      if r + g + b < 720 then drawn = drawn + 1 end
      if r > 170 and r - g > 50 and r - b > 40 then reds = reds + 1 end     -- heatmap above the mean, tok/s line
      if b > 150 and b - r > 50 and b - g > 40 then blues = blues + 1 end   -- heatmap below the mean, loss line
      if math.abs(r - 31) < 12 and math.abs(g - 119) < 12 and math.abs(b - 180) < 12 then line_blue = line_blue + 1 end
    end
  end
  local n = (w / 2) * (h / 2)
  print(fmt("  screenshot %dx%d (every 2nd pixel): %d colours, %.3f drawn, %d red, %d blue, %d loss-line pixels", w, h,
    distinct, drawn / n, reds, blues, line_blue))
  T.ok(distinct >= 200, fmt("%d distinct colours", distinct))
  T.ok(drawn / n > 0.05 and drawn / n < 0.6, fmt("%.3f of the pixels drawn", drawn / n))
  T.ok(reds > 500 and blues > 500, fmt("%d red and %d blue heatmap pixels", reds, blues))
  T.ok(line_blue > 50, fmt("%d pixels of the loss line's colour", line_blue))
end)

T.test("-o, a long run thinned, a dense run without MoE or stages", function()
  local out = the_run()
  local dir = tmpdir("other", { create = true })
  T.eq(quiet_main({ out, "-o", dir .. "/r.html" }), 0)
  T.eq(count(read(dir .. "/r.html"), "<svg"), 9)
  -- 5000 steps of 8 experts: at most 1500 points a line, 300 heatmap columns
  local recs = {}
  for s = 1, 5000 do
    local load = {}
    for j = 1, 8 do load[j] = 100 + ((s * j) % 50) end
    recs[s] = { step = s, loss = 3 - s / 5000, lr = 1e-3, tok_per_s = 1e4, stage = s <= 2500 and "s1" or "s2",
      ["moe/maxvio_batch/1"] = 0.1, ["moe/load/1"] = load }
  end
  local html, info = plot.report(recs, {})
  T.eq(info.heatmap_cells, 300 * 8)
  T.eq(count(html, '<rect class="cell"'), 300 * 8)
  local loss_path = html:match('<path class="line" stroke="[^"]+" d="([^"]+)"><title>train loss')
  T.eq(count(loss_path, "[ML]"), plot.MAX_POINTS)
  T.eq(count(html, '<line class="stage"'), 5)     -- loss, lr, tok/s, MaxVio, the heatmap (no grad norm, memory, val)
  T.eq(count(html, '<line class="stage over"'), 1)
  -- a large model: 24 MoE layers of 64 experts stay within MAX_CELLS; 24 MaxVio lines get a one-line legend
  local big = {}
  for s = 1, 400 do
    local r = { step = s, loss = 1, lr = 1e-3, tok_per_s = 1 }
    for l = 0, 23 do
      local load = {}
      for j = 1, 64 do load[j] = 1 + (s + j + l) % 7 end
      r["moe/load/" .. l], r["moe/maxvio_batch/" .. l] = load, 0.1
    end
    big[s] = r
  end
  local bh, bi = plot.report(big, {})
  local cols = math.floor(plot.MAX_CELLS / (24 * 64))
  T.eq(bi.heatmap_cells, 24 * 64 * cols)
  T.ok(bi.heatmap_cells <= plot.MAX_CELLS and #bh < 12e6, fmt("%d cells, %d bytes", bi.heatmap_cells, #bh))
  T.eq(count(bh, "24 series %(L0 batch … L23 batch%), colours cycle"), 1)
  -- a dense run: no MoE charts, no stages; a non-finite loss is a gap (two path pieces)
  local dense = { { step = 1, loss = 2, lr = 1e-3, grad_norm = 1, tok_per_s = 100, mem_peak = 10, mem_current = 5 },
    { step = 2, loss = json.null, nonfinite = { "loss" }, lr = 1e-3, grad_norm = 1, tok_per_s = 100 },
    { step = 3, loss = 1.5, lr = 1e-3, grad_norm = 1, tok_per_s = 100 },
    { step = 4, loss = 1.4, lr = 1e-3, grad_norm = 1, tok_per_s = 100 } }
  local dh, di = plot.report(dense, {})
  T.eq({ di.charts, di.heatmap_cells, count(dh, '<line class="stage"') }, { 5, 0, 0 })
  T.eq(count(dh:match('<path class="line" stroke="[^"]+" d="([^"]+)"><title>train loss'), "M"), 2)
  T.ok(dh:find("1 non-finite value (gaps)", 1, true))
end)

T.test("errors are one line: no directory, no metrics, a malformed line, a FIFO, no step records, usage", function()
  local dir = tmpdir("errors", { create = true })
  T.raises(function() quiet_main({ dir .. "/nope" }) end, "plot: '" .. dir .. "/nope' does not exist")
  write(dir .. "/file", "x")
  T.raises(function() quiet_main({ dir .. "/file" }) end, "is not a directory")
  T.raises(function() quiet_main({ dir }) end, "plot: '" .. dir .. "' has no metrics.jsonl")
  write(dir .. "/metrics.jsonl", '{"step":1,"loss":2}\n\n{"step":2,"loss":}\n')
  T.raises(function() quiet_main({ dir }) end, "plot: " .. dir .. "/metrics.jsonl:3: ")
  local ok, err = pcall(quiet_main, { dir })
  T.ok(not ok and not tostring(err):find("\n"), "one line: " .. tostring(err))
  -- a last line still being written (no LF yet) is left out; with its LF it is an error
  write(dir .. "/metrics.jsonl", '{"step":1,"loss":2}\n{"step":2,"lo')
  T.eq(#cmd.read_records(dir .. "/metrics.jsonl"), 1)
  write(dir .. "/metrics.jsonl", '{"step":1,"loss":2}\n{"step":2,"lo\n')
  T.raises(function() quiet_main({ dir }) end, "metrics.jsonl:2: ")
  write(dir .. "/metrics.jsonl", '{"step":1,"loss":2}\n[1,2]\n')
  T.raises(function() quiet_main({ dir }) end, "metrics.jsonl:2: a record must be a JSON object")
  write(dir .. "/metrics.jsonl", '{"event":"stopped"}\n')
  T.raises(function() quiet_main({ dir }) end, "metrics.jsonl holds no step records to draw")
  os.remove(dir .. "/metrics.jsonl")
  os.execute(fmt("mkfifo %s", cli.shell_quote(dir .. "/metrics.jsonl")))
  T.raises(function() quiet_main({ dir }) end, "is a FIFO (named pipe), not a regular file")
  T.raises(function() quiet_main({}) end, "tide plot: expected one run directory, got 0 argument(s)")
  T.raises(function() quiet_main({ dir, "--width=3" }) end, "tide plot: unknown option '--width' (known: --out)")
  T.eq(tide.C.tide_path_exists(dir .. "/report.html"), 0, "nothing written on an error")
end)

T.run()
