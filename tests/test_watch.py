"""sowtel.optax.watch: the optimizer's gradients, updates and parameters as sites, with both
transports, checked against numbers computed by hand with numpy."""

from __future__ import annotations

import doctest
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sowtel
import sowtel.optax
from sowtel.exporters.memory import MemoryExporter

LR = 0.25


def _params() -> dict[str, jax.Array]:
    return {"b": jnp.zeros(3), "w": jnp.array([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]])}


def _batch() -> tuple[jax.Array, jax.Array]:
    return jnp.array([[1.0, 2.0], [-1.0, 0.5]]), jnp.array([[0.5, 0.0, 1.0], [1.0, -1.0, 0.0]])


def _loss(p: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _step(tx: optax.GradientTransformation):  # type: ignore[no-untyped-def]
    def step(p, state, x, y):  # type: ignore[no-untyped-def]
        grads = jax.grad(_loss)(p, x, y)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    return step


def _expected(p: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Gradients of the loss written out by hand: d/dw mean(r^2) = 2 x^T r / r.size."""
    x, y = (np.asarray(a, np.float64) for a in _batch())
    w, b = np.asarray(p["w"], np.float64), np.asarray(p["b"], np.float64)
    r = x @ w + b - y
    gw, gb = 2 * x.T @ r / r.size, 2 * r.sum(0) / r.size
    out = {"optim/grads/w": gw, "optim/grads/b": gb, "optim/updates/w": -LR * gw,
           "optim/updates/b": -LR * gb, "optim/params/w": w, "optim/params/b": b}
    norm = lambda *a: np.sqrt(sum((v ** 2).sum() for v in a))  # noqa: E731
    out["optim/norm/grads"] = np.array(norm(gw, gb))
    out["optim/norm/updates"] = np.array(LR * norm(gw, gb))
    out["optim/norm/params"] = np.array(norm(w, b))
    out["optim/update_ratio/w"] = np.array(LR * norm(gw) / (norm(w) + sowtel.optax.RATIO_EPS))
    out["optim/update_ratio/b"] = np.array(LR * norm(gb) / (norm(b) + sowtel.optax.RATIO_EPS))
    return out


def _run(transport: str, every: int | None, steps: int) -> tuple[list[sowtel.Record], list[dict]]:
    tx = sowtel.optax.watch(optax.sgd(LR), every=every)
    step = _step(tx)
    p = _params()
    state = tx.init(p)
    seen = []
    memory = MemoryExporter()
    compiled = sowtel.jit(step) if transport == "sowtel.jit" else jax.jit(step)
    with sowtel.enable(exporter=memory, summary="full"):
        for k in range(steps):
            seen.append(p)
            with sowtel.at_step(k):
                p, state = compiled(p, state, *_batch())
        sowtel.flush()
    return memory.records, seen


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_values_match_hand_computed(transport: str) -> None:
    records, seen = _run(transport, None, 2)
    by_step: dict[int, dict[str, np.ndarray]] = {}
    for r in records:
        assert r.mode == "primal" and r.value is not None
        by_step.setdefault(r.step, {})[r.name] = r.value
    assert sorted(by_step) == [0, 1]
    for k in (0, 1):
        expected = _expected(seen[k])
        assert sorted(by_step[k]) == sorted(expected)
        for name, want in expected.items():
            np.testing.assert_allclose(by_step[k][name], want, rtol=2e-5, atol=1e-6,
                                       err_msg=f"{name} at step {k}")


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_every_streams_only_due_steps(transport: str) -> None:
    records, _ = _run(transport, 3, 7)
    assert sorted({r.step for r in records}) == [0, 3, 6]
    assert {r.name for r in records if r.step == 3} == set(_expected(_params()))


def test_training_is_unchanged_and_disabled_program_identical() -> None:
    plain, watched = optax.adam(1e-2), sowtel.optax.watch(optax.adam(1e-2))
    p = _params()
    a = jax.jit(_step(plain)).lower(p, plain.init(p), *_batch()).as_text()
    b = jax.jit(_step(watched)).lower(p, watched.init(p), *_batch()).as_text()
    assert a == b
    pa, sa = p, plain.init(p)
    pb, sb = p, watched.init(p)
    with sowtel.enable(exporter=MemoryExporter()):
        for k in range(3):
            pa, sa = jax.jit(_step(plain))(pa, sa, *_batch())
            with sowtel.at_step(k):
                pb, sb = sowtel.jit(_step(watched))(pb, sb, *_batch())
    for name in p:
        np.testing.assert_array_equal(pa[name], pb[name])


def test_no_params_no_param_sites_and_flags() -> None:
    tx = sowtel.optax.watch(optax.sgd(LR), grads=False, params=True)
    g = {"w": jnp.ones(2)}
    _, inter = sowtel.save_intermediates(lambda g: tx.update(g, tx.init(g)))(g)
    assert list(inter) == ["optim/updates", "optim/norm/updates"]


@pytest.mark.parametrize("bad, match", [
    ({"every": 0}, "every"), ({"grads": 1}, "grads"), ({"prefix": "/x"}, "name"),
])
def test_bad_arguments(bad: dict, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        sowtel.optax.watch(optax.sgd(LR), **bad)
    with pytest.raises(TypeError, match="GradientTransformation"):
        sowtel.optax.watch(lambda g: g)


def test_docstring_examples() -> None:
    result = doctest.testmod(sowtel.optax, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- inside optax's own wrappers: the calling convention optax uses --------------------------


def _adam() -> optax.GradientTransformation:
    return optax.adam(1e-2)


# Each wrapper, built around an optimizer made by `make` (the identity, or sowtel.optax.watch),
# and the extra keyword arguments its update takes (a callable of the step's loss).
WRAPPERS: dict[str, tuple[Any, Any]] = {
    "MultiSteps": (lambda make: optax.MultiSteps(make(_adam()), every_k_schedule=2), None),
    "MultiSteps.gradient_transformation": (
        lambda make: optax.MultiSteps(make(_adam()), every_k_schedule=2)
        .gradient_transformation(), None),
    "chain": (lambda make: optax.chain(optax.clip_by_global_norm(0.5), make(_adam())), None),
    "multi_transform": (lambda make: optax.multi_transform(
        {"adam": make(_adam()), "sgd": optax.sgd(0.1)}, {"w": "adam", "b": "sgd"}), None),
    "masked": (lambda make: optax.masked(make(_adam()), {"w": True, "b": False}), None),
    "inject_hyperparams": (lambda make: optax.inject_hyperparams(
        lambda learning_rate: make(optax.adam(learning_rate)))(learning_rate=1e-2), None),
    "apply_if_finite": (
        lambda make: optax.apply_if_finite(make(_adam()), max_consecutive_errors=2), None),
    "contrib.schedule_free": (lambda make: optax.contrib.schedule_free(
        make(optax.sgd(0.1)), learning_rate=0.1), None),
    # An extra argument through the watched optimizer: reduce_on_plateau needs value=.
    "contrib.reduce_on_plateau": (lambda make: optax.chain(
        make(_adam()), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)),
        lambda loss: {"value": loss}),
}


def _train_wrapped(tx: Any, extra: Any, transport: str, steps: int = 4
                   ) -> tuple[list[Any], list[sowtel.Record]]:
    def step(p, state, x, y):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(_loss)(p, x, y)
        kwargs = extra(loss) if extra is not None else {}
        updates, state = tx.update(grads, state, params=p, **kwargs)  # as optax passes params
        return optax.apply_updates(p, updates), state, updates

    compiled = sowtel.jit(step) if transport == "sowtel.jit" else jax.jit(step)
    p = _params()
    state = tx.init(p)
    memory = MemoryExporter()
    seen = []
    session = sowtel.enable(exporter=memory) if transport != "off" else None
    try:
        for k in range(steps):
            with sowtel.at_step(k):
                p, state, u = compiled(p, state, *_batch())
            seen.append((p, u))
        sowtel.flush()
    finally:
        if session is not None:
            sowtel.disable()
    return seen, memory.records


@pytest.mark.parametrize("transport", ["off", "callback", "sowtel.jit"])
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_watched_inside_optax_wrappers_is_bitwise_and_streams(wrapper: str,
                                                             transport: str) -> None:
    build, extra = WRAPPERS[wrapper]
    want, _ = _train_wrapped(build(lambda tx: tx), extra, "off")
    got, records = _train_wrapped(build(sowtel.optax.watch), extra, transport)
    # Every site once a step (none numbered _0/_1 by optax's own traces of the update, such
    # as MultiSteps' eval_shape of it in the branch that skips).
    steps: dict[str, list[int]] = {}
    for r in records:
        steps.setdefault(r.name, []).append(r.step)
    if transport == "off":
        assert steps == {}
    else:
        assert {"optim/norm/grads", "optim/norm/updates", "optim/update_ratio/w",
                "optim/grads/w", "optim/params/w"} <= set(steps), sorted(steps)
    for name, seen in steps.items():
        assert sorted(seen) == [0, 1, 2, 3], (name, seen)
    # Streaming on or off, the updates are those of the unwatched optimizer, bit for bit.
    for k, ((p, u), (p_ref, u_ref)) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(jax.tree_util.tree_leaves((p, u)), jax.tree_util.tree_leaves(
                (p_ref, u_ref)), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{wrapper} {transport} step {k}")


@pytest.mark.parametrize("make, extra_args", [
    (lambda: optax.adam(1e-2), True), (lambda: optax.scale(-0.1), False),
    (lambda: optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), True),
])
def test_watch_keeps_the_calling_convention_of_what_it_wraps(make: Any, extra_args: bool
                                                            ) -> None:
    tx, watched = make(), sowtel.optax.watch(make())
    assert isinstance(watched, optax.GradientTransformationExtraArgs) is extra_args
    assert isinstance(watched, optax.GradientTransformation)
    p = _params()
    g = jax.grad(_loss)(p, *_batch())
    want, _ = tx.update(g, tx.init(p), p)
    # params positional or by keyword, and every argument by optax's names.
    for got, _ in (watched.update(g, watched.init(p), p),
                   watched.update(g, watched.init(p), params=p),
                   watched.update(updates=g, state=watched.init(p), params=p)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    if extra_args:  # extra arguments reach the optimizer (and are ignored by those that may)
        watched.update(g, watched.init(p), p, value=jnp.float32(1.0))
    else:  # as the plain transformation itself refuses them
        with pytest.raises(TypeError):
            tx.update(g, tx.init(p), p, value=1.0)
        with pytest.raises(TypeError):
            watched.update(g, watched.init(p), p, value=1.0)
