# the slave: a RedisSpider reading the detail pages the master pushes
BOT_NAME = "slave"
SPIDER_MODULES = ["slave.spiders"]
NEWSPIDER_MODULE = "slave.spiders"
ROBOTSTXT_OBEY = False
CONCURRENT_REQUESTS = 64
DOWNLOAD_DELAY = 0.1
LOG_LEVEL = "INFO"
DEFAULT_REQUEST_HEADERS = {
    "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "Accept-Language": "zh-CN,zh;q=0.8,en-US;q=0.3,en;q=0.2",
    "Cache-Control": "max-age=0",
}
DOWNLOADER_MIDDLEWARES = {"slave.middlewares.AgentMiddleware": 1}
ITEM_PIPELINES = {"slave.pipelines.ContactPipeline": 300}
AGENT_POOL = [
    "Mozilla/5.0 (Windows NT 6.1; rv:2.0.1) Gecko/20100101 Firefox/4.0.1",
    "Opera/9.80 (Windows NT 6.1; U; en) Presto/2.8.131 Version/11.11",
]

REDIS_HOST = "127.0.0.1"
REDIS_PORT = "6379"
DUPEFILTER_CLASS = "scrapy_redis.dupefilter.RFPDupeFilter"
SCHEDULER = "scrapy_redis.scheduler.Scheduler"
SCHEDULER_PERSIST = True
SCHEDULER_DUPEFILTER_KEY = "%(spider)s:dupefilter"
REDIS_ITEMS_KEY = "%(spider)s:items"
REDIS_ITEMS_SERIALIZER = "json.dumps"
