-- extend_many: the renewal thread's batch, one round trip for every lock and permit it
-- holds on a node.
-- KEYS[i]      key of item i: a lock hash (its key ends with '}'), or a semaphore's
--              permits (its key ends with ':permits'; see permit_acquire.lua)
-- ARGV[2i-1]   token of item i
-- ARGV[2i]     lease of item i in milliseconds (set, not added)
-- Returns      a list, one code per key: 1 renewed, 0 no such lock or permit (an expired
--              permit is removed), -1 held by another token, -2 the key holds something
--              that is not a lock (foreign data). A foreign key costs only its own item:
--              the others in the batch are still renewed.
local count = #KEYS
local function item(i)
  return KEYS[i], ARGV[2 * i - 1], ARGV[2 * i]
end
