"""What a scrapy-redis project uses and what each use becomes on scrapy-dist, read from its source, and the
``scrapy-dist check-migration [PROJECT_DIR]`` command that prints it.

:func:`scan_project` parses the project's Python files (``ast``: nothing is imported or run) and returns one
:class:`Finding` per setting, import, class and hook that concerns scrapy-redis, with a status -- ``same``,
``changed`` (works differently: read the note) or ``action`` (edit the project) -- and the note of the
README's migration table (:mod:`scrapy_dist.cli.migration`), so the two never disagree. The command prints
``<file>:<line>: <status> <what> -- <what changes>`` per finding, then a count; exit 0 when nothing needs
action, 1 when something does, 2 when the directory cannot be read.
"""

from __future__ import annotations

import ast
import configparser
import importlib
from dataclasses import dataclass
from pathlib import Path

import click

from scrapy_dist.cli import main
from scrapy_dist.cli.migration import API_ROWS, FIRST_ROW
from scrapy_dist.frontier.orders import ALIASES as QUEUE_ALIASES
from scrapy_dist.settings.table import (
    ALIASES,
    CHANGED,
    CONNECTION_GUESSES,
    HONOURED,
    IGNORED,
    SCRAPY_REDIS_IGNORED,
    TABLE,
)

SAME, CHANGE, ACTION = "same", "changed", "action"
#: directories never read (virtualenvs, caches, VCS)
SKIP_DIRS = {".git", ".hg", ".tox", ".venv", "venv", "env", "__pycache__", "node_modules", "build", "dist"}
#: settings that say where Redis is; a project with none of them talked to localhost:6379
LOCATION_SETTINGS = ("REDIS_URL", "REDIS_HOST", "REDIS_PORT", "REDIS_SENTINELS")
#: scrapy-redis spider methods scrapy-dist never calls (seeds are read in ``async def start()``)
REMOVED_HOOKS = ("start_requests", "next_requests", "schedule_next_requests", "spider_idle", "setup_redis")
SPIDER_ATTRIBUTES = ("redis_key", "redis_batch_size", "max_idle_time", "redis_encoding")
SPIDER_BASES = {"RedisSpider", "RedisCrawlSpider"}
REDIS_CLIENTS = {"Redis", "StrictRedis", "from_url", "get_redis", "get_redis_from_settings"}


@dataclass(frozen=True)
class Finding:
    """One use of scrapy-redis in the project: where, what, its status and what changes."""

    path: str
    line: int
    subject: str
    status: str
    note: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.status:<7} {self.subject} -- {self.note}"


def _row(needle: str) -> tuple[str, str] | None:
    """(status word, note) of the first migration-table row whose scrapy-redis column names ``needle``."""
    for left, _right, status, note in API_ROWS:
        if needle in left:
            word = SAME if status == HONOURED else CHANGE if status == CHANGED else ACTION
            return word, note
    return None


def _counterpart(dotted: str) -> str | None:
    """``scrapy_dist.<rest>`` for ``scrapy_redis.<rest>`` if that object exists, else None."""
    target = "scrapy_dist" + dotted[len("scrapy_redis"):]
    module, _, name = target.rpartition(".")
    for mod, attr in ((target, None), (module, name)):
        try:
            obj = importlib.import_module(mod)
        except ImportError:
            continue
        if attr is None or hasattr(obj, attr):
            return target
    return None


def _dotted_finding(path: str, line: int, dotted: str, setting: str = "") -> Finding:
    """A ``scrapy_redis.x.y`` name written in settings or an import."""
    subject = f"{setting}: {dotted}" if setting else dotted
    if setting == "SCHEDULER_QUEUE_CLASS" and dotted in QUEUE_ALIASES:
        return Finding(path, line, subject, SAME, "accepted as written (the same order of the shared"
                       " frontier); `scrapy_dist.queue." + dotted.rsplit(".", 1)[1] + "` is its new name")
    target = _counterpart(dotted)
    row = _row(dotted.rsplit(".", 1)[0]) if target is None else _row(dotted)
    note = row[1] if row else ""
    if target is None:
        return Finding(path, line, subject, ACTION,
                       "no counterpart in scrapy-dist" + (f": {note}" if note else ""))
    return Finding(path, line, subject, ACTION, f"write `{target}`" + (f"; {note}" if note else ""))


# -- settings --------------------------------------------------------------------------------------
def _settings_module(root: Path) -> Path | None:
    """The settings file ``scrapy.cfg`` names, else the only ``settings.py`` of the project."""
    cfg = root / "scrapy.cfg"
    if cfg.is_file():
        parser = configparser.ConfigParser()
        parser.read(cfg, encoding="utf-8")
        module = parser.get("settings", "default", fallback="")
        if module:
            candidate = root.joinpath(*module.split(".")).with_suffix(".py")
            if candidate.is_file():
                return candidate
    found = [p for p in _python_files(root) if p.name == "settings.py"]
    return found[0] if len(found) == 1 else None


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def scan_settings(path: Path, rel: str) -> tuple[list[Finding], set[str]]:
    """Findings for a settings file, and the names it sets."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    table = {s.name: s for s in TABLE}
    out: list[Finding] = []
    names: set[str] = set()
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if not isinstance(target, ast.Name) or not target.id.isupper():
                continue
            name, line = target.id, node.lineno
            names.add(name)
            value = node.value if node.value is not None else ast.Constant(None)
            dotted = [t for t in _strings(value) if t.startswith("scrapy_redis.")]
            out.extend(_dotted_finding(rel, line, text, name) for text in dotted)
            spec = None if dotted else table.get(ALIASES.get(name, name))
            if name in SCRAPY_REDIS_IGNORED:
                out.append(Finding(rel, line, name, ACTION, "not applied (one WARNING at start): "
                                   + SCRAPY_REDIS_IGNORED[name] + "; remove it"))
            elif name in CONNECTION_GUESSES:
                out.append(Finding(rel, line, name, ACTION, CONNECTION_GUESSES[name]))
            elif spec is not None and spec.status in (HONOURED, CHANGED, IGNORED):
                status = {HONOURED: SAME, CHANGED: CHANGE, IGNORED: ACTION}[spec.status]
                if spec.status == CHANGED and spec.note.startswith("default "):
                    status = SAME  # set explicitly: the default that changed does not apply
                alias = f"alias of {spec.name}" if name != spec.name else ""
                note = "; ".join(x for x in (alias, spec.note) if x) or "honoured as in scrapy-redis"
                out.append(Finding(rel, line, name, status, note))
    return out, names


# -- Python files ----------------------------------------------------------------------------------
def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _spider_findings(cls: ast.ClassDef, rel: str, kind: str) -> list[Finding]:
    row = _row("RedisSpider")
    out = [Finding(rel, cls.lineno, f"class {cls.name}({kind})", SAME, row[1] if row else "")]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    hooks = _row("next_requests()")
    for name in REMOVED_HOOKS:
        if name in methods and "start" not in methods:
            out.append(Finding(rel, methods[name].lineno, f"{cls.name}.{name}()", ACTION,
                               "never called (one WARNING at start): " + (hooks[1] if hooks else "")))
    if "make_request_from_data" in methods:
        made = _row("make_request_from_data")
        out.append(Finding(rel, methods["make_request_from_data"].lineno,
                           f"{cls.name}.make_request_from_data()", SAME, made[1] if made else ""))
    attrs = _row("redis_key")
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in SPIDER_ATTRIBUTES
                                                 for t in node.targets):
            names = ", ".join(t.id for t in node.targets if isinstance(t, ast.Name))
            out.append(Finding(rel, node.lineno, f"{cls.name}.{names}", SAME, attrs[1] if attrs else ""))
        is_rules = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "rules" for t in node.targets)
        if (is_rules and isinstance(node, ast.Assign)
                and any(isinstance(k, ast.keyword) and k.arg == "callback" for k in ast.walk(node.value))):
            seeds = _row("seeds bypass the dupefilter")
            out.append(Finding(rel, node.lineno, f"{cls.name}.rules with a callback", SAME,
                               seeds[1] if seeds else ""))
    sets_server = any(isinstance(n, ast.Attribute) and n.attr == "server" and isinstance(n.ctx, ast.Store)
                      for n in ast.walk(cls))
    reads = sorted({n.lineno for n in ast.walk(cls)
                    if isinstance(n, ast.Attribute) and n.attr == "server" and isinstance(n.ctx, ast.Load)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"})
    if reads and not sets_server:
        out.append(Finding(rel, reads[0], f"{cls.name}: self.server", ACTION,
                           "a scrapy-dist spider has no `server` (one WARNING at start): set `self.server ="
                           " scrapy_dist.connection.get_redis(crawler.settings)` in `from_crawler`"))
    return out


def _pipeline_findings(cls: ast.ClassDef, rel: str) -> list[Finding]:
    row = _row("RedisPipeline")
    note = row[1] if row else ""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    uses_server = any(isinstance(n, ast.Attribute) and n.attr == "server" for n in ast.walk(cls))
    if "_process_item" in methods or ("__init__" in methods and uses_server):
        return [Finding(rel, cls.lineno, f"class {cls.name}(RedisPipeline)", ACTION, note)]
    return [Finding(rel, cls.lineno, f"class {cls.name}(RedisPipeline)", CHANGE, note)]


def scan_source(path: Path, rel: str, located: bool) -> list[Finding]:
    """Findings for one Python file; ``located``: the settings say where Redis is."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", 0) or 0
        return [Finding(rel, line, "unreadable file", CHANGE, f"not checked: {exc}")]
    out: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "scrapy_redis":
            for alias in node.names:
                out.append(_dotted_finding(rel, node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "scrapy_redis":
                    out.append(_dotted_finding(rel, node.lineno, alias.name))
        elif isinstance(node, ast.ClassDef):
            bases = {_base_name(b) for b in node.bases}
            kind = next(iter(sorted(bases & SPIDER_BASES)), "")
            if kind:
                out.extend(_spider_findings(node, rel, kind))
            if "RedisPipeline" in bases:
                out.extend(_pipeline_findings(node, rel))
        elif isinstance(node, ast.Call) and _base_name(node.func) in REDIS_CLIENTS:
            status = SAME if located else ACTION
            where = ("the settings name the Redis, so the crawl uses the one this client reaches"
                     if located else "the settings name no Redis: this client reaches localhost:6379, the"
                     " crawl the embedded Redis; set REDIS_URL")
            out.append(Finding(rel, node.lineno, "a Redis client of the project's own", status, where))
    return out


def scan_project(root: Path) -> list[Finding]:
    """Every finding in the project at ``root`` (settings first, then the other files in path order).

    Raises ``FileNotFoundError`` if ``root`` is not a directory.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    settings = _settings_module(root)
    findings: list[Finding] = []
    names: set[str] = set()
    if settings is not None:
        rel = settings.relative_to(root).as_posix()
        findings, names = scan_settings(settings, rel)
    located = bool(names.intersection(LOCATION_SETTINGS))
    for path in _python_files(root):
        if path != settings:
            findings.extend(scan_source(path, path.relative_to(root).as_posix(), located))
    uses = "SCHEDULER" in names or any("scrapy_redis" in f.subject for f in findings)
    if settings is not None and uses:
        rel = settings.relative_to(root).as_posix()
        if not located:
            findings.append(Finding(rel, 0, "no Redis setting", ACTION, f"{FIRST_ROW[1]}: {FIRST_ROW[2]}"))
        if "SCHEDULER_PERSIST" not in names:
            persist = {s.name: s for s in TABLE}["SCHEDULER_PERSIST"]
            findings.append(Finding(rel, 0, "SCHEDULER_PERSIST not set", CHANGE, persist.note))
    return findings


@main.command("check-migration")
@click.argument("project_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="Print only what needs action (and the count).")
def check_migration(project_dir: Path, quiet: bool) -> None:
    """List every scrapy-redis setting, import, spider pattern and hook of the project in PROJECT_DIR
    (default: here) with what changes on scrapy-dist; exit status 1 if anything needs action."""
    try:
        findings = scan_project(project_dir)
    except (FileNotFoundError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    counts = {ACTION: 0, CHANGE: 0, SAME: 0}
    for finding in findings:
        counts[finding.status] += 1
        if not quiet or finding.status == ACTION:
            click.echo(str(finding))
    if not findings:
        click.echo(f"{project_dir}: no scrapy-redis setting, import or spider found")
        return
    click.echo(f"{len(findings)} found: {counts[ACTION]} need action, {counts[CHANGE]} changed,"
               f" {counts[SAME]} same (the README's migration table says more)")
    if counts[ACTION]:
        raise SystemExit(1)
