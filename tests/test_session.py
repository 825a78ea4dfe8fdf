"""enable / disable / flush / status / at_step / export: the streaming switch and its inputs."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel.exporters import known_names
from sowtel.exporters.memory import MemoryExporter
from sowtel.summaries import host_summary

X = jnp.array([0.5, -1.5, 2.0, 0.0])


@jax.jit
def f(x):
    return sowtel.sow(x * 2.0, "y").sum()


def test_toggling_never_leaves_a_stale_program() -> None:
    f(X)  # compiled while disabled
    with sowtel.enable(exporter="memory") as first:
        f(X)
        sowtel.flush()
    assert len(first.exporters[0].records) == 1
    f(X)  # disabled again: no session, nothing streams (and nothing fails)
    assert sowtel.status()["enabled"] is False
    with sowtel.enable(exporter="memory") as second:
        f(X)
        f(X)
        sowtel.flush()
    assert [r.step for r in second.exporters[0].records] == [0, 1]
    assert len(first.exporters[0].records) == 1  # the closed session got nothing more


def test_enable_is_process_wide_across_threads() -> None:
    session = sowtel.enable(exporter="memory")
    try:
        worker = threading.Thread(target=lambda: f(X))
        worker.start()
        worker.join()
        sowtel.flush()
    finally:
        sowtel.disable()
    assert len(session.exporters[0].records) == 1


def test_a_second_thread_cannot_enable_beside_another_threads_session() -> None:
    # Sessions are process-wide: thread B enabling its own would take A's records and A's
    # disable() would close B's. B gets a clear error instead, and A's session is untouched.
    a_enabled, b_done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def thread_a() -> None:
        with sowtel.enable(exporter="memory") as session:
            a_enabled.set()
            assert b_done.wait(60)
            for _ in range(3):
                f(X)
            sowtel.flush()
            outcome["a"] = (len(session.exporters[0].records), sowtel.status()["enabled"])

    def thread_b() -> None:
        assert a_enabled.wait(60)
        try:
            with sowtel.enable(exporter="memory"):
                f(X)
        except RuntimeError as e:
            outcome["b"] = str(e)
        b_done.set()

    threads = [threading.Thread(target=thread_a, name="trainer-a"),
               threading.Thread(target=thread_b, name="trainer-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outcome["a"] == (3, True)
    message = outcome["b"]
    assert isinstance(message, str)
    assert "'trainer-b'" in message and "'trainer-a'" in message and "process-wide" in message
    assert not sowtel.status()["enabled"]
    with sowtel.enable(exporter="memory") as later:  # once A's is gone, any thread may enable
        f(X)
        sowtel.flush()
    assert len(later.exporters[0].records) == 1


def test_a_session_left_by_a_thread_that_ended_is_process_wide() -> None:
    made: list[sowtel.Session] = []
    worker = threading.Thread(target=lambda: made.append(sowtel.enable(exporter="memory")))
    worker.start()
    worker.join()
    try:
        with pytest.warns(RuntimeWarning, match="stacks on it"), \
                sowtel.enable(exporter="memory") as inner:  # as on one's own, not an error
            f(X)
            sowtel.flush()
        assert sowtel.status()["session"] == made[0].id
    finally:
        sowtel.disable()
    assert len(inner.exporters[0].records) == 1 and not made[0].exporters[0].records


@pytest.mark.parametrize("every", [1, 2])
def test_host_steps_are_per_asyncio_task(every: int) -> None:
    # Two coroutines in one thread, each awaiting inside its at_step block: each record of
    # the callback transport carries the step of the coroutine whose call sent it.
    import asyncio

    g = jax.jit(lambda x: sowtel.sow(x * 2.0, "h").sum())

    async def train(offset: int, value: float) -> None:
        for k in range(20):
            with sowtel.at_step(offset + k):
                await asyncio.sleep(0)  # the other coroutine runs here, inside its own block
                g(jnp.full(3, value)).block_until_ready()

    async def both() -> None:
        await asyncio.gather(train(0, 1.0), train(1000, -1.0))

    with sowtel.enable(exporter="memory", every=every) as session:
        g(X)  # compiled before the coroutines run
        asyncio.run(both())
        sowtel.flush()
    records = session.exporters[0].records[1:]
    assert sorted(r.step for r in records) == sorted(
        [*range(0, 20, every), *range(1000, 1020, every)])
    mislabelled = [(r.step, r.stats["mean"]) for r in records
                   if r.stats["mean"] != (2.0 if r.step < 1000 else -2.0)]
    assert not mislabelled


def test_nested_sessions_resume_the_outer_one() -> None:
    with sowtel.enable(exporter="memory") as outer:
        with sowtel.enable(exporter="memory", summary="health") as inner:
            f(X)
            sowtel.flush()
        f(X)
        sowtel.flush()
    assert [r.summary for r in inner.exporters[0].records] == ["health"]
    assert [r.summary for r in outer.exporters[0].records] == ["stats"]


def test_summaries_on_device_match_numpy() -> None:
    x = jnp.array([[1.0, -2.0, jnp.nan], [jnp.inf, 0.0, 4.0]])
    g = jax.jit(lambda v: sowtel.sow(v, "v") + sowtel.sow(v * 0, "z"))
    for summary in ("stats", "histogram", "health", "shape", "full"):
        with sowtel.enable(exporter="memory", summary=summary, include="v") as s:
            g(x)
            sowtel.flush()
        [r] = s.exporters[0].records
        assert r.summary == summary and r.shape == (2, 3) and r.dtype == "float32"
        host = host_summary(np.asarray(x), "stats" if summary == "full" else summary)
        for k, v in host["stats"].items():
            np.testing.assert_allclose(r.stats[k], v, rtol=1e-6, err_msg=f"{summary} {k}")
        if summary == "histogram":
            edges, counts = r.histogram
            assert len(edges) == len(counts) + 1 == 31
            np.testing.assert_allclose(edges, host["histogram"][0], rtol=1e-6)
            np.testing.assert_array_equal(counts, host["histogram"][1])
            assert counts.sum() == 4  # the finite elements only
        if summary == "full":
            np.testing.assert_array_equal(r.value, np.asarray(x))
        if summary == "shape":
            assert r.stats == {} and r.value is None


def test_integer_and_bool_values_get_stats() -> None:
    g = jax.jit(lambda v: (sowtel.sow(jnp.arange(5), "ints"), sowtel.sow(v > 0, "mask")))
    with sowtel.enable(exporter="memory") as s:
        g(X)
        sowtel.flush()
    ints, mask = sorted(s.exporters[0].records, key=lambda r: r.name)
    assert ints.stats["mean"] == 2.0 and ints.stats["zeros"] == 1 and ints.stats["max"] == 4
    assert mask.stats["mean"] == 0.5 and mask.dtype == "bool"


def test_first_nonfinite_is_kept_as_an_alert() -> None:
    g = jax.jit(lambda v: sowtel.sow(jnp.log(v), "log"))
    with sowtel.enable(exporter="memory") as s:
        g(jnp.array([1.0, 2.0]))
        g(jnp.array([1.0, -1.0, 0.0]))
        g(jnp.array([jnp.nan]))
        sowtel.flush()
        alert = sowtel.status()["first_nonfinite"]
    assert alert is not None
    assert (alert["step"], alert["name"], alert["mode"]) == (1, "log", "primal") if isinstance(
        alert, dict) else tuple(alert)[:3] == (1, "log", "primal")
    second = s.exporters[0].records[1]
    assert (second.stats["nan"], second.stats["neginf"]) == (1.0, 1.0)


@pytest.mark.parametrize("transport", ["sowtel.jit", "jax.jit"])
def test_the_first_nonfinite_log_line_names_the_layer(transport: str, caplog) -> None:
    # The dashboard's health panel shows the layer; the log line says it too.
    def f(x):
        def body(c, i):
            sowtel.sow(jnp.where(i == 2, jnp.nan, c), "blocks/h")
            return c + 1.0, None
        return jax.lax.scan(body, x, jnp.arange(4))[0].sum()

    step = (sowtel.jit if transport == "sowtel.jit" else jax.jit)(f)
    with caplog.at_level("WARNING", logger="sowtel"):
        with sowtel.enable(exporter="memory"):
            with sowtel.at_step(3):
                step(jnp.ones(2))
            sowtel.flush()
            alert = sowtel.status()["first_nonfinite"]
    assert tuple(alert) == (3, "blocks/h", "primal")
    assert [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()] == [
        "sowtel: first non-finite value at step 3 in blocks/h (primal, index 2)"]


def test_at_step_and_every_on_device() -> None:
    @jax.jit
    def train_step(x, step):
        with sowtel.at_step(step):
            a = sowtel.sow(x, "every3", every=3)
            b = sowtel.sow(x * 2, "always")
        return a + b

    with sowtel.enable(exporter="memory") as s:
        for step in range(7):
            train_step(X, jnp.int32(step))
        sowtel.flush()
    records = s.exporters[0].records
    assert sorted(r.step for r in records if r.name == "every3") == [0, 3, 6]
    assert sorted(r.step for r in records if r.name == "always") == list(range(7))
    # A session-wide stride applies where the site sets none; without at_step it counts calls.
    with sowtel.enable(exporter="memory", every=2) as s:
        for _ in range(5):
            f(X)
        sowtel.flush()
    assert [r.step for r in s.exporters[0].records] == [0, 2, 4]


def test_selection_by_tag_name_and_mode() -> None:
    def g(x):
        a = sowtel.sow(x, "enc/a")
        b = sowtel.sow(a * 2, "enc/b", tag="extra")
        c = sowtel.sow(b + 1, "dec/c")
        return jnp.sum(c**2)

    grad = jax.jit(jax.grad(g))
    cases = [
        (dict(), {("enc/a", "primal"), ("enc/a", "cotangent"), ("dec/c", "primal"),
                  ("dec/c", "cotangent")}),
        (dict(tags=("extra",)), {("enc/b", "primal"), ("enc/b", "cotangent")}),
        (dict(include="enc/*"), {("enc/a", "primal"), ("enc/a", "cotangent")}),
        (dict(exclude=["enc/*"]), {("dec/c", "primal"), ("dec/c", "cotangent")}),
        (dict(include=lambda n: n.startswith("dec")),
         {("dec/c", "primal"), ("dec/c", "cotangent")}),
        (dict(modes=("cotangent",)), {("enc/a", "cotangent"), ("dec/c", "cotangent")}),
    ]
    for options, expected in cases:
        with sowtel.enable(exporter="memory", **options) as s:
            grad(X)
            sowtel.flush()
        assert {(r.name, r.mode) for r in s.exporters[0].records} == expected, options


def test_exporter_instances_lists_and_entry_points(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = MemoryExporter(), MemoryExporter()
    with sowtel.enable(exporter=[a, b, "memory"]) as s:
        f(X)
        sowtel.flush()
    assert len(a.records) == len(b.records) == len(s.exporters[2].records) == 1

    # A third-party exporter registered under the entry-point group, as an installed package is.
    pkg = tmp_path / "sowtel_probe_exporter.py"
    pkg.write_text(textwrap.dedent("""
        class ProbeExporter:
            instances = []
            def __init__(self, **options):
                self.options, self.records = options, []
                ProbeExporter.instances.append(self)
            def write(self, records): self.records.extend(records)
            def flush(self): pass
            def close(self): pass
    """))
    dist = tmp_path / "sowtel_probe_exporter-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sowtel-probe-exporter\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[sowtel.exporters]\nprobe = sowtel_probe_exporter:ProbeExporter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "probe" in known_names()
    with sowtel.enable(exporter="probe", color="blue") as s:
        f(X)
        sowtel.flush()
    [probe] = s.exporters
    assert probe.options == {"color": "blue"} and len(probe.records) == 1
    sys.modules.pop("sowtel_probe_exporter", None)


def test_export_pushes_captured_intermediates_as_records() -> None:
    def g(x):
        return jnp.sum(sowtel.sow(jnp.sin(x), "s") ** 2)

    _, inter = sowtel.save_intermediates(jax.grad(g))(X)
    with sowtel.enable(exporter="memory") as s:
        assert sowtel.export(inter, step=5) == 2
        jax.jit(g)(X)  # the same site, streamed, for comparison
        sowtel.flush()
    exported = [r for r in s.exporters[0].records if r.step == 5]
    streamed = [r for r in s.exporters[0].records if r.step == 0]
    assert {r.mode for r in exported} == {"primal", "cotangent"}
    [p] = [r for r in exported if r.mode == "primal"]
    for k, v in streamed[0].stats.items():
        np.testing.assert_allclose(p.stats[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


# -- bad input ----------------------------------------------------------------------------------


def test_unknown_exporter_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown exporter 'tensorbord': known exporters are "
                                         ".*memory.*tensorboard"):
        sowtel.enable(exporter="tensorbord")
    assert sowtel.status()["enabled"] is False


def test_exporter_without_methods_is_rejected() -> None:
    class Half:
        def write(self, records):
            pass

    with pytest.raises(TypeError, match="lacks the method\\(s\\) flush, close"):
        sowtel.enable(exporter=Half())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(summary="mean"), "enable summary='mean' is not a summary"),
        (dict(every=0), "enable(every=0): every must be a positive int, such as 1 or 10"),
        (dict(every=2.5), "enable(every=2.5): every must be a positive int"),
        (dict(queue_size=-1), "enable(queue_size=-1): queue_size must be a positive int"),
        (dict(on_full="wait"), "on_full='wait' is not a policy: use 'drop' or 'block'"),
        (dict(modes=("primal", "hessian")), "holds 'hessian', which is not a mode"),
        (dict(tags=()), "enable tags=() must be a non-empty list"),
        (dict(include=3), "include=3 must be a glob pattern"),
    ],
)
def test_bad_enable_options(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        sowtel.enable(exporter="memory", **options)
    assert sowtel.status()["enabled"] is False


def test_flush_and_status_with_nothing_enabled() -> None:
    assert sowtel.flush() is True
    assert sowtel.status()["enabled"] is False
    final = sowtel.disable()  # nothing to disable: no error, the last counters
    assert final["enabled"] is False


def test_disable_returns_final_counters_and_status_keeps_them() -> None:
    f = jax.jit(lambda x: sowtel.sow(x * 2, "y", summary="stats").sum())
    sowtel.enable(exporter="memory")
    f(X)
    f(X)
    final = sowtel.disable()
    assert final["enabled"] is False
    assert final["received"] == 2 and final["exported"] == {"memory": 2} and final["late"] == 0
    after = sowtel.status()
    assert after["enabled"] is False and after["received"] == 2 and after["session"] == (
        final["session"])
    with sowtel.enable(exporter="memory"):  # the next enable() starts from zero
        assert sowtel.status()["received"] == 0


def _user_callback_fails(x: np.ndarray) -> None:
    raise RuntimeError("a user callback failed")


def test_flush_and_disable_go_past_an_earlier_failed_computation(
        caplog: pytest.LogCaptureFixture) -> None:
    # On several devices a failed callback surfaces when awaited; JAX then re-raises it from
    # every effects barrier, which flush() and disable() wait on.
    mesh = jax.make_mesh((8,), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def fails(x: jax.Array) -> jax.Array:
        jax.debug.callback(_user_callback_fails, x)
        return x * 2.0

    broken = jax.jit(jax.shard_map(fails, mesh=mesh, in_specs=spec, out_specs=spec))
    xs = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, spec))
    with caplog.at_level("WARNING", logger="sowtel"):
        session = sowtel.enable(exporter="memory")
        try:
            with pytest.raises(Exception, match="a user callback failed"):
                broken(xs).block_until_ready()  # the user meets their error where they wait
            f(X)
            assert sowtel.flush() is True
            assert sowtel.status()["effect_errors"] == 1
            with pytest.raises(Exception, match="a user callback failed"):
                broken(xs).block_until_ready()
            f(X)
        finally:
            sowtel.disable()
    assert session.status()["effect_errors"] == 2
    assert sowtel.flush() is True  # the failure is not left behind for later barriers
    records = session.exporters[0].records
    assert [(r.name, r.stats["mean"]) for r in records] == [("y", 0.5), ("y", 0.5)]
    warned = [r for r in caplog.records if "earlier failed computation" in r.getMessage()]
    assert len(warned) == 1 and "a user callback failed" in warned[0].getMessage()


def test_export_needs_a_session_and_an_int_step() -> None:
    with pytest.raises(RuntimeError, match="needs an active session"):
        sowtel.export({"h": {"primal": np.ones(2)}}, step=0)
    with sowtel.enable(exporter="memory"), pytest.raises(
            ValueError, match="export step=1.5 must be an int"):
        sowtel.export({"h": {"primal": np.ones(2)}}, step=1.5)  # type: ignore[arg-type]


def test_exporter_options_reach_the_exporters_that_take_them(tmp_path: Path) -> None:
    with sowtel.enable(exporter=["memory", "jsonl"], logdir=str(tmp_path)) as s:
        f(X)
        sowtel.flush()
    assert len(s.exporters[0].records) == 1
    assert (tmp_path / "records.jsonl").read_text().count("\n") == 1
    with pytest.raises(TypeError, match="option\\(s\\) colour are taken by none of the exporters"):
        sowtel.enable(exporter=["memory", "jsonl"], logdir=str(tmp_path), colour=3)
    assert sowtel.status()["enabled"] is False


def test_eager_sows_stream() -> None:
    with sowtel.enable(exporter="memory") as s:
        for i in range(3):
            out = sowtel.sow(jnp.full(3, float(i)), "eager")
        sowtel.flush()
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
    assert [(r.step, r.stats["mean"]) for r in s.exporters[0].records] == [
        (0, 0.0), (1, 1.0), (2, 2.0)]


def test_host_side_at_step_runs_the_plain_program_on_quiet_steps() -> None:
    @jax.jit
    def step_fn(x):
        return sowtel.sow(x * 2.0, "hs").sum() + sowtel.sow(x, "hs3", every=3).sum()

    plain = jax.jit(lambda x: (x * 2.0).sum() + x.sum())
    with sowtel.enable(exporter="memory", every=4) as s:
        for k in range(10):
            with sowtel.at_step(k):
                out = step_fn(X)
        sowtel.flush()
        # A quiet step's program is the one compiled with streaming off.
        with sowtel.at_step(1):
            quiet_text = step_fn.lower(X).as_text()
    assert float(out) == float(plain(X))
    got = sorted((r.name, r.step) for r in s.exporters[0].records)
    assert got == [("hs", 0), ("hs", 4), ("hs", 8), ("hs3", 0), ("hs3", 3), ("hs3", 6), ("hs3", 9)]
    assert "callback" not in quiet_text and "sow" not in quiet_text
    # Outside at_step again, steps count calls (the host step does not linger).
    with sowtel.enable(exporter="memory") as s:
        with sowtel.at_step(50):
            step_fn(X)
        step_fn(X)
        sowtel.flush()
    assert sorted(r.step for r in s.exporters[0].records if r.name == "hs") == [1, 50]
