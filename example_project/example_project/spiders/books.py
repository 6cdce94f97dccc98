"""A real-site setup: books.toscrape.com (a site made for scraping practice), crawled by any number of
workers on any number of hosts sharing one Redis.

    redis-cli lpush books:start_urls https://books.toscrape.com/
    scrapy crawl books                # on every host, with the same REDIS_URL

Items go to Redis too (``books:items``, read them with ``scrapy-dist items books``), so the results of
every worker end up in one place.
"""

from __future__ import annotations

from scrapy_dist.spiders import RedisSpider


class BooksSpider(RedisSpider):
    """Catalogue pages -> book pages -> one item per book (title, price, availability, UPC)."""

    name = "books"
    allowed_domains = ["books.toscrape.com"]
    custom_settings = {
        # Be polite to a site others use too: the limits hold per worker, so N workers make N times this.
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "DOWNLOAD_DELAY": 0.25,
        "AUTOTHROTTLE_ENABLED": True,
        # Every worker's items in one Redis LIST (`scrapy-dist items books`).
        "ITEM_PIPELINES": {"scrapy_dist.pipelines.RedisPipeline": 300},
    }

    def parse(self, response):
        """A catalogue page (the seed, a category, or a "next" page)."""
        yield from response.follow_all(css="article.product_pod h3 a", callback=self.parse_book)
        yield from response.follow_all(css="li.next a", callback=self.parse)

    def parse_book(self, response):
        yield {
            "url": response.url,
            "title": response.css("div.product_main h1::text").get(),
            "price": response.css("div.product_main p.price_color::text").get(),
            "availability": " ".join(response.css("p.availability::text").getall()).strip(),
            "upc": response.xpath("//th[text()='UPC']/following-sibling::td/text()").get(),
            "category": response.css("ul.breadcrumb li:nth-last-child(2) a::text").get(),
        }
