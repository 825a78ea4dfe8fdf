"""locate_nonfinite: planted NaNs and infinities, found at the right line, layer and pass.

Each planted operation carries a ``# plant: <label>`` comment; ``_line(label)`` reads its line
number from this file, so the expected lines are not written twice.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel


@functools.cache
def _source_lines() -> list[str]:
    with open(os.path.abspath(__file__)) as f:
        return f.read().splitlines()


def _line(label: str) -> int:
    hits = [i + 1 for i, text in enumerate(_source_lines()) if text.endswith(f"# plant: {label}")]
    assert len(hits) == 1, label
    return hits[0]


def _check(event: sowtel.NonFiniteEvent | None, primitive: str, label: str, phase: str) -> None:
    assert event is not None
    assert (event.primitive, event.line, event.phase) == (primitive, _line(label), phase), event
    assert event.file == os.path.abspath(__file__)


def test_forward_log_of_a_negative() -> None:
    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        h = x @ w
        return jnp.sum(jnp.log(h))  # plant: forward-log

    report = sowtel.locate_nonfinite(jax.grad(loss))(-jnp.ones((3, 2)), jnp.ones((4, 3)))
    _check(report.first, "log", "forward-log", "forward")
    assert report.first.iteration == () and not report.nonfinite_outputs
    assert report.nonfinite_inputs == ()
    # The result is fn's own: the gradient x.T @ (1 / h), with h = -3 everywhere, is finite.
    np.testing.assert_allclose(report.result, jnp.full((3, 2), -4 / 3.0), rtol=1e-6)


def test_backward_overflow() -> None:
    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(1e20 * jnp.tanh(1e20 * x))  # plant: backward-mul

    x = jnp.zeros(3)
    assert np.isfinite(jax.jit(loss)(x))  # the forward pass is finite: only the gradient is not
    report = sowtel.locate_nonfinite(jax.grad(loss))(x)
    _check(report.first, "mul", "backward-mul", "backward")
    assert report.first.shape == (3,) and report.first.dtype == "float32"
    assert report.nonfinite_outputs and len(report.events) == 1


def test_derivative_factor_computed_in_the_forward_pass() -> None:
    # JAX computes the primal-only factor of sqrt's derivative, 0.5 / sqrt(x), in the forward
    # pass (a residual): it is infinite there, at the line of the sqrt.
    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.sqrt(x * x))  # plant: residual-sqrt

    report = sowtel.locate_nonfinite(jax.grad(loss))(jnp.array([1.0, 0.0, 2.0]))
    _check(report.first, "div", "residual-sqrt", "forward")


def _scanned_model(scales: jax.Array, x: jax.Array, *, remat: bool = False) -> jax.Array:
    def layer(h: jax.Array, s: jax.Array) -> tuple[jax.Array, None]:
        with sowtel.scope("layer"):
            h = sowtel.sow(h, "input")
            # Two consecutive scales of 1e30: finite forward; the cotangent overflows backward.
            return h + jnp.sin(h) * s, None  # plant: scan-sin

    body = jax.checkpoint(layer) if remat else layer
    return jax.lax.scan(body, x, scales)[0].sum()


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan-checkpoint"])
def test_inside_scan_backward_names_the_layer(remat: bool) -> None:
    scales = jnp.ones(6).at[3].set(1e30).at[4].set(1e30)
    x = jnp.ones(4)
    model = functools.partial(_scanned_model, remat=remat)
    assert np.isfinite(jax.jit(model)(scales, x))
    report = sowtel.locate_nonfinite(jax.grad(model))(scales, x)
    _check(report.first, "mul", "scan-sin", "backward")
    assert report.first.loops == ("scan",) and report.first.iteration == (3,)
    assert report.first.scopes == "layer"
    assert report.first.site is not None and report.first.site.startswith("layer/input")


def test_inside_scan_forward_first_iteration_in_program_order() -> None:
    def f(xs: jax.Array) -> jax.Array:
        def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            return c, jnp.log(x)  # plant: scan-log
        return jax.lax.scan(body, 0.0, xs)[1].sum()

    report = sowtel.locate_nonfinite(f)(jnp.array([1.0, 2.0, -1.0, 3.0, -2.0]))
    _check(report.first, "log", "scan-log", "forward")
    assert [e.iteration for e in report.events] == [(2,)]  # one event an equation


def test_nested_scans() -> None:
    def f(xss: jax.Array) -> jax.Array:
        def outer(c: jax.Array, xs: jax.Array) -> tuple[jax.Array, None]:
            def inner(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
                return c + 1.0 / x, None  # plant: nested-div
            return jax.lax.scan(inner, c, xs)[0], None
        return jax.lax.scan(outer, 0.0, xss)[0]

    xss = jnp.ones((3, 4)).at[1, 2].set(0.0).at[2, 0].set(0.0)
    report = sowtel.locate_nonfinite(f)(xss)
    _check(report.first, "div", "nested-div", "forward")
    assert report.first.loops == ("scan", "scan") and report.first.iteration == (1, 2)
    assert [e.iteration for e in report.events if e.primitive == "div"] == [(1, 2)]


def test_reverse_scan_reports_the_iteration_that_ran_first() -> None:
    def f(xs: jax.Array) -> jax.Array:
        def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            return c, jnp.log(x)  # plant: reverse-log
        return jax.lax.scan(body, 0.0, xs, reverse=True)[1].sum()

    report = sowtel.locate_nonfinite(f)(jnp.array([1.0, -2.0, 1.0, -1.0, 3.0]))
    _check(report.first, "log", "reverse-log", "forward")
    assert [e.iteration for e in report.events] == [(3,)]


@jax.custom_vjp
def _safe_sin(x: jax.Array) -> jax.Array:
    return jnp.sin(x)


def _safe_sin_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.sin(x), x


def _safe_sin_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (g * jnp.log(x),)  # a wrong derivative: log(x) is NaN for x < 0


_safe_sin.defvjp(_safe_sin_fwd, _safe_sin_bwd)


def test_inside_custom_vjp_backward() -> None:
    def loss(x: jax.Array) -> jax.Array:
        y = jnp.cos(x) - 2.0
        return jnp.sum(_safe_sin(y))  # plant: custom-vjp-call

    report = sowtel.locate_nonfinite(jax.grad(loss))(jnp.array([0.5, 1.0]))
    # The bwd equations keep the line of the custom_vjp call they differentiate.
    _check(report.first, "log", "custom-vjp-call", "backward")


def test_under_vmap_per_example_gradients() -> None:
    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.sum(1e20 * jnp.tanh(w * x))  # plant: vmap-mul

    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))
    xs = jnp.zeros((5, 3)).at[4, 1].set(1e20)
    report = sowtel.locate_nonfinite(per_example)(jnp.full(3, 1e-20), xs)
    _check(report.first, "mul", "vmap-mul", "backward")
    assert report.first.shape == (5, 3)


def test_scopes_name_an_unrolled_layer() -> None:
    def f(x: jax.Array) -> jax.Array:
        for i in range(4):
            with sowtel.scope(f"block{i}"):
                x = jnp.exp(x * 30.0) if i == 2 else x + 1.0  # plant: scope-exp
        return x.sum()

    report = sowtel.locate_nonfinite(f)(jnp.ones(2))
    _check(report.first, "exp", "scope-exp", "forward")
    assert report.first.scopes == "block2" and report.first.module_path is None
    assert "exp" in str(report) and "scope block2" in str(report)


def test_flax_module_path() -> None:
    import flax.linen as nn

    class Block(nn.Module):
        bad: bool

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.Dense(4)(x)
            return jnp.log(h - 100.0) if self.bad else h  # plant: flax-log

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(3):
                x = Block(bad=(i == 1))(x)
            return x.sum()

    model, x = Model(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    report = sowtel.locate_nonfinite(jax.grad(lambda p: model.apply(p, x)))(params)
    _check(report.first, "log", "flax-log", "forward")
    assert report.first.module_path == "Model/Block_1"


def test_finite_program_and_nonfinite_inputs() -> None:
    def f(x: jax.Array, n: int) -> jax.Array:
        return jnp.sum(jnp.tanh(x) * n)

    x = jnp.arange(3.0)
    report = sowtel.locate_nonfinite(jax.grad(f))(x, 2)
    assert not report.found and report.events == () and not report.nonfinite_outputs
    np.testing.assert_allclose(report.result, 2 * (1 - jnp.tanh(x) ** 2), rtol=1e-6)
    report = sowtel.locate_nonfinite(f)(x.at[1].set(jnp.nan), 2)
    assert not report.found and report.nonfinite_inputs == ("[0][0]",)
    assert report.nonfinite_outputs


def test_while_loop_and_cond() -> None:
    def f(x: jax.Array) -> jax.Array:
        def body(s: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, v = s
            v = jax.lax.cond(i == 3, lambda v: v / (v - v), lambda v: v + 1.0, v)  # plant: cond
            return i + 1, v
        return jax.lax.while_loop(lambda s: s[0] < 5, body, (0, x))[1]

    report = sowtel.locate_nonfinite(f)(jnp.ones(2))
    _check(report.first, "div", "cond", "forward")
    assert report.first.loops == ("while",) and report.first.iteration == (3,)


def test_bad_argument() -> None:
    with pytest.raises(TypeError, match="needs a callable"):
        sowtel.locate_nonfinite(3)  # type: ignore[arg-type]


def test_a_python_float_argument_is_static_as_in_save_intermediates():
    """One rule of which arguments are traced (capture.is_dynamic): a Python float is static
    in locate_nonfinite as in save_intermediates, so Python control flow on it runs in both;
    a non-finite one is still reported as a non-finite input."""
    def f(x, scale):
        if scale > 1.0:  # needs a concrete (static) float
            x = x * scale
        return jnp.log(sowtel.sow(x, "y"))

    x = jnp.array([1.0, -1.0])
    _, inter = sowtel.save_intermediates(f)(x, 2.0)
    report = sowtel.locate_nonfinite(f)(x, 2.0)
    assert inter["y"]["primal"].tolist() == [2.0, -2.0]
    assert report.first.primitive == "log" and report.nonfinite_inputs == ()
    assert report.result.tolist()[0] == pytest.approx(np.log(2.0))
    assert sowtel.locate_nonfinite(f)(x, float("nan")).nonfinite_inputs == ("[0][1]",)


def test_while_loop_inside_scan_names_both_iterations() -> None:
    def f(xs: jax.Array) -> jax.Array:
        def layer(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            def step(s: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                i, v = s
                return i + 1, jnp.log(v - i)  # plant: while-in-scan
            return c, jax.lax.while_loop(lambda s: s[0] < 3, step, (0, x))[1]
        return jax.lax.scan(layer, 0.0, xs)[1]

    # log(1.5) - 1 < 0: the second step of the third layer; the other layers stay finite.
    report = sowtel.locate_nonfinite(f)(jnp.array([1e6, 1e6, 1.5, 1e6]))
    _check(report.first, "log", "while-in-scan", "forward")
    assert report.first.loops == ("scan", "while") and report.first.iteration == (2, 1)
    assert len(report.events) == 1


def test_vmapped_while_loop() -> None:
    # Under vmap the loop's predicate is batched: it runs while any row does.
    def f(r: jax.Array) -> jax.Array:
        def step(s: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return s[0] + 1.0, jnp.log(s[1] - 2.0)  # plant: vmap-while
        return jax.lax.while_loop(lambda s: s[0] < r[0], step, (0.0, r))[1]

    report = sowtel.locate_nonfinite(jax.vmap(f))(jnp.array([[1.0, 5.0], [3.0, 2.0]]))
    _check(report.first, "log", "vmap-while", "forward")
    assert report.first.loops == ("while",) and report.first.iteration == (0,)
