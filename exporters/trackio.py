"""The ``trackio`` exporter: sow sites as Trackio metrics and histograms (local-first).

Metrics are named as the TensorBoard exporter names its tags (see ``sowtel.exporters._tracker``):
``{name}/{mode}/{stat}`` scalars, ``{name}/{mode}`` histograms (``trackio.Histogram`` from the
device's buckets), ``{name}[i]/...`` for scan iterations and shards, ``sowtel.log`` scalars by
their name; each ``run.log`` call holds one step's metrics at that step.

Trackio keeps projects in a local SQLite database under ``$TRACKIO_DIR`` (read when trackio is
first imported; by default in the Hugging Face cache); ``trackio show`` opens its dashboard.
The exporter starts a run (``trackio.init(project, name=...)``) and finishes it on
``close()``; or pass ``run=`` to log into a run you started (left open). Trackio is an optional
extra: ``pip install 'sowtel[trackio]'``.

Example:
    >>> import sowtel  # doctest: +SKIP
    >>> with sowtel.enable(exporter="trackio", project="my-model"):  # doctest: +SKIP
    ...     train()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trackio

from sowtel import errors
from sowtel.exporters._tracker import StepBatch, StepMetrics, TrackerExporter

__all__ = ["TrackioExporter"]


class TrackioExporter(TrackerExporter):
    """Logs records to a Trackio run (see the module docs).

    Args:
      run: a run from ``trackio.init`` to log into (left open on close); else one is started.
      project, name, config: ``trackio.init``'s, for the run started here.
      stats: ``"default"``, ``"all"`` or a list of statistics, as for the TensorBoard exporter.
      scalar_derivatives: log derivative records of scalar sites too.
      histograms: log histograms of ``"histogram"`` and ``"full"`` records.
    """

    label = "trackio"

    def __init__(self, *, run: Any = None, project: str = "sowtel", name: str | None = None,
                 config: dict[str, Any] | None = None, stats: str | Sequence[str] = "default",
                 scalar_derivatives: bool = False, histograms: bool = True) -> None:
        self._metrics = StepMetrics(stats, scalar_derivatives=scalar_derivatives,
                                    histograms=histograms)
        self._owned = run is None
        if run is None:
            if not isinstance(project, str) or not project:
                raise errors.BadOptionError("project", project,
                                            "must be a non-empty project name")
            # No GPU or CPU sampling threads of Trackio's own: sowtel only logs its records.
            run = trackio.init(project=project, name=name, config=config,
                               auto_log_gpu=False, auto_log_cpu=False)
        elif not callable(getattr(run, "log", None)):
            raise errors.BadOptionTypeError("run", run, "is not a Trackio run: pass the result "
                                            "of trackio.init()")
        self.run = run
        self._closed = False

    def _log(self, batches: list[StepBatch]) -> None:
        for batch in batches:
            data: dict[str, Any] = dict(batch.scalars)
            for key, (edges, counts) in batch.histograms.items():
                data[key] = trackio.Histogram(np_histogram=(counts, edges))
            self.run.log(data, step=batch.step)

    def _alert(self, title: str, text: str, step: int) -> None:
        self.run.alert(title, text=text, step=step)

    def _finish(self) -> None:
        self.run.finish()  # writes what Trackio still holds

    def flush(self) -> None:
        """Trackio writes logged metrics in its own background thread; nothing is held here."""
