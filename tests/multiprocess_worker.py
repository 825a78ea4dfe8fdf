"""One process of the two-process jobs of test_multiprocess.py.

Run as ``python multiprocess_worker.py SCENARIO PROCESS_ID PORT OUT_DIR``: joins a
``jax.distributed`` job of two processes on 127.0.0.1:PORT (4 CPU devices each, a global mesh
of 8), runs SCENARIO and writes what it saw to ``OUT_DIR/<scenario>_<process>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # not when the test imports it: its JAX keeps its own devices
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sowtel  # noqa: E402
from sowtel import multihost  # noqa: E402

ROWS, COLS, SCAN = 16, 4, 3
SCAN_FACTORS = (1.0, 0.5, -1.0)


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """The step's global inputs, also computed by the test (float32)."""
    # No element of x, w or x @ w is near 0, so float32 and float64 agree on the zero counts.
    x = np.linspace(-1.9, 2.3, ROWS * COLS).reshape(ROWS, COLS)
    w = np.linspace(-1.0, 1.0, COLS * COLS).reshape(COLS, COLS) * 0.5 + 0.05
    return x.astype(np.float32), w.astype(np.float32)


def scan_inputs(h: Any) -> Any:
    """What the step scans over: ``SCAN`` multiples of ``h``."""
    return jnp.stack([h * c for c in SCAN_FACTORS])


def make_loss(mesh: Mesh) -> Any:
    def loss(w: Any, x: Any) -> Any:
        h = sowtel.sow(jnp.tanh(x @ w), "h")  # sharded over both processes' devices

        def body(c: Any, r: Any) -> tuple[Any, None]:
            return c + sowtel.sow(r * 2.0, "s"), None

        # Each iteration's value is as sharded as h: a global record per iteration.
        c, _ = jax.lax.scan(body, jnp.zeros_like(h), scan_inputs(h))
        m = jax.shard_map(lambda b: sowtel.sow(b * 3.0, "m"), mesh=mesh, in_specs=P("d"),
                          out_specs=P("d"))(h)
        return jnp.sum(m ** 2) + jnp.sum(c)

    return loss


def global_inputs() -> tuple[Mesh, Any, Any]:
    """The mesh of every process's devices, w (replicated) and x (rows sharded over the 8)."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    xg, wg = inputs()
    x = jax.make_array_from_callback(xg.shape, NamedSharding(mesh, P("d")), lambda i: xg[i])
    w = jax.make_array_from_callback(wg.shape, NamedSharding(mesh, P()), lambda i: wg[i])
    return mesh, w, x


def full_records(loss: Any, w: Any, x: Any, **options: Any) -> dict[str, Any]:
    """summary="full" of every primal, through both transports: what this process exported."""
    out = {}
    for transport, fn in (("jit", sowtel.jit(loss)), ("callback", jax.jit(loss))):
        with sowtel.enable(exporter="memory", summary="full", modes=("primal",),
                           **options) as session:
            fn(w, x)
            sowtel.flush()
            out[f"full_{transport}"] = [
                {"name": r.name, "index": r.index, "process_index": r.process_index,
                 "value": np.asarray(r.value).tolist()} for r in session.exporters[0].records]
    return out


def as_json(r: sowtel.Record) -> dict[str, Any]:
    return {"name": r.name, "mode": r.mode, "step": r.step, "index": r.index,
            "process_index": r.process_index, "shape": list(r.shape), "stats": r.stats}


def stream(k: int, out: Path) -> dict[str, Any]:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.otel import OTelExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    mesh, w, x = global_inputs()
    loss = make_loss(mesh)
    result: dict[str, Any] = {}

    # The gathered value of the global site, for the test's numpy statistics.
    h = jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x)
    result["h"] = np.asarray(multihost_utils.process_allgather(h, tiled=True)).tolist()

    # save_intermediates gives global arrays, as JAX does; each process dumps its shards of
    # them (and of the replicated w, which only process 0 holds a first copy of).
    _, inter = jax.jit(sowtel.save_intermediates(jax.value_and_grad(loss)))(w, x)
    result["captured_h"] = np.asarray(multihost_utils.process_allgather(
        inter["h"]["primal"], tiled=True)).tolist()
    result["captured_m_shape"] = list(inter["m"]["primal"].shape)
    result["dump"] = str(sowtel.dump({**inter, "w": {"primal": w}}, f"{out}/dumps/", step=0,
                                     metadata={"written_by": k}))
    try:  # a process-local value beside global ones: each process's would differ
        sowtel.dump({**inter, "local": {"primal": np.full(2, k)}}, out / "mixed", step=0)
    except ValueError as e:
        result["mixed_error"] = str(e)
    with sowtel.enable(exporter="memory"):
        try:  # records of a global value: no host holds it whole
            sowtel.export(inter, step=0)
        except ValueError as e:
            result["export_error"] = str(e)

    # Callback transport: enable() + jax.jit, two host-side steps.
    step = jax.jit(jax.value_and_grad(loss))
    with sowtel.enable(exporter="memory") as session:
        for i in range(2):
            with sowtel.at_step(i):
                value, _ = step(w, x)
        sowtel.flush()
        result["callback"] = [as_json(r) for r in session.exporters[0].records]
        callback_hlo = step.lower(w, x).compile().as_text()
    result["loss"] = float(value)

    # sowtel.jit, two counted steps, to every kind of exporter.
    spans = InMemorySpanExporter()
    exporters = [
        "memory", JsonlExporter(logdir=out / "jsonl"),
        TensorBoardExporter(logdir=str(out / "tb")),
        OTelExporter(span_processors=[SimpleSpanProcessor(spans)]),
    ]
    jstep = sowtel.jit(jax.value_and_grad(loss))
    with sowtel.enable(exporter=exporters) as session:
        for _ in range(2):
            value, _ = jstep(w, x)
        sowtel.flush()
        result["jit"] = [as_json(r) for r in session.exporters[0].records]
        # The collectives of the logging program, against those of the plain one.
        hlo = {"plain": jstep.lower(w, x).compile().as_text(),
               "logging": jstep.lower_logging(w, x, step=0).compile().as_text(),
               "callback": callback_hlo}
        result["collectives"] = {name: {op: text.count(f" {op}(") for op in (
            "all-reduce", "all-gather", "all-to-all", "collective-permute")}
            for name, text in hlo.items()}
    result["jit_loss"] = float(value)
    result["jit_status"] = {k: v for k, v in sowtel.status().items()
                            if k in ("received", "exported", "dropped", "errors", "accounts")}
    # summary="full": whole values, a global one gathered to process 0 by both transports.
    result.update(full_records(loss, w, x))
    result["resource"] = sorted({
        (key, str(val)) for s in spans.get_finished_spans()
        for key, val in s.resource.attributes.items() if key.startswith("process.")})
    return result


def export_process(k: int, out: Path) -> dict[str, Any]:
    # Process 1 exports the global records: by enable(export_process=1) with the callback
    # transport, by $SOWTEL_EXPORT_PROCESS=1 with sowtel.jit.
    mesh, w, x = global_inputs()
    loss = make_loss(mesh)
    result: dict[str, Any] = {}
    step = jax.jit(jax.value_and_grad(loss))
    with sowtel.enable(exporter="memory", export_process=1) as session:
        for i in range(2):
            with sowtel.at_step(i):
                step(w, x)
        sowtel.flush()
        result["callback"] = [as_json(r) for r in session.exporters[0].records]
    os.environ[multihost.EXPORT_PROCESS_ENV] = "1"
    jstep = sowtel.jit(jax.value_and_grad(loss))
    with sowtel.enable(exporter="memory") as session:
        for _ in range(2):
            jstep(w, x)
        sowtel.flush()
        result["jit"] = [as_json(r) for r in session.exporters[0].records]
    del os.environ[multihost.EXPORT_PROCESS_ENV]
    # summary="full": the whole global value, gathered to the export process.
    result.update(full_records(loss, w, x, export_process=1))
    errors = []
    for bad in (2, -1, True, "1"):
        try:
            sowtel.enable(exporter="memory", export_process=bad)
        except ValueError as e:
            errors.append(str(e))
    result["bad"] = errors
    try:  # each process names itself: the processes disagree
        sowtel.enable(exporter="memory", export_process=k)
    except ValueError as e:
        result["disagree"] = str(e)
    return result


def mismatch(k: int, out: Path) -> dict[str, Any]:
    # Process 1 asks for another summary: both processes must refuse, neither may hang.
    try:
        sowtel.enable(exporter="memory", summary="stats" if k == 0 else "health")
    except ValueError as e:
        return {"error": "ValueError", "class": type(e).__name__, "message": str(e)}
    return {"error": None}


def one_sided(k: int, out: Path) -> dict[str, Any]:
    # Only process 0 enables; it must give up within SOWTEL_PEER_TIMEOUT and both processes
    # then still run the step together.
    result: dict[str, Any] = {"error": None}
    if k == 0:
        start = time.monotonic()
        try:
            sowtel.enable(exporter="memory")
        except RuntimeError as e:
            result.update(error="RuntimeError", message=str(e))
        result["waited"] = time.monotonic() - start
    multihost_utils.sync_global_devices("after one-sided enable")
    mesh, w, x = global_inputs()
    result["loss"] = float(sowtel.jit(make_loss(mesh))(w, x))
    return result


def nudged_inputs(mesh: Mesh) -> Any:
    """x with the rows of process 1's devices (8..15) nudged: a run that diverges there."""
    xg, _ = inputs()
    xg = xg.copy()
    xg[ROWS // 2:] += 1e-3
    return jax.make_array_from_callback(xg.shape, NamedSharding(mesh, P("d")), lambda i: xg[i])


def compare_runs(k: int, out: Path) -> dict[str, Any]:
    # Runs for sowtel.compare_runs, by both transports: "a", and "b", whose inputs are nudged
    # from step 2 on in process 1's rows only. Each writes jsonl and TensorBoard runs.
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    mesh, w, x = global_inputs()
    x_nudged = nudged_inputs(mesh)
    loss = make_loss(mesh)
    jitted = sowtel.jit(jax.value_and_grad(loss))
    plain = jax.jit(jax.value_and_grad(loss))
    for transport in ("jit", "callback"):
        for run in ("a", "b"):
            where = out / f"{transport}-{run}"
            exporters = [JsonlExporter(logdir=where / "jsonl"),
                         TensorBoardExporter(logdir=str(where / "tb"))]
            with sowtel.enable(exporter=exporters):
                for i in range(4):
                    xi = x_nudged if run == "b" and i >= 2 else x
                    if transport == "jit":
                        jitted(w, xi)
                    else:
                        with sowtel.at_step(i):
                            plain(w, xi)
                sowtel.flush()
    return {}


SCENARIOS = {"stream": stream, "mismatch": mismatch, "one_sided": one_sided,
             "export_process": export_process, "compare_runs": compare_runs}


def main() -> None:
    scenario, k, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    multihost.initialize(f"127.0.0.1:{port}", 2, k)  # SOWTEL_PEER_TIMEOUT bounds it
    result = SCENARIOS[scenario](k, out)
    result["process_index"] = jax.process_index()
    (out / f"{scenario}_{k}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
