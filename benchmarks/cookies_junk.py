"""Requests per second through SharedCookiesMiddleware with junk records in the shared jar (issue 15).

    python benchmarks/cookies_junk.py [--junk 100000] [--seconds 5]

Starts its own redis-server, plants ``--junk`` invalid records (and one valid cookie) in the default jar,
then sends requests through ``process_request``/``process_response`` for ``--seconds`` of wall time with
the default ``REDIS_COOKIES_CACHE_SECONDS`` (1 s): the jar is refreshed once a second, as in a crawl.
Prints requests/s with no junk and with the junk, and a second run where another worker changes a cookie
every second (each refresh then has something new to read).
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

from scrapy_dist.keys import CrawlKeys  # noqa: E402
from scrapy_dist.middlewares.cookies import SharedCookiesMiddleware  # noqa: E402

KEYS = CrawlKeys("shop")
SITE = "http://shop.example"


async def rate(url: str, seconds: float, changing: bool) -> float:
    mw = SharedCookiesMiddleware(redis.asyncio.Redis.from_url(url), KEYS, flush_interval=0.01)
    other = SharedCookiesMiddleware(redis.asyncio.Redis.from_url(url), KEYS, flush_interval=0.01)
    # catching up with junk logged as changes costs each worker one rejection per record, once: not measured
    catch_up = time.monotonic()
    for m in (mw, other):
        while True:
            request = Request(f"{SITE}/warm")
            await m.process_request(request)
            if m._shared["default"].loaded_at is not None:
                break
    catch_up = time.monotonic() - catch_up
    if catch_up > 0.5:
        print(f"  (catching up took {catch_up:.1f}s)")
    n, start, next_change = 0, time.monotonic(), 0.0
    while (now := time.monotonic()) - start < seconds:
        if changing and now >= next_change:
            next_change = now + 1.0
            req = Request(f"{SITE}/login")
            await other.process_request(req)
            resp = Response(req.url, headers={"Set-Cookie": [f"s={n}; Path=/"]}, request=req)
            await other.process_response(req, resp)
        request = Request(f"{SITE}/p/{n}")
        await mw.process_request(request)
        await mw.process_response(request, Response(request.url, request=request))
        n += 1
    await mw.spider_closed()
    await other.spider_closed()
    return n / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--junk", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--versioned", action="store_true", help="log the junk as changes too"
    )
    args = parser.parse_args()
    server = RedisProcess().start()
    try:
        client = redis.Redis.from_url(server.url)
        jar = KEYS.cookie_jar("default")
        good = {"name": "ok", "value": "1", "domain": "shop.example", "path": "/"}
        for changing in (False, True):
            client.delete(jar, KEYS.cookie_changes("default"))
            client.hset(jar, '["shop.example","/","ok"]', json.dumps(good))
            client.zadd(KEYS.cookie_changes("default"), {'["shop.example","/","ok"]': 1})
            clean = asyncio.run(rate(server.url, args.seconds, changing))
            pipe = client.pipeline(transaction=False)
            for i in range(args.junk):
                pipe.hset(jar, f"junk{i}", '{"name": 5, "domain": "x", "path": "/"}')
                if args.versioned:
                    pipe.zadd(KEYS.cookie_changes("default"), {f"junk{i}": 10 + i})
            pipe.execute()
            junk = asyncio.run(rate(server.url, args.seconds, changing))
            label = "a cookie changes every second" if changing else "no cookie changes"
            print(f"{label}: {clean:,.0f} requests/s clean, {junk:,.0f} requests/s with {args.junk:,} junk"
                  f" records ({junk / clean:.0%})")
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
