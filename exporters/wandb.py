"""The ``wandb`` exporter: sow sites as Weights & Biases metrics and histograms.

Metrics are named as the TensorBoard exporter names its tags (see ``sowtel.exporters._tracker``):
``{name}/{mode}/{stat}`` scalars, ``{name}/{mode}`` histograms (``wandb.Histogram`` from the
device's buckets), ``{name}[i]/...`` for scan iterations and shards, ``sowtel.log`` scalars by
their name. Each ``run.log`` call holds one step's metrics with the step itself as the metric
``sowtel/step``, declared (``define_metric``) as the x-axis of every sowtel metric: records of a
step that arrive after a later step's (unordered callbacks, two exporter batches) are still
kept, where ``run.log(step=...)`` would drop them.

The exporter starts its own run (``wandb.init`` with ``project``, ``name``, ``dir``, ``mode``,
``config``, ``settings``) and finishes it on ``close()``; or pass ``run=`` to log into a run
you started (then it is left open). ``mode="offline"`` writes the run to disk only
(``wandb sync`` uploads it later). W&B is an optional extra: ``pip install 'sowtel[wandb]'``.

Example:
    >>> import sowtel  # doctest: +SKIP
    >>> with sowtel.enable(exporter="wandb", project="my-model", mode="offline"):  # doctest: +SKIP
    ...     train()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import wandb

from sowtel import errors
from sowtel.exporters._tracker import StepBatch, StepMetrics, TrackerExporter

__all__ = ["WandbExporter", "STEP_METRIC"]

#: The metric holding the training step, the x-axis of every metric sowtel logs.
STEP_METRIC = "sowtel/step"


class WandbExporter(TrackerExporter):
    """Logs records to a W&B run (see the module docs).

    Args:
      run: a run from ``wandb.init`` to log into (left open on close); else one is started.
      project, name, dir, mode, config, settings: ``wandb.init``'s, for the run started here
        (``mode="offline"`` keeps everything on this machine).
      stats: ``"default"``, ``"all"`` or a list of statistics, as for the TensorBoard exporter.
      scalar_derivatives: log derivative records of scalar sites too.
      histograms: log histograms of ``"histogram"`` and ``"full"`` records.
    """

    label = "wandb"

    def __init__(self, *, run: Any = None, project: str | None = "sowtel", name: str | None = None,
                 dir: str | None = None, mode: str | None = None,
                 config: dict[str, Any] | None = None, settings: Any = None,
                 stats: str | Sequence[str] = "default", scalar_derivatives: bool = False,
                 histograms: bool = True) -> None:
        self._metrics = StepMetrics(stats, scalar_derivatives=scalar_derivatives,
                                    histograms=histograms)
        if mode is not None and mode not in ("online", "offline", "disabled", "shared"):
            raise errors.BadOptionError("mode", mode, "is not a W&B mode: use 'online', "
                                        "'offline' or 'disabled'")
        self._owned = run is None
        if run is None:
            run = wandb.init(project=project, name=name, dir=dir, mode=cast(Any, mode),
                             config=config,
                             settings=settings, reinit="create_new")
        elif not callable(getattr(run, "log", None)):
            raise errors.BadOptionTypeError("run", run,
                                            "is not a W&B run: pass the result of wandb.init()")
        self.run = run
        self._defined: set[str] = set()
        self._closed = False
        self.run.define_metric(STEP_METRIC)

    def _log(self, batches: list[StepBatch]) -> None:
        for batch in batches:
            data: dict[str, Any] = {STEP_METRIC: batch.step, **batch.scalars}
            for key, (edges, counts) in batch.histograms.items():
                data[key] = wandb.Histogram(np_histogram=(counts, edges))
            # Each metric once, by name (not a "*" pattern: the run may hold metrics of others).
            for key in data.keys() - self._defined - {STEP_METRIC}:
                self.run.define_metric(key, step_metric=STEP_METRIC)
                self._defined.add(key)
            self.run.log(data)

    def _alert(self, title: str, text: str, step: int) -> None:
        self.run.alert(title=title, text=text, level="WARN")

    def _finish(self) -> None:
        self.run.finish()

    def flush(self) -> None:
        """W&B sends logged data in its own service process; nothing is held here."""
