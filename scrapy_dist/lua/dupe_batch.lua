-- dupe_batch: test-and-set (or only test) a batch of fingerprints atomically -- the dupefilter's own
-- path, used by BloomDupeFilter.request_seen under Scrapy's default scheduler, by `contains` checks and
-- by the benchmarks.
-- KEYS: the dupefilter keys as described in dupe.lua (bloom HASH then block bitmaps, or the SET).
-- ARGV[1] 'add' (test-and-set) or 'check' (test only), ARGV[2] mode, ARGV[3] P = number of dupe params,
--      ARGV[4 .. 3+P] dupe params, then pairs t1, t2 per fingerprint.
-- Returns {flags, n}: flags is a string with one '1' (new) or '0' (seen) per fingerprint; n is the
-- bloom item count after the call; or {-1, n} (nothing written) when a filter beyond the passed keys
-- could be needed: the caller retries with keys for more filters; or {-2, reason, key} (nothing written)
-- when the recorded count is garbage or the insert would pass the filter's bound (see dupe.lua).
local op = ARGV[1]
local mode = ARGV[2]
local P = tonumber(ARGV[3])
local params = {}
for i = 1, P do params[i] = ARGV[3 + i] end
local first = 4 + P
local count = (#ARGV - first + 1) / 2
local d = dupe_open(mode, 1, params)
if d.err then return {-2, d.err, d.err_detail} end
if op == 'add' and not dupe_can_insert(d, count) then
  if d.err then return {-2, d.err, d.err_detail} end
  return {-1, d.n}
end
local flags = {}
for i = 0, count - 1 do
  local t1, t2 = ARGV[first + 2 * i], ARGV[first + 2 * i + 1]
  if op == 'add' then
    flags[#flags + 1] = dupe_add(d, t1, t2)
  else
    flags[#flags + 1] = 1 - dupe_contains(d, t1, t2)
  end
end
return {table.concat(flags), dupe_close(d)}
