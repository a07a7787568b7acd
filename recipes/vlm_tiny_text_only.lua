-- vlm_tiny_text_only.lua — the baseline of recipes/vlm_tiny.lua: the same language model, stages and captions,
-- without the images (no vision encoder; every source text_only), so its caption accuracy is what the captions
-- alone give: the digit of "a handwritten 7" is a guess (about 10%), the colour and quadrant words too (1/8, 1/4).
--
--   tide run recipes/vlm_tiny_text_only.lua
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
return assert(loadfile(dir .. "vlm_tiny.lua"))(dir .. "vlm_tiny.lua", "text_only")
