-- MurmurHash3 x86 32-bit (seed 0) for LuaJIT / OpenResty, with exact 32-bit
-- multiplication on doubles. bucket(s) = floorMod(hash as int32, 100).
local bit = require "bit"
local band, bor, bxor, lshift, rshift, rol, tobit =
  bit.band, bit.bor, bit.bxor, bit.lshift, bit.rshift, bit.rol, bit.tobit
local byte = string.byte

local function mul32(a, b)
  local al, ah = band(a, 0xffff), rshift(a, 16)
  return tobit(al * b + tobit(ah * b) * 65536)
end

local C1, C2 = tobit(0xcc9e2d51), tobit(0x1b873593)

local function murmur3(s)
  local h, len = 0, #s
  local nblocks = len - len % 4
  for i = 1, nblocks, 4 do
    local b0, b1, b2, b3 = byte(s, i, i + 3)
    local k = bor(b0, lshift(b1, 8), lshift(b2, 16), lshift(b3, 24))
    k = mul32(rol(mul32(k, C1), 15), C2)
    h = rol(bxor(h, k), 13)
    h = tobit(mul32(h, 5) + 0xe6546b64)
  end
  local rem = len - nblocks
  if rem > 0 then
    local k = 0
    if rem >= 3 then k = bxor(k, lshift(byte(s, nblocks + 3), 16)) end
    if rem >= 2 then k = bxor(k, lshift(byte(s, nblocks + 2), 8)) end
    k = bxor(k, byte(s, nblocks + 1))
    k = mul32(rol(mul32(k, C1), 15), C2)
    h = bxor(h, k)
  end
  h = bxor(h, len)
  h = bxor(h, rshift(h, 16))
  h = mul32(h, tobit(0x85ebca6b))
  h = bxor(h, rshift(h, 13))
  h = mul32(h, tobit(0xc2b2ae35))
  h = bxor(h, rshift(h, 16))
  return h
end

return { murmur3 = murmur3, bucket = function(s) return murmur3(s) % 100 end }
