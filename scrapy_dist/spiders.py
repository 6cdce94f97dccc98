"""Placeholder: RedisSpider and RedisCrawlSpider are implemented by the seeds work."""
