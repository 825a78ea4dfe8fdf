"""Two real JAX processes (``jax.distributed`` on loopback), 4 CPU devices each, a mesh of 8.

Each job starts tests/multiprocess_worker.py twice and waits a bounded time: a hung process fails
the test (both are killed), it never hangs the suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_stats
from tensorboard.backend.event_processing import event_accumulator as ea

from sowtel import multihost
from sowtel.dumps import info, load
from sowtel.exporters.jsonl import read_records
from sowtel.postmortem import inspect_dump

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multiprocess_worker.py"
sys.path.insert(0, str(HERE))
import multiprocess_worker as worker  # noqa: E402

JOB_TIMEOUT = 60.0  # seconds for a whole job of two processes, start to exit
STAT_KEYS = ("size", "mean", "std", "min", "max", "l2", "mean_abs", "nan", "posinf", "neginf",
             "zeros")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(scenario: str, out: Path, *, processes: tuple[int, ...] = (0, 1),
            env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT
            ) -> list[tuple[int, str, dict[str, Any] | None]]:
    """Runs ``scenario`` in the given processes of a job of two; (exit status, log, result)."""
    port = free_port()
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    logs = [out / f"{scenario}_{k}.log" for k in processes]
    procs = []
    for k, log in zip(processes, logs, strict=True):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(k), str(port), str(out)],
                stdout=f, stderr=subprocess.STDOUT, env=full_env))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        text = "\n".join(f"--- process {k}:\n{log.read_text()[-3000:]}"
                         for k, log in zip(processes, logs, strict=True))
        pytest.fail(f"{scenario}: the job did not end within {timeout:g} s\n{text}")
    results = []
    for k, p, log in zip(processes, procs, logs, strict=True):
        path = out / f"{scenario}_{k}.json"
        results.append((p.returncode, log.read_text(),
                        json.loads(path.read_text()) if path.exists() else None))
    return results


def ok(results: list[tuple[int, str, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    for k, (rc, log, result) in enumerate(results):
        assert rc == 0 and result is not None, f"process {k} failed (exit {rc}):\n{log[-4000:]}"
    return [r for _, _, r in results]  # type: ignore[misc]


# -- what the records must say, computed another way ------------------------------------------


def references() -> dict[tuple[str, str, Any], np.ndarray]:
    """Each record's value, keyed by (name, mode, index), from a single-process computation.

    Cotangents are the gradients of the loss with respect to a perturbation added at each site.
    """
    x, w = worker.inputs()

    def perturbed(eh: Any, es: Any, em: Any) -> Any:
        h = jnp.tanh(jnp.asarray(x) @ jnp.asarray(w)) + eh
        c = jnp.sum(worker.scan_inputs(h) * 2.0 + es, axis=0)
        m = h * 3.0 + em
        return jnp.sum(m ** 2) + jnp.sum(c)

    h = np.tanh(x.astype(np.float64) @ w.astype(np.float64))
    zeros = (jnp.zeros((worker.ROWS, worker.COLS)),
             jnp.zeros((worker.SCAN, worker.ROWS, worker.COLS)),
             jnp.zeros((worker.ROWS, worker.COLS)))
    cot_h, cot_s, cot_m = (np.asarray(g) for g in jax.grad(perturbed, argnums=(0, 1, 2))(*zeros))
    rows = worker.ROWS // 8
    out: dict[tuple[str, str, Any], np.ndarray] = {
        ("h", "primal", None): h, ("h", "cotangent", None): cot_h}
    for i in range(worker.SCAN):
        out[("s", "primal", i)] = h * worker.SCAN_FACTORS[i] * 2.0
        out[("s", "cotangent", i)] = cot_s[i]
    for i in range(8):
        out[("m", "primal", i)] = h[i * rows:(i + 1) * rows] * 3.0
        out[("m", "cotangent", i)] = cot_m[i * rows:(i + 1) * rows]
    return out


def owner(key: tuple[str, str, Any]) -> int:
    """The process expected to export a record: process 0, or the one that ran its shard."""
    name, _, index = key
    return index // 4 if name == "m" else 0


def check_records(per_process: list[list[dict[str, Any]]], steps: list[int],
                  refs: dict[tuple[str, str, Any], np.ndarray], owner=owner) -> None:
    seen: dict[tuple[Any, ...], int] = {}
    for k, records in enumerate(per_process):
        for r in records:
            key = (r["name"], r["mode"], r["index"])
            assert r["process_index"] == k, r
            assert k == owner(key), f"process {k} exported {key}, owned by {owner(key)}"
            seen[(*key, r["step"])] = seen.get((*key, r["step"]), 0) + 1
            want = numpy_stats(refs[key])
            got = {s: r["stats"][s] for s in STAT_KEYS}
            np.testing.assert_allclose([got[s] for s in STAT_KEYS], [want[s] for s in STAT_KEYS],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{key}")
    expected = {(*key, step): 1 for key in refs for step in steps}
    assert seen == expected  # every record once, in exactly one process


def check_dumps(out: Path, results: list[dict[str, Any]],
                refs: dict[tuple[str, str, Any], np.ndarray]) -> None:
    """Each process dumped its own shards; read together they are the global values."""
    parts = [out / "dumps" / f"step_0.process_{k}.safetensors" for k in (0, 1)]
    assert [r["dump"] for r in results] == [str(p) for p in parts]
    assert sorted(p.name for p in (out / "dumps").iterdir()) == [p.name for p in parts]
    rows = worker.ROWS // 8
    for k, part in enumerate(parts):
        header = info(part)
        assert header.process == (k, 2) and header.metadata == {"written_by": k}
        by_name = {(e.name, e.mode): e for e in header.entries}
        h = by_name[("h", "primal")]
        assert (h.shape, h.key) == ((worker.ROWS, worker.COLS), "")
        # Process k's devices hold rows 8k..8k+8 of h, two rows each, each block once.
        assert sorted(box for _, _, box in h.shards) == [
            ((r, r + rows), (0, worker.COLS)) for r in range(8 * k, 8 * k + 8, rows)]
        assert {p for p, _, _ in h.shards} == {k}
        w_shards = by_name[("w", "primal")].shards
        assert [box for _, _, box in w_shards] == ([((0, worker.COLS), (0, worker.COLS))]
                                                   if k == 0 else [])
    # Any part, both parts, or the folder: the global values.
    _, w = worker.inputs()
    for loaded in (load(parts[1]), load(parts), load(out / "dumps")[0]):
        assert list(loaded) == ["h", "s", "m", "w"]
        np.testing.assert_allclose(loaded["h"]["primal"], refs[("h", "primal", None)],
                                   rtol=1e-6)
        np.testing.assert_allclose(loaded["h"]["cotangent"], refs[("h", "cotangent", None)],
                                   rtol=1e-5, atol=1e-6)
        for mode in ("primal", "cotangent"):
            np.testing.assert_allclose(
                loaded["s"][mode], np.stack([refs[("s", mode, i)] for i in range(worker.SCAN)]),
                rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(
                loaded["m"][mode], np.stack([refs[("m", mode, i)] for i in range(8)]),
                rtol=1e-5, atol=1e-6)
        assert loaded["s"].stacked["cotangent"] == (("scan", worker.SCAN),)
        assert loaded["m"].stacked["primal"] == (("shard", 8),)
        np.testing.assert_array_equal(loaded["w"]["primal"], w)
    # sowtel inspect reports the statistics of the global values.
    report = inspect_dump(parts[0])
    assert report.info.parts == tuple(parts)
    row = next(r for r in report.rows if (r.entry.name, r.entry.mode) == ("h", "primal"))
    want = numpy_stats(refs[("h", "primal", None)])
    np.testing.assert_allclose([row.stats[s] for s in STAT_KEYS], [want[s] for s in STAT_KEYS],
                               rtol=1e-5, atol=1e-5)
    for r in results:
        assert "'local'" in r["mixed_error"] and "written in parts" in r["mixed_error"]
        assert "intermediates['h']['primal'] is a jax.Array of global shape (16, 4)" in r[
            "export_error"] and "sowtel.load the parts" in r["export_error"]
    assert not (out / "mixed").exists() or not any((out / "mixed").iterdir())


def test_both_transports_give_one_coherent_set_of_records_across_two_processes(tmp_path):
    results = ok(run_job("stream", tmp_path))
    refs = references()
    gathered = np.asarray(results[0]["h"])
    # Statistics against numpy on the value gathered from both processes' devices.
    np.testing.assert_allclose(gathered, refs[("h", "primal", None)], rtol=1e-5, atol=1e-6)
    refs[("h", "primal", None)] = gathered
    # save_intermediates: the global value (shard_map sites stacked on a leading shard axis).
    for r in results:
        np.testing.assert_allclose(np.asarray(r["captured_h"]), gathered, rtol=1e-6)
        assert r["captured_m_shape"] == [8, worker.ROWS // 8, worker.COLS]
    check_dumps(tmp_path, results, refs)
    for transport in ("callback", "jit"):
        check_records([r[transport] for r in results], [0, 1], refs)
    assert results[0]["loss"] == pytest.approx(results[1]["jit_loss"], rel=1e-6)
    # Process 0 exported the global records (2 sites x 2 modes + scan and its own shards), and
    # both processes' exporters counted every record they were handed.
    for k, r in enumerate(results):
        n = len(r["jit"])
        assert r["jit_status"]["exported"] == {
            "memory": n, "jsonl": n, "tensorboard": n, "otel": n}, r["jit_status"]
        assert r["resource"] == [["process.count", "2"], ["process.index", str(k)]]
        for label in ("memory", "jsonl", "tensorboard", "otel"):
            account = r["jit_status"]["accounts"][label]
            assert account["received"] == account["exported"] == n, account
    assert [len(r["jit"]) for r in results] == [2 * (2 + 6 + 8), 2 * 8]

    # sowtel.jit's summaries of the global sites (h, and s in every iteration of its scan)
    # cross between processes in one all-gather: no more all-reduces than the step's own.
    for r in results:
        plain, logging = r["collectives"]["plain"], r["collectives"]["logging"]
        assert logging == {**plain, "all-gather": plain["all-gather"] + 1}, r["collectives"]
        # The callback transport: an all-gather per global site in the program text (h and s,
        # primal and cotangent: 4, or fewer where XLA merges them), no all-reduce beyond the
        # step's own (a direct summary holds about eight a site).
        callback = r["collectives"]["callback"]
        assert callback["all-reduce"] == plain["all-reduce"], r["collectives"]
        assert 1 <= callback["all-gather"] - plain["all-gather"] <= 4, r["collectives"]

    # summary="full": the whole value of each record, once, in the process that owns it.
    for transport in ("jit", "callback"):
        full = [(k, r) for k, result in enumerate(results) for r in result[f"full_{transport}"]]
        assert sorted((r["name"], str(r["index"])) for _, r in full) == sorted(
            (name, str(index)) for name, mode, index in refs if mode == "primal")
        for k, r in full:
            key = (r["name"], "primal", r["index"])
            assert k == r["process_index"] == owner(key)
            np.testing.assert_allclose(np.asarray(r["value"]), refs[key], rtol=1e-5, atol=1e-6)

    # jsonl: one file per process, holding that process's records.
    for k, r in enumerate(results):
        lines = read_records(tmp_path / "jsonl" / f"records_process_{k}.jsonl")
        assert sorted((x.name, x.mode, str(x.index), x.step) for x in lines) == sorted(
            (x["name"], x["mode"], str(x["index"]), x["step"]) for x in r["jit"])
        assert {x.process_index for x in lines} == {k}
    # TensorBoard: one run per process; global sites only in process 0's.
    # A site's shards and scan iterations are one depth tensor a step (its first row the index).
    from tensorboard.util import tensor_util

    tags, shards = [], []
    for k in (0, 1):
        acc = ea.EventAccumulator(str(tmp_path / "tb" / f"process_{k}"),
                                  size_guidance={ea.TENSORS: 0})
        acc.Reload()
        tags.append({t.split("/")[0] for t in acc.Tags()["scalars"]})
        shards.append(sorted({int(i) for e in acc.Tensors("m/primal/depth")
                              for i in tensor_util.make_ndarray(e.tensor_proto)[0]}))
    assert tags == [{"h", "s", "m"}, {"m"}]
    assert shards == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_another_process_can_export_the_global_records(tmp_path):
    results = ok(run_job("export_process", tmp_path))
    refs = references()

    def owner_1(key: tuple[str, str, Any]) -> int:  # shard_map shards stay where they ran
        name, _, index = key
        return index // 4 if name == "m" else 1

    for transport in ("callback", "jit"):
        check_records([r[transport] for r in results], [0, 1], refs, owner_1)
        # Process 0 keeps only the records of its own shards: 2 modes x 4 shards x 2 steps.
        assert len(results[0][transport]) == 16
        full = [(k, r) for k, result in enumerate(results) for r in result[f"full_{transport}"]]
        assert sorted((r["name"], str(r["index"])) for _, r in full) == sorted(
            (name, str(index)) for name, mode, index in refs if mode == "primal")
        for k, r in full:
            key = (r["name"], "primal", r["index"])
            assert k == r["process_index"] == owner_1(key), (transport, key, k)
            np.testing.assert_allclose(np.asarray(r["value"]), refs[key], rtol=1e-5, atol=1e-6)
    for r in results:
        bad = r["bad"]
        assert len(bad) == 4, bad
        assert "export_process=2 must be a process of this job: 0 <= export_process < 2" in bad[0]
        assert "export_process=-1 must be a process" in bad[1]
        assert "export_process=True must be an int" in bad[2]
        assert "export_process='1' must be an int" in bad[3]
    for k, r in enumerate(results):
        assert "export_process: " in r["disagree"] and f"process {1 - k}" in r["disagree"], r


def test_settings_that_differ_between_processes_raise_in_both(tmp_path):
    results = ok(run_job("mismatch", tmp_path))
    for k, r in enumerate(results):
        assert r["error"] == "ValueError" and r["class"] == "MismatchedProcessesError", r
        assert "summary: " in r["message"] and f"process {1 - k}" in r["message"], r["message"]


def test_enabling_in_one_process_only_fails_within_the_peer_timeout(tmp_path):
    results = ok(run_job("one_sided", tmp_path, env={multihost.PEER_TIMEOUT_ENV: "3"}))
    first = results[0]
    assert first["error"] == "RuntimeError", first
    assert "process 1 did not call sowtel.enable()" in first["message"]
    assert 2.5 <= first["waited"] < 30, first["waited"]
    # Both processes then ran the step together (no deadlock) and agree on it.
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)


def test_a_peer_that_never_starts_fails_the_job_within_the_bound(tmp_path):
    start = time.monotonic()
    [(rc, log, result)] = run_job("mismatch", tmp_path, processes=(0,),
                                  env={multihost.PEER_TIMEOUT_ENV: "5"})
    # JAX ends the process (it aborts) when its initialization_timeout, bounded by
    # SOWTEL_PEER_TIMEOUT, passes with a process missing.
    assert rc != 0 and result is None
    assert time.monotonic() - start < 40
    assert "DEADLINE_EXCEEDED" in log, log[-2000:]


def test_an_unreachable_coordinator_is_a_clear_error_before_jax_waits(tmp_path):
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"coordinator 127.0.0.1:{port} did not accept"):
        multihost.initialize(f"127.0.0.1:{port}", 2, 1, timeout=1.5)
    assert time.monotonic() - start < 10
    assert jax.process_count() == 1  # jax.distributed was never initialised here


@pytest.mark.parametrize("args, match", [
    (("127.0.0.1", 2, 1), "must be 'host:port'"),
    (("127.0.0.1:1234", 2, 2), "must be below num_processes=2"),
    (("127.0.0.1:1234", "two", 0), "num_processes='two' must be an int"),
])
def test_launch_arguments_are_checked(args, match):
    with pytest.raises(ValueError, match=match):
        multihost.initialize(*args, timeout=1)


@pytest.mark.parametrize("value, env, match", [
    (1, None, "export_process=1 must be a process of this job: 0 <= export_process < 1"),
    (1.0, None, "export_process=1.0 must be an int"),
    (None, "one", r"\$SOWTEL_EXPORT_PROCESS='one' must be an int"),
    (None, "3", r"\$SOWTEL_EXPORT_PROCESS=3 must be a process of this job"),
])
def test_a_bad_export_process_is_refused_before_anything_starts(monkeypatch, tmp_path, value,
                                                                 env, match):
    import sowtel

    monkeypatch.chdir(tmp_path)
    if env is not None:
        monkeypatch.setenv(multihost.EXPORT_PROCESS_ENV, env)
    with pytest.raises(ValueError, match=match):
        sowtel.enable(exporter="jsonl", export_process=value)
    assert list(tmp_path.iterdir()) == []  # no exporter was made
    assert not sowtel.status()["enabled"]


def test_the_export_process_keys_compiled_programs_apart():
    import sowtel

    with sowtel.enable(exporter="memory", export_process=0) as a:
        pass
    assert a.config.export_process == 0
    assert a.config != dataclasses.replace(a.config, export_process=1)


def test_the_keyword_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(multihost.EXPORT_PROCESS_ENV, "7")  # not a process of this job
    assert multihost.check_export_process(0) == 0
    monkeypatch.setenv(multihost.EXPORT_PROCESS_ENV, " 0 ")
    assert multihost.check_export_process(None) == 0
    monkeypatch.setenv(multihost.EXPORT_PROCESS_ENV, "")
    assert multihost.check_export_process(None) == 0


@pytest.fixture(scope="module")
def compare_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs "a" and "b" of a job of two processes by both transports, b's inputs nudged from
    step 2 on in the rows of process 1's devices (multiprocess_worker.compare_runs)."""
    out = tmp_path_factory.mktemp("compare_job")
    ok(run_job("compare_runs", out))
    return out


def test_runs_of_two_processes_compare_process_by_process(compare_job):
    """Process 0's global records (h, then s) and process 1's shards 4..7 of m diverge at step
    2, and nothing before."""
    import sowtel
    from sowtel.compare import diff_runs

    tmp_path = compare_job
    runs = {"jsonl": "records_process_{}.jsonl", "tb": "process_{}"}
    for kind, one in runs.items():
        for transport in ("jit", "callback"):
            a, b = tmp_path / f"{transport}-a" / kind, tmp_path / f"{transport}-b" / kind
            # Each process's run against its counterpart.
            d0 = sowtel.compare_runs(a / one.format(0), b / one.format(0))
            d1 = sowtel.compare_runs(a / one.format(1), b / one.format(1))
            assert (d0.step, d0.name, d0.mode, d0.index, d0.process_index) == (
                2, "h", "primal", None, 0), str(d0)
            assert (d1.step, d1.name, d1.mode, d1.index, d1.process_index) == (
                2, "m", "primal", 4, 1), str(d1)
            # The job's folders: compared process by process, the first of both answers.
            report = diff_runs(a, b)
            assert report.processes == "per process"
            assert (report.divergence.name, report.divergence.process_index) == ("h", 0)
            assert report.divergence.context[0].name == "s"  # h, then the scan over it
        # Both transports give the same records.
        assert sowtel.compare_runs(tmp_path / "jit-a" / kind,
                                   tmp_path / "callback-a" / kind) is None


def test_runs_on_different_numbers_of_processes_compare_as_one(compare_job, tmp_path):
    """The same steps on one process of 8 devices: its records meet those the two processes
    of 4 devices wrote by site, mode and index (a shard's is global)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import sowtel
    from sowtel.compare import diff_runs
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    mesh = Mesh(np.array(jax.devices()), ("d",))
    assert mesh.size == 8
    xg, wg = worker.inputs()
    x = jax.device_put(xg, NamedSharding(mesh, P("d")))
    w = jax.device_put(wg, NamedSharding(mesh, P()))
    step = sowtel.jit(jax.value_and_grad(worker.make_loss(mesh)))
    exporters = [JsonlExporter(logdir=tmp_path / "one" / "jsonl"),
                 TensorBoardExporter(logdir=str(tmp_path / "one" / "tb"))]
    with sowtel.enable(exporter=exporters):
        for _ in range(4):
            step(w, x)
        assert sowtel.flush(timeout=60.0)
    for kind in ("jsonl", "tb"):
        report = diff_runs(compare_job / "jit-a" / kind, tmp_path / "one" / kind)
        assert report.processes == "merged"
        assert (report.divergence, report.steps, report.records) == (None, 4, 24)
        div = sowtel.compare_runs(compare_job / "jit-b" / kind, tmp_path / "one" / kind)
        assert (div.step, div.name, div.mode) == (2, "h", "primal")
