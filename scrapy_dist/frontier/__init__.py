"""The shared frontier: the scheduler Scrapy talks to and everything between it and the ``sync`` script.

Owns the scheduler facade, the I/O-free ledger of what a worker holds and owes, the sync loop, the shard
router and layout, queue orders, crawl-wide politeness, revisits, retry timing and dead letters.
May import: ``settings``, ``redis``, ``wire``, ``dupefilter``, ``egress``, ``utils`` and the root's
exceptions.
"""
