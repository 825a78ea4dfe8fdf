"""OpenTelemetry exporter: a span per step, a span event per record, metrics per site.

Every training step becomes one span named ``sowtel.step``; every record of that step becomes a
span event ``sowtel.record`` on it, carrying the site's name, mode, tag, index, shape, dtype and
statistics as attributes. The latest statistics of each site are also metrics (one gauge per
statistic), next to counters of non-finite elements, records exported and records dropped. Where
the spans and metrics go (OTLP, Prometheus, a console, memory) is OpenTelemetry configuration:
the exporter uses the providers it is given, else the global ones, else providers of its own.

Example:
    >>> from opentelemetry.sdk.trace import TracerProvider
    >>> from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    >>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    >>> from sowtel.records import Record
    >>> spans = InMemorySpanExporter()
    >>> provider = TracerProvider()
    >>> provider.add_span_processor(SimpleSpanProcessor(spans))
    >>> exporter = OTelExporter(tracer_provider=provider)
    >>> exporter.write([Record(name="h", mode="primal", tag="intermediates", step=3, index=None,
    ...                        wall_time=1.0, summary="stats", shape=(2,), dtype="float32",
    ...                        stats={"size": 2.0, "mean": 0.5})])
    >>> exporter.close()
    >>> [span] = spans.get_finished_spans()
    >>> span.name, span.attributes["sowtel.step"], span.events[0].attributes["sowtel.stat.mean"]
    ('sowtel.step', 3, 0.5)

With ``sowtel.enable`` the same options are keywords: ``sowtel.enable(exporter="otel",
otlp_endpoint="http://127.0.0.1:4317")`` sends both signals over OTLP/gRPC, and
``sowtel.enable(exporter="otel", prometheus="127.0.0.1:9464")`` serves the metrics for
Prometheus to scrape.
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from sowtel import errors
from sowtel.exporters.otel._metrics import (
    COUNT_STATS,
    COUNTER_NAMES,
    GAUGE_NAMES,
    NONFINITE_KINDS,
    SCOPE_NAME,
    SeriesState,
    flush_push_readers,
    hub_for,
    sowtel_version,
)
from sowtel.exporters.otel._providers import (
    TROUBLE_BACKOFF_S,
    CountingMetricExporter,
    CountingSpanExporter,
    Runner,
    check_items,
    check_positive,
    check_prometheus,
    check_service_name,
    is_api_default,
    process_index_and_count,
)
from sowtel.records import SCALAR_SUMMARY, STAT_KEYS, Record, nonfinite_count
from sowtel.to_records import RecordBatch, SiteColumns

__all__ = [
    "OTelExporter",
    "SPAN_NAME",
    "EVENT_NAME",
    "ALERT_EVENT_NAME",
    "RULE_ALERT_EVENT_NAME",
    "GAUGE_NAMES",
    "COUNTER_NAMES",
    "DEFAULT_TIMEOUT_S",
]

_log = logging.getLogger(__name__)

#: Name of the span of one step.
SPAN_NAME = "sowtel.step"
#: Name of the span event of one record.
EVENT_NAME = "sowtel.record"
#: Name of the span event raised once, at the first record with NaN or infinite elements.
ALERT_EVENT_NAME = "sowtel.nonfinite"
#: Name of the span event of an alert of an ``enable(alerts=...)`` rule (:mod:`sowtel.alerts`),
#: on its step's span: attributes ``sowtel.name``, ``sowtel.mode``, ``sowtel.step``,
#: ``sowtel.alert.stat``, ``.value``, ``.kind``, ``.rule``, ``.text`` (and ``sowtel.index``).
RULE_ALERT_EVENT_NAME = "sowtel.alert"


#: Default bound, in seconds, on each of ``flush()`` and ``close()``.
DEFAULT_TIMEOUT_S = 2.0

#: On a span event that holds the records of several positions of one site (a ``sowtel.jit``
#: table): how many; its ``sowtel.index`` and ``sowtel.stat.*`` attributes are then lists,
#: except the statistics the same at every position (``size``, ``nan``, ``posinf``, ``neginf``).
RECORDS_ATTR = "sowtel.records"
_STAT_ATTR = {stat: f"sowtel.stat.{stat}" for stat in STAT_KEYS}
# Statistics a table's event holds as one int, not a list (the same at every position).
_CONSTANT_IN_TABLES = frozenset({"size", *NONFINITE_KINDS})
# How many steps remember their last span part, so late records continue the numbering.
_REMEMBERED_STEPS = 1024


def _plain_index(index: Any) -> int | list[int] | None:
    if index is None:
        return None
    if isinstance(index, (tuple, list)):
        return [int(i) for i in index]
    return int(index)


def _plain_stat(stat: str, value: Any) -> float | int:
    v = float(value)
    return int(v) if stat in COUNT_STATS and math.isfinite(v) else v


class _PendingEvent(NamedTuple):
    """A record's span event, waiting for its step's span."""

    wall_time: float
    seq: int
    attributes: dict[str, Any]
    name: str = EVENT_NAME


class OTelExporter:
    """Sends records to OpenTelemetry: a span per step, an event per record, metrics per site.

    Args:
      tracer_provider: an ``opentelemetry.trace.TracerProvider`` to create spans with. ``None``:
        the global one if an SDK is installed there, else one of the exporter's own.
      meter_provider: an ``opentelemetry.metrics.MeterProvider`` for the metrics, chosen the
        same way.
      service_name: ``service.name`` of the providers the exporter creates (default:
        ``$OTEL_SERVICE_NAME``, else ``"sowtel"``). Their resource also carries
        ``process.index`` and ``process.count`` (JAX's process index and count, also as
        ``sowtel.process_index`` and ``sowtel.process_count``) and whatever
        ``$OTEL_RESOURCE_ATTRIBUTES`` adds.
      otlp_endpoint: base URL of an OTLP receiver (``http://127.0.0.1:4317`` for gRPC,
        ``http://127.0.0.1:4318`` for HTTP); spans and metrics are sent there.
      otlp_protocol: ``"grpc"`` or ``"http/protobuf"``.
      prometheus: ``"host:port"`` to serve the metrics at ``http://host:port/metrics`` for
        Prometheus to scrape (port 0 picks a free port; see :attr:`prometheus_url`).
      span_processors, metric_readers: more span processors and metric readers for the
        providers the exporter creates (any exporter of the OpenTelemetry ecosystem).
      metrics_interval_s: how often the OTLP metric reader exports.
      timeout_s: bound on each of :meth:`flush` and :meth:`close` (and on one OTLP request),
        so ``sowtel.disable()`` returns within seconds even if the endpoint is down or hangs.
      max_events_per_span: split a step into spans of at most this many events (default: the
        tracer provider's event limit, 128 unless configured).

    ``otlp_endpoint``, ``prometheus``, ``span_processors`` and ``metric_readers`` configure
    providers the exporter creates; they cannot be combined with a provider passed in.

    Example:
      >>> from opentelemetry.sdk.metrics import MeterProvider
      >>> from opentelemetry.sdk.metrics.export import InMemoryMetricReader
      >>> reader = InMemoryMetricReader()
      >>> exporter = OTelExporter(meter_provider=MeterProvider(metric_readers=[reader]))
      >>> exporter.write([Record(name="w", mode="cotangent", tag="intermediates", step=0,
      ...                        index=None, wall_time=1.0, summary="health", shape=(4,),
      ...                        dtype="float32", stats={"size": 4.0, "nan": 1.0,
      ...                                                "posinf": 0.0, "neginf": 0.0})])
      >>> points = {m.name: m.data.data_points[0]
      ...           for rm in reader.get_metrics_data().resource_metrics
      ...           for sm in rm.scope_metrics for m in sm.metrics}
      >>> points["sowtel.nan"].value, dict(points["sowtel.nan"].attributes)
      (1.0, {'sowtel.name': 'w', 'sowtel.mode': 'cotangent'})
      >>> exporter.close()
    """

    #: How ``sowtel.status()`` names this exporter.
    label = "otel"

    def __init__(
        self,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        service_name: str | None = None,
        *,
        otlp_endpoint: str | None = None,
        otlp_protocol: str = "grpc",
        prometheus: str | None = None,
        span_processors: Sequence[SpanProcessor] = (),
        metric_readers: Sequence[MetricReader] = (),
        metrics_interval_s: float = 10.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_events_per_span: int | None = None,
    ) -> None:
        if tracer_provider is not None and not isinstance(
            tracer_provider, trace_api.TracerProvider
        ):
            raise errors.BadOptionTypeError(
                "tracer_provider", tracer_provider, "is not an opentelemetry.trace."
                "TracerProvider: pass opentelemetry.sdk.trace.TracerProvider(...), or None to "
                "use the global one")
        if meter_provider is not None and not isinstance(
            meter_provider, metrics_api.MeterProvider
        ):
            raise errors.BadOptionTypeError(
                "meter_provider", meter_provider, "is not an opentelemetry.metrics."
                "MeterProvider: pass opentelemetry.sdk.metrics.MeterProvider(...), or None to "
                "use the global one")
        self._service_name = check_service_name(service_name)
        if otlp_protocol not in ("grpc", "http/protobuf"):
            raise errors.BadOptionError(
                "otlp_protocol", otlp_protocol, "is not an OTLP protocol: use 'grpc' or "
                "'http/protobuf'")
        if otlp_endpoint is not None and (
            not isinstance(otlp_endpoint, str)
            or not otlp_endpoint.startswith(("http://", "https://"))
        ):
            raise errors.BadOptionError(
                "otlp_endpoint", otlp_endpoint, "is not an http(s) URL: use, for example, "
                "'http://127.0.0.1:4317' (gRPC) or 'http://127.0.0.1:4318' (http/protobuf)")
        prometheus_address = check_prometheus(prometheus)
        processors = check_items(span_processors, SpanProcessor, "span_processors")
        readers = check_items(metric_readers, MetricReader, "metric_readers")
        self._timeout_s = check_positive(timeout_s, "timeout_s")
        interval_s = check_positive(metrics_interval_s, "metrics_interval_s")
        if max_events_per_span is not None and (
            isinstance(max_events_per_span, bool)
            or not isinstance(max_events_per_span, int)
            or max_events_per_span < 1
        ):
            raise errors.BadOptionError(
                "max_events_per_span", max_events_per_span, "must be a positive int, or None "
                "for the tracer provider's event limit")
        configures_own = bool(otlp_endpoint or prometheus_address or processors or readers)
        if configures_own and (tracer_provider is not None or meter_provider is not None):
            own = "tracer_provider" if tracer_provider is not None else "meter_provider"
            raise errors.BadOptionError(
                own, tracer_provider if tracer_provider is not None else meter_provider,
                "cannot be combined with otlp_endpoint, prometheus, span_processors or "
                "metric_readers: those configure the providers sowtel creates, so they cannot "
                "be combined with tracer_provider= or meter_provider=; add the exporter or "
                "reader to your own provider instead")

        self._process_index, process_count = process_index_and_count()
        self._errors: collections.Counter[str] = collections.Counter()
        self._state = SeriesState()
        self._counted_exporters: list[CountingSpanExporter | CountingMetricExporter] = []
        self._prometheus_server: Any = None
        self._prometheus_thread: Any = None
        self.prometheus_url: str | None = None
        """``http://host:port/metrics`` when the exporter serves metrics, else ``None``."""

        # A provider passed in is used as it is; the global one only if an SDK was installed.
        if tracer_provider is None and not configures_own:
            global_tracer = trace_api.get_tracer_provider()
            if not is_api_default(global_tracer):
                tracer_provider = global_tracer
        if meter_provider is None and not configures_own:
            global_meter = metrics_api.get_meter_provider()
            if not is_api_default(global_meter):
                meter_provider = global_meter
        own_tracer = tracer_provider is None
        own_meter = meter_provider is None
        resource = None
        if own_tracer or own_meter:
            resource = Resource.create({
                "service.name": self._service_name,
                "sowtel.process_index": self._process_index,
                "sowtel.process_count": process_count,
                # The same under the names a collector merging several processes groups by.
                "process.index": self._process_index,
                "process.count": process_count,
            })
        # Before any thread is started: a port in use then leaves nothing running behind.
        prometheus_reader = (self._start_prometheus(*prometheus_address)
                             if own_meter and prometheus_address else None)
        if own_tracer:
            tracer_provider = TracerProvider(resource=resource)
            for processor in processors:
                tracer_provider.add_span_processor(processor)
            if otlp_endpoint:
                span_exporter = CountingSpanExporter(
                    self._otlp_exporter("traces", otlp_endpoint, otlp_protocol), self._count_failure
                )
                self._counted_exporters.append(span_exporter)
                # A short delay keeps a live trace view close to the training loop.
                tracer_provider.add_span_processor(
                    BatchSpanProcessor(
                        span_exporter,
                        schedule_delay_millis=1000,
                        export_timeout_millis=self._timeout_s * 1000,
                    )
                )
        if own_meter:
            if otlp_endpoint:
                metric_exporter = CountingMetricExporter(
                    self._otlp_exporter("metrics", otlp_endpoint, otlp_protocol),
                    self._count_failure,
                )
                self._counted_exporters.append(metric_exporter)
                readers.append(
                    PeriodicExportingMetricReader(
                        metric_exporter,
                        export_interval_millis=interval_s * 1000,
                        export_timeout_millis=self._timeout_s * 1000,
                    )
                )
            if prometheus_reader is not None:
                readers.append(prometheus_reader)
            meter_provider = MeterProvider(metric_readers=readers, resource=resource)
        if own_tracer and own_meter and not configures_own:
            _log.warning(
                "sowtel otel exporter: no OpenTelemetry SDK is configured and no destination was "
                "given, so spans and metrics go nowhere; pass otlp_endpoint=, prometheus=, "
                "span_processors= / metric_readers=, or your own tracer_provider= / "
                "meter_provider="
            )
        self._owns_tracer_provider = own_tracer
        self._owns_meter_provider = own_meter
        self._tracer_provider: Any = tracer_provider
        self._meter_provider: Any = meter_provider
        self._tracer = tracer_provider.get_tracer(SCOPE_NAME, sowtel_version())
        self._event_limit = (
            max_events_per_span
            if max_events_per_span is not None
            else self._provider_event_limit(tracer_provider)
        )
        self._hub = hub_for(meter_provider)
        self._new_logged: set[str] = set()  # logged names whose gauge may not exist yet
        self._hub.add(self._state)

        # Records of the newest step wait here until a later step shows the step is complete.
        self._pending: dict[int, list[_PendingEvent]] = {}
        self._newest_step: int | None = None
        # step -> (spans emitted so far, context of its first span): later parts join its trace.
        self._parts: collections.OrderedDict[int, tuple[int, Context]] = collections.OrderedDict()
        self._trouble_at = -math.inf
        self._alerted = False
        self._attrs_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        # Per table index: the event's sowtel.index list; per site, mode and index: its series.
        self._table_index: dict[tuple[Any, ...], list[Any]] = {}
        self._table_series: dict[tuple[Any, ...], tuple[list[Any], list[dict[str, Any]]]] = {}
        self._event_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._stuck: threading.Event | None = None
        self._runner = Runner("sowtel-otel-flush")
        self._closed = False

    # -- configuration -------------------------------------------------------------------------

    @property
    def tracer_provider(self) -> Any:
        """The tracer provider in use (given, global, or the exporter's own)."""
        return self._tracer_provider

    @property
    def meter_provider(self) -> Any:
        """The meter provider in use (given, global, or the exporter's own)."""
        return self._meter_provider

    @property
    def errors(self) -> dict[str, int]:
        """Counts of what went wrong without stopping training.

        Keys: ``export_failures.traces`` / ``export_failures.metrics`` (failed OTLP exports),
        ``flush_timeouts`` (a flush or close that hit ``timeout_s``), ``bad_records`` (records
        that could not be converted), ``span_events_dropped`` (events beyond the SDK's limit).
        """
        return dict(self._errors)

    def _count_failure(self, signal: str) -> None:
        self._trouble_at = time.monotonic()
        self._errors[f"export_failures.{signal}"] += 1
        with self._state.lock:
            self._state.export_failures[signal] += 1

    def _otlp_exporter(self, signal: str, endpoint: str, protocol: str) -> Any:
        """The OTLP exporter of ``signal`` (``"traces"`` or ``"metrics"``) over ``protocol``."""
        module, name = {"traces": ("trace_exporter", "OTLPSpanExporter"),
                        "metrics": ("metric_exporter", "OTLPMetricExporter")}[signal]
        transport = "grpc" if protocol == "grpc" else "http"
        exporter = getattr(importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{transport}.{module}"), name)
        if transport == "grpc":
            return exporter(endpoint=endpoint, insecure=endpoint.startswith("http://"),
                            timeout=self._timeout_s)
        return exporter(endpoint=f"{endpoint.rstrip('/')}/v1/{signal}", timeout=self._timeout_s)

    def _start_prometheus(self, host: str, port: int) -> MetricReader:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry of its own, so two exporters in one process never share or clash.
        registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(registry=registry)
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise errors.BadOptionError(
                "prometheus", shown, f"cannot be listened on by the metrics server "
                f"({e.strerror or e}; a port is served by one process at a time): choose "
                "another port, or port 0 for a free one (see prometheus_url)") from e
        self._prometheus_server, self._prometheus_thread = server, thread
        shown_host = f"[{host}]" if ":" in host else host
        self.prometheus_url = f"http://{shown_host}:{server.server_port}/metrics"
        return reader

    @staticmethod
    def _provider_event_limit(provider: Any) -> int | None:
        # The SDK keeps its limits private; SpanLimits() reads the same environment variables.
        limits = getattr(provider, "_span_limits", None)
        if not isinstance(limits, SpanLimits):
            limits = SpanLimits()
        return None if limits.max_events is None else max(1, int(limits.max_events))

    # -- Exporter protocol ---------------------------------------------------------------------

    def write(self, records: Sequence[Record]) -> None:
        """Adds records: metrics at once, span events when their step is complete.

        A step's span is ended when a record of a later step arrives, or on :meth:`flush` and
        :meth:`close`; a record that arrives after its step's span ended goes into a further span
        of that step (``sowtel.part`` 1, 2, ...).
        """
        if self._closed or not records:
            return
        accepted: list[tuple[Record, dict[str, float], int]] = []
        for record in records:
            try:
                stats = self._stats(record)
                step = int(record.step)
                event = _PendingEvent(record.wall_time, record.seq,
                                      self._event_attributes(record, stats))
            except Exception as e:
                self._count_error("bad_records", e)
                continue
            self._pending.setdefault(step, []).append(event)
            if self._newest_step is None or step > self._newest_step:
                self._newest_step = step
            accepted.append((record, stats, step))
        with self._state.lock:
            for record, stats, step in accepted:
                self._update_series(record, stats, step)
        while self._new_logged:
            self._hub.log_gauge(self._new_logged.pop())
        newest = self._newest_step
        for step in sorted(self._pending):
            if (newest is not None and step < newest) or self._over_limit(step):
                self._emit(step)

    def write_alerts(self, alerts: Sequence[Any]) -> None:
        """Adds each alert of a :mod:`sowtel.alerts` rule as a span event
        (:data:`RULE_ALERT_EVENT_NAME`) of its step's span, as a record's event is added: its
        step's span ends when a later step's record arrives, or on :meth:`flush`.

        Example:
            >>> from opentelemetry.sdk.trace import TracerProvider
            >>> from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            >>> from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            ...     InMemorySpanExporter)
            >>> from sowtel.alerts import Alert, alert
            >>> spans, provider = InMemorySpanExporter(), TracerProvider()
            >>> provider.add_span_processor(SimpleSpanProcessor(spans))
            >>> otel = OTelExporter(tracer_provider=provider)
            >>> found = Alert(3, "loss", "primal", None, "value", 2.0, "above",
            ...               alert("loss", above=1.0))
            >>> otel.write_alerts([found])
            >>> otel.flush()
            >>> [(e.name, e.attributes["sowtel.alert.kind"])
            ...  for s in spans.get_finished_spans() for e in s.events]
            [('sowtel.alert', 'above')]
            >>> otel.close()
        """
        if self._closed or not alerts:
            return
        for found in alerts:
            try:
                step = int(found.step)
                attrs: dict[str, Any] = {
                    "sowtel.name": str(found.name), "sowtel.mode": str(found.mode),
                    "sowtel.step": step, "sowtel.alert.stat": str(found.stat),
                    "sowtel.alert.value": float(found.value),
                    "sowtel.alert.kind": str(found.kind), "sowtel.alert.rule": str(found.rule),
                    "sowtel.alert.text": str(found)}
                index = _plain_index(found.index)
                if index is not None:
                    attrs["sowtel.index"] = index
            except Exception as e:
                self._count_error("bad_records", e)
                continue
            self._pending.setdefault(step, []).append(
                _PendingEvent(time.time(), -1, attrs, RULE_ALERT_EVENT_NAME))
        newest = self._newest_step
        for step in sorted(self._pending):
            if newest is not None and step < newest:
                self._emit(step)

    def write_batch(self, batch: RecordBatch) -> None:
        """Adds a batch. A table of a ``sowtel.jit`` step (one site and mode, its scan
        iterations and shards) becomes one span event a leaf, whose ``sowtel.index`` and
        ``sowtel.stat.*`` attributes are lists with one entry a position (but ``size`` and
        the non-finite counts, one int each: the same at every position), and
        ``sowtel.records`` says how many; other records (and tables with a NaN or infinity,
        whose alert names the record, or histograms and full values) as :meth:`write` does."""
        if self._closed or not len(batch):
            return
        rest: list[Record] = []
        for part in batch.parts:
            if (isinstance(part, SiteColumns) and part.summary in ("stats", "health")
                    and not part.any_nonfinite and part.index and part.index[0] is not None):
                if rest:
                    self.write(rest)
                    rest = []
                self._write_table(part)
            else:
                rest.extend(part.records() if isinstance(part, SiteColumns) else part)
        self.write(rest)

    def _write_table(self, table: SiteColumns) -> None:
        step = int(table.step)
        keys = table.stat_keys
        names = [_STAT_ATTR.get(k, f"sowtel.stat.{k}") for k in keys]
        # The same at every position of such a table: the element count, and the non-finite
        # counts (0: a table holding a NaN or infinity goes record by record). One int each.
        constant = [k in _CONSTANT_IN_TABLES for k in keys]
        counts = [k in COUNT_STATS for k in keys]
        positions = tuple(table.index)
        flat_index = self._table_index.get(positions)
        if flat_index is None:
            index = [_plain_index(i) for i in positions]
            flat_index = (index if all(isinstance(i, int) for i in index)
                          else [",".join(map(str, i)) if isinstance(i, list) else str(i)
                                for i in index])
            if len(self._table_index) < 10_000:
                self._table_index[positions] = flat_index
        pending = self._pending.setdefault(step, [])
        state = self._state
        for leaf, name in enumerate(table.names):
            rows = table.stats[:, leaf]
            attrs: dict[str, Any] = {
                "sowtel.name": name, "sowtel.mode": table.mode, "sowtel.tag": table.tag,
                "sowtel.summary": table.summary,
                "sowtel.shape": [int(d) for d in table.shapes[leaf]],
                "sowtel.dtype": table.dtypes[leaf], "sowtel.index": flat_index,
                RECORDS_ATTR: len(flat_index),
            }
            for k, (attr, once, is_count) in enumerate(zip(names, constant, counts,
                                                           strict=True)):
                column = rows[:, k]
                if once:
                    attrs[attr] = int(column[0])
                elif is_count:
                    attrs[attr] = column.astype(np.int64).tolist()
                else:
                    attrs[attr] = column.tolist()
            pending.append(_PendingEvent(table.wall_time, int(table.seqs[0]), attrs))
            block = (name, table.mode, positions)
            series = self._table_series.get(block)
            if series is None:
                series = ([(name, table.mode, i) for i in positions], [])
                for i in positions:
                    key = (name, table.mode, i)
                    attrs_of = self._attrs_cache.get(key)
                    if attrs_of is None:
                        attrs_of = {"sowtel.name": name, "sowtel.mode": table.mode}
                        plain = _plain_index(i)
                        if plain is not None:
                            attrs_of["sowtel.index"] = plain
                        if len(self._attrs_cache) < 100_000:
                            self._attrs_cache[key] = attrs_of
                    series[1].append(attrs_of)
                if len(self._table_series) < 10_000:
                    self._table_series[block] = series
            with state.lock:
                state.add_table(block, series[0], series[1], keys, rows, step)
        if self._newest_step is None or step > self._newest_step:
            self._newest_step = step
        newest = self._newest_step
        for s in sorted(self._pending):
            if (newest is not None and s < newest) or self._over_limit(s):
                self._emit(s)

    def flush(self) -> None:
        """Ends every open step span and asks the providers to export, within ``timeout_s``.

        While exports are failing (an endpoint down), it only ends the spans and leaves the
        retrying to the SDK's own schedule, so records behind it are not held up.
        """
        if self._closed:
            return
        self._emit_all()
        if time.monotonic() - self._trouble_at < TROUBLE_BACKOFF_S:
            return
        self._bounded("flush", self._force_flush, self._timeout_s)

    def close(self) -> None:
        """Ends every span, flushes, and shuts down the providers the exporter created.

        Returns within ``timeout_s`` even if the OTLP endpoint is down or never answers, and
        at once when exports are already known to fail (an export failed, or a flush is still
        waiting on the endpoint): then pending exports are interrupted rather than waited for.
        Providers passed in (or global ones) are flushed, not shut down. The exporter's own
        thread ends once the call it may be stuck in returns (an OTLP request is bounded by
        ``timeout_s`` too); no thread is left behind.
        """
        if self._closed:
            return
        deadline = time.monotonic() + self._timeout_s
        self._emit_all()
        self._closed = True
        owned = self._owns_tracer_provider or self._owns_meter_provider
        work = self._shutdown_owned if owned else self._force_flush
        stuck = self._stuck is not None and not self._stuck.is_set()
        troubled = time.monotonic() - self._trouble_at < TROUBLE_BACKOFF_S
        finished = False
        if not (stuck or troubled):
            finished = self._bounded("close", work, deadline - time.monotonic())
        if not finished:
            # Interrupt retries and close connections, so the SDK's threads end soon after.
            for exporter in self._counted_exporters:
                try:
                    exporter.abort()
                except Exception as e:
                    self._count_error("abort", e)
            if owned:
                # Releases the providers' threads, on this exporter's own thread once the call
                # it may be stuck in returns; nothing waits for it.
                self._runner.submit(work, "shutdown")
        self._runner.stop()
        self._hub.remove(self._state)
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()
            self._prometheus_server = None

    # -- records to spans ----------------------------------------------------------------------

    def _count_error(self, kind: str, error: BaseException) -> None:
        if not self._errors[kind]:
            _log.warning(
                "sowtel otel exporter: %s (%r); further ones are only counted", kind, error
            )
        self._errors[kind] += 1

    def _series_attributes(self, record: Record) -> tuple[tuple[Any, ...], dict[str, Any]]:
        key = (record.name, record.mode, record.index)
        attrs = self._attrs_cache.get(key)
        if attrs is None:
            attrs = {"sowtel.name": str(record.name), "sowtel.mode": str(record.mode)}
            index = _plain_index(record.index)
            if index is not None:
                attrs["sowtel.index"] = index
            if len(self._attrs_cache) < 100_000:
                self._attrs_cache[key] = attrs
        return key, attrs

    def _stats(self, record: Record) -> dict[str, float]:
        stats = record.stats
        if not stats and record.summary == "full" and record.value is not None:
            from sowtel.summaries import host_summary

            stats = host_summary(record.value, "stats")["stats"]
        return {k: float(v) for k, v in stats.items()}

    def _update_series(self, record: Record, stats: dict[str, float], step: int) -> None:
        # Called with the state lock held.
        state = self._state
        if record.summary == SCALAR_SUMMARY:
            # A logged number is a gauge of its own, not a site's series.
            if "value" in stats:
                state.logged[record.name] = float(stats["value"])
                self._new_logged.add(record.name)
            return
        key, attrs = self._series_attributes(record)
        if state.tables:
            state.fold()  # a table's series first, so that this newer record wins
        state.latest[key] = (attrs, stats, step)
        counted = state.exported.get(key)
        if counted is None:
            state.exported[key] = [attrs, 1]
        else:
            counted[1] += 1
        for kind in NONFINITE_KINDS:
            n = stats.get(kind, 0.0)
            if n > 0:
                entry = state.nonfinite.get((key, kind))
                if entry is None:
                    state.nonfinite[(key, kind)] = [attrs | {"sowtel.nonfinite_kind": kind}, n]
                else:
                    entry[1] += n

    def _event_attributes(self, record: Record, stats: dict[str, float]) -> dict[str, Any]:
        # The attributes that do not change from step to step are built once per series.
        key = (record.name, record.mode, record.index, record.tag, record.summary,
               record.shape, record.dtype)
        fixed = self._event_cache.get(key)
        if fixed is None:
            fixed = {
                "sowtel.name": str(record.name),
                "sowtel.mode": str(record.mode),
                "sowtel.tag": str(record.tag),
                "sowtel.summary": str(record.summary),
                "sowtel.shape": [int(d) for d in record.shape],
                "sowtel.dtype": str(record.dtype),
            }
            index = _plain_index(record.index)
            if index is not None:
                fixed["sowtel.index"] = index
            if len(self._event_cache) < 100_000:
                self._event_cache[key] = fixed
        attrs = dict(fixed)
        for stat, value in stats.items():
            attrs[_STAT_ATTR.get(stat, f"sowtel.stat.{stat}")] = _plain_stat(stat, value)
        if record.histogram is not None:
            edges, counts = record.histogram
            attrs["sowtel.histogram.edges"] = [float(e) for e in edges]
            attrs["sowtel.histogram.counts"] = [float(c) for c in counts]
        return attrs

    def _over_limit(self, step: int) -> bool:
        return self._event_limit is not None and len(self._pending[step]) >= self._event_limit

    def _emit_all(self) -> None:
        for step in sorted(self._pending):
            self._emit(step)

    def _emit(self, step: int) -> None:
        pending = self._pending.pop(step)
        pending.sort(key=lambda e: (e.wall_time, e.seq))
        events: list[tuple[str, dict[str, Any], int]] = []
        for event in pending:
            attrs = event.attributes
            t_ns = int(event.wall_time * 1e9)
            events.append((event.name, attrs, t_ns))
            if event.name != EVENT_NAME:
                continue
            # A table's event (RECORDS_ATTR) holds no NaN or infinity: it is never the alert.
            nonfinite = 0 if RECORDS_ATTR in attrs else nonfinite_count(
                {k: attrs.get(_STAT_ATTR[k], 0) for k in NONFINITE_KINDS})
            if not self._alerted and nonfinite > 0:
                self._alerted = True
                alert = {
                    "sowtel.name": attrs["sowtel.name"],
                    "sowtel.mode": attrs["sowtel.mode"],
                    "sowtel.step": step,
                } | {f"sowtel.stat.{k}": attrs.get(f"sowtel.stat.{k}", 0) for k in NONFINITE_KINDS}
                if "sowtel.index" in attrs:
                    alert["sowtel.index"] = attrs["sowtel.index"]
                events.append((ALERT_EVENT_NAME, alert, t_ns))
        size = self._event_limit or max(1, len(events))
        for start in range(0, len(events), size):
            self._emit_span(step, events[start : start + size])

    def _emit_span(self, step: int, events: list[tuple[str, dict[str, Any], int]]) -> None:
        # Every step is a trace of its own, whatever span is current; a step's further parts
        # (beyond the event limit, or records that came late) are children of its first span.
        part, parent = self._parts.pop(step, (0, Context()))
        start_ns = min(t for _, _, t in events)
        end_ns = max(t for _, _, t in events)
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=trace_api.SpanKind.INTERNAL,
            attributes={
                "sowtel.step": step,
                "sowtel.part": part,
                "sowtel.record_count": sum(attrs.get(RECORDS_ATTR, 1)
                                           for name, attrs, _ in events if name == EVENT_NAME),
                "sowtel.process_index": self._process_index,
            },
            start_time=start_ns,
        )
        if part == 0:
            # Only the span's identity is kept: the span itself holds all its events.
            first = trace_api.NonRecordingSpan(span.get_span_context())
            parent = trace_api.set_span_in_context(first, Context())
        self._parts[step] = (part + 1, parent)
        while len(self._parts) > _REMEMBERED_STEPS:
            self._parts.popitem(last=False)
        for name, attrs, t_ns in events:
            span.add_event(name, attributes=attrs, timestamp=t_ns)
        span.end(end_time=end_ns)
        dropped = int(getattr(span, "dropped_events", 0) or 0)
        if dropped:
            self._errors["span_events_dropped"] += dropped
            with self._state.lock:
                self._state.span_events_dropped += dropped

    # -- bounded provider calls ----------------------------------------------------------------

    def _bounded(self, name: str, fn: Callable[[], object], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if self._stuck is not None and not self._stuck.wait(max(0.0, timeout_s)):
            # The previous call is still waiting on the endpoint; do not pile up another.
            self._errors["flush_timeouts"] += 1
            return False
        timeout_s = deadline - time.monotonic()
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        if self._runner.run(run, timeout_s, name):
            return True
        self._trouble_at = time.monotonic()
        if not done.is_set():
            self._stuck = done
            self._count_error("flush_timeouts", TimeoutError(f"{name} exceeded {timeout_s:.1f} s"))
        return False

    def _force_flush(self) -> None:
        millis = int(self._timeout_s * 1000)
        force_flush = getattr(self._tracer_provider, "force_flush", None)
        if callable(force_flush):
            force_flush(millis)
        flush_push_readers(self._meter_provider, millis)

    def _shutdown_owned(self) -> None:
        millis = int(self._timeout_s * 1000)
        if self._owns_tracer_provider:
            self._tracer_provider.shutdown()
        elif callable(getattr(self._tracer_provider, "force_flush", None)):
            self._tracer_provider.force_flush(millis)
        if self._owns_meter_provider:
            self._meter_provider.shutdown(timeout_millis=millis)
        else:
            flush_push_readers(self._meter_provider, millis)
