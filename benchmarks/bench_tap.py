"""What ``sowtel.tap`` costs: tracing, and a logging training step against hand-placed sows.

The workload: a stack of pre-norm MLP blocks (two products a block, ``width`` wide) in a
``lax.scan`` over ``layers`` layers (48 by default), mean squared loss, ``value_and_grad`` and
SGD. Two tables, each of variants measured side by side in one process:

- **tracing**: the CPU time of ``jax.jit(step).trace(...)`` of a fresh function (no trace
  cache) with a session streaming, for the step whose loss has no site, the same loss with the
  two products of each block sown by hand, and the loss tapped (``jax.grad(sowtel.tap(loss))``;
  the target: ≤ 1.2× the untapped trace). The tapped trace runs the loss's own trace, then the
  evaluator over its jaxpr (once for the scan body, whatever ``layers``), then the
  differentiation. The same for a Flax Linen ``nn.scan(nn.remat(Block))`` model.
- **steps**: ``sowtel.jit`` steps, ``stats`` every step, of the tapped loss against the same
  sites sown by hand (the same names, so the same records; the target: within 5%), the
  uninstrumented ``jax.jit`` step as the baseline.

Records per step are counted, so a variant that streamed nothing cannot pass for a fast one.

Run: ``python -m benchmarks.bench_tap [--quick] [--markdown FILE]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import sowtel
from benchmarks import Table, fmt_ratio, fmt_time, hlo_structure, interleave, module_main
from sowtel.exporters.memory import MemoryExporter

__all__ = ["run", "main"]

TARGETS = {"tapped trace": 1.2, "sowtel.jit, tapped": 1.05}


def _workload(layers: int, width: int, batch: int) -> tuple[Any, Any, Callable[..., Any]]:
    keys = jax.random.split(jax.random.key(0), 3)
    params = {
        "up": jax.random.normal(keys[0], (layers, width, 2 * width)) / width ** 0.5,
        "down": jax.random.normal(keys[1], (layers, 2 * width, width)) / (2 * width) ** 0.5,
    }
    x = jax.random.normal(keys[2], (batch, width))

    def loss(params: Any, x: jax.Array, mark: Callable[[jax.Array, str], jax.Array]) -> Any:
        def block(h: jax.Array, p: Any) -> tuple[jax.Array, None]:
            with jax.named_scope("block"):
                n = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)
                with jax.named_scope("up"):
                    u = jax.nn.gelu(mark(n @ p["up"], "block/up/dot_general"))
                with jax.named_scope("down"):
                    return h + mark(u @ p["down"], "block/down/dot_general"), None

        out, _ = jax.lax.scan(block, x, params)
        return jnp.mean(out ** 2)

    return params, x, loss


def _linen_workload(layers: int, width: int, batch: int) -> tuple[Any, Any, Callable[..., Any]]:
    """The same stack as a Flax Linen model: ``nn.scan`` over ``nn.remat`` blocks."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            n = nn.LayerNorm()(h)
            return h + nn.Dense(width)(jax.nn.gelu(nn.Dense(2 * width)(n))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                            split_rngs={"params": True}, length=layers)
            return stack(name="layers")(x, None)[0]

    x = jax.random.normal(jax.random.key(2), (batch, width))
    params = Model().init(jax.random.key(0), x)

    def loss(params: Any, x: jax.Array, mark: Callable[[jax.Array, str], jax.Array]) -> Any:
        return jnp.mean(Model().apply(params, x) ** 2)

    return params, x, loss


def _step(loss: Callable[..., Any]) -> Callable[..., Any]:
    def step(params: Any, x: jax.Array) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), value

    return step


def _losses(loss: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    return {
        "plain": lambda p, x: loss(p, x, lambda v, _: v),
        "hand-placed sows": lambda p, x: loss(p, x, sowtel.sow),
        "tapped": sowtel.tap(lambda p, x: loss(p, x, lambda v, _: v)),
    }


def tracing_table(*, layers: int, width: int, batch: int, repeats: int) -> Table:
    table = Table(f"tracing a {layers}-layer scanned step (value_and_grad + SGD), streaming on",
                  ["model", "variant", "trace CPU time (median)",
                   "ratio to the untapped trace"])
    for label, make in (("jnp, lax.scan", _workload), ("Linen nn.scan(nn.remat)",
                                                       _linen_workload)):
        params, x, loss = make(layers, width, batch)
        losses = _losses(loss)
        if make is _linen_workload:
            del losses["hand-placed sows"]  # the Linen model has no hand-placed sows
        times: dict[str, list[float]] = {k: [] for k in losses}
        with sowtel.enable(exporter="memory"):
            for round_ in range(repeats + 2):  # two rounds of warm-up (JAX's own caches)
                order = list(losses.items())
                k = round_ % len(order)
                for name, fn in order[k:] + order[:k]:
                    step = _step(fn)
                    # CPU time: tracing is Python on one thread, and the CPU time of this
                    # process is what other processes' load inflates least.
                    start = time.process_time()
                    jax.jit(lambda p, x, step=step: step(p, x)).trace(params, x)
                    if round_ >= 2:
                        times[name].append(time.process_time() - start)
        base = statistics.median(times["plain"])
        for name, ts in times.items():
            ratios = [t / b for t, b in zip(ts, times["plain"], strict=True)]
            table.add(label, name, fmt_time(statistics.median(ts)), fmt_ratio(
                statistics.median(ts) / base, (min(ratios), max(ratios))))
    table.notes.append(f"{repeats} traces a variant after two of warm-up, interleaved (the "
                       "order rotating); [min–max] of the paired ratios; target for the "
                       f"tapped trace ≤ {TARGETS['tapped trace']}×")
    return table


def steps_table(*, layers: int, width: int, batch: int, rounds: int, steps: int) -> Table:
    params, x, loss = _workload(layers, width, batch)
    losses = _losses(loss)
    exporter = MemoryExporter(max_records=1_000_000)
    counted: dict[str, int] = {}
    with sowtel.enable(exporter=exporter):
        fns = {
            "jax.jit, no site": jax.jit(_step(losses["plain"])),
            "sowtel.jit, hand-placed sows": sowtel.jit(_step(losses["hand-placed sows"])),
            "sowtel.jit, tapped": sowtel.jit(_step(losses["tapped"])),
        }

        def runner(name: str) -> Callable[[], None]:
            fn = fns[name]

            def one() -> None:
                before = len(exporter.records)
                jax.block_until_ready(fn(params, x))
                sowtel.flush()
                counted[name] = len(exporter.records) - before
                exporter.records.clear()

            return one

        timing = interleave({name: runner(name) for name in fns}, rounds=rounds, steps=steps,
                            baseline="jax.jit, no site")
        same = (hlo_structure(fns["sowtel.jit, tapped"].lower_logging(params, x)
                              .compile().as_text())
                == hlo_structure(fns["sowtel.jit, hand-placed sows"].lower_logging(params, x)
                                 .compile().as_text()))
    base = timing["jax.jit, no site"]
    hand = timing["sowtel.jit, hand-placed sows"].per_step()
    table = Table(f"{layers}-layer scanned step, stats every step (width {width}, batch {batch})",
                  ["variant", "step (incl. flush)", "ratio to jax.jit", "ratio to hand-placed",
                   "records/step"])
    for name, t in timing.items():
        ratios = t.ratios_to(base) if name != "jax.jit, no site" else [1.0]
        table.add(name, fmt_time(t.per_step()),
                  fmt_ratio(statistics.median(ratios),
                            (min(ratios), max(ratios)) if len(ratios) > 1 else None),
                  fmt_ratio(t.per_step() / hand), counted.get(name, 0))
    table.notes.append(f"{rounds} rounds of {steps} steps, each variant bracketed by the "
                       "jax.jit step; the tapped step and the hand-sown one have the same "
                       "sites and names, so their records are the same")
    table.notes.append("the tapped step's logging program is the hand-sown one's (compiled "
                       f"HLO, up to XLA's instruction names): {'yes' if same else 'NO'}")
    return table


def run(quick: bool = False) -> list[Table]:
    """The tracing and step tables (fewer repeats and a narrower model with ``quick``)."""
    if quick:
        return [tracing_table(layers=48, width=64, batch=16, repeats=15),
                steps_table(layers=48, width=64, batch=16, rounds=3, steps=5)]
    return [tracing_table(layers=48, width=256, batch=64, repeats=30),
            steps_table(layers=48, width=256, batch=64, rounds=8, steps=10)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_tap [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_tap", __doc__, lambda args: run(quick=args.quick))


if __name__ == "__main__":
    raise SystemExit(main())
