"""The quickstart's own-project walk-through (docs/quickstart.md, section 3), run verbatim.

Every fenced block after a ``<!-- quickstart-test: ... -->`` marker is taken from the document, in order:

* ``run``: the bash block is run as written (one bash script for the whole walk-through, so ``cd`` and
  ``&`` / ``wait`` behave as in a terminal);
* ``settings FILE``: each ``NAME = value`` line of the python block replaces the line of the same name
  the ``startproject`` template has (``ADDONS = {}``), or is appended -- what the text tells the reader;
* ``write FILE``: the python block becomes FILE.

Three deviations: for a test without internet, ``https://example.com/`` is replaced by the test's local
site and ``SCHEDULER_DENY_NETWORKS = []`` is appended to the settings (by default the frontier refuses
127.0.0.1); and, for time only, the workers close 1 s after the crawl ran dry instead of the document's
10 s, without the template's ``DOWNLOAD_DELAY = 1`` (the local site needs no politeness).
The crawl must reach every page of the site with two workers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from scrapy_dist.redis.embedded import EmbeddedRedis

DOC = Path(__file__).resolve().parent.parent / "docs" / "quickstart.md"
MARKER = re.compile(r"<!-- quickstart-test: (\w+)(?: (\S+))? -->\n```(\w+)\n(.*?)\n```", re.S)

EDIT_SETTINGS = r'''
import re, sys
path, block = sys.argv[1], sys.stdin.read()
text = open(path).read()
for line in block.splitlines():
    m = re.match(r"([A-Z_][A-Z0-9_]*)\s*=", line)
    if not m:
        continue
    pattern = re.compile(rf"^{m.group(1)}\s*=.*$", re.M)
    text, n = pattern.subn(lambda _: line, text, count=1)
    if not n:
        text += "\n" + line + "\n"
open(path, "w").write(text)
'''

#: the template's politeness, off for the local site (time only)
FAST = "DOWNLOAD_DELAY=0"


def quickstart_steps(doc: str) -> list[tuple[str, str | None, str]]:
    """``(action, file or None, block)`` for every marked block of ``doc``, in order."""
    return [(m.group(1), m.group(2), m.group(4)) for m in MARKER.finditer(doc)]


def script(steps: list[tuple[str, str | None, str]], site_url: str) -> str:
    out = ["set -e"]
    for action, path, block in steps:
        block = block.replace("https://example.com/", site_url)
        block = block.replace("SCHEDULER_IDLE_BEFORE_CLOSE=10", f"SCHEDULER_IDLE_BEFORE_CLOSE=1 -s {FAST}")
        if action == "run":
            out.append(block)
        elif action == "write":
            out.append(f"cat > {path} <<'QUICKSTART_EOF'\n{block}\nQUICKSTART_EOF")
        elif action == "settings":
            out.append(f"\"$PYTHON\" -c {shlex_quote(EDIT_SETTINGS)} {path} <<'QUICKSTART_EOF'\n{block}\n"
                       "QUICKSTART_EOF")
            out.append(f"echo 'SCHEDULER_DENY_NETWORKS = []  # the test site is on 127.0.0.1' >> {path}")
        else:
            raise AssertionError(f"unknown quickstart-test action {action!r}")
    return "\n".join(out) + "\n"


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def test_the_document_marks_the_walk_through() -> None:
    steps = quickstart_steps(DOC.read_text())
    assert [a for a, _, _ in steps] == ["run", "settings", "write", "run"]
    assert "scrapy startproject shop" in steps[0][2]
    assert 'ADDONS = {"scrapy_dist.Addon": 0}' in steps[1][2]
    assert "lpush shop:start_urls" in steps[3][2] and steps[3][2].count("scrapy crawl shop") == 2
    assert steps[3][2].count("SCHEDULER_IDLE_BEFORE_CLOSE=10") == 2  # what script() shortens


@pytest.mark.slow
def test_quickstart_commands_run_verbatim(tmp_path: Path, site_factory: Any) -> None:
    site = site_factory(pages=6, links=3)
    bash = script(quickstart_steps(DOC.read_text()), site.page_url(0))
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SCRAPY_SETTINGS_MODULE")}
    env.update(PATH=venv_bin + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable)
    try:
        proc = subprocess.run(["bash", "-c", bash], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
    finally:
        EmbeddedRedis(tmp_path / "shop" / ".scrapy" / "scrapy_dist").shutdown(save=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    settings = (tmp_path / "shop" / "shop" / "settings.py").read_text()
    assert settings.count("ADDONS =") == 1  # the template's line was edited, not shadowed
    assert len(site.fetch_counts()) == 6, out[-5000:]  # every page of the site, from one seed
    assert out.count("Spider closed (finished)") == 2, out[-5000:]
    assert "closed (finished)" in proc.stdout and "Stopped the embedded Redis" in proc.stdout
    assert "redis-cli -s " in out  # the workers printed the plain redis-cli command
