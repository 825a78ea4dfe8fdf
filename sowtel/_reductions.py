"""The device reductions behind the ``"stats"`` summary (:func:`sowtel.summaries.device_summary`
and its packed form): the ``"separate"`` and ``"variadic"`` forms, their merge and identity, the
masked and scaled pass, the row-by-row form of packed values, and the arrays a device sends, in
THE layout of :data:`sowtel.records.DEVICE_MOMENTS` and :data:`~sowtel.records.DEVICE_COUNTS`.

Example:
    >>> import jax.numpy as jnp
    >>> wire_moments(mean=1.0, std=0.0, min=1.0, max=1.0, n=2.0, mean_abs=1.0).tolist()
    [1.0, 0.0, 1.0, 1.0, 2.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sowtel.records import DEVICE_COUNTS, DEVICE_MOMENTS, NONFINITE_KINDS

__all__ = ["aval", "all_axes", "separate_moments", "merge_moments", "moment_inits",
           "variadic_moments", "scaled_moments", "wire_moments", "wire_counts", "rows_moments",
           "stats_rows", "stats_rows_many"]


def aval(x: Any) -> Any:
    import jax

    typeof = getattr(jax, "typeof", None)
    try:
        return typeof(x) if typeof is not None else None
    except TypeError:  # not a JAX value
        return None


# Elements a first-level row of the variadic form reduces, for a 1-D value.
_ROW = 256


def _sharded(x: Any) -> bool:
    spec = getattr(getattr(aval(x), "sharding", None), "spec", None)
    return spec is not None and any(p is not None for p in spec)


def all_axes(x: Any) -> tuple[int, ...]:
    return tuple(range(x.ndim))


def separate_moments(x: Any) -> tuple[Any, ...]:
    """``(n, mean, sum (x - mean)^2, min, max, sum |x|, zeros, no counts)`` of every element,
    each reduction over every axis of ``x`` (never reshaped: a sharded value stays as it is
    sharded). The three sums are sibling reductions, each its own vectorised kernel on XLA:CPU;
    the sum of squares is about the mean (a second pass, exact). The extrema and the zero count
    come from one variadic reduce: minimum, maximum and integer addition are exact in any
    order, so XLA:CPU vectorises that loop (it cannot reorder a floating-point sum), and one
    read gives three statistics. Measured against forms without the conditional around the
    masked statistics (on a copy of every value with its non-finite elements replaced): as fast
    on the MLP, 4% faster on the transformer block, whose large values the copy reads twice
    (see docs/benchmarks.md)."""
    import jax
    import jax.numpy as jnp

    ftype = x.dtype
    n = jnp.asarray(x.size, ftype)
    mean = jnp.sum(x) / n
    m2 = jnp.sum(jnp.square(x - mean))
    a = jnp.sum(jnp.abs(x))
    i32 = jnp.int32
    mn, mx, zeros = jax.lax.reduce(
        (x, x, (x == 0).astype(i32)),
        (jnp.asarray(jnp.inf, ftype), jnp.asarray(-jnp.inf, ftype), i32(0)),
        lambda p, q: (jnp.minimum(p[0], q[0]), jnp.maximum(p[1], q[1]), p[2] + q[2]),
        all_axes(x))
    none = i32(0)
    return n, mean, m2, mn, mx, a, zeros, (none, none, none)


def merge_moments(p: tuple[Any, ...], q: tuple[Any, ...]) -> tuple[Any, ...]:
    """The pairwise merge of the variadic reduce (Chan et al.): count, mean, variance, min,
    max, mean |x|, then the integer counts, summed."""
    import jax.numpy as jnp

    count = p[0] + q[0]
    delta = q[1] - p[1]
    w = jnp.where(count > 0, q[0] / jnp.where(count > 0, count, 1), 0)
    v = 1 - w
    # Means of the variance and of |x|, not sums: no partial result exceeds the value's
    # largest magnitude (or the variance itself), so none overflows where the statistics do
    # not. delta^2 w v as (delta w)(delta v): a quarter of delta^2 at most.
    return (count, p[1] + delta * w, p[2] * v + q[2] * w + (delta * w) * (delta * v),
            jnp.minimum(p[3], q[3]), jnp.maximum(p[4], q[4]), p[5] * v + q[5] * w,
            *(a + b for a, b in zip(p[6:], q[6:], strict=True)))


def moment_inits(ftype: Any, counts: bool) -> tuple[Any, ...]:
    """The identity of :func:`merge_moments`, with the three non-finite counts if ``counts``."""
    import jax.numpy as jnp

    zero = jnp.zeros((), ftype)
    i32 = jnp.int32
    return (zero, zero, zero, jnp.asarray(jnp.inf, ftype), jnp.asarray(-jnp.inf, ftype),
            zero, i32(0)) + (i32(0),) * (3 * counts)


def variadic_moments(x: Any, mask: Any) -> tuple[Any, ...]:
    """What :func:`separate_moments` returns (with the NaN, +inf and -inf counts), of the elements
    ``mask`` keeps (all when None), from one variadic reduce: each element enters as a count of
    one, its value as the mean and no spread, and partial results merge pairwise (Chan et al.),
    which needs no shift to stay accurate. Counts are int32 operands of the same reduce, exact
    at any size. Over the last axis, then the others: two levels keep rounding at (rows + row
    length) ulps, with no reshape of a sharded value."""
    import jax
    import jax.numpy as jnp

    ftype = x.dtype
    i32 = jnp.int32
    counts = mask is not None

    merge = merge_moments
    inits = moment_inits(ftype, counts)
    operands: tuple[Any, ...]
    if mask is None:
        operands = (jnp.ones_like(x), x, jnp.zeros_like(x), x, x, jnp.abs(x),
                    (x == 0).astype(i32))
    else:
        vals = jnp.where(mask, x, 0)
        operands = (mask.astype(ftype), vals, jnp.zeros_like(x), jnp.where(mask, x, jnp.inf),
                    jnp.where(mask, x, -jnp.inf), jnp.abs(vals), (x == 0).astype(i32),
                    jnp.isnan(x).astype(i32), jnp.isposinf(x).astype(i32),
                    jnp.isneginf(x).astype(i32))
    parts: tuple[Any, ...] = operands
    if x.ndim == 1 and not _sharded(x):
        # Rows of _ROW elements: one long accumulation could reach size ulps.
        pad = -x.size % _ROW
        parts = tuple(jnp.concatenate([o, jnp.full((pad,), i, o.dtype)]).reshape(-1, _ROW)
                      for o, i in zip(operands, inits, strict=True))
    if parts[0].ndim >= 2:
        parts = jax.lax.reduce(parts, inits, merge, (parts[0].ndim - 1,))
    k, m, var, mn, mx, mean_abs, z, *bad = jax.lax.reduce(parts, inits, merge,
                                                          all_axes(parts[0]))
    return k, m, var, mn, mx, mean_abs, z, (tuple(bad) if counts else (i32(0),) * 3)


def scaled_moments(x: Any) -> tuple[Any, ...]:
    """:func:`variadic_moments` of the finite elements of ``x`` divided by the power of two at most
    their largest magnitude (exact: only the exponent changes; the largest becomes 1 to 2), the
    moments multiplied back: statistics of finite values that are finite and correct however
    close to the dtype's largest their squares or sums come. The zeros are counted in ``x``
    itself (a tiny element may round to zero once divided). The path of the values that hold a
    NaN or an infinity, or whose sums overflowed (see :func:`device_summary`)."""
    import jax
    import jax.numpy as jnp

    mask = jnp.isfinite(x)
    big = jnp.max(jnp.where(mask, jnp.abs(x), 0))
    _, exponent = jnp.frexp(jnp.where(big > 0, big, 1))
    scale = jnp.ldexp(jnp.ones((), x.dtype), exponent - 1)
    k, m, var, mn, mx, mean_abs, _, bad = variadic_moments(x / scale, mask)
    zeros = jax.lax.reduce((x == 0).astype(jnp.int32), jnp.int32(0), jax.lax.add,
                           all_axes(x))
    return (k, m * scale, var, mn * scale, mx * scale, mean_abs * scale, zeros, bad,
            scale)


def wire_moments(axis: int = 0, **moments: Any) -> Any:
    """The moments a device sends, stacked on ``axis`` in THE order
    (:data:`sowtel.records.DEVICE_MOMENTS`)."""
    import jax.numpy as jnp

    return jnp.stack([moments[k] for k in DEVICE_MOMENTS], axis=axis)


def wire_counts(nonfinite: Any, zeros: Any, axis: int = 0) -> Any:
    """The counts a device sends: the NaN, +inf and -inf counts, then the zeros
    (:data:`sowtel.records.DEVICE_COUNTS`)."""
    import jax.numpy as jnp

    counts = {**dict(zip(NONFINITE_KINDS, nonfinite, strict=True)), "zeros": zeros}
    return jnp.stack([counts[k] for k in DEVICE_COUNTS], axis=axis)


def rows_moments(x: Any, mask: Any, counts: bool) -> tuple[Any, ...]:
    """:func:`variadic_moments` of each row of the 2-D ``x``, of the elements ``mask`` keeps: the
    same merge, over rows of ``_ROW`` elements, then across them."""
    import jax
    import jax.numpy as jnp

    ftype = x.dtype
    i32 = jnp.int32
    merge = merge_moments
    inits = moment_inits(ftype, counts)
    vals = jnp.where(mask, x, 0)
    operands: tuple[Any, ...] = (
        mask.astype(ftype), vals, jnp.zeros_like(x), jnp.where(mask, x, jnp.inf),
        jnp.where(mask, x, -jnp.inf), jnp.abs(vals), (x == 0).astype(i32))
    if counts:
        operands += (jnp.isnan(x).astype(i32), jnp.isposinf(x).astype(i32),
                     jnp.isneginf(x).astype(i32))
    k, width = x.shape
    parts: tuple[Any, ...] = operands
    if width > _ROW:
        pad = -width % _ROW
        parts = tuple(jnp.pad(o, ((0, 0), (0, pad)), constant_values=i).reshape(k, -1, _ROW)
                      for o, i in zip(operands, inits, strict=True))
        parts = jax.lax.reduce(parts, inits, merge, (2,))
    out = jax.lax.reduce(parts, inits, merge, (1,))
    return (*out[:7], tuple(out[7:]) if counts else (jnp.zeros((k,), i32),) * 3)


def stats_rows(x: Any, sizes: np.ndarray, is_float: bool, variadic: bool
                ) -> tuple[Any, Any]:
    """The ``stats`` moments ``(k, 6)`` and counts ``(k, 4)`` of the rows of ``x``, each of
    its first ``sizes[i]`` elements (the rest are zero padding): :func:`device_summary`'s,
    row by row, in the same form."""
    return stats_rows_many([x], [sizes], is_float, variadic)[0]


def stats_rows_many(xs: list[Any], sizes: list[np.ndarray], is_float: bool, variadic: bool
                    ) -> list[tuple[Any, Any]]:
    """:func:`stats_rows` of each pack of rows in ``xs`` (one dtype), sharing one conditional
    in the separate form: the masked statistics are taken, of every pack, only when some row
    of some pack holds a NaN or an infinity (or a sum overflowed)."""
    import jax
    import jax.numpy as jnp

    parts = [_stats_parts(x, n, is_float, variadic) for x, n in zip(xs, sizes, strict=True)]
    if variadic or not is_float:
        chosen = [fast for fast, _ in parts]
    else:
        oks = [ok for _, ok in parts]
        fasts = [fast for fast, _ in parts]
        every = jnp.all(jnp.stack([jnp.all(ok) for ok in oks]))
        slows = jax.lax.cond(every, lambda: fasts, lambda: _masked_packs(xs, sizes, is_float))
        chosen = [jax.tree_util.tree_map(lambda f, s, ok=ok: jnp.where(ok, f, s), fast, slow)
                  for fast, slow, ok in zip(fasts, slows, oks, strict=True)]
    out = []
    for x, stats in zip(xs, chosen, strict=True):
        c, mean, std, mn, mx, mean_abs, zeros, bad = stats
        moments = wire_moments(mean=mean, std=std, min=mn, max=mx, n=c, mean_abs=mean_abs,
                               axis=1).astype(x.dtype)
        out.append((moments, wire_counts(bad, zeros, axis=1).astype(jnp.int32)))
    return out


def _masked_packs(xs: list[Any], sizes: list[np.ndarray], is_float: bool
                  ) -> list[tuple[Any, ...]]:
    """:func:`_masked_rows` of each pack: of all of them at once where their rows are of one
    length (the slow path's kernels once, not once a pack)."""
    import jax.numpy as jnp

    if len(xs) == 1 or len({x.shape[1] for x in xs}) > 1:
        return [_masked_rows(x, n, is_float) for x, n in zip(xs, sizes, strict=True)]
    every = _masked_rows(jnp.concatenate(xs, 0), np.concatenate(sizes), is_float)
    out, at = [], 0
    for x in xs:
        k = x.shape[0]
        rows = slice(at, at + k)
        out.append((*(f[rows] for f in every[:7]), tuple(f[rows] for f in every[7])))
        at += k
    return out


def _stats_parts(x: Any, sizes: np.ndarray, is_float: bool, variadic: bool
                 ) -> tuple[tuple[Any, ...], Any]:
    """The statistics of the rows of ``x`` as the fast path takes them, and where each row's
    are right (``ok``: no NaN, infinity or overflow; None in the variadic form, always right)."""
    import jax
    import jax.numpy as jnp

    ftype = x.dtype
    k, width = x.shape
    i32 = jnp.int32
    # The padding is zeros: exact to take back from the zero counts.
    pads = jnp.asarray(width - sizes, i32)
    if variadic:
        c, mean, var, mn, mx, mean_abs, zeros, bad = rows_moments(
            x, _kept(x, sizes, is_float), is_float)
        return (c, mean, jnp.sqrt(var), mn, mx, mean_abs, zeros - pads, bad), None
    padded = bool((sizes < width).any())
    valid = (jax.lax.broadcasted_iota(i32, x.shape, 1) < jnp.asarray(sizes, i32)[:, None]
             if padded else None)
    n = jnp.asarray(sizes, ftype)
    mean = jnp.sum(x, axis=1) / n
    d = x - mean[:, None]
    if valid is not None:
        d = jnp.where(valid, d, 0)
    m2 = jnp.sum(jnp.square(d), axis=1)
    a = jnp.sum(jnp.abs(x), axis=1)
    lo_in, hi_in = ((x, x) if valid is None else
                    (jnp.where(valid, x, jnp.inf), jnp.where(valid, x, -jnp.inf)))
    mn, mx, zeros = jax.lax.reduce(
        (lo_in, hi_in, (x == 0).astype(i32)),
        (jnp.asarray(jnp.inf, ftype), jnp.asarray(-jnp.inf, ftype), i32(0)),
        lambda p, q: (jnp.minimum(p[0], q[0]), jnp.maximum(p[1], q[1]), p[2] + q[2]), (1,))
    none = jnp.zeros((k,), i32)
    inv = jnp.asarray(1.0 / sizes, ftype)
    fast = (n, mean, jnp.sqrt(m2 * inv), mn, mx, a * inv, zeros - pads, (none,) * 3)
    # Each row keeps the statistics the per-value form would give it: where ok, the fast ones.
    return fast, jnp.isfinite(m2)


def _kept(x: Any, sizes: np.ndarray, is_float: bool) -> Any:
    """The elements of the rows of ``x`` that statistics of finite elements count: finite
    ones, and of each row its first ``sizes[i]`` (the rest are padding)."""
    import jax
    import jax.numpy as jnp

    keep = jnp.isfinite(x) if is_float else jnp.ones(x.shape, bool)
    if bool((sizes < x.shape[1]).any()):
        keep = keep & (jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
                       < jnp.asarray(sizes, jnp.int32)[:, None])
    return keep


def _masked_rows(x: Any, sizes: np.ndarray, is_float: bool) -> tuple[Any, ...]:
    """The statistics of the finite elements of each row of ``x`` (its first ``sizes[i]``),
    each row scaled by a power of two first, so that no sum overflows."""
    import jax.numpy as jnp

    ftype = x.dtype
    width = x.shape[1]
    i32 = jnp.int32
    keep = _kept(x, sizes, is_float)
    pads = jnp.asarray(width - sizes, i32)
    big = jnp.max(jnp.where(keep, jnp.abs(x), 0), axis=1)
    _, exponent = jnp.frexp(jnp.where(big > 0, big, 1))
    scale = jnp.ldexp(jnp.ones((), ftype), exponent - 1)
    # In two powers of two: XLA divides by a row's scale as a multiply by its reciprocal,
    # which is subnormal (flushed to zero) for a scale above 2^126 in float32.
    half = jnp.ldexp(jnp.ones((), ftype), (exponent - 1) // 2)[:, None]
    rest = jnp.ldexp(jnp.ones((), ftype), exponent - 1 - (exponent - 1) // 2)[:, None]
    c, m, var, lo, hi, mabs, z, bad = rows_moments(x / half / rest, keep, is_float)
    z = jnp.sum((x == 0).astype(i32), axis=1, dtype=i32)
    return (c, m * scale, jnp.sqrt(var) * scale, lo * scale, hi * scale, mabs * scale,
            z - pads, bad)
