"""The ``scrapy-dist`` command: a click group whose subcommands each live in ``scrapy_dist/cli/<name>.py``
and are registered by one import line at the bottom of this file.

Every subcommand finds Redis the same way (first match wins):

1. ``--redis-url`` (given before or after the subcommand name);
2. the ``REDIS_URL`` environment variable;
3. the Scrapy project's settings, when run inside a project (``REDIS_URL``, ``REDIS_SENTINELS``,
   ``REDIS_HOST``/``REDIS_PORT``, see :mod:`scrapy_dist.connection`);
4. the embedded Redis (the project's, inside a project, so it is the one its crawls use).

The project's other settings (``REDIS_PARAMS``, ``REDIS_KEY_PREFIX``, ...) apply in every case.

Writing a subcommand::

    from scrapy_dist.cli import ClientFactory, main, pass_redis

    @main.command()
    @pass_redis
    def status(redis: ClientFactory) -> None:
        client = redis.client()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import click

from scrapy_dist import __version__
from scrapy_dist.connection import (
    check_reachable,
    get_async_redis,
    get_redis,
    mask_url,
    resolve_target,
)
from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.keys import CrawlKeys, crawl_keys

if TYPE_CHECKING:
    import redis
    import redis.asyncio
    from scrapy.settings import Settings

F = TypeVar("F", bound=Callable[..., Any])

# Settings that name a Redis; an explicit --redis-url / $REDIS_URL replaces all of them.
_REDIS_LOCATION_SETTINGS = ("REDIS_URL", "REDIS_SENTINELS", "REDIS_HOST", "REDIS_PORT")


class ClientFactory:
    """The Redis every subcommand uses (resolved once, lazily) and the settings it came from.

    Lives on the click context (``ctx.obj``); subcommands get it through :func:`pass_redis`.
    """

    def __init__(self, redis_url: str | None = None, environ: Mapping[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.environ = os.environ if environ is None else environ
        self._settings: Settings | None = None
        self._source = ""

    def override_url(self, redis_url: str) -> None:
        """A subcommand's own ``--redis-url`` (wins over the group's)."""
        if self._settings is not None:
            raise RuntimeError("--redis-url given after the settings were resolved")
        self.redis_url = redis_url

    def _resolve(self) -> Settings:
        from scrapy.settings import Settings
        from scrapy.utils.project import inside_project

        in_project = inside_project()
        settings = _project_settings() if in_project else Settings()
        explicit = self.redis_url or self.environ.get("REDIS_URL")
        if explicit:
            for name in _REDIS_LOCATION_SETTINGS:
                settings.set(name, None, priority="cmdline")
            settings.set("REDIS_URL", explicit, priority="cmdline")
            self._source = "--redis-url" if self.redis_url else "REDIS_URL environment variable"
        elif in_project and any(settings.get(name) for name in _REDIS_LOCATION_SETTINGS):
            self._source = "project settings"
        else:
            self._source = "embedded Redis"
        return settings

    @property
    def settings(self) -> Settings:
        """Scrapy settings (the project's, if inside one) with the resolved Redis location."""
        if self._settings is None:
            self._settings = self._resolve()
        return self._settings

    @property
    def source(self) -> str:
        """Where the Redis location came from: ``--redis-url``, ``REDIS_URL environment variable``,
        ``project settings`` or ``embedded Redis``."""
        _ = self.settings
        return self._source

    @property
    def url(self) -> str:
        """The Redis URL, with its password (starts the embedded Redis if that is the one in use)."""
        return resolve_target(self.settings).display_url

    @property
    def masked_url(self) -> str:
        """:attr:`url` with the password masked, for output."""
        return mask_url(self.url)

    def client(self) -> redis.Redis:
        """A new synchronous client."""
        return get_redis(self.settings)

    def async_client(self) -> redis.asyncio.Redis:
        """A new ``redis.asyncio`` client."""
        return get_async_redis(self.settings)

    def check(self) -> None:
        """Raise :class:`~scrapy_dist.exceptions.RedisUnavailable` (one line) unless Redis answers."""
        check_reachable(self.settings)

    def keys(self, spider: str) -> CrawlKeys:
        """Key names of the crawl of ``spider`` (honours ``REDIS_KEY_PREFIX`` and friends)."""
        return crawl_keys(self.settings, spider)


def _project_settings() -> Settings:
    """The project's settings, without leaving ``SCRAPY_SETTINGS_MODULE`` behind in ``os.environ``
    (``get_project_settings()`` sets it; commands run in-process, e.g. in tests, must not inherit it)."""
    from scrapy.utils.project import get_project_settings

    saved = os.environ.get("SCRAPY_SETTINGS_MODULE")
    try:
        return get_project_settings()
    finally:
        if saved is None:
            os.environ.pop("SCRAPY_SETTINGS_MODULE", None)
        else:
            os.environ["SCRAPY_SETTINGS_MODULE"] = saved


class _Group(click.Group):
    """Turns scrapy-dist errors (Redis unreachable, ...) into one ``Error: ...`` line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ScrapyDistError as exc:
            raise click.ClickException(str(exc)) from exc


def _set_subcommand_url(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value:
        ctx.ensure_object(ClientFactory).override_url(value)


def pass_redis(f: F) -> F:
    """Subcommand decorator: accept ``--redis-url`` after the subcommand name too, and pass the shared
    :class:`ClientFactory` as the first argument."""
    passing = click.pass_obj(f)
    option = click.option(
        "--redis-url",
        metavar="URL",
        expose_value=False,
        callback=_set_subcommand_url,
        help="Redis to use (overrides the one given before the subcommand).",
    )
    return option(passing)  # type: ignore[return-value]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--redis-url",
    metavar="URL",
    help="Redis to use: redis://[user:password@]host:port/db, rediss://... or unix:///path. "
    "Default: $REDIS_URL, else the Scrapy project's settings, else the embedded Redis.",
)
@click.version_option(__version__, prog_name="scrapy-dist")
@click.pass_context
def main(ctx: click.Context, redis_url: str | None) -> None:
    """Manage distributed Scrapy crawls that share one frontier in Redis."""
    ctx.obj = ClientFactory(redis_url)


# Subcommands: one import line each (the module registers itself with @main.command()).
from scrapy_dist.cli import demo  # noqa: E402, F401
from scrapy_dist.cli import items  # noqa: E402, F401
from scrapy_dist.cli import dead  # noqa: E402, F401
from scrapy_dist.cli import status  # noqa: E402, F401
from scrapy_dist.cli import push  # noqa: E402, F401
from scrapy_dist.cli import embedded  # noqa: E402, F401
