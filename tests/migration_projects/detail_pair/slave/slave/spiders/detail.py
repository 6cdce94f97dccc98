import re

import scrapy
from scrapy_redis.spiders import RedisSpider

from slave.redisutil import connect


class ContactItem(scrapy.Item):
    name = scrapy.Field()
    telphone = scrapy.Field()
    phone = scrapy.Field()
    address = scrapy.Field()
    url = scrapy.Field()


class SlaveSpider(RedisSpider):
    """Parses the contact block of each detail page the master pushed to 'detailurl:'."""

    name = "slave186"
    redis_key = "detailurl:"

    def parse(self, response):
        item = ContactItem()
        try:
            block = response.css("div.ptlxfsC>ul>li")[0]
            item["name"] = block.re(r"联系人：([\u4e00-\u9fa5]{2,3})")[0]
            item["telphone"] = (block.re(r"\d+-\d+") or ["0759-7174717"])[0]
            item["phone"] = (block.re(r"\d{11}") or ["11111111111"])[0]
            item["address"] = re.sub(r"^地址：", "", block.css("p:nth-child(4)::text").get(""))
            item["url"] = response.url
        except IndexError:
            connect(self.settings).sadd("indexExcepturls:", response.url)
            self.logger.debug("no contact block: %s", response.url)
            return None
        return item
