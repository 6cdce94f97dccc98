-- finish: a worker leaves a crawl that ended with reason "finished" under SCHEDULER_PERSIST = False.
-- The crawl's keys are deleted only by the last worker to leave, and only when nothing is queued,
-- leased or delayed -- never by the first worker to stop.
-- KEYS[1] workers ZSET   KEYS[2] queue ZSET   KEYS[3] leases ZSET   KEYS[4] delayed ZSET
-- KEYS[5..] every other key of the crawl to delete
-- ARGV[1] worker id   ARGV[2] seconds after which a silent worker no longer counts as present
-- (the server's clock decides, as in the sync script)
-- Returns 1 if the keys were deleted, 0 otherwise.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
-- read before the first write (a key of the wrong type fails here, with nothing written)
local busy = redis.call('ZCARD', KEYS[2]) > 0 or redis.call('ZCARD', KEYS[3]) > 0 or redis.call('ZCARD', KEYS[4]) > 0
redis.call('ZREM', KEYS[1], ARGV[1])
if busy then return 0 end
if redis.call('ZCOUNT', KEYS[1], now - (tonumber(ARGV[2]) or 60), '+inf') > 0 then
  return 0
end
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return 1
