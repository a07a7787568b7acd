-- tide.repl: the interactive prompt (`tide repl`).
--
-- Lines are read through the host's readline (history in ~/.tide_history, tab completion of globals,
-- table fields and tensor methods) when running inside the `tide` executable, through io.read otherwise.
-- Incomplete chunks continue on the next line; expressions and `=expr` print their values (tensors
-- and modules through tostring); commands taking longer than 0.1 s print their time; help(x) shows
-- documentation; the last value is kept in `_`.
local ffi = require "ffi"

local M = {}

-- host-only functions (engine/host/main.c), not part of tide.h
if not pcall(function() return ffi.C.tide_host_readline end) then
  pcall(ffi.cdef, [[
    const char *tide_host_readline(const char *prompt);
    void tide_host_add_history(const char *line);
    void tide_host_set_completions(const char *words);
    int tide_host_has_readline(void);
    void tide_host_catch_interrupts(int on);
    int tide_host_interrupted(void);
  ]])
end
local host = pcall(function() return ffi.C.tide_host_readline end)

-- ---- documentation ------------------------------------------------------------------------------------
-- name -> text; help() resolves the name to a value so help(tide.zeros) finds it as well
M.docs = {
  ["tide.zeros"] = "tide.zeros(shape, opts) -> tensor of zeros; shape {2, 3} (or 2, 3); opts {dtype=\"f32\", device=\"cpu\", requires_grad=false}",
  ["tide.ones"] = "tide.ones(shape, opts) -> tensor of ones",
  ["tide.full"] = "tide.full(shape, value, opts) -> tensor filled with value",
  ["tide.empty"] = "tide.empty(shape, opts) -> uninitialised tensor",
  ["tide.arange"] = "tide.arange(n) or tide.arange(a, b[, step][, opts]) -> values a, a+step, ... below b",
  ["tide.randn"] = "tide.randn(shape, opts) -> normal samples; opts.mean (0), opts.std (1); see tide.manual_seed",
  ["tide.rand"] = "tide.rand(shape, opts) -> uniform samples in [opts.lo, opts.hi) (default [0, 1))",
  ["tide.tensor"] = "tide.tensor(data, opts) -> tensor from a number, a flat or nested table, or a tensor (copied); opts.shape reshapes flat data",
  ["tide.no_grad"] = "tide.no_grad(fn, ...) -> fn's results, computed without recording the autograd graph",
  ["tide.recompute"] = "tide.recompute(fn, ...) -> fn's results; activations inside are recomputed during backward instead of kept",
  ["tide.backward"] = "tide.backward(loss[, grad]) -> accumulates gradients into the leaves (same as loss:backward())",
  ["tide.manual_seed"] = "tide.manual_seed(n) -> seeds the counter-based RNG (same stream on every device)",
  ["tide.memory"] = "tide.memory([device]) -> {current=, peak=, cached=, limit=, n_alloc=, n_cache_hits=} engine bytes",
  ["tide.collect"] = "tide.collect() -> full Lua collection (releases unreachable tensors); returns tide.memory()",
  ["tide.Curriculum"] = "tide.Curriculum{model, optim, tokens_per_step, micro_tokens, sources, stages = {{name, seq_len, steps|tokens, mix, lr = {kind, from, to, warmup}, eval}}, val, evals, hooks, train} -> a recipe; tide run trains it (--resume, --stage=NAME, --scale=NAME, --dry-run)",
  ["tide.evals"] = "tide.evals.run(model, {task = \"mqar\"|\"passkey\"|\"copy\", lengths, depths, examples, batch, ...}) -> rows {task, length, depth, accuracy, exact}; tide.evals.table(rows) -> markdown",
  ["tide.nn.plan"] = "nn.plan.count(cfg) -> {total, active, per_layer}; nn.plan.activation_bytes(cfg, T, {recompute, dtype}); nn.plan.config(\"tiny\"|\"k3\"); nn.plan.describe(cfg, {seq_len})",
  ["tide.info"] = "tide.info() -> table: version, threads, blas, cuda, mpi, luajit, gc64, ops",
  ["tide.F"] = "tide.F: functional ops: matmul linear embedding rmsnorm layernorm softmax log_softmax cross_entropy rope attention swiglu concat split chunk index_select gather scatter_add adamw_step_",
  ["tide.F.matmul"] = "F.matmul(a, b[, ta, tb]) -> a @ b with a/b optionally transposed (last two dims)",
  ["tide.F.linear"] = "F.linear(x, weight[, bias]) -> x @ weight^T + bias; weight [out, in]",
  ["tide.F.embedding"] = "F.embedding(weight [V, d], ids) -> [..., d]; ids are 0-based token ids (tensor or table)",
  ["tide.F.rmsnorm"] = "F.rmsnorm(x, weight[, eps=1e-5]) -> x / sqrt(mean(x^2) + eps) * weight over the last dim",
  ["tide.F.layernorm"] = "F.layernorm(x, weight, bias[, eps=1e-5]) over the last dim",
  ["tide.F.softmax"] = "F.softmax(x[, dim=-1])",
  ["tide.F.log_softmax"] = "F.log_softmax(x[, dim=-1])",
  ["tide.F.cross_entropy"] = "F.cross_entropy(logits [N, V] or [..., V], targets, {ignore_index=-100, weights=nil, reduction=\"mean\"|\"sum\"|\"none\"})",
  ["tide.F.rope"] = "F.rope(x [B, T, H, D][, theta=10000][, pos0=0]) -> rotary position embedding",
  ["tide.F.attention"] = "F.attention(q [B, H, Tq, D], k, v[, {causal=false, scale=1/sqrt(D)}])",
  ["tide.F.swiglu"] = "F.swiglu(gate, up) -> silu(gate) * up",
  ["tide.F.concat"] = "F.concat({a, b, ...}[, dim=1])",
  ["tide.F.split"] = "F.split(x, sizes, dim=1) -> array of tensors; sizes is a table or one piece size",
  ["tide.F.chunk"] = "F.chunk(x, n, dim=1) -> n nearly equal pieces",
  ["tide.F.index_select"] = "F.index_select(x, dim, index) -> rows of x at the 0-based positions in index",
  ["tide.F.gather"] = "F.gather(x, dim, index) -> out[..i..] = x[..index[..i..]..] along dim",
  ["tide.F.scatter_add"] = "F.scatter_add(x, dim, index, src) -> a copy of x with src added at index along dim",
  ["tide.F.adamw_step_"] = "F.adamw_step_(param, grad, m, v, {lr=, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=0})",
}

M.tensor_docs = {
  shape = "t:shape() -> {sizes}", size = "t:size([dim]) -> size of a dim (1-based), or the shape",
  dim = "t:dim() -> number of dims", numel = "t:numel() -> number of elements", dtype = "t:dtype() -> \"f32\" ...",
  device = "t:device() -> \"cpu\" or \"cuda:N\"", item = "t:item() -> the value of a one-element tensor",
  totable = "t:totable() -> nested Lua tables", tolist = "t:tolist() -> flat Lua array (row-major)",
  reshape = "t:reshape(2, -1) or t:reshape{2, -1}", view = "t:view(...) -> reshape of a contiguous tensor",
  permute = "t:permute(2, 1, 3) (1-based dims)", transpose = "t:transpose(a, b) (default: the last two dims)",
  narrow = "t:narrow(dim, start, len) -> view of elements start..start+len-1 (1-based)",
  slice = "t:slice(dim, i, j[, step]) -> view of elements i..j inclusive (1-based; negative from the end)",
  select = "t:select(dim, i) -> the slice at position i with dim removed; t[i] = t:select(1, i)",
  squeeze = "t:squeeze([dim])", unsqueeze = "t:unsqueeze(dim)", flatten = "t:flatten([a, b])",
  expand = "t:expand(shape...) -> broadcast view", contiguous = "t:contiguous()",
  to = "t:to(\"f64\") / t:to(\"cuda\") / t:to{dtype=, device=}", clone = "t:clone() -> contiguous copy without history",
  sum = "t:sum([dims[, keepdim]])", mean = "t:mean([dims[, keepdim]])", max = "t:max([dim[, keepdim]])",
  argmax = "t:argmax([dim[, keepdim]]) -> i64 0-based positions", logsumexp = "t:logsumexp([dim[, keepdim]])",
  matmul = "t:matmul(b[, ta, tb])", pow = "t:pow(p) or t ^ p (p a number)",
  backward = "t:backward([grad])", grad = "t:grad() -> accumulated gradient or nil",
  requires_grad_ = "t:requires_grad_([flag=true]) -> t", zero_grad = "t:zero_grad()", detach = "t:detach()",
  fill_ = "t:fill_(v)", copy_ = "t:copy_(src)", sum_squares = "t:sum_squares() -> number",
  all_finite = "t:all_finite() -> boolean",
}

local function resolve(name)
  local v = _G
  for part in name:gmatch("[^.]+") do
    if type(v) ~= "table" then return nil end
    v = rawget(v, part) or (part == "F" and v.F) or v[part]
  end
  return v
end

-- help(x): documentation for a tide function/module, a tensor (its methods), or anything with __doc
function M.help(x)
  if x == nil then
    print([[
tide repl: Lua with the tide library loaded as `tide` (and `F` = tide.F).
  expressions print their value; `=expr` too; `_` holds the last value
  help(tide.zeros), help(F), help(t) for a tensor, help("t:sum"), help(tide.nn.HybridLM) (constructor keys)
  Ctrl-C stops a running command and keeps your variables (Lua runs interpreted here; jit.on() compiles)
  tide.info()  tide.memory()  tide.manual_seed(1)
  Ctrl-D leaves]])
    return
  end
  if type(x) == "string" then
    local method = x:match("^t:(.+)$") or x:match("^tensor:(.+)$")
    if method and M.tensor_docs[method] then print(M.tensor_docs[method]) return end
    if M.docs[x] then print(M.docs[x]) return end
    local full = "tide." .. x
    if M.docs[full] then print(M.docs[full]) return end
    local v = resolve(x) or resolve(full)
    if v ~= nil then return M.help(v) end
    print("no documentation for '" .. x .. "'")
    return
  end
  local ok, tide = pcall(require, "tide")
  if ok and type(x) == "cdata" and tide.is_tensor(x) then
    print(x:describe())
    local names = {}
    for k in pairs(M.tensor_docs) do names[#names + 1] = k end
    table.sort(names)
    print("methods (help(\"t:name\")): " .. table.concat(names, " "))
    return
  end
  if type(x) == "table" and x.__doc ~= nil then
    print(x.__doc)
    return
  end
  if M.is_class(x) then
    print(M.class_help(x))
    return
  end
  for name, text in pairs(M.docs) do
    if resolve(name) == x then print(text) return end
  end
  if type(x) == "table" then
    -- an object (a module, say): what it prints as, then its fields and the methods of its classes
    local mt = getmetatable(x)
    if mt and mt.__tostring then print(tostring(x)) end
    local fields, methods, seen = {}, {}, {}
    for k in pairs(x) do
      if type(k) == "string" and not k:match("^_") then fields[#fields + 1] = k; seen[k] = true end
    end
    local cls, depth = mt and rawget(mt, "__index"), 0
    while type(cls) == "table" and depth < 8 do
      for k, v in pairs(cls) do
        if type(k) == "string" and type(v) == "function" and not k:match("^_") and not seen[k] then
          methods[#methods + 1] = k; seen[k] = true
        end
      end
      local m2 = getmetatable(cls)
      cls, depth = m2 and rawget(m2, "__index"), depth + 1
    end
    table.sort(fields)
    table.sort(methods)
    if #fields > 0 then print("fields: " .. table.concat(fields, " ")) end
    if #methods > 0 then print("methods: " .. table.concat(methods, " ")) end
    return
  end
  print("no documentation for this " .. type(x))
end

-- ---- classes ------------------------------------------------------------------------------------------
-- a Module class (nn.HybridLM), not an instance of one: classes carry their own __name and init
function M.is_class(x)
  return type(x) == "table" and type(rawget(x, "__name")) == "string" and type(rawget(x, "init")) == "function"
end

-- the comment block right above `function Class:init` in its source file (the constructor's signature and
-- description, as the code documents it), and the file's header comment (what the module is)
local function init_comment(cls)
  local info = debug.getinfo(cls.init, "S")
  local path = info and info.source and info.source:match("^@(.*)$")
  if not path then return {}, {} end
  local lines, f = {}, io.open(path, "r")
  if not f then return {}, {} end
  for line in f:lines() do lines[#lines + 1] = line end
  f:close()
  local out, header = {}, {}
  for i = info.linedefined - 1, 1, -1 do
    local c = lines[i] and lines[i]:match("^%s*%-%-%s?(.*)$")
    if not c then break end
    table.insert(out, 1, c)
  end
  for i = 1, #lines do
    local c = lines[i]:match("^%-%-%s?(.*)$")
    if not c or c == "" then break end
    header[#header + 1] = c
  end
  return out, header
end

-- the first sentence of a file header ("nn/linear.lua — y = x Wᵀ + b ..."): the text after the dash up to the
-- first '.', ':' or ';' outside parentheses that ends a clause, at most about 110 characters
function M.one_line(header)
  local text = table.concat(header, " "):gsub("^[%w_/%.]+%.lua%s+\226\128\148%s+", "")
  local depth, cut = 0, #text
  for i = 1, #text do
    local c = text:sub(i, i)
    if c == "(" then depth = depth + 1
    elseif c == ")" then depth = math.max(depth - 1, 0)
    elseif depth == 0 and (c == "." or c == ":" or c == ";") and (i == #text or text:sub(i + 1, i + 1) == " ") then
      cut = c == "." and i or i - 1
      break
    end
  end
  text = text:sub(1, cut)
  if #text > 110 then text = text:sub(1, 107):gsub("%s+%S*$", "") .. " ..." end
  return text
end

-- help(Class): the constructor from its comment, then every key it accepts with its default
function M.class_help(cls)
  local doc, header = init_comment(cls)
  local about = M.one_line(header)
  local out = { about ~= "" and (cls.__name .. " — " .. about) or nil }
  if #doc == 0 then out[#out + 1] = cls.__name .. "(...)" end
  for i = 1, math.min(#doc, 6) do out[#out + 1] = doc[i] end
  if #doc > 6 then out[#out + 1] = "..." end
  local keys, defaults = {}, rawget(cls, "DEFAULTS") or {}
  local seen = {}
  for _, set in ipairs({ rawget(cls, "KEYS") or {}, defaults }) do
    for k in pairs(set) do
      if type(k) == "string" and not seen[k] then seen[k] = true; keys[#keys + 1] = k end
    end
  end
  table.sort(keys)
  if #keys > 0 then
    out[#out + 1] = "keys (default):"
    local row = {}
    for _, k in ipairs(keys) do
      local d = defaults[k]
      row[#row + 1] = d == nil and k or (k .. " = " .. (type(d) == "table" and "{...}" or
        (type(d) == "string" and string.format("%q", d) or tostring(d))))
    end
    -- a few per line
    local line = " "
    for _, item in ipairs(row) do
      if #line + #item + 2 > 110 then out[#out + 1] = line; line = " " end
      line = line .. " " .. item .. ","
    end
    out[#out + 1] = line:gsub(",$", "")
  end
  return table.concat(out, "\n")
end

-- ---- printing -----------------------------------------------------------------------------------------
local function short(v, depth)
  depth = depth or 0
  local t = type(v)
  if t == "string" then return string.format("%q", v) end
  if t ~= "table" then return tostring(v) end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return tostring(v) end
  if depth > 1 then return "{...}" end
  local parts, n = {}, 0
  for i = 1, #v do
    n = n + 1
    if n > 20 then parts[#parts + 1] = "..." break end
    parts[#parts + 1] = short(v[i], depth + 1)
  end
  local keys = {}
  for k in pairs(v) do
    if not (type(k) == "number" and k >= 1 and k <= #v and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    n = n + 1
    if n > 20 then parts[#parts + 1] = "..." break end
    local ks = type(k) == "string" and k:match("^[%a_][%w_]*$") and k or ("[" .. short(k, 2) .. "]")
    parts[#parts + 1] = ks .. " = " .. short(v[k], depth + 1)
  end
  return "{" .. table.concat(parts, ", ") .. "}"
end
M.format = short

-- ---- completion ---------------------------------------------------------------------------------------
function M.completion_words(env)
  local words, seen = {}, {}
  local function add(w) if not seen[w] then seen[w] = true; words[#words + 1] = w end end
  local ok, tide = pcall(require, "tide")
  local tensor_methods = ok and tide.methods or {}
  local function add_fields(prefix, t, depth)
    for k, v in pairs(t) do
      if type(k) == "string" and k:match("^[%a_][%w_]*$") then
        add(prefix .. k)
        if type(v) == "table" and depth < 2 and v ~= t and v ~= _G then add_fields(prefix .. k .. ".", v, depth + 1) end
        if ok and type(v) == "cdata" and tide.is_tensor(v) then
          for m in pairs(tensor_methods) do add(prefix .. k .. ":" .. m) end
        end
      end
    end
  end
  -- the methods of module instances (m:forward) and of classes' instances' methods listed on the class
  local function add_methods(prefix, v)
    local mt = getmetatable(v)
    local cls, depth = mt and rawget(mt, "__index"), 0
    while type(cls) == "table" and depth < 8 do
      for m, f in pairs(cls) do
        if type(m) == "string" and type(f) == "function" and not m:match("^_") then add(prefix .. ":" .. m) end
      end
      local m2 = getmetatable(cls)
      cls, depth = m2 and rawget(m2, "__index"), depth + 1
    end
  end
  for k, v in pairs(env) do
    if type(k) == "string" and type(v) == "table" and not M.is_class(v) and getmetatable(v) then add_methods(k, v) end
  end
  add_fields("", env, 0)
  if ok then
    add_fields("tide.", tide, 1)
    -- submodules load on first use; completing `tide.nn.` loads them (once) so their names are there at once
    for name in pairs(tide.submodules or {}) do
      add("tide." .. name)
      if name ~= "repl" and name ~= "cli" then
        local lok, m = pcall(function() return tide[name] end)
        if lok and type(m) == "table" then add_fields("tide." .. name .. ".", m, 1) end
      end
    end
  end
  for _, kw in ipairs { "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
                        "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while" } do
    add(kw)
  end
  return table.concat(words, "\n")
end

-- ---- the loop -----------------------------------------------------------------------------------------
local function read_line(prompt)
  if host then
    local p = ffi.C.tide_host_readline(prompt)
    if p == nil then return nil end
    return ffi.string(p)
  end
  io.write(prompt)
  io.flush()
  return io.read("*l")
end

local function add_history(line)
  if host then ffi.C.tide_host_add_history(line) end
end

-- an error as the REPL shows it: the message (without the REPL's own position, which a tail call in
-- `return expr` can leave on it), then only the traceback frames of code the user typed or loaded
local repl_source = debug.getinfo(1, "S").source:sub(2)
local lib_dir = repl_source:match("^(.*/)[^/]*$") or repl_source
function M.format_error(e)
  local text = tostring(e)
  local msg, tb = text:match("^(.-)\nstack traceback:\n(.*)$")
  msg, tb = msg or text, tb or ""
  msg = msg:gsub("^" .. repl_source:gsub("%p", "%%%0") .. ":%d+: ", "")
  local lines = { msg }
  for line in tb:gmatch("[^\n]+") do
    if not line:find(lib_dir, 1, true) and not line:find("[C]", 1, true) and not line:find("(tail call)", 1, true) then
      lines[#lines + 1] = line
    end
  end
  if #lines > 1 then table.insert(lines, 2, "stack traceback:") end
  return table.concat(lines, "\n")
end

local function incomplete(err) return err and err:find("<eof>", 1, true) ~= nil end

-- compiles a chunk: expressions first (so `1 + 1` prints), then statements
local function compile(src)
  if src:sub(1, 1) == "=" then src = "return " .. src:sub(2) end
  local f, err = loadstring("return " .. src, "=stdin")
  if f then return f end
  return loadstring(src, "=stdin")
end

local function print_results(env, r)
  if r.n == 0 then return end
  local parts = {}
  for i = 1, r.n do parts[i] = short(r[i]) end
  print(table.concat(parts, "\t"))
  env._ = r[1]
end

-- one prompt round: reads a line, and runs the chunk once it is complete. Returns the new pending
-- buffer, or false at end of input.
local function round(env, tide, buffer)
  if host and buffer == nil then ffi.C.tide_host_set_completions(M.completion_words(env)) end
  local line = read_line(buffer and ".. " or "> ")
  if host and ffi.C.tide_host_interrupted() ~= 0 then buffer = nil end   -- Ctrl-C at the prompt
  if line == nil then return false end
  local src = buffer and (buffer .. "\n" .. line) or line
  if src:match("^%s*$") then return nil end
  local f, err = compile(src)
  if not f and incomplete(err) then return src end
  add_history((src:gsub("\n", " ")))
  if not f then
    print(err)
    return nil
  end
  local t0 = tide.time()
  local r = { n = 0 }
  local ok, e = xpcall(function()
    r = (function(...) return { n = select("#", ...), ... } end)(f())
  end, function(m) return debug.traceback(tostring(m), 2) end)
  debug.sethook()   -- a Ctrl-C that arrived while engine code ran must not fire later
  local dt = tide.time() - t0
  if ok then
    local pok, perr = pcall(print_results, env, r)
    if not pok then print("(cannot print the result: " .. tostring(perr) .. ")") end
  else
    print(M.format_error(e))
  end
  if dt > 0.1 then print(string.format("(%.2f s)", dt)) end
  return nil
end

-- starts the prompt; returns 0 at end of input
function M.start()
  local tide = require "tide"
  local env = _G
  env.tide = tide
  env.F = tide.F
  env.help = M.help
  -- JIT-compiled loops never reach a debug hook, so Ctrl-C could not stop them: the REPL runs Lua interpreted (the
  -- engine's kernels are C either way); TIDE_REPL_JIT=1 or jit.on() compiles again, and a compiled loop then runs
  -- on through Ctrl-C (a second one ends the REPL)
  if os.getenv("TIDE_REPL_JIT") ~= "1" then
    jit.off()
    jit.flush()
  end
  print(string.format("tide %s  (%s) -- help() for help, Ctrl-C stops a command, Ctrl-D to leave", tide.version,
    jit.version))
  if host then ffi.C.tide_host_catch_interrupts(1) end
  local buffer = nil
  while true do
    local ok, r = pcall(round, env, tide, buffer)
    if not ok then
      -- only an interrupt landing in the REPL's own code gets here
      debug.sethook()
      print(tostring(r):match("interrupted") and "interrupted" or tostring(r))
      buffer = nil
    elseif r == false then
      break
    else
      buffer = r
    end
  end
  if host then ffi.C.tide_host_catch_interrupts(0) end
  print()
  return 0
end

return M
