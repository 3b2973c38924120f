-- permit_release: give back one permit only if ARGV[1] still holds it, and wake a waiter.
-- KEYS[1]  permits of the semaphore (see permit_acquire.lua)
-- KEYS[2]  notify list of this name (waiters BLPOP it)
-- KEYS[3]  waiter mark (optional; see acquire.lua): without it nobody can be waiting,
--          so no notice is pushed. Without KEYS[3], a notice always is.
-- ARGV[1]  token of the permit being released
-- ARGV[2]  how long an unconsumed wake-up notice lives, in milliseconds
-- ARGV[3]  the limit: the most notices kept in the list (one per free permit; at most
--          a million)
-- Returns  1   released (and a notice pushed if someone may be waiting)
--          0   no such permit: it expired (a lingering expired one is removed) or was
--              removed
--          -2  the key holds something that is not a permit hash (foreign data under
--              our prefix): nothing touched
local v = redis.pcall('HGET', KEYS[1], ARGV[1])
if type(v) == 'table' and v.err then
  return -2
end
if not v then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = tonumber(string.match(v, '^(%d+)|') or '0')
local code = 1
if exp <= now then
  code = 0
end
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
end
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 0 then
  return code
end
-- One notice per permit given back, up to the limit: several permits freed at once wake
-- as many waiters (a mutex keeps one notice; here each can win).
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], -math.min(tonumber(ARGV[3]), 1000000), -1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return code
