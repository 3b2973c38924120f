-- fenced_hset: set one field of a hash only while a lock is held by a given acquisition
-- and the field still has the value the caller last saw (an owner-checked
-- compare-and-set). Beat's leader records each schedule tick with it before
-- publishing, so a tick is claimed once even across a leadership hand-over.
-- KEYS[1]  lock key (a hash: token, fence, info); same hash tag as KEYS[2]
-- KEYS[2]  the hash to write
-- ARGV[1]  fence of the caller's acquisition of KEYS[1]
-- ARGV[2]  field
-- ARGV[3]  value the caller expects the field to have now ('' = absent)
-- ARGV[4]  new value
-- Returns  {1}          written
--          {0}          the lock is gone or held by another acquisition: nothing written
--          {-1, value}  the field changed since the caller read it: its current value
local fence = redis.call('HGET', KEYS[1], 'fence')
if (not fence) or fence ~= ARGV[1] then
  return {0}
end
local cur = redis.call('HGET', KEYS[2], ARGV[2]) or ''
if cur ~= ARGV[3] then
  return {-1, cur}
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return {1}
