"""Soak: a million ``stats`` records through memory, jsonl and TensorBoard, RSS sampled each second.

A jitted ``lax.scan`` of 1,000 sows (a 16-float vector each) runs 1,000 times while a session
streams every record to three exporters at once: ``MemoryExporter(max_records=10_000)``, jsonl
and TensorBoard, with ``on_full="block"`` so that nothing is dropped and the counts are exact.
A thread samples the process's resident memory (``VmRSS``) once a second. The table shows the
samples (at most 12, evenly spread), then the accounting at the end; memory is bounded when RSS
levels off after the first samples instead of growing with the records.

Run: ``python -m benchmarks.bench_soak [--quick] [--markdown FILE]`` (``--quick``: 30,000
records, a smoke run).

Example:
    >>> from benchmarks import bench_soak
    >>> tables = bench_soak.run(quick=True)  # doctest: +SKIP
    >>> print(tables[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import Table, module_main, rss  # noqa: E402

__all__ = ["run", "main", "soak"]

LENGTH = 1_000  # sows per call: one scan of this length


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def soak(records: int) -> Table:
    """Streams ``records`` stats records (a multiple of 1,000) and samples RSS each second."""
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.memory import MemoryExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    calls = max(1, records // LENGTH)

    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        def body(carry: jax.Array, _: None) -> tuple[jax.Array, None]:
            carry = jnp.tanh(carry) + 0.1
            sowtel.sow(carry, "layer/h")
            return carry, None
        return jax.lax.scan(body, x, None, length=LENGTH)[0]

    x = jnp.linspace(-1.0, 1.0, 16)
    samples: list[tuple[float, int, int]] = []  # (seconds, records exported by all, RSS)
    with tempfile.TemporaryDirectory() as logdir:
        exporters = [MemoryExporter(max_records=10_000), JsonlExporter(logdir=logdir),
                     TensorBoardExporter(logdir=os.path.join(logdir, "tb"))]
        with sowtel.enable(exporter=exporters, on_full="block") as session:
            done = threading.Event()
            t0 = time.monotonic()

            def sample() -> None:
                while True:
                    exported = min(session.status()["exported"].values())
                    samples.append((time.monotonic() - t0, exported, rss()))
                    if done.wait(1.0):
                        return

            sampler = threading.Thread(target=sample, name="rss-sampler")
            sampler.start()
            for _ in range(calls):
                x = step(x)
            x.block_until_ready()
            sowtel.flush(timeout=600.0)
            elapsed = time.monotonic() - t0
            done.set()
            sampler.join()
            samples.append((elapsed, min(session.status()["exported"].values()), rss()))
        final = session.status()
    n = calls * LENGTH
    table = Table(f"Soak: {n:,} stats records to memory + jsonl + TensorBoard, RSS each second",
                  ["seconds", "records written (by every exporter)", "RSS"])
    shown = samples if len(samples) <= 12 else [
        samples[round(i * (len(samples) - 1) / 11)] for i in range(12)]
    for seconds, exported, resident in shown:
        table.add(f"{seconds:.0f}", f"{exported:,}", _mib(resident))
    rss_values = [s[2] for s in samples]
    after_first = [s[2] for s in samples if s[1] >= n // 10] or rss_values
    total = final["accounts"]["total"]
    table.notes += [
        f"{n:,} records in {elapsed:.0f} s ({n / elapsed:,.0f} records/s through all three "
        f"exporters); {len(samples)} samples",
        f"RSS: first sample {_mib(rss_values[0])}, peak {_mib(max(rss_values))}, last "
        f"{_mib(rss_values[-1])}; from the first 10% of records to the end it moved by "
        f"{_mib(after_first[-1] - after_first[0])} (peak minus that sample: "
        f"{_mib(max(after_first) - after_first[0])})",
        f"accounting, per exporter: received {final['received']:,} = exported "
        f"{final['exported']} + dropped {total['dropped']} + failed {total['failed']} + late "
        f"{total['late']} (pending {total['pending']})",
    ]
    return table


def run(quick: bool = False) -> list[Table]:
    """The soak: a million records (``quick``: 30,000, a smoke run)."""
    return [soak(30_000 if quick else 1_000_000)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_soak [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_soak", __doc__, lambda args: run(args.quick))


if __name__ == "__main__":
    sys.exit(main())
