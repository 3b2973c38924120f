-- release: delete the lock only if ARGV[1] still owns it, and wake one waiter.
-- KEYS[1]  lock key
-- KEYS[2]  notify list of this lock (waiters BLPOP it)
-- KEYS[3]  waiter mark (optional; see acquire.lua): without it nobody can be
--          waiting, so no notice is pushed. Without KEYS[3], a notice always is.
-- KEYS[4]  done marks of this lock (optional; a sorted set): ARGV[3] is added when the
--          release succeeds, so a redelivered copy of the message that just finished
--          knows it ran; the 16 most recent are kept
-- ARGV[1]  token of the acquisition being released
-- ARGV[2]  how long an unconsumed wake-up notice lives, in milliseconds
-- ARGV[3]  with KEYS[4]: the done mark (the run's task id and attempt)
-- ARGV[4]  with KEYS[4]: how long the marks live after the last one, in milliseconds
-- Returns  1   released (and one notice pushed if someone may be waiting)
--          0   no such lock (expired or removed)
--          -1  held by another token: nothing touched
--          -2  the key holds something that is not a lock hash (foreign data under
--              our prefix): nothing touched
local tok = redis.pcall('HGET', KEYS[1], 'token')
if type(tok) == 'table' and tok.err then
  return -2
end
if not tok then
  return 0
end
if tok ~= ARGV[1] then
  return -1
end
redis.call('DEL', KEYS[1])
if KEYS[4] then
  local now = redis.call('TIME')
  redis.call('ZADD', KEYS[4], tonumber(now[1]) * 1000000 + tonumber(now[2]), ARGV[3])
  redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -17)
  redis.call('PEXPIRE', KEYS[4], ARGV[4])
end
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 0 then
  return 1
end
-- At most one notice in the list: a release wakes one waiter, the one that can win.
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
