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

local function hex(b)
    return (string.gsub(b, ".", function(c)
        return string.format("%02x", string.byte(c))
    end))
end

local function count(t)
    local n = 0
    for _ in pairs(t) do
        n = n + 1
    end
    return n
end

-- The keys of a table, sorted.
local function keys(t)
    local k = {}
    for name in pairs(t) do
        k[#k + 1] = tostring(name)
    end
    table.sort(k)
    return "{" .. table.concat(k, ",") .. "}"
end

-- The values of an array, sorted.
local function sorted(t)
    local v = {}
    for i = 1, #t do
        v[i] = tostring(t[i])
    end
    table.sort(v)
    return "{" .. table.concat(v, ",") .. "}"
end

-- A fixed sequence of ngx.shared operations (the dictionary is emptied
-- first, so every request sees the same results).
local function shared()
    local d = ngx.shared.probe
    local out = {}
    local function put(...)
        local parts = {}
        for i = 1, select("#", ...) do
            parts[i] = tostring((select(i, ...)))
        end
        out[#out + 1] = table.concat(parts, ",")
    end
    d:flush_all()
    put(#d:get_keys(0))
    put(d:set("a", 1))
    put(d:get("a"))
    put(d:add("a", 2))
    put(d:add("b", "two"))
    put(d:replace("a", 40))
    put(d:replace("zz", 1))
    local v, err = d:incr("a", 2)
    put(v, err)
    v, err = d:incr("nx", 1)
    put(v, err)
    v, err = d:incr("ny", 1, 10)
    put(v, err)
    v, err = d:incr("b", 1)
    put(v, err)
    v, err = d:incr("nz", 1, 0, 100)
    put(v, err)
    put(d:get("nz"))
    put(d:set("f", 1.5))
    put(d:get("f"))
    put(d:set("t", true))
    put(d:get("t"))
    put(d:set("e", "later", 100))
    put(d:get("e"))
    put(d:get("missing"))
    put(sorted(d:get_keys(0)))
    put(#d:get_keys(2))
    d:delete("t")
    put(d:get("t"))
    put(d:set("n", nil))
    put(d:get("n"))
    -- (ok and err only: nginx reports forcible = true here, having evicted
    -- the other items on the way, graygate false.)
    local ok
    ok, err = d:set("big", string.rep("x", 2 * 1024 * 1024))
    put(ok, err)
    put(d:get("big"))
    d:flush_all()
    put(d:get("a"), #d:get_keys(0))
    return table.concat(out, ";")
end

-- One line at every level (the test compares where each lands).
local LEVELS = { "STDERR", "EMERG", "ALERT", "CRIT", "ERR", "WARN", "NOTICE", "INFO" }
local function log_levels()
    for _, name in ipairs(LEVELS) do
        ngx.log(ngx[name], "probe level ", name)
    end
    return #LEVELS
end

function _M.probe()
    -- Before anything reads the headers: the change must be visible below.
    ngx.req.set_header("X-Probe-Set", "set-by-probe")
    ngx.req.clear_header("X-Probe-Clear")
    ngx.req.set_header("X-Probe-Num", 5)
    ngx.req.set_header("X-Probe-Nil", nil)
    local h = ngx.req.get_headers()
    local a = ngx.req.get_uri_args()
    local now, t = ngx.now(), ngx.time()
    local wrote = pcall(function()
        ngx.var.probe_undefined = "x"
    end)
    -- CR/LF in a header is percent-encoded, not an error.
    local crlf_ok = pcall(ngx.req.set_header, "X-Probe-Crlf", "a\r\nb")
    -- A value larger than the dictionary: "no memory", forcible.
    local big_ok, big_err, big_forcible =
        ngx.shared.probe:set("probe-big", string.rep("x", 2 * 1024 * 1024))
    return {
        "is_args=" .. s(ngx.var.is_args),
        "server_protocol=" .. s(ngx.var.server_protocol),
        "query_string=" .. s(ngx.var.query_string),
        "set_header=" .. s(ngx.var.http_x_probe_set) .. "," .. s(h["x-probe-set"]),
        "clear_header=" .. s(ngx.var.http_x_probe_clear) .. "," .. s(h["x-probe-clear"]),
        "set_number=" .. s(ngx.var.http_x_probe_num),
        "set_nil=" .. s(ngx.var.http_x_probe_nil) .. "," .. s(h["x-probe-nil"]),
        "other_var=" .. s(ngx.var.probe_no_such_variable),
        "h.keys=" .. keys(h),
        "h.max1=" .. keys(ngx.req.get_headers(1)),
        "h.max2=" .. s(count(ngx.req.get_headers(2))),
        "a.max1=" .. keys(ngx.req.get_uri_args(1)),
        "a.max2=" .. s(count(ngx.req.get_uri_args(2))),
        "md5_bin=" .. hex(ngx.md5_bin(ngx.var.request_uri)) .. "," .. s(#ngx.md5_bin("")),
        "md5_bin_is_md5=" .. s(hex(ngx.md5_bin("abc")) == ngx.md5("abc")),
        "time=" .. s(type(t)) .. "," .. s(t == math.floor(t)) .. "," .. s(math.abs(t - os.time()) <= 1),
        "now=" .. s(type(now)) .. "," .. s(math.abs(now - t) <= 1)
            .. "," .. s(math.abs(now * 1000 - math.floor(now * 1000 + 0.5)) < 0.01),
        "update_time=" .. s(select("#", ngx.update_time())),
        "log=" .. s(select("#", ngx.log(ngx.ERR, "probe log ", 42, " ", nil, " ", true))),
        "log_levels=" .. s(log_levels()),
        "levels=" .. table.concat({ ngx.STDERR, ngx.EMERG, ngx.ALERT, ngx.CRIT, ngx.ERR,
            ngx.WARN, ngx.NOTICE, ngx.INFO, ngx.DEBUG }, ","),
        "var_write=" .. s(wrote),
        "crlf=" .. s(crlf_ok) .. "," .. s(ngx.var.http_x_probe_crlf),
        "nomem=" .. s(big_ok) .. "," .. s(big_err) .. "," .. s(big_forcible),
        "shared=" .. shared(),
        "ror=" .. s(bit.ror(0x12345678, 12)),
        "ror0=" .. s(bit.ror(1, 1)),
        "rol40=" .. s(bit.rol(0x12345678, 40)),
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
        -- Numbers are LuaJIT's doubles: what Lua 5.4 prints or refuses
        -- differently ("5.0", "2.147483648e+09", %d of 2.7 an error).
        "num_div=" .. s(10 / 2) .. "," .. s(7 / 7) .. "," .. s(-0.0),
        "num_pow=" .. s(2 ^ 31) .. "," .. s(2 ^ 53) .. "," .. s(2 ^ 63),
        "num_frac=" .. s(1 / 3) .. "," .. s(10 / 4) .. "," .. s(1e15) .. "," .. s(1e16),
        "num_concat=" .. (6 / 2) .. "," .. 123456789012 .. "," .. math.floor(7 / 2),
        "num_mod=" .. s(7 % 3) .. "," .. s(-7 % 3) .. "," .. s(7.5 % 2) .. "," .. s(math.max(1, 2.0)),
        "fmt=" .. string.format("%d|%5.1f|%x|%s|%i|%g", 2.7, 5, 255, 10 / 4, -3.9, 2 ^ 31),
        "tonumber=" .. s(tonumber("0x10")) .. "," .. s(tonumber("1e2")) .. "," .. s(tonumber("10", 16))
            .. "," .. s(tonumber(" 5 ")) .. "," .. s(tonumber("5.")),
        "bit_num=" .. s(bit.band("0xff", 15)) .. "," .. s(bit.tobit(2.5)) .. "," .. s(bit.tobit(-2.5))
            .. "," .. s(bit.band(2 ^ 40 + 7, 0xff)) .. "," .. s(bit.tobit(2 ^ 31)),
        "bit_hex=" .. bit.tohex(-1) .. "," .. bit.tohex(0x1234, 2) .. "," .. bit.tohex(1, -8)
            .. "," .. s(bit.bswap(-1)) .. "," .. s(bit.arshift(0x80000000, 31)),
        "num_log=" .. s(select("#", ngx.log(ngx.ERR, "probe num ", 1 / 3, " ", 10 / 2, " ", 2 ^ 31, " ", -0.0))),
    }
end

return _M
