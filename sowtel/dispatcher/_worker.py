"""One exporter, its bounded backlog, and the only thread that ever calls it.

The dispatcher (:mod:`sowtel.dispatcher`) offers each converted batch to every exporter's
:class:`ExporterWorker`; the worker writes it in bounded writes sized to the exporter's pace,
flushes on schedule, gives up on an exporter stuck in one call for longer than its timeout, and
counts where every record it was offered went (exported, failed, dropped by reason, pending).

Example:
    >>> from sowtel.dispatcher._worker import ExporterWorker
    >>> from sowtel.exporters.memory import MemoryExporter
    >>> from sowtel.to_records import RecordBatch
    >>> worker = ExporterWorker(MemoryExporter(), "memory", max_records=10, flush_interval=0.5,
    ...                         timeout=10.0, release=lambda nbytes: None)
    >>> worker.offer(RecordBatch([]), 0, block=False)
    True
    >>> worker.wait(worker.request("close"), deadline=None)
    'done'
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sowtel.to_records import RecordBatch

__all__ = ["ExporterWorker", "Token", "Wait", "WRITE_RECORDS", "WRITE_BYTES", "POLL"]

logger = logging.getLogger("sowtel")

#: One ``write()`` gets at most this many records, and at most :data:`WRITE_BYTES` bytes of full
#: values (always at least one record): bounded calls let a stall be told from slow progress.
WRITE_RECORDS = 1024
#: See :data:`WRITE_RECORDS`.
WRITE_BYTES = 16 << 20
# The first write of an exporter, before its pace is known, holds at most this many records.
_FIRST_WRITE = 64
# Writes are sized to last about this fraction of exporter_timeout at the exporter's pace.
_WRITE_SHARE = 1 / 20
#: How often waits that cannot be woken by a notification re-check for stalled exporters.
POLL = 0.05

#: A timed wait: ``wait(condition, timeout)`` waits on ``condition`` (whose lock is held) for a
#: notification or until ``timeout`` seconds of the clock passed (``None``: no timeout), as
#: :meth:`threading.Condition.wait` does.
Wait = Callable[[threading.Condition, float | None], object]


class Token:
    """A flush or close request travelling through one worker's queue behind the records, or
    (kind ``"alerts"``) alerts for the exporter's ``write_alerts``, behind the records they
    were judged on."""

    __slots__ = ("kind", "done", "alerts")

    def __init__(self, kind: str, alerts: tuple[Any, ...] = ()) -> None:
        self.kind = kind
        self.done = False
        self.alerts = alerts


class Backlogged:
    """Records waiting in a worker's backlog, and the bytes of full values among them.

    ``started`` once a write took the first part of them: the rest is never shed, so a step
    is written whole or dropped whole.
    """

    __slots__ = ("records", "nbytes", "started")

    def __init__(self, records: RecordBatch, nbytes: int) -> None:
        self.records = records
        self.nbytes = nbytes
        self.started = False


class ExporterWorker:
    """One exporter, its bounded backlog, and the only thread that ever calls it.

    Every record offered ends in exactly one of ``exported``, ``failed`` (its write raised) or
    ``dropped`` (by reason), or is still ``pending``. ``held_bytes`` counts the full values the
    worker holds; ``release(nbytes)`` is called whenever it let go of records (written, failed
    or dropped), so the dispatcher can wake producers waiting for room; it is never called
    while this worker's lock is held.

    An exporter with a ``write_batch(batch)`` method gets each write as a
    :class:`~sowtel.to_records.RecordBatch`; one with only ``write(records)`` gets a list of
    records, built then.
    """

    def __init__(
        self, exporter: Any, label: str, *, max_records: int, flush_interval: float,
        timeout: float, release: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic, wait: Wait = threading.Condition.wait,
    ) -> None:
        self.exporter = exporter
        # Every duration here (stalls, the flush interval, a write's pace) is read from clock,
        # and every timed wait goes through wait(condition, timeout), so a test can drive time.
        self._clock = clock
        self._wait = wait
        self.label = label
        batch_method = getattr(exporter, "write_batch", None)
        self._write: Callable[[RecordBatch], Any] = (
            batch_method if callable(batch_method)
            else lambda batch: exporter.write(batch.records()))
        self.held_bytes = 0
        self.exported = 0
        self.failed = 0
        self.errors = 0
        self.pending = 0
        self.drop_reasons: dict[str, int] = {}
        self._max_records = max_records
        self._flush_interval = flush_interval
        self._timeout = timeout
        self._release = release
        # A Condition over an RLock: the SIGTERM handler may run on a thread that holds it.
        self._cond = threading.Condition()
        self._queue: deque[Backlogged | Token] = deque()
        self._writing: RecordBatch | None = None  # the records of the write in progress
        self._writing_bytes = 0
        self._busy_since: float | None = None
        self._busy_in = ""
        self._seconds_per_record: float | None = None
        self._accepting = True
        self._abandoned = False  # given up on while inside a call; its records were counted
        self._given_up = False  # given up on for good by close(): only close() is called next
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

    @property
    def dropped(self) -> int:
        return sum(self.drop_reasons.values())

    def _after_fork(self) -> None:
        # In a forked child this worker's thread does not exist: a fresh lock, and nothing to
        # wait for (flush and close answer at once).
        self._cond = threading.Condition()
        self._accepting = False
        self._finished = True
        for entry in self._queue:
            if isinstance(entry, Token):
                entry.done = True

    def _drop(self, reason: str, n: int) -> None:
        if n:
            self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + n

    # -- stalls -------------------------------------------------------------------------------

    def stalled(self) -> bool:
        """True while the exporter is given up on: one call has lasted longer than the timeout.

        The first time it is seen, everything queued for the exporter and the records of the
        call it is stuck in are counted as dropped (reason ``"stalled"``) and released.
        """
        released = 0
        with self._cond:
            if self._abandoned:
                return True
            since = self._busy_since
            if since is None or self._clock() - since <= self._timeout:
                # A worker that is gone (e.g. in a forked child) is never waited for.
                return not self._finished and not self._thread.is_alive()
            released = self._abandon("stalled")
            if not self._logged_stall:
                self._logged_stall = True
                logger.error(
                    "sowtel exporter %s made no progress for %.3g s inside %s() of at most %d "
                    "records; it is given up on until that call returns: its backlog and the "
                    "records of that call are counted in status()['drop_reasons'][%r]"
                    "['stalled']", self.label, self._timeout, self._busy_in or "a call",
                    WRITE_RECORDS, self.label,
                )
        self._release(released)
        return True

    def _abandon(self, reason: str) -> int:
        """Counts the backlog and the write in progress as dropped; returns their bytes (lock
        held)."""
        n = nbytes = 0
        tokens: deque[Backlogged | Token] = deque()
        for entry in self._queue:
            if isinstance(entry, Token):
                tokens.append(entry)
            else:
                n += len(entry.records)
                nbytes += entry.nbytes
        self._queue = tokens
        if self._writing is not None:
            n += len(self._writing)
            nbytes += self._writing_bytes
            self._writing = None
            self._writing_bytes = 0
        self.pending -= n
        self.held_bytes -= nbytes
        self._drop(reason, n)
        self._abandoned = True
        self._cond.notify_all()
        return nbytes

    def give_up(self) -> None:
        """Called by a close() whose time ran out: drops what is left, takes nothing more.

        The call the exporter may be inside is left to finish (its records are counted as
        dropped now); then the worker calls ``close()`` on the exporter and stops.
        """
        with self._cond:
            if self._finished or self._given_up:
                return
            self._given_up = True
            self._accepting = False
            released = self._abandon("close_timeout")
            for entry in self._queue:
                if isinstance(entry, Token):
                    entry.done = True
            self._queue.clear()
            self._cond.notify_all()
        self._release(released)

    # -- called from the dispatcher thread -------------------------------------------------

    def offer(self, batch: RecordBatch, nbytes: int, block: bool) -> bool:
        """Appends ``batch`` to the backlog; when it is full, drops it or waits for room.

        Returns False if the batch was dropped (and counted).
        """
        while True:
            stalled = self.stalled() if block else False
            with self._cond:
                if not self._accepting:
                    self._drop("closed" if not self._given_up else "close_timeout", len(batch))
                    return False
                if self._abandoned or stalled:
                    self._drop("stalled", len(batch))
                    return False
                # A backlog under its bound takes a whole batch, so it holds at most one batch
                # beyond it; no batch is ever refused for being larger than the bound.
                if self.pending < self._max_records:
                    self._queue.append(Backlogged(batch, nbytes))
                    self.pending += len(batch)
                    self.held_bytes += nbytes
                    self._cond.notify_all()
                    return True
                if not block:
                    self._drop("backlog_full", len(batch))
                    self._warn_overflow()
                    return False
                self._wait(self._cond, POLL)

    def tell(self, alerts: tuple[Any, ...]) -> None:
        """Queues ``alerts`` for the exporter's optional ``write_alerts(alerts)``, behind the
        records already queued (an exporter without that method is not told)."""
        if not alerts or not callable(getattr(self.exporter, "write_alerts", None)):
            return
        with self._cond:
            if not self._accepting or self._given_up:
                return
            self._queue.append(Token("alerts", alerts))
            self._cond.notify_all()

    # -- called from any thread --------------------------------------------------------------

    def shed(self, room: int) -> int:
        """Drops the oldest whole batches of the backlog until at most ``room`` records are
        pending, or only the write in progress and the rest of a started batch are left;
        returns the bytes let go of (the caller releases them).

        Under ``on_full="drop"`` the dispatcher calls it when the queue takes an item that would
        make the queue and this backlog together hold more than ``queue_size`` records plus
        that item and one batch: the exporter that falls behind loses its oldest steps
        (``"backlog_full"``), and neither the queue nor the other exporters lose anything for
        it.
        """
        n = nbytes = 0
        with self._cond:
            if self.pending <= room or not self._accepting:
                return 0
            kept: deque[Backlogged | Token] = deque()
            for entry in self._queue:
                if (self.pending - n > room and isinstance(entry, Backlogged)
                        and not entry.started):
                    n += len(entry.records)
                    nbytes += entry.nbytes
                else:
                    kept.append(entry)
            if not n:
                return 0
            self._queue = kept
            self.pending -= n
            self.held_bytes -= nbytes
            self._drop("backlog_full", n)
            self._warn_overflow()
            self._cond.notify_all()
        return nbytes

    def _warn_overflow(self) -> None:
        if not self._logged_overflow:
            self._logged_overflow = True
            logger.warning(
                "sowtel exporter %s is falling behind: its backlog is full (%d records), so "
                "records for it are dropped and counted in status()['drop_reasons'][%r]"
                "['backlog_full']", self.label, self.pending, self.label,
            )

    def request(self, kind: str) -> Token:
        """Queues a flush or close request behind everything already queued."""
        token = Token(kind)
        with self._cond:
            if self._finished or self._given_up:
                token.done = True
                return token
            if kind == "close":
                self._accepting = False
            self._queue.append(token)
            self._cond.notify_all()
        return token

    def wait(self, token: Token, deadline: float | None) -> str:
        """Waits for ``token``: returns ``"done"``, ``"stalled"`` or ``"timeout"``."""
        while True:
            if self.stalled():
                return "stalled"
            with self._cond:
                if token.done:
                    return "done"
                step = POLL
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return "timeout"
                    step = min(step, left)
                self._wait(self._cond, step)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def counts(self) -> tuple[int, int, int, int, dict[str, int], int]:
        """exported, failed, errors, pending, drop reasons, dropped: one consistent snapshot."""
        with self._cond:
            reasons = dict(self.drop_reasons)
            return (self.exported, self.failed, self.errors, self.pending, reasons,
                    sum(reasons.values()))

    # -- the worker thread -------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> bool:
        with self._cond:
            self._busy_in = what
            self._busy_since = self._clock()
        try:
            fn(*args)
            return True
        except BaseException:  # an exporter must never take its worker down with it
            with self._cond:
                self.errors += 1
            if not self._logged_error:
                self._logged_error = True
                logger.exception(
                    "sowtel exporter %s raised in %s(); it keeps receiving records, and the "
                    "records it lost are counted in status()['failed'] (failed calls in "
                    "status()['errors']); not logged again", self.label, what,
                )
            return False
        finally:
            with self._cond:
                self._busy_since = None
                if self._abandoned and not self._given_up:
                    self._abandoned = False
                    self._logged_stall = False
                    logger.warning("sowtel exporter %s returned from %s() and resumes",
                                   self.label, what)

    def _write_limit(self) -> int:
        per_record = self._seconds_per_record
        if per_record is None:
            return _FIRST_WRITE
        if per_record <= 0:
            return WRITE_RECORDS
        return max(1, min(WRITE_RECORDS, int(self._timeout * _WRITE_SHARE / per_record)))

    def _take(self) -> tuple[RecordBatch, int] | Token:
        """The next token, or the next records to write and their bytes, within the write
        bounds (lock held)."""
        first = self._queue[0]
        if isinstance(first, Token):
            self._queue.popleft()
            return first
        limit = self._write_limit()
        parts: list[Any] = []
        taken = nbytes = 0
        while self._queue and taken < limit:
            entry = self._queue[0]
            if isinstance(entry, Token):
                break
            records = entry.records
            if len(records) <= limit - taken and (
                    entry.nbytes == 0 or not parts or nbytes + entry.nbytes <= WRITE_BYTES):
                self._queue.popleft()
                parts.extend(records.parts)
                taken += len(records)
                nbytes += entry.nbytes
                continue
            room_bytes = WRITE_BYTES - nbytes if parts else WRITE_BYTES
            head, rest = records.split(limit - taken, room_bytes, started=bool(parts))
            if not len(head):
                break  # the byte bound ends this write here
            head_bytes = head.nbytes() if entry.nbytes else 0
            parts.extend(head.parts)
            taken += len(head)
            nbytes += head_bytes
            if rest is None:
                self._queue.popleft()
            else:
                entry.records = rest
                entry.nbytes -= head_bytes
                entry.started = True
            break
        return RecordBatch(parts), nbytes

    def _run(self) -> None:
        last_flush = self._clock()
        dirty = False
        while True:
            with self._cond:
                entry: tuple[RecordBatch, int] | Token | None = None
                while not self._queue and not self._given_up:
                    wait: float | None = None
                    if dirty:
                        # Written records reach the sink's storage within about one interval.
                        wait = self._flush_interval - (self._clock() - last_flush)
                        if wait <= 0:
                            break
                    self._wait(self._cond, wait)
                if self._given_up:
                    entry = Token("close")
                elif self._queue:
                    entry = self._take()
                    if not isinstance(entry, Token):
                        self._writing, self._writing_bytes = entry
            if entry is None or isinstance(entry, Token):
                kind = "flush" if entry is None else entry.kind
                if kind == "alerts":
                    assert entry is not None
                    self._call("write_alerts", self.exporter.write_alerts, entry.alerts)
                    dirty = True
                elif kind == "flush":
                    self._call("flush", self.exporter.flush)
                    dirty = False
                    last_flush = self._clock()
                else:
                    self._call("close", self.exporter.close)
                with self._cond:
                    if entry is not None:
                        entry.done = True
                    if kind == "close":
                        self._finished = True
                        for late in self._queue:  # requests made after the close: answered
                            if isinstance(late, Token):
                                late.done = True
                        self._queue.clear()
                    self._cond.notify_all()
                if kind == "close":
                    return
                continue
            batch, nbytes = entry
            t0 = self._clock()
            ok = self._call("write", self._write, batch)
            took = self._clock() - t0
            counted = False
            with self._cond:
                if self._writing is batch:  # else it was given up on and already counted
                    self._writing = None
                    self._writing_bytes = 0
                    counted = True
                    self.pending -= len(batch)
                    self.held_bytes -= nbytes
                    if ok:
                        self.exported += len(batch)
                    else:
                        self.failed += len(batch)
                # A slow-down shows at once; a speed-up is believed half at a time.
                per_record = took / max(1, len(batch))
                old = self._seconds_per_record
                self._seconds_per_record = (
                    per_record if old is None or per_record > old else (old + per_record) / 2)
                self._cond.notify_all()
            # The records are let go of here, before producers are told there is room: a
            # reference kept while waiting would hold a batch that no bound counts any more.
            entry = None
            del batch
            if counted:
                self._release(nbytes)
            dirty = True
            if self._given_up:
                continue  # only close() is called now
            if self._clock() - last_flush >= self._flush_interval:
                # Under a steady stream the backlog never empties; flush on schedule anyway.
                self._call("flush", self.exporter.flush)
                dirty = False
                last_flush = self._clock()
