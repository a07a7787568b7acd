-- tide.rl.markup: the chat markup of RL trajectories (rl.md §1-§2, formats.md §4), specials resolved by name.
--
--   local mk = markup.new(tokenizer)
--   mk:prompt(t, obs)          -- tool declarations, the user prompt (and the first observation), the assistant header
--   mk:tool_result(t, text, turn)
--   mk:parse_call(text)        -- "NAME: ARGS" -> name, args | nil, why
--
-- A message is <|im_ROLE|>role<|im_middle|>TEXT<|im_end|> (as the chat/SFT documents of tide.data.multimodal). The
-- assistant writes after its header: reasoning, tool calls <|tool_call_begin|>NAME: ARGS<|tool_call_end|>, the final
-- answer and the <|im_end|> that closes its turn; all of it is sampled, so loss_mask = 1. Everything the environment
-- or the template inserts is mask 0: system and user messages, tool declarations, tool results
-- <|tool_result_begin|>TEXT<|tool_result_end|> (inside the assistant's turn; sampling resumes after them), environment
-- observations (a user-side message named "environment") and the assistant header.
local traj = require "tide.rl.traj"

local markup = {}
local fmt = string.format
local R = traj.ROLE

local NAMES = { system = "<|im_system|>", user = "<|im_user|>", assistant = "<|im_assistant|>",
  middle = "<|im_middle|>", im_end = "<|im_end|>", call_begin = "<|tool_call_begin|>",
  call_end = "<|tool_call_end|>", result_begin = "<|tool_result_begin|>", result_end = "<|tool_result_end|>" }

local Markup = {}
Markup.__index = Markup

function markup.new(tok)
  local sp = {}
  for k, name in pairs(NAMES) do sp[k] = tok:id(name) end
  return setmetatable({ tok = tok, sp = sp }, Markup)
end

function Markup:encode(text) return self.tok:encode(text) end

-- a whole message (mask 0): <|im_ROLE|>name<|im_middle|>text<|im_end|>
function Markup:message(t, kind, name, text, role, turn)
  local sp = self.sp
  t:push(sp[kind], role, 0, 0, 0, turn)
  t:extend(self:encode(name), role, 0, turn)
  t:push(sp.middle, role, 0, 0, 0, turn)
  t:extend(self:encode(text), role, 0, turn)
  t:push(sp.im_end, role, 0, 0, 0, turn)
end

function Markup:assistant_header(t, turn)
  local sp = self.sp
  t:push(sp.assistant, R.assistant, 0, 0, 0, turn)
  t:extend(self:encode("assistant"), R.assistant, 0, turn)
  t:push(sp.middle, R.assistant, 0, 0, 0, turn)
end

-- the text declaring a tool set {name = description}, in name order
function markup.declaration(tools)
  local names = {}
  for k in pairs(tools) do names[#names + 1] = k end
  table.sort(names)
  local lines = { "You can call tools. Write a call as NAME: ARGS between the tool-call tokens; its result follows." }
  for _, k in ipairs(names) do lines[#lines + 1] = fmt("- %s", tools[k]) end
  return table.concat(lines, "\n")
end

-- the start of a trajectory from an environment's reset() observation {prompt, system?, tools?, observation?}
function Markup:prompt(t, obs)
  if obs.system then self:message(t, "system", "system", obs.system, R.system, 0) end
  if obs.tools then self:message(t, "system", "tools", markup.declaration(obs.tools), R.tool_declare, 0) end
  self:message(t, "user", "user", obs.prompt, R.user, 0)
  if obs.observation then self:message(t, "user", "environment", obs.observation, R.env_observation, 0) end
  self:assistant_header(t, 0)
end

function Markup:tool_result(t, text, turn)
  t:push(self.sp.result_begin, R.tool_result, 0, 0, 0, turn)
  t:extend(self:encode(text), R.tool_result, 0, turn)
  t:push(self.sp.result_end, R.tool_result, 0, 0, 0, turn)
end

-- an observation after an assistant turn, then the next assistant header
function Markup:observation(t, text, turn)
  self:message(t, "user", "environment", text, R.env_observation, turn)
  self:assistant_header(t, turn)
end

-- parse_call("NAME: ARGS") -> name, args | nil, why
function markup.parse_call(text)
  local name, args = text:match("^%s*([%a_][%w_%.%-]*)%s*:%s?(.-)%s*$")
  if not name then
    return nil, fmt("malformed tool call %q: expected NAME: ARGS", #text > 60 and text:sub(1, 57) .. "..." or text)
  end
  return name, args
end
Markup.parse_call = function(_, text) return markup.parse_call(text) end

-- the text the policy wrote in its current turn: the tokens after the last non-policy token, decoded
function Markup:turn_text(t)
  local n, first = #t.tokens, #t.tokens + 1
  while first > 1 and t.loss_mask[first - 1] == 1 do first = first - 1 end
  local ids = {}
  for i = first, n do ids[#ids + 1] = t.tokens[i] end
  return self.tok:decode(ids, true), ids
end

-- the text of a tool call just closed by <|tool_call_end|>: the tokens after the last <|tool_call_begin|> of the
-- current turn, or nil, why when the turn holds no begin token
function Markup:call_text(t)
  local n = #t.tokens
  local stop = n
  if t.tokens[n] == self.sp.call_end then stop = n - 1 end
  for i = stop, 1, -1 do
    if t.loss_mask[i] ~= 1 then break end
    if t.tokens[i] == self.sp.call_begin then
      local ids = {}
      for j = i + 1, stop do ids[#ids + 1] = t.tokens[j] end
      return self.tok:decode(ids, true)
    end
  end
  return nil, "a tool call end without its begin token"
end

return markup
