"""TensorBoard exporter: sow sites as live scalar curves, histograms and a custom-scalars layout.

Each record becomes, in the run's event file:

- scalars ``{name}/{mode}/{stat}`` for the statistics chosen with ``stats=`` (``"stats"``,
  ``"histogram"``, ``"health"`` and ``"full"`` summaries; ``"full"`` values are summarised on the
  host with :func:`sowtel.summaries.host_summary`). By default ``mean``, ``std``, ``min``,
  ``max`` and ``l2``, and the counts ``nan``, ``posinf``, ``neginf`` of a series from the first
  step one of them is non-zero (a ``"health"`` record writes its counts always);
  ``stats="all"`` writes every statistic a record carries;
- derivative records (tangent, cotangent) of scalar sites are skipped unless
  ``scalar_derivatives=True``: the cotangent of a scalar loss is 1.0 at every step;
- host-side scalars from :func:`sowtel.log` as plain tags ``{name}``;
- a histogram ``{name}/{mode}``: for ``"histogram"`` records the bucket counts computed on the
  device are written as they are (TensorBoard's raw histogram format, no re-bucketing on the
  host); ``"full"`` values are bucketed on the host with the same rule as the device;
- a custom-scalars layout (the "Custom Scalars" tab): the logged scalars first, then one
  category per site (sorted by name) with one chart per mode: the primal value's mean with a
  band from min to max, a derivative's l2 norm (its magnitude, which spans decades, so one
  series per chart keeps its axis readable), and, once a NaN or infinity appeared, the counts.
  TensorBoard colours custom-scalars lines by run, so a chart holds one statistic (scan
  iterations of a site are its several lines);
- the first record holding NaN or infinities, as a text summary ``sowtel/alerts/text_summary``
  (TensorBoard's text plugin appends ``/text_summary`` to :data:`ALERT_TAG`).

A record with an ``index`` (scan iteration, shard, or a tuple of them for nested scans) gets its
own series: the index is written in brackets after the site name, ``{name}[3]/{mode}/{stat}`` or
``{name}[1,0]/{mode}/{stat}``, so each iteration is a curve of its own over training steps.
Site names may not contain brackets, so these tags never collide with another site's.

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
import itertools
import math
import os
import re
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c
from tensorboardX.summary import custom_scalars, histogram_raw, text

from sowtel.records import (
    COUNT_STATS,
    DEFAULT_STATS,
    STAT_KEYS,
    Record,
    StatChoice,
    series_tag,
)
from sowtel.summaries import host_summary

__all__ = ["TensorBoardExporter", "series_tag", "ALERT_TAG", "LAYOUT_TAG", "DEFAULT_STATS",
           "COUNT_STATS", "LOG_CATEGORY"]

#: Tag of the text summary holding the first non-finite alert (TensorBoard's text plugin adds
#: ``/text_summary``).
ALERT_TAG = "sowtel/alerts"
#: Tag under which TensorBoard's custom-scalars plugin looks for its layout.
LAYOUT_TAG = "custom_scalars__config__"
#: Category of the custom-scalars layout holding the scalars of :func:`sowtel.log`.
LOG_CATEGORY = "logged scalars"

# Charts of the layout, in this order; any other statistic a record carries follows them.
_CHART_ORDER = {k: i for i, k in enumerate(STAT_KEYS)}
# Unique event-file names even for several exporters in one process within the same second.
_file_counter = itertools.count()


def _frame(event: Event) -> bytes:
    # TFRecord framing: length, its masked CRC-32C, the data, its masked CRC-32C.
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    return b"".join((header, struct.pack("<I", masked_crc32c(header)), data,
                     struct.pack("<I", masked_crc32c(data))))


def _chart_regex(name: str, mode: str | None, stat: str) -> str:
    # One statistic of one site and mode (any mode for None), every scan iteration.
    modes = "[^/]+" if mode is None else re.escape(mode)
    return "^" + re.escape(name) + r"(\[[0-9,]+\])?/" + modes + "/" + stat + "$"


class _Site:
    """What the custom-scalars layout needs to know of one site."""

    __slots__ = ("modes", "indexed", "nonfinite", "logged")

    def __init__(self) -> None:
        self.modes: dict[str, frozenset[str]] = {}  # mode -> statistics written
        self.indexed = False
        self.nonfinite = False
        self.logged = False  # a name of sowtel.log

    def learn(self, mode: str, stats: frozenset[str], indexed: bool, nonfinite: bool) -> bool:
        """Adds what one record shows; returns whether the layout changed."""
        known = self.modes.get(mode)
        changed = known is None or not known.issuperset(stats)
        if changed:
            self.modes[mode] = stats if known is None else known | stats
        changed |= (indexed and not self.indexed) or (nonfinite and not self.nonfinite)
        self.indexed |= indexed
        self.nonfinite |= nonfinite
        return changed


class _EventFile:
    """One TFRecord event file, written synchronously: no queue, no thread.

    tensorboardX's ``FileWriter.flush()`` only flushes what its background thread already
    dequeued; writing here directly means a flush really puts every event on the disk.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._pending = bytearray()
        self._fd = -1
        self._open()

    def _open(self) -> None:
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}"
        name = f"events.out.tfevents.{stamp}.{os.getpid()}.{next(_file_counter):04d}.sowtel"
        self.path = os.path.join(self.run_dir, name)
        # O_EXCL: a file (or a link) already there under this name is never written through.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                           | getattr(os, "O_NOFOLLOW", 0), 0o644)
        self._size = 0
        self._rotate = False
        self._pending[:0] = _frame(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add(self, event: Event) -> None:
        self._pending += _frame(event)

    def write_out(self, sync: bool) -> None:
        """Hands pending events to the OS (and to the disk if ``sync``); raises OSError."""
        if self._rotate:
            self._close_fd()
            try:
                self._open()
            except OSError:
                self._pending.clear()  # bounded memory while no file can be created
                raise
        buf, self._pending = memoryview(bytes(self._pending)), bytearray()
        written = 0
        try:
            while written < len(buf):
                written += os.write(self._fd, buf[written:])
            if sync:
                os.fsync(self._fd)
        except OSError:
            self._size += written
            if self._size == 0:
                # Nothing reached this file: keep it, and its header for the next attempt.
                self._pending[:0] = _frame(Event(wall_time=time.time(),
                                                 file_version="brain.Event:2"))
            else:
                # A record cut in the middle would make every later one unreadable, and one
                # written whole may have been cut before: go on in a new file.
                self._rotate = True
            raise
        self._size += written

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def close(self) -> None:
        try:
            if self._pending:
                self.write_out(sync=True)
        finally:
            self._close_fd()


class TensorBoardExporter:
    """Writes records as TensorBoard scalars, histograms, a custom-scalars layout and alerts.

    Args:
      logdir: the directory of the run (created if missing). Default: ``runs/<date-time>``.
        It is checked here, so ``sowtel.enable(exporter="tensorboard", logdir=...)`` fails at
        once on a path that is not a writable directory.
      flush_secs: the longest time, in seconds, events stay in the operating system's cache
        before they are synced to the disk while records arrive. Events are visible to a
        running TensorBoard as soon as ``write()`` returns.
      stats: the statistics written as scalars: ``"default"`` (:data:`DEFAULT_STATS`, plus the
        counts :data:`COUNT_STATS` of a series from its first non-zero one), ``"all"`` (every
        statistic a record carries, constant ones included), or a list of names from
        :data:`sowtel.records.STAT_KEYS` (written at every step).
      scalar_derivatives: also write tangent and cotangent records of sites whose value is a
        scalar (shape ``()``); off by default, as the cotangent of a loss is always 1.0.

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
                 scalar_derivatives: bool = False) -> None:
        if logdir is None:
            logdir = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(
                f"logdir={logdir!r} is not a path: pass a directory as a str or pathlib.Path"
            )
        if not os.fspath(logdir):
            # os.path.abspath("") is the current directory: an empty string is a mistake, not a
            # request to scatter event files there ("." says that explicitly).
            raise ValueError(
                "logdir='' is empty: pass a directory such as 'runs/exp1', or leave logdir out "
                "for runs/<date-time>"
            )
        if (isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float))
                or not math.isfinite(flush_secs) or flush_secs <= 0):
            raise ValueError(
                f"flush_secs={flush_secs!r} must be a positive number of seconds, such as 2.0"
            )
        if not isinstance(scalar_derivatives, bool):
            raise TypeError(f"scalar_derivatives={scalar_derivatives!r} must be True or False")
        self.flush_secs = float(flush_secs)
        self._choice = StatChoice(stats)
        self.stats = self._choice.stats
        self.scalar_derivatives = scalar_derivatives
        self.logdir = os.path.abspath(os.fspath(logdir))
        self.errors = 0
        self.last_error: str | None = None
        self._process_index, process_count = _jax_process()
        self._per_process_runs = process_count > 1
        self._files: dict[int, _EventFile] = {}
        self._prefixes: dict[tuple[str, str, Any], str] = {}
        self._layouts: dict[int, dict[str, _Site]] = {}
        self._layout_due: set[int] = set()
        self._alerted: set[int] = set()
        self._last_sync = time.monotonic()
        self._closed = False
        _check_logdir(self.logdir)
        self._file(self._process_index)

    def run_dir(self, process_index: int = 0) -> str:
        """The directory holding the event files of one JAX process's records."""
        if self._per_process_runs:
            return os.path.join(self.logdir, f"process_{int(process_index)}")
        return self.logdir

    def _file(self, process_index: int) -> _EventFile:
        f = self._files.get(process_index)
        if f is None:
            run_dir = self.run_dir(process_index)
            if run_dir != self.logdir and os.path.islink(run_dir):
                raise ValueError(
                    f"{run_dir!r} is a symbolic link, and the tensorboard exporter never follows "
                    "links out of its logdir: remove the link, or choose another logdir"
                )
            try:
                os.makedirs(run_dir, exist_ok=True)
                f = _EventFile(run_dir)
            except OSError as e:
                raise ValueError(
                    f"logdir {run_dir!r} is not writable ({e.strerror or e}): pass a directory "
                    "this process can create files in"
                ) from e
            self._files[process_index] = f
        return f

    def write(self, records: Sequence[Record]) -> None:
        """Writes a batch of records; raises ``OSError`` (and counts it) if the file write fails.

        A record that cannot be converted (a malformed value) is skipped, and the batch's other
        records are still written; the failure is then raised as ``ValueError`` after them.
        """
        if self._closed:
            raise RuntimeError("TensorBoardExporter.write() after close(): create a new exporter")
        bad: list[str] = []
        # Sorting by step keeps each tag's steps increasing in the file, which TensorBoard's
        # loader needs: it drops a tag's points after a step that goes backwards.
        ordered = sorted(records, key=lambda r: (r.process_index, r.step, r.seq))
        layout_due = self._layout_due
        for process_index, group in itertools.groupby(ordered, key=lambda r: r.process_index):
            f = self._file(process_index)
            layout = self._layouts.setdefault(process_index, {})
            for step, same_step in itertools.groupby(group, key=lambda r: r.step):
                values: list[Summary.Value] = []
                wall_time = 0.0
                for r in same_step:
                    try:
                        self._record_values(r, values, layout, layout_due)
                    except Exception as e:  # one bad record must not lose the batch's others
                        bad.append(f"{r.name!r} ({r.mode}, step {r.step}): {e}")
                    wall_time = max(wall_time, r.wall_time)
                if values:
                    f.add(Event(wall_time=wall_time or time.time(), step=int(step),
                                summary=Summary(value=values)))
        for process_index in sorted(layout_due):
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

    def _record_values(self, r: Record, values: list[Summary.Value],
                       layout: dict[str, _Site], layout_due: set[int]) -> None:
        if r.summary == "scalar":  # sowtel.log
            values.append(Summary.Value(tag=str(r.name), simple_value=float(r.stats["value"])))
            site = layout.setdefault(r.name, _Site())
            if not site.logged:
                site.logged = True
                layout_due.add(r.process_index)
            return
        key = (r.name, r.mode, r.index)
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self._prefixes[key] = series_tag(str(r.name), str(r.mode), r.index)
        stats: dict[str, float] = r.stats
        hist = r.histogram
        if r.value is not None:
            summary = host_summary(r.value, "histogram")
            stats, hist = summary["stats"], summary["histogram"]
        nonfinite = _nonfinite(stats) > 0
        if r.process_index not in self._alerted and nonfinite:
            self._alerted.add(r.process_index)
            values.append(text(ALERT_TAG, _alert_text(r, stats)).value[0])
        if r.shape == () and r.mode != "primal" and not self.scalar_derivatives:
            return
        written = self._chosen(key, r.summary, stats, nonfinite)
        for stat in written:
            values.append(Summary.Value(tag=f"{prefix}/{stat}", simple_value=float(stats[stat])))
        if hist is not None:
            h = _histogram_value(prefix, stats, hist)
            if h is not None:
                values.append(h)
        site = layout.setdefault(r.name, _Site())
        # A chart of counts once one is non-zero, or for a health site, which has nothing else.
        counts_chart = any(k in COUNT_STATS for k in written) and (
            nonfinite or r.summary == "health")
        if site.learn(r.mode, frozenset(written), r.index is not None, counts_chart):
            layout_due.add(r.process_index)

    def _chosen(self, key: tuple[str, str, Any], summary: str, stats: dict[str, float],
                nonfinite: bool) -> list[str]:
        return self._choice.chosen(key, summary, stats, nonfinite)

    def _write_out(self, sync: bool) -> None:
        failures = []
        self._layout_due = set()
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
        for f in self._files.values():
            try:
                f.close()
            except OSError as e:
                failures.append(f"{f.path}: {e.strerror or e}")
        if failures:
            self.errors += 1
            self.last_error = "; ".join(failures)
            raise OSError(f"TensorBoardExporter could not write {self.last_error} when closing")


def _jax_process() -> tuple[int, int]:
    import jax

    return int(jax.process_index()), int(jax.process_count())


def _check_logdir(logdir: str) -> None:
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ValueError(
            f"logdir {logdir!r} exists and is not a directory: pass a directory path (it is "
            "created if missing)"
        )
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"logdir {logdir!r} cannot be created ({e.strerror or e}): pass a directory path "
            "under a writable folder"
        ) from e


def _nonfinite(stats: dict[str, float]) -> float:
    return float(stats.get("nan", 0) + stats.get("posinf", 0) + stats.get("neginf", 0))


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


def _layout_summary(layout: dict[str, _Site]) -> Summary:
    categories: dict[str, dict[str, list[Any]]] = {}
    logged = sorted(name for name, site in layout.items() if site.logged)
    if logged:
        categories[LOG_CATEGORY] = {
            name: ["Multiline", ["^" + re.escape(name) + "$"]] for name in logged}
    for name, site in sorted(layout.items()):
        if site.modes:
            categories[name] = _site_charts(name, site)
    return custom_scalars(categories)


def _site_charts(name: str, site: _Site) -> dict[str, list[Any]]:
    charts: dict[str, list[Any]] = {}
    for mode in sorted(site.modes, key=lambda m: (m.count("."), m != "primal", m)):
        written = site.modes[mode]
        if mode == "primal" and not site.indexed and {"mean", "min", "max"} <= written:
            prefix = series_tag(name, mode)
            charts[f"{mode}: mean, band min to max"] = [
                "Margin", [f"{prefix}/mean", f"{prefix}/min", f"{prefix}/max"]]
            continue
        preferred = "mean" if mode == "primal" else "l2"
        shown = [preferred] if preferred in written else sorted(
            (k for k in written if k not in COUNT_STATS and k != "size"),
            key=lambda k: _CHART_ORDER.get(k, len(_CHART_ORDER)))[:1]
        for stat in shown:
            title = f"{mode}: {'l2 norm' if stat == 'l2' else stat}"
            charts[title] = ["Multiline", [_chart_regex(name, mode, stat)]]
    if site.nonfinite:
        counts = "(" + "|".join(COUNT_STATS) + ")"
        charts["NaN and infinities"] = ["Multiline", [_chart_regex(name, None, counts)]]
    return charts


def _alert_text(r: Record, stats: dict[str, float]) -> str:
    where = f"`{r.name}` ({r.mode}" + (f", index {r.index}" if r.index is not None else "") + ")"
    counts = ", ".join(
        f"{int(stats.get(k, 0))} {label}"
        for k, label in (("nan", "NaN"), ("posinf", "+inf"), ("neginf", "-inf"))
    )
    size = stats.get("size")
    of = f" of {int(size)} elements" if size is not None else ""
    return f"First non-finite value: step {r.step}, site {where}: {counts}{of}."
