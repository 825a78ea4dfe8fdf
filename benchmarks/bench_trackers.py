"""What the tracker exporters sustain: records per second into W&B (offline), MLflow (a local
SQLite store) and Trackio (its local store), against each tracker's own client alone.

For each tracker, the same records (``stats`` summaries of 200 sites, in batches of 256 as the
dispatcher hands them over) go

- **through the exporter**: ``write`` of every batch, then ``close`` (which waits for the
  tracker to have stored everything: W&B's ``finish``, Trackio's ``finish``; MLflow logs each
  batch synchronously);
- **through the tracker's client alone**: the very metric dictionaries the exporter would log,
  made before the clock starts, handed to ``run.log`` / ``MlflowClient.log_batch`` and closed
  the same way. The exporter cannot be faster than this: where the two rates are close, the
  tracker's client is the limit.

Each record gives 5 metrics (``mean``, ``std``, ``min``, ``max``, ``l2``: the default
statistics). Target: ≥ 10,000 records/s through each exporter.

Run: ``python -m benchmarks.bench_trackers [--quick] [--markdown FILE]``; trackers that are not
installed are reported as such.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import Table, module_main
from sowtel.exporters._tracker import StepMetrics
from sowtel.records import STAT_KEYS, Record

__all__ = ["run", "main", "trackers_table"]

SITES = 200
BATCH = 256
TARGET = 10_000


def _records(steps: int) -> list[Record]:
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        for site in range(SITES):
            stats = dict(zip(STAT_KEYS, rng.normal(size=len(STAT_KEYS)).tolist(), strict=True))
            stats.update(nan=0.0, posinf=0.0, neginf=0.0)
            out.append(Record(name=f"block{site // 8}/s{site % 8}", mode="primal",
                              tag="intermediates", step=step, index=None,
                              wall_time=time.time(), summary="stats", shape=(256,),
                              dtype="float32", stats=stats, seq=len(out)))
    return out


def _batches(records: list[Record]) -> list[list[Record]]:
    return [records[i:i + BATCH] for i in range(0, len(records), BATCH)]


def _first(records: list[Record]) -> tuple[list[Record], list[Record]]:
    """The first step's records (logged before the clock starts: a tracker's first sight of a
    metric costs more, e.g. W&B's define_metric), and the others, the steady state timed."""
    n = sum(1 for r in records if r.step == records[0].step)
    return records[:n], records[n:]


def _started(exporter: Any, first: list[Record]) -> Any:
    exporter.write(first)
    return exporter


def _timed(make: Callable[[], Any], use: Callable[[Any], None],
           close: Callable[[Any], None]) -> float:
    target = make()  # starting a run is not part of the rate
    t0 = time.perf_counter()
    use(target)
    close(target)
    return time.perf_counter() - t0


def _wandb(records: list[Record], tmp: str) -> tuple[float, float]:
    import wandb

    from sowtel.exporters.wandb import STEP_METRIC, WandbExporter

    os.environ.setdefault("WANDB_SILENT", "true")
    for sub in ("a", "b"):
        os.makedirs(os.path.join(tmp, sub))
    first, rest = _first(records)
    batches = _batches(rest)
    exporter_s = _timed(
        lambda: _started(WandbExporter(dir=os.path.join(tmp, "a"), mode="offline",
                                       project="bench"), first),
        lambda e: [e.write(b) for b in batches], lambda e: e.close())
    head = [{STEP_METRIC: b.step, **b.scalars} for b in StepMetrics().convert(first)]
    payload = [{STEP_METRIC: b.step, **b.scalars}
               for batch in batches for b in StepMetrics().convert(batch)]

    def start() -> Any:
        run = wandb.init(dir=os.path.join(tmp, "b"), mode="offline", project="bench",
                         reinit="create_new")
        run.define_metric(STEP_METRIC)
        for data in head:
            for key in data.keys() - {STEP_METRIC}:
                run.define_metric(key, step_metric=STEP_METRIC)
            run.log(data)
        return run

    client_s = _timed(start, lambda run: [run.log(d) for d in payload], lambda run: run.finish())
    return exporter_s, client_s


def _mlflow(records: list[Record], tmp: str) -> tuple[float, float]:
    from mlflow.entities import Metric

    from sowtel.exporters.mlflow import BATCH as MLFLOW_BATCH
    from sowtel.exporters.mlflow import MlflowExporter

    uri = f"sqlite:///{os.path.join(tmp, 'mlflow.db')}"
    first, rest = _first(records)
    batches = _batches(rest)
    exporter_s = _timed(
        lambda: _started(MlflowExporter(tracking_uri=uri, experiment="bench",
                                        artifact_location=os.path.join(tmp, "artifacts")),
                         first),
        lambda e: [e.write(b) for b in batches], lambda e: e.close())
    metrics = []
    for batch in batches:
        ms = [Metric(k, v, 0, b.step) for b in StepMetrics(index=(":", ":")).convert(batch)
              for k, v in b.scalars.items()]
        metrics.append([ms[i:i + MLFLOW_BATCH] for i in range(0, len(ms), MLFLOW_BATCH)])
    e2 = _started(MlflowExporter(tracking_uri=uri, experiment="bench"), first)  # a run

    def use(client: Any) -> None:
        for chunks in metrics:
            for chunk in chunks:
                client.log_batch(e2.run_id, metrics=chunk, synchronous=True)

    client_s = _timed(lambda: e2.client, use, lambda client: client.set_terminated(e2.run_id))
    return exporter_s, client_s


def _trackio(records: list[Record], tmp: str) -> tuple[float, float]:
    import trackio

    from sowtel.exporters.trackio import TrackioExporter

    first, rest = _first(records)
    batches = _batches(rest)
    exporter_s = _timed(lambda: _started(TrackioExporter(project="bench"), first),
                        lambda e: [e.write(b) for b in batches], lambda e: e.close())
    payload = [(b.step, b.scalars) for batch in batches for b in StepMetrics().convert(batch)]
    def start() -> Any:
        run = trackio.init(project="bench", auto_log_gpu=False, auto_log_cpu=False)
        for b in StepMetrics().convert(first):
            run.log(b.scalars, step=b.step)
        return run

    client_s = _timed(start, lambda run: [run.log(d, step=s) for s, d in payload],
                      lambda run: run.finish())
    return exporter_s, client_s


TRACKERS: dict[str, Callable[[list[Record], str], tuple[float, float]]] = {
    "wandb (offline)": _wandb, "mlflow (SQLite)": _mlflow, "trackio (local)": _trackio,
}


def trackers_table(steps: int) -> Table:
    """One row per tracker: the exporter's records/s and the client's alone."""
    records = _records(steps)
    table = Table(f"Tracker exporters: {len(records):,} stats records ({SITES} sites × {steps} "
                  f"steps, batches of {BATCH})",
                  ["tracker", "exporter records/s", "client alone records/s",
                   "exporter / client", "target"])
    tmp = tempfile.mkdtemp(prefix="sowtel-bench-trackers-")
    os.environ.setdefault("TRACKIO_DIR", os.path.join(tmp, "trackio"))  # before trackio loads
    try:
        for name, measure in TRACKERS.items():
            try:
                # The first run of a tracker in a process pays its one-time costs (W&B's
                # service process, Trackio's database): warm up with a tenth of the records.
                measure(records[:len(records) // 10], tempfile.mkdtemp(dir=tmp))
                exporter_s, client_s = measure(records, tempfile.mkdtemp(dir=tmp))
            except ImportError as e:
                table.add(name, "not installed", str(e)[:40], "", "")
                continue
            timed = len(_first(records)[1])
            rate, client_rate = timed / exporter_s, timed / client_s
            verdict = f"≥ {TARGET:,} {'met' if rate >= TARGET else 'MISSED'}"
            table.add(name, f"{rate:,.0f}", f"{client_rate:,.0f}",
                      f"{rate / client_rate:.2f}", verdict)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    for batch in _batches(records):
        StepMetrics().convert(batch)
    convert_rate = len(records) / (time.perf_counter() - t0)
    table.notes.append(
        f"sowtel's own conversion (records to per-step metric dictionaries): "
        f"{convert_rate:,.0f} records/s. Steady state: the first step's records are logged before "
        "the clock starts (a tracker's first sight of a metric costs more: W&B's define_metric, "
        "once per metric name). Each record gives 5 metrics. Client alone: the same metric "
        "dictionaries, made before the clock starts, logged with the tracker's own client; an "
        "exporter / client ratio near 1 means the tracker's client is the limit. Rates include "
        "closing the run.")
    return table


def run(quick: bool = False) -> list[Table]:
    """The table (20 steps with ``quick``, else 100)."""
    return [trackers_table(20 if quick else 100)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_trackers [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_trackers", __doc__, lambda args: run(quick=args.quick))


if __name__ == "__main__":
    sys.exit(main())
