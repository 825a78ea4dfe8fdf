"""The callback receiver of a session: counting, steps, indices, and the conversion of what
it received into batches.

Host callbacks of running programs call :meth:`Receiver.receive`, which does only this: count
the occurrence (the occurrence count gives a record its step and scan index) and enqueue the
arrays, which the runtime has just copied from the device. ``sowtel.jit`` logging steps call
:meth:`Receiver.receive_compiled`. Building records happens on the dispatcher thread, in
:meth:`Receiver.convert`. A :class:`sowtel.session.Session` is a receiver.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> f = jax.jit(lambda x: sowtel.sow(x, "h").sum())
    >>> with sowtel.enable(exporter="memory", every=1) as session:
    ...     _ = [f(jnp.full(2, float(i))) for i in range(3)]
    ...     _ = sowtel.flush()
    >>> isinstance(session, Receiver), [r.step for r in session.exporters[0].records]
    (True, [0, 1, 2])
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import math
import operator
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from sowtel import _exit, multihost
from sowtel import _jax_compat as jc
from sowtel.records import Record, record_index
from sowtel.to_records import CompiledConverter, RecordBatch, site_records

if TYPE_CHECKING:
    from sowtel.context import StreamConfig
    from sowtel.dispatcher import Dispatcher
    from sowtel.sites import StreamSite

__all__ = ["Receiver"]

logger = logging.getLogger("sowtel")

_by_seq = operator.attrgetter("seq")
_UNSET = object()


class _HostBlock:
    """One open :meth:`Receiver.host_step_block`: its step (compared by identity)."""

    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        self.step = step


# The innermost host-step block of this thread or asyncio task.
_BLOCK: contextvars.ContextVar[_HostBlock | None] = contextvars.ContextVar(
    "sowtel_host_block", default=None)
_warned_overlap = False


def _warn_overlap() -> None:
    global _warned_overlap
    if _warned_overlap:
        return
    _warned_overlap = True
    # From a callback's thread: logged, as a warning raised there could only lose a record.
    logger.warning(
        "sowtel.at_step: host-side at_step blocks of two asyncio tasks overlap in one thread "
        "(an await inside the block), and the runtime ran a callback on a thread of its own "
        "(large programs, GPUs), where it can only read the newest block's step: its records "
        "may carry the other task's step. Await outside at_step blocks, or stream with "
        "sowtel.jit, whose steps are exact")


class _Compiled(NamedTuple):
    """A ``sowtel.jit`` logging step's summaries, queued for the dispatcher thread."""

    summaries: Any
    step: int
    wall_time: float


_most: dict[int, tuple[Any, int]] = {}  # id(sites) -> (sites, records)


def _most_records(sites: Any) -> int:
    """The records a ``sowtel.jit`` step's summaries make when every site ran everywhere.

    A step lost before it is converted is counted as that many (one that is converted counts
    as the records it made). ``sites`` is fixed per compiled program: computed once each.
    """
    known = _most.get(id(sites))
    if known is not None and known[0] is sites:
        return known[1]
    n = sum(len(e.site.leaf_names) * math.prod(size for _, size in e.stacked) for e in sites)
    _most[id(sites)] = (sites, n)
    return n


class Receiver:
    """What a session receives: host callbacks' arrays and ``sowtel.jit`` steps' summaries,
    counted and enqueued on the callers' threads, turned into batches on the dispatcher's.

    The session that is one sets :attr:`dispatcher` (where items go), :attr:`config` and
    :attr:`process_index`.
    """

    dispatcher: Dispatcher
    config: StreamConfig
    process_index: int

    def __init__(self) -> None:
        self._counters: dict[Any, Iterable[int]] = {}
        self._views: dict[Any, bool] = {}
        # Host-side at_step blocks that log, one at a time (see host_step_block).
        self._host_lock = threading.RLock()
        self._host_steps: list[_HostBlock] = []
        self._overlaps = 0  # open blocks entered while another task's block was open
        self._seq = itertools.count()
        self._indices: dict[tuple[Any, ...], Any] = {}  # (loops, place, shard) -> index
        self._compiled = CompiledConverter()

    def _effects_barrier(self) -> None:
        """Waits until the host callbacks sent so far have run (a session counts the errors
        of earlier failed computations this meets)."""
        jc.effects_barrier()

    def _after_fork(self) -> None:
        # A forked child's receiver: a fresh lock (a thread of the parent may have held it).
        self._host_lock = threading.RLock()

    # -- host-side steps ------------------------------------------------------------------------

    @contextlib.contextmanager
    def host_step_block(self, step: int) -> Iterator[None]:
        """Host callbacks of programs run inside carry ``step``.

        Holds the session's host-step lock until those callbacks have run (however late they
        arrive), so each reads the step of the call that sent it: one such block at a time,
        across threads. Used by a host-side ``at_step`` at a logging step, and by ``sowtel.jit``
        calls of functions with while-body sites; steps that log nothing never enter it.

        Asyncio tasks share their thread, so the lock cannot keep their blocks apart: a
        callback the runtime runs inside the call (as the CPU backend does for small programs)
        reads the block of its own task, from a context variable; one it runs on a thread of
        its own reads the newest block open: when blocks of two tasks overlap then (an
        ``await`` inside ``at_step``), that is warned about once.
        """
        self._host_lock.acquire()
        overlaps = bool(self._host_steps) and self._host_steps[-1] is not _BLOCK.get()
        if overlaps:
            try:  # before this block is the newest: the other task's callbacks keep its step
                self._effects_barrier()
            except BaseException:
                self._host_lock.release()
                raise
            self._overlaps += 1
        block = _HostBlock(step)
        self._host_steps.append(block)
        token = _BLOCK.set(block)
        try:
            yield
        finally:
            try:
                self._effects_barrier()
            finally:
                if overlaps:
                    self._overlaps -= 1
                _BLOCK.reset(token)
                self._host_steps.remove(block)  # its own: the newest may be another task's
                self._host_lock.release()

    def skip(self, site: StreamSite, occurrences: int) -> None:
        """A cond's branch that did not run skipped ``occurrences`` of ``site`` (a site of
        another branch): its count moves on, so later records keep their step and index."""
        try:
            counter = self._counters.get(site.counter_key)
            if counter is None:
                counter = self._counters.setdefault(site.counter_key, itertools.count())
            for _ in range(occurrences):
                next(counter)  # type: ignore[call-overload]
        except Exception:  # noqa: BLE001 - a callback must never raise into XLA
            logger.exception("sowtel: a skipped branch of %r could not be counted", site.name)

    # -- the receiver: host callback threads -------------------------------------------------

    def receive(self, site: StreamSite, arrays: tuple[np.ndarray, ...]) -> None:
        """Counts and enqueues one callback's arrays. Never raises.

        The fast callback path hands over arrays the runtime has just copied from the device
        (they own their memory), so they are kept as they are; a view is copied.
        """
        try:
            key = site.counter_key if not site.sharded else (site.counter_key, int(arrays[-1]))
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters.setdefault(key, itertools.count())
            occurrence = next(counter)  # type: ignore[call-overload]
            block = _BLOCK.get()  # set when the runtime calls back inside the call
            if block is None:
                steps = self._host_steps
                block = steps[-1] if steps else None
                if self._overlaps:
                    _warn_overlap()
            host_step = None if block is None else block.step
            if site.host_every > 1:
                if "step" in site.extras:
                    step = int(arrays[len(arrays) - len(site.extras) + site.extras.index("step")])
                else:
                    step = host_step if host_step is not None else occurrence // site.period
                if step % site.host_every:
                    return
            views = self._views.get(site.counter_key)
            if views is None:  # decided once per site: does this path hand over views?
                views = self._views.setdefault(
                    site.counter_key, any(getattr(a, "base", None) is not None for a in arrays))
            if views:
                arrays = tuple(np.array(a, copy=True) for a in arrays)
            self.dispatcher.put(
                (site, arrays, occurrence, host_step, next(self._seq), time.time()),
                site.full_nbytes, len(site.leaf_names))
        except Exception:  # noqa: BLE001 - a callback must never raise into XLA
            logger.exception("sowtel: dropping a record of %r that could not be received",
                             site.name)

    def receive_compiled(self, summaries: Any, step: int) -> None:
        """Enqueues a ``sowtel.jit`` logging step's summary outputs (still on the device).

        Never waits for the device: the dispatcher thread fetches them (see :meth:`convert`).
        """
        if not summaries.sites:
            return
        self.dispatcher.put(_Compiled(summaries, step, time.time()), summaries.nbytes,
                            _most_records(summaries.sites))

    # -- the dispatcher thread ---------------------------------------------------------------

    def convert(self, items: list[Any]) -> RecordBatch:
        """Received items to one batch: a ``sowtel.jit`` step's summaries decoded into one
        table a site (see :mod:`sowtel.to_records`), a callback's arrays into its records."""
        parts: list[Any] = []
        records: list[Record] = []
        callbacks: list[Any] = []
        for item in items:
            if isinstance(item, _Compiled):
                if callbacks:
                    records.extend(self._callback_records(callbacks))
                    callbacks = []
                if records:
                    parts.append(tuple(records))
                    records = []
                # Waits for the device, here: one transfer a buffer; never once the process
                # is exiting (see sowtel._exit), when the step is counted as not delivered.
                with _exit.FETCHES.entered() as allowed:
                    if not allowed:
                        raise RuntimeError("the process is exiting: a sowtel.jit step's "
                                           "summaries were not fetched")
                    fetched, lowest = multihost.fetch(item.summaries.buffers,
                                                      self.config.export_process)
                if lowest is None and item.summaries.layout is not None:
                    parts.extend(self._compiled.packed_columns(
                        item.summaries, fetched, step=item.step, seqs=self._seq,
                        wall_time=item.wall_time, process_index=self.process_index))
                else:
                    parts.extend(self._compiled.columns(
                        item.summaries.sites, item.summaries.unpack(fetched), step=item.step,
                        seqs=self._seq, wall_time=item.wall_time,
                        process_index=self.process_index, lowest=lowest))
            else:
                callbacks.append(item)
        if callbacks:
            records.extend(self._callback_records(callbacks))
        if records:
            parts.append(tuple(records))
        return RecordBatch(parts)

    def _callback_records(self, items: list[Any]) -> list[Record]:
        """Records of host callbacks, in the order they were received: the callbacks of one
        site decoded together (:func:`sowtel.to_records.site_records`); full values, which
        keep their own arrays, one by one."""
        by_site: dict[int, tuple[StreamSite, list[Any]]] = {}
        for item in items:
            by_site.setdefault(id(item[0]), (item[0], []))[1].append(item)
        out: list[Record] = []
        for site, group in by_site.values():
            if site.summary == "full" or len(group) == 1:
                for item in group:
                    out.extend(self._records_of(*item))
                continue
            n_summary = site.n_summary
            places = [self._place(site, arrays[n_summary:], occurrence, host_step)
                      for site, arrays, occurrence, host_step, _, _ in group]
            out.extend(site_records(
                site, [item[1] for item in group], steps=[step for step, _ in places],
                index=[index for _, index in places], seqs=[item[4] for item in group],
                wall_times=[item[5] for item in group], process_index=self.process_index))
        if len(by_site) > 1:
            out.sort(key=_by_seq)  # stable: the leaves of one callback stay in order
        return out

    def _place(self, site: StreamSite, extras_arrays: Sequence[np.ndarray], occurrence: int,
               host_step: int | None) -> tuple[int, Any]:
        """A callback's step and record index, from its occurrence count and extras."""
        extras = dict(zip(site.extras, extras_arrays, strict=True)) if site.extras else {}
        shard = int(extras["shard"]) if "shard" in extras else None
        # The index repeats with the enclosing scans' period: computed once per place.
        key = (site.loops, occurrence % site.period, shard)
        index = self._indices.get(key, _UNSET)
        if index is _UNSET:
            axes: list[tuple[str, int, int]] = []
            if shard is not None:  # already one number over the manual axes
                axes.append(("shard", 0, shard))
            # The iterations, from the occurrence count: innermost scan fastest, a reversed
            # scan from its last position.
            rest = occurrence
            loops: list[tuple[str, int, int]] = []
            for length, reverse in reversed(site.loops or ()):
                i = rest % length if length else 0
                rest = rest // length if length else rest
                loops.append(("scan", length, length - 1 - i if reverse else i))
            axes.extend(reversed(loops))
            index = record_index(axes)
            if len(self._indices) < 100_000:
                self._indices[key] = index
        if "step" in extras:
            step = int(extras["step"])
        else:
            step = host_step if host_step is not None else occurrence // site.period
        return step, index

    def _records_of(self, site: StreamSite, arrays: tuple[np.ndarray, ...], occurrence: int,
                    host_step: int | None, seq: int, wall_time: float) -> list[Record]:
        n_summary = site.n_summary
        step, index = self._place(site, arrays[n_summary:], occurrence, host_step)
        return site_records(site, [arrays[:n_summary]], steps=[step], index=[index], seqs=[seq],
                            wall_times=[wall_time], process_index=self.process_index)
