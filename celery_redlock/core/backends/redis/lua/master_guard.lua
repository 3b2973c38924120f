-- master_guard: what a script sent to a Sentinel-managed master runs first. The Redis
-- backend puts this in front of the script (see sentinel_watch.py) and appends one key
-- and one argument to the script's own, which it then sees unchanged as KEYS and ARGV.
-- KEYS[#KEYS]  the replaced-master mark of the key prefix: the config-epoch of a master
--              that replaced this server (written here by master_mark.lua when the
--              sentinels announced the switch; absent on a server never replaced)
-- ARGV[#ARGV]  the config-epoch at which the sentinels made this server the master, as
--              the caller knows it (an integer >= 0)
-- Fails    'REPLACED <mark>' when the mark is above ARGV[#ARGV]: this server was the
--          master the caller thinks it is, and a later master has replaced it; nothing
--          ran. The caller asks the sentinels again.
-- Sets     ARGV.fence_floor = ARGV[#ARGV] * 10^12 (a field of the script's ARGV, not a
--          position): acquire.lua and permit_acquire.lua hand out no fence below it
--          plus the server's clock in microseconds (hold_all.lua passes it on), so every
--          fence from the master of a later config-epoch is above every fence from an
--          earlier one, whatever the counters replicated before the promotion, while
--          the two masters' clocks agree within 10^12 us (11.5 days).
local KEYS, ARGV, master_epoch, replaced_mark = (function(keys, args)
  local k, a = {}, {}
  for i = 1, #keys - 1 do k[i] = keys[i] end
  for i = 1, #args - 1 do a[i] = args[i] end
  local epoch = tonumber(args[#args])
  a.fence_floor = epoch * 1000000000000
  return k, a, epoch, keys[#keys]
end)(KEYS, ARGV)
local replaced = tonumber(redis.call('GET', replaced_mark) or '-1')
if replaced > master_epoch then
  return redis.error_reply('REPLACED ' .. string.format('%d', replaced) ..
    ' this server was replaced as the Sentinel master at config-epoch ' ..
    string.format('%d', replaced))
end
