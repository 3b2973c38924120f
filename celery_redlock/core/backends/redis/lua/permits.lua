-- permits: the live permits of a semaphore (reads only).
-- KEYS[1]  permits of the semaphore (see permit_acquire.lua)
-- Returns  {token, ms left, fence, holder record, ...}: four entries per live permit;
--          expired permits are left out
local all = redis.call('HGETALL', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #all, 2 do
  local exp, fence, rest = string.match(all[i + 1], '^(%d+)|(%d*)|(.*)$')
  exp = tonumber(exp or '0')
  if exp > now then
    out[#out + 1] = all[i]
    out[#out + 1] = exp - now
    out[#out + 1] = fence
    out[#out + 1] = rest
  end
end
return out
