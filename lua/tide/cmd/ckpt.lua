-- tide ckpt info|consolidate: what a checkpoint holds, and a sharded checkpoint (several ranks) as a single-file one
-- (lua/tide/checkpoint.lua describes both layouts).
local cli = require "tide.cli"

local M = {}

M.USAGE = [[
usage: tide ckpt info CKPT
       tide ckpt consolidate CKPT [--out DIR] [--overwrite]

CKPT is a run directory (its latest checkpoint) or a step directory (<run>/ckpt/step_00001234).

  info          the step, the layout (single files, or shards and the ranks that wrote them), and per file the
                tensors and bytes
  consolidate   a checkpoint written by several ranks (model-0000i-of-0000N.safetensors shards and
                model.safetensors.index.json, the same for optim) rewritten as model.safetensors and
                optim.safetensors, every tensor's bytes as stored; state.json and tokenizer.json are copied.
                The result is a step directory like any other: it resumes (--resume=DIR, under any number of
                ranks), samples, evaluates and exports.
    --out DIR     where to write it (default: CKPT's step directory with "-consolidated" appended)
    --overwrite   replace an existing non-empty DIR (refused otherwise)]]

local function consolidate(args)
  local pos, flags = cli.parse_flags(args, { out = { kind = "string" }, overwrite = { kind = "boolean", default = false } },
    "tide ckpt consolidate")
  if #pos ~= 1 then
    cli.usage_error("tide ckpt consolidate: expected CKPT, got " .. #pos .. " argument(s) (tide ckpt --help)")
  end
  local checkpoint = require "tide.checkpoint"
  local ok, dir = pcall(checkpoint.resolve, pos[1])
  if not ok then error(dir, 0) end
  local out = flags.out or (dir:gsub("/+$", "") .. "-consolidated")
  local info = checkpoint.consolidate(dir, out, { overwrite = flags.overwrite })
  local parts = {}
  for _, kind in ipairs({ "model.safetensors", "optim.safetensors" }) do
    local f = info.files[kind]
    if f then
      parts[#parts + 1] = string.format("%s (%d tensors, %.2f MB, from %d shard%s)", kind, f.tensors, f.bytes / 2 ^ 20,
        f.shards, f.shards == 1 and "" or "s")
    end
  end
  print(string.format("consolidate: %s (step %d) -> %s: %s", info.dir, info.step or 0, out, table.concat(parts, ", ")))
  return 0
end

local function info(args)
  local pos = cli.parse_flags(args, {}, "tide ckpt info")
  if #pos ~= 1 then cli.usage_error("tide ckpt info: expected CKPT, got " .. #pos .. " argument(s) (tide ckpt --help)") end
  local checkpoint = require "tide.checkpoint"
  local ok, dir = pcall(checkpoint.resolve, pos[1])
  if not ok then error(dir, 0) end
  local r = checkpoint.open(dir)
  local st = r.state
  local layout = st.dist and string.format("saved by a run of %d ranks (data parallel%s)", st.dist.dp,
    (st.dist.zero or 0) > 0 and (", ZeRO-" .. st.dist.zero) or "") or "saved by a run of one rank"
  print(string.format("%s: step %s, %s", dir, tostring(st.step), layout))
  for _, kind in ipairs({ "model.safetensors", "optim.safetensors" }) do
    local lok, L = pcall(r.layout, r, kind)
    if lok then
      local tensors = r:tensors(kind)
      local n, bytes = 0, 0
      for _, t in pairs(tensors) do n, bytes = n + 1, bytes + t:nbytes() end
      print(string.format("  %-18s %d tensors, %.2f MB, %s", kind, n, bytes / 2 ^ 20,
        L.map and string.format("%d shards (%s)", #L.files, kind .. ".index.json") or "one file"))
    elseif kind == "model.safetensors" then
      r:close()
      error(L, 0)
    end
  end
  r:close()
  return 0
end

function M.main(args)
  return cli.subcommand(args, { info = info, consolidate = consolidate }, { "info", "consolidate" }, "tide ckpt", M.USAGE)
end

return M
