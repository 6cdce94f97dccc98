"""The components scrapy-dist runs in a crawl besides its scheduler and dupefilter: the one list the add-on
enables (``ADDONS = {"scrapy_dist.Addon": 0}``) and the scheduler checks on the two-line path
(``SCHEDULER`` and ``DUPEFILTER_CLASS`` only), so that both give the same crawl.

Each :class:`Component` says how the scheduler can run it without the add-on: ``signals`` (an extension:
built and connected to the crawler's signals by the scheduler itself), ``chain`` (a downloader middleware
whose place in the chain does not matter for what it guards: put into the running downloader's chain) or
``position`` (it must sit at its place among Scrapy's middlewares, or replace one of Scrapy's: only the
add-on can; the scheduler names it in one WARNING).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scrapy.utils.misc import load_object

#: the add-on line that enables everything below
ADDON_LINE = 'ADDONS = {"scrapy_dist.Addon": 0}'


@dataclass(frozen=True)
class Component:
    """One component: its class path, the component setting it goes in, its order, how the scheduler runs
    it on the two-line path (``signals``, ``chain`` or ``position``), Scrapy's component it replaces, and
    what a crawl lacks without it (for the WARNING)."""

    path: str
    setting: str
    order: int
    attach: str
    lacks: str = ""
    replaces: str = ""
    #: a DistSettings attribute path (``scheduler.revisit_conditional``): the component does nothing while
    #: it is false, so the two-line path lacks nothing then
    when: str = ""


#: Plain settings the add-on fills in while they hold Scrapy's default.
SETTINGS = {
    "SCHEDULER": "scrapy_dist.scheduler.Scheduler",
    "DUPEFILTER_CLASS": "scrapy_dist.dupefilter.BloomDupeFilter",
}

COMPONENTS = (
    Component("scrapy_dist.extensions.ClusterStats", "EXTENSIONS", 500, "signals"),
    Component("scrapy_dist.extensions.IdleMonitor", "EXTENSIONS", 500, "signals"),
    Component("scrapy_dist.extensions.ErrorMonitor", "EXTENSIONS", 500, "signals"),
    # first in the chain, so credentials are remembered as scheduled before other middlewares add theirs
    Component("scrapy_dist.middlewares.ScheduledHeadersMiddleware", "DOWNLOADER_MIDDLEWARES", 10,
              "position", "credential headers the spider set kept apart from those middlewares add"),
    # denied networks refused before any work; anywhere in the chain, it refuses before the download
    Component("scrapy_dist.middlewares.DenyNetworksMiddleware", "DOWNLOADER_MIDDLEWARES", 20,
              "chain", "SCHEDULER_DENY_NETWORKS"),
    # last, to learn which credential values the middlewares added
    Component("scrapy_dist.middlewares.AddedCredentialsMiddleware", "DOWNLOADER_MIDDLEWARES", 990,
              "position", "credential headers added by middlewares kept out of the shared queue"),
    # REVISIT_CONDITIONAL: a 304 to a conditional revisit ends the request (off without the setting)
    Component("scrapy_dist.middlewares.ConditionalRevisitMiddleware", "DOWNLOADER_MIDDLEWARES", 580,
              "position", "REVISIT_CONDITIONAL (a 304 ends a conditional revisit)",
              when="scheduler.revisit_conditional"),
    Component("scrapy_dist.middlewares.retry.RetryMiddleware", "DOWNLOADER_MIDDLEWARES", 550, "position",
              "delayed retries through the shared frontier (Scrapy's RetryMiddleware retries at once, on"
              " this worker)", replaces="scrapy.downloadermiddlewares.retry.RetryMiddleware"),
    Component("scrapy_dist.middlewares.HttpErrorMiddleware", "SPIDER_MIDDLEWARES", 50, "position",
              "dead letters for HTTP error responses",
              replaces="scrapy.spidermiddlewares.httperror.HttpErrorMiddleware"),
)


def mentions(component_dict: dict[Any, Any], path: str) -> bool:
    """Whether a component dict (a project's ``EXTENSIONS``, ...) names the class at ``path``, enabled or
    disabled with ``None``, by any import path or as the class itself."""
    target = load_object(path)
    for key in component_dict:
        try:
            if (load_object(key) if isinstance(key, str) else key) is target:
                return True
        except (ImportError, AttributeError, ValueError, NameError):
            continue
    return False
