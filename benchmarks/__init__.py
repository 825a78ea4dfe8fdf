"""sowtel's benchmarks: overhead and throughput, as ratios of variants timed side by side.

Every number is a ratio of variants measured in one process, interleaved (A B C A B C ...,
or bracketed by a baseline: B A B C B ...), after warm-up and compilation, with
``block_until_ready`` on every step; a ratio is the median over rounds of the per-round ratio,
so slow drift of the machine (other processes, frequency scaling) cancels. Absolute times are
printed too, but only ratios are compared with targets.

Run everything (``--quick`` for a short smoke run, ``--markdown FILE`` to write the tables)::

    python -m benchmarks [--quick] [--markdown docs/benchmarks-results.md]

A benchmark module is a ``benchmarks/bench_*.py`` with ``main(argv=None)``; it may also have
``run(quick: bool) -> list[Table]``, which the runner prefers, so its tables join the markdown.

This module holds what the benchmark modules share: :func:`interleave` (the timing loop),
:class:`Timing`, :class:`Table`, :func:`normalized_hlo`, :func:`hlo_structure` and
:func:`machine`.

Example:
    >>> from benchmarks import interleave
    >>> timings = interleave({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))},
    ...                      rounds=3, steps=2)
    >>> timings["b"].ratio_to(timings["a"]) > 0
    True
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Timing", "Table", "interleave", "normalized_hlo", "machine", "fmt_time",
           "fmt_ratio", "add_common_arguments", "write_markdown", "hlo_structure", "calibration",
           "module_main"]


@dataclasses.dataclass
class Timing:
    """The timed steps of one variant.

    Attributes:
      name: the variant.
      rounds: per round, the seconds of each timed step.
      drains: per round, the seconds of the drains after its steps (``sowtel.flush()`` and the
        like): work the variant left behind that its steps did not wait for.
      bracket_of: the baseline variant timed right before and right after this one in each
        round (``interleave(..., baseline=...)``), or None.
      bracket: per round, the baseline's mean step time around this variant, without and with
        its drains.
    """

    name: str
    rounds: list[list[float]] = dataclasses.field(default_factory=list)
    drains: list[float] = dataclasses.field(default_factory=list)
    bracket_of: str | None = None
    bracket: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def round_means(self, *, with_drain: bool = False) -> list[float]:
        """Per round, the mean step time (with the round's drains shared over its steps).

        A mean, not a median, within a round: with ``every=N`` one step in N does the work, and
        a median of the round's steps would hide it. Rounds of N steps each contain one.
        """
        return [(sum(steps) + (drain if with_drain else 0.0)) / len(steps)
                for steps, drain in zip(self.rounds, self.drains, strict=True)]

    def per_step(self, *, with_drain: bool = False) -> float:
        """The median over rounds of the mean step time, in seconds."""
        return statistics.median(self.round_means(with_drain=with_drain))

    @property
    def steps(self) -> int:
        """How many steps were timed, in all rounds."""
        return sum(len(r) for r in self.rounds)

    def ratios_to(self, base: Timing, *, with_drain: bool = False) -> list[float]:
        """Per-round ratios of this variant's mean step to ``base``'s in the same round.

        When ``base`` bracketed this variant (``interleave(..., baseline=base.name)``), the
        ratio is to the baseline's steps right around it, not to all of the round's.
        """
        mine = self.round_means(with_drain=with_drain)
        if self.bracket_of == base.name and self.bracket:
            theirs = [b[1] if with_drain else b[0] for b in self.bracket]
        else:
            theirs = base.round_means(with_drain=with_drain)
        return [a / b for a, b in zip(mine, theirs, strict=True)]

    def ratio_to(self, base: Timing, *, with_drain: bool = False) -> float:
        """The median over rounds of the per-round ratio to ``base``."""
        return statistics.median(self.ratios_to(base, with_drain=with_drain))

    def ratio_spread(self, base: Timing, *, with_drain: bool = False) -> tuple[float, float]:
        """The first and third quartiles of the per-round ratios (equal with one round)."""
        r = sorted(self.ratios_to(base, with_drain=with_drain))
        if len(r) < 2:
            return r[0], r[0]
        q = statistics.quantiles(r, n=4, method="inclusive")
        return q[0], q[2]


def interleave(
    variants: Mapping[str, Callable[[], Any]],
    *,
    rounds: int,
    steps: int | Mapping[str, int],
    warmup: int = 2,
    drains: Mapping[str, Callable[[], Any]] | None = None,
    baseline: str | None = None,
) -> dict[str, Timing]:
    """Times ``variants`` side by side: ``rounds`` rounds of ``steps`` steps of each.

    Each variant is a callable that runs one step and returns once its results are ready (call
    ``jax.block_until_ready`` inside). ``steps`` is a count for all variants or a mapping from
    variant to count (a variant it does not name gets the mapping's ``"*"``). The order of
    variants rotates from round to round, so no variant always runs right after the same other
    one. After a variant's steps its drain (if given) runs, timed apart.

    With ``baseline`` (one of the variants), every other variant is bracketed by the baseline:
    ``B V1 B V2 B ...``, the baseline running as many steps as its neighbour, and each
    variant's ratio to the baseline is taken to the baseline steps right around it. On a
    machine whose load drifts (other processes), this pairs measurements seconds apart.

    Example:
        >>> t = interleave({"noop": lambda: None}, rounds=2, steps=3, warmup=0)
        >>> [len(r) for r in t["noop"].rounds]
        [3, 3]
        >>> t = interleave({"a": lambda: None, "b": lambda: None}, rounds=1, steps=2, warmup=0,
        ...                baseline="a")
        >>> len(t["a"].rounds[0]), t["b"].bracket_of
        (4, 'a')
    """
    names = list(variants)
    counts = ({n: steps.get(n, steps.get("*", 1)) for n in names} if isinstance(steps, Mapping)
              else dict.fromkeys(names, steps))
    if rounds < 1 or min(counts.values(), default=1) < 1:
        raise ValueError(f"rounds={rounds} and steps={steps} must all be at least 1")
    if baseline is not None and baseline not in variants:
        raise ValueError(f"baseline={baseline!r} is not one of the variants {names}")
    drains = drains or {}
    for name in names:
        for _ in range(warmup):
            variants[name]()
        if name in drains:
            drains[name]()
    timings = {name: Timing(name) for name in names}
    clock = time.perf_counter

    def block(name: str, count: int) -> tuple[float, float]:
        """Runs ``count`` steps of ``name`` into this round; returns the mean step time without
        and with the drain."""
        step = variants[name]
        times = []
        for _ in range(count):
            t0 = clock()
            step()
            times.append(clock() - t0)
        t0 = clock()
        if name in drains:
            drains[name]()
        drain = clock() - t0
        timings[name].rounds[-1].extend(times)
        timings[name].drains[-1] += drain
        return sum(times) / count, (sum(times) + drain) / count

    others = [n for n in names if n != baseline]
    for r in range(rounds):
        for t in timings.values():
            t.rounds.append([])
            t.drains.append(0.0)
        order = others[r % len(others):] + others[:r % len(others)] if others else []
        if baseline is None:
            for name in order:
                block(name, counts[name])
            continue
        before: tuple[int, tuple[float, float]] | None = None
        for name in order:
            k = counts[name]
            if before is None or before[0] != k:
                before = (k, block(baseline, k))
            block(name, k)
            after = block(baseline, k)
            timings[name].bracket_of = baseline
            timings[name].bracket.append(((before[1][0] + after[0]) / 2,
                                          (before[1][1] + after[1]) / 2))
            before = (k, after)
        if not order:
            block(baseline, counts[baseline])
    return timings


def fmt_time(seconds: float) -> str:
    """``1.23 ms``, ``4.5 µs``, ``1.20 s``: three significant digits in a fitting unit."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    raise AssertionError("unreachable")


def fmt_ratio(ratio: float, spread: tuple[float, float] | None = None) -> str:
    """``1.032×`` (with ``[1.01–1.05]``, the quartiles over rounds, when given)."""
    text = f"{ratio:.3f}×"
    if spread is not None:
        text += f" [{spread[0]:.2f}–{spread[1]:.2f}]"
    return text


@dataclasses.dataclass
class Table:
    """A result table, printed as aligned text and written as markdown.

    Example:
        >>> t = Table("demo", ["variant", "ratio"], [["a", "1.00×"]], notes=["a note"])
        >>> print(t.markdown().splitlines()[2])
        | variant | ratio |
    """

    title: str
    columns: list[str]
    rows: list[list[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row {cells!r} has {len(cells)} cells, the table "
                             f"{self.title!r} has {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def text(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
                  for i, c in enumerate(self.columns)]
        lines = [self.title, "=" * len(self.title)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True)))
        lines.append("  ".join("-" * w for w in widths))
        for row in self.rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        lines.extend(f"  * {n}" for n in self.notes)
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [f"#### {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)


_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def normalized_hlo(text: str) -> str:
    """Compiled HLO text without what differs between equal programs: the module's name,
    ``metadata={...}`` attributes (source lines, op names) and the source-location tables.

    Example:
        >>> normalized_hlo('HloModule jit_f, x=1\\n%a = f32[] add(%b, %c), metadata={op_name="f"}')
        'HloModule _, x=1\\n%a = f32[] add(%b, %c)'
    """
    lines = text.splitlines()
    out: list[str] = []
    in_table = False
    for line in lines:
        stripped = line.strip()
        if stripped in _TABLES:
            in_table = True
            continue
        if in_table:
            if not stripped:
                in_table = False
            continue
        if line.startswith("HloModule "):
            line = re.sub(r"^HloModule [^,\s]+", "HloModule _", line)
        out.append(_METADATA.sub("", line))
    return "\n".join(out).strip()


def hlo_structure(text: str, *, output_order: bool = True) -> str:
    """:func:`normalized_hlo` with every ``%name`` renamed by order of first appearance, and the
    parameters in computation signatures by position, so two programs that differ only in how
    XLA named their instructions compare equal. With ``output_order=False``, the operands of
    the entry computation's ``ROOT`` tuple are sorted too (the same outputs in another order).

    Example:
        >>> hlo_structure("%c.9 = f32[] constant(0)\\nROOT %t.1 = (f32[]) tuple(%c.9)")
        '%0 = f32[] constant(0)\\nROOT %1 = (f32[]) tuple(%0)'
    """
    names: dict[str, str] = {}

    def rename(match: re.Match[str]) -> str:
        return names.setdefault(match.group(0), f"%{len(names)}")

    def rename_params(match: re.Match[str]) -> str:
        position = iter(range(1 << 30))
        params = re.sub(r"[\w.\-]+(?=: )", lambda _: f"p{next(position)}", match.group(2))
        return f"{match.group(1)}({params}) -> "

    lines = []
    in_entry = False
    for line in normalized_hlo(text).splitlines():
        in_entry = line.startswith("ENTRY ") or (in_entry and line != "}")
        line = re.sub(r"^((?:ENTRY )?%\S+ )\((.*)\) -> ", rename_params, line)
        line = re.sub(r"%[\w.\-]+", rename, line)
        root = line.lstrip().startswith("ROOT ") and " tuple(" in line
        if not output_order and in_entry and root:
            head, _, operands = line.partition(" tuple(")
            ops = re.sub(r"/\*index=\d+\*/", "", operands.rstrip(")")).split(",")
            line = f"{head} tuple({', '.join(sorted(o.strip() for o in ops))})"
        lines.append(line)
    return "\n".join(lines)


def rss() -> int:
    """This process's resident memory in bytes (Linux's ``/proc``; 0 elsewhere).

    Example:
        >>> rss() >= 0
        True
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine() -> str:
    """One line about where the numbers come from: CPU, cores, load, Python, JAX."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import jax

    try:
        load = f"load average {os.getloadavg()[0]:.1f}"
    except OSError:
        load = "load unknown"
    return (f"{cpu}, {os.cpu_count()} cores ({load}), Python {platform.python_version()}, "
            f"jax {jax.__version__} on {jax.devices()[0].platform}")


def calibration() -> Table:
    """Reference costs of this machine, measured now: absolute times in the other tables scale
    with them (a loaded or slow machine shows larger absolute numbers, not larger ratios)."""
    import queue
    import threading

    import jax
    import numpy as np

    table = Table("Reference costs on this machine (measured now)", ["operation", "time"])

    def best(fn: Callable[[], Any], number: int, repeat: int = 5) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - t0) / number)
        return min(times)

    table.add("`sum(range(1_000_000))` (Python speed)",
              fmt_time(best(lambda: sum(range(10**6)), 3)))
    ping: queue.SimpleQueue[Any] = queue.SimpleQueue()
    pong: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def echo() -> None:
        while (item := ping.get()) is not None:
            pong.put(item)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()

    def round_trip() -> None:
        ping.put(1)
        pong.get()

    try:
        table.add("thread hand-off round trip (two Python threads)",
                  fmt_time(best(round_trip, 2000)))
    finally:
        ping.put(None)
        thread.join()
    big = np.ones(16 << 20, np.float32)
    copy = best(lambda: np.array(big, copy=True), 3)
    table.add("numpy copy of 64 MiB (fresh allocation)", f"{fmt_time(copy)} "
              f"({0.0625 / copy:.2f} GiB/s)")

    def noop(*_: Any) -> None:
        pass

    n = 32

    def callbacks(x: jax.Array) -> jax.Array:
        for i in range(n):
            jax.debug.callback(noop, x[i])
        return x

    x = jax.numpy.zeros((n,), jax.numpy.float32)
    with_cb = jax.jit(callbacks).lower(x).compile()
    without = jax.jit(lambda v: v).lower(x).compile()
    per_cb = (best(lambda: jax.block_until_ready(with_cb(x)), 20)
              - best(lambda: jax.block_until_ready(without(x)), 20)) / n
    table.add("`jax.debug.callback` of a scalar, per call", fmt_time(per_cb))
    return table


def add_common_arguments(parser: Any) -> None:
    """``--quick`` and ``--markdown FILE``, which every benchmark module accepts."""
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds: a smoke run, not a measurement")
    parser.add_argument("--markdown", metavar="FILE", default=None,
                        help="also write the result tables as markdown to FILE")


def module_main(argv: Sequence[str] | None, module: str, doc: str | None,
                tables: Callable[[Any], Iterable[Any]],
                arguments: Callable[[Any], None] | None = None) -> int:
    """The ``main`` of a benchmark module: ``--quick``, ``--markdown FILE`` (and the module's
    own ``arguments``), the machine line, then each table of ``tables(args)`` as it finishes.

    Example:
        >>> module_main(["--quick"], "bench_none", "Nothing.", lambda args: [])  # doctest: +SKIP
    """
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}",
                                     description=(doc or "").split("\n\n")[0])
    add_common_arguments(parser)
    if arguments is not None:
        arguments(parser)
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    done = []
    for table in tables(args):
        print("\n" + table.text(), flush=True)
        done.append(table)
    if args.markdown:
        write_markdown(args.markdown, done, header=f"Machine: {machine()}")
    return 0


def write_markdown(path: str, tables: Sequence[Table], *, header: str = "") -> None:
    """Writes ``tables`` (after ``header``) as one markdown file."""
    body = "\n\n".join(t.markdown() for t in tables)
    with open(path, "w", encoding="utf-8") as f:
        f.write((header + "\n\n" if header else "") + body + "\n")
