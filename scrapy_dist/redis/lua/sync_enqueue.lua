-- Fragment: step 3 (enqueue) and step 7 (delay) of a sync call (KEYS/ARGV: see sync_common.lua).
-- sync_enqueue(state, d, sec) dedupes the discovered requests (dupe.lua) and queues the new ones; returns
-- the flags string ('1' new / '0' seen per item). sync_delay(state, sec) files delayed retries.
--
-- Queue members. A *single* is <6-byte seq><payload> (payloads start with a version byte); that is
-- also what a lease holds and what anyone may ZADD. With 'asc' order and no politeness, new entries of
-- one score are packed into *chunks*: <6-byte seq of the first record>\0 then records
-- <2-byte length><6-byte seq><payload>, up to CHUNK_RECORDS per chunk. A chunk costs the sorted set's
-- per-member overhead (~100 bytes) once for many requests, which is most of a single's memory. The
-- tails HASH maps a score to the chunk still open for appends; a tail that is not a well-formed chunk
-- in the queue (chunk_singles) is not appended to (a new chunk is opened).

local function new_seqs(state, count)
  local last = redis.call('INCRBY', key_of.seq, count)
  local first = last - count + 1
  local out = {}
  for i = 0, count - 1 do
    local s = first + i
    if state.order == 'desc' then s = MAXSEQ - s end
    out[i + 1] = seq6(s)
  end
  return out
end

-- Append singles (a flat list seq, payload, seq, payload...) of one score to that score's open chunk,
-- opening new ones.
local function append_chunked(state, score, singles)
  local tail = redis.call('HGET', key_of.queue_tails, score)
  local records, count, head = {}, 0, nil
  if tail and redis.call('ZSCORE', key_of.queue, tail) then
    local held = chunk_singles(tail, state.max_entry)
    if held and string.byte(tail, 7) == 0 then
      redis.call('ZREM', key_of.queue, tail)
      head = tail
      count = #held
    end
  end
  local function close()
    if head then redis.call('ZADD', key_of.queue, score, head .. table.concat(records)) end
  end
  for i = 1, #singles, 2 do
    local seq, payload = singles[i], singles[i + 1]
    if not head or count >= CHUNK_RECORDS then
      close()
      head, records, count = seq .. '\0', {}, 0
    end
    records[#records + 1] = u16(#payload) .. seq .. payload
    count = count + 1
  end
  close()
  redis.call('HSET', key_of.queue_tails, score, head .. table.concat(records))
end

local function sync_enqueue(state, d, sec)
  local flags, to_add = {}, {}
  local pos, w = sec.pos, sec.w
  for i = 1, sec.n do
    local t1, payload = ARGV[pos], ARGV[pos + 3]
    local new = 1
    if t1 ~= '' then new = dupe_add(d, t1, ARGV[pos + 1]) end
    flags[i] = new
    if new == 1 and payload ~= '' then to_add[#to_add + 1] = pos end
    pos = pos + w
  end
  if #to_add == 0 then return table.concat(flags) end
  state.queued_delta = state.queued_delta + #to_add
  local seqs = new_seqs(state, #to_add)
  if state.chunked then
    local by_score, scores = {}, {}
    for i, p in ipairs(to_add) do
      local score = ARGV[p + 2]
      if not by_score[score] then by_score[score] = {}; scores[#scores + 1] = score end
      local group = by_score[score]
      group[#group + 1] = seqs[i]
      group[#group + 1] = ARGV[p + 3]
    end
    for _, score in ipairs(scores) do append_chunked(state, score, by_score[score]) end
  else
    local args = {}
    for i, p in ipairs(to_add) do
      local m, score = member_of(state, seqs[i], ARGV[p + 2], ARGV[p + 3], ARGV[p + 4])
      args[#args + 1] = score; args[#args + 1] = m
      if state.polite then pol_enqueued(ARGV[p + 4], ARGV[p + 5]) end
    end
    for i = 1, #args, 7998 do
      redis.call('ZADD', key_of.queue, unpack(args, i, math.min(i + 7997, #args)))
    end
  end
  return table.concat(flags)
end

local function sync_delay(state, sec)
  if sec.n == 0 then return end
  local seqs = new_seqs(state, sec.n)
  local pos = sec.pos
  for i = 1, sec.n do
    local score, payload, delay = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
    local m, qscore = member_of(state, seqs[i], score, payload, ARGV[pos + 3])
    if state.polite then pol_remember_limits(ARGV[pos + 3], ARGV[pos + 4]) end
    redis.call('ZADD', key_of.delayed, state.now + delay, m)
    redis.call('HSET', key_of.delayed_meta, m, qscore)
    pos = pos + sec.w
  end
end
