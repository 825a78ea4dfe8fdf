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

import threading
from collections.abc import Sequence

from sowtel.records import Record

__all__ = ["MemoryExporter"]


class MemoryExporter:
    """Keeps every record it is given, in arrival order, readable from any thread.

    Args:
      max_records: keep only the newest this many records (None: keep all). Use it for long
        runs in a notebook, where an unbounded list would grow with every step.

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

    def __init__(self, max_records: int | None = None) -> None:
        if max_records is not None and (
            not isinstance(max_records, int) or isinstance(max_records, bool) or max_records <= 0
        ):
            raise ValueError(
                f"max_records={max_records!r} must be a positive integer, or None to keep all"
            )
        self._max_records = max_records
        self._records: list[Record] = []
        self._lock = threading.Lock()

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
        """Forgets every record kept so far.

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
            self._records.extend(records)
            if self._max_records is not None and len(self._records) > self._max_records:
                del self._records[: len(self._records) - self._max_records]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
