"""What a session does when a NaN or an infinity arrives: ``enable(on_nonfinite=...)``.

``sowtel.enable(..., on_nonfinite=..., health_every=..., flight_recorder=...)`` sets a
:class:`Guard` on the session. It sees every record the session converts (both transports) and
acts once on each failure episode (from a step whose records hold a NaN or an infinity to the
next step whose records are all finite), on its first non-finite record:

==================  ==========================================================================
``on_nonfinite``    what happens
==================  ==========================================================================
``None``            nothing beyond the usual alert (``status()["first_nonfinite"]``, a log line)
``"warn"``          a :class:`NonFiniteWarning` at the next ``sowtel.jit`` call or ``flush()``
``"raise"``         the next ``sowtel.jit`` call (before it runs) or ``flush()`` raises
                    :class:`NonFiniteError` naming site, mode, step and index
``"dump"``          a post-mortem of the step (below), with :func:`sowtel.locate_nonfinite`'s
                    report, then a warning naming its folder
a callable          called with the :class:`~sowtel.Record`, on the dispatcher thread
==================  ==========================================================================

Records are checked off the training thread, once the device has computed them, so the call
that raises is the first one after that (usually the second after the faulty step);
``flush()`` waits for every record, so it always raises when one is pending.

``health_every=k`` adds a cheap check to ``sowtel.jit`` steps at which no site logs: every
``k`` steps each site sends its ``"health"`` summary (size and NaN / +inf / -inf counts) instead
of nothing, so with ``every=100, health_every=1`` a NaN of step 57 is caught at step 57, not at
step 100, also inside a host-side ``with sowtel.at_step(i):`` around the call. Health records
go to the exporters like any other (``summary="health"``).

The flight recorder (``flight_recorder=K``, on with K=1 by default under ``on_nonfinite="dump"``)
keeps references to the arguments of each ``sowtel.jit`` call that sends records: those of the
last K calls whose records were checked, and of every call whose records are still on their way
(up to :data:`HOLD`; the call after waits for the checks), so the first bad step is always there
to dump. Keeping a reference costs no device time, but it keeps the arrays alive: K+1 to K+8
extra copies of the arguments (for ``step(params, opt_state, batch)``: of the parameters,
optimizer state and batch) stay in device memory. Arguments a function donates
(``donate_argnums``) are deleted by the call, so such functions are not recorded unless
``record_donated=True``, which copies them before each call (device time and memory). When an
episode's first step is kept (and fewer than ``max_postmortems``, default 3, were written), the
step is run again through :func:`sowtel.save_intermediates` and written to
``<logdir>/postmortem/step_<k>/step_<k>.safetensors`` (``logdir``: the first exporter's, else the
working directory), with every site's full value and derivatives: ``sowtel inspect`` of that
folder names the first non-finite site in program order. Under ``on_nonfinite="dump"`` the same
folder gets ``locate.txt`` and ``locate.json``, :func:`sowtel.locate_nonfinite`'s report.

Example:
    >>> import jax.numpy as jnp, sowtel
    >>> step = sowtel.jit(lambda x: sowtel.sow(jnp.log(x), "logx").sum())
    >>> with sowtel.enable(exporter="memory", on_nonfinite="raise"):
    ...     _ = step(jnp.array([1.0, -1.0]))
    ...     try:
    ...         sowtel.flush()
    ...     except sowtel.NonFiniteError as err:
    ...         print(err.site, err.mode, err.step)
    logx primal 0
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sowtel import errors
from sowtel.alerts import AlertError
from sowtel.records import Record, is_nonfinite, nonfinite_text
from sowtel.to_records import RecordBatch, SiteColumns

__all__ = ["Guard", "NonFiniteError", "NonFiniteWarning", "POLICIES", "make_guard"]

logger = logging.getLogger("sowtel")

POLICIES = (None, "warn", "raise", "dump")


class NonFiniteError(AlertError, FloatingPointError):
    """A record held NaN or infinite values (``enable(on_nonfinite="raise")``): the alert of
    the non-finite rule, so ``except sowtel.AlertError`` catches it too.

    Attributes:
      record: the :class:`~sowtel.Record`; ``site``, ``mode``, ``step``, ``index``: its fields.
      postmortem: the post-mortem folder written for the step, if the flight recorder kept it.

    Example:
        >>> from sowtel.records import Record, is_nonfinite
        >>> r = Record(name="h", mode="cotangent", tag="intermediates", step=3, index=2,
        ...            wall_time=0.0, summary="health", shape=(4,), dtype="float32",
        ...            stats={"size": 4.0, "nan": 1.0, "posinf": 0.0, "neginf": 0.0})
        >>> str(NonFiniteError(r))
        "non-finite value in site 'h' (cotangent) at step 3, index 2: 1 NaN, 0 +inf, 0 -inf"
    """

    def __init__(self, record: Record, postmortem: Path | None = None) -> None:
        self.record = record
        self.site, self.mode, self.step, self.index = (
            record.name, record.mode, record.step, record.index)
        self.postmortem = postmortem
        super().__init__(None, describe(record) + (f"; post-mortem in {postmortem}"
                                                   if postmortem else ""))


class NonFiniteWarning(RuntimeWarning):
    """A record held NaN or infinite values (``enable(on_nonfinite="warn" | "dump")``)."""


def describe(record: Record) -> str:
    """One line naming a non-finite record: site, mode, step, index and the counts."""
    where = f"site {record.name!r} ({record.mode}) at step {record.step}"
    if record.index is not None:
        where += f", index {record.index}"
    s = record.stats
    if "nan" in s:
        counts = nonfinite_text(s)
    else:
        counts = "non-finite elements in its full value"
    return f"non-finite value in {where}: {counts}"


def _check_int(value: Any, what: str, least: int, meaning: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        if meaning is not None:
            raise errors.BadOptionError(
                f"enable {what}", value, f"must be an int >= {least} (the most "
                f"{meaning})")
        raise errors.BadOptionError(f"enable {what}", value, f"must be None or an int >= {least}")
    return int(value)


@dataclasses.dataclass
class _Kept:
    fun: Any  # the sowtel.jit function
    step: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


#: ``enable(max_postmortems=...)``'s default: post-mortems a session writes at most (one per
#: failure episode, for its first step).
MAX_POSTMORTEMS = 3

#: Logging steps whose records are still on their way that the flight recorder holds at most:
#: beyond it, the next ``sowtel.jit`` call waits for the dispatcher to check the oldest one
#: (so that the first bad step is never let go unchecked), for :data:`HOLD_TIMEOUT` s at most.
HOLD = 8
HOLD_TIMEOUT = 30.0


class Guard:
    """A session's policy for non-finite records, its health stride and its flight recorder.

    The session calls :meth:`observe` on the dispatcher thread with the records it converted,
    ``sowtel.jit`` calls :meth:`before_call` on the training thread before each step (and
    :meth:`sent` once the step's records are on their way), and ``flush()`` calls
    :meth:`deliver`. Make one with :func:`make_guard`.

    **Episodes.** A failure episode begins at the first step whose records hold a NaN or an
    infinity and lasts until a step's records are all finite again. It gives one alert (its
    first step's first non-finite record) and one post-mortem (of that step, while fewer than
    ``max_postmortems`` were written in the session): a run that stays NaN from step 10 on
    gives one warning and one folder, ``step_10``.
    """

    def __init__(self, on_nonfinite: Any, health_every: int | None, keep: int,
                 record_donated: bool, logdir: str | None, tags: Sequence[str],
                 max_postmortems: int = MAX_POSTMORTEMS) -> None:
        self.on_nonfinite = on_nonfinite
        self.health_every = health_every
        self.keep = keep
        self.record_donated = record_donated
        self.logdir = logdir
        self.tags = tuple(tags)
        self.max_postmortems = max_postmortems
        self._lock = threading.Lock()
        self._checked = threading.Condition(self._lock)  # notified when _checked_step grows
        # Alerts not delivered yet, oldest first: a later episode's alert never replaces an
        # earlier one that the training thread has not seen.
        self._pending: collections.deque[Record] = collections.deque()
        self._last_bad = -1  # the latest step that held a non-finite record
        self._finite: list[int] = []  # steps after it seen all finite (the first 16)
        self._earliest: float = math.inf  # the earliest step alerted
        self._checked_step = -1  # the highest step whose records were seen
        self._kept: collections.deque[_Kept] = collections.deque()
        self._staged: _Kept | None = None  # this call's arguments, until its records leave
        self._said: set[str] = set()  # advice given once a session
        #: Asks the dispatcher to convert what waits now (set by the session).
        self.hurry: Callable[[], None] = lambda: None
        self.callback_errors = 0
        self.episodes = 0
        self.postmortems: list[Path] = []

    # -- the dispatcher thread ----------------------------------------------------------------

    def observe(self, records: Sequence[Record] | RecordBatch) -> None:
        """Looks for the first non-finite record of each step checked; alerts on the first
        step of each failure episode. Never raises.

        Of a :class:`~sowtel.to_records.RecordBatch`, only the tables that hold a NaN or an
        infinity are turned into records."""
        try:
            firsts: dict[int, Record | None] = {}
            if isinstance(records, RecordBatch):
                records = self._candidates(records, firsts)
            for r in records:
                if is_nonfinite(r):
                    if firsts.get(r.step) is None:
                        firsts[r.step] = r
                else:
                    firsts.setdefault(r.step, None)
            alerts = []
            with self._lock:
                for step in sorted(firsts):
                    first = firsts[step]
                    if first is None:
                        if step > self._last_bad and step not in self._finite:
                            # All finite so far (a callback step's records may come in
                            # several batches): it ends the episode once a later step is bad.
                            bisect.insort(self._finite, step)
                            del self._finite[16:]
                        continue
                    if step in self._finite:
                        self._finite.remove(step)
                    if step <= self._last_bad:
                        # An earlier step than the latest bad one, come by another path (a
                        # step streamed before one sowtel.export-ed, converted after it):
                        # an alert if earlier than every alert so far: the earliest wins.
                        new = step < self._earliest
                    else:
                        # A later step: a new episode unless it continues the last one (no
                        # all-finite step between them).
                        new = self._last_bad < 0 or bool(self._finite and
                                                         self._finite[0] < step)
                        self._last_bad = step
                        self._finite = [f for f in self._finite if f > step]
                    if new:
                        self._earliest = min(self._earliest, step)
                        self.episodes += 1
                        alerts.append(first)
                if firsts and max(firsts) > self._checked_step:
                    self._checked_step = max(firsts)
                if not callable(self.on_nonfinite):
                    for record in alerts:  # in step order: the earliest is delivered first
                        at = bisect.bisect([r.step for r in self._pending], record.step)
                        self._pending.insert(at, record)
                self._checked.notify_all()
            if callable(self.on_nonfinite):
                for record in alerts:
                    self.on_nonfinite(record)
        except Exception:  # noqa: BLE001 - a user's callable must not stop the dispatcher
            self.callback_errors += 1
            if self.callback_errors == 1:
                logger.exception("sowtel: the on_nonfinite callable raised (counted; logged "
                                 "once)")

    def _candidates(self, batch: RecordBatch, firsts: dict[int, Record | None]) -> list[Record]:
        out: list[Record] = []
        for part in batch.parts:
            if isinstance(part, SiteColumns):
                if not part.any_nonfinite and part.values is None:  # full values: look inside
                    firsts.setdefault(part.step, None)
                    continue
                out.extend(part.records())
            else:
                out.extend(part)
        return out

    # -- the training thread ------------------------------------------------------------------

    def health_at(self, step: int) -> bool:
        """Whether a ``sowtel.jit`` step at which no site logs checks the sites' health."""
        return self.health_every is not None and step % self.health_every == 0

    def before_call(self, fun: Any, step: int, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        """Delivers a pending alert (may raise :class:`NonFiniteError`), then stages the call's
        arguments if the flight recorder is on (kept by :meth:`sent`)."""
        self._staged = None
        if self._pending:
            self.deliver()
        if self.keep:
            self._stage(fun, step, args, kwargs)

    def sent(self, step: int) -> None:
        """The staged call's records are on their way: its arguments are kept until they are
        checked. Holds at most :data:`HOLD` such steps: beyond, waits for the dispatcher."""
        staged, self._staged = self._staged, None
        if staged is None or staged.step != step:
            return
        kept = self._kept
        kept.append(staged)
        unchecked = sum(1 for k in kept if k.step > self._checked_step)
        if unchecked > HOLD // 2:
            self.hurry()
        if unchecked > HOLD and "hold" not in self._said:  # after one timeout, never again
            oldest = next(k.step for k in kept if k.step > self._checked_step)
            with self._lock:
                waited = self._checked.wait_for(lambda: self._checked_step >= oldest,
                                                HOLD_TIMEOUT)
            if not waited:
                self._once("hold", "sowtel: the flight recorder waited %.0f s for the records "
                           "of step %s to be checked; from now on it lets go of the oldest "
                           "steps it holds unchecked without waiting (logged once)",
                           HOLD_TIMEOUT, oldest)
        self._trim()

    def _trim(self) -> None:
        # Keep the K newest steps whose records were checked, every step still unchecked (at
        # most HOLD + 1 of them, see sent), and the steps whose alert waits for delivery.
        kept = self._kept
        checked = self._checked_step
        pinned = {r.step for r in list(self._pending)}
        n_checked = sum(1 for k in kept if k.step <= checked)
        unchecked = len(kept) - n_checked
        out: list[_Kept] = []
        while kept and (n_checked > self.keep or unchecked > HOLD + 1):
            k = kept.popleft()
            if k.step in pinned:
                out.append(k)
                continue
            if k.step <= checked:
                n_checked -= 1
            else:
                unchecked -= 1
        kept.extendleft(reversed(out))

    def deliver(self) -> None:
        """Acts on the pending non-finite records, oldest first: post-mortem, then warn or
        raise (one alert a call under ``"raise"``; the rest wait for the next call)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                record = self._pending[0]
            folder = self._postmortem(record) if self.keep else None
            with self._lock:
                self._pending.popleft()
            if self.on_nonfinite == "raise":
                raise NonFiniteError(record, folder)
            if self.on_nonfinite in ("warn", "dump"):
                where = f"; post-mortem in {folder}" if folder else ""
                warnings.warn(describe(record) + where, NonFiniteWarning, stacklevel=3)

    # -- the flight recorder -------------------------------------------------------------------

    def _stage(self, fun: Any, step: int, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        options = getattr(fun, "_options", {})
        if options.get("donate_argnums") is not None or options.get("donate_argnames"):
            if not self.record_donated:
                return
            # The call deletes donated buffers: keep copies (device time, documented).
            args, kwargs = jax.tree_util.tree_map(
                lambda x: x.copy() if isinstance(x, jax.Array) else x, (args, kwargs))
        self._staged = _Kept(fun, step, args, kwargs)

    def _once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._said:
            self._said.add(what)
            logger.warning(message, *args)

    def _postmortem(self, record: Record) -> Path | None:
        if len(self.postmortems) >= self.max_postmortems:
            self._once("cap", "sowtel: %d post-mortems written (max_postmortems=%d): no more "
                       "in this session (logged once)", len(self.postmortems),
                       self.max_postmortems)
            return None
        kept = next((k for k in reversed(self._kept) if k.step == record.step), None)
        if kept is None:
            self._once("gone", "sowtel: no post-mortem for step %s: the flight recorder does "
                       "not hold its arguments (a function that donates them is recorded "
                       "with record_donated=True; logged once)", record.step)
            return None
        try:
            folder = write_postmortem(getattr(kept.fun, "_fun", kept.fun), kept.args,
                                      kept.kwargs, step=kept.step, record=record,
                                      logdir=self.logdir or os.getcwd(), tags=self.tags,
                                      locate=self.on_nonfinite == "dump")
            self.postmortems.append(folder)
            return folder
        except Exception:  # noqa: BLE001 - a failed post-mortem must not stop training
            logger.exception("sowtel: the post-mortem of step %s failed", record.step)
            return None


    def postmortem_of_alert(self, alert: Any) -> Path | None:
        """The post-mortem of the step an alert rule fired at (``sowtel.alerts``, action
        ``"dump"``), from the flight recorder; None if it no longer keeps that step."""
        kept = next((k for k in reversed(self._kept) if k.step == alert.step), None)
        if kept is None:
            return None
        try:
            folder = write_postmortem(getattr(kept.fun, "_fun", kept.fun), kept.args,
                                      kept.kwargs, step=kept.step, record=None,
                                      logdir=self.logdir or os.getcwd(), tags=self.tags,
                                      locate=False, alert=str(alert))
            self.postmortems.append(folder)
            return folder
        except Exception:  # noqa: BLE001 - a failed post-mortem must not stop training
            logger.exception("sowtel: the post-mortem of step %s failed", alert.step)
            return None


def write_postmortem(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                     step: int, record: Record | None, logdir: str, tags: Sequence[str],
                     locate: bool, alert: str | None = None) -> Path:
    """Runs ``fun(*args, **kwargs)`` again through ``save_intermediates`` (streaming off) and
    writes ``<logdir>/postmortem/step_<step>/step_<step>.safetensors``; with ``locate``, also
    ``locate.txt`` / ``locate.json`` from :func:`sowtel.locate_nonfinite`. Returns the folder.
    """
    from sowtel.capture import save_intermediates
    from sowtel.context import CONTEXT
    from sowtel.dumps import dump
    from sowtel.locate import locate_nonfinite

    folder = Path(logdir) / "postmortem" / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    inter: dict[str, Any] = {}
    with CONTEXT(None):  # the re-run streams nothing
        for tag in tags:
            _, found = save_intermediates(fun, tag=tag, duplicates="number")(*args, **kwargs)
            inter.update(found)
        report = locate_nonfinite(fun, tag=tags[0])(*args, **kwargs) if locate else None
    metadata: dict[str, Any] = {"postmortem_step": step}
    if record is not None:
        metadata["alert"] = describe(record)
    elif alert is not None:
        metadata["alert"] = alert
    if report is not None:
        metadata["first_nonfinite_operation"] = str(report.first) if report.first else None
        (folder / "locate.txt").write_text(str(report) + "\n")
        (folder / "locate.json").write_text(json.dumps({
            "nonfinite_inputs": list(report.nonfinite_inputs),
            "events": [_event_json(e) for e in report.events]}, indent=1) + "\n")
    dump(inter, str(folder) + os.sep, step=step, metadata=metadata)
    return folder


def _event_json(event: Any) -> dict[str, Any]:
    d = dataclasses.asdict(event)
    d["frames"] = [list(f) for f in event.frames]
    d["shape"], d["iteration"], d["loops"] = (list(event.shape), list(event.iteration),
                                              list(event.loops))
    return d


def make_guard(on_nonfinite: Any, health_every: Any, flight_recorder: Any, record_donated: Any,
               logdir: str | None, tags: Sequence[str],
               max_postmortems: Any = MAX_POSTMORTEMS) -> Guard | None:
    """Checks ``enable``'s non-finite options and returns the session's guard (None if unused).

    Example:
        >>> make_guard(None, None, None, False, None, ("intermediates",)) is None
        True
        >>> make_guard("dump", 1, None, False, "runs", ("intermediates",)).keep
        1
    """
    if not (on_nonfinite in POLICIES or callable(on_nonfinite)):
        raise errors.BadOptionError(
            "on_nonfinite", on_nonfinite, "is not a policy: use None, 'warn', 'raise', "
            "'dump' or a callable that takes the Record")
    health = None if health_every is None else _check_int(health_every, "health_every", 1)
    if flight_recorder is None:
        keep = 1 if on_nonfinite == "dump" else 0
    else:
        keep = _check_int(flight_recorder, "flight_recorder", 0)
    if not isinstance(record_donated, bool):
        raise errors.BadOptionError(
            "enable record_donated", record_donated, "must be True or False")
    most = _check_int(max_postmortems, "max_postmortems", 0, "post-mortems a session writes")
    if on_nonfinite is None and health is None and keep == 0:
        return None
    return Guard(on_nonfinite, health, keep, record_donated, logdir, tags, most)
