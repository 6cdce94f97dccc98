-- cookies_read: the changes of one shared jar since a reader's last read, at most a page of them
-- (SharedCookiesMiddleware); junk written into the jar HASH alone is never read.
-- KEYS[1] the jar HASH, KEYS[2] the jar's changes ZSET (field -> version of its last change)
-- ARGV[1] the reader's version (0: it has nothing), ARGV[2] the most changes to return
-- Returns {latest version (0: no changes), field, version, record or false (deleted), ...} for the changes
-- after ARGV[1] in version order. A reader ahead of the latest version (the keys were deleted and written
-- again) gets everything from the start.
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local latest = top[2] or '0'
local since = tonumber(ARGV[1]) or 0
if since > tonumber(latest) then since = 0 end
local out = {latest}
local changed = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. since, '+inf', 'WITHSCORES', 'LIMIT', 0,
  tonumber(ARGV[2]) or 1000)
for i = 1, #changed, 2 do
  out[#out + 1] = changed[i]
  out[#out + 1] = changed[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[1], changed[i])
end
return out
