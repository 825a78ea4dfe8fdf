"""The small built-in exporters (memory, console, jsonl) and the exporter registry.

Files are real, read back with numpy and a strict JSON parser; the end-to-end tests stream from
jitted JAX code through ``sowtel.enable``.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import numpy_stats

import sowtel
from sowtel import exporters
from sowtel.dispatcher import Dispatcher
from sowtel.exporters.console import ConsoleExporter, format_record
from sowtel.exporters.jsonl import JsonlExporter, read_records
from sowtel.exporters.memory import MemoryExporter
from sowtel.records import STAT_KEYS, Record


def record(name: str = "h", mode: str = "primal", step: int = 0, **fields) -> Record:
    base = dict(name=name, mode=mode, tag="intermediates", step=step, index=None,
                wall_time=1700000000.25, summary="stats", shape=(2, 3), dtype="float32")
    base.update(fields)
    return Record(**base)


def strict_json(line: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


# -- memory -------------------------------------------------------------------------------------

def test_memory_keeps_records_and_filters_by_name_and_mode():
    memory = MemoryExporter()
    memory.write([record("a", step=2, seq=5), record("b", step=0), record("a", "cotangent", 1)])
    memory.write([record("a", step=1, seq=9), record("a", step=1, seq=3)])
    assert len(memory) == 5
    assert [(r.step, r.seq) for r in memory.by_name("a", mode="primal")] == [(1, 3), (1, 9), (2, 5)]
    assert [r.mode for r in memory.by_name("a")] == ["cotangent", "primal", "primal", "primal"]
    assert memory.by_name("zzz") == []
    assert memory.names() == ["a", "b"]
    snapshot = memory.records
    memory.clear()
    assert len(memory) == 0 and len(snapshot) == 5
    memory.close()


def test_memory_max_records_keeps_the_newest():
    memory = MemoryExporter(max_records=3)
    memory.write([record(step=i) for i in range(5)])
    memory.write([record(step=5)])
    assert [r.step for r in memory.records] == [3, 4, 5]
    with pytest.raises(ValueError, match="max_records=0 must be a positive integer"):
        MemoryExporter(max_records=0)


def test_memory_reads_are_safe_while_a_dispatcher_writes():
    memory = MemoryExporter()
    d = Dispatcher([memory], convert=lambda items: [record(step=i) for i in items],
                   queue_size=100_000, flush_interval=0.001)
    seen_lengths, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            steps = [r.step for r in memory.records]
            # A snapshot is always a prefix of what was written, never a torn list.
            assert steps == list(range(len(steps)))
            seen_lengths.append(len(steps))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(20_000):
        d.put(i)
    d.close(timeout=10.0)
    stop.set()
    reader.join()
    assert [r.step for r in memory.records] == list(range(20_000))
    assert seen_lengths == sorted(seen_lengths)


# -- console ------------------------------------------------------------------------------------

def test_console_lines_have_the_documented_format():
    out = io.StringIO()
    console = ConsoleExporter(stream=out)
    stats = dict(zip(STAT_KEYS, (32.0, 0.125, 1.5, -2.0, 4.0, 12.3, 1.0, 0.0, 0.0, 0.0, 3.0),
                     strict=True))
    bad = {**stats, "nan": 2.0, "neginf": 1.0}
    console.write([
        record("block0/attn", "cotangent", 3, index=2, shape=(4, 8), stats=stats),
        record("scan/h", "primal", 12, index=(1, 0), shape=(5,), dtype="bfloat16", stats=bad),
        record("w", step=4, summary="shape", shape=(), dtype="int32"),
    ])
    console.flush()
    assert out.getvalue().splitlines() == [
        "[sowtel] step     3  block0/attn cotangent[2]  float32[4,8]   "
        "mean=0.125 std=1.5 min=-2 max=4 l2=12.3",
        "[sowtel] step    12  scan/h primal[1,0]      bfloat16[5]    "
        "mean=0.125 std=1.5 min=-2 max=4 l2=12.3  NONFINITE nan=2 +inf=0 -inf=1",
        "[sowtel] step     4  w primal                int32[]        (shape)",
    ]


def test_console_full_records_show_stats_of_their_value():
    value = np.array([[1.0, -3.0, 0.5], [2.0, np.inf, 0.0]], np.float32)
    line = format_record(record("f", summary="full", value=value))
    ref = numpy_stats(value)
    shown = dict(part.split("=") for part in line.split() if "=" in part)
    for key in ("mean", "std", "min", "max", "l2"):
        assert float(shown[key]) == pytest.approx(ref[key], rel=1e-3)
    assert shown["+inf"] == "1" and line.endswith("(full)")


def test_console_every_and_default_stream(capsys):
    console = ConsoleExporter(every=5)
    console.write([record(step=s) for s in range(12)])
    console.flush()
    steps = [int(line.split()[2]) for line in capsys.readouterr().out.splitlines()]
    assert steps == [0, 5, 10]
    with pytest.raises(ValueError, match="every=0 must be a positive integer"):
        ConsoleExporter(every=0)
    with pytest.raises(TypeError, match="has no write"):
        ConsoleExporter(stream="stdout")  # type: ignore[arg-type]


# -- jsonl --------------------------------------------------------------------------------------

def test_jsonl_round_trip_with_nonfinite_stats_histograms_and_full_values(tmp_path):
    logdir = tmp_path / "run"
    full = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    edges, counts = np.linspace(-1.0, 1.0, 5), np.array([1.0, 0.0, 3.0, 2.0])
    stats = {**numpy_stats(np.array([1.0, np.nan, np.inf, -np.inf])), "mean": 1.0}
    records = [
        record("a/b", step=3, index=(2, 1), stats=stats, seq=17, process_index=1),
        record("a/b", "cotangent", 3, summary="histogram", stats=numpy_stats(edges),
               histogram=(edges, counts)),
        record("w", "tangent", 4, index=5, summary="full", shape=(3, 4), value=full),
        record("mask", step=4, summary="full", shape=(2,), dtype="bool",
               value=np.array([True, False])),
        record("half", step=4, summary="full", shape=(2,), dtype="bfloat16",
               value=np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)),
    ]
    jsonl = JsonlExporter(logdir=logdir)
    jsonl.write(records)
    jsonl.close()
    jsonl.close()  # idempotent

    lines = (logdir / "records.jsonl").read_text().splitlines()
    objs = [strict_json(line) for line in lines]
    assert len(objs) == 5
    assert objs[0]["stats"]["nan"] == 1.0 and objs[0]["stats"]["min"] == 1.0
    assert objs[0]["index"] == [2, 1] and objs[0]["seq"] == 17 and objs[0]["process_index"] == 1
    assert objs[0]["stats"]["std"] == 0.0 and objs[0]["value_file"] is None
    nonfinite = record("n", stats={"mean": math.nan, "max": math.inf, "min": -math.inf})
    jsonl2 = JsonlExporter(logdir=logdir, filename="more.jsonl")
    jsonl2.write([nonfinite])
    jsonl2.close()
    more = strict_json((logdir / "more.jsonl").read_text())
    assert more["stats"] == {"mean": "NaN", "max": "Infinity", "min": "-Infinity"}

    # Sidecars, read independently with numpy (never unpickling).
    sidecar = objs[2]["value_file"]
    assert sidecar.startswith("records_values/") and sidecar.endswith(".npy")
    np.testing.assert_array_equal(np.load(logdir / sidecar, allow_pickle=False), full)
    assert np.load(logdir / objs[3]["value_file"], allow_pickle=False).dtype == np.bool_
    stored_half = np.load(logdir / objs[4]["value_file"], allow_pickle=False)
    assert stored_half.dtype == np.float32 and objs[4]["value_dtype"] == "float32"
    np.testing.assert_array_equal(stored_half, [1.5, -2.0])

    back = read_records(logdir / "records.jsonl")
    assert len(back) == 5
    for original, restored in zip(records, back, strict=True):
        assert (restored.name, restored.mode, restored.step, restored.index) == (
            original.name, original.mode, original.step, original.index)
        assert restored.shape == original.shape and restored.dtype == original.dtype
        assert restored.wall_time == original.wall_time and restored.seq == original.seq
        assert restored.stats.keys() == original.stats.keys()
        for key, v in original.stats.items():
            assert restored.stats[key] == v or (math.isnan(v) and math.isnan(restored.stats[key]))
    np.testing.assert_array_equal(back[1].histogram[0], edges)
    np.testing.assert_array_equal(back[1].histogram[1], counts)
    np.testing.assert_array_equal(back[2].value, full)
    assert back[2].value.dtype == np.float32
    assert back[4].value.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(back[4].value.astype(np.float32), [1.5, -2.0])
    assert read_records(logdir / "more.jsonl")[0].stats["max"] == math.inf


def test_jsonl_files_stay_inside_logdir_whatever_the_names(tmp_path):
    logdir = tmp_path / "inside" / "run"
    hostile = ["../../escape", "/etc/passwd", "a/../../b", "..", ".", "", "~/x", "c:\\win",
               "név\x00\n*?<>|", "a" * 500]
    value = np.ones(2, np.float32)
    jsonl = JsonlExporter(logdir=logdir)
    jsonl.write([record(name, mode="../" + name, summary="full", value=value) for name in hostile])
    jsonl.close()
    everything = [p for p in tmp_path.rglob("*")]
    assert all(p == tmp_path / "inside" or logdir in (p, *p.parents) for p in everything)
    sidecars = sorted((logdir / "records_values").iterdir())
    assert len(sidecars) == len(hostile)
    assert all(len(p.name) < 200 for p in sidecars)
    back = read_records(logdir / "records.jsonl")
    assert [r.name for r in back] == hostile  # the true names survive in the JSON
    for r in back:
        np.testing.assert_array_equal(r.value, value)


def test_jsonl_refuses_to_read_sidecars_outside_its_folder(tmp_path):
    outside = tmp_path / "secret.npy"
    np.save(outside, np.zeros(1))
    run = tmp_path / "run"
    run.mkdir()
    obj = {**strict_json(json.dumps({
        "name": "h", "mode": "primal", "tag": "t", "step": 0, "index": None, "wall_time": 0.0,
        "summary": "full", "shape": [1], "dtype": "float64", "stats": {}, "histogram": None,
    })), "value_file": "../secret.npy"}
    (run / "records.jsonl").write_text(json.dumps(obj) + "\n")
    with pytest.raises(ValueError, match="points outside"):
        read_records(run / "records.jsonl")


def test_jsonl_appends_across_runs_without_replacing_sidecars(tmp_path):
    for run_value in (1.0, 2.0):
        jsonl = JsonlExporter(logdir=tmp_path)
        jsonl.write([record("w", step=0, summary="full", value=np.full(3, run_value))])
        jsonl.close()
    back = read_records(tmp_path / "records.jsonl")
    assert [float(r.value[0]) for r in back] == [1.0, 2.0]
    assert len(list((tmp_path / "records_values").iterdir())) == 2


def test_jsonl_bad_logdir_and_filename_fail_at_construction(tmp_path):
    a_file = tmp_path / "plain.txt"
    a_file.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        JsonlExporter(logdir=a_file)
    with pytest.raises(ValueError, match="cannot be created"):
        JsonlExporter(logdir=a_file / "sub")
    for bad in ("a/b.jsonl", "..", "", os.sep + "x.jsonl"):
        with pytest.raises(ValueError, match="must be a bare file name"):
            JsonlExporter(logdir=tmp_path, filename=bad)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="cannot write 'taken' there"):
        JsonlExporter(logdir=tmp_path, filename="taken")
    with pytest.raises(ValueError, match="must be a folder path"):
        JsonlExporter(logdir="")


def test_jsonl_write_after_close_raises_and_the_dispatcher_counts_it(tmp_path):
    jsonl = JsonlExporter(logdir=tmp_path)
    jsonl.close()
    d = Dispatcher([jsonl], convert=lambda items: [record(step=i) for i in items])
    d.put(1)
    assert d.flush(timeout=5.0)
    d.close(timeout=5.0)
    assert d.status()["errors"] == {"jsonl": 1}


# -- registry -----------------------------------------------------------------------------------

def test_registry_resolves_builtin_names_and_instances(tmp_path):
    [memory] = exporters.resolve("memory")
    assert isinstance(memory, MemoryExporter)
    mine = MemoryExporter()
    made = exporters.resolve(["console", mine])
    assert isinstance(made[0], ConsoleExporter) and made[1] is mine
    [jsonl] = exporters.resolve("jsonl", logdir=tmp_path / "j")
    assert isinstance(jsonl, JsonlExporter) and (tmp_path / "j" / "records.jsonl").exists()
    jsonl.close()


def test_registry_rejects_unknown_names_and_incomplete_objects():
    with pytest.raises(ValueError, match="unknown exporter 'nope'") as info:
        exporters.resolve("nope")
    for name in ("console", "jsonl", "memory", "otel", "tensorboard"):
        assert name in str(info.value)

    class WriteOnly:
        def write(self, records):
            pass

    with pytest.raises(TypeError, match="lacks the method\\(s\\) flush, close"):
        exporters.resolve(WriteOnly())
    with pytest.raises(ValueError, match="at least one exporter"):
        exporters.resolve([])


# -- end to end through sowtel.enable -----------------------------------------------------------

def test_streaming_from_jit_reaches_memory_jsonl_and_console(tmp_path, capsys):
    def step_fn(w, x):
        h = sowtel.sow(jnp.tanh(x @ w), "hidden")
        return jnp.sum(h ** 2)

    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32))
    xs = [jnp.asarray(np.full((2, 4), i + 1.0, np.float32)) for i in range(3)]
    memory = MemoryExporter()
    jsonl = JsonlExporter(logdir=tmp_path)
    with sowtel.enable(exporter=[memory, jsonl, "console"], modes="primal"):
        f = jax.jit(step_fn)
        for x in xs:
            f(w, x)
        assert sowtel.flush()
        status = sowtel.status()
    assert status["exported"] == {"memory": 3, "jsonl": 3, "console": 3}
    assert status["dropped"] == 0 and status["errors"] == {"memory": 0, "jsonl": 0, "console": 0}

    got = memory.by_name("hidden", mode="primal")
    assert [r.step for r in got] == [0, 1, 2]
    for r, x in zip(got, xs, strict=True):
        ref = numpy_stats(np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64)))
        for key in STAT_KEYS:
            assert r.stats[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    back = read_records(tmp_path / "records.jsonl")
    assert [(r.name, r.step, r.stats) for r in back] == [(r.name, r.step, r.stats) for r in got]
    console_lines = [line for line in capsys.readouterr().out.splitlines()
                     if line.startswith("[sowtel]")]
    assert len(console_lines) == 3 and all("hidden primal" in line for line in console_lines)


def test_full_values_stream_to_jsonl_sidecars(tmp_path):
    def f(x):
        return sowtel.sow(x * 2.0, "doubled", summary="full").sum()

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with sowtel.enable(exporter="jsonl", logdir=tmp_path):
        jax.jit(f)(x)
    [r] = read_records(tmp_path / "records.jsonl")
    assert r.summary == "full" and r.shape == (2, 3)
    np.testing.assert_array_equal(r.value, x * 2.0)


def test_export_of_captured_intermediates_goes_through_put_records(tmp_path):
    def f(x):
        return sowtel.sow(jnp.sin(x), "s").sum()

    x = jnp.linspace(0.0, 1.0, 5)
    _, inter = sowtel.save_intermediates(jax.grad(f))(x)
    memory = MemoryExporter()
    with sowtel.enable(exporter=memory):
        assert sowtel.export(inter, step=9) == 2
    got = {r.mode: r for r in memory.records}
    assert set(got) == {"primal", "cotangent"} and got["primal"].step == 9
    assert got["primal"].stats["mean"] == pytest.approx(float(np.sin(np.linspace(0, 1, 5)).mean()))
    assert got["cotangent"].stats["mean"] == pytest.approx(1.0)


def test_unwritable_location_for_jsonl_fails_in_enable(tmp_path):
    a_file = Path(tmp_path) / "f"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        sowtel.enable(exporter="jsonl", logdir=a_file)
    assert sowtel.status()["enabled"] is False
