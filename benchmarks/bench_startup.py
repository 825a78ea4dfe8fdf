"""Startup: how long until a training step under ``sowtel.jit`` runs at its steady speed.

Each variant runs in a fresh process (nothing traced or compiled before it), the variants
interleaved over rounds, and is timed from its first call to the end of the steps that need a
new program:

- **plain, first step**: ``jax.jit`` of the step with sows, nothing enabled (the baseline:
  tracing, lowering and compiling the plain program, then one step);
- **sowtel.jit, stats every step, first step**: the time to the first logging step;
- **hand-written floor, first step**: ``jax.jit`` of a step that returns the same summaries
  (``sowtel.summaries.device_summary`` of every site's primal and cotangent), no sowtel at run
  time: what compiling these statistics costs on its own;
- **sowtel.jit, every=10, steps 0-1**: to steady state (step 0 logs; step 1 runs the plain
  program if it is ready, else the logging program already compiled, its summaries dropped:
  after it, no step waits for a compilation);
- **sowtel.jit, every=10, to the plain program's first step**: until the background
  compilation has ended and a step has run the plain program (its first run included);
- **with the persistent cache**: the same two ``every=10`` steps, the plain first step and the
  hand-written floor's first step in a process whose JAX persistent compilation cache was
  filled by earlier processes (``jax_compilation_cache_dir``,
  ``jax_persistent_cache_min_compile_time_secs=0``).

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
import threading
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

VARIANTS = ("plain", "every=1", "every=10", "floor")


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

    work = mlp() if workload == "mlp" else transformer_block()
    params, opt_state, batch = work.init()
    jax.block_until_ready((params, opt_state, batch))
    sown = make_train_step(work, sowtel.sow)
    step: Any
    if variant == "plain":
        step, session, calls = jax.jit(sown), None, 1
    elif variant == "floor":
        from benchmarks.bench_jit import floor_step

        step, session, calls = floor_step(work), None, 1
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

    def compiling() -> bool:
        return any(t.name == "sowtel-compile" and t.is_alive() for t in threading.enumerate())

    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(calls):
        one(i)
    startup = time.perf_counter() - t0
    cpu = time.process_time() - c0
    i = calls
    if calls > 1:
        # Steps go on while the plain program compiles in the background; then one runs it.
        while compiling() and i < 10_000:
            one(i)
            i += 1
        i += i % 10 == 0  # a step that logs nothing: the plain program's first run
        one(i)
        i += 1
    plain_ready = time.perf_counter() - t0
    t0 = time.perf_counter()
    one(i + (i % 10 == 0))
    steady = time.perf_counter() - t0
    if session is not None:
        session.flush()
        session.close()
    return {"startup": startup, "cpu": cpu, "step": steady, "plain_ready": plain_ready}


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
    warm: dict[str, list[float]] = {v: [] for v in ("plain", "every=10", "floor")}
    cold_cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    warm_cpu: dict[str, list[float]] = {v: [] for v in warm}
    steps: list[float] = []
    plain_ready: list[float] = []
    for _ in range(rounds):
        for variant in VARIANTS:
            got = _spawn(variant, workload, None)
            cold[variant].append(got["startup"])
            cold_cpu[variant].append(got["cpu"])
            steps.append(got["step"])
            if variant == "every=10":
                plain_ready.append(got["plain_ready"])
        with tempfile.TemporaryDirectory(prefix="sowtel-bench-cache-") as cache:
            _spawn("every=10", workload, cache)  # fills the cache with both programs
            _spawn("floor", workload, cache)
            for variant in warm:
                got = _spawn(variant, workload, cache)
                warm[variant].append(got["startup"])
                warm_cpu[variant].append(got["cpu"])
    med = {k: statistics.median(v) for k, v in cold.items()}
    med_warm = {k: statistics.median(v) for k, v in warm.items()}
    cpu = {k: statistics.median(v) for k, v in cold_cpu.items()}
    cpu_warm = {k: statistics.median(v) for k, v in warm_cpu.items()}
    table = Table(f"Startup: {workload}", ["variant", "time (median)", "ratio", "CPU time",
                                           "CPU ratio", "target"])

    def row(name: str, key: str, warm_cache: bool, target_key: str | None) -> None:
        seconds, base = (med_warm[key], med_warm["plain"]) if warm_cache else (med[key],
                                                                             med["plain"])
        cpu_s, cpu_base = (cpu_warm[key], cpu_warm["plain"]) if warm_cache else (cpu[key],
                                                                               cpu["plain"])
        ratio = seconds / base
        target = TARGETS.get(target_key) if target_key else None
        verdict = "" if target is None else (
            f"≤ {target:.1f}× {'met' if ratio <= target else 'MISSED'}")
        table.add(name, fmt_time(seconds), fmt_ratio(ratio), fmt_time(cpu_s),
                  fmt_ratio(cpu_s / cpu_base), verdict)

    row("plain, first step (baseline)", "plain", False, None)
    row("sowtel.jit, stats every step, first step", "every=1", False, "first logging step")
    row("hand-written floor, first step", "floor", False, None)
    row("sowtel.jit, every=10, steps 0-1", "every=10", False, "every=10 to steady state")
    ready = statistics.median(plain_ready)
    table.add("sowtel.jit, every=10, to the plain program's first step", fmt_time(ready),
              fmt_ratio(ready / med["plain"]), "", "", "")
    row("persistent cache: plain, first step (baseline)", "plain", True, None)
    row("persistent cache: hand-written floor, first step", "floor", True, None)
    row("persistent cache: sowtel.jit, every=10, steps 0-1", "every=10", True,
        "second process, every=10 to steady state")
    table.notes.append(
        f"{rounds} rounds, each variant in a fresh process; CPU time: the process's CPU "
        f"seconds (all threads) over the same interval, which other load on the machine does "
        f"not inflate (a compilation in a background thread counts in full); a steady step takes "
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
