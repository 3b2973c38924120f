-- release: delete the lock only if ARGV[1] still owns it, wake one waiter, and remember
-- ARGV[1] as released, so that a re-sent copy of this release (a lost reply) is told
-- apart from a lock that expired, was removed, or was taken by another token.
-- KEYS[1]  lock key
-- KEYS[2]  notify list of this lock (waiters BLPOP it)
-- KEYS[3]  waiter mark (see acquire.lua): set while someone may be waiting; without
--          it no notice is pushed
-- KEYS[4]  released tokens of this name (a sorted set, token -> server time in ms until
--          which it is remembered); entries past their time are dropped as it is written
-- KEYS[5]  done marks of this lock (optional; a sorted set): ARGV[3] is added when the
--          release succeeds, so a redelivered copy of the message that just finished
--          knows it ran; the 16 most recent are kept
-- ARGV[1]  token of the acquisition being released
-- ARGV[2]  how long an unconsumed wake-up notice lives, and how long ARGV[1] is
--          remembered as released, in milliseconds (the lease length)
-- ARGV[3]  with KEYS[5]: the done mark (the run's task id and attempt)
-- ARGV[4]  with KEYS[5]: how long the marks live after the last one, in milliseconds
-- Returns  1   released (and one notice pushed if someone may be waiting); also when
--              the key is gone or held by another token but ARGV[1] is remembered in
--              KEYS[4]: a re-sent copy of this token's own release
--          0   no such lock (expired or removed by someone else)
--          -1  held by another token: nothing touched
--          -2  the key holds something that is not a lock hash (foreign data under
--              our prefix): nothing touched
local tok = redis.pcall('HGET', KEYS[1], 'token')
if type(tok) == 'table' and tok.err then
  return -2
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tok ~= ARGV[1] then
  local until_ms = redis.pcall('ZSCORE', KEYS[4], ARGV[1])
  if type(until_ms) == 'string' and tonumber(until_ms) > now then
    return 1
  end
  if not tok then
    return 0
  end
  return -1
end
redis.call('DEL', KEYS[1])
-- The record of the release never stops the release: foreign data at KEYS[4] only
-- costs a re-sent copy its recognition (pcall), and is never given an expiry.
local ms = tonumber(ARGV[2])
if type(redis.pcall('ZADD', KEYS[4], now + ms, ARGV[1])) == 'number' then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('PTTL', KEYS[4]) < ms then
    redis.call('PEXPIRE', KEYS[4], ms)
  end
end
if KEYS[5] then
  redis.call('ZADD', KEYS[5], tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[3])
  redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -17)
  redis.call('PEXPIRE', KEYS[5], ARGV[4])
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return 1
end
-- At most one notice in the list: a release wakes one waiter, the one that can win.
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
