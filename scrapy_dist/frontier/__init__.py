"""The shared frontier: the scheduler Scrapy talks to and everything between it and the ``sync`` script.

``scheduler`` (the facade and the request encoder), ``ledger`` (what a worker holds and owes, no I/O),
``syncloop`` (the rounds), ``shard`` (one shard's ``sync`` call and its wire layout), ``layout`` (the
crawl's shards in Redis and the router), ``orders`` (queue orders, politeness, retry timing), ``revisit``,
``control`` (control flags, dead letters, stats and logs) and ``engine`` (what comes from Scrapy's
crawler: engine access, ``from_crawler`` wiring, item output).
May import: ``settings``, ``redis``, ``wire``, ``dupefilter``, ``egress``, ``utils`` and the root's
exceptions.
"""
