-- Fragment (not a script on its own): the dupefilter used by sync.lua and dupe_batch.lua.
--
-- dupe_open(mode, key_index, params) prepares a filter; `params` is a flat list taken from ARGV:
--   mode "bloom": nfilters, window_bits, max_items, then per filter i (oldest first): m_i, k_i, cum_i,
--                 nblocks_i, wpb_i
--                 where m_i = bits, k_i = hashes, cum_i = capacity of filters 0..i together, wpb_i =
--                 windows per block. KEYS[key_index] is the bloom HASH (field "n" = items inserted), then
--                 the block bitmaps of filter 0, filter 1, ... in order (nblocks_i keys each).
--   mode "set":   KEYS[key_index] is the SET of raw fingerprints; no params.
--   mode "none":  no deduplication.
-- dupe_add(d, t1, t2) test-and-sets one fingerprint and returns 1 if it was new, 0 if seen.
--   bloom: t1, t2 are the fingerprint's two 46-bit hashes (decimal strings), see bloom_item() below.
--   set:   t1 is the raw fingerprint.
-- dupe_can_insert(d, count) is false when `count` new items could need a filter whose keys were not passed
--   (or would take the filter past max_items: then d.err is set).
-- d.err / d.err_detail (reason, key) are set when the recorded item count ("n" of the bloom HASH) is not
--   a decimal integer in [0, max_items], or an insert would pass max_items (the bound bloom.py documents:
--   a small multiple of the declared capacity); the caller then answers {-2, reason, detail} and
--   writes nothing. Nothing here writes before dupe_add.
-- dupe_contains(d, t1, t2) tests without adding (1 = probably seen).
-- dupe_close(d) persists counters; returns the bloom item count (0 for other modes).
--
-- Bloom layout (scrapy_dist/bloom.py, HASHING = 3): every filter is cut into windows of window_bits
-- (4096) bits, and all k bits of an item lie in one window: window h1 mod (m / window_bits), and inside it
-- bit j at (a + j*b + j^2*c) mod window_bits with a, b (odd), c (even) from disjoint bits of h2, so the k
-- positions are distinct (two of them differ by (j-i)*(b + (i+j)*c), an odd multiple of j-i). A test
-- reads the window with one GETRANGE; an insert then SETBITs only the bits still clear. Each redis.call
-- costs about a microsecond whatever it does, so one read per filter instead of one per bit is what makes
-- the filter fast. One BITFIELD SET u1 ... per insert instead of the SETBITs was tried (issue 19) and
-- measured slower: 17.0 against 13.1 us of Redis CPU per insert (200,000 inserts, Redis 6.2), because
-- building its argument table in Lua costs more than the ~10 SETBIT calls it saves (1.0 us in all). Most
-- of an insert's cost is the script's own Lua arithmetic, not the Redis commands it calls.

local function dupe_open(mode, key_index, params)
  local d = {mode = mode, key = KEYS[key_index]}
  if mode ~= 'bloom' then return d end
  local nfilters = tonumber(params[1])
  d.wbits = tonumber(params[2])
  d.max_items = tonumber(params[3])
  d.wbytes = d.wbits / 8
  d.filters = {}
  d.ready = {}
  d.kmax = 0
  local ki = key_index + 1
  for i = 1, nfilters do
    local b = 3 + (i - 1) * 5
    local f = {m = tonumber(params[b + 1]), k = tonumber(params[b + 2]), cum = tonumber(params[b + 3]),
               nb = tonumber(params[b + 4]), wpb = tonumber(params[b + 5]), key0 = ki}
    f.nwin = f.m / d.wbits
    if f.k > d.kmax then d.kmax = f.k end
    ki = ki + f.nb
    d.filters[i] = f
  end
  local raw = redis.call('HGET', d.key, 'n') or '0'
  d.n = string.match(raw, '^%d+$') and #raw <= 16 and tonumber(raw) or nil
  if not d.n or d.n > d.max_items then
    d.err, d.err_detail, d.n = 'bloom_n', d.key, 0
  end
  d.n0 = d.n
  d.cur = 1
  while d.cur <= nfilters and d.filters[d.cur].cum <= d.n do d.cur = d.cur + 1 end
  return d
end

local function dupe_can_insert(d, count)
  if d.mode ~= 'bloom' then return true end
  if d.n + count > d.max_items then
    d.err, d.err_detail = 'bloom_bound', d.key
    return false
  end
  local last = #d.filters
  return d.filters[last].cum > d.n + count or false
end

-- MASK[r] is bit r of a byte as Redis numbers bits (bit 0 = most significant); HALF[r] = 2 * MASK[r].
local MASK, HALF = {}, {}
for r = 0, 7 do MASK[r] = 2 ^ (7 - r); HALF[r] = 2 ^ (8 - r) end

-- One item: h1 (picks the window) and the pattern (a, b, c) inside it. Everything below uses plain
-- arithmetic on small integers (exact in Lua's doubles, and much cheaper than math.fmod or bit.*
-- calls); only the window index, from the 46-bit h1, needs math.fmod.
local function bloom_item(d, t1, t2)
  local h2, w = tonumber(t2), d.wbits
  local half = w / 2
  return {h1 = tonumber(t1), a = math.floor(h2 / 2) % w, b = 2 * (math.floor(h2 / 8192) % half) + 1,
          c = 2 * (math.floor(h2 / 16777216) % half)}
end

-- Key and 0-based byte offset of the item's window in filter f.
local function bloom_window(d, f, it)
  local win = math.fmod(it.h1, f.nwin)
  local blk = math.floor(win / f.wpb)
  return KEYS[f.key0 + blk], (win - blk * f.wpb) * d.wbytes
end

-- Does window string s (possibly empty: a block not created yet) hold all k bits of the item?
local function bloom_window_has(d, s, f, it)
  if #s == 0 then return false end
  local w, b, c, x = d.wbits, it.b, it.c, it.a
  local byte = string.byte
  for j = 1, f.k do
    local r = x % 8
    if byte(s, (x - r) / 8 + 1) % HALF[r] < MASK[r] then return false end
    x = (x + b + (2 * j - 1) * c) % w
  end
  return true
end

local function bloom_has(d, f, it)
  local key, off = bloom_window(d, f, it)
  return bloom_window_has(d, redis.call('GETRANGE', key, off, off + d.wbytes - 1), f, it)
end

-- Blocks are created at their full size in one SET: growing a Redis string bit by bit (SETBIT,
-- SETRANGE) over-allocates up to 2x, which would double the filter's memory.
local function bloom_ready(d, f)
  if d.ready[f] then return end
  local size = f.wpb * d.wbytes
  for b = 0, f.nb - 1 do
    local key = KEYS[f.key0 + b]
    if redis.call('EXISTS', key) == 0 then
      redis.call('SET', key, string.rep('\0', size))
    end
  end
  d.ready[f] = true
end

-- Sets the item's k bits in filter f, given its window string s as read just before: one SETBIT per
-- bit still clear (about half of them in a filter nearing its capacity). Measured: a SETRANGE of the
-- changed span costs more, because building a new string of a few hundred bytes in Lua does.
local function bloom_put(d, f, it, s)
  bloom_ready(d, f)
  local key, off = bloom_window(d, f, it)
  local fresh = #s == 0
  local w, b, c, x = d.wbits, it.b, it.c, it.a
  local base = off * 8
  local byte = string.byte
  for j = 1, f.k do
    local r = x % 8
    if fresh or byte(s, (x - r) / 8 + 1) % HALF[r] < MASK[r] then
      redis.call('SETBIT', key, base + x, '1')
    end
    x = (x + b + (2 * j - 1) * c) % w
  end
end

local function dupe_add(d, t1, t2)
  if d.mode == 'none' then return 1 end
  if d.mode == 'set' then return redis.call('SADD', d.key, t1) end
  local it = bloom_item(d, t1, t2)
  -- newest filters hold most items: test them first; the current filter's window is kept for the insert
  local f = d.filters[d.cur]
  local key, off = bloom_window(d, f, it)
  local s = redis.call('GETRANGE', key, off, off + d.wbytes - 1)
  if bloom_window_has(d, s, f, it) then return 0 end
  for i = d.cur - 1, 1, -1 do
    if bloom_has(d, d.filters[i], it) then return 0 end
  end
  bloom_put(d, f, it, s)
  d.n = d.n + 1
  if d.n >= d.filters[d.cur].cum then d.cur = d.cur + 1 end
  return 1
end

-- dupe_contains(d, t1, t2): 1 if the fingerprint is (probably) in the filter, 0 if not; writes nothing.
local function dupe_contains(d, t1, t2)
  if d.mode == 'none' then return 0 end
  if d.mode == 'set' then return redis.call('SISMEMBER', d.key, t1) end
  local it = bloom_item(d, t1, t2)
  for i = math.min(d.cur, #d.filters), 1, -1 do
    if bloom_has(d, d.filters[i], it) then return 1 end
  end
  return 0
end

local function dupe_close(d)
  if d.mode ~= 'bloom' then return 0 end
  if d.n ~= d.n0 then redis.call('HINCRBY', d.key, 'n', d.n - d.n0) end
  return d.n
end
