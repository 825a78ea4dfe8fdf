"""Alert rules over any series a session streams: ``sowtel.alert`` and ``enable(alerts=...)``.

A rule watches the series whose names match its pattern: a site's statistic (``stat`` of its
records in ``mode``, one series per position: a scan iteration, a shard) or a number logged
with :func:`sowtel.log`. It fires at the first step where the value is

- ``above`` a bound, or ``below`` one;
- a ``spike``: more than ``spike`` robust standard deviations from the median of the series'
  last ``window`` values (the robust standard deviation is 1.4826 times their median absolute
  deviation, MAD), in either direction.

Each alert goes to the rule's ``action``, else the session's ``on_alert``: ``"warn"`` (an
:class:`AlertWarning` at the next ``sowtel.jit`` call or ``flush()``), ``"raise"`` (that call
raises :class:`AlertError`), ``"dump"`` (a post-mortem of the step from the flight recorder,
then a warning naming its folder), or a callable that receives the :class:`Alert` on the
dispatcher thread. Every alert is also logged once on the ``sowtel`` logger and counted in
``sowtel.status()["alerts"]``; ``session.alerts`` lists them.

How the rules stay quiet when nothing is wrong:

- **One alert an episode.** A series that fired stays quiet while it stays past the same
  bound (or goes on spiking), and fires again once it came back within the rule, or when it
  crosses the other bound.
- **History first.** A spike needs a history: the rule judges a value against at least
  ``min(window, 20)`` earlier values of its series, so the first steps of a run never fire.
- **Flat windows.** A window whose MAD is 0 (a constant series, or one that repeats one value
  more than half the time) is judged by its mean absolute deviation from the median instead
  (times 1.2533, the same scale for normal noise); a window of one value repeated throughout
  spikes at any change beyond ``1e-6`` of its magnitude.
- **Non-finite values** are not judged here: ``on_nonfinite`` (:mod:`sowtel.nonfinite`) is the
  rule for them, and its :class:`~sowtel.NonFiniteError` is one kind of :class:`AlertError`.

The rules run on the dispatcher thread, on the statistics the device already sends: no device
time, and a few microseconds a series a step on the host (``benchmarks/bench_alerts.py``).

Example:
    >>> import sowtel
    >>> rule = sowtel.alert("train/loss", spike=6.0, window=20)
    >>> seen = []
    >>> with sowtel.enable(exporter="memory", alerts=[rule], on_alert=seen.append):
    ...     for step in range(30):
    ...         _ = sowtel.log({"train/loss": 10.0 if step == 25 else 1.0 + 0.01 * (step % 3)},
    ...                        step=step)
    ...     _ = sowtel.flush()
    >>> [(a.name, a.step, a.kind) for a in seen]
    [('train/loss', 25, 'spike')]
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import fnmatch
import logging
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from sowtel import errors
from sowtel.records import BASE_MODES, LOG_TAG, SCALAR_SUMMARY, STAT_KEYS, Record

__all__ = ["ACTIONS", "Alert", "AlertError", "AlertRule", "AlertWarning", "Alerts", "alert",
           "make_alerts"]

logger = logging.getLogger("sowtel")

#: What an alert does, besides being logged and counted (or a callable taking the Alert).
ACTIONS = ("warn", "raise", "dump")
#: The statistics a rule may watch: a record's statistics, and a logged number's ``value``.
STATS = (*STAT_KEYS, "value")
#: Robust standard deviations from the MAD, and from the mean absolute deviation, for normal
#: noise.
MAD_SCALE, MEAN_ABS_SCALE = 1.4826, 1.2533
#: The fewest earlier values a spike is judged against (or the window, if smaller).
MIN_HISTORY = 20
# A record name's characters: a name's, and the %XX of an escaped pytree key
# (sowtel.naming.leaf_segment).
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-/%]*")


class AlertError(RuntimeError):
    """An alert rule fired with the action ``"raise"``; raised by the next ``sowtel.jit`` call
    or ``flush()``. :class:`~sowtel.NonFiniteError` is one kind of it.

    Attributes:
      alert: the :class:`Alert` (None for a :class:`~sowtel.NonFiniteError`, which carries
        its record instead).

    Example:
        >>> import sowtel
        >>> with sowtel.enable(exporter="memory", alerts=[sowtel.alert("loss", above=1.0)],
        ...                    on_alert="raise"):
        ...     try:
        ...         _ = sowtel.log({"loss": 2.0}, step=4)
        ...     except sowtel.AlertError as e:
        ...         print(e.alert.step, e.alert.kind)
        4 above
    """

    def __init__(self, alert: Alert | None, message: str | None = None) -> None:
        self.alert = alert
        super().__init__(message if message is not None else str(alert))


class AlertWarning(RuntimeWarning):
    """An alert rule fired with the action ``"warn"`` or ``"dump"``."""


@dataclasses.dataclass(frozen=True)
class AlertRule:
    """A rule made by :func:`alert`; see there for the fields."""

    pattern: str | Callable[[str], bool]
    mode: str | None = None
    stat: str | None = None
    above: float | None = None
    below: float | None = None
    spike: float | None = None
    window: int = 100
    action: str | Callable[[Alert], Any] | None = None

    def matches(self, name: str) -> bool:
        """Whether the series ``name`` is one this rule watches."""
        if callable(self.pattern):
            return bool(self.pattern(name))
        return fnmatch.fnmatchcase(name, self.pattern)

    def __str__(self) -> str:
        parts = [repr(self.pattern) if isinstance(self.pattern, str) else "<callable>"]
        for key in ("mode", "stat", "above", "below", "spike"):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{key}={value!r}")
        if self.spike is not None:
            parts.append(f"window={self.window}")
        return f"alert({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class Alert:
    """One firing of a rule.

    Attributes:
      step, name, mode, index: the record's (``index``: its scan iteration or shard, or None).
      stat: the statistic judged; value: its value at ``step``.
      kind: ``"above"``, ``"below"`` or ``"spike"``.
      rule: the :class:`AlertRule`.
      median, deviation: for a spike, the window's median and robust standard deviation.
      postmortem: the post-mortem folder, once ``"dump"`` wrote one.
    """

    step: int
    name: str
    mode: str
    index: Any
    stat: str
    value: float
    kind: str
    rule: AlertRule
    median: float | None = None
    deviation: float | None = None
    postmortem: Any = None

    def __str__(self) -> str:
        where = f"{self.name!r} ({self.mode}"
        where += ")" if self.index is None else f", index {self.index})"
        if self.kind == "spike":
            assert self.median is not None and self.deviation is not None
            z = abs(self.value - self.median) / self.deviation if self.deviation else math.inf
            what = (f"{z:.3g} robust standard deviations from the median {self.median:.6g} of "
                    f"its last values (the rule allows {self.rule.spike:g})")
        else:
            bound = self.rule.above if self.kind == "above" else self.rule.below
            what = f"{self.kind} {bound:g}"
        return (f"alert at step {self.step}: {where} {self.stat} = {self.value:.6g}, {what}; "
                f"rule {self.rule}")


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise errors.BadOptionError(f"sowtel.alert {what}", value, "must be a number")
    if not math.isfinite(float(value)):
        raise errors.BadOptionError(f"sowtel.alert {what}", value, "must be finite")
    return float(value)


def _check_mode(mode: Any) -> str | None:
    if mode is None:
        return None
    if not isinstance(mode, str) or not all(m in BASE_MODES for m in mode.split(".")):
        raise errors.BadOptionError(
            "sowtel.alert mode", mode, "is not a mode: use 'primal', 'tangent', 'cotangent' "
            "or a composition such as 'cotangent.tangent' (or None: every mode)")
    return mode


def _check_pattern(pattern: Any) -> str | Callable[[str], bool]:
    if callable(pattern):
        return pattern  # type: ignore[no-any-return]
    if not isinstance(pattern, str) or not pattern:
        raise errors.BadOptionError(
            "sowtel.alert pattern", pattern, "must be a non-empty glob over series names "
            "(such as 'train/loss' or 'blocks/*') or a callable taking the name")
    literal = re.sub(r"\[[^\]]*\]|[*?]", "", pattern)
    if not _NAME_CHARS.fullmatch(literal) or pattern.startswith("/") or "//" in pattern:
        raise errors.BadOptionError(
            "sowtel.alert pattern", pattern, "can never match a series: names hold letters, "
            "digits and _ - . / with no empty segment, and %XX for an escaped pytree key "
            "(globs add * ? [...])")
    return pattern


def alert(pattern: str | Callable[[str], bool], *, mode: str | None = None,
          stat: str | None = None, above: float | None = None, below: float | None = None,
          spike: float | None = None, window: int = 100,
          action: str | Callable[[Alert], Any] | None = None) -> AlertRule:
    """A rule for ``sowtel.enable(alerts=[...])`` (see :mod:`sowtel.alerts`).

    Args:
      pattern: a glob over series names (site names, ``sowtel.log`` names), or a callable
        taking the name.
      mode: only records of this mode (None: every mode).
      stat: the statistic judged (a key of ``Record.stats``, or ``"value"``). Default: the
        value of a logged number, else ``"l2"``.
      above, below: bounds; the rule fires at the first step whose value is past one.
      spike: fires at a value more than ``spike`` robust standard deviations from the median
        of the series' last ``window`` values.
      window: how many earlier values a spike is judged against (at least 2).
      action: ``"warn"``, ``"raise"``, ``"dump"`` or a callable taking the :class:`Alert`;
        None takes the session's ``on_alert``.

    Raises:
      ValueError: a rule with no bound and no spike, ``window < 2``, ``spike <= 0``, an
        unknown statistic, mode or action, or a pattern that can never match a name.

    Example:
        >>> import sowtel
        >>> rule = sowtel.alert("blocks/*", mode="cotangent", stat="l2", above=1e3)
        >>> print(rule)
        alert('blocks/*', mode='cotangent', stat='l2', above=1000.0)
        >>> rule.window, rule.action
        (100, None)
    """
    pattern = _check_pattern(pattern)
    mode = _check_mode(mode)
    if stat is not None and stat not in STATS:
        raise errors.BadOptionError("sowtel.alert stat", stat, f"is not a statistic: use one of "
                                    f"{', '.join(STATS)}")
    above_f, below_f = _number(above, "above"), _number(below, "below")
    spike_f = _number(spike, "spike")
    if above_f is None and below_f is None and spike_f is None:
        raise ValueError(
            f"sowtel.alert({pattern!r}) has no bound: give above=..., below=... or spike=... "
            "(a rule fires when its series crosses one)")
    if spike_f is not None and spike_f <= 0:
        raise errors.BadOptionError(
            "sowtel.alert spike", spike, "must be > 0: it is a number of robust "
            "standard deviations")
    if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 2:
        raise errors.BadOptionError(
            "sowtel.alert window", window, "must be an int >= 2: the values a "
            "spike is judged against")
    _check_action(action, "sowtel.alert action")
    return AlertRule(pattern, mode, stat, above_f, below_f, spike_f, int(window), action)


def _check_action(action: Any, what: str) -> None:
    if action is None or callable(action) or action in ACTIONS:
        return
    raise errors.BadOptionError(what, action, "is not an action: use 'warn', 'raise', 'dump' or a "
                                "callable that takes the Alert")


class _Window:
    """The last ``size`` values of a series: in arrival order, and sorted (median and MAD in
    O(log size) after an O(size) insertion)."""

    __slots__ = ("size", "order", "sorted")

    def __init__(self, size: int) -> None:
        self.size = size
        self.order: collections.deque[float] = collections.deque()
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.order)

    def push(self, x: float) -> None:
        if len(self.order) == self.size:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
        self.order.append(x)
        bisect.insort(self.sorted, x)

    def median(self) -> float:
        s, n = self.sorted, len(self.sorted)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def mad(self, med: float) -> float:
        """The median of |x - med| over the window, from the sorted values: the deviations of
        the values below the middle, read from the middle outwards, and of those above are
        two ascending sequences, whose merged middle is found by bisection."""
        s, n = self.sorted, len(self.sorted)
        h = n // 2
        lo = lambda i: med - s[h - 1 - i]  # noqa: E731 - i in [0, h)
        hi = lambda j: s[h + j] - med  # noqa: E731 - j in [0, n - h)
        kth = lambda k: _kth(k, lo, h, hi, n - h)  # noqa: E731
        return kth(n // 2) if n % 2 else 0.5 * (kth(n // 2 - 1) + kth(n // 2))


def _kth(k: int, a: Callable[[int], float], na: int, b: Callable[[int], float],
         nb: int) -> float:
    """The ``k``-th smallest (from 0) of two ascending sequences ``a`` (length ``na``) and
    ``b`` (``nb``): the split taking ``i`` from ``a`` and ``k + 1 - i`` from ``b``, bisected."""
    lo, hi = max(0, k + 1 - nb), min(k + 1, na)
    while lo < hi:
        i = (lo + hi) // 2
        j = k + 1 - i
        if j > 0 and b(j - 1) > a(i):
            lo = i + 1
        else:
            hi = i
    i, j = lo, k + 1 - lo
    return max(a(i - 1) if i > 0 else -math.inf, b(j - 1) if j > 0 else -math.inf)


@dataclasses.dataclass
class _Series:
    window: _Window | None
    firing: str | None = None  # the kind of the episode going on
    last_step: int | None = None


class Alerts:
    """A session's alert rules: :meth:`observe` (the dispatcher thread) judges each converted
    batch, :meth:`deliver` (the training thread: ``sowtel.jit`` calls and ``flush()``) acts on
    what fired. Make one with :func:`make_alerts`.

    Attributes:
      rules: the rules, in the order given.
      fired: the alerts so far, oldest first (the last ``keep``; ``count`` counts them all).
    """

    def __init__(self, rules: Sequence[AlertRule], on_alert: str | Callable[[Alert], Any],
                 keep: int = 1000) -> None:
        self.rules = tuple(rules)
        self.on_alert = on_alert
        self.fired: collections.deque[Alert] = collections.deque(maxlen=keep)
        self.count = 0
        self.callback_errors = 0
        self.postmortem: Callable[[Alert], Any] | None = None  # set by the session for "dump"
        self._series: dict[tuple[int, str, str, Any, str], _Series] = {}
        self._matches: dict[tuple[int, str, str], bool] = {}
        self._pending: collections.deque[Alert] = collections.deque()
        self._outbox: collections.deque[Alert] = collections.deque()  # for the exporters
        self._lock = threading.Lock()
        self._judging = threading.RLock()  # a callable action may log again

    # -- the dispatcher thread ----------------------------------------------------------------

    def observe(self, records: Iterable[Record]) -> None:
        """Judges every record of ``records`` (a batch: its columnar parts are read as
        columns) against the rules. Never raises; a rule's callable action runs here."""
        try:
            parts = getattr(records, "parts", None)
            with self._judging:  # the dispatcher's batches, and sowtel.log on its own thread
                if parts is None:
                    self._observe_records(records)
                    return
                for part in parts:
                    if isinstance(part, tuple):
                        self._observe_records(part)
                    else:
                        self._observe_columns(part)
        except Exception:  # noqa: BLE001 - alerts must never stop the dispatcher
            self.callback_errors += 1
            if self.callback_errors == 1:
                logger.exception("sowtel: an alert rule failed (counted; logged once)")

    def _watching(self, r: int, rule: AlertRule, name: str, mode: str) -> bool:
        key = (r, name, mode)
        found = self._matches.get(key)
        if found is None:
            found = self._matches[key] = ((rule.mode is None or rule.mode == mode)
                                          and rule.matches(name))
        return found

    def _observe_records(self, records: Iterable[Record]) -> None:
        for rec in records:
            for r, rule in enumerate(self.rules):
                if not self._watching(r, rule, rec.name, rec.mode):
                    continue
                stat = rule.stat or _default_stat(rec.summary, rec.tag)
                value = rec.stats.get(stat) if rec.stats else None
                if value is None and rec.value is not None and rec.value.size == 1 and (
                        stat in ("value", "mean")):
                    value = float(np.asarray(rec.value, np.float64).reshape(()))
                if value is not None:
                    self._judge(r, rule, rec.name, rec.mode, rec.index, stat, float(value),
                                rec.step)

    def _observe_columns(self, part: Any) -> None:
        keys = part.stat_keys
        for r, rule in enumerate(self.rules):
            stat = rule.stat or _default_stat(part.summary, part.tag)
            if stat not in keys:
                continue
            column = keys.index(stat)
            for leaf, name in enumerate(part.names):
                if not self._watching(r, rule, name, part.mode):
                    continue
                values = part.stats[:, leaf, column]
                for p, index in enumerate(part.index):
                    self._judge(r, rule, name, part.mode, index, stat, float(values[p]),
                                part.step)

    def _judge(self, r: int, rule: AlertRule, name: str, mode: str, index: Any, stat: str,
               value: float, step: int) -> None:
        if not math.isfinite(value):
            return  # the non-finite rule's (on_nonfinite)
        key = (r, name, mode, index, stat)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(
                _Window(rule.window) if rule.spike is not None else None)
        if series.last_step is not None and step <= series.last_step:
            return  # a step seen already (a record sent twice): judged once
        series.last_step = step
        kind = None
        median = deviation = None
        if rule.above is not None and value > rule.above:
            kind = "above"
        elif rule.below is not None and value < rule.below:
            kind = "below"
        window = series.window
        if window is not None:
            if kind is None and len(window) >= min(rule.window, MIN_HISTORY):
                median = window.median()
                deviation = _deviation(window, median)
                assert rule.spike is not None
                if abs(value - median) > rule.spike * deviation:
                    kind = "spike"
            window.push(value)
        if kind == series.firing:
            return  # the same episode
        series.firing = kind
        if kind is None:
            return
        self._fire(Alert(step, name, mode, index, stat, value, kind, rule,
                         median if kind == "spike" else None,
                         deviation if kind == "spike" else None))

    def _fire(self, found: Alert) -> None:
        self.count += 1
        self.fired.append(found)
        logger.warning("sowtel: %s", found)
        with self._lock:
            self._outbox.append(found)
        action = found.rule.action if found.rule.action is not None else self.on_alert
        if callable(action):
            try:
                action(found)
            except Exception:  # noqa: BLE001 - a user's callable must not stop the dispatcher
                self.callback_errors += 1
                if self.callback_errors == 1:
                    logger.exception("sowtel: an alert's callable raised (counted; logged once)")
            return
        with self._lock:
            self._pending.append(found)

    # -- the training thread ------------------------------------------------------------------

    def deliver(self) -> None:
        """Acts on the alerts that fired since the last call, oldest first: ``"dump"`` writes
        the post-mortem, then ``"warn"`` and ``"dump"`` warn; ``"raise"`` raises
        :class:`AlertError` for the first (the rest wait for the next call)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                found = self._pending.popleft()
            action = found.rule.action if found.rule.action is not None else self.on_alert
            if action == "dump":
                folder = self.postmortem(found) if self.postmortem is not None else None
                found = dataclasses.replace(found, postmortem=folder)
                where = (f"; post-mortem in {folder}" if folder else
                         "; no post-mortem: the flight recorder no longer keeps that step")
                warnings.warn(str(found) + where, AlertWarning, stacklevel=3)
            elif action == "raise":
                raise AlertError(found)
            else:
                warnings.warn(str(found), AlertWarning, stacklevel=3)

    def take_fired(self) -> list[Alert]:
        """The alerts fired since the last call, oldest first, for the exporters that show
        alerts (their ``write_alerts``; the dispatcher calls this).

        Example:
            >>> rules = make_alerts([alert("loss", above=1.0)], "warn")
            >>> rules.observe([Record(name="loss", mode="primal", tag=LOG_TAG, step=3,
            ...                       index=None, wall_time=0.0, summary=SCALAR_SUMMARY,
            ...                       shape=(), dtype="float32", stats={"value": 2.0})])
            >>> [(a.step, a.kind) for a in rules.take_fired()], rules.take_fired()
            ([(3, 'above')], [])
        """
        with self._lock:
            out = list(self._outbox)
            self._outbox.clear()
        return out

    @property
    def pending(self) -> bool:
        """Whether alerts wait for :meth:`deliver`."""
        return bool(self._pending)

    @property
    def dumps(self) -> bool:
        """Whether any rule (or the session's ``on_alert``) writes post-mortems."""
        return self.on_alert == "dump" or any(r.action == "dump" for r in self.rules)


def _default_stat(summary: str, tag: str) -> str:
    return "value" if summary == SCALAR_SUMMARY or tag == LOG_TAG else "l2"


def _deviation(window: _Window, median: float) -> float:
    mad = window.mad(median)
    if mad > 0:
        return MAD_SCALE * mad
    mean_abs = sum(abs(x - median) for x in window.order) / len(window)
    if mean_abs > 0:
        return MEAN_ABS_SCALE * mean_abs
    return 1e-6 * max(abs(median), 1e-30)


def make_alerts(alerts: Any, on_alert: Any) -> Alerts | None:
    """Checks ``enable``'s ``alerts`` and ``on_alert`` and returns the session's rules (None if
    there are none).

    Example:
        >>> make_alerts(None, "warn") is None
        True
        >>> len(make_alerts([alert("loss", above=10.0)], "raise").rules)
        1
    """
    _check_action(on_alert, "enable on_alert")
    if on_alert is None:
        raise errors.BadOptionError("enable on_alert", None, "is not an action: use 'warn', "
                                    "'raise', 'dump' or a callable that takes the Alert")
    if alerts is None:
        return None
    if isinstance(alerts, AlertRule):
        alerts = [alerts]
    rules = list(alerts) if isinstance(alerts, list | tuple) else None
    if rules is None or not all(isinstance(a, AlertRule) for a in rules):
        raise errors.BadOptionError(
            "enable alerts", alerts, "must be a list of sowtel.alert(...) rules, e.g. "
            "alerts=[sowtel.alert('train/loss', spike=6.0)]")
    if not rules:
        return None
    return Alerts(rules, on_alert)
