-- log_events: append lock events to the board's event log, a capped stream, in one call.
-- KEYS[1]   the event log (a stream)
-- ARGV[1]   about how many entries the log keeps (XADD MAXLEN ~)
-- ARGV[2]   how long the log lives after its last write, in milliseconds
-- ARGV[3..] the events, one JSON text each, oldest first
-- Returns   how many events were appended
-- Fails     as XADD does when KEYS[1] holds something that is not a stream
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'e', ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return #ARGV - 2
