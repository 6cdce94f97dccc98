"""The shared frontier: the scheduler Scrapy talks to and everything between it and the ``sync`` script.

``scheduler`` (the facade, the request encoder, stats and logs), ``ledger`` (what a worker holds and owes,
no I/O), ``syncloop`` (the rounds), ``shard`` (one shard's ``sync`` call and its wire layout), ``layout``
(the crawl's shards and control hash in Redis, the router), ``orders`` (queue orders, politeness, retry
timing, dead letters) and ``engine`` (what comes from Scrapy's crawler: engine access, components, item
output, revisits).
May import: ``settings``, ``redis``, ``wire``, ``dupefilter``, ``egress``, ``utils`` and the root's
exceptions.
"""
