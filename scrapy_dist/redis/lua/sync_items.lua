-- Fragment: items that travel with the ack of the page they came from (RedisPipeline, exactly once).
-- A page's items are appended to the items key in the call that acknowledges its lease, and only if that
-- ack is this worker's to give: the lease was still its own (the lease key carries the worker's tag), or
-- it ran out and its request still waits in the queue (nobody else took it; the ack removes that copy).
-- A lease that ran out and was leased by another worker -- this worker was stopped or cut off longer than
-- its lease -- or that an earlier call already acknowledged (a retried call whose answer was lost) is
-- refused, and so are its items: the other fetch writes them, so they land exactly once per ack.
--   items_acked(state, L, ok)   sync_ack / sync_revisit tell the outcome of each ack (lease key L)
--   sync_items_check(state)     before the first write: the items key holds the type it is written as
--   sync_items(state, sec)      section 'items' (lease key, encoded item): appended if L's ack was accepted
-- Head: items_mode ('' none, 'list' RPUSH, 'stream' XADD <key> * item <data>), items_maxlen ('' or the
-- stream's approximate cap). KEYS: the items key is the last key of the call (after the dupefilter's),
-- passed only with an items_mode.
-- state.items_written / state.items_refused / state.acks_refused are answered as 'items', 'items_refused', 'acks_refused'.

local ITEMS_TYPES = {list = 'list', stream = 'stream'}

local function items_acked(state, L, ok)
  if ok then
    state.acked[L] = true
  else
    state.acks_refused = state.acks_refused + 1
  end
end

local function sync_items_check(state)
  state.acked, state.acks_refused, state.items_written, state.items_refused = {}, 0, 0, 0
  local want = ITEMS_TYPES[call_args.items_mode or '']
  if want then
    key_of.items = KEYS[#KEYS]
    type_ok(key_of.items, want, state.repaired)
  end
end

local function sync_items(state, sec)
  if sec.n == 0 then return end
  local stream = call_args.items_mode == 'stream'
  local maxlen = tonumber(call_args.items_maxlen or '')
  local pos = sec.pos
  local batch = {}
  for i = 1, sec.n do
    local L, data = ARGV[pos], ARGV[pos + 1]
    pos = pos + sec.w
    if not key_of.items or not state.acked[L] then
      state.items_refused = state.items_refused + 1
    elseif stream then
      if maxlen then
        redis.call('XADD', key_of.items, 'MAXLEN', '~', maxlen, '*', 'item', data)
      else
        redis.call('XADD', key_of.items, '*', 'item', data)
      end
      state.items_written = state.items_written + 1
    else
      batch[#batch + 1] = data
      state.items_written = state.items_written + 1
      -- unpack() has a limit on its arguments: one RPUSH per few hundred items
      if #batch >= 256 then redis.call('RPUSH', key_of.items, unpack(batch)); batch = {} end
    end
  end
  if #batch > 0 then redis.call('RPUSH', key_of.items, unpack(batch)) end
end
