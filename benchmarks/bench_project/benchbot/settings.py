"""Settings shared by every contestant; the scheduler/dupefilter/Redis settings come from the harness
as ``-s NAME=VALUE`` (see ``benchmarks/crawl.py``'s ``CONTESTANTS``)."""

BOT_NAME = "benchbot"
SPIDER_MODULES = ["benchbot.spiders"]
NEWSPIDER_MODULE = "benchbot.spiders"

CONCURRENT_REQUESTS = 32
CONCURRENT_REQUESTS_PER_DOMAIN = 32
DOWNLOAD_DELAY = 0
AUTOTHROTTLE_ENABLED = False
ROBOTSTXT_OBEY = False
LOG_LEVEL = "INFO"
TELNETCONSOLE_ENABLED = False
ITEM_PIPELINES: dict = {}

# Writes the stats and timing JSON the harness reads (path given with -s BENCH_STATS_FILE=...); with
# -s BENCH_SCRIPT_CALLS_FILE=... also records the crawl's Lua script calls (benchmarks/replay.py).
EXTENSIONS = {"benchbot.extensions.BenchStats": 0, "benchbot.extensions.RecordScriptCalls": 0}
