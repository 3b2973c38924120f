-- enqueue: take the enqueue-time hold of a lock for the message of one task id, or say
-- who has it. At most one queued message per lock name; the worker that starts it turns
-- the hold into the lock itself in one step (acquire.lua with KEYS[5]).
-- KEYS[1]  queued hold (a hash: owner, info); same hash tag as the lock
-- KEYS[2]  lock key (the run-time hold: token, fence, info, and 'owner' after a hand-over)
-- ARGV[1]  owner: the task id of the message about to be published
-- ARGV[2]  lifetime of the hold in milliseconds (integer)
-- ARGV[3]  holder record (JSON text), shown by `celery locks`
-- ARGV[4]  '1': a hold of another task id is replaced (the newest call wins)
-- ARGV[5]  '1': while the lock is held by another task id (running), this call is a
--          duplicate of that run; '0': it may be queued behind the run
-- Index    the queued hold's key (index.lua)
-- Returns  {1}                              held for ARGV[1]: new, or its own hold renewed
--                                           (a retry re-publishes under the same id)
--          {2, owner, info}                 held for ARGV[1]; it replaced owner's hold
--          {0, owner, info, pttl, state}    a duplicate: the hold ('queued') or the run
--                                           ('running') of task owner, its record, ms left;
--                                           a run kept for its redelivered copy (park.lua)
--                                           is 'queued'
local q = redis.call('HMGET', KEYS[1], 'owner', 'info')
if q[1] and q[1] ~= ARGV[1] then
  if ARGV[4] ~= '1' then
    return {0, q[1], q[2] or '', redis.call('PTTL', KEYS[1]), 'queued'}
  end
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'info', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
index_put(KEYS[1], ARGV[2], 'queued')
  return {2, q[1], q[2] or ''}
end
if not q[1] and ARGV[5] == '1' then
  local run = redis.call('HMGET', KEYS[2], 'token', 'owner', 'info')
  if run[1] and run[2] ~= ARGV[1] then
    local state = string.sub(run[1], 1, 7) == 'parked:' and 'queued' or 'running'
    return {0, run[2] or '', run[3] or '', redis.call('PTTL', KEYS[2]), state}
  end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'info', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
index_put(KEYS[1], ARGV[2], 'queued')
return {1}
