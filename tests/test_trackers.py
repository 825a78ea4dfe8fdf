"""The tracker exporters (W&B offline, MLflow with a local SQLite store, Trackio's local store),
fed by real training: a Linen, an NNX (trained in place) and an Equinox model, each with a
watched Optax optimizer and captured module outputs. What each tracker stored is read back with
its own client (W&B: the offline run file) and compared with the records of a memory exporter
of the same session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Trackio reads its store's directory when first imported: a private one for these tests.
_TRACKIO_DIR = tempfile.mkdtemp(prefix="sowtel-trackio-")
atexit.register(shutil.rmtree, _TRACKIO_DIR, True)
os.environ["TRACKIO_DIR"] = _TRACKIO_DIR
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the options say

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import sowtel  # noqa: E402
import sowtel.equinox  # noqa: E402
import sowtel.flax  # noqa: E402
import sowtel.nnx  # noqa: E402
import sowtel.optax  # noqa: E402
from sowtel.exporters import resolve  # noqa: E402
from sowtel.exporters._tracker import StepMetrics  # noqa: E402
from sowtel.exporters.memory import MemoryExporter  # noqa: E402
from sowtel.records import Record  # noqa: E402

X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [0.0, 1.0, 1.0]])
Y = jnp.array([[1.0], [-1.0], [0.5]])
STEPS = 3


# -- three real trainings ---------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(4)(x)))


def _linen_step(tx):  # type: ignore[no-untyped-def]
    def loss(params, x, y):  # type: ignore[no-untyped-def]
        with sowtel.flax.capture():
            return jnp.mean((LinenMLP().apply(params, x) - y) ** 2)

    @sowtel.jit
    def step(params, state, x, y):  # type: ignore[no-untyped-def]
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(3, 4, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):  # type: ignore[no-untyped-def]
        return self.out(jnp.tanh(self.hidden(x)))


@sowtel.nnx.jit
def _nnx_step(model, optimizer, x, y):  # type: ignore[no-untyped-def]
    def loss(model):  # type: ignore[no-untyped-def]
        with sowtel.nnx.capture(model):
            return jnp.mean((model(x) - y) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


def _eqx_step(tx):  # type: ignore[no-untyped-def]
    @sowtel.equinox.filter_jit
    def step(model, state, x, y):  # type: ignore[no-untyped-def]
        def loss(model):  # type: ignore[no-untyped-def]
            return jnp.mean((jax.vmap(sowtel.equinox.capture(model))(x) - y) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    return step


def train_all() -> dict[str, list[float]]:
    """Trains the three models STEPS steps each, in the active session; returns the losses."""
    losses: dict[str, list[float]] = {"linen": [], "nnx": [], "equinox": []}
    with sowtel.scope("linen"):
        tx = sowtel.optax.watch(optax.adam(1e-2))
        params = LinenMLP().init(jax.random.key(0), X)
        state, step = tx.init(params), _linen_step(tx)
        for k in range(STEPS):
            with sowtel.at_step(k):
                params, state, loss = step(params, state, X, Y)
            losses["linen"].append(float(loss))
    with sowtel.scope("nnx"):
        model = NnxMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, sowtel.optax.watch(optax.adam(1e-2)), wrt=nnx.Param)
        for k in range(STEPS):
            with sowtel.at_step(k):
                losses["nnx"].append(float(_nnx_step(model, optimizer, X, Y)))
    with sowtel.scope("equinox"):
        tx = sowtel.optax.watch(optax.adam(1e-2))
        emodel = eqx.nn.MLP(3, 1, width_size=4, depth=1, key=jax.random.key(0))
        estate, estep = tx.init(eqx.filter(emodel, eqx.is_array)), _eqx_step(tx)
        for k in range(STEPS):
            with sowtel.at_step(k):
                emodel, estate, loss = estep(emodel, estate, X, Y)
            losses["equinox"].append(float(loss))
    for k in range(STEPS):
        sowtel.log({"train/loss": losses["linen"][k]}, step=k)
    return losses


#: A rule that fires once, at step 0 (a loss is positive, and one episode lasts the run).
LOSS_RULE = sowtel.alert("train/loss", above=0.0)


def run_session(exporter: Any) -> tuple[list[Record], dict[str, list[float]]]:
    """The three trainings streamed to ``exporter`` and a memory exporter, with
    :data:`LOSS_RULE`; the memory exporter's records, and the losses."""
    memory = MemoryExporter(max_records=None)
    with sowtel.enable(exporter=[exporter, memory], summary="histogram", alerts=[LOSS_RULE],
                       on_alert=lambda alert: None) as session:
        losses = train_all()
        sowtel.flush()
    status = session.status()
    assert status["dropped"] == 0 and not any(status["errors"].values()), status
    [found] = memory.alerts
    assert (found.step, found.name, found.kind) == (0, "train/loss", "above")
    assert str(found) == (f"alert at step 0: 'train/loss' (primal) value = "
                          f"{losses['linen'][0]:.6g}, above 0; rule {LOSS_RULE}")
    return memory.records, losses


def alert_text(losses: dict[str, list[float]]) -> str:
    """What :data:`LOSS_RULE`'s alert says (each tracker must hold it)."""
    return (f"alert at step 0: 'train/loss' (primal) value = {losses['linen'][0]:.6g}, "
            f"above 0; rule {LOSS_RULE}")


def expected(records: list[Record], index: tuple[str, str] = ("[]", ",")) -> tuple[
        dict[str, dict[int, float]], dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]]:
    """What a tracker should hold: the series the records give, by metric and step."""
    scalars: dict[str, dict[int, float]] = {}
    hists: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for batch in StepMetrics(index=index).convert(records):
        for key, value in batch.scalars.items():
            scalars.setdefault(key, {})[batch.step] = value
        for key, hist in batch.histograms.items():
            hists.setdefault(key, {})[batch.step] = hist
    return scalars, hists


def check_training(records: list[Record], losses: dict[str, list[float]]) -> None:
    for name, series in losses.items():
        assert series[-1] < series[0], (name, series)
    names = {r.name for r in records}
    for expected_name in ("linen/Dense_0/__call__", "linen/optim/grads/params/Dense_1/kernel",
                          "nnx/hidden/__call__", "nnx/optim/update_ratio/out/kernel",
                          "equinox/layers/1/__call__", "equinox/optim/norm/grads",
                          "train/loss"):
        assert expected_name in names, (expected_name, sorted(names))


# -- W&B --------------------------------------------------------------------------------------


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline W&B run file: W&B's LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks, each a 7-byte header (crc, length, type) and its bytes)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_finished(run_dir: Path, timeout: float = 180.0) -> Path:
    """The offline run file once W&B wrote its exit record. Finishing a run can outlast
    ``exporter_timeout`` on a loaded machine: ``disable()`` then returns while the exporter's
    ``close()`` (``run.finish()``) is still writing, so the file is read only once it is whole."""
    deadline = time.monotonic() + timeout
    while True:
        paths = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        try:  # a record being written reads as cut: read again
            if len(paths) == 1 and any(r.WhichOneof("record_type") == "exit"
                                       for r in _wandb_records(paths[0])):
                return paths[0]
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, struct's error
            pass
        assert time.monotonic() < deadline, f"no finished W&B run in {run_dir} after {timeout} s"
        time.sleep(0.5)


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    path = wandb_finished(run_dir)
    rows = []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            if len(keys) == 1:
                row[keys[0]] = value
            else:
                row.setdefault(keys[0], {})[keys[1]] = value
        rows.append(row)
    return rows


def test_wandb_offline_run_holds_the_series(tmp_path: Path) -> None:
    [exporter] = resolve("wandb", dir=str(tmp_path), mode="offline", project="sowtel-test")
    records, losses = run_session(exporter)
    check_training(records, losses)
    scalars, hists = expected(records)
    rows = wandb_history(tmp_path)
    got: dict[str, dict[int, Any]] = {}
    for row in rows:
        step = row["sowtel/step"]
        for key, value in row.items():
            if not key.startswith("_") and key != "sowtel/step":
                got.setdefault(key, {})[step] = value
    assert set(scalars) | set(hists) == set(got)
    for key, series in scalars.items():
        assert sorted(got[key]) == sorted(series)
        np.testing.assert_allclose([got[key][s] for s in sorted(series)],
                                   [series[s] for s in sorted(series)], rtol=1e-6, err_msg=key)
    assert [got["train/loss"][k] for k in range(STEPS)] == pytest.approx(losses["linen"])
    # The alert, as W&B's own alert record of the run.
    alerts = [r.alert for r in _wandb_records(wandb_finished(tmp_path))
              if r.WhichOneof("record_type") == "alert"]
    assert [(a.title, a.text) for a in alerts] == [
        ("sowtel above alert: train/loss (primal) value", alert_text(losses))]
    assert hists, "histogram records give wandb.Histogram values"
    for key, series in hists.items():
        for step, (edges, counts) in series.items():
            assert got[key][step]["_type"] == "histogram"
            np.testing.assert_array_equal(got[key][step]["values"], counts)
            np.testing.assert_allclose(got[key][step]["bins"], edges, rtol=1e-6)


# -- MLflow -----------------------------------------------------------------------------------


def test_mlflow_sqlite_store_holds_the_series(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    [exporter] = resolve("mlflow", tracking_uri=uri, experiment="sowtel-test",
                         artifact_location=str(tmp_path / "artifacts"))
    records, losses = run_session(exporter)
    check_training(records, losses)
    scalars, hists = expected(records, index=(":", ":"))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(exporter.run_id)
    assert run.info.status == "FINISHED"
    # MLflow has no alerts: the latest is a run tag, and sowtel/alerts.txt lists them all.
    assert run.data.tags["sowtel.alert"] == alert_text(losses)
    listed = client.download_artifacts(exporter.run_id, "sowtel/alerts.txt", str(tmp_path))
    assert Path(listed).read_text() == alert_text(losses) + "\n"
    assert set(run.data.metrics) == set(scalars)
    for key, series in scalars.items():
        history = client.get_metric_history(exporter.run_id, key)
        assert {m.step: m.value for m in history} == pytest.approx(series, rel=1e-6), key
        assert len(history) == len(series), key
    logged: dict[str, dict[int, Any]] = {}
    for info in client.list_artifacts(exporter.run_id, "histograms"):
        step = int(info.path.split("step_")[1].split("_")[0])
        local = client.download_artifacts(exporter.run_id, info.path, str(tmp_path))
        for key, value in json.loads(Path(local).read_text()).items():
            logged.setdefault(key, {})[step] = value
    assert set(logged) == set(hists) and hists
    for key, series in hists.items():
        for step, (edges, counts) in series.items():
            np.testing.assert_array_equal(logged[key][step]["counts"], counts)
            np.testing.assert_allclose(logged[key][step]["edges"], edges, rtol=1e-6)


# -- Trackio ----------------------------------------------------------------------------------


def test_trackio_local_store_holds_the_series() -> None:
    from trackio.sqlite_storage import SQLiteStorage

    [exporter] = resolve("trackio", project="sowtel-test", name="run-1")
    records, losses = run_session(exporter)
    check_training(records, losses)
    scalars, hists = expected(records)
    got: dict[str, dict[int, Any]] = {}
    for row in SQLiteStorage.get_logs("sowtel-test", "run-1"):
        for key, value in row.items():
            if key not in ("step", "timestamp"):
                got.setdefault(key, {})[row["step"]] = value
    assert set(got) == set(scalars) | set(hists)
    # The alert, in Trackio's own store of alerts, at its step.
    alerts = SQLiteStorage.get_alerts("sowtel-test", run_name="run-1")
    assert [(a["title"], a["text"], a["step"]) for a in alerts] == [
        ("sowtel above alert: train/loss (primal) value", alert_text(losses), 0)]
    for key, series in scalars.items():
        assert got[key] == pytest.approx(series, rel=1e-6), key
    assert hists
    for key, series in hists.items():
        for step, (edges, counts) in series.items():
            assert got[key][step]["_type"] == "trackio.histogram"
            np.testing.assert_array_equal(got[key][step]["values"], counts)
            np.testing.assert_allclose(got[key][step]["bins"], edges, rtol=1e-6)


# -- shared rules -----------------------------------------------------------------------------


def test_metric_names_follow_tensorboard_tags() -> None:
    from sowtel.records import series_tag

    r = Record(name="blk/h", mode="cotangent", tag="intermediates", step=2, index=(1, 0),
               wall_time=0.0, summary="stats", shape=(3,), dtype="float32",
               stats={"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "l2": 2.0, "nan": 0.0})
    [batch] = StepMetrics().convert([r])
    assert set(batch.scalars) == {f"{series_tag(r.name, r.mode, r.index)}/{s}"
                                  for s in ("mean", "std", "min", "max", "l2")}
    [batch] = StepMetrics(index=(":", ":")).convert([r])
    assert "blk/h:1:0/cotangent/mean" in batch.scalars
    with pytest.raises(ValueError, match="stats"):
        StepMetrics(stats=["nope"])
