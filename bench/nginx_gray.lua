-- access_by_lua decision for the nginx+lua anchor: the same decision as
-- graygate's scripts/gray.lua.
local mm = require "murmur3_luajit"
local addr = ngx.var.remote_addr
local lane = "formal"
if addr:sub(1, 8) == "127.0.9." then
  lane = "gray"
elseif ngx.var.http_x_gray == "1" then
  lane = "gray"
else
  local uid = ngx.var.http_x_user_id
  if uid and mm.bucket(uid) < 10 then lane = "gray" end
end
ngx.var.lane = lane
