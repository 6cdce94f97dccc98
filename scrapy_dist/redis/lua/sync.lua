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
--   = polite.lua's MAX_DELAY and MAX_JITTER), replay_memory (nonces of entries handed out kept in
--   KEYS spent, 0 = none); then P and P dupe params (dupe.lua); then SYNC_SECTIONS,
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
  K, A, sec = sync_names(keys, argv)
  local now = call_now(A.now)
  local polite = A.politeness == 'cluster'
  local S = {
    now = now, worker = A.worker, lease_s = tonumber(A.lease_seconds), n_lease = tonumber(A.lease),
    order = A.order, polite = polite, chunked = A.order == 'asc' and not polite,
    max_entry = tonumber(A.max_entry_bytes), rejected_maxlen = tonumber(A.rejected_maxlen),
    dead_maxlen = tonumber(A.dead_maxlen), queued_delta = 0, rejected = 0, repaired = {}, tags = {},
    replay_memory = tonumber(A.replay_memory) or 0, remembered = 0, replayed = 0,
  }
  -- as the strings Redis would make of them (once, not once per command: each is a printf)
  S.now_s, S.deadline = string.format('%.17g', now), string.format('%.17g', now + S.lease_s)
  math.randomseed(tonumber(A.seed) or 0)
  pol_reset(now, S.now_s, K.queue, K.leases, K.domain_info)
  -- limits read from l:<domain> are clamped to what the worker's settings give any domain (polite.lua)
  local bound_delay, bound_jitter = string.match(A.limits_bound or '', '^(%S+) (%S+)$')
  if bound_delay then
    pol.max_delay = finite_in(bound_delay, 0, MAX_DELAY)
    pol.max_jitter = finite_in(bound_jitter, 0, MAX_JITTER)
  end
  local P = tonumber(ARGV[#SYNC_HEAD + 1])
  local params = {}
  for i = 1, P do params[i] = ARGV[#SYNC_HEAD + 1 + i] end
  sync_sections(sec, #SYNC_HEAD + 2 + P, polite)

  -- nothing is written before these checks
  local d = dupe_open(A.dupe_mode, DUPE_KEY, params, now)
  if d.err then return {-2, d.err, d.err_detail} end
  if not dupe_can_insert(d, sec.enqueue.n) then
    if d.err then return {-2, d.err, d.err_detail} end
    return {-1, dupe_count(d)}
  end
  local bad, detail = sync_check(S, sec)
  if bad then return {-2, bad, detail} end
  sync_items_check(S)

  sync_sweep(S)
  local flags = sync_enqueue(S, d, sec.enqueue)
  sync_ack(S, sec.ack)
  sync_renew(S, sec.renew)
  sync_release(S, sec.release)
  sync_delay(S, sec.delay)
  sync_reject(S, sec.reject)
  sync_dead(S, sec.dead)
  sync_penalize(S, sec.penalize)
  sync_revisit(S, sec.revisit)
  sync_forget(d, sec.forget)
  sync_items(S, sec.items)

  local control = redis.call('HMGET', K.control, 'paused', 'forgets')  -- one read of the crawl's decisions
  local paused, forgets = control[1], control[2]
  if paused ~= '1' then paused = '0' end
  S.paused = paused
  if polite then sync_polite_queue(S) end
  local leased = sync_lease(S)
  if polite then
    pol_unstick(K.domains, now)
    pol_flush(K.domains, now)
  end

  -- the nonces handed out stay bounded: the oldest beyond replay_memory are forgotten
  if S.remembered > 0 then
    local over = redis.call('ZCARD', K.spent) - S.replay_memory
    if over > 0 then redis.call('ZREMRANGEBYRANK', K.spent, 0, over - 1) end
  end
  S.queued_delta = S.queued_delta - #leased / 2
  local members_left = redis.call('ZCARD', K.queue)
  local queued = 0
  if members_left > 0 then
    -- requests in the queue (chunks hold several, so ZCARD undercounts): tails field 'count'
    queued = (S.count0 or 0) + S.queued_delta
    if not S.count0 or queued < members_left then
      queued = members_left  -- written by someone else than this script: heal the counter
    end
  end
  redis.call('HSET', K.queue_tails, 'count', queued)

  if S.worker ~= '' and A.heartbeat ~= '0' then redis.call('ZADD', K.workers, S.now_s, S.worker) end
  local bloom_n = dupe_close(d)
  for _, key in ipairs(DUPE_REPAIRED) do S.repaired[#S.repaired + 1] = key end
  if pol.clamped then S.repaired[#S.repaired + 1] = K.domain_info end
  return {'flags', flags, 'leased', leased, 'requeued', S.requeued, 'moved', S.moved, 'queued', queued,
          'inflight', redis.call('ZCARD', K.leases), 'delayed', redis.call('ZCARD', K.delayed),
          'bloom_n', bloom_n, 'paused', paused, 'seq', redis.call('GET', K.seq) or '0',
          'rejected', S.rejected, 'repaired', S.repaired, 'replayed', S.replayed,
          'items', S.items_written, 'items_refused', S.items_refused, 'acks_refused', S.acks_refused,
          'forgets', forgets or ''}
end
