-- dupe_batch: test-and-set a batch of fingerprints atomically (the dupefilter's own path, used by
-- BloomDupeFilter.request_seen under Scrapy's default scheduler and by the benchmarks).
-- KEYS: the dupefilter keys as described in dupe.lua (bloom HASH then block bitmaps, or the SET).
-- ARGV[1] mode, ARGV[2] P = number of dupe params, ARGV[3 .. 2+P] dupe params,
--      then pairs t1, t2 per fingerprint.
-- Returns {flags, n}: flags is a string with one '1' (new) or '0' (seen) per fingerprint; n is the
-- bloom item count after the call; or {-1, n} (nothing written) when a filter beyond the passed keys
-- could be needed: the caller retries with keys for more filters.
local mode = ARGV[1]
local P = tonumber(ARGV[2])
local params = {}
for i = 1, P do params[i] = ARGV[2 + i] end
local first = 3 + P
local count = (#ARGV - first + 1) / 2
local d = dupe_open(mode, 1, params)
if not dupe_can_insert(d, count) then return {-1, d.n} end
local flags = {}
for i = 0, count - 1 do
  flags[#flags + 1] = dupe_add(d, ARGV[first + 2 * i], ARGV[first + 2 * i + 1])
end
return {table.concat(flags), dupe_close(d)}
