"""What offline capture costs: ``jax.jit(save_intermediates(f))`` against the same values by hand.

The workload is a 3-layer MLP under ``jax.value_and_grad`` with 6 sites, at the reference size
(batch 256, width 512) and at a small size (batch 32, width 64) where any fixed overhead of the
wrapper (argument handling, output pytrees) would show. Three programs, timed side by side:

- ``save_intermediates``: ``jax.jit(sowtel.save_intermediates(jax.value_and_grad(loss)))``;
- ``by hand``: a jitted function returning the same values without sowtel (primals as auxiliary
  outputs, cotangents as the gradient with respect to a zero perturbation added at each site);
- ``no intermediates``: ``jax.jit(jax.value_and_grad(loss))`` without sows, for scale.

Before timing, the two programs' results are compared (they must agree to float32 rounding),
and so are their compiled programs (up to the names XLA gives instructions and the order of
the outputs: ``save_intermediates`` keeps sites in trace order, plain dicts come back sorted).

Run: ``python -m benchmarks.bench_capture [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_capture
    >>> [table] = bench_capture.run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import sowtel
from benchmarks import (
    Table,
    fmt_ratio,
    fmt_time,
    hlo_structure,
    interleave,
    module_main,
)
from benchmarks.workloads import Workload, make_returning_value_and_grad, mlp, no_tap

__all__ = ["run", "main", "capture_table", "max_difference"]

#: DESIGN §8: ``jit(save_intermediates(f))`` at most this times the hand-written equivalent.
TARGET = 1.02


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two pytrees of arrays with the same structure.

    Example:
        >>> max_difference({"x": np.ones(2)}, {"x": np.array([1.0, 1.5])})
        0.5
    """
    leaves_a, tree_a = jax.tree_util.tree_flatten(_plain(a))
    leaves_b, tree_b = jax.tree_util.tree_flatten(_plain(b))
    if str(tree_a) != str(tree_b):
        raise ValueError(f"the results have different structures: {tree_a} and {tree_b}")
    return max((float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                for x, y in zip(leaves_a, leaves_b, strict=True)), default=0.0)


def _plain(tree: Any) -> Any:
    # save_intermediates returns dict subclasses that keep trace order; compare as plain dicts.
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def _unflatten_time(result: Any, number: int = 2000) -> float:
    # What a jitted call pays, after the computation, to hand its results back as the pytree.
    leaves, treedef = jax.tree_util.tree_flatten(result)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(number):
            jax.tree_util.tree_unflatten(treedef, leaves)
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def _programs(work: Workload) -> dict[str, Any]:
    def sown_loss(params: Any, batch: Any) -> jax.Array:
        return work.loss(params, batch, sowtel.sow)

    def plain_loss(params: Any, batch: Any) -> jax.Array:
        return work.loss(params, batch, no_tap)

    return {
        "save_intermediates": jax.jit(sowtel.save_intermediates(jax.value_and_grad(sown_loss))),
        "by hand": jax.jit(make_returning_value_and_grad(work)),
        "no intermediates": jax.jit(jax.value_and_grad(plain_loss)),
    }


def capture_table(quick: bool = False) -> Table:
    """Times the three programs on both MLP sizes; one row per program and size."""
    table = Table(
        "Offline capture: jit(save_intermediates(value_and_grad(loss))) vs the same by hand",
        ["workload", "program", "call", "ratio to by hand [quartiles]", "target"],
    )
    notes = []
    sizes = ((mlp(), 4 if quick else 10), (mlp(batch=32, width=64), 50 if quick else 200))
    for work, steps in sizes:
        params, _, batch = work.init()
        programs = _programs(work)
        ours = programs["save_intermediates"](params, batch)
        hand = programs["by hand"](params, batch)
        diff = max_difference(ours, hand)
        same_program = len({
            hlo_structure(programs[k].lower(params, batch).compile().as_text(),
                          output_order=False)
            for k in ("save_intermediates", "by hand")
        }) == 1
        notes.append(
            f"{work.description}: results agree to {diff:.2g} (max abs difference); compiled "
            f"programs {'identical' if same_program else 'DIFFERENT'} up to instruction names and "
            "the order of outputs."
        )
        notes.append(
            f"{work.description}: rebuilding the outputs' pytree from their arrays takes "
            f"{fmt_time(_unflatten_time(ours))} for save_intermediates' result and "
            f"{fmt_time(_unflatten_time(hand))} for the hand-written one (plain dicts), "
            "once per call."
        )
        if diff > 1e-4:
            notes.append(f"WARNING: {work.name} results differ by {diff:.3g}: the comparison "
                         "is not of the same values")

        def step(f: Callable[..., Any], args: tuple[Any, ...] = (params, batch)
                 ) -> Callable[[], Any]:
            return lambda: jax.block_until_ready(f(*args))

        rounds = 3 if quick else 10
        timings = interleave({k: step(f) for k, f in programs.items()}, rounds=rounds,
                             steps=steps, warmup=3, baseline="by hand")
        base = timings["by hand"]
        for name, t in timings.items():
            ratio = t.ratio_to(base)
            target = ""
            if name == "save_intermediates":
                target = f"≤ {TARGET:.2f}× {'met' if ratio <= TARGET else 'MISSED'}"
            table.add(f"batch {work.batch[0].shape[0]}, width {work.batch[0].shape[1]}", name,
                      fmt_time(t.per_step()), fmt_ratio(ratio, t.ratio_spread(base)), target)
        notes.append(f"{work.description}: {rounds} rounds of {steps} calls of each program, "
                     "each bracketed by as many calls of 'by hand' (ratios to those).")
    table.notes.extend(notes)
    return table


def run(quick: bool = False) -> list[Table]:
    """Runs the capture benchmark; returns its table."""
    return [capture_table(quick)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_capture [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_capture", __doc__, lambda args: run(args.quick))


if __name__ == "__main__":
    sys.exit(main())
