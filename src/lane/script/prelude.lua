-- Layer: lane. Wraps pcall & co. so no script swallows the budget error.
local raw_pcall, raw_xpcall, raw_resume, killed, error = ...
local function check(...)
  if killed() then error("instruction budget exceeded", 0) end
  return ...
end
pcall = function(...) return check(raw_pcall(...)) end
xpcall = function(...) return check(raw_xpcall(...)) end
coroutine.resume = function(...) return check(raw_resume(...)) end
