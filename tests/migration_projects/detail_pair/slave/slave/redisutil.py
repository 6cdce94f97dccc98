import redis


def connect(settings):
    """The project's own client (not scrapy-redis's), from REDIS_HOST and REDIS_PORT."""
    return redis.Redis(host=settings.get("REDIS_HOST"), port=int(settings.get("REDIS_PORT")))
