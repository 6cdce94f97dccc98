"""Requests per second through SharedCookiesMiddleware with junk records in the shared jar (issue 15).

    python benchmarks/cookies_junk.py [--junk 100000] [--requests 20000] [--versioned] [--impl FILE]

Starts its own redis-server, plants ``--junk`` invalid records (and one valid cookie) in the default jar,
then sends ``--requests`` requests through ``process_request``/``process_response`` with the default
``REDIS_COOKIES_CACHE_SECONDS`` (1 s) on a clock advanced 1 ms per request: the jar is refreshed every
1,000 requests, as in a crawl of 1,000 pages/s. Prints requests per CPU second of this process (robust on
a shared machine) with no junk and with the junk, and again while another worker changes a cookie every
1,000 requests (each refresh then has something new to read). ``--impl old/cookies.py`` measures another
version of the middleware; ``--versioned`` also logs the junk as changes (an attacker knowing the format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import redis
import redis.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_servers import RedisProcess  # noqa: E402
from scrapy import Request  # noqa: E402
from scrapy.http import Response  # noqa: E402

from scrapy_dist.middlewares.cookies import SharedCookiesMiddleware  # noqa: E402
from scrapy_dist.redis.keys import CrawlKeys  # noqa: E402
from scrapy_dist.settings import CookieSettings  # noqa: E402

KEYS = CrawlKeys("shop")
SITE = "http://shop.example"


class Clock:
    """Monotonic time advanced 1 ms per request: a jar refresh every 1,000 requests, whatever the machine."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def rate(url: str, requests: int, changing: bool, middleware: type[SharedCookiesMiddleware]) -> float:
    """Requests per CPU second of this process (other processes on a shared machine do not count)."""
    clock = Clock()
    settings = CookieSettings(flush_interval=0.001)
    mw = middleware(redis.asyncio.Redis.from_url(url), KEYS, settings, monotonic=clock)
    other = middleware(redis.asyncio.Redis.from_url(url), KEYS, settings, monotonic=clock)
    # catching up with junk logged as changes costs each worker one rejection per record, once: not measured
    for m in (mw, other):
        while True:
            await m.process_request(Request(f"{SITE}/warm"))
            if m._shared["default"].loaded_at is not None:
                break
    cpu = time.process_time()
    for n in range(requests):
        clock.t += 0.001
        if changing and n % 1000 == 0:  # another worker changes a cookie once a second
            req = Request(f"{SITE}/login")
            await other.process_request(req)
            resp = Response(req.url, headers={"Set-Cookie": [f"s={n}; Path=/"]}, request=req)
            await other.process_response(req, resp)
        request = Request(f"{SITE}/p/{n}")
        await mw.process_request(request)
        await mw.process_response(request, Response(request.url, request=request))
    cpu = time.process_time() - cpu
    await mw.spider_closed()
    await other.spider_closed()
    return requests / cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--junk", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--impl", help="path of another cookies.py to measure (e.g. the old one)")
    parser.add_argument(
        "--versioned", action="store_true", help="log the junk as changes too"
    )
    args = parser.parse_args()
    middleware = SharedCookiesMiddleware
    if args.impl:
        import importlib.util

        spec = importlib.util.spec_from_file_location("cookies_impl", args.impl)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        middleware = module.SharedCookiesMiddleware
    server = RedisProcess().start()
    try:
        client = redis.Redis.from_url(server.url)
        jar = KEYS.cookie_jar("default")
        good = {"name": "ok", "value": "1", "domain": "shop.example", "path": "/"}
        for changing in (False, True):
            client.delete(jar, KEYS.cookie_changes("default"))
            client.hset(jar, '["shop.example","/","ok"]', json.dumps(good))
            client.zadd(KEYS.cookie_changes("default"), {'["shop.example","/","ok"]': 1})
            clean = asyncio.run(rate(server.url, args.requests, changing, middleware))
            pipe = client.pipeline(transaction=False)
            for i in range(args.junk):
                pipe.hset(jar, f"junk{i}", '{"name": 5, "domain": "x", "path": "/"}')
                if args.versioned:
                    pipe.zadd(KEYS.cookie_changes("default"), {f"junk{i}": 10 + i})
            pipe.execute()
            junk = asyncio.run(rate(server.url, args.requests, changing, middleware))
            label = "a cookie changes every second" if changing else "no cookie changes"
            print(f"{label}: {clean:,.0f} requests/CPU-s clean, {junk:,.0f} with {args.junk:,} junk"
                  f" records ({junk / clean:.0%})")
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
