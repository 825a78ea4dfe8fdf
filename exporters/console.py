"""The ``console`` exporter: one compact line per record on a text stream.

A line reads ``[sowtel] step <step>  <name> <mode>[<index>]  <dtype>[<shape>]  <stats>``, the
stats being ``mean std min max l2`` and, when there are any, ``NONFINITE nan= +inf= -inf=``.
Statistics are printed with 4 significant digits. ``full`` records show the statistics of their
value, ``health`` records their size and non-finite counts, ``shape`` records nothing more.

Example:
    >>> import io
    >>> from sowtel.exporters.console import ConsoleExporter
    >>> from sowtel.records import Record
    >>> out = io.StringIO()
    >>> console = ConsoleExporter(stream=out)
    >>> console.write([Record(name="h", mode="primal", tag="intermediates", step=3, index=None,
    ...                       wall_time=0.0, summary="shape", shape=(2, 5), dtype="float32")])
    >>> out.getvalue()
    '[sowtel] step     3  h primal                float32[2,5]   (shape)\\n'
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

from sowtel import errors
from sowtel.records import NONFINITE_KINDS, NONFINITE_LABELS, Record, nonfinite_count
from sowtel.summaries import host_summary

__all__ = ["ConsoleExporter", "format_record"]

_SHOWN = ("mean", "std", "min", "max", "l2")


def _number(x: float) -> str:
    return f"{x:.4g}"


def format_record(record: Record) -> str:
    """The console line of one record, without the newline.

    Example:
        >>> from sowtel.records import Record
        >>> line = format_record(Record(
        ...     name="w", mode="cotangent", tag="intermediates", step=7, index=(1, 2),
        ...     wall_time=0.0, summary="health", shape=(), dtype="float32",
        ...     stats={"size": 1.0, "nan": 1.0, "posinf": 0.0, "neginf": 0.0}))
        >>> line[:40]
        '[sowtel] step     7  w cotangent[1,2]   '
        >>> line[45:]
        'float32[]      size=1  NONFINITE nan=1 +inf=0 -inf=0  (health)'
    """
    index = record.index
    if index is None:
        where = ""
    elif isinstance(index, tuple):
        where = "[" + ",".join(str(i) for i in index) + "]"
    else:
        where = f"[{index}]"
    site = f"{record.name} {record.mode}{where}"
    shape = f"{record.dtype}[{','.join(str(d) for d in record.shape)}]"
    parts = [f"[sowtel] step {record.step:>5}", f"{site:<22}", f"{shape:<13}"]
    stats = record.stats
    if not stats and record.value is not None:
        stats = host_summary(record.value, "stats")["stats"]
    if "mean" in stats:
        parts.append(" ".join(f"{k}={_number(stats[k])}" for k in _SHOWN if k in stats))
    elif "size" in stats:
        parts.append(f"size={_number(stats['size'])}")
    elif "value" in stats:  # a scalar of sowtel.log
        parts.append(f"value={_number(stats['value'])}")
    if nonfinite_count(stats):
        parts.append("NONFINITE " + " ".join(
            f"{NONFINITE_LABELS[k].lower()}={_number(stats.get(k, 0.0))}"
            for k in NONFINITE_KINDS))
    if record.summary != "stats":
        parts.append(f"({record.summary})")
    return "  ".join(parts).rstrip()


class ConsoleExporter:
    """Prints one line per record (see :func:`format_record`) on ``stream``.

    Args:
      stream: where lines go (standard output by default); it is flushed by ``flush()`` and
        never closed, since the exporter does not own it.
      every: print only records whose step is divisible by this.

    Example:
        >>> import sowtel  # doctest: +SKIP
        >>> sowtel.enable(exporter="console", every=10)  # doctest: +SKIP
        >>> ConsoleExporter(every=100).every
        100
    """

    label = "console"

    def __init__(self, stream: TextIO | None = None, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise errors.BadOptionError("every", every, "must be a positive integer (print steps "
                                        "divisible by it)")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise errors.BadOptionTypeError("stream", stream, "has no write(): pass a text "
                                            "stream such as sys.stderr or an open file")
        self._stream = stream
        self.every = every

    @property
    def stream(self) -> TextIO:
        # Looked up at write time, so a replaced sys.stdout (notebooks, pytest) is honoured.
        return self._stream if self._stream is not None else sys.stdout

    def write(self, records: Sequence[Record]) -> None:
        lines = [format_record(r) for r in records if r.step % self.every == 0]
        if lines:
            self.stream.write("\n".join(lines) + "\n")

    def write_alerts(self, alerts: Sequence[Any]) -> None:
        """Prints each alert of a :mod:`sowtel.alerts` rule as a line ``[sowtel] ALERT ...``.

        Example:
            >>> import io
            >>> from sowtel.alerts import Alert, alert
            >>> out = io.StringIO()
            >>> found = Alert(3, "loss", "primal", None, "value", 2.0, "above",
            ...               alert("loss", above=1.0))
            >>> ConsoleExporter(out).write_alerts([found])
            >>> out.getvalue().split(";")[0]
            "[sowtel] ALERT alert at step 3: 'loss' (primal) value = 2, above 1"
        """
        self.stream.write("".join(f"[sowtel] ALERT {a}\n" for a in alerts))

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.flush()
