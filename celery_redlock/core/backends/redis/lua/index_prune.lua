-- index_prune: drop from the index of a key prefix (see index.lua) the keys whose expiry
-- has passed: leases that ran out unreleased, whose keys Redis removed by itself.
-- KEYS[1]     the index's expiry set (P .. 'index:expiry')
-- KEYS[2..]   every set of the index (P .. 'index:held', ...)
-- ARGV[1]     the most keys dropped in one call
-- Returns     how many keys were dropped (ARGV[1]: call again, there may be more)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, key in ipairs(gone) do
  for i = 1, #KEYS do
    redis.call('ZREM', KEYS[i], key)
  end
end
return #gone
