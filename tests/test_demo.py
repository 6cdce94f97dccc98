"""``scrapy-dist demo``: the whole product in one command -- and the example project it runs.

The end-to-end tests run the real command (real ``scrapy crawl`` workers, a real Redis, a worker
SIGKILLed half way) on a small site; the others check the pieces the summary's verdict rests on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from helpers import read_demo_until_crawling
from rich.console import Console
from zygote import Zygote

from scrapy_dist.demo import Demo, DemoOptions, render_summary, summarize
from scrapy_dist.demo.site import EXAMPLE_PROJECT, SiteGraph, SiteTally, demo_graph, locate_project


def _env() -> dict[str, str]:
    """The environment of a user who configured nothing."""
    return {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-c", "from scrapy_dist.cli import main; main()", "demo", *args]


def _figure(label: str, output: str) -> int:
    match = re.search(rf"^\s*{re.escape(label)}\s+([\d,]+)", output, re.MULTILINE)
    assert match, f"no {label!r} in the summary:\n{output}"
    return int(match.group(1).replace(",", ""))


# -- the verdict ---------------------------------------------------------------------------------------
def test_summary_counts_lost_duplicate_and_retried_pages() -> None:
    graph = SiteGraph(6, links=2, missing=1)
    (missing,) = graph.missing
    existing = [i for i in range(6) if i != missing]
    answered = {f"/page/{i}": 1 for i in existing[:-1]}  # the last existing page was never answered 200
    answered[f"/page/{existing[0]}"] = 3  # ... and the first one three times
    answered["/robots.txt"] = 1  # not a page
    s = summarize(graph, answered, {f"/page/{existing[1]}": 2, "/other": 5}, {"404": 1}, elapsed=3.0)
    assert (s.ok_pages, s.missing, s.crawled, s.lost) == (5, 1, 4, 1)
    assert s.duplicates == 2
    assert s.retried == 2
    assert s.dead_letters == 1
    assert not s.ok


def test_nothing_lost_is_ok_unless_a_worker_failed_or_time_ran_out() -> None:
    graph = SiteGraph(3, links=1)
    answered = {f"/page/{i}": 1 for i in range(3)}
    assert summarize(graph, answered, {}, {}, elapsed=1.0).ok
    assert not summarize(graph, answered, {}, {}, elapsed=1.0, workers_failed=["worker 1"]).ok
    assert not summarize(graph, answered, {}, {}, elapsed=1.0, timed_out=True).ok


def test_site_tally_reads_new_answers_only() -> None:
    log: list[tuple[float, str, int]] = [
        (0.0, "/page/1", 200), (0.1, "/page/2", 503), (0.2, "/robots.txt", 404),
    ]
    tally = SiteTally(SimpleNamespace(log=log), window=1.0)  # type: ignore[arg-type]
    tally.update()
    log += [(0.5, "/page/1", 200), (0.6, "/page/2", 200), (0.7, "/page/3", 404)]
    tally.update()
    tally.update()  # nothing new: nothing counted twice
    assert (tally.crawled, tally.duplicates, tally.retried, tally.not_found) == (2, 1, 1, 1)
    assert tally.last_new == 0.6
    assert tally.pages_per_second(now=1.05) == 4.0  # the /page/ answers of the last second


def test_demo_site_has_a_few_slow_flaky_and_missing_pages() -> None:
    g = demo_graph(5000)
    assert (len(g.slow), len(g.flaky), len(g.missing), g.ok_pages) == (5, 10, 10, 4990)
    tiny = demo_graph(10)
    assert tiny.ok_pages == 10  # too small for missing pages


def test_lost_pages_are_named_and_bloom_false_positives_told_apart(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    from scrapy import Request
    from scrapy.utils.request import RequestFingerprinter

    from scrapy_dist.dupefilter import BloomDupeFilter

    demo = Demo(DemoOptions(pages=100, run_dir=tmp_path))
    demo.client = redis_client
    with demo.site:
        # the crawl's filter holds page 7 (as if a false positive had made it skip it) but not page 8
        df = BloomDupeFilter(redis_client, demo.keys, RequestFingerprinter(), capacity=10_000)
        df.open()
        df.seen_tokens([df.tokens(Request(demo.site.page_url(7)))])
        lines = demo.explain_lost([7, 8], total=12)
    assert lines[0].startswith(f"lost: {demo.site.page_url(7)} -- the crawl's bloom filter took it")
    assert lines[1].startswith(f"lost: {demo.site.page_url(8)} -- never answered 200")
    assert lines[2] == "... and 10 more lost pages"


@pytest.mark.parametrize("width", [40, 200])
def test_summary_reads_the_same_on_any_terminal_width(width: int) -> None:
    graph = SiteGraph(300, links=10, missing=10)
    answered = {f"/page/{i}": 1 for i in range(300) if i not in graph.missing}
    console = Console(width=width, record=True, color_system=None)
    console.print(render_summary(summarize(graph, answered, {}, {"404": 10}, elapsed=12.5)))
    text = console.export_text()
    assert _figure("lost (must be 0)", text) == 0
    assert re.search(r"pages crawled\s+290 of 290", text), text


# -- the project ---------------------------------------------------------------------------------------
def test_without_a_source_checkout_the_demo_uses_the_packaged_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    import scrapy_dist.demo.site as demo_workers

    packaged = tmp_path / "_example_project"
    shutil.copytree(EXAMPLE_PROJECT, packaged, ignore=shutil.ignore_patterns(".scrapy", "__pycache__"))
    monkeypatch.setattr(demo_workers, "PACKAGED_PROJECT", packaged)
    root, copied = locate_project(tmp_path, example=tmp_path / "nowhere")
    assert copied and root == packaged
    listed = Zygote.run_cli([sys.executable, "-m", "scrapy", "list"], cwd=root, env=_env(), timeout=60)
    assert "demo" in listed.stdout.split(), listed.stderr
    assert locate_project(tmp_path) == (EXAMPLE_PROJECT, False)


def test_books_spider_follows_the_catalogue_and_extracts_books(monkeypatch: pytest.MonkeyPatch) -> None:
    from scrapy.http import HtmlResponse

    monkeypatch.syspath_prepend(str(EXAMPLE_PROJECT))
    from example_project.spiders.books import BooksSpider

    spider = BooksSpider()
    catalogue = HtmlResponse(
        "https://books.toscrape.com/catalogue/page-1.html",
        body=b"""<ol><li><article class="product_pod"><h3><a href="a-light_1000/index.html">A Light</a></h3>
        </article></li></ol><ul class="pager"><li class="next"><a href="page-2.html">next</a></li></ul>""",
    )
    urls = sorted(r.url for r in spider.parse(catalogue))
    assert urls == [
        "https://books.toscrape.com/catalogue/a-light_1000/index.html",
        "https://books.toscrape.com/catalogue/page-2.html",
    ]
    book = HtmlResponse(
        "https://books.toscrape.com/catalogue/a-light_1000/index.html",
        body=b"""<ul class="breadcrumb"><li><a href="/">Home</a></li><li><a href="/c">Poetry</a></li>
        <li class="active">A Light</li></ul><div class="product_main"><h1>A Light in the Attic</h1>
        <p class="price_color">\xc2\xa351.77</p><p class="instock availability"> In stock (22 available)
        </p></div><table><tr><th>UPC</th><td>a897fe39b1053632</td></tr></table>""",
        encoding="utf-8",
    )
    (item,) = spider.parse_book(book)
    assert item == {
        "url": book.url,
        "title": "A Light in the Attic",
        "price": "\u00a351.77",
        "availability": "In stock (22 available)",
        "upc": "a897fe39b1053632",
        "category": "Poetry",
    }


# -- the real thing ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_runs_to_its_summary_with_nothing_lost_after_a_kill(tmp_path: Path) -> None:
    """What the README promises, on a small site: the embedded Redis, two workers, one SIGKILLed (its
    leases run out after 3 s instead of the demo's 10: the crawl waits for them either way)."""
    proc = subprocess.run(
        _demo("--workers", "2", "--pages", "300"), cwd=tmp_path,
        env={**_env(), "SCRAPY_DIST_DEMO_LEASE_SECONDS": "3"}, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=150,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "(embedded, " in out
    assert re.search(r"chaos: SIGKILL worker \d+ \(pid \d+\)", out), out
    assert re.search(r"pages crawled\s+290 of 290", out), out
    assert _figure("lost (must be 0)", out) == 0
    assert _figure("dead letters", out) >= 10  # the 10 missing pages (404), at least once each
    assert _figure("retried", out) == 20  # 10 flaky pages, 503 twice each
    assert "OK: nothing lost." in out
    held = re.search(r"chaos: SIGKILL worker \d+ \(pid \d+\), holding (\d+) leased", out)
    if held:  # the victim held leases when it died: the wait for them is named, not a silent 0 pages/s
        wait = r"waiting for the killed worker's [\d,]+ leases to expire: back in the queue"
        assert re.search(wait, out), out


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_removes_the_crawl(redis_url: str, redis_client: redis.Redis) -> None:
    proc = subprocess.Popen(
        _demo("--workers", "2", "--pages", "2000", "--redis-url", redis_url), env=_env(),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    pids: list[int] = []
    try:
        lines, _ = read_demo_until_crawling(proc, pids.append)
        assert len(pids) == 2 and redis_client.dbsize() > 0, "".join(lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "Interrupted (SIGINT)" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert redis_client.dbsize() == 0  # the run's keys are gone
