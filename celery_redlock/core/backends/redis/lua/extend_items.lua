-- extend_items: the loop that extend_many.lua and extend_node.lua share; the Redis
-- backend (core/backends/redis_backend.py) appends it to each. They define count (how many
-- items) and item(i) (key, token, lease in milliseconds of item i); the codes returned
-- are those their headers list. Each renewed key's expiry moves in the index (index.lua).
local out = {}
local now
for i = 1, count do
  local key, token, ms = item(i)
  if string.byte(key, -1) == 125 then -- '}': a lock
    local tok = redis.pcall('HGET', key, 'token')
    if type(tok) == 'table' and tok.err then
      out[i] = -2
    elseif not tok then
      out[i] = 0
    elseif tok ~= token then
      out[i] = -1
    else
      redis.call('PEXPIRE', key, ms)
      index_renew(key, ms)
      out[i] = 1
    end
  else -- a permit
    local v = redis.pcall('HGET', key, token)
    if type(v) == 'table' and v.err then
      out[i] = -2
    elseif not v then
      out[i] = 0
    else
      if not now then
        local t = redis.call('TIME')
        now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      local exp, rest = string.match(v, '^(%d+)(|.*)$')
      if tonumber(exp or '0') <= now then
        redis.call('HDEL', key, token)
        index_sync(key, 'permits')
        out[i] = 0
      else
        redis.call('HSET', key, token, string.format('%d', now + tonumber(ms)) .. rest)
        if redis.call('PTTL', key) < tonumber(ms) then
          redis.call('PEXPIRE', key, ms)
          index_renew(key, ms)
        end
        out[i] = 1
      end
    end
  end
end
return out
