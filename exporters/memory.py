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

from sowtel.records import Record

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
    stay after ``close()``, so they can be read after ``sowtel.disable()``.

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
            raise ValueError(
                f"max_records={max_records!r} must be a positive integer, or None to keep all"
            )
        self.max_records = max_records
        self._records: deque[Record] = deque(maxlen=max_records)
        self._evicted = 0
        self._logged = False
        self._lock = threading.Lock()

    @property
    def evicted(self) -> int:
        """How many records were let go of to keep within ``max_records``."""
        return self._evicted

    @property
    def records(self) -> list[Record]:
        """A snapshot of the records, in the order they were written."""
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def by_name(self, name: str, mode: str | None = None) -> list[Record]:
        """The records of site ``name`` (and ``mode``, if given), ordered by step then arrival.

        Example:
            >>> MemoryExporter().by_name("loss", mode="primal")
            []
        """
        with self._lock:
            found = [r for r in self._records
                     if r.name == name and (mode is None or r.mode == mode)]
        found.sort(key=lambda r: (r.step, r.seq))
        return found

    def names(self) -> list[str]:
        """The distinct site names seen, sorted.

        Example:
            >>> MemoryExporter().names()
            []
        """
        with self._lock:
            return sorted({r.name for r in self._records})

    def clear(self) -> None:
        """Forgets every record kept so far (not counted in :attr:`evicted`).

        Example:
            >>> memory = MemoryExporter()
            >>> memory.clear()
            >>> len(memory)
            0
        """
        with self._lock:
            self._records.clear()

    def write(self, records: Sequence[Record]) -> None:
        with self._lock:
            if self.max_records is not None:
                self._evicted += max(0, len(self._records) + len(records) - self.max_records)
            self._records.extend(records)
            if self._evicted and not self._logged:
                self._logged = True
                logger.warning(
                    "sowtel memory exporter holds its max_records=%d: the oldest records are "
                    "let go of and counted in status()['evicted']; pass "
                    "MemoryExporter(max_records=...) to keep more", self.max_records)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
