"""Turning streaming on leaves a program's results bit for bit what they are without sowtel.

On XLA's CPU backend a multiply and the add that consumes it are rounded once (a fused
multiply-add) when they are compiled into one loop, and twice when the product is written out
between them. A summary that reads a sown product used to make XLA write it out, so the user's
own arithmetic changed in the last bits, and an optimizer such as Adam (which divides each
gradient by its running magnitude) carries that into every later step. Each case here trains
or solves with streaming on, through each transport that runs it, and compares with
``np.array_equal``, not a tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimistix as optx
import pytest

import sowtel
import sowtel.flax
import sowtel.summaries

STEPS = 3
TRANSPORTS = ("callback", "sowtel.jit")


def run(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any, way: str,
        summary: str = "stats") -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """``STEPS`` steps of ``step`` run ``way`` (``"plain"``: ``jax.jit``, nothing enabled):
    the final state's leaves, the losses, and the number of records streamed."""
    fn = sowtel.jit(step) if way == "sowtel.jit" else jax.jit(step)
    ctx: Any = contextlib.nullcontext()
    if way != "plain":
        ctx = sowtel.enable(exporter="memory", summary=summary)
    losses = []
    with ctx as session:
        for _ in range(STEPS):
            state, loss = fn(state, batch)
            losses.append(np.asarray(loss))
        records = 0
        if way != "plain":
            assert sowtel.flush(timeout=60)
            records = len(session.exporters[0].records)
    return [np.asarray(x) for x in jax.tree.leaves(state)], losses, records


def assert_bit_identical(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i)
        if not np.array_equal(g, w):
            rel = np.max(np.abs(g - w) / np.maximum(np.abs(w), 1e-30))
            raise AssertionError(f"{what}: leaf {i} differs (max relative {rel:.3g})")


# -- a Flax Linen model trained with Adam ----------------------------------------------------


class ScaledBlock(nn.Module):
    """A residual block whose branch is scaled by a learned vector before the residual add
    (LayerScale, as in CaiT and many vision transformers): the sown value is a product that
    the residual add consumes, the pattern XLA:CPU compiles to a fused multiply-add."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        gamma = self.param("gamma", nn.initializers.constant(0.5), (x.shape[-1],))
        h = nn.gelu(nn.Dense(2 * x.shape[-1], name="up")(nn.LayerNorm(name="ln")(x)))
        h = sowtel.flax.sow(self, h, "act")
        branch = sowtel.flax.sow(self, gamma * nn.Dense(x.shape[-1], name="down")(h), "branch")
        return x + branch


class Net(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        for i in range(2):
            x = ScaledBlock(name=f"block{i}")(x)
        return nn.Dense(1, name="head")(x)


def linen_adam() -> tuple[Callable[[Any, Any], Any], Any, Any]:
    model, tx = Net(), optax.adam(1e-2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    batch = (x, jnp.sin(x.sum(axis=1, keepdims=True)))
    params = model.init(jax.random.key(0), x)

    def step(state: Any, batch: Any) -> Any:
        params, opt = state
        x, y = batch
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    return step, (params, tx.init(params)), batch


@pytest.mark.parametrize("summary", ["stats", "full"])
@pytest.mark.parametrize("way", TRANSPORTS)
def test_linen_adam_training_is_bit_identical_with_streaming_on(way: str, summary: str) -> None:
    step, state, batch = linen_adam()
    want_state, want_losses, _ = run(step, state, batch, "plain")
    assert want_losses[-1] < want_losses[0], want_losses  # it learns
    got_state, got_losses, records = run(step, state, batch, way, summary)
    # Both sites of both blocks, primal and cotangent, every step: the summaries really ran.
    assert records == STEPS * 2 * 2 * 2, records
    assert_bit_identical(got_losses, want_losses, f"{way} {summary}: losses")
    assert_bit_identical(got_state, want_state, f"{way} {summary}: parameters and Adam state")


@pytest.mark.parametrize("summary", ["stats", "histogram", "health", "full"])
def test_sown_product_feeding_an_add_keeps_its_rounding(summary: str) -> None:
    # The smallest case: with the product written out, a * b + c rounds twice.
    def f(a: Any, b: Any, c: Any) -> Any:
        return sowtel.sow(a * b, "p") + c

    rng = np.random.default_rng(1)
    a, b, c = (jnp.asarray(rng.normal(size=4096), jnp.float32) for _ in range(3))
    want = np.asarray(jax.jit(f)(a, b, c))
    # The test can fail: rounding the product first differs from a fused multiply-add here.
    assert not np.array_equal(want, np.asarray(a) * np.asarray(b) + np.asarray(c))
    with sowtel.enable(exporter="memory", summary=summary) as session:
        got = {way: np.asarray((sowtel.jit if way == "sowtel.jit" else jax.jit)(f)(a, b, c))
               for way in TRANSPORTS}
        assert sowtel.flush(timeout=30)
    assert len(session.exporters[0].records) == 2
    for way, value in got.items():
        assert np.array_equal(value, want), way


@pytest.mark.parametrize("way", TRANSPORTS)
def test_every_n_steps_keeps_the_rounding_of_every_step(way: str) -> None:
    # every=2 with the step traced into the program: the callback transport decides on the
    # device, under a lax.cond whose operands XLA writes out; sowtel.jit runs its logging
    # program one step in two and jax.jit's own program otherwise.
    def f(a: Any, b: Any, c: Any, step: Any) -> Any:
        with sowtel.at_step(step):
            return sowtel.sow(a * b, "p") + c

    rng = np.random.default_rng(2)
    a, b, c = (jnp.asarray(rng.normal(size=4096), jnp.float32) for _ in range(3))
    want = np.asarray(jax.jit(f)(a, b, c, 0))
    fn = (sowtel.jit if way == "sowtel.jit" else jax.jit)(f)
    with sowtel.enable(exporter="memory", every=2) as session:
        got = [np.asarray(fn(a, b, c, jnp.int32(k))) for k in range(4)]
        assert sowtel.flush(timeout=30)
    assert sorted(r.step for r in session.exporters[0].records) == [0, 2]
    for k, value in enumerate(got):
        assert np.array_equal(value, want), k


def test_summary_copy_opt_out_reads_the_value_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # SOWTEL_SUMMARY_COPY=0: the summaries read the sown product itself, XLA writes it out,
    # and the add after it rounds twice (what streaming did before the copy).
    def f(a: Any, b: Any, c: Any) -> Any:
        return sowtel.sow(a * b, "p") + c

    rng = np.random.default_rng(1)
    a, b, c = (jnp.asarray(rng.normal(size=4096), jnp.float32) for _ in range(3))
    want = np.asarray(jax.jit(f)(a, b, c))
    rounded_twice = np.asarray(a) * np.asarray(b) + np.asarray(c)
    monkeypatch.setenv("SOWTEL_SUMMARY_COPY", "0")
    with sowtel.enable(exporter="memory"):
        got = np.asarray(jax.jit(f)(a, b, c))
    assert np.array_equal(got, rounded_twice) and not np.array_equal(got, want)
    monkeypatch.setenv("SOWTEL_SUMMARY_COPY", "yes")
    with pytest.raises(ValueError, match="SOWTEL_SUMMARY_COPY='yes' is not a setting"):
        sowtel.summaries.reads_copy()


# -- optimistix: the implicit gradient of a least-squares fit ---------------------------------

def observations() -> tuple[Any, Any]:
    """A decaying exponential, slightly perturbed, sampled at 24 times."""
    t = jnp.linspace(0.0, 3.0, 24)
    return t, 2.0 * jnp.exp(-0.7 * t) + 0.1 + 0.01 * jnp.sin(7 * t)


def residual(y: Any, args: Any) -> Any:
    offset, t, obs = args
    return sowtel.sow(y[0] * jnp.exp(-y[1] * t) + offset - obs, "residual")


@pytest.mark.parametrize("solver", ["gauss_newton", "levenberg_marquardt"])
def test_optimistix_implicit_gradient_is_bit_identical_with_streaming_on(solver: str) -> None:
    # The sow sits in the residual function, which optimistix runs in its solver loop, in the
    # Jacobian's jvp and inside lineax's linear solve of the implicit gradient. Only the
    # callback transport runs sows inside lineax's primitive so far.
    make = {"gauss_newton": optx.GaussNewton,
            "levenberg_marquardt": optx.LevenbergMarquardt}[solver]

    t, obs = observations()

    def fit(offset: Any) -> Any:
        sol = optx.least_squares(residual, make(rtol=1e-6, atol=1e-6), jnp.array([1.0, 0.3]),
                                 args=(offset, t, obs), max_steps=64, throw=False)
        return jnp.sum(sol.value ** 2)

    grad = jax.grad(fit)
    offset = jnp.float32(0.05)
    want = np.asarray(jax.jit(grad)(offset))
    # The gradient is right: against central finite differences of the fit in float64 terms.
    h = 1e-2
    fd = (float(jax.jit(fit)(offset + h)) - float(jax.jit(fit)(offset - h))) / (2 * h)
    np.testing.assert_allclose(want, fd, rtol=1e-2)
    for summary in ("stats", "full"):
        with sowtel.enable(exporter="memory", summary=summary) as session:
            got = np.asarray(jax.jit(grad)(offset))
            assert sowtel.flush(timeout=30)
        modes = {r.mode for r in session.exporters[0].records}
        assert {"primal", "tangent"} <= modes, modes
        assert np.array_equal(got, want), (summary, float(got), float(want))
