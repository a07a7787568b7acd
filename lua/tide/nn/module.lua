-- nn/module.lua — the Module base class: parameters, children, train/eval, state dicts.
--
-- A module keeps its parameters and children as plain fields (self.weight, self.q_proj) plus an
-- ordered list of their names, so names are deterministic and read like HuggingFace's:
-- model.layers.0.self_attn.q_proj.weight. A class is made with Module:extend(name) and constructed by
-- calling it: nn.Linear(64, 32). Calling an instance runs its forward.
local ffi = require "ffi"
local tide = require "tide"
local raw = tide.raw

local Module = {}
Module.__index = Module
Module.__name = "Module"

-- a new leaf parameter; init = {"normal", std} | {"ones"} | {"zeros"}; opts.dtype, opts.device
function Module.new_param(shape, init, opts)
  opts = opts or {}
  local dtype = opts.dtype or "f32"
  if dtype ~= "f32" and dtype ~= "f64" and dtype ~= "bf16" then
    error("nn: parameter dtype must be f32, f64 or bf16, got '" .. tostring(dtype) .. "'", 3)
  end
  local o = { dtype = dtype, device = opts.device, requires_grad = true }
  if init[1] == "normal" then
    o.std = init[2]
    return tide.randn(shape, o)
  elseif init[1] == "ones" then
    return tide.ones(shape, o)
  elseif init[1] == "zeros" then
    return tide.zeros(shape, o)
  end
  error("nn: unknown init '" .. tostring(init[1]) .. "'", 2)
end

-- Module:extend("Name") -> a class; Class(...) builds an instance and runs Class.init(self, ...)
function Module:extend(name)
  local cls = {}
  for k, v in pairs(self) do
    if type(k) == "string" and k:sub(1, 2) == "__" then cls[k] = v end   -- metamethods are not inherited
  end
  cls.__index = cls
  cls.__name = name
  cls.super = self
  return setmetatable(cls, {
    __index = self,
    __call = function(c, ...)
      local obj = setmetatable({
        training = true, _param_names = {}, _param_meta = {}, _buffer_names = {}, _child_names = {},
      }, c)
      obj:init(...)
      return obj
    end,
  })
end

function Module:init() end

function Module:forward()
  error(self.__name .. ": forward is not defined", 2)
end

Module.__call = function(self, ...) return self:forward(...) end

local function add_name(list, name)
  for _, n in ipairs(list) do if n == name then return end end
  list[#list + 1] = name
end

-- register a parameter; meta.decay = false puts it in the no-decay group (norms, biases, embeddings)
function Module:param(name, t, meta)
  if not tide.is_tensor(t) then
    error(self.__name .. ":param: '" .. tostring(name) .. "' must be a tensor, got " .. type(t), 2)
  end
  if not t:requires_grad() then t:requires_grad_(true) end
  self[name] = t
  add_name(self._param_names, name)
  self._param_meta[name] = meta or {}
  return t
end

-- a tensor saved in the state dict but not trained (e.g. a balancer's bias)
function Module:buffer(name, t)
  self[name] = t
  add_name(self._buffer_names, name)
  return t
end

function Module:child(name, m)
  self[name] = m
  add_name(self._child_names, tostring(name))
  return m
end

local function join(prefix, name)
  if prefix == "" then return name end
  return prefix .. "." .. name
end

local function ptr_key(t) return tostring(ffi.cast("uintptr_t", raw(t))) end

-- walk(fn(module, prefix)) in definition order, depth first
function Module:walk(fn, prefix)
  prefix = prefix or ""
  fn(self, prefix)
  for _, name in ipairs(self._child_names) do
    self[name]:walk(fn, join(prefix, name))
  end
end

-- named_parameters() -> iterator over (name, tensor, meta); a tensor shared by two modules (a tied
-- head) appears once, under its first name
function Module:named_parameters()
  local list, seen = {}, {}
  self:walk(function(m, prefix)
    for _, name in ipairs(m._param_names) do
      local t = m[name]
      local key = ptr_key(t)
      if not seen[key] then
        seen[key] = true
        list[#list + 1] = { join(prefix, name), t, m._param_meta[name], m }
      end
    end
  end)
  local i = 0
  return function()
    i = i + 1
    local e = list[i]
    if e then return e[1], e[2], e[3], e[4] end
  end
end

function Module:parameters()
  local out = {}
  for _, t in self:named_parameters() do out[#out + 1] = t end
  return out
end

function Module:num_parameters()
  local n = 0
  for _, t in self:named_parameters() do n = n + t:numel() end
  return n
end

function Module:named_children()
  local i = 0
  return function()
    i = i + 1
    local name = self._child_names[i]
    if name then return name, self[name] end
  end
end

function Module:children()
  local out = {}
  for _, m in self:named_children() do out[#out + 1] = m end
  return out
end

function Module:modules()
  local out = {}
  self:walk(function(m) out[#out + 1] = m end)
  return out
end

function Module:train(flag)
  if flag == nil then flag = true end
  self:walk(function(m) m.training = flag and true or false end)
  return self
end

function Module:eval() return self:train(false) end

function Module:zero_grad()
  for _, t in self:named_parameters() do t:zero_grad() end
end

-- state_names() -> ordered names of every parameter and buffer (the checkpoint order)
function Module:state_names()
  local names = {}
  for name in self:named_parameters() do names[#names + 1] = name end
  self:walk(function(m, prefix)
    for _, name in ipairs(m._buffer_names) do names[#names + 1] = join(prefix, name) end
  end)
  return names
end

-- state_dict() -> {name = tensor}: the module's own tensors (not copies), HuggingFace names
function Module:state_dict()
  local sd = {}
  for name, t in self:named_parameters() do sd[name] = t end
  self:walk(function(m, prefix)
    for _, name in ipairs(m._buffer_names) do sd[join(prefix, name)] = m[name] end
  end)
  return sd
end

local function shape_str(t) return "[" .. table.concat(t:shape(), ", ") .. "]" end

-- load_state_dict(sd, strict) copies values into the module's tensors (dtype converted). With strict
-- (the default) missing and unexpected names are errors naming them; shapes must always match.
function Module:load_state_dict(sd, strict)
  if strict == nil then strict = true end
  local own_sd = self:state_dict()
  local missing, unexpected = {}, {}
  for _, name in ipairs(self:state_names()) do
    if sd[name] == nil then missing[#missing + 1] = name end
  end
  local ignored = self.ignored_state_keys or {}
  for name in pairs(sd) do
    if own_sd[name] == nil and not ignored[name] then unexpected[#unexpected + 1] = name end
  end
  table.sort(unexpected)
  if strict and (#missing > 0 or #unexpected > 0) then
    local msg = self.__name .. ".load_state_dict:"
    if #missing > 0 then msg = msg .. " missing " .. table.concat(missing, ", ") .. ";" end
    if #unexpected > 0 then msg = msg .. " unexpected " .. table.concat(unexpected, ", ") .. ";" end
    error(msg, 2)
  end
  for name, dst in pairs(own_sd) do
    local src = sd[name]
    if src ~= nil then
      if not tide.is_tensor(src) then
        error(self.__name .. ".load_state_dict: '" .. name .. "' is a " .. type(src) .. ", expected a tensor", 2)
      end
      local same = shape_str(src) == shape_str(dst)
      if not same then
        error(string.format("%s.load_state_dict: '%s' is %s in the state dict but %s in the model",
          self.__name, name, shape_str(src), shape_str(dst)), 2)
      end
      dst:copy_(src)
    end
  end
  return missing, unexpected
end

-- to(device): move every parameter and buffer (tied tensors stay tied)
function Module:to(device)
  local moved = {}
  self:walk(function(m)
    for _, list in ipairs({ m._param_names, m._buffer_names }) do
      for _, name in ipairs(list) do
        local t = m[name]
        local key = ptr_key(t)
        if not moved[key] then
          local nt = t:to(device):detach()
          if t:requires_grad() then nt:requires_grad_(true) end
          moved[key] = nt
        end
        m[name] = moved[key]
      end
    end
  end)
  return self
end

function Module:extra_repr() return "" end

function Module:__tostring()
  local lines = {}
  local function rec(m, name, indent)
    local head = string.rep("  ", indent) .. (name and (name .. ": ") or "") .. m.__name
    local extra = m:extra_repr()
    if extra ~= "" then head = head .. "(" .. extra .. ")" end
    lines[#lines + 1] = head
    for _, cname in ipairs(m._child_names) do rec(m[cname], cname, indent + 1) end
  end
  rec(self, nil, 0)
  return table.concat(lines, "\n")
end

-- ModuleList: children named 0, 1, 2, ... (HuggingFace layer numbering is 0-based)
local ModuleList = Module:extend("ModuleList")

function ModuleList:init(mods)
  self.n = 0
  for _, m in ipairs(mods or {}) do self:append(m) end
end

function ModuleList:append(m)
  self:child(tostring(self.n), m)
  self.n = self.n + 1
  return m
end

-- get(i): the i-th module, 1-based like every Lua list
function ModuleList:get(i) return self[tostring(i - 1)] end

function ModuleList:extra_repr() return tostring(self.n) end

return { Module = Module, ModuleList = ModuleList }
