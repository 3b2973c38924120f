-- raise_fence: lift a lock's fence counter to at least ARGV[1] (Redlock writes the
-- fence it chose back to a quorum, so the next holder's majority sees it).
-- KEYS[1]  fence counter
-- ARGV[1]  fence value (integer)
-- ARGV[2]  idle lifetime of the counter in ms (optional; 0 or absent: never expires)
-- Returns  the counter after the call
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if cur < want then
  redis.call('SET', KEYS[1], ARGV[1])
  if ARGV[2] and tonumber(ARGV[2]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return want
end
return cur
