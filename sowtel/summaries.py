"""Summaries of a sown value: what crosses from the device to the host.

The same definitions run in two places: :func:`device_summary` inside the compiled program (JAX
ops, before the host callback) and :func:`host_summary` on numpy arrays (for
:func:`sowtel.export` of captured intermediates). Both follow the rules of the ``"stats"``
summary: statistics ignore non-finite elements and count them apart; ``std`` has ddof=0; ``l2``
is the Euclidean norm of the finite elements; integers and bools are summarised as floats.

Example:
    >>> import numpy as np
    >>> s = host_summary(np.array([1.0, -1.0, np.nan]), "stats")["stats"]
    >>> (s["size"], s["mean"], s["std"], s["nan"])
    (3.0, 0.0, 1.0, 1.0)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sowtel.records import HEALTH_KEYS, STAT_KEYS, SUMMARIES

#: Default number of histogram buckets.
DEFAULT_BINS = 30

#: How many arrays the device sends per leaf, by summary (see :func:`device_summary`).
ARRAYS_PER_LEAF = {"full": 1, "histogram": 3, "stats": 2, "health": 1, "shape": 0}

# Order of the float and count vectors the device sends for "stats".
_FLOAT_KEYS = ("mean", "std", "min", "max", "l2", "mean_abs")
_COUNT_KEYS = ("nan", "posinf", "neginf", "zeros")


def check_summary(summary: Any, what: str = "summary") -> str:
    """Returns ``summary`` if it names a summary kind, else raises ValueError."""
    if summary not in SUMMARIES:
        raise ValueError(f"{what}={summary!r} is not a summary: use one of {', '.join(SUMMARIES)}")
    return str(summary)


def _float_dtype(dtype: np.dtype) -> np.dtype:
    # Half precision is summarised in float32 so sums do not overflow; float64 stays float64.
    if np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize >= 8:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def host_summary(x: Any, summary: str, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Summarises a host array. Returns ``stats`` (dict) and, for histograms, ``histogram``.

    The result has the keys ``"stats"`` (floats keyed by ``STAT_KEYS`` or ``HEALTH_KEYS``) and
    ``"histogram"`` (``(edges, counts)`` or ``None``).
    """
    check_summary(summary)
    x = np.asarray(x)
    if summary == "shape":
        return {"stats": {}, "histogram": None}
    is_float = np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating)
    if np.issubdtype(x.dtype, np.complexfloating):
        x = np.abs(x)
    xf = x.astype(_float_dtype(x.dtype) if is_float else np.float64).ravel()
    size = float(xf.size)
    if is_float:
        nan = float(np.isnan(xf).sum())
        posinf = float(np.isposinf(xf).sum())
        neginf = float(np.isneginf(xf).sum())
    else:
        nan = posinf = neginf = 0.0
    if summary == "health":
        vals = dict(zip(HEALTH_KEYS, (size, nan, posinf, neginf), strict=True))
        return {"stats": vals, "histogram": None}
    finite = xf[np.isfinite(xf)]
    n = finite.size
    if n:
        mean = float(finite.mean(dtype=np.float64))
        std = float(np.sqrt(np.mean((finite.astype(np.float64) - mean) ** 2)))
        mn, mx = float(finite.min()), float(finite.max())
        l2 = float(np.sqrt(np.sum(finite.astype(np.float64) ** 2)))
        mean_abs = float(np.mean(np.abs(finite), dtype=np.float64))
    else:
        mean = std = mn = mx = mean_abs = float("nan")
        l2 = 0.0
    zeros = float((xf == 0).sum())
    stats = dict(
        zip(STAT_KEYS, (size, mean, std, mn, mx, l2, mean_abs, nan, posinf, neginf, zeros),
            strict=True)
    )
    hist = None
    if summary == "histogram":
        lo, hi = (mn, mx) if n else (0.0, 0.0)
        edges = np.linspace(lo, hi, bins + 1) if hi > lo else lo + np.arange(bins + 1) * 1.0
        counts = _bucket_counts_host(finite, lo, hi, bins)
        hist = (edges, counts)
    return {"stats": stats, "histogram": hist}


def _bucket_counts_host(finite: np.ndarray, lo: float, hi: float, bins: int) -> np.ndarray:
    # The device's bucketing, in the same precision: floor((x - lo) * scale), max in the last.
    dtype = finite.dtype.type
    lo_, hi_ = dtype(lo), dtype(hi)
    # A multiply by bins / (hi - lo), as the device does: division is not bit-reproducible there.
    scale = dtype(bins) / (hi_ - lo_) if hi_ > lo_ else dtype(0)
    idx = np.clip(np.floor((finite - lo_) * scale), 0, bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=bins).astype(np.float64)


def device_summary(x: Any, summary: str, bins: int = DEFAULT_BINS) -> list[Any]:
    """JAX ops that reduce ``x`` on the device to the arrays the host callback receives.

    Returns a list of arrays: ``stats`` -> ``[floats(6), counts(4)]``; ``full`` -> ``[x]``
    (its stats are computed on the host, off the training thread, so that the transfer runs at
    copy speed);
    ``histogram`` -> the stats plus ``[counts(bins)]``; ``health`` -> ``[counts(3)]``;
    ``shape`` -> ``[]``. :func:`decode_device_summary` turns them back into a dict.

    Each statistic is one pass over the value, and XLA runs the passes one after another, so
    the common case is kept short: a plain sum doubles as the test for non-finite elements (any
    NaN or infinity makes it non-finite), and only then do the masked passes run, under a
    ``lax.cond``. An all-finite value costs six passes (sum, centred sum of squares, sum of
    absolute values, zeros, min, max).
    """
    import jax
    import jax.numpy as jnp

    if summary == "full":
        return [x]
    if summary == "shape":
        return []
    is_float = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.abs(x)
    ftype = jnp.float64 if (is_float and x.dtype.itemsize >= 8) else jnp.float32
    xf = x.astype(ftype).ravel()
    cdtype = jnp.int32

    def nonfinite_counts() -> Any:
        return jnp.stack([jnp.sum(jnp.isnan(xf), dtype=cdtype),
                          jnp.sum(jnp.isposinf(xf), dtype=cdtype),
                          jnp.sum(jnp.isneginf(xf), dtype=cdtype)])

    total = jnp.sum(xf)
    # Zeros derived from the data, so that inside shard_map they vary across shards as the
    # computed counts do (the branches of a cond must agree on that).
    no_counts = jnp.zeros((3,), cdtype) + (total != total).astype(cdtype) * 0
    all_finite = jnp.isfinite(total) if is_float else jnp.bool_(True)
    if summary == "health":
        if not is_float or xf.size == 0:
            return [no_counts]
        return [jax.lax.cond(all_finite, lambda: no_counts, nonfinite_counts)]
    size = xf.size

    def finite_moments() -> Any:
        # The sum is already there, so the variance is the exact two-pass one, and the sum of
        # squares follows from it without another pass.
        mean = total / size
        d = xf - mean
        sd2 = jnp.sum(d * d)
        std = jnp.sqrt(sd2 / size)
        return (jnp.stack([mean, std, jnp.min(xf), jnp.max(xf), jnp.sqrt(sd2 + size * mean * mean),
                           jnp.sum(jnp.abs(xf)) / size]), no_counts)

    def masked_moments() -> Any:
        mask = jnp.isfinite(xf)
        n = jnp.sum(mask, dtype=ftype)
        safe = jnp.where(mask, xf, 0)
        mean = jnp.sum(safe) / n
        dev = jnp.where(mask, xf - mean, 0)
        empty = n == 0
        mn = jnp.where(empty, jnp.nan, jnp.min(jnp.where(mask, xf, jnp.inf)))
        mx = jnp.where(empty, jnp.nan, jnp.max(jnp.where(mask, xf, -jnp.inf)))
        return (jnp.stack([mean, jnp.sqrt(jnp.sum(dev * dev) / n), mn, mx,
                           jnp.sqrt(jnp.sum(safe * safe)), jnp.sum(jnp.abs(safe)) / n]),
                nonfinite_counts())

    if size == 0:
        nan = jnp.asarray(jnp.nan, ftype)
        floats = jnp.stack([nan, nan, nan, nan, jnp.asarray(0, ftype), nan])
        counts = no_counts
    elif is_float:
        floats, counts = jax.lax.cond(all_finite, finite_moments, masked_moments)
    else:
        floats, counts = finite_moments()
    zeros = jnp.sum(xf == 0, dtype=cdtype)
    out = [floats, jnp.concatenate([counts, zeros[None]])]
    if summary == "histogram":
        mn, mx = floats[2], floats[3]
        empty = jnp.isnan(mn)
        lo = jnp.where(empty, 0, mn)
        hi = jnp.where(empty, 0, mx)
        mask = jnp.isfinite(xf)
        safe = jnp.where(mask, xf, 0)
        scale = jnp.where(hi > lo, jnp.asarray(bins, ftype) / (hi - lo), 0)
        idx = jnp.clip(jnp.floor((safe - lo) * scale), 0, bins - 1).astype(jnp.int32)
        counts_h = jnp.zeros((bins,), cdtype).at[idx].add(mask.astype(cdtype))
        out.append(counts_h)
    return out


def decode_device_summary(
    arrays: list[np.ndarray], summary: str, size: int, bins: int = DEFAULT_BINS
) -> dict[str, Any]:
    """Turns :func:`device_summary`'s arrays (now on the host) into ``stats`` and ``histogram``."""
    if summary == "full":
        return {"stats": host_summary(arrays[0], "stats")["stats"], "histogram": None}
    if summary == "shape":
        return {"stats": {}, "histogram": None}
    if summary == "health":
        nan, posinf, neginf = arrays[0].tolist()
        return {"stats": dict(zip(HEALTH_KEYS, (float(size), float(nan), float(posinf),
                                                float(neginf)), strict=True)),
                "histogram": None}
    stats = {"size": float(size)}
    stats.update(zip(_FLOAT_KEYS, np.asarray(arrays[0], np.float64).tolist(), strict=True))
    stats.update(zip(_COUNT_KEYS, np.asarray(arrays[1], np.float64).tolist(), strict=True))
    if stats["nan"] + stats["posinf"] + stats["neginf"] == size and size:
        stats["l2"] = 0.0
    hist = None
    if summary == "histogram":
        lo, hi = stats["min"], stats["max"]
        if not np.isfinite(lo):
            lo = hi = 0.0
        edges = np.linspace(lo, hi, bins + 1) if hi > lo else lo + np.arange(bins + 1) * 1.0
        hist = (edges, np.asarray(arrays[2], dtype=np.float64))
    return {"stats": {k: stats[k] for k in STAT_KEYS}, "histogram": hist}
