-- control: set or lift one operator control of a name (celery locks pause / set / unset).
-- KEYS[1]  the name's control hash: field -> '<until: server ms, 0 none>|<value>' (see
--          hold_all.lua, which reads it for a run with rules; acquire.lua and
--          permit_acquire.lua read it for a run without); the key lives as long as its
--          longest field
-- ARGV[1]  the field: 'pause', 'limit' or 'rate'
-- ARGV[2]  the value; '' lifts the control
-- ARGV[3]  how long it holds in ms (0: until lifted)
-- Index    the control hash's key, with its expiry, out when deleted (index.lua)
-- Returns  1 changed, 0 nothing to lift
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local changed = 1
if ARGV[2] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[1])
else
  local ms = tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%d|%s', ms > 0 and now + ms or 0, ARGV[2]))
end
-- The key lives until its last field lapses; a field without an end keeps it.
local all = redis.call('HGETALL', KEYS[1])
local last = 0
for i = 1, #all, 2 do
  local untl = tonumber(string.match(all[i + 1], '^(%d+)|') or '0')
  if untl == 0 then
    last = -1
    break
  end
  if untl > now then
    last = math.max(last, untl)
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
if last == -1 then
  redis.call('PERSIST', KEYS[1])
elseif last > 0 then
  redis.call('PEXPIREAT', KEYS[1], last)
else
  redis.call('DEL', KEYS[1])
end
index_sync(KEYS[1], 'control')
return changed
