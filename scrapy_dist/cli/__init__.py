"""The ``scrapy-dist`` command: a click group whose subcommands each live in ``scrapy_dist/cli/<name>.py``
and are registered by one import line at the bottom of this file.

Every subcommand finds Redis the way workers do (first match wins; one function,
:func:`scrapy_dist.connection.resolve_target`):

1. ``--redis-url`` (given before or after the subcommand name; the command line's ``-s REDIS_URL``);
2. the Scrapy project's settings, when run inside a project (``REDIS_URL``, ``REDIS_SENTINELS``,
   ``REDIS_HOST``/``REDIS_PORT``, see :mod:`scrapy_dist.connection`);
3. the ``REDIS_URL`` environment variable;
4. the embedded Redis (the project's, inside a project, so it is the one its crawls use).

Every setting is checked as a worker checks it: a bad value is the same one line, exit status 1.

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
from scrapy_dist.settings import DistSettings, SettingsError

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
        self._dist: DistSettings | None = None
        self._source = ""

    def override_url(self, redis_url: str) -> None:
        """A subcommand's own ``--redis-url`` (wins over the group's)."""
        if self._settings is not None:
            raise RuntimeError("--redis-url given after the settings were resolved")
        self.redis_url = redis_url

    def _resolve(self) -> Settings:
        from scrapy.settings import Settings
        from scrapy.utils.project import inside_project

        settings = _project_settings() if inside_project() else Settings()
        if self.redis_url:
            for name in _REDIS_LOCATION_SETTINGS:
                settings.set(name, None, priority="cmdline")
            settings.set("REDIS_URL", self.redis_url, priority="cmdline")
        # checked as a worker checks them (SettingsError: one line), with the same Redis order
        self._dist = DistSettings.from_settings(settings, environ=self.environ)
        for line in self._dist.warnings:
            click.echo(f"Warning: {line}", err=True)
        source = self._dist.connection.source
        if self.redis_url:
            self._source = "--redis-url"
        elif source == "embedded":
            self._source = "embedded Redis"
        elif source == "REDIS_URL environment variable":
            self._source = source
        else:
            self._source = "project settings"
        return settings

    @property
    def settings(self) -> Settings:
        """Scrapy settings (the project's, if inside one) with the resolved Redis location."""
        if self._settings is None:
            self._settings = self._resolve()
        return self._settings

    @property
    def dist(self) -> DistSettings:
        """The typed, checked scrapy-dist settings (:class:`~scrapy_dist.settings.DistSettings`)."""
        _ = self.settings
        assert self._dist is not None
        return self._dist

    @property
    def source(self) -> str:
        """Where the Redis location came from: ``--redis-url``, ``REDIS_URL environment variable``,
        ``project settings`` or ``embedded Redis``."""
        _ = self.settings
        return self._source

    @property
    def url(self) -> str:
        """The Redis URL, with its password (starts the embedded Redis if that is the one in use)."""
        return resolve_target(self.dist).display_url

    @property
    def masked_url(self) -> str:
        """:attr:`url` with the password masked, for output."""
        return mask_url(self.url)

    def client(self) -> redis.Redis:
        """A new synchronous client."""
        return get_redis(self.dist)

    def async_client(self) -> redis.asyncio.Redis:
        """A new ``redis.asyncio`` client."""
        return get_async_redis(self.dist)

    def check(self) -> None:
        """Raise :class:`~scrapy_dist.exceptions.RedisUnavailable` (one line) unless Redis answers."""
        check_reachable(self.dist)

    def keys(self, spider: str) -> CrawlKeys:
        """Key names of the crawl of ``spider`` (honours ``REDIS_KEY_PREFIX`` and friends)."""
        return crawl_keys(self.dist, spider)


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


class _OneLine(click.ClickException):
    """A settings error: printed as the very line a worker logs (no ``Error:`` prefix), exit status 1."""

    def show(self, file: Any = None) -> None:
        click.echo(self.message, err=True)


class _Group(click.Group):
    """Turns scrapy-dist errors (Redis unreachable, ...) into one ``Error: ...`` line and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SettingsError as exc:
            raise _OneLine(str(exc)) from exc
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
