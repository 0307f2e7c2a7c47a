-- Decides the lane of each request: return a lane name, or nil for formal.
--   client IP in the `gray_ips` list  -> gray
--   header X-Gray: 1                  -> gray
--   10% of X-User-Id values           -> gray (stable MurmurHash3 bucket)
return function(req)
  if req:in_list("gray_ips") then
    return "gray"
  end
  if req:header("X-Gray") == "1" then
    return "gray"
  end
  local uid = req:header("X-User-Id")
  if uid and graygate.bucket(uid) < 10 then
    return "gray"
  end
  return nil
end
