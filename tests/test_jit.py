"""``sowtel.jit``: records equal to the callback transport's, no host callback in the program,
host-side steps and strides, jax.jit's options, bad input, and the jit cache across sessions."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sowtel
from sowtel import sow
from sowtel.records import Record
from sowtel.summaries import host_summary

X = np.array([0.3, -0.7, 1.1, 0.5], np.float32)
T = np.array([1.0, 0.5, -0.25, 2.0], np.float32)


def run(step: Callable[..., Any], *args: Any, calls: int = 1, **options: Any) -> list[Record]:
    with sowtel.enable(exporter="memory", **options) as session:
        for _ in range(calls):
            jax.block_until_ready(step(*args))
        assert sowtel.flush(timeout=60)
        status = sowtel.status()
    assert status["dropped"] == 0 and not any(status["errors"].values())
    return sorted(session.exporters[0].records, key=lambda r: (r.step, r.order, r.seq))


def key(r: Record) -> tuple[Any, ...]:
    return (r.name, r.mode, r.step, r.index, r.shape, r.dtype, r.tag, r.summary)


def scan_loss(x):
    def body(c, xt):
        h = sow(jnp.tanh(c * xt + 0.1), "s")
        return c + h, None

    return jax.lax.scan(body, jnp.float32(1.0), x)[0] ** 2


def nested_reverse(x):
    def inner(c, xt):
        return c * 0.9 + sow(jnp.sin(c + xt), "inner"), None

    def outer(c, row):
        c2, _ = jax.lax.scan(inner, c, row, reverse=True)
        return sow(c2 * 2.0, "outer"), None

    return jnp.sum(jax.lax.scan(outer, jnp.float32(0.5), x.reshape(2, 2))[0] ** 2)


def switch_fn(x):
    k = (x[0] > 0).astype(jnp.int32) + (x[1] > 0).astype(jnp.int32)
    out = jax.lax.switch(k, [lambda v: sow(v + 1, "b0"), lambda v: sow(v * 2, "b1"),
                             lambda v: sow(-v, "b2")], x)
    return jnp.sum(out ** 2)


@jax.custom_vjp
def scale3(x):
    return x * 3.0


def _fwd(x):
    return sow(x * 3.0, "fwd"), None


def _bwd(_, ct):
    return (sow(ct * 3.0, "bwd"),)


scale3.defvjp(_fwd, _bwd)


def pytree_fn(x):
    pair = sow({"a": jnp.sin(x), "b": (x * 2.0, jnp.int32(3))}, "pair")
    return jnp.sum(pair["a"] * pair["b"][0])


def _shard_map_loss(v):
    mesh = jax.make_mesh((8,), ("i",))
    sm = jax.shard_map(lambda u: sow(u * 2.0, "sm"), mesh=mesh, in_specs=P("i"),
                       out_specs=P("i"))
    return jnp.sum(sm(v) ** 2)


CASES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "plain": (lambda x: jnp.sum(sow(jnp.sin(x) * 2.0, "h") ** 2), (X,)),
    "grad": (jax.grad(lambda x: jnp.sum(sow(jnp.sin(x) * 2.0, "h") ** 2)), (X,)),
    "jvp": (lambda x, t: jax.jvp(lambda v: jnp.sum(sow(jnp.sin(v), "h") ** 2), (x,), (t,)),
            (X, T)),
    "vmap": (jax.vmap(lambda x: jnp.sum(sow(jnp.sin(x), "h"))), (np.stack([X, -X, 2 * X]),)),
    "scan_under_grad": (jax.grad(scan_loss), (X,)),
    "nested_reverse_scan_under_grad": (jax.grad(nested_reverse), (X,)),
    "switch": (jax.grad(switch_fn), (X,)),
    "cond_untaken": (lambda x: jax.lax.cond(x[0] > 5, lambda v: sow(v, "yes"),
                                            lambda v: sow(-v, "no"), x), (X,)),
    "checkpoint": (jax.grad(lambda x: jnp.sum(
        jax.checkpoint(lambda v: jnp.sin(sow(jnp.tanh(v) * 3, "c")))(x) ** 2)), (X,)),
    "custom_vjp": (jax.grad(lambda x: jnp.sum(scale3(x) ** 2)), (X,)),
    "pytree_and_int_leaf": (jax.grad(pytree_fn), (X,)),
    "shard_map_under_grad": (jax.grad(_shard_map_loss), (jax.device_put(
        jnp.arange(16.0), NamedSharding(jax.make_mesh((8,), ("i",)), P("i"))),)),
    "repeated_name": (jax.grad(lambda x: jnp.sum(sow(sow(x * 2.0, "r") + 1.0, "r") ** 2)), (X,)),
}


@pytest.mark.parametrize("summary", ["stats", "histogram", "health"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_records_equal_the_callback_transports(case: str, summary: str) -> None:
    fn, args = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the repeated name's warning, once per process
        by_callback = run(jax.jit(fn), *args, calls=2, summary=summary)
        by_outputs = run(sowtel.jit(fn), *args, calls=2, summary=summary)
    assert by_callback, "the case streams something"
    assert sorted(map(key, by_outputs)) == sorted(map(key, by_callback))
    match = {key(r): r for r in by_callback}
    for r in by_outputs:
        other = match[key(r)]
        assert r.stats.keys() == other.stats.keys()
        for k, v in r.stats.items():
            np.testing.assert_allclose(v, other.stats[k], rtol=1e-5, atol=1e-6, err_msg=k)
        if summary == "histogram":
            np.testing.assert_array_equal(r.histogram[1], other.histogram[1])
            np.testing.assert_allclose(r.histogram[0], other.histogram[0], rtol=1e-5, atol=1e-6)


def test_untaken_branch_gives_no_record_and_scan_gives_one_per_iteration() -> None:
    records = run(sowtel.jit(CASES["cond_untaken"][0]), X, summary="full")
    assert [r.name for r in records] == ["no"]
    np.testing.assert_allclose(records[0].value, -X)
    records = run(sowtel.jit(jax.grad(scan_loss)), X, summary="full")
    primal = [r for r in records if r.mode == "primal"]
    cot = [r for r in records if r.mode == "cotangent"]
    assert [r.index for r in primal] == [0, 1, 2, 3]
    assert [r.index for r in cot] == [3, 2, 1, 0]  # in the order the backward pass ran

    def scan_loss_eps(x, eps):
        def body(c, xe):
            h = jnp.tanh(c * xe[0] + 0.1) + xe[1]
            return c + h, h

        c, hs = jax.lax.scan(body, jnp.float32(1.0), (x, eps))
        return c ** 2, hs

    _, hs = scan_loss_eps(X, jnp.zeros(4))
    expected_ct = jax.grad(lambda e: scan_loss_eps(X, e)[0])(jnp.zeros(4))
    for r in primal:
        np.testing.assert_allclose(r.value, hs[r.index], rtol=1e-6)
    for r in cot:
        np.testing.assert_allclose(r.value, expected_ct[r.index], rtol=1e-5)


def test_tangent_matches_finite_differences() -> None:
    records = run(sowtel.jit(CASES["jvp"][0]), X, T, summary="full")
    [tangent] = [r for r in records if r.mode == "tangent"]
    d = 1e-3
    x64, t64 = X.astype(np.float64), T.astype(np.float64)
    np.testing.assert_allclose(tangent.value, (np.sin(x64 + d * t64) - np.sin(x64 - d * t64))
                               / (2 * d), rtol=1e-4, atol=1e-5)


def _custom_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if "custom_call" in line or "callback" in line]


def test_logging_program_has_no_host_callback_unless_a_site_is_in_a_while_body() -> None:
    step = sowtel.jit(jax.grad(nested_reverse))
    with sowtel.enable(exporter="memory"):
        text = step.lower_logging(X, step=0).as_text()
        assert "stablehlo.while" in text  # the scans are there...
        assert _custom_calls(text) == []  # ...and no host callback

        def with_while(x):
            def body(state):
                k, v = state
                return k + 1, sow(v * 1.5, "w")

            return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, sow(x, "before")))[1]

        text = sowtel.jit(with_while).lower_logging(X, step=0).as_text()
        assert len([c for c in _custom_calls(text) if "callback" in c]) == 1
        # With nothing due at a step, a call runs the plain program: jax.jit's.
        assert "callback" not in sowtel.jit(with_while).lower(X).as_text()


def test_no_session_runs_jax_jits_program() -> None:
    fn = CASES["grad"][0]
    step = sowtel.jit(fn)
    assert step.lower(X).as_text() == jax.jit(fn).lower(X).as_text()
    np.testing.assert_allclose(step(X), jax.jit(fn)(X))
    assert step.__wrapped__ is fn
    shape = step.eval_shape(X)
    assert shape.shape == (4,) and shape.dtype == jnp.float32
    assert step.trace(X).jaxpr is not None


def test_steps_count_calls_and_every_is_decided_on_the_host() -> None:
    traced: list[str] = []

    def f(x):
        traced.append("t")
        return jnp.sum(sow(x * 2.0, "h") + sow(x, "often", every=3))

    step = sowtel.jit(f)
    records = run(step, X, calls=30, every=10)
    got = sorted({(r.name, r.step) for r in records})
    assert got == sorted([("h", s) for s in (0, 10, 20)] + [("often", s) for s in range(0, 30, 3)])
    # The plain program (steps 1, 2, 4, ...), the step-0 program (both due), the every-3 program
    # (3, 6, 9, ...), plus the one trace that finds the sites' strides: no more.
    assert len(traced) <= 5

    records = run(step, X, calls=3)  # a new session counts from 0 again
    assert sorted(r.step for r in records if r.name == "h") == [0, 1, 2]


def test_host_side_at_step_around_the_call() -> None:
    step = sowtel.jit(lambda x: jnp.sum(sow(x * 2.0, "h")))
    with sowtel.enable(exporter="memory", every=5) as session:
        for k in range(12):
            with sowtel.at_step(100 + k):
                step(X)
        sowtel.flush()
    assert sorted(r.step for r in session.exporters[0].records) == [100, 105, 110]


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_host_steps_are_per_thread(transport: str) -> None:
    def f(x):
        return jnp.sum(sow(x * 2.0, "h", summary="full"))

    step = jax.jit(f) if transport == "callback" else sowtel.jit(f)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def train(offset: int, scale: float) -> None:
        try:
            start.wait(timeout=60)
            for k in range(20):
                with sowtel.at_step(offset + k):
                    step(X * scale)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with sowtel.enable(exporter="memory", every=2) as session:
        threads = [threading.Thread(target=train, args=(0, 1.0)),
                   threading.Thread(target=train, args=(1000, -1.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        sowtel.flush()
    assert not errors and not any(t.is_alive() for t in threads)
    records = session.exporters[0].records
    assert sorted(r.step for r in records) == sorted([*range(0, 20, 2), *range(1000, 1020, 2)])
    for r in records:  # each record carries the step of the thread that computed it
        expected = X * 2.0 if r.step < 1000 else -X * 2.0
        np.testing.assert_allclose(r.value, expected)


def test_callback_transport_keeps_late_callbacks_steps() -> None:
    # The callbacks of a logging step may run after the call returns: they keep its step.
    step = jax.jit(lambda x: jnp.sum(sow(jnp.tanh(x) * 2.0, "h")))
    for _ in range(50):
        with sowtel.enable(exporter="memory", every=10) as session:
            for k in range(30):
                with sowtel.at_step(k):
                    step(X)
            sowtel.flush()
        assert sorted(r.step for r in session.exporters[0].records) == [0, 10, 20]


def test_static_and_donated_arguments() -> None:
    def update(params, x, *, scale):
        h = sow(jnp.tanh(params * x), "h")
        return params - scale * h

    step = sowtel.jit(update, static_argnames="scale", donate_argnums=0)
    with sowtel.enable(exporter="memory") as session:
        params = jnp.ones(4)
        for _ in range(3):
            params = step(params, X, scale=0.5)
        sowtel.flush()
    assert len(session.exporters[0].records) == 3
    expected = np.ones(4, np.float32)
    for _ in range(3):
        expected = expected - 0.5 * np.tanh(expected * X)
    np.testing.assert_allclose(params, expected, rtol=1e-6)

    positional = sowtel.jit(lambda n, x: sow(x * n, "p").sum(), static_argnums=0)
    records = run(positional, 3, X, summary="full")
    np.testing.assert_allclose(records[0].value, X * 3)


def test_bad_input_errors() -> None:
    with pytest.raises(TypeError, match="sowtel.jit needs a callable, got int 3"):
        sowtel.jit(3)
    with pytest.raises(TypeError) as ours:
        sowtel.jit(lambda x: x, not_an_option=1)
    with pytest.raises(TypeError) as theirs:
        jax.jit(lambda x: x, not_an_option=1)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError, match="at_step step must be an integer scalar"):
        with sowtel.at_step("3"):
            sowtel.jit(lambda x: x)(X)

    @jax.jit
    def enables_inside(x):
        sowtel.enable(exporter="memory")
        return x

    with pytest.raises(RuntimeError, match="enable\\(\\) was called inside a function JAX is"):
        enables_inside(X)
    assert sowtel.status()["enabled"] is False


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_sessions_with_the_same_settings_reuse_the_compiled_program(transport: str) -> None:
    traced: list[int] = []

    def f(x):
        traced.append(1)
        return jnp.sum(sow(jnp.tanh(x) @ jnp.ones((64, 64)), "h"))

    step = jax.jit(f) if transport == "callback" else sowtel.jit(f)
    x = jnp.ones((64, 64))
    run(step, x)
    first = len(traced)
    gc.collect()
    before = _rss_mb()
    for _ in range(100):
        records = run(step, x)
        assert len(records) == 1
    gc.collect()
    grown = _rss_mb() - before
    assert len(traced) == first, "a new session with the same settings retraced"
    assert grown <= 20, f"RSS grew {grown:.1f} MB over 100 sessions"


def test_a_callback_after_its_session_ended_is_counted_late() -> None:
    f = jax.jit(lambda x: jnp.sum(sow(x * 2.0, "h")))
    with sowtel.enable(exporter="memory") as session:
        compiled = f.lower(X).compile()  # compiled while streaming: it holds the callback
    final = session.status()
    compiled(X)  # runs after the session ended
    jax.effects_barrier()
    assert session.status()["late"] == final["late"] + 1
    assert sowtel.status()["late"] == final["late"] + 1
    assert session.status()["exported"] == final["exported"]


def test_sharded_input_reduces_globally() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("i")))
    [r] = run(sowtel.jit(lambda v: sow(v * 0.5, "g").sum()), x)
    assert r.shape == (16, 4) and r.index is None
    expected = host_summary(np.arange(64.0).reshape(16, 4) * 0.5, "stats")["stats"]
    for k, v in expected.items():
        np.testing.assert_allclose(r.stats[k], v, rtol=1e-5, err_msg=k)


def test_shardings_as_in_jax_jit() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    sharding = NamedSharding(mesh, P("i"))
    step = sowtel.jit(lambda x, scale: sow(x * scale, "h") + 1.0,
                      in_shardings=(sharding,), out_shardings=sharding, static_argnums=1)
    x = jax.device_put(jnp.arange(16.0), sharding)
    with sowtel.enable(exporter="memory", summary="full") as session:
        y = step(x, 2.0)
        sowtel.flush()
    assert y.sharding == sharding
    np.testing.assert_allclose(y, np.arange(16.0) * 2 + 1)
    [r] = session.exporters[0].records
    np.testing.assert_allclose(r.value, np.arange(16.0) * 2)


def test_while_body_sites_carry_the_calls_step() -> None:
    def f(x):
        def body(state):
            k, v = state
            return k + 1, sow(v * 1.5, "w")

        return jax.lax.while_loop(lambda s: s[0] < 2, body, (0, sow(x, "before")))[1]

    step = sowtel.jit(f)
    with sowtel.enable(exporter="memory", summary="full") as session:
        for k in (5, 6):
            with sowtel.at_step(k):
                step(X)
        step(X)  # no at_step: the call count since enable() (the third call)
        sowtel.flush()
    got = sorted((r.step, r.name) for r in session.exporters[0].records)
    assert got == sorted([(5, "before"), (5, "w"), (5, "w"), (6, "before"), (6, "w"), (6, "w"),
                          (2, "before"), (2, "w"), (2, "w")])


# -- enable(histogram_every=N) ------------------------------------------------------------------

W3 = np.random.default_rng(3).normal(scale=0.9, size=(3, 4, 4)).astype(np.float32)
X3 = np.random.default_rng(4).normal(size=(5, 4)).astype(np.float32)


def _layers(w, x, eps=None):
    """Three tanh layers under scan, each output sown; ``eps`` (3, 5, 4) is added to the sown
    values, so ``jax.grad`` in ``eps`` is the sites' cotangent computed without sowtel."""
    def body(h, wi_e):
        wi, e = wi_e
        return sow(jnp.tanh(h @ wi), "layers/h", summary=None) + e, None

    zeros = jnp.zeros((3, *x.shape), x.dtype) if eps is None else eps
    h, _ = jax.lax.scan(body, x, (w, zeros))
    health = sow(h.sum(axis=1), "head", summary="health")
    return jnp.sum(h ** 2) + 0.0 * health.sum()


def _primal_values() -> list[np.ndarray]:
    h, out = X3.astype(np.float64), []
    for wi in W3.astype(np.float64):
        h = np.tanh(h @ wi)
        out.append(h)
    return out


def _cotangent_values() -> np.ndarray:
    with sowtel.enable(exporter="memory", tags=("nothing",)):  # no site selected: plain
        return np.asarray(jax.grad(lambda e: _layers(W3, X3, e))(jnp.zeros((3, 5, 4))))


def _assert_histogram_of(r: Record, value: np.ndarray) -> None:
    edges, counts = r.histogram
    assert counts.sum() == value.size, (r.name, r.mode, r.step, r.index)
    want_counts, want_edges = np.histogram(value, bins=len(counts),
                                           range=(value.min(), value.max()))
    np.testing.assert_allclose(edges, want_edges, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(counts, want_counts)


def test_histogram_every_n_adds_histograms_at_its_steps_only() -> None:
    step = sowtel.jit(jax.grad(_layers))
    records = run(step, W3, X3, calls=7, histogram_every=3)
    primal, cotangent = _primal_values(), _cotangent_values()
    hist_steps = set()
    for r in records:
        assert r.step in range(7)
        if r.name == "head":  # its own summary, whatever the step
            assert (r.summary, r.histogram) == ("health", None)
            continue
        if r.step in (3, 6):
            assert r.summary == "histogram", r
            value = primal[r.index] if r.mode == "primal" else cotangent[r.index]
            _assert_histogram_of(r, value)
            hist_steps.add(r.step)
        else:  # step 0 included: the first logging step compiles only the stats program
            assert (r.summary, r.histogram) == ("stats", None), r
    assert hist_steps == {3, 6}
    # Every step logged every layer and the health site, primal and cotangent.
    assert len(records) == 7 * 2 * (3 + 1)


def test_histogram_every_default_and_the_callback_transport() -> None:
    from sowtel.summaries import HISTOGRAM_EVERY

    assert HISTOGRAM_EVERY == 100
    f = sowtel.jit(lambda x: jnp.sum(sow(x * 2.0, "d") ** 2))
    x = np.random.default_rng(5).normal(size=(8, 8)).astype(np.float32)
    records = run(f, x, calls=HISTOGRAM_EVERY + 1)
    assert [r.step for r in records if r.histogram is not None] == [HISTOGRAM_EVERY]
    _assert_histogram_of(records[-1], x.astype(np.float64) * 2.0)
    # The callback transport keeps each site's summary: stats at every step.
    by_callback = run(jax.jit(f.__wrapped__), x, calls=3, histogram_every=1)
    assert [(r.summary, r.histogram) for r in by_callback] == [("stats", None)] * 3
    assert [r.summary for r in run(f, x, calls=3, histogram_every=1)] == ["histogram"] * 3
    assert [r.summary for r in run(f, x, calls=3, histogram_every=None)] == ["stats"] * 3


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_histogram_every_rejects_what_is_not_a_positive_int(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"histogram_every={bad!r} must be a positive int"):
        sowtel.enable(exporter="memory", histogram_every=bad)
    assert sowtel.status()["enabled"] is False


def test_a_dropped_function_frees_its_logging_programs() -> None:
    # The logging programs are shared per function, keyed weakly: they must not hold the
    # function themselves, or every sowtel.jit function would live (compiled) to the end.
    import importlib
    import weakref

    shared = importlib.import_module("sowtel.jit")._SHARED

    def step(x):
        return jnp.sum(sow(jnp.sin(x), "freed") ** 2)

    gone = weakref.ref(step)
    with sowtel.enable(exporter="memory"):
        jitted = sowtel.jit(step)
        jax.block_until_ready(jitted(jnp.ones(3)))
        assert sowtel.flush(timeout=30)
        assert step in shared and shared[step]
        del jitted, step
        gc.collect()
    assert gone() is None
    assert not any(getattr(f, "__name__", "") == "step" for f in list(shared.keys()))
