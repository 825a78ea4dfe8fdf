"""Startup: how long until a training step under ``sowtel.jit`` runs at its steady speed.

Each variant runs in a fresh process (nothing traced or compiled before it), the variants
interleaved over rounds, and is timed from its first call to the end of the steps that need a
new program:

- **plain, first step**: ``jax.jit`` of the step with sows, nothing enabled (the baseline:
  tracing, lowering and compiling the plain program, then one step);
- **sowtel.jit, stats every step, first step**: the time to the first logging step;
- **sowtel.jit, every=10, steps 0-1**: to steady state (step 0 logs, step 1 runs the plain
  program; after it, every step runs a compiled program);
- **with the persistent cache**: the same two ``every=10`` steps and the plain first step in a
  process whose JAX persistent compilation cache was filled by an earlier process
  (``jax_compilation_cache_dir``, ``jax_persistent_cache_min_compile_time_secs=0``).

Each time is the median over rounds; a ratio is of medians, as in the targets (first logging
step ≤ 1.5× the plain first step, ``every=10`` to steady state ≤ 1.6×, a second process with the
cache ≤ 1.2× a warm plain start, that is the plain first step with the cache).

Run: ``python -m benchmarks.bench_startup [--quick] [--rounds N] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import Table, fmt_ratio, fmt_time, module_main

__all__ = ["run", "main", "startup_table"]

ROOT = Path(__file__).resolve().parents[1]

#: The issue's targets, as ratios.
TARGETS = {"first logging step": 1.5, "every=10 to steady state": 1.6,
           "second process, every=10 to steady state": 1.2}

VARIANTS = ("plain", "every=1", "every=10")


def _child(variant: str, workload: str, cache: str | None) -> dict[str, float]:
    """In a fresh process: the seconds from the first call to the end of the steps that need
    a program (one step for plain and every=1, two for every=10), and one steady step."""
    import jax

    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import sowtel
    from benchmarks.workloads import make_train_step, mlp, transformer_block
    from sowtel.exporters.memory import MemoryExporter

    work = {"mlp": mlp, "transformer": transformer_block}[workload]()
    params, opt_state, batch = work.init()
    jax.block_until_ready((params, opt_state, batch))
    sown = make_train_step(work, sowtel.sow)
    if variant == "plain":
        step, session, calls = jax.jit(sown), None, 1
    else:
        every = int(variant.split("=")[1])
        step = sowtel.jit(sown)
        session = sowtel.enable(exporter=MemoryExporter(max_records=10_000), summary="stats",
                                every=every)
        calls = 1 if every == 1 else 2

    def one(i: int) -> None:
        nonlocal params, opt_state
        out = jax.block_until_ready(step(params, opt_state, batch, jax.numpy.int32(i)))
        params, opt_state = out[0], out[1]

    t0 = time.perf_counter()
    for i in range(calls):
        one(i)
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    one(calls)
    steady = time.perf_counter() - t0
    if session is not None:
        session.flush()
        session.close()
    return {"startup": startup, "step": steady}


def _spawn(variant: str, workload: str, cache: str | None) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "benchmarks.bench_startup", "--child", variant, workload]
    if cache:
        args.append(cache)
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"bench_startup child {variant} {workload} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def startup_table(workload: str, rounds: int) -> Table:
    """Each variant in fresh processes, ``rounds`` times, interleaved; one row per variant."""
    cold: dict[str, list[float]] = {v: [] for v in VARIANTS}
    warm: dict[str, list[float]] = {v: [] for v in ("plain", "every=10")}
    steps: list[float] = []
    for _ in range(rounds):
        for variant in VARIANTS:
            got = _spawn(variant, workload, None)
            cold[variant].append(got["startup"])
            steps.append(got["step"])
        with tempfile.TemporaryDirectory(prefix="sowtel-bench-cache-") as cache:
            _spawn("every=10", workload, cache)  # fills the cache with both programs
            for variant in warm:
                warm[variant].append(_spawn(variant, workload, cache)["startup"])
    med = {k: statistics.median(v) for k, v in cold.items()}
    med_warm = {k: statistics.median(v) for k, v in warm.items()}
    table = Table(f"Startup: {workload}", ["variant", "time (median)", "ratio", "target"])

    def row(name: str, seconds: float, base: float, target_key: str | None) -> None:
        ratio = seconds / base
        target = TARGETS.get(target_key) if target_key else None
        verdict = "" if target is None else (
            f"≤ {target:.1f}× {'met' if ratio <= target else 'MISSED'}")
        table.add(name, fmt_time(seconds), fmt_ratio(ratio), verdict)

    base = med["plain"]
    row("plain, first step (baseline)", base, base, None)
    row("sowtel.jit, stats every step, first step", med["every=1"], base, "first logging step")
    row("sowtel.jit, every=10, steps 0-1", med["every=10"], base, "every=10 to steady state")
    warm_base = med_warm["plain"]
    row("persistent cache: plain, first step (baseline)", warm_base, warm_base, None)
    row("persistent cache: sowtel.jit, every=10, steps 0-1", med_warm["every=10"], warm_base,
        "second process, every=10 to steady state")
    table.notes.append(
        f"{rounds} rounds, each variant in a fresh process; a steady step takes "
        f"{fmt_time(statistics.median(steps))}. Times in seconds per variant and round: "
        + "; ".join(f"{k}: {', '.join(f'{t:.2f}' for t in v)}" for k, v in cold.items())
        + "; with the cache: "
        + "; ".join(f"{k}: {', '.join(f'{t:.2f}' for t in v)}" for k, v in warm.items()))
    return table


def run(quick: bool = False, rounds: int | None = None) -> list[Table]:
    """The tables: the MLP and the transformer block (the MLP once, with ``quick``)."""
    if quick:
        return [startup_table("mlp", rounds or 1)]
    return [startup_table("mlp", rounds or 3), startup_table("transformer", rounds or 3)]


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=None, help="fresh processes a variant")
    parser.add_argument("--only", choices=("mlp", "transformer"), default=None)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_startup [--quick] [--rounds N] [--markdown FILE]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(argv[1], argv[2], argv[3] if len(argv) > 3 else None)))
        return 0

    def tables(args: Any) -> list[Table]:
        if args.only:
            return [startup_table(args.only, args.rounds or (1 if args.quick else 3))]
        return run(quick=args.quick, rounds=args.rounds)

    return module_main(argv, "bench_startup", __doc__, tables, arguments=_arguments)


if __name__ == "__main__":
    sys.exit(main())
