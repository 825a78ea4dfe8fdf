"""The OpenTelemetry exporter, read back through the real SDK and over the real OTLP protocols.

The OTLP receivers here are small servers on 127.0.0.1 built on opentelemetry-proto's own
service definitions: an HTTP server that decodes ``ExportTraceServiceRequest`` /
``ExportMetricsServiceRequest`` bodies, and a gRPC server implementing ``TraceService`` and
``MetricsService``. The SDK's own OTLP exporters talk to them.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reference import numpy_stats

import sowtel
from sowtel.exporters.memory import MemoryExporter
from sowtel.exporters.otel import (
    ALERT_EVENT_NAME,
    COUNTER_NAMES,
    EVENT_NAME,
    GAUGE_NAMES,
    SPAN_NAME,
    OTelExporter,
)
from sowtel.records import STAT_KEYS, Record
from sowtel.summaries import host_summary

COUNTS = {"size", "nan", "posinf", "neginf", "zeros"}


# -- helpers ------------------------------------------------------------------------------------


def make_record(name: str, step: int, x: np.ndarray, *, mode: str = "primal", index: Any = None,
                summary: str = "stats", wall_time: float = 1.7e9, seq: int = 0) -> Record:
    s = host_summary(x, summary) if summary != "full" else {"stats": {}, "histogram": None}
    return Record(name=name, mode=mode, tag="intermediates", step=step, index=index,
                  wall_time=wall_time, summary=summary, shape=tuple(x.shape),
                  dtype=str(x.dtype), value=x if summary == "full" else None,
                  stats=s["stats"], histogram=s["histogram"], seq=seq)


def sdk_providers(**limits: int) -> tuple[TracerProvider, InMemorySpanExporter, MeterProvider,
                                          InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(span_limits=SpanLimits(**limits) if limits else None)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    return tracer_provider, spans, MeterProvider(metric_readers=[reader]), reader


def metric_points(reader: InMemoryMetricReader) -> dict[str, dict[tuple, float]]:
    """{metric name: {sorted attribute items: value}} from one collection."""
    out: dict[str, dict[tuple, float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = {
                    tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                                 for k, v in p.attributes.items())): p.value
                    for p in m.data.data_points
                }
    return out


def assert_plain(attributes: dict[str, Any]) -> None:
    """Attribute values are plain Python scalars or tuples of them, never numpy objects."""
    for key, value in attributes.items():
        if isinstance(value, tuple):
            assert all(type(v) in (int, float) for v in value), (key, value)
        else:
            assert type(value) in (str, int, float, bool), (key, type(value))


def expected_event(name: str, mode: str, x: np.ndarray, *, index: Any = None,
                   summary: str = "stats") -> dict[str, Any]:
    want: dict[str, Any] = {
        "sowtel.name": name, "sowtel.mode": mode, "sowtel.tag": "intermediates",
        "sowtel.summary": summary, "sowtel.shape": tuple(x.shape), "sowtel.dtype": str(x.dtype),
    }
    if index is not None:
        want["sowtel.index"] = tuple(index) if isinstance(index, tuple) else index
    keys = ("size", "nan", "posinf", "neginf") if summary == "health" else STAT_KEYS
    if summary != "shape":
        stats = numpy_stats(x)
        want.update({f"sowtel.stat.{k}": stats[k] for k in keys})
    return want


def assert_event(attributes: dict[str, Any], want: dict[str, Any]) -> None:
    assert_plain(dict(attributes))
    got = {k: v for k, v in attributes.items() if not k.startswith("sowtel.histogram.")}
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        if key.startswith("sowtel.stat.") and key.rsplit(".", 1)[1] not in COUNTS:
            assert got[key] == pytest.approx(float(value), rel=2e-6, abs=1e-7), key
        else:
            assert got[key] == value, key


@pytest.fixture(autouse=True)
def _no_session_left() -> Iterator[None]:
    yield
    while sowtel.status().get("enabled"):
        sowtel.disable(timeout=10)


# -- in memory ------------------------------------------------------------------------------


def test_spans_events_and_metrics_equal_what_was_sown():
    rng = np.random.default_rng(0)
    tracer_provider, spans, meter_provider, reader = sdk_providers()
    exporter = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
    h = [rng.normal(size=(4, 8)).astype(np.float32) for _ in range(2)]
    g = [rng.normal(scale=1e-3, size=(16,)).astype(np.float32) for _ in range(2)]
    scan = [[rng.uniform(-i - 1, i + 1, size=(5,)).astype(np.float32) for i in range(3)]
            for _ in range(2)]
    w = [rng.normal(size=(6,)).astype(np.float32) for _ in range(2)]
    w[1][:4] = [np.nan, np.nan, np.inf, -np.inf]
    full = [np.arange(6, dtype=np.float32).reshape(2, 3) - s for s in range(2)]
    pair = [rng.normal(size=(3,)).astype(np.float32) for _ in range(2)]

    def step_records(s: int) -> list[Record]:
        t = 1.7e9 + 10 * s
        recs = [make_record("block0/h", s, h[s], wall_time=t, seq=0),
                make_record("block0/h", s, g[s], mode="cotangent", wall_time=t + 0.5, seq=9)]
        recs += [make_record("scan/x", s, scan[s][i], index=i, wall_time=t + 0.1 * (i + 1),
                             seq=1 + i) for i in range(3)]
        recs += [make_record("w", s, w[s], summary="health", wall_time=t + 0.4, seq=4),
                 make_record("full", s, full[s], summary="full", wall_time=t + 0.41, seq=5),
                 make_record("pair/0", s, pair[s], index=(1, 2), summary="histogram",
                             wall_time=t + 0.42, seq=6),
                 make_record("shape_only", s, h[s], summary="shape", wall_time=t + 0.43, seq=7)]
        return recs

    # Out of order within a batch, as concurrent host callbacks deliver them.
    exporter.write(step_records(0)[::-1])
    assert spans.get_finished_spans() == ()  # step 0 may still get records
    exporter.write(step_records(1)[::-1])
    exporter.flush()
    finished = sorted(spans.get_finished_spans(), key=lambda sp: sp.attributes["sowtel.step"])
    assert [sp.name for sp in finished] == [SPAN_NAME, SPAN_NAME]
    for s, span in enumerate(finished):
        assert span.attributes["sowtel.step"] == s
        assert span.attributes["sowtel.part"] == 0
        assert span.attributes["sowtel.record_count"] == 9
        assert span.parent is None
        assert span.start_time == int((1.7e9 + 10 * s) * 1e9)
        assert span.end_time == int((1.7e9 + 10 * s + 0.5) * 1e9)
        records = [e for e in span.events if e.name == EVENT_NAME]
        want = [expected_event("block0/h", "primal", h[s])]
        want += [expected_event("scan/x", "primal", scan[s][i], index=i) for i in range(3)]
        want += [expected_event("w", "primal", w[s], summary="health"),
                 expected_event("full", "primal", full[s], summary="full"),
                 expected_event("pair/0", "primal", pair[s], index=(1, 2), summary="histogram"),
                 expected_event("shape_only", "primal", h[s], summary="shape"),
                 expected_event("block0/h", "cotangent", g[s])]
        assert len(records) == len(want)
        for event, w_attrs in zip(records, want, strict=True):
            assert_event(event.attributes, w_attrs)
        assert [e.timestamp for e in records] == sorted(e.timestamp for e in records)
        hist = next(e for e in records if e.attributes["sowtel.name"] == "pair/0").attributes
        counts, edges = np.histogram(pair[s].astype(np.float64), bins=30)
        assert hist["sowtel.histogram.counts"] == tuple(float(c) for c in counts)
        np.testing.assert_allclose(hist["sowtel.histogram.edges"], edges, rtol=1e-12)
    # The first non-finite record raises one alert, on its step's span, right after it.
    alerts = [(s, i, e) for s, sp in enumerate(finished) for i, e in enumerate(sp.events)
              if e.name == ALERT_EVENT_NAME]
    assert len(alerts) == 1
    s, i, alert = alerts[0]
    assert s == 1 and finished[1].events[i - 1].attributes["sowtel.name"] == "w"
    assert dict(alert.attributes) == {"sowtel.name": "w", "sowtel.mode": "primal",
                                      "sowtel.step": 1, "sowtel.stat.nan": 2,
                                      "sowtel.stat.posinf": 1, "sowtel.stat.neginf": 1}

    points = metric_points(reader)
    # No session is enabled here, so there are no exporters whose errors could be counted.
    assert set(GAUGE_NAMES.values()) | set(COUNTER_NAMES.values()) == set(points) | {
        COUNTER_NAMES["exporter_errors"]}
    site = (("sowtel.mode", "primal"), ("sowtel.name", "block0/h"))
    for stat in STAT_KEYS:  # gauges hold the latest step's statistics
        assert points[f"sowtel.{stat}"][site] == pytest.approx(numpy_stats(h[1])[stat], rel=2e-6)
    cot = (("sowtel.mode", "cotangent"), ("sowtel.name", "block0/h"))
    assert points["sowtel.l2"][cot] == pytest.approx(np.linalg.norm(g[1].astype(np.float64)),
                                                     rel=2e-6)
    for i in range(3):
        key = (("sowtel.index", i), ("sowtel.mode", "primal"), ("sowtel.name", "scan/x"))
        assert points["sowtel.max"][key] == pytest.approx(float(scan[1][i].max()))
        assert points["sowtel.records.exported"][key] == 2
    assert points["sowtel.mean"][(("sowtel.mode", "primal"), ("sowtel.name", "full"))] == (
        pytest.approx(float(full[1].mean())))
    pair_key = (("sowtel.index", (1, 2)), ("sowtel.mode", "primal"), ("sowtel.name", "pair/0"))
    assert points["sowtel.std"][pair_key] == pytest.approx(float(pair[1].astype(float).std()))
    assert points["sowtel.step"][site] == 1
    w_site = (("sowtel.mode", "primal"), ("sowtel.name", "w"))
    assert points["sowtel.nan"][w_site] == 2 and "sowtel.mean" not in {
        k for k, v in points.items() if w_site in v}
    nonfinite = points["sowtel.nonfinite_elements"]
    assert nonfinite == {
        (("sowtel.mode", "primal"), ("sowtel.name", "w"), ("sowtel.nonfinite_kind", "nan")): 2,
        (("sowtel.mode", "primal"), ("sowtel.name", "w"), ("sowtel.nonfinite_kind", "posinf")): 1,
        (("sowtel.mode", "primal"), ("sowtel.name", "w"), ("sowtel.nonfinite_kind", "neginf")): 1,
    }
    assert sum(points["sowtel.records.exported"].values()) == 18
    assert points["sowtel.span_events.dropped"] == {(): 0}
    assert exporter.errors == {}
    exporter.close()


def test_counters_accumulate_over_steps_and_batches():
    tracer_provider, spans, meter_provider, reader = sdk_providers()
    exporter = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
    nans = [0, 3, 0, 1, 5]
    for s, n in enumerate(nans):
        x = np.ones(8, np.float32)
        x[:n] = np.nan
        exporter.write([make_record("loss", s, x, wall_time=100.0 + s)])
    exporter.close()
    points = metric_points(reader)
    key = (("sowtel.mode", "primal"), ("sowtel.name", "loss"), ("sowtel.nonfinite_kind", "nan"))
    assert points["sowtel.nonfinite_elements"][key] == sum(nans)
    assert points["sowtel.records.exported"][key[:2]] == len(nans)
    assert points["sowtel.nan"][key[:2]] == nans[-1]
    assert [sp.attributes["sowtel.step"] for sp in spans.get_finished_spans()] == [0, 1, 2, 3, 4]


def test_a_step_beyond_the_event_limit_is_split_into_spans_of_one_trace():
    tracer_provider, spans, meter_provider, reader = sdk_providers(max_events=4)
    exporter = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
    xs = [np.full((2,), i, np.float32) for i in range(10)]
    exporter.write([make_record(f"site{i}", 7, x, wall_time=50.0 + i, seq=i)
                    for i, x in enumerate(xs)])
    exporter.close()
    parts = sorted(spans.get_finished_spans(), key=lambda sp: sp.attributes["sowtel.part"])
    assert [sp.attributes["sowtel.part"] for sp in parts] == [0, 1, 2]
    assert [len(sp.events) for sp in parts] == [4, 4, 2]
    assert [sp.attributes["sowtel.record_count"] for sp in parts] == [4, 4, 2]
    assert all(sp.attributes["sowtel.step"] == 7 for sp in parts)
    assert {sp.context.trace_id for sp in parts} == {parts[0].context.trace_id}
    assert parts[0].parent is None
    assert all(sp.parent.span_id == parts[0].context.span_id for sp in parts[1:])
    names = [e.attributes["sowtel.name"] for sp in parts for e in sp.events]
    assert names == [f"site{i}" for i in range(10)]
    assert all(sp.dropped_events == 0 for sp in parts)
    assert metric_points(reader)["sowtel.span_events.dropped"] == {(): 0}


def test_events_the_sdk_drops_anyway_are_counted():
    # A split size above the provider's real limit: the SDK drops, sowtel counts.
    tracer_provider, spans, meter_provider, reader = sdk_providers(max_events=3)
    exporter = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider,
                            max_events_per_span=5)
    exporter.write([make_record(f"s{i}", 0, np.ones(2, np.float32), wall_time=1.0 + i)
                    for i in range(5)])
    exporter.flush()
    [span] = spans.get_finished_spans()
    assert span.dropped_events == 2
    assert exporter.errors["span_events_dropped"] == 2
    assert metric_points(reader)["sowtel.span_events.dropped"] == {(): 2}
    exporter.close()


def test_late_records_join_their_steps_trace():
    tracer_provider, spans, meter_provider, _ = sdk_providers()
    exporter = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
    one = np.ones(3, np.float32)
    exporter.write([make_record("a", 0, one, wall_time=1.0)])
    exporter.write([make_record("a", 1, one, wall_time=2.0)])
    exporter.write([make_record("b", 0, one, wall_time=1.5)])  # step 0 already ended
    exporter.close()
    by_step: dict[int, list] = {}
    for sp in spans.get_finished_spans():
        by_step.setdefault(sp.attributes["sowtel.step"], []).append(sp)
    first, late = sorted(by_step[0], key=lambda sp: sp.attributes["sowtel.part"])
    assert (first.attributes["sowtel.part"], late.attributes["sowtel.part"]) == (0, 1)
    assert late.context.trace_id == first.context.trace_id
    assert late.parent.span_id == first.context.span_id
    assert [e.attributes["sowtel.name"] for e in late.events] == ["b"]
    assert len(by_step[1]) == 1 and by_step[1][0].context.trace_id != first.context.trace_id


def test_without_providers_it_creates_sdk_ones_with_service_name_and_process_index(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    exporter = OTelExporter(span_processors=[SimpleSpanProcessor(spans)],
                            metric_readers=[reader])
    assert isinstance(exporter.tracer_provider, TracerProvider)
    assert isinstance(exporter.meter_provider, MeterProvider)
    exporter.write([make_record("h", 0, np.ones(2, np.float32))])
    exporter.flush()
    resource = reader.get_metrics_data().resource_metrics[0].resource.attributes
    exporter.close()
    [span] = spans.get_finished_spans()
    for attrs in (span.resource.attributes, resource):
        assert attrs["service.name"] == "sowtel"
        assert attrs["sowtel.process_index"] == jax.process_index()
        assert attrs["sowtel.process_count"] == jax.process_count()
    assert span.attributes["sowtel.process_index"] == jax.process_index()
    # OTEL_SERVICE_NAME is honoured when no name is given; an explicit name wins.
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    for kwargs, want in (({}, "from-env"), ({"service_name": "trainer-7"}, "trainer-7")):
        spans = InMemorySpanExporter()
        e = OTelExporter(span_processors=[SimpleSpanProcessor(spans)], **kwargs)
        e.write([make_record("h", 0, np.ones(2, np.float32))])
        e.close()
        assert spans.get_finished_spans()[0].resource.attributes["service.name"] == want


def test_registered_under_otel_and_streams_a_jitted_mlp():
    tracer_provider, spans, meter_provider, reader = sdk_providers()
    memory = MemoryExporter()
    params, x = mlp_params(), mlp_batch()
    with sowtel.enable(exporter=["otel", memory], tracer_provider=tracer_provider,
                       meter_provider=meter_provider) as session:
        for step in range(3):
            mlp_grad(params, x, step)
        assert sowtel.flush()
        assert session.status()["exported"]["otel"] == 12
    events = [(sp.attributes["sowtel.step"], e) for sp in spans.get_finished_spans()
              for e in sp.events]
    got = sorted((s, e.attributes["sowtel.name"], e.attributes["sowtel.mode"],
                  e.attributes["sowtel.stat.mean"]) for s, e in events)
    want = sorted((r.step, r.name, r.mode, r.stats["mean"]) for r in memory.records)
    assert got == want and len(got) == 12
    h1 = np.tanh(np.asarray(x, np.float64) @ np.asarray(params[0], np.float64))
    step2 = {(e.attributes["sowtel.name"], e.attributes["sowtel.mode"]): e.attributes
             for s, e in events if s == 2}
    assert step2["mlp/h1", "primal"]["sowtel.stat.std"] == pytest.approx(h1.std(), rel=1e-5)
    assert step2["mlp/h1", "primal"]["sowtel.shape"] == (3, 8)
    points = metric_points(reader)
    assert points["sowtel.step"][(("sowtel.mode", "cotangent"), ("sowtel.name", "mlp/out"))] == 2


class _Blocked:
    """An exporter stuck in write() until released: its backlog overflows, and it is counted."""

    label = "blocked"

    def __init__(self) -> None:
        self.release = threading.Event()

    def write(self, records):
        self.release.wait(30)

    def flush(self):
        pass

    def close(self):
        pass


class _Broken:
    label = "broken"

    def write(self, records):
        raise RuntimeError("broken on purpose")

    def flush(self):
        pass

    def close(self):
        pass


def test_dropped_records_and_exporter_errors_are_metrics_read_from_status():
    tracer_provider, _, meter_provider, reader = sdk_providers()
    otel = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
    blocked = _Blocked()
    with sowtel.enable(exporter=[otel, blocked, _Broken()], queue_size=4):
        for step in range(12):
            sowtel.export({"h": {"primal": np.ones(3, np.float32)}}, step=step)
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while sowtel.status()["exported"]["otel"] < 12 and time.monotonic() < deadline:
            time.sleep(0.02)
        status = sowtel.status()
        points = metric_points(reader)
        blocked.release.set()
    assert status["exporter_dropped"]["blocked"] > 0
    dropped = points["sowtel.records.dropped"]
    assert dropped[(("sowtel.exporter", "blocked"), ("sowtel.stage", "exporter"))] == (
        status["exporter_dropped"]["blocked"])
    assert dropped[(("sowtel.stage", "queue"),)] == status["dropped"]
    errors = points["sowtel.exporter.errors"]
    assert errors[(("sowtel.exporter", "broken"),)] == status["errors"]["broken"] > 0
    assert errors[(("sowtel.exporter", "otel"),)] == 0


# -- bad options --------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"tracer_provider": MeterProvider()}, TypeError,
     r"tracer_provider=.*MeterProvider.* is not an opentelemetry\.trace\.TracerProvider"),
    ({"meter_provider": TracerProvider()}, TypeError,
     r"meter_provider=.*TracerProvider.* is not an opentelemetry\.metrics\.MeterProvider"),
    ({"tracer_provider": "otlp"}, TypeError, r"tracer_provider='otlp' is not"),
    ({"service_name": ""}, ValueError, r"service_name='' is not a valid service name"),
    ({"service_name": " padded"}, ValueError, r"without leading or trailing whitespace"),
    ({"service_name": "two\nlines"}, ValueError, r"printable characters"),
    ({"service_name": "x" * 256}, ValueError, r"1 to 255"),
    ({"service_name": 7}, TypeError, r"service_name=7 is a int, not a str"),
    ({"otlp_protocol": "udp"}, ValueError, r"otlp_protocol='udp' .* 'grpc' or 'http/protobuf'"),
    ({"otlp_endpoint": "127.0.0.1:4317"}, ValueError, r"is not an http\(s\) URL"),
    ({"prometheus": "9464"}, ValueError, r"prometheus='9464' is not a 'host:port'"),
    ({"timeout_s": 0}, ValueError, r"timeout_s=0 must be a positive number"),
    ({"metrics_interval_s": float("nan")}, ValueError, r"metrics_interval_s=nan"),
    ({"max_events_per_span": 0}, ValueError, r"max_events_per_span=0 must be a positive int"),
    ({"span_processors": [object()]}, TypeError, r"span_processors=.* holds .* not a"),
    ({"metric_readers": "prometheus"}, TypeError, r"metric_readers='prometheus' must be a list"),
    ({"tracer_provider": TracerProvider(), "otlp_endpoint": "http://127.0.0.1:4317"},
     ValueError, r"cannot be combined with tracer_provider="),
])
def test_bad_options_fail_at_enable_with_a_clear_error(options, error, match):
    with pytest.raises(error, match=match):
        sowtel.enable(exporter="otel", **options)
    assert sowtel.status()["enabled"] is False


# -- OTLP over the wire ---------------------------------------------------------------------


def any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(any_value(e) for e in v.array_value.values)
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


class Receiver:
    """What an OTLP receiver decoded: spans with their events, and metric data points."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.requests = 0

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        with self.lock:
            return [(attributes(rs.resource.attributes), span) for req in self.traces
                    for rs in req.resource_spans for ss in rs.scope_spans for span in ss.spans]

    def last_points(self, name: str) -> dict[tuple, float]:
        out: dict[tuple, float] = {}
        with self.lock:
            for req in self.metrics:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            if m.name != name:
                                continue
                            data = getattr(m, m.WhichOneof("data"))
                            for p in data.data_points:
                                value = p.as_double if p.HasField("as_double") else p.as_int
                                out[tuple(sorted(attributes(p.attributes).items()))] = value
        return out


class _HttpHandler(BaseHTTPRequestHandler):
    receiver: Receiver
    behaviour: str

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.receiver.requests += 1
        if self.behaviour == "unavailable":
            self.send_response(503)
            self.end_headers()
            return
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            with self.receiver.lock:
                self.receiver.traces.append(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/metrics":
            request = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
            with self.receiver.lock:
                self.receiver.metrics.append(request)
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


class _Service:
    """An OTLP gRPC service that keeps what it receives in ``receiver.<store>``."""

    store: str
    response: Any

    def __init__(self, receiver: Receiver, behaviour: str) -> None:
        self.receiver, self.behaviour = receiver, behaviour

    def Export(self, request, context):  # noqa: N802 (the service's naming)
        self.receiver.requests += 1
        if self.behaviour == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "receiver refusing on purpose")
        with self.receiver.lock:
            getattr(self.receiver, self.store).append(request)
        return self.response()


class _TraceService(_Service, trace_service_pb2_grpc.TraceServiceServicer):
    store, response = "traces", trace_service_pb2.ExportTraceServiceResponse


class _MetricsService(_Service, metrics_service_pb2_grpc.MetricsServiceServicer):
    store, response = "metrics", metrics_service_pb2.ExportMetricsServiceResponse


def serve_otlp(protocol: str, behaviour: str = "ok") -> tuple[str, Receiver, Any]:
    """Starts a receiver on 127.0.0.1; returns its endpoint, what it got, and a stop function.

    ``behaviour``: ``"ok"``, ``"unavailable"`` (answers 503 / UNAVAILABLE), ``"hang"`` (accepts
    connections and never answers) or ``"down"`` (nothing listens: connections are refused).
    """
    receiver = Receiver()
    if behaviour in ("hang", "down"):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        if behaviour == "hang":
            sock.listen(64)
            return f"http://127.0.0.1:{port}", receiver, sock.close
        sock.close()
        return f"http://127.0.0.1:{port}", receiver, lambda: None
    if protocol == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(receiver, behaviour), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsService(receiver, behaviour), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return f"http://127.0.0.1:{port}", receiver, lambda: server.stop(grace=None).wait()
    handler = type("Handler", (_HttpHandler,), {"receiver": receiver, "behaviour": behaviour})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    return f"http://127.0.0.1:{httpd.server_address[1]}", receiver, stop


def mlp_params() -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return jax.random.normal(k1, (4, 8)), jax.random.normal(k2, (8, 2)) * 0.5


def mlp_batch() -> jax.Array:
    return jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def mlp_loss(params, x, step):
    w1, w2 = params
    with sowtel.at_step(step):
        h = sowtel.sow(jnp.tanh(x @ w1), "mlp/h1")
        out = sowtel.sow(h @ w2, "mlp/out")
    return jnp.mean(out ** 2)


mlp_grad = jax.jit(jax.grad(mlp_loss))


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_receiver_decodes_the_expected_spans_events_and_metrics(protocol):
    endpoint, receiver, stop = serve_otlp(protocol)
    try:
        # What is checked is what arrives, not how long it may take: on a loaded machine one
        # OTLP request can outlast the default bound (2 s), which other tests check.
        otel = OTelExporter(otlp_endpoint=endpoint, otlp_protocol=protocol,
                            service_name="mlp-trainer", timeout_s=30.0)
        memory = MemoryExporter()
        params, x = mlp_params(), mlp_batch()
        with sowtel.enable(exporter=[otel, memory]):
            for step in range(4):
                mlp_grad(params, x, step)
        # On a loaded machine disable() may return while the exporter's close() is still
        # exporting (it bounds each exporter's close by exporter_timeout): the receiver stays
        # up until the last spans and metrics arrived.
        last = {(r.name, r.mode) for r in memory.records if r.step == 3}
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline and not (
                len(receiver.spans()) >= 4 and sorted(receiver.last_points(
                    COUNTER_NAMES["exported"]).values()) == [4] * len(last)):
            time.sleep(0.2)
        assert otel.errors == {}
    finally:
        stop()
    spans = receiver.spans()
    assert sorted(span.name for _, span in spans) == [SPAN_NAME] * 4
    for resource, _ in spans:
        assert resource["service.name"] == "mlp-trainer"
        assert resource["sowtel.process_index"] == jax.process_index()
    steps = {attributes(span.attributes)["sowtel.step"]: span for _, span in spans}
    assert sorted(steps) == [0, 1, 2, 3]
    for step, span in steps.items():
        want = sorted((r.name, r.mode, r.seq) for r in memory.records if r.step == step)
        got = [attributes(e.attributes) for e in span.events]
        assert all(e.name == EVENT_NAME for e in span.events)
        assert sorted((a["sowtel.name"], a["sowtel.mode"]) for a in got) == [
            (n, m) for n, m, _ in want]
        for a in got:
            [r] = [r for r in memory.records
                   if (r.step, r.name, r.mode) == (step, a["sowtel.name"], a["sowtel.mode"])]
            assert a["sowtel.shape"] == r.shape and a["sowtel.dtype"] == r.dtype
            for stat in STAT_KEYS:
                assert a[f"sowtel.stat.{stat}"] == pytest.approx(r.stats[stat], rel=1e-12)
        assert span.start_time_unix_nano == min(e.time_unix_nano for e in span.events)
    h1 = np.tanh(np.asarray(x, np.float64) @ np.asarray(params[0], np.float64))
    event = next(attributes(e.attributes) for e in steps[3].events
                 if attributes(e.attributes)["sowtel.name"] == "mlp/h1")
    assert event["sowtel.stat.l2"] == pytest.approx(np.linalg.norm(h1), rel=1e-5)
    # Metrics: the last export holds each site's latest statistics.
    last = {(r.name, r.mode): r for r in memory.records if r.step == 3}
    for stat in ("mean", "std", "l2", "min", "max"):
        points = receiver.last_points(GAUGE_NAMES[stat])
        assert points == {
            (("sowtel.mode", mode), ("sowtel.name", name)): pytest.approx(r.stats[stat])
            for (name, mode), r in last.items()
        }
    exported = receiver.last_points(COUNTER_NAMES["exported"])
    assert sorted(exported.values()) == [4] * len(last)


@pytest.fixture(scope="module")
def reference_grads() -> list[Any]:
    params, x = mlp_params(), mlp_batch()
    return [mlp_grad(params, x, step) for step in range(3)]


@pytest.mark.parametrize(("protocol", "behaviour"), [
    ("grpc", "down"), ("http/protobuf", "unavailable"), ("http/protobuf", "hang"),
    ("grpc", "hang"),
])
def test_an_unreachable_endpoint_leaves_training_alone_and_disable_is_bounded(
        protocol, behaviour, reference_grads):
    endpoint, receiver, stop = serve_otlp(protocol, behaviour)
    params, x = mlp_params(), mlp_batch()
    try:
        otel = OTelExporter(otlp_endpoint=endpoint, otlp_protocol=protocol,
                            metrics_interval_s=0.5)
        memory = MemoryExporter()
        sowtel.enable(exporter=[otel, memory])
        grads = []
        for step in range(3):
            grads.append(mlp_grad(params, x, step))
            time.sleep(0.3)  # let the SDK's schedules try, and fail, to export
        for got, want in zip(grads, reference_grads, strict=True):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        status = sowtel.status()
        start = time.monotonic()
        sowtel.disable()
        elapsed = time.monotonic() - start
    finally:
        stop()
    assert elapsed <= 5.0, f"disable() took {elapsed:.2f} s"
    assert len(memory.records) == 12  # the other exporter got everything
    assert status["errors"]["otel"] == 0  # the OTel exporter never raised into the dispatcher
    errors = otel.errors
    assert sum(errors.values()) > 0, errors
    assert set(errors) <= {"export_failures.traces", "export_failures.metrics",
                           "flush_timeouts"}
    if behaviour == "unavailable":
        assert receiver.requests > 0 and errors.get("export_failures.traces", 0) > 0


# -- threads --------------------------------------------------------------------------------


def _otel_threads(old: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    # sowtel's own thread, and the SDK's (batch span processor, periodic metric reader),
    # started since the threads ``old``.
    return [t for t in threading.enumerate()
            if t.name.startswith(("sowtel-otel", "Otel")) and t not in old]


def _wait_for_no_otel_threads(seconds: float,
                              old: frozenset[threading.Thread] = frozenset()) -> list[str]:
    deadline = time.monotonic() + seconds
    while _otel_threads(old) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [t.name for t in _otel_threads(old)]


def test_sessions_leave_no_exporter_thread_behind():
    old = frozenset(threading.enumerate())
    for step in range(20):
        tracer_provider, spans, meter_provider, _ = sdk_providers()
        otel = OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)
        with sowtel.enable(exporter=otel):
            sowtel.log({"loss": 1.0}, step=step)
        assert len(spans.get_finished_spans()) == 1  # the session did export
    # A thread per session would be 20 here; they end with their exporter's close().
    assert _wait_for_no_otel_threads(10.0, old) == []


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_disable_against_a_black_holed_endpoint_is_quick_and_leaves_no_thread(protocol):
    endpoint, _, stop = serve_otlp(protocol, "hang")  # accepts connections, never answers
    old = frozenset(threading.enumerate())
    try:
        otel = OTelExporter(otlp_endpoint=endpoint, otlp_protocol=protocol)
        sowtel.enable(exporter=otel)
        for step in range(3):
            sowtel.log({"loss": float(step)}, step=step)
        # The first export runs into the endpoint's silence: waited for, not timed (each
        # request is bounded by timeout_s, 2 s).
        deadline = time.monotonic() + 60.0
        while not otel.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert otel.errors
        start = time.monotonic()
        final = sowtel.disable()
        elapsed = time.monotonic() - start
        # Known to fail, the exporter interrupts its exports instead of waiting timeout_s
        # (2 s) for a shutdown that cannot succeed.
        assert elapsed < 1.0, f"disable() took {elapsed:.2f} s"
        assert final["accounts"]["otel"]["pending"] == 0
        # Every thread ends once the request in flight gives up (timeout_s).
        assert _wait_for_no_otel_threads(30.0, old) == []
    finally:
        stop()
