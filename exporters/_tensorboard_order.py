"""Where each series the TensorBoard exporter writes as scalars ran within its step.

A depth tensor carries its site's ``order`` and ``scans`` in its metadata; a series written as
scalars has no metadata of its own that TensorBoard keeps, so the exporter writes, at the step
where series first appear, one string tensor :data:`ORDER_TAG` listing them: JSON
``[[name, mode, order, scans], ...]`` (``scans`` as ``[[entry, reverse], ...]``). With a
record's index these give its place in execution order (:func:`sowtel.records.order_key`), which
``sowtel.compare_runs`` reads back.

Example:
    >>> from tensorboardX.proto.summary_pb2 import SummaryMetadata
    >>> orders = SeriesOrders(lambda content: SummaryMetadata())
    >>> orders.note(["mean"], 0, "h", "primal", 4, ())
    >>> orders.note(["mean"], 0, "h", "primal", 4, ())     # known: not listed again
    >>> values = []
    >>> orders.add_to(values, 0)
    >>> values[0].tag, values[0].tensor.string_val[0]
    ('sowtel/order', b'[["h", "primal", 4, []]]')
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.proto.tensor_pb2 import TensorProto
from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboardX.proto.types_pb2 import DT_STRING

__all__ = ["ORDER_TAG", "ORDER_CONTENT", "SeriesOrders"]

#: A string tensor at the steps where series written as scalars first appear.
ORDER_TAG = "sowtel/order"
#: The metadata content of :data:`ORDER_TAG` (the ``sowtel`` plugin's, which ignores it).
ORDER_CONTENT = b'{"version": 1, "kind": "order"}'


class SeriesOrders:
    """The series an exporter wrote as scalars, and the rows of :data:`ORDER_TAG` due next.

    ``metadata(content)`` makes the tensor's metadata, written with its first value only.
    """

    def __init__(self, metadata: Callable[[bytes], Any]) -> None:
        self._metadata = metadata
        self._known: set[tuple[int, str, str]] = set()
        self._due: dict[int, list[list[Any]]] = {}
        self._tagged = False

    def note(self, written: Sequence[str] | None, process_index: int, name: str, mode: str,
             order: int, scans: tuple[tuple[int, bool], ...]) -> None:
        """A series of which the statistics ``written`` were written (none: nothing to note)."""
        key = (process_index, name, mode)
        if written and key not in self._known:
            self._known.add(key)
            self._due.setdefault(process_index, []).append(
                [name, mode, int(order), [[int(e), bool(r)] for e, r in scans]])

    def add_to(self, values: list[Any], process_index: int) -> None:
        """Appends the process's due rows, if any, to a step's ``values``."""
        rows = self._due.pop(process_index, None)
        if not rows:
            return
        tensor = TensorProto(dtype=DT_STRING, tensor_shape=TensorShapeProto(),
                             string_val=[json.dumps(rows).encode()])
        first, self._tagged = not self._tagged, True
        values.append(Summary.Value(tag=ORDER_TAG, tensor=tensor, metadata=self._metadata(
            ORDER_CONTENT) if first else None))
