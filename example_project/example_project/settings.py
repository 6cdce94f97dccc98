"""Settings of the example project: a normal Scrapy project, made distributed by the scrapy-dist add-on.

Every `scrapy crawl <spider>` started with these settings -- on this machine or on others pointing at the
same Redis -- shares one frontier, one duplicate filter, one retry schedule and one dead-letter list.
"""

BOT_NAME = "example_project"
SPIDER_MODULES = ["example_project.spiders"]
NEWSPIDER_MODULE = "example_project.spiders"

# scrapy-dist: the shared frontier (SCHEDULER), the crawl-wide bloom filter (DUPEFILTER_CLASS), retries
# delayed through the frontier, dead letters, crawl-wide stats, heartbeats and closing together.
ADDONS = {"scrapy_dist.Addon": 0}

# Where the shared Redis is. Unset: this project's embedded Redis (started on first use, one machine only).
# On several hosts, set the same Redis everywhere, here or with `scrapy crawl <spider> -s REDIS_URL=...`:
# REDIS_URL = "redis://:password@redis.internal:6379/0"

# Keep responses ignored for their status (404, 410, ...) in the crawl's dead-letter list, next to the
# requests whose retries ran out (`scrapy-dist dead <spider>` lists, requeues or purges them).
HTTPERROR_DEAD_LETTER = True

# Close every worker once the whole crawl has had no work (and no seeds) for this many seconds.
# 0 keeps RedisSpider workers waiting for new seeds forever.
SCHEDULER_IDLE_BEFORE_CLOSE = 30

ROBOTSTXT_OBEY = True
LOG_LEVEL = "INFO"
TELNETCONSOLE_ENABLED = False
FEED_EXPORT_ENCODING = "utf-8"
