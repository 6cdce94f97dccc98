-- cookies_write: write changed cookies of one shared jar and log each change with a new version, so readers
-- fetch only what changed since their last read (SharedCookiesMiddleware).
-- KEYS[1] the jar HASH (JSON [domain, path, name] -> JSON record)
-- KEYS[2] the jar's changes ZSET (field -> version of its last change)
-- KEYS[3] the jar index HASH (jar name -> unix time of its last write)
-- ARGV[1] jar name, ARGV[2] unix time now
-- ARGV[3] number of sets S; ARGV[4 .. 3+2S] field, record pairs; ARGV[4+2S ..] fields to delete
-- Returns the jar's version after the write.
-- Versions are integers below 2^50; members outside that range are not ours and are removed first.
local LIMIT = 1125899906842624
redis.call('ZREMRANGEBYSCORE', KEYS[2], '(' .. LIMIT, '+inf')
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(0')
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local v = 0
if top[2] then v = math.floor(tonumber(top[2])) end
local sets = tonumber(ARGV[3])
if not sets or sets < 0 or 3 + 2 * sets > #ARGV then
  return redis.error_reply('cookies_write: bad set count')
end
for i = 4, 3 + 2 * sets, 2 do
  v = v + 1
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], v, ARGV[i])
end
for i = 4 + 2 * sets, #ARGV do
  v = v + 1
  redis.call('HDEL', KEYS[1], ARGV[i])
  redis.call('ZADD', KEYS[2], v, ARGV[i])
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return v
