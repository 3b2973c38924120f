-- extend_many: the renewal thread's batch, one round trip for every lock and permit it
-- holds on a node.
-- KEYS[i]      key of item i: a lock hash (its key ends with '}'), or a semaphore's
--              permits (its key ends with ':permits'; see permit_acquire.lua)
-- ARGV[2i-1]   token of item i
-- ARGV[2i]     lease of item i in milliseconds (set, not added)
-- Returns      a list, one code per key: 1 renewed, 0 no such lock or permit (an expired
--              permit is removed), -1 held by another token, -2 the key holds something
--              that is not a lock (foreign data). A foreign key costs only its own item:
--              the others in the batch are still renewed.
local out = {}
local now
for i = 1, #KEYS do
  local key, token, ms = KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
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
        out[i] = 0
      else
        redis.call('HSET', key, token, string.format('%d', now + tonumber(ms)) .. rest)
        if redis.call('PTTL', key) < tonumber(ms) then
          redis.call('PEXPIRE', key, ms)
        end
        out[i] = 1
      end
    end
  end
end
return out
