"""The generated site (``scrapy_dist.demo.site``) as a process of its own, for a site host's namespace.

``python -m benchmarks.faultsite --host ADDR --port N --pages N --delay S --access-log FILE`` serves the
site and appends one line per answered request to the access log (``<unix time> <status> <path>``),
flushed every 0.2 s, so the harness and the checker read what was fetched while the crawl runs. It prints
``ready`` once listening and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

from scrapy_dist.demo.site import SiteGraph, SiteServer

FLUSH_EVERY = 0.2


def read_access_log(path: Path) -> list[tuple[float, int, str]]:
    """The access log's complete lines as ``(unix time, status, path)``."""
    out: list[tuple[float, int, str]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            out.append((float(parts[0]), int(parts[1]), parts[2]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faultsite")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--access-log", type=Path, required=True)
    args = parser.parse_args(argv)
    site = SiteServer(SiteGraph(args.pages), host=args.host, port=args.port, delay=args.delay).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("ready", flush=True)
    written = 0
    offset = time.time() - time.monotonic()  # the site records monotonic times
    with open(args.access_log, "a") as fh:
        while True:
            stopping = stop.wait(FLUSH_EVERY)
            new = site.log[written:]  # a list slice is atomic under the GIL
            written += len(new)
            fh.write("".join(f"{t + offset:.3f} {status} {path}\n" for t, path, status in new))
            fh.flush()
            if stopping:
                break
    site.stop()


if __name__ == "__main__":
    main()
