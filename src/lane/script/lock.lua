-- Layer: lane. Makes the shared library tables read-only (script/sandbox.rs).
local G, names, req = ...
local error, setmetatable, tostring = error, setmetatable, tostring
local raw_rawset, raw_insert = rawset, table.insert
local locked = setmetatable({}, { __mode = "k" })
local function refuse(t, k)
  if locked[t] then
    error(locked[t] .. " is read-only (assigning " .. tostring(k) .. ")", 3)
  end
end
G.rawset = function(t, k, v)
  refuse(t, k)
  return raw_rawset(t, k, v)
end
table.insert = function(t, ...)
  refuse(t, "an element")
  return raw_insert(t, ...)
end
for _, name in ipairs(names) do
  local parent, key = G, name
  local dot = name:find(".", 1, true)
  if dot then parent, key = G[name:sub(1, dot - 1)], name:sub(dot + 1) end
  local lib = parent[key]
  local proxy = setmetatable({}, {
    __index = lib,
    __newindex = function(_, k)
      error(name .. " is read-only (assigning " .. tostring(k) .. ")", 2)
    end,
    __metatable = false,
  })
  locked[proxy] = name
  raw_rawset(parent, key, proxy)
end
getmetatable("").__metatable = false
-- `ngx.var` stays an empty table whose writes go to `__newindex`: a raw
-- field would outlive the request.
locked[G.ngx.var] = "ngx.var"
-- `req` is one table per VM: a raw field would reach the next request.
locked[req] = "req"
