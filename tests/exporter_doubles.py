"""Records and small exporters shared by the dispatcher and reliability tests.

Example:
    >>> [r.step for r in convert([3, 4])]
    [3, 4]
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from sowtel.records import Record


def make_record(step: int, name: str = "x", mode: str = "primal",
                stats: dict[str, float] | None = None, value: np.ndarray | None = None) -> Record:
    """A float32 scalar record of ``step`` (a ``full`` one when ``value`` is given)."""
    return Record(name=name, mode=mode, tag="intermediates", step=step, index=None,
                  wall_time=0.0, summary="full" if value is not None else "stats", shape=(),
                  dtype="float32", value=value, stats=stats or {"mean": float(step)})


def convert(items: list[int]) -> list[Record]:
    """A dispatcher's ``convert``: one record per int put."""
    return [make_record(i) for i in items]


class Raising:
    """An exporter whose every call raises; counts its writes."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, records: Sequence[Record]) -> None:
        self.calls += 1
        raise RuntimeError("disk on fire")

    def flush(self) -> None:
        raise RuntimeError("flush on fire")

    def close(self) -> None:
        raise RuntimeError("close on fire")


class Hung:
    """Blocks inside its first write() until released; remembers every call after that."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.entered = threading.Event()
        self.calls: list[str] = []
        self.closed = threading.Event()

    def write(self, records: Sequence[Record]) -> None:
        self.calls.append("write")
        self.entered.set()
        self.release.wait()

    def flush(self) -> None:
        self.calls.append("flush")

    def close(self) -> None:
        self.calls.append("close")
        self.closed.set()
