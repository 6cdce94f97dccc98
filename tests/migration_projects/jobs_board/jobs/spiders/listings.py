import hashlib
import re

from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import Rule
from scrapy_redis.spiders import RedisCrawlSpider

from jobs.items import JobItem

_UNITS = {"千": 1000, "万": 10000}


def salary(text):
    """(min, max) in yuan per month from '6-8千/月', '1-1.5万/月', '10-20万/年', '面议', '4500元/月以下'."""
    if "面议" in text or not text:
        return 0, 0
    if "以下" in text or "以上" in text:
        n = int(re.sub(r"\D", "", text))
        return n, n
    low, high = text.split("/")[0].split("-")
    unit = _UNITS.get(high[-1], 1)
    yearly = 12 if text.endswith("/年") else 1
    return int(float(low) * unit / yearly), int(float(high[:-1]) * unit / yearly)


class JobSpider(RedisCrawlSpider):
    """Listing pages pushed to the plain 'start_urls' key; pagination followed, every job parsed once."""

    name = "jobs_redis"
    redis_key = "start_urls"
    rules = [
        Rule(LinkExtractor(allow=r"/list/", restrict_xpaths=('//div[@class="cn hlist"]',
                                                             '//div[@class="dw_page"]')), follow=True),
        Rule(LinkExtractor(allow=r"/jobs/.*?/\d+\.html"), callback="parse_job", follow=False),
    ]

    def parse_job(self, response):
        item = JobItem()
        item["url"] = response.url
        item["jid"] = hashlib.md5(response.url.encode()).hexdigest()
        item["title"] = response.xpath("//h1/text()").get()
        item["location"] = response.xpath('//span[@class="lname"]/text()').get()
        exp = response.xpath('//div[@class="t1"]/span[1]/text()').get().strip("年经验")
        item["exp"] = 0 if "无" in exp else int(exp)
        item["degree"] = response.xpath('//div[@class="t1"]/span[2]/text()').get()
        pay = response.xpath('//div[@class="cn"]/strong/text()').get("")
        item["minmoney"], item["maxmoney"] = salary(pay)
        yield item
