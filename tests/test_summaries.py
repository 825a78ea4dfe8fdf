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


def _std_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = 200_003  # not a multiple of the shift's sampling stride
    spread = rng.normal(size=n)
    periodic = np.where(np.arange(n) % (n // 64) == 0, 50.0, 0.0) + rng.normal(size=n) * 0.1
    return {
        "centred": spread,
        "mean_1e3_std": 950.0 + spread,  # |mean| near 1e3 * std: the edge of the promise
        "negative_mean_1e3_std": -2.85e3 + 3.0 * spread,
        "tiny_std": 1e-3 * spread + 0.95,  # the same ratio at a small scale
        "sampled_outliers": 950.0 * periodic.std() + periodic,  # the shift samples outliers
        "uniform_ramp": np.linspace(-7.0, 9.0, n),
    }


@pytest.mark.parametrize("form", ["separate", "variadic"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", list(_std_cases()))
def test_std_is_accurate_against_float64(case: str, dtype: str, form: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    raw = _std_cases()[case]
    if dtype == "float16" and np.abs(raw).max() > 6e4:
        raw = raw / 100.0  # within float16's range, same |mean| / std
    for widen in (1.0, 4.0, 16.0):
        # Rounding to bfloat16 (8 bits) can collapse a spread of less than one ulp around a
        # large mean: widen the spread until the rounded values keep |mean| <= 1e3 std.
        wide = raw.mean() + (raw - raw.mean()) * widen
        value = jnp.asarray(wide, dtype)
        exact = np.asarray(value.astype(jnp.float32), np.float64)  # what the device sees
        if abs(exact.mean()) <= 1e3 * exact.std():
            break
    else:
        pytest.fail(f"case {case} in {dtype} breaks |mean| <= 1e3 std: fix the case")
    assert abs(exact.mean()) > 50 * exact.std() or case in ("centred", "uniform_ramp")
    floats, _ = jax.jit(lambda v: device_summary(v, "stats"))(value)
    mean, std, mn, mx, l2, mean_abs = np.asarray(floats, np.float64)
    np.testing.assert_allclose(std, exact.std(), rtol=1e-3, err_msg="std")
    np.testing.assert_allclose(mean, exact.mean(), rtol=1e-5, atol=1e-3 * exact.std())
    np.testing.assert_allclose(l2, np.sqrt(np.sum(exact ** 2)), rtol=1e-4)
    np.testing.assert_allclose(mean_abs, np.abs(exact).mean(), rtol=1e-4)
    assert (mn, mx) == (exact.min(), exact.max())


def test_summary_form_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from sowtel.summaries import summary_form

    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", "fused")
    with pytest.raises(ValueError, match="SOWTEL_SUMMARY_FORM='fused' is not a summary form"):
        summary_form()
    monkeypatch.delenv("SOWTEL_SUMMARY_FORM")
    assert summary_form() == "separate"  # what measured fastest on XLA:CPU


def test_both_forms_give_the_same_stats_with_non_finite_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    value = VALUES["with_nan_inf"]
    got = []
    for form in ("separate", "variadic"):
        monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
        arrays = jax.jit(lambda v: device_summary(v, "histogram"))(value)
        got.append(decode_device_summary([np.asarray(a) for a in arrays], "histogram", 7))
    assert got[0]["stats"] == got[1]["stats"]
    assert got[0]["stats"]["nan"] == 1 and got[0]["stats"]["mean"] == pytest.approx(0.5)
    np.testing.assert_array_equal(got[0]["histogram"][1], got[1]["histogram"][1])
