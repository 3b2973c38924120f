-- acquire: take the lock if free, or confirm we already hold it.
-- KEYS[1]  lock key (a hash: token, fence, info)
-- KEYS[2]  fence counter of this lock (same hash tag; expires only with ARGV[5])
-- KEYS[3]  waiter mark of this lock: set while someone may be blocked on the notify
--          list, so that a release knows to push a notice
-- ARGV[1]  token of this acquisition (>= 128 random bits)
-- ARGV[2]  lease in milliseconds (integer)
-- ARGV[3]  holder record (JSON text), shown by `celery locks`
-- ARGV[4]  '1' when the caller will block for a release notice if the lock is held
--          (optional; absent: it will not)
-- ARGV[5]  idle lifetime of the fence counter in ms (optional; 0 or absent: never
--          expires). A counter that is gone (expired, or never made) restarts from the
--          server's clock in microseconds, above any value it could have reached by
--          counting (fewer than one a microsecond), so fences still increase after it
--          expired.
-- KEYS[4]  control hash of this name (optional: a task's run; always with KEYS[5]):
--          field -> '<until: server ms, 0 none>|<value>' (control.lua writes it), a
--          lapsed field counts as absent; a 'pause' refuses the acquisition (below).
--          Not read when ARGV.checked is set (hold_all.lua read it already)
-- KEYS[5]  queued hold of this lock (optional: a hand-over, see enqueue.lua): the
--          acquisition takes over the enqueue-time hold of task ARGV[6], in this one step
-- ARGV[6]  with KEYS[5]: the task id taking over; kept in the lock's 'owner' field
-- ARGV[7]  with KEYS[5]: '1' refuses when the queued hold belongs to another task id
--          (this message was superseded or is a duplicate); '0' takes the lock anyway
--          (a retry of a task that already ran keeps its place)
-- ARGV[6]  without KEYS[5]: the restart's step in ms (optional): a restart rounds up to
--          the next whole step of min(ARGV[6], ARGV[5]). A Redlock asks its masters for a
--          step of 1 s, so masters whose clocks agree to the second restart a new name's
--          counter alike and their fences agree (no write-back round); a step no longer
--          than the counter's idle lifetime keeps a restart after expiry above the last
--          one. A counter deleted within the step restarts at the same value: Redlock's
--          write-back covers one master that lost it, as it covers a master restarted
--          without persistence.
-- ARGV.fence_floor  (a field, not a position: set by master_guard.lua in front of this
--          script on a Sentinel-managed master; nil elsewhere) the fence is at least
--          ARGV.fence_floor + the server's clock in microseconds, and the counter is
--          raised to it
-- ARGV.checked  (a field: set by hold_all.lua, which runs this script as take_lock) the
--          controls of KEYS[4] are read already: they are not read again
-- ARGV.clock  (a field: set by hold_all.lua when it read the server's clock) TIME's reply,
--          which this script then reads no more
-- With KEYS[5], a lock kept for task ARGV[6]'s redelivered copy (park.lua: its token is
-- 'parked:' .. ARGV[6]) is taken over as if free, whoever holds the queued hold.
-- Index    the lock key, and the queued hold it takes over (index.lua)
-- Returns  {1, fence}          acquired; also when the key already holds ARGV[1]
--                              (a re-sent acquire finds its own token: same fence,
--                              lease reset; no control is read). With KEYS[5]: the
--                              queued hold is deleted if ARGV[6] owned it
--          {0, holder, pttl}   held by another token: its record and ms left; with
--                              KEYS[5] a 4th item, the queued hold's owner ('' if none)
--          {-1, info, pttl, owner}  with KEYS[5] and ARGV[7] = '1': the lock is free
--                              but the queued hold belongs to another task id (its
--                              record, ms left, that id); nothing is changed
--          {-2, '', wait ms, 'paused', reason}  KEYS[4] pauses the name (as hold_all.lua
--                              refuses it): the wait is the ms to the pause's end (-1:
--                              no end); nothing is changed
-- The server's clock (TIME) is read at most once, and only when a control, a counter's
-- restart or a fence floor needs it.
local t, us = ARGV.clock, nil -- the server's clock: TIME's reply, and in microseconds
local function clock()
  -- TIME read at most once, and its reply made a number once, for the index too.
  if not us then
    t = t or redis.call('TIME')
    us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    index_time(t, us)
  end
  return t, us
end
local cur = redis.call('HMGET', KEYS[1], 'token', 'fence', 'info')
if cur[1] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  index_renew(KEYS[1], ARGV[2])
  return {1, tonumber(cur[2])}
end
if KEYS[4] and not ARGV.checked then
  local pause = redis.call('HGET', KEYS[4], 'pause')
  if pause then
    local untl, reason = string.match(pause, '^(%d+)|(.*)$')
    untl = tonumber(untl or '0')
    if untl == 0 then
      return {-2, '', -1, 'paused', reason or ''}
    end
    local _, now = clock()
    local left = untl - math.floor(now / 1000)
    if left > 0 then
      return {-2, '', left, 'paused', reason or ''}
    end
  end
end
local queued = KEYS[5] and redis.call('HMGET', KEYS[5], 'owner', 'info')
local parked = KEYS[5] and cur[1] == 'parked:' .. ARGV[6]
if cur[1] and not parked then
  local left = redis.call('PTTL', KEYS[1])
  if ARGV[4] == '1' then
    -- The caller blocks at most `left` ms (or its own lease when the key has no
    -- expiry) from now; the mark outlives that by a second, so every release while
    -- it waits finds the mark and pushes a notice. Several waiters: the longest wins.
    local want = (left > 0 and left or tonumber(ARGV[2])) + 1000
    if redis.call('PTTL', KEYS[3]) < want then
      redis.call('SET', KEYS[3], '1', 'PX', want)
    end
  end
  if queued then
    return {0, cur[3] or '', left, queued[1] or ''}
  end
  return {0, cur[3] or '', left}
end
if queued and not parked and queued[1] and queued[1] ~= ARGV[6] and ARGV[7] == '1' then
  return {-1, queued[2] or '', redis.call('PTTL', KEYS[5]), queued[1]}
end
-- Numbers go to Redis as '%d' text (a whole number's sprintf) and arguments as they came
-- (tonumber is a strtod, and Lua writes a number it passes on with '%.17g': each costs
-- about what a command does).
local fence, fresh
local fence_ttl = ARGV[5]
local expires = fence_ttl and fence_ttl ~= '0' and fence_ttl ~= ''
if expires then
  -- A counter that is gone (the common case: a name not taken for longer than the
  -- counter's idle lifetime) restarts above anything it counted to, in one write.
  local _, now = clock()
  local step = 0
  if ARGV[6] and not KEYS[5] then
    step = math.min(tonumber(ARGV[6]) * 1000, tonumber(fence_ttl) * 1000)
  end
  if step > 1 then
    fence = (math.floor(now / step) + 1) * step
  else
    fence = now + 1
  end
  fresh = redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', fence_ttl, 'NX')
  if not fresh then
    fence = redis.call('INCR', KEYS[2])
  end
else
  fence = redis.call('INCR', KEYS[2])
end
local floored = fence_floor(KEYS[2], fence, ARGV.fence_floor, ARGV.fence_floor and clock())
if expires and (floored ~= fence or not fresh) then
  redis.call('PEXPIRE', KEYS[2], fence_ttl)
end
fence = floored
local text = string.format('%d', fence)
if queued then
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', text, 'info', ARGV[3], 'owner', ARGV[6])
  if queued[1] == ARGV[6] then
    redis.call('DEL', KEYS[5])
    index_drop(KEYS[5], 'queued')
  end
else
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', text, 'info', ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
index_lock(KEYS[1], ARGV[2], index_state(ARGV[3]))
return {1, fence}
