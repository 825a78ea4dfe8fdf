"""What ``sowtel.optax.watch`` costs a training step.

The transformer-block workload's step (``value_and_grad`` + Adam, no sows in the model) timed
side by side with the same step whose optimizer is wrapped in ``sowtel.optax.watch``:

- **plain**: ``jax.jit``, the unwrapped optimizer (the baseline every ratio is taken to);
- **disabled**: ``jax.jit``, the watched optimizer, nothing enabled (the same program);
- **sowtel.jit, watch every=10**: gradients, updates, parameters, norms and ratios streamed
  (``stats``) on one step in ten; the other nine run the plain program (the target: ≤ 1.02×);
- **sowtel.jit, watch every step**: the same on every step;
- **callback transport, watch every=10**: ``jax.jit`` with the step inside ``sowtel.at_step``,
  so the stride is decided on the device; the program holds the host callbacks on every step.

Records per step are counted, so a variant that streamed nothing cannot pass for a fast one.

Run: ``python -m benchmarks.bench_watch [--quick] [--markdown FILE]``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import jax
import optax

import sowtel
import sowtel.optax
from benchmarks import Table, bench_jit, fmt_ratio, fmt_time, interleave, module_main
from benchmarks.workloads import (
    Workload,
    activate_session,
    make_train_step,
    mlp,
    no_tap,
    transformer_block,
)
from sowtel.exporters.memory import MemoryExporter

__all__ = ["run", "main", "watch_table"]

TARGETS = {"sowtel.jit, watch every=10": 1.02}


class Runner(bench_jit.Runner):
    """A variant of :class:`benchmarks.bench_jit.Runner` whose step counts its calls, so that
    the watch's ``every=N`` applies."""

    def __call__(self) -> None:
        self.step = jax.numpy.int32(self.calls)
        super().__call__()


def _watched(work: Workload, every: int | None) -> Workload:
    return dataclasses.replace(work, optimizer=sowtel.optax.watch(work.optimizer, every=every))


def _train_step(work: Workload) -> Callable[..., Any]:
    """The workload's step with the whole step (the optimizer's update too) in ``at_step``."""

    def train_step(params: Any, opt_state: Any, batch: Any, step: jax.Array) -> Any:
        with sowtel.at_step(step):
            loss, grads = jax.value_and_grad(lambda p: work.loss(p, batch, no_tap))(params)
            updates, opt_state = work.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def watch_table(work: Workload, *, rounds: int, steps: int) -> Table:
    """Times the variants of the module docs on ``work``, side by side."""
    with ExitStack() as stack:
        def session() -> sowtel.Session:
            return stack.enter_context(sowtel.enable(
                exporter=MemoryExporter(max_records=256), summary="stats"))

        every10, every1 = _watched(work, 10), _watched(work, None)
        runners = {
            "plain": Runner(jax.jit(make_train_step(work, no_tap)), work, None),
            "disabled": Runner(jax.jit(make_train_step(every10, no_tap)), work, None),
            "sowtel.jit, watch every=10": Runner(
                sowtel.jit(make_train_step(every10, no_tap)), work, session()),
            "sowtel.jit, watch every step": Runner(
                sowtel.jit(make_train_step(every1, no_tap)), work, session()),
            "callback transport, watch every=10": Runner(
                jax.jit(_train_step(every10)), work, session()),
        }
        activate_session(None)
        t0 = time.perf_counter()
        for r in runners.values():  # compile (and trace) outside the timing
            for _ in range(11):
                r()
            r.drain()
        warm_s = time.perf_counter() - t0
        counts = {name: (r.records(), r.calls) for name, r in runners.items()}
        timings = interleave(runners, rounds=rounds, steps={"*": steps}, warmup=0,
                             drains={n: r.drain for n, r in runners.items()}, baseline="plain")
        for r in runners.values():
            r.drain()
        leaves = len(jax.tree_util.tree_leaves(work.params))
        per_logging_step = 4 * leaves + 3  # grads, updates, params, ratios; three norms
        table = Table(f"sowtel.optax.watch: {work.description}",
                      ["variant", "step", "ratio [quartiles]", "+ drain", "records/step",
                       "target"])
        base = timings["plain"]
        for name, r in runners.items():
            t = timings[name]
            ratio, drained = t.ratio_to(base), t.ratio_to(base, with_drain=True)
            before, calls_before = counts[name]
            recorded = (r.records() - before) / max(r.calls - calls_before, 1)
            expected = 0.0 if r.session is None else per_logging_step / (
                10 if "every=10" in name else 1)
            rec = f"{recorded:.1f}" + ("" if abs(recorded - expected) <= 0.05 * per_logging_step
                                       else f" (expected {expected:.1f})")
            target = TARGETS.get(name)
            verdict = ""
            if target is not None:
                verdict = f"≤ {target:.2f}× {'met' if max(ratio, drained) <= target else 'MISSED'}"
            table.add(name, fmt_time(t.per_step()), fmt_ratio(ratio, t.ratio_spread(base)),
                      fmt_ratio(drained), rec, verdict)
        table.notes.append(
            f"{rounds} rounds of {steps} steps a variant, each bracketed by as many plain steps; "
            f"a ratio is the median over rounds of the variant's mean step over the plain steps "
            f"around it (quartiles in brackets); + drain: with the session's flush after each "
            f"block. {leaves} parameter arrays. Warm-up and compilation: {warm_s:.1f} s.")
        activate_session(None)
        return table


def run(quick: bool = False) -> list[Table]:
    """The transformer-block table (a small MLP, one short round, with ``quick``)."""
    if quick:
        return [watch_table(mlp(batch=32, width=64), rounds=1, steps=10)]
    return [watch_table(transformer_block(), rounds=8, steps=10)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_watch [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_watch", __doc__, lambda args: run(quick=args.quick))


if __name__ == "__main__":
    sys.exit(main())
