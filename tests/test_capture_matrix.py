"""The transform matrix of save_intermediates.

Every case is one function written once with a hook at each site. With ``eps=None`` the hook is
``sowtel.sow``; with ``eps`` a dict it adds an explicit perturbation instead. So:

- primals are checked against values derived by hand (numpy, written separately per case);
- cotangents against ``jax.grad`` with respect to a zero perturbation at the same point;
- tangents against central finite differences of the captured primal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sowtel
from sowtel import save_intermediates, sow

X = np.array([0.3, -0.7, 1.1, 0.5], np.float32)
T = np.array([1.0, 0.5, -0.25, 2.0], np.float32)


def site(h: Any, name: str, eps: Any, i: Any = None) -> Any:
    if eps is None:
        return sow(h, name)
    e = eps[name]
    return h + (e if i is None else e[i])


@dataclasses.dataclass
class Case:
    fn: Callable[[Any, Any], Any]  # (x, eps) -> scalar loss
    primal: Callable[[np.ndarray], dict[str, np.ndarray]]  # hand-derived sown values
    grad: bool = True  # reverse mode applies
    jvp: bool = True  # forward mode applies (JAX has no jvp of custom_vjp)
    # The cotangent reaches the site (not inside a custom_vjp fwd, whose bwd is the user's).
    cotangent: bool = True
    x: np.ndarray = dataclasses.field(default_factory=lambda: X)


# -- the cases ------------------------------------------------------------------------------


def plain_fn(x, eps):
    h = site(jnp.sin(x) * 2.0, "h", eps)
    return jnp.sum(h**2)


def plain_ref(x):
    return {"h": np.sin(x) * 2.0}


def jit_inside_fn(x, eps):
    return jax.jit(plain_fn)(x, eps)


def scan_fn(x, eps):
    def body(c, xi):
        xt, i = xi
        h = site(jnp.tanh(c * xt + 0.1), "s", eps, i)
        return c + h, h

    c, _ = jax.lax.scan(body, jnp.float32(1.0), (x, jnp.arange(x.shape[0])))
    return c**2


def scan_ref(x):
    c, hs = np.float32(1.0), []
    for xt in x:
        h = np.tanh(c * xt + 0.1)
        hs.append(h)
        c = c + h
    return {"s": np.array(hs)}


def reverse_scan_fn(x, eps):
    def body(c, xi):
        xt, i = xi
        h = site(jnp.sin(c + xt), "r", eps, i)
        return c * 0.5 + h, None

    c, _ = jax.lax.scan(body, jnp.float32(0.2), (x, jnp.arange(x.shape[0])), reverse=True)
    return c**2


def reverse_scan_ref(x):
    c, hs = np.float32(0.2), [None] * len(x)
    for i in reversed(range(len(x))):
        h = np.sin(c + x[i])
        hs[i] = h
        c = c * 0.5 + h
    return {"r": np.array(hs)}


def fori_fn(x, eps):
    def body(i, c):
        return c + site(jnp.cos(c) * jnp.asarray(x)[i], "f", eps, i)

    return jax.lax.fori_loop(0, x.shape[0], body, jnp.float32(0.5)) ** 2


def fori_ref(x):
    c, hs = np.float32(0.5), []
    for xi in x:
        h = np.cos(c) * xi
        hs.append(h)
        c = c + h
    return {"f": np.array(hs)}


def map_fn(x, eps):
    def f(xi):
        xv, i = xi
        return site(xv**3, "m", eps, i)

    return jnp.sum(jax.lax.map(f, (x, jnp.arange(x.shape[0]))) ** 2)


def map_ref(x):
    return {"m": x**3}


def nested_scan_fn(x, eps):
    xs = jnp.asarray(x).reshape(2, 2)

    def outer(c, row_i):
        row, i = row_i

        def inner(c2, xj):
            xv, j = xj
            h = site(jnp.sin(c2 + xv), "n", eps, None if eps is None else (i, j))
            return c2 + h, None

        c, _ = jax.lax.scan(inner, c, (row, jnp.arange(2)))
        return c, None

    c, _ = jax.lax.scan(outer, jnp.float32(0.1), (xs, jnp.arange(2)))
    return c**2


def nested_scan_ref(x):
    c, hs = np.float32(0.1), np.zeros((2, 2), np.float32)
    for i in range(2):
        for j in range(2):
            h = np.sin(c + x[2 * i + j])
            hs[i, j] = h
            c = c + h
    return {"n": hs}


def while_fn(x, eps):
    def body(state):
        k, v = state
        v = site(v * 1.5, "w", eps)
        return k + 1, v

    _, v = jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))
    return jnp.sum(v)


def while_ref(x):
    return {"w": x * 1.5**3}


def cond_fn(x, eps):
    def yes(x):
        return site(x * 2.0, "yes", eps)

    def no(x):
        return site(x * 3.0, "no", eps)

    return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, yes, no, x) ** 2)


def cond_ref(x):
    nan = np.full_like(x, np.nan)
    return {"yes": x * 2.0, "no": nan} if x.sum() > 0 else {"yes": nan, "no": x * 3.0}


def switch_fn(x, eps):
    branches = [lambda x: site(x + 1.0, "b0", eps), lambda x: site(x * x, "b1", eps),
                lambda x: site(-x, "b2", eps)]
    return jnp.sum(jax.lax.switch(1, branches, x) ** 2)


def switch_ref(x):
    nan = np.full_like(x, np.nan)
    return {"b0": nan, "b1": x * x, "b2": nan}


def checkpoint_fn(x, eps):
    @jax.checkpoint
    def block(x):
        return jnp.sin(site(jnp.tanh(x) * 3.0, "c", eps))

    return jnp.sum(block(x) ** 2)


def checkpoint_ref(x):
    return {"c": np.tanh(x) * 3.0}


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


@_softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus(x), t * jax.nn.sigmoid(x)


def custom_jvp_fn(x, eps):
    return jnp.sum(_softplus(site(x * 2.0, "cj", eps)) ** 2)


def custom_jvp_ref(x):
    return {"cj": x * 2.0}


def custom_vjp_fn(x, eps):
    # The perturbation is an argument of the custom_vjp function: it may not close over tracers.
    use_sow = eps is None
    e = jnp.zeros_like(x) if use_sow else eps["fwd"]

    def hooked(y, e):
        return sow(y, "fwd") if use_sow else y + e

    @jax.custom_vjp
    def scale(x, e):
        return hooked(x * 3.0, e)

    def fwd(x, e):
        return hooked(x * 3.0, e), None

    def bwd(_, ct):
        return ct * 3.0, ct

    scale.defvjp(fwd, bwd)
    return jnp.sum(scale(x, e) ** 2)


def custom_vjp_ref(x):
    return {"fwd": x * 3.0}


CASES: dict[str, Case] = {
    "plain": Case(plain_fn, plain_ref),
    "jit_inside": Case(jit_inside_fn, plain_ref),
    "scan": Case(scan_fn, scan_ref),
    "scan_reverse": Case(reverse_scan_fn, reverse_scan_ref),
    "fori_loop": Case(fori_fn, fori_ref),
    "lax_map": Case(map_fn, map_ref),
    "nested_scan": Case(nested_scan_fn, nested_scan_ref),
    "while_body": Case(while_fn, while_ref, grad=False),
    "cond": Case(cond_fn, cond_ref),
    "cond_other_branch": Case(cond_fn, cond_ref, x=-X - 1.0),
    "switch": Case(switch_fn, switch_ref),
    "checkpoint": Case(checkpoint_fn, checkpoint_ref),
    "custom_jvp": Case(custom_jvp_fn, custom_jvp_ref),
    "custom_vjp": Case(custom_vjp_fn, custom_vjp_ref, jvp=False, cotangent=False),
}


def _assert_primals(inter: dict, ref: dict[str, np.ndarray]) -> None:
    assert set(inter) == set(ref)
    for name, value in ref.items():
        np.testing.assert_allclose(np.asarray(inter[name]["primal"]), value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def _zero_eps(inter: dict) -> dict[str, Any]:
    return {n: jnp.zeros_like(jnp.nan_to_num(m["primal"])) for n, m in inter.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_plain_call(name: str) -> None:
    case = CASES[name]
    out, inter = save_intermediates(lambda x: case.fn(x, None))(case.x)
    np.testing.assert_allclose(out, case.fn(case.x, _zero_eps(inter)), rtol=1e-6)
    _assert_primals(inter, case.primal(case.x))
    assert all(list(m) == ["primal"] for m in inter.values())


@pytest.mark.parametrize("jit_outside", [False, True], ids=["eager", "jit_outside"])
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.grad])
def test_grad_cotangent_equals_grad_of_perturbation(name: str, jit_outside: bool) -> None:
    case = CASES[name]
    wrapped = save_intermediates(jax.grad(lambda x: case.fn(x, None)))
    if jit_outside:
        wrapped = jax.jit(wrapped)
    g, inter = wrapped(case.x)
    _assert_primals(inter, case.primal(case.x))
    np.testing.assert_allclose(g, jax.grad(case.fn)(case.x, _zero_eps(inter)), rtol=1e-5)
    expected = jax.grad(lambda e: case.fn(case.x, e))(_zero_eps(inter))
    if not case.cotangent:
        assert all(list(m) == ["primal"] for m in inter.values())
        return
    for n, cot in expected.items():
        got = np.asarray(inter[n]["cotangent"])
        ran = ~np.isnan(np.asarray(inter[n]["primal"]))
        # A site whose branch did not run has a NaN cotangent too; where it ran, it must match.
        np.testing.assert_allclose(got[ran], np.asarray(cot)[ran], rtol=1e-5, atol=1e-6,
                                   err_msg=n)
        assert np.isnan(got[~ran]).all()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.jvp])
def test_jvp_tangent_equals_finite_differences(name: str) -> None:
    case = CASES[name]
    (y, ty), inter = save_intermediates(
        lambda x, t: jax.jvp(lambda x: case.fn(x, None), (x,), (t,)))(case.x, T)
    assert all(set(m) == {"primal", "tangent"} for m in inter.values())
    delta = 1e-3
    plus = save_intermediates(lambda x: case.fn(x, None))(case.x + delta * T)[1]
    minus = save_intermediates(lambda x: case.fn(x, None))(case.x - delta * T)[1]
    for n in inter:
        fd = (np.asarray(plus[n]["primal"], np.float64)
              - np.asarray(minus[n]["primal"], np.float64)) / (2 * delta)
        got = np.asarray(inter[n]["tangent"])
        ran = ~np.isnan(np.asarray(inter[n]["primal"]))
        np.testing.assert_allclose(got[ran], fd[ran], rtol=2e-2, atol=2e-3, err_msg=n)


def test_value_and_grad_vjp_linearize_keys() -> None:
    f = lambda x: plain_fn(x, None)  # noqa: E731
    (v, g), inter = save_intermediates(jax.value_and_grad(f))(X)
    assert list(inter["h"]) == ["primal", "cotangent"]
    expected_ct = jax.grad(lambda e: plain_fn(X, e))({"h": jnp.zeros(4)})["h"]
    np.testing.assert_allclose(inter["h"]["cotangent"], expected_ct, rtol=1e-6)

    def vjp_call(x, ct):
        y, pullback = jax.vjp(f, x)
        return pullback(ct)

    _, inter = save_intermediates(vjp_call)(X, jnp.float32(2.0))
    np.testing.assert_allclose(inter["h"]["cotangent"], 2 * expected_ct, rtol=1e-6)

    def linearized(x, t):
        y, f_jvp = jax.linearize(f, x)
        return f_jvp(t)

    _, inter = save_intermediates(linearized)(X, T)
    np.testing.assert_allclose(inter["h"]["tangent"], 2 * np.cos(X) * T, rtol=1e-5)
    assert set(inter["h"]) == {"primal", "tangent"}


def test_hessian_and_jvp_of_grad_compose_modes() -> None:
    f = lambda x: plain_fn(x, None)  # noqa: E731
    _, inter = save_intermediates(jax.hessian(f))(X)
    assert set(inter["h"]) == {"primal", "tangent", "cotangent", "cotangent.tangent"}
    # jacfwd(jacrev): tangents and cotangents are batched over the basis (leading axes).
    np.testing.assert_allclose(inter["h"]["primal"], 2 * np.sin(X), rtol=1e-6)

    def jvp_of_grad(x, t):
        return jax.jvp(jax.grad(f), (x,), (t,))

    _, inter = save_intermediates(jvp_of_grad)(X, T)
    assert set(inter["h"]) == {"primal", "tangent", "cotangent", "cotangent.tangent"}
    # cotangent of h is 2h; its tangent along t is 2 * dh = 2 * 2cos(x) t.
    np.testing.assert_allclose(inter["h"]["cotangent"], 4 * np.sin(X), rtol=1e-5)
    np.testing.assert_allclose(inter["h"]["cotangent.tangent"], 4 * np.cos(X) * T, rtol=1e-5)
    np.testing.assert_allclose(inter["h"]["tangent"], 2 * np.cos(X) * T, rtol=1e-5)


def test_vmap_inside_and_outside_put_batch_axis_first() -> None:
    xs = np.stack([X, 2 * X, -X])
    f = lambda x: plain_fn(x, None)  # noqa: E731
    _, inside = save_intermediates(jax.vmap(f))(xs)
    _, outside = jax.vmap(save_intermediates(f))(xs)
    for inter in (inside, outside):
        np.testing.assert_allclose(inter["h"]["primal"], 2 * np.sin(xs), rtol=1e-6)
    _, inside_grad = save_intermediates(jax.vmap(jax.grad(f)))(xs)
    np.testing.assert_allclose(inside_grad["h"]["cotangent"], 4 * np.sin(xs), rtol=1e-5)
    # vmap in axis 1: the batch axis still comes first.
    _, inter = save_intermediates(jax.vmap(f, in_axes=1))(xs.T)
    np.testing.assert_allclose(inter["h"]["primal"], 2 * np.sin(xs), rtol=1e-6)


# -- a pytree whose leaves vmap batches differently -------------------------------------------

XS = np.stack([X, 2 * X, -X])
S = np.float32(0.8)


def mixed_row(x, s, eps=None):
    """One row: a site holding a batched leaf (from ``x``) and an unbatched one (from ``s``)."""
    if eps is None:
        a, b = sow((x * 2.0, jnp.sin(s)), "pair")
    else:
        a, b = x * 2.0 + eps[0], jnp.sin(s) + eps[1]
    return a * b**2


def test_vmap_keeps_each_leaf_batched_as_it_was() -> None:
    # The identity keeps out_axes=None valid for the unbatched leaf (it used to be batched).
    f = jax.vmap(lambda x, s: sow((x * 2, s + 1), "pair"), in_axes=(0, None),
                 out_axes=(0, None))
    for wrapped in (save_intermediates(f), jax.jit(save_intermediates(f))):
        (a, b), inter = wrapped(XS, S)
        np.testing.assert_allclose(a, 2 * XS, rtol=1e-6)
        np.testing.assert_allclose(b, S + 1, rtol=1e-6)
        got_a, got_b = inter["pair"]["primal"]
        # The unbatched leaf is captured as the program holds it: once, without a batch axis.
        assert got_a.shape == (3, 4) and got_b.shape == ()
        np.testing.assert_allclose(got_b, S + 1, rtol=1e-6)


def test_mixed_pytree_cotangents_equal_grad_of_perturbation() -> None:
    def loss(xs, s):  # vmap inside grad
        return jnp.sum(jax.vmap(mixed_row, in_axes=(0, None))(xs, s) ** 2)

    def loss_eps(ea, eb):  # the batched leaf's perturbation per row, the other's shared
        rows = jax.vmap(lambda x, e: mixed_row(x, S, (e, eb)))(XS, ea)
        return jnp.sum(rows**2)

    _, inter = save_intermediates(jax.grad(loss, argnums=(0, 1)))(XS, S)
    ga, gb = jax.grad(loss_eps, argnums=(0, 1))(jnp.zeros_like(XS), jnp.float32(0))
    ca, cb = inter["pair"]["cotangent"]
    assert ca.shape == (3, 4) and cb.shape == ()  # the unbatched leaf: the rows' sum
    np.testing.assert_allclose(ca, ga, rtol=1e-5)
    np.testing.assert_allclose(cb, gb, rtol=1e-5)

    def row_loss(x, s):  # vmap outside grad: each row's own cotangents
        return jnp.sum(mixed_row(x, s) ** 2)

    def row_loss_eps(x, ea, eb):
        return jnp.sum(mixed_row(x, S, (ea, eb)) ** 2)

    _, inter = save_intermediates(
        jax.vmap(jax.grad(row_loss, argnums=(0, 1)), in_axes=(0, None)))(XS, S)
    ga, gb = jax.vmap(jax.grad(row_loss_eps, argnums=(1, 2)))(
        XS, jnp.zeros_like(XS), jnp.zeros(3))
    a, b = inter["pair"]["primal"]
    ca, cb = inter["pair"]["cotangent"]
    assert (a.shape, b.shape, ca.shape, cb.shape) == ((3, 4), (), (3, 4), (3,))
    np.testing.assert_allclose(ca, ga, rtol=1e-5)
    np.testing.assert_allclose(cb, gb, rtol=1e-5)

    # A cotangent the same for every row of a batched primal keeps the primal's shape.
    def linear(x, s):
        a, b = sow((x * 2.0, s + 1.0), "lin")
        return jnp.sum(a) + 3.0 * b

    _, inter = save_intermediates(
        jax.vmap(jax.grad(linear, argnums=(0, 1)), in_axes=(0, None)))(XS, S)
    ca, cb = inter["lin"]["cotangent"]
    np.testing.assert_allclose(ca, np.ones_like(XS))
    np.testing.assert_allclose(cb, 3.0)


def test_mixed_pytree_tangents_under_jvp_and_vmap() -> None:
    tx, ts = np.full_like(XS, 0.3), np.float32(0.5)

    def ref(xs, s):  # the sown values, with no sowtel
        return 2.0 * xs, jnp.sin(s)

    want = jax.jvp(ref, (XS, S), (tx, ts))[1]
    fv = lambda xs, s: jax.vmap(mixed_row, in_axes=(0, None))(xs, s)  # noqa: E731
    _, inter = save_intermediates(lambda *a: jax.jvp(fv, a[:2], a[2:]))(XS, S, tx, ts)
    ta, tb = inter["pair"]["tangent"]
    assert ta.shape == (3, 4) and tb.shape == ()
    np.testing.assert_allclose(ta, want[0], rtol=1e-6)
    np.testing.assert_allclose(tb, want[1], rtol=1e-6)

    # vmap outside jvp, the unbatched leaf's tangent unbatched too: out_axes=None holds.
    g = jax.vmap(lambda x, s, t: jax.jvp(lambda s: sow((x * 2.0, jnp.sin(s)), "p")[1], (s,),
                                         (t,)), in_axes=(0, None, None), out_axes=None)
    (value, tangent), inter = save_intermediates(g)(XS, S, ts)
    np.testing.assert_allclose(tangent, np.cos(S) * ts, rtol=1e-6)
    ta, tb = inter["p"]["tangent"]
    assert ta.shape == (3, 4) and tb.shape == ()  # the batched primal's tangent: its shape
    np.testing.assert_allclose(ta, 0.0)
    np.testing.assert_allclose(tb, np.cos(S) * ts, rtol=1e-6)


def test_mixed_pytree_in_scan_cond_and_map_under_vmap() -> None:
    def scanned(x, s):
        def body(c, i):
            h, k = sow((jnp.tanh(c * x), s * (i + 1.0)), "step")
            return c + h * k, None

        return jax.lax.scan(body, jnp.full(4, 0.5), jnp.arange(2.0))[0]

    out, inter = save_intermediates(jax.vmap(scanned, in_axes=(0, None)))(XS, S)
    h, k = inter["step"]["primal"]
    assert h.shape == (2, 3, 4) and k.shape == (2,)  # (T, B, ...) and (T, ...)
    np.testing.assert_allclose(k, [S, 2 * S], rtol=1e-6)
    c = np.full_like(XS, 0.5)
    for i in range(2):
        np.testing.assert_allclose(h[i], np.tanh(c * XS), rtol=1e-5)
        c = c + np.tanh(c * XS) * S * (i + 1)
    np.testing.assert_allclose(out, c, rtol=1e-5)

    # A cond whose predicate vmap batches runs both branches on every row: there the site
    # gives every leaf the batch axis, rows of the other branch filled with NaN.
    def branchy(x, s):
        return jax.lax.cond(x[0] > 0, lambda: sow((x + 1.0, s * 2.0), "yes")[0], lambda: x)

    _, inter = save_intermediates(jax.vmap(branchy, in_axes=(0, None)))(XS, S)
    a, b = inter["yes"]["primal"]
    taken = XS[:, 0] > 0
    np.testing.assert_allclose(a[taken], XS[taken] + 1.0, rtol=1e-6)
    np.testing.assert_allclose(b, np.where(taken, 2 * S, np.nan), rtol=1e-6)

    # lax.map(batch_size=...) gives every leaf the map's axis, as a lax.map without batches.
    xs6 = np.concatenate([XS, XS[::-1]])

    def mapped(batch_size):
        def f(x):
            a, b = sow((x * 2.0, S + 1.0), "m")
            return a * b

        return lambda xs: jax.lax.map(f, xs, batch_size=batch_size)

    for size in (2, 4):
        _, inter = save_intermediates(mapped(size))(xs6)
        _, whole = save_intermediates(mapped(None))(xs6)
        for got, want in zip(inter["m"]["primal"], whole["m"]["primal"], strict=True):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_checkpoint_reports_primal_once_and_keeps_no_residual() -> None:
    f = lambda x: checkpoint_fn(x, None)  # noqa: E731
    _, inter = save_intermediates(jax.grad(f))(X)
    assert list(inter) == ["c"]  # the recomputation did not add a second "c"
    # The sown value is rematerialised, not saved: the forward pass saves only its input.
    with sowtel.enable(exporter="memory"):
        text = str(jax.make_jaxpr(jax.grad(f))(X))
    # The forward sow streams; the backward pass recomputes it silently, with no residual.
    assert text.count("recompute=False") == 2  # primal and cotangent
    assert text.count("recompute=True") == 1


def test_shard_map_and_pmap_stack_per_shard() -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))

    def body(x):
        return sow(jnp.sin(x) * 2.0, "sm")

    f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    loss = lambda x: jnp.sum(f(x) ** 2)  # noqa: E731
    g, inter = save_intermediates(jax.grad(loss))(x)
    xv = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    np.testing.assert_allclose(np.asarray(inter["sm"]["primal"]), 2 * np.sin(xv), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(inter["sm"]["cotangent"]), 4 * np.sin(xv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), (8 * np.sin(xv) * np.cos(xv)).ravel(), rtol=1e-5)

    _, inter = save_intermediates(jax.pmap(lambda v: sow(v * 3.0, "pm")))(xv)
    np.testing.assert_allclose(np.asarray(inter["pm"]["primal"]), 3 * xv, rtol=1e-6)
    assert inter["pm"]["primal"].shape == (8, 2)


def test_pytrees_and_static_arguments() -> None:
    def pipeline_a(x):
        return {"y": jnp.sin(x), "z": x * 2.0}

    def pipeline_b(d):
        return jnp.sum(d["y"] * d["z"])

    def pipeline(x):
        return pipeline_b(sow(pipeline_a(x), "mid"))

    for wrapped in (save_intermediates(pipeline), jax.jit(save_intermediates(pipeline))):
        out, inter = wrapped(X)
        assert set(inter["mid"]["primal"]) == {"y", "z"}
        np.testing.assert_allclose(inter["mid"]["primal"]["y"], np.sin(X), rtol=1e-6)
    _, inter = save_intermediates(jax.grad(pipeline))(X)
    ct = inter["mid"]["cotangent"]
    np.testing.assert_allclose(ct["y"], 2 * X, rtol=1e-6)  # d/dy sum(y z) = z
    np.testing.assert_allclose(ct["z"], np.sin(X), rtol=1e-6)
    (_, tangent_out), inter = save_intermediates(
        lambda x, t: jax.jvp(pipeline, (x,), (t,)))(X, T)
    np.testing.assert_allclose(inter["mid"]["tangent"]["y"], np.cos(X) * T, rtol=1e-6)
    np.testing.assert_allclose(inter["mid"]["tangent"]["z"], 2 * T, rtol=1e-6)
    _, inter = save_intermediates(lambda x, ct: jax.vjp(pipeline, x)[1](ct))(X, 1.0)
    np.testing.assert_allclose(inter["mid"]["cotangent"]["z"], np.sin(X), rtol=1e-6)

    # A tuple (y, x) under vmap and jit, inside and outside.
    def pair(x):
        y, x2 = sow((jnp.cos(x), x), "pair")
        return jnp.sum(y * x2)

    xs = np.stack([X, X + 1])
    for wrapped in (
        save_intermediates(jax.vmap(pair)), jax.vmap(save_intermediates(pair)),
        jax.jit(save_intermediates(jax.vmap(pair))), save_intermediates(jax.jit(jax.vmap(pair))),
    ):
        _, inter = wrapped(xs)
        y, x2 = inter["pair"]["primal"]
        assert isinstance(inter["pair"]["primal"], tuple)
        np.testing.assert_allclose(y, np.cos(xs), rtol=1e-6)
        np.testing.assert_allclose(x2, xs, rtol=1e-6)

    # Non-array arguments act static; pytree results keep their structure.
    def scaled(x, power, label):
        assert isinstance(power, int) and isinstance(label, str)
        return {label: sow(x**power, label)}

    out, inter = save_intermediates(scaled)(X, 3, "cube")
    np.testing.assert_allclose(out["cube"], X**3, rtol=1e-6)
    np.testing.assert_allclose(inter["cube"]["primal"], X**3, rtol=1e-6)


def test_structure_survives_trace_caches() -> None:
    inner = jax.jit(lambda x: sow({"a": (x, x * 2)}, "d")["a"][1])

    def f(x):
        def body(c, xi):
            return c + sow([xi, {"k": c}], "scan_tree")[1]["k"], None
        c, _ = jax.lax.scan(body, 0.0, x)
        return inner(x).sum() + c

    wrapped = save_intermediates(f)
    first = wrapped(X)[1]
    second = wrapped(X)[1]
    third = save_intermediates(f)(X)[1]
    for inter in (first, second, third):
        assert jax.tree_util.tree_structure(inter["d"]["primal"]) == (
            jax.tree_util.tree_structure({"a": (0, 0)}))
        assert isinstance(inter["scan_tree"]["primal"], list)
        assert inter["scan_tree"]["primal"][0].shape == (4,)


def test_duplicate_policies() -> None:
    def twice(x):
        a = sow(x * 2.0, "dup")
        b = sow(a * 3.0, "dup")
        return jnp.sum(b**2)

    with pytest.raises(ValueError, match="'dup' is used 2 times"):
        save_intermediates(twice)(X)
    _, inter = save_intermediates(jax.grad(twice), duplicates="number")(X)
    assert list(inter) == ["dup_0", "dup_1"]
    np.testing.assert_allclose(inter["dup_0"]["primal"], 2 * X, rtol=1e-6)
    np.testing.assert_allclose(inter["dup_1"]["primal"], 6 * X, rtol=1e-6)
    # d/db sum(b^2) = 2b; d/da = 3 * 2b.
    np.testing.assert_allclose(inter["dup_1"]["cotangent"], 12 * X, rtol=1e-5)
    np.testing.assert_allclose(inter["dup_0"]["cotangent"], 36 * X, rtol=1e-5)
    with pytest.raises(ValueError, match="duplicates='sometimes' is not a duplicate policy"):
        save_intermediates(twice, duplicates="sometimes")


def test_tag_selects_sites() -> None:
    def f(x):
        a = sow(x * 2.0, "a", tag="acts")
        b = sow(a + 1.0, "b")
        return jnp.sum(b)

    assert list(save_intermediates(f, tag="acts")(X)[1]) == ["a"]
    assert list(save_intermediates(f)(X)[1]) == ["b"]


def test_custom_vjp_bwd_sows_are_cotangents() -> None:
    @jax.custom_vjp
    def clip_grad(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, ct):
        return (sow(jnp.clip(ct, -1.0, 1.0), "clipped"),)

    clip_grad.defvjp(fwd, bwd)
    f = lambda x: jnp.sum(clip_grad(x) * jnp.array([3.0, -0.5, 0.2, -4.0]))  # noqa: E731
    g, inter = save_intermediates(jax.grad(f))(X)
    assert list(inter["clipped"]) == ["cotangent"]
    np.testing.assert_allclose(inter["clipped"]["cotangent"], [1.0, -0.5, 0.2, -1.0])
    np.testing.assert_allclose(g, [1.0, -0.5, 0.2, -1.0])


def test_integer_and_bool_sites() -> None:
    def f(x):
        n = sow(jnp.arange(3), "ints")
        m = sow(x > 0, "mask")
        return jnp.sum(jnp.where(m, x, 0.0)) + n.sum()

    _, inter = save_intermediates(jax.grad(f))(X)
    np.testing.assert_array_equal(inter["ints"]["primal"], np.arange(3))
    np.testing.assert_array_equal(inter["mask"]["primal"], X > 0)
    assert "cotangent" not in inter["ints"]


def test_mixed_float_and_integer_pytree_keeps_its_derivatives() -> None:
    def f(x):
        y, n = sow((x * 2.0, jnp.arange(4)), "mixed")
        return jnp.sum(y**2) + n.sum()

    _, inter = save_intermediates(jax.grad(f))(X)
    y, n = inter["mixed"]["primal"]
    np.testing.assert_array_equal(n, np.arange(4))
    # The cotangent keeps the structure, with None where the leaf has no derivative.
    ct_y, ct_n = inter["mixed"]["cotangent"]
    assert ct_n is None
    np.testing.assert_allclose(ct_y, 4 * X, rtol=1e-6)  # d/dy sum(y^2) = 2y = 4x
    with sowtel.enable(exporter="memory") as session:
        jax.jit(jax.grad(f))(X)
        sowtel.flush()
    assert sorted((r.name, r.mode) for r in session.exporters[0].records) == [
        ("mixed/0", "cotangent"), ("mixed/0", "primal"), ("mixed/1", "primal")]


def test_untaken_integer_branch_site_is_zero() -> None:
    def f(x):
        return jax.lax.cond(x[0] > 100, lambda: sow(jnp.arange(2), "never"), lambda: jnp.zeros(
            2, jnp.int32))

    _, inter = save_intermediates(f)(X)
    np.testing.assert_array_equal(inter["never"]["primal"], [0, 0])


def test_while_loop_that_never_runs_reports_nan() -> None:
    def f(x):
        return jax.lax.while_loop(lambda v: v[0] > 100, lambda v: sow(v * 2, "w"), x)

    _, inter = save_intermediates(f)(X)
    assert np.isnan(inter["w"]["primal"]).all()


# -- bad input ----------------------------------------------------------------------------------


def test_sow_in_while_cond_is_an_error() -> None:
    def f(x):
        return jax.lax.while_loop(lambda c: sow(c, "in_cond") < 3.0, lambda c: c + 1.0, x)

    with pytest.raises(ValueError, match="'in_cond' is inside a while_loop cond"):
        save_intermediates(f)(jnp.float32(0.0))


def test_save_intermediates_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="save_intermediates needs a callable, got int"):
        save_intermediates(3)  # type: ignore[arg-type]


def test_unsupported_construct_is_an_error_not_a_silent_drop() -> None:
    from hop_primitive import opaque_call

    def f(x):
        return jax.lax.custom_linear_solve(
            lambda v: v * 2.0, x, solve=lambda mv, b: sow(b / 2.0, "hidden"))

    # A library's primitive is captured as it runs (see tests/test_library_primitives.py)...
    _, inter = save_intermediates(f)(X)
    np.testing.assert_allclose(inter["hidden"]["primal"], X / 2.0)

    def g(x):  # ...one with no implementation to run cannot be, and says so
        return opaque_call(lambda v: [sow(v / 2.0, "hidden")], x, implemented=False)[0]

    with pytest.raises(NotImplementedError, match="cannot capture sow 'hidden' inside"):
        save_intermediates(g)(X)
