"""The dispatcher: bounded queue, batching, per-exporter isolation, flush/close, exit hooks.

Everything here runs real threads, real files and real subprocesses; nothing is mocked.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from exporter_doubles import Hung, Raising, convert, make_record

from sowtel.dispatcher import BATCH_RECORDS, Dispatcher
from sowtel.exporters.memory import MemoryExporter
from sowtel.records import Record
from sowtel.to_records import RecordBatch, first_nonfinite


class FakeClock:
    """Time that moves only when the test moves it, for a dispatcher made with
    ``clock=fake, wait=fake.wait``.

    A timed wait returns when its condition is notified or once the test advanced the clock
    past its timeout, never because real time passed: what happens at which time is exact,
    however slowly a loaded machine runs the threads. It waits without a real timeout (a real
    timeout that ran out just as a notification came would swallow it); :meth:`advance` wakes
    the waits whose time is up (and, harmlessly, others on the same condition: every wait of the
    dispatcher re-checks what it waits for).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: Counter[str] = Counter()  # timed or not, by thread name
        self._lock = threading.Lock()
        # The timed waits now: [end, up], their condition, the waiting thread's name.
        self._timed: list[tuple[list[float | bool], threading.Condition, str]] = []
        self._free_since: float | None = None

    def __call__(self) -> float:
        if self._free_since is not None:
            return self.now + time.monotonic() - self._free_since
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
            up = [(w, cond) for w, cond, _ in self._timed if w[0] <= self.now]
            for w, _ in up:
                w[1] = True
        for _, cond in up:  # not under self._lock: a waiter takes it holding its condition
            with cond:
                cond.notify_all()

    def run_free(self) -> None:
        """From now on time is real: the end of a test closes its dispatchers in bounded time."""
        with self._lock:
            self._free_since = time.monotonic()
            waiting = list(self._timed)
        for _, cond, _ in waiting:
            with cond:
                cond.notify_all()

    def wait(self, cond: threading.Condition, timeout: float | None) -> bool:
        self.waits[threading.current_thread().name] += 1
        if timeout is None:
            return cond.wait()
        if self._free_since is not None:
            return cond.wait(timeout)
        if timeout <= 0:
            return False
        with self._lock:
            entry: tuple[list[float | bool], threading.Condition, str] = (
                [self.now + timeout, False], cond, threading.current_thread().name)
            self._timed.append(entry)
        try:
            cond.wait()  # the caller holds cond: advance() notifies only once this waits
        finally:
            with self._lock:
                self._timed.remove(entry)
        return not entry[0][1]

    def until_waiting(self, thread: threading.Thread) -> None:
        """Returns once ``thread`` waited (it read the clock for its deadlines before)."""
        deadline = time.monotonic() + 60.0  # a safety bound only: fires on a hang
        while not self.waits[thread.name] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.waits[thread.name], f"{thread.name} never waited"

    def until_timed(self, name: str) -> None:
        """Returns once the thread ``name`` is in a timed wait whose time is not up."""
        def timed() -> bool:
            with self._lock:
                return any(n == name and not w[1] for w, _, n in self._timed)
        deadline = time.monotonic() + 60.0  # a safety bound only: fires on a hang
        while not timed() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert timed(), f"{name} is not in a timed wait"


@pytest.fixture
def clock(made: list[Dispatcher]) -> Iterator[FakeClock]:
    """A fake clock; at the end of the test it runs free, before ``made`` closes the
    dispatchers, so that a test that failed half-way still ends."""
    fake = FakeClock()
    yield fake
    fake.run_free()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Runs ``fn`` on a new thread; its result lands in the list returned."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    return thread, result


def returns_without_time(clock: FakeClock, fn: Callable[[], object]) -> object:
    """``fn()`` returns without the clock moving: it waited for no timeout."""
    before = clock()
    thread, result = in_thread(fn)
    thread.join(60.0)  # a call waiting for a timeout of the fake clock would never return
    assert not thread.is_alive(), "waited for the clock"
    assert clock() == before
    return result[0]


class CallLog:
    """An exporter that remembers every call, its thread, and the records written; each write
    calls ``sleep(write_delay)`` (a test gives one that waits for it, or moves a fake clock)."""

    def __init__(self, write_delay: float = 0.0,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.calls: list[tuple[str, int]] = []
        self.threads: set[int] = set()
        self.steps: list[int] = []
        self.write_delay = write_delay
        self.sleep = sleep

    def write(self, records: Sequence[Record]) -> None:
        self.threads.add(threading.get_ident())
        if self.write_delay:
            self.sleep(self.write_delay)
        self.steps.extend(r.step for r in records)
        self.calls.append(("write", len(records)))

    def flush(self) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("flush", 0))

    def close(self) -> None:
        self.threads.add(threading.get_ident())
        self.calls.append(("close", 0))


# -- ordering and counts ----------------------------------------------------------------------

def test_everything_arrives_in_order_with_exact_counts(made):
    memory, log = MemoryExporter(), CallLog()
    d = Dispatcher([memory, log], convert=convert, queue_size=100_000)
    made.append(d)
    n = 20_000
    assert all(d.put(i) for i in range(n))
    assert d.flush(timeout=10.0)
    assert [r.step for r in memory.records] == list(range(n))
    assert log.steps == list(range(n))
    s = d.status()
    assert (s["received"], s["dropped"], s["queued"], s["records"]) == (n, 0, 0, n)
    assert s["exported"] == {"memory": n, "CallLog": n}
    assert s["errors"] == {"memory": 0, "CallLog": 0}
    assert s["exporter_dropped"] == {"memory": 0, "CallLog": 0}
    assert s["pending"] == {"memory": 0, "CallLog": 0}
    assert s["stalled"] == [] and s["first_nonfinite"] is None and s["closed"] is False


def test_concurrent_producers_lose_nothing_and_keep_each_threads_order(made):
    memory = MemoryExporter()

    def convert_pairs(items):
        return [make_record(k, name=f"t{t}") for t, k in items]

    d = Dispatcher([memory], convert=convert_pairs, queue_size=100_000)
    made.append(d)
    per_thread, threads = 5_000, 4
    accepted = []

    def produce(t):
        accepted.append(sum(d.put((t, k)) for k in range(per_thread)))

    workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert accepted == [per_thread] * threads
    assert d.flush(timeout=10.0)
    assert len(memory.records) == per_thread * threads
    for t in range(threads):
        assert [r.step for r in memory.records if r.name == f"t{t}"] == list(range(per_thread))


def test_put_records_pass_through_between_converted_items(made):
    memory = MemoryExporter()
    d = Dispatcher([memory], convert=convert)
    made.append(d)
    d.put(0)
    d.put_records([make_record(100, name="built"), make_record(101, name="built")])
    d.put(1)
    assert d.flush(timeout=5.0)
    assert [(r.name, r.step) for r in memory.records] == [
        ("x", 0), ("built", 100), ("built", 101), ("x", 1)]
    with pytest.raises(TypeError, match="Record objects, got int"):
        d.put_records([make_record(1), 5])  # type: ignore[list-item]


def test_exporter_labels_are_unique():
    d = Dispatcher([MemoryExporter(), MemoryExporter(), CallLog()], convert=convert)
    try:
        assert list(d.status()["exported"]) == ["memory", "memory#2", "CallLog"]
    finally:
        d.close()


# -- overload -----------------------------------------------------------------------------------

def test_drop_mode_counts_exactly_what_does_not_fit(made):
    gate, inside = threading.Event(), threading.Event()

    def gated(items):
        inside.set()
        gate.wait(10.0)
        return convert(items)

    memory = MemoryExporter()
    d = Dispatcher([memory], convert=gated, queue_size=100, flush_interval=0.01)
    made.append(d)
    assert d.put(-1)
    assert inside.wait(5.0)  # the dispatcher holds item -1 inside convert; the queue is empty
    results = [d.put(i) for i in range(1000)]
    # The record being converted counts toward queue_size: 99 more fit.
    assert results == [True] * 99 + [False] * 901
    s = d.status()
    assert (s["received"], s["dropped"], s["queued"]) == (1001, 901, 99)
    gate.set()
    assert d.flush(timeout=5.0)
    assert [r.step for r in memory.records] == [-1, *range(99)]
    assert d.status()["exported"] == {"memory": 100}


def test_drop_mode_byte_bound_and_oversized_item(made):
    gate, inside = threading.Event(), threading.Event()

    def gated(items):
        inside.set()
        gate.wait(10.0)
        return convert(items)

    memory = MemoryExporter()
    d = Dispatcher([memory], convert=gated, queue_size=1000, max_bytes=55, flush_interval=0.01)
    made.append(d)
    d.put(-1)
    assert inside.wait(5.0)
    # 10-byte items: five fit in 55 bytes, the sixth would make 60.
    assert [d.put(i, nbytes=10) for i in range(8)] == [True] * 5 + [False] * 3
    gate.set()
    assert d.flush(timeout=5.0)
    # An item larger than max_bytes still goes through an empty queue, or it could never pass.
    assert d.put(99, nbytes=10_000)
    assert d.flush(timeout=5.0)
    assert [r.step for r in memory.records] == [-1, 0, 1, 2, 3, 4, 99]
    assert d.status()["dropped"] == 3


def test_drop_mode_bounds_the_queue_and_a_slow_backlog_together(made, release):
    # Items of `step` records, as sowtel.jit steps. What waits for the hung exporter (queued,
    # being converted, in its backlog) stays within queue_size plus one step and one batch,
    # and the healthy exporter still gets every record the queue took.
    step, queue_size = 10, 100
    permits, entered = threading.Semaphore(0), threading.Semaphore(0)

    def gated(items):  # one permit per convert call: the test decides when batches move on
        entered.release()
        assert permits.acquire(timeout=30.0)
        return [make_record(k) for k in items for _ in range(step)]

    hung, memory = Hung(release), MemoryExporter()
    d = Dispatcher([hung, memory], convert=gated, queue_size=queue_size, flush_interval=0.01,
                   exporter_timeout=60.0)
    made.append(d)
    accepted = 0

    def fill() -> None:
        nonlocal accepted
        while d.put(accepted, records=step):
            accepted += step

    def waiting() -> int:
        s = d.status()
        return s["queued_records"] + s["backlog"]["Hung"]

    def healthy_drained() -> None:
        # A batch moves on only once the healthy exporter wrote the last one: its own backlog
        # (bounded by queue_size too) never overflows, however slowly a loaded machine runs
        # its thread.
        deadline = time.monotonic() + 60.0
        while d.status()["backlog"]["memory"] and time.monotonic() < deadline:
            time.sleep(0.002)

    assert d.put(-1, records=step)
    accepted += step
    assert entered.acquire(timeout=30.0)
    most = 0
    for _ in range(4):
        fill()  # the queue is full while the dispatcher holds a batch in convert
        most = max(most, waiting())
        healthy_drained()
        permits.release()  # that batch reaches the backlogs; the next is taken whole
        assert entered.acquire(timeout=30.0)
        most = max(most, waiting())
    assert hung.entered.wait(timeout=30.0)  # its thread may start late on a loaded machine
    batch = min(queue_size, BATCH_RECORDS) + step
    assert most <= queue_size + step + batch, most
    deadline = time.monotonic() + 60.0
    while len(memory.records) < accepted and time.monotonic() < deadline:
        healthy_drained()
        permits.release()
        entered.acquire(timeout=0.05)
    permits.release(1000)
    assert len(memory.records) == accepted  # nothing lost for the healthy exporter
    s = d.status()
    assert s["drop_reasons"]["memory"] == {"queue_full": s["dropped"]}
    assert s["drop_reasons"]["Hung"]["backlog_full"] > 0  # dropped, and counted
    a = s["accounts"]["Hung"]
    assert a["received"] == a["exported"] + a["dropped"] + a["failed"] + a["pending"]


def test_block_mode_loses_nothing_under_overload_and_stays_bounded(made, clock):
    # The slow exporter's writes wait until the test lets them end: while they cannot, the
    # producers must be held back (nothing may be dropped), whatever the machine's speed.
    may_write = threading.Event()
    memory, slow = MemoryExporter(), CallLog(write_delay=1.0, sleep=lambda _: may_write.wait(60))

    def slow_convert(items):
        return [make_record(k, name=f"t{t}") for t, k in items]

    queue_size = 16
    d = Dispatcher([memory, slow], convert=slow_convert, queue_size=queue_size,
                   on_full="block", flush_interval=0.01, clock=clock, wait=clock.wait)
    made.append(d)
    most_queued, most_pending, done = [0], [0], threading.Event()

    def watch():
        while not done.is_set():
            s = d.status()
            most_queued[0] = max(most_queued[0], s["queued"])
            most_pending[0] = max(most_pending[0], *s["backlog"].values())
            time.sleep(0.0005)

    per_thread, threads = 1_000, 4
    total = per_thread * threads
    accepted = []
    watcher = threading.Thread(target=watch)
    watcher.start()
    producers = [threading.Thread(target=lambda t=t: accepted.append(
        sum(d.put((t, k)) for k in range(per_thread)))) for t in range(threads)]
    for p in producers:
        p.start()
    # Back-pressure: with the slow exporter's write held, every producer comes to wait for room
    # inside put(), and only what the bounds let through was taken.
    for p in producers:
        clock.until_waiting(p)
    held = d.status()
    assert held["received"] <= 4 * queue_size + 2 and held["dropped"] == 0
    assert all(p.is_alive() for p in producers) and accepted == []
    may_write.set()
    for p in producers:
        p.join(60.0)  # a safety bound only
    assert not any(p.is_alive() for p in producers)
    assert d.flush(timeout=30.0)
    done.set()
    watcher.join()
    assert accepted == [per_thread] * threads
    s = d.status()
    assert s["dropped"] == 0 and s["exporter_dropped"] == {"memory": 0, "CallLog": 0}
    assert s["exported"] == {"memory": total, "CallLog": total}
    for t in range(threads):
        assert [r.step for r in memory.records if r.name == f"t{t}"] == list(range(per_thread))
    # Memory stayed bounded: the queue never held more than queue_size items, and a backlog at
    # most its bound plus one batch (itself at most queue_size items).
    assert most_queued[0] <= queue_size
    assert most_pending[0] <= 2 * queue_size
    # Nothing above waited for a timeout: notifications alone moved every record.
    assert clock() == 0.0


def test_a_block_mode_put_reads_the_backlogs_as_they_are_not_a_stale_copy(made, clock):
    # The largest backlog is kept for put(), refreshed from two threads (the dispatcher's offer,
    # a worker's release). A stale, larger copy, as an unlocked refresh could leave it, must not
    # hold a producer back once the backlogs are empty: the waiting put reads them again.
    memory = MemoryExporter()
    d = Dispatcher([memory], convert=lambda items: [make_record(k) for k in items],
                   queue_size=4, on_full="block", clock=clock, wait=clock.wait)
    made.append(d)
    d._backlog = 4  # what a lost refresh leaves: nothing is pending for the exporter
    accepted = []
    producer = threading.Thread(target=lambda: accepted.append(d.put(7)))
    producer.start()
    producer.join(30.0)  # a safety bound only: the put has room and returns at once
    alive = producer.is_alive()
    if alive:
        d.close(timeout=5.0)  # frees the producer the stale copy held
        producer.join(30.0)
    assert not alive and accepted == [True]
    assert d.flush(timeout=30.0) and [r.step for r in memory.records] == [7]


# -- a failing exporter ------------------------------------------------------------------------

def test_raising_exporter_is_isolated_counted_and_logged_once(made, caplog):
    raising, memory = Raising(), MemoryExporter()
    d = Dispatcher([raising, memory], convert=convert, flush_interval=0.05)
    made.append(d)
    with caplog.at_level(logging.WARNING, logger="sowtel"):
        for batch in range(5):
            for i in range(100):
                d.put(batch * 100 + i)
            assert d.flush(timeout=5.0)
        d.close(timeout=5.0)
    assert [r.step for r in memory.records] == list(range(500))
    s = d.status()
    assert s["exported"] == {"Raising": 0, "memory": 500}
    # Every failed call is counted: each write, and the flushes and the close that raised too.
    assert raising.calls >= 5
    assert s["errors"]["Raising"] >= raising.calls + 5 + 1
    assert s["errors"]["memory"] == 0
    about = [r for r in caplog.records if "Raising" in r.getMessage()]
    assert len(about) == 1
    assert "disk on fire" in caplog.text


def test_convert_failure_loses_only_its_batch_and_is_logged_once(made, caplog):
    def fragile(items):
        if 13 in items:
            raise ValueError("unlucky")
        if 14 in items:
            return ["not a record"]
        return convert(items)

    memory = MemoryExporter()
    d = Dispatcher([memory], convert=fragile)
    made.append(d)
    with caplog.at_level(logging.WARNING, logger="sowtel"):
        for group in ([1, 2], [13], [14], [20, 21]):
            for i in group:
                d.put(i)
            assert d.flush(timeout=5.0)
    assert [r.step for r in memory.records] == [1, 2, 20, 21]
    s = d.status()
    assert (s["convert_errors"], s["unconverted"]) == (2, 2)
    assert len([r for r in caplog.records if "convert" in r.getMessage()]) == 1


# -- a hung exporter ---------------------------------------------------------------------------

def test_hung_exporter_in_drop_mode_never_blocks_training_nor_the_others(made, release, clock):
    hung, memory = Hung(release), MemoryExporter()
    d = Dispatcher([hung, memory], convert=convert, queue_size=500, exporter_timeout=4.0,
                   flush_interval=0.01, clock=clock, wait=clock.wait)
    made.append(d)
    n = 0
    for _chunk in range(10):
        for _ in range(400):
            assert d.put(n)
            n += 1
        # Lets the dispatcher drain the queue (the healthy exporter has everything so far), so
        # only the hung backlog overflows. The clock stands still, so no flush_interval drain
        # comes: the drain is asked for, then waited for (not timed: the machine may be loaded).
        d.convert_now()
        deadline = time.monotonic() + 60.0  # a safety bound only: fires on a hang
        while len(memory.records) < n and time.monotonic() < deadline:
            time.sleep(0.002)
        assert len(memory.records) == n
    assert hung.entered.wait(timeout=30.0)  # its thread may start late on a loaded machine
    # No put ever waited (for the hung exporter, or for anything), and no time passed: a put
    # that waited for the hung exporter would have waited for exporter_timeout of the clock.
    assert clock.waits[threading.current_thread().name] == 0 and clock() == 0.0
    # flush waits until the hung exporter counts as stalled (its write started at 0 s and
    # lasts past exporter_timeout, 4 s), then skips it, before its own 10 s are up.
    flushing, flushed = in_thread(lambda: d.flush(timeout=10.0))
    clock.until_waiting(flushing)
    clock.advance(3.9)
    clock.until_timed(flushing.name)  # it looked again at that time, and waits on
    assert flushing.is_alive()  # not stalled yet: still waiting
    clock.advance(0.2)
    flushing.join(60.0)
    assert not flushing.is_alive() and flushed == [True]
    assert [r.step for r in memory.records] == list(range(n))
    s = d.status()
    assert s["stalled"] == ["Hung"]
    assert s["exported"] == {"Hung": 0, "memory": n}
    # The hung exporter's backlog stayed bounded; everything beyond it was counted as dropped.
    assert s["pending"]["Hung"] <= 2 * 500
    assert s["pending"]["Hung"] + s["exporter_dropped"]["Hung"] == n
    # Already stalled: close does not wait (10 s) for it.
    returns_without_time(clock, lambda: d.close(timeout=10.0))


def test_hung_exporter_in_block_mode_applies_back_pressure_then_is_skipped(made, release, clock):
    hung, memory = Hung(release), MemoryExporter()
    d = Dispatcher([hung, memory], convert=convert, queue_size=20, on_full="block",
                   exporter_timeout=0.5, flush_interval=0.01, clock=clock, wait=clock.wait)
    made.append(d)
    producer, accepted = in_thread(lambda: all(d.put(i) for i in range(300)))
    assert hung.entered.wait(timeout=30.0)  # its write started at 0 s
    clock.until_waiting(producer)  # the hung backlog is full: the producer waits for room
    # The producer waits for the hung exporter until it is declared stalled (its write lasted
    # past exporter_timeout, 0.5 s), then goes on: not sooner, not forever.
    clock.advance(0.4)
    clock.until_timed(producer.name)  # it looked again at that time, and waits on
    assert producer.is_alive()
    clock.advance(0.2)
    producer.join(60.0)
    assert not producer.is_alive() and accepted == [True]
    assert returns_without_time(clock, lambda: d.flush(timeout=10.0))
    assert [r.step for r in memory.records] == list(range(300))
    s = d.status()
    assert s["stalled"] == ["Hung"] and s["dropped"] == 0
    # A close that waited for the hung exporter would take its 10 s.
    returns_without_time(clock, lambda: d.close(timeout=10.0))


def test_close_is_bounded_by_its_timeout_while_an_exporter_hangs(release, clock):
    hung = Hung(release)
    d = Dispatcher([hung], convert=convert, exporter_timeout=60.0, flush_interval=0.01,
                   clock=clock, wait=clock.wait)
    d.put(1)
    d.convert_now()  # the clock stands still: no flush_interval drain would come
    assert hung.entered.wait(30.0)
    closing, _ = in_thread(lambda: d.close(timeout=0.5))
    clock.until_waiting(closing)
    clock.advance(0.4)
    clock.until_timed(closing.name)  # it looked again at that time, and waits on
    assert closing.is_alive()  # its 0.5 s are not up
    clock.advance(0.2)
    closing.join(60.0)
    assert not closing.is_alive()  # they are: it returned, the exporter still hanging
    assert d.put(2) is False


# -- flush and close ---------------------------------------------------------------------------

def test_flush_delivers_everything_then_flushes_each_exporter_on_its_own_thread(made, clock):
    log = CallLog()
    d = Dispatcher([log], convert=convert, flush_interval=60.0,  # no periodic drain
                   clock=clock, wait=clock.wait)
    made.append(d)
    for i in range(10):
        d.put(i)
    assert log.steps == []  # nothing moves before the interval or a flush
    assert returns_without_time(clock, lambda: d.flush(timeout=5.0))
    assert log.steps == list(range(10))
    assert log.calls[-1] == ("flush", 0) and ("write", 10) in log.calls
    d.close()
    d.close()  # idempotent
    assert [c for c in log.calls if c[0] == "close"] == [("close", 0)]
    assert len(log.threads) == 1
    assert threading.get_ident() not in log.threads
    (ident,) = log.threads
    names = {t.ident: t.name for t in threading.enumerate()}
    assert names.get(ident, "sowtel-exporter-CallLog") == "sowtel-exporter-CallLog"
    assert d.put(11) is False
    s = d.status()
    assert s["closed"] and s["dropped"] == 1


def test_flush_returns_false_on_timeout_then_true(made, clock):
    write_may_end = threading.Event()
    slow = CallLog(write_delay=3.0, sleep=lambda _: write_may_end.wait(60.0))
    d = Dispatcher([slow], convert=convert, exporter_timeout=30.0, flush_interval=60.0,
                   clock=clock, wait=clock.wait)
    made.append(d)
    d.put(1)
    flushing, flushed = in_thread(lambda: d.flush(timeout=0.2))
    clock.until_waiting(flushing)
    clock.advance(0.1)
    clock.until_timed(flushing.name)  # it looked again at that time, and waits on
    assert flushing.is_alive()
    clock.advance(0.15)
    flushing.join(60.0)
    assert not flushing.is_alive() and flushed == [False]  # its 0.2 s were up, the write not
    assert slow.steps == []
    write_may_end.set()
    assert returns_without_time(clock, lambda: d.flush(timeout=10.0)) is True
    assert slow.steps == [1]


def until(condition: Callable[[], bool]) -> None:
    """Waits for ``condition`` to hold (a safety bound of 60 s fires only on a hang)."""
    deadline = time.monotonic() + 60.0
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert condition()


def test_periodic_flush_reaches_exporters_without_explicit_flush(made, clock):
    # Seconds exact in binary: the clock's sums are exact, so "due at 1 s" is exactly 1 s.
    log = CallLog()
    d = Dispatcher([log], convert=convert, flush_interval=0.5, clock=clock, wait=clock.wait)
    made.append(d)
    # A write leaves the exporter to be flushed one flush_interval after its last flush.
    d.put(7)
    d.convert_now()
    until(lambda: log.calls == [("write", 1)])
    clock.until_timed("sowtel-exporter-CallLog")  # written at 0 s; the flush is due at 0.5 s
    clock.until_timed("sowtel-dispatcher")  # it drained at 0 s; it looks again at 0.5 s
    clock.advance(0.375)
    clock.until_timed("sowtel-exporter-CallLog")
    assert log.calls == [("write", 1)]  # not yet
    clock.advance(0.125)
    until(lambda: len(log.calls) == 2)
    assert log.calls == [("write", 1), ("flush", 0)]
    # A slowly filling queue is drained one flush_interval after the dispatcher's last drain.
    clock.until_timed("sowtel-dispatcher")  # it looked at 0.5 s: the next look is at 1 s
    d.put(8)
    clock.advance(0.375)
    clock.until_timed("sowtel-dispatcher")
    assert log.steps == [7]  # not yet
    clock.advance(0.125)
    until(lambda: len(log.calls) == 4)
    assert log.steps == [7, 8]
    assert log.calls[2:] == [("write", 1), ("flush", 0)]  # the last flush was 0.5 s ago


def test_flush_from_inside_an_exporter_does_not_deadlock(made):
    results = []

    class Reentrant(CallLog):
        def write(self, records):
            results.append(dispatcher.flush(timeout=5.0))
            super().write(records)

    dispatcher = Dispatcher([Reentrant()], convert=convert)
    made.append(dispatcher)
    dispatcher.put(1)
    assert dispatcher.flush(timeout=5.0)
    assert results == [False]


def test_first_nonfinite_record_is_found_in_a_batch():
    # The rule sessions apply to every batch they convert or export (sowtel.to_records).
    finite = {"nan": 0.0, "posinf": 0.0, "neginf": 0.0}
    clean = RecordBatch([(make_record(0, "a", stats=finite), make_record(1, "b", stats=finite))])
    assert first_nonfinite(clean) is None
    assert first_nonfinite(RecordBatch([(
        make_record(2, "a", stats=finite),
        make_record(3, "b", "cotangent", stats={**finite, "posinf": 1.0}),
        make_record(4, "c", stats={**finite, "nan": 5.0}),
    )])) == (3, "b", "cotangent")


def test_full_values_without_stats_count_as_nonfinite():
    assert first_nonfinite(RecordBatch([(
        make_record(0, "w", value=np.ones(3, np.float32)),
        make_record(1, "w", value=np.arange(3)),
        make_record(2, "w", value=np.array([1.0, -np.inf])),
    )])) == (2, "w", "primal")


@pytest.mark.parametrize("kwargs, message", [
    ({"queue_size": 0}, "queue_size=0 must be a positive integer"),
    ({"queue_size": True}, "queue_size=True must be a positive integer"),
    ({"max_bytes": 1.5}, "max_bytes=1.5 must be a positive integer"),
    ({"on_full": "wait"}, "on_full='wait' is not a policy: use one of drop, block"),
    ({"flush_interval": 0}, "flush_interval=0 must be a positive, finite number of seconds"),
    ({"exporter_timeout": float("inf")}, "exporter_timeout=inf must be a positive, finite"),
])
def test_bad_settings_are_rejected_with_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Dispatcher([MemoryExporter()], convert=convert, **kwargs)


def test_bad_exporters_and_convert_are_rejected():
    with pytest.raises(TypeError, match="lacks the method"):
        Dispatcher([object()], convert=convert)
    with pytest.raises(TypeError, match="wrap a single one in a list"):
        Dispatcher(MemoryExporter(), convert=convert)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="convert=3 must be callable"):
        Dispatcher([MemoryExporter()], convert=3)  # type: ignore[arg-type]


# -- process exit --------------------------------------------------------------------------------

_CHILD = """
import json, signal, sys, time
from sowtel.dispatcher import BATCH_RECORDS, Dispatcher
from sowtel.exporters.jsonl import JsonlExporter
from sowtel.records import Record

logdir, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "chained":
    def previous(signum, frame):
        print("previous handler ran", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, previous)
if mode == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

def convert(items):
    return [Record(name="loss", mode="primal", tag="intermediates", step=i, index=None,
                   wall_time=0.0, summary="stats", shape=(), dtype="float32",
                   stats={"mean": float(i)}) for i in items]

# A long interval: without the exit hooks, most records would still be queued at exit.
d = Dispatcher([JsonlExporter(logdir=logdir)], convert=convert, flush_interval=60.0)
for i in range(n):
    d.put(i)
if mode == "exit":
    sys.exit(0)
print("ready", flush=True)
if mode == "ignored":
    # The handler flushes (nothing else would within 60 s) and leaves the dispatcher open.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if sum(d.status()["exported"].values()) == n:
            print("still alive after SIGTERM", flush=True)
            if d.put(n):
                print("still streaming", flush=True)
            d.close()
            sys.exit(0)
    sys.exit(5)
# Short sleeps: a signal that lands between the last check for pending signals and the start
# of a sleep is only handled when that sleep ends.
for _ in range(1200):
    time.sleep(0.05)
sys.exit(4)
"""


def _run_child(tmp_path: Path, n: int, mode: str, send_sigterm: bool) -> tuple[int, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path), str(n), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        if send_sigterm:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out + err


def _steps_in(tmp_path: Path) -> list[int]:
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_sigterm_flushes_every_record_then_terminates_as_sigterm(tmp_path):
    n = 5_000
    rc, output = _run_child(tmp_path, n, "default", send_sigterm=True)
    assert rc == -signal.SIGTERM, output
    assert _steps_in(tmp_path) == list(range(n))


def test_sigterm_chains_the_previous_handler(tmp_path):
    n = 2_000
    rc, output = _run_child(tmp_path, n, "chained", send_sigterm=True)
    assert rc == 3, output
    assert "previous handler ran" in output
    assert _steps_in(tmp_path) == list(range(n))


def test_sigterm_that_was_ignored_stays_ignored_after_flushing_and_keeps_streaming(tmp_path):
    n = 1_000
    rc, output = _run_child(tmp_path, n, "ignored", send_sigterm=True)
    assert rc == 0, output
    assert "still alive after SIGTERM" in output and "still streaming" in output
    assert _steps_in(tmp_path) == list(range(n + 1))


def test_interpreter_exit_flushes_every_record(tmp_path):
    n = 5_000
    rc, output = _run_child(tmp_path, n, "exit", send_sigterm=False)
    assert rc == 0, output
    assert _steps_in(tmp_path) == list(range(n))


def test_benchmark_script_runs_and_prints_its_table():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dispatcher.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["measure", "value"]
    for row in ("put(), 1 thread", "receiver (count, copy, put)", "put -> convert -> jsonl"):
        assert any(line.startswith(row) for line in lines), row


def test_periodic_flush_happens_under_a_steady_stream(made, clock):
    # Every write takes 0.08 s of the clock, longer than flush_interval, and the backlog holds
    # every record before the first write ends: it never runs empty between writes, yet the
    # exporter is flushed on schedule, after every write.
    may_write = threading.Event()

    def slow(seconds: float) -> None:
        assert may_write.wait(60.0)
        clock.advance(seconds)

    log = CallLog(write_delay=0.08, sleep=slow)
    d = Dispatcher([log], convert=convert, flush_interval=0.05, queue_size=100_000,
                   clock=clock, wait=clock.wait)
    made.append(d)
    n = 1000
    assert all(d.put(i) for i in range(n))
    d.convert_now()
    until(lambda: d.status()["backlog"]["CallLog"] == n)  # the first write is held
    may_write.set()
    until(lambda: len(log.steps) == n and len(log.calls) % 2 == 0)
    writes = [k for k, _ in log.calls].count("write")
    assert writes >= 3
    assert [k for k, _ in log.calls] == ["write", "flush"] * writes
    assert log.steps == list(range(n))
