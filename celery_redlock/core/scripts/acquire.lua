-- acquire: take the lock if free, or confirm we already hold it.
-- KEYS[1]  lock key (a hash: token, fence, info)
-- KEYS[2]  fence counter of this lock (same hash tag, never expires)
-- ARGV[1]  token of this acquisition (>= 128 random bits)
-- ARGV[2]  lease in milliseconds (integer)
-- ARGV[3]  holder record (JSON text), shown by `celery locks`
-- Returns  {1, fence}          acquired; also when the key already holds ARGV[1]
--                              (a re-sent acquire finds its own token: same fence,
--                              lease reset)
--          {0, holder, pttl}   held by another token: its record and ms left
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'info')
if cur[1] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(cur[2])}
end
if cur[1] then
  return {0, cur[3] or '', redis.call('PTTL', KEYS[1])}
end
local fence = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, 'info', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence}
