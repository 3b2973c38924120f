-- raise_fence: lift a lock's fence counter to at least ARGV[1] (Redlock writes the
-- fence it chose back to a quorum, so the next holder's majority sees it).
-- KEYS[1]  fence counter
-- ARGV[1]  fence value (integer)
-- Returns  the counter after the call
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if cur < want then
  redis.call('SET', KEYS[1], want)
  return want
end
return cur
