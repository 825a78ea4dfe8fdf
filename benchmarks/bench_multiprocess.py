"""The two-process training step: ``sowtel.jit`` streaming ``stats`` every step vs the plain step.

Starts two processes joined by ``jax.distributed`` on loopback (4 CPU devices each, a global
mesh of 8), which run the small-MLP workload data-parallel: the batch sharded over the 8
devices, the parameters replicated, gradients reduced across the processes by the compiled
program. Both processes time, interleaved in rounds, the plain step (``jax.jit``, no sows) and
the same step with sows through ``sowtel.jit`` with a session streaming ``stats`` every step
(each site's statistics reduced over the global activations on the devices; process 0 exports
the records), the same session through ``jax.jit`` (the callback transport), and ``sowtel.jit``
with ``every=10``. Process 0 reports the medians and their ratio, and the records per step it
exported, so a variant that streamed nothing cannot pass for a fast one.

Then the step's intermediates (``save_intermediates``: global arrays) are dumped, interleaved,
as per-process parts (each process writes the shards it holds) and by gathering them to every
process first (``process_allgather``) and dumping from process 0; process 0 then times loading
the parts against loading the gathered file.

Run: ``python -m benchmarks.bench_multiprocess [--quick]``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

TIMEOUT_S = 600.0


def _worker(k: int, port: int, out: Path, quick: bool) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import sowtel
    from benchmarks.workloads import make_train_step, mlp, no_tap
    from sowtel import multihost
    from sowtel.exporters.memory import MemoryExporter

    multihost.initialize(f"127.0.0.1:{port}", 2, k)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    work = mlp(batch=32, width=64) if quick else mlp()  # quick: a smoke run, small and short
    params, opt_state, batch = work.init()
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def put(tree: Any, sharding: Any) -> Any:
        def one(a: Any) -> Any:
            host = np.asarray(a)
            return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

        return jax.tree.map(one, tree)

    params, opt_state, batch = put(params, replicated), put(opt_state, replicated), put(
        batch, rows)
    step = jax.numpy.int32(0)
    plain = jax.jit(make_train_step(work, no_tap))
    rounds, n = (1, 3) if quick else (7, 20)
    times: dict[str, list[float]] = {}
    result: dict[str, Any] = {"process": k, "description": work.description}
    for every in (1, 10):
        memory = MemoryExporter(max_records=100_000)
        name = "sowtel.jit" if every == 1 else f"sowtel.jit every={every}"
        with sowtel.enable(exporter=memory, every=every):
            logged = sowtel.jit(make_train_step(work, sowtel.sow))
            variants = [(f"plain ({name})", plain), (name, logged)]
            if every == 1:
                variants.append(("callback", jax.jit(make_train_step(work, sowtel.sow))))
            for _, fn in variants:  # compile, warm up
                for _ in range(2):
                    jax.block_until_ready(fn(params, opt_state, batch, step))
            sowtel.flush()
            before = sowtel.status()["exported"]["memory"]
            for _ in range(rounds):
                for variant, fn in variants:
                    start = time.perf_counter()
                    for _ in range(n):
                        results = fn(params, opt_state, batch, step)
                    jax.block_until_ready(results)
                    times.setdefault(variant, []).append((time.perf_counter() - start) / n)
            sowtel.flush()
            exported = sowtel.status()["exported"]["memory"] - before
        result[f"records_per_step ({name})"] = exported / (rounds * n * (len(variants) - 1))
    result["median_s"] = {variant: float(np.median(t)) for variant, t in times.items()}
    result["dumps"] = _dumps(k, work, (params, batch), out, rounds=2 if quick else 5)
    (out / f"bench_{k}.json").write_text(json.dumps(result))


def _dumps(k: int, work: Any, args: tuple[Any, Any], out: Path, rounds: int) -> dict[str, Any]:
    """Dumping the step's intermediates (global arrays): per-process parts vs gathering them
    to process 0 first; then reading the parts vs reading the gathered file, in process 0."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import sowtel

    fn = jax.jit(sowtel.save_intermediates(
        lambda p, b: jax.value_and_grad(lambda q: work.loss(q, b, sowtel.sow))(p)))
    _, inter = fn(*args)
    jax.block_until_ready(inter)
    times: dict[str, list[float]] = {}
    for i in range(rounds):
        multihost_utils.sync_global_devices(f"dump parts {i}")
        start = time.perf_counter()
        part = sowtel.dump(inter, f"{out}/parts/", step=i)
        multihost_utils.sync_global_devices(f"dumped parts {i}")  # the job waits for both
        times.setdefault("dump parts", []).append(time.perf_counter() - start)
        start = time.perf_counter()
        gathered = jax.tree.map(lambda a: multihost_utils.process_allgather(a, tiled=True),
                                inter)
        if k == 0:
            whole = sowtel.dump(gathered, f"{out}/gathered/", step=i)
        multihost_utils.sync_global_devices(f"dumped gathered {i}")
        times.setdefault("gather + dump in process 0", []).append(time.perf_counter() - start)
    result: dict[str, Any] = {"nbytes": int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(
        gathered)))}
    if k == 0:
        for _ in range(rounds):  # interleaved
            for name, path in (("load parts", part), ("load gathered", whole)):
                start = time.perf_counter()
                sowtel.load(path)
                times.setdefault(name, []).append(time.perf_counter() - start)
    result["median_s"] = {name: float(np.median(t)) for name, t in times.items()}
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(quick: bool) -> dict[str, Any]:
    """Runs the two processes; returns process 0's result."""
    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_multiprocess", "--worker", str(k),
             str(port), tmp, *(["--quick"] if quick else [])], env=env, cwd=root)
            for k in (0, 1)]
        deadline = time.monotonic() + TIMEOUT_S
        try:
            for p in procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a benchmark process failed: {[p.returncode for p in procs]}")
        return json.loads((Path(tmp) / "bench_0.json").read_text())  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in args
    if args and args[0] == "--worker":
        _worker(int(args[1]), int(args[2]), Path(args[3]), quick)
        return 0
    result = run_pair(quick)
    median = result["median_s"]
    print(f"two processes x 4 CPU devices, {result['description']}")
    for name in ("sowtel.jit", "sowtel.jit every=10"):
        plain, logged = median[f"plain ({name})"], median[name]
        print(f"  plain step (jax.jit, no sows)  {plain * 1e3:8.2f} ms")
        print(f"  {name:<29}  {logged * 1e3:8.2f} ms   {logged / plain:.2f}x   "
              f"({result[f'records_per_step ({name})']:.1f} records/step, process 0)")
        if name == "sowtel.jit":
            callback = median["callback"]
            print(f"  {'callback (enable + jax.jit)':<29}  {callback * 1e3:8.2f} ms   "
                  f"{callback / plain:.2f}x")
    dumps = result["dumps"]
    times = dumps["median_s"]
    print(f"dumps of the step's intermediates ({dumps['nbytes'] / 2**20:.1f} MiB, global arrays)")
    for name, reference in (("dump parts", "gather + dump in process 0"),
                            ("load parts", "load gathered")):
        print(f"  {name:<29}  {times[name] * 1e3:8.2f} ms   {times[name] / times[reference]:.2f}x"
              f" of {reference} ({times[reference] * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
