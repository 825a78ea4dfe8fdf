"""Values with an explicit sharding (``jax.make_mesh``'s default axis type) are summarised where
they lie: no transport flattens a value whose sharding cannot be flattened.

Over 8 host devices (a 4 x 2 mesh, ``data`` x ``model``, both axes ``Explicit``): a value
``[B@data, T, H@model]``, a ``[B, H@model]`` value and cotangent, and a site in a ``shard_map``
manual over ``data`` only, under ``save_intermediates``, the callback transport and
``sowtel.jit``, with the ``stats``, ``histogram`` and ``full`` summaries; every number is checked
against numpy on the same values computed in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sowtel
from sowtel.summaries import host_summary

B, T, D, H = 8, 3, 4, 6


def _mesh() -> Any:
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _inputs(mesh: Any) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    w = rng.normal(size=(D, H)).astype(np.float32) / 2
    w[0, 1] = 0.0  # an exact zero in h = x @ w is unlikely: zeros come from relu below
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    return x, w, xs, ws


def three_axes(w: Any, x: Any) -> Any:
    """A site ``[B@data, T, H@model]``: relu(x @ w), loss sum(h^2)."""
    h = sowtel.sow(jax.nn.relu(x @ w), "h")
    return (h * h).sum()


def two_axes(w: Any, x: Any) -> Any:
    """A site ``[B@data, H@model]``: relu(sum_t x @ w), loss sum(h^2)."""
    h = sowtel.sow(jax.nn.relu(x.sum(axis=1) @ w), "h")
    return (h * h).sum()


def partly_manual(w: Any, x: Any) -> Any:
    """A site in a shard_map manual over ``data`` only (``model`` stays explicit)."""
    def body(x: Any, w: Any) -> Any:
        return sowtel.sow(jax.nn.relu(x @ w), "h")

    h = jax.shard_map(body, in_specs=(P("data"), P()), out_specs=P("data"),
                      axis_names={"data"})(x, w)
    return (h * h).sum()


def _expected(case: str, x: np.ndarray, w: np.ndarray) -> dict[str, list[np.ndarray]]:
    """Per mode, the site's values (one per shard inside shard_map), in float64 by hand:
    h = relu(pre), and d loss / d h = 2 h."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    pre = (x64.sum(axis=1) if case == "two_axes" else x64) @ w64
    h = np.maximum(pre, 0)
    values = np.split(h, 4) if case == "partly_manual" else [h]
    return {"primal": values, "cotangent": [2 * v for v in values]}


CASES: dict[str, Callable[..., Any]] = {
    "three_axes": three_axes, "two_axes": two_axes, "partly_manual": partly_manual}


def _check_stats(stats: dict[str, float], value: np.ndarray) -> None:
    np.testing.assert_allclose(
        [stats[k] for k in ("mean", "std", "min", "max", "l2", "mean_abs")],
        [value.mean(), value.std(), value.min(), value.max(), np.sqrt((value ** 2).sum()),
         np.abs(value).mean()], rtol=2e-5, atol=1e-6)
    assert stats["size"] == value.size
    assert stats["zeros"] == (value == 0).sum() > 0
    assert stats["nan"] == stats["posinf"] == stats["neginf"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_capture_gives_the_values_and_cotangents(case: str) -> None:
    mesh = _mesh()
    x, w, xs, ws = _inputs(mesh)
    with jax.set_mesh(mesh):
        _, inter = jax.jit(sowtel.save_intermediates(jax.grad(CASES[case])))(ws, xs)
    expected = _expected(case, x, w)
    for mode in ("primal", "cotangent"):
        got = np.asarray(inter["h"][mode], np.float64)
        want = np.stack(expected[mode]) if case == "partly_manual" else expected[mode][0]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("summary", ["stats", "histogram", "full", "stats, variadic"])
@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_summaries_match_numpy(case: str, transport: str, summary: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if summary == "stats, variadic":  # the GPU's reduction form, run here on the CPU
        monkeypatch.setenv("SOWTEL_SUMMARY_FORM", "variadic")
        summary = "stats"
    mesh = _mesh()
    x, w, xs, ws = _inputs(mesh)
    wrap = jax.jit if transport == "callback" else sowtel.jit
    step = wrap(jax.grad(CASES[case]))
    with jax.set_mesh(mesh), sowtel.enable(exporter="memory", summary=summary) as session:
        grad = jax.block_until_ready(step(ws, xs))
        sowtel.flush()
    records = session.exporters[0].records
    expected = _expected(case, x, w)
    # The step's own result is untouched: d/dw sum(relu(x w)^2) = x^T (2 h).
    x64 = x.astype(np.float64).sum(axis=1) if case == "two_axes" else x.astype(np.float64)
    h = np.concatenate(expected["primal"]) if case == "partly_manual" else expected["primal"][0]
    np.testing.assert_allclose(np.asarray(grad),
                               (x64.reshape(-1, D).T @ (2 * h).reshape(-1, H)), rtol=1e-4,
                               atol=1e-5)
    for mode in ("primal", "cotangent"):
        got = sorted((r for r in records if r.mode == mode), key=lambda r: r.index or 0)
        assert [r.index for r in got] == ([0, 1, 2, 3] if case == "partly_manual" else [None])
        for record, value in zip(got, expected[mode], strict=True):
            _check_stats(record.stats, value)
            if summary == "full":
                np.testing.assert_allclose(np.asarray(record.value, np.float64), value,
                                           rtol=2e-5, atol=1e-6)
            if summary == "histogram":
                edges, counts = record.histogram
                _, want = host_summary(value.astype(np.float32), "histogram")["histogram"]
                assert counts.sum() == value.size
                np.testing.assert_array_equal(counts, want)
