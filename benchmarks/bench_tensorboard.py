"""What the TensorBoard exporter costs: records and histograms per second, and a training step.

The measurements, taken side by side in this one process:

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
4. **Depth** (:func:`deep_model`): a 48-layer x 8-site scan's scalar tags and event bytes per
   1,000 steps in each layout, and the plugin's routes on a real TensorBoard; and the plugin
   page's **first paint** in headless Chromium on that run (:func:`first_paint`).

Run: ``python -m benchmarks.bench_tensorboard [--quick] [--first-paint] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_tensorboard
    >>> tables = bench_tensorboard.run(quick=True)  # doctest: +SKIP
    >>> print(tables[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
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

__all__ = ["run", "main", "tables", "scalars", "histograms", "deep_model", "first_paint",
           "training_step"]

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



DEEP_LAYERS, DEEP_SITES = 48, 8


def _deep_records(steps: int) -> Iterator[list[Record]]:
    """A logging step at a time of a 48-layer model with 8 sites a layer under ``scan``:
    768 records a step (primal and cotangent), real statistics."""
    rng = np.random.default_rng(1)
    pool = [host_summary(rng.normal(scale=10.0 ** rng.uniform(-3, 1), size=(64,)), "stats")
            for _ in range(97)]
    t0 = time.time()
    for step in range(steps):
        batch = []
        for s in range(DEEP_SITES):
            for order, mode in ((s, "primal"), (2 * DEEP_SITES - s, "cotangent")):
                for layer in range(DEEP_LAYERS):
                    stats = pool[(step + s * 7 + layer) % len(pool)]["stats"]
                    batch.append(Record(
                        name=f"blocks/site{s}", mode=mode, tag="intermediates", step=step,
                        index=layer, wall_time=t0 + step, summary="stats", shape=(64,),
                        dtype="float32", stats=stats, order=order))
        yield batch


def _run_size(logdir: str) -> tuple[int, int]:
    """(scalar tags, bytes) of the event files under ``logdir``."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 1, ea.TENSORS: 1})
    acc.Reload()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(logdir) for f in fs)
    return len(acc.Tags()["scalars"]), size


def deep_model(quick: bool = False) -> Table:
    """The 48-layer x 8-site model: scalar tags and event bytes per 1,000 steps in each
    layout, and how fast a real TensorBoard answers the plugin's depth route."""
    steps = 40 if quick else 1000
    table = Table("TensorBoard at depth: a 48-layer x 8-site scan, per 1,000 logging steps",
                  ["layout (depth=)", "scalar tags", "MB / 1,000 steps", "write (records/s)",
                   "depth route, loaded", "page's data"])
    top = tempfile.mkdtemp(prefix="sowtel-bench-deep-")
    try:
        for depth in ("tensor", "scalars"):
            logdir = os.path.join(top, depth)
            exporter = TensorBoardExporter(logdir=logdir, depth=depth)
            t0 = time.perf_counter()
            n = 0
            for batch in _deep_records(steps):
                exporter.write(batch)
                n += len(batch)
            exporter.close()
            rate = n / (time.perf_counter() - t0)
            tags, size = _run_size(logdir)
            route = _route_seconds(top, depth, steps) if depth == "tensor" else None
            table.add(depth, f"{tags:,}", f"{size / 1e6 * 1000 / steps:,.1f}", f"{rate:,.0f}",
                      "—" if route is None else fmt_time(route[0]),
                      "—" if route is None else fmt_time(route[1]))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    table.notes.append(
        f"{steps} logging steps of {DEEP_LAYERS * DEEP_SITES * 2} records (stats summaries, "
        "primal and cotangent), written through TensorBoardExporter.write a step at a time; "
        "sizes scaled to 1,000 steps. Targets: <= 1,000 scalar tags and <= 40 MB per 1,000 "
        "steps. 'depth route': GET /data/plugin/sowtel/depth for one site, mode and statistic "
        "from a TensorBoard started by `sowtel dashboard`'s launcher, once the run is loaded "
        "(median of 5; target < 2 s). 'page's data': the five requests the plugin page makes "
        "(runs, sites, health, overview, depth), in sequence; it paints after the depth.")
    return table


def _wait_loaded(query: str, steps: int, seconds: float) -> None:
    """Polls the depth route ``query`` until TensorBoard has loaded ``steps`` steps."""
    import json
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(query, timeout=30) as r:
                if len(json.load(r)["steps"]) >= steps:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"TensorBoard did not load the run within {seconds:.0f} s")
        time.sleep(0.5)


def _route_seconds(top: str, run: str, steps: int) -> tuple[float, float]:
    import json
    import urllib.request

    from sowtel.dashboard import _launch, pick_port

    url = _launch(top, "127.0.0.1", pick_port("127.0.0.1", None))
    query = f"{url}data/plugin/sowtel/depth?run={run}&site=blocks/site3&mode=cotangent&stat=l2"
    _wait_loaded(query, steps, 120)
    base = f"{url}data/plugin/sowtel/"
    page = [f"{base}runs", f"{base}sites?run={run}", f"{base}health?run={run}",
            f"{base}overview?run={run}", query]
    times: dict[str, list[float]] = {"depth": [], "page": []}
    for _ in range(5):
        t0 = time.perf_counter()
        with urllib.request.urlopen(query, timeout=30) as r:
            json.load(r)
        times["depth"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for u in page:  # what the page asks before it paints, in its order
            with urllib.request.urlopen(u, timeout=30) as r:
                json.load(r)
        times["page"].append(time.perf_counter() - t0)
    return statistics.median(times["depth"]), statistics.median(times["page"])


# In the page's frame once it is ready: when (ms after the top page's navigation began) the
# depth view was drawn, and each of the plugin's requests (start and end, same clock).
_PAINT_TIMES = r"""(() => {
  const f = document.querySelector('iframe');
  const w = f && f.contentWindow;
  if (!w || !w.document.body || w.document.body.getAttribute('data-ready') !== '1') return null;
  const shift = w.performance.timeOrigin - performance.timeOrigin;
  const ready = w.performance.getEntriesByName('sowtel-ready')[0];
  const nav = performance.getEntriesByType('navigation')[0];
  const top = performance.getEntriesByType('resource').map(
    e => [e.name, e.startTime, e.responseEnd]);
  return {ready: ready.startTime + shift, frame: shift, load: nav ? nav.loadEventEnd : null,
          top: top,
          requests: w.performance.getEntriesByType('resource').map(
            e => [e.name.split('/').pop(), e.startTime + shift, e.responseEnd + shift])};
})()"""


def first_paint(quick: bool = False) -> Table:
    """First paint of the plugin page on the 48 x 8 model's run, in headless Chromium.

    The run (1,000 logging steps, 40 with ``quick``) is served by a TensorBoard started as
    ``sowtel dashboard`` starts it; once every step is loaded, Chromium opens
    ``/#sowtel`` afresh (a new profile: nothing cached) three times, and the page's own clock
    says when its depth view was drawn, counted from the navigation's start.
    """
    import json

    from benchmarks.chromium import Chromium
    from sowtel.dashboard import _launch, pick_port

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise RuntimeError("Chromium is missing: install Debian's chromium (make system-deps)")
    steps = 40 if quick else 1000
    table = Table(f"The plugin page's first paint: the 48 x 8 model, {steps:,} logging steps",
                  ["load", "first paint", "TensorBoard's app", "plugin requests",
                   "slowest request"])
    top = tempfile.mkdtemp(prefix="sowtel-bench-paint-")
    try:
        exporter = TensorBoardExporter(logdir=os.path.join(top, "deep"))
        for batch in _deep_records(steps):
            exporter.write(batch)
        exporter.close()
        url = _launch(top, "127.0.0.1", pick_port("127.0.0.1", None))
        _wait_loaded(f"{url}data/plugin/sowtel/depth?run=deep&site=blocks/site0&mode=primal"
                     "&stat=std", steps, 180)
        for attempt in range(3):
            profile = tempfile.mkdtemp(prefix="sowtel-bench-chromium-")
            browser = Chromium(binary, Path(profile))
            try:
                browser.call("Page.navigate", page=True, url=f"{url}#sowtel")
                deadline = time.monotonic() + 120
                while (times := browser.evaluate(_PAINT_TIMES)) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the plugin page was not ready within 120 s")
                    time.sleep(0.1)
            finally:
                browser.close()
                shutil.rmtree(profile, ignore_errors=True)
            assert isinstance(times, dict)
            requests = times["requests"]
            slowest = max(requests, key=lambda e: e[2] - e[1]) if requests else None
            table.add(
                str(attempt + 1),
                fmt_time(times["ready"] / 1e3),
                fmt_time(times["frame"] / 1e3),
                f"{len(requests)} in {fmt_time((requests[-1][2] - requests[0][1]) / 1e3)}"
                if requests else "—",
                "—" if slowest is None else
                f"{slowest[0].split('?')[0]} {fmt_time((slowest[2] - slowest[1]) / 1e3)}")
            if os.environ.get("SOWTEL_BENCH_PAINT_DETAIL"):
                print(json.dumps(times, indent=1), file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    table.notes.append(
        "first paint: from the start of the navigation to /#sowtel until the plugin has drawn "
        "its health panel, heatmap and line chart (the page's own performance mark). "
        "TensorBoard's app: when TensorBoard's page created the plugin's frame. plugin "
        "requests: the frame's requests (its script and its JSON routes), first start to last "
        "end. Each load is a fresh browser profile (nothing cached) against the same loaded "
        "TensorBoard. Target: first paint < 3 s on the 1,000-step run.")
    return table


def tables(quick: bool = False) -> Iterator[Table]:
    """Runs the measurements, yielding each table as soon as it is measured."""
    yield scalars(quick)
    yield histograms(quick)
    yield deep_model(quick)
    yield first_paint(quick)
    yield training_step(quick)


def run(quick: bool = False) -> list[Table]:
    """Runs the three measurements; returns their tables."""
    return list(tables(quick))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_tensorboard [--quick] [--first-paint] [--markdown FILE]``."""
    def only(parser: Any) -> None:
        parser.add_argument("--first-paint", action="store_true",
                            help="only the plugin page's first paint in headless Chromium")

    return module_main(argv, "bench_tensorboard", __doc__,
                       lambda args: [first_paint(args.quick)] if args.first_paint
                       else tables(args.quick), arguments=only)


if __name__ == "__main__":
    sys.exit(main())
