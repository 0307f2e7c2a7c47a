-- The heavy ABTestingGateway-style chain of bench/openresty_bench.py: every
-- policy runs on every request (no early exit), then the first that matched
-- decides. The same file runs in nginx + lua-nginx-module
--   access_by_lua_block { ngx.var.lane = require("openresty_heavy").lane() or "formal" }
-- and in graygate as the lane script (`script: bench/openresty_heavy.lua`).
--
--   iprange   client address in one of the ranges (bit ops)      -> gray
--   header    X-Gray: 1 (ngx.req.get_headers())                  -> gray
--   arg       ?lane=canary (ngx.req.get_uri_args())              -> gray
--   cookie    ver=v2                                             -> gray
--   uid (cookie uid, else header X-User-Id, else arg uid):
--     uidappoint  in the set                                     -> gray
--     uidrange    in one of the ranges                           -> gray
--     uidsuffix   last digit 7                                   -> gray
--     percentage  crc32 bucket < 5 (5%)                          -> gray
--   anything else                                                -> formal (nil)
local bit = require("bit")

local _M = {}

local function ip2int(ip)
    local a, b, c, d = string.match(ip, "^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
    if not a then
        return nil
    end
    local n = bit.bor(bit.lshift(tonumber(a), 24), bit.lshift(tonumber(b), 16),
        bit.lshift(tonumber(c), 8), tonumber(d))
    if n < 0 then
        n = n + 4294967296
    end
    return n
end

local IP_RANGES = {}
for _, r in ipairs({
    { "10.10.0.0", "10.10.255.255" },
    { "127.0.9.0", "127.0.9.255" },
    { "172.16.5.0", "172.16.5.127" },
    { "192.168.100.0", "192.168.100.255" },
    { "203.0.113.0", "203.0.113.63" },
}) do
    IP_RANGES[#IP_RANGES + 1] = { ip2int(r[1]), ip2int(r[2]) }
end

local UID_SET = {}
for _, u in ipairs({ 1001, 1002, 1003, 2024, 4242, 31337, 65535, 90001 }) do
    UID_SET[u] = true
end
local UID_RANGES = { { 5000, 5999 }, { 70000, 70999 }, { 123400, 123499 } }
local UID_SUFFIX = 7
local PERCENT = 5

local function iprange(ip)
    local n = ip and ip2int(ip)
    if not n then
        return nil
    end
    for i = 1, #IP_RANGES do
        local r = IP_RANGES[i]
        if n >= r[1] and n <= r[2] then
            return "gray"
        end
    end
    return nil
end

local function uid_policies(uid)
    if not uid then
        return nil
    end
    local n = tonumber(uid)
    local lane
    if n then
        if UID_SET[n] then
            lane = "gray"
        end
        for i = 1, #UID_RANGES do
            local r = UID_RANGES[i]
            if not lane and n >= r[1] and n <= r[2] then
                lane = "gray"
            end
        end
        if not lane and n % 10 == UID_SUFFIX then
            lane = "gray"
        end
    end
    if ngx.crc32_short(uid) % 100 < PERCENT then
        lane = lane or "gray"
    end
    return lane
end

function _M.lane()
    local headers = ngx.req.get_headers()
    local args = ngx.req.get_uri_args()
    local by_ip = iprange(ngx.var.remote_addr)
    local by_header = headers["x-gray"] == "1" and "gray" or nil
    local by_arg = args.lane == "canary" and "gray" or nil
    local by_cookie = ngx.var.cookie_ver == "v2" and "gray" or nil
    local uid = ngx.var.cookie_uid or headers["x-user-id"] or args.uid
    local by_uid = uid_policies(uid)
    return by_ip or by_header or by_arg or by_cookie or by_uid
end

return _M
