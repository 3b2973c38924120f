-- rate: one decision of a rate limiter (GCRA, the generic cell rate algorithm) in one call.
-- KEYS[1]  state of the limiter: a hash with 'tat' (theoretical arrival time: when the
--          limiter is back to empty, in server microseconds), 'line' (the first slot not
--          yet promised to a caller told to come back; see 'queue'), and the 'interval'
--          and 'burst' last used (for `celery locks`). O(1) per name; the key expires
--          when the limiter is idle again (tat and line both past).
-- ARGV[1]  emission interval T in microseconds: the period divided by the rate (>= 1)
-- ARGV[2]  burst b: grants allowed at once after an idle spell (>= 1)
-- ARGV[3]  'take'  grant if a grant is possible now; a refusal writes nothing
--          'queue' as 'take', but refused while callers promised a slot are still due
--                  (the line is ahead of now), and a refused caller is promised the
--                  next slot not yet promised (the line moves on by T): it comes back
--                  then and asks with 'take'. Spreads re-queued callers one per slot.
--                  A free grant that no promised caller claimed within ARGV[5] of
--                  becoming possible lapses: the next caller takes it, so a line whose
--                  callers are late (stuck behind a backlog) does not leave the rate idle.
--          'peek'  never writes: whether 'take' would grant now
-- ARGV[4]  'queue' only: promise no slot further than this many microseconds away
--          (0 or absent: any); a caller that would not wait that long is not promised one
-- ARGV[5]  'queue' only: the grace in microseconds after which an unclaimed free grant
--          lapses to whoever asks (0 or absent: at once)
-- Index    the rate state's key, with its expiry (index.lua)
-- Returns  {granted (1 or 0), wait_us, free}
--          granted: wait_us until the next grant is possible, free: grants possible now
--          refused: wait_us until the caller's slot ('queue') or the next possible grant
--          A grant needs tat - now <= (b - 1) * T; it moves tat on by T. So in any window
--          of one period at most rate + b - 1 grants happen, and a refusal consumes
--          nothing. A copy re-sent after a lost reply may consume a second slot: fewer
--          grants, never more.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T = tonumber(ARGV[1])
local b = tonumber(ARGV[2])
local mode = ARGV[3]
local cur = redis.call('HMGET', KEYS[1], 'tat', 'line')
local tat = tonumber(cur[1] or '0') or 0
local line = tonumber(cur[2] or '0') or 0
local tol = (b - 1) * T
local grace = tonumber(ARGV[5] or '0') or 0
-- promised callers are due and the next grant became possible less than grace ago
local due = mode == 'queue' and line > now and tat - tol > now - grace
if tat < now then
  tat = now
end
local next_at = tat - tol
if next_at <= now and not due then
  if mode == 'peek' then
    return {1, 0, math.floor((now - next_at) / T) + 1}
  end
  tat = tat + T
  local keep = math.max(tat, line) - now
  redis.call('HSET', KEYS[1], 'tat', string.format('%d', tat), 'interval', ARGV[1], 'burst', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], math.ceil(keep / 1000) + 1)
  index_sync(KEYS[1], 'rate')
  local after = tat - tol
  if after <= now then
    return {1, 0, math.floor((now - after) / T) + 1}
  end
  return {1, after - now, 0}
end
if mode == 'queue' then
  local slot = math.max(line, next_at)
  local most = tonumber(ARGV[4] or '0') or 0
  if most <= 0 or slot - now <= most then
    line = slot + T
    local keep = math.max(tat, line) - now
    redis.call('HSET', KEYS[1], 'line', string.format('%d', line), 'interval', ARGV[1], 'burst', ARGV[2])
    redis.call('PEXPIRE', KEYS[1], math.ceil(keep / 1000) + 1)
    index_sync(KEYS[1], 'rate')
  end
  return {0, slot - now, 0}
end
return {0, next_at - now, 0}
