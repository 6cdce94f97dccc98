from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import Rule
from scrapy_redis.spiders import RedisCrawlSpider, RedisSpider


def _domains(kwargs):
    # -a domain=a.com,b.com, kept as a lazy filter object as the original does
    return filter(None, kwargs.pop("domain", "").split(","))


class PageSpider(RedisSpider):
    """One item per seed pushed to myspider:start_urls."""

    name = "myspider_redis"
    redis_key = "myspider:start_urls"

    def __init__(self, *args, **kwargs):
        self.allowed_domains = _domains(kwargs)
        super().__init__(*args, **kwargs)

    def parse(self, response):
        return {"name": response.css("title::text").get(), "url": response.url}


class SiteCrawler(RedisCrawlSpider):
    """Follows every link from the seeds pushed to mycrawler:start_urls; one item per page a link led to."""

    name = "mycrawler_redis"
    redis_key = "mycrawler:start_urls"
    rules = (Rule(LinkExtractor(), callback="parse_page", follow=True),)

    def __init__(self, *args, **kwargs):
        self.allowed_domains = _domains(kwargs)
        super().__init__(*args, **kwargs)

    def parse_page(self, response):
        return {"name": response.css("title::text").get(), "url": response.url}
