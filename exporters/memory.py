"""The ``memory`` exporter: records kept in a list, for notebooks and tests.

Example:
    >>> from sowtel.exporters.memory import MemoryExporter
    >>> from sowtel.records import Record
    >>> memory = MemoryExporter()
    >>> memory.write([Record(name="h", mode="primal", tag="intermediates", step=0, index=None,
    ...                      wall_time=0.0, summary="stats", shape=(3,), dtype="float32",
    ...                      stats={"mean": 0.5})])
    >>> [r.stats["mean"] for r in memory.by_name("h")]
    [0.5]
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from sowtel import errors
from sowtel.records import Record
from sowtel.to_records import RecordBatch, SiteColumns

__all__ = ["MemoryExporter"]

logger = logging.getLogger("sowtel")


class MemoryExporter:
    """Keeps the newest records it is given, in arrival order, readable from any thread.

    Args:
      max_records: keep at most this many records (default :attr:`DEFAULT_MAX_RECORDS`); when
        more arrive, the oldest are let go of and counted in :attr:`evicted`, which
        ``sowtel.status()["evicted"]`` shows. ``None`` keeps every record: memory then grows
        with every step, so use it only for runs you know to be short.

    The oldest records go, not the newest: a notebook or test reads the latest steps (where a
    run diverged, what the last step did), and a bound that refused new records would freeze
    the view at the start of a long run. Records let go of this way were exported (they count
    in ``status()["exported"]``); ``evicted`` says how many of them the exporter no longer holds.

    ``records`` returns a snapshot, so reading it while training streams is safe. The records
    stay after ``close()``, so they can be read after ``sowtel.disable()``. :attr:`alerts`
    holds the alerts of ``enable(alerts=...)`` rules the exporter was given (the newest 1,000).

    Example:
        >>> import sowtel  # doctest: +SKIP
        >>> memory = MemoryExporter()
        >>> with sowtel.enable(exporter=memory):  # doctest: +SKIP
        ...     train_step(params, batch)
        >>> memory.by_name("block0/attn", mode="cotangent")  # doctest: +SKIP
    """

    label = "memory"
    #: The default bound: about 100 MB of ``stats`` records (about 1 KB each).
    DEFAULT_MAX_RECORDS = 100_000

    def __init__(self, max_records: int | None = DEFAULT_MAX_RECORDS) -> None:
        if max_records is not None and (
            not isinstance(max_records, int) or isinstance(max_records, bool) or max_records <= 0
        ):
            raise errors.BadOptionError("max_records", max_records,
                                        "must be a positive integer, or None to keep all")
        self.max_records = max_records
        # Batches are kept as they come (columnar tables stay tables): records are built only
        # when read, by whoever reads them.
        self._parts: deque[SiteColumns | tuple[Record, ...]] = deque()
        self._count = 0
        self._evicted = 0
        self._logged = False
        self._lock = threading.Lock()
        self._alerts: deque[Any] = deque(maxlen=1000)
        from sowtel import _exit

        _exit.after_fork(self)  # readable in a forked child, whatever a parent thread held

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    @property
    def evicted(self) -> int:
        """How many records were let go of to keep within ``max_records``."""
        return self._evicted

    @property
    def records(self) -> list[Record]:
        """A snapshot of the records, in the order they were written."""
        with self._lock:
            parts = list(self._parts)
        return RecordBatch(parts).records()

    @property
    def _records(self) -> list[Record]:
        return self.records

    def __len__(self) -> int:
        return self._count

    def by_name(self, name: str, mode: str | None = None) -> list[Record]:
        """The records of site ``name`` (and ``mode``, if given), ordered by step then arrival.

        Example:
            >>> MemoryExporter().by_name("loss", mode="primal")
            []
        """
        found = [r for r in self.records
                     if r.name == name and (mode is None or r.mode == mode)]
        found.sort(key=lambda r: (r.step, r.seq))
        return found

    def names(self) -> list[str]:
        """The distinct site names seen, sorted.

        Example:
            >>> MemoryExporter().names()
            []
        """
        return sorted({r.name for r in self.records})

    def clear(self) -> None:
        """Forgets every record kept so far (not counted in :attr:`evicted`).

        Example:
            >>> memory = MemoryExporter()
            >>> memory.clear()
            >>> len(memory)
            0
        """
        with self._lock:
            self._parts.clear()
            self._count = 0

    def write(self, records: Sequence[Record]) -> None:
        self._keep(RecordBatch([tuple(records)]))

    def write_batch(self, batch: RecordBatch) -> None:
        """Keeps a batch as it comes: its columnar parts become records only when read."""
        self._keep(batch)

    def _keep(self, batch: RecordBatch) -> None:
        with self._lock:
            self._parts.extend(batch.parts)
            self._count += len(batch)
            excess = 0 if self.max_records is None else self._count - self.max_records
            while excess > 0:
                first = self._parts[0]
                if len(first) <= excess:
                    self._parts.popleft()
                    gone = len(first)
                else:
                    rest = tuple(first.records() if isinstance(first, SiteColumns)
                                 else first)[excess:]
                    self._parts[0] = rest
                    gone = excess
                self._count -= gone
                self._evicted += gone
                excess -= gone
            if self._evicted and not self._logged:
                self._logged = True
                logger.warning(
                    "sowtel memory exporter holds its max_records=%d: the oldest records are "
                    "let go of and counted in status()['evicted']; pass "
                    "MemoryExporter(max_records=...) to keep more", self.max_records)

    def write_alerts(self, alerts: Sequence[Any]) -> None:
        """Keeps the alerts of :mod:`sowtel.alerts` rules (:attr:`alerts`).

        Example:
            >>> from sowtel.alerts import Alert, alert
            >>> memory = MemoryExporter()
            >>> found = Alert(3, "loss", "primal", None, "value", 2.0, "above",
            ...               alert("loss", above=1.0))
            >>> memory.write_alerts([found])
            >>> [(a.step, a.name, a.kind) for a in memory.alerts]
            [(3, 'loss', 'above')]
        """
        with self._lock:
            self._alerts.extend(alerts)

    @property
    def alerts(self) -> list[Any]:
        """The :class:`sowtel.alerts.Alert` s given to this exporter, oldest first."""
        with self._lock:
            return list(self._alerts)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
