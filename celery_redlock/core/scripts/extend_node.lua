#!lua flags=allow-cross-slot-keys,allow-oom
-- extend_node: the renewal thread's batch for one Redis Cluster node: every lock held
-- there in one call, whatever their slots (extend_many.lua takes one slot per call).
-- The keys travel in ARGV, not KEYS: a script's declared keys must share one slot, and
-- the flag lets it reach keys of other slots this node serves.
-- ARGV[3i-2]   lock key i
-- ARGV[3i-1]   token of lock i
-- ARGV[3i]     lease of lock i in milliseconds (set, not added)
-- Returns      a list, one code per lock, as extend_many.lua: 1 renewed, 0 no such lock,
--              -1 held by another token, -2 foreign data at the key
local out = {}
for i = 1, #ARGV / 3 do
  local key = ARGV[3 * i - 2]
  local tok = redis.pcall('HGET', key, 'token')
  if type(tok) == 'table' and tok.err then
    out[i] = -2
  elseif not tok then
    out[i] = 0
  elseif tok ~= ARGV[3 * i - 1] then
    out[i] = -1
  else
    redis.call('PEXPIRE', key, ARGV[3 * i])
    out[i] = 1
  end
end
return out
