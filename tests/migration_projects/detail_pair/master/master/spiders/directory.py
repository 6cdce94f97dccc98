import redis
from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import CrawlSpider, Rule


class DirectorySpider(CrawlSpider):
    """Walks the directory's detail pages and hands each new one to the slave through 'detailurl:'."""

    name = "master"
    rules = [Rule(LinkExtractor(allow=(r"/info/s168-\d+\.html",)), callback="parse_item", follow=True)]

    def __init__(self, site="", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_urls = [site]

    def _redis(self):
        if not hasattr(self, "_conn"):
            s = self.settings
            self._conn = redis.Redis(host=s.get("REDIS_HOST"), port=int(s.get("REDIS_PORT")))
        return self._conn

    def parse_item(self, response):
        conn = self._redis()
        if conn.sismember("completeurl:", response.url) or conn.sismember("indexExcepturls:", response.url):
            self.logger.debug("already crawled: %s", response.url)
            return None
        conn.lpush("detailurl:", response.url)
        return None
