-- dupe_batch: test-and-set (or only test, or forget) a batch of fingerprints atomically -- the dupefilter's
-- own path, used by BloomDupeFilter.request_seen under Scrapy's default scheduler, by `contains` checks,
-- by `scrapy-dist forget` and by the benchmarks.
-- KEYS: the dupefilter keys as described in dupe.lua (the FORGOTTEN set, then the filter's keys).
-- ARGV[1] 'add' (test-and-set), 'check' (test only) or 'forget' (make new again), ARGV[2] mode, ARGV[3] now
--      (unix seconds; '' = the server's clock), ARGV[4] P = number of dupe params, ARGV[5 .. 4+P] dupe
--      params, then pairs t1, t2 per fingerprint.
-- Returns {flags, n, repaired}: flags is a string with one '1' (new) or '0' (seen) per fingerprint ('1'
-- each for 'forget'); n is the bloom item count after the call; repaired names the keys whose garbage
-- the call repaired (dupe.lua's DUPE_REPAIRED: a recounted item count, a block of another type). Or
-- {-1, n} (nothing written) when a filter beyond the passed keys could be needed: the caller retries with
-- keys for more filters; or {-2, reason, key} (nothing written) when the insert would pass the filter's
-- bound or the generations passed miss a live one (see dupe.lua).
local op = ARGV[1]
local mode = ARGV[2]
local now = call_now(ARGV[3])
local n_params = tonumber(ARGV[4])
local params = {}
for i = 1, n_params do params[i] = ARGV[4 + i] end
local first = 5 + n_params
local count = (#ARGV - first + 1) / 2
local d = dupe_open(mode, 1, params, now)
if d.err then return {-2, d.err, d.err_detail} end
if not dupe_can_insert(d, op == 'add' and count or 0) then
  if d.err then return {-2, d.err, d.err_detail} end
  return {-1, dupe_count(d)}
end
local flags = {}
for i = 0, count - 1 do
  local t1, t2 = ARGV[first + 2 * i], ARGV[first + 2 * i + 1]
  if op == 'add' then
    flags[#flags + 1] = dupe_add(d, t1, t2)
  elseif op == 'forget' then
    dupe_forget(d, t1, t2)
    flags[#flags + 1] = 1
  else
    flags[#flags + 1] = 1 - dupe_contains(d, t1, t2)
  end
end
return {table.concat(flags), dupe_close(d), DUPE_REPAIRED}
