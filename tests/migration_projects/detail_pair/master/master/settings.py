# the master: a plain Scrapy crawl (no scrapy-redis component) that pushes detail pages to the slave
BOT_NAME = "master"
SPIDER_MODULES = ["master.spiders"]
NEWSPIDER_MODULE = "master.spiders"
ROBOTSTXT_OBEY = False
CONCURRENT_REQUESTS = 64
DOWNLOAD_DELAY = 0.1
LOG_LEVEL = "INFO"
REDIS_HOST = "127.0.0.1"
REDIS_PORT = "6379"
