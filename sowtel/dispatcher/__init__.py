"""The host side of live streaming: a bounded queue, a dispatcher thread, a worker per exporter.

Values leave the compiled program through host callbacks, which run on JAX's own threads,
several at once and in no fixed order. Those threads must get back to JAX at once, so the
receiver only calls :meth:`Dispatcher.put`, which appends to a bounded queue and returns. A
dispatcher thread drains the queue in batches, turns raw items into :class:`~sowtel.records.Record`
objects with the ``convert`` function it was given, and hands each batch to every exporter.

Each exporter has its own worker thread and its own bounded backlog, so an exporter that raises
or hangs never stops the others nor training. Exporters see no threads: ``write``, ``flush`` and
``close`` of one exporter are always called from its one worker thread.

Every record received ends, for each exporter, in exactly one of ``exported``, ``dropped`` (with
its reason), ``failed`` (a call raised) or ``late`` (counted by the session), or is still
``pending``: :func:`accounts` checks ``received == exported + dropped + failed + late +
pending``, and ``pending`` is 0 after :meth:`Dispatcher.flush` and :meth:`Dispatcher.close`.

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

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from sowtel import _exit, errors
from sowtel._exit import EXIT_TIMEOUT, close_all, sigterm_unhandled
from sowtel.dispatcher._ledger import accounts, merge_reasons
from sowtel.dispatcher._worker import POLL, WRITE_BYTES, WRITE_RECORDS, ExporterWorker, Wait
from sowtel.records import Record
from sowtel.to_records import RecordBatch, record_nbytes

__all__ = [
    "Dispatcher", "ON_FULL", "EXIT_TIMEOUT", "DROP_REASONS", "WRITE_RECORDS", "WRITE_BYTES",
    "BATCH_RECORDS",
    "accounts", "labels", "close_all", "sigterm_unhandled",
]

logger = logging.getLogger("sowtel")

#: What :meth:`Dispatcher.put` does when the queue is full.
ON_FULL: tuple[str, ...] = ("drop", "block")


#: The dispatcher thread takes at most this many records off the queue at a time (plus one
#: item: a ``sowtel.jit`` step is never cut), converts them and offers them to every exporter.
BATCH_RECORDS = 4096
# How often waits that cannot be woken by a notification re-check for stalled exporters.
_POLL = POLL  # the worker's poll interval, for the waits here too

#: Why records were dropped (``status()["drop_reasons"]``).
DROP_REASONS: tuple[str, ...] = (
    "queue_full", "backlog_full", "stalled", "closed", "close_timeout",
)


def _check_count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise errors.BadOptionError(name, value, "must be a positive integer")
    return value


def _check_seconds(value: Any, name: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 < value < float("inf"):
        raise errors.BadOptionError(name, value, "must be a positive, finite number of seconds")
    return float(value)


_record_nbytes = record_nbytes


def labels(exporters: Sequence[Any]) -> list[str]:
    """The name each exporter is reported under: its ``label``, else its class name, made unique.

    A repeated name gets ``#2``, ``#3``, ... in order, so ``status()`` and the drop counts can
    tell two exporters of one kind apart.

    Example:
        >>> from sowtel.exporters.memory import MemoryExporter
        >>> labels([MemoryExporter(), MemoryExporter()])
        ['memory', 'memory#2']
    """
    taken: list[str] = []
    for exporter in exporters:
        base = getattr(exporter, "label", None)
        if not isinstance(base, str) or not base:
            base = type(exporter).__name__
        label, n = base, 1
        while label in taken:
            n += 1
            label = f"{base}#{n}"
        taken.append(label)
    return taken


class Dispatcher:
    """Moves items from host callbacks to exporters without ever stalling training.

    Args:
      exporters: objects with ``write(records)``, ``flush()`` and ``close()`` (and optionally
        ``write_batch(batch)``, which then gets each write as a
        :class:`~sowtel.to_records.RecordBatch`).
      convert: turns a list of raw items given to :meth:`put` into a list of records or a
        :class:`~sowtel.to_records.RecordBatch`; runs on the dispatcher thread. If it raises,
        that batch is lost, counted in ``status()`` and logged once.
      queue_size: the most records waiting in the queue and the batch being converted (under
        ``"block"``: and the largest backlog), plus one item. What waits for any one exporter,
        its backlog included, stays within ``queue_size`` plus one item and one batch: under
        ``"drop"`` a backlog that would pass it sheds its oldest whole items (counted as
        ``"backlog_full"`` for that exporter only).
      max_bytes: the most bytes of full values (the ``nbytes`` given to :meth:`put`, then the
        records' own) held anywhere from :meth:`put` until the last exporter is done with them:
        queued, being converted, in backlogs, being written. An item is accepted only if it
        fits, or if nothing else is held, so at most ``max_bytes`` plus one item is held.
      on_full: ``"drop"`` counts and refuses items when the queue is full; ``"block"`` makes
        :meth:`put` wait for room, so nothing is lost, at the price of back-pressure on
        training when an exporter is slow.
      flush_interval: seconds between drains of the queue when it is filling slowly, and
        between periodic ``flush()`` calls of an exporter that has written something.
      exporter_timeout: an exporter inside one call for longer than this is *stalled* and
        given up on: it is reported in ``status()["stalled"]``, its backlog and the records of
        that call are counted as dropped, records for it are dropped and counted, and
        :meth:`flush` and :meth:`close` stop waiting for it, until the call returns. Writes
        are bounded (:data:`WRITE_RECORDS` records, :data:`WRITE_BYTES` bytes) and sized to
        last about a twentieth of this at the exporter's measured pace, so an exporter that
        keeps making progress is not taken for a hung one.
      alerts: returns the alerts fired since it was last called (:mod:`sowtel.alerts`); each
        exporter with a ``write_alerts(alerts)`` method gets them on its own thread, behind
        the records they were judged on.
      clock: the seconds every timeout, interval and stall is measured in (a monotonic
        clock); ``wait(condition, timeout)`` does every timed wait, in seconds of that clock,
        like :meth:`threading.Condition.wait`. Both are for tests that drive time by hand.

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
        convert: Callable[[list[Any]], Sequence[Record] | RecordBatch],
        queue_size: int = 10_000,
        max_bytes: int = 1 << 30,
        on_full: str = "drop",
        flush_interval: float = 0.5,
        exporter_timeout: float = 10.0,
        alerts: Callable[[], Sequence[Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Wait = threading.Condition.wait,
    ) -> None:
        from sowtel.exporters import check_distinct, check_exporter

        if not isinstance(exporters, (list, tuple)):
            raise errors.BadOptionTypeError(
                "exporters", exporters, "must be a list of exporters "
                "(objects with write/flush/close); wrap a single one in a list"
            )
        exporters = [check_exporter(e) for e in exporters]
        check_distinct(exporters)
        if not callable(convert):
            raise errors.BadOptionTypeError(
                "convert", convert, "must be callable: list of items -> records")
        _check_count(queue_size, "queue_size")
        _check_count(max_bytes, "max_bytes")
        if on_full not in ON_FULL:
            raise errors.BadOptionError(
                "on_full", on_full, f"is not a policy: use one of {', '.join(ON_FULL)}"
            )
        _check_seconds(flush_interval, "flush_interval")
        _check_seconds(exporter_timeout, "exporter_timeout")
        for value, what in ((clock, "clock"), (wait, "wait")):
            if not callable(value):
                raise errors.BadOptionTypeError(what, value, "must be callable")

        self._clock = clock
        self._wait = wait

        self._convert = convert
        self._alerts = alerts
        self._logged_alerts = False
        self._queue_size = queue_size
        self._max_bytes = max_bytes
        self._on_full = on_full
        self._flush_interval = float(flush_interval)
        self._exporter_timeout = float(exporter_timeout)
        # The queue drains as soon as this many records wait, else every flush_interval.
        self._wake_at = max(1, min(512, queue_size // 4))

        # One RLock under every condition: the SIGTERM handler runs on the main thread, which may
        # be interrupted while it holds the lock (put_records, flush), and must not deadlock.
        # Lock order: this lock, then a worker's; a worker never takes this lock holding its own.
        self._lock = threading.RLock()
        self._wake_cond = threading.Condition(self._lock)
        self._space_cond = threading.Condition(self._lock)
        self._progress_cond = threading.Condition(self._lock)
        self._block = on_full == "block"
        # Queued (item, records, nbytes), and the records they hold.
        self._items: deque[tuple[Any, int, int]] = deque()
        self._queued = 0
        self._backlog = 0  # the largest exporter backlog
        self._in_hand = 0  # the records of the batch being converted
        self._batch_records = min(queue_size, BATCH_RECORDS)
        # In records, as put() declared them: accepted, taken off the queue, and dealt with.
        self._accepted = 0
        self._taken = 0
        self._dispatched = 0
        self._urgent = False
        self._space_waiters = 0
        self._closed = False
        self._stop = False
        self._close_started = False
        self._logged_full = False
        self._logged_closed = False

        # The accounting, in records: every record received ends in exactly one place.
        self._queue_drops: dict[str, int] = {}  # refused by put(), or given up on by close()
        self._extra = 0  # records convert made beyond those declared (a received item counts
        # as the records it became)
        self._records = 0  # made by convert (or given to put_records), handed to the workers
        self._convert_errors = 0
        self._unconverted = 0  # items
        self._unconverted_records = 0
        self._logged_convert = False
        # max_bytes bounds every byte of full values from put() until the last exporter is
        # done with the record: queued and in the dispatcher's hands (here), and in every
        # backlog (each worker's held_bytes).
        self._live_bytes = 0
        self._hand: list[Any] | None = None  # the batch being converted: [records, nbytes, lost]

        self._workers = [
            ExporterWorker(
                e, label, max_records=queue_size, flush_interval=self._flush_interval,
                timeout=self._exporter_timeout, release=self._release, clock=clock, wait=wait,
            )
            for e, label in zip(exporters, labels(exporters), strict=True)
        ]
        self._thread = threading.Thread(target=self._run, name="sowtel-dispatcher", daemon=True)
        self._thread.start()
        self._own_threads = {self._thread.ident} | {w.ident for w in self._workers}
        _exit.register(self)
        _exit.after_fork(self)
        for worker in self._workers:
            _exit.after_fork(worker)

    # -- the hot path ---------------------------------------------------------------------------

    def put(self, item: Any, nbytes: int = 0, records: int = 1) -> bool:
        """Enqueues one raw item for ``convert``; safe from any thread. Returns True if accepted.

        Only appends to the queue: no conversion, no I/O. ``nbytes`` is the size of the full
        values the item holds, ``records`` how many records ``convert`` will make of it (a
        ``sowtel.jit`` step counts as every record it makes). The queue is full when
        ``queue_size`` records wait in it and in the batch being converted (with
        ``on_full="block"``: anywhere between put and the exporters, backlogs included), or
        ``max_bytes`` bytes of full values are held anywhere in the dispatcher; an item is taken
        while fewer wait, so at most ``queue_size`` records plus one item wait. Under
        ``"drop"``, taking it may make a lagging exporter's backlog shed its oldest items. When
        full, ``on_full="drop"`` counts the item's records as dropped and returns False at
        once, ``"block"`` waits for room. After :meth:`close`, returns False.

        Example:
            >>> d = Dispatcher([], convert=lambda items: [])
            >>> d.put(("loss", 0), nbytes=8)
            True
            >>> d.close()
            >>> d.put(("loss", 1))
            False
        """
        with self._lock:
            before = self._queued
            # _has_room, inlined: this runs once per host callback.
            if (before + self._in_hand + self._backlog < self._queue_size and not self._closed
                    and (nbytes == 0 or self._bytes_fit(nbytes))):
                self._items.append((item, records, nbytes))
                self._queued = queued = before + records
                self._accepted += records
                if nbytes:
                    self._live_bytes += nbytes
                    if self._live_bytes * 4 >= self._max_bytes:  # full values: move them early
                        self._wake_cond.notify()
                if before < self._wake_at <= queued:
                    self._wake_cond.notify()
                return True
        accepted = self._put_full(item, nbytes, records)
        if not accepted and self._closed and threading.get_ident() not in self._own_threads:
            _exit.wait_if_ending()  # SIGTERM is ending the process: never return as if kept
        return accepted

    def _waiting(self) -> int:
        """Records waiting: in the queue, being converted, and in the largest backlog (lock
        held). Under "block" a put waits while they reach ``queue_size``; under "drop" the
        queue takes an item while it and the batch being converted hold fewer, and a backlog
        that would make the sum exceed it by more than one step and one batch sheds its oldest
        steps (:meth:`_shed`)."""
        return self._queued + self._in_hand + self._backlog

    def _note_backlogs(self) -> None:
        # The largest backlog, kept for put(): refreshed whenever a backlog grows (an offer)
        # or shrinks (a worker let go of records). Under the lock: a worker's release and the
        # dispatcher's offer refresh it from two threads, and an unlocked read-then-write
        # could leave a stale, larger value that no later release corrects.
        with self._lock:
            self._backlog = max((w.pending for w in self._workers), default=0)

    def _shed(self, records: int) -> None:
        """Under "drop", after the queue took an item of ``records`` records (lock held): a
        backlog that would make what waits for its exporter (queued, being converted, in the
        backlog) exceed ``queue_size`` plus that step and one batch sheds its oldest whole
        steps (``"backlog_full"``). An exporter that keeps up holds at most the batch just
        given to it and is never shed; only the one that fell behind loses records."""
        room = self._queue_size + records + self._batch_records - self._queued - self._in_hand
        released = 0
        for worker in self._workers:
            if worker.pending > room:
                released += worker.shed(room)
        self._note_backlogs()
        if released and self._space_waiters:
            self._space_cond.notify_all()

    def held_bytes(self) -> int:
        """Bytes of full values held now: queued, being converted, and by the exporters' workers
        (the largest holder: every worker is given the same records)."""
        return self._live_bytes + max((w.held_bytes for w in self._workers), default=0)

    def _has_room(self, nbytes: int) -> bool:
        self._note_backlogs()  # a waiting producer reads the backlogs as they are now
        if self._waiting() >= self._queue_size:
            return False
        return nbytes == 0 or self._bytes_fit(nbytes)

    def _bytes_fit(self, nbytes: int) -> bool:
        held = self.held_bytes()
        return held == 0 or held + nbytes <= self._max_bytes

    def _put_full(self, item: Any, nbytes: int, records: int) -> bool:
        with self._lock:
            if self._closed:
                return self._refuse("closed", records)
            if (not self._block and self._queued + self._in_hand < self._queue_size
                    and (nbytes == 0 or self._bytes_fit(nbytes))):
                # The queue has room; a backlog that has not makes room by shedding.
                self._items.append((item, records, nbytes))
                self._queued += records
                self._live_bytes += nbytes
                self._accepted += records
                self._shed(records)
                if self._queued >= self._wake_at or (
                        nbytes and self._live_bytes * 4 >= self._max_bytes):
                    self._wake_cond.notify()
                return True
            if self._block and threading.get_ident() not in self._own_threads:
                self._space_waiters += 1
                try:
                    while not self._has_room(nbytes):
                        if self._closed:
                            return self._refuse("closed", records)
                        self._urgent = True
                        self._wake_cond.notify()
                        self._wait(self._space_cond, _POLL)
                    if self._closed:
                        return self._refuse("closed", records)
                finally:
                    self._space_waiters -= 1
                self._items.append((item, records, nbytes))
                self._queued += records
                self._live_bytes += nbytes
                self._accepted += records
                return True
            # Also reached by a put from inside an exporter or convert in "block" mode, which
            # would otherwise wait for the very thread it runs on.
            self._refuse("queue_full", records)
            self._urgent = True  # drain now rather than at the next interval
            self._wake_cond.notify()
            if not self._logged_full:
                self._logged_full = True
                logger.warning(
                    "sowtel queue is full (%d records waiting, %d bytes of full values held): "
                    "dropping whole items (a sowtel.jit step at a time) and counting their "
                    "records in status()['dropped']; raise queue_size / max_bytes, stream less "
                    "(summary, every=) or use on_full='block' to lose nothing",
                    self._waiting(), self.held_bytes(),
                )
            return False

    def _refuse(self, reason: str, records: int) -> bool:
        self._queue_drops[reason] = self._queue_drops.get(reason, 0) + records
        if reason == "closed" and not self._logged_closed:
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

    def _release(self, nbytes: int) -> None:
        """A worker let go of records (``nbytes`` of full values): producers may have room."""
        with self._lock:
            self._note_backlogs()
            if self._space_waiters:
                self._space_cond.notify_all()

    # -- the dispatcher thread ----------------------------------------------------------------

    def _run(self) -> None:
        more = False
        while True:
            with self._lock:
                if not (more or self._stop or self._urgent or self._queued >= self._wake_at):
                    self._wait(self._wake_cond, self._flush_interval)
                items: list[tuple[Any, int]] = []
                declared = nbytes = 0
                # One batch at a time, of whole items: at most BATCH_RECORDS records plus one
                # item, so a backlog, a conversion and a write never grow with the queue.
                while self._items and (not items or declared < self._batch_records):
                    item, n, b = self._items.popleft()
                    items.append((item, n))
                    declared += n
                    nbytes += b
                self._queued -= declared
                self._taken += declared
                self._hand = [declared, nbytes, False] if items else None
                self._in_hand = declared
                more = bool(self._items)
                if not more:
                    self._urgent = False
                stop = self._stop
                if self._space_waiters:
                    self._space_cond.notify_all()
            for worker in self._workers:
                worker.stalled()  # gives up on a hung exporter even when nobody waits for it
            _exit.watch_sigterm()
            if items:
                try:
                    self._dispatch(items)
                except BaseException:  # the dispatcher thread must outlive any bug below it
                    with self._lock:
                        hand, self._hand = self._hand, None
                        self._in_hand = 0
                        if hand is not None and not hand[2]:
                            self._convert_errors += 1
                            self._unconverted += len(items)
                            self._unconverted_records += hand[0]
                            self._live_bytes -= hand[1]
                    if not self._logged_convert:
                        self._logged_convert = True
                        logger.exception("sowtel dispatcher failed on a batch of %d items",
                                         len(items))
            self._tell_alerts()
            took = bool(items)
            # The workers hold the records now (and count their bytes): none kept here while
            # waiting for the next batch, where no bound would count them.
            items = []
            with self._lock:
                self._dispatched += declared
                self._progress_cond.notify_all()
                if self._space_waiters:
                    self._space_cond.notify_all()
            if stop and not took and not more:
                return

    def _to_batch(
        self, items: list[tuple[Any, int]],
    ) -> tuple[RecordBatch, int, int, int]:
        """The records of ``items``; how many more records than declared the converted items
        made; and the items and declared records of runs that failed to convert.

        Records from put_records pass through; runs of raw items between them are converted,
        so the order of everything accepted is kept.
        """
        parts: list[Any] = []
        passed: list[Record] = []
        extra = failed_items = failed_records = 0
        start = 0
        for i, entry in enumerate([*items, None]):
            if entry is not None and not isinstance(entry[0], Record):
                continue
            if start < i:
                run = items[start:i]
                declared = sum(n for _, n in run)
                made = self._convert_raw([item for item, _ in run])
                if made is not None:
                    if passed:
                        parts.append(tuple(passed))
                        passed = []
                    parts.extend(made.parts)
                    extra += len(made) - declared
                else:
                    failed_items += len(run)
                    failed_records += declared
            if entry is not None:
                passed.append(entry[0])
            start = i + 1
        if passed:
            parts.append(tuple(passed))
        return RecordBatch(parts), extra, failed_items, failed_records

    def _convert_raw(self, raw: list[Any]) -> RecordBatch | None:
        try:
            made = self._convert(raw)
            if isinstance(made, RecordBatch):
                return made
            records = tuple(made)
            for record in records:
                if not isinstance(record, Record):
                    raise TypeError(f"convert() returned {type(record).__name__} {record!r} "
                                    "among its records; it must return sowtel Record objects "
                                    "or a sowtel.to_records.RecordBatch")
            return RecordBatch([records])
        except Exception:
            with self._lock:
                self._convert_errors += 1
            if not self._logged_convert:
                self._logged_convert = True
                logger.exception(
                    "sowtel could not convert %d received items into records; they are lost, "
                    "counted in status()['failed'] (and ['unconverted']), and further failures "
                    "are not logged", len(raw),
                )
            return None

    def _dispatch(self, items: list[tuple[Any, int]]) -> None:
        batch, extra, failed_items, failed_records = self._to_batch(items)
        nbytes = batch.nbytes()
        with self._lock:
            hand, self._hand = self._hand, None
            if hand is None or hand[2]:
                self._in_hand = 0
                return  # close() gave up on this batch and counted it as dropped
            # Converted items count as the records they became; failed ones as declared.
            self._extra += extra
            if failed_items:
                self._unconverted += failed_items
                self._unconverted_records += failed_records
            self._records += len(batch)
        try:
            if not len(batch):
                return
            for worker in self._workers:
                worker.offer(batch, nbytes, self._block)
            self._note_backlogs()
        finally:
            with self._lock:
                # Now the workers hold the full values (each its own count), and the records:
                # counted here until then, so that no moment counts them nowhere.
                self._live_bytes -= hand[1]
                self._in_hand = 0

    # -- flush, close, status -------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Blocks until everything accepted so far reached every exporter and was flushed.

        Every item accepted before the call is converted and handed to every exporter, then
        each exporter's ``flush()`` runs. An exporter given up on as stalled (see
        ``exporter_timeout``) is not waited for: what it was given is counted as dropped.
        Returns False if that did not finish within ``timeout`` seconds (None: no limit) or if
        called from inside an exporter or ``convert``.

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
        deadline = None if timeout is None else self._clock() + timeout
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
                    left = deadline - self._clock()
                    if left <= 0:
                        return False
                    step = min(step, left)
                self._wait(self._progress_cond, step)
        self._tell_alerts()  # what sowtel.log fired on this thread, behind its records
        tokens = [(w, w.request("flush")) for w in self._workers if not w.stalled()]
        return all(w.wait(t, deadline) != "timeout" for w, t in tokens)

    def _tell_alerts(self) -> None:
        if self._alerts is None:
            return
        try:
            fired = tuple(self._alerts())
        except Exception:  # noqa: BLE001 - alerts must never stop the dispatcher
            if not self._logged_alerts:
                self._logged_alerts = True
                logger.exception("sowtel could not hand alerts to the exporters (logged once)")
            return
        if fired:
            for worker in self._workers:
                worker.tell(fired)

    def convert_now(self) -> None:
        """Asks the dispatcher thread to take what waits in the queue now, without waiting for
        it (as :meth:`flush` does before it waits): the guard of ``on_nonfinite`` uses it so
        that a step's records are checked soon after the step.

        Example:
            >>> d = Dispatcher([], convert=lambda items: [], flush_interval=60.0)
            >>> d.convert_now()
            >>> d.close()
        """
        with self._lock:
            self._urgent = True
            self._wake_cond.notify()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stops accepting items, flushes everything accepted, then closes every exporter.

        Returns within about ``timeout`` seconds even if an exporter hangs or has a long
        backlog: when the time is up, what is still queued is counted as dropped (reason
        ``"close_timeout"``), and so are the records of a write still in progress. That write
        may still finish after close() returns; then the exporter's ``close()`` is called, and
        nothing else. Idempotent: a second call returns at once.

        Example:
            >>> d = Dispatcher([], convert=list)
            >>> d.close()
            >>> d.close()
            >>> d.status()["closed"]
            True
        """
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            if self._close_started:
                return
            self._close_started = True
            self._closed = True
            self._space_cond.notify_all()
        inside = threading.get_ident() in self._own_threads
        try:
            self.flush(timeout)
            with self._lock:
                self._stop = True
                self._wake_cond.notify()
            left = None if deadline is None else max(0.0, deadline - self._clock())
            if not inside:
                self._thread.join(left)
            tokens = [(w, w.request("close")) for w in self._workers]
            for worker, token in tokens:
                if worker.ident != threading.get_ident():  # an exporter closing its own session
                    worker.wait(token, deadline)
            self._give_up()
            if not inside:
                # Given up on, the dispatcher thread has nothing left to wait for.
                self._thread.join(_POLL * 4)
                for worker in self._workers:
                    worker.join(_POLL)
        finally:
            _exit.unregister(self)

    def _give_up(self) -> None:
        """Counts whatever close() could not deliver in time as dropped (``close_timeout``)."""
        with self._lock:
            queued = self._accepted - self._taken
            self._taken += queued
            self._dispatched += queued  # nothing more will come of them: flush() must not wait
            n = queued
            if self._hand is not None:
                n += self._hand[0]
                self._hand[2] = True  # the dispatcher thread will not deliver it
                self._live_bytes -= self._hand[1]
                self._hand = None
                self._in_hand = 0
            self._live_bytes -= sum(b for _, _, b in self._items)
            self._items.clear()
            self._queued = 0
            if n:
                self._queue_drops["close_timeout"] = self._queue_drops.get("close_timeout", 0) + n
        for worker in self._workers:
            # An exporter closing its own session from inside write() is not given up on: its
            # worker writes what it still has, then closes it, once that call returns.
            if worker.ident != threading.get_ident():
                worker.give_up()

    def status(self, late: int = 0) -> dict[str, Any]:
        """Counters for ``sowtel.status()``, in records.

        One snapshot: every count is read at one moment, so ``exported`` never exceeds
        ``received`` and ``pending`` is never negative.

        Keys: ``received`` (records of the items offered to put/put_records), ``dropped``
        (refused: queue full or closed, or given up on at close), ``queued`` (items waiting
        now), ``queued_records`` (the records they hold, and those being converted),
        ``records`` (made by convert or given to put_records), ``convert_errors`` and
        ``unconverted`` (failed convert calls, items they lost), ``late`` (records whose
        callback came after the session ended: given by the session); per exporter label:
        ``exported`` (records written), ``failed`` (records of writes that raised),
        ``errors`` (calls that raised), ``exporter_dropped`` (records not written for a
        reason of that exporter's own), ``drop_reasons`` (every dropped record on that
        exporter's way, by reason), ``pending`` (its backlog); ``accounts`` (per label and
        ``"total"``: ``received == exported + dropped + failed + late + pending``), ``stalled``
        (labels), ``first_nonfinite`` (always None here: a session fills it in, from its
        conversion), ``closed``.

        Example:
            >>> from sowtel.exporters.memory import MemoryExporter
            >>> d = Dispatcher([MemoryExporter()], convert=list)
            >>> d.put_records([Record(name="w", mode="primal", tag="intermediates", step=0,
            ...                       index=None, wall_time=0.0, summary="shape", shape=(),
            ...                       dtype="float32")])
            >>> d.close()
            >>> d.status()["accounts"]["memory"]
            {'received': 1, 'exported': 1, 'dropped': 0, 'failed': 0, 'late': 0, 'pending': 0}
        """
        workers = self._workers
        stalled = [w.label for w in workers if w.stalled()]
        with self._lock:
            queue_drops = dict(self._queue_drops)
            refused = queue_drops.get("queue_full", 0) + queue_drops.get("closed", 0)
            received = self._accepted + refused + self._extra
            queued = len(self._items)
            hand = self._hand
            queued_records = self._accepted - self._taken + (hand[0] if hand is not None else 0)
            records = self._records
            unconverted_records = self._unconverted_records
            closed = self._closed
            held_bytes = self.held_bytes()
            # Under the dispatcher's lock (the lock order allows it): records move from the
            # queue to the workers only under it, so the counts below match the ones above.
            counts = {w.label: w.counts() for w in workers}
        status: dict[str, Any] = {
            "received": received,
            "dropped": sum(queue_drops.values()),
            "queued": queued,
            "queued_records": queued_records,
            "records": records,
            "convert_errors": self._convert_errors,
            "unconverted": self._unconverted,
            "late": late,
            "exported": {k: c[0] for k, c in counts.items()},
            "failed": {k: c[1] + unconverted_records for k, c in counts.items()},
            "errors": {k: c[2] for k, c in counts.items()},
            "exporter_dropped": {k: c[5] for k, c in counts.items()},
            "drop_reasons": {k: merge_reasons(queue_drops, c[4]) for k, c in counts.items()},
            # Everything on its way to each exporter: queued, being converted, in its backlog.
            "pending": {k: records - (c[0] + c[1] + c[5]) + queued_records
                        for k, c in counts.items()},
            "backlog": {k: c[3] for k, c in counts.items()},
            "held_bytes": held_bytes,
            "stalled": stalled,
            "first_nonfinite": None,  # the session's conversion detects it (sowtel.session)
            "closed": closed,
        }
        status["accounts"] = accounts(status)
        return status


    @property
    def exporters(self) -> list[Any]:
        """The exporters, in the order given."""
        return [w.exporter for w in self._workers]

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _after_fork(self) -> None:
        # In a forked child the threads do not exist and a lock one of them held stays held:
        # fresh locks; refuse items, and never wait for the threads.
        self._lock = threading.RLock()
        self._wake_cond = threading.Condition(self._lock)
        self._space_cond = threading.Condition(self._lock)
        self._progress_cond = threading.Condition(self._lock)
        self._space_waiters = 0
        self._closed = self._stop = self._close_started = True
