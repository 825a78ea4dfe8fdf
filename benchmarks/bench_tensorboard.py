"""What the TensorBoard exporter costs: records and histograms per second, and a training step.

Three measurements, taken side by side in this one process:

1. **Scalars**: records per second through ``TensorBoardExporter.write`` (batches of 64 records
   of 12 sites, as the dispatcher hands them over) then ``close``, against the same statistics
   written with raw tensorboardX ``SummaryWriter.add_scalar`` calls (11 per record) then
   ``close`` (which drains tensorboardX's queue). Target: the exporter at ≥ 0.9× the raw rate.
2. **Histograms**: records with the device's raw buckets (``summary="histogram"``: 30 buckets
   plus the statistics) through the exporter, against raw ``add_histogram_raw`` plus
   ``add_scalar`` calls for the same content.
3. **Training step** of the small-MLP reference workload (:func:`benchmarks.workloads.mlp`),
   streaming ``stats`` every step to the TensorBoard exporter, against the same step streaming
   to the memory exporter and against the step without sows. The exporter runs on its own
   worker thread, so its file writes show in the step only through the GIL: the training
   thread never waits on it. "+ drain" adds the time to flush what the round left behind.

Run: ``python -m benchmarks.bench_tensorboard [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_tensorboard
    >>> tables = bench_tensorboard.run(quick=True)  # doctest: +SKIP
    >>> print(tables[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from benchmarks import (
    Table,
    fmt_ratio,
    fmt_time,
    module_main,
)
from benchmarks.workloads import exporter_training_table
from sowtel.exporters.tensorboard import TensorBoardExporter, series_tag
from sowtel.records import Record
from sowtel.summaries import host_summary

__all__ = ["run", "main", "tables", "scalars", "histograms", "training_step"]

SITES = 12  # the MLP workload: 6 sites, primal and cotangent
BATCH = 64


def _records(steps: int, summary: str) -> list[Record]:
    """``steps`` steps of the MLP's 12 records, with real ``stats`` (and bucket) summaries."""
    rng = np.random.default_rng(0)
    summaries = [host_summary(rng.normal(size=(256, 512)).astype(np.float32), summary)
                 for _ in range(SITES)]
    names = [(f"dense{i // 2}/{'pre' if i % 2 == 0 else 'act'}", mode)
             for mode in ("primal", "cotangent") for i in range(SITES // 2)]
    out = []
    t0 = time.time()
    for step in range(steps):
        for k, (name, mode) in enumerate(names):
            out.append(Record(name=name, mode=mode, tag="intermediates", step=step, index=None,
                              wall_time=t0 + step * 1e-3 + k * 1e-5, summary=summary,
                              shape=(256, 512), dtype="float32", stats=summaries[k]["stats"],
                              histogram=summaries[k]["histogram"], seq=step * SITES + k))
    return out


def _exporter_run(records: list[Record]) -> float:
    """Records per second of a fresh exporter: every record through write(), then close()."""
    logdir = tempfile.mkdtemp(prefix="sowtel-bench-")
    try:
        exporter = TensorBoardExporter(logdir=logdir)
        t0 = time.perf_counter()
        for start in range(0, len(records), BATCH):
            exporter.write(records[start:start + BATCH])
        exporter.close()
        return len(records) / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def _raw_run(records: list[Record], with_histograms: bool) -> float:
    """Records per second of tensorboardX's SummaryWriter writing the same content."""
    from tensorboardX import SummaryWriter

    # Tags prepared outside the timed part, as a hand-written logger would keep them.
    prepared = []
    for r in records:
        prefix = series_tag(r.name, r.mode, r.index)
        prepared.append((prefix, [(f"{prefix}/{k}", v) for k, v in r.stats.items()], r))
    logdir = tempfile.mkdtemp(prefix="sowtel-bench-")
    try:
        writer = SummaryWriter(logdir=logdir, flush_secs=2)
        t0 = time.perf_counter()
        for prefix, scalars, r in prepared:
            for tag, value in scalars:
                writer.add_scalar(tag, value, r.step, walltime=r.wall_time)
            if with_histograms and r.histogram is not None:
                edges, counts = r.histogram
                n = float(counts.sum())
                writer.add_histogram_raw(
                    prefix, min=r.stats["min"], max=r.stats["max"], num=n,
                    sum=r.stats["mean"] * n, sum_squares=r.stats["l2"] ** 2,
                    bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(),
                    global_step=r.step, walltime=r.wall_time)
        writer.close()  # drains the queue: every event is in the file
        return len(records) / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def _compare(title: str, records: list[Record], rounds: int, raw_name: str,
             with_histograms: bool, unit: str) -> Table:
    variants: dict[str, Callable[[], float]] = {
        "TensorBoardExporter.write": lambda: _exporter_run(records),
        raw_name: lambda: _raw_run(records, with_histograms),
    }
    names = list(variants)
    rates: dict[str, list[float]] = {n: [] for n in names}
    # Interleaved rounds, rotating the order, so a busy moment of the machine hits both.
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(variants[name]())
    table = Table(title, ["writer", f"{unit}/s", f"per {unit[:-1]}", "rate vs raw tensorboardX"])
    raw = rates[raw_name]
    for name in names:
        rate = statistics.median(rates[name])
        ratio = statistics.median(a / b for a, b in zip(rates[name], raw, strict=True))
        table.add(name, f"{rate:,.0f}", fmt_time(1.0 / rate), fmt_ratio(ratio))
    from tensorboardX import crc32c

    crc = "native crc32c" if crc32c._crc32c_native is not None else "pure-Python CRC-32C"
    table.notes.append(
        f"{len(records)} records ({len(records) // SITES} steps of {SITES} sites), each with 11 "
        f"statistics{' and 30 buckets' if with_histograms else ''}; the exporter gets batches "
        f"of {BATCH}. {rounds} interleaved rounds, medians over rounds (the ratio: of per-round "
        f"rate ratios); each writer fresh, timed until close() returns. Both use {crc}.")
    return table


def scalars(quick: bool = False) -> Table:
    """Records per second of ``stats`` records: the exporter against raw ``add_scalar``."""
    return _compare("TensorBoard scalars: exporter vs raw tensorboardX add_scalar",
                    _records(100 if quick else 1000, "stats"), 3 if quick else 9,
                    "SummaryWriter.add_scalar × 11", False, "records")


def histograms(quick: bool = False) -> Table:
    """Histograms per second (raw device buckets): the exporter against raw tensorboardX."""
    return _compare("TensorBoard histograms from raw buckets: exporter vs raw tensorboardX",
                    _records(50 if quick else 500, "histogram"), 3 if quick else 9,
                    "SummaryWriter.add_histogram_raw + add_scalar × 11", True, "histograms")


def training_step(quick: bool = False) -> Table:
    """The MLP step streaming ``stats`` to TensorBoard, against memory and against no sows."""

    def exporters(stack: ExitStack) -> dict[str, Callable[[], Any]]:
        logdir = tempfile.mkdtemp(prefix="sowtel-bench-")
        stack.callback(shutil.rmtree, logdir, ignore_errors=True)
        return {"tensorboard exporter": lambda: TensorBoardExporter(logdir=logdir)}

    return exporter_training_table(
        "TensorBoard", exporters, quick,
        note=" The exporter's writes run on its worker thread: 'vs memory' near 1 means the "
             "training thread does not wait on them.")



def tables(quick: bool = False) -> Iterator[Table]:
    """Runs the three measurements, yielding each table as soon as it is measured."""
    yield scalars(quick)
    yield histograms(quick)
    yield training_step(quick)


def run(quick: bool = False) -> list[Table]:
    """Runs the three measurements; returns their tables."""
    return list(tables(quick))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_tensorboard [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_tensorboard", __doc__, lambda args: tables(args.quick))


if __name__ == "__main__":
    sys.exit(main())
