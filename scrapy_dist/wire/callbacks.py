"""Which spider methods a request in Redis may name as its callback or errback, both ways: the name
:func:`~scrapy_dist.wire.codec.encode_request` stores for a bound method, and the method an untrusted name is
resolved to -- only a public method the spider's own code defines (or one of CrawlSpider's rule
dispatchers), never Scrapy's hooks and plumbing.
"""

from __future__ import annotations

import inspect
import types
from typing import TYPE_CHECKING, Any

from scrapy.spiders import CrawlSpider

from scrapy_dist.exceptions import RejectedEntry, UnserializableRequest

if TYPE_CHECKING:
    from scrapy import Spider

__all__ = ["HOOK_NAMES", "entry_callback", "method_name", "spider_method", "user_defined"]

#: private dispatchers of CrawlSpider rules: rule requests name them, with the rule index in meta
_CRAWLSPIDER_METHODS = frozenset({"_callback", "_errback"})
#: RedisCrawlSpider's public stand-ins for them (defined by scrapy-dist, so not "user-defined")
_RULE_METHODS = frozenset({"rule_callback", "rule_errback"})


def method_name(func: Any, spider: Spider | None, what: str) -> str | None:
    """The name a request stores for its callback/errback ``func``: a method of ``spider`` (or a name
    already); raises :class:`UnserializableRequest` for anything else."""
    if func is None:
        return None
    if isinstance(func, str):
        return func
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", None)
    bound_to_spider = owner is not None and (spider is None or owner is spider)
    if bound_to_spider and name and getattr(owner, name, None) == func:
        return str(name)
    raise UnserializableRequest(f"{what} {func!r} is not a method of the spider", what)


def _framework_module(module: Any) -> bool:
    return not isinstance(module, str) or module.split(".", 1)[0] in ("scrapy", "scrapy_dist")


#: Scrapy's hooks and spider plumbing: never a callback, even where the spider's own code overrides them
HOOK_NAMES = frozenset({
    "start", "start_requests", "closed", "close", "log", "make_request_from_data", "from_crawler",
    "update_settings", "handles_request", "set_crawler", "make_requests_from_url", "parse_start_url",
    "process_results", "process_start", "process_start_requests", "spider_opened", "spider_idle",
    "spider_closed", "has_callback",
})


def user_defined(cls: type, name: str) -> bool:
    """Whether ``name`` is a plain function defined by a class of the user's, not by Scrapy or
    scrapy-dist: ``start``, ``log``, ``make_request_from_data``, ``closed``, ``Spider.parse`` (which only
    raises) are methods of every spider, but no entry read from Redis has any business calling them --
    nor the hooks of :data:`HOOK_NAMES` where the spider's code overrides them."""
    if not isinstance(name, str) or name.startswith("_") or not name.isidentifier() or name in HOOK_NAMES:
        return False
    for klass in cls.__mro__:
        if name in vars(klass):
            value = inspect.getattr_static(klass, name)
            return isinstance(value, types.FunctionType) and not _framework_module(klass.__module__)
    return False


def spider_method(spider: Spider, name: Any, what: str) -> Any:
    """Resolve ``name`` to a public method of ``spider``; reject anything else (shared with seeds)."""
    if not isinstance(name, str):  # checked first: a list or map is not even hashable
        raise RejectedEntry(f"bad_{what}", f"{what} has type {type(name).__name__}")
    if name in _CRAWLSPIDER_METHODS and isinstance(spider, CrawlSpider):
        pass  # CrawlSpider routes rule requests through these two
    elif not name.isidentifier() or name.startswith("_"):
        raise RejectedEntry(f"bad_{what}", f"{what} {name[:40]!r} is not a public method name")
    method = getattr(spider, name, None)
    if method is None or not callable(method) or getattr(method, "__self__", None) is not spider:
        raise RejectedEntry(f"bad_{what}", f"spider has no method {name[:40]!r}")
    return method


def entry_callback(spider: Spider, name: Any, what: str) -> Any:
    """The callback/errback a queue entry names: a method the spider's own code defines (as for seeds),
    or one of CrawlSpider's rule dispatchers."""
    method = spider_method(spider, name, what)
    if isinstance(spider, CrawlSpider) and (name in _CRAWLSPIDER_METHODS or name in _RULE_METHODS):
        return method
    if not user_defined(type(spider), name):
        raise RejectedEntry(f"bad_{what}", f"{name!r} is not a method defined by the spider's code")
    return method
