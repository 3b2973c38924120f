-- dequeue: give up the enqueue-time hold of a lock, only if ARGV[1] still owns it (a
-- message revoked, expired or rejected before it ran, or one that failed to publish).
-- KEYS[1]  queued hold (a hash: owner, info)
-- ARGV[1]  owner: the task id the hold was taken for
-- Index    the queued hold's key leaves it (index.lua)
-- Returns  1   removed
--          0   no hold (expired, handed over, or removed)
--          -1  held for another task id: nothing touched
--          -2  the key holds something that is not a queued hold (foreign data)
local owner = redis.pcall('HGET', KEYS[1], 'owner')
if type(owner) == 'table' and owner.err then
  return -2
end
if not owner then
  return 0
end
if owner ~= ARGV[1] then
  return -1
end
redis.call('DEL', KEYS[1])
index_drop(KEYS[1], 'queued')
return 1
