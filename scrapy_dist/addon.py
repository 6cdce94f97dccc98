"""The scrapy-dist Scrapy add-on: ``ADDONS = {"scrapy_dist.Addon": 0}`` enables the shared frontier, the
dupefilter, the components and the resolver refusing ``SCHEDULER_DENY_NETWORKS``, never over what the user
set: a setting only while it has Scrapy's default, a component only if the user's dict mentions neither it
nor the Scrapy one it replaces."""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import TYPE_CHECKING

from scrapy.commands import ScrapyCommand
from scrapy.settings import SETTINGS_PRIORITIES
from scrapy.utils.misc import load_object

from scrapy_dist.settings import reader as components

if TYPE_CHECKING:
    from types import FrameType

    from scrapy.crawler import Crawler
    from scrapy.settings import BaseSettings
    from typing_extensions import Self

logger = logging.getLogger(__name__)

#: Scrapy's commands that fetch a page or two for a person (``view`` is a ``fetch``): with the add-on they
#: would join the shared crawl and record their URLs in its dupefilter.
TOOL_COMMANDS = ("scrapy.commands.shell", "scrapy.commands.parse", "scrapy.commands.fetch",
                 "scrapy.commands.check")


def tool_command() -> str | None:
    """The Scrapy tool command (``parse``, ...) the add-on is loaded under, from the stack (not in argv)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if isinstance(command := frame.f_locals.get("self"), ScrapyCommand):
            if isinstance(command, tuple(load_object(f"{m}.Command") for m in TOOL_COMMANDS)):
                return type(command).__module__.rpartition(".")[2]
            return None
        frame = frame.f_back
    return None


def _user_set(settings: BaseSettings, name: str) -> bool:
    return (settings.getpriority(name) or 0) > SETTINGS_PRIORITIES["default"]


def _available(path: str) -> bool:
    """Whether the class at ``path`` can be imported (a missing optional module is not an error)."""
    module, _, name = path.rpartition(".")
    try:
        return importlib.util.find_spec(module) is not None and hasattr(importlib.import_module(module), name)
    except ImportError as exc:
        logger.warning("scrapy-dist add-on: cannot import %s (%s); keeping Scrapy's component", path, exc)
        return False


class Addon:
    """Scrapy add-on enabling scrapy-dist with sensible defaults (see the module docstring)."""

    def __init__(self, crawler: Crawler | None = None) -> None:
        self.crawler = crawler

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        return cls(crawler)

    @classmethod
    def update_pre_crawler_settings(cls, settings: BaseSettings) -> None:
        """The reactor's DNS resolver: ours, unless the project chose one (``TWISTED_DNS_RESOLVER``)."""
        if not (_user_set(settings, "TWISTED_DNS_RESOLVER") or _user_set(settings, "DNS_RESOLVER")):
            settings.set("TWISTED_DNS_RESOLVER", "scrapy_dist.egress.DenyNetworksResolver", priority="addon")

    def update_settings(self, settings: BaseSettings) -> None:
        if (command := tool_command()) is not None:
            logger.info("scrapy-dist add-on: off for `scrapy %s` (it stays out of the shared crawl)", command)
            return
        for name, value in components.SETTINGS.items():
            if not _user_set(settings, name):
                settings.set(name, value, priority="addon")
        for c in components.COMPONENTS:
            user = settings.getdict(c.setting)
            if c.replaces:  # ours in place of Scrapy's, unless the user's dict names either
                mentioned = components.mentions(user, c.replaces) or components.mentions(user, c.path)
                if mentioned or not _available(c.path):
                    continue
                settings.set_in_component_priority_dict(c.setting, load_object(c.replaces), None)
            elif components.mentions(user, c.path):
                continue
            settings.set_in_component_priority_dict(c.setting, load_object(c.path), c.order)
        # before Scrapy loads SCHEDULER and STATS_CLASS, which would fail with a traceback
        if self.crawler is not None:
            components.refuse_misspelt_components(self.crawler)
        else:
            components.check_components(settings)
        _warn_foreign_scheduler(settings)


def _warn_foreign_scheduler(settings: BaseSettings) -> None:
    """One WARNING when the project keeps a SCHEDULER of its own: the crawl then has no shared frontier."""
    from scrapy_dist.frontier.scheduler import Scheduler
    path = settings.get("SCHEDULER")
    try:
        ours = issubclass(load_object(path), Scheduler)
    except (ImportError, AttributeError, ValueError, NameError, TypeError):
        ours = False  # Scrapy refuses it when it builds the engine
    if not ours:
        logger.warning("scrapy-dist add-on: SCHEDULER = %r (set by the project) is not scrapy-dist's, so this"
                       " crawl does not share its frontier in Redis; remove that setting if unintended", path)
