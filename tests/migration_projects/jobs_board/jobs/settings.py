# a job-listing crawler fed through a custom seeds key, with the settings such projects carry
BOT_NAME = "jobs"
SPIDER_MODULES = ["jobs.spiders"]
NEWSPIDER_MODULE = "jobs.spiders"
USER_AGENT = "scrapy-redis (+https://github.com/rolando/scrapy-redis)"

DUPEFILTER_CLASS = "scrapy_redis.dupefilter.RFPDupeFilter"
SCHEDULER = "scrapy_redis.scheduler.Scheduler"
SCHEDULER_PERSIST = True
SCHEDULER_QUEUE_CLASS = "scrapy_redis.queue.SpiderPriorityQueue"

ITEM_PIPELINES = {
    "jobs.pipelines.CrawledPipeline": 300,
    "scrapy_redis.pipelines.RedisPipeline": 999,
}
LOG_LEVEL = "INFO"
DOWNLOAD_DELAY = 0.2
CONCURRENT_REQUESTS = 8
CONCURRENT_ITEMS = 16
REDIS_URL = "redis://127.0.0.1:6379"
COOKIES_ENABLED = False
