"""Bounds in records, status() as one snapshot, and sessions inherited by a forked child.

- ``queue_size`` counts records (a ``sowtel.jit`` step counts as every record it makes): under
  "block" a slow exporter holds the training loop back, and what waits stays within
  ``queue_size`` plus one step and one batch; under "drop" whole steps are dropped and counted.
- ``status()`` is read at one moment: no sample ever shows more exported than received, or a
  negative pending count.
- A child made with ``multiprocessing``'s fork while sowtel's threads are busy gets fresh locks:
  its inherited session answers ``status``, ``flush``, ``log`` and ``disable`` at once.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import sowtel
from sowtel.dispatcher import BATCH_RECORDS
from sowtel.records import Record

LAYERS, SITES = 6, 3
PER_STEP = LAYERS * SITES


def _scan_step(x):
    def body(c, _):
        for k in range(SITES):
            c = jnp.tanh(c) + 0.1 * k
            sowtel.sow(c, f"s{k}")
        return c, None
    return jax.lax.scan(body, x, None, length=LAYERS)[0]


class Slow:
    """Sleeps ``per_record`` seconds a record; keeps the steps of what it wrote."""

    def __init__(self, per_record: float) -> None:
        self.per_record = per_record
        self.steps: collections.Counter[int] = collections.Counter()

    def write(self, records: Sequence[Record]) -> None:
        time.sleep(self.per_record * len(records))
        self.steps.update(r.step for r in records)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _waiting(s: dict) -> int:
    return s["queued_records"] + max(s["backlog"].values())


def test_block_holds_the_loop_back_within_queue_size_plus_a_step_and_a_batch():
    queue_size, steps = 40, 30
    slow = Slow(per_record=0.001)
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-1.0, 1.0, 16)
    most = 0
    with sowtel.enable(exporter=slow, on_full="block", queue_size=queue_size) as session:
        for _ in range(steps):
            x = f(x)
            most = max(most, _waiting(session.status()))
        assert sowtel.flush(timeout=120.0)
        final = sowtel.status()
    # Waiting: the queue (under queue_size plus the step that crossed it) and the batch being
    # converted or written (at most queue_size records plus one step).
    assert most <= queue_size + PER_STEP + min(queue_size, BATCH_RECORDS) + PER_STEP
    # Back-pressure, not loss: every record of every step reached the slow exporter.
    assert final["dropped"] == 0 and slow.steps == {s: PER_STEP for s in range(steps)}
    assert final["accounts"]["Slow"]["exported"] == steps * PER_STEP


def test_drop_mode_drops_whole_steps_and_counts_them():
    slow = Slow(per_record=0.002)
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-1.0, 1.0, 16)
    steps = 40
    with sowtel.enable(exporter=slow, on_full="drop", queue_size=PER_STEP):
        for _ in range(steps):
            x = f(x)
        x.block_until_ready()
        assert sowtel.flush(timeout=120.0)
        final = sowtel.status()
    reasons = final["drop_reasons"]["Slow"]
    dropped = sum(reasons.values())
    assert dropped > 0  # 40 steps at once into a queue of one step: the host fell behind
    # A step is written whole or dropped whole, and the counts say which.
    assert set(slow.steps.values()) == {PER_STEP}
    assert dropped % PER_STEP == 0 and dropped == (steps - len(slow.steps)) * PER_STEP
    a = final["accounts"]["Slow"]
    assert a["received"] == steps * PER_STEP == a["exported"] + a["dropped"] and a["pending"] == 0


def test_status_is_one_snapshot_while_records_stream():
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-1.0, 1.0, 16)
    samples: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set() and len(samples) < 20_000:
            samples.append(sowtel.status())

    with sowtel.enable(exporter=["memory", Slow(per_record=0.0)]):
        sampler = threading.Thread(target=sample)
        sampler.start()
        for _ in range(200):
            x = f(x)
        x.block_until_ready()
        assert sowtel.flush(timeout=60.0)
        done.set()
        sampler.join()
    live = [s for s in samples if s.get("enabled")]
    assert len(live) > 10
    for s in live:
        for label, a in s["accounts"].items():
            assert a["exported"] <= a["received"], (label, a)
            assert a["pending"] >= 0, (label, a)
            assert a["received"] == (a["exported"] + a["dropped"] + a["failed"] + a["late"]
                                     + a["pending"]), (label, a)


def _hold(lock, held: threading.Event, release: threading.Event) -> None:
    with lock:
        held.set()
        release.wait(30.0)


def _child_uses_inherited_session(out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    s = sowtel.status()
    flushed = sowtel.flush(timeout=5.0)
    logged = sowtel.log({"loss": 1.0}, step=0)
    final = sowtel.disable(timeout=5.0)
    out.put((s["enabled"], flushed, logged, final["enabled"]))


def test_a_forked_child_answers_status_flush_log_and_disable_at_once():
    ctx = multiprocessing.get_context("fork")
    f = sowtel.jit(_scan_step)
    x = jnp.linspace(-1.0, 1.0, 16)
    stop = threading.Event()

    def train() -> None:
        y = x
        while not stop.is_set():
            y = f(y)
            sowtel.status()  # the dispatcher's lock, taken and released all the time

    forks = 20
    with sowtel.enable(exporter=["memory", Slow(per_record=0.00001)]) as session:
        # Locks a sowtel thread may hold at the moment of a fork (the dispatcher's, a
        # worker's, the sessions'): each fork below happens while another thread holds one.
        import sowtel.session as sessions

        locks = [session.dispatcher._lock, sessions._lock,
                 *(w._cond for w in session.dispatcher._workers)]
        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            with warnings.catch_warnings():
                # Python warns that forking a threaded process may deadlock: what is tested.
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", RuntimeWarning)
                for k in range(forks):
                    held, release = threading.Event(), threading.Event()
                    holder = threading.Thread(target=_hold,
                                              args=(locks[k % len(locks)], held, release))
                    holder.start()
                    assert held.wait(30.0)
                    out = ctx.Queue()
                    child = ctx.Process(target=_child_uses_inherited_session, args=(out,))
                    child.start()
                    release.set()
                    holder.join()
                    child.join(60.0)  # a child that hangs stays alive far beyond a second
                    hung = child.is_alive()
                    if hung:
                        child.kill()
                        child.join()
                    assert not hung, "a forked child hung on an inherited sowtel lock"
                    assert child.exitcode == 0
                    # In the child: the session answered; nothing to flush or deliver there.
                    enabled, flushed, logged, final_enabled = out.get(timeout=10.0)
                    assert enabled is True and logged == 1 and final_enabled is False
                    assert flushed in (True, False)
        finally:
            stop.set()
            trainer.join()
        assert sowtel.flush(timeout=60.0)  # the parent's session is untouched by the forks
