"""The package's layers as docs/architecture.md draws them: every import inside scrapy_dist (at module
level or inside a function; not under ``TYPE_CHECKING``) goes to its own layer or to one the table allows."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scrapy_dist"
DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def allowed_imports() -> dict[str, set[str]]:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- layers:start", 1)[1].split("<!-- layers:end", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        targets = set(re.findall(r"`([\w.]+)`", cells[1]))
        for layer in re.findall(r"`([\w.]+)`", cells[0]):
            allowed[layer] = targets
    return allowed


def layer_of(module: str) -> str:
    """``scrapy_dist.frontier.ledger`` -> ``frontier``; ``scrapy_dist`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


@functools.cache  # parsed once per test process, not once per layer
def package_imports() -> list[tuple[str, str, str]]:
    """(file, importing layer, imported layer) for every import of a scrapy_dist module."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "scrapy_dist":
                    targets = [f"scrapy_dist.{a.name}" for a in node.names]
                elif node.module.startswith("scrapy_dist."):
                    targets = [node.module]
                else:
                    continue
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "scrapy_dist"]
            else:
                continue
            for target in targets:
                found.append((str(path.relative_to(PACKAGE.parent)), layer_of(module), layer_of(target)))
    return found


def test_the_doc_names_every_layer_of_the_package() -> None:
    allowed = allowed_imports()
    layers = {layer_of(".".join(p for p in path.relative_to(PACKAGE.parent).with_suffix("").parts
                                if p != "__init__"))
              for path in PACKAGE.rglob("*.py")}
    assert layers - set(allowed) == set(), "add these layers to docs/architecture.md's table"


@pytest.mark.parametrize("layer", sorted(allowed_imports()))
def test_a_layer_imports_only_what_the_doc_allows(layer: str) -> None:
    allowed = allowed_imports()[layer] | {layer, "__version__"}
    wrong = sorted({f"{file} -> {target}" for file, source, target in package_imports()
                    if source == layer and target not in allowed})
    assert wrong == [], f"imports docs/architecture.md does not allow for {layer}/"

