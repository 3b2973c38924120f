-- extend_many: the renewal thread's batch, one round trip for every lock it holds on a node.
-- KEYS[i]      lock key i
-- ARGV[2i-1]   token of lock i
-- ARGV[2i]     lease of lock i in milliseconds (set, not added)
-- Returns      a list, one code per key: 1 renewed, 0 no such lock, -1 held by another token,
--              -2 the key holds something that is not a lock hash (foreign data). A foreign
--              key costs only its own lock: the others in the batch are still renewed.
local out = {}
for i = 1, #KEYS do
  local tok = redis.pcall('HGET', KEYS[i], 'token')
  if type(tok) == 'table' and tok.err then
    out[i] = -2
  elseif not tok then
    out[i] = 0
  elseif tok ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  end
end
return out
