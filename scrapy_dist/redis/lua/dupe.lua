-- Fragment (not a script on its own): the dupefilter used by sync.lua and dupe_batch.lua.
--
-- dupe_open(mode, key_index, params, now) prepares a filter; `params` is a flat list taken from ARGV, `now`
-- the call's time (unix seconds: the server's, or the one a test injects). KEYS[key_index] is always the
-- FORGOTTEN set ({spider}:forgotten: "t1:t2" of bloom fingerprints made new again, see dupe_forget; a key
-- of another type there is ignored); the filter's own keys follow it, from key_index + 1:
--   mode "bloom":    params nfilters, window_bits, max_items, then per filter i (oldest first): m_i, k_i,
--                    cum_i, nblocks_i, wpb_i, where m_i = bits, k_i = hashes, cum_i = capacity of filters
--                    0..i together, wpb_i = windows per block, then probe ('1': a probe key follows the
--                    blocks; together: a CHAIN's params). KEYS: the bloom HASH (field "n" = items
--                    inserted), then the block bitmaps of filter 0, filter 1, ... in order (nblocks_i keys
--                    each), then the probe: the first block of the filter after the last passed.
--   mode "bloomgen": DUPEFILTER_TTL (dupefilter/generations.py). params span, G, lo, count, then one
--                    chain's params (every generation has the same). A call at `now` tests generations
--                    cur-G+1 .. cur+1 (cur = floor(now / span); cur+1 only a worker whose clock is ahead
--                    writes) and inserts into cur. KEYS: the crawl's bloom HASH (field "live" written),
--                    then for each generation e = lo .. lo+count-1 its HASH {spider}:bloom:g<e>, blocks and
--                    probe, as for "bloom", created to expire (e+G)*span - now seconds away. The live
--                    generations must be among those passed (else d.err 'bloom_clock').
--   mode "set":      KEYS: the SET of raw fingerprints; no params.
--   mode "setttl":   params ttl; KEYS: the ZSET fingerprint -> unix time it expires. A fingerprint whose
--                    time has passed is new again; dupe_close drops a bounded number of expired ones.
--   mode "none":     no deduplication.
-- dupe_add(d, t1, t2) test-and-sets one fingerprint and returns 1 if it was new, 0 if seen.
--   bloom: t1, t2 are the fingerprint's two 46-bit hashes (decimal strings), see bloom_item() below.
--   set:   t1 is the raw fingerprint.
-- dupe_forget(d, t1, t2) makes a fingerprint new again: set modes remove it; bloom modes add "t1:t2" to
--   FORGOTTEN, which dupe_add consults before the bloom and empties as it admits (each forgotten URL once).
-- dupe_can_insert(d, count) is false when `count` new items could need a filter whose keys were not passed
--   (or would take the filter past max_items: then d.err is set).
-- d.err / d.err_detail (reason, key) are set when an insert would pass max_items (bloom.py's
--   MAX_OVERSHOOT) or the generations passed miss a live one ('bloom_clock'); the caller then answers
--   {-2, reason, detail} and writes nothing. Nothing here writes before dupe_add but repairs, each named in
--   DUPE_REPAIRED (docs/frontier.md, "Scripts validate before they write"): a key of another Redis type is
--   moved aside (move_aside) or, for a block, replaced by an empty one (window_read); a block cut short
--   reads as clear bits; an item count that is garbage or that the blocks contradict is recounted
--   (chain_recount) and written back by dupe_close.
-- dupe_contains(d, t1, t2) tests without adding (1 = probably seen).
-- dupe_close(d) persists counters; returns dupe_count(d): the bloom item count of the fullest live chain
--   (it decides how many keys the next call passes; 0 for other modes). A call that writes nothing answers
--   {-1, dupe_count(d)}.
--
-- Bloom layout (dupefilter/bloom.py; docs/frontier.md, "The bloom filter"): every filter is cut into
-- windows of window_bits (4096) bits, and all k bits of an item lie in one window: window h1 mod
-- (m / window_bits), and inside it bit j at (a + j*b + j^2*c) mod window_bits with a, b (odd), c (even)
-- from disjoint bits of h2, so the k positions are distinct (two of them differ by (j-i)*(b + (i+j)*c),
-- an odd multiple of j-i). A test reads the window with one GETRANGE; an insert then SETBITs only the bits
-- still clear: one redis.call per filter instead of one per bit, since each call has a fixed cost.

-- The call's time: `raw` (unix seconds a caller or a test injects), else the server's clock.
local function call_now(raw)
  local now = tonumber(raw)
  if now then return now end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end

-- Keys repaired by this call (named in the sync answer's 'repaired'): bloom blocks and bloom HASHes.
local DUPE_REPAIRED = {}

-- Does any block of filter f exist? The first block answers in one EXISTS of one key (every call asks
-- this of the filter its count names: blocks are created together); only when it is missing are the
-- others asked (someone deleted it), over at most 500 keys at a time (unpack has a limit).
local function blocks_exist(f)
  if redis.call('EXISTS', KEYS[f.key0]) == 1 then return true end
  for first = 1, f.nb - 1, 500 do
    local keys = {}
    for b = first, math.min(first + 499, f.nb - 1) do keys[#keys + 1] = KEYS[f.key0 + b] end
    if redis.call('EXISTS', unpack(keys)) > 0 then return true end
  end
  return false
end

-- Bytes of a block read to estimate its filter's fill (chain_recount): 128 windows, a few microseconds.
local SAMPLE_BYTES = 65536

-- Items in filter f, estimated from the fill p of a sample of its blocks (items spread evenly over the
-- windows, k bits each): -(m/k) ln(1 - p).
local function filter_items(f)
  for b = 0, f.nb - 1 do
    local key = KEYS[f.key0 + b]
    local len = redis.pcall('STRLEN', key)
    if type(len) == 'number' and len > 0 then
      local ones = redis.call('BITCOUNT', key, 0, SAMPLE_BYTES - 1)
      local p = math.min(ones / (math.min(len, SAMPLE_BYTES) * 8), 0.999)
      return math.floor(-(f.m / f.k) * math.log(1 - p))
    end
  end
  return 0
end

-- Does chain c's recorded count agree with its blocks? Blocks are created by the insert that counts a
-- filter's first item, so the filter holding item n exists and the one after it does not. Only filters
-- whose keys were passed are checked (at most two EXISTS); the one after the last passed is seen through
-- the probe key (bloom.py, block_coords).
local function chain_consistent(c)
  local fs = c.filters
  local holder = 0
  if c.n > 0 then
    holder = 1
    while holder <= #fs and fs[holder].cum < c.n do holder = holder + 1 end
  end
  -- past the keys passed (the caller then asks for more): the last filter passed must exist
  if holder > #fs then return blocks_exist(fs[#fs]) end
  if holder > 0 and not blocks_exist(fs[holder]) then return false end
  -- the filter after: its first block, as the probe (a filter's blocks are created together)
  local after = holder < #fs and KEYS[fs[holder + 1].key0] or c.probe
  return not after or redis.call('EXISTS', after) == 0
end

-- A count for chain c from its blocks: the newest filter that exists is the one being filled; the ones
-- before it are full. When the chain goes on past the keys passed (the probe exists, or no probe was
-- passed and the last filter exists), the last filter's capacity is answered, so that the call asks for
-- more keys (nothing written) and recounts with them.
local function chain_recount(c)
  local fs = c.filters
  for i = #fs, 1, -1 do
    local f = fs[i]
    if blocks_exist(f) then
      local before = i > 1 and fs[i - 1].cum or 0
      local further = i == #fs and (not c.probe or redis.call('EXISTS', c.probe) == 1)
      if further and f.cum < c.max_items then return f.cum end
      return math.min(before + math.min(f.cum - before, filter_items(f)), c.max_items)
    end
  end
  return 0
end

-- One bloom chain (a scalable filter): its HASH, then its blocks from KEYS[ki] (and, when the params end
-- in 1, the probe: the first block of the filter after them); params from params[p].
-- Returns the chain and the index of the first key after its keys.
local function chain_open(d, hash_key, ki, params, p)
  local c = {key = hash_key, filters = {}, ready = {}, wbits = tonumber(params[p + 1]),
             max_items = tonumber(params[p + 2])}
  c.wbytes = c.wbits / 8
  local nfilters = tonumber(params[p])
  for i = 1, nfilters do
    local b = p + 2 + (i - 1) * 5
    local f = {m = tonumber(params[b + 1]), k = tonumber(params[b + 2]), cum = tonumber(params[b + 3]),
               nb = tonumber(params[b + 4]), wpb = tonumber(params[b + 5]), key0 = ki}
    f.nwin = f.m / c.wbits
    ki = ki + f.nb
    c.filters[i] = f
  end
  if params[p + 3 + nfilters * 5] == '1' then
    c.probe = KEYS[ki]
    ki = ki + 1
  end
  local raw = redis.pcall('HGET', hash_key, 'n') or '0'
  local moved = type(raw) == 'table'
  if moved then  -- the HASH holds another Redis type (WRONGTYPE): not ours, moved aside; then recounted
    move_aside(hash_key, DUPE_REPAIRED)
    raw = '0'
  end
  c.n = string.match(raw, '^%d+$') and #raw <= 16 and tonumber(raw) or nil
  if not c.n or c.n > c.max_items or not chain_consistent(c) then
    c.n, c.fix = chain_recount(c), true
    if not moved then DUPE_REPAIRED[#DUPE_REPAIRED + 1] = hash_key end
    d.fixed[#d.fixed + 1] = c
  end
  c.n0 = c.n
  c.cur = 1
  while c.cur <= nfilters and c.filters[c.cur].cum <= c.n do c.cur = c.cur + 1 end
  return c, ki
end

local function dupe_open(mode, key_index, params, now)
  local d = {mode = mode, forgotten = KEYS[key_index], key = KEYS[key_index + 1], now = now, fixed = {}}
  if mode == 'set' then type_ok(d.key, 'set', DUPE_REPAIRED) end
  if mode == 'setttl' then
    d.ttl = tonumber(params[1])
    type_ok(d.key, 'zset', DUPE_REPAIRED)
  end
  if mode ~= 'bloom' and mode ~= 'bloomgen' then return d end
  -- FORGOTTEN of another type (someone else's data) is ignored, not a reason to stop deduplicating
  local ft = redis.call('TYPE', d.forgotten)['ok']
  d.forgot_ok = ft == 'none' or ft == 'set'
  d.forgot = ft == 'set' and redis.call('SCARD', d.forgotten) > 0
  if mode == 'bloom' then
    d.chain = chain_open(d, d.key, key_index + 2, params, 1)
    d.older = {}
    return d
  end
  -- generations: keys of generation lo + i start at ki; the live ones are opened, newest first
  local span, G, lo, count = tonumber(params[1]), tonumber(params[2]), tonumber(params[3]),
    tonumber(params[4])
  local cur = math.floor(now / span)
  if lo > cur - G + 1 or lo + count - 1 < cur then
    d.err, d.err_detail = 'bloom_clock', d.key
    return d
  end
  local chains = {}
  local ki = key_index + 2
  for e = lo, lo + count - 1 do
    local c
    c, ki = chain_open(d, KEYS[ki], ki + 1, params, 5)
    c.expire_ms = math.max(1, math.floor(((e + G) * span - now) * 1000))
    if e > cur - G and e <= cur then chains[#chains + 1] = c end
    -- the generation after the current one holds items only when a worker whose clock is ahead wrote
    -- them (the dupefilter's own path takes the worker's clock): test it too, so skew never doubles a URL
    if e == cur + 1 and c.n > 0 then d.ahead = c end
  end
  d.chain = chains[#chains]
  -- the other chains a lookup tests, newest first; empty ones are skipped (no bit of theirs can be set)
  d.older = {d.ahead}
  for i = #chains - 1, 1, -1 do
    if chains[i].n > 0 then d.older[#d.older + 1] = chains[i] end
  end
  return d
end

-- Does chain c hold keys for `count` more items (filters past its last passed one are not needed)?
local function chain_has_room(c, count)
  return c.filters[#c.filters].cum > c.n + count
end

local function dupe_can_insert(d, count)
  if not d.chain then return true end
  local c = d.chain
  for _, o in ipairs(d.older) do
    if not chain_has_room(o, 0) then return false end
  end
  -- a count past the keys passed is first checked against its filter's blocks, once they are passed
  if not chain_has_room(c, 0) then return false end
  if c.n + count > c.max_items then
    d.err, d.err_detail = 'bloom_bound', c.key
    return false
  end
  return chain_has_room(c, count)
end

-- MASK[r] is bit r of a byte as Redis numbers bits (bit 0 = most significant); HALF[r] = 2 * MASK[r].
local MASK, HALF = {}, {}
for r = 0, 7 do MASK[r] = 2 ^ (7 - r); HALF[r] = 2 ^ (8 - r) end

-- One item: h1 (picks the window) and the pattern (a, b, c) inside it. Everything below uses plain
-- arithmetic on small integers (exact in Lua's doubles, and much cheaper than math.fmod or bit.*
-- calls); only the window index, from the 46-bit h1, needs math.fmod.
local function bloom_item(c, t1, t2)
  local h2, w = tonumber(t2), c.wbits
  local half = w / 2
  return {h1 = tonumber(t1), a = math.floor(h2 / 2) % w, b = 2 * (math.floor(h2 / 8192) % half) + 1,
          c = 2 * (math.floor(h2 / 16777216) % half)}
end

-- Key and 0-based byte offset of the item's window in filter f.
local function bloom_window(c, f, it)
  local win = math.fmod(it.h1, f.nwin)
  local blk = math.floor(win / f.wpb)
  return KEYS[f.key0 + blk], (win - blk * f.wpb) * c.wbytes
end

-- Does window string s (possibly empty: a block not created yet) hold all k bits of the item?
local function bloom_window_has(c, s, f, it)
  if #s == 0 then return false end
  local w, b, cc, x = c.wbits, it.b, it.c, it.a
  local byte = string.byte
  for j = 1, f.k do
    local r = x % 8
    if byte(s, (x - r) / 8 + 1) % HALF[r] < MASK[r] then return false end
    x = (x + b + (2 * j - 1) * cc) % w
  end
  return true
end

-- Blocks are created at their full size in one SET: growing a Redis string bit by bit (SETBIT,
-- SETRANGE) over-allocates up to 2x, which would double the filter's memory. A generation's blocks get its
-- expiry with them.
local function block_create(c, f, key)
  local zeros = string.rep('\0', f.wpb * c.wbytes)
  if c.expire_ms then
    redis.call('SET', key, zeros, 'PX', c.expire_ms)
  else
    redis.call('SET', key, zeros)
  end
end

local function bloom_ready(c, f)
  if c.ready[f] then return end
  for b = 0, f.nb - 1 do
    local key = KEYS[f.key0 + b]
    if redis.call('EXISTS', key) == 0 then block_create(c, f, key) end
  end
  c.ready[f] = true
end

-- The window at byte `off` of block `key` of filter f: '' when the block does not exist yet. Garbage there
-- is repaired, never an error half way through a call (which would leave the call's earlier requests marked
-- seen but not queued): a block of another Redis type is replaced by an empty block (whatever it held is
-- no filter of ours), and a block cut short reads as clear bits past its end (SETBIT extends it).
local function window_read(c, f, key, off)
  local s = redis.pcall('GETRANGE', key, off, off + c.wbytes - 1)
  if type(s) == 'table' then
    if not string.find(tostring(s.err), 'WRONGTYPE', 1, true) then error(s.err) end
    redis.call('DEL', key)
    block_create(c, f, key)
    DUPE_REPAIRED[#DUPE_REPAIRED + 1] = key
    redis.log(redis.LOG_WARNING, 'scrapy-dist: ' .. key .. ' held another Redis type: now an empty block')
    return string.rep('\0', c.wbytes)
  end
  if #s > 0 and #s < c.wbytes then s = s .. string.rep('\0', c.wbytes - #s) end
  return s
end

local function bloom_has(c, f, it)
  local key, off = bloom_window(c, f, it)
  return bloom_window_has(c, window_read(c, f, key, off), f, it)
end

-- Sets the item's k bits in filter f, given its window string s as read just before: one SETBIT per
-- bit still clear (about half of them in a filter nearing its capacity), cheaper than building the
-- changed span in Lua for one SETRANGE.
local function bloom_put(c, f, it, s)
  local fresh = #s == 0
  -- a window read back non-empty lies in a block that exists; an empty one may be a block not created yet
  if fresh then bloom_ready(c, f) end
  local key, off = bloom_window(c, f, it)
  local w, b, cc, x = c.wbits, it.b, it.c, it.a
  local base = off * 8
  local byte = string.byte
  for j = 1, f.k do
    local r = x % 8
    if fresh or byte(s, (x - r) / 8 + 1) % HALF[r] < MASK[r] then
      redis.call('SETBIT', key, base + x, '1')
    end
    x = (x + b + (2 * j - 1) * cc) % w
  end
end

-- Is the item in chain c's filters 1 .. upto (newest first)?
local function chain_has(c, it, upto)
  for i = math.min(upto, #c.filters), 1, -1 do
    if bloom_has(c, c.filters[i], it) then return true end
  end
  return false
end

local function set_seen(d, t1)
  if d.mode == 'set' then return redis.call('SISMEMBER', d.key, t1) == 1 end
  local expires = redis.call('ZSCORE', d.key, t1)
  return expires ~= false and tonumber(expires) > d.now
end

local function dupe_add(d, t1, t2)
  if d.mode == 'none' then return 1 end
  if d.mode == 'set' then return redis.call('SADD', d.key, t1) end
  if d.mode == 'setttl' then
    if set_seen(d, t1) then return 0 end
    redis.call('ZADD', d.key, d.now + d.ttl, t1)
    d.added = (d.added or 0) + 1
    return 1
  end
  local forgotten = d.forgot and redis.call('SREM', d.forgotten, t1 .. ':' .. t2) == 1
  local c = d.chain
  local it = bloom_item(c, t1, t2)
  -- newest filters hold most items: test them first; the current filter's window is kept for the insert
  local f = c.filters[c.cur]
  local key, off = bloom_window(c, f, it)
  local s = window_read(c, f, key, off)
  if not forgotten then
    if bloom_window_has(c, s, f, it) or chain_has(c, it, c.cur - 1) then return 0 end
    for _, o in ipairs(d.older) do
      if chain_has(o, it, o.cur) then return 0 end
    end
  end
  bloom_put(c, f, it, s)
  c.n = c.n + 1
  if c.n >= f.cum then c.cur = c.cur + 1 end
  return 1
end

-- dupe_contains(d, t1, t2): 1 if the fingerprint is (probably) in the filter, 0 if not; writes nothing.
local function dupe_contains(d, t1, t2)
  if d.mode == 'none' then return 0 end
  if d.mode == 'set' or d.mode == 'setttl' then return set_seen(d, t1) and 1 or 0 end
  if d.forgot and redis.call('SISMEMBER', d.forgotten, t1 .. ':' .. t2) == 1 then return 0 end
  local it = bloom_item(d.chain, t1, t2)
  if chain_has(d.chain, it, d.chain.cur) then return 1 end
  for _, o in ipairs(d.older) do
    if chain_has(o, it, o.cur) then return 1 end
  end
  return 0
end

local function dupe_forget(d, t1, t2)
  if d.mode == 'set' then redis.call('SREM', d.key, t1)
  elseif d.mode == 'setttl' then redis.call('ZREM', d.key, t1)
  elseif d.chain and d.forgot_ok then
    redis.call('SADD', d.forgotten, t1 .. ':' .. t2)
    d.forgot = true
  end
end

local function dupe_count(d)
  if not d.chain then return 0 end
  local most = d.chain.n
  if d.mode == 'bloomgen' then
    for _, o in ipairs(d.older) do
      if o.n > most then most = o.n end
    end
  end
  return most
end

-- a chain's count written whole: recounted (c.fix), or changed by this call's inserts
local function chain_save(c)
  if c.fix then
    redis.call('HSET', c.key, 'n', c.n)
  elseif c.n ~= c.n0 then
    redis.call('HINCRBY', c.key, 'n', c.n - c.n0)
  else
    return false
  end
  if c.expire_ms then redis.call('PEXPIRE', c.key, c.expire_ms) end
  return true
end

local function dupe_close(d)
  if d.mode == 'setttl' then
    -- expired fingerprints are gone from lookups already; drop a bounded number of them from memory
    local old = redis.call('ZRANGEBYSCORE', d.key, '-inf', d.now, 'LIMIT', 0, 2 * (d.added or 0) + 64)
    if #old > 0 then redis.call('ZREM', d.key, unpack(old)) end
    return 0
  end
  if not d.chain then return 0 end
  local c = d.chain
  local changed = chain_save(c)
  for _, o in ipairs(d.fixed) do
    if o ~= c then chain_save(o) end
  end
  if d.mode == 'bloomgen' and changed then
    local live = c.n
    for _, o in ipairs(d.older) do live = live + o.n end
    redis.call('HSET', d.key, 'live', live)
  end
  return dupe_count(d)
end
