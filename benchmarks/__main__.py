"""``python -m benchmarks``: run every registered benchmark (or ``--only`` some) and write
``benchmarks/results/latest.{json,md,png}``. See docs/benchmarks.md."""

from __future__ import annotations

import argparse
import datetime
import importlib
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

from benchmarks import BENCHMARKS, report
from benchmarks.machine import describe

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def load_modules() -> dict[str, ModuleType | str]:
    """name -> module, or name -> reason it cannot be loaded yet (a module not written yet is not an error;
    a module that exists but fails to import is, and its traceback is the reason)."""
    out: dict[str, ModuleType | str] = {}
    for name, module_name in BENCHMARKS:
        try:
            out[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            out[name] = f"{module_name} does not exist yet"
    return out


def build_parser(modules: dict[str, ModuleType | str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run scrapy-dist's benchmarks and write results/latest.{json,md,png}.",
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="run only these benchmarks (see --list): same as --only"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks (see --list)")
    parser.add_argument(
        "--pages",
        type=int,
        metavar="N",
        help="site size / problem size for benchmarks that crawl (default 20,000; 2,000 with --quick)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help=f"output directory (default {RESULTS_DIR})"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    for module in modules.values():
        if isinstance(module, ModuleType) and hasattr(module, "add_arguments"):
            module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modules = load_modules()
    args = build_parser(modules).parse_args(argv)
    if args.list:
        for name, module in modules.items():
            title = getattr(module, "TITLE", "") if isinstance(module, ModuleType) else f"({module})"
            print(f"{name:12} {title}")
        return 0
    selected = list(modules)
    if args.only or args.names:
        selected = [n.strip() for n in (args.only or "").split(",") + args.names if n.strip()]
        unknown = [n for n in selected if n not in modules]
        if unknown:
            print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(modules)}", file=sys.stderr)
            return 2
    args.out = args.out.resolve()  # the crawls run in the bench project's directory
    args.tmp_dir = args.out / "tmp"  # logs and stats of the crawls (gitignored)
    args.tmp_dir.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    run: dict = {
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks " + shlex.join(argv),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": describe(),
        "benchmarks": {},
    }
    failed = False
    for name in selected:
        module = modules[name]
        if isinstance(module, str):
            run["benchmarks"][name] = {"status": "skipped", "reason": module}
            print(f"== {name}: skipped ({module})", flush=True)
            continue
        print(f"== {name}: {getattr(module, 'TITLE', '')}", flush=True)
        t = time.monotonic()
        try:
            result = dict(module.run(args))
            result.setdefault("status", "ok")
        except Exception as exc:  # one broken benchmark must not lose the others' results
            failed = True
            result = {
                "status": "error",
                "reason": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            print(result["traceback"], file=sys.stderr)
        failed = failed or bool(result.get("failed"))
        result["duration_s"] = round(time.monotonic() - t, 1)
        run["benchmarks"][name] = result
        print(f"== {name}: {result['status']} in {result['duration_s']:.0f} s", flush=True)
    run["duration_s"] = time.monotonic() - started

    paths = report.write(run, args.out)
    print()
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
