"""``python -m benchmarks``: runs every benchmark module and prints (and writes) its tables.

Usage::

    python -m benchmarks [--quick] [--markdown FILE] [--only NAME ...]

Modules are the ``benchmarks/bench_*.py`` files, capture and streaming first, then the others
by name. A module with ``run(quick)`` returning tables (or markdown text) has them gathered into
``--markdown``; a module with only ``main(argv)`` is called with ``["--quick"]`` or ``[]`` and
prints its own results. A module that fails is reported and the others still run; the exit
status is then 1.

Example:
    >>> from benchmarks.__main__ import discover
    >>> "bench_streaming" in discover()
    True
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, calibration, machine

FIRST = ("bench_capture", "bench_streaming")


def discover() -> list[str]:
    """The benchmark modules present, in the order they run."""
    here = str(Path(__file__).parent)
    found = sorted(m.name for m in pkgutil.iter_modules([here]) if m.name.startswith("bench_"))
    return [m for m in FIRST if m in found] + [m for m in found if m not in FIRST]


def _run_module(name: str, quick: bool) -> list[str]:
    """Runs one module; returns its results as markdown sections (empty if it printed them)."""
    module = importlib.import_module(f"benchmarks.{name}")
    run = getattr(module, "run", None)
    if callable(run):
        sections: list[str] = []
        results = run(quick=quick)
        for item in [results] if isinstance(results, (str, Table)) else list(results or []):
            if isinstance(item, Table):
                print("\n" + item.text(), flush=True)
                sections.append(item.markdown())
            else:
                print("\n" + str(item), flush=True)
                sections.append(str(item))
        return sections
    main = getattr(module, "main", None)
    if not callable(main):
        print(f"\n{name}: no run() or main(); skipped", flush=True)
        return []
    argv = ["--quick"] if quick else []
    if inspect.signature(main).parameters:
        result: Any = main(argv)
    else:
        saved = sys.argv
        sys.argv = [f"benchmarks.{name}", *argv]
        try:
            result = main()
        finally:
            sys.argv = saved
    return [result] if isinstance(result, str) else []


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks; returns 0, or 1 if any module failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds: a smoke run, not a measurement")
    parser.add_argument("--markdown", metavar="FILE", default=None,
                        help="also write every result table as markdown to FILE")
    parser.add_argument("--only", metavar="NAME", action="append", default=None,
                        help="run only this module (bench_capture, streaming, ...); repeatable")
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args.only}
        unknown = sorted(wanted - set(names))
        if unknown:
            parser.error(f"--only {', '.join(unknown)}: no such module; there are "
                         f"{', '.join(names)}")
        names = [n for n in names if n in wanted]
    started = time.perf_counter()
    header = machine()
    print(header, flush=True)
    reference = calibration()
    print("\n" + reference.text(), flush=True)
    sections = [reference.markdown()]
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"\n### {name}", flush=True)
        try:
            sections.extend(_run_module(name, args.quick))
        except Exception:  # noqa: BLE001 - one broken module must not hide the others' results
            traceback.print_exc()
            failed.append(name)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    total = time.perf_counter() - started
    print(f"\nall benchmarks: {total:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(f"Machine: {header}; {'--quick, ' if args.quick else ''}"
                    f"total {total:.0f} s.\n\n" + "\n\n".join(sections) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
