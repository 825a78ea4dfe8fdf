"""TensorBoard exporter: sow sites as live scalar curves, histograms and a custom-scalars layout.

Each record becomes, in the run's event file:

- scalars ``{name}/{mode}/{stat}`` for the statistics chosen with ``stats=`` (``"stats"``,
  ``"histogram"``, ``"health"`` and ``"full"`` summaries; ``"full"`` values are summarised on the
  host with :func:`sowtel.summaries.host_summary`). By default, per mode
  (:data:`DEFAULT_STATS_BY_MODE`): ``mean``, ``std`` and ``max_abs`` (max |x|) of a value,
  ``l2``, ``std`` and ``max_abs`` of a tangent or cotangent, only the value of a site that is
  one number; and the counts ``nan``, ``posinf``, ``neginf`` of a series from the first step
  one of them is non-zero (a ``"health"`` record writes its counts always). ``stats="all"``
  writes every statistic a record carries;
- derivative records of scalar sites are skipped unless ``scalar_derivatives=True``;
- host-side scalars from :func:`sowtel.log` as plain tags ``{name}``;
- a histogram ``{name}/{mode}``: for ``"histogram"`` records the bucket counts computed on the
  device are written as they are (TensorBoard's raw histogram format, no re-bucketing on the
  host); ``"full"`` values are bucketed on the host with the same rule as the device;
- a custom-scalars layout (the "Custom Scalars" tab, ``_tensorboard_layout``): the logged
  scalars first, then one category per site in program order, with one chart per mode;
- the first record holding NaN or infinities, as a text summary ``sowtel/alerts/text_summary``
  (TensorBoard's text plugin appends ``/text_summary`` to :data:`ALERT_TAG`);
- the alerts of ``enable(alerts=...)`` rules (:mod:`sowtel.alerts`), one line each in a text
  summary at the alert's step, :data:`RULE_ALERT_TAG` (the Text tab; the ``sowtel`` plugin's
  health panel lists them);
- where each series ran in its step: a depth tensor's metadata, else :data:`ORDER_TAG`.

A site inside a scan is one tensor a step for the ``sowtel`` plugin (``depth="tensor"``), with
the l2 norm of the whole stacked value as a scalar and, from its first non-zero one on, its
counts over all positions (``blocks/h/primal/nan``), or a series per iteration,
``{name}[3]/{mode}/{stat}`` (``depth="scalars"``); site names may not contain brackets, so
these tags never collide with another site's.

Site names are only ever tags inside an event file, never file or folder names: whatever a name
holds, everything is written inside ``logdir``. With several JAX processes each process writes
its own run, ``logdir/process_<i>``; a single process writes into ``logdir`` itself.

Events are handed to the operating system at the end of every ``write()`` call, so a running
TensorBoard sees them at once, and synced to the disk at least every ``flush_secs`` seconds
while records arrive (and on ``flush()`` and ``close()``).

Example:
    >>> import tempfile, numpy as np
    >>> from sowtel.records import Record
    >>> exporter = TensorBoardExporter(logdir=tempfile.mkdtemp())
    >>> exporter.write([Record(name="h", mode="primal", tag="intermediates", step=0,
    ...                        index=None, wall_time=0.0, summary="full", shape=(3,),
    ...                        dtype="float32", value=np.array([1.0, 2.0, 3.0]))])
    >>> exporter.close()
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboardX.proto.tensor_pb2 import TensorProto
from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboardX.proto.types_pb2 import DT_FLOAT, DT_STRING
from tensorboardX.summary import histogram_raw, text

from sowtel import errors
from sowtel.exporters import check_logdir
from sowtel.exporters._tensorboard_events import EventFile, event_bytes, value_head

# The counter behind event-file names, under the name a caller predicting the next name reads.
from sowtel.exporters._tensorboard_events import file_counter as _file_counter  # noqa: F401
from sowtel.exporters._tensorboard_layout import (
    DEFAULT_STATS_BY_MODE,
    LAYOUT_TAG,
    LOG_CATEGORY,
    default_stats,
)
from sowtel.exporters._tensorboard_layout import Site as _Site
from sowtel.exporters._tensorboard_layout import layout_summary as _layout_summary
from sowtel.exporters._tensorboard_order import ORDER_TAG, SeriesOrders
from sowtel.records import (
    COUNT_STATS,
    DEFAULT_STATS,
    SCALAR_SUMMARY,
    STAT_KEYS,
    Record,
    StatChoice,
    nonfinite_count,
    nonfinite_text,
    series_tag,
    with_derived,
)
from sowtel.summaries import host_summary
from sowtel.tensorboard_plugin import (
    DEPTH_SUFFIX,
    NONFINITE_CONTENT,
    NONFINITE_TAG,
    PLUGIN_NAME,
    depth_content,
)
from sowtel.to_records import RecordBatch, SiteColumns

__all__ = ["TensorBoardExporter", "series_tag", "ALERT_TAG", "RULE_ALERT_TAG", "LAYOUT_TAG",
           "DEFAULT_STATS",
           "DEFAULT_STATS_BY_MODE", "COUNT_STATS", "LOG_CATEGORY", "DEPTH_LAYOUTS", "ORDER_TAG"]

#: Tag of the text summary holding the first non-finite alert (TensorBoard's text plugin adds
#: ``/text_summary``).
ALERT_TAG = "sowtel/alerts"
#: Tag of the text summaries of the alert rules' alerts, one a step with every alert of it.
RULE_ALERT_TAG = "sowtel/alerts/rules"
#: Layouts of scan-stacked sites (``depth=``): a tensor for the plugin, scalars, or both.
DEPTH_LAYOUTS: tuple[str, ...] = ("tensor", "scalars", "both")

logger = logging.getLogger("sowtel")


class TensorBoardExporter:
    """Writes records as TensorBoard scalars, histograms, a custom-scalars layout and alerts.

    Args:
      logdir: the directory of the run (created if missing). Default: ``runs/<date-time>``.
        It is checked here, so ``sowtel.enable(exporter="tensorboard", logdir=...)`` fails at
        once on a path that is not a writable directory.
      flush_secs: the longest time, in seconds, events stay in the operating system's cache
        before they are synced to the disk while records arrive. Events are visible to a
        running TensorBoard as soon as ``write()`` returns.
      stats: the statistics written as scalars: ``"default"`` (:data:`DEFAULT_STATS_BY_MODE`,
        plus the counts :data:`COUNT_STATS` of a series from its first non-zero one), ``"all"``
        (every statistic a record carries), or a list of names from
        :data:`sowtel.records.STAT_KEYS` and ``"max_abs"`` (written at every step).
      scalar_derivatives: also write tangent and cotangent records of sites whose value is a
        scalar (shape ``()``); off by default, as the cotangent of a loss is always 1.0.
      depth: how a site with an ``index`` (inside a scan) is written. ``"tensor"`` (default):
        its statistics at every position as one tensor a step (tag ``{name}/{mode}/depth``,
        read by the ``sowtel`` plugin's depth view), plus one headline scalar per mode, the l2
        norm over all positions (``{name}/{mode}/l2``), and a record's histogram, if it has one,
        per position (``{name}[3]/{mode}``); ``"scalars"``: a scalar tag per position and
        statistic (``{name}[3]/{mode}/{stat}``) and a histogram per position; ``"both"``.

    Attributes:
      logdir: the absolute run directory (the parent of the per-process runs, if several).
      errors: how many ``write()``/``flush()`` calls failed (each one raised an ``OSError``).
      last_error: the message of the latest failure, or ``None``.

    Example:
        >>> import sowtel                                   # doctest: +SKIP
        >>> with sowtel.enable(exporter="tensorboard", logdir="runs/exp1"):  # doctest: +SKIP
        ...     train()
        >>> # then: sowtel dashboard --logdir runs
    """

    label = "tensorboard"

    def __init__(self, logdir: str | os.PathLike[str] | None = None, *,
                 flush_secs: float = 2.0, stats: str | Sequence[str] = "default",
                 scalar_derivatives: bool = False, depth: str = "tensor") -> None:
        if logdir is None:
            logdir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        if not isinstance(logdir, (str, os.PathLike)):
            raise errors.BadOptionTypeError(
                "logdir", logdir, "is not a path: pass a directory as a str or pathlib.Path")
        if not os.fspath(logdir):
            # os.path.abspath("") is the current directory: an empty string is a mistake, not a
            # request to scatter event files there ("." says that explicitly).
            raise errors.BadOptionError(
                "logdir", logdir, "is empty: pass a directory such as 'runs/exp1', or leave "
                "logdir out for runs/<date-time>")
        if (isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float))
                or not math.isfinite(flush_secs) or flush_secs <= 0):
            raise errors.BadOptionError(
                "flush_secs", flush_secs, "must be a positive number of seconds, such as 2.0")
        if not isinstance(scalar_derivatives, bool):
            raise errors.BadOptionTypeError("scalar_derivatives", scalar_derivatives,
                                            "must be True or False")
        if depth not in DEPTH_LAYOUTS:
            raise errors.BadOptionError(
                "depth", depth, "is not a layout of scan-stacked sites: use 'tensor' (one "
                "vector a step for the sowtel plugin, plus one headline scalar), 'scalars' (a "
                "scalar tag per position and statistic) or 'both'")
        self.depth = depth
        self.flush_secs = float(flush_secs)
        self._choice = StatChoice(stats, by_mode=default_stats)
        self.stats = self._choice.stats
        self.scalar_derivatives = scalar_derivatives
        self.logdir = os.path.abspath(check_logdir(logdir))
        self.errors = 0
        self.last_error: str | None = None
        self._process_index, process_count = _jax_process()
        self._per_process_runs = process_count > 1
        self._files: dict[int, EventFile] = {}
        self._prefixes: dict[tuple[str, str, Any], str] = {}
        self._layouts: dict[int, dict[str, _Site]] = {}
        # Per (name, mode, index, statistics, summary): its tags and their columns, for tables.
        self._tags: dict[tuple[Any, ...], tuple[list[bytes], list[int]]] = {}
        self._layout_due: set[int] = set()
        self._alerted: set[int] = set()
        self._depth_tags: set[str] = set()
        # The last step written of each depth tensor and its positions, to complete it.
        self._last_depth: dict[tuple[int, str, str],
                               tuple[int, list[tuple[Any, tuple[str, ...], np.ndarray]]]] = {}
        self._last_nonfinite: dict[int, tuple[int, list[list[Any]]]] = {}
        self._alert_lines: tuple[int, list[str]] | None = None  # the last step's alerts
        # Scanned sites (process, name, mode) whose depth tensors' counts are written as
        # scalars: from their first non-zero count on.
        self._depth_counting: set[tuple[int, str, str]] = set()
        self._depth_counted: dict[tuple[int, str, str], tuple[int, list[float]]] = {}
        self._orders = SeriesOrders(_tensor_metadata)  # where series of scalars ran
        self._last_sync = time.monotonic()
        self._closed = False
        #: How often a deleted run folder was found and created again.
        self.recreated = 0
        self._warned_deleted = False
        _check_logdir(self.logdir)
        self._file(self._process_index)

    def run_dir(self, process_index: int = 0) -> str:
        """The directory holding the event files of one JAX process's records."""
        if self._per_process_runs:
            return os.path.join(self.logdir, f"process_{int(process_index)}")
        return self.logdir

    def _file(self, process_index: int) -> EventFile:
        f = self._files.get(process_index)
        if f is None:
            run_dir = self.run_dir(process_index)
            if run_dir != self.logdir and os.path.islink(run_dir):
                raise errors.UnwritableLogdirError(
                    repr(run_dir), "is a symbolic link, and the tensorboard exporter never "
                    "follows links out of its logdir: remove the link, or choose another logdir")
            try:
                os.makedirs(run_dir, exist_ok=True)
                f = EventFile(run_dir)
            except FileExistsError as e:
                raise errors.UnwritableLogdirError(
                    f"logdir={run_dir!r}:", f"a file named "
                    f"{os.path.basename(e.filename or '')!r} is already there, under the name of "
                    "the event file this exporter was about to create, and it never writes into "
                    "a file it did not create (it may be a link planted to redirect it): remove "
                    "that file, or choose another logdir") from e
            except OSError as e:
                raise errors.UnwritableLogdirError(
                    f"logdir {run_dir!r}", f"is not writable ({e.strerror or e}): pass a "
                    "directory this process can create files in") from e
            self._files[process_index] = f
        return f

    def write(self, records: Sequence[Record]) -> None:
        """Writes a batch of records; raises ``OSError`` (and counts it) if the file write fails.

        A record that cannot be converted (a malformed value) is skipped, and the batch's other
        records are still written; the failure is then raised as ``ValueError`` after them.
        """
        if self._closed:
            raise errors.ExporterClosedError("TensorBoardExporter")
        bad: list[str] = []
        # Sorting by step keeps each tag's steps increasing in the file, which TensorBoard's
        # loader needs: it drops a tag's points after a step that goes backwards.
        ordered = sorted(records, key=lambda r: (r.process_index, r.step, r.seq))
        layout_due = self._layout_due
        for process_index, group in itertools.groupby(ordered, key=lambda r: r.process_index):
            f = self._file(process_index)
            layout = self._layouts.setdefault(process_index, {})
            for step, same_step in itertools.groupby(group, key=lambda r: r.step):
                state = _StepState()
                for r in same_step:
                    self._add_record(r, state, layout, layout_due, bad)
                values = self._step_values(process_index, int(step), state, layout,
                                           layout_due, bad)
                if values:
                    f.add(Event(wall_time=state.wall_time or time.time(), step=int(step),
                                summary=Summary(value=values)))
        self._finish(bad)

    def _add_record(self, r: Record, state: _StepState, layout: dict[str, _Site],
                    layout_due: set[int], bad: list[str]) -> None:
        """One record of a step: its scalars and histogram now, or its row of a depth tensor
        (written by :meth:`_step_values` once the step's batch is read)."""
        state.wall_time = max(state.wall_time, r.wall_time)
        try:
            if self._stacked(r):
                keys = tuple(k for k in STAT_KEYS if k != "size" and k in r.stats)
                state.depth_row(r.name, r.mode, r.order, r.scans).add_block(
                    [_index_tuple(r.index)], keys,
                    np.array([[r.stats[k] for k in keys]], dtype=np.float64), lambda: [r])
                count = int(_nonfinite(r.stats))
                if self.depth == "tensor":
                    self._alert(r, r.stats, state.values)
                    if r.histogram is not None:  # a position's histogram has no depth row
                        self._position_histogram(r, state.values)
                else:
                    self._record_values(r, state.values, layout, layout_due)
            else:
                count = self._record_values(r, state.values, layout, layout_due)
            if count:
                index = list(_index_tuple(r.index)) if r.index is not None else None
                state.nonfinite.append([r.name, r.mode, index, count])
        except Exception as e:  # one bad record must not lose the batch's others
            bad.append(f"{r.name!r} ({r.mode}, step {r.step}): {e}")

    def _add_table(self, table: SiteColumns, state: _StepState) -> None:
        """A finite table of a site inside a scan: its leaves' rows of depth tensors, as one
        block of rows a leaf (no per-position work)."""
        state.wall_time = max(state.wall_time, table.wall_time)
        keys = tuple(table.stat_keys)
        kept = [i for i, k in enumerate(keys) if k != "size"]
        kept_keys = tuple(keys[i] for i in kept)
        positions = np.asarray(table.index, dtype=np.int64)
        if positions.ndim == 1:
            positions = positions[:, None]
        for leaf, name in enumerate(table.names):
            rows = table.stats[:, leaf][:, kept]
            state.depth_row(name, table.mode, table.order, table.scans).add_block(
                positions, kept_keys, rows, functools.partial(_table_records, table, name))

    def _step_values(self, process_index: int, step: int, state: _StepState,
                     layout: dict[str, _Site], layout_due: set[int],
                     bad: list[str]) -> list[Summary.Value]:
        """What closes a step's event: the non-finite list and the depth tensors."""
        values = state.values
        if state.nonfinite:
            values.append(self._nonfinite_value(process_index, step, state.nonfinite))
        self._orders.add_to(values, process_index)
        for (name, mode), rows in state.depth.items():
            try:
                self._depth_values(process_index, name, mode, step, rows, values, layout,
                                   layout_due)
            except Exception as e:
                bad.append(f"{name!r} ({mode}, step {step}): {e}")
        return values

    def _finish(self, bad: list[str]) -> None:
        """After a batch: the layout where it changed, then the file out."""
        for process_index in sorted(self._layout_due):
            # Step 0 for every version: TensorBoard keeps the last one written.
            self._files[process_index].add(
                Event(wall_time=time.time(), step=0,
                      summary=_layout_summary(self._layouts[process_index]))
            )
        self._write_out(sync=time.monotonic() - self._last_sync >= self.flush_secs)
        if bad:
            raise ValueError(
                f"TensorBoardExporter skipped {len(bad)} record(s) it could not convert, first "
                f"{bad[0]}: records need finite-or-NaN float stats and numeric values"
            )

    def write_batch(self, batch: RecordBatch) -> None:
        """Writes a batch; tables of ``stats``/``health`` summaries without a NaN or infinity go
        from their columns straight to protobuf bytes (one encoded prefix a tag, cached), or,
        for a site inside a scan, into its depth tensor; the other records (full values,
        histograms, ``sowtel.log`` scalars, non-finite rows) as :meth:`write` converts them; one
        event per process and step either way."""
        if self._closed:
            raise errors.ExporterClosedError("TensorBoardExporter")
        units: list[tuple[int, int, int, SiteColumns | Record]] = []
        for part in batch.parts:
            if (isinstance(part, SiteColumns) and part.summary in ("stats", "health")
                    and not part.any_nonfinite):
                units.append((part.process_index, part.step, part.seqs[0], part))
            else:
                units.extend((r.process_index, r.step, r.seq, r)
                             for r in (part.records() if isinstance(part, SiteColumns) else part))
        # Steps increase per tag in the file, as TensorBoard's loader needs (see write()).
        units.sort(key=lambda u: u[:3])
        bad: list[str] = []
        layout_due = self._layout_due
        for (process_index, step), same in itertools.groupby(units, key=lambda u: u[:2]):
            f = self._file(process_index)
            layout = self._layouts.setdefault(process_index, {})
            state = _StepState()
            encoded: list[bytes] = []
            for *_, unit in same:
                if isinstance(unit, SiteColumns):
                    stacked = unit.index[0] is not None and self.depth != "scalars"
                    if stacked:
                        self._add_table(unit, state)
                    if not stacked or self.depth == "both":
                        self._table_values(unit, encoded, layout, layout_due)
                    state.wall_time = max(state.wall_time, unit.wall_time)
                else:
                    self._add_record(unit, state, layout, layout_due, bad)
            values = self._step_values(process_index, int(step), state, layout, layout_due, bad)
            if values or encoded:
                # Repeated fields concatenate: the converted values, then the encoded ones.
                summary = Summary(value=values).SerializeToString() + b"".join(encoded)
                f.add_bytes(event_bytes(state.wall_time or time.time(), int(step), summary))
        self._finish(bad)

    def _table_values(self, table: SiteColumns, encoded: list[bytes],
                      layout: dict[str, _Site], layout_due: set[int]) -> None:
        keys = table.stat_keys
        with np.errstate(over="ignore"):  # beyond float32: infinity, as protobuf stores it
            as_f32 = table.stats.astype(np.float32)
        if "min" in keys and "max" in keys:  # max_abs, derived as with_derived derives it
            lo, hi = (as_f32[..., keys.index(k)] for k in ("min", "max"))
            as_f32 = np.concatenate([as_f32, np.fmax(abs(lo), abs(hi))[..., None]], axis=-1)
            keys = (*keys, "max_abs")
        for leaf, name in enumerate(table.names):
            if table.shapes[leaf] == () and table.mode != "primal" and not self.scalar_derivatives:
                continue
            written: list[str] | None = None
            for index, row in zip(table.index, as_f32[:, leaf], strict=True):
                cache = (name, table.mode, index, keys, table.summary)
                known = self._tags.get(cache)
                if known is None:
                    key = (name, table.mode, index)
                    prefix = self._prefixes.get(key)
                    if prefix is None:
                        prefix = self._prefixes[key] = series_tag(name, table.mode, index)
                    chosen = self._chosen(key, table.summary, dict.fromkeys(keys, 0.0), False,
                                          single=math.prod(table.shapes[leaf]) == 1)
                    known = self._tags[cache] = (
                        [value_head(f"{prefix}/{stat}") for stat in chosen],
                        [keys.index(stat) for stat in chosen])
                heads, cols = known
                data = row.tobytes()
                encoded.extend(head + data[4 * c:4 * c + 4]
                               for head, c in zip(heads, cols, strict=True))
                if written is None:
                    written = [keys[c] for c in cols]
            self._orders.note(written, table.process_index, name, table.mode, table.order,
                              table.scans)
            site = layout.setdefault(name, _Site())
            chosen_stats = written or []
            counts_chart = (any(k in COUNT_STATS for k in chosen_stats)
                            and table.summary == "health")
            if site.learn(table.mode, frozenset(chosen_stats), table.index[0] is not None,
                          counts_chart, order=table.order,
                          single=math.prod(table.shapes[leaf]) == 1):
                layout_due.add(table.process_index)

    def _record_values(self, r: Record, values: list[Summary.Value], layout: dict[str, _Site],
                       layout_due: set[int], every_stat: bool = False) -> int:
        """Adds ``r``'s values (``every_stat``: all but ``size``); returns its non-finite count."""
        if r.summary == "scalar":  # sowtel.log
            values.append(Summary.Value(tag=str(r.name), simple_value=float(r.stats["value"])))
            site = layout.setdefault(r.name, _Site())
            if not site.logged:
                site.logged = True
                layout_due.add(r.process_index)
            return 0
        key = (r.name, r.mode, r.index)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = series_tag(str(r.name), str(r.mode), r.index)
        stats: dict[str, float] = r.stats
        hist = r.histogram
        if r.value is not None:
            summary = host_summary(r.value, "histogram")
            stats, hist = summary["stats"], summary["histogram"]
        stats = with_derived(stats)
        nonfinite = self._alert(r, stats, values)
        count = int(_nonfinite(stats))
        if r.shape == () and r.mode != "primal" and not self.scalar_derivatives:
            return count
        written = [k for k in stats if k != "size"] if every_stat else self._chosen(
            key, r.summary, stats, nonfinite, single=math.prod(r.shape) == 1)
        for stat in written:
            values.append(Summary.Value(tag=f"{prefix}/{stat}", simple_value=float(stats[stat])))
        self._orders.note(written, r.process_index, r.name, r.mode, r.order, r.scans)
        if hist is not None:
            h = _histogram_value(prefix, stats, hist)
            if h is not None:
                values.append(h)
        site = layout.setdefault(r.name, _Site())
        # A chart of counts once one is non-zero, or for a health site, which has nothing else.
        counts_chart = any(k in COUNT_STATS for k in written) and (
            nonfinite or r.summary == "health")
        if site.learn(r.mode, frozenset(written), r.index is not None, counts_chart,
                      order=r.order, single=math.prod(r.shape) == 1):
            layout_due.add(r.process_index)
        return count

    def _position_histogram(self, r: Record, values: list[Summary.Value]) -> None:
        # Tagged as the per-position layout tags it: {name}[i]/{mode}.
        key = (r.name, r.mode, r.index)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = series_tag(str(r.name), str(r.mode), r.index)
        h = _histogram_value(prefix, r.stats, r.histogram)  # type: ignore[arg-type]
        if h is not None:
            values.append(h)

    def _alert(self, r: Record, stats: dict[str, float], values: list[Summary.Value]) -> bool:
        """Whether ``r`` holds a non-finite value; the run's first such record is an alert."""
        nonfinite = _nonfinite(stats) > 0
        if r.process_index not in self._alerted and nonfinite:
            self._alerted.add(r.process_index)
            values.append(text(ALERT_TAG, _alert_text(r, stats)).value[0])
        return nonfinite

    def _stacked(self, r: Record) -> bool:
        # Full values carry no statistics to stack; they keep their per-position layout.
        return (self.depth != "scalars" and r.index is not None and r.value is None
                and r.summary != SCALAR_SUMMARY and bool(r.stats))

    def _depth_values(self, process_index: int, name: str, mode: str, step: int,
                      rows: _DepthRows, values: list[Summary.Value], layout: dict[str, _Site],
                      layout_due: set[int]) -> None:
        """One tensor of every position's statistics, and the headline scalar, of one step.

        A step's records may come in several batches: the tensor is written again with every
        position seen so far (TensorBoard keeps the last one of a step). A record of a step
        older than the last one written for its site goes out as per-position scalars, since
        TensorBoard's loaders drop a tag's later steps when an earlier one follows them.
        """
        key = (process_index, name, mode)
        last = self._last_depth.get(key)
        if last is not None and step < last[0]:
            if self.depth == "tensor":  # with "both" they are written as scalars already
                for make in rows.late:
                    for r in make():
                        if r.name == name and r.mode == mode:
                            self._record_values(r, values, layout, layout_due, True)
            return
        blocks = (last[1] if last is not None and last[0] == step else []) + rows.blocks
        self._last_depth[key] = (step, blocks)
        table, stats, rank = _depth_table(blocks)
        tag = f"{series_tag(name, mode)}{DEPTH_SUFFIX}"
        values.append(Summary.Value(tag=tag, metadata=self._depth_metadata(tag, stats, rank,
                                                                             rows.order,
                                                                             rows.scans),
                                    tensor=_float_tensor(table)))
        written: set[str] = set()
        prefix = series_tag(name, mode)
        if "l2" in stats:
            # The l2 norm of the whole stacked value: of every position's finite elements;
            # NaN when no position has one (a NaN position has no finite element).
            l2 = table[rank + stats.index("l2")].astype(np.float64)
            some = ~np.isnan(l2)
            total = float(np.sqrt(np.sum(l2[some] ** 2))) if some.any() else float("nan")
            values.append(Summary.Value(tag=f"{prefix}/l2", simple_value=total))
            written.add("l2")
        counts = [k for k in COUNT_STATS if k in stats and self._choice.writes_count(k)]
        if counts:
            # The non-finite counts of the whole stacked value, a scalar series each, from the
            # site's first non-zero count on (always for a health site): the Scalars tab
            # shows a NaN in a scanned site as it does in any other.
            sums = [float(np.nansum(table[rank + stats.index(k)])) for k in counts]
            if any(sums) or "mean" not in stats:
                self._depth_counting.add(key)
            if key in self._depth_counting:
                written.update(counts)
                # A step cut over batches: its counts again only if they changed.
                if self._depth_counted.get(key) != (step, sums):
                    self._depth_counted[key] = (step, sums)
                    values.extend(Summary.Value(tag=f"{prefix}/{k}", simple_value=v)
                                  for k, v in zip(counts, sums, strict=True))
        site = layout.setdefault(name, _Site())
        if site.learn(mode, frozenset(written), False, bool(written & set(COUNT_STATS)),
                      order=rows.order):
            layout_due.add(process_index)

    def _nonfinite_value(self, process_index: int, step: int,
                         rows: list[list[Any]]) -> Summary.Value:
        # One small string tensor at the steps that had a NaN or infinity: the plugin's health
        # overview reads this tag alone instead of every site's counts. A step seen again
        # (another batch of it) is written again whole, as TensorBoard keeps a step's last.
        last = self._last_nonfinite.get(process_index)
        if last is not None and last[0] == step:
            rows = last[1] + rows
        self._last_nonfinite[process_index] = (step, rows)
        first = NONFINITE_TAG not in self._depth_tags
        self._depth_tags.add(NONFINITE_TAG)
        tensor = TensorProto(dtype=DT_STRING, tensor_shape=TensorShapeProto(),
                             string_val=[json.dumps(rows).encode()])
        return Summary.Value(tag=NONFINITE_TAG, tensor=tensor, metadata=_tensor_metadata(
            NONFINITE_CONTENT) if first else None)

    def _depth_metadata(self, tag: str, stats: list[str], rank: int, order: int,
                        scans: tuple[tuple[int, bool], ...] = ()) -> Any:
        # TensorBoard keeps a tag's first metadata: written once per tag and file. The order
        # lets the plugin list sites in program order.
        if tag in self._depth_tags:
            return None
        self._depth_tags.add(tag)
        return _tensor_metadata(depth_content(stats, rank, order, scans))

    def _chosen(self, key: tuple[str, str, Any], summary: str, stats: dict[str, float],
                nonfinite: bool, single: bool = False) -> list[str]:
        counting = len(self._choice.counting)
        chosen = self._choice.chosen(key, summary, stats, nonfinite, single=single)
        if len(self._choice.counting) != counting:
            self._tags.clear()  # cached tag lists of tables now lack this series' counts
        return chosen

    def _recreate_deleted(self) -> None:
        """Notices event files whose run folder was deleted, and writes on in a new one.

        Writing on into a deleted file would count events as exported that no TensorBoard can
        ever read. One ``fstat`` per file and batch notices it; a warning is logged once.
        """
        for process_index, f in self._files.items():
            if not f.deleted():
                continue
            if not self._warned_deleted:
                self._warned_deleted = True
                logger.warning("sowtel tensorboard: the event file %s was deleted while "
                               "training (its logdir removed?); re-creating the run folder, "
                               "events from now on go to a new event file there", f.path)
            self.recreated += 1
            f.recreate()
            if process_index in self._layouts:  # the layout went with the deleted file
                f.add(Event(wall_time=time.time(), step=0,
                            summary=_layout_summary(self._layouts[process_index])))

    def _write_out(self, sync: bool) -> None:
        failures = []
        self._layout_due = set()
        try:
            self._recreate_deleted()
        except OSError as e:
            failures.append(f"{self.logdir} (deleted, and not created again): {e.strerror or e}")
        for process_index, f in self._files.items():
            try:
                f.write_out(sync)
            except OSError as e:
                failures.append(f"{f.path}: {e.strerror or e}")
                # The layout may have been lost with the batch: write it again with the next.
                if process_index in self._layouts:
                    self._layout_due.add(process_index)
        if sync:
            self._last_sync = time.monotonic()
        if failures:
            self.errors += 1
            self.last_error = "; ".join(failures)
            raise OSError(
                f"TensorBoardExporter could not write {self.last_error}; the events of this "
                "batch are lost and later ones go to a new event file: free disk space or "
                "choose another logdir"
            )

    def write_alerts(self, alerts: Sequence[Any]) -> None:
        """Writes the alerts of :mod:`sowtel.alerts` rules as lines of a text summary at their
        step (:data:`RULE_ALERT_TAG`): TensorBoard's Text tab, and the ``sowtel`` plugin's
        health panel. A step's alerts are written again whole with each new one, as
        TensorBoard keeps a step's last; an alert of a step older than the last one written is
        written at that step (its own is in its line), since TensorBoard's loaders drop a tag's
        later steps when an earlier one follows them.

        Example:
            >>> import tempfile
            >>> from tensorboard.backend.event_processing import event_accumulator as ea
            >>> from sowtel.alerts import Alert, alert
            >>> logdir = tempfile.mkdtemp()
            >>> exporter = TensorBoardExporter(logdir)
            >>> found = Alert(3, "loss", "primal", None, "value", 2.0, "above",
            ...               alert("loss", above=1.0))
            >>> exporter.write_alerts([found])
            >>> exporter.close()
            >>> acc = ea.EventAccumulator(logdir, size_guidance={ea.TENSORS: 0}); _ = acc.Reload()
            >>> [t.step for t in acc.Tensors(RULE_ALERT_TAG + "/text_summary")]
            [3]
        """
        if self._closed or not alerts:
            return
        for found in sorted(alerts, key=lambda a: a.step):
            step = int(found.step)
            last = self._alert_lines
            if last is not None and step <= last[0]:
                step, lines = last[0], last[1]
            else:
                lines = []
            lines.append(f"- {found}")
            self._alert_lines = (step, lines)
            self._file(self._process_index).add(Event(
                wall_time=time.time(), step=step,
                summary=Summary(value=[text(RULE_ALERT_TAG, "\n".join(lines)).value[0]])))
        self._write_out(sync=False)

    def flush(self) -> None:
        """Puts every event written so far on the disk (raises ``OSError`` if that fails)."""
        if not self._closed:
            self._write_out(sync=True)

    def close(self) -> None:
        """Flushes and closes the event files; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        failures = []
        try:
            self._recreate_deleted()
        except OSError as e:
            failures.append(f"{self.logdir} (deleted, and not created again): {e.strerror or e}")
        for f in self._files.values():
            try:
                f.close()
            except OSError as e:
                failures.append(f"{f.path}: {e.strerror or e}")
        if failures:
            self.errors += 1
            self.last_error = "; ".join(failures)
            raise OSError(f"TensorBoardExporter could not write {self.last_error} when closing")


class _DepthRows:
    """One site and mode's rows of a depth tensor in one step, as they arrive: blocks of
    ``(positions, statistics' names, rows)``, a table's leaf or a single record each."""

    __slots__ = ("order", "scans", "blocks", "late")

    def __init__(self, order: int, scans: tuple[tuple[int, bool], ...] = ()) -> None:
        self.order = order
        self.scans = scans
        self.blocks: list[tuple[Any, tuple[str, ...], np.ndarray]] = []
        # How to get the records back, should the step come after a later one of the site.
        self.late: list[Callable[[], Sequence[Record]]] = []

    def add_block(self, positions: Any, keys: tuple[str, ...], rows: np.ndarray,
                  records: Callable[[], Sequence[Record]]) -> None:
        """``positions``: one index tuple (or array row) per row of ``rows``."""
        self.blocks.append((positions, keys, rows))
        self.late.append(records)


def _depth_table(blocks: list[tuple[Any, tuple[str, ...], np.ndarray]]
                 ) -> tuple[np.ndarray, list[str], int]:
    """The depth tensor of a step's blocks: rows ``(rank + statistics) x positions``, float32,
    positions in increasing order; a position seen again keeps its latest row. Returns the
    tensor, the statistics' names and the rank of the positions."""
    if len(blocks) == 1 and isinstance(blocks[0][0], np.ndarray):
        # One table (the usual case): its positions are distinct; sorted with numpy.
        positions, keys, rows = blocks[0]
        rank = positions.shape[1]
        order = np.lexsort(positions.T[::-1])
        table = np.empty((rank + len(keys), len(positions)), dtype=np.float32)
        table[:rank] = positions[order].T
        table[rank:] = rows[order].T
        return table, list(keys), rank
    columns: dict[tuple[int, ...], tuple[tuple[str, ...], np.ndarray]] = {}
    for positions, keys, rows in blocks:
        listed = positions.tolist() if isinstance(positions, np.ndarray) else positions
        for position, row in zip(listed, rows, strict=True):
            columns[tuple(position)] = (keys, row)
    ordered = sorted(columns)
    stats = list(columns[ordered[0]][0])
    rank = len(ordered[0])
    table = np.empty((rank + len(stats), len(ordered)), dtype=np.float32)
    for j, position in enumerate(ordered):
        keys, row = columns[position]
        if len(position) != rank:
            raise ValueError(f"index {position!r} has not the rank {rank} of the site's others")
        table[:rank, j] = position
        table[rank:, j] = row if list(keys) == stats else [
            dict(zip(keys, row, strict=True)).get(k, math.nan) for k in stats]
    return table, stats, rank


class _StepState:
    """What one step of one process collects before its event is written."""

    __slots__ = ("values", "depth", "nonfinite", "wall_time")

    def __init__(self) -> None:
        self.values: list[Summary.Value] = []
        self.depth: dict[tuple[str, str], _DepthRows] = {}
        self.nonfinite: list[list[Any]] = []  # [name, mode, index, count]
        self.wall_time = 0.0

    def depth_row(self, name: str, mode: str, order: int,
                  scans: tuple[tuple[int, bool], ...] = ()) -> _DepthRows:
        rows = self.depth.get((name, mode))
        if rows is None:
            rows = self.depth[(name, mode)] = _DepthRows(order, scans)
        return rows


def _table_records(table: SiteColumns, name: str) -> list[Record]:
    return [r for r in table.records() if r.name == name]


def _index_tuple(index: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if index is None:
        return ()
    return tuple(int(i) for i in index) if isinstance(index, tuple) else (int(index),)


def _float_tensor(table: np.ndarray) -> TensorProto:
    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=n) for n in table.shape])
    return TensorProto(dtype=DT_FLOAT, tensor_shape=shape,
                       tensor_content=np.ascontiguousarray(table, dtype="<f4").tobytes())


def _tensor_metadata(content: bytes) -> SummaryMetadata:
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name=PLUGIN_NAME, content=content))
    # TensorBoard serves a plugin's tensors only with data_class DATA_CLASS_TENSOR (field 4,
    # value 2), which tensorboardX's older copy of the message lacks: appended as raw bytes,
    # protobuf keeps it as an unknown field and writes it back out.
    return SummaryMetadata.FromString(meta.SerializeToString() + b"\x20\x02")


def _jax_process() -> tuple[int, int]:
    import jax

    return int(jax.process_index()), int(jax.process_count())


def _check_logdir(logdir: str) -> None:
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise errors.UnwritableLogdirError(
            f"logdir {logdir!r}", "exists and is not a directory: pass a directory path (it is "
            "created if missing)")
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as e:
        raise errors.UnwritableLogdirError(
            f"logdir {logdir!r}", f"cannot be created ({e.strerror or e}): pass a directory "
            "path under a writable folder") from e


def _nonfinite(stats: dict[str, float]) -> float:
    return float(nonfinite_count(stats))


def _histogram_value(prefix: str, stats: dict[str, float],
                     hist: tuple[np.ndarray, np.ndarray]) -> Summary.Value | None:
    edges, counts = (np.asarray(a, dtype=np.float64) for a in hist)
    if len(edges) != len(counts) + 1:
        raise ValueError(f"histogram has {len(edges)} edges for {len(counts)} buckets")
    num = float(counts.sum())
    if num == 0:
        return None  # no finite element: TensorBoard has nothing to draw
    # TensorBoard wants sum and sum of squares; the device sends mean and l2 of the finite part.
    mean = float(stats.get("mean", math.nan))
    l2 = float(stats.get("l2", math.nan))
    summary: Summary = histogram_raw(
        prefix,
        min=float(stats.get("min", edges[0])),
        max=float(stats.get("max", edges[-1])),
        num=num,
        sum=mean * num,
        sum_squares=l2 * l2,
        bucket_limits=edges[1:].tolist(),
        bucket_counts=counts.tolist(),
    )
    return summary.value[0]


def _alert_text(r: Record, stats: dict[str, float]) -> str:
    where = f"`{r.name}` ({r.mode}" + (f", index {r.index}" if r.index is not None else "") + ")"
    counts = nonfinite_text(stats)
    size = stats.get("size")
    of = f" of {int(size)} elements" if size is not None else ""
    return f"First non-finite value: step {r.step}, site {where}: {counts}{of}."
