-- HAProxy (Lua 5.3+) fetch with the same decision as graygate's gray.lua.
local M32 = 0xffffffff
local function mul32(a, b) return (a * b) & M32 end
local function rol(x, r) return ((x << r) | (x >> (32 - r))) & M32 end
local function murmur3(s)
  local h, len = 0, #s
  local nblocks = len - len % 4
  for i = 1, nblocks, 4 do
    local b0, b1, b2, b3 = string.byte(s, i, i + 3)
    local k = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    k = mul32(rol(mul32(k, 0xcc9e2d51), 15), 0x1b873593)
    h = rol(h ~ k, 13)
    h = (mul32(h, 5) + 0xe6546b64) & M32
  end
  local rem = len - nblocks
  if rem > 0 then
    local k = 0
    if rem >= 3 then k = k ~ (string.byte(s, nblocks + 3) << 16) end
    if rem >= 2 then k = k ~ (string.byte(s, nblocks + 2) << 8) end
    k = k ~ string.byte(s, nblocks + 1)
    k = mul32(rol(mul32(k, 0xcc9e2d51), 15), 0x1b873593)
    h = h ~ k
  end
  h = h ~ len
  h = h ~ (h >> 16)
  h = mul32(h, 0x85ebca6b)
  h = h ~ (h >> 13)
  h = mul32(h, 0xc2b2ae35)
  h = h ~ (h >> 16)
  if h >= 0x80000000 then h = h - 0x100000000 end
  return h
end

core.register_fetches("gray_lane", function(txn)
  local ip = txn.f:src()
  if ip:sub(1, 8) == "127.0.9." then return "gray" end
  local hdr = txn.http:req_get_headers()
  local g = hdr["x-gray"]
  if g and g[0] == "1" then return "gray" end
  local uid = hdr["x-user-id"]
  if uid and (murmur3(uid[0]) % 100) < 10 then return "gray" end
  return "formal"
end)
