"""The transform matrix: every case of ``tests/transform_cases.py`` (a program written once,
with its hand-derived values and an explicit-perturbation twin) through the four paths it runs
on, capture (``sowtel.save_intermediates``), the fast host callback, the debug callback and
``sowtel.jit``, under each transformation the case claims.

The capture path checks the captured dict; the streaming paths check the memory exporter's
records (names, modes, steps, indices, shapes, values or device stats) against the same
references: primals against numpy, cotangents against ``jax.grad`` of the perturbation,
tangents against a closed form or central finite differences of the numpy primal.

After the matrix, the cases that do not fit it (pytrees batched leaf by leaf, shard_map and
pmap, duplicates, errors), on the paths they concern. Random programs across the same
transforms are the fuzzer's (tests/test_fuzz_transforms.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transform_cases
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transform_cases import (
    CASES,
    STREAMING,
    Case,
    T,
    X,
    by,
    checkpoint_fn,
    jit,
    jit_of,
    plain_fn,
    stream,
)

import sowtel
from sowtel import save_intermediates, sow
from sowtel.records import Record
from sowtel.summaries import host_summary

streaming = transform_cases.streaming  # the transport fixture of every transform test
PATHS = ("capture",) + STREAMING
# The cotangent seed of each reverse-mode transform; the others run forward or not at all.
REVERSE = {"grad": 1.0, "grad_jit_outside": 1.0, "value_and_grad": 1.0, "vjp": 2.0}
FORWARD = ("jvp", "linearize")
DELTA = 1e-3  # the finite differences' step


def transformed(transform: str, case: Case) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The case's function under ``transform``, and the arguments to call it with."""
    f = lambda x: case.fn(x, None)  # noqa: E731
    if transform in ("call", "call_stats"):
        return f, (case.x,)
    if transform in ("grad", "grad_jit_outside"):
        return jax.grad(f), (case.x,)
    if transform == "value_and_grad":
        return jax.value_and_grad(f), (case.x,)
    if transform == "vjp":
        return (lambda x, ct: jax.vjp(f, x)[1](ct)), (case.x, jnp.float32(REVERSE["vjp"]))
    if transform == "jvp":
        return (lambda x, t: jax.jvp(f, (x,), (t,))), (case.x, T)
    assert transform == "linearize"
    return (lambda x, t: jax.linearize(f, x)[1](t)), (case.x, T)


def zero_eps(ref: dict[str, np.ndarray]) -> dict[str, Any]:
    return {n: jnp.zeros_like(jnp.nan_to_num(v)) for n, v in ref.items()}


@functools.cache
def cotangents(name: str) -> dict[str, np.ndarray]:
    """``jax.grad`` of the loss at a zero perturbation of each site (one per case, shared)."""
    case = CASES[name]
    ct = jax.jit(jax.grad(lambda e: case.fn(case.x, e)))(zero_eps(case.primal(case.x)))
    return {n: np.asarray(v) for n, v in ct.items()}


@functools.cache
def input_grad(name: str) -> np.ndarray:
    """``jax.grad`` of the loss with respect to ``x``, perturbation zero: what grad returns."""
    case = CASES[name]
    return np.asarray(jax.jit(jax.grad(case.fn))(case.x, zero_eps(case.primal(case.x))))


def expected(name: str, transform: str) -> dict[str, dict[str, np.ndarray]]:
    """Each site's expected value per mode, in the order the modes are reported."""
    case = CASES[name]
    ref = case.primal(case.x)
    want = {n: {"primal": np.asarray(v)} for n, v in ref.items()}
    if transform in REVERSE and case.cotangent:
        for n, ct in cotangents(name).items():
            want[n]["cotangent"] = REVERSE[transform] * ct
    if transform in FORWARD:
        if case.tangent is not None:
            tangent = case.tangent(case.x, T)
        else:
            x64, t64 = case.x.astype(np.float64), T.astype(np.float64)
            plus, minus = case.primal(x64 + DELTA * t64), case.primal(x64 - DELTA * t64)
            tangent = {n: (np.asarray(plus[n], np.float64) - np.asarray(minus[n], np.float64))
                       / (2 * DELTA) for n in ref}
        for n in want:
            want[n]["tangent"] = np.asarray(tangent[n])
    return want


def tolerance(case: Case, mode: str) -> dict[str, float]:
    if mode == "tangent" and case.tangent is None:
        return {"rtol": 2e-2, "atol": 2e-3}  # finite differences
    return {"rtol": 1e-5, "atol": 1e-6}


def matrix() -> Iterator[Any]:
    for name, case in CASES.items():
        for transform in case.capture_transforms():
            yield pytest.param(name, transform, "capture", id=f"{name}-{transform}-capture")
        for transform in case.streamed:
            for path in STREAMING:
                yield pytest.param(name, transform, path, id=f"{name}-{transform}-{path}")


@pytest.mark.parametrize(("name", "transform", "path"), list(matrix()))
def test_matrix(name: str, transform: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "capture":
        check_capture(name, transform)
    else:
        check_stream(name, transform, path, monkeypatch)


# -- the capture path -----------------------------------------------------------------------


def check_capture(name: str, transform: str) -> None:
    case = CASES[name]
    fn, args = transformed(transform, case)
    wrapped = save_intermediates(fn)
    if transform == "grad_jit_outside":
        wrapped = jax.jit(wrapped)
    out, inter = wrapped(*args)
    want = expected(name, transform)
    if transform == "call":
        np.testing.assert_allclose(out, case.fn(case.x, zero_eps(case.primal(case.x))),
                                   rtol=1e-6)
    if transform in ("grad", "grad_jit_outside"):
        np.testing.assert_allclose(out, input_grad(name), rtol=1e-5)
    assert set(inter) == set(want)
    for n, modes in want.items():
        got = inter[n]
        if case.stacked is not None:
            assert got.stacked == dict.fromkeys(modes, case.stacked), n
        if transform in FORWARD:
            assert set(got) == set(modes), n
        else:
            assert list(got) == list(modes), n
        primal = np.asarray(got["primal"])
        np.testing.assert_allclose(primal, modes["primal"], err_msg=n, **tolerance(case, "primal"))
        # A site whose branch did not run has NaN derivatives too; where it ran, they match.
        ran = ~np.isnan(primal)
        for mode, value in modes.items():
            if mode == "primal":
                continue
            d = np.asarray(got[mode])
            np.testing.assert_allclose(d[ran], value[ran], err_msg=f"{n} {mode}",
                                       **tolerance(case, mode))
            if mode == "cotangent":
                assert np.isnan(d[~ran]).all()


# -- the streaming paths --------------------------------------------------------------------


def check_record(r: Record, value: np.ndarray, stats: bool, tol: dict[str, float]) -> None:
    assert r.shape == value.shape and r.dtype == "float32", (r.name, r.shape, r.dtype)
    if stats:
        want = host_summary(value.astype(np.float64), "stats")["stats"]
        for k, v in want.items():
            np.testing.assert_allclose(r.stats[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    else:
        np.testing.assert_allclose(r.value, value, err_msg=f"{r.name} {r.mode}", **tol)


def check_stream(name: str, transform: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    fn, args = transformed(transform, case)
    stats = transform == "call_stats"
    records = stream(jit_of(path, monkeypatch)(fn), *args, calls=case.calls,
                     summary="stats" if stats else "full")
    want = expected(name, transform)
    if case.streamed_primal is not None:
        for n, v in case.streamed_primal(case.x).items():
            want[n]["primal"] = v
    # A branch that did not run streams nothing.
    want = {n: m for n, m in want.items() if not np.isnan(m["primal"]).all()}
    assert {r.name for r in records} == set(want)
    for n, modes in want.items():
        assert {r.mode for r in records if r.name == n} == set(modes), n
        for mode, value in modes.items():
            got, tol = by(records, mode, n), tolerance(case, mode)
            if case.streamed_primal is not None:  # every iteration, in order, unindexed
                assert len(got) == len(value) and all(r.index is None for r in got)
                for r, v in zip(got, value, strict=True):
                    check_record(r, v, stats, tol)
            elif got[0].index is None:  # once per call
                assert [(r.step, r.index) for r in got] == [(s, None) for s in range(case.calls)]
                for r in got:
                    check_record(r, value, stats, tol)
            else:  # once per iteration of the loops around the site, each call
                depth = value.ndim - len(got[0].shape)
                indices = [i[0] if depth == 1 else i for i in np.ndindex(value.shape[:depth])]
                for step in range(case.calls):
                    here = [r for r in got if r.step == step]
                    assert sorted(r.index for r in here) == indices, (n, mode, step)
                    for r in here:
                        check_record(r, value[r.index], stats, tol)
                assert len(got) == case.calls * len(indices)
        if "cotangent" in modes and by(records, "primal", n)[0].index is not None:
            # The backward pass runs the loop in reverse.
            forward = [r.index for r in by(records, "primal", n) if r.step == 0]
            assert [r.index for r in by(records, "cotangent", n) if r.step == 0] == forward[::-1]
    if len(want) == 1 and records[0].index is None and case.streamed_primal is None:
        # One record per mode per call, in the modes' order.
        assert [r.mode for r in records] == list(next(iter(want.values()))) * case.calls
    if case.streamed_primal is not None:
        # Without at_step the callback transports count occurrences; sowtel.jit counts calls,
        # and its while-body callbacks carry the call's step.
        n = len(records)
        assert [r.step for r in records] == ([0] * n if path == "sowtel.jit" else list(range(n)))


# -- capture beyond the matrix ------------------------------------------------------------


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


# -- streaming beyond the matrix ----------------------------------------------------------


def plain(x, eps=None):
    h = jnp.sin(x) * 2.0
    h = sow(h, "h") if eps is None else h + eps
    return jnp.sum(h**2)


def test_vmap_inside_and_outside_one_record_per_batch(streaming: str) -> None:
    xs = np.stack([X, X * 2, -X])
    for fn in (jit(streaming)(jax.vmap(plain)), jax.vmap(jit(streaming)(plain))):
        [r] = stream(fn, xs)
        assert r.shape == (3, 4)
        np.testing.assert_allclose(r.value, 2 * np.sin(xs), rtol=1e-6)


def test_vmap_streams_each_leaf_batched_as_it_was(streaming: str) -> None:
    # A pytree of a batched and an unbatched leaf (out_axes=None on the latter, which turning
    # streaming on used to break): each leaf's record has the shape the program gives it.
    xs, s = np.stack([X, X * 2, -X]), np.float32(0.8)
    pair = jax.vmap(lambda x, s: sow((x * 2.0, jnp.sin(s)), "pair"), in_axes=(0, None),
                    out_axes=(0, None))

    def loss(xs, s, eps=None):
        a, b = pair(xs, s) if eps is None else (xs * 2.0 + eps[0], jnp.sin(s) + eps[1])
        return jnp.sum(a * b**2)

    _, b = jit(streaming)(pair)(xs, s)
    np.testing.assert_allclose(b, np.sin(s), rtol=1e-6)
    records = stream(jit(streaming)(jax.grad(loss, argnums=(0, 1))), xs, s)
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


def test_switch_streams_only_the_taken_branch(streaming: str) -> None:
    def f(x, k):
        return jax.lax.switch(
            k, [lambda v: sow(v + 1, "b0"), lambda v: sow(v * 2, "b1"), lambda v: sow(-v, "b2")], x)

    jitted = jit(streaming)(f)
    for k in (0, 1, 2):
        [r] = stream(jitted, X, jnp.int32(k))
        assert r.name == f"b{k}"


def test_custom_vjp_fwd_primal_bwd_cotangent(streaming: str) -> None:
    @jax.custom_vjp
    def scale(x):
        return x * 3.0

    def fwd(x):
        return sow(x * 3.0, "fwd"), None

    def bwd(_, ct):
        return (sow(ct * 3.0, "bwd"),)

    scale.defvjp(fwd, bwd)
    records = stream(jit(streaming)(jax.grad(lambda x: jnp.sum(scale(x) ** 2))), X)
    assert [(r.name, r.mode) for r in records] == [("fwd", "primal"), ("bwd", "cotangent")]
    np.testing.assert_allclose(records[1].value, 3 * 2 * 3 * X, rtol=1e-6)


def test_shard_map_and_pmap_one_record_per_shard(streaming: str) -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
    sm = jax.shard_map(lambda v: sow(v * 2.0, "sm"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    records = stream(jit(streaming)(jax.grad(lambda v: jnp.sum(sm(v) ** 2))), x)
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


def test_sharded_jit_reduces_globally(streaming: str) -> None:
    mesh = jax.make_mesh((8,), ("i",))
    x = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("i")))
    [r] = stream(jit(streaming)(lambda v: sow(v * 0.5, "g").sum()), x, summary="stats")
    assert r.shape == (16, 4) and r.index is None
    expected = host_summary(np.arange(64.0).reshape(16, 4) * 0.5, "stats")["stats"]
    for k, v in expected.items():
        np.testing.assert_allclose(r.stats[k], v, rtol=1e-5, err_msg=k)
