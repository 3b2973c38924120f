-- park: the run holding a lock is gone (its process was killed) and its message comes
-- back (requeued): its acquisition becomes a hold of its task id, kept for the message's
-- redelivered copy, which takes it over (acquire.lua with a hand-over of that task id).
-- Meanwhile the name stays taken by that task id: a new call is a duplicate of it, or
-- is queued behind it, as while it ran.
-- KEYS[1]  lock key
-- KEYS[2]  notify list of this lock (waiters BLPOP it)
-- KEYS[3]  waiter mark (see acquire.lua): set while someone may be waiting
-- ARGV[1]  token of the gone run's acquisition
-- ARGV[2]  the task id the hold is kept for
-- ARGV[3]  how long the hold is kept, in milliseconds
-- ARGV[4]  holder record shown while it is kept (JSON text)
-- ARGV[5]  how long an unconsumed wake-up notice lives, in milliseconds
-- Index    the lock key, as a mutex kept for a redelivery ('parked', index.lua)
-- Returns  1   kept (a waiter is woken: a copy already waiting takes it over now)
--          0   no such lock (expired or removed)
--          -1  held by another token: nothing touched
--          -2  the key holds something that is not a lock hash: nothing touched
local owned = owner_of(KEYS[1], ARGV[1])
if owned ~= 1 then
  return owned
end
redis.call('HSET', KEYS[1], 'token', 'parked:' .. ARGV[2], 'owner', ARGV[2], 'info', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
index_lock(KEYS[1], ARGV[3], 'parked')
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
return 1
