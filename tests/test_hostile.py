"""Hostile input: crafted dump files, planted symbolic links, and arguments of the wrong kind.

Every crafted file must give a ``ValueError`` naming the file and the rule it breaks, and the
``sowtel inspect`` / ``sowtel diff`` commands must exit with status 2 and print no traceback.
Crafted headers carry a valid header checksum (a CRC is no secret), so each rule is checked by
the reader itself and not merely by the checksum. Commands that could hang (a FIFO) or whose
memory is measured run in subprocesses with a time limit.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel import dumps
from sowtel.cli import main
from sowtel.dispatcher import Dispatcher
from sowtel.dumps import _format as _dump_format
from sowtel.dumps import dump, load
from sowtel.exporters.jsonl import JsonlExporter
from sowtel.exporters.memory import MemoryExporter
from sowtel.records import Record

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
# Generous: a loaded two-core machine may take many seconds to import JAX.
LIMIT = 180


def run(capsys, *argv: object) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def cli(*args: object, timeout: float = LIMIT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sowtel.cli", *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=timeout)


def record(step: int, name: str = "h") -> Record:
    return Record(name=name, mode="primal", tag="intermediates", step=step, index=None,
                  wall_time=0.0, summary="stats", shape=(), dtype="float32",
                  stats={"mean": float(step)})


# ----------------------------------------------------------------------------- crafted dumps


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(out: Path, header_text: bytes, data: bytes) -> Path:
    header_text += b" " * (-len(header_text) % 8)
    out.write_bytes(len(header_text).to_bytes(8, "little") + header_text + data)
    return out


def forged(path: Path, out: Path, **fields: str) -> Path:
    """A copy of the dump at ``path`` with header fields replaced and the checksum re-signed."""
    header, data = _header(path)
    meta = header["__metadata__"]
    meta.pop("checksums")
    checksums = json.loads(_header(path)[0]["__metadata__"]["checksums"])
    meta.update(fields)
    table = {k: (_dump_format.CODE_TO_DTYPE[v["dtype"]].name, v["shape"])
             for k, v in header.items() if k != "__metadata__"}
    checksums["header"] = _dump_format.header_crc(meta, table)
    meta["checksums"] = json.dumps(checksums)
    return _write(out, json.dumps(header).encode(), data)


@pytest.fixture
def good(tmp_path) -> Path:
    return dump({"h": {"primal": np.arange(3.0)}, "g": {"primal": np.ones(2)}},
                tmp_path / "good.safetensors", step=1, metadata={"run": "a"})


def _global_sites(h_key: str, g_key: str, *, shape=(5,), dtype="float64", box=((0, 3),)):
    """A structure holding the two tensors of ``good`` as shards of one global value."""
    return [["h", [["primal", {"global": {
        "shape": list(shape), "dtype": dtype,
        "shards": [[h_key, [list(b) for b in box]], [g_key, [[3, 5]]]]}}]]]]


def _part(good: Path, out: Path, h_key: str, g_key: str, **node) -> Path:
    return forged(good, out, process='{"index": 0, "count": 2}',
                  sites=json.dumps(_global_sites(h_key, g_key, **node)))


def _nested(depth: int) -> str:
    return '{"list": [' * depth + "null" + "]}" * depth


def crafted(good: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """Crafted files and the words their error must hold (besides the file name)."""
    header, data = _header(good)
    h_key = next(k for k in header if k.startswith("h::"))
    g_key = next(k for k in header if k.startswith("g::"))
    deep_header = _write(tmp / "deep_header.safetensors",
                         b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", data)
    return {
        "deep_header": (deep_header, "nested"),
        "deep_sites": (forged(good, tmp / "deep_sites.safetensors",
                              sites='[["h", [["primal", ' + _nested(100_000) + "]]]]"), "nested"),
        "deep_metadata": (forged(good, tmp / "deep_metadata.safetensors",
                                 metadata='{"a": ' * 100_000 + "1" + "}" * 100_000), "nested"),
        "medium_deep_sites": (forged(good, tmp / "medium.safetensors", sites=(
            f'[["h", [["primal", {{"leaf": "{h_key}"}}]]], ["g", [["primal", '
            + '{"list": [' * 300 + json.dumps({"leaf": g_key}) + "]}" * 300 + "]]]]")),
            "nested"),
        "list_key": (forged(good, tmp / "list_key.safetensors", sites=json.dumps(
            [["h", [["primal", {"dict": [[["k"], {"leaf": h_key}]]}]]],
             ["g", [["primal", {"leaf": g_key}]]]])), "dict key"),
        "bool_key": (forged(good, tmp / "bool_key.safetensors", sites=json.dumps(
            [["h", [["primal", {"dict": [[True, {"leaf": h_key}]]}]]],
             ["g", [["primal", {"leaf": g_key}]]]])), "dict key"),
        "same_dict_key": (forged(good, tmp / "same_key.safetensors", sites=json.dumps(
            [["h", [["primal", {"dict": [["k", {"leaf": h_key}], ["k", {"leaf": g_key}]]}]]]])),
            "twice"),
        "duplicate_site": (forged(good, tmp / "dup_site.safetensors", sites=json.dumps(
            [["h", [["primal", {"leaf": h_key}]]], ["h", [["tangent", {"leaf": g_key}]]]])),
            "twice"),
        "duplicate_mode": (forged(good, tmp / "dup_mode.safetensors", sites=json.dumps(
            [["h", [["primal", {"leaf": h_key}], ["primal", {"leaf": g_key}]]]])), "twice"),
        "escape_mode": (forged(good, tmp / "escape_mode.safetensors", sites=json.dumps(
            [["h", [["\x1b[2J\x1b[31mprimal", {"leaf": h_key}]]],
             ["g", [["primal", {"leaf": g_key}]]]])), "not a mode"),
        "step_string": (forged(good, tmp / "step_string.safetensors", step='"7"'), "step"),
        "step_bool": (forged(good, tmp / "step_bool.safetensors", step="true"), "step"),
        "step_float": (forged(good, tmp / "step_float.safetensors", step="1.5"), "step"),
        "metadata_list": (forged(good, tmp / "metadata_list.safetensors", metadata="[1, 2]"),
                          "metadata"),
        "metadata_nan": (forged(good, tmp / "metadata_nan.safetensors", metadata='{"a": NaN}'),
                         "metadata"),
        "created_nan": (forged(good, tmp / "created_nan.safetensors", created="nan"), "created"),
        "version_escape": (forged(good, tmp / "version.safetensors",
                                  sowtel_version="1.0\x1b]0;pwned\x07"), "sowtel_version"),
        # The parts of a multi-process dump: who wrote them, and where each shard lies.
        "process_index_too_big": (forged(good, tmp / "proc_big.safetensors",
                                         process='{"index": 2, "count": 2}'), "process"),
        "process_not_object": (forged(good, tmp / "proc_str.safetensors", process='"0 of 2"'),
                               "process"),
        "process_bool": (forged(good, tmp / "proc_bool.safetensors",
                                process='{"index": false, "count": 2}'), "process"),
        "global_outside_part": (forged(good, tmp / "global_whole.safetensors",
                                       sites=json.dumps(_global_sites(h_key, g_key))),
                                "not one process's part"),
        "global_bad_shape": (_part(good, tmp / "g_shape.safetensors", h_key, g_key,
                                   shape=[-3]), "shape"),
        "global_bad_dtype": (_part(good, tmp / "g_dtype.safetensors", h_key, g_key,
                                   dtype="object"), "dtype"),
        "global_box_outside": (_part(good, tmp / "g_box.safetensors", h_key, g_key,
                                     box=[[3, 8]]), "malformed shard"),
        "global_box_rank": (_part(good, tmp / "g_rank.safetensors", h_key, g_key,
                                  box=[[0, 3], [0, 1]]), "malformed shard"),
        "global_box_size": (_part(good, tmp / "g_size.safetensors", h_key, g_key,
                                  box=[[0, 2]]), "whose tensor"),
        "global_absent_tensor": (_part(good, tmp / "g_absent.safetensors", "nope", g_key),
                                 "absent or used twice"),
        # Python keeps the last of two equal keys, other readers may keep the first: a second,
        # validly signed header that says step 99 must not silently win.
        "duplicate_json_key": (_write(
            tmp / "dup_json.safetensors", json.dumps(header)[:-1].encode() + b', "__metadata__": '
            + json.dumps(_header(forged(good, tmp / "step99.safetensors", step="99"))[0][
                "__metadata__"]).encode() + b"}", data), "twice"),
    }


CASES = ["deep_header", "deep_sites", "deep_metadata", "medium_deep_sites", "list_key",
         "bool_key", "same_dict_key", "duplicate_site", "duplicate_mode", "escape_mode",
         "step_string", "step_bool", "step_float", "metadata_list", "metadata_nan",
         "created_nan", "version_escape", "duplicate_json_key", "process_index_too_big",
         "process_not_object", "process_bool", "global_outside_part", "global_bad_shape",
         "global_bad_dtype", "global_box_outside", "global_box_rank", "global_box_size",
         "global_absent_tensor"]


@pytest.mark.parametrize("case", CASES)
def test_crafted_dumps_give_a_clear_value_error(good, tmp_path, case):
    path, words = crafted(good, tmp_path)[case]
    for read in (load, lambda p: load(p, lazy=True), dumps.info):
        with pytest.raises(ValueError, match=f"'{path}'") as caught:
            read(path)
        assert words in str(caught.value), (case, str(caught.value))


@pytest.mark.parametrize("case", CASES)
def test_crafted_dumps_make_inspect_and_diff_exit_2_without_traceback(good, tmp_path, capsys,
                                                                      case):
    path, words = crafted(good, tmp_path)[case]
    for argv in (("inspect", path), ("inspect", path, "--json"), ("diff", path, good),
                 ("diff", good, path)):
        status, out, err = run(capsys, *argv)
        assert status == 2, (case, argv, out, err)
        assert out == "" and "Traceback" not in err and words in err, (case, argv, err)
        assert "\x1b" not in err and "\x07" not in err


def test_crafted_dumps_in_real_processes(good, tmp_path):
    files = crafted(good, tmp_path)
    for case in ("deep_header", "list_key"):
        path = files[case][0]
        for args in (("inspect", path), ("diff", path, good)):
            done = cli(*args)
            assert done.returncode == 2, (case, args, done.stderr)
            assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_structure_deeper_than_the_limit_is_refused_when_dumping(tmp_path):
    value: object = np.zeros(1)
    for _ in range(dumps.MAX_DEPTH + 1):
        value = [value]
    with pytest.raises(ValueError, match="nested deeper than"):
        dump({"h": {"primal": value}}, tmp_path / "deep.safetensors")
    with pytest.raises(ValueError, match="nested deeper than"):
        dump({"h": {"primal": 1.0}}, tmp_path / "deep.safetensors",
             metadata=_deep_metadata(dumps.MAX_DEPTH + 1))
    # The deepest structure allowed round-trips.
    ok: object = np.zeros(1)
    for _ in range(dumps.MAX_DEPTH - 1):
        ok = [ok]
    back = load(dump({"h": {"primal": ok}}, tmp_path / "ok.safetensors"))["h"]["primal"]
    for _ in range(dumps.MAX_DEPTH - 1):
        back = back[0]
    assert back.tolist() == [0.0]


def _deep_metadata(depth: int) -> dict:
    meta: dict = {}
    for _ in range(depth - 1):
        meta = {"a": meta}
    return meta


def test_control_characters_in_names_are_escaped_when_printed(tmp_path, capsys):
    nasty = "h\x1b[2J\x1b]0;title\x07\u009b31m"
    a = dump({nasty: {"primal": np.array([1.0, np.nan])},
              "p": {"primal": {"k\x1b[1m": np.ones(2)}}}, tmp_path / "a.safetensors",
             metadata={"note": "x\x1b[5m"})
    b = dump({nasty: {"primal": np.array([2.0, np.nan])}}, tmp_path / "b.safetensors")
    for argv in (("inspect", a), ("diff", a, b), ("inspect", a, "--json"),
                 ("diff", a, b, "--json")):
        status, out, err = run(capsys, *argv)
        assert status in (0, 1), (argv, err)
        for bad in ("\x1b", "\x07", "\u009b"):
            assert bad not in out and bad not in err, (argv, bad)
        assert "h\\x1b[2J" in out or "h\\u001b[2J" in out, out
    # The names themselves are kept exactly: only printing escapes them.
    assert list(load(a)) == [nasty, "p"]


def test_a_control_character_in_the_file_name_is_escaped(tmp_path, capsys):
    path = dump({"h": {"primal": np.ones(2)}}, tmp_path / "x\x1b[31m.safetensors")
    status, out, err = run(capsys, "inspect", path)
    assert status == 0 and "\x1b" not in out and "x\\x1b[31m" in out
    path.write_bytes(b"garbage")
    status, out, err = run(capsys, "inspect", path)
    assert status == 2 and "\x1b" not in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_is_refused_before_reading(tmp_path):
    fifo = tmp_path / "step_1.safetensors"
    os.mkfifo(fifo)
    # Nothing ever writes into the FIFO: a reader that opens it blocks forever, and the
    # subprocess time limit turns that hang into a failure instead of a stuck suite.
    code = ("import sys, sowtel\n"
            "try:\n    sowtel.load(sys.argv[1])\n"
            "except ValueError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True,
                          text=True, env=ENV, timeout=LIMIT)
    assert "is not a regular file" in done.stdout and str(fifo) in done.stdout, done
    dump({"h": {"primal": np.ones(2)}}, tmp_path, step=0)
    for args in (("inspect", fifo), ("diff", fifo, fifo), ("inspect", tmp_path),
                 ("diff", tmp_path, tmp_path)):
        done = cli(*args)
        assert done.returncode == 2 and "is not a regular file" in done.stderr, done
        assert "Traceback" not in done.stderr


def test_a_device_file_is_refused(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    with pytest.raises(ValueError, match="'/dev/zero' is not a regular file"):
        load("/dev/zero")


_MEASURE = textwrap.dedent("""
    import gc, sys
    import sowtel
    from sowtel import postmortem

    def peak():
        # VmHWM, the peak resident size of this process's memory (mapped file pages count too).
        # Not getrusage's ru_maxrss: Linux carries the parent's size over a fork and exec into
        # it, which would hide the growth measured here when the test runner is large.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    path, step = sys.argv[1:]
    read = {"load": lambda: sowtel.load(path), "inspect": lambda: postmortem.inspect_dump(path),
            "diff": lambda: postmortem.diff_dumps(path, path)}[step]
    gc.collect()
    before = peak()
    try:
        read()
        print("no error")
    except ValueError as e:
        print(e)
    print(peak() - before)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmHWM")
def test_a_bad_checksum_is_found_while_streaming(tmp_path):
    size = 96 << 20
    path = dump({"small": {"primal": np.ones(4, np.float32)},
                 "big": {"primal": np.ones(size // 4, np.float32)}}, tmp_path / "big.safetensors")
    header, _ = _header(path)
    big_end = header[next(k for k in header if k.startswith("big::"))]["data_offsets"][1]
    with open(path, "r+b") as f:  # the last byte of the big array, wherever it lies
        f.seek(8 + int.from_bytes(f.read(8), "little") + big_end - 1)
        f.write(b"\x7f")
    for step in ("load", "inspect", "diff"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(path), step],
                              capture_output=True, text=True, env=ENV, timeout=LIMIT)
        assert done.returncode == 0, done.stderr
        message, growth = done.stdout.strip().rsplit("\n", 1)
        assert "fails its checksum" in message and str(path) in message, (step, message)
        # Reading the file whole would grow the peak by its size; streaming holds a chunk.
        assert int(growth) < size / 3, (step, int(growth) / 2**20)


def test_checksums_still_catch_every_changed_array(tmp_path):
    path = dump({"a": {"primal": np.arange(10.0)}, "b": {"primal": np.zeros(0)},
                 "c": {"primal": np.arange(5, dtype=np.int8)}}, tmp_path / "x.safetensors")
    raw = bytearray(path.read_bytes())
    data_start = 8 + int.from_bytes(raw[:8], "little")
    for pos in (data_start, len(raw) - 1, data_start + 40):
        bad = bytearray(raw)
        bad[pos] ^= 1
        (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="fails its checksum"):
            load(tmp_path / "bad.safetensors")
    assert load(path)["a"]["primal"].tolist() == list(range(10))


def test_a_path_that_is_not_a_path_is_named(tmp_path):
    from sowtel.postmortem import diff_dumps, inspect_dump

    for call in (lambda: load(42), lambda: load(None), lambda: dumps.info(42),
                 lambda: dump({"h": {"primal": np.ones(2)}}, 42), lambda: inspect_dump(42),
                 lambda: diff_dumps(42, tmp_path), lambda: dumps.find_dumps(42)):
        with pytest.raises(TypeError, match=r"=(42|None) is not a path: pass a str or a pathlib"):
            call()


# ----------------------------------------------------------------------------- exporters


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_jsonl_never_follows_a_symlink_planted_in_its_logdir(tmp_path):
    logdir, outside = tmp_path / "logs", tmp_path / "outside"
    logdir.mkdir()
    outside.mkdir()
    target = outside / "victim.txt"
    target.write_text("precious\n")
    (logdir / "records.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        JsonlExporter(logdir=logdir)
    assert target.read_text() == "precious\n"

    # A planted folder of sidecar values: full values must not land outside the logdir.
    (logdir / "records.jsonl").unlink()
    (logdir / "records_values").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        JsonlExporter(logdir=logdir)
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_jsonl_sidecar_folder_planted_after_opening_is_not_followed(tmp_path):
    logdir, outside = tmp_path / "logs", tmp_path / "outside"
    outside.mkdir()
    jsonl = JsonlExporter(logdir=logdir)
    (logdir / "records_values").symlink_to(outside, target_is_directory=True)
    full = Record(name="h", mode="primal", tag="intermediates", step=0, index=None,
                  wall_time=0.0, summary="full", shape=(2,), dtype="float32",
                  value=np.ones(2, np.float32))
    jsonl.write([full])  # the line is written (the record is exported); its value is not
    jsonl.close()
    assert list(outside.iterdir()) == []
    assert jsonl.values_not_saved == 1
    line = json.loads((logdir / "records.jsonl").read_text())
    assert line["value_file"] is None and "not saved" in line["value_error"]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_tensorboard_never_follows_a_planted_per_process_run_folder(tmp_path):
    from sowtel.exporters.tensorboard import TensorBoardExporter

    outside = tmp_path / "outside"
    outside.mkdir()
    exporter = TensorBoardExporter(logdir=tmp_path / "logs")
    # As with several JAX processes, where each process's records go to logdir/process_<i>.
    exporter._per_process_runs = True
    (tmp_path / "logs" / "process_1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        exporter.write([dataclasses.replace(record(0), process_index=1)])
    exporter.close()
    assert list(outside.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_dump_never_writes_through_a_link_planted_under_its_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / f".step_3.safetensors.{os.getpid()}.tmp").symlink_to(victim)
    path = dump({"h": {"primal": np.arange(3.0)}}, folder, step=3)
    assert victim.read_text() == "precious\n"
    assert load(path)["h"]["primal"].tolist() == [0.0, 1.0, 2.0]
    # The temporary name is unguessable now: the planted link is not ours, and is left alone.
    assert sorted(p.name for p in folder.iterdir()) == [
        f".step_3.safetensors.{os.getpid()}.tmp", "step_3.safetensors"]
    assert (folder / f".step_3.safetensors.{os.getpid()}.tmp").is_symlink()


# ----------------------------------------------------------------------------- memory exporter


def test_memory_exporter_is_bounded_by_default_and_keeps_the_newest():
    memory = MemoryExporter()
    assert memory.max_records == MemoryExporter.DEFAULT_MAX_RECORDS
    n = MemoryExporter.DEFAULT_MAX_RECORDS + 5
    memory.write([record(i) for i in range(n)])
    assert len(memory) == MemoryExporter.DEFAULT_MAX_RECORDS
    assert memory.records[0].step == 5 and memory.records[-1].step == n - 1
    assert memory.evicted == 5

    small = MemoryExporter(max_records=3)
    for i in range(10):
        small.write([record(i)])
    assert [r.step for r in small.records] == [7, 8, 9] and small.evicted == 7
    unbounded = MemoryExporter(max_records=None)
    unbounded.write([record(i) for i in range(50)])
    assert len(unbounded) == 50 and unbounded.evicted == 0


def test_memory_evictions_show_in_the_session_counters():
    memory = MemoryExporter(max_records=4)
    with sowtel.enable(exporter=[memory, "memory"]) as session:
        sowtel.log({f"x{i}": float(i) for i in range(10)}, step=0)
        assert sowtel.flush(timeout=60)
        s = sowtel.status()
    assert s["exported"] == {"memory": 10, "memory#2": 10}
    assert s["evicted"] == {"memory": 6, "memory#2": 0}
    assert [r.name for r in memory.records] == ["x6", "x7", "x8", "x9"]
    assert session.status()["evicted"] == {"memory": 6, "memory#2": 0}
    after = sowtel.status()  # nothing enabled: the last session's final counters
    assert after["enabled"] is False and after["evicted"] == {"memory": 6, "memory#2": 0}


# ----------------------------------------------------------------------------- input gaps


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("option, value", [("tags", 42), ("modes", 3.5), ("tags", None)])
def test_enable_rejects_a_non_list_of_strings_naming_it(in_tmp, option, value):
    with pytest.raises(ValueError, match=f"{option}={value!r} must be"):
        sowtel.enable(exporter="memory", **{option: value})
    assert not sowtel.status()["enabled"] and list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("timeout", ["x", -1.0, float("nan"), True, [1]])
def test_flush_and_disable_reject_a_bad_timeout(timeout):
    with pytest.raises(ValueError, match=r"timeout=.* must be None or a number of seconds"):
        sowtel.flush(timeout=timeout)
    with sowtel.enable(exporter="memory"):
        with pytest.raises(ValueError, match=r"timeout=.* must be None or a number"):
            sowtel.flush(timeout=timeout)
        with pytest.raises(ValueError, match=r"timeout=.* must be None or a number"):
            sowtel.disable(timeout=timeout)
        assert sowtel.status()["enabled"]
        assert sowtel.flush(timeout=0) in (True, False)
    assert not sowtel.status()["enabled"]


def test_an_exporter_class_is_refused_with_advice():
    with pytest.raises(TypeError, match=r"is a class.*MemoryExporter\(\)"):
        sowtel.enable(exporter=MemoryExporter)
    with pytest.raises(TypeError, match="is a class"):
        sowtel.enable(exporter=["memory", JsonlExporter])
    with pytest.raises(TypeError, match="is a class"):
        Dispatcher([MemoryExporter], convert=list)
    assert not sowtel.status()["enabled"]


def test_tensorboard_refuses_an_empty_logdir(in_tmp):
    from sowtel.exporters.tensorboard import TensorBoardExporter

    with pytest.raises(ValueError, match="logdir='' is empty"):
        TensorBoardExporter(logdir="")
    with pytest.raises(ValueError, match="logdir='' is empty"):
        sowtel.enable(exporter="tensorboard", logdir="")
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("exporter, options", [
    ("jsonl", {"logdri": "elsewhere"}),
    ("tensorboard", {"flush_sec": 1}),
    (["jsonl", "tensorboard"], {"bogus": 1}),
    (["jsonl", "no-such-exporter"], {}),
    (["jsonl", MemoryExporter], {}),
    (["jsonl", 42], {}),
])
def test_a_rejected_enable_leaves_no_files(in_tmp, exporter, options):
    with pytest.raises((TypeError, ValueError)):
        sowtel.enable(exporter=exporter, **options)
    assert list(in_tmp.rglob("*")) == []
    assert not sowtel.status()["enabled"]


def test_sow_names_the_site_of_a_dict_with_mixed_key_types():
    with pytest.raises(ValueError, match=r"sow 'mixed'.*keys.*\b1\b.*'a'|sow 'mixed'.*'a'.*\b1\b"):
        sowtel.sow({"a": jnp.ones(2), 1: jnp.zeros(2)}, "mixed")
    with pytest.raises(ValueError, match="sow 'deep'"):
        sowtel.sow([{"x": 1.0, ("t",): 2.0}], "deep")
    # One key type is fine, as before.
    out = sowtel.sow({"b": jnp.ones(1), "a": jnp.zeros(1)}, "fine")
    assert sorted(out) == ["a", "b"]


# ----------------------------------------------------------------------------- exporters apart


class _Vandal:
    """Writes into every record it gets (stats, full value, histogram), counting refusals."""

    label = "vandal"

    def __init__(self) -> None:
        self.tried = self.refused = 0

    def _try(self, attempt) -> None:
        self.tried += 1
        try:
            attempt()
        except (TypeError, ValueError):  # a read-only dict; a read-only numpy array
            self.refused += 1

    def write(self, records) -> None:
        for r in records:
            self._try(lambda r=r: operator.setitem(r.stats, "mean", -1e9))
            self._try(lambda r=r: r.stats.update(max=-1e9))
            if r.value is not None:
                self._try(lambda r=r: operator.setitem(r.value, ..., -1e9))
            if r.histogram is not None:
                self._try(lambda r=r: operator.setitem(r.histogram[1], ..., 0))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _BatchVandal(_Vandal):
    label = "batch-vandal"

    def write_batch(self, batch) -> None:
        for columns in batch.columns():
            self._try(lambda c=columns: operator.setitem(c.stats, ..., -1e9))
            self._try(lambda c=columns: operator.setitem(c.index, 0, 99))
            if columns.counts is not None:
                self._try(lambda c=columns: operator.setitem(c.counts, ..., 0))
        self.write(batch.records())


def test_an_exporter_cannot_change_the_records_the_others_hold():
    import jax

    def step(x):
        def body(c, _):
            c = c + 1.0
            sowtel.sow(c, "h")
            sowtel.sow(c, "hist", summary="histogram")
            sowtel.sow(c, "v", summary="full")
            return c, None
        return jax.lax.scan(body, x, None, length=4)[0]

    vandal, batch_vandal, memory = _Vandal(), _BatchVandal(), MemoryExporter()
    f = sowtel.jit(step)
    x = jnp.arange(8.0)
    with sowtel.enable(exporter=[vandal, batch_vandal, memory]) as session:
        for _ in range(10):
            x = f(x)
        assert session.flush(timeout=60.0)
    records = memory.records
    assert len(records) == 10 * 4 * 3
    corrupted = 0
    for r in records:
        # The scan's value at (step, index): arange(8) + 4 * step + index + 1.
        expected = np.arange(8.0) + 4 * r.step + r.index + 1
        ok = r.stats["mean"] == pytest.approx(expected.mean())
        ok &= r.stats["max"] == pytest.approx(expected.max())
        if r.value is not None:
            ok &= bool(np.array_equal(r.value, expected))
        if r.histogram is not None:
            ok &= int(r.histogram[1].sum()) == 8
        corrupted += not ok
    assert corrupted == 0, f"{corrupted} of {len(records)} records changed by another exporter"
    for v in (vandal, batch_vandal):
        assert v.tried > len(records) and v.refused == v.tried


def test_the_same_exporter_instance_twice_is_refused_naming_it():
    memory = MemoryExporter()
    with pytest.raises(ValueError, match=r"exporter 'memory' \(.*MemoryExporter.*\) is given "
                                         r"twice, at positions 0 and 2 .* pass it once"):
        sowtel.enable(exporter=[memory, "memory", memory])
    assert sowtel.status()["enabled"] is False  # nothing was enabled
    vandal = _Vandal()
    with pytest.raises(ValueError, match=r"exporter 'vandal' .* given twice, at positions 0 "
                                         r"and 1"):
        Dispatcher([vandal, vandal], convert=list)
    # Two instances of one class are two exporters.
    with sowtel.enable(exporter=[memory, MemoryExporter()]) as session:
        assert list(session.status()["exported"]) == ["memory", "memory#2"]
