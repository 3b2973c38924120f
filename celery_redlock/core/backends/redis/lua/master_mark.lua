-- master_mark: tell a demoted Sentinel master that a later master replaced it. Written
-- on the old master by every process that hears the sentinels announce the switch,
-- before it sends anything to the new one; master_guard.lua then refuses the scripts
-- of callers that have not heard yet.
-- KEYS[1]  the replaced-master mark of a key prefix
-- ARGV[1]  the config-epoch of the master that replaced this server
-- ARGV[2]  how long the mark lives, in ms
-- Returns  the mark after the call (a later epoch already there stays)
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
local want = tonumber(ARGV[1])
if cur < want then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return want
end
return cur
