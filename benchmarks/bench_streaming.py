"""What streaming costs a training step, and what one record costs the host.

Four measurements, all as ratios of variants timed side by side in this one process:

1. **Training steps** of the two reference workloads (:mod:`benchmarks.workloads`), in these
   variants: no sows; sows, nothing enabled; streaming ``stats`` every step (memory exporter);
   ``every=10`` under ``sowtel.at_step``; streaming ``full`` values; the same ``stats`` through
   the fallback callback (``SOWTEL_CALLBACK=debug``); the naive way (``jax.debug.callback`` of
   every full array, forward and backward); the values returned as extra outputs; and sowtel's
   on-device stats of those values returned as outputs (the device half of streaming stats,
   without the callbacks).
2. **Compiled programs**: with nothing enabled, the program with sows is the program without
   them (compiled HLO compared after removing names, metadata and source-location tables).
3. **Host cost per record**: ``Session.receive`` called directly on the arrays a ``stats`` site
   sends; and a jitted program of N sows and no other work, streaming against disabled.
4. **Full-value transfer**: a 64 MiB value streamed with ``summary="full"`` against a
   fresh-allocation numpy copy of the same bytes.

Every variant is compiled ahead of time (``jax.jit(f).lower(...).compile()``) while its own
session is the active one, so all variants run in one process with their sessions open side
by side; before each step a variant makes its session the active one (records go to the active
session), so each records to its own memory exporter. Between rounds each variant's session is
flushed; the flush is timed apart (column "+ drain": the step including the dispatcher work it
left behind, shared over the round's steps).

Run: ``python -m benchmarks.bench_streaming [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_streaming
    >>> tables = bench_streaming.run(quick=True)  # doctest: +SKIP
    >>> print(tables[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sowtel
from benchmarks import (
    Table,
    Timing,
    add_common_arguments,
    fmt_ratio,
    fmt_time,
    interleave,
    machine,
    normalized_hlo,
    write_markdown,
)
from benchmarks.workloads import (
    Trainer,
    Workload,
    activate_session,
    debug_tap,
    make_returning_train_step,
    make_train_step,
    mlp,
    no_tap,
    transformer_block,
)
from sowtel.exporters.memory import MemoryExporter

__all__ = ["run", "main", "tables", "training_tables", "receive_cost", "sow_program_cost",
           "full_transfer"]

#: DESIGN §8 targets, as ratios to the uninstrumented step.
STATS_TARGET = {"mlp": 1.25, "transformer": 1.05}
EVERY_TARGET = 1.02
RECORD_TARGET_S = 3e-6
FULL_TARGET = 0.8


@contextmanager
def callback_path(path: str) -> Iterator[None]:
    """Sets ``SOWTEL_CALLBACK`` (read when a program is lowered) for the block."""
    old = os.environ.get("SOWTEL_CALLBACK")
    os.environ["SOWTEL_CALLBACK"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["SOWTEL_CALLBACK"]
        else:
            os.environ["SOWTEL_CALLBACK"] = old


def compiled_text(compiled: Any) -> str:
    """The normalized HLO of a compiled program."""
    return normalized_hlo(compiled.as_text())


class HostStepTrainer(Trainer):
    """A jitted step called under a host-side ``sowtel.at_step(k)``: steps that log nothing run
    the program compiled without sows, the logging ones the instrumented program."""

    def __call__(self) -> None:
        self.activate()
        step = self.step_numbers[self.calls % len(self.step_numbers)]
        with sowtel.at_step(int(step)):
            out = jax.block_until_ready(
                self.compiled(self.params, self.opt_state, self.batch, step))
        self.params, self.opt_state = out[0], out[1]
        self.calls += 1


@dataclasses.dataclass
class Variant:
    """A way of running a workload: its step, what drains it, and what it should stream."""

    name: str
    trainer: Trainer
    drain: Callable[[], Any]
    records_per_step: float  # what a correct run streams on a logging step (0: nothing)
    count_records: Callable[[], int]  # what it did stream so far
    every: int = 1
    target: float | None = None
    compile_s: float = float("nan")  # seconds to lower and compile the step
    baseline: str = "no sows"  # the variant its ratio is taken to

    def expected_records(self) -> float:
        """What a correct run streamed in all the steps run so far."""
        numbers = self.trainer.step_numbers
        logging = sum(1 for i in range(self.trainer.calls)
                      if int(numbers[i % len(numbers)]) % self.every == 0)
        return self.records_per_step * logging


def _received(session: sowtel.Session) -> int:
    return int(session.status()["received"])


def _memory_session(stack: ExitStack, *, keep: int = 256, **options: Any) -> sowtel.Session:
    # The exporter keeps only the newest `keep` records: memory stays flat however long it runs.
    # Entered as a context, as sessions stacked on purpose are.
    return stack.enter_context(sowtel.enable(exporter=MemoryExporter(max_records=keep), **options))


def workload_variants(
    work: Workload, stack: ExitStack
) -> tuple[dict[str, Variant], dict[str, str]]:
    """Compiles every variant of ``work``; returns them and the normalized HLO texts compared.

    Sessions opened here are closed by ``stack``.
    """
    state = work.init()
    args = (*state, jnp.int32(0))
    steps = [jnp.int32(i) for i in range(1000)]
    sites = len(work.sites)
    per_step = 2.0 * sites  # primal and cotangent of every site

    compile_s: dict[int, float] = {}

    def compile_step(step_fn: Callable[..., Any]) -> Any:
        t0 = time.perf_counter()
        compiled = jax.jit(step_fn).lower(*args).compile()
        compile_s[id(compiled)] = time.perf_counter() - t0
        return compiled

    def jax_drain() -> None:
        jax.effects_barrier()

    variants: dict[str, Variant] = {}
    texts: dict[str, str] = {}

    def add(name: str, compiled: Any, *, session: sowtel.Session | None = None,
            records: float = 0.0, target: float | None = None,
            count: Callable[[], int] | None = None, every: int = 1,
            baseline: str = "no sows") -> None:
        drain: Callable[[], Any] = jax_drain
        counted: Callable[[], int] = count or (lambda: 0)
        if session is not None:
            drain = session.flush
            counted = functools.partial(_received, session)
        variants[name] = Variant(
            name=name, trainer=Trainer(compiled, work, steps, session=session), drain=drain,
            records_per_step=records, count_records=counted, every=every, target=target,
            compile_s=compile_s.get(id(compiled), float("nan")), baseline=baseline,
        )

    none = compile_step(make_train_step(work, no_tap))
    texts["none"] = compiled_text(none)
    add("no sows", none)

    sown = make_train_step(work, sowtel.sow, at_step=True)
    disabled = compile_step(sown)
    texts["disabled"] = compiled_text(disabled)
    add("sows, disabled", disabled)

    session = _memory_session(stack)
    add("stats every step", compile_step(sown), session=session, records=per_step,
        target=STATS_TARGET.get(work.name))
    texts["stats"] = compiled_text(variants["stats every step"].trainer.compiled)

    session = _memory_session(stack, every=10)
    add("stats, every=10", compile_step(sown), session=session, records=per_step, every=10,
        target=EVERY_TARGET)

    session = _memory_session(stack, keep=sites, summary="full", max_bytes=1 << 31)
    add("full values every step", compile_step(sown), session=session, records=per_step)

    session = _memory_session(stack)
    with callback_path("debug"):
        add("stats, SOWTEL_CALLBACK=debug", compile_step(sown), session=session,
            records=per_step)
    texts["disabled, after sessions"] = "(pending)"

    logged = [0]

    def sink(name: str, mode: str, value: np.ndarray) -> None:
        np.array(value, copy=True)  # what a naive logger does: keep a host copy
        logged[0] += 1

    add("naive jax.debug.callback (full)", compile_step(make_train_step(work, debug_tap(sink))),
        records=per_step, count=lambda: logged[0])

    returning = make_returning_train_step(work)
    add("returned as outputs", compile_step(returning))
    add("device stats only, returned (no callback)", compile_step(_summarized(returning)))

    # Opened last, so its session is the active one while the rounds run: the host-side
    # at_step picks between two programs through jit's cache.
    session = _memory_session(stack, every=10)
    host = jax.jit(make_train_step(work, sowtel.sow))
    variants[HOST_EVERY] = Variant(
        name=HOST_EVERY, trainer=HostStepTrainer(host, work, steps, session=session),
        drain=session.flush,
        records_per_step=per_step, count_records=functools.partial(_received, session),
        every=10, target=EVERY_TARGET,
    )
    return variants, texts


HOST_EVERY = "stats, every=10, host-side at_step"


def _summarized(train_step: Callable[..., Any]) -> Callable[..., Any]:
    """A returning train step that returns sowtel's device stats of every value instead of the
    value: the on-device part of streaming stats, without any callback."""
    from sowtel.summaries import device_summary

    def summarized(*args: Any) -> Any:
        params, opt_state, loss, inter = train_step(*args)
        stats = jax.tree_util.tree_map(lambda v: device_summary(v, "stats"), inter)
        return params, opt_state, loss, stats

    return summarized


def _rounds(work: Workload, quick: bool) -> tuple[int, dict[str, int]]:
    if work.name == "mlp":
        return (2 if quick else 10), {"*": 10}
    # A transformer step is ~20x an MLP step: fewer steps per round, but every=10 (and the
    # baseline around it) always sees a whole stride of 10 steps.
    return (2 if quick else 6), {"*": 2, "stats, every=10": 10, HOST_EVERY: 10}


def training_tables(quick: bool = False) -> Iterator[Table]:
    """Training-step overhead for both reference workloads (a table each, as each finishes),
    then the compiled-program identity table."""
    identity = Table(
        "Nothing enabled: the compiled program with sows is the program without them",
        ["workload", "no sows vs sows disabled", "disabled, after enable()/disable()",
         "sanity: streaming program differs"],
        notes=["Compared: `jax.jit(step).lower(*args).compile().as_text()` with the module "
               "name, `metadata={...}` attributes and the FileNames/FunctionNames/"
               "FileLocations/StackFrames tables removed."],
    )
    # --quick is a smoke run of every code path: the transformer block exercises the same ones
    # as the MLP, at four times its compile time.
    for work in (mlp(batch=64, width=128),) if quick else (mlp(), transformer_block()):
        with ExitStack() as stack:
            variants, texts = workload_variants(work, stack)
            rounds, steps = _rounds(work, quick)
            timings = interleave(
                {n: v.trainer for n, v in variants.items()}, rounds=rounds, steps=steps,
                warmup=2, drains={n: v.drain for n, v in variants.items()}, baseline="no sows",
            )
            for v in variants.values():
                v.drain()
            same = texts["none"] == texts["disabled"]
            yield _overhead_table(work, variants, timings, rounds, {
                "sows, disabled": f"identical program {'met' if same else 'MISSED'}",
            })
        # Every session is closed now: the same function lowers to the disabled program again.
        args = (*work.init(), jnp.int32(0))
        again = jax.jit(make_train_step(work, sowtel.sow, at_step=True)).lower(*args).compile()
        texts["disabled, after sessions"] = compiled_text(again)
        identity.add(
            work.name,
            _same(texts["none"], texts["disabled"]),
            _same(texts["none"], texts["disabled, after sessions"]),
            "yes" if texts["stats"] != texts["none"] else "NO (the check is blind)",
        )
    yield identity


def _same(a: str, b: str) -> str:
    if a == b:
        return f"identical ({len(a.splitlines())} lines)"
    diff = sum(1 for x, y in zip(a.splitlines(), b.splitlines(), strict=False) if x != y)
    return f"DIFFERENT ({diff} lines differ)"


def _overhead_table(work: Workload, variants: dict[str, Variant], timings: dict[str, Timing],
                    rounds: int, targets: dict[str, str]) -> Table:
    table = Table(
        f"Training step: {work.description}",
        ["variant", "step", "ratio [quartiles]", "+ drain", "records/step", "compile",
         "target"],
    )
    for name, v in variants.items():
        t = timings[name]
        own_base = timings[v.baseline]
        ratio = t.ratio_to(own_base)
        drained = t.ratio_to(own_base, with_drain=True)
        calls = v.trainer.calls
        records, expected = v.count_records(), v.expected_records()
        rec_text = f"{records / calls:.1f}" + ("" if records == expected
                                               else f" (expected {expected / calls:.1f})")
        if v.target is None:
            target = targets.get(name, "")
        else:
            # The target is met by the drained ratio: dispatcher work counts too.
            met = max(ratio, drained) <= v.target
            target = f"≤ {v.target:.2f}× {'met' if met else 'MISSED'}"
        table.add(name, fmt_time(t.per_step()), fmt_ratio(ratio, t.ratio_spread(own_base)),
                  fmt_ratio(drained), rec_text, fmt_time(v.compile_s), target)
    per_round = {n: t.steps // rounds for n, t in timings.items() if n != "no sows"}
    usual = statistics.mode(per_round.values())
    longer = {n: k for n, k in per_round.items() if k != usual}
    table.notes.append(
        f"{rounds} rounds; in each, every variant runs {usual} steps"
        + "".join(f" ({n!r}: {k})" for n, k in longer.items())
        + ", bracketed by as many steps of 'no sows' before and after; a ratio is the median "
        "over rounds of the variant's mean step over the mean of the 'no sows' steps around "
        "it (quartiles in brackets). + drain: with the flush after each block of steps. "
        "records/step: records streamed over all steps run (warm-up included). compile: "
        "`jax.jit(step).lower(...).compile()`. 'sows, disabled' runs the very program of "
        "'no sows', so its spread is the noise of this measurement."
    )
    return table


# ---------------------------------------------------------------------------------------------
# Host cost per record.


def captured_callback(session: sowtel.Session, shape: tuple[int, ...] = (256, 512)
                      ) -> tuple[Any, tuple[np.ndarray, ...]]:
    """The ``(site, arrays)`` one real host callback hands to ``session.receive``: a stats site
    of a ``shape`` float32 value inside ``at_step``, caught by running it once."""
    caught: list[tuple[Any, tuple[np.ndarray, ...]]] = []

    def catch(site: Any, arrays: tuple[np.ndarray, ...]) -> None:
        caught.append((site, arrays))

    def program(x: jax.Array, step: jax.Array) -> jax.Array:
        with sowtel.at_step(step):
            return sowtel.sow(x, "dense0/act")

    x = jnp.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=jnp.float32).reshape(shape)
    session.receive = catch  # type: ignore[method-assign]
    try:
        jax.block_until_ready(jax.jit(program)(x, jnp.int32(7)))
        jax.effects_barrier()
    finally:
        del session.receive
    if len(caught) != 1:
        raise RuntimeError(f"expected one callback from one sow, got {len(caught)}")
    return caught[0]


def receive_cost(quick: bool = False) -> Table:
    """``Session.receive`` timed directly, with the dispatcher idle and with it converting
    records at the same time, and the whole host pipeline through ``flush``."""
    # The dispatcher wakes when 512 records wait (or every 0.5 s): batches of 400 receives
    # run with it asleep; batches of 20,000 run while it builds and exports records.
    small, large = 400, (5_000 if quick else 20_000)
    rounds = 3 if quick else 7
    idle, busy, pipeline = [], [], []
    with sowtel.enable(exporter=MemoryExporter(max_records=1000),
                       queue_size=large + 1) as session:
        site, arrays = captured_callback(session)
        receive = session.receive
        for _ in range(2):
            receive(site, arrays)
        session.flush()
        for _ in range(rounds):
            for _ in range(10):
                t0 = time.perf_counter()
                for _ in range(small):
                    receive(site, arrays)
                idle.append((time.perf_counter() - t0) / small)
                session.flush()
            t0 = time.perf_counter()
            for _ in range(large):
                receive(site, arrays)
            t1 = time.perf_counter()
            session.flush()
            t2 = time.perf_counter()
            busy.append((t1 - t0) / large)
            pipeline.append((t2 - t0) / large)
        dropped = session.status()["dropped"]
    table = Table(
        "Host cost per record: the receiver (stats summary)",
        ["measure", "per record", "target"],
        notes=["`Session.receive` called directly with the site and arrays one real callback "
               "of a stats site of a (256, 512) float32 value under `at_step` handed over "
               f"(6 floats, 4 counts, the step); medians over rounds; {dropped} dropped.",
               f"dispatcher idle: batches of {small} (it wakes at 512); converting: batches of "
               f"{large:,}, while the dispatcher thread builds records and competes for the "
               "GIL; pipeline: from the first receive until `flush()` returns."],
    )
    rec = statistics.median(idle)
    table.add("`Session.receive`, dispatcher idle", fmt_time(rec), _target_us(rec))
    table.add("`Session.receive`, dispatcher converting", fmt_time(statistics.median(busy)), "")
    table.add("receive + build records + memory exporter (until flush)",
              fmt_time(statistics.median(pipeline)), "")
    return table


def _target_us(seconds: float) -> str:
    return f"≤ 3 µs {'met' if seconds <= RECORD_TARGET_S else 'MISSED'}"


def _sow_program(n: int) -> Callable[[jax.Array], jax.Array]:
    def program(x: jax.Array) -> jax.Array:
        return jnp.stack([sowtel.sow(x[i], f"site{i}") for i in range(n)])

    return program


def _summary_program(n: int) -> Callable[[jax.Array], Any]:
    # The on-device part of a stats site alone: sowtel's own summary, returned, no callback.
    from sowtel.summaries import device_summary

    def program(x: jax.Array) -> Any:
        return x, [device_summary(x[i], "stats") for i in range(n)]

    return program


def sow_program_cost(quick: bool = False, *, many: int = 16, width: int = 256) -> Table:
    """A jitted program of N sows and no other work: streaming (both callback paths) against
    disabled, for N = 1 and N = ``many``; the per-record cost, the fixed cost per run, and
    where the per-record cost goes (the on-device summary, the callback)."""
    xs = {n: jnp.ones((n, width), jnp.float32) for n in (1, many)}
    variants: dict[str, Callable[[], Any]] = {}
    drains: dict[str, Callable[[], Any]] = {}
    sessions: dict[str, sowtel.Session] = {}

    def runner(compiled: Any, x: jax.Array,
               session: sowtel.Session | None = None) -> Callable[[], Any]:
        if session is None:
            return lambda: jax.block_until_ready(compiled(x))

        def run() -> Any:
            activate_session(session)  # its records go to its own session
            return jax.block_until_ready(compiled(x))

        return run

    def lower(program: Callable[..., Any], x: jax.Array) -> Any:
        return jax.jit(program).lower(x).compile()

    x_many = xs[many]
    with ExitStack() as stack:
        for n, x in xs.items():
            variants[f"disabled/{n}"] = runner(lower(_sow_program(n), x), x)
        variants["summary only"] = runner(lower(_summary_program(many), x_many), x_many)
        for path, summary in (("fast", "stats"), ("debug", "stats"), ("shape", "shape")):
            session = _memory_session(stack, queue_size=100_000, summary=summary)
            with callback_path("debug" if path == "debug" else "fast"):
                for n, x in xs.items():
                    if path == "shape" and n != many:
                        continue
                    key = f"{path}/{n}"
                    variants[key] = runner(lower(_sow_program(n), x), x, session)
                    drains[key] = session.flush
                    sessions[key] = session
        rounds = 3 if quick else 9
        timings = interleave(variants, rounds=rounds, steps={"*": 40, f"debug/{many}": 10},
                             warmup=3, drains=drains)
        received = {p: sessions[f"{p}/{many}"].status()["received"]
                    for p in ("fast", "debug", "shape")}
    t = {k: v.per_step() for k, v in timings.items()}
    d1, dn = t["disabled/1"], t[f"disabled/{many}"]
    table = Table(
        f"Host cost per record: a jitted program of N sows of ({width},) float32, no other work",
        ["what", f"per record (N = {many})", "per record, marginal", "fixed per run",
         "+ dispatcher, per record", "target"],
        notes=[f"per record = (time streaming - time disabled) / N at N = {many}; marginal = "
               f"its growth from N = 1 to N = {many}, per added sow; fixed = what remains at "
               f"N = 1 (the program loses JAX's C++ dispatch path). {rounds} interleaved rounds.",
               "+ dispatcher: the same with each round's flush (records built and exported) "
               "shared over its records.",
               "device summary only: sowtel's on-device stats of each row returned as outputs, "
               "no callback; shape summary: a callback that carries no data.",
               f"records received: default path {received['fast']:,}, fallback "
               f"{received['debug']:,}, shape {received['shape']:,}."],
    )
    for path in ("fast", "debug"):
        s1, sn = t[f"{path}/1"], t[f"{path}/{many}"]
        sn_drained = timings[f"{path}/{many}"].per_step(with_drain=True)
        per_record = (sn - dn) / many
        marginal = ((sn - dn) - (s1 - d1)) / (many - 1)
        fixed = (s1 - d1) - marginal
        label = ("stats, emit_python_callback (default)" if path == "fast"
                 else "stats, jax.debug.callback (SOWTEL_CALLBACK=debug)")
        table.add(label, fmt_time(per_record), fmt_time(marginal), fmt_time(fixed),
                  fmt_time((sn_drained - dn) / many),
                  _target_us(marginal) + " (marginal)" if path == "fast" else "")
    table.add("of which: device stats summary only", fmt_time((t["summary only"] - dn) / many),
              "", "", "", "")
    shape_drained = timings[f"shape/{many}"].per_step(with_drain=True)
    table.add("of which: callback without data (summary=\"shape\")",
              fmt_time((t[f"shape/{many}"] - dn) / many), "", "",
              fmt_time((shape_drained - dn) / many), "")
    return table


def _run_blocking(compiled: Any, *args: Any, session: sowtel.Session | None = None) -> Any:
    if session is not None:
        activate_session(session)
    return jax.block_until_ready(compiled(*args))


def full_transfer(quick: bool = False, *, mib: int = 64) -> Table:
    """Streaming a ``mib`` MiB value with ``summary="full"`` against a numpy copy of it."""
    n = mib * (1 << 20) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    x_host = np.asarray(x)

    def program(v: jax.Array) -> jax.Array:
        return sowtel.sow(v, "big", summary="full")[:1]

    variants: dict[str, Callable[[], Any]] = {}
    drains: dict[str, Callable[[], Any]] = {}
    with ExitStack() as stack:
        disabled = jax.jit(program).lower(x).compile()
        variants["disabled"] = lambda: jax.block_until_ready(disabled(x))
        sessions = {}
        for path in ("fast", "debug"):
            session = _memory_session(stack, keep=1)
            with callback_path(path):
                compiled = jax.jit(program).lower(x).compile()
            variants[path] = functools.partial(_run_blocking, compiled, x, session=session)
            drains[path] = session.flush
            sessions[path] = session
        variants["numpy copy"] = lambda: np.array(x_host, copy=True)
        rounds = 4 if quick else 8
        timings = interleave(variants, rounds=rounds, steps=2, warmup=1, drains=drains)
        first = sessions["fast"].exporters[0].records  # type: ignore[attr-defined]
        ok = bool(first) and np.array_equal(first[-1].value, x_host)
    copy = timings["numpy copy"].per_step()
    table = Table(
        f"Full-value transfer: a {mib} MiB float32 value, summary=\"full\"",
        ["variant", "per record", "throughput", "memcpy / this", "target"],
        notes=[f"per record = time streaming - time of the same program disabled; "
               f"{rounds} interleaved rounds of 2; the dispatcher's work (stats of the value, "
               "on its own thread) is flushed outside the timed steps.",
               f"the streamed value equals the input: {'yes' if ok else 'NO'}."],
    )
    gib = mib / 1024
    table.add("numpy copy (fresh allocation)", fmt_time(copy), f"{gib / copy:.2f} GiB/s", "1.000×",
              "")
    base = timings["disabled"].per_step()
    for path in ("fast", "debug"):
        per = timings[path].per_step() - base
        ratio = copy / per
        target = f"≥ {FULL_TARGET}× {'met' if ratio >= FULL_TARGET else 'MISSED'}"
        label = "sowtel, emit_python_callback" if path == "fast" else "sowtel, jax.debug.callback"
        table.add(label, fmt_time(per), f"{gib / per:.2f} GiB/s", f"{ratio:.3f}×",
                  target if path == "fast" else "")
    return table


# ---------------------------------------------------------------------------------------------


def tables(quick: bool = False) -> Iterator[Table]:
    """Runs every streaming benchmark, yielding each table as soon as it is measured."""
    yield from training_tables(quick)
    yield receive_cost(quick)
    yield sow_program_cost(quick)
    yield full_transfer(quick, mib=8 if quick else 64)


def run(quick: bool = False) -> list[Table]:
    """Runs every streaming benchmark; returns its tables."""
    return list(tables(quick))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_streaming [--quick] [--markdown FILE]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_streaming",
                                     description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    print(machine(), flush=True)
    done = []
    for table in tables(args.quick):
        print("\n" + table.text(), flush=True)
        done.append(table)
    if args.markdown:
        write_markdown(args.markdown, done, header=f"Machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
