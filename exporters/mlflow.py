"""The ``mlflow`` exporter: sow sites as MLflow metrics, histograms as run artifacts.

Metrics are named as the TensorBoard exporter names its tags (see ``sowtel.exporters._tracker``):
``{name}/{mode}/{stat}``, ``sowtel.log`` scalars by their name, with one difference MLflow's
naming rules force: a scan iteration or shard index, ``{name}[3]`` in TensorBoard, is written
``{name}:3`` (``{name}:1:0`` for nested scans), since MLflow names cannot hold brackets or
commas (site names cannot hold ``:``, so these never collide with another site's). Each
metric's step is the record's step (``MlflowClient.get_metric_history`` returns the series).

Histograms (of ``"histogram"`` and ``"full"`` records) go to the run's artifacts as JSON, one
file a step and batch: ``histograms/step_<step>_<n>.json`` holding
``{"{name}/{mode}": {"edges": [...], "counts": [...]}}``.

The exporter starts a run in ``experiment`` (created if needed) and ends it on ``close()``;
or pass ``run_id=`` to log into a run you created (left open). ``tracking_uri`` chooses the
store: a local SQLite database (``sqlite:///mlflow.db``), a server, or MLflow's default. MLflow
is an optional extra: ``pip install 'sowtel[mlflow]'`` (the SQLite store needs SQLAlchemy and
Alembic, which the extra includes).

Example:
    >>> import sowtel  # doctest: +SKIP
    >>> with sowtel.enable(exporter="mlflow", tracking_uri="sqlite:///mlflow.db"):  # doctest: +SKIP
    ...     train()
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from sowtel import errors
from sowtel.exporters._tracker import StepBatch, StepMetrics, TrackerExporter

__all__ = ["MlflowExporter", "BATCH"]

#: Metrics per ``log_batch`` call: MLflow's own limit.
BATCH = 1000


class MlflowExporter(TrackerExporter):
    """Logs records to an MLflow run (see the module docs).

    Args:
      tracking_uri: the tracking store (``"sqlite:///mlflow.db"``, a server URL); None: MLflow's
        default (``MLFLOW_TRACKING_URI``).
      experiment: the experiment a new run is created in (created if it does not exist).
      run_name: the name of the run created here.
      run_id: log into this existing run instead (left open on close).
      artifact_location: where a new experiment keeps its artifacts (the histograms); None:
        the store's default (``./mlruns`` for a SQLite store).
      stats: ``"default"``, ``"all"`` or a list of statistics, as for the TensorBoard exporter.
      scalar_derivatives: log derivative records of scalar sites too.
      histograms: log histograms of ``"histogram"`` and ``"full"`` records as artifacts.
    """

    label = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment: str = "sowtel",
                 run_name: str | None = None, run_id: str | None = None,
                 artifact_location: str | None = None, stats: str | Sequence[str] = "default",
                 scalar_derivatives: bool = False, histograms: bool = True) -> None:
        self._metrics = StepMetrics(stats, scalar_derivatives=scalar_derivatives,
                                    histograms=histograms, index=(":", ":"))
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._owned = run_id is None
        if run_id is None:
            if not isinstance(experiment, str) or not experiment:
                raise errors.BadOptionError("experiment", experiment,
                                            "must be a non-empty name")
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = (found.experiment_id if found is not None else
                             self.client.create_experiment(experiment, artifact_location))
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        else:
            self.client.get_run(run_id)  # an unknown run fails here, not at the first write
        self.run_id: str = run_id
        self._files = itertools.count()
        self._alert_lines: list[str] = []
        self._closed = False

    def _log(self, batches: list[StepBatch]) -> None:
        metrics: list[Metric] = []
        for batch in batches:
            timestamp = int(batch.wall_time * 1000)
            metrics.extend(Metric(key, value, timestamp, batch.step)
                           for key, value in batch.scalars.items())
            if batch.histograms:
                self._log_histograms(batch.step, batch.histograms)
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + BATCH],
                                  synchronous=True)

    def _log_histograms(self, step: int, histograms: dict[str, Any]) -> None:
        body = {key: {"edges": edges.tolist(), "counts": counts.tolist()}
                for key, (edges, counts) in histograms.items()}
        self.client.log_dict(self.run_id, body,
                             f"histograms/step_{step:08d}_{next(self._files)}.json")

    def _alert(self, title: str, text: str, step: int) -> None:
        # MLflow has no alerts: the run's tag shows the latest (in the run's page), and
        # sowtel/alerts.txt lists them all, rewritten whole with each.
        self._alert_lines.append(text)
        self.client.set_tag(self.run_id, "sowtel.alert", text[:5000])
        self.client.log_text(self.run_id, "\n".join(self._alert_lines) + "\n",
                             "sowtel/alerts.txt")

    def _finish(self) -> None:
        self.client.set_terminated(self.run_id)

    def flush(self) -> None:
        """Every batch is logged synchronously; nothing is held here."""
