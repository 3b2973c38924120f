-- force_release: an operator removes a lock whoever holds it (`celery locks release`),
-- and one waiter is woken as by a normal release.
-- KEYS[1]  lock key (a hash: token, fence, info)
-- KEYS[2]  notify list of this lock (waiters BLPOP it)
-- ARGV[1]  how long an unconsumed wake-up notice lives, in milliseconds
-- ARGV[2]  fence the operator confirmed ('' = whoever holds it now)
-- Index    the lock key leaves it (index.lua)
-- Returns  {1, info, fence}   removed; info is the holder record (JSON text)
--          {0}                no such lock (expired or already released)
--          {-1, info, fence}  held by another acquisition than ARGV[2]: nothing touched
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'info')
if not cur[1] then
  return {0}
end
local fence = cur[2] or ''
if ARGV[2] ~= '' and fence ~= ARGV[2] then
  return {-1, cur[3] or '', fence}
end
redis.call('DEL', KEYS[1])
index_drop(KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return {1, cur[3] or '', fence}
