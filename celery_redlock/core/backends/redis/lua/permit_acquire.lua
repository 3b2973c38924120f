-- permit_acquire: take one of a semaphore's ARGV[6] permits, or confirm we already hold one.
-- KEYS[1]  permits of the semaphore: a hash, one field per permit, token ->
--          "<expiry: server time in ms>|<fence>|<holder record>"; the key itself lives as
--          long as its longest permit (PEXPIRE), each permit only until its own expiry
-- KEYS[2]  fence counter of this name (same hash tag; shared with a Lock of the name;
--          expires only with ARGV[5])
-- KEYS[3]  waiter mark (optional): set while someone may be blocked on the notify list
-- ARGV[1]  token of this acquisition (>= 128 random bits)
-- ARGV[2]  lease in milliseconds (integer)
-- ARGV[3]  holder record (JSON text), shown by `celery locks`
-- ARGV[4]  '1' when the caller will block for a release notice if every permit is held
-- ARGV[5]  idle lifetime of the fence counter in ms (0: never expires); see acquire.lua
-- KEYS[4]  control hash of this name (optional: a task's run; with KEYS[3]), as in
--          acquire.lua: a 'pause' refuses the acquisition, a 'limit' (value: the
--          permits) stands for ARGV[6]. Not read when ARGV.checked is set
-- ARGV[6]  the limit: how many permits may be held at once (integer >= 1)
-- ARGV.fence_floor  as in acquire.lua (a Sentinel-managed master)
-- ARGV.checked  as in acquire.lua: hold_all.lua read KEYS[4] already (and passes the
--          control's limit as ARGV[6])
-- ARGV.clock  as in acquire.lua: the server's clock as hold_all.lua read it
-- Index    the permits' key, with the expiry of its longest permit (index.lua)
-- Returns  {1, fence}               acquired; also when KEYS[1] already holds an unexpired
--                                   ARGV[1] (a re-sent acquire: same fence, lease reset)
--          {0, record, left, held}  every permit is held: the record and ms left of the
--                                   permit that expires first, and how many are held
--          {-2, '', wait ms, 'paused', reason}  KEYS[4] pauses the name, as in acquire.lua
-- Expired permits are removed when the hash is full (or met by their token): until then
-- they take no one's place, since a new permit is granted only while fewer than ARGV[6]
-- fields exist. So at every moment live permits <= fields <= the limit.
local t = ARGV.clock or redis.call('TIME') -- read once: the index takes it too
index_time(t)
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local limit = tonumber(ARGV[6])
local mine = redis.call('HGET', KEYS[1], ARGV[1])
if mine then
  local exp, fence, rest = string.match(mine, '^(%d+)|(%d+)|(.*)$')
  if exp and tonumber(exp) > now then
    redis.call('HSET', KEYS[1], ARGV[1], string.format('%d|%s|%s', now + ttl, fence, rest))
    if redis.call('PTTL', KEYS[1]) < ttl then
      redis.call('PEXPIRE', KEYS[1], ttl)
    end
    index_sync(KEYS[1], 'permits')
    return {1, tonumber(fence)}
  end
  redis.call('HDEL', KEYS[1], ARGV[1])
end
if KEYS[4] and not ARGV.checked then
  local c = redis.call('HMGET', KEYS[4], 'pause', 'limit')
  local untl, value = string.match(c[1] or '', '^(%d+)|(.*)$')
  untl = tonumber(untl or '-1')
  if untl == 0 or untl > now then
    return {-2, '', untl == 0 and -1 or untl - now, 'paused', value}
  end
  untl, value = string.match(c[2] or '', '^(%d+)|(.*)$')
  untl = tonumber(untl or '-1')
  if untl == 0 or untl > now then
    limit = tonumber(value)
  end
end
if redis.call('HLEN', KEYS[1]) >= limit then
  -- Full: drop the expired permits, and find the one that expires first.
  local all = redis.call('HGETALL', KEYS[1])
  local held, first, first_record = 0, nil, ''
  for i = 1, #all, 2 do
    local exp, _, rest = string.match(all[i + 1], '^(%d+)|(%d*)|(.*)$')
    exp = tonumber(exp or '0')
    if exp <= now then
      redis.call('HDEL', KEYS[1], all[i])
    else
      held = held + 1
      if not first or exp < first then
        first, first_record = exp, rest
      end
    end
  end
  if held >= limit then
    local left = first - now
    if ARGV[4] == '1' and KEYS[3] then
      -- As in acquire.lua: the mark outlives the caller's wait (capped at `left`) by a
      -- second, so every release while it waits pushes a notice.
      local want = left + 1000
      if redis.call('PTTL', KEYS[3]) < want then
        redis.call('SET', KEYS[3], '1', 'PX', want)
      end
    end
    return {0, first_record, left, held}
  end
end
local fence_ttl = tonumber(ARGV[5] or '0')
if fence_ttl > 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SET', KEYS[2], t[1] .. string.format('%06d', tonumber(t[2])))
end
local fence = redis.call('INCR', KEYS[2])
fence = fence_floor(KEYS[2], fence, ARGV.fence_floor, t)
if fence_ttl > 0 then
  redis.call('PEXPIRE', KEYS[2], fence_ttl)
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d|%d|%s', now + ttl, fence, ARGV[3]))
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
index_sync(KEYS[1], 'permits')
return {1, fence}
