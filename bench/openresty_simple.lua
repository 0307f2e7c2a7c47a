-- The simple anchor-style OpenResty module of bench/openresty_bench.py: the
-- same file runs in nginx + lua-nginx-module
--   access_by_lua_block { ngx.var.lane = require("openresty_simple").lane() or "formal" }
-- and in graygate as the lane script (`script: bench/openresty_simple.lua`).
--
--   client in 127.0.9.0/24 (bit.band CIDR check) -> gray
--   X-Gray: 1                                    -> gray
--   crc32 bucket of X-User-Id < 10 (10%)         -> gray
--   anything else                                -> formal (nil)
local bit = require("bit")

local _M = {}

local function ip2int(ip)
    local a, b, c, d = string.match(ip, "^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
    if not a then
        return nil
    end
    return bit.bor(bit.lshift(tonumber(a), 24), bit.lshift(tonumber(b), 16),
        bit.lshift(tonumber(c), 8), tonumber(d))
end

local NET = ip2int("127.0.9.0")
local MASK = bit.tobit(0xffffff00)

function _M.lane()
    local ip = ip2int(ngx.var.remote_addr)
    if ip and bit.band(ip, MASK) == NET then
        return "gray"
    end
    if ngx.var.http_x_gray == "1" then
        return "gray"
    end
    local uid = ngx.var.http_x_user_id
    if uid and ngx.crc32_short(uid) % 100 < 10 then
        return "gray"
    end
    return nil
end

return _M
