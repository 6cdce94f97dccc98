import scrapy


class JobItem(scrapy.Item):
    jid = scrapy.Field()
    url = scrapy.Field()
    title = scrapy.Field()
    location = scrapy.Field()
    exp = scrapy.Field()
    degree = scrapy.Field()
    minmoney = scrapy.Field()
    maxmoney = scrapy.Field()
    crawled = scrapy.Field()
