-- release: delete the lock only if ARGV[1] still owns it, wake one waiter, and remember
-- ARGV[1] as released, so that a re-sent copy of this release (a lost reply) is told
-- apart from a lock that expired, was removed, or was taken by another token.
-- KEYS[1]  lock key
-- KEYS[2]  notify list of this lock (waiters BLPOP it)
-- KEYS[3]  waiter mark (see acquire.lua): set while someone may be waiting; without
--          it no notice is pushed
-- KEYS[4]  the recently released tokens of this name: a string ' t1 t2 ... ', newest
--          first, at most ARGV[3] bytes (the oldest dropped), living ARGV[2] ms after
--          the last release
-- KEYS[5]  done marks of this lock (optional; a sorted set): ARGV[4] is added when the
--          release succeeds, so a redelivered copy of the message that just finished
--          knows it ran; the 16 most recent are kept
-- ARGV[1]  token of the acquisition being released
-- ARGV[2]  how long an unconsumed wake-up notice lives, and how long the released
--          tokens are remembered after the last release, in milliseconds (the lease)
-- ARGV[3]  the most bytes of released tokens kept (a cap per name, whatever the rate)
-- ARGV[4]  with KEYS[5]: the done mark (the run's task id and attempt)
-- ARGV[5]  with KEYS[5]: how long the marks live after the last one, in milliseconds
-- Index    the lock key leaves it when released (index.lua)
-- Returns  1   released (and one notice pushed if someone may be waiting); also when
--              the key is gone or held by another token but ARGV[1] is among the
--              recently released tokens: a re-sent copy of this token's own release
--          0   no such lock (expired or removed by someone else)
--          -1  held by another token: nothing touched
--          -2  the key holds something that is not a lock hash (foreign data under
--              our prefix): nothing touched
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'info')
if cur.err then
  return -2
end
local tok = cur[1]
-- Foreign data at KEYS[4] never stops a release: it only costs a re-sent copy its
-- recognition (pcall), and is left as it is.
local recent = redis.pcall('GET', KEYS[4])
if type(recent) ~= 'string' then
  recent = recent == false and ' ' or nil
end
if tok ~= ARGV[1] then
  if recent and string.find(recent, ' ' .. ARGV[1] .. ' ', 1, true) then
    return 1
  end
  if not tok then
    return 0
  end
  return -1
end
redis.call('DEL', KEYS[1])
index_gone(KEYS[1], cur[2] or '')
if recent then
  recent = ' ' .. ARGV[1] .. recent
  if #recent > tonumber(ARGV[3]) then -- drop the oldest, whole tokens only
    recent = string.match(string.sub(recent, 1, tonumber(ARGV[3])), '^(.* )')
  end
  redis.call('SET', KEYS[4], recent, 'PX', ARGV[2])
end
if KEYS[5] then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[5], tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[4])
  redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -17)
  redis.call('PEXPIRE', KEYS[5], ARGV[5])
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return 1
end
-- At most one notice in the list: a release wakes one waiter, the one that can win.
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
