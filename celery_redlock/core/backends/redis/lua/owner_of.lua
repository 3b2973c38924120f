-- owner_of: a shared part, put in front of the scripts that list it (scripts.py).
-- owner_of(key, token)  whether *token* holds the lock hash at *key*:
--          1   it does
--          0   no such lock (expired or removed)
--          -1  held by another token
--          -2  the key holds something that is not a lock hash (foreign data)
local function owner_of(key, token)
  local tok = redis.pcall('HGET', key, 'token')
  if type(tok) == 'table' and tok.err then
    return -2
  end
  if not tok then
    return 0
  end
  if tok ~= token then
    return -1
  end
  return 1
end
