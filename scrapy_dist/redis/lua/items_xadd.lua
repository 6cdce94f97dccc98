-- items_xadd: append a batch of items to the items STREAM in one call (RedisPipeline with
-- REDIS_ITEMS_STREAM = True), so a batch costs one command instead of one XADD per item.
-- KEYS[1] items STREAM
-- ARGV[1] approximate length cap (XADD MAXLEN ~ N), or "" for none
-- ARGV[2] name of the entry field holding the item
-- ARGV[3..] encoded items, in order
-- Returns the number of entries added.
local field = ARGV[2]
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'none' and t ~= 'stream' then
  return redis.error_reply('WRONGTYPE scrapy-dist: ' .. KEYS[1] .. ' must be a STREAM')
end
if ARGV[1] == '' then
  for i = 3, #ARGV do
    redis.call('XADD', KEYS[1], '*', field, ARGV[i])
  end
else
  for i = 3, #ARGV do
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', field, ARGV[i])
  end
end
return #ARGV - 2
