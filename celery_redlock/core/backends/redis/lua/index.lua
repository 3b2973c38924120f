-- index: a shared part, put in front of the scripts that write what the operator reads
-- (scripts.py), after `local INDEX = true` (a plain Redis, a Sentinel master) or
-- `local INDEX = false` (a Redis Cluster: a script touches one hash slot's keys only, so
-- there the operator's reads walk the keyspace instead, and these functions do nothing).
-- The index of key prefix P is a few sorted sets beside the locks, outside every lock's
-- braces, reached by name (a plain Redis lets a script do so; they are not in KEYS):
--   P .. 'index:' .. set member = key, score 0 (so ordered by key): one set per kind and
--                        state: 'held', 'running', 'parked' (a mutex by its holder),
--                        'permits' (a semaphore), 'queued' (an enqueue-time hold),
--                        'rate' (a rate limiter's state), 'control' (a name's controls)
--   P .. 'index:expiry'  member = key of the first four sets, score = when it expires
--                        (server time, ms): what a holder releases
--   P .. 'index:timed'   the same for the last three ('inf': no expiry): what expires by
--                        itself; these four sets live as long as their longest member,
--                        and each write drops two members whose time has passed
-- A script adds a key when it writes it, moves its expiry when it renews it, and takes
-- it out when it deletes it; a lease that ran out unreleased goes when a reader lists
-- the index (index_prune.lua), and sixteen of them at one write of a held key in
-- sixteen (index_sweep), so that the index stays bounded where nobody reads it.
-- index_lock(key, ms, state)  a mutex at *key* held *ms* more, in the set *state*
-- index_put(key, ms, set)     *key* lives *ms* more (nil: no expiry), in *set*
-- index_renew(key, ms)        *key*, already indexed, lives *ms* more
-- index_sync(key, set)        *key* as it is now: its expiry, or out when it is gone
-- index_drop(key, set)        *key* deleted (*set* nil: a mutex, out of its three sets)
-- index_gone(key, record)     a mutex at *key* released, its holder *record* (JSON text)
-- index_state(record)         the set of a mutex taken with holder *record* (JSON text)
-- index_time(t, us)           the server's clock as the script read it (TIME's reply,
--                             and *us* that in microseconds when the script made it a
--                             number): the index reads it no second time
-- Sets of a kind, as words (a loop reads them with gmatch: a table would be built on
-- every call of every script, used or not).
local INDEX_MUTEX = 'held running parked'
local function index_state(record)
  if string.find(record, '"kept_for":', 1, true) then
    return 'parked'
  end
  -- Plain finds, then one match anchored where the name ends: an unanchored pattern
  -- would be tried at every byte of the record.
  local at = string.find(record, '"task_name":', 1, true)
  return at and string.find(record, '^%s*"[^"]', at + 12) and 'running' or 'held'
end
local index_ms
local function index_head(key)
  return string.sub(key, 1, string.find(key, '{', 1, true) - 1) .. 'index:'
end
local function index_now()
  if not index_ms then
    local t = redis.call('TIME')
    index_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return index_ms
end
local function index_at(ms)
  -- A score as '%d' text: Lua would print a number it passes on with '%.17g', a
  -- floating-point print that costs about what the ZADD does.
  if not ms then
    return 'inf'
  end
  return string.format('%d', index_now() + tonumber(ms))
end
local function index_time(t, us)
  if not index_ms then
    us = us or tonumber(t[1]) * 1000000 + tonumber(t[2])
    index_ms = math.floor(us / 1000)
  end
end
local INDEX_TIMED = 'queued rate control'
local function index_timed_set(set)
  return set == 'queued' or set == 'rate' or set == 'control'
end
local function index_timed(head, set)
  -- Two members whose time has passed go, then the family's sets live as long as the
  -- longest member left.
  local timed = head .. 'timed'
  local gone = redis.call('ZRANGEBYSCORE', timed, '-inf', '(' .. index_at(0), 'LIMIT', 0, 2)
  for _, old in ipairs(gone) do
    redis.call('ZREM', timed, old)
    for other in string.gmatch(INDEX_TIMED, '%a+') do
      redis.call('ZREM', head .. other, old)
    end
  end
  local top = redis.call('ZRANGE', timed, -1, -1, 'WITHSCORES')[2]
  for _, k in ipairs({timed, head .. set}) do
    if top == 'inf' then
      redis.call('PERSIST', k)
    elseif top then
      redis.call('PEXPIREAT', k, string.format('%d', tonumber(top) + 1000))
    end
  end
end
local INDEX_HELD = 'held running parked permits'
local INDEX_SWEEP = 16
local function index_sweep(head)
  -- In one write of a held key out of INDEX_SWEEP (by the server's clock), that many keys
  -- whose lease ran out unreleased (a dropped Lock, a killed worker) go from the held
  -- sets, so that the index stays bounded where no operator ever reads it, at about one
  -- command a sixteenth of the writes; a key that still lives (renewed by a script that
  -- did not list it) gets its expiry back.
  local now = index_now()
  if now % INDEX_SWEEP ~= 0 then
    return
  end
  local expiry = head .. 'expiry'
  local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', '(' .. string.format('%d', now), 'LIMIT', 0, INDEX_SWEEP)
  for _, old in ipairs(gone) do
    local left = redis.call('PTTL', old)
    if left > 0 then
      redis.call('ZADD', expiry, index_at(left), old)
    elseif left == -2 then
      redis.call('ZREM', expiry, old)
      for other in string.gmatch(INDEX_HELD, '%a+') do
        redis.call('ZREM', head .. other, old)
      end
    end
  end
end
local function index_put(key, ms, set)
  if INDEX then
    local head = index_head(key)
    local timed = index_timed_set(set)
    redis.call('ZADD', head .. (timed and 'timed' or 'expiry'), index_at(ms), key)
    redis.call('ZADD', head .. set, '0', key)
    if timed then
      index_timed(head, set)
    else
      index_sweep(head)
    end
  end
end
local function index_lock(key, ms, state)
  if INDEX then
    local head = index_head(key)
    if redis.call('ZADD', head .. 'expiry', index_at(ms), key) == 0 then
      -- Listed already: held before (a lease that ran out unlisted, or a run parked or
      -- taken over), maybe in another state's set.
      for other in string.gmatch(INDEX_MUTEX, '%a+') do
        if other ~= state then
          redis.call('ZREM', head .. other, key)
        end
      end
    end
    redis.call('ZADD', head .. state, '0', key)
    index_sweep(head)
  end
end
local function index_renew(key, ms)
  if INDEX then
    redis.call('ZADD', index_head(key) .. 'expiry', 'XX', index_at(ms), key)
  end
end
local function index_drop(key, set)
  if INDEX then
    local head = index_head(key)
    redis.call('ZREM', head .. (index_timed_set(set) and 'timed' or 'expiry'), key)
    if set then
      redis.call('ZREM', head .. set, key)
    else
      for other in string.gmatch(INDEX_MUTEX, '%a+') do
        redis.call('ZREM', head .. other, key)
      end
    end
  end
end
local function index_gone(key, record)
  if INDEX then
    local head = index_head(key)
    redis.call('ZREM', head .. 'expiry', key)
    redis.call('ZREM', head .. index_state(record), key)
  end
end
local function index_sync(key, set)
  if INDEX then
    local left = redis.call('PTTL', key)
    if left == -2 then
      index_drop(key, set)
    else
      index_put(key, left > 0 and left or nil, set)
    end
  end
end
