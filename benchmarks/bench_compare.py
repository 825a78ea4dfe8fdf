"""Comparing runs: ``sowtel.compare_runs`` on a 48-layer x 8-site run of 1,000 steps.

Three runs of the model (768 records a step: 8 sites under a scan of 48 layers, primal and
cotangent) are written through the jsonl and TensorBoard exporters' batch methods, as
``sowtel.jit`` steps reach them: A, A again (another wall time: what a rerun differs in), and B,
which departs from A at step 900 in one layer's ``std``. Then, timed side by side:

- A against A again: every step of both runs read and compared (the most work there is);
- A against B: read up to the divergence and the step after it;
- the same from TensorBoard event files; and, once, a jsonl run against a TensorBoard run
  (compared record by record, as their files group records differently; no target).

Targets: <= 5 s per run from jsonl, <= 10 s per run from TensorBoard (seconds per run are the
comparison's time halved). Memory: the comparison runs in a child process, whose peak of
allocated memory (``tracemalloc``) is reported beside the size of the files it read. And
TensorBoard's own ``RawEventFileLoader`` over one run's event file, for the record reader's
choice.

Usage::

    python -m benchmarks.bench_compare [--quick] [--markdown FILE]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import Table, fmt_time, interleave, module_main

LAYERS, SITES = 48, 8
DIVERGE_AT = 900  # the step where B departs (of 1,000; 90 with --quick)


def _batches(steps: int, diverge: int | None, seed: int = 1) -> Iterator[Any]:
    """A logging step at a time of the 48 x 8 model, as ``RecordBatch`` of site tables."""
    from sowtel.records import STAT_KEYS
    from sowtel.summaries import host_summary
    from sowtel.to_records import RecordBatch, SiteColumns

    rng = np.random.default_rng(seed)
    pool = np.array([[host_summary(rng.normal(scale=10.0 ** rng.uniform(-3, 1), size=(64,)),
                                   "stats")["stats"][k] for k in STAT_KEYS] for _ in range(97)])
    seq = 0
    for step in range(steps):
        wall = time.time()
        parts = []
        for backward in (False, True):
            for s in reversed(range(SITES)) if backward else range(SITES):
                layers = np.arange(LAYERS)[::-1] if backward else np.arange(LAYERS)
                rows = pool[(step + s * 7 + layers + 31 * backward) % len(pool)].copy()
                if diverge is not None and step >= diverge and (s, backward) == (3, False):
                    rows[layers == 10, STAT_KEYS.index("std")] *= 1.001
                parts.append(SiteColumns(
                    names=(f"blocks/site{s}",), shapes=((64,),), dtypes=("float32",),
                    mode="cotangent" if backward else "primal", tag="intermediates",
                    summary="stats", step=step, wall_time=wall, process_index=0,
                    order=(2 * SITES - s) if backward else s + 1, index=layers.tolist(),
                    seqs=list(range(seq, seq + LAYERS)), stat_keys=STAT_KEYS,
                    stats=rows[:, None, :], scans=((SITES + 1 if backward else 1, backward),)))
                seq += LAYERS
        yield RecordBatch(parts)


def write_runs(root: Path, steps: int) -> dict[str, Path]:
    """Runs A, A again and B, each as a jsonl run and a TensorBoard run under ``root``."""
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    out = {}
    for name, diverge in (("a", None), ("again", None), ("b", steps * DIVERGE_AT // 1000)):
        jsonl = JsonlExporter(logdir=root / name / "jsonl")
        tb = TensorBoardExporter(logdir=str(root / name / "tb"))
        for batch in _batches(steps, diverge):
            jsonl.write_batch(batch)
            tb.write_batch(batch)
        jsonl.close()
        tb.close()
        out[name] = root / name
    return out


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


_CHILD = """
import json, sys, time, tracemalloc
import sowtel.compare
tracemalloc.start()
t0 = time.perf_counter()
report = sowtel.compare.diff_runs(sys.argv[1], sys.argv[2])
took = time.perf_counter() - t0
_, peak = tracemalloc.get_traced_memory()
print(json.dumps({"peak": peak, "seconds": took, "steps": report.steps}))
"""


def _child_memory(a: Path, b: Path) -> dict[str, Any]:
    """The peak of the memory a process comparing ``a`` and ``b`` allocates (Python objects and
    numpy arrays, as ``tracemalloc`` counts them), from the comparison's start."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(a), str(b)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def compare_runs_table(quick: bool = False) -> Table:
    """Seconds to compare runs of the 48 x 8 model, from jsonl and TensorBoard files."""
    from sowtel._run_read import event_records
    from sowtel.compare import diff_runs

    steps = 100 if quick else 1000
    root = Path(tempfile.mkdtemp(prefix="sowtel-bench-compare-"))
    try:
        runs = write_runs(root, steps)
        a, again, b = runs["a"], runs["again"], runs["b"]
        cases = {
            "jsonl: A vs A again (whole runs)": (a / "jsonl", again / "jsonl"),
            "jsonl: A vs B (to the divergence)": (a / "jsonl", b / "jsonl"),
            "tensorboard: A vs A again": (a / "tb", again / "tb"),
            "tensorboard: A vs B": (a / "tb", b / "tb"),
        }
        answers: dict[str, Any] = {}

        def variant(name: str) -> Any:
            def run() -> None:
                answers[name] = diff_runs(*cases[name])
            return run

        timings = interleave({name: variant(name) for name in cases}, rounds=3, steps=1,
                             warmup=1)
        # A jsonl run against a TensorBoard run is compared record by record (no target): once.
        t0 = time.perf_counter()
        mixed = diff_runs(a / "jsonl", again / "tb")
        mixed_time = time.perf_counter() - t0
        (events,) = (a / "tb").glob("events.out.tfevents.*")
        t0 = time.perf_counter()
        count = sum(1 for _ in event_records(events))
        ours = time.perf_counter() - t0
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

        t0 = time.perf_counter()
        theirs_count = sum(1 for _ in RawEventFileLoader(str(events)).Load())
        theirs = time.perf_counter() - t0
        assert theirs_count == count
        memory = {kind: _child_memory(a / kind, again / kind) for kind in ("jsonl", "tb")}
        table = Table(
            f"Comparing runs: a 48-layer x 8-site model, {steps:,} steps (768 records a step)",
            ["comparison", "steps compared", "answer", "time", "per run", "target per run"])
        for name, timing in timings.items():
            report = answers[name]
            d = report.divergence
            answer = "none" if d is None else f"step {d.step}, {d.site}"
            per_run = timing.per_step() / 2
            target = "<= 5 s" if name.startswith("jsonl") else "<= 10 s"
            table.add(name, report.steps, answer, fmt_time(timing.per_step()),
                      fmt_time(per_run), target)
        table.add("jsonl A vs tensorboard A again (once)", mixed.steps,
                  "none" if mixed.divergence is None else str(mixed.divergence.step),
                  fmt_time(mixed_time), fmt_time(mixed_time / 2), "")
        mb = 1 << 20
        for kind in ("jsonl", "tb"):
            m = memory[kind]
            table.notes.append(
                f"memory, {kind}: comparing two runs of {_size(a / kind) / mb:.0f} MB each, at "
                f"most {m['peak'] / mb:.1f} MB allocated at once (tracemalloc's peak, in a "
                "process of its own)")
        table.notes.append(
            f"one run's event file ({_size(a / 'tb') / mb:.0f} MB, {count} events): "
            f"{fmt_time(ours)} with sowtel's reader (checksums by the crc32c package), "
            f"{fmt_time(theirs)} with TensorBoard's RawEventFileLoader (pure-Python checksums "
            "where TensorFlow is not installed)")
        table.notes.append(
            f"medians of 3 interleaved rounds after a warm-up; B departs from A at step "
            f"{steps * DIVERGE_AT // 1000} in one layer's std (x1.001); 'per run' is the time "
            "halved")
        return table
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(quick: bool = False) -> list[Table]:
    """The comparison's table."""
    return [compare_runs_table(quick)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_compare [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_compare", __doc__, lambda args: run(args.quick))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
