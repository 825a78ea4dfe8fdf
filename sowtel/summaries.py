"""Summaries of a sown value: what crosses from the device to the host.

The same definitions run in two places: :func:`device_summary` inside the compiled program (JAX
ops, before the host callback) and :func:`host_summary` on numpy arrays (for
:func:`sowtel.export` of captured intermediates). Both follow the rules of the ``"stats"``
summary (:func:`packed_summary` takes those of many values at once, as a sown pytree's leaves
are): statistics ignore non-finite elements and count them apart; ``std`` has ddof=0; ``l2``
is the Euclidean norm of the finite elements (a value with none has NaN ``mean``, ``std``,
``min``, ``max``, ``l2`` and ``mean_abs``); integers and bools are summarised as floats.

Example:
    >>> import numpy as np
    >>> s = host_summary(np.array([1.0, -1.0, np.nan]), "stats")["stats"]
    >>> (s["size"], s["mean"], s["std"], s["nan"])
    (3.0, 0.0, 1.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from sowtel import errors
from sowtel._reductions import (
    all_axes,
    aval,
    scaled_moments,
    separate_moments,
    stats_rows_many,
    variadic_moments,
    wire_counts,
    wire_moments,
)
from sowtel.records import (
    DEVICE_COUNTS,
    DEVICE_MOMENTS,
    HEALTH_COL,
    HEALTH_KEYS,
    MOMENT_COL,
    NONFINITE_KINDS,
    STAT_COL,
    STAT_KEYS,
    SUMMARIES,
    inexact,
    key_span,
)

#: Default number of histogram buckets.
DEFAULT_BINS = 30

#: ``enable(histogram_every=...)``'s default: the ``sowtel.jit`` logging steps divisible by it
#: send histograms of their ``stats`` sites (chosen from benchmarks/bench_jit.py --histogram).
HISTOGRAM_EVERY: int | None = 100

#: How many arrays the device sends per leaf, by summary (see :func:`device_summary`).
ARRAYS_PER_LEAF = {"full": 1, "histogram": 3, "stats": 2, "health": 1, "shape": 0}


def check_summary(summary: Any, what: str = "summary") -> str:
    """Returns ``summary`` if it names a summary kind, else raises ValueError."""
    if summary not in SUMMARIES:
        raise errors.BadOptionError(
            what, summary, f"is not a summary: use one of {', '.join(SUMMARIES)}")
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
    is_float = inexact(x.dtype)  # bfloat16 and float8 too (numpy files them as kind "V")
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
    if is_float:
        # Subnormal elements are zeros, as the device sees them: XLA:CPU flushes them to
        # zero (they count in "zeros" and add nothing to the statistics).
        tiny = np.finfo(xf.dtype).tiny
        sub = (np.abs(xf) < tiny) & (xf != 0)
        if sub.any():
            xf = np.where(sub, xf.dtype.type(0), xf)
    finite = xf[np.isfinite(xf)]
    n = finite.size
    if n:
        wide = finite.astype(np.float64)
        # Divided by the power of two below the largest magnitude (exact), so that no square
        # or sum overflows where the statistics do not (float64 values near 1e300).
        big = float(np.max(np.abs(wide)))
        scale = float(np.ldexp(1.0, np.frexp(big)[1] - 1)) if big > 0 else 1.0
        scaled = wide / scale
        mean_s = float(scaled.mean())
        mean = mean_s * scale
        std = float(np.sqrt(np.mean((scaled - mean_s) ** 2))) * scale
        mn, mx = float(finite.min()), float(finite.max())
        l2 = float(np.sqrt(np.sum(scaled * scaled))) * scale
        mean_abs = float(np.mean(np.abs(scaled))) * scale
    else:  # no finite element: a statistic of no element is NaN, never 0
        mean = std = mn = mx = l2 = mean_abs = float("nan")
    zeros = float((xf == 0).sum())
    stats = dict(
        zip(STAT_KEYS, (size, mean, std, mn, mx, l2, mean_abs, nan, posinf, neginf, zeros),
            strict=True)
    )
    hist = None
    if summary == "histogram":
        lo, hi = (mn, mx) if n else (0.0, 0.0)
        hist = (histogram_edges(lo, hi, bins)[0], _bucket_counts_host(finite, lo, hi, bins))
    return {"stats": stats, "histogram": hist}


def histogram_edges(lo: Any, hi: Any, bins: int) -> np.ndarray:
    """THE bucket edges of a histogram, every path's: ``bins + 1`` edges evenly spaced from
    the least to the greatest finite element (``lo``, ``hi``), the last one ``hi`` exactly;
    unit-wide buckets from ``lo`` when the two are equal; from 0 when ``lo`` is not finite
    (no finite element). ``lo`` and ``hi`` are one value's or ``(n,)`` values'; the edges
    are float64, ``(n, bins + 1)``.

    Example:
        >>> histogram_edges([-1.0, 1.0, np.nan], [2.0, 1.0, np.nan], 4).tolist()
        [[-1.0, -0.25, 0.5, 1.25, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
    """
    lo = np.array(lo, np.float64, ndmin=1)  # copies: the caller's arrays stay as they are
    hi = np.array(hi, np.float64, ndmin=1)
    bad = ~np.isfinite(lo)
    lo[bad] = hi[bad] = 0.0
    edges = np.empty((len(lo), bins + 1))
    spread = hi > lo
    if spread.any():
        edges[spread] = np.linspace(lo[spread], hi[spread], bins + 1, axis=1)
    if (~spread).any():
        edges[~spread] = lo[~spread, None] + np.arange(bins + 1) * 1.0
    return edges


def _bucket_counts_host(finite: np.ndarray, lo: float, hi: float, bins: int) -> np.ndarray:
    # The device's bucketing, in the same precision: floor((x - lo) * scale), max in the last.
    dtype = finite.dtype.type
    lo_, hi_ = dtype(lo), dtype(hi)
    # A multiply by bins / (hi - lo), as the device does: division is not bit-reproducible there.
    scale = dtype(bins) / (hi_ - lo_) if hi_ > lo_ else dtype(0)
    idx = np.clip(np.floor((finite - lo_) * scale), 0, bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=bins).astype(np.float64)


#: How :func:`device_summary` reduces, per backend, chosen by measurement (see
#: docs/benchmarks.md): ``"separate"``, sibling reductions and a ``lax.cond`` that masks
#: non-finite elements only in values that hold some (XLA:CPU, where each sum is a vectorised
#: library kernel but a variadic floating-point reduce is a scalar loop), and ``"variadic"``,
#: one variadic ``lax.reduce`` that masks and counts in the same pass, with no conditional
#: (GPU, TPU: one read of the value; XLA:GPU copies a conditional's predicate to the host
#: before it can go on).
#: ``SOWTEL_SUMMARY_FORM`` overrides.
SUMMARY_FORMS = ("separate", "variadic")
_FORM_BY_BACKEND = {"cpu": "separate", "gpu": "variadic", "cuda": "variadic", "rocm": "variadic",
                    "tpu": "variadic"}


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
            raise errors.BadOptionError(
                "SOWTEL_SUMMARY_FORM", chosen, f"is not a summary form: use one of "
                f"{', '.join(SUMMARY_FORMS)}")
        return chosen
    return _FORM_BY_BACKEND.get(jax.default_backend(), "separate")


def flatten(x: Any) -> Any:
    """``x`` as a 1-D array, also when its sharding is explicit (``jax.make_mesh``'s default
    axis type), where a plain ``ravel`` of a value sharded on a dimension other than the first
    is refused: such a value is flattened replicated. Statistics never flatten (they reduce
    over every axis); the histogram's bucket indices, ``full`` values and packed outputs do.

    Example:
        >>> import jax.numpy as jnp
        >>> flatten(jnp.ones((2, 3))).shape
        (6,)
    """
    import jax
    import jax.numpy as jnp

    sharding = getattr(aval(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or spec is None or x.ndim < 2 or all(p is None for p in spec[1:]):
        return jnp.ravel(x)
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.lax.reshape(x, (x.size,),
                           out_sharding=NamedSharding(sharding.mesh, PartitionSpec(None)))


def apart(x: Any) -> Any:
    """``x`` as a summary reads it: a copy that XLA computes in a fusion of its own, so that
    reading a value never changes how the program that made it is compiled.

    A value that the program computes inside a fusion (``a * b`` added to ``c`` in one loop,
    where XLA:CPU rounds once, as a fused multiply-add) is left there only if every new reader
    of it can fuse its producer too. A library reduction, a conditional or a host callback
    cannot, so XLA would write the value out and the program's own fusion would read it back,
    rounded: streaming would change the last bits of the results (and an optimizer such as
    Adam amplifies them). The copy is ``x + z`` with ``z`` a -0.0 (``x + -0.0`` is ``x`` for
    every ``x``, signed zeros included) hidden behind an optimization barrier until XLA's
    simplifier has run: an elementwise op that fuses, whose fusion recomputes a cheap producer
    on its own. Integers and booleans are exact in any fusion and are read as they are.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.array([-0.0, 1.5, jnp.inf])
        >>> y = jax.jit(apart)(x)
        >>> y.tolist(), bool(jnp.signbit(y[0]))
        ([-0.0, 1.5, inf], True)
    """
    import jax
    import jax.numpy as jnp

    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        part = jnp.finfo(x.dtype).dtype
        zero = jax.lax.complex(jnp.asarray(-0.0, part), jnp.asarray(-0.0, part))
    else:
        zero = jnp.asarray(-0.0, x.dtype)
    return x + jax.lax.optimization_barrier(zero)


def apart_all(values: list[Any]) -> list[Any]:
    """:func:`apart` of each of ``values``, their -0.0s behind one optimization barrier (one
    per value costs a pytree of thousands of leaves thousands of operations).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> [v.tolist() for v in jax.jit(apart_all)([jnp.array([-0.0, 2.0]), jnp.arange(2)])]
        [[-0.0, 2.0], [0, 1]]
    """
    import jax
    import jax.numpy as jnp

    dtypes = sorted({np.dtype(v.dtype) for v in values if jnp.issubdtype(v.dtype, jnp.inexact)},
                    key=str)
    if not dtypes:
        return list(values)
    if len(values) < 2:
        return [apart(v) for v in values]

    def negative_zero(dtype: Any) -> Any:
        if jnp.issubdtype(dtype, jnp.complexfloating):
            part = jnp.finfo(dtype).dtype
            return jax.lax.complex(jnp.asarray(-0.0, part), jnp.asarray(-0.0, part))
        return jnp.asarray(-0.0, dtype)

    zeros = dict(zip(dtypes, jax.lax.optimization_barrier(
        tuple(negative_zero(d) for d in dtypes)), strict=True))
    return [jax.lax.add(v, jax.lax.broadcast(zeros[np.dtype(v.dtype)], v.shape))
            if np.dtype(v.dtype) in zeros else v for v in values]


def reads_copy() -> bool:
    """Whether summaries read each value through :func:`apart` (so that streaming leaves the
    program's results bit for bit): yes, unless the environment variable
    ``SOWTEL_SUMMARY_COPY`` is ``0``, which makes them read the value itself (XLA may then
    write it out of the program's fusions, and results may change in their last bits).

    Example:
        >>> reads_copy()
        True
    """
    import os

    chosen = os.environ.get("SOWTEL_SUMMARY_COPY", "").strip()
    if chosen not in ("", "0", "1"):
        raise errors.BadOptionError(
            "SOWTEL_SUMMARY_COPY", chosen, "is not a setting: use 1 (the default: "
            "summaries read a copy, results stay bit for bit) or 0 (they read the "
            "value itself)")
    return chosen != "0"


def device_summary(x: Any, summary: str, bins: int = DEFAULT_BINS,
                   form: str | None = None, copy: bool | None = None) -> list[Any]:
    """JAX ops that reduce ``x`` on the device to the arrays the host receives.

    Returns a list of arrays: ``stats`` -> ``[moments(6), counts(4)]`` (see
    :func:`stats_table`); ``full`` -> ``[x]``
    (its stats are computed on the host, off the training thread, so that the transfer runs at
    copy speed);
    ``histogram`` -> the stats plus ``[counts(bins)]``; ``health`` -> ``[counts(3)]``;
    ``shape`` -> ``[]``. :func:`decode_device_summary` turns them back into a dict.
    With ``copy`` (else :func:`reads_copy`) they read ``x`` through :func:`apart`.

    ``stats`` reduces over every axis of ``x`` without reshaping it (so a value with an
    explicit sharding is summarised where it lies), in one of two forms (``form``, else
    :func:`summary_form`): ``"variadic"`` reads the value once, masking the non-finite elements
    and counting them in the same reduce, with no conditional, merging means (of the value, of
    its variance, of ``|x|``) rather than sums, so that no partial result overflows unless the
    variance itself does (a standard deviation above about 1.8e19 in float32, 1.3e154 in
    float64); ``"separate"`` takes the sums as sibling reductions and the extrema with the zero
    count in one more, and tests the sum of squares for being finite: only when it is not (the
    value holds a NaN or an infinity, or a sum overflowed), under a ``lax.cond``, are the
    statistics taken again with those elements masked out and counted, of the value divided by
    the power of two below its largest magnitude (:func:`scaled_moments`): finite and correct for
    every finite value. Either way the moments sent are the mean, the standard
    deviation and the mean of ``|x|``, which never exceed the largest finite magnitude.

    Example:
        >>> import jax.numpy as jnp
        >>> moments, counts = device_summary(jnp.array([[1.0, 0.0], [3.0, jnp.nan]]), "stats")
        >>> [round(v, 5) for v in moments.tolist()]  # mean std min max n mean|x| (finite)
        [1.33333, 1.24722, 0.0, 3.0, 3.0, 1.33333]
        >>> counts.tolist()  # nan +inf -inf zeros
        [1, 0, 0, 1]
    """
    import jax
    import jax.numpy as jnp

    if summary == "shape":
        return []
    if reads_copy() if copy is None else copy:
        x = apart(x)
    if summary == "full":
        return [x]
    is_float = jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.abs(x)
    ftype = jnp.float64 if (is_float and x.dtype.itemsize >= 8) else jnp.float32
    xf = x.astype(ftype)
    cdtype = jnp.int32
    size = xf.size
    variadic = (form or summary_form()) == "variadic"

    if summary == "health":
        if not is_float or size == 0:
            # Zeros derived from the data, so that inside shard_map they vary across shards
            # as computed counts do.
            return [jnp.zeros((3,), cdtype) + (jnp.sum(xf) != 0).astype(cdtype) * 0]
        # One integer reduce, no conditional: as cheap as a sum on XLA:CPU, one pass on GPU.
        return [jnp.stack(jax.lax.reduce(
            tuple(f(xf).astype(cdtype) for f in (jnp.isnan, jnp.isposinf, jnp.isneginf)),
            (cdtype(0),) * 3, lambda p, q: tuple(a + b for a, b in zip(p, q, strict=True)),
            all_axes(xf)))]
    if size == 0:
        zero = jnp.zeros((), ftype)
        nan = jnp.asarray(jnp.nan, ftype)
        empty = {"mean": nan, "std": zero, "min": nan, "max": nan, "n": zero, "mean_abs": zero}
        out = [jnp.stack([empty[k] for k in DEVICE_MOMENTS]),
               jnp.zeros((len(DEVICE_COUNTS),), cdtype)]
        if summary == "histogram":
            out.append(jnp.zeros((bins,), cdtype))
        return out

    if variadic:
        n, mean, var, mn, mx, mean_abs, zeros, bad = variadic_moments(
            xf, jnp.isfinite(xf) if is_float else None)
        std = jnp.sqrt(var)
    else:
        raw = separate_moments(xf)
        n, _, m2, _, _, a, _, _ = raw
        # Sent as a standard deviation and a mean of |x| (no larger than the value's largest
        # magnitude), never as sums, which overflow where the statistics do not.
        inv = 1.0 / size  # a constant: the multiplies fuse into the reductions' outputs
        fast = (*raw[:2], jnp.sqrt(m2 * inv), *raw[3:5], a * inv, *raw[6:])
        if is_float:
            from sowtel import _jax_compat as jc

            if jc.manual_axes():
                # Inside shard_map the branches' outputs must vary alike: the size and the
                # counts, constants here, plus zeros derived from the data.
                vary = (m2 != m2).astype(cdtype) * 0
                fast = (fast[0] + vary.astype(ftype), *fast[1:7],
                        tuple(b + vary for b in fast[7]))

            def masked() -> tuple[Any, ...]:
                k, m, var, lo, hi, mabs, z, counted, scale = scaled_moments(xf)
                return k, m, jnp.sqrt(var) * scale, lo, hi, mabs, z, counted

            # The value holds a NaN or an infinity, or a sum overflowed: its finite elements'
            # statistics, scaled, and the others counted, in one variadic reduce.
            # (A sum of |x| overflows only where the sum of squares does, or the sum itself,
            # which makes the sum of squares NaN: one test for both.)
            fast = jax.lax.cond(jnp.isfinite(m2), lambda: fast, masked)
        n, mean, std, mn, mx, mean_abs, zeros, bad = fast
    # The host derives the rest (stats_table), so that little scalar arithmetic is compiled a
    # site (six kernels a site on XLA:CPU when it all was).
    out = [wire_moments(mean=mean, std=std, min=mn, max=mx, n=n, mean_abs=mean_abs
                         ).astype(ftype), wire_counts(bad, zeros).astype(cdtype)]
    if summary == "histogram":
        empty = n == 0
        lo = jnp.where(empty, 0, mn)
        hi = jnp.where(empty, 0, mx)
        flat = flatten(xf)
        mask = jnp.isfinite(flat)
        safe = jnp.where(mask, flat, 0)
        scale = jnp.where(hi > lo, jnp.asarray(bins, ftype) / (hi - lo), 0)
        idx = jnp.clip(jnp.floor((safe - lo) * scale), 0, bins - 1).astype(jnp.int32)
        out.append(jnp.zeros((bins,), cdtype).at[idx].add(mask.astype(cdtype)))
    return out


# -- many values at once --------------------------------------------------------------------
#
# A site's pytree of thousands of leaves would be thousands of summaries, each a dozen kernels
# and (on XLA:CPU) a conditional: compile time and memory grew faster than the leaves (see
# docs/benchmarks.md, "Many leaves"). tree_summary packs the leaves of one summary dtype and
# size class into one (leaves, length) array and reduces its rows: a few kernels a group.

#: Leaves of at most this many elements are packed into rows of a common length (padded, the
#: padding masked out); larger ones are packed with the leaves of their own size only (no
#: padding: a large leaf is copied once into its row and never padded).
PACK_SMALL = 4096
#: A group is cut into packs of at most this many bytes (and at least ``PACK_MIN`` values),
#: which share one conditional: the statistics then read a pack while it is still in the
#: CPU's caches, where one pack of a whole tree streamed it from memory once a statistic.
#: 300 leaves of 256×256 on XLA:CPU, a step: one pack 120 ms, packs of 16 MiB 75 ms, of
#: 4 MiB 52-71 ms (each pack's kernels compile: first step 4.2×, 4.9×, 7.6-9.7× the plain
#: program's), the leaves one by one 54 ms (65×); see docs/benchmarks.md, "Many leaves".
PACK_BYTES = 16 << 20
PACK_MIN = 8
#: A pack of small rows is concatenated this many rows at a time (see :func:`_rows`).
CONCAT_ROWS = 16


def _pack_key(x: Any) -> tuple[Any, ...] | None:
    """The group a value is packed with: its summary dtype, whether it is floating, its size
    class. ``None``: summarised on its own (an empty value, or one with an explicit sharding,
    which a pack would gather)."""
    import jax.numpy as jnp

    typed = aval(x) or x  # a value being traced, or the abstract value of one
    spec = getattr(getattr(typed, "sharding", None), "spec", None)
    if x.size == 0 or (spec is not None and any(p is not None for p in spec)):
        return None
    is_float = bool(jnp.issubdtype(x.dtype, jnp.inexact))
    # As device_summary: a complex value's magnitude, in its real dtype; float64 stays float64.
    real = jnp.finfo(x.dtype).dtype if jnp.issubdtype(x.dtype, jnp.complexfloating) else x.dtype
    ftype = np.dtype(np.float64 if is_float and np.dtype(real).itemsize >= 8 else np.float32)
    size = int(x.size)
    return (ftype, is_float, -1 if size <= PACK_SMALL else size)


def _rows(values: list[Any], ftype: Any, copy: bool) -> tuple[Any, np.ndarray]:
    """``values`` (raveled, as ``ftype``) as the rows of one array, each padded with zeros to
    the longest; and their sizes."""
    import jax
    import jax.numpy as jnp

    sizes = np.array([int(v.size) for v in values])
    width = int(sizes.max())
    if copy:
        values = apart_all(values)
    rows = []
    zero = jnp.zeros((), ftype)
    # lax, not jnp: a few microseconds of tracing a leaf, not a few milliseconds.
    for v in values:
        if jnp.issubdtype(v.dtype, jnp.complexfloating):
            v = jnp.abs(v)
        v = jax.lax.reshape(v, (1, v.size))
        if v.dtype != ftype:
            v = jax.lax.convert_element_type(v, ftype)
        if v.size < width:
            v = jax.lax.pad(v, zero, ((0, 0, 0), (0, width - v.size, 0)))
        rows.append(v)
    if len(rows) > CONCAT_ROWS and width <= PACK_SMALL:
        # One concatenate of thousands of rows compiles superlinearly on XLA:CPU (2,000 rows:
        # 13.8 s, in concatenates of 16 behind a barrier 8.4 s; docs/benchmarks.md); the
        # barrier keeps XLA's simplifier from merging them back into one. Small rows only:
        # the chunks are a second copy, which a pack of large rows would pay in each step.
        rows = list(jax.lax.optimization_barrier(
            [jax.lax.concatenate(rows[i:i + CONCAT_ROWS], 0)
             for i in range(0, len(rows), CONCAT_ROWS)]))
    return jax.lax.concatenate(rows, 0), sizes


def _group_summary(packs: list[list[Any]], summary: str, bins: int, ftype: Any, is_float: bool,
                   variadic: bool, copy: bool) -> list[Any]:
    """:func:`device_summary`'s arrays of the values of each pack (one summary dtype and size
    class), each pack from one packed array, stacked: row ``i`` of a pack's arrays is its value
    ``i``'s. The packs share one conditional (:func:`stats_rows_many`)."""
    import jax
    import jax.numpy as jnp

    rows = [_rows(values, ftype, copy) for values in packs]
    i32 = jnp.int32
    if summary == "health":
        out = []
        for x, _ in rows:
            if not is_float:
                # Zeros derived from the data, as device_summary's.
                out.append(jnp.zeros((x.shape[0], 3), i32) + (jnp.sum(x) != 0).astype(i32) * 0)
            else:  # the padding is zeros, which count as none of these
                out.append(jnp.stack([jnp.sum(f(x).astype(i32), axis=1, dtype=i32)
                                      for f in (jnp.isnan, jnp.isposinf, jnp.isneginf)], axis=1))
        return out
    stats = stats_rows_many([x for x, _ in rows], [n for _, n in rows], is_float, variadic)
    if summary != "histogram":
        return [a for pair in stats for a in pair]
    out = []
    for (x, sizes), (moments, counts) in zip(rows, stats, strict=True):
        k, width = x.shape
        n, mn, mx = (moments[:, MOMENT_COL[c]] for c in ("n", "min", "max"))
        empty = n == 0
        lo = jnp.where(empty, 0, mn)[:, None]
        hi = jnp.where(empty, 0, mx)[:, None]
        mask = jnp.isfinite(x)
        if bool((sizes < width).any()):
            mask = mask & (jax.lax.broadcasted_iota(i32, x.shape, 1)
                           < jnp.asarray(sizes, i32)[:, None])
        safe = jnp.where(mask, x, 0)
        scale = jnp.where(hi > lo, jnp.asarray(bins, ftype) / (hi - lo), 0)
        idx = jnp.clip(jnp.floor((safe - lo) * scale), 0, bins - 1).astype(i32)
        idx = idx + jnp.arange(k, dtype=i32)[:, None] * bins  # each row its own buckets
        hist = jnp.zeros((k * bins,), i32).at[idx.ravel()].add(mask.ravel().astype(i32))
        out += [moments, counts, hist.reshape(k, bins)]
    return out


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each value's :func:`device_summary` arrays lie among :func:`packed_summary`'s:
    ``count`` arrays in all; per value, per array, ``(array, row)``: row ``row`` of a packed
    group's array (along its second-to-last axis, after any leading axes of positions), or the
    whole array (``row`` -1) of a value summarised on its own.

    Example:
        >>> packing = Packing(count=1, leaves=(((0, 0),), ((0, 1),)))
        >>> [a.tolist() for a in packing.unpack([np.array([[1, 2], [3, 4]])])]
        [[1, 2], [3, 4]]
    """

    count: int
    leaves: tuple[tuple[tuple[int, int], ...], ...]

    def unpack(self, arrays: Any) -> list[Any]:
        """The arrays, value after value, as :func:`device_summary` gives them (views)."""
        return [arrays[a] if row < 0 else arrays[a][..., row, :]
                for leaf in self.leaves for a, row in leaf]


def pack_plan(values: list[Any], summary: str) -> dict[tuple[Any, ...], list[int]] | None:
    """The groups :func:`packed_summary` packs ``values`` (arrays or abstract values) into:
    per group key, the positions of its values; ``None`` when none is packed (a single value,
    ``full`` and ``shape``, inside ``shard_map``)."""
    from sowtel import _jax_compat as jc

    if summary in ("shape", "full") or len(values) < 2 or jc.manual_axes():
        return None
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, v in enumerate(values):
        key = _pack_key(v)
        if key is not None:
            groups.setdefault(key, []).append(i)
    packs: dict[tuple[Any, ...], list[int]] = {}
    for key, members in groups.items():
        for n, chunk in enumerate(_packs(members, values, np.dtype(key[0]).itemsize)):
            if len(chunk) > 1:
                packs[(*key, n)] = chunk
    return packs or None


def _packs(members: list[int], values: list[Any], itemsize: int) -> list[list[int]]:
    """``members`` cut, in order, into packs of at most ``PACK_BYTES`` as packed (each row as
    long as the pack's longest value), and at least ``PACK_MIN`` values."""
    out: list[list[int]] = [[]]
    width = 0
    for i in members:
        size = int(values[i].size)
        wider = max(width, size)
        if (len(out[-1]) >= PACK_MIN
                and (len(out[-1]) + 1) * wider * itemsize > PACK_BYTES):
            out.append([])
            wider = size
        out[-1].append(i)
        width = wider
    return out


def packed_summary(values: list[Any], summary: str, bins: int = DEFAULT_BINS,
                   form: str | None = None, copy: bool | None = None,
                   plan: dict[tuple[Any, ...], list[int]] | None | bool = True
                   ) -> tuple[list[Any], Packing | None]:
    """The summary arrays of ``values``, packed (see :func:`tree_summary`), and where each
    value's lie (``None``: not packed, :func:`device_summary` of each value in turn).
    ``plan``: :func:`pack_plan`'s groups, made before (True: planned here; None or False:
    nothing packed).

    Example:
        >>> import jax.numpy as jnp
        >>> arrays, packing = packed_summary([jnp.ones(3), jnp.zeros(2)], "stats")
        >>> [a.shape for a in arrays], packing.unpack(arrays)[3].tolist()  # zeros of the second
        ([(2, 6), (2, 4)], [0, 0, 0, 2])
    """
    check_summary(summary)
    groups = pack_plan(values, summary) if plan is True else plan or None
    if groups is None:
        return [a for v in values for a in device_summary(v, summary, bins, form, copy)], None
    copy = reads_copy() if copy is None else copy
    variadic = (form or summary_form()) == "variadic"
    # The packs of one dtype and size class, consecutive in the plan, are summarised together.
    families: dict[tuple[Any, ...], list[list[Any]]] = {}
    for key, members in groups.items():
        families.setdefault(key[:3], []).append([values[i] for i in members])
    arrays: list[Any] = []
    for (ftype, is_float, _), packs in families.items():
        arrays.extend(_group_summary(packs, summary, bins, ftype, is_float, variadic, copy))
    packed = {i for members in groups.values() for i in members}
    for i, v in enumerate(values):
        if i not in packed:
            arrays.extend(device_summary(v, summary, bins, form, copy))
    packing = packing_of(groups, len(values), summary)
    assert packing.count == len(arrays)
    return arrays, packing


def packing_of(groups: dict[tuple[Any, ...], list[int]], n: int, summary: str) -> Packing:
    """The :class:`Packing` of :func:`packed_summary`'s arrays for the plan ``groups``
    (:func:`pack_plan`) of ``n`` values: each group's arrays, then each other value's."""
    per = ARRAYS_PER_LEAF[summary]
    where: list[tuple[tuple[int, int], ...]] = [()] * n
    at = 0
    for members in groups.values():
        for row, i in enumerate(members):
            where[i] = tuple((at + j, row) for j in range(per))
        at += per
    for i in range(n):
        if not where[i]:
            where[i] = tuple((at + j, -1) for j in range(per))
            at += per
    return Packing(at, tuple(where))


def tree_summary(values: list[Any], summary: str, bins: int = DEFAULT_BINS,
                 form: str | None = None, copy: bool | None = None) -> list[Any]:
    """:func:`device_summary` of each of ``values``: the same arrays, in the same order
    (``device_summary`` of the first value, then of the second, ...), computed together.

    The values of one summary dtype (float32 for half precision, integers and bools; float64)
    and size class are packed into one 2-D array, one value a row: those of at most
    ``PACK_SMALL`` elements padded to the longest among them (the padding masked out of every
    statistic), larger ones with the values of their own size. Each statistic is then one
    reduction of the group's rows: a pytree of thousands of leaves compiles a few kernels a
    group, not a dozen a leaf. A group past ``PACK_BYTES`` is cut into packs of that size (at
    least ``PACK_MIN`` values each), each read while it is in cache, a few kernels a pack. On
    XLA:CPU the group's packs also share one conditional: only when
    some value holds a NaN or an infinity are the masked statistics taken, of the group, and
    used for those values. A group of one value, an empty value, a value with an explicit
    sharding, and every value inside ``shard_map`` are summarised on their own, as
    :func:`device_summary` does.

    Example:
        >>> import jax.numpy as jnp
        >>> out = tree_summary([jnp.array([1.0, 3.0]), jnp.array([2.0, jnp.nan, 4.0])], "stats")
        >>> [len(out), out[0][:2].tolist(), out[2][:2].tolist(), out[3].tolist()]
        [4, [2.0, 1.0], [3.0, 1.0], [1, 0, 0, 0]]
    """
    arrays, packing = packed_summary(values, summary, bins, form, copy)
    return arrays if packing is None else packing.unpack(arrays)


def _summary_jit() -> Any:
    import jax

    return jax.jit(device_summary, static_argnums=(1, 2, 3, 4))


# Made on first use: this module imports JAX only inside functions (host-side users of the
# summaries never load it).
_SUMMARY_JIT: Any = None


def site_summary(x: Any, summary: str, bins: int = DEFAULT_BINS) -> list[Any]:
    """:func:`device_summary`, traced once per (abstract value, summary, bins, form, copy) in this
    process and called as a nested ``jax.jit`` (XLA inlines it: the program is the same).

    A training step's sites often share a shape (every layer's activations and their
    cotangents): tracing the summary's few hundred operations once instead of once a site
    takes most of a logging program's trace time away, and JAX lowers the repeated call once.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> out = jax.jit(lambda a, b: site_summary(a, "stats") + site_summary(b, "stats"))(
        ...     jnp.arange(4.0), jnp.ones(4))
        >>> [round(float(v), 4) for v in out[0][:2]], out[2][:2].tolist()  # mean, std
        ([1.5, 1.118], [1.0, 0.0])
    """
    global _SUMMARY_JIT
    if _SUMMARY_JIT is None:
        _SUMMARY_JIT = _summary_jit()
    return list(_SUMMARY_JIT(x, summary, bins, summary_form(), reads_copy()))


_TREE_JIT: Any = None


def sites_summary(values: list[Any], summary: str, bins: int = DEFAULT_BINS
                  ) -> tuple[list[Any], Packing | None]:
    """A site's leaves' summary arrays and their :class:`Packing`: :func:`site_summary` of a
    single leaf, else :func:`packed_summary`, traced once per (abstract values, summary, bins,
    form, copy) in this process and called as a nested ``jax.jit``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> out, packing = sites_summary([jnp.arange(4.0), jnp.ones(3)], "stats")
        >>> [[round(float(v), 4) for v in m[:2]] for m in out[0]]  # mean, std of each
        [[1.5, 1.118], [1.0, 0.0]]
        >>> packing.unpack(out)[3].tolist()  # the second's NaN, +inf, -inf and zero counts
        [0, 0, 0, 0]
    """
    global _TREE_JIT
    groups = pack_plan(values, summary)
    if groups is None:
        return [a for v in values for a in site_summary(v, summary, bins)], None
    if _TREE_JIT is None:
        import jax

        _TREE_JIT = jax.jit(lambda *a: packed_summary(*a)[0], static_argnums=(1, 2, 3, 4))
    arrays = list(_TREE_JIT(list(values), summary, bins, summary_form(), reads_copy()))
    return arrays, packing_of(groups, len(values), summary)


# The statistics of the finite elements, and the counts, as they lie in a STAT_KEYS table.
_OF_FINITE = key_span(STAT_KEYS, ("mean", "std", "min", "max", "l2", "mean_abs"))
_COUNTS = key_span(STAT_KEYS, DEVICE_COUNTS)
# Where a health table holds what its device array sends (the non-finite counts).
_HEALTH_COUNTS = key_span(HEALTH_KEYS, NONFINITE_KINDS)


def stats_table(moments: np.ndarray, counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``stats`` of ``N`` device summaries as a float64 table ``(N, len(STAT_KEYS))``.

    ``moments`` ``(N, 6)`` are what :func:`device_summary` sends for ``stats``: the mean, the
    standard deviation, the minimum and maximum, the number and the mean of absolute values of
    the finite elements (none larger than the largest finite magnitude, so none overflows);
    ``counts`` ``(N, 4)`` the NaN, +inf, -inf and zero counts; ``sizes`` the values' sizes.
    ``l2`` is ``sqrt(n (mean^2 + std^2))``, in float64. A value with no finite element has NaN
    statistics, ``l2`` included.

    Example:
        >>> stats_table(np.array([[2.0, 2.0, 0.0, 4.0, 2.0, 2.0]]), np.array([[1, 0, 0, 1]]),
        ...             np.array([3.0])).tolist()  # the finite elements 0 and 4, and a NaN
        [[3.0, 2.0, 2.0, 0.0, 4.0, 4.0, 2.0, 1.0, 0.0, 0.0, 1.0]]
    """
    moments = np.asarray(moments, np.float64)
    mean, std, n = (moments[:, MOMENT_COL[k]] for k in ("mean", "std", "n"))
    table = np.empty((len(moments), len(STAT_KEYS)))
    table[:, STAT_COL["size"]] = sizes
    with np.errstate(invalid="ignore", over="ignore"):
        for k in ("mean", "std", "min", "max", "mean_abs"):
            table[:, STAT_COL[k]] = moments[:, MOMENT_COL[k]]
        # sum x^2 = n (std^2 + mean^2), both terms positive: no cancellation; where the
        # squares overflow float64 (values near 1e300), scaled by hypot.
        l2 = np.sqrt(n * (mean * mean + std * std))
        over = np.isinf(l2) & np.isfinite(mean) & np.isfinite(std)
        if over.any():
            l2[over] = np.sqrt(n[over]) * np.hypot(mean[over], std[over])
        table[:, STAT_COL["l2"]] = l2
    empty = n == 0
    if empty.any():
        table[empty, _OF_FINITE] = np.nan  # none of no element
    table[:, _COUNTS] = counts
    return table


def decode_summaries(summary: str, arrays: Sequence[np.ndarray], size: int, bins: int, n: int
                     ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray | None, np.ndarray | None]:
    """THE decoder: one leaf's :func:`device_summary` arrays at ``n`` positions (each with a
    leading axis of positions), now on the host, as the statistics' keys, their float64 table
    ``(n, len(keys))`` (:func:`stats_table`), and for ``"histogram"`` the edges
    ``(n, bins + 1)`` (:func:`histogram_edges`) and bucket counts ``(n, bins)`` (else None).
    Every path decodes here: ``sowtel.jit``'s steps, the host callbacks, and one value's
    arrays (:func:`decode_device_summary`). A ``"full"`` value is summarised on the host.

    Example:
        >>> keys, table, _, _ = decode_summaries("health", [np.array([[0, 1, 0], [2, 0, 0]])],
        ...                                      5, 30, 2)
        >>> keys, table.tolist()
        (('size', 'nan', 'posinf', 'neginf'), [[5.0, 0.0, 1.0, 0.0], [5.0, 2.0, 0.0, 0.0]])
    """
    if summary == "shape":
        return (), np.zeros((n, 0)), None, None
    if summary == "health":
        table = np.empty((n, len(HEALTH_KEYS)))
        table[:, HEALTH_COL["size"]] = size
        # assigning converts to float64
        table[:, _HEALTH_COUNTS] = np.reshape(arrays[0], (n, len(NONFINITE_KINDS)))
        return HEALTH_KEYS, table, None, None
    table = stats_table(np.reshape(arrays[0], (n, len(DEVICE_MOMENTS))),
                        np.reshape(arrays[1], (n, len(DEVICE_COUNTS))), np.full(n, float(size)))
    if summary != "histogram":
        return STAT_KEYS, table, None, None
    edges = histogram_edges(table[:, STAT_COL["min"]], table[:, STAT_COL["max"]], bins)
    counts = np.asarray(arrays[2], np.float64).reshape(n, bins)
    return STAT_KEYS, table, edges, counts


def decode_device_summary(
    arrays: list[np.ndarray], summary: str, size: int, bins: int = DEFAULT_BINS
) -> dict[str, Any]:
    """One value's :func:`device_summary` arrays (now on the host) as ``stats`` and
    ``histogram``: :func:`decode_summaries` at one position."""
    if summary == "full":
        return {"stats": host_summary(arrays[0], "stats")["stats"], "histogram": None}
    keys, table, edges, counts = decode_summaries(
        summary, [np.asarray(a)[None] for a in arrays], size, bins, 1)
    hist = None if edges is None or counts is None else (edges[0], counts[0])
    return {"stats": dict(zip(keys, table[0].tolist(), strict=True)), "histogram": hist}
