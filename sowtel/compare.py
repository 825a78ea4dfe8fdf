"""Comparing runs: the first step, site and layer where two runs diverge.

Two runs that should match (a refactor, a new JAX version, bf16 for f32, a different sharding
or number of hosts) do not. The statistics sowtel streamed say where they part: every site's,
at every step, in the order the program computed them. :func:`compare_runs` reads two runs as
the jsonl or TensorBoard exporter wrote them and returns the first record whose statistics
differ beyond tolerance, in execution order: by step, then within the step the forward pass in
program order, the backward pass in the order it ran (the last layer's cotangent first), and
inside a scan iteration after iteration (:func:`sowtel.records.order_key`). Everything computed
after that record depends on it, so it is where to look.

Example:
    >>> import tempfile, jax, jax.numpy as jnp, sowtel
    >>> def loss(w, x):
    ...     h = sowtel.sow(jnp.tanh(x @ w), "hidden")
    ...     return jnp.sum(sowtel.sow(h * 2.0, "out") ** 2)
    >>> step = sowtel.jit(jax.grad(loss))
    >>> runs = []
    >>> for nudge in (0.0, 1e-3):
    ...     logdir = tempfile.mkdtemp()
    ...     with sowtel.enable(exporter="jsonl", logdir=logdir):
    ...         for k in range(3):
    ...             w = jnp.ones((3, 2)) + (nudge if k == 2 else 0.0)
    ...             _ = step(w, jnp.ones((4, 3)))
    ...     runs.append(logdir)
    >>> div = sowtel.compare_runs(*runs)
    >>> div.step, div.name, div.mode
    (2, 'hidden', 'primal')
    >>> sowtel.compare_runs(runs[0], runs[0]) is None
    True

From the shell, ``sowtel diff RUN_A RUN_B`` prints it, with the records around it, and exits 1
(0 when the runs agree; ``sowtel diff`` of two dumps compares their arrays, as before).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sowtel import errors
from sowtel._run_read import (
    NONFINITE,
    Entry,
    Key,
    Run,
    StepData,
    entries,
    open_run,
    run_steps,
)
from sowtel.records import STAT_KEYS, Index, index_text

__all__ = ["Divergence", "RunComparison", "Row", "compare_runs", "diff_runs",
           "configure_diff", "run_diff"]

#: How many divergent records after the first a :class:`Divergence` lists in ``context``.
CONTEXT = 5
#: Records shown before and after the first divergence in ``sowtel diff``'s table.
BEFORE, AFTER = 3, 6
_PROCESSES = {"one": "", "per process": ", compared process by process",
              "merged": ", processes merged (they differ between the runs)"}
# Which statistic to name when several differ equally: the order of STAT_KEYS, counts last.
_STAT_RANK = {k: i for i, k in enumerate((*STAT_KEYS, NONFINITE, "value"))}


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs part: the first record, in execution order, whose statistics differ.

    Attributes:
      step: the step.
      name, mode, index: the record (``index``: its scan iteration or shard, else None).
      stat: the statistic that differs most (relative to its size): ``"mean"``, ``"std"``,
        ``"l2"``, ... or ``"nonfinite"`` (the count of NaN and infinite elements); None when
        the record is in one run only at this step (``absent`` says which lacks it).
      a, b: that statistic in run A and run B (None where absent).
      process_index: the JAX process whose record it is.
      context: the next divergent records, in execution order (up to five, from this step
        and the next compared one), as :class:`Divergence` objects of their own.
      only_in_a, only_in_b: sites (``"name (mode)"``) found in one run only, compared nowhere.
      absent: ``"A"`` or ``"B"``: the run without this record at this step, else None.

    Example:
      >>> d = Divergence(7, "blocks/h", "primal", 3, "std", 0.5, 0.55)
      >>> str(d)
      'step 7, blocks/h[3] (primal): std 0.5 in A, 0.55 in B (relative difference 0.0909)'
    """

    step: int
    name: str
    mode: str
    index: Index
    stat: str | None
    a: float | None
    b: float | None
    process_index: int = 0
    context: tuple[Divergence, ...] = ()
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    absent: str | None = None

    @property
    def site(self) -> str:
        """The record as ``sowtel diff`` names it: ``blocks/h[3] (primal)``."""
        return f"{self.name}{index_text(self.index)} ({self.mode})"

    @property
    def rel(self) -> float:
        """``|a - b| / max(|a|, |b|)``: 1.0 for a sign change, inf for NaN against a number."""
        if self.a is None or self.b is None:
            return math.inf
        return _rel(self.a, self.b)

    def __str__(self) -> str:
        if self.absent is not None:
            other = "B" if self.absent == "A" else "A"
            return (f"step {self.step}, {self.site}: in {other} only (run {self.absent} did "
                    "not record it at this step)")
        if self.stat is None:
            kept = ", ".join((*self.only_in_a, *self.only_in_b)[:3])
            return f"sites in one run only: {kept}"
        return (f"step {self.step}, {self.site}: {self.stat} {_num(self.a)} in A, "
                f"{_num(self.b)} in B (relative difference {self.rel:.3g})")


@dataclasses.dataclass(frozen=True)
class Row:
    """A record of the divergent step, as ``sowtel diff``'s table shows it."""

    name: str
    mode: str
    index: Index
    verdict: str  # "same", "differs", "first", "only in A", "only in B"
    stat: str | None
    a: float | None
    b: float | None


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """What :func:`diff_runs` found (``sowtel diff`` prints :meth:`format`).

    Attributes:
      a, b: the runs' paths; kinds: their kinds (``"jsonl"`` or ``"tensorboard"``).
      rtol, atol: the tolerances.
      divergence: the first divergence, or None.
      steps: steps compared (present in both runs, up to the divergence); sites: distinct
        record names compared; records: records compared in the last step.
      only_a, only_b: the first step each run has that the other lacks beyond (or between)
        the compared ones, else None.
      rows: the divergent step's records around the divergence, in execution order.
      processes: how processes were paired: ``"one"``, ``"per process"`` or ``"merged"``.
      only_in_a, only_in_b: sites (``"name (mode)"``) found in one run only. Between a jsonl
        and a TensorBoard run they are not a divergence: the TensorBoard exporter leaves some
        out (a scalar site's cotangent, unless ``scalar_derivatives=True``).
    """

    a: str
    b: str
    kinds: tuple[str, str]
    rtol: float
    atol: float
    divergence: Divergence | None
    steps: int
    sites: int
    records: int
    only_a: int | None = None
    only_b: int | None = None
    rows: tuple[Row, ...] = ()
    processes: str = "one"
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()

    def format(self) -> str:
        """The text ``sowtel diff`` prints for runs."""
        kinds = self.kinds[0] if self.kinds[0] == self.kinds[1] else " vs ".join(self.kinds)
        lines = [f"sowtel diff A={self.a} B={self.b}  (rtol={self.rtol:g}, atol={self.atol:g}; "
                 f"{kinds}{_PROCESSES[self.processes]})"]
        d = self.divergence
        beyond = [f"{run} has steps the other lacks from step {k}, not compared"
                  for run, k in (("A", self.only_a), ("B", self.only_b)) if k is not None]
        if d is None:
            lines.append(f"no divergence in {self.steps} steps, {self.sites} sites "
                         f"({self.records} records a step)")
            lines += beyond
            for run, sites in (("A", self.only_in_a), ("B", self.only_in_b)):
                if sites:
                    lines.append(f"sites only in {run} (not compared): {', '.join(sites[:8])}"
                                 + (f" and {len(sites) - 8} more" if len(sites) > 8 else ""))
            return "\n".join(lines)
        if d.stat is None and d.absent is None:
            lines.append(f"no divergence in {self.steps} steps, {self.sites} sites, but:")
        else:
            where = "" if self.processes == "one" else f" in process {d.process_index}"
            lines.append(f"first divergence{where}: {d}")
        if self.rows:
            stat = d.stat or "mean"  # as rows() shows them
            lines.append("")
            lines.append(f"step {d.step} in execution order:")
            table = [["", "site", stat + " in A", stat + " in B", "rel. diff", ""]]
            for row in self.rows:
                mark = ">>" if row.verdict == "first" else ""
                note = {"first": "<- first divergence", "same": "",
                        "differs": f"differs ({row.stat})"}.get(row.verdict, row.verdict)
                rel = "" if row.a is None or row.b is None else f"{_rel(row.a, row.b):.3g}"
                table.append([mark, f"{row.name}{index_text(row.index)} ({row.mode})",
                              _num(row.a), _num(row.b), rel, note])
            lines += _table(table)
        if d.context:
            lines.append("")
            lines.append("next divergent records:")
            lines += [f"  {c}" for c in d.context]
        for run, sites in (("A", d.only_in_a), ("B", d.only_in_b)):
            if sites:
                lines.append(f"sites only in {run}: {', '.join(sites[:8])}"
                             + (f" and {len(sites) - 8} more" if len(sites) > 8 else ""))
        lines += beyond
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A plain-JSON form (``sowtel diff --json``)."""
        d = self.divergence
        return {"a": self.a, "b": self.b, "kinds": list(self.kinds), "rtol": self.rtol,
                "atol": self.atol, "steps": self.steps, "sites": self.sites,
                "records": self.records, "only_a": self.only_a, "only_b": self.only_b,
                "processes": self.processes, "only_in_a": list(self.only_in_a),
                "only_in_b": list(self.only_in_b),
                "divergence": None if d is None else _divergence_json(d)}


def _divergence_json(d: Divergence) -> dict[str, Any]:
    return {"step": d.step, "name": d.name, "mode": d.mode,
            "index": list(d.index) if isinstance(d.index, tuple) else d.index,
            "stat": d.stat, "a": _json_num(d.a), "b": _json_num(d.b),
            "process_index": d.process_index, "absent": d.absent,
            "only_in_a": list(d.only_in_a), "only_in_b": list(d.only_in_b),
            "context": [_divergence_json(c) for c in d.context]}


def _json_num(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _rel(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


# ----------------------------------------------------------------------------- comparing


class _Tolerance:
    __slots__ = ("rtol", "atol", "f32")

    def __init__(self, rtol: float, atol: float, f32: bool) -> None:
        # TensorBoard keeps float32: against a jsonl run, a number differs from its float32
        # rounding by up to 2**-24 of it, which is no divergence.
        self.rtol, self.atol, self.f32 = max(rtol, 2.0 ** -23) if f32 else rtol, atol, f32

    def stored(self, x: float) -> float:
        """``x`` as both runs hold it: float32 when one is a TensorBoard run and one is not."""
        return float(np.float32(x)) if self.f32 else x

    def worst(self, sa: dict[str, float], sb: dict[str, float]
              ) -> tuple[str, float, float] | None:
        """The statistic, of those both records have, that differs most beyond tolerance."""
        found: tuple[float, int, str, float, float] | None = None
        for k in sa.keys() & sb.keys():
            x, y = sa[k], sb[k]
            if x == y or (x != x and y != y):
                continue
            if math.isclose(x, y, rel_tol=self.rtol, abs_tol=self.atol):
                continue
            rank = (-_rel(x, y), _STAT_RANK.get(k, len(_STAT_RANK)))
            if found is None or rank < found[:2]:
                found = (*rank, k, x, y)
        return None if found is None else found[2:]  # type: ignore[return-value]


def _index_key(index: Index) -> tuple[int, ...]:
    if index is None:
        return ()
    return index if isinstance(index, tuple) else (index,)


class _Pair:
    """Two runs' streams of steps (one process of each, or all), compared step by step."""

    def __init__(self, tol: _Tolerance, mixed: bool, flat: bool) -> None:
        self.tol = tol
        self.mixed = mixed  # kinds differ: what one run keeps and the other not is no divergence
        self.flat = flat or mixed  # blocks differ between the runs: compare record by record
        self.seen_a: set[tuple[str, str]] = set()
        self.seen_b: set[tuple[str, str]] = set()
        self.only_a: dict[tuple[str, str], int] = {}
        self.only_b: dict[tuple[str, str], int] = {}
        self.names: set[str] = set()
        self.steps = self.records = 0
        self._keys_a: Any = None
        self._keys_b: Any = None

    def _learn(self, a: StepData, b: StepData) -> None:
        # The sites each run has had so far: what a run lacks at one step is a divergence
        # only where that run has recorded the site at some step.
        if a.blocks.keys() != self._keys_a:
            self._keys_a = set(a.blocks)
            self.seen_a.update(k[:2] for k in a.blocks)
            self.names.update(k[0] for k in a.blocks)
        if b.blocks.keys() != self._keys_b:
            self._keys_b = set(b.blocks)
            self.seen_b.update(k[:2] for k in b.blocks)
            self.names.update(k[0] for k in b.blocks)
        for site in [s for s in self.only_a if s in self.seen_b]:
            del self.only_a[site]
        for site in [s for s in self.only_b if s in self.seen_a]:
            del self.only_b[site]

    def step(self, a: StepData, b: StepData) -> list[tuple[tuple[Any, ...], Divergence]]:
        """The records of one step that diverge, each with its sort key."""
        self._learn(a, b)
        self.steps += 1
        tol = self.tol
        found: list[tuple[tuple[Any, ...], Divergence]] = []
        pairs: list[tuple[dict[Key, Entry], dict[Key, Entry]]] = []
        if self.flat:
            pairs.append((a.records(), b.records()))
            self.records = len(pairs[0][0])
        else:
            blocks_b = b.blocks
            count = 0
            for bk, ba in a.blocks.items():
                bb = blocks_b.get(bk)
                count += ba[1]
                if bb is not None and ba[0] is not None and ba[0] == bb[0]:
                    continue
                pairs.append((entries(ba), {} if bb is None else entries(bb)))
            if len(blocks_b) != len(a.blocks) or pairs:
                for bk, bb in blocks_b.items():
                    if bk not in a.blocks:
                        pairs.append(({}, entries(bb)))
            self.records = count
        for ea, eb in pairs:
            for key, x in ea.items():
                y = eb.get(key)
                if y is None:
                    self._absent(key, x, a.step, "B", self.seen_b, self.only_a, found)
                    continue
                worst = tol.worst(x.stats, y.stats)
                if worst is not None:
                    stat, va, vb = worst
                    found.append(((x.order, x.process_index, key[:2], _index_key(key[2])),
                                  Divergence(a.step, key[0], key[1], key[2], stat, va, vb,
                                             x.process_index)))
            for key, y in eb.items():
                if key not in ea:
                    self._absent(key, y, a.step, "A", self.seen_a, self.only_b, found)
        found.sort(key=lambda f: f[0])
        return found

    def _absent(self, key: Key, entry: Entry, step: int, absent: str,
                seen: set[tuple[str, str]], only: dict[tuple[str, str], int],
                found: list[tuple[tuple[Any, ...], Divergence]]) -> None:
        if key[:2] in seen and not self.mixed:
            found.append(((entry.order, entry.process_index, key[:2], _index_key(key[2])),
                          Divergence(step, key[0], key[1], key[2], None, None, None,
                                     entry.process_index, absent=absent)))
        else:
            only.setdefault(key[:2], step)

    def rows(self, a: StepData, b: StepData, first: Divergence) -> tuple[Row, ...]:
        """The step's records around ``first``, in execution order."""
        ra, rb = a.records(), b.records()
        listed: list[tuple[tuple[Any, ...], Row]] = []
        stat = first.stat or "mean"
        for key in ra.keys() | rb.keys():
            x, y = ra.get(key), rb.get(key)
            entry = x if x is not None else y
            assert entry is not None
            sort = (entry.order, entry.process_index, key[:2], _index_key(key[2]))
            is_first = (key == (first.name, first.mode, first.index)
                        and entry.process_index == first.process_index)
            if x is None or y is None:
                listed.append((sort, Row(*key, "first" if is_first else (
                    "only in A" if y is None else "only in B"), None, None, None)))
                continue
            worst = self.tol.worst(x.stats, y.stats)
            shown = stat if stat in x.stats and stat in y.stats else None
            va = self.tol.stored(x.stats[shown]) if shown else None
            vb = self.tol.stored(y.stats[shown]) if shown else None
            verdict = "first" if is_first else ("same" if worst is None else "differs")
            listed.append((sort, Row(*key, verdict, None if worst is None else worst[0],
                                     va, vb)))
        listed.sort(key=lambda r: r[0])
        at = next((i for i, (_, r) in enumerate(listed) if r.verdict == "first"), 0)
        return tuple(r for _, r in listed[max(0, at - BEFORE):at + AFTER + 1])


def _sites(only: dict[tuple[str, str], int]) -> tuple[str, ...]:
    return tuple(f"{name} ({mode})" for (name, mode), _ in sorted(only.items(),
                                                                   key=lambda kv: kv[1]))


class _Outcome(NamedTuple):
    divergence: Divergence | None
    sort: tuple[Any, ...]
    pair: _Pair
    rows: tuple[Row, ...]
    only_a: int | None
    only_b: int | None


def _compare_streams(steps_a: Iterator[StepData], steps_b: Iterator[StepData],
                     pair: _Pair) -> _Outcome:
    a, b = next(steps_a, None), next(steps_b, None)
    only_a = only_b = None
    while a is not None and b is not None:
        if a.step != b.step:
            if a.step < b.step:
                only_a = a.step if only_a is None else only_a
                a = next(steps_a, None)
            else:
                only_b = b.step if only_b is None else only_b
                b = next(steps_b, None)
            continue
        found = pair.step(a, b)
        if found:
            sort, first = found[0]
            context = [d for _, d in found[1:CONTEXT + 1]]
            if len(context) < CONTEXT:
                context += _next_divergent(steps_a, steps_b, pair, CONTEXT - len(context))
            first = dataclasses.replace(first, context=tuple(context),
                                        only_in_a=_sites(pair.only_a),
                                        only_in_b=_sites(pair.only_b))
            return _Outcome(first, (first.step, *sort), pair, pair.rows(a, b, first),
                            only_a, only_b)
        a, b = next(steps_a, None), next(steps_b, None)
    # One run ended: what the other has beyond it is not compared.
    if a is not None and only_a is None:
        only_a = a.step
    if b is not None and only_b is None:
        only_b = b.step
    if (pair.only_a or pair.only_b) and not pair.mixed:
        first_step = min((*pair.only_a.values(), *pair.only_b.values()))
        name, mode = min((*pair.only_a, *pair.only_b),
                         key=lambda s: (pair.only_a.get(s, pair.only_b.get(s)), s))
        d = Divergence(first_step, name, mode, None, None, None, None,
                       only_in_a=_sites(pair.only_a), only_in_b=_sites(pair.only_b))
        return _Outcome(d, (first_step, (sys.maxsize,)), pair, (), only_a, only_b)
    return _Outcome(None, (), pair, (), only_a, only_b)


def _next_divergent(steps_a: Iterator[StepData], steps_b: Iterator[StepData], pair: _Pair,
                    n: int) -> list[Divergence]:
    """Up to ``n`` divergent records of the next step both runs have."""
    a, b = next(steps_a, None), next(steps_b, None)
    while a is not None and b is not None and a.step != b.step:
        if a.step < b.step:
            a = next(steps_a, None)
        else:
            b = next(steps_b, None)
    if a is None or b is None:
        return []
    steps = pair.steps
    found = [d for _, d in pair.step(a, b)[:n]]
    pair.steps = steps  # counted as compared up to the divergence only
    return found


def _check_tolerance(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.BadOptionTypeError(what, value, "must be a number such as 1e-5")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise errors.BadOptionError(what, value, "must be a finite number >= 0, such as 1e-5")
    return v


def _pairs(ra: Run, rb: Run) -> tuple[str, list[tuple[list[Any], list[Any]]]]:
    pa, pb = set(ra.processes), set(rb.processes)
    if pa == pb:
        how = "one" if len(pa) == 1 else "per process"
        return how, [(ra.processes[k], rb.processes[k]) for k in sorted(pa, key=lambda k: k or 0)]
    # Different processes (a run on another number of hosts): each run's records as one. A
    # record is named by its site, mode and index (a shard's is its global shard number), so
    # records of any process meet their counterparts.
    every_a = [s for k in sorted(pa, key=lambda k: k or 0) for s in ra.processes[k]]
    every_b = [s for k in sorted(pb, key=lambda k: k or 0) for s in rb.processes[k]]
    return "merged", [(every_a, every_b)]


def diff_runs(run_a: Any, run_b: Any, *, rtol: float = 1e-5,
              atol: float = 0.0) -> RunComparison:
    """Compares two runs step by step; returns a :class:`RunComparison` (see
    :func:`compare_runs`, whose answer is its ``divergence``), with the counts and the records
    around the divergence that ``sowtel diff`` prints.

    Example:
      >>> import tempfile
      >>> from sowtel.exporters.jsonl import JsonlExporter
      >>> from sowtel.records import Record
      >>> logdir = tempfile.mkdtemp()
      >>> jsonl = JsonlExporter(logdir=logdir)
      >>> jsonl.write([Record(name="h", mode="primal", tag="intermediates", step=0, index=None,
      ...                     wall_time=0.0, summary="stats", shape=(), dtype="float32",
      ...                     stats={"mean": 1.0})])
      >>> jsonl.close()
      >>> print(diff_runs(logdir, logdir).format().splitlines()[-1])
      no divergence in 1 steps, 1 sites (1 records a step)
    """
    rtol = _check_tolerance(rtol, "rtol")
    atol = _check_tolerance(atol, "atol")
    ra, rb = open_run(run_a, "run_a"), open_run(run_b, "run_b")
    mixed = ra.kind != rb.kind
    how, pairs = _pairs(ra, rb)
    outcomes = []
    for sources_a, sources_b in pairs:
        pair = _Pair(_Tolerance(rtol, atol, mixed), mixed, how == "merged")
        outcomes.append(_compare_streams(run_steps(sources_a), run_steps(sources_b), pair))
    if not any(o.pair.steps for o in outcomes) or not any(
            {n for n, _ in o.pair.seen_a} & {n for n, _ in o.pair.seen_b} for o in outcomes):
        _no_common_sites(ra, rb, outcomes)
    found = [o for o in outcomes if o.divergence is not None]
    best = min(found, key=lambda o: o.sort) if found else outcomes[0]
    steps = max(o.pair.steps for o in outcomes)
    names: set[str] = set().union(*(o.pair.names for o in outcomes))
    only_a = [o.only_a for o in outcomes if o.only_a is not None]
    only_b = [o.only_b for o in outcomes if o.only_b is not None]
    return RunComparison(str(ra.path), str(rb.path), (ra.kind, rb.kind), rtol, atol,
                         best.divergence, steps, len(names),
                         sum(o.pair.records for o in outcomes), min(only_a, default=None),
                         min(only_b, default=None), best.rows, how,
                         tuple(sorted({s for o in outcomes for s in _sites(o.pair.only_a)})),
                         tuple(sorted({s for o in outcomes for s in _sites(o.pair.only_b)})))


def _no_common_sites(ra: Run, rb: Run, outcomes: list[_Outcome]) -> None:
    sa = sorted({n for o in outcomes for n, _ in o.pair.seen_a})
    sb = sorted({n for o in outcomes for n, _ in o.pair.seen_b})
    if not any(o.pair.steps for o in outcomes):
        raise errors.BadRunError(
            f"runs {str(ra.path)!r} and {str(rb.path)!r}", "have no step in common (or one "
            "holds no records): compare runs of the same training, logged at the same steps")
    raise errors.BadRunError(
        f"runs {str(ra.path)!r} and {str(rb.path)!r}", f"have no site in common (A: "
        f"{', '.join(sa[:5]) or 'none'}; B: {', '.join(sb[:5]) or 'none'}): they are runs of "
        "different models, or were logged with different tags or filters")


def compare_runs(run_a: Any, run_b: Any, *, rtol: float = 1e-5,
                 atol: float = 0.0) -> Divergence | None:
    """The first divergence between two runs, or None when they agree.

    ``run_a`` and ``run_b`` are the folders the jsonl or tensorboard exporter wrote (their
    ``logdir``: one run, or a run of several processes, or one process's ``process_<k>``
    folder), or one jsonl or event file. A folder holding both kinds is read from its jsonl
    files. Steps both runs have are compared in order, each step's records in execution order
    (:func:`sowtel.records.order_key`); a record diverges when one of the statistics both runs
    kept differs by more than ``math.isclose(a, b, rel_tol=rtol, abs_tol=atol)`` allows (NaN
    matches NaN), or when its count of NaN and infinite elements differs. Every statistic a
    site streams counts: a record can diverge in ``std`` with an equal ``mean``.

    - A run that stops earlier is compared up to its last step. Steps one run has and the
      other lacks are skipped (they are counted in :func:`diff_runs`).
    - A record one run lacks at a step where it has recorded that site before is a divergence
      (``absent`` names the run: a ``cond`` branch that did not run, say). Sites one run never
      recorded are listed in ``only_in_a`` / ``only_in_b``; runs that differ only in those give
      a :class:`Divergence` with ``stat`` None naming the first.
    - Runs of several processes are compared process by process (``process_<k>`` with
      ``process_<k>``); runs with different processes (another number of hosts) as one,
      records meeting their counterparts by site, mode and index.
    - A jsonl run against a TensorBoard run compares the statistics the TensorBoard exporter
      kept (by default ``mean``, ``std``, ``min``, ``max``, ``l2`` of sites outside scans,
      all of them inside), at float32, as it stores them; sites it does not write are listed,
      not divergences.

    Raises ``FileNotFoundError`` for a missing path, ``ValueError`` for a folder that holds no
    run (another tool's event files, no files at all), runs with no site or step in common,
    or a file holding two runs one after the other. Files cut short are read up to their last
    whole record, with a warning.

    Example:
      >>> compare_runs("runs/baseline", "runs/bf16")  # doctest: +SKIP
      Divergence(step=7, name='blocks/h', mode='primal', index=3, stat='std', ...)
    """
    return diff_runs(run_a, run_b, rtol=rtol, atol=atol).divergence


# ----------------------------------------------------------------------------- CLI


def configure_diff(parser: argparse.ArgumentParser) -> None:
    """Adds ``sowtel diff``'s arguments to ``parser``."""
    parser.add_argument("a", metavar="A", help="a run's folder (or a dump, or a folder of dumps)")
    parser.add_argument("b", metavar="B", help="the run (or dump) to compare it with")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default 0 for runs, 1e-8 for dumps)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _is_run(path: str) -> bool:
    """Whether ``path`` is a run (a jsonl or event file, or a folder holding a run)."""
    p = Path(path)
    if p.is_file():
        return p.name.endswith(".jsonl") or "tfevents" in p.name
    try:
        open_run(p, "run")
    except (OSError, ValueError):
        return False
    return True


def _holds_dumps(path: str) -> bool:
    """Whether the folder ``path`` holds files named as sowtel dumps (``step_<k>.*``)."""
    return any(child.name.startswith("step_") for child in Path(path).iterdir())


def run_diff(args: argparse.Namespace) -> int:
    """Runs ``sowtel diff``: 0 when A and B agree, 1 when they differ, 2 on bad input.

    Two runs (folders the jsonl or tensorboard exporter wrote) are compared with
    :func:`diff_runs`; two dumps or folders of dumps with :func:`sowtel.postmortem.diff_dumps`.
    """
    from sowtel.postmortem import diff_dumps, format_diff, printable

    def fail(message: str) -> int:
        print(f"sowtel diff: error: {printable(message)}", file=sys.stderr)
        return 2

    for path in (args.a, args.b):
        if not Path(path).exists():
            return fail(f"{path!r} does not exist: give two runs' folders (or two dumps)")
    runs = [_is_run(p) for p in (args.a, args.b)]
    if all(runs):
        try:
            report = diff_runs(args.a, args.b, rtol=1e-5 if args.rtol is None else args.rtol,
                               atol=0.0 if args.atol is None else args.atol)
        except (OSError, TypeError, ValueError) as e:
            return fail(str(e))
        print(json.dumps(report.to_json(), indent=2) if args.json else
              "\n".join(printable(line) for line in report.format().splitlines()))
        return 0 if report.divergence is None else 1
    for what, path, run in (("A", args.a, runs[0]), ("B", args.b, runs[1])):
        if Path(path).is_dir() and not run and not _holds_dumps(path):
            try:
                open_run(path, what)
            except (OSError, ValueError) as e:
                return fail(f"{e}; nor does it hold sowtel dumps (step_<k>.safetensors)")
    if any(runs):
        return fail(f"{'A' if runs[0] else 'B'} is a run and {'B' if runs[0] else 'A'} holds "
                    "dumps: compare two runs, or two dumps")
    try:
        dumps = diff_dumps(args.a, args.b, rtol=1e-5 if args.rtol is None else args.rtol,
                           atol=1e-8 if args.atol is None else args.atol)
    except (OSError, ValueError) as e:
        return fail(str(e))
    print(json.dumps(dumps.to_json(), indent=2) if args.json else format_diff(dumps))
    return 0 if dumps.equal else 1
