"""Reliability under hostile conditions: exact accounting, honest stalls, a real byte bound,
shutdown from any thread, and a load test through the real exporters.

Every exporter here is a real one or a small class written for the test; waits are bounded and
margins wide, as the suite runs on a loaded two-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from exporter_doubles import Hung, Raising, convert, make_record

from sowtel.dispatcher import Dispatcher
from sowtel.exporters.memory import MemoryExporter
from sowtel.records import Record


def assert_adds_up(status: dict[str, Any], received: int | None = None) -> None:
    """received == exported + dropped + failed + late per exporter and in total; none pending."""
    accounts = status["accounts"]
    assert "total" in accounts
    for label, a in accounts.items():
        assert a["pending"] == 0, (label, a)
        assert a["received"] == a["exported"] + a["dropped"] + a["failed"] + a["late"], (label, a)
        if label != "total":
            assert a["received"] == status["received"] + status["late"], (label, a)
            assert a["exported"] == status["exported"][label]
            assert a["failed"] == status["failed"][label]
            assert a["dropped"] == sum(status["drop_reasons"][label].values())
    labels = [k for k in accounts if k != "total"]
    for key in ("received", "exported", "dropped", "failed", "late"):
        assert accounts["total"][key] == sum(accounts[k][key] for k in labels)
    if received is not None:
        assert status["received"] == received


class Slow:
    """Takes ``per_record`` seconds for each record it writes: slow, but always progressing."""

    def __init__(self, per_record: float) -> None:
        self.per_record = per_record
        self.steps: list[int] = []
        self.largest_write = 0
        self.closed_at: float | None = None
        self.last_write_end = 0.0

    def write(self, records: Sequence[Record]) -> None:
        self.largest_write = max(self.largest_write, len(records))
        time.sleep(self.per_record * len(records))
        self.steps.extend(r.step for r in records)
        self.last_write_end = time.monotonic()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed_at = time.monotonic()


# -- 1. accounting ------------------------------------------------------------------------------

def test_a_raising_exporters_records_are_counted_as_failed_records(made):
    memory = MemoryExporter()
    d = Dispatcher([Raising(), memory], convert=convert, flush_interval=0.05)
    made.append(d)
    for batch in range(5):
        for i in range(100):
            d.put(batch * 100 + i)
        assert d.flush(timeout=10.0)
    s = d.status()
    assert s["failed"] == {"Raising": 500, "memory": 0}
    assert s["exported"] == {"Raising": 0, "memory": 500}
    assert len(memory.records) == 500
    assert_adds_up(s, received=500)
    d.close(timeout=5.0)
    assert_adds_up(d.status(), received=500)


def test_queue_drops_convert_failures_and_pytree_items_add_up(made):
    gate, inside = threading.Event(), threading.Event()

    def gated(items):
        inside.set()
        gate.wait(10.0)
        if 13 in items:
            raise ValueError("unlucky")
        # An item (k, n) becomes n records, as a pytree site gives one record per leaf.
        return [make_record(k) for k, n in items for _ in range(n)]

    memory = MemoryExporter()
    d = Dispatcher([memory], convert=gated, queue_size=10, flush_interval=0.01)
    made.append(d)
    assert d.put((-1, 1))
    assert inside.wait(5.0)
    # queue_size counts records, the one being converted included: items of 3 records are
    # taken while fewer than 10 wait (1, 4, 7: three items, 9 records), the next 12 are
    # refused: 36 records dropped, not 12.
    assert [d.put((i, 3), records=3) for i in range(15)] == [True] * 3 + [False] * 12
    gate.set()
    assert d.flush(timeout=10.0)
    assert d.put(13, records=2)  # convert raises on it: 2 records failed
    assert d.flush(timeout=10.0)
    s = d.status()
    assert len(memory.records) == 1 + 9
    assert s["drop_reasons"]["memory"] == {"queue_full": 36}
    assert (s["exported"]["memory"], s["failed"]["memory"]) == (10, 2)
    assert_adds_up(s, received=1 + 45 + 2)


def test_late_records_complete_the_identity_after_disable():
    import jax
    import jax.numpy as jnp

    import sowtel

    def pair_sum(x):
        a, b = sowtel.sow((x * 2.0, x + 1.0), "pair")
        return jnp.sum(a) + jnp.sum(b)

    f = jax.jit(pair_sum)
    x = jnp.ones(3)
    with sowtel.enable(exporter="memory") as session:
        compiled = f.lower(x).compile()  # holds the callback of this session
        compiled(x)
    final = session.status()
    assert_adds_up(final, received=2)
    compiled(x)  # after the session ended: its two records (one a leaf) arrive late
    jax.effects_barrier()
    later = session.status()
    assert later["late"] == final["late"] + 2
    assert later["accounts"]["memory"]["received"] == 4
    assert_adds_up(later, received=2)


# -- 2. stalls per record ------------------------------------------------------------------------

def test_a_slow_exporter_that_keeps_progressing_is_never_declared_hung(made):
    # 1 ms a record against a 0.5 s timeout: before, one write of thousands of records took
    # seconds and the exporter was declared stalled, its backlog never counted.
    slow = Slow(per_record=0.001)
    d = Dispatcher([slow], convert=convert, queue_size=10_000, exporter_timeout=0.5,
                   flush_interval=0.05)
    made.append(d)
    n = 3_000
    assert all(d.put(i) for i in range(n))
    assert d.flush(timeout=120.0)
    s = d.status()
    assert s["stalled"] == []
    assert slow.steps == list(range(n))
    assert s["exported"] == {"Slow": n}
    assert_adds_up(s, received=n)
    # Each write was sized to take a small part of the timeout at the exporter's pace.
    assert slow.largest_write * slow.per_record < 0.5


def test_a_hung_exporter_is_abandoned_with_its_backlog_counted(made, release):
    hung, memory = Hung(release), MemoryExporter()
    d = Dispatcher([hung, memory], convert=convert, exporter_timeout=0.5, flush_interval=0.01)
    made.append(d)
    d.put(0)
    assert hung.entered.wait(10.0)
    for i in range(1, 300):
        d.put(i)
    t0 = time.monotonic()
    assert d.flush(timeout=30.0)
    assert time.monotonic() - t0 < 20.0
    s = d.status()
    assert s["stalled"] == ["Hung"]
    assert s["exported"] == {"Hung": 0, "memory": 300}
    assert s["drop_reasons"]["Hung"] == {"stalled": 300}
    assert_adds_up(s, received=300)
    d.close(timeout=5.0)
    assert_adds_up(d.status(), received=300)
    # Once close() returned, the hung call may finish; then only close() is called, once.
    release.set()
    assert hung.closed.wait(10.0)
    time.sleep(0.2)
    assert hung.calls == ["write", "close"]


def test_close_gives_up_on_a_backlog_within_its_timeout_and_counts_it(made):
    slow = Slow(per_record=0.005)
    d = Dispatcher([slow], convert=convert, queue_size=10_000, exporter_timeout=30.0,
                   flush_interval=0.01)
    n = 4_000  # 20 s of writing
    assert all(d.put(i) for i in range(n))
    deadline = time.monotonic() + 20.0
    while not slow.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    d.close(timeout=1.0)
    closed_in = time.monotonic() - t0
    closed_at = time.monotonic()
    assert closed_in < 5.0
    s = d.status()
    written = s["exported"]["Slow"]
    assert 0 < written < n
    assert s["drop_reasons"]["Slow"] == {"close_timeout": n - written}
    assert_adds_up(s, received=n)
    # What the docs promise may still happen after close(): the one write in progress ends,
    # then the exporter is closed; nothing more is written.
    deadline = time.monotonic() + 10.0
    while slow.closed_at is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow.closed_at is not None
    late_writes = len(slow.steps) - written
    assert 0 <= late_writes <= slow.largest_write
    assert slow.last_write_end <= slow.closed_at
    assert slow.closed_at - closed_at < 5.0


def test_an_exporter_that_closes_its_own_dispatcher_still_writes_what_it_was_given():
    d: Dispatcher

    class ClosesItself(Slow):
        def write(self, records: Sequence[Record]) -> None:
            if not self.steps:
                d.close(timeout=5.0)  # from inside write(): must not wait for itself
            super().write(records)

    exporter = ClosesItself(per_record=0.0)
    d = Dispatcher([exporter], convert=convert, flush_interval=60.0)
    for i in range(100):
        d.put(i)
    t0 = time.monotonic()
    d.flush(timeout=20.0)
    assert time.monotonic() - t0 < 10.0
    deadline = time.monotonic() + 10.0
    while exporter.closed_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exporter.steps == list(range(100))
    s = d.status()
    assert s["exported"] == {"ClosesItself": 100}
    assert_adds_up(s, received=100)


# -- 4. max_bytes is a real bound ----------------------------------------------------------------

@pytest.mark.parametrize("on_full", ["drop", "block"])
def test_max_bytes_bounds_every_full_value_held_by_the_pipeline(made, on_full):
    mib = 1 << 20
    slow = Slow(per_record=0.005)  # discards values: whatever is alive is the pipeline's
    d = Dispatcher([slow, Slow(per_record=0.0)], convert=list, queue_size=10_000,
                   max_bytes=8 * mib, on_full=on_full, flush_interval=0.01)
    made.append(d)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        n = 150
        for i in range(n):
            d.put_records([make_record(i, value=np.ones(mib // 8, np.float64))])
        assert d.flush(timeout=60.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # max_bytes, plus one record being offered, plus the one the producer just made.
    assert peak - base <= 8 * mib + 2 * mib + mib // 2, (peak - base) / mib
    s = d.status()
    assert_adds_up(s, received=n)
    if on_full == "block":
        assert s["exported"] == {"Slow": n, "Slow#2": n}


def test_full_values_to_tensorboard_are_bounded_counted_and_disable_keeps_its_timeout(tmp_path):
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.exporters.tensorboard import TensorBoardExporter

    mib = 1 << 20

    @jax.jit
    def step(x):
        return sowtel.sow(x * 1.5, "big").sum()

    x = jnp.ones((2 * mib,), jnp.float32)  # 8 MiB a record
    session = sowtel.enable(exporter=TensorBoardExporter(logdir=tmp_path), summary="full",
                            max_bytes=64 * mib)
    most = 0
    for _ in range(60):
        step(x).block_until_ready()
        most = max(most, session.status()["held_bytes"])
    assert most <= 64 * mib + 8 * mib
    deadline = time.monotonic() + 60.0
    while session.status()["exported"]["tensorboard"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.status()["exported"]["tensorboard"] > 0  # TensorBoard really writes them
    t0 = time.monotonic()
    final = sowtel.disable(timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    assert final is not None and final["held_bytes"] == 0
    assert_adds_up(final, received=60)


# -- 5. shutdown from any thread -----------------------------------------------------------------

_CHILD = """
import os, signal, sys, threading, time
import sowtel

logdir, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ready = threading.Event()

def train():
    sowtel.enable(exporter="jsonl", logdir=logdir)
    for i in range(n):
        sowtel.log({"loss": float(i)}, step=i)
    ready.set()
    while True:
        time.sleep(0.05)

threading.Thread(target=train, daemon=True).start()
ready.wait()
if how == "exit":
    sys.exit(0)
print("ready", flush=True)
for _ in range(1200):
    time.sleep(0.05)
sys.exit(4)
"""


def _child(tmp_path: Path, n: int, how: str) -> tuple[int, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path), str(n), how],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        # Started from a shell's background, a process inherits SIGINT ignored: the child gets
        # the default action back, so the signal reaches it as a user's Ctrl-C does.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        if how != "exit":
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        out, err = child.communicate(timeout=90)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out + err


@pytest.mark.parametrize("how", ["sigterm", "sigint", "exit"])
def test_a_session_enabled_in_another_thread_loses_nothing_at_shutdown(tmp_path, how):
    n = 3_000
    rc, output = _child(tmp_path, n, how)
    expected = {"sigterm": (-signal.SIGTERM,), "sigint": (-signal.SIGINT, 1), "exit": (0,)}
    assert rc in expected[how], output
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(n)), output


_CHILD_IMPORT_IN_THREAD = """
import sys, threading, warnings
warnings.simplefilter("default")

def train():
    import sowtel
    for _ in range(2):
        with sowtel.enable(exporter="memory"):
            pass

t = threading.Thread(target=train)
t.start()
t.join()
"""


def test_enable_warns_once_when_no_sigterm_handler_could_be_installed():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD_IMPORT_IN_THREAD)],
                          capture_output=True, text=True, timeout=90,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("SIGTERM") == 1, done.stderr
    assert "main thread" in done.stderr


# -- SIGTERM and the user's own handling of it ------------------------------------------------

def _run_child(code: str, *args: str, signal_after: str | None = None, stdin: str | None = None,
               cwd: Path, timeout: float = 90) -> tuple[int, str, str]:
    """Runs ``code`` in a fresh interpreter; once it prints ``signal_after``, sends SIGTERM
    (then ``stdin``, if given). Returns the exit status, stdout and stderr."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines: list[str] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        if signal_after is not None:
            for line in child.stdout:
                lines.append(line)
                if line.strip() == signal_after:
                    child.send_signal(signal.SIGTERM)
                    break
            if stdin is not None:
                child.stdin.write(stdin)
                child.stdin.flush()
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, "".join(lines) + out, err


_CHILD_GRACEFUL = """
import json, signal, sys, threading
import sowtel

how, logdir = sys.argv[1], sys.argv[2]
stop = threading.Event()
if how == "handler":  # finish the epoch, then exit
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
sowtel.enable(exporter="jsonl", logdir=logdir)
for i in range(300):
    sowtel.log({"loss": float(i)}, step=i)
print("ready", flush=True)
sys.stdin.readline()  # sent after SIGTERM
if how == "handler":
    assert stop.wait(60), "the handler did not run"
enabled = sowtel.status()["enabled"]
for i in range(300, 600):
    sowtel.log({"loss": float(i)}, step=i)
final = sowtel.disable()
print(json.dumps({"enabled": enabled, "dropped": final["dropped"]}), flush=True)
"""


@pytest.mark.parametrize("how", ["handler", "ignored"])
def test_sigterm_handled_by_the_user_keeps_the_session_streaming(tmp_path, how):
    rc, out, err = _run_child(_CHILD_GRACEFUL, how, str(tmp_path), signal_after="ready",
                              stdin="go\n", cwd=tmp_path)
    assert rc == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result == {"enabled": True, "dropped": 0}, err
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(600)), err


_CHILD_CHAINING = """
import os, signal, sys, time
import sowtel

logdir = sys.argv[1]
previous = signal.getsignal(signal.SIGTERM)  # sowtel's, as it was imported first

def checkpoint(signum, frame):
    with open(os.path.join(logdir, "checkpoint"), "a") as f:
        f.write("saved\\n")
    previous(signum, frame)

signal.signal(signal.SIGTERM, checkpoint)
sowtel.enable(exporter="jsonl", logdir=logdir)
for i in range(300):
    sowtel.log({"loss": float(i)}, step=i)
print("ready", flush=True)
for _ in range(1200):
    time.sleep(0.05)
sys.exit(4)
"""


def test_a_chaining_handler_completes_and_every_record_is_written(tmp_path):
    rc, _, err = _run_child(_CHILD_CHAINING, str(tmp_path), signal_after="ready", cwd=tmp_path)
    assert rc == -signal.SIGTERM, err[-2000:]
    assert (tmp_path / "checkpoint").read_text() == "saved\n"  # once: no recursion
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(300))


_CHILD_JIT_IN_THREAD = """
import sys, threading
import jax, jax.numpy as jnp
import sowtel

logdir = sys.argv[1]

def step(x):
    def body(c, _):
        for k in range(8):
            c = jnp.tanh(c) + 0.01 * k
            sowtel.sow(c, f"s{k}")
        return c, None
    return jax.lax.scan(body, x, None, length=16)[0]

f = sowtel.jit(step)

def train():
    sowtel.enable(exporter="jsonl", logdir=logdir, on_full="block")
    x = jnp.linspace(-1.0, 1.0, 256)
    i = 0
    while True:
        x = f(x)
        print(f"step {i}", flush=True)  # its records were accepted by now
        i += 1

worker = threading.Thread(target=train, daemon=True)
worker.start()
worker.join()
"""


def test_sigterm_with_the_session_in_a_thread_keeps_every_step_that_returned(tmp_path):
    rc, out, err = _run_child(_CHILD_JIT_IN_THREAD, str(tmp_path), signal_after="step 20",
                              cwd=tmp_path)
    assert rc == -signal.SIGTERM, err[-2000:]
    reported = sum(1 for line in out.splitlines() if line.startswith("step "))
    per_step: dict[int, int] = {}
    for line in (tmp_path / "records.jsonl").read_text().splitlines():
        step = json.loads(line)["step"]
        per_step[step] = per_step.get(step, 0) + 1
    assert reported >= 21
    missing = {s: per_step.get(s, 0) for s in range(reported) if per_step.get(s, 0) != 128}
    assert not missing, (reported, missing)


_CHILD_SIGNAL_IN_THREAD = """
import signal, sys, threading, time
import sowtel

logdir = sys.argv[1]

def train():
    sowtel.enable(exporter="jsonl", logdir=logdir)
    for i in range(100):
        sowtel.log({"loss": float(i)}, step=i)
    # Taken by this thread, as a running training thread takes a SIGTERM sent to the process;
    # the main thread waits in join(), where nothing wakes it to run the handler.
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(60)

worker = threading.Thread(target=train, daemon=True)
worker.start()
worker.join()
"""


def test_a_sigterm_another_thread_took_reaches_the_main_thread_waiting_in_join(tmp_path):
    try:
        rc, _, err = _run_child(_CHILD_SIGNAL_IN_THREAD, str(tmp_path), cwd=tmp_path,
                                timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("the handler never ran: the main thread stayed in join()")
    assert rc == -signal.SIGTERM, err[-2000:]
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["step"] for line in lines) == list(range(100))


_CHILD_HANDLER_AFTER_ENABLE = """
import os, signal, sys, time
import sowtel

logdir = sys.argv[1]

class Slow:
    # Half a second a write: records queued at the signal are not written by then.
    def write(self, records):
        time.sleep(0.5)
        with open(os.path.join(logdir, "steps.txt"), "a") as f:
            f.writelines(f"{r.step}\\n" for r in records)
    def flush(self):
        pass
    def close(self):
        pass

def cleanup(signum, frame):  # tidy up, then die of SIGTERM: it skips sowtel's flush
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

sowtel.enable(exporter=Slow())
signal.signal(signal.SIGTERM, cleanup)
for i in range(300):
    sowtel.log({"loss": float(i)}, step=i)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
sys.exit(4)
"""


def test_a_handler_set_after_enable_on_the_main_thread_still_gets_the_flush(tmp_path):
    rc, _, err = _run_child(_CHILD_HANDLER_AFTER_ENABLE, str(tmp_path), cwd=tmp_path)
    assert rc == -signal.SIGTERM, err[-2000:]
    steps = (tmp_path / "steps.txt").read_text().split() if (tmp_path / "steps.txt").exists() \
        else []
    assert sorted(map(int, steps)) == list(range(300))


_CHILD_HANDLER_UNSEEN = """
import signal, sys, threading, time, warnings
import sowtel

seen = threading.Event()
shown = warnings.showwarning

def show(message, category, *args, **kwargs):
    if "SIGTERM" in str(message):
        seen.set()
    shown(message, category, *args, **kwargs)

warnings.showwarning = show
with sowtel.enable(exporter="memory"):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    # No sowtel call on the main thread from here on, so nothing can put sowtel's back.
    print("warned" if seen.wait(30) else "silent", flush=True)
"""


def test_a_handler_that_replaces_sowtels_for_good_is_warned_about():
    rc, out, err = _run_child(_CHILD_HANDLER_UNSEEN, cwd=Path.cwd())
    assert rc == 0, err[-2000:]
    assert out.strip() == "warned", err[-2000:]
    assert err.count("replaced sowtel's") == 1, err


# -- load ----------------------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_load_100k_stats_records_through_memory_jsonl_and_tensorboard(tmp_path):
    import jax
    import jax.numpy as jnp

    import sowtel
    from sowtel.exporters.jsonl import JsonlExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    length, calls = 1_000, 100  # a scan of 1,000 sows, run 100 times: 100,000 records

    @jax.jit
    def step(x):
        def body(carry, _):
            carry = jnp.tanh(carry) + 0.1
            sowtel.sow(carry, "layer/h")
            return carry, None
        return jax.lax.scan(body, x, None, length=length)[0]

    x = jnp.linspace(-1.0, 1.0, 16)
    memory = MemoryExporter(max_records=10_000)
    jsonl = JsonlExporter(logdir=tmp_path / "jsonl")
    tensorboard = TensorBoardExporter(logdir=tmp_path / "tb")
    with sowtel.enable(exporter=[memory, jsonl, tensorboard], on_full="block"):
        step(x).block_until_ready()  # compiled, and the first 1,000 records
        assert sowtel.flush(timeout=60.0)
        rss0, peak, done = _rss(), [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.monotonic()
        for _ in range(calls - 1):
            x = step(x)
        x.block_until_ready()
        assert sowtel.flush(timeout=120.0)
        elapsed = time.monotonic() - t0
        done.set()
        watcher.join()
        status = sowtel.status()
    n = length * calls
    assert_adds_up(status, received=n)
    assert status["exported"] == {"memory": n, "jsonl": n, "tensorboard": n}
    assert status["dropped"] == 0 and status["stalled"] == []
    assert len(memory.records) == 10_000
    assert sum(1 for _ in open(tmp_path / "jsonl" / "records.jsonl")) == n
    # Backlogs are bounded (queue_size each) and so is the memory exporter here: RSS stays
    # flat (keeping all 100k records would add about 90 MiB).
    growth = peak[0] - rss0
    assert growth < 48 << 20, f"RSS grew {growth / 2**20:.0f} MiB"
    assert elapsed < 60.0, f"{elapsed:.1f} s"
    print(f"\n100k records: {elapsed:.1f} s, RSS +{growth / 2**20:.0f} MiB")
