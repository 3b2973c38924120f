#!lua flags=allow-cross-slot-keys,allow-oom
-- extend_node: the renewal thread's batch for one Redis Cluster node: every lock and
-- permit held there in one call, whatever their slots (extend_many.lua takes one slot
-- per call).
-- The keys travel in ARGV, not KEYS: a script's declared keys must share one slot, and
-- the flag lets it reach keys of other slots this node serves.
-- ARGV[3i-2]   key of item i: a lock hash (ends with '}') or a semaphore's permits
--              (ends with ':permits'), as in extend_many.lua
-- ARGV[3i-1]   token of item i
-- ARGV[3i]     lease of item i in milliseconds (set, not added)
-- Returns      a list, one code per item, as extend_many.lua: 1 renewed, 0 no such lock
--              or permit, -1 held by another token, -2 foreign data at the key
local count = #ARGV / 3
local function item(i)
  return ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
end
