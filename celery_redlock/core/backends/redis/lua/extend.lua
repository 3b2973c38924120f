-- extend: lengthen the lease only if ARGV[1] still owns it; never recreates a key.
-- KEYS[1]  lock key
-- ARGV[1]  token
-- ARGV[2]  milliseconds (integer)
-- ARGV[3]  '1': set the lease to ARGV[2]; '0': add ARGV[2] to what is left
-- Index    the lock key's expiry moves with its lease (index.lua)
-- Returns  the new lease in ms (> 0) when extended
--          0   no such lock (expired or removed): lost
--          -1  held by another token: lost
--          -2  the key holds something that is not a lock hash (foreign data): lost
local owned = owner_of(KEYS[1], ARGV[1])
if owned ~= 1 then
  return owned
end
local ms = tonumber(ARGV[2])
if ARGV[3] ~= '1' then
  local left = redis.call('PTTL', KEYS[1])
  if left > 0 then
    ms = ms + left
  end
end
redis.call('PEXPIRE', KEYS[1], ms)
index_renew(KEYS[1], ms)
return ms
