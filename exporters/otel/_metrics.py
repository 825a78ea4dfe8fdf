"""The OpenTelemetry exporter's metrics: sowtel's instruments on a meter provider, shared by
every exporter that uses it, and what each exporter has seen for them to observe.

Records only update dictionaries here (:class:`SeriesState`); the SDK turns them into data
points when a reader collects. :class:`MetricHub` owns the instruments of one meter provider:
a gauge per statistic, counters of records and non-finite elements, and a gauge per name
logged with :func:`sowtel.log` (``sowtel.log.<name>``).

Example:
    >>> from opentelemetry.sdk.metrics import MeterProvider
    >>> hub = hub_for(MeterProvider())
    >>> state = SeriesState()
    >>> hub.add(state)
    >>> state.observe_stat("mean")
    []
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry.metrics import CallbackOptions, Observation

from sowtel.records import NONFINITE_KINDS, STAT_KEYS

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


COUNT_STATS = frozenset({"size", *NONFINITE_KINDS, "zeros"})


GAUGE_UNITS = {stat: "{element}" for stat in COUNT_STATS} | {"step": "{step}"}


GAUGE_DESCRIPTIONS = {
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


SIGNALS = ("traces", "metrics")


#: Prefix of the gauge of each name logged with :func:`sowtel.log`: ``sowtel.log.loss``.
LOG_GAUGE_PREFIX = "sowtel.log."


def log_gauge_name(name: str) -> str:
    """The gauge of a logged name; OpenTelemetry allows letters, digits and ``_ . - /`` in
    instrument names (up to 255 characters), which sowtel's names already keep to.

    Example:
        >>> log_gauge_name("train/loss")
        'sowtel.log.train/loss'
    """
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "_.-/") else "_" for c in name)
    return (LOG_GAUGE_PREFIX + safe)[:255]


class SeriesState:
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
        self.export_failures = dict.fromkeys(SIGNALS, 0)
        self.logged: dict[str, float] = {}  # name -> latest value of sowtel.log
        # The series of a table's leaf, kept whole until a reader needs them one by one:
        # block key -> (series keys, their attributes, statistics' names, rows, step, tables
        # seen), in arrival order (the latest block last).
        self.tables: dict[Any, tuple[list[Any], list[dict[str, Any]], tuple[str, ...], Any,
                                     int, int]] = {}

    def add_table(self, block: Any, keys: list[Any], attrs: list[dict[str, Any]],
                  stat_keys: tuple[str, ...], rows: Any, step: int) -> None:
        """A table leaf's series (lock held): ``keys[p]`` and ``attrs[p]`` name the series of
        position ``p``, ``rows[p]`` its statistics (a numpy array ``positions x stats``)."""
        earlier = self.tables.pop(block, None)
        seen = 1 if earlier is None else earlier[5] + 1
        self.tables[block] = (keys, attrs, stat_keys, rows, step, seen)

    def fold(self) -> None:
        """Turns the kept tables into per-series entries (lock held): before a reader looks at
        them, and before a record updates a series one by one, so the latest always wins."""
        for keys, attrs, stat_keys, rows, step, seen in self.tables.values():
            for key, series, row in zip(keys, attrs, rows.tolist(), strict=True):
                self.latest[key] = (series, dict(zip(stat_keys, row, strict=True)), step)
                counted = self.exported.get(key)
                if counted is None:
                    self.exported[key] = [series, seen]
                else:
                    counted[1] += seen
        self.tables.clear()

    def observe_stat(self, stat: str) -> list[tuple[dict[str, Any], float]]:
        with self.lock:
            self.fold()
            if stat == "step":
                return [(attrs, float(step)) for attrs, _, step in self.latest.values()]
            return [
                (attrs, stats[stat]) for attrs, stats, _ in self.latest.values() if stat in stats
            ]

    def observe_logged(self, name: str) -> float | None:
        with self.lock:
            return self.logged.get(name)

    def observe_counter(self, counter: str) -> list[tuple[dict[str, Any], float]]:
        with self.lock:
            self.fold()
            if counter == "exported":
                return [(attrs, n) for attrs, n in self.exported.values()]
            if counter == "nonfinite":
                return [(attrs, n) for attrs, n in self.nonfinite.values()]
            if counter == "span_events_dropped":
                return [({}, self.span_events_dropped)]
            if counter == "export_failures":
                return [({"sowtel.signal": s}, n) for s, n in self.export_failures.items()]
        return []


def session_status() -> dict[str, Any]:
    # The dispatcher keeps these counters; sowtel may be absent, disabled or of another shape.
    try:
        # Looked up, not imported: an exporter sits below the session that runs it.
        status = getattr(sys.modules.get("sowtel"), "status", None)
        counters = status() if callable(status) else {}
        return counters if isinstance(counters, dict) else {}
    except Exception:
        return {}


def per_exporter(counters: Any) -> list[tuple[dict[str, Any], float]]:
    if not isinstance(counters, dict):
        return []
    return [({"sowtel.exporter": str(label)}, float(n or 0)) for label, n in counters.items()]


def observe_dropped() -> list[tuple[dict[str, Any], float]]:
    """Records dropped: at the session's queue, and in each exporter's backlog."""
    status = session_status()
    queue = [({"sowtel.stage": "queue"}, float(status.get("dropped", 0) or 0))]
    backlogs = [
        ({"sowtel.stage": "exporter"} | attrs, n)
        for attrs, n in per_exporter(status.get("exporter_dropped"))
    ]
    return queue + backlogs


def observe_exporter_errors() -> list[tuple[dict[str, Any], float]]:
    """Calls of each exporter that raised (the dispatcher isolates and counts them)."""
    return per_exporter(session_status().get("errors"))


class MetricHub:
    """sowtel's instruments on one meter provider, shared by every exporter that uses it.

    The SDK keeps the first callbacks of an instrument registered twice, so the callbacks read
    every live exporter's state rather than belonging to one exporter.
    """

    def __init__(self, meter: metrics_api.Meter):
        self._lock = threading.Lock()
        self._states: list[SeriesState] = []
        self._meter = meter
        self._log_gauges: set[str] = set()
        for stat, name in GAUGE_NAMES.items():
            meter.create_observable_gauge(
                name,
                callbacks=[self._gauge_callback(stat)],
                unit=GAUGE_UNITS.get(stat, ""),
                description=GAUGE_DESCRIPTIONS[stat],
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
            COUNTER_NAMES["dropped"], callbacks=[self._session_callback(observe_dropped)],
            unit="{record}",
            description="Records dropped by the session's queue or an exporter's backlog",
        )
        meter.create_observable_counter(
            COUNTER_NAMES["exporter_errors"],
            callbacks=[self._session_callback(observe_exporter_errors)],
            unit="{call}", description="Exporter calls that raised, by exporter",
        )

    def log_gauge(self, name: str) -> None:
        """Creates, once, the gauge of a name logged with :func:`sowtel.log`
        (:func:`log_gauge_name`), so a dashboard plots the loss as a metric of its own."""
        with self._lock:
            if name in self._log_gauges:
                return
            self._log_gauges.add(name)
        self._meter.create_observable_gauge(
            log_gauge_name(name), callbacks=[self._log_callback(name)],
            description=f"The latest value of {name!r} logged with sowtel.log",
        )

    def _log_callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            values = [v for state in self._live() if (v := state.observe_logged(name)) is not None]
            return [Observation(values[-1], {})] if values else []

        return callback

    def add(self, state: SeriesState) -> None:
        with self._lock:
            self._states.append(state)

    def remove(self, state: SeriesState) -> None:
        with self._lock:
            self._states = [s for s in self._states if s is not state]

    def _live(self) -> list[SeriesState]:
        with self._lock:
            return list(self._states)

    def _gauge_callback(self, stat: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            latest: dict[tuple[Any, ...], tuple[dict[str, Any], float]] = {}
            for state in self._live():
                for attrs, value in state.observe_stat(stat):
                    latest[attrs_key(attrs)] = (attrs, value)
            return [Observation(v, attrs) for attrs, v in latest.values()]

        return callback

    def _counter_callback(self, counter: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            total: dict[tuple[Any, ...], list[Any]] = {}
            for state in self._live():
                for attrs, value in state.observe_counter(counter):
                    total.setdefault(attrs_key(attrs), [attrs, 0.0])[1] += value
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


def is_pull_reader(reader: Any) -> bool:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
    except ImportError:
        return False
    return isinstance(reader, PrometheusMetricReader)


def flush_push_readers(meter_provider: Any, millis: int) -> None:
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
        if not is_pull_reader(reader):
            reader.force_flush(timeout_millis=millis)


def attrs_key(attrs: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


HUBS: weakref.WeakKeyDictionary[Any, MetricHub] = weakref.WeakKeyDictionary()


HUBS_LOCK = threading.Lock()


def hub_for(meter_provider: Any) -> MetricHub:
    with HUBS_LOCK:
        try:
            hub = HUBS.get(meter_provider)
        except TypeError:  # a provider that takes no weak references gets a hub of its own
            return MetricHub(meter_provider.get_meter(SCOPE_NAME, sowtel_version()))
        if hub is None:
            hub = MetricHub(meter_provider.get_meter(SCOPE_NAME, sowtel_version()))
            HUBS[meter_provider] = hub
        return hub


def sowtel_version() -> str:
    try:
        from importlib.metadata import version

        return version("sowtel")
    except Exception:
        return "0"
