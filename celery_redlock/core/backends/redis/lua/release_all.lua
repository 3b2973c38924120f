-- release_all: give back a run's holds in one step: its primary and the permit of each of
-- its Limit rules, all with the primary's token. The Redis backend puts release.lua and
-- permit_release.lua in front of this file as the local functions give_lock(KEYS, ARGV)
-- and give_permit(KEYS, ARGV).
-- KEYS[1 .. n]   the primary's keys, as release.lua (a mutex) or permit_release.lua (a
--                semaphore) takes them; n = ARGV[1] (0 with 'none': Limits alone, as
--                those of a Redis Cluster slot other than the primary's)
-- then four keys per Limit rule, as permit_release.lua (a Limit of one: release.lua)
--                takes them: its permits (its lock), notify list, waiter mark and
--                released tokens
-- ARGV[1]  n: how many keys the primary takes
-- ARGV[2]  'lock' or 'permit': which script gives the primary back; 'none': no primary
-- ARGV[3]  m: how many arguments the primary takes, ARGV[4 .. 3 + m] (token, notice ms,
--          then as its script takes them)
-- then three per Limit rule: 'limit' or 'mutex' (a Limit of one), its limit (the most
--          notices its list keeps) and the most bytes of released tokens kept; or per
--          Rate rule given back (a Redis Cluster's run that another slot refused: its
--          units are returned): 'rate', its interval in us, its cost (its four keys: its
--          state, then anything in its slot)
-- Returns  {primary code (1 with 'none'), code of each rule}: the codes release.lua and
--          permit_release.lua return. Every hold is given back whatever the others
--          answer.
local n = tonumber(ARGV[1])
local m = tonumber(ARGV[3])
local pk, pa = {}, {}
for i = 1, n do pk[i] = KEYS[i] end
for i = 1, m do pa[i] = ARGV[3 + i] end
local out = {}
if ARGV[2] == 'permit' then
  out[1] = give_permit(pk, pa)
elseif ARGV[2] == 'lock' then
  out[1] = give_lock(pk, pa)
else
  out[1] = 1
end
local r = 0
while ARGV[3 + m + 3 * r + 1] do
  local k = n + 4 * r
  local a = 3 + m + 3 * r
  local keys = {KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]}
  if ARGV[a + 1] == 'rate' then
    -- The units return to the rate: its theoretical arrival time moves back by them,
    -- never before now (what the units of others promise stays promised).
    local tat = tonumber(redis.call('HGET', keys[1], 'tat') or '0') or 0
    local t = redis.call('TIME')
    local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local back = math.max(now_us, tat - tonumber(ARGV[a + 3]) * tonumber(ARGV[a + 2]))
    if tat > now_us then
      redis.call('HSET', keys[1], 'tat', string.format('%d', back))
    end
    out[r + 2] = 1
  elseif ARGV[a + 1] == 'mutex' then
    out[r + 2] = give_lock(keys, {pa[1], pa[2], ARGV[a + 3]})
  else
    out[r + 2] = give_permit(keys, {pa[1], pa[2], ARGV[a + 2], ARGV[a + 3]})
  end
  r = r + 1
end
return out
