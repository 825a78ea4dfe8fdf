"""Every path's values to columnar batches, and batches to :class:`~sowtel.records.Record` objects.

A ``sowtel.jit`` logging step hands the host, per site, summary arrays stacked over the scans
and shard_maps around it. They are decoded here once, with numpy, into a table per site
(:class:`SiteColumns`: positions × leaves × statistics), never record by record. A
:class:`RecordBatch` is what the dispatcher hands an exporter: a sequence of parts, each a
:class:`SiteColumns` or a tuple of ready :class:`Record` objects (callback-transport records,
``sowtel.log``, ``sowtel.export``). An exporter with a ``write_batch(batch)`` method reads the
columns directly; one with only ``write(records)`` gets ``batch.records()``, built then.

Example:
    >>> import numpy as np
    >>> from sowtel.sites import StreamSite
    >>> site = StreamSite(name="h", mode="primal", tag="intermediates", leaf_names=("h",),
    ...                   shapes=((2,),), dtypes=("float32",), summary="health", every=1,
    ...                   bins=30, loops=((3, False),), extras=())
    >>> columns = site_columns(site, [np.array([[0, 0, 0], [1, 0, 0], [0, 0, 0]])],
    ...                        index=[0, 1, 2], step=7, seqs=[0, 1, 2], wall_time=0.0,
    ...                        process_index=0)
    >>> columns.stat_keys, columns.stats[:, 0, 1].tolist()
    (('size', 'nan', 'posinf', 'neginf'), [0.0, 1.0, 0.0])
    >>> batch = RecordBatch([columns])
    >>> [(r.step, r.index, r.stats["nan"]) for r in batch.records()]
    [(7, 0, 0.0), (7, 1, 1.0), (7, 2, 0.0)]
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sowtel import naming
from sowtel.intermediates import (
    check_intermediates,
    check_step,
    program_order,
    site_leaves,
    stack_indices,
    stacking,
)
from sowtel.records import (
    DEVICE_COUNTS,
    DEVICE_MOMENTS,
    HEALTH_KEYS,
    LOG_TAG,
    NONFINITE_KINDS,
    SCALAR_SUMMARY,
    STAT_KEYS,
    FrozenStats,
    Record,
    is_nonfinite,
    key_span,
    nonfinite_columns,
    nonfinite_rows,
    read_only,
    record_index,
)
from sowtel.summaries import check_summary, decode_summaries, host_summary, stats_table

if TYPE_CHECKING:
    from sowtel.sites import StreamSite

__all__ = ["SiteColumns", "RecordBatch", "site_columns", "site_records", "log_records",
           "compiled_columns", "first_nonfinite", "record_nbytes", "records_from_intermediates"]

Index = int | tuple[int, ...] | None

# Where each summary's table holds its non-finite counts (THE rule: sowtel.records).
_NONFINITE = {"stats": nonfinite_columns(STAT_KEYS), "histogram": nonfinite_columns(STAT_KEYS),
              "full": nonfinite_columns(STAT_KEYS), "health": nonfinite_columns(HEALTH_KEYS)}
_new_record = object.__new__
# Where a stats table holds its non-finite counts, as a view; the device arrays' shapes.
_STATS_NONFINITE = key_span(STAT_KEYS, NONFINITE_KINDS)
_MOMENTS, _COUNTS = (len(DEVICE_MOMENTS),), (len(DEVICE_COUNTS),)


def record_nbytes(record: Record) -> int:
    """Bytes of the full value a record holds (0 for summaries)."""
    value = record.value
    return int(getattr(value, "nbytes", 0)) if value is not None else 0


def _frozen(array: np.ndarray) -> np.ndarray:
    # The table's own arrays (decoded from the step's buffers): made read-only in place.
    if isinstance(array, np.ndarray):
        array.flags.writeable = False
    return array


class SiteColumns:
    """One site's records of one step, as columns: positions × leaves × statistics.

    A position is one place the site ran (a scan iteration, a shard, or the one place of a site
    outside any), in the order the program ran them; the site's records are position after
    position, leaf after leaf within one. Everything a :class:`Record` holds is here:

    Attributes:
      names, shapes, dtypes: per leaf (``names[l]`` is the record name of leaf ``l``).
      mode, tag, summary, step, wall_time, process_index, order, scans: shared by every
        record.
      index: per position, the record index (``None``, an int, or a tuple).
      seqs: per position, the records' ``seq`` (the leaves of one position share it).
      stat_keys: the statistics' names (:data:`~sowtel.records.STAT_KEYS`,
        :data:`~sowtel.records.HEALTH_KEYS`, or empty for ``"shape"``).
      stats: float64 array of shape ``(positions, leaves, len(stat_keys))``.
      edges, counts: for ``"histogram"``, float64 arrays ``(positions, leaves, bins + 1)`` and
        ``(positions, leaves, bins)``; else None.
      values: for ``"full"``, ``values[p][l]`` the value of leaf ``l`` at position ``p``; else
        None.

    Example:
      >>> c = SiteColumns(names=("w",), shapes=((),), dtypes=("float32",), mode="primal",
      ...                 tag="intermediates", summary="health", step=0, wall_time=0.0,
      ...                 process_index=0, order=0, index=[None], seqs=[5],
      ...                 stat_keys=HEALTH_KEYS, stats=np.zeros((1, 1, 4)))
      >>> len(c), c.records()[0].seq
      (1, 5)
    """

    __slots__ = ("names", "shapes", "dtypes", "mode", "tag", "summary", "step", "wall_time",
                 "process_index", "order", "index", "seqs", "stat_keys", "stats", "edges",
                 "counts", "values", "any_nonfinite", "_records", "scans")

    def __init__(self, *, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                 dtypes: tuple[str, ...], mode: str, tag: str, summary: str, step: int,
                 wall_time: float, process_index: int, order: int, index: Sequence[Index],
                 seqs: Sequence[int], stat_keys: tuple[str, ...], stats: np.ndarray,
                 edges: np.ndarray | None = None, counts: np.ndarray | None = None,
                 values: Sequence[Sequence[np.ndarray]] | None = None,
                 any_nonfinite: bool | None = None,
                 scans: tuple[tuple[int, bool], ...] = ()) -> None:
        self.names = names
        self.shapes = shapes
        self.dtypes = dtypes
        self.mode = mode
        self.tag = tag
        self.summary = summary
        self.step = step
        self.wall_time = wall_time
        self.process_index = process_index
        self.order = order
        self.scans = scans
        # Tuples, like the arrays below read-only: every exporter reads the same table.
        self.index = index if isinstance(index, tuple) else tuple(index)
        self.seqs = seqs if isinstance(seqs, tuple) else tuple(seqs)
        self.stat_keys = stat_keys
        # Every exporter is given the same table and the same records made of it: nothing in
        # them may be written to (Record.stats is a FrozenStats).
        self.stats = _frozen(stats)
        self.edges = None if edges is None else _frozen(edges)
        self.counts = None if counts is None else _frozen(counts)
        if values is not None:
            # Views: a value the caller handed in (sowtel.export) stays writeable for them.
            values = tuple(tuple(read_only(v) for v in row) for row in values)
        self.values = values
        if any_nonfinite is None:
            cols = _NONFINITE.get(summary)
            any_nonfinite = bool(cols is not None and len(stats)
                                 and nonfinite_rows(stats, stat_keys).any())
        # Decided once, where the table is made: first_nonfinite reads only this flag.
        self.any_nonfinite = any_nonfinite
        self._records: list[Record] | None = None

    @property
    def positions(self) -> int:
        """How many positions (rows) the table has."""
        return len(self.index)

    def __len__(self) -> int:
        return len(self.index) * len(self.names)

    def nbytes(self, start: int = 0, stop: int | None = None) -> int:
        """Bytes of the full values of positions ``start:stop`` (0 unless ``"full"``)."""
        if self.values is None:
            return 0
        return sum(int(v.nbytes) for row in self.values[start:stop] for v in row)

    def slice(self, start: int, stop: int) -> SiteColumns:
        """The positions ``start:stop`` as a table of their own (views, no copies)."""
        return SiteColumns(
            names=self.names, shapes=self.shapes, dtypes=self.dtypes, mode=self.mode,
            tag=self.tag, summary=self.summary, step=self.step, wall_time=self.wall_time,
            process_index=self.process_index, order=self.order, scans=self.scans,
            index=self.index[start:stop], seqs=self.seqs[start:stop], stat_keys=self.stat_keys,
            stats=self.stats[start:stop],
            edges=None if self.edges is None else self.edges[start:stop],
            counts=None if self.counts is None else self.counts[start:stop],
            values=None if self.values is None else self.values[start:stop])

    def records(self) -> list[Record]:
        """The :class:`Record` objects of this table (built on the first call, then kept)."""
        if self._records is not None:
            return self._records
        keys = self.stat_keys
        rows = self.stats.tolist()
        shared = {"mode": self.mode, "tag": self.tag, "step": self.step,
                  "wall_time": self.wall_time, "summary": self.summary,
                  "process_index": self.process_index, "order": self.order,
                  "scans": self.scans, "histogram": None, "value": None}
        out: list[Record] = []
        for p, (index, seq, row) in enumerate(zip(self.index, self.seqs, rows, strict=True)):
            for leaf, name in enumerate(self.names):
                # A frozen dataclass's __init__ sets each field through object.__setattr__;
                # filling __dict__ at once is what makes a lazily built record cheap.
                r = _new_record(Record)
                d = r.__dict__
                d.update(shared)
                d["name"] = name
                d["index"] = index
                d["shape"] = self.shapes[leaf]
                d["dtype"] = self.dtypes[leaf]
                d["seq"] = seq
                d["stats"] = FrozenStats(zip(keys, row[leaf], strict=True))
                if self.edges is not None and self.counts is not None:
                    d["histogram"] = (self.edges[p, leaf], self.counts[p, leaf])
                if self.values is not None:
                    d["value"] = self.values[p][leaf]
                out.append(r)
        self._records = out
        return out


Part = SiteColumns | tuple[Record, ...]


class RecordBatch(Sequence[Record]):
    """What the dispatcher hands an exporter: records in order, in columnar parts.

    ``parts`` is a tuple, each a :class:`SiteColumns` (one site's records of one ``sowtel.jit``
    step, or a stretch of them) or a tuple of ready :class:`Record` objects. ``len(batch)`` is
    the number of records; iterating, indexing and :meth:`records` build the records of
    columnar parts on first use (once each).

    Example:
      >>> from sowtel.records import Record
      >>> r = Record(name="loss", mode="primal", tag="log", step=3, index=None, wall_time=0.0,
      ...            summary="scalar", shape=(), dtype="float64", stats={"value": 0.5})
      >>> batch = RecordBatch([(r,)])
      >>> len(batch), batch[0].name, batch.records() == [r]
      (1, 'loss', True)
    """

    __slots__ = ("parts", "_len")

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts: tuple[Part, ...] = tuple(p for p in parts if len(p))
        self._len = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Record]:
        for part in self.parts:
            yield from (part.records() if isinstance(part, SiteColumns) else part)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.records()[i]
        return self.records()[i]

    def records(self) -> list[Record]:
        """Every record, in order, as :class:`Record` objects."""
        out: list[Record] = []
        for part in self.parts:
            out.extend(part.records() if isinstance(part, SiteColumns) else part)
        return out

    def columns(self) -> Iterator[SiteColumns]:
        """The columnar parts only."""
        return (p for p in self.parts if isinstance(p, SiteColumns))

    def nbytes(self) -> int:
        """Bytes of full values held by the batch."""
        return sum(p.nbytes() if isinstance(p, SiteColumns) else
                   sum(record_nbytes(r) for r in p) for p in self.parts)

    def split(self, limit: int, max_bytes: int, started: bool = False
              ) -> tuple[RecordBatch, RecordBatch | None]:
        """The first records, up to ``limit`` records and ``max_bytes`` bytes of full values,
        and the rest (None when nothing is left). A table is cut between positions only. Unless
        ``started`` (the write already holds records), the head holds at least one record, or
        one position of a table, whatever the bounds."""
        head: list[Part] = []
        taken = nbytes = 0
        for k, part in enumerate(self.parts):
            room = limit - taken
            some = started or bool(head)
            if room <= 0:
                return RecordBatch(head), RecordBatch(self.parts[k:])
            if isinstance(part, SiteColumns):
                rows, width = part.positions, len(part.names)
                n = min(rows, room // width if some else max(1, room // width))
                if part.values is not None:
                    m = 0
                    while m < n:
                        b = part.nbytes(m, m + 1)
                        if (some or m) and nbytes + b > max_bytes:
                            break
                        nbytes += b
                        m += 1
                    n = m
                if n >= rows:
                    head.append(part)
                    taken += len(part)
                    continue
                if n:
                    head.append(part.slice(0, n))
                return RecordBatch(head), RecordBatch([part.slice(n, rows), *self.parts[k + 1:]])
            n = 0
            while n < min(room, len(part)):
                b = record_nbytes(part[n])
                if (some or n) and b and nbytes + b > max_bytes:
                    break
                nbytes += b
                n += 1
            if n >= len(part):
                head.append(part)
                taken += n
                continue
            if n:
                head.append(part[:n])
            return RecordBatch(head), RecordBatch([part[n:], *self.parts[k + 1:]])
        return self, None


def site_columns(site: StreamSite, arrays: Sequence[np.ndarray], *, index: Sequence[Index],
                 step: int, seqs: Sequence[int], wall_time: float,
                 process_index: int) -> SiteColumns:
    """A site's records at ``len(index)`` positions from its device summary ``arrays``.

    ``arrays`` are the site's summary arrays as sent (leaf after leaf, or packed: see
    ``StreamSite.packing``), each with one leading axis of positions (in the order of ``index``).
    """
    arrays = site.per_leaf(arrays)
    n = len(index)
    per_leaf = site.arrays_per_leaf
    leaves = len(site.leaf_names)
    keys: tuple[str, ...] = ()
    stats = edges = counts = None
    values: list[list[np.ndarray]] | None = None
    if site.summary == "full":
        values = [[np.asarray(arrays[leaf][p]) for leaf in range(leaves)] for p in range(n)]
        keys = STAT_KEYS
        stats = np.array([[[host_summary(v, "stats")["stats"][k] for k in keys] for v in row]
                          for row in values], dtype=np.float64).reshape(n, leaves, len(keys))
    elif leaves == 1:  # the table is the site's, as a view
        keys, table, e, c = decode_summaries(site.summary, arrays[:per_leaf], site.sizes[0],
                                             site.bins, n)
        stats = table[:, None, :]
        if e is not None and c is not None:
            edges, counts = e[:, None, :], c[:, None, :]
    else:
        for leaf in range(leaves):
            keys, table, e, c = decode_summaries(
                site.summary, arrays[leaf * per_leaf:(leaf + 1) * per_leaf], site.sizes[leaf],
                site.bins, n)
            if stats is None:
                stats = np.empty((n, leaves, table.shape[1]))
                if e is not None and c is not None:
                    edges = np.empty((n, leaves, e.shape[1]))
                    counts = np.empty((n, leaves, c.shape[1]))
            stats[:, leaf] = table
            if edges is not None and counts is not None:
                edges[:, leaf] = e
                counts[:, leaf] = c
    assert stats is not None
    return SiteColumns(
        names=tuple(site.leaf_names), shapes=tuple(site.shapes), dtypes=tuple(site.dtypes),
        mode=site.mode, tag=site.tag, summary=site.summary, step=step, wall_time=wall_time,
        process_index=process_index, order=site.order, index=index, seqs=seqs, stat_keys=keys,
        stats=stats, edges=edges, counts=counts, values=values, scans=site.scans)


def site_records(site: StreamSite, arrays: Sequence[Sequence[np.ndarray]], *,
                 steps: Sequence[int], index: Sequence[Index], seqs: Sequence[int],
                 wall_times: Sequence[float], process_index: int) -> list[Record]:
    """The records of several host callbacks of one site, decoded together.

    ``arrays[c]`` are callback ``c``'s summary arrays, leaf after leaf; ``steps``, ``index``,
    ``seqs`` and ``wall_times`` are per callback. The callbacks' arrays are stacked into one
    table (:func:`site_columns`, the same decoding as ``sowtel.jit`` steps), whose records then
    take each callback's step and time. Records come callback after callback, leaf after leaf.

    Example:
        >>> from sowtel.sites import StreamSite
        >>> site = StreamSite(name="h", mode="primal", tag="intermediates", leaf_names=("h",),
        ...                   shapes=((2,),), dtypes=("float32",), summary="health", every=1,
        ...                   bins=30, loops=(), extras=())
        >>> records = site_records(site, [[np.array([0, 0, 0])], [np.array([2, 0, 0])]],
        ...                        steps=[4, 5], index=[None, None], seqs=[9, 10],
        ...                        wall_times=[0.5, 0.7], process_index=0)
        >>> [(r.step, r.seq, r.wall_time, r.stats["nan"]) for r in records]
        [(4, 9, 0.5, 0.0), (5, 10, 0.7, 2.0)]
    """
    count = site.n_summary
    if len(arrays) == 1:  # views: a full value keeps its own array
        stacked = [np.asarray(a)[None] for a in arrays[0][:count]]
    else:
        stacked = [np.stack([np.asarray(a[k]) for a in arrays]) for k in range(count)]
    records = site_columns(site, stacked, index=index, step=0, seqs=seqs, wall_time=0.0,
                           process_index=process_index).records()
    width = len(site.leaf_names)
    for c, (step, wall_time) in enumerate(zip(steps, wall_times, strict=True)):
        for r in records[c * width:(c + 1) * width]:
            d = r.__dict__  # built here, not yet shared: see SiteColumns.records
            d["step"] = step
            d["wall_time"] = wall_time
    return records


def log_records(values: Sequence[tuple[str, float]], *, step: int, wall_time: float,
                process_index: int) -> list[Record]:
    """The records of one :func:`sowtel.log` call: one ``summary="scalar"`` record a number.

    Example:
        >>> [(r.name, r.tag, r.stats) for r in log_records([("loss", 0.5)], step=3,
        ...                                                 wall_time=0.0, process_index=0)]
        [('loss', 'log', {'value': 0.5})]
    """
    return [Record(name=name, mode="primal", tag=LOG_TAG, step=int(step), index=None,
                   wall_time=wall_time, summary=SCALAR_SUMMARY, shape=(), dtype="float64",
                   stats={"value": float(v)}, process_index=process_index)
            for name, v in values]


class _Layout:
    """Where one site's positions lie in its stacked arrays, in program order (fixed per
    compiled program, so computed once)."""

    __slots__ = ("entry", "take", "index", "positions", "in_order")

    def __init__(self, entry: Any, shape: tuple[int, ...]) -> None:
        kinds = [kind for kind, _ in entry.stacked]
        # Positions in the order the program ran them: a reversed scan from its last iteration.
        reverse = iter([r for _, r in entry.site.loops or ()])
        backward = [k == "scan" and next(reverse, False) for k in kinds]
        self.entry = entry
        self.positions = [tuple(n - 1 - p if b else p
                                for p, n, b in zip(step_pos, shape, backward, strict=True))
                          for step_pos in np.ndindex(shape)]
        # Flat offsets of the positions in a C-ordered array of `shape`.
        self.take = np.array([np.ravel_multi_index(p, shape) if shape else 0
                              for p in self.positions], dtype=np.intp)
        self.index = [record_index(list(zip(kinds, shape, p, strict=True)))
                      for p in self.positions]
        # Positions already in the arrays' order (no reversed scan): a reshape is the gather.
        self.in_order = bool((self.take == np.arange(len(self.take))).all())


class _StepPlan:
    """Where a logging program's plain ``stats`` sites lie in its packed buffers: those of one
    leaf outside any scan or ``shard_map`` (most sites of most steps), decoded for the whole
    step with a few numpy operations instead of site by site (fixed per program, so computed
    once)."""

    __slots__ = ("sites", "layout", "rows", "buffers", "moments", "counts", "ran", "sizes")

    def __init__(self, sites: Sequence[Any], layout: Sequence[tuple[int, int, tuple[int, ...]]]
                 ) -> None:
        self.sites = sites
        self.layout = layout
        self.rows: list[int | None] = []  # per site: its row of the step's table, or None
        moments: list[int] = []
        counts: list[int] = []
        ran: list[int] = []
        sizes: list[int] = []
        buffers: tuple[int, int, int] | None = None
        at = 0
        for entry in sites:
            site = entry.site
            spots = layout[at:at + entry.n_arrays]
            at += entry.n_arrays
            where = tuple(b for b, _, _ in spots)
            if (site.summary != "stats" or len(site.leaf_names) != 1 or entry.stacked
                    or [shape for _, _, shape in spots] != [_MOMENTS, _COUNTS, ()]
                    or buffers not in (None, where)):
                self.rows.append(None)
                continue
            buffers = where  # type: ignore[assignment]
            self.rows.append(len(sizes))
            moments.extend(range(spots[0][1], spots[0][1] + len(DEVICE_MOMENTS)))
            counts.extend(range(spots[1][1], spots[1][1] + len(DEVICE_COUNTS)))
            ran.append(spots[2][1])
            sizes.append(site.sizes[0])
        self.buffers = buffers
        self.moments = np.array(moments, np.intp).reshape(-1, len(DEVICE_MOMENTS))
        self.counts = np.array(counts, np.intp).reshape(-1, len(DEVICE_COUNTS))
        self.ran = np.array(ran, np.intp)
        self.sizes = np.array(sizes, np.float64)

    def table(self, buffers: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plain sites' stats ``(rows, len(STAT_KEYS))`` (:func:`~sowtel.summaries.
        stats_table` of all rows at once), whether each ran, and whether each holds a
        non-finite element."""
        if self.buffers is None:
            return np.empty((0, len(STAT_KEYS))), np.zeros(0, bool), np.zeros(0, bool)
        m, c, r = (buffers[b] for b in self.buffers)
        table = stats_table(m[self.moments], c[self.counts], self.sizes)
        ran: np.ndarray = r[self.ran] != 0
        nonfinite: np.ndarray = np.any(table[:, _STATS_NONFINITE], axis=1)
        return table, ran, nonfinite


class CompiledConverter:
    """Turns ``sowtel.jit`` logging steps' summary outputs into :class:`SiteColumns`.

    Keeps, per compiled program's site, where its positions lie and their record indices.

    Example:
      >>> converter = CompiledConverter()
      >>> converter.columns([], [], step=0, seqs=iter(range(10)), wall_time=0.0,
      ...                   process_index=0)
      []
    """

    def __init__(self) -> None:
        self._layouts: dict[int, _Layout] = {}
        self._plans: dict[int, _StepPlan] = {}

    def _layout(self, entry: Any, shape: tuple[int, ...]) -> _Layout:
        layout = self._layouts.get(id(entry))
        if layout is None or layout.entry is not entry:
            layout = self._layouts[id(entry)] = _Layout(entry, shape)
        return layout

    def _plan(self, sites: Sequence[Any], layout: Any) -> _StepPlan:
        plan = self._plans.get(id(sites))
        if plan is None or plan.sites is not sites or plan.layout is not layout:
            plan = self._plans[id(sites)] = _StepPlan(sites, layout)
        return plan

    def packed_columns(self, summaries: Any, buffers: Sequence[np.ndarray], *, step: int,
                       seqs: Iterator[int], wall_time: float,
                       process_index: int) -> list[SiteColumns]:
        """:meth:`columns` of a logging step's packed outputs (``sowtel.jit``'s
        ``CompiledSummaries``, fetched into ``buffers``): the plain ``stats`` sites decoded
        together, the others site by site.

        Example:
          >>> CompiledConverter().packed_columns(type("S", (), {"sites": (), "layout": ()})(),
          ...                                    [], step=0, seqs=iter(range(3)),
          ...                                    wall_time=0.0, process_index=0)
          []
        """
        plan = self._plan(summaries.sites, summaries.layout)
        table, ran, nonfinite = plan.table(buffers)
        arrays = summaries.unpack(buffers) if None in plan.rows else []
        out: list[SiteColumns] = []
        at = 0
        for entry, row in zip(summaries.sites, plan.rows, strict=True):
            mine = arrays[at:at + entry.n_arrays]
            at += entry.n_arrays
            if row is None:
                found = self._entry_columns(entry, mine, None, step=step, seqs=seqs,
                                            wall_time=wall_time, process_index=process_index)
                if found is not None:
                    out.append(found)
                continue
            if not ran[row]:
                continue
            site = entry.site
            out.append(SiteColumns(
                names=site.leaf_names, shapes=site.shapes, dtypes=site.dtypes, mode=site.mode,
                tag=site.tag, summary="stats", step=step, wall_time=wall_time,
                process_index=process_index, order=site.order, index=_UNINDEXED,
                seqs=[next(seqs)], stat_keys=STAT_KEYS, stats=table[row:row + 1, None, :],
                any_nonfinite=bool(nonfinite[row]), scans=site.scans))
        return out

    def columns(self, sites: Sequence[Any], arrays: Sequence[np.ndarray], *, step: int,
                seqs: Iterator[int], wall_time: float, process_index: int,
                lowest: Sequence[np.ndarray] | None = None) -> list[SiteColumns]:
        """One table per site of a logging step, from its outputs now on the host.

        ``sites`` are the program's ``SiteSummary`` entries, ``arrays`` its outputs in their
        order: each site's summary arrays carry leading axes for the scans and shard_maps
        around it (outermost first), and its last array says, per position, whether the site
        ran there (0 in a cond branch not taken: no record). ``lowest`` (several processes,
        see :func:`sowtel.multihost.fetch`): this process keeps only the positions it owns.
        """
        out: list[SiteColumns] = []
        at = 0
        for entry in sites:
            mine = arrays[at:at + entry.n_arrays]
            held = lowest[at:at + entry.n_arrays] if lowest is not None else None
            at += entry.n_arrays
            found = self._entry_columns(entry, mine, held, step=step, seqs=seqs,
                                        wall_time=wall_time, process_index=process_index)
            if found is not None:
                out.append(found)
        return out

    def _entry_columns(self, entry: Any, mine: Sequence[np.ndarray],
                       held: Sequence[np.ndarray] | None, *, step: int, seqs: Iterator[int],
                       wall_time: float, process_index: int) -> SiteColumns | None:
        from sowtel.multihost import owns

        ran = np.asarray(mine[-1])
        layout = self._layout(entry, ran.shape)
        everywhere = held is None and bool(ran.all())  # the usual case: one numpy call
        if everywhere:
            n = everywhere_n = len(layout.take)
        else:
            keep = ran.reshape(-1)[layout.take].astype(bool)
            if held is not None:
                keep &= np.array([owns(held, p, process_index) for p in layout.positions],
                                 dtype=bool)
            n = int(keep.sum())
            everywhere_n = len(keep)
        if not n:
            return None
        take = layout.take if n == everywhere_n else layout.take[keep]
        index = layout.index if n == everywhere_n else [
            i for i, k in zip(layout.index, keep, strict=True) if k]
        lead = ran.ndim
        if n == everywhere_n and layout.in_order:
            gathered = [np.asarray(a).reshape(n, *np.shape(a)[lead:]) for a in mine[:-1]]
        else:
            gathered = [np.asarray(a).reshape(-1, *np.shape(a)[lead:])[take]
                        for a in mine[:-1]]
        seq = list(itertools.islice(seqs, n))
        return site_columns(entry.site, gathered, index=index, step=step, seqs=seq,
                            wall_time=wall_time, process_index=process_index)


# The record index of a site outside any scan or shard_map (record_index of no axes).
_UNINDEXED: tuple[Index, ...] = (record_index([]),)


def compiled_columns(sites: Sequence[Any], arrays: Sequence[np.ndarray], *, step: int,
                     seqs: Iterator[int], wall_time: float, process_index: int,
                     lowest: Sequence[np.ndarray] | None = None) -> list[SiteColumns]:
    """:meth:`CompiledConverter.columns` without keeping layouts between steps."""
    return CompiledConverter().columns(sites, arrays, step=step, seqs=seqs, wall_time=wall_time,
                                       process_index=process_index, lowest=lowest)


def first_nonfinite(batch: RecordBatch, *, with_index: bool = False) -> tuple[Any, ...] | None:
    """``(step, name, mode)`` of the first record of ``batch`` holding a NaN or infinity, and
    its ``index`` (scan iteration or shard, else None) fourth with ``with_index=True``.

    Where a batch's non-finite record is found: tables by their count columns, records by
    :func:`sowtel.records.is_nonfinite` (THE rule).

    Example:
      >>> from sowtel.records import Record
      >>> r = Record(name="g", mode="cotangent", tag="t", step=4, index=2, wall_time=0.0,
      ...            summary="health", shape=(), dtype="float32", stats={"nan": 1.0})
      >>> first_nonfinite(RecordBatch([(r,)])), first_nonfinite(RecordBatch([(r,)]),
      ...                                                         with_index=True)
      ((4, 'g', 'cotangent'), (4, 'g', 'cotangent', 2))
    """
    for part in batch.parts:
        if isinstance(part, SiteColumns):
            cols = _NONFINITE.get(part.summary)
            if cols is None or not part.any_nonfinite:
                continue
            bad = nonfinite_rows(part.stats, part.stat_keys)
            if bad.any():
                p, leaf = np.argwhere(bad)[0]
                found: tuple[Any, ...] = (part.step, part.names[leaf], part.mode)
                return (*found, part.index[p]) if with_index else found
            continue
        for r in part:
            if is_nonfinite(r):
                return (r.step, r.name, r.mode, r.index) if with_index else (
                    r.step, r.name, r.mode)
    return None


# -- save_intermediates results: summarised on the host (sowtel.export, the dumps) ------------


def _process_index() -> int:
    try:
        import jax

        return int(jax.process_index())
    except Exception:  # no backend: records made on a plain host are process 0
        return 0


def _host_value(x: Any, site: str, mode: str, leaf: tuple[Any, ...]) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True) is False:
        raise ValueError(
            f"intermediates[{site!r}][{mode!r}]{''.join(f'[{p!r}]' for p in leaf)} is a "
            f"jax.Array of global shape {tuple(x.shape)} spanning the devices of several "
            "processes, which no host holds whole: stream it (sowtel.jit, or enable() with "
            "jax.jit), or sowtel.dump it in every process and sowtel.load the parts in one")
    return np.asarray(x)


def records_from_intermediates(
    intermediates: Mapping[str, Mapping[str, Any]],
    *,
    step: int,
    summary: str = "stats",
    tag: str = "intermediates",
) -> list[Record]:
    """Turns a ``save_intermediates`` result into the records streaming would produce.

    One record per array leaf, in the order the program computed them (see
    :func:`~sowtel.intermediates.program_order`: the forward pass in site order, then
    cotangents in reverse site order), numbered by ``seq`` in that order; a pytree sown at one
    site gives records named ``name/<leaf path>`` (``"pair/0"``, ``"params/w"``). Summaries
    are computed on the host with :func:`sowtel.summaries.host_summary`, the same definitions
    the device uses. A value stacked by ``scan`` or ``shard_map`` (see
    :attr:`sowtel.Intermediates.stacked`) gives one record per iteration and shard, in index
    order, with the ``index`` streaming gives them; a value whose leading axes do not match
    its stacking (under a ``vmap`` of ``save_intermediates``) gives one record for the whole
    stack (``index=None``).
    :func:`sowtel.export` calls this and hands the records to the active exporters.

    Example:
      >>> import numpy as np
      >>> recs = records_from_intermediates(
      ...     {"pair": {"primal": (np.array([1.0, 3.0]), np.array(2))}}, step=5)
      >>> [(r.name, r.step, r.stats["mean"]) for r in recs]
      [('pair/0', 5, 2.0), ('pair/1', 5, 2.0)]
    """
    check_intermediates(intermediates, "intermediates")
    for name in intermediates:
        naming.check_name(name)  # the rule of sow names: records are named by it
    step = check_step(step)
    check_summary(summary)
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag={tag!r} must be a non-empty string")
    wall_time = time.time()
    process_index = _process_index()
    values = [
        (program_order(i, mode, j), site, mode, value, stacking(modes).get(mode, ()))
        for i, (site, modes) in enumerate(intermediates.items())
        for j, (mode, value) in enumerate(modes.items())
    ]
    values.sort(key=lambda v: v[0])
    records: list[Record] = []
    for _, site, mode, value, axes in values:
        leaves = [(leaf, _host_value(x, site, mode, leaf)) for leaf, x in site_leaves(value)]
        stacks = [stack_indices(axes, arr.shape) for _, arr in leaves]
        # One record per leaf and element of the stack, a stack's leaves together (as streaming
        # sends them); leaves that are not stacked as their site says come whole, after them.
        positions = next((s for s in stacks if s is not None), [])
        parts: list[tuple[tuple[Any, ...], np.ndarray, int | tuple[int, ...] | None]] = [
            (leaf, np.asarray(arr[pos]), index)
            for pos, index in positions
            for (leaf, arr), stack in zip(leaves, stacks, strict=True) if stack is not None
        ]
        parts += [(leaf, arr, None)
                  for (leaf, arr), stack in zip(leaves, stacks, strict=True) if stack is None]
        for leaf, arr, index in parts:
            s = host_summary(arr, summary)
            records.append(Record(
                name=naming.leaf_name(site, leaf), mode=mode, tag=tag, step=step, index=index,
                wall_time=wall_time, summary=summary, shape=tuple(arr.shape),
                dtype=arr.dtype.name, value=arr if summary == "full" else None,
                stats=s["stats"], histogram=s["histogram"], process_index=process_index,
                seq=len(records),
            ))
    return records
