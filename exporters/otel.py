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
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from sowtel.records import STAT_KEYS, Record
from sowtel.to_records import RecordBatch, SiteColumns

__all__ = [
    "OTelExporter",
    "SPAN_NAME",
    "EVENT_NAME",
    "ALERT_EVENT_NAME",
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
#: Instrumentation scope of the tracer and the meter.
SCOPE_NAME = "sowtel"

#: Gauges: the latest value of each statistic per site, plus the latest step.
GAUGE_NAMES: dict[str, str] = {stat: f"sowtel.{stat}" for stat in STAT_KEYS} | {
    "step": "sowtel.step"
}
#: Counters (cumulative, monotonic).
COUNTER_NAMES: dict[str, str] = {
    "exported": "sowtel.records.exported",
    "dropped": "sowtel.records.dropped",
    "exporter_errors": "sowtel.exporter.errors",
    "nonfinite": "sowtel.nonfinite_elements",
    "span_events_dropped": "sowtel.span_events.dropped",
    "export_failures": "sowtel.export.failures",
}

#: Default bound, in seconds, on each of ``flush()`` and ``close()``.
DEFAULT_TIMEOUT_S = 2.0

_COUNT_STATS = frozenset({"size", "nan", "posinf", "neginf", "zeros"})
_NONFINITE_KINDS = ("nan", "posinf", "neginf")
#: On a span event that holds the records of several positions of one site (a ``sowtel.jit``
#: table): how many; its ``sowtel.index`` and ``sowtel.stat.*`` attributes are then lists.
RECORDS_ATTR = "sowtel.records"
_STAT_ATTR = {stat: f"sowtel.stat.{stat}" for stat in STAT_KEYS}
_GAUGE_UNITS = {stat: "{element}" for stat in _COUNT_STATS} | {"step": "{step}"}
_GAUGE_DESCRIPTIONS = {
    "size": "Number of elements of the sown value",
    "mean": "Mean of the finite elements",
    "std": "Standard deviation (ddof=0) of the finite elements",
    "min": "Minimum of the finite elements",
    "max": "Maximum of the finite elements",
    "l2": "Euclidean norm of the finite elements",
    "mean_abs": "Mean absolute value of the finite elements",
    "nan": "NaN elements in the latest record",
    "posinf": "+inf elements in the latest record",
    "neginf": "-inf elements in the latest record",
    "zeros": "Zero elements in the latest record",
    "step": "Step of the latest record",
}
_MAX_SERVICE_NAME = 255
# After an export failure or a timed-out flush, flush() leaves exporting to the SDK's own
# schedule for this long, so a dead endpoint does not hold up the records behind it.
_TROUBLE_BACKOFF_S = 10.0
# How many steps remember their last span part, so late records continue the numbering.
_REMEMBERED_STEPS = 1024
_SIGNALS = ("traces", "metrics")


def _check_service_name(service_name: Any) -> str:
    if service_name is None:
        service_name = os.environ.get("OTEL_SERVICE_NAME") or "sowtel"
    if not isinstance(service_name, str):
        raise TypeError(
            f"service_name={service_name!r} is a {type(service_name).__name__}, not a str: "
            "pass a name such as 'my-trainer'"
        )
    if (
        not service_name.strip()
        or service_name != service_name.strip()
        or len(service_name) > _MAX_SERVICE_NAME
        or not service_name.isprintable()
    ):
        raise ValueError(
            f"service_name={service_name!r} is not a valid service name: it must be 1 to "
            f"{_MAX_SERVICE_NAME} printable characters without leading or trailing whitespace, "
            "such as 'my-trainer'"
        )
    return service_name


def _check_positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise ValueError(f"{what}={value!r} must be a positive number of seconds, such as 2.0")
    return float(value)


def _check_prometheus(address: Any) -> tuple[str, int] | None:
    if address is None:
        return None
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"prometheus={address!r} is not a 'host:port' address: use, for example, "
            "'127.0.0.1:9464' (port 0 picks a free port)"
        )
    return host.strip("[]"), int(port)


def _check_items(items: Any, kind: type, what: str) -> list[Any]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"{what}={items!r} must be a list of {kind.__name__} instances")
    out = list(items)
    for item in out:
        if not isinstance(item, kind):
            raise TypeError(
                f"{what} holds {item!r}, which is not a {kind.__module__}.{kind.__name__}: "
                f"pass {kind.__name__} instances"
            )
    return out


def _is_api_default(provider: Any) -> bool:
    # The API's proxies and no-ops live in the API packages; any SDK or vendor provider does not.
    module = type(provider).__module__
    return module.startswith(("opentelemetry.trace", "opentelemetry.metrics"))


def _process_index_and_count() -> tuple[int, int]:
    try:
        import jax

        return int(jax.process_index()), int(jax.process_count())
    except Exception:  # a process without a usable JAX backend is process 0 of 1
        return 0, 1


class _Runner:
    """One daemon thread, reused, that runs the provider calls which may hang.

    The SDK's ``force_flush`` ignores its timeout and an OTLP exporter retries for as long as
    its own, so those calls run here while the caller waits at most its deadline. One thread
    serves every flush of an exporter (a thread a flush would be started thousands of times in
    a run); it is started on first use.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], object], timeout_s: float, name: str) -> bool:
        """Runs ``fn`` there; returns whether it finished, without raising, within
        ``timeout_s``."""
        done = threading.Event()
        failure: list[BaseException] = []

        def call() -> None:
            try:
                fn()
            except BaseException as e:  # reported below, on the caller's thread
                failure.append(e)
            finally:
                done.set()

        with self._ready:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._calls.append(call)
            self._ready.notify()
        finished = done.wait(max(0.0, timeout_s))
        if failure:
            _log.warning("sowtel otel exporter: %s failed: %r", name, failure[0])
            return False
        return finished

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._calls:
                    self._ready.wait()
                call = self._calls.popleft()
            call()


def _run_with_deadline(fn: Callable[[], object], timeout_s: float, name: str) -> bool:
    """Runs ``fn`` on a thread of its own; returns whether it finished within ``timeout_s``
    (for a call made once, such as a shutdown left to finish in the background)."""
    return _Runner(f"sowtel-otel-{name}").run(fn, timeout_s, name)


def _plain_index(index: Any) -> int | list[int] | None:
    if index is None:
        return None
    if isinstance(index, (tuple, list)):
        return [int(i) for i in index]
    return int(index)


def _plain_stat(stat: str, value: Any) -> float | int:
    v = float(value)
    return int(v) if stat in _COUNT_STATS and math.isfinite(v) else v


class _PendingEvent(NamedTuple):
    """A record's span event, waiting for its step's span."""

    wall_time: float
    seq: int
    attributes: dict[str, Any]


class _CountingSpanExporter(SpanExporter):
    """Hands spans to ``inner`` and counts the exports that fail."""

    def __init__(self, inner: SpanExporter, on_failure: Callable[[str], None]):
        self._inner = inner
        self._on_failure = on_failure
        self._aborted = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._aborted:
            self._on_failure("traces")
            return SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_failure("traces")
        return result

    def abort(self) -> None:
        """Makes pending and future exports fail at once (retry back-offs are interrupted)."""
        self._aborted = True
        self._inner.shutdown()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _CountingMetricExporter(MetricExporter):
    """Hands metrics to ``inner`` and counts the exports that fail."""

    def __init__(self, inner: MetricExporter, on_failure: Callable[[str], None]):
        # The reader asks the exporter for its temporality and aggregation: keep the inner's.
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self._inner = inner
        self._on_failure = on_failure
        self._aborted = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if self._aborted:
            self._on_failure("metrics")
            return MetricExportResult.FAILURE
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._on_failure("metrics")
        return result

    def abort(self) -> None:
        """Makes pending and future exports fail at once (retry back-offs are interrupted)."""
        self._aborted = True
        self._inner.shutdown()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis)


class _SeriesState:
    """What one exporter has seen, read by the metric callbacks at collection time.

    Records only update dictionaries here; the SDK turns them into data points when a reader
    collects (a periodic export or a Prometheus scrape), so a record costs no metric work.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # series key -> (attributes, stats, step) of the latest record
        self.latest: dict[tuple[Any, ...], tuple[dict[str, Any], dict[str, float], int]] = {}
        self.exported: dict[tuple[Any, ...], list[Any]] = {}  # key -> [attributes, count]
        self.nonfinite: dict[tuple[Any, ...], list[Any]] = {}  # (key, kind) -> [attrs, count]
        self.span_events_dropped = 0
        self.export_failures = dict.fromkeys(_SIGNALS, 0)

    def observe_stat(self, stat: str) -> list[tuple[dict[str, Any], float]]:
        with self.lock:
            if stat == "step":
                return [(attrs, float(step)) for attrs, _, step in self.latest.values()]
            return [
                (attrs, stats[stat]) for attrs, stats, _ in self.latest.values() if stat in stats
            ]

    def observe_counter(self, counter: str) -> list[tuple[dict[str, Any], float]]:
        with self.lock:
            if counter == "exported":
                return [(attrs, n) for attrs, n in self.exported.values()]
            if counter == "nonfinite":
                return [(attrs, n) for attrs, n in self.nonfinite.values()]
            if counter == "span_events_dropped":
                return [({}, self.span_events_dropped)]
            if counter == "export_failures":
                return [({"sowtel.signal": s}, n) for s, n in self.export_failures.items()]
        return []


def _session_status() -> dict[str, Any]:
    # The dispatcher keeps these counters; sowtel may be absent, disabled or of another shape.
    try:
        import sowtel

        status = getattr(sowtel, "status", None)
        counters = status() if callable(status) else {}
        return counters if isinstance(counters, dict) else {}
    except Exception:
        return {}


def _per_exporter(counters: Any) -> list[tuple[dict[str, Any], float]]:
    if not isinstance(counters, dict):
        return []
    return [({"sowtel.exporter": str(label)}, float(n or 0)) for label, n in counters.items()]


def _observe_dropped() -> list[tuple[dict[str, Any], float]]:
    """Records dropped: at the session's queue, and in each exporter's backlog."""
    status = _session_status()
    queue = [({"sowtel.stage": "queue"}, float(status.get("dropped", 0) or 0))]
    backlogs = [
        ({"sowtel.stage": "exporter"} | attrs, n)
        for attrs, n in _per_exporter(status.get("exporter_dropped"))
    ]
    return queue + backlogs


def _observe_exporter_errors() -> list[tuple[dict[str, Any], float]]:
    """Calls of each exporter that raised (the dispatcher isolates and counts them)."""
    return _per_exporter(_session_status().get("errors"))


class _MetricHub:
    """sowtel's instruments on one meter provider, shared by every exporter that uses it.

    The SDK keeps the first callbacks of an instrument registered twice, so the callbacks read
    every live exporter's state rather than belonging to one exporter.
    """

    def __init__(self, meter: metrics_api.Meter):
        self._lock = threading.Lock()
        self._states: list[_SeriesState] = []
        for stat, name in GAUGE_NAMES.items():
            meter.create_observable_gauge(
                name,
                callbacks=[self._gauge_callback(stat)],
                unit=_GAUGE_UNITS.get(stat, ""),
                description=_GAUGE_DESCRIPTIONS[stat],
            )
        meter.create_observable_counter(
            COUNTER_NAMES["exported"], callbacks=[self._counter_callback("exported")],
            unit="{record}", description="Records written by the OpenTelemetry exporter",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["nonfinite"], callbacks=[self._counter_callback("nonfinite")],
            unit="{element}", description="NaN and infinite elements seen, by kind",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["span_events_dropped"],
            callbacks=[self._counter_callback("span_events_dropped")],
            unit="{event}", description="Span events the SDK dropped beyond its event limit",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["export_failures"],
            callbacks=[self._counter_callback("export_failures")],
            unit="{batch}", description="Failed exports of sowtel's own OTLP exporters",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["dropped"], callbacks=[self._session_callback(_observe_dropped)],
            unit="{record}",
            description="Records dropped by the session's queue or an exporter's backlog",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["exporter_errors"],
            callbacks=[self._session_callback(_observe_exporter_errors)],
            unit="{call}", description="Exporter calls that raised, by exporter",
        )

    def add(self, state: _SeriesState) -> None:
        with self._lock:
            self._states.append(state)

    def remove(self, state: _SeriesState) -> None:
        with self._lock:
            self._states = [s for s in self._states if s is not state]

    def _live(self) -> list[_SeriesState]:
        with self._lock:
            return list(self._states)

    def _gauge_callback(self, stat: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            latest: dict[tuple[Any, ...], tuple[dict[str, Any], float]] = {}
            for state in self._live():
                for attrs, value in state.observe_stat(stat):
                    latest[_attrs_key(attrs)] = (attrs, value)
            return [Observation(v, attrs) for attrs, v in latest.values()]

        return callback

    def _counter_callback(self, counter: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            total: dict[tuple[Any, ...], list[Any]] = {}
            for state in self._live():
                for attrs, value in state.observe_counter(counter):
                    total.setdefault(_attrs_key(attrs), [attrs, 0.0])[1] += value
            return [Observation(v, attrs) for attrs, v in total.values()]

        return callback

    def _session_callback(
        self, observe: Callable[[], list[tuple[dict[str, Any], float]]]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            if not self._live():
                return []
            return [Observation(v, attrs) for attrs, v in observe()]

        return callback


def _is_pull_reader(reader: Any) -> bool:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
    except ImportError:
        return False
    return isinstance(reader, PrometheusMetricReader)


def _flush_push_readers(meter_provider: Any, millis: int) -> None:
    """Flushes a meter provider's push readers (OTLP, console), never its pull readers.

    ``MeterProvider.force_flush`` collects every reader; a Prometheus reader queues each such
    collection until the next scrape, which then serves every queued copy: each flush between
    two scrapes would add a duplicate of every series.
    """
    # The SDK keeps its readers private (checked on opentelemetry-sdk 1.45); without them, the
    # provider's own flush is the fallback.
    readers = getattr(meter_provider, "_metric_readers", None)
    if not isinstance(readers, (list, tuple)):
        force_flush = getattr(meter_provider, "force_flush", None)
        if callable(force_flush):
            force_flush(millis)
        return
    for reader in readers:
        if not _is_pull_reader(reader):
            reader.force_flush(timeout_millis=millis)


def _attrs_key(attrs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


_HUBS: weakref.WeakKeyDictionary[Any, _MetricHub] = weakref.WeakKeyDictionary()
_HUBS_LOCK = threading.Lock()


def _hub_for(meter_provider: Any) -> _MetricHub:
    with _HUBS_LOCK:
        try:
            hub = _HUBS.get(meter_provider)
        except TypeError:  # a provider that takes no weak references gets a hub of its own
            return _MetricHub(meter_provider.get_meter(SCOPE_NAME, _version()))
        if hub is None:
            hub = _MetricHub(meter_provider.get_meter(SCOPE_NAME, _version()))
            _HUBS[meter_provider] = hub
        return hub


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sowtel")
    except Exception:
        return "0"


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
            raise TypeError(
                f"tracer_provider={tracer_provider!r} is not an opentelemetry.trace."
                "TracerProvider: pass opentelemetry.sdk.trace.TracerProvider(...), or None to "
                "use the global one"
            )
        if meter_provider is not None and not isinstance(
            meter_provider, metrics_api.MeterProvider
        ):
            raise TypeError(
                f"meter_provider={meter_provider!r} is not an opentelemetry.metrics."
                "MeterProvider: pass opentelemetry.sdk.metrics.MeterProvider(...), or None to "
                "use the global one"
            )
        self._service_name = _check_service_name(service_name)
        if otlp_protocol not in ("grpc", "http/protobuf"):
            raise ValueError(
                f"otlp_protocol={otlp_protocol!r} is not an OTLP protocol: use 'grpc' or "
                "'http/protobuf'"
            )
        if otlp_endpoint is not None and (
            not isinstance(otlp_endpoint, str)
            or not otlp_endpoint.startswith(("http://", "https://"))
        ):
            raise ValueError(
                f"otlp_endpoint={otlp_endpoint!r} is not an http(s) URL: use, for example, "
                "'http://127.0.0.1:4317' (gRPC) or 'http://127.0.0.1:4318' (http/protobuf)"
            )
        prometheus_address = _check_prometheus(prometheus)
        processors = _check_items(span_processors, SpanProcessor, "span_processors")
        readers = _check_items(metric_readers, MetricReader, "metric_readers")
        self._timeout_s = _check_positive(timeout_s, "timeout_s")
        interval_s = _check_positive(metrics_interval_s, "metrics_interval_s")
        if max_events_per_span is not None and (
            isinstance(max_events_per_span, bool)
            or not isinstance(max_events_per_span, int)
            or max_events_per_span < 1
        ):
            raise ValueError(
                f"max_events_per_span={max_events_per_span!r} must be a positive int, or None "
                "for the tracer provider's event limit"
            )
        configures_own = bool(otlp_endpoint or prometheus_address or processors or readers)
        if configures_own and (tracer_provider is not None or meter_provider is not None):
            raise ValueError(
                "otlp_endpoint, prometheus, span_processors and metric_readers configure the "
                "providers sowtel creates, so they cannot be combined with tracer_provider= or "
                "meter_provider=: add the exporter or reader to your own provider instead"
            )

        self._process_index, process_count = _process_index_and_count()
        self._errors: collections.Counter[str] = collections.Counter()
        self._state = _SeriesState()
        self._counted_exporters: list[_CountingSpanExporter | _CountingMetricExporter] = []
        self._prometheus_server: Any = None
        self._prometheus_thread: Any = None
        self.prometheus_url: str | None = None
        """``http://host:port/metrics`` when the exporter serves metrics, else ``None``."""

        # A provider passed in is used as it is; the global one only if an SDK was installed.
        if tracer_provider is None and not configures_own:
            global_tracer = trace_api.get_tracer_provider()
            if not _is_api_default(global_tracer):
                tracer_provider = global_tracer
        if meter_provider is None and not configures_own:
            global_meter = metrics_api.get_meter_provider()
            if not _is_api_default(global_meter):
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
                span_exporter = _CountingSpanExporter(
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
                metric_exporter = _CountingMetricExporter(
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
        self._tracer = tracer_provider.get_tracer(SCOPE_NAME, _version())
        self._event_limit = (
            max_events_per_span
            if max_events_per_span is not None
            else self._provider_event_limit(tracer_provider)
        )
        self._hub = _hub_for(meter_provider)
        self._hub.add(self._state)

        # Records of the newest step wait here until a later step shows the step is complete.
        self._pending: dict[int, list[_PendingEvent]] = {}
        self._newest_step: int | None = None
        # step -> (spans emitted so far, context of its first span): later parts join its trace.
        self._parts: collections.OrderedDict[int, tuple[int, Context]] = collections.OrderedDict()
        self._trouble_at = -math.inf
        self._alerted = False
        self._attrs_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._event_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._stuck: threading.Event | None = None
        self._runner = _Runner("sowtel-otel-flush")
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
            raise ValueError(
                f"prometheus={shown!r}: the metrics server cannot listen there "
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
        newest = self._newest_step
        for step in sorted(self._pending):
            if (newest is not None and step < newest) or self._over_limit(step):
                self._emit(step)

    def write_batch(self, batch: RecordBatch) -> None:
        """Adds a batch. A table of a ``sowtel.jit`` step (one site and mode, its scan
        iterations and shards) becomes one span event a leaf, whose ``sowtel.index`` and
        ``sowtel.stat.*`` attributes are lists with one entry a position, and
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
        counts = [k in _COUNT_STATS for k in keys]
        rows = table.stats.tolist()
        index = [_plain_index(i) for i in table.index]
        flat_index: list[Any] = (index if all(isinstance(i, int) for i in index)
                                 else [",".join(map(str, i)) if isinstance(i, list) else str(i)
                                       for i in index])
        pending = self._pending.setdefault(step, [])
        state = self._state
        for leaf, name in enumerate(table.names):
            attrs: dict[str, Any] = {
                "sowtel.name": name, "sowtel.mode": table.mode, "sowtel.tag": table.tag,
                "sowtel.summary": table.summary,
                "sowtel.shape": [int(d) for d in table.shapes[leaf]],
                "sowtel.dtype": table.dtypes[leaf], "sowtel.index": flat_index,
                RECORDS_ATTR: len(index),
            }
            for k, (attr, is_count) in enumerate(zip(names, counts, strict=True)):
                column = [row[leaf][k] for row in rows]
                attrs[attr] = [int(v) for v in column] if is_count else column
            pending.append(_PendingEvent(table.wall_time, int(table.seqs[0]), attrs))
            with state.lock:
                for i, row in zip(table.index, rows, strict=True):
                    key = (name, table.mode, i)
                    series = self._attrs_cache.get(key)
                    if series is None:
                        series = {"sowtel.name": name, "sowtel.mode": table.mode}
                        plain = _plain_index(i)
                        if plain is not None:
                            series["sowtel.index"] = plain
                        if len(self._attrs_cache) < 100_000:
                            self._attrs_cache[key] = series
                    state.latest[key] = (series, dict(zip(keys, row[leaf], strict=True)), step)
                    counted = state.exported.get(key)
                    if counted is None:
                        state.exported[key] = [series, 1]
                    else:
                        counted[1] += 1
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
        if time.monotonic() - self._trouble_at < _TROUBLE_BACKOFF_S:
            return
        self._bounded("flush", self._force_flush, self._timeout_s)

    def close(self) -> None:
        """Ends every span, flushes, and shuts down the providers the exporter created.

        Returns within ``timeout_s`` even if the OTLP endpoint is down or never answers;
        providers passed in (or global ones) are flushed, not shut down.
        """
        if self._closed:
            return
        deadline = time.monotonic() + self._timeout_s
        self._emit_all()
        self._closed = True
        owned = self._owns_tracer_provider or self._owns_meter_provider
        work = self._shutdown_owned if owned else self._force_flush
        finished = self._bounded("close", work, deadline - time.monotonic())
        if not finished:
            # Interrupt retries and close connections, so the worker threads end soon after.
            for exporter in self._counted_exporters:
                try:
                    exporter.abort()
                except Exception as e:
                    self._count_error("abort", e)
            if owned:
                # Releases the providers' threads in the background; nothing waits for it.
                _run_with_deadline(work, 0.0, "shutdown")
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
        key, attrs = self._series_attributes(record)
        state = self._state
        state.latest[key] = (attrs, stats, step)
        counted = state.exported.get(key)
        if counted is None:
            state.exported[key] = [attrs, 1]
        else:
            counted[1] += 1
        for kind in _NONFINITE_KINDS:
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
            events.append((EVENT_NAME, attrs, t_ns))
            # A table's event (RECORDS_ATTR) holds no NaN or infinity: it is never the alert.
            nonfinite = 0 if RECORDS_ATTR in attrs else sum(
                attrs.get(_STAT_ATTR[k], 0) for k in _NONFINITE_KINDS)
            if not self._alerted and nonfinite > 0:
                self._alerted = True
                alert = {
                    "sowtel.name": attrs["sowtel.name"],
                    "sowtel.mode": attrs["sowtel.mode"],
                    "sowtel.step": step,
                } | {f"sowtel.stat.{k}": attrs.get(f"sowtel.stat.{k}", 0) for k in _NONFINITE_KINDS}
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
        _flush_push_readers(self._meter_provider, millis)

    def _shutdown_owned(self) -> None:
        millis = int(self._timeout_s * 1000)
        if self._owns_tracer_provider:
            self._tracer_provider.shutdown()
        elif callable(getattr(self._tracer_provider, "force_flush", None)):
            self._tracer_provider.force_flush(millis)
        if self._owns_meter_provider:
            self._meter_provider.shutdown(timeout_millis=millis)
        else:
            _flush_push_readers(self._meter_provider, millis)
