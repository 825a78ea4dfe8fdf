"""The two transports side by side: what streaming ``stats`` costs a training step.

Variants of one workload's training step, timed interleaved in this one process, each as a
ratio to the plain step (``jax.jit`` of the step without sows) run right around it:

- **plain**: ``jax.jit``, no sows;
- **disabled**: ``jax.jit`` of the step with sows, nothing enabled (the same program);
- **callback transport**: ``jax.jit`` with a session streaming ``stats`` every step (one host
  callback a site);
- **sowtel.jit**: the same session settings through ``sowtel.jit`` (summaries as outputs);
- **sowtel.jit, every=10**: one step in ten logs; the others run the plain program;
- **sowtel.jit, health every step only**: ``enable(every=10**9, health_every=1)``: every step
  sends every site's NaN / inf counts, and nothing else;
- **sowtel.jit, every=10, health every step**: ``health_every=1``: the nine steps in ten that
  log nothing send every site's NaN / inf counts;
- **sowtel.jit, every=10, flight recorder K=1**: keeps references to each call's arguments
  (``enable(flight_recorder=1)``); no device work is added;
- **sowtel.jit, histogram every step**: ``enable(summary="histogram")``: the stats plus 30
  bucket counts a site, every step;
- **sowtel.jit, stats, histograms every 10 steps**: ``enable(histogram_every=10)``: one logging
  step in ten sends histograms, the others stats (a separate cached program);
- **hand-written floor**: the same summaries (``sowtel.summaries.device_summary`` of every
  site's primal and cotangent) returned as outputs of a hand-written step, no sowtel at run time.
- **hand-written floor, sums unmasked**: the same, with the sums taken over each value as it
  is: what ``stats`` would cost if the sum-based statistics of a value holding a NaN or an
  infinity were NaN rather than those of its finite elements (the proposal in
  docs/benchmarks.md; not a sowtel summary).
- **hand-written floor, every=10**: the hand-written floor's program one step in ten, the plain
  step otherwise: the least that ``every=10`` can cost with these statistics (on XLA:CPU a
  program run once among another's steps costs more than the same program run step after step).
- **..., value read directly**: the callback transport, ``sowtel.jit`` and the floor with
  ``SOWTEL_SUMMARY_COPY=0``: the summaries read each sown value itself rather than the copy
  that keeps the program's own fusions, and so its results, as they are without sowtel
  (``sowtel.summaries.apart``): what that copy costs.

Workloads: the small MLP, the transformer block, and the GPT decoder (reduced on CPU; the full
size with ``--gpt-full``, for a GPU). Each session has its own memory exporter (bounded); the
variant about to run is made the active one, as a single training loop would have it. Records
per step are counted, so a variant that streamed nothing cannot pass for a fast one.

Run: ``python -m benchmarks.bench_jit [--quick] [--gpt-full] [--workload W] [--nonfinite]
[--histogram] [--copy] [--markdown FILE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import jax
import numpy as np

import sowtel
from benchmarks import (
    Table,
    fmt_ratio,
    fmt_time,
    interleave,
    module_main,
)
from benchmarks.workloads import (
    Workload,
    activate_session,
    gpt,
    gpt_reduced,
    make_returning_train_step,
    make_train_step,
    mlp,
    no_tap,
    transformer_block,
)
from sowtel._reductions import separate_moments
from sowtel.exporters.memory import MemoryExporter
from sowtel.summaries import device_summary, summary_form

__all__ = ["run", "main", "jit_table", "floor_step", "copy_cost_table"]

#: The targets on CPU, as ratios to the plain step.
TARGETS = {
    ("mlp", "sowtel.jit, stats every step"): 1.08,
    ("transformer", "sowtel.jit, stats every step"): 1.06,
    ("gpt", "sowtel.jit, stats every step"): 1.05,
    ("mlp", "callback transport, stats every step"): 1.25,
    ("*", "sowtel.jit, every=10"): 1.01,
    ("transformer", "sowtel.jit, health every step only"): 1.03,
}

#: The variants of ``--nonfinite``: what NaN checks cost (docs/debugging-nans.md).
NONFINITE_VARIANTS = (
    "plain", "sowtel.jit, every=10", "sowtel.jit, health every step only",
    "sowtel.jit, every=10, health every step", "sowtel.jit, every=10, flight recorder K=1",
)

#: The variants of ``--copy``: what reading each value through a copy costs (README, Speed).
COPY_VARIANTS = (
    "plain", "callback transport, stats every step",
    "callback transport, stats every step, value read directly",
    "sowtel.jit, stats every step", "sowtel.jit, stats every step, value read directly",
    "hand-written floor (summaries as outputs)", "hand-written floor, value read directly",
)

#: The variants of ``--histogram``: what histograms cost next to stats (docs/tensorboard.md).
HISTOGRAM_VARIANTS = (
    "plain", "sowtel.jit, stats every step", "sowtel.jit, histogram every step",
    "sowtel.jit, stats, histograms every 10 steps",
)


class Runner:
    """One variant: a step function, its own training state, and the session it streams to."""

    def __init__(self, fn: Callable[..., Any], work: Workload,
                 session: sowtel.Session | None, env: dict[str, str] | None = None) -> None:
        self.fn = fn
        self.session = session
        self.env = env or {}  # set around each call: read where the step is traced and lowered
        self.params, self.opt_state, self.batch = work.init()
        self.step = jax.numpy.int32(0)
        self.calls = 0
        self.cpu = 0.0  # process CPU seconds in its steps and drains (all threads)

    def __call__(self) -> None:
        start = time.process_time()
        activate_session(self.session)
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            out = jax.block_until_ready(
                self.fn(self.params, self.opt_state, self.batch, self.step))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.params, self.opt_state = out[0], out[1]
        self.calls += 1
        self.cpu += time.process_time() - start

    def drain(self) -> None:
        if self.session is not None:
            start = time.process_time()
            self.session.flush()
            self.cpu += time.process_time() - start

    def records(self) -> int:
        return 0 if self.session is None else int(self.session.status()["records"])


def floor_step(work: Workload, copy: bool = True) -> Callable[..., Any]:
    """The hand-written floor: ``jax.jit`` of ``work``'s training step that also returns
    ``device_summary(v, "stats")`` of every site's primal and cotangent, with no sowtel at run
    time (cotangents as gradients of zero perturbations); ``copy=False``: the summaries read
    each value itself (``SOWTEL_SUMMARY_COPY=0``).

    Example:
        >>> from benchmarks.workloads import mlp
        >>> work = mlp(batch=4, width=8)
        >>> params, opt_state, loss, summaries = floor_step(work)(*work.init(), 0)
        >>> sorted(summaries["dense0/act"])
        ['cotangent', 'primal']
    """
    returning = make_returning_train_step(work)

    def step(*args: Any) -> Any:
        params, opt_state, loss, inter = returning(*args)
        summaries = jax.tree_util.tree_map(
            lambda v: device_summary(v, "stats", copy=copy), inter)
        return params, opt_state, loss, summaries

    return jax.jit(step)


def _unmasked_stats(x: Any) -> list[Any]:
    """``stats``'s arrays as sowtel's ``"separate"`` form takes them for a value with nothing
    to mask, with no conditional around the masked statistics. Not a sowtel summary: what
    ``stats`` would cost if those of a value holding a NaN or an infinity were NaN instead of
    its finite elements' (the proposal in docs/benchmarks.md)."""
    jnp = jax.numpy
    n, mean, m2, mn, mx, a, zeros, bad = separate_moments(x.astype(jnp.float32))
    return [jnp.stack([mean, m2, mn, mx, n, a]), jnp.stack([*bad, zeros])]


def _floor_unmasked(work: Workload) -> Callable[..., Any]:
    returning = make_returning_train_step(work)

    def step(*args: Any) -> Any:
        params, opt_state, loss, inter = returning(*args)
        return params, opt_state, loss, jax.tree_util.tree_map(_unmasked_stats, inter)

    return jax.jit(step)


def _one_in(every: int, logging: Callable[..., Any],
            plain: Callable[..., Any]) -> Callable[..., Any]:
    """A step that runs ``logging`` on every ``every``-th call (the first included) and
    ``plain`` on the others."""
    calls = 0

    def step(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return (logging if (calls - 1) % every == 0 else plain)(*args)

    return step


def variants(work: Workload, stack: ExitStack,
             only: Sequence[str] | None = None) -> dict[str, Runner]:
    def session(**options: Any) -> sowtel.Session:
        options = {"summary": "stats", "histogram_every": None, **options}
        return stack.enter_context(sowtel.enable(
            exporter=MemoryExporter(max_records=256), **options))

    sown = make_train_step(work, sowtel.sow)
    plain = jax.jit(make_train_step(work, no_tap))
    direct = {"SOWTEL_SUMMARY_COPY": "0"}
    out = {
        "plain": Runner(plain, work, None),
        "disabled": Runner(jax.jit(sown), work, None),
        "callback transport, stats every step": Runner(jax.jit(sown), work, session()),
        "sowtel.jit, stats every step": Runner(sowtel.jit(sown), work, session()),
        "sowtel.jit, every=10": Runner(sowtel.jit(sown), work, session(every=10)),
        "sowtel.jit, health every step only": Runner(
            sowtel.jit(sown), work, session(every=10**9, health_every=1)),
        "sowtel.jit, every=10, health every step": Runner(
            sowtel.jit(sown), work, session(every=10, health_every=1)),
        "sowtel.jit, every=10, flight recorder K=1": Runner(
            sowtel.jit(sown), work, session(every=10, flight_recorder=1)),
        "sowtel.jit, histogram every step": Runner(
            sowtel.jit(sown), work, session(summary="histogram")),
        "sowtel.jit, stats, histograms every 10 steps": Runner(
            sowtel.jit(sown), work, session(histogram_every=10)),
        "callback transport, stats every step, value read directly": Runner(
            jax.jit(sown), work, session(), direct),
        "sowtel.jit, stats every step, value read directly": Runner(
            sowtel.jit(sown), work, session(), direct),
        "hand-written floor (summaries as outputs)": Runner(floor_step(work), work, None),
        "hand-written floor, value read directly": Runner(floor_step(work, copy=False), work,
                                                         None),
        "hand-written floor, sums unmasked": Runner(_floor_unmasked(work), work, None),
        "hand-written floor, every=10": Runner(_one_in(10, floor_step(work), plain), work,
                                               None),
    }
    activate_session(None)
    return out if only is None else {name: out[name] for name in only}


def jit_table(work: Workload, *, rounds: int, steps: int,
              only: Sequence[str] | None = None) -> Table:
    """Times every variant of ``work`` (or those named in ``only``) side by side; one table
    row per variant."""
    with ExitStack() as stack:
        runners = variants(work, stack, only)
        t0 = time.perf_counter()
        for r in runners.values():  # compile (and, for sowtel.jit, trace) outside the timing
            for _ in range(11):
                r()
            r.drain()
        warm_s = time.perf_counter() - t0
        counts = {name: (r.records(), r.calls) for name, r in runners.items()}
        for r in runners.values():
            r.cpu = 0.0
        timings = interleave(runners, rounds=rounds, steps={"*": steps}, warmup=0,
                             drains={n: r.drain for n, r in runners.items()}, baseline="plain")
        for r in runners.values():
            r.drain()
        table = Table(f"Transports: {work.description}",
                      ["variant", "step", "ratio [quartiles]", "+ drain", "CPU time",
                       "records/step", "target"])
        base_cpu = runners["plain"].cpu / max(runners["plain"].calls - counts["plain"][1], 1)
        base = timings["plain"]
        per_step = 2 * len(work.sites)
        for name, r in runners.items():
            t = timings[name]
            ratio = t.ratio_to(base)
            drained = t.ratio_to(base, with_drain=True)
            before, calls_before = counts[name]
            recorded = (r.records() - before) / max(r.calls - calls_before, 1)
            logs_all = "every=10" not in name or "health" in name
            expected = 0 if r.session is None else per_step / (1 if logs_all else 10)
            rec = f"{recorded:.1f}" + ("" if abs(recorded - expected) <= 0.5 * per_step / 10
                                       else f" (expected {expected:.1f})")
            target = TARGETS.get((work.name, name), TARGETS.get(("*", name)))
            verdict = ""
            if target is not None:
                met = max(ratio, drained) <= target
                verdict = f"≤ {target:.2f}× {'met' if met else 'MISSED'}"
            cpu = r.cpu / max(r.calls - calls_before, 1) / base_cpu
            table.add(name, fmt_time(t.per_step()), fmt_ratio(ratio, t.ratio_spread(base)),
                      fmt_ratio(drained), fmt_ratio(cpu), rec, verdict)
        table.notes.append(
            f"{rounds} rounds of {steps} steps a variant, each bracketed by as many plain steps; "
            f"a ratio is the median over rounds of the variant's mean step over the plain steps "
            f"around it (quartiles in brackets); + drain: with the session's flush after each "
            f"block. CPU time: the process's CPU seconds (all threads) a step, its drains "
            f"included, over the plain step's: the cost that other load on the machine does not "
            f"inflate. Summary form: {summary_form()}. Warm-up and compilation: {warm_s:.1f} s.")
        activate_session(None)
        return table


def copy_cost_table(rounds: int = 20, values: int = 12, shape: tuple[int, int] = (256, 512)
                    ) -> Table:
    """The CPU time ``stats`` summaries add to a jitted program of ``values`` arrays of
    ``shape``, with the copy (``sowtel.summaries.apart``) and reading each value itself, for
    three kinds of sown value: a cheap product feeding an add (the copy keeps the program's
    fused multiply-add), an expensive last operation and a matmul's output (both written out
    whatever the summary does)."""
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(values)]
    w = jnp.asarray(rng.normal(size=(shape[1], shape[1])) / np.sqrt(shape[1]), jnp.float32)
    kinds: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
        "a cheap product feeding an add (x * s + 1, then + 2)":
            (lambda x: x * 1.01 + 1.0, lambda v: v + 2.0),
        "an expensive last operation feeding a matmul (tanh)": (jnp.tanh, lambda v: v @ w),
        "a matmul's output, feeding a tanh": (lambda x: x @ w, jnp.tanh),
    }

    def program(make: Callable[[Any], Any], use: Callable[[Any], Any],
                copy: bool | None) -> Callable[..., Any]:
        def f(xs: Any) -> Any:
            vals = [make(x) for x in xs]
            summaries = ([] if copy is None else
                         [device_summary(v, "stats", copy=copy) for v in vals])
            return [use(v) for v in vals], summaries

        return jax.jit(f)

    table = Table(f"The summaries' copy: {values} values of {shape[0]}x{shape[1]} float32",
                  ["sown value", "no summaries (CPU)", "stats, with the copy",
                   "stats, the value read directly"])
    for label, (make, use) in kinds.items():
        fns = {c: program(make, use, c) for c in (None, True, False)}
        for f in fns.values():
            jax.block_until_ready(f(xs))
        cpu: dict[bool | None, list[float]] = {c: [] for c in fns}
        for _ in range(rounds):
            for c, f in fns.items():
                start = time.process_time()
                for _ in range(5):
                    jax.block_until_ready(f(xs))
                cpu[c].append((time.process_time() - start) / 5)
        base = float(np.median(cpu[None]))
        cells = []
        for c in (True, False):
            q1, med, q3 = (float(np.percentile(cpu[c], q)) - base for q in (25, 50, 75))
            cells.append(f"{med * 1e3:+.2f} ms [{q1 * 1e3:+.2f}, {q3 * 1e3:+.2f}]")
        table.add(label, fmt_time(base), *cells)
    table.notes.append(
        f"{rounds} rounds of 5 calls of each program, interleaved; process CPU time (all "
        "threads) a call, median over rounds of the summarised program's minus the plain "
        "program's median (quartiles in brackets).")
    return table


def run(quick: bool = False, gpt_full: bool = False,
        workload: str | None = None, nonfinite: bool = False,
        histogram: bool = False, copy: bool = False) -> list[Table]:
    """The tables, one per workload (the MLP only, two short rounds, with ``quick``; only
    ``workload`` if given; with ``nonfinite``, the transformer's NaN-check variants only; with
    ``histogram``, the MLP's and the transformer's histogram variants only; with ``copy``,
    every workload's (or ``workload``'s) variants with and without the summaries' copy)."""
    if copy:
        works = {"mlp": (mlp, 10), "transformer": (transformer_block, 8),
                 "gpt": (gpt if gpt_full else gpt_reduced, 6)}
        chosen = [workload] if workload else list(works)
        if quick:
            return [jit_table(mlp(batch=32, width=64), rounds=1, steps=10, only=COPY_VARIANTS),
                    copy_cost_table(rounds=2, values=2, shape=(64, 64))]
        return [*(jit_table(works[w][0](), rounds=works[w][1], steps=10, only=COPY_VARIANTS)
                  for w in chosen), copy_cost_table()]
    if histogram:
        return [jit_table(mlp(), rounds=10, steps=10, only=HISTOGRAM_VARIANTS),
                jit_table(transformer_block(), rounds=8, steps=10, only=HISTOGRAM_VARIANTS)]
    if nonfinite:
        return [jit_table(transformer_block(), rounds=8, steps=10, only=NONFINITE_VARIANTS)]
    if quick:  # a smoke run of every variant, on a small MLP
        return [jit_table(mlp(batch=32, width=64), rounds=1, steps=10)]
    if workload == "mlp":
        return [jit_table(mlp(), rounds=10, steps=10)]
    if workload == "transformer":
        return [jit_table(transformer_block(), rounds=8, steps=10)]
    if workload == "gpt":
        return [jit_table(gpt() if gpt_full else gpt_reduced(), rounds=6, steps=10)]
    return [
        jit_table(mlp(), rounds=10, steps=10),
        jit_table(transformer_block(), rounds=8, steps=10),
        jit_table(gpt() if gpt_full else gpt_reduced(), rounds=6, steps=10),
    ]


def tables(quick: bool = False) -> Iterator[Table]:
    yield from run(quick)


def _gpt_full_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpt-full", action="store_true",
                        help="the GPT workload at full size (d_model 768, seq 512, batch 16)")
    parser.add_argument("--workload", choices=("mlp", "transformer", "gpt"),
                        help="only this workload's table")
    parser.add_argument("--nonfinite", action="store_true",
                        help="the transformer block's NaN-check variants only (health checks, "
                             "flight recorder)")
    parser.add_argument("--histogram", action="store_true",
                        help="the MLP's and the transformer block's histogram variants only "
                             "(histograms every step, every 10 steps, against stats)")
    parser.add_argument("--copy", action="store_true",
                        help="the transports and the floor with and without the summaries' "
                             "copy of each value (SOWTEL_SUMMARY_COPY=0)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_jit [--quick] [--gpt-full] [--markdown FILE]``."""
    return module_main(argv, "bench_jit", __doc__,
                       lambda args: run(quick=args.quick, gpt_full=args.gpt_full,
                                        workload=args.workload, nonfinite=args.nonfinite,
                                        histogram=args.histogram, copy=args.copy),
                       arguments=_gpt_full_argument)


if __name__ == "__main__":
    sys.exit(main())
