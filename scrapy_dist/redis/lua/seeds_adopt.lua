-- seeds_adopt: give the seeds held by workers whose lease ran out (dead, or stalled longer than the
-- lease) back to the seeds key, so a live worker takes them. Each worker is checked again here, so two
-- workers adopting the same one at once give its seeds back once.
--
-- KEYS[1] seeds key (LIST, SET or ZSET)   KEYS[2] processing LIST   KEYS[3] workers ZSET
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] kind of the seeds key: 'list', 'set' or 'zset'
-- ARGV[3] horizon and ARGV[4] cap, as for seeds_take   ARGV[5..] worker ids
-- Returns {workers adopted, their entries given back, entries of no live worker given back too (garbage,
-- see seeds_pass)}

local now = seeds_now(ARGV[1])
local kind = ARGV[2]
local horizon = now + tonumber(ARGV[3])
if not seeds_type_ok(KEYS[1], kind) then return {0, 0, 0} end
local adopt, workers = {}, 0
for i = 5, #ARGV do
  local w = ARGV[i]
  local deadline = tonumber(redis.call('ZSCORE', KEYS[3], w))
  if deadline and (deadline < now or deadline > horizon) then
    adopt[w] = true
    redis.call('ZREM', KEYS[3], w)
    workers = workers + 1
  end
end
if workers == 0 then return {0, 0, 0} end
-- one pass for every worker adopted here (it was one per worker)
local out, strays = seeds_pass(KEYS[2], KEYS[3], adopt, horizon, tonumber(ARGV[4]))
seeds_return(KEYS[1], kind, out)
return {workers, #out - strays, strays}
