"""Host-side cost of streaming: the dispatcher's hot path, the receiver, and throughput.

Run it as a script (``python benchmarks/bench_dispatcher.py``, ``--quick`` for a short run).
It prints one table:

- ``put`` from one thread, and from 4 threads at once (wall time per item): the only work a
  host callback does besides copying its arrays; next to the floor any thread-safe queue pays
  (a lock and a list append), so numbers from a busy machine can still be read.
- the receiver as the host callback runs it (``sowtel.primitive._deliver``: count the
  occurrence, copy the arrays, ``put``), per record; DESIGN §8 target: at most 3 µs.
- streaming a ``stats`` summary out of a jitted ``lax.scan``, per record: the step time with
  streaming minus without, divided by the records streamed (includes JAX's callback machinery).
- throughput from ``put`` through ``convert`` to the memory and jsonl exporters, items/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from sowtel.dispatcher import Dispatcher  # noqa: E402
from sowtel.exporters.jsonl import JsonlExporter  # noqa: E402
from sowtel.exporters.memory import MemoryExporter  # noqa: E402
from sowtel.records import Record  # noqa: E402


def _records(items: list) -> list[Record]:
    return [Record(name="h", mode="primal", tag="intermediates", step=i, index=None,
                   wall_time=0.0, summary="stats", shape=(16,), dtype="float32",
                   stats={"mean": 0.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0})
            for i in items]


def _nothing(items: list) -> list[Record]:
    return []


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(repeats))


def lock_and_append(n: int) -> float:
    """Seconds per uncontended lock + list append: the floor any thread-safe queue pays."""
    lock, items = threading.RLock(), []
    t0 = time.perf_counter()
    for i in range(n):
        with lock:
            items.append(i)
    return (time.perf_counter() - t0) / n


def put_one_thread(n: int) -> float:
    """Seconds per put() from one thread, with the dispatcher draining concurrently."""
    with Dispatcher([MemoryExporter()], convert=_nothing, queue_size=n + 1) as d:
        put, item = d.put, ("site", (np.zeros(6, np.float32), np.zeros(4, np.int32)), 0)
        t0 = time.perf_counter()
        for _ in range(n):
            put(item, 0)
        return (time.perf_counter() - t0) / n


def put_threads(n: int, threads: int = 4) -> float:
    """Wall seconds per put() while ``threads`` threads put at once."""
    with Dispatcher([MemoryExporter()], convert=_nothing, queue_size=n * threads + 1) as d:
        barrier = threading.Barrier(threads + 1)

        def produce() -> None:
            put = d.put
            barrier.wait()
            for _ in range(n):
                put(1, 0)

        workers = [threading.Thread(target=produce) for _ in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        return (time.perf_counter() - t0) / (n * threads)


def receiver(n: int) -> float:
    """Seconds per record through the receiver a host callback calls (real session code)."""
    import sowtel
    from sowtel.primitive import _deliver
    from sowtel.sites import StreamSite

    with sowtel.enable(exporter=MemoryExporter(max_records=1), queue_size=n + 1) as session:
        site = StreamSite(
            name="h", mode="primal", tag="intermediates", leaf_names=("h",),
            shapes=((16,),), dtypes=("float32",), summary="stats", every=1, bins=30,
            loops=None, extras=(),
        )
        floats, counts = np.zeros(6, np.float32), np.zeros(4, np.int32)
        t0 = time.perf_counter()
        for _ in range(n):
            _deliver(site, floats, counts)
        per = (time.perf_counter() - t0) / n
        received = session.status()["received"]
    if received != n:
        raise RuntimeError(f"the receiver enqueued {received} of {n} records")
    return per


def streaming_in_scan(length: int, repeats: int) -> tuple[float, float]:
    """Per-record seconds of streaming ``stats`` from a jitted scan, and the plain step time."""
    import jax
    import jax.numpy as jnp

    import sowtel

    def body(carry, _):
        h = sowtel.sow(jnp.tanh(carry), "h")
        return h * 0.5 + 1.0, None

    def f(x):
        return jax.lax.scan(body, x, None, length=length)[0]

    x = jnp.ones(16, jnp.float32)

    def timed(fn: Callable) -> float:
        fn(x).block_until_ready()
        jax.effects_barrier()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            jax.effects_barrier()
            best = min(best, time.perf_counter() - t0)
        return best

    plain = timed(jax.jit(f))
    with sowtel.enable(exporter=MemoryExporter(max_records=1), queue_size=length * 4):
        streamed = timed(jax.jit(f))
        sowtel.flush()
    return (streamed - plain) / length, plain


def throughput(n: int, exporter_factory: Callable[[], object]) -> float:
    """Items per second from put() through convert to the exporter (block mode, none lost)."""
    exporter = exporter_factory()
    with Dispatcher([exporter], convert=_records, on_full="block") as d:
        t0 = time.perf_counter()
        for i in range(n):
            d.put(i)
        if not d.flush(timeout=600.0):
            raise RuntimeError("flush timed out")
        elapsed = time.perf_counter() - t0
        exported = sum(d.status()["exported"].values())
    if exported != n:
        raise RuntimeError(f"only {exported} of {n} records were exported")
    return n / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    n = 5_000 if args.quick else 300_000
    repeats = 2 if args.quick else 5

    rows: list[tuple[str, str]] = []
    floor = best_of(repeats, lambda: lock_and_append(n))
    rows.append(("floor: lock + list.append", f"{floor * 1e6:.2f} µs/item"))
    one = best_of(repeats, lambda: put_one_thread(n))
    rows.append(("put(), 1 thread", f"{one * 1e6:.2f} µs/item ({one / floor:.1f}x the floor)"))
    rows.append(("put(), 4 threads at once",
                 f"{best_of(repeats, lambda: put_threads(n // 4)) * 1e6:.2f} µs/item (wall)"))
    rows.append(("receiver (count, copy, put)",
                 f"{best_of(repeats, lambda: receiver(n)) * 1e6:.2f} µs/record (target <= 3)"))
    length = 200 if args.quick else 2_000
    per_record, plain = streaming_in_scan(length, repeats)
    rows.append((f"stats from jit(scan) of {length}",
                 f"{per_record * 1e6:.2f} µs/record (plain step {plain * 1e3:.2f} ms)"))
    rows.append(("put -> convert -> memory",
                 f"{throughput(n, MemoryExporter):,.0f} items/s"))
    with tempfile.TemporaryDirectory() as logdir:
        rows.append(("put -> convert -> jsonl",
                     f"{throughput(n // 4, lambda: JsonlExporter(logdir=logdir)):,.0f} items/s"))

    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
