"""What peer libraries test of their own tagging and callbacks, checked of sowtel.

Written here after what Flax's ``Module.sow`` / ``Module.perturb`` tests, Oryx's ``harvest``
tests and JAX's ``debug_callback`` tests check: sows in ``nn.scan`` with broadcast variables,
cotangents equal to Flax's perturbation gradients, reaping through nested calls and loops, and
callbacks in scan / while / cond arriving once per execution, in program order.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
import sowtel.flax
from sowtel import save_intermediates, sow

JAX_NEW = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
X = np.array([0.5, -1.0, 2.0], np.float32)


def stream(fn: Any, *args: Any, calls: int = 1) -> list[Any]:
    """Records of ``calls`` calls, in program order (step, then position, then index)."""
    with sowtel.enable(exporter="memory", summary="full") as session:
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        assert sowtel.flush(timeout=30)
    return sorted(session.exporters[0].records,
                  key=lambda r: (r.step, r.order, -1 if r.index is None else r.index))


# -- Flax: sow and perturb ------------------------------------------------------------------------


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c: Any, x: Any) -> Any:
        h = jnp.tanh(nn.Dense(3, name="dense")(c) + x)
        return sowtel.flax.sow(self, h, "h"), None


def test_sow_in_nn_scan_with_broadcast_params_stacks_per_iteration() -> None:
    scanned = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False},
                      in_axes=0, out_axes=0)
    xs = jnp.asarray(np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
    params = scanned().init(jax.random.key(0), jnp.zeros(3), xs)
    _, inter = save_intermediates(scanned().apply)(params, jnp.zeros(3), xs)
    w, b = (np.asarray(params["params"]["dense"][k]) for k in ("kernel", "bias"))
    c, expected = np.zeros(3, np.float32), []
    for x in np.asarray(xs):  # the scan by hand: one shared (broadcast) set of parameters
        c = np.tanh(c @ w + b + x)
        expected.append(c)
    np.testing.assert_allclose(inter["h"]["primal"], np.stack(expected), rtol=1e-5, atol=1e-6)


class Perturbed(nn.Module):
    """Flax's perturb pattern: ``self.perturb`` adds a zero whose gradient is the cotangent."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.Dense(4, name="d1")(x)
        h = sowtel.flax.sow(self, self.perturb("h", h), "h")
        h = sowtel.flax.sow(self, self.perturb("g", jnp.sin(h) * h), "g")
        return jnp.sum(nn.Dense(1, name="d2")(h) ** 2)


def test_cotangents_equal_flax_perturbation_gradients() -> None:
    model = Perturbed()
    variables = model.init(jax.random.key(1), X)
    params, perturbations = variables["params"], variables["perturbations"]

    def loss(params: Any, perturbations: Any) -> Any:
        return model.apply({"params": params, "perturbations": perturbations}, X)

    flax_grads = jax.grad(loss, argnums=1)(params, perturbations)
    _, inter = save_intermediates(jax.grad(loss))(params, perturbations)
    for name in ("h", "g"):
        np.testing.assert_allclose(inter[name]["cotangent"], flax_grads[name], rtol=1e-5,
                                   atol=1e-7)
    # Streamed the same, through both transports.
    for jit in (jax.jit, sowtel.jit):
        records = stream(jit(jax.grad(loss)), params, perturbations)
        got = {r.name: r.value for r in records if r.mode == "cotangent"}
        for name in ("h", "g"):
            np.testing.assert_allclose(got[name], flax_grads[name], rtol=1e-5, atol=1e-7)


# -- Oryx harvest: reaping through calls, loops and transforms ------------------------------------


def test_reaps_through_nested_jit_and_calls_by_name() -> None:
    def inner(x: Any) -> Any:
        return sow(x * 2.0, "inner")

    def f(x: Any) -> Any:
        y = jax.jit(inner)(x)
        with sowtel.scope("outer"):
            z = sow(jnp.exp(y), "z")
        return z.sum()

    _, inter = save_intermediates(f)(X)
    assert set(inter) == {"inner", "outer/z"}
    np.testing.assert_allclose(inter["inner"]["primal"], X * 2, rtol=1e-6)
    np.testing.assert_allclose(inter["outer/z"]["primal"], np.exp(X * 2), rtol=1e-6)


def test_reaps_loops_stacked_and_while_last() -> None:
    def f(x: Any) -> Any:
        def body(c: Any, i: Any) -> Any:
            return sow(c * 0.5 + i, "scanned"), None

        c, _ = jax.lax.scan(body, x, jnp.arange(3.0))
        _, w = jax.lax.while_loop(lambda s: s[0] < 4, lambda s: (s[0] + 1, sow(s[1] + 1, "w")),
                                  (0, c))
        return w

    _, inter = save_intermediates(f)(X)
    c, stacked = X.copy(), []
    for i in range(3):
        c = c * 0.5 + i
        stacked.append(c)
    np.testing.assert_allclose(inter["scanned"]["primal"], np.stack(stacked), rtol=1e-6)
    np.testing.assert_allclose(inter["w"]["primal"], c + 4, rtol=1e-6)


def test_repeated_name_is_an_error_or_numbered() -> None:
    def f(x: Any) -> Any:
        return sow(sow(x, "a") * 2, "a")

    with pytest.raises(ValueError, match="'a'"):
        save_intermediates(f)(X)
    _, inter = save_intermediates(f, duplicates="number")(X)
    np.testing.assert_allclose(inter["a_0"]["primal"], X)
    np.testing.assert_allclose(inter["a_1"]["primal"], X * 2)


def test_sow_in_cond_predicate_free_branches_and_vmap() -> None:
    def f(x: Any) -> Any:
        return jax.lax.cond(x.sum() > 0, lambda v: sow(v + 1, "pos"), lambda v: sow(v - 1, "neg"),
                            x)

    _, inter = save_intermediates(f)(X)  # X sums to 1.5: the "pos" branch
    np.testing.assert_allclose(inter["pos"]["primal"], X + 1)
    assert np.isnan(inter["neg"]["primal"]).all()
    xs = np.stack([X, X * 3])
    _, inter = save_intermediates(jax.vmap(lambda v: sow(jnp.sin(v), "s")))(xs)
    np.testing.assert_allclose(inter["s"]["primal"], np.sin(xs), rtol=1e-6)


# -- JAX debug_callback: once per execution, in program order --------------------------------------


@pytest.mark.parametrize("jit", [jax.jit, sowtel.jit], ids=["callback", "sowtel.jit"])
def test_scan_streams_each_iteration_in_order_with_the_sites_of_an_iteration(jit: Any) -> None:
    def f(x: Any) -> Any:
        def body(c: Any, _: Any) -> Any:
            a = sow(c + 1.0, "a")
            return sow(a * 2.0, "b"), None

        return jax.lax.scan(body, x, None, length=3)[0]

    records = stream(jit(f), X)
    assert [(r.name, r.index) for r in sorted(records, key=lambda r: (r.index, r.order))] == [
        (n, i) for i in range(3) for n in ("a", "b")]
    c = X.copy()
    for r in sorted(records, key=lambda r: (r.index, r.order)):
        if r.name == "a":
            c = c + 1.0
            np.testing.assert_allclose(r.value, c)
        else:
            c = c * 2.0
            np.testing.assert_allclose(r.value, c)


@pytest.mark.parametrize("jit", [jax.jit, sowtel.jit], ids=["callback", "sowtel.jit"])
def test_cond_streams_only_the_taken_branch_each_call(jit: Any) -> None:
    def f(x: Any) -> Any:
        return jax.lax.cond(x[0] > 0, lambda v: sow(v * 2, "yes"), lambda v: sow(-v, "no"), x)

    fn = jit(f)
    with sowtel.enable(exporter="memory", summary="full") as session:
        for x in (X, -X, X):
            fn(x)
        sowtel.flush()
    got = sorted((r.step, r.name) for r in session.exporters[0].records)
    # Steps count the calls: sowtel.jit counts them; host callbacks count each name's
    # occurrences, and a branch that does not run counts the other branch's as skipped.
    assert got == [(0, "yes"), (1, "no"), (2, "yes")]


@pytest.mark.parametrize("jit", [jax.jit, sowtel.jit], ids=["callback", "sowtel.jit"])
def test_while_streams_once_per_iteration_in_order(jit: Any) -> None:
    def f(x: Any) -> Any:
        return jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, sow(s[1] * 3, "w")),
                                  (0, x))[1]

    records = stream(jit(f), X)
    assert len(records) == 3
    values = sorted((np.abs(r.value).sum(), r.step) for r in records)
    # The values grow by 3x an iteration: the order by value is the order of the iterations.
    for k, (total, _) in enumerate(values):
        np.testing.assert_allclose(total, np.abs(X).sum() * 3 ** (k + 1), rtol=1e-5)


@pytest.mark.parametrize("jit", [jax.jit, sowtel.jit], ids=["callback", "sowtel.jit"])
def test_cond_inside_scan_indices_skip_untaken_iterations(
        jit: Any, recwarn: pytest.WarningsRecorder) -> None:
    # sowtel.jit reads the iteration from the program. A host callback cannot (the scan's
    # counter never reaches the sow): it counts, and the branch that does not run says what
    # it skipped. Both are exact, and neither warns.
    def f(xs: Any) -> Any:
        def body(c: Any, x: Any) -> Any:
            return c + jax.lax.cond(x > 0, lambda v: sow(v, "pos"), lambda v: 0.0 * v, x), None

        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.asarray([1.0, -1.0, 2.0, -3.0, 4.0])
    records = stream(jit(f), xs, calls=2)
    assert sorted((r.step, r.index) for r in records) == [
        (0, 0), (0, 2), (0, 4), (1, 0), (1, 2), (1, 4)]
    assert not [w for w in recwarn if "inside a cond" in str(w.message)]


# -- found by the fuzzer ---------------------------------------------------------------------------


@jax.custom_jvp
def _sine(h: Any) -> Any:
    return sow(jnp.sin(h), "c")


@_sine.defjvp
def _sine_jvp(primals: Any, tangents: Any) -> Any:
    (h,), (t,) = primals, tangents
    return _sine(h), jnp.cos(h) * t


def test_custom_jvp_site_reports_the_same_modes_inside_a_scan() -> None:
    # JAX 0.10 differentiates the scan's body with the custom_jvp inlined (its rule lost) under
    # jvp-of-grad; the site still reports its primal only, as outside a scan.
    def top(x: Any) -> Any:
        return _sine(x).sum()

    def scanned(x: Any) -> Any:
        return jax.lax.scan(lambda c, _: (_sine(c), None), x, None, length=2)[0].sum()

    modes = []
    for f in (top, scanned):
        _, inter = save_intermediates(lambda x, t, f=f: jax.jvp(jax.grad(f), (x,), (t,)))(X, X)
        modes.append(set(inter["c"]))
    assert modes == [{"primal"}, {"primal"}]


def test_custom_jvp_in_jitted_fori_under_jvp_keeps_its_index() -> None:
    def f(x: Any) -> Any:
        inner = jax.jit(lambda c: jax.lax.fori_loop(0, 2, lambda i, d: _sine(d + 0.2 * i), c))
        return inner(x).sum()

    records = stream(jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))), X, X)
    assert sorted((r.step, r.index) for r in records) == [(0, 0), (0, 1)]


@pytest.mark.parametrize("jit", [jax.jit, sowtel.jit], ids=["callback", "sowtel.jit"])
def test_scan_inside_while_streams_its_index(jit: Any) -> None:
    def f(x: Any) -> Any:
        def body(s: Any) -> Any:
            i, c = s
            c, _ = jax.lax.scan(lambda c, t: (sow(jnp.sin(c + t), "s"), None), c, jnp.arange(2.0))
            return i + 1, c

        return jax.lax.while_loop(lambda s: s[0] < 2, body, (0, x))[1].sum()

    _, inter = save_intermediates(f)(X)
    assert inter["s"]["primal"].shape == (2, 3)  # the scan's iterations, of the last while pass
    records = stream(jit(f), X)
    assert sorted(r.index for r in records) == [0, 0, 1, 1]
