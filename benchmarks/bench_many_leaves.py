"""Many leaves: what streaming one sown pytree of N leaves costs to compile, in memory, and a step.

A step updates every leaf of a pytree (``x * 0.999 + 0.001``) and sows the tree as one site
(``stats``, every step): the pattern of ``sowtel.optax.watch`` on a model whose parameters are
many arrays. Each variant runs in a fresh process (nothing compiled before it; its peak RSS is
the process's own), the variants of a size interleaved over rounds:

- **plain**: ``jax.jit`` of the step, nothing enabled (the baseline);
- **sowtel.jit**: the step through ``sowtel.jit`` with a session streaming ``stats`` every step;
- **callback transport**: ``jax.jit`` of the step under the same session (a host callback).

Per variant: the **first step** (trace, lower, compile and one run, from the first call; the
first logging step for the streaming variants), as a ratio to the plain first step (targets:
≤ 3× for 2,000 small leaves and for 300 leaves of 256×256), the **steady step** (the median of
timed steps after the first), and the child's **peak RSS** (target: ≤ 8 GB for 10,000 leaves).

Workloads: ``small`` leaves of 1 to 40 elements (mixed shapes, float32), ``large`` leaves of
256×256 float32. Sizes default to 250, 500, 1,000 and 2,000 small leaves (growth about
linear: the ratio of first steps stays flat as N doubles), 300 large, and 10,000 small for
memory (``--sizes`` overrides).

Run: ``python -m benchmarks.bench_many_leaves [--quick] [--rounds N] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, fmt_time, module_main

__all__ = ["run", "main", "leaves_table"]

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "sowtel.jit", "callback")
#: The issue's targets: first-step ratios, and the 10,000-leaf peak RSS in bytes.
TARGETS = {"small": 3.0, "large": 3.0, "rss": 8 * 2**30}


def _tree(kind: str, n: int) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(8,), (3, 4), (17,), (), (2, 2, 2), (40,), (5, 1)]
    out = {}
    for i in range(n):
        shape = (256, 256) if kind == "large" else shapes[i % len(shapes)]
        out[f"p{i:05d}"] = jnp.asarray(rng.normal(size=shape), jnp.float32)
    return out


def _child(variant: str, kind: str, n: int, steps: int) -> dict[str, float]:
    """In a fresh process: the first step's seconds, the median steady step, peak RSS."""
    import jax

    import sowtel

    tree = _tree(kind, n)
    jax.block_until_ready(tree)

    def step(t: Any) -> Any:
        t = jax.tree_util.tree_map(lambda x: x * 0.999 + 0.001, t)
        return sowtel.sow(t, "params")

    records = 0
    if variant == "plain":
        fn = jax.jit(step)
        session = None
    else:
        from sowtel.exporters.memory import MemoryExporter

        exporter = MemoryExporter(max_records=n)
        # A step sends N records: the queue holds a few steps (the default 10,000 would drop).
        session = sowtel.enable(exporter=exporter, queue_size=max(10_000, 4 * n))
        fn = sowtel.jit(step) if variant == "sowtel.jit" else jax.jit(step)
    start = time.perf_counter()
    tree = jax.block_until_ready(fn(tree))
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tree = jax.block_until_ready(fn(tree))
        times.append(time.perf_counter() - start)
    if session is not None:
        session.flush()
        records = len(exporter.records) + exporter.evicted
        sowtel.disable()
    return {"first": first, "steady": statistics.median(times),
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
            "records": float(records)}


def _spawn(variant: str, kind: str, n: int, steps: int) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_many_leaves", "--child", variant, kind,
         str(n), str(steps)], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode:
        raise RuntimeError(f"{variant} {kind} {n}: exit {out.returncode}\n{out.stderr[-2000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def leaves_table(sizes: Sequence[tuple[str, int]], rounds: int, steps: int,
                 variants: Sequence[str] = VARIANTS) -> Table:
    """One row per (workload, size, variant): medians over ``rounds`` fresh processes."""
    table = Table("One sown pytree of N leaves (stats every step), a fresh process a variant",
                  ["leaves", "variant", "first step", "× plain", "steady step", "× plain",
                   "peak RSS"])
    for kind, n in sizes:
        got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                got[v].append(_spawn(v, kind, n, steps))
        med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for v, rs in got.items()}
        base = med.get("plain")
        for v in variants:
            m = med[v]
            if v != "plain" and m["records"] < n * (steps + 1):
                raise RuntimeError(f"{v} {kind} {n}: {m['records']:.0f} records, "
                                   f"expected {n * (steps + 1)}")
            first = f"{m['first'] / base['first']:.2f}×" if base else "-"
            steady = f"{m['steady'] / base['steady']:.2f}×" if base else "-"
            table.add(f"{n:,} {kind}", v, fmt_time(m["first"]), first, fmt_time(m["steady"]),
                      steady, f"{m['rss'] / 2**20:,.0f} MiB")
    table.notes.append(
        f"targets: first logging step ≤ {TARGETS['small']:g}× the plain first step (2,000 "
        f"small leaves; 300 of 256×256); 10,000 leaves ≤ {TARGETS['rss'] / 2**30:g} GiB peak "
        "RSS; the steady step not above the per-leaf summaries' (run this module on both)")
    return table


def run(quick: bool = False, rounds: int | None = None,
        sizes: Sequence[tuple[str, int]] | None = None) -> list[Table]:
    """The table, at ``sizes`` (``(workload, leaves)``)."""
    if sizes is None:
        sizes = ([("small", 250), ("small", 1000), ("large", 50)] if quick else
                 [("small", 250), ("small", 500), ("small", 1000), ("small", 2000),
                  ("large", 300), ("small", 10000)])
    return [leaves_table(sizes, rounds or 1, 3 if quick else 10)]


def _size(text: str) -> tuple[str, int]:
    kind, _, n = text.partition(":")
    if kind not in ("small", "large") or not n.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write small:N or large:N (N leaves)")
    return kind, int(n)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="fresh processes a variant")
    parser.add_argument("--sizes", type=_size, nargs="+", default=None,
                        help="workloads as small:N or large:N")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_many_leaves [--quick] [--rounds N] [--sizes ...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(argv[1], argv[2], int(argv[3]), int(argv[4]))))
        return 0
    return module_main(argv, "bench_many_leaves", __doc__,
                       lambda args: run(args.quick, args.rounds, args.sizes),
                       arguments=_arguments)


if __name__ == "__main__":
    sys.exit(main())
