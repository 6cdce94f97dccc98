"""Turning raw setting values (Python objects or ``-s`` strings) into checked, typed ones; every refusal is
a :class:`SettingsError`: ``scrapy-dist: <SETTING>=<value>: <what is wrong>; <what is expected>``."""

from __future__ import annotations

import difflib
import inspect
import json
import math
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from scrapy_dist.exceptions import ScrapyDistError
from scrapy_dist.settings.table import Setting

_SHOWN = 60  # longest value quoted in an error line


class SettingsError(ScrapyDistError, ValueError):
    """A setting value scrapy-dist refuses (a ``ValueError``); ``str()`` is the one line users see."""

    def __init__(self, name: str, value: Any, problem: str, expected: str) -> None:
        self.name, self.value, self.problem, self.expected = name, value, problem, expected
        super().__init__(f"scrapy-dist: {name}={_show(name, value)}: {problem}; {expected}")


def _show(name: str, value: Any) -> str:
    text = (mask_url(value) if name == "REDIS_URL" else value) if isinstance(value, str) else repr(value)
    text = " ".join(text.split()) if text.strip() else repr(text)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN - 3]}..."


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)
_AUTHORITY = re.compile(r"([^/?#]*)(.*)", re.DOTALL)


def mask_url(url: str) -> str:
    """``url`` with its password (userinfo or ``password=`` query) as ``***``: ``redis://user:***@host/0``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # a password may hold unencoded '#', '/', '?' or '@': the userinfo ends at the *last* '@' when what
    # precedes it looks like "user:..." (masking too much is the safe mistake)
    userinfo, at, after = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    masked = at and ":" in userinfo and not any(c in user for c in "/?#")
    authority, tail = _AUTHORITY.match(after if masked else rest).groups()  # type: ignore[union-attr]
    masked_tail = _QUERY_PASSWORD.sub(r"\1***", tail)
    return f"{scheme}://{user + ':***@' if masked else ''}{authority}{masked_tail}"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _number(spec: Setting, value: Any) -> float | int:
    integer = spec.kind == "int"
    what = "an integer" if integer else "a number"
    expected = f"expected {what} {spec.range_words}".rstrip()
    if spec.low == 0 and spec.low_open and spec.high is None:
        expected = f"expected a positive {what.split()[1]}"
    if isinstance(value, bool):
        raise SettingsError(spec.name, value, "not a number", expected)
    number: float | int
    if isinstance(value, (int, float)):
        number = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            number = int(text) if integer and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise SettingsError(spec.name, value, f"not {what}", expected) from None
    else:
        raise SettingsError(spec.name, value, f"not {what} but a {type(value).__name__}", expected)
    if isinstance(number, float):
        if not math.isfinite(number):
            raise SettingsError(spec.name, value, "not a finite number", expected)
        if integer and not number.is_integer():
            raise SettingsError(spec.name, value, "not an integer", expected)
    lo, hi = spec.low, spec.high
    too_low = lo is not None and (number <= lo if spec.low_open else number < lo)
    if too_low or (hi is not None and number > hi):
        raise SettingsError(spec.name, value, "out of range", expected)
    if spec.multiple_of and number % spec.multiple_of:
        raise SettingsError(spec.name, value, f"not a multiple of {spec.multiple_of:,}", expected)
    return int(number) if integer else float(number)


def _bool(spec: Setting, value: Any, expected: str = "expected True or False (1/0, true/false)") -> bool:
    if (text := str(value).strip().lower()) not in (*_TRUE, *_FALSE):  # True, 1 and "on" alike
        raise SettingsError(spec.name, value, "not a boolean", expected)
    return text in _TRUE


_CONTAINERS: dict[str, tuple[Any, str, str]] = {  #: kind -> (types taken, JSON kind of its text, expected)
    "dict": (Mapping, "object", 'expected a dict, or JSON like {"socket_timeout": 30}'),
    "list": ((list, tuple, set, frozenset), "list", "expected a list, or comma-separated values")}


def _container(spec: Setting, value: Any) -> Any:
    """A dict (or a JSON object) or a list (a JSON list, or comma-separated values)."""
    types, json_kind, expected = _CONTAINERS[spec.kind]
    text = value.strip() if isinstance(value, str) else None
    if text is not None and spec.kind == "list" and not text.startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    if text == "":
        return {}
    if text is not None:
        try:
            value = json.loads(text)
        except ValueError:
            raise SettingsError(spec.name, value, f"not a JSON {json_kind}", expected) from None
    if isinstance(value, types):
        return dict(value) if spec.kind == "dict" else list(value)
    raise SettingsError(spec.name, value, f"not a {spec.kind} but a {type(value).__name__}", expected)


def check_url(value: Any) -> str:
    name, expected = "REDIS_URL", "expected redis://[[user]:password@]host[:port][/db], rediss://... or" \
                                  " unix:///path/to/socket[?db=N]"
    if not isinstance(value, str):
        raise SettingsError(name, value, f"not a string but a {type(value).__name__}", expected)
    url = value.strip()
    if (match := re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(//)?", url)) is None or not match.group(2):
        # "127.0.0.1:6380" or "localhost:6379" parse as a scheme; "redis:/host" lacks a slash
        looks_like_ours = match is not None and match.group(1).lower() in ("redis", "rediss", "unix")
        problem = "malformed: the scheme must be followed by //" if looks_like_ours else "no scheme"
        raise SettingsError(name, value, problem, expected)
    if (scheme := match.group(1).lower()) not in ("redis", "rediss", "unix"):
        raise SettingsError(name, value, f"scheme {scheme}:// is not Redis", expected)
    rest = url[match.end():]
    if scheme == "unix":
        if not rest.rpartition("@")[2].split("?", 1)[0].startswith("/"):
            raise SettingsError(name, value, "no socket path", expected)
        return url
    hostport, _, tail = rest.rpartition("@")[2].partition("/")
    try:
        if urlsplit(f"redis://{hostport}").port == 0:  # above 65535 raises ValueError itself
            raise ValueError(0)
    except ValueError:
        raise SettingsError(name, value, "the port is not a number from 1 to 65535", expected) from None
    if hostport.endswith(":"):
        raise SettingsError(name, value, "empty port", expected)
    db = tail.split("?", 1)[0].split("#", 1)[0]
    if db and not (db.isascii() and db.isdigit() and len(db) <= 9):
        raise SettingsError(name, value, f"database {db!r} is not a number", expected)
    return url


_CONVERTERS = {"int": _number, "float": _number, "bool": _bool, "dict": _container, "list": _container}


def convert(spec: Setting, value: Any) -> Any:
    if value is None or (spec.optional and isinstance(value, str) and value.strip().lower() in ("", "none")):
        if spec.optional or spec.default is None:
            return None
        if spec.kind in ("dict", "list"):
            return type(spec.default)()
        raise SettingsError(spec.name, value, "missing", f"expected a {spec.type_name}")
    if spec.kind in _CONVERTERS:
        return _CONVERTERS[spec.kind](spec, value)
    if spec.kind == "auto_bool":
        auto = isinstance(value, str) and value.strip().lower() in ("", "auto", "none")
        return None if auto else _bool(spec, value, "expected True, False or None (auto-detect)")
    if spec.kind == "url":
        return check_url(value)
    if spec.kind == "choice":
        if (text := str(value).strip().lower()) not in spec.choices:
            raise SettingsError(spec.name, value, "unknown value",
                                f"expected one of {', '.join(spec.choices)}")
        return text
    if spec.kind == "size":
        text = str(value).strip().lower().replace("_", "")
        if isinstance(value, bool) or not re.fullmatch(r"\d+(b|k|kb|m|mb|g|gb)?", text):
            raise SettingsError(spec.name, value, "not a size", 'expected bytes or a size like "2gb"')
        return value
    if spec.kind == "secret":
        return (value if isinstance(value, bytes) else str(value).encode("utf-8")) or None
    if not isinstance(value, str):
        raise SettingsError(spec.name, value, f"not a string but a {type(value).__name__}",
                            "expected a string")
    return value


def sentinels(entries: list[Any]) -> tuple[tuple[str, int], ...]:
    out = []
    for entry in entries:
        try:
            if isinstance(entry, (tuple, list)):
                out.append((str(entry[0]), int(entry[1])))
                continue
            text = str(entry).strip()
            parts = urlsplit(text if "://" in text else f"redis://{text}")
            out.append((parts.hostname or "localhost", parts.port or 26379))
        except (ValueError, IndexError, TypeError):
            raise SettingsError("REDIS_SENTINELS", entries, f"{entry!r} is not an address",
                                'expected ["host:port", ...]') from None
    return tuple(out)


def domain_limits(rules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    expected = 'expected {"*.example.com": {"delay": 1.0, "concurrency": 2, "jitter": 0.5}}'
    for pattern, rule in rules.items():
        if not isinstance(rule, Mapping) or set(rule) - {"delay", "concurrency", "jitter"}:
            raise SettingsError("DOMAIN_LIMITS", rules, f"rule {pattern!r} is not a dict of delay,"
                                " concurrency, jitter", expected)
        for key, value in rule.items():
            kind, low = ("int", 1) if key == "concurrency" else ("float", 0)
            convert(Setting(f"DOMAIN_LIMITS[{pattern!r}][{key!r}]", None, kind, "", "scheduler", low=low),
                    value)
    return {str(pattern): dict(rule) for pattern, rule in rules.items()}


MAX_REVISIT_SECONDS = 10 * 365 * 86400.0


def check_seconds(value: Any) -> float | None:
    """``value`` as a revisit delay (None stays None); raises ValueError saying what is wrong."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number of seconds")
    if not math.isfinite(seconds := float(value)) or seconds <= 0 or seconds > MAX_REVISIT_SECONDS:
        raise ValueError(f"{value!r} is not between 0 (excluded) and {MAX_REVISIT_SECONDS:.0f} seconds")
    return seconds


def revisit_rules(rules: Any, floor: float = 0.0) -> dict[str, float | None]:
    """``REVISIT_AFTER`` checked: ``{glob: seconds or None}``, none below ``floor`` (REVISIT_MIN_INTERVAL)."""
    expected = 'expected {"*.example.com": 3600, "https://example.com/item/*": 2592000, "*/login*": None}'
    if not isinstance(rules, Mapping):
        raise SettingsError("REVISIT_AFTER", rules, "not a dict", expected)
    out: dict[str, float | None] = {}
    for pattern, seconds in rules.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise SettingsError("REVISIT_AFTER", dict(rules), f"rule {pattern!r} is not a glob", expected)
        try:
            out[pattern.strip()] = checked = check_seconds(seconds)
        except ValueError as exc:
            raise SettingsError("REVISIT_AFTER", dict(rules), f"rule {pattern!r}: {exc}", expected) from None
        if checked is not None and checked < floor:
            raise SettingsError("REVISIT_AFTER", dict(rules), f"rule {pattern!r}: {checked:g} s is below"
                                f" REVISIT_MIN_INTERVAL ({floor:g} s)",
                                "raise it, or lower REVISIT_MIN_INTERVAL")
    return out


_SECONDS = ("socket_timeout", "socket_connect_timeout", "health_check_interval")  # client options in seconds
_INTEGERS = {"max_connections": 1}  # client options that are whole numbers, with their least value
_OURS = frozenset({"sentinel_kwargs"})  # read by scrapy-dist itself (as REDIS_PARAMS' host, port and db)


@lru_cache(maxsize=1)
def known_options() -> frozenset[str]:
    """Every keyword one of the clients scrapy-dist builds accepts."""
    import redis.asyncio.cluster
    import redis.cluster
    names: set[str] = set(_OURS)
    conn = redis.connection
    for cls in (redis.Redis, redis.asyncio.Redis, redis.cluster.RedisCluster,
                redis.asyncio.cluster.RedisCluster, conn.AbstractConnection, conn.Connection,
                conn.SSLConnection, conn.UnixDomainSocketConnection, redis.ConnectionPool):
        names.update(p.name for p in inspect.signature(cls.__init__).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self")
    return frozenset(names)


def _check(name: str, value: Any, options: Mapping[str, Any]) -> None:
    known = known_options()
    for option, given in options.items():
        if option not in known:
            close = difflib.get_close_matches(str(option), sorted(known), n=1, cutoff=0.7)
            shown = value if name != "REDIS_PARAMS" else f"{{{option!r}: ...}}"  # a value may be secret
            raise SettingsError(name, shown, f"{option!r} is not a redis-py client option",
                                f"did you mean {close[0]}?" if close
                                else "expected keywords of redis.Redis, e.g. socket_timeout")
        if given is None or option not in (*_SECONDS, *_INTEGERS):
            continue
        whole, low = option in _INTEGERS, _INTEGERS.get(option, 0)
        if isinstance(given, bool) or not isinstance(given, int if whole else (int, float)) or given < low:
            shown = value if name != "REDIS_PARAMS" else given
            kind = "a whole number" if whole else "a number of seconds"
            where = f"{name}[{option!r}]" if name == "REDIS_PARAMS" else name
            raise SettingsError(where, shown, f"{option} is {given!r}, not {kind} >= {low}",
                                f"expected e.g. {option}={max(low, 5)}")


def check_client_options(url: str | None, params: Mapping[str, Any]) -> None:
    """Raise :class:`SettingsError` if ``REDIS_PARAMS`` or the query of ``REDIS_URL`` holds an option no
    client takes, or a timeout or pool size that is not a number."""
    if query := url.rpartition("@")[2].partition("?")[2] if url else "":  # a password may hold '?' or '/'
        from redis.connection import parse_url
        try:
            parsed = parse_url(f"redis://localhost?{query}")  # as redis-py reads the query of any URL
        except ValueError as exc:
            raise SettingsError("REDIS_URL", url, f"bad query option ({exc})",
                                "expected options like ?socket_timeout=5") from None
        _check("REDIS_URL", url, {k: v for k, v in parsed.items() if k != "host"})
    _check("REDIS_PARAMS", params, params)
