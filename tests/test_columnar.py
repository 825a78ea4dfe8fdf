"""The columnar host path: a ``sowtel.jit`` step decoded once into tables, exporters' batch
methods, and exporters with only ``write(records)``.

Every batch method is checked against the same exporter's ``write`` of the records the batch
builds (the per-record path, itself checked against hand-derived numbers elsewhere), and the
tables against the per-record decoder of the device summaries.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel.exporters.jsonl import JsonlExporter, read_records, record_to_json
from sowtel.exporters.memory import MemoryExporter
from sowtel.records import STAT_KEYS, Record
from sowtel.summaries import decode_device_summary
from sowtel.to_records import RecordBatch, SiteColumns, first_nonfinite

LAYERS, SITES = 6, 3


def _scan_step(x):
    def body(c, _):
        for k in range(SITES):
            c = jnp.tanh(c) * (1.0 + k) + 0.1
            sowtel.sow(c, f"s{k}")
        return c, None
    return jax.lax.scan(body, x, None, length=LAYERS)[0]


class WriteOnly:
    """A third-party exporter as written before batches existed: write, flush, close."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.types: set[type] = set()

    def write(self, records: Sequence[Record]) -> None:
        self.types.add(type(records))
        self.records.extend(records)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Batches(WriteOnly):
    """An exporter with a batch method: keeps the batches it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[RecordBatch] = []

    def write_batch(self, batch: RecordBatch) -> None:
        self.batches.append(batch)


def _stream(summary: str, exporters: list, steps: int = 3):
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-2.0, 2.0, 40)
    with sowtel.enable(exporter=exporters, summary=summary):
        for _ in range(steps):
            x = f(x)
        assert sowtel.flush(timeout=60.0)
    return x


@pytest.mark.parametrize("summary", ["stats", "histogram", "health"])
def test_a_step_is_one_table_a_site_and_write_only_exporters_get_the_same_records(summary):
    plain, batches = WriteOnly(), Batches()
    _stream(summary, [plain, batches])
    # The exporter with only write() got plain Record lists, as before.
    assert plain.types == {list} and all(type(r) is Record for r in plain.records)
    assert len(plain.records) == 3 * LAYERS * SITES
    tables = [p for b in batches.batches for p in b.parts]
    assert all(isinstance(t, SiteColumns) for t in tables)
    # One table per site and step (a write may cut a table between positions only).
    assert sum(t.positions for t in tables) == 3 * LAYERS * SITES
    for t in tables:
        assert t.stats.shape == (t.positions, 1, len(t.stat_keys))
        assert (t.edges is not None) == (summary == "histogram")
    built = [r for b in batches.batches for r in b.records()]
    assert [(r.name, r.step, r.index, r.seq) for r in built] == [
        (r.name, r.step, r.index, r.seq) for r in plain.records]
    for a, b in zip(built, plain.records, strict=True):
        assert a == b or (a.histogram is not None and a.stats == b.stats
                          and np.array_equal(a.histogram[0], b.histogram[0])
                          and np.array_equal(a.histogram[1], b.histogram[1]))
    # Values against numpy: layer 0 of site s0 at step 0 is tanh(x) + 0.1.
    x0 = np.tanh(np.linspace(-2.0, 2.0, 40, dtype=np.float32)) + np.float32(0.1)
    [first] = [r for r in plain.records if (r.name, r.step, r.index) == ("s0", 0, 0)]
    if summary != "health":
        assert first.stats["mean"] == pytest.approx(float(x0.mean()), rel=1e-5)
        assert first.stats["std"] == pytest.approx(float(x0.std()), rel=1e-4)
        assert first.stats["max"] == pytest.approx(float(x0.max()), rel=1e-6)
    assert first.stats["size"] == 40.0 and first.stats["nan"] == 0.0


def test_tables_decode_to_hand_derived_statistics_and_edges_nonfinite_and_constant_rows_included():
    from sowtel.sites import StreamSite
    from sowtel.to_records import site_columns

    site = StreamSite(name="h", mode="primal", tag="intermediates", leaf_names=("h",),
                      shapes=((5,),), dtypes=("float32",), summary="histogram", every=1,
                      bins=4, loops=((3, False),), extras=())
    # mean, standard deviation, min, max, finite count, mean |x|
    floats = np.array([[0.5, 0.2, -1.0, 2.0, 5.0, 0.7],     # ordinary
                       [1.0, 0.0, 1.0, 1.0, 5.0, 1.0],     # constant: min == max
                       [0.0, 0.0, np.inf, -np.inf, 0.0, 0.0]], np.float32)  # all NaN
    counts = np.array([[0, 0, 0, 1], [0, 0, 0, 0], [5, 0, 0, 0]], np.float32)
    buckets = np.array([[1, 2, 1, 1], [0, 0, 0, 5], [0, 0, 0, 0]], np.float32)
    table = site_columns(site, [floats, counts, buckets], index=[0, 1, 2], step=4,
                         seqs=[7, 8, 9], wall_time=1.0, process_index=0)
    nan = float("nan")
    # By hand: l2 = sqrt(n (mean^2 + std^2)); edges from min to max in 4 buckets, unit-wide
    # from min when min == max, from 0 when no element is finite.
    wants = [
        ({"size": 5.0, "mean": 0.5, "std": 0.2, "min": -1.0, "max": 2.0,
          "l2": np.sqrt(5 * (0.25 + 0.04)), "mean_abs": 0.7, "nan": 0.0, "posinf": 0.0,
          "neginf": 0.0, "zeros": 1.0}, [-1.0, -0.25, 0.5, 1.25, 2.0], [1.0, 2.0, 1.0, 1.0]),
        ({"size": 5.0, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "l2": np.sqrt(5.0),
          "mean_abs": 1.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0, "zeros": 0.0},
         [1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 0.0, 5.0]),
        ({"size": 5.0, "mean": nan, "std": nan, "min": nan, "max": nan, "l2": nan,
          "mean_abs": nan, "nan": 5.0, "posinf": 0.0, "neginf": 0.0, "zeros": 0.0},
         [0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]),
    ]
    for p, (want, want_edges, want_counts) in enumerate(wants):
        got = table.records()[p]
        assert tuple(got.stats.keys()) == STAT_KEYS
        for k, v in want.items():
            assert got.stats[k] == pytest.approx(v, rel=1e-6, nan_ok=True), (p, k)
        np.testing.assert_array_equal(got.histogram[0], want_edges)
        np.testing.assert_array_equal(got.histogram[1], want_counts)
        # The per-record decoder gives the same numbers.
        one = decode_device_summary([floats[p], counts[p], buckets[p]], "histogram", 5, 4)
        assert one["stats"].keys() == got.stats.keys()
        np.testing.assert_array_equal(list(one["stats"].values()), list(got.stats.values()))
        np.testing.assert_array_equal(one["histogram"][0], want_edges)
    ordinary, _, all_nan = table.records()
    assert ordinary.stats["std"] == pytest.approx(0.2, rel=1e-6)  # as sent
    assert ordinary.stats["l2"] == pytest.approx(np.sqrt(0.2 + 5 * 0.25), rel=1e-6)
    assert ordinary.stats["mean_abs"] == pytest.approx(0.7, rel=1e-6)
    # No finite element: every statistic NaN, l2 included (never 0).
    assert all(np.isnan(all_nan.stats[k])
               for k in ("mean", "std", "min", "max", "l2", "mean_abs"))
    assert table.any_nonfinite
    assert first_nonfinite(RecordBatch([table])) == (4, "h", "primal")


def test_a_batch_splits_between_positions_within_its_bounds():
    from sowtel.records import HEALTH_KEYS

    table = SiteColumns(names=("a", "b"), shapes=((), ()), dtypes=("float32",) * 2,
                        mode="primal", tag="t", summary="health", step=0, wall_time=0.0,
                        process_index=0, order=0, index=list(range(10)), seqs=list(range(10)),
                        stat_keys=HEALTH_KEYS, stats=np.arange(80.0).reshape(10, 2, 4))
    head, rest = RecordBatch([table]).split(7, 1 << 20)
    # Two leaves a position: 7 records make 3 whole positions; the rest keeps the other 7.
    assert (len(head), len(rest)) == (6, 14)
    assert head.records() + rest.records() == table.records()
    # Nothing fits a write that already holds records; one position goes when it is the first.
    assert len(RecordBatch([table]).split(1, 1 << 20, started=True)[0]) == 0
    assert len(RecordBatch([table]).split(1, 1 << 20)[0]) == 2


def test_memory_keeps_tables_and_evicts_exactly_its_bound():
    memory = MemoryExporter(max_records=50)
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-2.0, 2.0, 40)
    with sowtel.enable(exporter=memory):
        for _ in range(4):
            x = f(x)
        assert sowtel.flush(timeout=60.0)
        s = sowtel.status()
    total = 4 * LAYERS * SITES
    assert len(memory) == 50 and len(memory.records) == 50
    assert memory.evicted == total - 50 == s["evicted"]["memory"]
    # The newest are kept, in order.
    assert [r.step for r in memory.records][-1] == 3
    assert [r.seq for r in memory.records] == sorted(r.seq for r in memory.records)


def test_jsonl_batch_lines_are_the_records_json(tmp_path):
    jsonl = JsonlExporter(logdir=tmp_path)
    plain = WriteOnly()
    x = jnp.linspace(-2.0, 2.0, 40).at[3].set(jnp.nan)  # non-finite numbers in the lines too
    f = sowtel.jit(_scan_step)
    with sowtel.enable(exporter=[jsonl, plain], summary="histogram"):
        for _ in range(2):
            x = f(x)
        assert sowtel.flush(timeout=60.0)
    lines = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert lines == [record_to_json(r) for r in plain.records]
    assert read_records(tmp_path / "records.jsonl")[0].name == "s0"


@pytest.mark.parametrize("depth", ["tensor", "scalars"])
def test_tensorboard_batch_writes_what_write_writes(tmp_path, depth):
    from tensorboard.backend.event_processing import event_accumulator as ea

    from sowtel.exporters.tensorboard import TensorBoardExporter

    batch_dir, plain_dir = tmp_path / "batch", tmp_path / "plain"
    by_batch = TensorBoardExporter(logdir=batch_dir, depth=depth)
    plain = WriteOnly()
    _stream("stats", [by_batch, plain])
    by_write = TensorBoardExporter(logdir=plain_dir, depth=depth)
    by_write.write(plain.records)
    by_write.close()

    def read(run: os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        acc = ea.EventAccumulator(os.fspath(run), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        acc.Reload()
        scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                   for tag in acc.Tags()["scalars"]}
        depths = {tag: [(e.step, tf_array(e.tensor_proto).tolist()) for e in acc.Tensors(tag)]
                  for tag in acc.Tags()["tensors"] if tag.endswith("/depth")}
        return scalars, depths

    (got, got_depth), (want, want_depth) = read(batch_dir), read(plain_dir)
    assert got == want and got_depth == want_depth
    if depth == "scalars":
        assert len(got) == LAYERS * SITES * 3 and not got_depth  # mean, std, max_abs a series
    else:
        # A site's layers are one tensor a step, and one headline curve: the l2 over layers.
        assert sorted(got) == [f"s{i}/primal/l2" for i in range(SITES)]
        assert sorted(got_depth) == [f"s{i}/primal/depth" for i in range(SITES)]
        steps, table = got_depth["s0/primal/depth"][0]
        assert steps == 0 and table[0] == list(range(LAYERS))  # the index row, then the stats


def test_tensorboard_depth_tensor_of_a_step_in_pieces_equals_it_whole(tmp_path):
    """A step's table split across batches (positions in reverse order, 2-d indices) is one
    depth tensor, positions sorted, equal to the per-record path's; a step older than the last
    written goes out as per-position scalars, as write() does."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    from sowtel.exporters.tensorboard import TensorBoardExporter
    from sowtel.records import STAT_KEYS

    rng = np.random.default_rng(0)
    index = [(i, j) for i in (1, 0) for j in (2, 1, 0)]  # reversed scans, as a program runs them

    def table(step: int) -> SiteColumns:
        return SiteColumns(
            names=("h",), shapes=((4,),), dtypes=("float32",), mode="primal",
            tag="intermediates", summary="stats", step=step, wall_time=float(step),
            process_index=0, order=0, index=index, seqs=list(range(10 * step, 10 * step + 6)),
            stat_keys=STAT_KEYS, stats=rng.random((6, 1, len(STAT_KEYS))) * 0.0 + np.arange(
                6 * len(STAT_KEYS)).reshape(6, 1, -1) + step)

    tables = [table(1), table(2), table(0)]
    by_batch = TensorBoardExporter(logdir=tmp_path / "batch")
    head, rest = RecordBatch([tables[0]]).split(2, 1 << 20)
    assert rest is not None and len(head) == 2
    for batch in (head, rest, RecordBatch([tables[1]]), RecordBatch([tables[2]])):
        by_batch.write_batch(batch)
    by_batch.close()
    by_write = TensorBoardExporter(logdir=tmp_path / "plain")
    for t in tables:
        by_write.write(t.records())
    by_write.close()

    def read(run: os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        acc = ea.EventAccumulator(os.fspath(run), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        acc.Reload()
        # A step written again (its second piece) counts as TensorBoard reads it: the last.
        scalars = {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items())
                   for tag in acc.Tags()["scalars"]}
        depths = {tag: sorted({e.step: tf_array(e.tensor_proto).tolist()
                               for e in acc.Tensors(tag)}.items())
                  for tag in acc.Tags()["tensors"] if tag.endswith("/depth")}
        return scalars, depths

    (got, got_depth), (want, want_depth) = read(tmp_path / "batch"), read(tmp_path / "plain")
    assert got == want and got_depth == want_depth
    (step, first), (step2, _) = got_depth["h/primal/depth"]
    assert (step, step2) == (1, 2)
    # Rows: the two index rows, then the statistics but size; columns: positions sorted.
    assert first[0] == [0, 0, 0, 1, 1, 1] and first[1] == [0, 1, 2, 0, 1, 2]
    k = len(STAT_KEYS)
    order = [index.index(p) for p in sorted(index)]
    assert first[2] == [float(1 + p * k + 1) for p in order]  # "mean", the column after size
    # Step 0 came after step 2: its positions as scalars, one tag each.
    assert got["h[0,0]/primal/mean"] == [(0, float(index.index((0, 0)) * k + 1))]


def tf_array(proto: Any) -> Any:
    from tensorboard.util import tensor_util

    return tensor_util.make_ndarray(proto)


def test_otel_one_event_a_site_and_step_with_positions_as_lists():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sowtel.exporters.otel import OTelExporter

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    otel, plain = OTelExporter(tracer_provider=provider), WriteOnly()
    _stream("stats", [otel, plain], steps=2)
    events = [(s.attributes["sowtel.step"], e.attributes)
              for s in spans.get_finished_spans() for e in s.events]
    assert len(events) == 2 * SITES  # one a site and step, not one a record
    for step, attrs in events:
        assert attrs["sowtel.records"] == LAYERS
        assert list(attrs["sowtel.index"]) == list(range(LAYERS))
        records = sorted((r for r in plain.records
                          if (r.name, r.step) == (attrs["sowtel.name"], step)),
                         key=lambda r: r.index)
        assert list(attrs["sowtel.stat.mean"]) == [r.stats["mean"] for r in records]
        assert list(attrs["sowtel.stat.zeros"]) == [r.stats["zeros"] for r in records]
        assert all(type(v) is int for v in attrs["sowtel.stat.zeros"])
        # The same at every position: one int each (40 elements; no NaN or infinity).
        assert (attrs["sowtel.stat.size"], attrs["sowtel.stat.nan"], attrs["sowtel.stat.posinf"],
                attrs["sowtel.stat.neginf"]) == (40, 0, 0, 0)
        assert all(type(attrs[f"sowtel.stat.{k}"]) is int
                   for k in ("size", "nan", "posinf", "neginf"))
    assert sum(s.attributes["sowtel.record_count"]
               for s in spans.get_finished_spans()) == 2 * LAYERS * SITES


def test_otel_metrics_of_tables_are_each_positions_latest_and_count():
    """Gauges and the exported counter read a table's positions as the records' series; a
    record after a table updates its series, and a table after the record wins again."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from sowtel.exporters.otel import OTelExporter

    reader = InMemoryMetricReader()
    otel = OTelExporter(tracer_provider=TracerProvider(),
                        meter_provider=MeterProvider(metric_readers=[reader]))
    plain, grab = WriteOnly(), Batches()
    _stream("stats", [plain, grab], steps=3)
    for batch in grab.batches:
        otel.write_batch(batch)

    def points() -> dict[str, dict[Any, float]]:
        out: dict[str, dict[Any, float]] = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out[m.name] = {(p.attributes["sowtel.name"], p.attributes.get("sowtel.index"))
                                   : p.value for p in m.data.data_points
                                   if "sowtel.name" in p.attributes}
        return out

    got = points()
    last = max(r.step for r in plain.records)
    for r in plain.records:
        assert got["sowtel.records.exported"][r.name, r.index] == 3
        if r.step == last:
            assert got["sowtel.mean"][r.name, r.index] == pytest.approx(r.stats["mean"])
            assert got["sowtel.step"][r.name, r.index] == last
    assert len(got["sowtel.mean"]) == LAYERS * SITES
    # Between two readings: a table, then a record of one of its positions (the record wins),
    # then (another reading later) the table again (the table wins).
    r = next(r for r in plain.records if r.step == last and r.index == 2)
    table = next(t for b in grab.batches for t in b.columns()
                 if t.names == (r.name,) and t.step == last)

    def table_at(step: int) -> RecordBatch:
        again = table.slice(0, table.positions)
        again.step = step
        return RecordBatch([again])

    otel.write_batch(table_at(last + 1))
    otel.write([dataclasses.replace(r, step=last + 2, stats={**r.stats, "mean": 123.0})])
    got = points()
    assert got["sowtel.mean"][r.name, 2] == 123.0
    assert got["sowtel.step"][r.name, 2] == last + 2
    assert got["sowtel.records.exported"][r.name, 2] == 5
    assert got["sowtel.mean"][r.name, 1] != 123.0
    assert got["sowtel.step"][r.name, 1] == last + 1
    otel.write_batch(table_at(last + 3))
    got = points()
    assert got["sowtel.mean"][r.name, 2] == pytest.approx(r.stats["mean"])
    assert got["sowtel.records.exported"][r.name, 2] == 6
    assert got["sowtel.step"][r.name, 2] == last + 3
    otel.close()


def test_callback_records_decoded_together_keep_each_callbacks_step_index_seq_and_time():
    """The callback transport decodes a batch's callbacks of a site as one table: each record
    still has its own callback's step, scan index, seq and arrival time, in received order,
    and its statistics are the per-record decoder's."""
    from sowtel.exporters.memory import MemoryExporter as Memory

    memory = Memory(max_records=None)
    f = jax.jit(_scan_step)
    x = jnp.linspace(-2.0, 2.0, 40)
    with sowtel.enable(exporter=memory, summary="histogram"):
        for _ in range(3):
            x = f(x)
        assert sowtel.flush(timeout=60.0)
    records = memory.records
    assert len(records) == 3 * LAYERS * SITES
    seqs = [r.seq for r in records]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)  # one leaf a callback
    # Each callback's own arrival time (not one for the batch or the step).
    assert len({r.wall_time for r in records}) > 3 * SITES
    for k in range(SITES):
        mine = [r for r in records if r.name == f"s{k}"]
        assert [(r.step, r.index) for r in mine] == [
            (step, layer) for step in range(3) for layer in range(LAYERS)]
    # Values by an independent path: the scan's activations recomputed with numpy.
    c = np.linspace(-2.0, 2.0, 40, dtype=np.float32)
    for _ in range(2):
        for _layer in range(LAYERS):
            for k in range(SITES):
                c = np.tanh(c) * np.float32(1.0 + k) + np.float32(0.1)
    for layer in range(LAYERS):
        for k in range(SITES):
            c = np.tanh(c) * np.float32(1.0 + k) + np.float32(0.1)
            r = next(r for r in records if (r.name, r.step, r.index) == (f"s{k}", 2, layer))
            assert r.stats["mean"] == pytest.approx(float(c.astype(np.float64).mean()),
                                                    rel=1e-5, abs=1e-6)
            assert r.stats["max"] == pytest.approx(float(c.max()), rel=1e-6)
            edges, counts = r.histogram
            assert edges[0] == pytest.approx(float(c.min()), rel=1e-6)
            assert counts.sum() == 40


def test_otel_a_steps_span_ends_when_a_later_steps_table_arrives():
    """Tables, like records, end a step's span as soon as a later step shows it complete; the
    last step waits for flush."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sowtel.exporters.otel import OTelExporter

    grab = Batches()
    _stream("stats", [grab], steps=2)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    otel = OTelExporter(tracer_provider=provider)
    tables = [t for b in grab.batches for t in b.columns()]
    for step in (0, 1):
        otel.write_batch(RecordBatch([t for t in tables if t.step == step]))
    ended = [(s.attributes["sowtel.step"], len(s.events)) for s in spans.get_finished_spans()]
    assert ended == [(0, SITES)]
    otel.flush()
    ended = [(s.attributes["sowtel.step"], len(s.events)) for s in spans.get_finished_spans()]
    assert ended == [(0, SITES), (1, SITES)]
    otel.close()


def test_a_steps_plain_stats_sites_decoded_together_equal_the_site_by_site_tables():
    from sowtel.to_records import CompiledConverter

    def step(x):
        sowtel.sow(x * 2.0, "plain")
        sowtel.sow(jnp.log(x - 1.0), "some_nan")  # log of negatives: NaN, log 0: -inf
        sowtel.sow(jnp.full((3,), jnp.nan), "all_nan")
        sowtel.sow({"a": x, "b": x[:2] + 1.0}, "tree")
        sowtel.sow(x.astype(jnp.int32), "ints")
        sowtel.sow(x + 5.0, "hist", summary="histogram")
        jax.lax.cond(x[0] > 100.0, lambda v: sowtel.sow(v, "untaken"), lambda v: v, x)
        jax.lax.scan(lambda c, _: (sowtel.sow(c * 3.0, "in_scan"), None), x, None, length=2)
        return (x ** 2).sum()

    x = jnp.array([0.0, 1.0, 2.0, 3.5])
    f = sowtel.jit(step)
    with sowtel.enable(exporter="memory") as session:
        _, summaries = f._program(session.config, frozenset({1}))(x)
    buffers = [np.asarray(b) for b in summaries.buffers]
    args = dict(step=3, wall_time=1.5, process_index=0)
    together = CompiledConverter().packed_columns(summaries, buffers, seqs=iter(range(100)),
                                                  **args)
    one_by_one = CompiledConverter().columns(summaries.sites, summaries.unpack(buffers),
                                             seqs=iter(range(100)), **args)
    got, want = RecordBatch(together).records(), RecordBatch(one_by_one).records()
    assert [(r.name, r.index, r.seq) for r in got] == [(r.name, r.index, r.seq) for r in want]
    assert "untaken" not in {r.name for r in got}
    for a, b in zip(got, want, strict=True):
        assert a.stats.keys() == b.stats.keys()
        for k in a.stats:
            assert a.stats[k] == b.stats[k] or (np.isnan(a.stats[k]) and np.isnan(b.stats[k]))
    by_name = {r.name: r for r in got}
    assert by_name["plain"].stats["max"] == 7.0 and by_name["plain"].stats["zeros"] == 1.0
    assert (by_name["some_nan"].stats["nan"], by_name["some_nan"].stats["neginf"]) == (1.0, 1.0)
    assert all(np.isnan(by_name["all_nan"].stats[k])
               for k in ("mean", "std", "min", "max", "l2", "mean_abs"))
    assert [t.any_nonfinite for t in together if t.names[0] in ("plain", "some_nan")] == [
        False, True]
