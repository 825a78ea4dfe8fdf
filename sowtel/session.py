"""Streaming sessions: ``enable``, ``disable``, ``flush``, ``status``, ``export``.

A session holds what to stream (tags, modes, name filters, summary, stride), the exporters and
the dispatcher that feeds them. Enabling is process-wide: it sets the global value of a
jit-cache-keyed context, so every function traced afterwards (in any thread) streams, and a
function compiled before is recompiled on its next call, and stops streaming after
``disable()`` the same way. One session streams for every thread: ``enable()`` in a thread
while a session enabled by another running thread is active raises (see :func:`enable`).

A session is the receiver (:mod:`sowtel.receiver`) that the host callbacks of running programs
call: it counts the occurrence and enqueues the arrays (which the runtime has just copied from
the device); building records happens on the dispatcher thread.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> @jax.jit
    ... def f(x):
    ...     return sowtel.sow(x * 2, "y").sum()
    >>> with sowtel.enable(exporter="memory") as session:
    ...     _ = f(jnp.arange(4.0))
    ...     _ = sowtel.flush()
    ...     [r] = session.exporters[0].records
    >>> r.name, r.mode, r.stats["mean"]
    ('y', 'primal', 3.0)
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sowtel import _exit, errors, multihost
from sowtel import _jax_compat as jc
from sowtel.alerts import Alert, Alerts, make_alerts
from sowtel.context import CONTEXT, RECEIVERS, Context, Globs, StreamConfig, check_positive_int
from sowtel.dispatcher import Dispatcher, accounts, sigterm_unhandled
from sowtel.dispatcher import labels as exporter_labels
from sowtel.exporters import Exporter, resolve
from sowtel.nonfinite import MAX_POSTMORTEMS, Guard, make_guard
from sowtel.primitive import sow_p
from sowtel.receiver import Receiver
from sowtel.records import BASE_MODES
from sowtel.sites import StreamSite
from sowtel.summaries import HISTOGRAM_EVERY, check_summary
from sowtel.to_records import (
    RecordBatch,
    first_nonfinite,
    log_records,
    records_from_intermediates,
)

__all__ = ["Session", "enable", "disable", "flush", "status", "export", "log", "active_session"]

logger = logging.getLogger("sowtel")

ON_FULL = ("drop", "block")
_ids = itertools.count(1)
_lock = threading.RLock()
_stack: list[Session] = []  # enabled sessions, innermost last; the last one streams


def _renew_lock() -> None:
    global _lock
    _lock = threading.RLock()


_exit.after_fork(_renew_lock)


def _check_patterns(value: Any, what: str) -> Callable[[str], bool] | None:
    if value is None:
        return None
    if callable(value):
        return value  # type: ignore[no-any-return]
    patterns = [value] if isinstance(value, str) else (
        list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value])
    if not all(isinstance(p, str) for p in patterns):
        raise errors.BadOptionError(
            what, value, "must be a glob pattern, a list of them, or a callable on the name")
    return Globs(tuple(patterns))


def _check_strings(value: Any, what: str) -> tuple[str, ...]:
    rule = "must be a non-empty list of non-empty strings"
    try:
        items = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:  # not iterable: tags=42
        raise errors.BadOptionError(what, value, f"{rule}, such as ('intermediates',)") from None
    if not items or not all(isinstance(v, str) and v for v in items):
        raise errors.BadOptionError(what, value, rule)
    return items


def _check_timeout(timeout: Any, what: str) -> float | None:
    ok = timeout is None or (
        isinstance(timeout, (int, float, np.integer, np.floating))
        and not isinstance(timeout, bool) and math.isfinite(timeout) and timeout >= 0)
    if not ok:
        raise errors.BadOptionError(
            f"{what} timeout", timeout, "must be None or a number of seconds >= 0 (such as "
            "30.0); None waits as long as it takes")
    return None if timeout is None else float(timeout)


class Session(Receiver):
    """One ``enable()``: what is streamed, and where to.

    Use :func:`enable` to make one. A session is a context manager: leaving the block disables
    it and resumes the session that was active before, if any.

    Attributes:
      exporters: the exporter instances records go to.
      dispatcher: the queue and threads between the receiver and the exporters.

    A session is the :class:`~sowtel.receiver.Receiver` of the host callbacks and
    ``sowtel.jit`` steps of the programs it streams.
    """

    def __init__(
        self,
        exporters: list[Exporter],
        *,
        summary: str,
        tags: tuple[str, ...],
        modes: tuple[str, ...],
        include: Callable[[str], bool] | None,
        exclude: Callable[[str], bool] | None,
        every: int,
        queue_size: int,
        on_full: str,
        max_bytes: int,
        export_process: int = 0,
        guard: Guard | None = None,
        histogram_every: int | None = None,
        alerts: Alerts | None = None,
    ) -> None:
        super().__init__()
        self.id = next(_ids)
        # What shapes compiled programs, and keys their cache (never the session's identity).
        self.config = StreamConfig(tags=tags, modes=modes, include=include, exclude=exclude,
                                   summary=summary, every=every, export_process=export_process)
        self.summary = summary
        self.tags = tags
        self.modes = modes
        self.include = include
        self.exclude = exclude
        self.every = every
        self.histogram_every = histogram_every
        self.exporters = exporters
        self.process_index = jax.process_index()
        self.dispatcher = Dispatcher(
            exporters, convert=self._convert, queue_size=queue_size, max_bytes=max_bytes,
            on_full=on_full, alerts=None if alerts is None else alerts.take_fired,
        )
        self._late = 0
        self._late_lock = threading.Lock()
        self._forked = False
        _exit.after_fork(self)
        self._final: dict[str, Any] | None = None
        self.first_nonfinite: tuple[int, str, str] | None = None
        self._closed = False
        self._effect_errors = 0
        self.scoped = False  # entered as a context manager
        self.thread = threading.current_thread()  # the thread that enabled it
        self.guard = guard  # on_nonfinite, health_every, flight recorder (sowtel.nonfinite)
        if guard is not None:
            guard.hurry = self.dispatcher.convert_now
        self.alert_rules = alerts  # enable(alerts=...) (sowtel.alerts)
        if alerts is not None and guard is not None:
            alerts.postmortem = guard.postmortem_of_alert

    # -- host-side steps ------------------------------------------------------------------------

    def histogram_at(self, step: int) -> bool:
        """Whether a ``sowtel.jit`` logging step at ``step`` sends histograms of its ``stats``
        sites (``enable(histogram_every=N)``): steps divisible by N from step N on (every step
        for N=1), so that the first logging step compiles only the program without them."""
        every = self.histogram_every
        return every is not None and step % every == 0 and (step > 0 or every == 1)

    def logs_at(self, step: int) -> bool:
        """Whether any site may log at a host-side ``at_step(step)`` (else it runs quiet)."""
        return any(step % e == 0 for e in self.config.strides())

    def _after_fork(self) -> None:
        # A forked child's session: fresh locks (a thread of the parent may have held them),
        # and no waiting for JAX, whose runtime threads did not survive the fork.
        super()._after_fork()
        self._late_lock = threading.Lock()
        self._forked = True

    def count_late(self, site: StreamSite) -> None:
        """A host callback of ``site`` ran after this session ended: counted, not exported."""
        with self._late_lock:
            self._late += len(site.leaf_names)

    # -- the dispatcher thread ---------------------------------------------------------------

    def _convert(self, items: list[Any]) -> RecordBatch:
        """Received items to one batch (:meth:`~sowtel.receiver.Receiver.convert`), watched for
        non-finite records."""
        batch = self.convert(items)
        self._watch_nonfinite(batch)
        return batch

    def _watch_nonfinite(self, batch: RecordBatch) -> None:
        """Where a session notices a non-finite record: each converted batch (on the
        dispatcher thread) and each batch of exported intermediates passes here once; the
        rule itself is :func:`sowtel.to_records.first_nonfinite`, and ``on_nonfinite`` acts
        through :attr:`guard`."""
        if self.guard is not None:
            self.guard.observe(batch)
        if self.alert_rules is not None:
            self.alert_rules.observe(batch)
        found = first_nonfinite(batch, with_index=True)
        if found is None:
            return
        step, name, mode, index = found
        with self._late_lock:
            # The earliest step wins, whatever path it came by: sowtel.export notices its
            # records at once, a streamed step's once the dispatcher converts them.
            known = self.first_nonfinite
            if known is not None and known[0] <= step:
                return
            self.first_nonfinite = (step, name, mode)
        # The index is the layer (scan iteration) or shard the dashboard shows.
        logger.warning("sowtel: %s non-finite value at step %s in %s (%s%s)",
                       "first" if known is None else "an earlier", step, name, mode,
                       "" if index is None else f", index {index}")

    # -- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Blocks until every record accepted so far reached every exporter; False on timeout."""
        timeout = _check_timeout(timeout, "flush")
        self._effects_barrier()
        done = self.dispatcher.flush(timeout)
        if self.guard is not None:
            self.guard.deliver()  # may raise NonFiniteError
        if self.alert_rules is not None:
            self.alert_rules.deliver()  # may raise AlertError
        return done

    @property
    def alerts(self) -> list[Alert]:
        """Every alert the session's rules fired so far, oldest first (the last 1,000)."""
        return [] if self.alert_rules is None else list(self.alert_rules.fired)

    def _effects_barrier(self) -> None:
        """Waits for the host callbacks sent so far; counts (and logs once) the error of an
        earlier failed computation it meets, never raises it."""
        if self._forked:
            return
        # A user computation that failed earlier is the user's error, already raised to them
        # (or never awaited); it must not make flush() or disable() fail: count it, log once.
        error = jc.effects_barrier()
        if error is not None:
            self._effect_errors += 1
            if self._effect_errors == 1:
                logger.warning("sowtel: waiting for host callbacks met the error of an earlier "
                               "failed computation (flushing went on; counted in "
                               "status()['effect_errors']): %s", error)

    def status(self) -> dict[str, Any]:
        """This session's counters (see :func:`sowtel.status`)."""
        s = dict(self.dispatcher.status())
        s.update(enabled=not self._closed, session=self.id, effect_errors=self._effect_errors,
                 late=self._late, split_unexported=multihost.SPLIT_UNEXPORTED[0],
                 first_nonfinite=self.first_nonfinite,
                 alerts=0 if self.alert_rules is None else self.alert_rules.count)
        # Records an exporter was handed (so counted as exported) and later let go of to stay
        # within its own bound, such as the memory exporter's max_records.
        s["evicted"] = {label: _evicted(e) for label, e in
                        zip(exporter_labels(self.exporters), self.exporters, strict=True)}
        s["accounts"] = accounts(s)  # with the session's own count of late records in
        return s

    def close(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """Flushes and closes this session (and resumes the one enabled before it).

        Returns the final counters (as :meth:`status`; received == exported + dropped +
        failed + late for every exporter); closing again returns them again.
        """
        timeout = _check_timeout(timeout, "disable")
        with _lock:
            if self._closed:
                return self.status()
            self._closed = True
            if self in _stack:
                _stack.remove(self)
            _activate(_stack[-1] if _stack else None, closed=self)
        try:
            self._effects_barrier()
        finally:
            self.dispatcher.close(timeout)
        return self.status()

    def __enter__(self) -> Session:
        self.scoped = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Session(id={self.id}, exporters={[type(e).__name__ for e in self.exporters]}, "
                f"summary={self.summary!r}, tags={self.tags}, modes={self.modes})")


def _evicted(exporter: Exporter) -> int:
    n = getattr(exporter, "evicted", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def _activate(session: Session | None, closed: Session | None = None) -> None:
    # Programs compiled for an earlier session with the same settings deliver to this one.
    RECEIVERS.active = session
    if closed is not None:
        RECEIVERS.closed = closed
    CONTEXT.set_global(Context(stream=session.config) if session is not None else None)


def enable(
    exporter: Any = "tensorboard",
    *,
    summary: str = "stats",
    tags: Sequence[str] | str = ("intermediates",),
    modes: Sequence[str] | str = BASE_MODES,
    include: Any = None,
    exclude: Any = None,
    every: int = 1,
    queue_size: int = 10_000,
    on_full: str = "drop",
    max_bytes: int = 1 << 30,
    export_process: int | None = None,
    on_nonfinite: Any = None,
    health_every: int | None = None,
    histogram_every: int | None = HISTOGRAM_EVERY,
    flight_recorder: int | None = None,
    record_donated: bool = False,
    max_postmortems: int = MAX_POSTMORTEMS,
    alerts: Any = None,
    on_alert: Any = "warn",
    **exporter_options: Any,
) -> Session:
    """Streams every selected sow, in every program traced from now on, to ``exporter``.

    Args:
      exporter: ``"tensorboard"`` (the default; ``logdir=`` defaults to ``runs/<date-time>``, and
        one line on stderr says where and how to view it), ``"otel"``, ``"jsonl"``,
        ``"memory"``, ``"console"``, a name registered under the ``sowtel.exporters``
        entry-point group, an exporter instance, or a list of these.
      summary: what crosses to the host per site (``"stats"``, ``"histogram"``, ``"full"``,
        ``"health"``, ``"shape"``); a site's own ``summary=`` wins.
      tags: stream sites with these tags.
      modes: stream these modes (``"primal"``, ``"tangent"``, ``"cotangent"``); a composed mode
        such as ``"cotangent.tangent"`` streams if its last part is listed.
      include, exclude: glob patterns (or a list, or a callable on the name) on site names.
      every: stream only steps divisible by ``every`` (a site's own ``every=`` wins).
      queue_size: records waiting for the exporters at most; beyond it ``on_full`` decides.
        What waits for any one exporter, its backlog included, stays within ``queue_size``
        plus one step and one batch (docs/exporters.md, *What queue_size bounds*).
      on_full: ``"drop"`` (count and drop) or ``"block"`` (back-pressure; nothing is lost).
      max_bytes: bytes of full values waiting at most.
      export_process: under ``jax.distributed``, the process that exports the records of sites
        whose values span processes (default: ``$SOWTEL_EXPORT_PROCESS``, else 0); records
        of ``shard_map`` shards stay with the process that ran them.
      on_nonfinite: what a record holding NaN or infinities does: ``None`` (the alert in
        :func:`status` only), ``"warn"``, ``"raise"`` (the next ``sowtel.jit`` call or
        ``flush()`` raises :class:`sowtel.NonFiniteError`), ``"dump"`` (a post-mortem with
        :func:`sowtel.locate_nonfinite`'s report), or a callable taking the record (see
        :mod:`sowtel.nonfinite`).
      health_every: ``sowtel.jit`` steps at which no site logs still send every site's
        ``"health"`` summary every ``health_every`` steps (``1``: a NaN is caught at its step).
      histogram_every: ``sowtel.jit`` logging steps divisible by it, from that step on, send
        the ``"histogram"`` summary (stats plus bucket counts) of every site whose summary is
        ``"stats"``; the other logging steps send stats only (default 100: histograms cost
        more than stats, see docs/tensorboard.md). ``None``: never. The callback transport
        (``enable()`` + ``jax.jit``) keeps each site's own summary.
      flight_recorder: keep the arguments of the last K checked ``sowtel.jit`` calls, and of
        those whose records are still being checked (8 at most), to write a post-mortem of
        the step that made a non-finite value (default: 1 under ``on_nonfinite="dump"``, else
        off); memory: K+1 to K+8 extra copies of the arguments.
      record_donated: also record functions that donate arguments (copies them each call).
      max_postmortems: post-mortems the session writes at most (default 3): one per failure
        episode (from a non-finite step to the next all-finite one), of its first step.
      alerts: rules made by :func:`sowtel.alert` over the sites' statistics and the
        :func:`sowtel.log` series (see :mod:`sowtel.alerts`).
      on_alert: what a rule without an action of its own does when it fires: ``"warn"``,
        ``"raise"`` (the next ``sowtel.jit`` call or ``flush()`` raises
        :class:`sowtel.AlertError`), ``"dump"`` (a post-mortem of the step from the flight
        recorder, on with K=1 then) or a callable taking the :class:`sowtel.alerts.Alert`.
      **exporter_options: passed to exporters named by string (``logdir=...``).

    Returns:
      The :class:`Session`; also a context manager that disables it on exit. Enabling while a
      session enabled without ``with`` is active stacks the new one on it (it resumes when the
      new one is disabled) and warns, as re-running a notebook cell would do that unawares.

    Raises:
      RuntimeError: a session enabled by another thread that still runs is active. Sessions
        are process-wide: enable one before starting the threads and let them all stream to
        it (a thread may stack sessions on its own, or on those of a thread that has ended).

    Example:
        >>> import sowtel
        >>> session = sowtel.enable(exporter="memory", summary="health")
        >>> _ = sowtel.disable()
    """
    if jc.is_tracing():
        raise errors.EnableWhileTracingError()
    summary = check_summary(summary, "enable summary")
    tags_t = _check_strings(tags, "enable tags")
    modes_t = _check_strings(modes, "enable modes")
    for m in modes_t:
        if m not in BASE_MODES:
            raise errors.BadOptionError("enable modes", modes,
                                        f"holds {m!r}, which is not a mode: use some of "
                                        f"{BASE_MODES}")
    every = check_positive_int(every, "enable every")
    if histogram_every is not None:
        if (isinstance(histogram_every, bool)
                or not isinstance(histogram_every, (int, np.integer)) or histogram_every < 1):
            raise errors.BadOptionError(
                "enable histogram_every", histogram_every, "must be a positive int (histograms "
                "at the logging steps divisible by it) or None (no histograms beyond sites "
                "with summary='histogram')")
        histogram_every = int(histogram_every)
    queue_size = check_positive_int(queue_size, "enable queue_size")
    max_bytes = check_positive_int(max_bytes, "enable max_bytes")
    if on_full not in ON_FULL:
        raise errors.BadOptionError("on_full", on_full, "is not a policy: use 'drop' or 'block'")
    include_fn = _check_patterns(include, "include")
    exclude_fn = _check_patterns(exclude, "exclude")
    export_process = multihost.check_export_process(export_process)
    if multihost.spans_processes():
        # Programs with sows are then lowered knowing their devices, so that the host callback
        # of a global site can be placed on the export process's device.
        jc.requires_devices(sow_p)
    multihost.agree(dict(summary=summary, tags=tags_t, modes=modes_t, include=include_fn,
                         exclude=exclude_fn, every=every, export_process=export_process,
                         histogram_every=histogram_every),
                    what="enable")
    with _lock:
        other = _other_threads_session()
    if other is not None:  # before any exporter opens a file
        raise _second_thread_error(other)
    rules = make_alerts(alerts, on_alert)
    if rules is not None and flight_recorder is None and rules.dumps:
        flight_recorder = 1  # a post-mortem of the step an alert fired at
    guard_options = (on_nonfinite, health_every, flight_recorder, record_donated)
    make_guard(*guard_options, None, tags_t, max_postmortems)  # before exporters open files
    exporters = resolve(exporter, **exporter_options)
    logdirs = [getattr(e, "logdir", None) for e in exporters]  # where post-mortems go
    logdir = next((os.fspath(d) for d in logdirs if isinstance(d, str | os.PathLike)), None)
    session = Session(
        exporters, summary=summary, tags=tags_t, modes=modes_t, include=include_fn,
        exclude=exclude_fn, every=every, queue_size=queue_size, on_full=on_full,
        max_bytes=max_bytes, export_process=export_process,
        guard=make_guard(*guard_options, logdir, tags_t, max_postmortems),
        histogram_every=histogram_every, alerts=rules,
    )
    with _lock:
        other = _other_threads_session()  # again: another thread may have enabled one since
        if other is None:
            below = _stack[-1] if _stack else None
            _stack.append(session)
            _activate(session)
    if other is not None:  # never active: its threads and files go, nothing else changes
        session._closed = True
        session.dispatcher.close(5.0)
        raise _second_thread_error(other)
    try:
        if below is not None and not below.scoped:
            warnings.warn(
                f"sowtel.enable(): {below!r} is still active, so the new session stacks on it and "
                "it resumes when the new one is disabled; call sowtel.disable() first to replace "
                "it, or use `with sowtel.enable(...):` for a temporary one", RuntimeWarning,
                stacklevel=2)
        unhandled = sigterm_unhandled()
        if unhandled is not None:
            warnings.warn(unhandled, RuntimeWarning, stacklevel=2)
        specs = list(exporter) if isinstance(exporter, (list, tuple)) else [exporter]
        _announce([e for e, spec in zip(exporters, specs, strict=True) if isinstance(spec, str)])
    except BaseException:
        # A warning turned into an error (-W error), say: nothing enable() started stays running.
        session.close(5.0)
        raise
    return session


def _other_threads_session() -> Session | None:
    """An enabled session of another thread that still runs, or None (lock held).

    Sessions are process-wide: one streams, for every thread. A thread may stack sessions on
    its own (or on those of a thread that has ended), never on another running thread's, whose
    records would go to the new one and whose ``disable()`` would close it.
    """
    me = threading.current_thread()
    for other in reversed(_stack):
        if other.thread is not me and other.thread.is_alive():
            return other
    return None


def _second_thread_error(other: Session) -> RuntimeError:
    me = threading.current_thread()
    return RuntimeError(
        f"sowtel.enable() in thread {me.name!r}: {other!r}, enabled by thread "
        f"{other.thread.name!r}, is active. Sessions are process-wide (one streams, for every "
        "thread and every program), so a second thread cannot enable one of its own beside "
        "it. Enable one session before starting the threads and let them all stream to it, or "
        "disable that session first")


def _announce(exporters: list[Exporter]) -> None:
    # One line per TensorBoard run enable() created, so a bare enable() does not write files
    # unseen; whoever built an exporter instance knows where it writes.
    from sowtel.dashboard import dashboard_command

    for e in exporters:
        logdir = getattr(e, "logdir", None)
        if getattr(e, "label", None) == "tensorboard" and isinstance(logdir, str):
            try:
                if sys.stderr is not None:  # None under pythonw: nowhere to print
                    print(f"sowtel: streaming to TensorBoard in {logdir}; view it with: "
                          f"{dashboard_command(logdir)}", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass  # stderr closed or broken: the line is a courtesy, never a reason to fail


def active_session() -> Session | None:
    """The session that streams now, or None."""
    with _lock:
        return _stack[-1] if _stack else None


def disable(timeout: float | None = 30.0) -> dict[str, Any]:
    """Flushes and closes the active session; the one enabled before it (if any) resumes.

    Returns the closed session's final counters (as :func:`status`; ``enabled=False`` and zero
    counts when nothing was enabled). :func:`status` keeps showing them until the next
    ``enable()``. When an exporter cannot finish within ``timeout`` seconds, what it still had
    is counted as dropped (reason ``close_timeout``).

    Example:
        >>> import sowtel
        >>> _ = sowtel.enable(exporter="memory")
        >>> sowtel.log({"loss": 0.5}, step=0)
        1
        >>> final = sowtel.disable()
        >>> final["enabled"], final["received"], final["accounts"]["memory"]["exported"]
        (False, 1, 1)
        >>> sowtel.status()["enabled"]
        False
    """
    timeout = _check_timeout(timeout, "disable")
    session = active_session()
    if session is None:
        return status()
    return session.close(timeout)


def flush(timeout: float | None = 30.0) -> bool:
    """Blocks until every record accepted so far has reached every exporter.

    Returns False if ``timeout`` seconds passed first; True (and does nothing) with nothing
    enabled. Under ``enable(on_nonfinite="raise")`` it raises :class:`sowtel.NonFiniteError`
    when a record with a NaN or an infinity arrived since the last alert (``"warn"`` /
    ``"dump"``: a warning).

    Example:
        >>> import sowtel
        >>> sowtel.flush()
        True
    """
    timeout = _check_timeout(timeout, "flush")
    _exit.keep_sigterm()
    session = active_session()
    return True if session is None else session.flush(timeout)


def status() -> dict[str, Any]:
    """Counters of the active session: received, exported per exporter, dropped, errors, and
    the first non-finite record (step, name, mode). With nothing enabled: the last session's
    final counters with ``enabled=False`` (zero counts if there was none). ``effect_errors``
    counts earlier failed computations that flushing met (and went past); ``late`` counts
    records whose host callbacks ran after their session had ended (not exported).
    ``evicted`` counts, per exporter, records it was handed and later let go of to stay within
    its own bound (the memory exporter's ``max_records``); they are counted as exported too.

    Example:
        >>> import sowtel
        >>> sowtel.status()["enabled"]
        False
    """
    session = active_session()
    if session is None:
        closed = RECEIVERS.closed
        if isinstance(closed, Session):  # the last session's final counters
            return closed.status()
        empty: dict[str, Any] = {
            "enabled": False, "received": 0, "dropped": 0, "queued": 0, "exported": {},
            "errors": {}, "stalled": [], "first_nonfinite": None, "alerts": 0, "effect_errors": 0,
            "late": 0, "evicted": {}, "failed": {}, "drop_reasons": {}, "pending": {},
            "backlog": {}, "held_bytes": 0}
        empty["accounts"] = accounts(empty)
        return empty
    return session.status()


def export(intermediates: dict[str, dict[str, Any]], *, step: int,
           summary: str | None = None) -> int:
    """Sends ``save_intermediates`` results through the active session's exporters.

    Records are the same as streaming would give (summaries computed on the host). Returns the
    number of records handed over.

    Example:
        >>> import jax.numpy as jnp, sowtel
        >>> with sowtel.enable(exporter="memory") as s:
        ...     sowtel.export({"h": {"primal": jnp.ones(3)}}, step=7)
        1
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise errors.BadOptionError("export step", step, "must be an int")
    _exit.keep_sigterm()
    session = active_session()
    if session is None:
        raise errors.NoSessionError("sowtel.export")
    try:
        records = records_from_intermediates(
            intermediates, step=int(step), summary=summary or session.summary,
        )
    except ValueError as e:
        raise errors.prefixed(e, "sowtel.export") from None
    session._watch_nonfinite(RecordBatch([tuple(records)]))
    session.dispatcher.put_records(records)
    return len(records)


def log(scalars: dict[str, Any], *, step: int) -> int:
    """Sends host-side numbers (loss, accuracy, learning rate) to the active exporters.

    Each ``name: number`` becomes one record of its own kind: ``summary="scalar"``,
    ``tag="log"``, mode ``"primal"``, shape ``()``, the number in ``stats["value"]``.
    TensorBoard writes it as the plain scalar ``name`` in the same run as the sows; NaN and
    infinities are kept as they are. Returns the number of records handed over.

    Example:
        >>> import sowtel
        >>> with sowtel.enable(exporter="memory") as s:
        ...     sowtel.log({"train/loss": 0.25, "lr": 1e-3}, step=10)
        ...     _ = sowtel.flush()
        2
        >>> [(r.name, r.step, r.stats["value"]) for r in s.exporters[0].records]
        [('train/loss', 10, 0.25), ('lr', 10, 0.001)]
    """
    from sowtel.naming import check_name

    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise errors.BadOptionError("sowtel.log step", step, "must be an int")
    if not isinstance(scalars, dict):
        raise errors.BadOptionTypeError(
            "sowtel.log scalars", scalars, f"is a {type(scalars).__name__}, not a dict of name "
            "-> number: write sowtel.log({'loss': loss}, step=step)")
    values: list[tuple[str, float]] = []
    for name, value in scalars.items():
        try:
            check_name(name)
        except ValueError as e:
            raise errors.prefixed(e, "sowtel.log") from None
        number = np.asarray(value)
        if number.shape != () or number.dtype.kind not in "biuf":
            raise errors.BadOptionError(
                f"sowtel.log scalars[{name!r}]", value, "is not a number: pass a Python or "
                "NumPy number or a 0-d array (sow arrays with sowtel.sow)")
        values.append((name, float(number)))
    _exit.keep_sigterm()
    session = active_session()
    if session is None:
        raise errors.NoSessionError("sowtel.log")
    records = log_records(values, step=int(step), wall_time=time.time(),
                          process_index=session.process_index)
    session.dispatcher.put_records(records)
    if session.alert_rules is not None:  # logged numbers skip the conversion: judged here
        session.alert_rules.observe(records)
        session.alert_rules.deliver()  # may raise AlertError
    return len(records)
