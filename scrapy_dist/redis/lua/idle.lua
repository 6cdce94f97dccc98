-- idle: decide, atomically, that a crawl has finished because its frontier is empty, and tell every worker
-- (the control flag 'close' = reason, 'close_at' = now, which every worker's IdleMonitor polls).
--
-- KEYS[1] queue ZSET   KEYS[2] leases ZSET   KEYS[3] delayed ZSET   KEYS[4] control HASH   KEYS[5] workers ZSET
-- ARGV[1] close reason ('finished')   ARGV[2] the caller's start (unix seconds, server time): a close flag
--         set at or after it is already the decision of this crawl and is kept as it is
-- Returns {decided, reason, close_at}: decided 1 if this call set the flag, 0 if the frontier holds work
-- (reason '') or the flag was already set (its reason and time are returned).
-- A crawl no worker is registered in has ended (the last worker's finish deleted its keys, or none has
-- joined yet): nothing is decided and nothing written, so a poll racing that finish recreates no key.

local busy = redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
if busy > 0 or redis.call('ZCARD', KEYS[5]) == 0 then return {0, '', ''} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local now_s = string.format('%.6f', now)
local cur = redis.call('HMGET', KEYS[4], 'close', 'close_at')
-- A garbage close_at (not a number, NaN, or beyond now + 60 s: CLOSE_AT_SLACK in control.py) is no
-- decision of this crawl: it is overwritten, never obeyed.
local at = tonumber(cur[2] or '')
if cur[1] and at and at == at and at >= tonumber(ARGV[2]) and at <= now + 60 then return {0, cur[1], cur[2]} end
redis.call('HSET', KEYS[4], 'close', ARGV[1], 'close_at', now_s)
return {1, ARGV[1], now_s}
