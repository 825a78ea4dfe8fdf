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


#: How :func:`device_summary` reduces, per backend, chosen by measurement (see the README's
#: speed section): ``"separate"`` sibling reductions (fastest on XLA:CPU), ``"variadic"`` one
#: ``lax.reduce`` over all operands together (fastest on GPU). ``SOWTEL_SUMMARY_FORM`` overrides.
SUMMARY_FORMS = ("separate", "variadic")
_FORM_BY_BACKEND = {"cpu": "separate", "gpu": "variadic", "cuda": "variadic", "rocm": "variadic",
                    "tpu": "variadic"}

# Elements a first-level row reduces in the variadic form.
_ROW = 256

# Elements sampled (strided) to estimate the shift the sum of squares is taken about.
_SHIFT_SAMPLES = 64


def summary_form() -> str:
    """The reduction form :func:`device_summary` uses on the default backend (see
    ``SUMMARY_FORMS``); the environment variable ``SOWTEL_SUMMARY_FORM`` overrides it.

    Example:
        >>> import jax
        >>> summary_form() == ("separate" if jax.default_backend() == "cpu" else "variadic")
        True
    """
    import os

    import jax

    chosen = os.environ.get("SOWTEL_SUMMARY_FORM", "").strip().lower()
    if chosen:
        if chosen not in SUMMARY_FORMS:
            raise ValueError(f"SOWTEL_SUMMARY_FORM={chosen!r} is not a summary form: use one of "
                             f"{', '.join(SUMMARY_FORMS)}")
        return chosen
    return _FORM_BY_BACKEND.get(jax.default_backend(), "separate")


def _moments(xf: Any, mask: Any, form: str) -> tuple[Any, ...]:
    """``(n, shift, sum d, sum d*d, min, max, sum |x|, zeros)`` over the elements ``mask`` keeps
    (all when None), with ``d = x - shift``; one pass over ``xf`` (several sibling reductions,
    or one variadic reduce)."""
    import jax
    import jax.numpy as jnp

    ftype = xf.dtype
    size = xf.shape[0]
    # The shift: the mean of a few evenly spaced (finite) elements. Sums of squares about a
    # value near the mean keep float32's precision where sum(x*x) - n*mean^2 would not.
    stride = max(size // _SHIFT_SAMPLES, 1)
    sample = xf[::stride][:_SHIFT_SAMPLES]
    if mask is None:
        shift = jnp.mean(sample)
        n = jnp.asarray(size, ftype)
    else:
        keep = mask[::stride][:_SHIFT_SAMPLES]
        shift = jnp.sum(jnp.where(keep, sample, 0)) / jnp.maximum(jnp.sum(keep, dtype=ftype), 1)
        n = jnp.sum(mask, dtype=ftype)
    # Counts in the float type are exact up to 2**24 elements (float32); beyond, in int32.
    ctype = ftype if size < (1 << 24) else jnp.int32
    if mask is None:
        d = xf - shift
        vals, low, high, absx = xf, xf, xf, jnp.abs(xf)
    else:
        d = jnp.where(mask, xf - shift, 0)
        vals = jnp.where(mask, xf, 0)
        low = jnp.where(mask, xf, jnp.inf)
        high = jnp.where(mask, xf, -jnp.inf)
        absx = jnp.abs(vals)
    is_zero = (vals == 0) if mask is None else ((xf == 0) & mask)
    if form == "variadic":
        # One reduce; the mean and the sum of squared deviations merge pairwise (Chan et al.),
        # which stays accurate however far the shift is from the mean.
        zero = jnp.zeros((), ftype)
        ones = jnp.ones_like(d) if mask is None else mask.astype(ftype)

        def merge(p: tuple[Any, ...], q: tuple[Any, ...]) -> tuple[Any, ...]:
            count = p[0] + q[0]
            delta = q[1] - p[1]
            w = jnp.where(count > 0, q[0] / jnp.where(count > 0, count, 1), 0)
            return (count, p[1] + delta * w, p[2] + q[2] + delta * delta * p[0] * w,
                    jnp.minimum(p[3], q[3]), jnp.maximum(p[4], q[4]), p[5] + q[5], p[6] + q[6])

        inits = (zero, zero, zero, jnp.asarray(jnp.inf, ftype), jnp.asarray(-jnp.inf, ftype),
                 zero, zero)
        operands = [ones, d, jnp.zeros_like(d), low, high, absx, is_zero.astype(ftype)]
        # Rows of _ROW elements, then the rows: a two-level reduction keeps rounding errors at
        # (size / _ROW + _ROW) ulps where one long accumulation could reach size ulps.
        pad = -size % _ROW
        if pad:
            operands = [jnp.concatenate([o, jnp.full((pad,), i, ftype)])
                        for o, i in zip(operands, inits, strict=True)]
        rows = jax.lax.reduce(tuple(o.reshape(-1, _ROW) for o in operands), inits, merge, (1,))
        k, m, m2, mn, mx, a, z = jax.lax.reduce(rows, inits, merge, (0,))
        s1 = m * k
        s2 = m2 + m * m * k
    else:
        s1, s2 = jnp.sum(d), jnp.sum(d * d)
        mn, mx = jnp.min(low), jnp.max(high)
        a, z = jnp.sum(absx), jnp.sum(is_zero, dtype=ctype)
    return n, shift, s1, s2, mn, mx, a, z


def device_summary(x: Any, summary: str, bins: int = DEFAULT_BINS) -> list[Any]:
    """JAX ops that reduce ``x`` on the device to the arrays the host receives.

    Returns a list of arrays: ``stats`` -> ``[floats(6), counts(4)]``; ``full`` -> ``[x]``
    (its stats are computed on the host, off the training thread, so that the transfer runs at
    copy speed);
    ``histogram`` -> the stats plus ``[counts(bins)]``; ``health`` -> ``[counts(3)]``;
    ``shape`` -> ``[]``. :func:`decode_device_summary` turns them back into a dict.

    ``stats`` reads the value once: the sum and the sum of squares about a shift (the mean of
    64 evenly spaced elements, so ``std`` keeps float32's precision when the mean is far from
    zero), the extrema, the sum of absolute values and the count of zeros, computed together
    (as sibling reductions or one variadic reduce, see :func:`summary_form`). A non-finite sum
    of squares means the value holds NaN or infinities: only then, under a ``lax.cond``, the
    same pass runs again with those elements masked out and counted.
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
    size = xf.size

    def nonfinite_counts() -> Any:
        return jnp.stack([jnp.sum(jnp.isnan(xf), dtype=cdtype),
                          jnp.sum(jnp.isposinf(xf), dtype=cdtype),
                          jnp.sum(jnp.isneginf(xf), dtype=cdtype)])

    if summary == "health":
        # Zeros derived from the data, so that inside shard_map they vary across shards as the
        # computed counts do (the branches of a cond must agree on that).
        total = jnp.sum(xf)
        no_counts = jnp.zeros((3,), cdtype) + (total != total).astype(cdtype) * 0
        if not is_float or size == 0:
            return [no_counts]
        return [jax.lax.cond(jnp.isfinite(total), lambda: no_counts, nonfinite_counts)]
    if size == 0:
        nan = jnp.asarray(jnp.nan, ftype)
        floats = jnp.stack([nan, nan, nan, nan, jnp.asarray(0, ftype), nan])
        out = [floats, jnp.zeros((4,), cdtype)]
        if summary == "histogram":
            out.append(jnp.zeros((bins,), cdtype))
        return out
    form = summary_form()

    def pack(moments: tuple[Any, ...], counts: Any) -> tuple[Any, Any]:
        n, shift, s1, s2, mn, mx, a, z = moments
        safe_n = jnp.maximum(n, 1)
        m1 = s1 / safe_n
        mean = shift + m1
        var = jnp.maximum(s2 / safe_n - m1 * m1, 0)
        # sum x^2 = sum (d + shift)^2
        sq = jnp.maximum(s2 + 2 * shift * s1 + n * shift * shift, 0)
        empty = n == 0
        nan = jnp.asarray(jnp.nan, ftype)
        floats = jnp.stack([
            jnp.where(empty, nan, mean), jnp.where(empty, nan, jnp.sqrt(var)),
            jnp.where(empty, nan, mn), jnp.where(empty, nan, mx), jnp.sqrt(sq),
            jnp.where(empty, nan, a / safe_n)]).astype(ftype)
        return floats, jnp.concatenate([counts, z.astype(cdtype)[None]])

    first = _moments(xf, None, form)

    def careful() -> tuple[Any, Any]:
        # Non-finite elements (masked out and counted), or a sampled shift far from the mean
        # (outliers where it sampled): the sums again about the mean itself. Rare by design.
        mask = jnp.isfinite(xf) if is_float else jnp.ones(xf.shape, bool)
        n = jnp.sum(mask, dtype=ftype)
        mean = jnp.sum(jnp.where(mask, xf, 0)) / jnp.maximum(n, 1)
        d = jnp.where(mask, xf - mean, 0)
        _, _, _, _, mn, mx, a, z = _moments(xf, mask, form)
        counts = nonfinite_counts() if is_float else jnp.zeros((3,), cdtype)
        return pack((n, mean, jnp.sum(d), jnp.sum(d * d), mn, mx, a, z), counts)

    n, shift, s1, s2 = first[:4]
    m1 = s1 / n
    # The shift is good when the mean of d is small against its spread (or all is finite).
    fine = jnp.isfinite(s1) & jnp.isfinite(s2) & (m1 * m1 * n <= 16 * s2)
    no_counts = jnp.zeros((3,), cdtype) + (s2 != s2).astype(cdtype) * 0
    floats, counts = jax.lax.cond(fine, lambda: pack(first, no_counts), careful)
    out = [floats, counts]
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
