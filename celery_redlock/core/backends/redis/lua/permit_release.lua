-- permit_release: give back one permit only if ARGV[1] still holds it, wake a waiter, and
-- remember ARGV[1] as released (see release.lua: a re-sent copy then counts as released).
-- KEYS[1]  permits of the semaphore (see permit_acquire.lua)
-- KEYS[2]  notify list of this name (waiters BLPOP it)
-- KEYS[3]  waiter mark (see acquire.lua): set while someone may be waiting; without it
--          no notice is pushed
-- KEYS[4]  the recently released tokens of this name (shared with the lock of the name;
--          see release.lua)
-- ARGV[1]  token of the permit being released
-- ARGV[2]  how long an unconsumed wake-up notice lives, and how long the released
--          tokens are remembered after the last release, in milliseconds (the lease)
-- ARGV[3]  the limit: the most notices kept in the list (one per free permit; at most
--          a million)
-- ARGV[4]  the most bytes of released tokens kept (see release.lua)
-- Index    the permits' key, out when its last permit goes (index.lua)
-- Returns  1   released (and a notice pushed if someone may be waiting); also when no
--              such permit is held but ARGV[1] is among the recently released tokens: a
--              re-sent copy of this token's own release
--          0   no such permit: it expired (a lingering expired one is removed) or was
--              removed
--          -2  the key holds something that is not a permit hash (foreign data under
--              our prefix): nothing touched
local v = redis.pcall('HGET', KEYS[1], ARGV[1])
if type(v) == 'table' and v.err then
  return -2
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local recent = redis.pcall('GET', KEYS[4])
if type(recent) ~= 'string' then
  recent = recent == false and ' ' or nil
end
if not v then
  if recent and string.find(recent, ' ' .. ARGV[1] .. ' ', 1, true) then
    return 1
  end
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
local exp = tonumber(string.match(v, '^(%d+)|') or '0')
local code = 1
if exp <= now then
  code = 0
else
  -- As in release.lua: foreign data at KEYS[4] never stops the release.
  if recent then
    recent = ' ' .. ARGV[1] .. recent
    if #recent > tonumber(ARGV[4]) then
      recent = string.match(string.sub(recent, 1, tonumber(ARGV[4])), '^(.* )')
    end
    redis.call('SET', KEYS[4], recent, 'PX', ARGV[2])
  end
end
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
end
index_sync(KEYS[1], 'permits')
if redis.call('EXISTS', KEYS[3]) == 0 then
  return code
end
-- One notice per permit given back, up to the limit: several permits freed at once wake
-- as many waiters (a mutex keeps one notice; here each can win).
redis.call('RPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], -math.min(tonumber(ARGV[3]), 1000000), -1)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return code
