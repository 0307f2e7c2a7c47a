-- Exercises every req member and helper, including hostile returns.
return function(req)
  local l = req:header('X-Lane')
  if l then return l end
  local c = req:cookie('lane')
  if c then return c end
  local a = req:arg('lane')
  if a then return a end
  if graygate.in_list('gray_ips', req.ip) then return 'gray' end
  if req.path:sub(1, 4) == '/v2/' then return 'v2' end
  local uid = req:header('X-User-Id')
  if uid and graygate.bucket(uid) < 10 then return 'gray' end
  return nil
end
