-- sync: one worker's whole exchange with the frontier in one atomic call. Requeues expired leases, moves
-- due delayed retries into the queue, dedupes and enqueues discovered requests, acknowledges finished
-- ones, renews/releases/rejects leases, writes dead letters and leases new work -- so a batch's new
-- requests and the ack of the request that produced them land together.
--
-- Put together from fragments (scrapy_dist/redis/scripts.py): dupe.lua, polite.lua, sync_common.lua (KEYS,
-- ARGV head and sections by name, chunk checks), sync_check.lua (every value read before the first write),
-- sync_sweep.lua, sync_enqueue.lua, sync_items.lua, sync_settle.lua, sync_lease.lua. The wire layout is
-- encoded once in Python (frontier/shard.py: SYNC_KEYS, SYNC_HEAD, SYNC_SECTIONS, decode_sync_result) and
-- read by name here.
-- Sharded frontier: every KEYS of one call are one shard's (one hash slot); for a shard > 0 the
-- crawl-wide keys (deadletter, workers, control, domains, domain info) are that shard's names and stay
-- empty, and head 'heartbeat' is '0' (the worker's heartbeat is written by its shard-0 call).
--
-- KEYS: SYNC_KEYS (declared in frontier/shard.py), then the dupefilter keys (dupe.lua).
-- ARGV: SYNC_HEAD by name: now (unix seconds; '' = server time), worker ('' = a tool), lease_seconds,
--   lease (how many to lease), order ('asc' FIFO/priority, 'desc' LIFO), politeness ('process' or
--   'cluster'), seed (politeness jitter), heartbeat ('1'/'0'), max_entry_bytes (larger queue entries
--   are rejected whole), rejected_maxlen and dead_maxlen (caps of the record LISTs, 0 = none),
--   dupe_mode, limits_bound ('<delay> <jitter>' no domain's limits exceed in this worker's settings; ''
--   = polite.lua's MAX_DELAY and MAX_JITTER), limits_default (the worker's limits of a domain no
--   DOMAIN_LIMITS rule matches, "delay concurrency jitter"; '' = none), replay_memory (nonces of entries handed out kept in
--   KEYS spent, 0 = none); then n_params and n_params dupe params (dupe.lua); then SYNC_SECTIONS,
--   each a count and its items:
--   enqueue  t1, t2 (t1 == '' skips dedupe), score, payload (payload == '' dedupes only)
--            [, domain, limits "delay concurrency jitter" with politeness]
--   ack, renew, release  lease key (what 'leased' answered: sync_sweep.lua)
--   delay    score, payload, delay in seconds from now (the server's clock decides) [, domain, limits]
--   reject   lease key, JSON record        dead  JSON record        penalize  domain, seconds
--   revisit  lease key, delay in seconds, new member ('' = unchanged): an ack that files it again
--   forget   t1, t2: a fingerprint made new again (dupe.lua's dupe_forget)
--   items    lease key, encoded item: appended to the items key (the call's last key) only if that
--            lease's ack in this call was accepted (sync_items.lua; head items_mode, items_maxlen)
-- Returns the flat list 'flags', f, 'leased', l, 'requeued', n, 'moved', n, 'queued', n, 'inflight', n,
--   'delayed', n, 'bloom_n', n, 'paused', '0'/'1', 'seq', s, 'rejected', n, 'repaired', {keys},
--   'replayed', n, 'items', n, 'items_refused', n, 'acks_refused', n, 'forgets', g: flags has
--   one '1'/'0' per enqueue item (new/duplicate); leased is lease key, score, lease key, score...; seq is
--   the sequence counter (it grows with every entry created: two equal readings with nothing queued, leased
--   or delayed in between prove the shard stayed empty); rejected counts queue members this call rejected
--   whole (sync_lease: malformed, or a copy of an entry handed out); repaired names keys whose garbage
--   this call repaired (sync_check); items, items_refused and acks_refused count the items appended and
--   refused and the acks refused (sync_items); forgets is the control hash's 'forgets' field as written
--   ('' when absent): it changes with every `scrapy-dist forget`.
--   Or {-1, bloom_n} / {-2, reason, detail}: nothing written (see sync_common.lua).

-- sync_call(keys, argv) is the call: scripts.py ends the EVAL script with `return sync_call(KEYS, ARGV)`
-- and registers it as the function of the FUNCTION library, whose top level (every helper, every
-- constant) runs once at load; so everything a call owns is made anew here.
local function sync_call(keys, argv)
  KEYS, ARGV, DUPE_REPAIRED = keys, argv, {}
  local sec
  key_of, call_args, sec = sync_names(keys, argv)
  local now = call_now(call_args.now)
  local polite = call_args.politeness == 'cluster'
  local state = {
    now = now, worker = call_args.worker, lease_s = tonumber(call_args.lease_seconds), n_lease = tonumber(call_args.lease),
    order = call_args.order, polite = polite, chunked = call_args.order == 'asc' and not polite,
    max_entry = tonumber(call_args.max_entry_bytes), rejected_maxlen = tonumber(call_args.rejected_maxlen),
    dead_maxlen = tonumber(call_args.dead_maxlen), queued_delta = 0, rejected = 0, repaired = {}, tags = {},
    replay_memory = tonumber(call_args.replay_memory) or 0, remembered = 0, replayed = 0, priority_keys = {},
  }
  -- as the strings Redis would make of them (once, not once per command: each is a printf)
  state.now_s, state.deadline = string.format('%.17g', now), string.format('%.17g', now + state.lease_s)
  math.randomseed(tonumber(call_args.seed) or 0)
  -- limits read from a domain's field are clamped to what the worker's settings give any domain
  -- (limits_bound: polite.lua)
  pol_reset(now, state.now_s, key_of.queue, key_of.leases, key_of.domain_info, call_args.limits_default,
            call_args.limits_bound)
  local n_params = tonumber(ARGV[#SYNC_HEAD + 1])
  local params = {}
  for i = 1, n_params do params[i] = ARGV[#SYNC_HEAD + 1 + i] end
  sync_sections(sec, #SYNC_HEAD + 2 + n_params, polite)

  -- nothing is written before these checks
  local d = dupe_open(call_args.dupe_mode, DUPE_KEY, params, now)
  if d.err then return {-2, d.err, d.err_detail} end
  if not dupe_can_insert(d, sec.enqueue.n) then
    if d.err then return {-2, d.err, d.err_detail} end
    return {-1, dupe_count(d)}
  end
  local bad, detail = sync_check(state, sec)
  if bad then return {-2, bad, detail} end
  sync_items_check(state)

  sync_sweep(state)
  local flags = sync_enqueue(state, d, sec.enqueue)
  sync_ack(state, sec.ack)
  sync_renew(state, sec.renew)
  sync_release(state, sec.release)
  sync_delay(state, sec.delay)
  sync_reject(state, sec.reject)
  sync_dead(state, sec.dead)
  sync_penalize(state, sec.penalize)
  sync_revisit(state, sec.revisit)
  sync_forget(d, sec.forget)
  sync_items(state, sec.items)

  local control = redis.call('HMGET', key_of.control, 'paused', 'forgets')  -- one read of the crawl's decisions
  local paused, forgets = control[1], control[2]
  if paused ~= '1' then paused = '0' end
  state.paused = paused
  -- the checks of the queue and the schedule (sync_polite_queue, pol_unstick) run in one call in four,
  -- and after the lease of every call that leased fewer than it asked for while members are queued:
  -- where what they repair would show
  local checked = polite and math.random(4) == 1
  if checked then sync_polite_queue(state) end
  local leased = sync_lease(state)
  if polite then
    if not checked and #leased < 2 * state.n_lease and paused ~= '1'
       and redis.call('ZCARD', key_of.queue) > 0 then
      checked = true
      sync_polite_queue(state)
    end
    if checked then pol_unstick(key_of.domains, now) end
    pol_flush(key_of.domains, now)
  end

  -- the nonces handed out stay bounded: the oldest beyond replay_memory are forgotten
  if state.remembered > 0 then
    local over = redis.call('ZCARD', key_of.spent) - state.replay_memory
    if over > 0 then redis.call('ZREMRANGEBYRANK', key_of.spent, 0, over - 1) end
  end
  state.queued_delta = state.queued_delta - #leased / 2
  local members_left = redis.call('ZCARD', key_of.queue)
  local queued = 0
  if members_left > 0 then
    -- requests in the queue (chunks hold several, so ZCARD undercounts): tails field 'count'
    queued = (state.count0 or 0) + state.queued_delta
    if not state.count0 or queued < members_left then
      queued = members_left  -- written by someone else than this script: heal the counter
    end
  end
  redis.call('HSET', key_of.queue_tails, 'count', queued)

  if state.worker ~= '' and call_args.heartbeat ~= '0' then redis.call('ZADD', key_of.workers, state.now_s, state.worker) end
  local bloom_n = dupe_close(d)
  for _, key in ipairs(DUPE_REPAIRED) do state.repaired[#state.repaired + 1] = key end
  if pol.clamped then state.repaired[#state.repaired + 1] = key_of.domain_info end
  return {'flags', flags, 'leased', leased, 'requeued', state.requeued, 'moved', state.moved, 'queued', queued,
          'inflight', redis.call('ZCARD', key_of.leases), 'delayed', redis.call('ZCARD', key_of.delayed),
          'bloom_n', bloom_n, 'paused', paused, 'seq', redis.call('GET', key_of.seq) or '0',
          'rejected', state.rejected, 'repaired', state.repaired, 'replayed', state.replayed,
          'items', state.items_written, 'items_refused', state.items_refused, 'acks_refused', state.acks_refused,
          'forgets', forgets or ''}
end
