"""Device summaries equal the host's numpy definitions, on values built to stress each rule."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sowtel.records import STAT_KEYS
from sowtel.summaries import (
    decode_device_summary,
    device_summary,
    histogram_edges,
    host_summary,
    stats_table,
)

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


def test_histogram_edges_by_hand_the_one_rule_of_every_path() -> None:
    # Evenly spaced from min to max, the last edge max exactly; unit-wide from min when min ==
    # max; from 0 when no element is finite (NaN min); one value or several at once.
    got = histogram_edges(np.array([-1.0, 1.0, np.nan, 0.0]),
                          np.array([2.0, 1.0, np.nan, 0.3]), 4)
    assert got.dtype == np.float64 and got.shape == (4, 5)
    np.testing.assert_array_equal(got[:3], [[-1.0, -0.25, 0.5, 1.25, 2.0],
                                            [1.0, 2.0, 3.0, 4.0, 5.0],
                                            [0.0, 1.0, 2.0, 3.0, 4.0]])
    assert got[3, -1] == 0.3 and got[3, 0] == 0.0
    np.testing.assert_allclose(got[3], [0.0, 0.075, 0.15, 0.225, 0.3], rtol=1e-15)
    np.testing.assert_array_equal(histogram_edges(-2.0, 2.0, 2), [[-2.0, 0.0, 2.0]])
    lo = np.array([np.inf, 1.0])
    histogram_edges(lo, np.array([-np.inf, 1.0]), 1)
    assert lo.tolist() == [np.inf, 1.0]  # the caller's arrays untouched
    # host_summary and the device decoder take theirs from it.
    host = host_summary(np.array([-1.0, 0.0, 2.0]), "histogram", bins=4)["histogram"]
    np.testing.assert_array_equal(host[0], [-1.0, -0.25, 0.5, 1.25, 2.0])
    np.testing.assert_array_equal(host_summary(np.array([np.nan]), "histogram", 2)["histogram"][0],
                                  [0.0, 1.0, 2.0])


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
    mean, std, mn, mx, l2, mean_abs = _stats(value)[1:7]
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


def _stats(value: Any) -> np.ndarray:
    """The device's ``stats`` of ``value``, decoded: one row in ``STAT_KEYS`` order."""
    moments, counts = jax.jit(lambda v: device_summary(v, "stats"))(value)
    return stats_table(np.asarray(moments)[None], np.asarray(counts)[None],
                       np.array([np.size(value)], np.float64))[0]


def _finite_stats(value: np.ndarray) -> dict[str, float]:
    """The stats of ``value`` by numpy in float64: finite elements only, the rest counted."""
    x = np.asarray(value, np.float64).ravel()
    finite = x[np.isfinite(x)]
    return {"mean": finite.mean(), "std": finite.std(), "min": finite.min(),
            "max": finite.max(), "l2": np.sqrt(np.sum(finite ** 2)),
            "mean_abs": np.abs(finite).mean(), "nan": np.isnan(x).sum(),
            "posinf": np.isposinf(x).sum(), "neginf": np.isneginf(x).sum(),
            "zeros": (x == 0).sum()}


@pytest.mark.parametrize("form", ["separate", "variadic"])
@pytest.mark.parametrize("share", [0.001, 0.3, 0.9])
@pytest.mark.parametrize("first", ["finite", "nan"])
def test_non_finite_elements_are_masked_without_losing_the_spread(
        form: str, share: float, first: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # |mean| = 900 std with up to 90% NaN / +inf / -inf: the non-finite elements are taken out
    # of the sums exactly enough that std keeps its 1e-3 promise.
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    rng = np.random.default_rng(3)
    n = 100_000
    x = (900.0 + rng.normal(size=n)).astype(np.float32)
    bad = rng.random(n) < share
    x[bad] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), size=int(bad.sum()))
    x[0] = np.nan if first == "nan" else 900.5
    got = dict(zip(STAT_KEYS, _stats(jnp.asarray(x.reshape(4, -1))), strict=True))
    want = _finite_stats(x)
    assert want["mean"] > 500 * want["std"]
    for key in ("nan", "posinf", "neginf", "zeros", "min", "max"):
        assert got[key] == want[key], key
    np.testing.assert_allclose(got["std"], want["std"], rtol=1e-3)
    for key in ("mean", "l2", "mean_abs"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("form", ["separate", "variadic"])
def test_extremes_and_signed_zeros_by_hand(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    big = np.finfo(np.float32).max
    x = np.array([big, -big, -0.0, 0.0, 1.0, np.inf, np.nan, -np.inf], np.float32)
    stats = _stats(jnp.asarray(x))
    assert (stats[3], stats[4]) == (-big, big)  # the finite extremes, not the infinities
    assert stats[7:].tolist() == [1, 1, 1, 2]  # nan, +inf, -inf, zeros (both signs)


def test_float64_values_are_summarised_in_float64() -> None:
    x = np.array([1e300, 3e300, np.inf, np.nan, 0.0, -2e300], np.float64)
    with jax.enable_x64(True):
        moments, _ = jax.jit(lambda v: device_summary(v, "stats"))(jnp.asarray(x))
        assert moments.dtype == jnp.float64
        stats = _stats(jnp.asarray(x))
    size, mean, std, mn, mx, l2, mean_abs = stats[:7]
    assert (mn, mx) == (-2e300, 3e300)
    assert mean == pytest.approx(0.5e300)
    assert mean_abs == pytest.approx(1.5e300)
    assert stats[7:].tolist() == [1, 1, 0, 1]


NO_FINITE = {
    "all_nan": np.full(5, np.nan, np.float32),
    "infinities": np.array([np.inf, -np.inf, np.nan, np.inf], np.float32),
    "empty": np.zeros((0, 3), np.float32),
}
UNDEFINED = ("mean", "std", "min", "max", "l2", "mean_abs")


@pytest.mark.parametrize("form", ["separate", "variadic"])
@pytest.mark.parametrize("kind", list(NO_FINITE))
def test_a_value_with_no_finite_element_has_nan_statistics_l2_included(
        kind: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # DESIGN "Contract changes accepted": NaN mean/std/min/max/l2/mean_abs, never 0, on the
    # device (both reduction forms, decoded one by one and as a table) and on the host.
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    value = NO_FINITE[kind]
    arrays = [np.asarray(a) for a in jax.jit(lambda v: device_summary(v, "stats"))(value)]
    decoded = decode_device_summary(arrays, "stats", value.size)["stats"]
    row = dict(zip(STAT_KEYS, _stats(jnp.asarray(value)).tolist(), strict=True))
    host = host_summary(value, "stats")["stats"]
    for stats in (decoded, row, host):
        assert [k for k in UNDEFINED if not np.isnan(stats[k])] == [], (kind, stats)
        assert stats["size"] == value.size
    counts = {k: host[k] for k in ("nan", "posinf", "neginf")}
    assert counts == {"all_nan": {"nan": 5.0, "posinf": 0.0, "neginf": 0.0},
                      "infinities": {"nan": 1.0, "posinf": 2.0, "neginf": 1.0},
                      "empty": {"nan": 0.0, "posinf": 0.0, "neginf": 0.0}}[kind]


def test_bfloat16_and_float8_nan_and_inf_are_counted_on_the_host() -> None:
    # numpy files ml_dtypes' types as kind "V" (np.issubdtype(bfloat16, np.floating) is
    # False); their NaN and infinities must count as float16's do.
    import ml_dtypes

    from sowtel.records import Record, inexact, is_nonfinite

    x = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], ml_dtypes.bfloat16)
    s = host_summary(x, "stats")["stats"]
    assert (s["nan"], s["posinf"], s["neginf"]) == (1.0, 1.0, 1.0)
    assert (s["mean"], s["std"], s["min"], s["max"]) == (1.5, 0.5, 1.0, 2.0)
    assert host_summary(x, "health")["stats"] == {"size": 5.0, "nan": 1.0, "posinf": 1.0,
                                                  "neginf": 1.0}
    f8 = np.array([np.nan, 1.0, 2.0], ml_dtypes.float8_e4m3fn)  # no infinities in e4m3fn
    assert host_summary(f8, "stats")["stats"]["nan"] == 1.0
    assert [inexact(t) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, ml_dtypes.int4,
                                 np.int32, np.complex64)] == [True, True, False, False, True]
    full = Record(name="h", mode="primal", tag="t", step=0, index=None, wall_time=0.0,
                  summary="full", shape=(5,), dtype="bfloat16", value=x)
    assert is_nonfinite(full)


BIG = {
    # value, std, l2, mean_abs: by hand
    "pm_1.5e19": (np.array([1.5e19, -1.5e19], np.float32), 1.5e19, 1.5e19 * np.sqrt(2), 1.5e19),
    "eight_1e38": (np.full(8, 1e38, np.float32), 0.0, 1e38 * np.sqrt(8), 1e38),
}


@pytest.mark.parametrize("form", ["separate", "variadic"])
@pytest.mark.parametrize("kind", list(BIG))
def test_finite_values_whose_squares_overflow_have_finite_correct_statistics(
        kind: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    value, std, l2, mean_abs = BIG[kind]
    big = float(value.astype(np.float64)[0])  # the float32 value, exactly
    scale = big / float(np.abs(np.float64(value[0])))
    device = dict(zip(STAT_KEYS, _stats(jnp.asarray(value)).tolist(), strict=True))
    host = host_summary(value, "stats")["stats"]
    for stats in (device, host):
        np.testing.assert_allclose([stats["std"], stats["l2"], stats["mean_abs"]],
                                   [std * scale, l2 * scale, mean_abs * scale],
                                   rtol=1e-6, atol=0, err_msg=f"{kind} {form}")
        assert (stats["nan"], stats["posinf"], stats["neginf"]) == (0.0, 0.0, 0.0)


def test_float64_values_near_1e300_have_finite_correct_statistics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The "separate" form (XLA:CPU's) scales when a sum overflows; the host always does.
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", "separate")
    x = np.array([1e300, 3e300, np.inf, np.nan, 0.0, -2e300], np.float64)
    with jax.enable_x64(True):
        device = dict(zip(STAT_KEYS, _stats(jnp.asarray(x)).tolist(), strict=True))
    host = host_summary(x, "stats")["stats"]
    # Finite elements 1, 3, 0, -2 (x1e300): mean 0.5, deviations 0.5 2.5 0.5 2.5.
    for stats in (device, host):
        np.testing.assert_allclose(
            [stats["mean"], stats["std"], stats["l2"], stats["mean_abs"]],
            [0.5e300, np.sqrt(13.0 / 4) * 1e300, np.sqrt(14.0) * 1e300, 1.5e300], rtol=1e-12)


@pytest.mark.parametrize("form", ["separate", "variadic"])
def test_subnormals_are_zeros_on_the_device_and_the_host_alike(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOWTEL_SUMMARY_FORM", form)
    x = np.concatenate([np.full(16, 1e-40, np.float32), np.array([2.0, -2.0], np.float32)])
    device = dict(zip(STAT_KEYS, _stats(jnp.asarray(x)).tolist(), strict=True))
    host = host_summary(x, "stats")["stats"]
    for stats in (device, host):
        assert stats["zeros"] == 16.0
        assert (stats["min"], stats["max"]) == (-2.0, 2.0)
        assert stats["mean"] == pytest.approx(0.0, abs=1e-7)
        assert stats["mean_abs"] == pytest.approx(4.0 / 18, rel=1e-6)


def test_block_summaries_merge_without_overflow() -> None:
    # Under sharded jit across processes a value's blocks are summarised apart and merged
    # (sowtel.multihost.merge_partials): the merge must not square what the blocks did not.
    from sowtel.multihost import merge_partials

    rows = jnp.array([[1.5e19, -1.5e19], [3e19, -3e19]], jnp.float32)
    moments, counts = jax.vmap(lambda r: tuple(device_summary(r, "stats")))(rows)
    merged, _ = merge_partials(jnp.concatenate([moments, counts.astype(moments.dtype)], 1))
    table = stats_table(np.asarray(merged)[None], np.zeros((1, 4)), np.array([4.0]))[0]
    stats = dict(zip(STAT_KEYS, table.tolist(), strict=True))
    exact = np.asarray(rows, np.float64).ravel()
    np.testing.assert_allclose([stats["mean"], stats["std"], stats["l2"], stats["mean_abs"]],
                               [0.0, exact.std(), np.linalg.norm(exact), np.abs(exact).mean()],
                               rtol=1e-6, atol=1e13)
