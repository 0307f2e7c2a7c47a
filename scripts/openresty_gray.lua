-- An OpenResty-style gray policy module. It reads only ngx.* and runs
-- unchanged under OpenResty, e.g.
--   access_by_lua_block { ngx.var.gray_lane = require("openresty_gray").lane() or "formal" }
-- and under graygate as the lane script (`script: scripts/openresty_gray.lua`).
--
--   office network 127.0.9.0/24                 -> gray
--   header X-Gray: 1                            -> gray
--   URI under /api/v2/                          -> v2
--   uid (cookie uid, header X-User-Id, arg uid):
--     in the appointed list                     -> gray
--     numeric with low byte 0x2a                -> gray-b
--     crc32 bucket < 20 (20%)                   -> gray
--   session cookie sid with md5 prefix < 0x20   -> gray-a (1/8 of sessions)
--   GET with ?lane=canary                       -> gray
--   anything else                               -> formal (nil)
local bit = require("bit")

local _M = { _VERSION = "1.0" }

local APPOINTED = { ["1001"] = true, ["1002"] = true, alice = true }
local PERCENT = 20

local function uid()
    return ngx.var.cookie_uid or ngx.var.http_x_user_id or ngx.var.arg_uid
end

local function in_office(ip)
    local a, b, c = string.match(ip, "^(%d+)%.(%d+)%.(%d+)%.%d+$")
    return a == "127" and b == "0" and c == "9"
end

function _M.lane()
    if in_office(ngx.var.remote_addr) then
        return "gray"
    end
    local headers = ngx.req.get_headers()
    if headers["X-Gray"] == "1" then
        return "gray"
    end
    if string.find(ngx.var.uri, "^/api/v2/") then
        return "v2"
    end
    local u = uid()
    if u then
        if APPOINTED[u] then
            return "gray"
        end
        local n = tonumber(u)
        if n and bit.band(n, 0xff) == 0x2a then
            return "gray-b"
        end
        if ngx.crc32_short(u) % 100 < PERCENT then
            ngx.log(ngx.INFO, "uid ", u, " in the ", PERCENT, "% gray bucket")
            return "gray"
        end
    end
    local sid = ngx.var.cookie_sid
    if sid and tonumber(string.sub(ngx.md5(sid), 1, 2), 16) < 0x20 then
        return "gray-a"
    end
    local args = ngx.req.get_uri_args()
    if args.lane == "canary" and ngx.req.get_method() == "GET" then
        return "gray"
    end
    return nil
end

return _M
