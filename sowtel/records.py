"""The one record type that flows from a sow site to every exporter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sowtel import errors

#: The keys of ``Record.stats`` for the ``"stats"`` and ``"histogram"`` summaries, in order.
STAT_KEYS: tuple[str, ...] = (
    "size", "mean", "std", "min", "max", "l2", "mean_abs", "nan", "posinf", "neginf", "zeros",
)
#: The keys of ``Record.stats`` for the ``"health"`` summary.
HEALTH_KEYS: tuple[str, ...] = ("size", "nan", "posinf", "neginf")

# -- THE stats column layout: every table of statistics and every array a device sends for a
#    summary is read and written by these names, never by column numbers.

#: The column of each statistic in a table of :data:`STAT_KEYS` rows: ``table[:, STAT_COL["min"]]``.
STAT_COL: dict[str, int] = {k: i for i, k in enumerate(STAT_KEYS)}
#: The column of each statistic in a table of :data:`HEALTH_KEYS` rows.
HEALTH_COL: dict[str, int] = {k: i for i, k in enumerate(HEALTH_KEYS)}
#: What a device sends for ``"stats"`` (and ``"histogram"``), first array: the moments of the
#: finite elements, none larger than the largest finite magnitude (so that none overflows);
#: ``"n"`` is the number of finite elements. The host derives ``l2`` from them.
DEVICE_MOMENTS: tuple[str, ...] = ("mean", "std", "min", "max", "n", "mean_abs")
#: ... second array: the counts. ``"health"`` sends the first three (the non-finite counts).
DEVICE_COUNTS: tuple[str, ...] = ("nan", "posinf", "neginf", "zeros")
#: The position of each of :data:`DEVICE_MOMENTS` in its array (its last axis).
MOMENT_COL: dict[str, int] = {k: i for i, k in enumerate(DEVICE_MOMENTS)}
#: The position of each of :data:`DEVICE_COUNTS` in its array (its last axis).
COUNT_COL: dict[str, int] = {k: i for i, k in enumerate(DEVICE_COUNTS)}


def key_span(keys: Sequence[str], names: Sequence[str]) -> slice:
    """The columns of ``names`` in a ``keys`` layout as one slice; they must lie side by side
    in that order (a view of a table, never a copy).

    Example:
        >>> key_span(STAT_KEYS, DEVICE_COUNTS), key_span(HEALTH_KEYS, ("nan", "posinf", "neginf"))
        (slice(7, 11, None), slice(1, 4, None))
    """
    start = list(keys).index(names[0])
    if tuple(keys[start:start + len(names)]) != tuple(names):
        raise ValueError(f"{names} do not lie side by side in {keys}")
    return slice(start, start + len(names))


#: Summary kinds, from most to least data crossing to the host.
SUMMARIES: tuple[str, ...] = ("full", "histogram", "stats", "health", "shape")
#: Derivative modes a site can report.
BASE_MODES: tuple[str, ...] = ("primal", "tangent", "cotangent")


def mode_order(mode: str) -> tuple[int, int, str]:
    """The order modes are shown in: primal, tangent, cotangent, then compositions.

    Example:
        >>> sorted(["cotangent.tangent", "cotangent", "primal", "tangent"], key=mode_order)
        ['primal', 'tangent', 'cotangent', 'cotangent.tangent']
    """
    base = BASE_MODES.index(mode) if mode in BASE_MODES else len(BASE_MODES)
    return (mode.count("."), base, mode)


#: ``Record.summary`` and ``Record.tag`` of a host-side scalar from :func:`sowtel.log`; its
#: number is ``stats["value"]``, its mode ``"primal"`` and its shape ``()``.
SCALAR_SUMMARY = "scalar"
LOG_TAG = "log"


#: ``Record.index``: the scan iteration(s) and/or shard of an occurrence, or None.
Index = int | tuple[int, ...] | None


def record_index(axes: Sequence[tuple[str, int, int]]) -> Index:
    """THE record-index rule, for every path: the shard first, then the scan iterations.

    ``axes`` lists, outermost first, the ``(kind, size, position)`` of each axis a site is
    repeated over: ``"shard"`` (a shard_map or pmap) or ``"scan"`` (a scan, ``fori_loop`` or
    ``lax.map``; the position is the iteration's place in ``xs``, also in a reversed scan).
    Several shard axes combine row-major into one shard number, as ``lax.axis_index`` over
    the manual axes gives it; scan positions follow, outermost first. One part gives an int,
    several a tuple, none ``None``.

    Example:
      >>> record_index([("shard", 4, 2), ("scan", 5, 3)])
      (2, 3)
      >>> record_index([("shard", 2, 1), ("shard", 4, 3)]), record_index([("scan", 5, 3)])
      (7, 3)
      >>> record_index([]) is None
      True
    """
    shard: int | None = None
    scans: list[int] = []
    for kind, size, position in axes:
        if kind == "shard":
            shard = (0 if shard is None else shard * int(size)) + int(position)
        else:
            scans.append(int(position))
    parts = ([] if shard is None else [shard]) + scans
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else tuple(parts)


def order_key(order: int, scans: Sequence[Sequence[Any]], index: Index) -> tuple[int, ...]:
    """THE execution-order rule: sorting a step's records by this key gives the order they ran.

    The forward pass in program order, then the backward pass in the order it ran, and inside
    a scan iteration after iteration: every site of the scan's body at one iteration before
    any at the next. A record of a site outside any scan is ``(order,)``. Inside scans, each
    scan (outermost first) adds its ``entry`` (the ``order`` at which it began, its first
    site's) and the iteration's rank (the index, negated when the scan ran last-first), then
    the site's ``order``. Shards run side by side and do not count: records of several shards
    share a key. ``scans`` is :attr:`Record.scans`; the scan iterations are the last parts of
    ``index`` (a shard comes first).

    Example:
      >>> scan = [(1, False)]                  # a scan whose first site has order 1
      >>> keys = {"a[0]": order_key(1, scan, 0), "b[0]": order_key(2, scan, 0),
      ...         "a[1]": order_key(1, scan, 1), "before": order_key(0, (), None),
      ...         "after": order_key(3, (), None)}
      >>> sorted(keys, key=keys.get)
      ['before', 'a[0]', 'b[0]', 'a[1]', 'after']
      >>> order_key(6, [(5, True)], 2) < order_key(5, [(5, True)], 1)   # backward: 2 runs first
      True
    """
    if not scans:
        return (int(order),)
    parts = index if isinstance(index, tuple) else (() if index is None else (index,))
    steps = parts[len(parts) - len(scans):] if len(parts) >= len(scans) else ()
    key: list[int] = []
    for k, (entry, reverse) in enumerate(scans):
        i = int(steps[k]) if steps else 0
        key += (int(entry), -i if reverse else i)
    key.append(int(order))
    return tuple(key)


def loop_entries(enclosing: Sequence[Sequence[Any]], order: int) -> tuple[int, ...]:
    """The entries, for :func:`order_key`, of the scans that index a site of ``order``.

    ``enclosing`` lists the loops around the site where it runs, outermost first, each
    ``(kind, length, reverse, cell)`` as the program's loops are noted while it is lowered
    (host callbacks) or evaluated (``sowtel.jit``'s summary pass); ``cell`` is a list that
    holds the loop's entry once a site inside it was met. A scan's entry is the ``order`` of
    the first site met inside it, so it falls between the orders of the sites before the scan
    and those in it. The scans are those that index the site's records (after the innermost
    ``while_loop``, as :func:`sowtel.naming.program_loops` takes them).

    Example:
      >>> scan, inner = ("scan", 3, False, []), ("scan", 2, False, [])
      >>> loop_entries([scan], 4), loop_entries([scan, inner], 5), loop_entries([], 6)
      ((4,), (4, 5), ())
    """
    cells: list[list[int]] = []
    for kind, _, _, cell in enclosing:
        if kind == "while":
            cells = []
        else:
            cells.append(cell)
    for cell in cells:
        if not cell:
            cell.append(int(order))
    return tuple(cell[0] for cell in cells)


def inexact(dtype: Any) -> bool:
    """Whether values of ``dtype`` can be NaN or infinite: numpy's floating and complex types,
    and those of ml_dtypes that JAX computes in (``bfloat16``, the ``float8`` types...), which
    numpy files as kind ``"V"``, so that ``np.issubdtype(bfloat16, np.floating)`` is False.

    Example:
        >>> import ml_dtypes
        >>> inexact(np.float32), inexact(ml_dtypes.bfloat16), inexact(ml_dtypes.int4)
        (True, True, False)
    """
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        return True
    if dt.kind != "V":
        return False
    try:
        import ml_dtypes

        ml_dtypes.finfo(dt)
    except (ImportError, ValueError, TypeError):
        return False
    return True


# -- THE non-finite rule: every path that asks whether a value held a NaN or an infinity -------
#    (the guard, the alert rules, every exporter, the post-mortem report, the plugin) asks here.

#: The counts of non-finite elements a summary carries, in the order every text shows them.
NONFINITE_KINDS: tuple[str, ...] = ("nan", "posinf", "neginf")
#: How texts name each of :data:`NONFINITE_KINDS`.
NONFINITE_LABELS: dict[str, str] = {"nan": "NaN", "posinf": "+inf", "neginf": "-inf"}


def nonfinite_count(stats: Any) -> int:
    """How many NaN and infinite elements statistics count (0 when they carry no counts).

    A count that is itself not a finite number (a hand-made or damaged record) counts as one
    non-finite element: such a record is never read as healthy.

    Example:
        >>> nonfinite_count({"nan": 2.0, "posinf": 1.0, "neginf": 0.0}), nonfinite_count({})
        (3, 0)
    """
    total = 0.0
    for kind in NONFINITE_KINDS:
        v = stats.get(kind, 0)
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = 1.0
        total += v if np.isfinite(v) else 1.0
    return int(total)


def nonfinite_text(stats: Any) -> str:
    """The counts of :func:`nonfinite_count` as one text: ``"1 NaN, 0 +inf, 2 -inf"``.

    Example:
        >>> nonfinite_text({"nan": 1.0, "neginf": 2.0})
        '1 NaN, 0 +inf, 2 -inf'
    """
    return ", ".join(f"{int(stats.get(k, 0) or 0)} {NONFINITE_LABELS[k]}"
                     for k in NONFINITE_KINDS)


def nonfinite_columns(stat_keys: Sequence[str]) -> tuple[int, ...] | None:
    """The positions of the non-finite counts in a statistics layout (:data:`STAT_KEYS`,
    :data:`HEALTH_KEYS`), or None when it carries none: tables are checked by these columns.

    Example:
        >>> nonfinite_columns(STAT_KEYS), nonfinite_columns(HEALTH_KEYS), nonfinite_columns(())
        ((7, 8, 9), (1, 2, 3), None)
    """
    if not all(k in stat_keys for k in NONFINITE_KINDS):
        return None
    return tuple(list(stat_keys).index(k) for k in NONFINITE_KINDS)


def nonfinite_rows(table: np.ndarray, stat_keys: Sequence[str]) -> np.ndarray:
    """Which rows of a statistics table (``(..., len(stat_keys))``) count a NaN or infinity,
    as a boolean array of the table's leading shape (all False without counts).

    Example:
        >>> t = np.zeros((2, 4)); t[1, 2] = 1.0
        >>> nonfinite_rows(t, HEALTH_KEYS).tolist()
        [False, True]
    """
    cols = nonfinite_columns(stat_keys)
    if cols is None:
        return np.zeros(table.shape[:-1], bool)
    counts = table[..., list(cols)]
    return ((counts != 0) & ~np.isnan(counts)).any(axis=-1) | np.isnan(counts).any(axis=-1)


def value_nonfinite(value: Any) -> bool:
    """Whether a whole value (an array of any :func:`inexact` dtype, bfloat16 and float8
    included) holds a NaN or an infinity: full values carry no counts.

    Example:
        >>> value_nonfinite(np.array([1.0, np.nan])), value_nonfinite(np.arange(3))
        (True, False)
    """
    if value is None or getattr(value, "dtype", None) is None or not inexact(value.dtype):
        return False
    return not bool(np.isfinite(value).all())


def is_nonfinite(record: Record) -> bool:
    """THE non-finite rule: whether ``record`` holds a NaN or an infinity, by the counts
    ``nan``/``posinf``/``neginf`` of its statistics or, for a full value without them, by its
    elements (of any :func:`inexact` dtype, bfloat16 and float8 included).

    Example:
        >>> import ml_dtypes
        >>> r = Record(name="h", mode="primal", tag="t", step=0, index=None, wall_time=0.0,
        ...            summary="full", shape=(2,), dtype="bfloat16",
        ...            value=np.array([1.0, np.inf], ml_dtypes.bfloat16))
        >>> is_nonfinite(r)
        True
    """
    stats = record.stats
    if "nan" in stats:
        return nonfinite_count(stats) > 0
    return value_nonfinite(record.value)


class FrozenStats(dict):  # type: ignore[type-arg]
    """A record's statistics, read-only: the same record goes to every exporter, so one that
    wrote to it would change what the others hold. A ``dict`` still (``json.dumps``,
    ``isinstance(stats, dict)``, ``{**stats}`` and ``dict(stats)`` work as before); a write
    raises ``TypeError``. Copy it to change it: ``{**record.stats, "mean": 0.0}``.

    Example:
        >>> stats = FrozenStats(mean=1.0)
        >>> stats["mean"], {**stats, "max": 2.0}
        (1.0, {'mean': 1.0, 'max': 2.0})
        >>> stats["mean"] = 0.0  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        sowtel.errors.ReadOnlyStatsError: a record's stats are shared by every exporter and ...
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise errors.ReadOnlyStatsError()

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only
    __ior__ = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling and copying rebuild it whole, never item by item through __setitem__.
        return (type(self), (dict(self),))


def read_only(array: Any) -> Any:
    """``array`` as exporters get it: a numpy array not writeable (a view where the array was,
    so the caller's own stays as it was); anything else as it is.

    Example:
        >>> a = np.zeros(2)
        >>> read_only(a).flags.writeable, a.flags.writeable
        (False, True)
    """
    if isinstance(array, np.ndarray) and array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class Record:
    """One observation of one sow site, as handed to exporters.

    Attributes:
      name: the site's name (``"block0/attn"``); a pytree sown at one site gives one record per
        leaf, named ``name/<leaf path>`` (``"pair/0"``, ``"params/w"``).
      mode: ``"primal"``, ``"tangent"``, ``"cotangent"`` or a composition such as
        ``"cotangent.tangent"``.
      tag: the site's tag.
      step: the device-side step from :func:`sowtel.at_step`, else the occurrence count of
        ``(name, mode, index)`` since :func:`sowtel.enable`.
      index: the scan iteration (a tuple for nested scans) and/or shard, else ``None``.
      wall_time: seconds since the epoch when the host received the value.
      summary: which summary produced the record (``"stats"``, ``"full"``, ...).
      shape, dtype: of the sown value (with a leading batch axis under ``vmap``).
      value: the whole value for ``"full"``, else ``None``.
      stats: floats keyed by :data:`STAT_KEYS` (or :data:`HEALTH_KEYS`); empty for ``"shape"``.
        A :class:`FrozenStats`: read-only, as ``value`` and the ``histogram`` arrays are (not
        writeable), since every exporter is given the same record.
      histogram: ``(edges, counts)`` with ``len(edges) == len(counts) + 1``, else ``None``.
      process_index: ``jax.process_index()`` of the process that produced it.
      seq: arrival order on the host (unique, increasing). Callbacks are unordered, so arrival
        order is not program order.
      order: the site's position in its compiled program (its backward-pass sites come after
        its forward ones).
      scans: the scans the site ran in, outermost first, each ``(entry, reverse)``: the
        ``order`` at which the scan began (its first site's) and whether its iterations ran
        last-first (a backward pass). With ``order`` and ``index`` it gives
        :attr:`order_key`.

    Example:
      >>> r = Record(name="h", mode="primal", tag="intermediates", step=0, index=None,
      ...            wall_time=0.0, summary="shape", shape=(2,), dtype="float32")
      >>> r.key
      ('h', 'primal', None)
    """

    name: str
    mode: str
    tag: str
    step: int
    index: int | tuple[int, ...] | None
    wall_time: float
    summary: str
    shape: tuple[int, ...]
    dtype: str
    value: np.ndarray | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    histogram: tuple[np.ndarray, np.ndarray] | None = None
    process_index: int = 0
    seq: int = 0
    order: int = 0
    scans: tuple[tuple[int, bool], ...] = ()

    def __post_init__(self) -> None:
        # Shared by every exporter: nothing one of them can write to (FrozenStats).
        if type(self.stats) is not FrozenStats:
            object.__setattr__(self, "stats", FrozenStats(self.stats))
        if self.value is not None:
            object.__setattr__(self, "value", read_only(self.value))
        if self.histogram is not None:
            object.__setattr__(self, "histogram", tuple(read_only(a) for a in self.histogram))

    @property
    def order_key(self) -> tuple[int, ...]:
        """Where the record ran within its step: see :func:`order_key`."""
        return order_key(self.order, self.scans, self.index)

    @property
    def key(self) -> tuple[str, str, Any]:
        """``(name, mode, index)``: what identifies a series of records across steps."""
        return (self.name, self.mode, self.index)

    @property
    def nonfinite(self) -> int:
        """Count of NaN and infinite elements (0 when the summary does not count them)."""
        return nonfinite_count(self.stats)


# -- How exporters name series and choose statistics (TensorBoard tags, tracker metrics) -------

#: The statistics exporters write by default: those that change from step to step for most sites.
DEFAULT_STATS: tuple[str, ...] = ("mean", "std", "min", "max", "l2")
#: Counts written by default only from the first step one of them is non-zero.
COUNT_STATS: tuple[str, ...] = NONFINITE_KINDS
#: Statistics an exporter derives from a record's own: ``max_abs`` = max(|min|, |max|), the
#: largest magnitude of the finite elements.
DERIVED_STATS: tuple[str, ...] = ("max_abs",)


def with_derived(stats: dict[str, float]) -> dict[str, float]:
    """``stats`` with :data:`DERIVED_STATS` added where the statistics they come from exist.

    Example:
        >>> with_derived({"min": -3.0, "max": 2.0})["max_abs"]
        3.0
    """
    if "min" not in stats or "max" not in stats or "max_abs" in stats:
        return stats
    return {**stats, "max_abs": float(np.fmax(abs(stats["min"]), abs(stats["max"])))}


def index_text(index: int | tuple[int, ...] | None, brackets: str = "[]", sep: str = ",") -> str:
    """A record's index as written after its name: ``[3]``, ``[1,0]``, or ``""`` for None.

    Example:
        >>> index_text((1, 0)), index_text(None), index_text(3, brackets=":", sep=":")
        ('[1,0]', '', ':3')
    """
    if index is None:
        return ""
    items = index if isinstance(index, tuple) else (index,)
    return brackets[0] + sep.join(str(int(i)) for i in items) + brackets[1:]


def series_tag(name: str, mode: str, index: int | tuple[int, ...] | None = None) -> str:
    """The name prefix of one series: ``{name}[index]/{mode}``; scalars append ``/{stat}``.

    Example:
        >>> series_tag("block0/attn", "cotangent", 3)
        'block0/attn[3]/cotangent'
        >>> series_tag("h", "primal")
        'h/primal'
    """
    return f"{name}{index_text(index)}/{mode}"


def check_stats(stats: Any) -> tuple[str, ...] | None:
    """An exporter's ``stats=`` as a tuple of names, or None for every statistic a record has.

    Example:
        >>> check_stats("default"), check_stats(["max", "mean"]), check_stats("all")
        (('mean', 'std', 'min', 'max', 'l2'), ('max', 'mean'), None)
    """
    if isinstance(stats, str) and stats in ("default", "all"):
        return None if stats == "all" else DEFAULT_STATS
    items = [stats] if isinstance(stats, str) else stats
    if (not isinstance(items, (list, tuple)) or not items
            or not all(isinstance(k, str) and k in STAT_KEYS + DERIVED_STATS for k in items)):
        raise errors.BadOptionError(
            "stats", stats, f"is not a choice of statistics: use 'default' "
            f"({', '.join(DEFAULT_STATS)}, and the non-finite counts once non-zero), 'all', or "
            f"a list of some of {', '.join(STAT_KEYS + DERIVED_STATS)}"
        )
    return tuple(dict.fromkeys(items))


class StatChoice:
    """Which statistics of each record an exporter writes, from its ``stats=`` option.

    ``"default"`` writes :data:`DEFAULT_STATS`, and :data:`COUNT_STATS` of a series from the
    first record in which one of them is non-zero on (always for ``"health"`` records);
    ``"all"`` everything a record carries; a list exactly those.

    Example:
        >>> choice = StatChoice("default")
        >>> choice.chosen(("h", "primal", None), "stats", {"mean": 1.0, "nan": 0.0}, False)
        ['mean']
        >>> choice.chosen(("h", "primal", None), "stats", {"mean": 1.0, "nan": 2.0}, True)
        ['mean', 'nan']
    """

    def __init__(self, stats: str | Sequence[str] = "default", *,
                 by_mode: Callable[[str], Sequence[str]] | None = None) -> None:
        self.stats = check_stats(stats)
        self._counts_once_nonzero = stats == "default"
        # An exporter's own defaults for each mode (the TensorBoard exporter's), else
        # DEFAULT_STATS for every mode.
        self._by_mode = by_mode if stats == "default" else None
        #: The series whose counts are written (from their first non-zero count on).
        self.counting: set[tuple[str, str, Any]] = set()

    def writes_count(self, stat: str) -> bool:
        """Whether the count ``stat`` (one of :data:`COUNT_STATS`) may be written: always
        under ``"all"`` or a list naming it; under ``"default"`` from a series' first non-zero
        count on (the caller keeps that series' state, as :meth:`chosen` does in
        :attr:`counting`).

        Example:
            >>> StatChoice("default").writes_count("nan"), StatChoice(["mean"]).writes_count("nan")
            (True, False)
        """
        return self._counts_once_nonzero or self.stats is None or stat in self.stats

    def chosen(self, key: tuple[str, str, Any], summary: str, stats: dict[str, float],
               nonfinite: bool, single: bool = False) -> list[str]:
        """The statistics of ``stats`` to write for the series ``key`` now; ``single``: the
        value is one number, so by default only its ``mean`` (its value) is written."""
        if self.stats is None:
            return list(stats)
        wanted = self.stats if self._by_mode is None else self._by_mode(key[1])
        chosen = [k for k in wanted if k in stats]
        if self._counts_once_nonzero and single and "mean" in stats:
            # A sown scalar is its own mean, min and max: one chart of its value.
            chosen = ["mean"]
        if self._counts_once_nonzero:
            # Counts are zero for almost every series: written from the first non-zero step on,
            # and for a health summary, whose counts are all it has.
            if nonfinite or summary == "health":
                self.counting.add(key)
            if key in self.counting:
                chosen += [k for k in COUNT_STATS if k in stats]
        return chosen
