-- items_trim: after `scrapy-dist items --export` has written and fsynced the head of the items LIST, remove
-- it -- only if it is still the head that was exported (else it was removed already, or popped).
-- KEYS[1] items LIST
-- ARGV[1] number of elements exported from the head
-- ARGV[2] SHA-1 hex digest of those elements joined with "\n"
-- Returns 1 if they were removed, else 0.
local head = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if #head ~= tonumber(ARGV[1]) or redis.sha1hex(table.concat(head, '\n')) ~= ARGV[2] then return 0 end
redis.call('LTRIM', KEYS[1], tonumber(ARGV[1]), -1)
return 1
