-- Fragment (not a script on its own): the dupefilter used by sync.lua and dupe_batch.lua.
--
-- dupe_open(mode, key_index, params) prepares a filter; `params` is a flat list taken from ARGV:
--   mode "bloom": nfilters, block_bits, then per filter i (oldest first): m_i, k_i, cum_i, nblocks_i
--                 where m_i = bits, k_i = hashes, cum_i = capacity of filters 0..i together.
--                 KEYS[key_index] is the bloom HASH (field "n" = items inserted), then the block bitmaps of
--                 filter 0, filter 1, ... in order (nblocks_i keys each).
--   mode "set":   KEYS[key_index] is the SET of raw fingerprints; no params.
--   mode "none":  no deduplication.
-- dupe_add(d, t1, t2) test-and-sets one fingerprint and returns 1 if it was new, 0 if seen.
--   bloom: t1, t2 are the fingerprint's two 46-bit hashes (decimal strings); bit j of filter i is
--          (a + j*b + j^2*c) mod m_i, see probe() below.
--   set:   t1 is the raw fingerprint.
-- dupe_can_insert(d, count) is false when `count` new items could need a filter whose keys were not passed.
-- dupe_contains(d, t1, t2) tests without adding (1 = probably seen).
-- dupe_close(d) persists counters; returns the bloom item count (0 for other modes).

local function dupe_open(mode, key_index, params)
  local d = {mode = mode, key = KEYS[key_index]}
  if mode ~= 'bloom' then return d end
  local nfilters = tonumber(params[1])
  d.block_bits = tonumber(params[2])
  d.filters = {}
  d.ready = {}
  local ki = key_index + 1
  for i = 1, nfilters do
    local b = 2 + (i - 1) * 4
    local f = {m = tonumber(params[b + 1]), k = tonumber(params[b + 2]),
               cum = tonumber(params[b + 3]), nb = tonumber(params[b + 4]), key0 = ki}
    ki = ki + f.nb
    d.filters[i] = f
  end
  d.n = tonumber(redis.call('HGET', d.key, 'n') or '0')
  d.n0 = d.n
  d.cur = 1
  while d.cur <= nfilters and d.filters[d.cur].cum <= d.n do d.cur = d.cur + 1 end
  return d
end

local function dupe_can_insert(d, count)
  if d.mode ~= 'bloom' then return true end
  local last = #d.filters
  return d.filters[last].cum > d.n + count or false
end

-- Block key and offset of bit j of filter f for hashes h1, h2.
-- Bit positions: triple hashing, bit j at (a + j*b + j^2*c) mod m with a, b = h1, h2 mod m and c a
-- third hash mixed from the full h1 and h2. Plain double hashing (a + j*b) has a false-positive floor
-- of about n/m^2 -- two items agreeing on (h1 mod m, h2 mod m) share all k bits -- which is far above
-- the tiny error rates the chain gives its small first filters; the third term lowers it to n/m^3.
-- Positions are computed incrementally, every intermediate below 2^53, so Lua's doubles stay exact.
local C_MOD = 35184372088832  -- 2^45
local function probe(d, f, h1, h2)
  local m = f.m
  local b = math.fmod(h2, m)
  local c = math.fmod(math.fmod(math.floor(h1 / 64) * 1021 + h2, C_MOD), m)
  return {m = m, x = math.fmod(h1, m), b = b, c = c, j = 0, bb = d.block_bits, key0 = f.key0}
end

-- Block key and offset of the probe's current bit, then advance to the next one.
local function probe_next(p)
  local pos = p.x
  p.j = p.j + 1
  p.x = math.fmod(p.x + math.fmod(p.b + (2 * p.j - 1) * p.c, p.m), p.m)
  local blk = math.floor(pos / p.bb)
  return KEYS[p.key0 + blk], pos - blk * p.bb
end

-- Membership in one filter. Bits are read one GETBIT at a time, their positions computed lazily, so
-- a filter that does not hold the item usually answers after one or two bits. (Measured on Redis 6.2:
-- GETBIT/SETBIT cost less per bit than BITFIELD GET/SET from Lua, whose per-subcommand parsing dominates.)
local function bloom_has(d, f, h1, h2)
  local p = probe(d, f, h1, h2)
  for _ = 1, f.k do
    local key, off = probe_next(p)
    if redis.call('GETBIT', key, off) == 0 then return false end
  end
  return true
end

-- Blocks are created at their full size in one SET: growing a Redis string bit by bit (SETBIT,
-- BITFIELD) over-allocates up to 2x, which would double the filter's memory.
local function bloom_ready(d, f)
  if d.ready[f] then return end
  for b = 0, f.nb - 1 do
    local key = KEYS[f.key0 + b]
    if redis.call('EXISTS', key) == 0 then
      local bits = math.min(d.block_bits, f.m - b * d.block_bits)
      redis.call('SET', key, string.rep('\0', math.ceil(bits / 8)))
    end
  end
  d.ready[f] = true
end

local function bloom_put(d, f, h1, h2)
  bloom_ready(d, f)
  local p = probe(d, f, h1, h2)
  for _ = 1, f.k do
    local key, off = probe_next(p)
    redis.call('SETBIT', key, off, 1)
  end
end

local function dupe_add(d, t1, t2)
  if d.mode == 'none' then return 1 end
  if d.mode == 'set' then return redis.call('SADD', d.key, t1) end
  local h1, h2 = tonumber(t1), tonumber(t2)
  -- newest filters hold most items: test them first
  for i = d.cur, 1, -1 do
    if bloom_has(d, d.filters[i], h1, h2) then return 0 end
  end
  bloom_put(d, d.filters[d.cur], h1, h2)
  d.n = d.n + 1
  if d.n >= d.filters[d.cur].cum then d.cur = d.cur + 1 end
  return 1
end

-- dupe_contains(d, t1, t2): 1 if the fingerprint is (probably) in the filter, 0 if not; writes nothing.
local function dupe_contains(d, t1, t2)
  if d.mode == 'none' then return 0 end
  if d.mode == 'set' then return redis.call('SISMEMBER', d.key, t1) end
  local h1, h2 = tonumber(t1), tonumber(t2)
  for i = math.min(d.cur, #d.filters), 1, -1 do
    if bloom_has(d, d.filters[i], h1, h2) then return 1 end
  end
  return 0
end

local function dupe_close(d)
  if d.mode ~= 'bloom' then return 0 end
  if d.n ~= d.n0 then redis.call('HINCRBY', d.key, 'n', d.n - d.n0) end
  return d.n
end
