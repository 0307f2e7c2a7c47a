-- wrk: a different X-User-Id on every request.
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, { ["X-User-Id"] = tostring(n) })
end
