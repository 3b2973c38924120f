-- fence_floor: a shared part, put in front of the scripts that list it (scripts.py).
-- fence_floor(key, fence, floor, t)  the fence to hand out: *fence* as it is without a
--          *floor* (ARGV.fence_floor, set by master_guard.lua on a Sentinel-managed
--          master only); else at least *floor* + the server's clock in microseconds
--          (*t*: TIME's reply, read here when nil), with the counter at *key* raised to it
local function fence_floor(key, fence, floor, t)
  if not floor then
    return fence
  end
  t = t or redis.call('TIME')
  local least = floor + tonumber(t[1]) * 1000000 + tonumber(t[2])
  if fence < least then
    redis.call('SET', key, string.format('%d', least))
    return least
  end
  return fence
end
