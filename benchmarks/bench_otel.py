"""What the OpenTelemetry exporter costs: records per second, and a training step's ratio.

Two measurements, as numbers taken side by side in this one process:

1. **Throughput**: records per second through ``OTelExporter.write`` (batches of 64 records of
   12 sites, as the dispatcher hands them over), then ``flush``, with the SDK's
   ``BatchSpanProcessor``; spans go to (a) an exporter that discards them, so the number is
   sowtel's and the SDK's own work, and (b) the SDK's OTLP/gRPC exporter sending to a receiver
   on 127.0.0.1 (opentelemetry-proto's ``TraceService``), so it includes protobuf encoding and
   the wire. The memory exporter's throughput is the floor for comparison.
2. **Training step** of the small-MLP reference workload (:func:`benchmarks.workloads.mlp`),
   streaming ``stats`` every step through the OTel exporter, against the same step streaming to
   the memory exporter and against the step without sows; interleaved rounds, ratios are
   medians of per-round ratios. The dispatcher runs exporters on their own threads, so the
   OTel exporter's work shows up in the step only through the GIL; "+ drain" adds the time to
   flush what the round left behind.

Run: ``python -m benchmarks.bench_otel [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_otel
    >>> tables = bench_otel.run(quick=True)  # doctest: +SKIP
    >>> print(tables[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
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
from sowtel.exporters.memory import MemoryExporter
from sowtel.exporters.otel import OTelExporter
from sowtel.records import Record
from sowtel.summaries import host_summary

__all__ = ["run", "main", "tables", "throughput", "training_step"]

SITES = 12  # the MLP workload: 6 sites, primal and cotangent
BATCH = 64


def _discarding_providers(span_exporter: Any = None) -> tuple[Any, Any]:
    """SDK providers with a batch span processor and a periodic metric reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DiscardSpans(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class DiscardMetrics(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 10_000,
                   **kwargs: Any) -> MetricExportResult:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter or DiscardSpans()))
    reader = PeriodicExportingMetricReader(DiscardMetrics(), export_interval_millis=1000)
    return tracer_provider, MeterProvider(metric_readers=[reader])


def _grpc_receiver(stack: ExitStack) -> str:
    """An OTLP/gRPC trace and metrics receiver on 127.0.0.1 that decodes and drops requests."""
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import (
        metrics_service_pb2,
        metrics_service_pb2_grpc,
    )
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (service naming)
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (service naming)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stack.callback(lambda: server.stop(grace=None).wait())
    return f"http://127.0.0.1:{port}"


def _records(steps: int) -> list[Record]:
    """``steps`` steps of the MLP's 12 records, with real ``stats`` summaries."""
    rng = np.random.default_rng(0)
    summaries = [host_summary(rng.normal(size=(256, 512)).astype(np.float32), "stats")["stats"]
                 for _ in range(SITES)]
    names = [(f"dense{i // 2}/{'pre' if i % 2 == 0 else 'act'}", mode)
             for mode in ("primal", "cotangent") for i in range(SITES // 2)]
    out = []
    t0 = time.time()
    for step in range(steps):
        for k, (name, mode) in enumerate(names):
            out.append(Record(name=name, mode=mode, tag="intermediates", step=step, index=None,
                              wall_time=t0 + step * 1e-3 + k * 1e-5, summary="stats",
                              shape=(256, 512), dtype="float32", stats=summaries[k],
                              seq=step * SITES + k))
    return out


def _one_run(make: Callable[[], Any], records: list[Record]) -> float:
    """Records per second of one fresh exporter: every record through write(), then flush()."""
    exporter = make()
    t0 = time.perf_counter()
    for start in range(0, len(records), BATCH):
        exporter.write(records[start:start + BATCH])
    exporter.flush()
    rate = len(records) / (time.perf_counter() - t0)
    exporter.close()
    return rate


class _SdkAlone:
    """The floor: the same spans and events straight through the SDK, attributes prebuilt."""

    def __init__(self, records: list[Record]) -> None:
        probe = OTelExporter(tracer_provider=_discarding_providers()[0])
        self.events = [(r.step, int(r.wall_time * 1e9), probe._event_attributes(r, r.stats))
                       for r in records]
        probe.close()

    def run(self) -> float:
        from opentelemetry.context import Context

        tracer_provider, _ = _discarding_providers()
        tracer = tracer_provider.get_tracer("floor")
        t0 = time.perf_counter()
        for start in range(0, len(self.events), SITES):
            step_events = self.events[start:start + SITES]
            span = tracer.start_span("sowtel.step", context=Context(),
                                     attributes={"sowtel.step": step_events[0][0]},
                                     start_time=step_events[0][1])
            for _, t_ns, attrs in step_events:
                span.add_event("sowtel.record", attributes=attrs, timestamp=t_ns)
            span.end(end_time=step_events[-1][1])
        tracer_provider.force_flush()
        rate = len(self.events) / (time.perf_counter() - t0)
        tracer_provider.shutdown()
        return rate


def throughput(quick: bool = False) -> Table:
    """Records per second through ``write`` + ``flush`` of each exporter configuration."""
    records = _records(200 if quick else 1000)
    rounds = 3 if quick else 9
    floor_name = "the SDK alone (span per step, add_event per record)"
    table = Table(
        "OpenTelemetry exporter throughput (write + flush)",
        ["exporter", "records/s", "per record", f"time vs {floor_name.split(' (')[0]}"],
    )
    with ExitStack() as stack:
        endpoint = _grpc_receiver(stack)

        def otlp_grpc() -> OTelExporter:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            tracer_provider, meter_provider = _discarding_providers(
                OTLPSpanExporter(endpoint=endpoint, insecure=True))
            return OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)

        def discard() -> OTelExporter:
            tracer_provider, meter_provider = _discarding_providers()
            return OTelExporter(tracer_provider=tracer_provider, meter_provider=meter_provider)

        floor = _SdkAlone(records)
        variants: dict[str, Callable[[], float]] = {
            "memory": lambda: _one_run(MemoryExporter, records),
            floor_name: floor.run,
            "otel, batch span processor, spans discarded": lambda: _one_run(discard, records),
            "otel, batch span processor, OTLP/gRPC to 127.0.0.1":
                lambda: _one_run(otlp_grpc, records),
        }
        names = list(variants)
        rates: dict[str, list[float]] = {n: [] for n in names}
        # Interleaved rounds, rotating the order, so a busy moment of the machine hits all.
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rates[name].append(variants[name]())
    for name in names:
        rate = statistics.median(rates[name])
        ratio = statistics.median(f / x for f, x in zip(rates[floor_name], rates[name],
                                                          strict=True))
        table.add(name, f"{rate:,.0f}", fmt_time(1.0 / rate), fmt_ratio(ratio))
    table.notes.append(
        f"{len(records)} records ({len(records) // SITES} steps of {SITES} sites) in batches of "
        f"{BATCH}; {rounds} interleaved rounds, each exporter fresh with fresh providers; "
        "medians over rounds (the ratio: of per-round time ratios). The time includes flush(), "
        "which ends the last span and force-flushes the SDK.")
    return table


def training_step(quick: bool = False) -> Table:
    """The MLP step streaming ``stats`` through OTel, against memory and against no sows."""

    def exporters(stack: ExitStack) -> dict[str, Callable[[], Any]]:
        tracer_provider, meter_provider = _discarding_providers()
        endpoint = _grpc_receiver(stack)
        return {
            "otel exporter (spans discarded)": lambda: OTelExporter(
                tracer_provider=tracer_provider, meter_provider=meter_provider),
            "otel exporter (OTLP/gRPC to 127.0.0.1)": lambda: OTelExporter(
                otlp_endpoint=endpoint, metrics_interval_s=1.0),
        }

    return exporter_training_table("OTel", exporters, quick)



def tables(quick: bool = False) -> Iterator[Table]:
    """Runs both measurements, yielding each table as soon as it is measured."""
    yield throughput(quick)
    yield training_step(quick)


def run(quick: bool = False) -> list[Table]:
    """Runs both measurements; returns their tables."""
    return list(tables(quick))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_otel [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_otel", __doc__, lambda args: tables(args.quick))


if __name__ == "__main__":
    sys.exit(main())
