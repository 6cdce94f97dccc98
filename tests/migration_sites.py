"""Generated copies of the sites the migration projects crawl, served on 127.0.0.1.

Each site is a dict path -> HTML built from a seeded RNG (the same on every run) and served by
:class:`PagesServer`, a :class:`scrapy_dist.demo.site.SiteServer` that answers from the dict and records
every request in ``log`` as the demo site does.
"""

from __future__ import annotations

import random

from scrapy_dist.demo.site import SiteGraph, SiteServer


class PagesServer(SiteServer):
    """Serves a fixed ``{path: html}`` dict; any other path is a 404."""

    def __init__(self, pages: dict[str, str]) -> None:
        super().__init__(SiteGraph(1, links=0))
        self.pages = pages

    def respond(self, path: str) -> tuple[int, bytes, float]:
        page = self.pages.get(path)
        return (404, b"not found", 0.0) if page is None else (200, page.encode(), 0.0)


def _html(title: str, body: str) -> str:
    return f"<!doctype html><html><head><title>{title}</title></head><body>{body}</body></html>"


def jobs_board(cities: int = 3, list_pages: int = 4, per_page: int = 5, seed: int = 7) -> dict[str, str]:
    """A job board: ``/list/<city>/<n>`` listing pages (city links and pagination inside the
    ``hlist``/``dw_page`` blocks, an unrelated footer link outside them) and ``/jobs/<city>/<id>.html``
    job pages; a job is listed on one or two pages. Job pages link to other jobs (not to be followed)."""
    rng = random.Random(seed)
    pages: dict[str, str] = {}
    jobs: list[str] = []
    salaries = ["6-8千/月", "1-1.5万/月", "10-20万/年", "面议", "4500元/月以下"]
    for c in range(cities):
        for n in range(1, list_pages + 1):
            listed = [f"/jobs/city{c}/{1000 * c + 10 * n + k}.html" for k in range(per_page)]
            jobs += listed
            if jobs and rng.random() < 0.5:
                listed.append(rng.choice(jobs))  # a job listed twice
            links = "".join(f'<p class="t1"><a href="{j}">job</a></p>' for j in listed)
            cities_block = "".join(f'<a href="/list/city{k}/1">city {k}</a>' for k in range(cities))
            pager = "".join(f'<a href="/list/city{c}/{m}">{m}</a>' for m in range(1, list_pages + 1))
            pages[f"/list/city{c}/{n}"] = _html(
                f"city {c} page {n}",
                f'<div class="cn hlist">{cities_block}</div><div class="el">{links}</div>'
                f'<div class="dw_page">{pager}</div><div class="footer"><a href="/about">about</a></div>',
            )
    for i, path in enumerate(dict.fromkeys(jobs)):
        other = jobs[(i * 7) % len(jobs)]
        pages[path] = _html(
            f"job {i}",
            f'<div class="cn"><h1>Engineer {i}</h1><strong>{salaries[i % len(salaries)]}</strong>'
            f'<span class="lname">city {path.split("/")[2][4:]}</span></div>'
            f'<div class="t1"><span>{i % 5}年经验</span><span>本科</span></div><a href="{other}">more</a>',
        )
    pages["/about"] = _html("about", "<p>about us</p>")
    return pages


def yellow_pages(details: int = 40, seed: int = 11) -> dict[str, str]:
    """A business directory: ``/`` links to a few ``/info/s168-<id>.html`` detail pages, each detail
    page to a few others (so the master reaches them all); every fifth detail page has no contact block
    (the slave records it as an exception instead of an item)."""
    rng = random.Random(seed)
    ids = [20000 + 37 * i for i in range(details)]
    detail = [f"/info/s168-{i}.html" for i in ids]
    pages = {"/": _html("index", "".join(f'<a href="{p}">shop</a>' for p in detail[:3])
                        + '<a href="/news/1.html">news</a>')}
    pages["/news/1.html"] = _html("news", "<p>nothing to see</p>")
    for k, path in enumerate(detail):
        nxt = [detail[(k + 1) % details], detail[rng.randrange(details)]]
        links = "".join(f'<a href="{p}">related</a>' for p in nxt)
        contact = (
            "" if k % 5 == 4 else
            f'<div class="ptlxfsC"><ul><li><p>联系人：张{"三四五六七"[k % 5]}</p>'
            f"<p>电话：0759-{7100000 + k}</p>"
            f"<p>手机：{13800000000 + k}</p><p>地址：广东湛江{k}号</p></li></ul></div>"
        )
        pages[path] = _html(f"shop {k}", contact + links)
    return pages
