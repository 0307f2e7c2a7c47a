-- Layer: lane. `ngx.crc32_short` / `crc32_long` in Lua, for LuaJIT's
-- compiler (ngx/digest.rs): `$MAX` and the `--$STEPS` line are filled in
-- there, one step per byte.
local host, bit = ...
local band, bxor, rshift, bnot = bit.band, bit.bxor, bit.rshift, bit.bnot
local byte, type = string.byte, type
local T = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if band(c, 1) == 1 then c = bxor(rshift(c, 1), 0xEDB88320) else c = rshift(c, 1) end
  end
  T[i] = c
end
return function(s)
  if type(s) ~= "string" or #s > $MAX then return host(s) end
  local c, b = -1
--$STEPS
  ::done::
  c = bnot(c)
  if c < 0 then c = c + 4294967296 end
  return c
end
