-- seeds_adopt: give the seeds held by workers whose lease ran out (dead, or stalled longer than the
-- lease) back to the seeds key, so a live worker takes them. Each worker is checked again here, so two
-- workers adopting the same one at once give its seeds back once.
--
-- KEYS[1] seeds key (LIST, SET or ZSET)   KEYS[2] processing LIST   KEYS[3] workers ZSET
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] kind of the seeds key: 'list', 'set' or 'zset'
-- ARGV[3..] worker ids
-- Returns {workers adopted, entries given back}

local now = seeds_now(ARGV[1])
local kind = ARGV[2]
if not seeds_type_ok(KEYS[1], kind) then return {0, 0} end
local workers, entries = 0, 0
for i = 3, #ARGV do
  local w = ARGV[i]
  local deadline = redis.call('ZSCORE', KEYS[3], w)
  if deadline and tonumber(deadline) < now then
    local mine = seeds_extract(KEYS[2], w .. '\n')
    seeds_return(KEYS[1], kind, mine)
    redis.call('ZREM', KEYS[3], w)
    workers = workers + 1
    entries = entries + #mine
  end
end
return {workers, entries}
