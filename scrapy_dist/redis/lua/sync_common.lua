-- Fragment (not a script on its own): the sync script's argument checks and queue-member helpers, shared by
-- the sync_*.lua fragments and sync.lua (scrapy_dist/redis/scripts.py puts them together).
--
-- KEYS, ARGV: SYNC_KEYS (with SYNC_TYPES), SYNC_HEAD and SYNC_SECTIONS are declared in Python
--   (scrapy_dist/frontier/shard.py) and put before this fragment as Lua tables (sync_prelude): KEYS are the
--   frontier keys then the dupefilter keys (dupe.lua); ARGV is the head by name, n_params and n_params dupe params, then
--   the sections, each a count followed by its items.
-- Returns (sync.lua) a flat name, value list (frontier/shard.py's decode_sync_result reads it by name), or
--   {-1, bloom_n} (nothing written: the bloom filter needs keys for more filters), or
--   {-2, reason, detail} (nothing written: a value read from Redis cannot be used; see sync_check).

-- records in one queue chunk (a member holding several requests, see sync_enqueue.lua)
local CHUNK_RECORDS = 16
-- seqs are 6 bytes; the counter is refused (repaired) long before it could wrap
local MAXSEQ = 281474976710655  -- 2^48 - 1
local SEQ_LIMIT = 140737488355328  -- 2^47
-- counters we HINCRBY stay far from Redis's 64-bit overflow (and exact in Lua's doubles)
local COUNTER_LIMIT = 4503599627370496  -- 2^52

-- KEYS and ARGV by name: set by sync_call (sync.lua) at the start of every call
local key_of, call_args
local DUPE_KEY = #SYNC_KEYS + 1

-- The sections: name -> {pos = ARGV index of the first item, n = items, w = width of an item}, in `out`
-- (sync_names' third table).
local function sync_sections(out, pos, polite)
  for _, s in ipairs(SYNC_SECTIONS) do
    local n = tonumber(ARGV[pos])
    local w = s[2] + (polite and s[3] or 0)
    out[s[1]] = {pos = pos + 1, n = n, w = w}
    pos = pos + 1 + n * w
  end
  return out
end

-- A finite number as Redis takes it for a score (nil if s is not one).
local function score_of(s)
  local x = tonumber(s)
  if not x or x ~= x or x == math.huge or x == -math.huge then return nil end
  return x
end

-- A decimal integer string within +-limit (nil if not).
local function int_of(s, limit)
  if type(s) ~= 'string' or not string.match(s, '^%-?%d+$') or #s > 17 then return nil end
  local x = tonumber(s)
  if math.abs(x) > limit then return nil end
  return x
end

local function u16(n) return string.char(math.floor(n / 256), n % 256) end

local function seq6(s)
  return struct.pack('>I6', s)
end

local function seq_value(six)
  local s = 0
  for i = 1, 6 do s = s * 256 + string.byte(six, i) end
  return s
end

-- A queue member split into its singles: {singles} or nil, reason. The shape is checked before anything
-- is split, and the work is bounded: a chunk holds at most CHUNK_RECORDS records and must end exactly
-- at its last record; a single is at most max_entry bytes of payload. A member failing that is rejected
-- whole, as one record (sync_reject_member), whatever it holds.
local function chunk_singles(member, max_entry)
  local size = #member
  if size < 7 or string.byte(member, 7) ~= 0 then
    if size > max_entry + 6 then return nil, 'entry_too_large' end
    return {member}
  end
  if size > 7 + CHUNK_RECORDS * (8 + max_entry) then return nil, 'chunk_too_large' end
  local out, p = {}, 8
  while p <= size do
    if #out >= CHUNK_RECORDS then return nil, 'chunk_too_many_records' end
    if p + 1 > size then return nil, 'chunk_truncated' end
    local len = string.byte(member, p) * 256 + string.byte(member, p + 1)
    if p + 7 + len > size then return nil, 'chunk_truncated' end
    out[#out + 1] = string.sub(member, p + 2, p + 7 + len)
    p = p + 8 + len
  end
  if #out == 0 then return nil, 'chunk_empty' end
  return out
end

-- The nonce of a queue member's signed payload (version 3: version, 16-byte tag, 8-byte nonce, body;
-- scrapy_dist/wire/entrypolicy.py), or nil: an unsigned entry has none. The tag itself cannot be checked
-- here (Lua has no secret): a member whose nonce was forged was never the crawl's own, and the worker
-- that decodes it rejects it (bad_tag); a genuine nonce cannot be changed without breaking the tag.
local function entry_nonce(state, m)
  local p = 7
  if state.polite then
    local z = string.find(m, '\0', 1, true)
    if not z then return nil end
    p = z + 18
  end
  if string.byte(m, p) ~= 3 or #m < p + 24 then return nil end
  return string.sub(m, p + 17, p + 24)
end

-- The nonces of the entries handed out (KEYS spent, nonce -> when): claim remembers one when it leases
-- it, and a copy of it is rejected when leased (replayed) while it is in flight and after it was
-- acknowledged. Forgotten again only when the lease goes back to the queue unfinished (unremember: a
-- lease that ran out, a release); remember records it again (a late ack of such a lease). Trimmed to the
-- newest replay_memory by sync.lua.
local function remember(state, m)
  if state.replay_memory <= 0 then return end
  local nonce = entry_nonce(state, m)
  if nonce then
    redis.call('ZADD', key_of.spent, state.now_s, nonce)
    state.remembered = state.remembered + 1
  end
end

local function unremember(state, m)
  if state.replay_memory <= 0 then return end
  local nonce = entry_nonce(state, m)
  if nonce then redis.call('ZREM', key_of.spent, nonce) end
end

-- Whether member m may be leased, remembering it if so (one ZADD NX): false for a copy of an entry
-- already handed out (in flight or acknowledged).
local function claim(state, m)
  if state.replay_memory <= 0 then return true end
  local nonce = entry_nonce(state, m)
  if not nonce then return true end
  if redis.call('ZADD', key_of.spent, 'NX', state.now_s, nonce) == 0 then return false end
  state.remembered = state.remembered + 1
  return true
end

local function hex_head(s, n)
  return (string.gsub(string.sub(s, 1, n), '.', function(c) return string.format('%02x', string.byte(c)) end))
end

-- A capped record list: push, then keep only the newest `maxlen` records (0 = no cap).
local function push_capped(key, record, maxlen)
  redis.call('RPUSH', key, record)
  if maxlen > 0 then redis.call('LTRIM', key, -maxlen, -1) end
end
