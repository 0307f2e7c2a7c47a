-- Layer: lane. The `ngx.var` / `ngx.req` glue, run once per VM (ngx/mod.rs).
local var, vcache, rcache, fetch, store, build_headers, build_args, names, fetch_all, make_fill = ...
local rawget, rawset, setmetatable, type, next = rawget, rawset, setmetatable, type, next
local lower, gsub, find, sub, byte = string.lower, string.gsub, string.find, string.sub, string.byte
-- Empties what a request left in the caches, in Lua (mlua's `Table::clear`
-- is a protected call per table, dearer than these loops). A script that
-- mentions `ngx.` runs behind `make_entry`'s entry, which resets before
-- the script when `dirty`; any other is reset from Rust after a call whose
-- host calls filled the caches (`Current::ngx_cached`).
local dirty = false
local function reset()
  for k in next, vcache do rawset(vcache, k, nil) end
  for i = 1, 4 do rawset(rcache, i, nil) end
  dirty = false
end
local new_tab = table.new
-- The builders hand over one packed string (see `Packed` in ngx/req.rs):
-- records `name \0 = value \0` or `name \0 !` (a bare flag); a repeated
-- name becomes an array in order. A table is already built. `hint`: how
-- many names to make room for at once (the last such request's count),
-- instead of the table growing by rehashes as names are added.
local function unpack_entries(s, hint)
  if type(s) == "table" then return s end
  local t, pos, n = new_tab(0, hint or 0), 1, #s
  while pos <= n do
    local e = find(s, "\0", pos, true)
    local k, v = sub(s, pos, e - 1), true
    if byte(s, e + 1) == 33 then
      pos = e + 2
    else
      local e2 = find(s, "\0", e + 2, true)
      v, pos = sub(s, e + 2, e2 - 1), e2 + 1
    end
    local old = rawget(t, k)
    if old == nil then
      rawset(t, k, v)
    elseif type(old) == "table" then
      old[#old + 1] = v
    else
      rawset(t, k, { old, v })
    end
  end
  return t
end
-- The get_headers() / get_uri_args() table of a request whose packed
-- entries are the last such request's (the same interned string: a
-- pointer compare) is copied from that table's keys and values, kept here
-- (arrays copied too: a script's table is its own), instead of split
-- again: every substring made is an interned string (LuaJIT hashes it and
-- looks it up), and the splitting runs its `find`s. `last` is
-- cleared while the copy is rebuilt, so a rebuild stopped half-way (a
-- memory error) is never reused. The copy is a table of its own, as
-- unpacking makes one.
local function copy_array(v)
  local a = new_tab(#v, 0)
  for j = 1, #v do a[j] = v[j] end
  return a
end
local function memo_entries()
  local last, keys, vals, n = nil, {}, {}, 0
  return function(p)
    if p == last then
      local t = new_tab(0, n)
      for i = 1, n do
        local v = vals[i]
        if type(v) == "table" then v = copy_array(v) end
        t[keys[i]] = v
      end
      return t
    end
    local t = unpack_entries(p, n)
    if type(p) == "string" then
      last = nil
      local m = 0
      for k, v in next, t do
        m = m + 1
        if type(v) == "table" then v = copy_array(v) end
        keys[m], vals[m] = k, v
      end
      for i = m + 1, n do keys[i], vals[i] = nil, nil end
      n, last = m, p
    end
    return t
  end
end
local headers_entries, args_entries = memo_entries(), memo_entries()
-- The names the source mentions (`names`, a set too) are fetched together
-- on the request's first miss or first get_headers()/get_uri_args(), the
-- batch; `DONE` (a key no script can reach) marks the cache filled, so a
-- mentioned name that is nil needs no host call either. Any other name is
-- fetched alone. The batch also brings the packed get_headers() and
-- get_uri_args() entries where the source mentions those (kept in
-- rcache[3] / [4] until they are asked for). `clear` empties the lot.
local DONE, mentioned = {}, {}
for i = 1, #names do mentioned[names[i]] = true end
local fill = make_fill(DONE)
local function take(h, a, s)
  if h ~= nil then rawset(rcache, 3, h) end
  if a ~= nil then rawset(rcache, 4, a) end
  fill(vcache, s)
end
local function batch()
  dirty = true
  take(fetch_all())
end
-- The packed entries of rcache[i] (3: headers, 4: args) from the batch, if
-- it has not run yet; nil if it ran without them.
local function batched(i)
  local p = rawget(rcache, i)
  if p == nil and not rawget(vcache, DONE) then
    batch()
    p = rawget(rcache, i)
  end
  return p
end
setmetatable(vcache, { __index = function(c, k)
  dirty = true
  if mentioned[k] then
    if rawget(c, DONE) then return nil end
    batch()
    return rawget(c, k)
  end
  local v = fetch(k)
  if v ~= nil then c[k] = v end
  return v
end })
setmetatable(var, { __index = vcache, __newindex = store, __metatable = false })
-- Header tables are keyed in lower case; lookups accept any case and `_`.
-- Each table gets a metatable of its own (as OpenResty's): a script that
-- changes it changes only its own request's table.
-- `gsub` only for a name with `_` in it: a pattern call per miss costs
-- many times a plain `find`.
local function hdr_index(t, k)
  if type(k) ~= "string" then return nil end
  local n = k
  if find(k, "_", 1, true) then n = gsub(k, "_", "-") end
  n = lower(n)
  if n ~= k then return rawget(t, n) end
  return nil
end
local function get_headers(max)
  if max == nil then
    local h = rawget(rcache, 1)
    if h == nil then
      dirty = true
      local p = batched(3) or build_headers(nil)
      h = setmetatable(headers_entries(p), { __index = hdr_index })
      rawset(rcache, 1, h)
    end
    return h
  end
  return setmetatable(unpack_entries(build_headers(max)), { __index = hdr_index })
end
local function get_uri_args(max)
  if max == nil then
    local a = rawget(rcache, 2)
    if a == nil then
      dirty = true
      a = args_entries(batched(4) or build_args(nil))
      rawset(rcache, 2, a)
    end
    return a
  end
  return unpack_entries(build_args(max))
end
-- The entry of a script that mentions `ngx.`: empties what the last
-- request left — these caches and the globals it wrote (`env`, where
-- per-request global writes land) — then calls the lane function with
-- `req` (an upvalue: nothing to push per call) and checks its result here:
-- a string or nil as it is, anything else as nil and its type's name (read
-- by Rust from the stack as bytes, no reference to a Lua value). Errors
-- and positions are the script's own. A call stopped by an error or a
-- limit is cleaned up all the same, before the next one.
local function make_entry(lane, env, req)
  return function()
    if dirty then reset() end
    if next(env) ~= nil then
      for k in next, env do rawset(env, k, nil) end
    end
    local r = lane(req)
    if r == nil or type(r) == "string" then return r end
    return nil, type(r)
  end
end
return get_headers, get_uri_args, reset, make_entry
