-- hold_all: a run's holds taken in one step, all or nothing, after the operator controls
-- of every name involved (a task's lock_limits; celery locks pause / set). A run with
-- rules takes this script; a run without takes acquire.lua or permit_acquire.lua alone,
-- which read its name's controls themselves (their KEYS[4]). The Redis backend puts
-- acquire.lua and permit_acquire.lua in front of this file as the local functions
-- take_lock(KEYS, ARGV) and take_permit(KEYS, ARGV); it passes them ARGV.checked, so
-- that they do not read the primary's controls again.
-- KEYS[1 .. n]   the primary's keys, as acquire.lua (a mutex) or permit_acquire.lua (a
--                semaphore) takes them (their KEYS[4], the control hash, is not read
--                there: KEYS[n + 1] is, here); n = ARGV[1] (0 with 'none': rules alone,
--                as the rules of a Redis Cluster slot other than the primary's)
-- KEYS[n + 1]    the primary's control hash (absent with 'none'): field -> '<until:
--                server ms, 0 none>|<value>', fields 'pause' (value: the reason), 'limit'
--                (the permits of a semaphore) and 'rate' ('<interval us>|<burst, 0: the
--                rule's own>|<as written>'); a lapsed field counts as absent
-- then three keys per rule: a Limit's permits hash (as permit_acquire.lua's; a Limit of
--                one: the lock hash of its name, as acquire.lua's) or a Rate's state (as
--                rate.lua's), the Limit's fence counter (the Rate's state again), the
--                rule's control hash
-- ARGV[1]  n: how many keys the primary takes
-- ARGV[2]  'lock' or 'permit': which script takes the primary; 'none': no primary
-- ARGV[3]  m: how many arguments the primary takes, ARGV[4 .. 3 + m]: token, lease ms,
--          record, wait, fence ttl (as acquire.lua), then its limit (a permit) or its
--          hand-over (a lock); a Limit rule's permit uses the same token, lease, record
--          and fence ttl (with 'none', these five alone)
-- then five per rule: 'limit', 'mutex' (a Limit of one) or 'rate', the limit or the
--          interval in us, the burst, the cost (units of a Rate), the rule's name
-- Index    what take_lock and take_permit take, and each Rate's state (index.lua)
-- Returns  {1, fence, f1, ..., fk}   taken: the primary's fence (0 with 'none'), then
--                                     each rule's (0 for a Rate); a re-sent copy finds
--                                     its own token and reports the same fences, and
--                                     takes no Rate unit again (with 'none': a Limit of
--                                     the call holds the token, or a Rate's last
--                                     taker, field 'by', is the token)
--          the primary's refusal, as acquire.lua / permit_acquire.lua return it
--          {-2, name, wait ms, why, detail}  refused by a control or a rule, nothing
--                                     taken: why 'paused' (detail: the reason), 'limit'
--                                     (detail: the record of its permit that expires
--                                     first, or of its holder) or 'rate'; the wait is the
--                                     longest known one of every refusal: a pause's end,
--                                     a rate's slot (-1: none known, such as a Limit's,
--                                     which frees when a holder ends)
--          {-3, name, cost, most}     a Rate rule asked for more units than it can grant
--                                     at once (its burst): nothing taken
-- The server's clock, read once and only when a control or a rule needs it; take_lock,
-- take_permit (ARGV.clock) and the index are handed it and read it no more.
local now_t, now_ms, now_us
local function clock()
  if not now_ms then
    local t = redis.call('TIME')
    now_t = t
    index_time(t)
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
end

local function controls(key)
  local c = {}
  local raw = redis.call('HGETALL', key)
  if #raw > 0 then clock() end
  for i = 1, #raw, 2 do
    local untl, value = string.match(raw[i + 1], '^(%d+)|(.*)$')
    untl = tonumber(untl or '0')
    if untl == 0 or untl > now_ms then
      c[raw[i]] = {untl, value}
    end
  end
  return c
end

local n = tonumber(ARGV[1])
local kind = ARGV[2]
local m = tonumber(ARGV[3])
local pk, pa = {}, {}
for i = 1, n do pk[i] = KEYS[i] end
for i = 1, m do pa[i] = ARGV[3 + i] end
pa.fence_floor = ARGV.fence_floor -- a Sentinel-managed master's (master_guard.lua)
pa.checked = true -- the primary's controls are read here: take_lock / take_permit skip them

local refused, longest, unknown = nil, -1, false
local function refuse(name, wait, why, detail)
  if wait < 0 then
    unknown = true
  elseif wait > longest then
    longest = wait
  end
  if not refused then
    refused = {name, why, detail}
  end
end

local function paused(c, name)
  local p = c['pause']
  if p then
    refuse(name, p[1] == 0 and -1 or p[1] - now_ms, 'paused', p[2])
  end
end

local first = n + 1 -- the first rule's first key
if kind ~= 'none' then
  local main = controls(KEYS[n + 1])
  paused(main, '')
  if kind == 'permit' and main['limit'] then
    pa[6] = main['limit'][2]
  end
  first = n + 2
end

-- Check every rule before anything is written.
local rules = {}
local base = 3 + m
local r = 0
while ARGV[base + 1] do
  clock()
  r = r + 1
  local k = first - 1 + 3 * (r - 1)
  local rule = {
    kind = ARGV[base + 1], a = tonumber(ARGV[base + 2]), burst = tonumber(ARGV[base + 3]),
    cost = tonumber(ARGV[base + 4]), name = ARGV[base + 5],
    key = KEYS[k + 1], fence = KEYS[k + 2],
  }
  local c = controls(KEYS[k + 3])
  paused(c, rule.name)
  if rule.kind == 'limit' then
    if c['limit'] then rule.a = tonumber(c['limit'][2]) end
    if redis.call('HLEN', rule.key) >= rule.a then
      local all = redis.call('HGETALL', rule.key)
      local live, first, record = 0, nil, ''
      for i = 1, #all, 2 do
        local exp, _, rest = string.match(all[i + 1], '^(%d+)|(%d*)|(.*)$')
        exp = tonumber(exp or '0')
        if exp > now_ms then
          live = live + 1
          if not first or exp < first then first, record = exp, rest end
        end
      end
      if live >= rule.a then
        -- A permit frees when its holder ends, which its lease does not tell.
        refuse(rule.name, -1, 'limit', record)
      end
    end
  elseif rule.kind == 'mutex' then
    local cur = redis.call('HMGET', rule.key, 'token', 'info')
    if cur[1] and cur[1] ~= pa[1] then
      refuse(rule.name, -1, 'limit', cur[2] or '')
    end
  else
    if c['rate'] then
      local interval, burst = string.match(c['rate'][2], '^(%d+)|(%d+)')
      rule.a = tonumber(interval)
      if tonumber(burst) > 0 then rule.burst = tonumber(burst) end
    end
    if rule.cost > rule.burst then
      return {-3, rule.name, rule.cost, rule.burst}
    end
    local tat = tonumber(redis.call('HGET', rule.key, 'tat') or '0') or 0
    if tat < now_us then tat = now_us end
    local at = tat + (rule.cost - rule.burst) * rule.a
    if at > now_us then
      refuse(rule.name, math.ceil((at - now_us) / 1000), 'rate', '')
    end
    rule.tat = tat
  end
  rules[r] = rule
  base = base + 5
end
-- A re-sent copy of an acquire that got through (a lost reply) finds the primary held by
-- its own token: it is not refused (its own permits fill the Limits), and its Rates'
-- units are not taken twice.
local resent
local function own()
  if resent == nil then
    if kind == 'permit' then
      resent = redis.call('HEXISTS', KEYS[1], pa[1]) == 1
    elseif kind == 'lock' then
      resent = redis.call('HGET', KEYS[1], 'token') == pa[1]
    else
      resent = false
      for i = 1, r do
        local rule = rules[i]
        if rule.kind == 'limit' and redis.call('HEXISTS', rule.key, pa[1]) == 1
            or rule.kind == 'mutex' and redis.call('HGET', rule.key, 'token') == pa[1]
            or rule.kind == 'rate' and redis.call('HGET', rule.key, 'by') == pa[1] then
          resent = true
        end
      end
    end
  end
  return resent
end
if refused and not own() then
  return {-2, refused[1], unknown and longest < 0 and -1 or longest, refused[2], refused[3]}
end

if r > 0 then
  own() -- before the primary is taken: is this a re-sent copy?
end
local got = {1, 0}
pa.clock = now_t -- the clock read here, if it was: take_lock / take_permit read it no more
if kind == 'permit' then
  got = take_permit(pk, pa)
elseif kind == 'lock' then
  got = take_lock(pk, pa)
end
if got[1] ~= 1 then
  return got
end

local out = {1, got[2]}
for i = 1, r do
  local rule = rules[i]
  if rule.kind == 'limit' then
    local taken = take_permit({rule.key, rule.fence},
      {pa[1], pa[2], pa[3], '0', pa[5], rule.a, fence_floor = pa.fence_floor, clock = now_t})
    out[#out + 1] = taken[2]
  elseif rule.kind == 'mutex' then
    local taken = take_lock({rule.key, rule.fence},
      {pa[1], pa[2], pa[3], '0', pa[5], fence_floor = pa.fence_floor, clock = now_t})
    out[#out + 1] = taken[2]
  elseif resent then
    out[#out + 1] = 0
  else
    local tat = rule.tat + rule.cost * rule.a
    redis.call('HSET', rule.key, 'tat', string.format('%d', tat), 'interval', string.format('%d', rule.a), 'burst', rule.burst)
    if kind == 'none' then
      redis.call('HSET', rule.key, 'by', pa[1])
    end
    local line = tonumber(redis.call('HGET', rule.key, 'line') or '0') or 0
    redis.call('PEXPIRE', rule.key, math.ceil((math.max(tat, line) - now_us) / 1000) + 1)
    index_sync(rule.key, 'rate')
    out[#out + 1] = 0
  end
end
return out
