#!lua flags=allow-cross-slot-keys,allow-oom
-- extend_node: the renewal thread's batch for one Redis Cluster node: every lock and
-- permit held there in one call, whatever their slots (extend_many.lua takes one slot
-- per call).
-- The keys travel in ARGV, not KEYS: a script's declared keys must share one slot, and
-- the flag lets it reach keys of other slots this node serves.
-- ARGV[3i-2]   key of item i: a lock hash (ends with '}') or a semaphore's permits
--              (ends with ':permits'), as in extend_many.lua
-- ARGV[3i-1]   token of item i
-- ARGV[3i]     lease of item i in milliseconds (set, not added)
-- Returns      a list, one code per item, as extend_many.lua: 1 renewed, 0 no such lock
--              or permit, -1 held by another token, -2 foreign data at the key
local out = {}
local now
for i = 1, #ARGV / 3 do
  local key, token, ms = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
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
