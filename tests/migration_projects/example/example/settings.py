# scrapy-redis's example project, in miniature: its two Redis-fed spiders and its settings
BOT_NAME = "example"
SPIDER_MODULES = ["example.spiders"]
NEWSPIDER_MODULE = "example.spiders"
USER_AGENT = "scrapy-redis (+https://github.com/rolando/scrapy-redis)"

DUPEFILTER_CLASS = "scrapy_redis.dupefilter.RFPDupeFilter"
SCHEDULER = "scrapy_redis.scheduler.Scheduler"
SCHEDULER_PERSIST = True
# SCHEDULER_QUEUE_CLASS = "scrapy_redis.queue.SpiderPriorityQueue"

ITEM_PIPELINES = {
    "example.pipelines.StampPipeline": 300,
    "scrapy_redis.pipelines.RedisPipeline": 400,
}
LOG_LEVEL = "INFO"
DOWNLOAD_DELAY = 1
