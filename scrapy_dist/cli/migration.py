"""``scrapy-dist check-migration`` and the rows of the README's migration table (:data:`API_ROWS`: data in
``migration.json``, read by ``tools/migration_table.py`` too; the settings rows come from
:mod:`scrapy_dist.settings.table`). :func:`scan_project` reads a project with ``ast``, importing nothing."""

from __future__ import annotations

import ast
import configparser
import json
import pkgutil
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import click

from scrapy_dist.cli import LOCATION_SETTINGS, main
from scrapy_dist.frontier.orders import ALIASES as QUEUE_ALIASES
from scrapy_dist.settings import table as settings_table
from scrapy_dist.settings.table import ALIASES, CHANGED, HONOURED, IGNORED, SCRAPY_REDIS_IGNORED

REMOVED = "removed"  #: a scrapy-redis class or function with no counterpart

#: The table's rows (migration.json): first the row every migrating user must read (scrapy-redis, scrapy-dist,
#: what changes), then classes, functions, hooks, behaviour (scrapy-redis, scrapy-dist, status, what changes).
_TABLE = json.loads(resources.files(__package__).joinpath("migration.json").read_text(encoding="utf-8"))
FIRST_ROW: list[str] = _TABLE["first_row"]
API_ROWS: list[list[str]] = _TABLE["api_rows"]

SAME, CHANGE, ACTION = "same", "changed", "action"  #: a finding's status: nothing to do, read the note, act
#: directories never read (virtualenvs, caches, VCS)
SKIP_DIRS = {".git", ".hg", ".tox", ".venv", "venv", "env", "__pycache__", "node_modules", "build", "dist"}
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


def _note(needle: str) -> str:
    """The note of the first migration-table row whose scrapy-redis column names ``needle``."""
    return next((note for left, _right, _status, note in API_ROWS if needle in left), "")


def _dotted_finding(path: str, line: int, dotted: str, setting: str = "") -> Finding:
    """A ``scrapy_redis.x.y`` name written in settings or an import."""
    subject = f"{setting}: {dotted}" if setting else dotted
    if setting == "SCHEDULER_QUEUE_CLASS" and dotted in QUEUE_ALIASES:
        return Finding(path, line, subject, SAME, "accepted as written (the same order of the shared"
                       " frontier); `scrapy_dist.queue." + dotted.rsplit(".", 1)[1] + "` is its new name")
    target = "scrapy_dist" + dotted[len("scrapy_redis"):]  # its counterpart, if that object exists
    try:
        pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError):
        note = _note(dotted.rsplit(".", 1)[0])
        return Finding(path, line, subject, ACTION, "no counterpart in scrapy-dist" + (note and f": {note}"))
    note = _note(dotted)
    return Finding(path, line, subject, ACTION, f"write `{target}`" + (note and f"; {note}"))


def _settings_module(root: Path) -> Path | None:
    """The settings file ``scrapy.cfg`` names, else the only ``settings.py`` of the project."""
    parser = configparser.ConfigParser()
    parser.read(root / "scrapy.cfg", encoding="utf-8")
    module = parser.get("settings", "default", fallback="")
    if module and (candidate := root.joinpath(*module.split(".")).with_suffix(".py")).is_file():
        return candidate
    found = [p for p in _python_files(root) if p.name == "settings.py"]
    return found[0] if len(found) == 1 else None


def scan_settings(path: Path, rel: str) -> tuple[list[Finding], set[str]]:
    """Findings for a settings file, and the names it sets."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out: list[Finding] = []
    names: set[str] = set()
    assigned = [(target, node) for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    for target, node in assigned:
        if not isinstance(target, ast.Name) or not target.id.isupper():
            continue
        name, line = target.id, node.lineno
        names.add(name)
        dotted = [n.value for n in ast.walk(node.value or ast.Constant(None)) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and n.value.startswith("scrapy_redis.")]
        out.extend(_dotted_finding(rel, line, text, name) for text in dotted)
        spec = None if dotted else settings_table.BY_NAME.get(ALIASES.get(name, name))
        if name in SCRAPY_REDIS_IGNORED:
            note = f"not applied (one WARNING at start): {SCRAPY_REDIS_IGNORED[name]}; remove it"
            out.append(Finding(rel, line, name, ACTION, note))
        elif name in settings_table.CONNECTION_GUESSES:
            out.append(Finding(rel, line, name, ACTION, settings_table.CONNECTION_GUESSES[name]))
        elif spec is not None and spec.status in (HONOURED, CHANGED, IGNORED):
            status = {HONOURED: SAME, CHANGED: CHANGE, IGNORED: ACTION}[spec.status]
            if spec.status == CHANGED and spec.note.startswith("default "):
                status = SAME  # set explicitly: the default that changed does not apply
            alias = f"alias of {spec.name}" if name != spec.name else ""
            note = "; ".join(x for x in (alias, spec.note) if x) or "honoured as in scrapy-redis"
            out.append(Finding(rel, line, name, status, note))
    return out, names


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))


def _base_name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _spider_findings(cls: ast.ClassDef, rel: str, kind: str) -> list[Finding]:
    out = [Finding(rel, cls.lineno, f"class {cls.name}({kind})", SAME, _note("RedisSpider"))]
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    out += [Finding(rel, methods[name].lineno, f"{cls.name}.{name}()", ACTION,
                    "never called (one WARNING at start): " + _note("next_requests()"))
            for name in REMOVED_HOOKS if name in methods and "start" not in methods]
    if "make_request_from_data" in methods:
        out.append(Finding(rel, methods["make_request_from_data"].lineno,
                           f"{cls.name}.make_request_from_data()", SAME, _note("make_request_from_data")))
    for node in (n for n in cls.body if isinstance(n, ast.Assign)):
        names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if set(names) & set(SPIDER_ATTRIBUTES):
            out.append(Finding(rel, node.lineno, f"{cls.name}.{', '.join(names)}", SAME, _note("redis_key")))
        if "rules" in names and any(isinstance(k, ast.keyword) and k.arg == "callback"
                                    for k in ast.walk(node.value)):
            out.append(Finding(rel, node.lineno, f"{cls.name}.rules with a callback", SAME,
                               _note("seeds bypass the dupefilter")))
    server = [n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and n.attr == "server"]
    reads = sorted(n.lineno for n in server
                   if isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name) and n.value.id == "self")
    if reads and not any(isinstance(n.ctx, ast.Store) for n in server):
        out.append(Finding(rel, reads[0], f"{cls.name}: self.server", ACTION,
                           "a scrapy-dist spider has no `server` (one WARNING at start): set `self.server ="
                           " scrapy_dist.connection.get_redis(crawler.settings)` in `from_crawler`"))
    return out


def _pipeline_finding(cls: ast.ClassDef, rel: str) -> Finding:
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    uses_server = any(isinstance(n, ast.Attribute) and n.attr == "server" for n in ast.walk(cls))
    status = ACTION if "_process_item" in methods or ("__init__" in methods and uses_server) else CHANGE
    return Finding(rel, cls.lineno, f"class {cls.name}(RedisPipeline)", status, _note("RedisPipeline"))


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
            out.extend(_dotted_finding(rel, node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend(_dotted_finding(rel, node.lineno, a.name) for a in node.names
                       if a.name.split(".")[0] == "scrapy_redis")
        elif isinstance(node, ast.ClassDef):
            bases = {_base_name(b) for b in node.bases}
            if kind := next(iter(sorted(bases & SPIDER_BASES)), ""):
                out.extend(_spider_findings(node, rel, kind))
            if "RedisPipeline" in bases:
                out.append(_pipeline_finding(node, rel))
        elif isinstance(node, ast.Call) and _base_name(node.func) in REDIS_CLIENTS:
            status = SAME if located else ACTION
            where = ("the settings name the Redis, so the crawl uses the one this client reaches"
                     if located else "the settings name no Redis: this client reaches localhost:6379, the"
                     " crawl the embedded Redis; set REDIS_URL")
            out.append(Finding(rel, node.lineno, "a Redis client of the project's own", status, where))
    return out


def scan_project(root: Path) -> list[Finding]:
    """Every finding in the project at ``root``, settings first; ``FileNotFoundError`` if no directory."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    settings = _settings_module(root)
    rel = settings.relative_to(root).as_posix() if settings is not None else ""
    findings, names = scan_settings(settings, rel) if settings is not None else ([], set[str]())
    located = bool(names.intersection(LOCATION_SETTINGS))  # else the project talked to localhost:6379
    for path in _python_files(root):
        if path != settings:
            findings.extend(scan_source(path, path.relative_to(root).as_posix(), located))
    uses = "SCHEDULER" in names or any("scrapy_redis" in f.subject for f in findings)
    if settings is not None and uses:
        if not located:
            findings.append(Finding(rel, 0, "no Redis setting", ACTION, f"{FIRST_ROW[1]}: {FIRST_ROW[2]}"))
        if "SCHEDULER_PERSIST" not in names:
            note = settings_table.BY_NAME["SCHEDULER_PERSIST"].note
            findings.append(Finding(rel, 0, "SCHEDULER_PERSIST not set", CHANGE, note))
    return findings


@main.command("check-migration")
@click.argument("project_dir", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="Print only what needs action (and the count).")
def check_migration(project_dir: Path, quiet: bool) -> None:
    """List every scrapy-redis setting, import, spider pattern and hook of the project in PROJECT_DIR
    (default: here) with what changes on scrapy-dist; exit status 1 if anything needs action."""
    try:
        findings = scan_project(project_dir)
    except OSError as exc:  # FileNotFoundError: no such directory
        raise click.UsageError(str(exc)) from None
    for finding in findings:
        if not quiet or finding.status == ACTION:
            click.echo(str(finding))
    counts = Counter(finding.status for finding in findings)
    if not findings:
        click.echo(f"{project_dir}: no scrapy-redis setting, import or spider found")
        return
    click.echo(f"{len(findings)} found: {counts[ACTION]} need action, {counts[CHANGE]} changed,"
               f" {counts[SAME]} same (the README's migration table says more)")
    if counts[ACTION]:
        raise SystemExit(1)

