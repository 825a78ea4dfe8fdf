"""Device summaries equal the host's numpy definitions, on values built to stress each rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sowtel.records import STAT_KEYS
from sowtel.summaries import decode_device_summary, device_summary, host_summary

RNG = np.random.default_rng(0)
VALUES = {
    "normal": RNG.normal(size=(64, 33)).astype(np.float32),
    "large_mean": (1000.0 + RNG.normal(size=4096)).astype(np.float32),
    "with_nan_inf": np.array([1.0, np.nan, -2.0, np.inf, 0.0, -np.inf, 3.0], np.float32),
    "all_nan": np.full(5, np.nan, np.float32),
    "empty": np.zeros((0, 3), np.float32),
    "scalar": np.float32(-2.5),
    "ints": RNG.integers(-5, 5, size=100).astype(np.int32),
    "bools": RNG.random(50) > 0.3,
    "float16": RNG.normal(size=300).astype(np.float16),
    "bfloat16": jnp.asarray(RNG.normal(size=300), jnp.bfloat16),
    "float64_as_32": RNG.normal(size=100),
}


@pytest.mark.parametrize("summary", ["stats", "histogram", "health"])
@pytest.mark.parametrize("kind", list(VALUES))
def test_device_summary_matches_host(kind: str, summary: str) -> None:
    value = VALUES[kind]
    arrays = jax.jit(lambda v: device_summary(v, summary))(value)
    size = int(np.size(value))
    device = decode_device_summary([np.asarray(a) for a in arrays], summary, size)
    host = host_summary(np.asarray(value, np.float32) if kind == "bfloat16" else value, summary)
    assert list(device["stats"]) == list(host["stats"])
    for key, expected in host["stats"].items():
        got = device["stats"][key]
        if np.isnan(expected):
            assert np.isnan(got), key
        else:
            tol = 2e-3 if kind in ("float16", "bfloat16") else 2e-5
            np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=key)
    if summary == "histogram":
        (d_edges, d_counts), (h_edges, h_counts) = device["histogram"], host["histogram"]
        np.testing.assert_allclose(d_edges, h_edges, rtol=1e-5)
        assert d_counts.sum() == h_counts.sum() == size - host["stats"]["nan"] - (
            host["stats"]["posinf"] + host["stats"]["neginf"])
        if kind not in ("float16", "bfloat16"):
            np.testing.assert_array_equal(d_counts, h_counts)


def test_stats_by_hand() -> None:
    s = host_summary(np.array([3.0, -4.0, 0.0, np.nan, np.inf]), "stats")["stats"]
    assert list(s) == list(STAT_KEYS)
    assert (s["size"], s["nan"], s["posinf"], s["neginf"], s["zeros"]) == (5, 1, 1, 0, 1)
    assert s["mean"] == pytest.approx(-1 / 3)
    assert s["std"] == pytest.approx(np.sqrt(((3 + 1 / 3) ** 2 + (4 - 1 / 3) ** 2 + (1 / 3) ** 2)
                                             / 3))
    assert (s["min"], s["max"], s["l2"], s["mean_abs"]) == (-4.0, 3.0, 5.0, pytest.approx(7 / 3))
