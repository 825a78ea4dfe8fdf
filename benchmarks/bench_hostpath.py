"""The host path at the size of a deep model: records/s from ``sowtel.jit`` steps to exporters.

A 48-layer scan with 8 sites a layer (384 ``stats`` records a logging step, tiny values, so the
host side dominates) runs chained ``sowtel.jit`` steps with ``on_full="block"``: the rate is
what the host sustains, from the call to the last record handed to every exporter. Rows, in
one run: the plain step (no session), the memory exporter alone, memory + jsonl + TensorBoard
+ OpenTelemetry together, and the callback transport (``enable()`` + ``jax.jit``) to memory.

Run: ``python -m benchmarks.bench_hostpath [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_hostpath
    >>> tables = bench_hostpath.run(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import Table, module_main, rss  # noqa: E402

__all__ = ["run", "main"]

LAYERS = 48
SITES = 8


def _model(jit):  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp

    import sowtel

    def step(x):  # type: ignore[no-untyped-def]
        def body(carry, _):  # type: ignore[no-untyped-def]
            for k in range(SITES):
                carry = jnp.tanh(carry) + 0.01 * k
                sowtel.sow(carry, f"site{k}")
            return carry, None
        return jax.lax.scan(body, x, None, length=LAYERS)[0]

    return jit(step)


def _otel_exporter():  # type: ignore[no-untyped-def]
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sowtel.exporters.otel import OTelExporter

    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    meter = MeterProvider(metric_readers=[InMemoryMetricReader()])
    return OTelExporter(tracer_provider=tracer, meter_provider=meter)


def rate(kind: str, steps: int) -> tuple[float, int, dict]:  # type: ignore[type-arg]
    """Records/s (or steps/s x records a step for the plain step) for one configuration."""
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.memory import MemoryExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    per_step = LAYERS * SITES
    x0 = jnp.linspace(-1.0, 1.0, 16)
    if kind == "plain":
        f = _model(jax.jit)
        f(x0).block_until_ready()
        t0 = time.perf_counter()
        x = x0
        for _ in range(steps):
            x = f(x)
        x.block_until_ready()
        return steps * per_step / (time.perf_counter() - t0), steps * per_step, {}
    with tempfile.TemporaryDirectory() as logdir:
        if kind == "all":
            exporters = [MemoryExporter(max_records=10_000), JsonlExporter(logdir=logdir),
                         TensorBoardExporter(logdir=os.path.join(logdir, "tb")), _otel_exporter()]
        else:
            exporters = [MemoryExporter(max_records=10_000)]
        f = _model(jax.jit if kind == "callback" else sowtel.jit)
        with sowtel.enable(exporter=exporters, on_full="block") as session:
            f(x0).block_until_ready()  # compile
            sowtel.flush(timeout=600.0)
            t0 = time.perf_counter()
            x = x0
            for _ in range(steps):
                x = f(x)
            x.block_until_ready()
            sowtel.flush(timeout=600.0)
            elapsed = time.perf_counter() - t0
            final = session.status()
    return steps * per_step / elapsed, steps * per_step, final


def table(quick: bool) -> Table:
    steps = 30 if quick else 300
    rows = [("plain step, no session", "plain"), ("sowtel.jit -> memory", "memory"),
            ("sowtel.jit -> memory + jsonl + TensorBoard + OpenTelemetry", "all"),
            ("callback (enable + jax.jit) -> memory", "callback")]
    t = Table(f"Host path: {LAYERS}-layer scan x {SITES} sites = {LAYERS * SITES} stats records "
              f"a step, {steps} chained steps, on_full='block'",
              ["configuration", "records/s", "vs plain step"])
    plain = None
    for label, kind in rows:
        r, n, final = rate(kind, steps if kind not in ("all", "callback") else max(10, steps // 3))
        plain = r if plain is None else plain
        t.add(label, f"{r:,.0f}", f"{plain / r:.2f}x")
        if final:
            total = final["accounts"]["total"]
            if total["pending"] or total["dropped"] or total["failed"]:
                t.notes.append(f"{kind}: accounts {total}")
    return t


class _Slow:
    """An exporter far slower than the steps: sleeps ``per_record`` seconds a record."""

    label = "slow"

    def __init__(self, per_record: float) -> None:
        self.per_record = per_record

    def write(self, records):  # type: ignore[no-untyped-def]
        time.sleep(self.per_record * len(records))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def overload(quick: bool) -> Table:
    """A slow exporter under a stream it cannot keep up with, in both modes."""
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.dispatcher import BATCH_RECORDS
    from sowtel.exporters.memory import MemoryExporter

    queue_size = 10_000
    per_step = LAYERS * SITES
    seconds = 3.0 if quick else 10.0
    t = Table(f"Overload: memory + an exporter at 20 us a record, {seconds:.0f} s of sowtel.jit "
              f"steps ({per_step} records each), queue_size={queue_size:,}",
              ["on_full", "steps", "most waiting (records)", "bound", "RSS growth",
               "disable(timeout=5)", "accounts balanced"])
    f = _model(sowtel.jit)
    x0 = jnp.linspace(-1.0, 1.0, 16)
    for mode in ("drop", "block"):
        with sowtel.enable(exporter=[MemoryExporter(max_records=10_000), _Slow(20e-6)],
                           on_full=mode, queue_size=queue_size) as session:
            f(x0).block_until_ready()
            rss0 = rss()
            most = rss_most = steps = 0
            x = x0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                x = f(x)
                steps += 1
                if steps % 10 == 0:
                    s = session.status()
                    most = max(most, max(s["pending"].values()))
                    rss_most = max(rss_most, rss())
            jax.block_until_ready(x)
            t0 = time.monotonic()
            final = sowtel.disable(timeout=5.0)
            took = time.monotonic() - t0
        bound = queue_size + per_step + min(queue_size, BATCH_RECORDS) + per_step
        balanced = all(a["received"] == a["exported"] + a["dropped"] + a["failed"] + a["late"]
                       and a["pending"] == 0 for a in final["accounts"].values())
        t.add(mode, f"{steps:,}", f"{most:,}", f"{bound:,}",
              f"{(rss_most - rss0) / 2**20:.0f} MiB", f"{took:.2f} s", str(balanced))
    return t


def device_bound(quick: bool) -> Table:
    """Steps that compute (a 256x256 matmul a site): all four exporters against memory alone."""
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.memory import MemoryExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    def step(x, w):  # type: ignore[no-untyped-def]
        def body(carry, _):  # type: ignore[no-untyped-def]
            for k in range(SITES):
                carry = jnp.tanh(carry @ w) + 0.01 * k
                sowtel.sow(carry, f"site{k}")
            return carry, None
        return jax.lax.scan(body, x, None, length=LAYERS)[0]

    steps = 5 if quick else 20
    x0 = jnp.ones((256, 256)) * 0.01
    w = jnp.eye(256) * 0.5
    f = sowtel.jit(step)
    t = Table(f"Device-bound steps: the same {LAYERS}x{SITES} scan with a 256x256 matmul a site, "
              f"{steps} steps, on_full='block'", ["exporters", "seconds a step", "vs memory"])
    rows = []
    for label in ("memory", "memory + jsonl + TensorBoard + OpenTelemetry"):
        with tempfile.TemporaryDirectory() as logdir:
            exporters = [MemoryExporter(max_records=10_000)]
            if label != "memory":
                exporters += [JsonlExporter(logdir=logdir),
                              TensorBoardExporter(logdir=os.path.join(logdir, "tb")),
                              _otel_exporter()]
            with sowtel.enable(exporter=exporters, on_full="block"):
                f(x0, w).block_until_ready()
                sowtel.flush(timeout=600.0)
                t0 = time.perf_counter()
                x = x0
                for _ in range(steps):
                    x = f(x, w)
                x.block_until_ready()
                sowtel.flush(timeout=600.0)
                rows.append((label, (time.perf_counter() - t0) / steps))
    for label, seconds in rows:
        t.add(label, f"{seconds * 1e3:.1f} ms", f"{seconds / rows[0][1]:.2f}x")
    return t


def run(quick: bool = False) -> list[Table]:
    """The host-path rates (``quick``: 30 steps each), the overload check, device-bound steps."""
    return [table(quick), overload(quick), device_bound(quick)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_hostpath [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_hostpath", __doc__, lambda args: run(args.quick))


if __name__ == "__main__":
    sys.exit(main())
