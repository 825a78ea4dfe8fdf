"""The streaming transform matrix, on 8 forced CPU devices, through the three transports: the
two host-callback paths (``jax.jit`` programs) and ``sowtel.jit``'s summaries as outputs.

Each case streams with the memory exporter and checks the number of records, their modes, steps
and indices, and their values: ``"full"`` values against hand-derived numbers, derivatives
against ``jax.grad`` of an explicit perturbation or finite differences, and the device's
``"stats"`` against numpy on the same values computed independently.
"""

from __future__ import annotations

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


# The jit the cases compile with: jax.jit (host callbacks) or sowtel.jit (set by the fixture).
jit: Callable[..., Any] = jax.jit


@pytest.fixture(params=["fast", "debug", "sowtel.jit"], autouse=True)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "sowtel.jit":
        monkeypatch.setitem(globals(), "jit", sowtel.jit)
    else:
        # Read at lowering time: each jax.jit below is a new function, so it compiles anew.
        monkeypatch.setenv("SOWTEL_CALLBACK", request.param)
    return str(request.param)


def stream(fn: Callable[..., Any], *args: Any, **options: Any) -> list[Record]:
    options.setdefault("summary", "full")
    with sowtel.enable(exporter="memory", **options) as session:
        jax.block_until_ready(fn(*args))
        assert sowtel.flush(timeout=30)
        status = sowtel.status()
    assert status["dropped"] == 0 and not any(status["errors"].values())
    # Program order: callbacks are unordered, so arrival (seq) order may differ.
    return sorted(session.exporters[0].records, key=lambda r: (r.step, r.order, r.seq))


def by(records: list[Record], mode: str, name: str | None = None) -> list[Record]:
    return [r for r in records if r.mode == mode and (name is None or r.name == name)]


def plain(x, eps=None):
    h = jnp.sin(x) * 2.0
    h = sow(h, "h") if eps is None else h + eps
    return jnp.sum(h**2)


def test_jit_streams_primal_with_device_stats() -> None:
    records = stream(jit(plain), X, summary="stats")
    [r] = records
    assert (r.name, r.mode, r.step, r.index, r.shape, r.dtype) == (
        "h", "primal", 0, None, (4,), "float32")
    expected = host_summary(np.sin(X.astype(np.float64)) * 2.0, "stats")["stats"]
    for k, v in expected.items():
        np.testing.assert_allclose(r.stats[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("kind", ["grad", "value_and_grad", "vjp"])
def test_reverse_mode_streams_cotangent(kind: str) -> None:
    if kind == "grad":
        fn = jit(jax.grad(plain))
    elif kind == "value_and_grad":
        fn = jit(jax.value_and_grad(plain))
    else:
        fn = jit(lambda x: jax.vjp(plain, x)[1](jnp.float32(1.0)))
    records = stream(fn, X)
    assert [r.mode for r in records] == ["primal", "cotangent"]
    expected = jax.grad(lambda e: plain(X, e))(jnp.zeros(4))
    np.testing.assert_allclose(by(records, "cotangent")[0].value, expected, rtol=1e-5)
    np.testing.assert_allclose(by(records, "primal")[0].value, 2 * np.sin(X), rtol=1e-6)


def test_jvp_streams_tangent_matching_finite_differences() -> None:
    records = stream(jit(lambda x, t: jax.jvp(plain, (x,), (t,))), X, T)
    assert [r.mode for r in records] == ["primal", "tangent"]
    d = 1e-3
    fd = (2 * np.sin(X.astype(np.float64) + d * T) - 2 * np.sin(X.astype(np.float64) - d * T)) / (
        2 * d)
    np.testing.assert_allclose(by(records, "tangent")[0].value, fd, rtol=1e-4, atol=1e-5)


def test_vmap_inside_and_outside_one_record_per_batch() -> None:
    xs = np.stack([X, X * 2, -X])
    for fn in (jit(jax.vmap(plain)), jax.vmap(jit(plain))):
        [r] = stream(fn, xs)
        assert r.shape == (3, 4)
        np.testing.assert_allclose(r.value, 2 * np.sin(xs), rtol=1e-6)


def test_vmap_streams_each_leaf_batched_as_it_was() -> None:
    # A pytree of a batched and an unbatched leaf (out_axes=None on the latter, which turning
    # streaming on used to break): each leaf's record has the shape the program gives it.
    xs, s = np.stack([X, X * 2, -X]), np.float32(0.8)
    pair = jax.vmap(lambda x, s: sow((x * 2.0, jnp.sin(s)), "pair"), in_axes=(0, None),
                    out_axes=(0, None))

    def loss(xs, s, eps=None):
        a, b = pair(xs, s) if eps is None else (xs * 2.0 + eps[0], jnp.sin(s) + eps[1])
        return jnp.sum(a * b**2)

    _, b = jit(pair)(xs, s)
    np.testing.assert_allclose(b, np.sin(s), rtol=1e-6)
    records = stream(jit(jax.grad(loss, argnums=(0, 1))), xs, s)
    got = {(r.name, r.mode): r for r in records}
    assert set(got) == {("pair/0", "primal"), ("pair/1", "primal"), ("pair/0", "cotangent"),
                        ("pair/1", "cotangent")}
    assert got["pair/0", "primal"].shape == (3, 4) and got["pair/1", "primal"].shape == ()
    np.testing.assert_allclose(got["pair/0", "primal"].value, 2 * xs, rtol=1e-6)
    np.testing.assert_allclose(got["pair/1", "primal"].value, np.sin(s), rtol=1e-6)
    want = jax.grad(lambda e: loss(xs, s, e))((jnp.zeros_like(xs), jnp.float32(0)))
    assert got["pair/1", "cotangent"].shape == ()  # the rows' sum, as the program holds it
    np.testing.assert_allclose(got["pair/0", "cotangent"].value, want[0], rtol=1e-5)
    np.testing.assert_allclose(got["pair/1", "cotangent"].value, want[1], rtol=1e-5)


def scan_loss(x):
    def body(c, xt):
        h = sow(jnp.tanh(c * xt + 0.1), "s")
        return c + h, None

    c, _ = jax.lax.scan(body, jnp.float32(1.0), x)
    return c**2


def scan_loss_eps(x, eps):
    def body(c, xe):
        xt, e = xe
        h = jnp.tanh(c * xt + 0.1) + e
        return c + h, h

    c, hs = jax.lax.scan(body, jnp.float32(1.0), (x, eps))
    return c**2, hs


def test_scan_streams_every_iteration_with_its_index() -> None:
    records = stream(jit(jax.grad(scan_loss)), X)
    primal, cot = by(records, "primal"), by(records, "cotangent")
    assert [r.index for r in primal] == [0, 1, 2, 3]
    assert sorted(r.index for r in cot) == [0, 1, 2, 3]
    assert [r.index for r in cot] == [3, 2, 1, 0]  # the backward pass runs in reverse
    assert {r.step for r in records} == {0}
    _, hs = scan_loss_eps(X, jnp.zeros(4))
    expected_ct = jax.grad(lambda e: scan_loss_eps(X, e)[0])(jnp.zeros(4))
    for r in primal:
        np.testing.assert_allclose(r.value, hs[r.index], rtol=1e-6)
    for r in cot:
        np.testing.assert_allclose(r.value, expected_ct[r.index], rtol=1e-5)


def test_fori_loop_and_second_execution_steps() -> None:
    def f(x):
        return jax.lax.fori_loop(0, 4, lambda i, c: c + sow(x[i] * c, "f"), jnp.float32(1.0))

    jitted = jit(f)
    with sowtel.enable(exporter="memory", summary="full") as session:
        jitted(X)
        jitted(X)
        sowtel.flush()
    records = session.exporters[0].records
    assert sorted((r.step, r.index) for r in records) == [(s, i) for s in (0, 1) for i in range(4)]
    c, expected = 1.0, []
    for xi in X:
        expected.append(xi * c)
        c += xi * c
    for r in records:
        np.testing.assert_allclose(r.value, expected[r.index], rtol=1e-6)


def test_while_body_streams_once_per_iteration(transport: str) -> None:
    def f(x):
        def body(state):
            k, v = state
            return k + 1, sow(v * 1.5, "w")

        return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    records = stream(jit(f), X)
    # Without at_step the callback transport counts occurrences; sowtel.jit counts calls, and its
    # while-body callbacks carry the call's step.
    assert [r.step for r in records] == ([0, 0, 0] if transport == "sowtel.jit" else [0, 1, 2])
    assert all(r.index is None for r in records)
    for k, r in enumerate(records):
        np.testing.assert_allclose(r.value, X * 1.5 ** (k + 1), rtol=1e-6)


def test_cond_and_switch_stream_only_the_taken_branch() -> None:
    def f(x, k):
        return jax.lax.switch(
            k, [lambda v: sow(v + 1, "b0"), lambda v: sow(v * 2, "b1"), lambda v: sow(-v, "b2")], x)

    jitted = jit(f)
    for k in (0, 1, 2):
        [r] = stream(jitted, X, jnp.int32(k))
        assert r.name == f"b{k}"
    records = stream(jit(lambda x: jax.lax.cond(
        x[0] > 0, lambda v: sow(v, "yes"), lambda v: sow(v, "no"), x)), X)
    assert [r.name for r in records] == ["yes"]


def test_checkpoint_streams_primal_once() -> None:
    def f(x):
        return jnp.sum(jax.checkpoint(lambda v: jnp.sin(sow(jnp.tanh(v) * 3, "c")))(x) ** 2)

    records = stream(jit(jax.grad(f)), X)
    assert [r.mode for r in records] == ["primal", "cotangent"]
    np.testing.assert_allclose(records[0].value, np.tanh(X) * 3, rtol=1e-6)
    h = np.tanh(X.astype(np.float64)) * 3
    np.testing.assert_allclose(records[1].value, 2 * np.sin(h) * np.cos(h), rtol=1e-5)


def test_custom_vjp_fwd_primal_bwd_cotangent() -> None:
    @jax.custom_vjp
    def scale(x):
        return x * 3.0

    def fwd(x):
        return sow(x * 3.0, "fwd"), None

    def bwd(_, ct):
        return (sow(ct * 3.0, "bwd"),)

    scale.defvjp(fwd, bwd)
    records = stream(jit(jax.grad(lambda x: jnp.sum(scale(x) ** 2))), X)
    assert [(r.name, r.mode) for r in records] == [("fwd", "primal"), ("bwd", "cotangent")]
    np.testing.assert_allclose(records[1].value, 3 * 2 * 3 * X, rtol=1e-6)


def test_shard_map_and_pmap_one_record_per_shard() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
    sm = jax.shard_map(lambda v: sow(v * 2.0, "sm"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    records = stream(jit(jax.grad(lambda v: jnp.sum(sm(v) ** 2))), x)
    expected = 2.0 * np.arange(16.0).reshape(8, 2)
    for mode, factor in (("primal", 1.0), ("cotangent", 2.0)):
        got = by(records, mode)
        assert sorted(r.index for r in got) == list(range(8))
        for r in got:
            np.testing.assert_allclose(r.value, factor * expected[r.index], rtol=1e-6)

    records = stream(jax.pmap(lambda v: sow(v + 1.0, "pm")), np.arange(16.0).reshape(8, 2))
    assert sorted(r.index for r in records) == list(range(8))
    for r in records:
        np.testing.assert_allclose(r.value, np.arange(16.0).reshape(8, 2)[r.index] + 1)


def test_sharded_jit_reduces_globally() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("i")))
    [r] = stream(jit(lambda v: sow(v * 0.5, "g").sum()), x, summary="stats")
    assert r.shape == (16, 4) and r.index is None
    expected = host_summary(np.arange(64.0).reshape(16, 4) * 0.5, "stats")["stats"]
    for k, v in expected.items():
        np.testing.assert_allclose(r.stats[k], v, rtol=1e-5, err_msg=k)
