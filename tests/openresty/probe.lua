-- Evaluates the ngx.* / bit subset on the current request and returns the
-- results as strings, so the same request can be compared between OpenResty
-- and graygate value by value.
local bit = require("bit")

local _M = {}

local function s(v)
    if type(v) == "table" then
        local parts = {}
        for i = 1, #v do
            parts[i] = tostring(v[i])
        end
        return "{" .. table.concat(parts, ",") .. "}"
    end
    return tostring(v)
end

function _M.probe()
    local h = ngx.req.get_headers()
    local a = ngx.req.get_uri_args()
    return {
        "remote_addr=" .. s(ngx.var.remote_addr),
        "uri=" .. s(ngx.var.uri),
        "request_uri=" .. s(ngx.var.request_uri),
        "args=" .. s(ngx.var.args),
        "host=" .. s(ngx.var.host),
        "request_method=" .. s(ngx.var.request_method),
        "scheme=" .. s(ngx.var.scheme),
        "http_x_user_id=" .. s(ngx.var.http_x_user_id),
        "http_accept=" .. s(ngx.var.http_accept),
        "cookie_uid=" .. s(ngx.var.cookie_uid),
        "cookie_sid=" .. s(ngx.var.cookie_sid),
        "arg_uid=" .. s(ngx.var.arg_uid),
        "arg_name=" .. s(ngx.var.arg_name),
        "arg_missing=" .. s(ngx.var.arg_missing),
        "h[X-User-Id]=" .. s(h["X-User-Id"]),
        "h.x_user_id=" .. s(h.x_user_id),
        "h.accept=" .. s(h.accept),
        "a.uid=" .. s(a.uid),
        "a.name=" .. s(a.name),
        "a.k=" .. s(a.k),
        "a.flag=" .. s(a.flag),
        "a.sp=" .. s(a.sp),
        "method=" .. s(ngx.req.get_method()),
        "crc_uri=" .. s(ngx.crc32_short(ngx.var.uri)),
        "crc_long=" .. s(ngx.crc32_long(ngx.var.request_uri)),
        "crc_mod=" .. s(ngx.crc32_short("abc") % 100),
        "md5=" .. s(ngx.md5(ngx.var.request_uri)),
        "band=" .. s(bit.band(0x12345678, 0xff)),
        "bor=" .. s(bit.bor(1, 2, 4)),
        "bxor=" .. s(bit.bxor(0xa5a5f0f0, 0xaa55ff00)),
        "lshift=" .. s(bit.lshift(1, 31)),
        "lshift40=" .. s(bit.lshift(1, 40)),
        "rshift=" .. s(bit.rshift(-1, 28)),
        "arshift=" .. s(bit.arshift(-256, 4)),
        "tobit=" .. s(bit.tobit(0xffffffff)),
        "tobit2=" .. s(bit.tobit(2 ^ 32 + 5)),
        "bnot=" .. s(bit.bnot(5)),
        "tohex=" .. s(bit.tohex(0x87654321, -4)),
        "tohex2=" .. s(bit.tohex(255)),
        "bswap=" .. s(bit.bswap(0x12345678)),
        "rol=" .. s(bit.rol(0x12345678, 12)),
    }
end

return _M
