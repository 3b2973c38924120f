-- claim_field: set one field of a hash only while the caller's acquisition holds a lock,
-- and never over a newer version of the field written under that same acquisition.
-- Beat's leader records each schedule tick with it before publishing (on every
-- master for Redlock), so a deposed leader can write nothing once another holds the lock.
-- KEYS[1]  lock key (a hash: token, fence, info); same hash tag as KEYS[2]
-- KEYS[2]  the hash to write
-- ARGV[1]  token of the caller's acquisition of KEYS[1] (the same on every Redlock master,
--          unlike the per-master fence field)
-- ARGV[2]  field
-- ARGV[3]  new value: a JSON object whose "fence" and "n" are ARGV[4] and ARGV[5]
-- ARGV[4]  the caller's fence (for Redlock the fence chosen for the quorum)
-- ARGV[5]  n: the caller's sequence number for this field, increasing per write
-- Returns  {1}          written; also when the field already holds ARGV[3] (a re-sent call)
--          {0}          the lock is gone or held by another acquisition: nothing written
--          {-1, value}  the field holds a write of the same fence with n >= ARGV[5]
--                       (a late or re-ordered copy of an older claim): nothing written
local tok = redis.call('HGET', KEYS[1], 'token')
if tok ~= ARGV[1] then
  return {0}
end
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if cur then
  if cur == ARGV[3] then
    return {1}
  end
  local ok, rec = pcall(cjson.decode, cur)
  if ok and type(rec) == 'table' then
    local fence, n = tonumber(rec['fence']), tonumber(rec['n'])
    if fence == tonumber(ARGV[4]) and n and n >= tonumber(ARGV[5]) then
      return {-1, cur}
    end
  end
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return {1}
