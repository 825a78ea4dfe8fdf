"""What the experiment-tracker exporters (W&B, MLflow, Trackio) share: records to per-step
metrics, named as the TensorBoard exporter names its tags.

For each record: scalars ``{name}[index]/{mode}/{stat}`` for the statistics chosen with
``stats=`` (:class:`sowtel.records.StatChoice`: by default ``mean``, ``std``, ``min``, ``max``,
``l2``, and the non-finite counts of a series from the first step one is non-zero); a histogram
``{name}[index]/{mode}`` for ``"histogram"`` records (the device's buckets) and ``"full"``
records (bucketed on the host as the device would); the number of :func:`sowtel.log` scalars
as ``{name}``. Derivative records of scalar sites are skipped unless
``scalar_derivatives=True`` (the cotangent of a scalar loss is 1.0 at every step).

Example:
    >>> from sowtel.records import Record
    >>> steps = StepMetrics()
    >>> [(s.step, s.scalars) for s in steps.convert([Record(
    ...     name="h", mode="primal", tag="intermediates", step=3, index=1, wall_time=0.0,
    ...     summary="stats", shape=(2,), dtype="float32", stats={"mean": 0.5, "nan": 0.0})])]
    [(3, {'h[1]/primal/mean': 0.5})]
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sowtel import errors
from sowtel.records import Record, StatChoice, index_text, nonfinite_count
from sowtel.summaries import host_summary

__all__ = ["StepMetrics", "StepBatch", "TrackerExporter"]


@dataclasses.dataclass
class StepBatch:
    """The metrics of one step from one batch of records."""

    step: int
    wall_time: float
    scalars: dict[str, float]
    histograms: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (edges, counts)


class StepMetrics:
    """Turns records into :class:`StepBatch` es, one per step, steps in increasing order.

    Args:
      stats: ``"default"``, ``"all"`` or a list of statistics (see the module docs).
      scalar_derivatives: write derivative records of scalar sites too.
      histograms: write histograms (of ``"histogram"`` and ``"full"`` records).
      index: how a record's index is written after its name, as ``(brackets, separator)``:
        ``("[]", ",")`` gives TensorBoard's ``h[1,0]``; a tracker whose names cannot hold
        brackets passes another form.
    """

    def __init__(self, stats: str | Sequence[str] = "default", *,
                 scalar_derivatives: bool = False, histograms: bool = True,
                 index: tuple[str, str] = ("[]", ",")) -> None:
        if not isinstance(scalar_derivatives, bool):
            raise errors.BadOptionTypeError("scalar_derivatives", scalar_derivatives,
                                            "must be True or False")
        if not isinstance(histograms, bool):
            raise errors.BadOptionTypeError("histograms", histograms, "must be True or False")
        self.choice = StatChoice(stats)
        self.scalar_derivatives = scalar_derivatives
        self.histograms = histograms
        self._index = index
        self._prefixes: dict[tuple[str, str, Any], str] = {}

    def prefix(self, r: Record) -> str:
        key = (r.name, r.mode, r.index)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = (
                f"{r.name}{index_text(r.index, *self._index)}/{r.mode}")
        return prefix

    def convert(self, records: Sequence[Record],
                on_error: Callable[[Record, Exception], None] | None = None) -> list[StepBatch]:
        """The metrics of ``records`` by step. A record that cannot be converted is passed to
        ``on_error`` (raised when None) and the others are still converted."""
        out = []
        ordered = sorted(records, key=lambda r: (r.step, r.seq))
        for step, group in itertools.groupby(ordered, key=lambda r: r.step):
            batch = StepBatch(int(step), 0.0, {}, {})
            for r in group:
                try:
                    self._add(r, batch)
                except Exception as e:  # one bad record must not lose the batch's others
                    if on_error is None:
                        raise
                    on_error(r, e)
                batch.wall_time = max(batch.wall_time, r.wall_time)
            if batch.scalars or batch.histograms:
                out.append(batch)
        return out

    def _add(self, r: Record, batch: StepBatch) -> None:
        if r.summary == "scalar":  # sowtel.log
            batch.scalars[str(r.name)] = float(r.stats["value"])
            return
        if r.shape == () and r.mode != "primal" and not self.scalar_derivatives:
            return
        stats, hist = r.stats, r.histogram
        if r.value is not None:
            summary = host_summary(r.value, "histogram")
            stats, hist = summary["stats"], summary["histogram"]
        prefix = self.prefix(r)
        nonfinite = nonfinite_count(stats) > 0
        for stat in self.choice.chosen((r.name, r.mode, r.index), r.summary, stats, nonfinite):
            batch.scalars[f"{prefix}/{stat}"] = float(stats[stat])
        if self.histograms and hist is not None:
            edges, counts = (np.asarray(a) for a in hist)
            if len(edges) != len(counts) + 1:
                raise ValueError(f"histogram has {len(edges)} edges for {len(counts)} buckets")
            if counts.sum() > 0:  # no finite element: nothing to draw
                batch.histograms[prefix] = (edges, counts)


class TrackerExporter:
    """What the tracker exporters share around their client: records to per-step batches
    (:class:`StepMetrics`), bad records counted and raised after the others are logged, and a
    run that is finished on ``close()`` only if the exporter started it.

    A subclass sets ``self._metrics``, ``self._owned`` and ``self._closed`` in its constructor
    and implements ``_log(batches)`` (hand the batches to the client) and ``_finish()``.
    """

    _metrics: StepMetrics
    _owned: bool
    _closed: bool

    def write(self, records: Sequence[Record]) -> None:
        """Logs ``records`` a step at a time; a record that cannot be converted is skipped and,
        after the others are logged, raised as ``ValueError``."""
        name = type(self).__name__
        if self._closed:
            raise errors.ExporterClosedError(name)
        bad: list[str] = []
        self._log(self._metrics.convert(
            records, lambda r, e: bad.append(f"{r.name!r} ({r.mode}, step {r.step}): {e}")))
        if bad:
            raise ValueError(f"{name} skipped {len(bad)} record(s) it could not convert, "
                             f"first {bad[0]}")

    def write_alerts(self, alerts: Sequence[Any]) -> None:
        """Hands each alert of a :mod:`sowtel.alerts` rule to the tracker's own alerts, where
        it has them (W&B's and Trackio's ``alert``; MLflow: a run tag and a text file)."""
        if self._closed:
            return
        for found in alerts:
            self._alert(f"sowtel {found.kind} alert: {found.name} ({found.mode}) {found.stat}",
                        str(found), int(found.step))

    def _alert(self, title: str, text: str, step: int) -> None:
        """One alert to the tracker (a tracker without alerts keeps this no-op)."""

    def _log(self, batches: list[StepBatch]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """The tracker's client sends what it was given itself; nothing is held here."""

    def close(self) -> None:
        """Finishes the run if this exporter started it; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._finish()
