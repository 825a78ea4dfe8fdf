"""Hardening against hostile folders, full disks, deleted logdirs and crafted files.

Each test here failed on the code before the fix it covers: races in the dump folder, a full
disk under the jsonl exporter, a logdir deleted while training, crafted sidecars and headers,
and errors that were bare ``OSError``s.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sowtel.dumps import dump, load
from sowtel.exporters.jsonl import JsonlExporter, read_records
from sowtel.records import Record

ROOT = Path(__file__).resolve().parent.parent


def stats_record(step: int, name: str = "h") -> Record:
    return Record(name=name, mode="primal", tag="intermediates", step=step, index=None,
                  wall_time=0.0, summary="stats", shape=(), dtype="float32",
                  stats={"mean": float(step)})


def full_record(step: int, name: str = "h") -> Record:
    return Record(name=name, mode="primal", tag="intermediates", step=step, index=None,
                  wall_time=0.0, summary="full", shape=(2,), dtype="float32",
                  value=np.array([step, step + 1], np.float32))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_python(code: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          **kwargs)


# ----------------------------------------------------------------------------- dump races


class SwapAtRename:
    """The attacker: at the moment the dump renames or chmods its temporary file by path (an
    audit event, raised just before the system call), it swaps that file for a link to a
    private file of someone else's. A real race, made to happen every time."""

    def __init__(self, folder: Path, victim: Path) -> None:
        self.folder, self.victim, self.armed, self.swapped = folder, victim, True, 0
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple) -> None:
        if not self.armed or event not in ("os.rename", "os.chmod"):
            return
        name = args[0]
        if isinstance(name, int):  # through a descriptor: nothing to swap
            return
        name = os.fsdecode(name)
        tmp = self.folder / os.path.basename(name)
        if os.path.basename(name).startswith(".") and name.endswith(".tmp") and tmp.exists():
            self.armed = False  # once; audit hooks cannot be removed
            tmp.unlink()
            tmp.symlink_to(self.victim)
            self.swapped += 1


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_temporary_file_swapped_for_a_link_is_never_followed_nor_moved_into_place(tmp_path):
    victim = tmp_path / "private.key"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    folder = tmp_path / "dumps"
    folder.mkdir()
    attacker = SwapAtRename(folder, victim)
    try:
        with pytest.raises(ValueError, match="was replaced.*no dump was made.*only you can write"):
            dump({"h": {"primal": np.arange(3.0)}}, folder, step=3)
    finally:
        attacker.armed = False
    assert attacker.swapped == 1
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert victim.read_text() == "secret\n"
    final = folder / "step_3.safetensors"
    assert not final.is_symlink() and not final.exists()
    # The next dump into the folder works, and is a regular file of its own.
    path = dump({"h": {"primal": np.arange(3.0)}}, folder, step=3)
    assert not path.is_symlink() and load(path)["h"]["primal"].tolist() == [0.0, 1.0, 2.0]


def test_temporary_names_are_unguessable_and_dumps_get_the_umask_mode(tmp_path):
    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and args[0].endswith(".tmp"):
            seen.append(os.path.basename(args[0]))

    sys.addaudithook(hook)
    old = os.umask(0o027)
    try:
        for _ in range(2):
            path = dump({"h": {"primal": np.zeros(2)}}, tmp_path, step=1)
    finally:
        os.umask(old)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert all(str(os.getpid()) in name and len(name) > 40 for name in seen)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


# ----------------------------------------------------------------------------- stale temporaries


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_dead_processes_are_removed_by_the_next_dump(tmp_path):
    from sowtel.dumps._write import host_tag as _host_tag

    host, dead = _host_tag(), dead_pid()
    stale = tmp_path / f".step_1.safetensors.{host}.{dead}.0123456789abcdef.tmp"
    stale.write_bytes(b"x" * 1000)
    alive = tmp_path / f".step_1.safetensors.{host}.{os.getpid()}.0123456789abcdef.tmp"
    alive.write_bytes(b"y")
    elsewhere = tmp_path / f".step_1.safetensors.otherhost.{dead}.0123456789abcdef.tmp"
    elsewhere.write_bytes(b"z")
    old_form = tmp_path / f".step_2.safetensors.{dead}.tmp"
    old_form.write_bytes(b"w")
    old_recent = tmp_path / f".step_3.safetensors.{dead}.tmp"
    old_recent.write_bytes(b"v")
    os.utime(old_form, (0, 1_000_000))  # written long ago
    dump({"h": {"primal": np.zeros(1)}}, tmp_path, step=5)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert stale.name not in left and old_form.name not in left
    # A live writer's file, another machine's, and a recent one of the old form are kept.
    assert {alive.name, elsewhere.name, old_recent.name, "step_5.safetensors"} == set(left)


def test_a_dump_killed_mid_write_leaves_a_temporary_the_next_dump_removes(tmp_path):
    # A real process killed while writing: it stops itself (SIGKILL) from inside the write.
    code = f"""
        import os, signal, sys, numpy as np
        from sowtel.dumps import dump
        def hook(event, args):
            if event == "os.rename":
                os.kill(os.getpid(), signal.SIGKILL)
        sys.addaudithook(hook)
        dump({{"h": {{"primal": np.zeros(1000)}}}}, {str(tmp_path)!r}, step=1)
    """
    result = run_python(code)
    assert result.returncode == -9, result.stderr
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers
    dump({"h": {"primal": np.zeros(1)}}, tmp_path, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2.safetensors"]


# ----------------------------------------------------------------------------- header amplification


def test_a_huge_header_of_empty_lists_is_refused_before_parsing(tmp_path):
    n = 33_000_000  # a 99 MB header of [] values
    path = tmp_path / "crafted.safetensors"
    body = b'{"__metadata__":{"format":"sowtel.dump"},"x":[' + b"[]," * (n - 1) + b"[]]}"
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little"))
        f.write(body)
    del body
    code = f"""
        import resource, sys
        from sowtel.dumps import load, info
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for read in (load, info):
            try:
                read({str(path)!r})
            except ValueError as e:
                assert "JSON arrays and objects" in str(e) and "crafted.safetensors" in str(e), e
            else:
                sys.exit("not refused")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    grown = int(result.stdout.split()[-1])
    assert grown < 500_000_000, grown  # the header read once: ~100 MB, not gigabytes


def test_dump_refuses_to_write_a_header_load_would_refuse(tmp_path):
    from sowtel.dumps import MAX_CONTAINERS

    wide = {"h": {"primal": [[] for _ in range(MAX_CONTAINERS // 2 + 1)]}}
    with pytest.raises(ValueError, match="containers.*dump fewer leaves"):
        dump(wide, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- jsonl: full disk


def test_jsonl_on_a_full_disk_writes_whole_lines_and_counts_agree_with_the_file(tmp_path):
    # A real write limit: RLIMIT_FSIZE makes writes past 60,000 bytes fail (EFBIG), the first
    # one cut short, as a full disk does.
    code = f"""
        import json, resource, signal
        import sowtel
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))
        sowtel.enable(exporter="jsonl", logdir={str(tmp_path)!r}, queue_size=100_000,
                      on_full="block")
        for step in range(2000):
            sowtel.log({{"loss": step * 0.5, "acc": 1.0}}, step=step)
            if step % 50 == 0:
                sowtel.flush()
        final = sowtel.disable()
        print(json.dumps(final["accounts"]["jsonl"]))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    account = json.loads(result.stdout.strip().splitlines()[-1])
    path = tmp_path / "records.jsonl"
    text = path.read_bytes()
    assert 0 < len(text) <= 60_000 and text.endswith(b"\n")
    assert account["failed"] > 0 and account["exported"] > 0  # the limit was really hit
    lines = text.splitlines()
    assert all(json.loads(line)["summary"] == "scalar" for line in lines)
    assert len(lines) == account["exported"]
    assert account["received"] == 4000 == account["exported"] + account["failed"]


def test_jsonl_truncates_a_cut_write_and_retries_the_truncation_on_close(tmp_path):
    # The file layer alone, with a real limit in a child process: one write that does not fit.
    code = f"""
        import os, resource, signal
        from sowtel.exporters.jsonl import JsonlExporter
        from sowtel.records import Record
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        exporter = JsonlExporter(logdir={str(tmp_path)!r})
        exporter._append("x" * 99 + "\\n")
        resource.setrlimit(resource.RLIMIT_FSIZE, (150, 150))
        try:
            exporter._append("y" * 199 + "\\n")
        except OSError as e:
            print("raised", e.errno)
        print(os.path.getsize({str(tmp_path / "records.jsonl")!r}))
        exporter.close()
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["raised", "27", "100"]  # EFBIG; back to the whole line


def test_read_records_reads_up_to_a_cut_last_line_with_a_warning(tmp_path):
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([stats_record(k) for k in range(3)])
    exporter.close()
    path = tmp_path / "records.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole[:-40])
    with pytest.warns(UserWarning, match=r"records.jsonl: line 3, the last, is cut short"):
        records = read_records(path)
    assert [r.step for r in records] == [0, 1]
    # A bad line that is not the last is an error naming its line, not its column alone.
    path.write_bytes(whole.replace(b'"step":1', b'"step":1,,', 1))
    with pytest.raises(ValueError, match=r"records.jsonl: line 2 is not a JSON object"):
        read_records(path)


def test_jsonl_removes_a_cut_last_line_before_appending(tmp_path):
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([stats_record(0)])
    exporter.close()
    path = tmp_path / "records.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"name":"h","mo')  # a process died in the middle of a line
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([stats_record(1)])
    exporter.close()
    assert [r.step for r in read_records(path)] == [0, 1]


# ----------------------------------------------------------------------------- jsonl: sidecars


def test_sidecars_that_cannot_be_created_cost_their_values_not_their_records(tmp_path):
    import sowtel

    exporter = JsonlExporter(logdir=tmp_path)
    (tmp_path / "records_values").write_text("a file where the sidecar folder goes")
    values = {f"site{k}": {"primal": np.full(2, k, np.float32)} for k in range(100)}
    with sowtel.enable(exporter=exporter, summary="full"):
        sowtel.export(values, step=1)
        final = sowtel.disable()
    account = final["accounts"]["jsonl"]
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    # Every line was written, so every record is exported; the values lost are counted apart.
    assert len(lines) == 100 == account["exported"] and account["failed"] == 0
    assert all(x["value_file"] is None and "not saved" in x["value_error"] for x in lines)
    assert exporter.values_not_saved == 100


def test_a_sidecar_folder_deleted_and_blocked_costs_the_value_of_its_line_only(tmp_path):
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([full_record(0)])
    folder = tmp_path / "records_values"
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    folder.write_text("not a folder")  # the sidecar folder is gone, a file in its place
    exporter.write([full_record(1), stats_record(2)])  # does not raise: both lines written
    exporter.close()
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert "not saved" in lines[1]["value_error"] and lines[1]["value_file"] is None
    assert exporter.values_not_saved == 1


def test_read_records_refuses_a_fifo_sidecar_at_once(tmp_path):
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([full_record(0)])
    exporter.close()
    (sidecar,) = (tmp_path / "records_values").iterdir()
    sidecar.unlink()
    os.mkfifo(sidecar)
    # In a child with a deadline: before the fix, reading blocked forever on the FIFO.
    code = f"""
        from sowtel.exporters.jsonl import read_records
        try:
            read_records({str(tmp_path / "records.jsonl")!r})
        except ValueError as e:
            print(e)
    """
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "records.jsonl:1" in result.stdout and "not a regular file" in result.stdout
    assert sidecar.name in result.stdout


def test_read_records_refuses_a_sidecar_header_claiming_4_tib(tmp_path):
    exporter = JsonlExporter(logdir=tmp_path)
    exporter.write([full_record(0)])
    exporter.close()
    (sidecar,) = (tmp_path / "records_values").iterdir()
    header = {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)}
    with open(sidecar, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 8)
    with pytest.raises(ValueError, match=r"records.jsonl:1: the sidecar .* claims .* holds 8 "
                                         "bytes"):
        read_records(tmp_path / "records.jsonl")
    assert read_records(tmp_path / "records.jsonl", load_values=False)[0].value is None


# ----------------------------------------------------------------------------- jsonl: hard links


def test_jsonl_refuses_a_records_file_with_another_hard_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    logdir = tmp_path / "logs"
    logdir.mkdir()
    os.link(outside, logdir / "records.jsonl")
    with pytest.raises(ValueError, match=r"logdir=.*'records.jsonl' there has 2 hard links.*"
                                         "remove that file"):
        JsonlExporter(logdir=logdir)
    assert outside.read_text() == "precious\n"


def test_jsonl_refuses_a_fifo_planted_as_its_file_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "records.jsonl")
    # In a child with a deadline: opening a FIFO to write blocks until someone reads it.
    code = f"""
        from sowtel.exporters.jsonl import JsonlExporter
        try:
            JsonlExporter(logdir={str(tmp_path)!r})
        except ValueError as e:
            print(e)
    """
    result = run_python(code, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "cannot write" in result.stdout or "not a regular file" in result.stdout


# ----------------------------------------------------------------------------- deleted logdir


def test_jsonl_notices_a_deleted_logdir_warns_once_and_writes_on_into_a_new_one(tmp_path, caplog):
    import shutil

    logdir = tmp_path / "run"
    exporter = JsonlExporter(logdir=logdir)
    exporter.write([stats_record(0), full_record(1)])
    for round_ in range(2):
        shutil.rmtree(logdir)  # rmtree while training
        with caplog.at_level("WARNING", logger="sowtel"):
            exporter.write([stats_record(10 + round_), full_record(20 + round_)])
    exporter.close()
    assert exporter.recreated == 2
    assert sum("was deleted" in r.getMessage() for r in caplog.records) == 1
    records = read_records(logdir / "records.jsonl")
    assert [r.step for r in records] == [11, 21]
    assert records[1].value.tolist() == [21.0, 22.0]


def test_a_deleted_logdir_under_a_session_counts_only_what_reached_a_file(tmp_path):
    import shutil

    from tensorboard.backend.event_processing import event_accumulator as ea

    import sowtel

    logdir = tmp_path / "run"
    with sowtel.enable(exporter=["jsonl", "tensorboard"], logdir=str(logdir)):
        for step in range(50):
            sowtel.log({"loss": float(step)}, step=step)
        sowtel.flush()
        shutil.rmtree(logdir)
        for step in range(50, 120):
            sowtel.log({"loss": float(step)}, step=step)
        final = sowtel.disable()
    assert final["accounts"]["jsonl"]["exported"] == 120
    assert final["accounts"]["tensorboard"]["exported"] == 120
    # What was exported after the deletion is in files that exist: 70 lines, 70 points.
    assert [r.step for r in read_records(logdir / "records.jsonl")] == list(range(50, 120))
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(50, 120))


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize("exporter", ["jsonl", "tensorboard"])
@pytest.mark.parametrize("logdir, rule", [
    ("runs/a\0b", r"logdir='runs/a\\x00b' holds a NUL character .* remove it"),
    ("x" * 5000, r"logdir='x+'\.\.\.'x+' is \d+ bytes long .* limit of \d+ bytes per path: "
                 "choose a shorter logdir"),
    ("runs/" + "y" * 300, r"has a folder name of 300 bytes .* limit of \d+ bytes per name: "
                          "choose a shorter logdir"),
])
def test_an_impossible_logdir_is_a_value_error_naming_option_value_and_rule(
        in_tmp, exporter, logdir, rule):
    import sowtel

    with pytest.raises(ValueError, match=rule):
        sowtel.enable(exporter=exporter, logdir=logdir)
    assert not sowtel.status()["enabled"] and os.listdir(".") == []


@pytest.mark.parametrize("filename", ["r" * 300, "a\0b"])
def test_an_impossible_jsonl_filename_is_a_value_error_naming_it(tmp_path, filename):
    with pytest.raises(ValueError, match=r"filename='[ra].*NUL character or is over 240 bytes.*"
                                         "choose a short file name"):
        JsonlExporter(logdir=tmp_path, filename=filename)
    assert list(tmp_path.iterdir()) == []


def test_a_file_planted_under_the_event_file_name_is_named(tmp_path, monkeypatch):
    import socket
    import time

    from sowtel.exporters import tensorboard

    # Plant a file under every name the exporter could pick in the next seconds.
    now, counter = int(time.time()), next(tensorboard._file_counter) + 1
    for t in range(now, now + 30):
        name = (f"events.out.tfevents.{t:010d}.{socket.gethostname()}.{os.getpid()}."
                f"{counter:04d}.sowtel")
        (tmp_path / name).write_text("planted")
    with pytest.raises(ValueError, match=r"logdir=.*a file named 'events\.out\.tfevents\..*' is "
                                         "already there.*remove that file, or choose another "
                                         "logdir"):
        tensorboard.TensorBoardExporter(logdir=tmp_path)
    assert all(p.read_text() == "planted" for p in tmp_path.iterdir())


def test_a_prometheus_port_in_use_is_a_value_error_and_leaves_no_thread():
    import socket
    import threading

    import sowtel

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    before = set(threading.enumerate())
    try:
        with pytest.raises(ValueError, match=rf"prometheus='127\.0\.0\.1:{port}' cannot be "
                                             "listened on by the metrics server .* choose "
                                             "another port"):
            sowtel.enable(exporter="otel", prometheus=f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert not sowtel.status()["enabled"]
    assert {t for t in threading.enumerate() if t.is_alive()} - before == set()


# ----------------------------------------------------------------------------- failed enable()


def test_enable_with_stderr_closed_works_and_disable_leaves_nothing(tmp_path):
    code = f"""
        import sys, threading
        import sowtel
        sys.stderr.close()
        before = threading.active_count()
        session = sowtel.enable(exporter="tensorboard", logdir={str(tmp_path / "run")!r})
        sowtel.log({{"loss": 1.0}}, step=0)
        final = sowtel.disable()
        print(final["accounts"]["tensorboard"]["exported"], threading.active_count() - before,
              sowtel.status()["enabled"])
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0", "False"]


def test_an_enable_that_fails_after_starting_undoes_everything():
    import threading
    import warnings

    import sowtel

    first = sowtel.enable(exporter="memory")  # not scoped: a second enable() warns
    try:
        before = threading.active_count()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # as under python -W error
            with pytest.raises(RuntimeWarning, match="still active"):
                sowtel.enable(exporter="memory")
        assert sowtel.status()["enabled"]
        from sowtel.session import active_session

        assert active_session() is first
        assert threading.active_count() == before
    finally:
        sowtel.disable()
    assert not sowtel.status()["enabled"]
