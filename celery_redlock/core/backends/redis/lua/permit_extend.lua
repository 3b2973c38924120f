-- permit_extend: lengthen one permit only if ARGV[1] still holds it; never revives an
-- expired permit.
-- KEYS[1]  permits of the semaphore (see permit_acquire.lua)
-- ARGV[1]  token
-- ARGV[2]  milliseconds (integer)
-- ARGV[3]  '1': set the lease to ARGV[2]; '0': add ARGV[2] to what is left
-- Index    the permits' key's expiry moves with its longest permit (index.lua)
-- Returns  the new lease in ms (> 0) when extended
--          0   no such permit (expired or removed): lost; a lingering expired one is removed
--          -2  the key holds something that is not a permit hash (foreign data): lost
local v = redis.pcall('HGET', KEYS[1], ARGV[1])
if type(v) == 'table' and v.err then
  return -2
end
if not v then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp, rest = string.match(v, '^(%d+)(|.*)$')
exp = tonumber(exp or '0')
if exp <= now then
  redis.call('HDEL', KEYS[1], ARGV[1])
  index_sync(KEYS[1], 'permits')
  return 0
end
local ms = tonumber(ARGV[2])
if ARGV[3] ~= '1' then
  ms = ms + (exp - now)
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', now + ms) .. rest)
if redis.call('PTTL', KEYS[1]) < ms then
  redis.call('PEXPIRE', KEYS[1], ms)
  index_renew(KEYS[1], ms)
end
return ms
