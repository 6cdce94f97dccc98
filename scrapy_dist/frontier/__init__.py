"""The shared frontier: the scheduler Scrapy talks to (``scheduler``) over an I/O-free ``ledger``, the
``syncloop`` rounds, one shard's ``sync`` call (``shard``), the crawl's shards and control hash (``layout``),
queue orders, politeness, retry timing and dead letters (``orders``), and what comes from Scrapy's crawler
(``engine``: engine access, components, item output, revisits). May import: ``settings``, ``redis``, ``wire``,
``dupefilter``, ``egress``, ``utils`` and the root's exceptions."""
