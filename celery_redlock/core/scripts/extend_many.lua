-- extend_many: the renewal thread's batch, one round trip for every lock it holds on a node.
-- KEYS[i]      lock key i
-- ARGV[2i-1]   token of lock i
-- ARGV[2i]     lease of lock i in milliseconds (set, not added)
-- Returns      a list, one code per key: 1 renewed, 0 no such lock, -1 held by another token
local out = {}
for i = 1, #KEYS do
  local tok = redis.call('HGET', KEYS[i], 'token')
  if not tok then
    out[i] = 0
  elseif tok ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  end
end
return out
