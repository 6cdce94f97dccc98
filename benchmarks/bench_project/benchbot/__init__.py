"""The benchmark's Scrapy project: one spider that follows every link of the generated site."""
