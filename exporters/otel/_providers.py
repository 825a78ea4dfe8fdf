"""The OpenTelemetry exporter's set-up: its options checked, the providers it creates, and the
span and metric exporters wrapped so that their failures are counted.

Example:
    >>> check_prometheus("127.0.0.1:9464")
    ('127.0.0.1', 9464)
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from sowtel import errors

MAX_SERVICE_NAME = 255

_log = logging.getLogger("sowtel.exporters.otel")


# After an export failure or a timed-out flush, flush() leaves exporting to the SDK's own
# schedule for this long, so a dead endpoint does not hold up the records behind it.
TROUBLE_BACKOFF_S = 10.0


def check_service_name(service_name: Any) -> str:
    if service_name is None:
        service_name = os.environ.get("OTEL_SERVICE_NAME") or "sowtel"
    if not isinstance(service_name, str):
        raise errors.BadOptionTypeError(
            "service_name", service_name, f"is a {type(service_name).__name__}, not a str: "
            "pass a name such as 'my-trainer'")
    if (
        not service_name.strip()
        or service_name != service_name.strip()
        or len(service_name) > MAX_SERVICE_NAME
        or not service_name.isprintable()
    ):
        raise errors.BadOptionError(
            "service_name", service_name, f"is not a valid service name: it must be 1 to "
            f"{MAX_SERVICE_NAME} printable characters without leading or trailing whitespace, "
            "such as 'my-trainer'")
    return service_name


def check_positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value > 0
    ):
        raise errors.BadOptionError(what, value, "must be a positive number of seconds, such "
                                    "as 2.0")
    return float(value)


def check_prometheus(address: Any) -> tuple[str, int] | None:
    if address is None:
        return None
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise errors.BadOptionError(
            "prometheus", address, "is not a 'host:port' address: use, for example, "
            "'127.0.0.1:9464' (port 0 picks a free port)")
    return host.strip("[]"), int(port)


def check_items(items: Any, kind: type, what: str) -> list[Any]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise errors.BadOptionTypeError(what, items,
                                        f"must be a list of {kind.__name__} instances")
    out = list(items)
    for item in out:
        if not isinstance(item, kind):
            raise errors.BadOptionTypeError(
                what, items, f"holds {item!r}, which is not a {kind.__module__}."
                f"{kind.__name__}: pass {kind.__name__} instances")
    return out


def is_api_default(provider: Any) -> bool:
    # The API's proxies and no-ops live in the API packages; any SDK or vendor provider does not.
    module = type(provider).__module__
    return module.startswith(("opentelemetry.trace", "opentelemetry.metrics"))


def process_index_and_count() -> tuple[int, int]:
    try:
        import jax

        return int(jax.process_index()), int(jax.process_count())
    except Exception:  # a process without a usable JAX backend is process 0 of 1
        return 0, 1


class Runner:
    """One daemon thread, reused, that runs the provider calls which may hang.

    The SDK's ``force_flush`` ignores its timeout and an OTLP exporter retries for as long as
    its own, so those calls run here while the caller waits at most its deadline. One thread
    serves every flush of an exporter (a thread a flush would be started thousands of times in
    a run); it is started on first use, and :meth:`stop` ends it once the calls queued before
    it are done, so a closed exporter leaves no thread behind.

    Example:
        >>> runner = Runner("sowtel-otel-example")
        >>> runner.run(lambda: None, 5.0, "a call")
        True
        >>> runner.stop()
        >>> runner.join(5.0)
        True
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: collections.deque[Callable[[], None] | None] = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None  # the newest thread, for join()

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

        self._queue(call)
        finished = done.wait(max(0.0, timeout_s))
        if failure:
            _log.warning("sowtel otel exporter: %s failed: %r", name, failure[0])
            return False
        return finished

    def submit(self, fn: Callable[[], object], name: str) -> None:
        """Queues ``fn`` behind the calls already queued, without waiting for it."""

        def call() -> None:
            try:
                fn()
            except BaseException as e:  # nobody waits for it: logged here
                _log.warning("sowtel otel exporter: %s failed: %r", name, e)

        self._queue(call)

    def stop(self) -> None:
        """Ends the thread once the calls queued so far are done (at once if it never ran)."""
        with self._ready:
            if self._thread is not None:
                self._calls.append(None)
                self._ready.notify()

    def join(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the thread to end; returns whether it has."""
        thread = self._last
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _queue(self, call: Callable[[], None]) -> None:
        with self._ready:
            if self._thread is None:
                self._thread = self._last = threading.Thread(
                    target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._calls.append(call)
            self._ready.notify()

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._calls:
                    self._ready.wait()
                call = self._calls.popleft()
                if call is None:
                    if self._calls:
                        self._calls.append(None)  # queued after stop(): served first
                        continue
                    # Under the lock: a call queued from now on starts a thread of its own.
                    self._thread = None
                    return
            call()


class CountingSpanExporter(SpanExporter):
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


class CountingMetricExporter(MetricExporter):
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
