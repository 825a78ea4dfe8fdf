"""The host side of live streaming: a bounded queue, a dispatcher thread, a worker per exporter.

Values leave the compiled program through host callbacks, which run on JAX's own threads,
several at once and in no fixed order. Those threads must get back to JAX at once, so the
receiver only calls :meth:`Dispatcher.put`, which appends to a bounded queue and returns. A
dispatcher thread drains the queue in batches, turns raw items into :class:`~sowtel.records.Record`
objects with the ``convert`` function it was given, and hands each batch to every exporter.

Each exporter has its own worker thread and its own bounded backlog, so an exporter that raises
or hangs never stops the others nor training. Exporters see no threads: ``write``, ``flush`` and
``close`` of one exporter are always called from its one worker thread.

Example:
    >>> from sowtel.dispatcher import Dispatcher
    >>> from sowtel.exporters.memory import MemoryExporter
    >>> from sowtel.records import Record
    >>> def convert(items):
    ...     return [Record(name=n, mode="primal", tag="intermediates", step=s, index=None,
    ...                    wall_time=0.0, summary="shape", shape=(), dtype="float32")
    ...             for n, s in items]
    >>> memory = MemoryExporter()
    >>> with Dispatcher([memory], convert=convert) as dispatcher:
    ...     dispatcher.put(("loss", 0))
    ...     dispatcher.put(("loss", 1))
    ...     dispatcher.flush()
    True
    True
    True
    >>> [r.step for r in memory.by_name("loss")]
    [0, 1]
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from sowtel.records import Record

__all__ = ["Dispatcher", "ON_FULL", "EXIT_TIMEOUT", "close_all"]

logger = logging.getLogger("sowtel")

#: What :meth:`Dispatcher.put` does when the queue is full.
ON_FULL: tuple[str, ...] = ("drop", "block")

#: Seconds the exit hooks (``atexit`` and SIGTERM) spend, in all, flushing and closing every
#: live dispatcher before the process goes on exiting.
EXIT_TIMEOUT: float = 10.0

# A worker hands at most this many records to one write() call when it has fallen behind.
_MAX_WRITE = 8192
# How often waits that cannot be woken by a notification re-check for stalled exporters.
_POLL = 0.05


def _check_count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def _check_seconds(value: Any, name: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds")
    return float(value)


def _record_nbytes(record: Record) -> int:
    value = record.value
    return int(getattr(value, "nbytes", 0)) if value is not None else 0


def _is_nonfinite(record: Record) -> bool:
    stats = record.stats
    if "nan" in stats:
        return bool(stats["nan"] or stats.get("posinf", 0) or stats.get("neginf", 0))
    value = record.value
    if value is not None and getattr(value, "dtype", None) is not None and value.dtype.kind in "fc":
        import numpy as np

        return not bool(np.isfinite(value).all())
    return False


class _Token:
    """A flush or close request travelling through one worker's queue behind the records."""

    __slots__ = ("kind", "done")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = False


class _ExporterWorker:
    """One exporter, its bounded backlog, and the only thread that ever calls it."""

    def __init__(
        self, exporter: Any, label: str, *, max_records: int, max_bytes: int,
        flush_interval: float, timeout: float,
    ) -> None:
        self.exporter = exporter
        self.label = label
        self.exported = 0
        self.errors = 0
        self.dropped = 0
        self.pending = 0
        self._pending_bytes = 0
        self._max_records = max_records
        self._max_bytes = max_bytes
        self._flush_interval = flush_interval
        self._timeout = timeout
        # A Condition over an RLock: the SIGTERM handler may run on a thread that holds it.
        self._cond = threading.Condition()
        self._queue: deque[Sequence[Record] | _Token] = deque()
        self._busy_since: float | None = None
        self._busy_in = ""
        self._accepting = True
        self._finished = False
        self._logged_error = False
        self._logged_stall = False
        self._logged_overflow = False
        self._thread = threading.Thread(
            target=self._run, name=f"sowtel-exporter-{label}", daemon=True
        )
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def stalled(self) -> bool:
        """True while the exporter has been inside one call for longer than the timeout."""
        since = self._busy_since
        stalled = since is not None and time.monotonic() - since > self._timeout
        if not stalled and not self._finished and not self._thread.is_alive():
            stalled = True  # the worker is gone (e.g. in a forked child): never wait for it
        if stalled and not self._logged_stall:
            self._logged_stall = True
            logger.error(
                "sowtel exporter %s made no progress for %.3g s inside %s(); it is skipped "
                "until that call returns (records for it are counted in status()"
                "['exporter_dropped'])", self.label, self._timeout, self._busy_in or "a call",
            )
        return stalled

    # -- called from the dispatcher thread -------------------------------------------------

    def offer(self, batch: Sequence[Record], nbytes: int, block: bool) -> None:
        """Appends ``batch`` to the backlog; when it is full, drops it or waits for room."""
        with self._cond:
            while True:
                if not self._accepting:
                    self.dropped += len(batch)
                    return
                # A backlog under its bounds takes a whole batch, so it holds at most one batch
                # beyond them; no batch is ever refused for being larger than the bounds.
                if self.pending < self._max_records and self._pending_bytes < self._max_bytes:
                    self._queue.append(batch)
                    self.pending += len(batch)
                    self._pending_bytes += nbytes
                    self._cond.notify_all()
                    return
                if not block or self.stalled():
                    self.dropped += len(batch)
                    if not self._logged_overflow:
                        self._logged_overflow = True
                        logger.warning(
                            "sowtel exporter %s is falling behind: its backlog is full (%d "
                            "records), so records for it are dropped and counted in status()"
                            "['exporter_dropped']", self.label, self.pending,
                        )
                    return
                self._cond.wait(_POLL)

    # -- called from any thread --------------------------------------------------------------

    def request(self, kind: str) -> _Token:
        """Queues a flush or close request behind everything already queued."""
        token = _Token(kind)
        with self._cond:
            if self._finished:
                token.done = True
                return token
            if kind == "close":
                self._accepting = False
            self._queue.append(token)
            self._cond.notify_all()
        return token

    def wait(self, token: _Token, deadline: float | None) -> str:
        """Waits for ``token``: returns ``"done"``, ``"stalled"`` or ``"timeout"``."""
        with self._cond:
            while not token.done:
                if self.stalled():
                    return "stalled"
                step = _POLL
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return "timeout"
                    step = min(step, left)
                self._cond.wait(step)
        return "done"

    # -- the worker thread -------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        self._busy_in = what
        self._busy_since = time.monotonic()
        try:
            fn(*args)
            return True
        except BaseException:  # an exporter must never take its worker down with it
            self.errors += 1
            if not self._logged_error:
                self._logged_error = True
                logger.exception(
                    "sowtel exporter %s raised in %s(); it keeps receiving records, and its "
                    "errors are counted in status()['errors'] and not logged again",
                    self.label, what,
                )
            return False
        finally:
            self._busy_since = None
            if self._logged_stall:
                self._logged_stall = False
                logger.warning("sowtel exporter %s returned from %s() and resumes", self.label,
                               what)

    def _take(self) -> Sequence[Record] | _Token:
        first = self._queue.popleft()
        if isinstance(first, _Token) or not self._queue or isinstance(self._queue[0], _Token):
            return first
        merged = list(first)
        while self._queue and not isinstance(self._queue[0], _Token) and len(merged) < _MAX_WRITE:
            merged.extend(self._queue.popleft())  # type: ignore[arg-type]
        return merged

    def _run(self) -> None:
        last_flush = time.monotonic()
        dirty = False
        while True:
            with self._cond:
                entry: Sequence[Record] | _Token | None = None
                while not self._queue:
                    wait: float | None = None
                    if dirty:
                        # Written records reach the sink's storage within about one interval.
                        wait = self._flush_interval - (time.monotonic() - last_flush)
                        if wait <= 0:
                            break
                    self._cond.wait(wait)
                if self._queue:
                    entry = self._take()
            if entry is None or isinstance(entry, _Token):
                kind = "flush" if entry is None else entry.kind
                if kind == "flush":
                    self._call("flush", self.exporter.flush)
                    dirty = False
                    last_flush = time.monotonic()
                else:
                    self._call("close", self.exporter.close)
                with self._cond:
                    if entry is not None:
                        entry.done = True
                    if kind == "close":
                        self._finished = True
                    self._cond.notify_all()
                if kind == "close":
                    return
                continue
            ok = self._call("write", self.exporter.write, entry)
            nbytes = sum(_record_nbytes(r) for r in entry if r.value is not None)
            with self._cond:
                self.pending -= len(entry)
                self._pending_bytes -= nbytes
                if ok:
                    self.exported += len(entry)
                self._cond.notify_all()
            dirty = True
            if time.monotonic() - last_flush >= self._flush_interval:
                # Under a steady stream the backlog never empties; flush on schedule anyway.
                self._call("flush", self.exporter.flush)
                dirty = False
                last_flush = time.monotonic()


def _labels(exporters: Sequence[Any]) -> list[str]:
    labels: list[str] = []
    for exporter in exporters:
        base = getattr(exporter, "label", None)
        if not isinstance(base, str) or not base:
            base = type(exporter).__name__
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}#{n}"
        labels.append(label)
    return labels


class Dispatcher:
    """Moves items from host callbacks to exporters without ever stalling training.

    Args:
      exporters: objects with ``write(records)``, ``flush()`` and ``close()``.
      convert: turns a list of raw items given to :meth:`put` into a list of records; runs on
        the dispatcher thread. If it raises, that batch is lost, counted in ``status()`` and
        logged once.
      queue_size: the most items waiting in the queue; also the backlog bound of each exporter,
        in records.
      max_bytes: the most bytes (the ``nbytes`` given to :meth:`put`) waiting in the queue; also
        each exporter's backlog bound in bytes of full values. An item larger than this is
        still accepted into an empty queue.
      on_full: ``"drop"`` counts and refuses items when the queue is full; ``"block"`` makes
        :meth:`put` wait for room, so nothing is lost, at the price of back-pressure on
        training when an exporter is slow.
      flush_interval: seconds between drains of the queue when it is filling slowly, and
        between periodic ``flush()`` calls of an exporter that has written something.
      exporter_timeout: an exporter inside one call for longer than this is *stalled*: it is
        reported in ``status()["stalled"]`` and skipped (records for it are dropped and
        counted, and :meth:`flush` and :meth:`close` stop waiting for it) until the call returns.

    Example:
        >>> from sowtel.exporters.memory import MemoryExporter
        >>> memory = MemoryExporter()
        >>> dispatcher = Dispatcher([memory], convert=list, queue_size=100)
        >>> dispatcher.status()["received"]
        0
        >>> dispatcher.close()
    """

    def __init__(
        self,
        exporters: list[Any],
        *,
        convert: Callable[[list[Any]], list[Record]],
        queue_size: int = 10_000,
        max_bytes: int = 1 << 30,
        on_full: str = "drop",
        flush_interval: float = 0.5,
        exporter_timeout: float = 10.0,
    ) -> None:
        from sowtel.exporters import check_exporter

        if not isinstance(exporters, (list, tuple)):
            raise TypeError(
                f"exporters={exporters!r} must be a list of exporters "
                "(objects with write/flush/close); wrap a single one in a list"
            )
        exporters = [check_exporter(e) for e in exporters]
        if not callable(convert):
            raise TypeError(f"convert={convert!r} must be callable: list of items -> records")
        _check_count(queue_size, "queue_size")
        _check_count(max_bytes, "max_bytes")
        if on_full not in ON_FULL:
            raise ValueError(
                f"on_full={on_full!r} is not a policy: use one of {', '.join(ON_FULL)}"
            )
        _check_seconds(flush_interval, "flush_interval")
        _check_seconds(exporter_timeout, "exporter_timeout")

        self._convert = convert
        self._queue_size = queue_size
        self._max_bytes = max_bytes
        self._on_full = on_full
        self._flush_interval = float(flush_interval)
        self._exporter_timeout = float(exporter_timeout)
        # The queue drains as soon as this many items wait, else every flush_interval.
        self._wake_at = max(1, min(512, queue_size // 4))

        # One RLock under every condition: the SIGTERM handler runs on the main thread, which may
        # be interrupted while it holds the lock (put_records, flush), and must not deadlock.
        self._lock = threading.RLock()
        self._wake_cond = threading.Condition(self._lock)
        self._space_cond = threading.Condition(self._lock)
        self._progress_cond = threading.Condition(self._lock)
        self._items: list[Any] = []
        self._nbytes = 0
        self._accepted = 0
        self._dropped = 0
        self._dispatched = 0
        self._urgent = False
        self._space_waiters = 0
        self._closed = False
        self._stop = False
        self._close_started = False
        self._logged_full = False
        self._logged_closed = False

        self._records = 0
        self._convert_errors = 0
        self._unconverted = 0
        self._logged_convert = False
        self._first_nonfinite: tuple[int, str, str] | None = None

        self._workers = [
            _ExporterWorker(
                e, label, max_records=queue_size, max_bytes=max_bytes,
                flush_interval=self._flush_interval, timeout=self._exporter_timeout,
            )
            for e, label in zip(exporters, _labels(exporters), strict=True)
        ]
        self._thread = threading.Thread(target=self._run, name="sowtel-dispatcher", daemon=True)
        self._thread.start()
        self._own_threads = {self._thread.ident} | {w.ident for w in self._workers}
        _register(self)

    # -- the hot path ---------------------------------------------------------------------------

    def put(self, item: Any, nbytes: int = 0) -> bool:
        """Enqueues one raw item for ``convert``; safe from any thread. Returns True if accepted.

        Only appends to the queue: no conversion, no I/O. When the queue is full (``queue_size``
        items or ``max_bytes`` bytes), ``on_full="drop"`` counts a drop and returns False at once,
        ``"block"`` waits for room. After :meth:`close`, returns False.

        Example:
            >>> d = Dispatcher([], convert=lambda items: [])
            >>> d.put(("loss", 0), nbytes=8)
            True
            >>> d.close()
            >>> d.put(("loss", 1))
            False
        """
        with self._lock:
            n = len(self._items)
            if (n < self._queue_size and not self._closed
                    and (n == 0 or self._nbytes + nbytes <= self._max_bytes)):
                self._items.append(item)
                self._nbytes += nbytes
                self._accepted += 1
                if n + 1 == self._wake_at:
                    self._wake_cond.notify()
                return True
        return self._put_full(item, nbytes)

    def _put_full(self, item: Any, nbytes: int) -> bool:
        with self._lock:
            if self._closed:
                return self._refuse_closed()
            if self._on_full == "block" and threading.get_ident() not in self._own_threads:
                self._space_waiters += 1
                try:
                    while True:
                        n = len(self._items)
                        if self._closed:
                            return self._refuse_closed()
                        if n < self._queue_size and (
                            n == 0 or self._nbytes + nbytes <= self._max_bytes
                        ):
                            break
                        self._urgent = True
                        self._wake_cond.notify()
                        self._space_cond.wait(_POLL)
                finally:
                    self._space_waiters -= 1
                self._items.append(item)
                self._nbytes += nbytes
                self._accepted += 1
                return True
            # Also reached by a put from inside an exporter or convert in "block" mode, which
            # would otherwise wait for the very thread it runs on.
            self._dropped += 1
            if not self._logged_full:
                self._logged_full = True
                logger.warning(
                    "sowtel queue is full (%d items, %d bytes): dropping records and counting "
                    "them in status()['dropped']; raise queue_size / max_bytes, stream less "
                    "(summary, every=) or use on_full='block' to lose nothing",
                    len(self._items), self._nbytes,
                )
            return False

    def _refuse_closed(self) -> bool:
        self._dropped += 1
        if not self._logged_closed:
            self._logged_closed = True
            logger.warning("sowtel dispatcher is closed: dropping records that arrive after it")
        return False

    def put_records(self, records: Sequence[Record]) -> None:
        """Enqueues already-built records (they bypass ``convert``), under the same bounds.

        Example:
            >>> from sowtel.exporters.memory import MemoryExporter
            >>> from sowtel.records import Record
            >>> memory = MemoryExporter()
            >>> d = Dispatcher([memory], convert=list)
            >>> d.put_records([Record(name="w", mode="primal", tag="intermediates", step=3,
            ...                       index=None, wall_time=0.0, summary="shape", shape=(2,),
            ...                       dtype="float32")])
            >>> d.close()
            >>> [r.step for r in memory.records]
            [3]
        """
        for record in records:
            if not isinstance(record, Record):
                raise TypeError(
                    f"put_records() takes sowtel Record objects, got {type(record).__name__}: "
                    f"{record!r}; use put() for raw items that convert() turns into records"
                )
        for record in records:
            self.put(record, _record_nbytes(record))

    # -- the dispatcher thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if not (self._stop or self._urgent or len(self._items) >= self._wake_at):
                    self._wake_cond.wait(self._flush_interval)
                self._urgent = False
                items, self._items = self._items, []
                self._nbytes = 0
                stop = self._stop
                if self._space_waiters:
                    self._space_cond.notify_all()
            if items:
                try:
                    self._dispatch(items)
                except BaseException:  # the dispatcher thread must outlive any bug below it
                    self._convert_errors += 1
                    self._unconverted += len(items)
                    if not self._logged_convert:
                        self._logged_convert = True
                        logger.exception("sowtel dispatcher failed on a batch of %d items",
                                         len(items))
            with self._lock:
                self._dispatched += len(items)
                self._progress_cond.notify_all()
            if stop and not items:
                return

    def _to_records(self, items: list[Any]) -> list[Record]:
        # Records from put_records pass through; runs of raw items between them are converted,
        # so the order of everything accepted is kept.
        out: list[Record] = []
        raw: list[Any] = []
        for item in items:
            if isinstance(item, Record):
                if raw:
                    out.extend(self._convert_raw(raw))
                    raw = []
                out.append(item)
            else:
                raw.append(item)
        if raw:
            out.extend(self._convert_raw(raw))
        return out

    def _convert_raw(self, raw: list[Any]) -> Sequence[Record]:
        try:
            records = list(self._convert(raw))
            for record in records:
                if not isinstance(record, Record):
                    raise TypeError(f"convert() returned {type(record).__name__} {record!r} "
                                    "among its records; it must return sowtel Record objects")
            return records
        except Exception:
            self._convert_errors += 1
            self._unconverted += len(raw)
            if not self._logged_convert:
                self._logged_convert = True
                logger.exception(
                    "sowtel could not convert %d received items into records; they are lost, "
                    "counted in status()['unconverted'], and further failures are not logged",
                    len(raw),
                )
            return ()

    def _dispatch(self, items: list[Any]) -> None:
        records = tuple(self._to_records(items))
        if not records:
            return
        self._records += len(records)
        if self._first_nonfinite is None:
            for r in records:
                if _is_nonfinite(r):
                    self._first_nonfinite = (r.step, r.name, r.mode)
                    logger.warning("sowtel: first non-finite value at step %s in %s (%s)",
                                   r.step, r.name, r.mode)
                    break
        nbytes = sum(_record_nbytes(r) for r in records if r.value is not None)
        block = self._on_full == "block"
        for worker in self._workers:
            worker.offer(records, nbytes, block)

    # -- flush, close, status -------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Blocks until everything accepted so far reached every exporter and was flushed.

        Every item accepted before the call is converted and handed to every healthy exporter,
        then each exporter's ``flush()`` runs. Stalled exporters (see ``exporter_timeout``) are
        skipped. Returns False if that did not finish within ``timeout`` seconds (None: no limit)
        or if called from inside an exporter or ``convert``.

        Example:
            >>> from sowtel.exporters.memory import MemoryExporter
            >>> memory = MemoryExporter()
            >>> d = Dispatcher([memory], convert=lambda items: [], flush_interval=60.0)
            >>> d.put("item")
            True
            >>> d.flush(timeout=5.0)
            True
            >>> d.close()
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if threading.get_ident() in self._own_threads:
            logger.warning("sowtel: flush() called from inside an exporter or convert; ignored")
            return False
        with self._lock:
            target = self._accepted
            self._urgent = True
            self._wake_cond.notify()
            while self._dispatched < target:
                if not self._thread.is_alive():
                    return False
                step = _POLL * 4
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    step = min(step, left)
                self._progress_cond.wait(step)
        tokens = [(w, w.request("flush")) for w in self._workers if not w.stalled()]
        return all(w.wait(t, deadline) != "timeout" for w, t in tokens)

    def close(self, timeout: float | None = 30.0) -> None:
        """Stops accepting items, flushes everything accepted, then closes every exporter.

        Returns within about ``timeout`` seconds even if an exporter hangs. Idempotent: a second
        call returns at once.

        Example:
            >>> d = Dispatcher([], convert=list)
            >>> d.close()
            >>> d.close()
            >>> d.status()["closed"]
            True
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._close_started:
                return
            self._close_started = True
            self._closed = True
            self._space_cond.notify_all()
        try:
            self.flush(timeout)
            with self._lock:
                self._stop = True
                self._wake_cond.notify()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if threading.get_ident() not in self._own_threads:
                self._thread.join(left)
            tokens = [(w, w.request("close")) for w in self._workers]
            for worker, token in tokens:
                if worker.ident != threading.get_ident():  # an exporter closing its own session
                    worker.wait(token, deadline)
        finally:
            _unregister(self)

    def status(self) -> dict[str, Any]:
        """Counters for ``sowtel.status()``.

        Keys: ``received`` (items offered to put/put_records), ``dropped`` (refused: queue
        full or closed), ``queued`` (waiting now), ``records`` (made by convert or given to
        put_records), ``convert_errors`` and ``unconverted`` (failed convert calls, items they
        lost), per exporter label: ``exported`` (records written), ``errors`` (calls that raised),
        ``exporter_dropped`` (records not handed to it), ``pending`` (its backlog); ``stalled``
        (labels), ``first_nonfinite`` (``(step, name, mode)`` or None), ``closed``.

        Example:
            >>> d = Dispatcher([], convert=list)
            >>> sorted(d.status())[:3]
            ['closed', 'convert_errors', 'dropped']
            >>> d.close()
        """
        with self._lock:
            received = self._accepted + self._dropped
            dropped = self._dropped
            queued = len(self._items)
            closed = self._closed
        workers = self._workers
        return {
            "received": received,
            "dropped": dropped,
            "queued": queued,
            "records": self._records,
            "convert_errors": self._convert_errors,
            "unconverted": self._unconverted,
            "exported": {w.label: w.exported for w in workers},
            "errors": {w.label: w.errors for w in workers},
            "exporter_dropped": {w.label: w.dropped for w in workers},
            "pending": {w.label: w.pending for w in workers},
            "stalled": [w.label for w in workers if w.stalled()],
            "first_nonfinite": self._first_nonfinite,
            "closed": closed,
        }

    @property
    def exporters(self) -> list[Any]:
        """The exporters, in the order given."""
        return [w.exporter for w in self._workers]

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _forget_threads(self) -> None:
        # In a forked child the threads do not exist: refuse items and never wait for them.
        self._closed = self._stop = self._close_started = True


# -- process exit ---------------------------------------------------------------------------------

_live: dict[int, Dispatcher] = {}
_hooks_lock = threading.RLock()
_atexit_installed = False
_sigterm_installed = False
_previous_sigterm: Any = None


def _register(dispatcher: Dispatcher) -> None:
    global _atexit_installed, _sigterm_installed, _previous_sigterm
    with _hooks_lock:
        _live[id(dispatcher)] = dispatcher
        if not _atexit_installed:
            atexit.register(close_all)
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _atexit_installed = True
        # Signal handlers can only be installed from the main thread; a dispatcher made
        # elsewhere leaves it to the next one made on the main thread.
        if not _sigterm_installed and threading.current_thread() is threading.main_thread():
            try:
                previous = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, _on_sigterm)
            except (ValueError, OSError):
                return
            _previous_sigterm = previous
            _sigterm_installed = True


def _unregister(dispatcher: Dispatcher) -> None:
    with _hooks_lock:
        _live.pop(id(dispatcher), None)


def _after_fork_in_child() -> None:
    for dispatcher in list(_live.values()):
        dispatcher._forget_threads()
    _live.clear()


def close_all(timeout: float | None = None) -> None:
    """Flushes and closes every live dispatcher within ``timeout`` seconds in all.

    Runs at interpreter exit and on SIGTERM (with :data:`EXIT_TIMEOUT`); safe to call any time.

    Example:
        >>> close_all(timeout=5.0)
    """
    if timeout is None:
        timeout = EXIT_TIMEOUT
    deadline = time.monotonic() + timeout
    with _hooks_lock:
        dispatchers = list(_live.values())
    for dispatcher in dispatchers:
        try:
            dispatcher.close(max(0.0, deadline - time.monotonic()))
        except Exception:  # SystemExit from a chained SIGTERM handler must go through
            logger.exception("sowtel could not close a dispatcher at exit")


def _on_sigterm(signum: int, frame: Any) -> None:
    close_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # There was no Python handler: terminate the way SIGTERM would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    os._exit(128 + signal.SIGTERM)
