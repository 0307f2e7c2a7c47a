-- Layer: lane. `make_fill(DONE)` of the ngx glue (ngx/batch.rs fills in
-- one statement per mentioned name at the `--$PACKED` and `--$EACH` lines).
local DONE = ...
local byte, sub, type = string.byte, string.sub, type
return function(c, s)
if type(s) == "string" then
local p, n = 1
--$PACKED
else
--$EACH
end
c[DONE] = true
end
