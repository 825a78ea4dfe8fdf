"""Labels, indices and layouts under transformations: what a site is called (its mode), which
iteration a record belongs to, which rows of a batch ran its branch, and how captured values
are laid out, under capture and the three streaming transports.

Values are checked against hand-derived numbers, derivatives against ``jax.grad`` of an explicit
perturbation at the site.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transform_cases
from transform_cases import by, iteration_order, jit, jit_of, rerun_loss

import sowtel
from sowtel import save_intermediates, sow
from sowtel.records import Record

streaming = transform_cases.streaming  # the transport fixture of every transform test


def stream(fn: Callable[..., Any], *args: Any, **options: Any) -> list[Record]:
    """The shared stream, a site's records by iteration (the sort these tests compare)."""
    return transform_cases.stream(fn, *args, key=iteration_order, **options)


def hook(h: Any, name: str, eps: Any) -> Any:
    """``sow`` at the site, or with ``eps`` a dict, an explicit perturbation there instead."""
    return sow(h, name) if eps is None else h + eps[name]


# -- a cond inside a scan ---------------------------------------------------------------------


def cond_in_scan(xs):
    def body(c, x):
        return c + jax.lax.cond(x > 0, lambda v: sow(v * 2.0, "pos"), lambda v: v, x), None

    return jax.lax.scan(body, 0.0, xs)[0]


COND_XS = np.array([1.0, -1.0, 2.0, -3.0, 4.0], np.float32)


def test_cond_in_scan_records_carry_the_iteration(
        streaming: str, recwarn: pytest.WarningsRecorder) -> None:
    # With the host callbacks the branch that does not run tells the host what it skipped:
    # the host's count, and so each record's step and index, stays that of the iteration.
    records = stream(jit(streaming)(lambda xs: cond_in_scan(xs)), COND_XS, calls=2)
    assert [(r.step, r.index) for r in records] == [
        (0, 0), (0, 2), (0, 4), (1, 0), (1, 2), (1, 4)]
    np.testing.assert_allclose([r.value for r in records], [2.0, 4.0, 8.0] * 2)
    assert not [w for w in recwarn if "inside a cond" in str(w.message)]


def test_scan_in_a_skipped_branch_skips_all_its_iterations(streaming: str) -> None:
    # A branch holding a scan of 3 skips 3 occurrences of its site; the other branch's site
    # is skipped once a run of the taken branch.
    def f(xs):
        def body(c, x):
            inner = lambda v: jax.lax.scan(  # noqa: E731
                lambda a, k: (a + sow(v * k, "inner"), None), 0.0, jnp.arange(1.0, 4.0))[0]
            return c + jax.lax.cond(x > 0, inner, lambda v: sow(v - 1.0, "other"), x), None

        return jax.lax.scan(body, 0.0, xs)[0]

    records = stream(jit(streaming)(f), COND_XS, calls=2)
    inner = [(r.step, r.index, float(r.value)) for r in records if r.name == "inner"]
    other = [(r.step, r.index, float(r.value)) for r in records if r.name == "other"]
    assert sorted(inner) == [(s, (i, k), COND_XS[i] * (k + 1)) for s in (0, 1)
                             for i in (0, 2, 4) for k in range(3)]
    assert sorted(other) == [(s, i, COND_XS[i] - 1.0) for s in (0, 1) for i in (1, 3)]


def test_switch_in_fori_loop_counts_every_branch_it_skips(streaming: str) -> None:
    # Three branches, two sites (one held by two branches): each site gets the iterations
    # whose branch held it.
    def f(x):
        branches = [lambda v: sow(v + 1.0, "ab"), lambda v: sow(v * 2.0, "ab"),
                    lambda v: sow(-v, "c")]
        return jax.lax.fori_loop(
            0, 6, lambda i, c: c + jax.lax.switch(i % 3, branches, x * i), 0.0)

    records = stream(jit(streaming)(f), jnp.float32(0.5), calls=2)
    ab = [(r.step, r.index, float(r.value)) for r in records if r.name == "ab"]
    c = [(r.step, r.index, float(r.value)) for r in records if r.name == "c"]
    want_ab = {0: 1.0, 1: 1.0, 3: 2.5, 4: 4.0}
    assert sorted(ab) == [(s, i, want_ab[i]) for s in (0, 1) for i in (0, 1, 3, 4)]
    assert sorted(c) == [(s, i, -0.5 * i) for s in (0, 1) for i in (2, 5)]


def test_a_skipped_branch_outside_loops_keeps_the_step(streaming: str) -> None:
    # Without at_step the host counts calls by occurrences: a call that skips the branch
    # still counts.
    fn = jit(streaming)(lambda x: jax.lax.cond(x > 0, lambda v: sow(v, "p"), lambda v: v * 0.0, x))
    with sowtel.enable(exporter="memory", summary="full") as session:
        for x in (1.0, -1.0, 2.0, -2.0, 3.0):
            jax.block_until_ready(fn(jnp.float32(x)))
        assert sowtel.flush(timeout=30)
    assert [(r.step, float(r.value)) for r in session.exporters[0].records] == [
        (0, 1.0), (2, 2.0), (4, 3.0)]


def test_cond_in_scan_every_n_at_a_device_step_keeps_indices() -> None:
    # Under a device at_step with every=2 the host applies every: the skipped branches are
    # counted on every step, logged or not.
    @jax.jit
    def step_fn(xs, step):
        with sowtel.at_step(step):
            return cond_in_scan(xs)

    with sowtel.enable(exporter="memory", summary="full", every=2) as session:
        for step in range(4):
            jax.block_until_ready(step_fn(COND_XS, jnp.int32(step)))
        assert sowtel.flush(timeout=30)
    records = sorted(session.exporters[0].records, key=lambda r: (r.step, r.index))
    assert [(r.step, r.index) for r in records] == [
        (0, 0), (0, 2), (0, 4), (2, 0), (2, 2), (2, 4)]
    np.testing.assert_allclose([r.value for r in records], [2.0, 4.0, 8.0] * 2)


def test_cond_in_scan_inside_shard_map_warns_that_indices_are_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each device counts its own occurrences, and a skipped branch does not say which device
    # skipped it: there the host callbacks still count, and say so.
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    monkeypatch.setattr(sowtel.primitive, "_warned_counted", set())
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))

    def per_device(v):
        def body(c, x):
            return c + jax.lax.cond(x > 0, lambda a: sow(a * 2.0, "shpos"), lambda a: a, x), None

        return jax.lax.scan(body, jnp.zeros_like(v[0]), v)[0][None]

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    with pytest.warns(UserWarning, match="'shpos' is inside a cond inside a scan inside "
                                         "shard_map"):
        records = stream(fn, np.tile(np.array([1.0, -1.0], np.float32), 8))
    # Each device ran the branch in its first iteration: one record each, none dropped.
    assert sorted(r.index for r in records) == [(k, 0) for k in range(8)]
    np.testing.assert_allclose([r.value for r in records], [2.0] * 8)


def test_scan_in_cond_does_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    def f(xs):
        return jax.lax.cond(xs[0] > 0, lambda v: jax.lax.scan(
            lambda c, x: (c + sow(x, "inner"), None), 0.0, v)[0], lambda v: 0.0, xs)

    records = stream(jax.jit(f), COND_XS)
    assert sorted(r.index for r in records) == [0, 1, 2, 3, 4]
    assert not [w for w in recwarn if "inside a cond inside a scan" in str(w.message)]


# -- vmap of a cond whose predicate is batched -----------------------------------------------

XS = np.array([0.3, -0.5, 0.2, 0.9], np.float32)
PRED = np.array([1.0, -1.0, 1.0, -1.0], np.float32)  # rows 0 and 2 take the true branch


def batched_cond(x, p, eps=None):
    return jax.lax.cond(p > 0, lambda v: jnp.sin(hook(v * 3.0, "t", eps)),
                        lambda v: v * 2.0, x)


def test_vmap_of_batched_cond_fills_rows_that_did_not_take_the_branch() -> None:
    _, inter = save_intermediates(jax.vmap(jax.grad(batched_cond)))(XS, PRED)
    taken = PRED > 0
    primal = np.asarray(inter["t"]["primal"])
    np.testing.assert_allclose(primal[taken], XS[taken] * 3.0, rtol=1e-6)
    # The rows that took the branch: the cotangent d(sin(t))/dt = cos(t), as jax.grad of a
    # perturbation at the site gives it for that row alone.
    cot = np.asarray(inter["t"]["cotangent"])
    for row in np.flatnonzero(taken):
        expected = jax.grad(lambda e, r=row: batched_cond(XS[r], PRED[r], {"t": e}))(0.0)
        np.testing.assert_allclose(cot[row], expected, rtol=1e-6)
    # The others did not run the branch: NaN, as the unbatched program reports them.
    assert np.isnan(primal[~taken]).all() and np.isnan(cot[~taken]).all()
    _, row1 = save_intermediates(jax.grad(batched_cond))(XS[1], PRED[1])
    assert np.isnan(row1["t"]["primal"]) and np.isnan(row1["t"]["cotangent"])


def test_vmap_of_batched_cond_integer_site_is_zero_where_not_taken() -> None:
    def f(x, p):
        return jax.lax.cond(p > 0, lambda v: sow(v.astype(jnp.int32) + 7, "k").sum() * 1.0,
                            lambda v: 0.0, x)

    _, inter = save_intermediates(jax.vmap(f))(XS, PRED)
    np.testing.assert_array_equal(inter["k"]["primal"], np.where(PRED > 0, 7, 0))


def test_vmap_of_batched_cond_joins_a_name_in_both_branches_into_one_site() -> None:
    def f(x, p):
        return jax.lax.cond(p > 0, lambda v: jnp.sum(sow(v + 1.0, "same") ** 2),
                            lambda v: jnp.sum(sow(v * 2.0, "same") ** 2), x)

    _, inter = save_intermediates(jax.vmap(jax.grad(f)))(XS, PRED)
    value = np.where(PRED > 0, XS + 1.0, XS * 2.0)
    assert list(inter) == ["same"]
    np.testing.assert_allclose(inter["same"]["primal"], value, rtol=1e-6)
    np.testing.assert_allclose(inter["same"]["cotangent"], 2.0 * value, rtol=1e-6)


def test_vmap_of_batched_switch_and_of_scan_over_a_cond() -> None:
    def g(x, i):
        return jax.lax.switch(i, [lambda v: sow(v + 1.0, "a"), lambda v: v * 2.0,
                                  lambda v: sow(v - 1.0, "b")], x)

    index = np.array([0, 1, 2, 0])
    _, inter = save_intermediates(jax.vmap(g))(XS, index)
    np.testing.assert_allclose(inter["a"]["primal"], np.where(index == 0, XS + 1.0, np.nan))
    np.testing.assert_allclose(inter["b"]["primal"], np.where(index == 2, XS - 1.0, np.nan))

    ks = np.array([1.0, -1.0, 2.0], np.float32)

    def f(x, p):
        def body(c, k):
            y = jax.lax.cond(p * k > 0, lambda v: sow(v * k, "t"), lambda v: v, x)
            return c + y, None

        return jax.lax.scan(body, 0.0, ks)[0]

    _, inter = save_intermediates(jax.vmap(jax.grad(f)))(XS, PRED)
    taken = (PRED[None, :] * ks[:, None]) > 0  # (iterations, batch)
    np.testing.assert_allclose(inter["t"]["primal"],
                               np.where(taken, XS[None, :] * ks[:, None], np.nan), rtol=1e-6)
    np.testing.assert_allclose(inter["t"]["cotangent"], np.where(taken, 1.0, np.nan))


def test_vmap_of_batched_cond_streams_nan_rows(streaming: str) -> None:
    records = stream(jit(streaming)(jax.vmap(jax.grad(batched_cond))), XS, PRED)
    by_mode = {r.mode: r for r in records}
    assert set(by_mode) == {"primal", "cotangent"}
    taken = PRED > 0
    for r in by_mode.values():
        assert r.shape == (4,)
        assert np.isnan(r.value[~taken]).all() and np.isfinite(r.value[taken]).all()
    np.testing.assert_allclose(by_mode["primal"].value[taken], XS[taken] * 3.0, rtol=1e-6)
    np.testing.assert_allclose(by_mode["cotangent"].value[taken], np.cos(XS[taken] * 3.0),
                               rtol=1e-5)


# -- custom_vjp backward sows are cotangents, wherever the bwd runs ---------------------------


def _clip_vjp(jit_bwd: bool) -> Callable[[Any], Any]:
    @jax.custom_vjp
    def clip(x):
        return x * 2.0

    def fwd(x):
        return sow(x * 2.0, "fwd"), None

    def bwd(_, ct):
        return (sow(ct * 0.5, "bwd"),)

    clip.defvjp(fwd, jax.jit(bwd) if jit_bwd else bwd)
    return clip


WRAPPERS: dict[str, Callable[[Callable[[Any], Any], Any], Any]] = {
    "plain": lambda g, x: jnp.sum(g(x) * 3.0),
    "jit": lambda g, x: jax.jit(lambda v: jnp.sum(g(v) * 3.0))(x),
    "checkpoint": lambda g, x: jax.checkpoint(lambda v: jnp.sum(g(v) * 3.0))(x),
    "cond": lambda g, x: jax.lax.cond(True, lambda v: jnp.sum(g(v) * 3.0),
                                      lambda v: jnp.sum(v), x),
    "scan": lambda g, x: jax.lax.scan(lambda c, v: (c + g(v) * 3.0, None), 0.0, x)[0],
    "fori": lambda g, x: jax.lax.fori_loop(
        0, 4, lambda i, c: c + g(x[i]) * 3.0, 0.0),
}


@pytest.mark.parametrize("jit_bwd", [False, True], ids=["bwd", "jitted_bwd"])
@pytest.mark.parametrize("where", list(WRAPPERS))
def test_custom_vjp_bwd_sow_is_a_cotangent(where: str, jit_bwd: bool) -> None:
    loss = WRAPPERS[where]
    g = _clip_vjp(jit_bwd)
    grads, inter = save_intermediates(jax.grad(lambda x: loss(g, x)))(XS)
    assert list(inter["fwd"]) == ["primal"] and list(inter["bwd"]) == ["cotangent"]
    # bwd gets the cotangent 3 of each output and returns half of it.
    np.testing.assert_allclose(inter["bwd"]["cotangent"], np.full(4, 1.5), rtol=1e-6)
    np.testing.assert_allclose(inter["fwd"]["primal"], XS * 2.0, rtol=1e-6)
    np.testing.assert_allclose(grads, np.full(4, 1.5), rtol=1e-6)


def test_custom_vjp_bwd_in_scan_streams_cotangents_with_their_index(streaming: str) -> None:
    g = _clip_vjp(jit_bwd=True)
    records = stream(jit(streaming)(jax.grad(lambda x: WRAPPERS["scan"](g, x))), XS)
    bwd = [r for r in records if r.name == "bwd"]
    assert {r.mode for r in bwd} == {"cotangent"}
    assert sorted(r.index for r in bwd) == [0, 1, 2, 3]
    assert all(r.step == 0 for r in bwd)
    for r in bwd:
        np.testing.assert_allclose(r.value, 1.5, rtol=1e-6)
    fwd = sorted((r for r in records if r.name == "fwd"), key=lambda r: r.index)
    assert [(r.mode, r.index) for r in fwd] == [("primal", i) for i in range(4)]
    np.testing.assert_allclose([r.value for r in fwd], XS * 2.0, rtol=1e-6)


# -- a custom_jvp function inside fori_loop(scan(...)) under grad ------------------------------


def test_custom_jvp_in_fori_of_scan_streams_iteration_pairs(streaming: str) -> None:
    @jax.custom_jvp
    def h(x):
        return sow(jnp.sin(x), "cj")

    h.defjvp(lambda p, t: (h(p[0]), jnp.cos(p[0]) * t[0]))
    xs = jnp.array([0.1, 0.2, 0.3])

    def f(x):
        def outer(i, c):
            return c + jax.lax.scan(lambda cc, xx: (cc + h(xx * (i + 1.0)), None), 0.0, x)[0]

        return jax.lax.fori_loop(0, 2, outer, 1.0)

    records = stream(jit(streaming)(jax.grad(f)), xs)
    got = sorted((r.index, r.step, float(r.value)) for r in records)
    expected = [((i, j), 0, float(np.sin(np.float32(xs[j]) * (i + 1))))
                for i in range(2) for j in range(3)]
    assert [(i, s) for i, s, _ in got] == [(i, s) for i, s, _ in expected]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in expected], rtol=1e-6)
    _, inter = save_intermediates(jax.grad(f))(xs)
    assert inter["cj"].stacked == {"primal": (("scan", 2), ("scan", 3))}


# -- lax.map(batch_size=b): one leading axis of the map's length -----------------------------
# (Its grad, one case per batch size: the map_batch cases of tests/transform_cases.py.)


def test_map_with_batch_size_inside_a_scan_keeps_the_outer_axis() -> None:
    def f(x):
        def outer(c, k):
            ys = jax.lax.map(lambda v: sow(v * k, "m"), x, batch_size=3)
            return c + ys.sum(), None

        return jax.lax.scan(outer, 0.0, jnp.array([1.0, 2.0]))[0]

    _, inter = save_intermediates(f)(jnp.arange(7.0))
    np.testing.assert_allclose(inter["m"]["primal"],
                               np.outer([1.0, 2.0], np.arange(7.0)), rtol=1e-6)
    assert inter["m"].stacked == {"primal": (("scan", 2), ("scan", 7))}


@pytest.mark.parametrize("b", [2, 5], ids=lambda b: f"batch{b}")
def test_map_with_batch_size_in_a_jitted_function_called_twice(b: int) -> None:
    # The jitted function is traced once: both calls hold the same sites, joined call by call.
    inner = jax.jit(lambda xs: jax.lax.map(lambda v: sow(v * 2.0, "m"), xs, batch_size=b))

    def f(xs):
        return inner(xs).sum() + 3.0 * inner(xs + 10.0).sum()

    xs = jnp.arange(5.0)
    _, inter = save_intermediates(jax.grad(f), duplicates="number")(xs)
    assert list(inter) == ["m_0", "m_1"]
    for name, shift, weight in (("m_0", 0.0, 1.0), ("m_1", 10.0, 3.0)):
        np.testing.assert_allclose(inter[name]["primal"], (np.arange(5.0) + shift) * 2.0)
        # The derivative of f with respect to the site: the weight of its call's sum.
        np.testing.assert_allclose(inter[name]["cotangent"], np.full(5, weight))
        assert inter[name].stacked == {"primal": (("scan", 5),), "cotangent": (("scan", 5),)}


@pytest.mark.parametrize("n", [5, 4], ids=["remainder", "divides"])
def test_map_with_batch_size_under_vmap_joins_the_maps_own_axis(n: int) -> None:
    # A vmap around the map puts its batch axis before the map's own; one inside it, after.
    # Either way the map's axis is the one joined: (n, B) like vmap of a scan.
    xs = np.arange(2.0 * n, dtype=np.float32).reshape(2, n)  # B = 2 rows, maps of n

    def loss(x, eps=None):
        ys = jax.lax.map(lambda v: hook(jnp.sin(v) * 2.0, "m", None if eps is None else
                                        {"m": eps["m"][jnp.int32(v) % n]}), x, batch_size=2)
        return jnp.sum(ys ** 2)

    around = lambda xs: jnp.sum(jax.vmap(loss)(xs))  # noqa: E731
    _, inter = save_intermediates(jax.grad(around))(xs)
    assert inter["m"].stacked == {"primal": (("scan", n),), "cotangent": (("scan", n),)}
    np.testing.assert_allclose(inter["m"]["primal"], np.sin(xs.T) * 2.0, rtol=1e-6)
    # Row b's cotangent at element i: jax.grad of a perturbation added there.
    eps = np.stack([jax.grad(lambda e, b=b: loss(xs[b], {"m": e}))(jnp.zeros(n))
                    for b in range(2)], axis=1)
    np.testing.assert_allclose(inter["m"]["cotangent"], eps, rtol=1e-6)

    inside = lambda x: jnp.sum(jax.lax.map(  # noqa: E731
        lambda v: jax.vmap(lambda u: sow(u * 2.0, "m"))(v), x, batch_size=2))
    _, inter = save_intermediates(inside)(xs.T)
    np.testing.assert_allclose(inter["m"]["primal"], xs.T * 2.0)
    assert inter["m"].stacked == {"primal": (("scan", n),)}


# -- vmap of a scan: the scan axis leads, the batch axis follows -----------------------------


def scanned(x):
    return jax.lax.scan(lambda c, v: (c + sow(v * 2.0, "s"), None), 0.0, x)[0]


def test_vmap_of_scan_stacks_iterations_then_batch() -> None:
    xs = np.arange(10.0, dtype=np.float32).reshape(2, 5)  # batch 2, 5 iterations
    for fn in (jax.vmap(scanned),
               lambda x: jax.lax.scan(lambda c, v: (c + jax.vmap(
                   lambda u: sow(u * 2.0, "s"))(v), None), jnp.zeros(2), x.T)[0]):
        _, inter = save_intermediates(fn)(xs)
        np.testing.assert_allclose(inter["s"]["primal"], xs.T * 2.0)  # (T, B)
        assert inter["s"].stacked == {"primal": (("scan", 5),)}
        records = sowtel.to_records.records_from_intermediates(inter, step=0, summary="full")
        assert [r.index for r in records] == list(range(5))
        assert all(r.shape == (2,) for r in records)
        np.testing.assert_allclose(records[3].value, xs[:, 3] * 2.0)


def test_vmap_of_scan_streams_one_record_per_iteration_with_the_batch(streaming: str) -> None:
    xs = np.arange(10.0, dtype=np.float32).reshape(2, 5)
    records = stream(jit(streaming)(jax.vmap(scanned)), xs)
    assert sorted(r.index for r in records) == list(range(5))
    for r in records:
        assert r.shape == (2,)
        np.testing.assert_allclose(r.value, xs[:, r.index] * 2.0)


# -- forward code that a custom_vjp bwd runs again: its primal is silent, its cotangent reports --
# (Its grad, captured and streamed: the vjp_rerun cases of tests/transform_cases.py.)


def checkpointed_while(x, eps=None, *, steps=3, checkpoints=None):
    """Equinox's checkpointed while loop (diffrax's default adjoint): its bwd re-runs the body
    (a closure-converted jaxpr) under ``jax.vjp``, from checkpoints."""
    import equinox.internal as eqxi

    def body(c):
        i, h = c
        h = jnp.sin(h) * 1.5
        return i + 1, (sow(h, "h") if eps is None else h + eps[i])

    _, h = eqxi.while_loop(lambda c: c[0] < steps, body, (0, x), max_steps=steps,
                           kind="checkpointed", checkpoints=checkpoints)
    return jnp.sum(h ** 2)


def unrolled(x, eps, steps):
    """The same loop in plain Python: the reference for values and cotangents."""
    hs = []
    h = x
    for i in range(steps):
        h = jnp.sin(h) * 1.5 + eps[i]
        hs.append(h)
    return jnp.sum(h ** 2), hs


def loop_reference(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Per iteration: the value sown, and its cotangent (jax.grad of a perturbation there)."""
    eps = jnp.zeros((steps, 2))
    values = np.stack(unrolled(XS[:2], eps, steps)[1])
    cotangents = np.asarray(jax.grad(lambda e: unrolled(XS[:2], e, steps)[0])(eps))
    return values, cotangents


LOOPS = {"all_checkpointed": (3, None), "recomputing": (5, 2)}


def _rows(records: list[Record]) -> np.ndarray:
    """The records' values, ordered by value (a while body's records carry no index)."""
    values = np.stack([np.asarray(r.value) for r in records])
    return values[np.lexsort(values.T[::-1])]


def _ordered(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_checkpointed_while_loop_captures_each_site_once(loop: str) -> None:
    steps, checkpoints = LOOPS[loop]
    f = lambda x: checkpointed_while(x, steps=steps, checkpoints=checkpoints)  # noqa: E731
    grads, inter = save_intermediates(jax.grad(f))(XS[:2])  # duplicates="error"
    values, cotangents = loop_reference(steps)
    assert list(inter) == ["h"] and list(inter["h"]) == ["primal", "cotangent"]
    # A while body's value is its last iteration's, and its cotangent that value's: the first
    # one the backward pass computes (it runs the iterations last first).
    np.testing.assert_allclose(inter["h"]["primal"], values[-1], rtol=1e-5)
    np.testing.assert_allclose(inter["h"]["cotangent"], cotangents[-1], rtol=1e-5)
    np.testing.assert_allclose(grads, jax.grad(lambda x: unrolled(
        x, jnp.zeros((steps, 2)), steps)[0])(XS[:2]), rtol=1e-5)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_checkpointed_while_loop_streams_each_iteration_once(streaming: str, loop: str) -> None:
    steps, checkpoints = LOOPS[loop]
    f = lambda x: checkpointed_while(x, steps=steps, checkpoints=checkpoints)  # noqa: E731
    records = stream(jit(streaming)(jax.grad(f)), XS[:2])
    values, cotangents = loop_reference(steps)
    assert {r.name for r in records} == {"h"}
    primal, cotangent = by(records, "primal"), by(records, "cotangent")
    assert len(primal) == steps and len(cotangent) == steps  # not once per recomputation
    np.testing.assert_allclose(_rows(primal), _ordered(values), rtol=1e-5)
    np.testing.assert_allclose(_rows(cotangent), _ordered(cotangents), rtol=1e-5)


def test_hessian_through_a_bwd_rerunning_the_forward_function_reports_each_mode_once() -> None:
    # Forward over reverse: the outer jvp differentiates the bwd, recomputation included; each
    # mode is the one the same function gives without the custom_vjp.
    def plain(x):
        return jnp.sum((jnp.cos(sow(jnp.sin(x) * 1.5, "h")) * 2.0) ** 2)

    _, got = save_intermediates(jax.hessian(rerun_loss))(XS)
    _, want = save_intermediates(jax.hessian(plain))(XS)
    assert list(got["h"]) == list(want["h"]) == ["primal", "tangent", "cotangent",
                                                 "cotangent.tangent"]
    for mode, value in want["h"].items():
        np.testing.assert_allclose(got["h"][mode], value, rtol=1e-5, atol=1e-6, err_msg=mode)


# -- the two transports give the same records: names, modes, steps and indices ---------------


def ode_loss(k):
    """``odeint``: a custom_vjp whose fwd runs a scan of while loops of a fori_loop (the six
    Runge-Kutta stages, a scan of length 6), and whose bwd runs ``odeint`` again backward
    under ``jax.vjp`` of the vector field, in a scan; ``closure_convert`` traces the vector field
    once, outside all of them."""
    from jax.experimental.ode import odeint

    def field(y, t, k):
        return sow(-k * y + jnp.sin(t), "f")

    return jnp.sum(odeint(field, jnp.array([1.0, 2.0]), jnp.array([0.0, 0.5, 1.0]), k) ** 2)


def _step(y, k):
    return y + 0.1 * sow(-k * y, "dy")


@jax.custom_vjp
def relax(y0, k):
    """Four Euler steps in a while loop, then three in a scan."""
    _, y = jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, _step(c[1], k)), (0, y0))
    return jax.lax.scan(lambda y, _: (_step(y, k), None), y, None, length=3)[0]


def _relax_fwd(y0, k):
    return relax(y0, k), (y0, k)


def _relax_bwd(res, g):
    """Recomputes the trajectory in a while loop (the primal of ``jax.vjp``, unused), then
    walks it back in a reversed scan with ``jax.vjp`` of each step; sows its own cotangent."""
    y0, k = res

    def again(c):
        i, y, ys = c
        return i + 1, jax.vjp(_step, y, k)[0], ys.at[i].set(y)

    _, _, ys = jax.lax.while_loop(lambda c: c[0] < 7, again, (0, y0, jnp.zeros((7, 2))))

    def back(carry, y):
        gy, gk = carry
        dy, dk = jax.vjp(_step, y, k)[1](gy)
        return (dy, gk + dk), None

    (gy, gk), _ = jax.lax.scan(back, (g, jnp.zeros_like(k)), ys, reverse=True)
    return gy, sow(gk, "gk")


relax.defvjp(_relax_fwd, _relax_bwd)


def relax_loss(k):
    return jnp.sum(relax(jnp.array([1.0, 2.0]), k) ** 2)


SOLVERS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "odeint": (jax.grad(ode_loss), (jnp.float32(0.7),)),
    "odeint_forward": (ode_loss, (jnp.float32(0.7),)),
    "custom_vjp_while_scan": (jax.grad(relax_loss), (jnp.float32(0.7),)),
    "checkpointed_while": (jax.grad(lambda x: checkpointed_while(x, steps=5, checkpoints=2)),
                           (XS[:2],)),
}


def _stream_at_step(fn: Callable[..., Any], *args: Any) -> list[Record]:
    # The host's step: sites in while bodies count no steps.
    return stream(fn, *args, at_step=3)


def _by_key(records: list[Record]) -> dict[tuple[Any, ...], list[np.ndarray]]:
    out: dict[tuple[Any, ...], list[np.ndarray]] = {}
    for r in records:
        key = (r.name, r.mode, r.step, r.index, r.shape, r.dtype)
        out.setdefault(key, []).append(np.asarray(r.value, np.float64))
    return out


@pytest.mark.parametrize("path", ["fast", "debug"])
@pytest.mark.parametrize("case", sorted(SOLVERS))
def test_solvers_stream_the_same_records_through_both_transports(
        case: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args = SOLVERS[case]
    jit_of(path, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the repeated names' warning, once per process
        by_callback = _by_key(_stream_at_step(jax.jit(lambda *a: fn(*a)), *args))
        by_outputs = _by_key(_stream_at_step(sowtel.jit(lambda *a: fn(*a)), *args))
    assert by_callback, "the case streams something"
    assert {k: len(v) for k, v in by_outputs.items()} == {
        k: len(v) for k, v in by_callback.items()}
    for key, values in by_callback.items():
        # Records of one key (a while body's iterations) may arrive in any order.
        order = lambda vs: sorted(vs, key=lambda v: (float(v.sum()), float(v.flat[0])))  # noqa: E731
        np.testing.assert_allclose(np.stack(order(by_outputs[key])), np.stack(order(values)),
                                   rtol=1e-5, atol=1e-6, err_msg=str(key))


@pytest.mark.parametrize("unroll", [1, 5, True], ids=lambda u: f"unroll{u}")
def test_unrolled_scan_indexes_its_iterations_not_a_while_loop_in_its_body(
        streaming: str, unroll: Any) -> None:
    # JAX lowers a scan as a while loop of its own, or (unrolled whole) as none: a while_loop
    # in its body is never taken for it.
    def f(xs):
        def body(c, x):
            w = jax.lax.while_loop(lambda v: v < 2.0, lambda v: v + sow(x * 0.0 + 1.0, "w"),
                                   0.0)
            return c + sow(x * 2.0, "s") + w, None

        return jax.lax.scan(body, 0.0, xs, unroll=unroll)[0]

    records = stream(jit(streaming)(f), np.arange(5.0, dtype=np.float32))
    assert sorted(r.index for r in records if r.name == "s") == list(range(5))
    for r in records:
        np.testing.assert_allclose(r.value, 2.0 * r.index if r.name == "s" else 1.0)
    assert [r.index for r in records if r.name == "w"] == [None] * 10


def test_odeint_sites_are_indexed_by_the_loops_they_run_in() -> None:
    # The vector field is traced once, outside every loop, and evaluated in the Runge-Kutta
    # stages' scan (index 0-5) inside the adaptive while loop, and in the backward scan over
    # the output times (index 0-1): records are indexed where the site runs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = _stream_at_step(jax.jit(jax.grad(ode_loss)), jnp.float32(0.7))
    stages = [r for r in records if r.mode == "primal" and r.index is not None]
    assert stages and {r.index for r in stages} == set(range(6))
    assert len({r.name for r in stages}) == 1
    backward: dict[str, set[Any]] = {}
    for r in records:
        if r.mode == "cotangent":
            backward.setdefault(r.name, set()).add(r.index)
    # The backward odeint's stages (in its while loop), and its two evaluations outside the
    # while loop, once per output time in the backward scan.
    assert sorted(map(sorted, backward.values())) == [[0, 1], [0, 1], list(range(6))]
    outside = {r.name for r in records if r.mode == "primal" and r.index is None}
    assert len(outside) == 2  # the first evaluation and the initial step size's
