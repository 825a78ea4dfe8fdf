"""Sites inside a construct nested in a cond whose predicate ``vmap`` batches.

JAX runs every branch of such a cond on every row and selects. A site reports its values in the
rows that took its branch and NaN in the others, also where it sits inside a jitted function, a
``jax.checkpoint``, a loop, another cond or a ``custom_jvp`` / ``custom_vjp`` function in the
branch, under ``vmap`` and ``vmap`` of ``grad``, in capture and both streaming transports.
Expected derivatives come from ``jax.grad`` of an explicit perturbation at the site, row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel import save_intermediates, sow

XS = np.array([[0.3, 1.2], [-0.5, 0.4], [0.2, -0.7], [-0.9, 0.1]], np.float32)
TAKEN = XS[:, 0] > 0  # rows 0 and 2 take the sowing branch


def site(v: Any, eps: Any) -> Any:
    return sow(jnp.sin(v), "s") if eps is None else jnp.sin(v) + eps


def checkpointed(v: Any, eps: Any) -> Any:
    fn = jax.checkpoint(lambda y: site(y, eps), policy=jax.checkpoint_policies.nothing_saveable)
    return fn(v)


def in_custom_jvp(v: Any, eps: Any) -> Any:
    if eps is not None:  # the reference: the rule's derivative (cos) is sin's own
        return site(v, eps)

    @jax.custom_jvp
    def g(y: Any) -> Any:
        return site(y, eps)

    g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * t[0]))
    return g(v)


def in_custom_vjp(v: Any, eps: Any) -> Any:
    if eps is not None:
        return site(v, eps)

    @jax.custom_vjp
    def g(y: Any) -> Any:
        return site(y, eps)

    g.defvjp(lambda y: (g(y), y), lambda y, ct: (jnp.cos(y) * ct,))
    return g(v)


def jitted(v: Any, eps: Any) -> Any:
    return jax.jit(lambda y: site(y, eps))(v)


def in_while(v: Any, eps: Any) -> Any:
    # One pass (a while loop's sites report the last pass's value).
    return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, site(c[1], eps)),
                              (0, v))[1]


def in_unbatched_cond(v: Any, eps: Any) -> Any:
    return jax.lax.cond(True, lambda y: site(y, eps), lambda y: jnp.sin(y), v)


NESTED: dict[str, Callable[[Any, Any], Any]] = {
    "checkpoint": checkpointed, "custom_jvp": in_custom_jvp, "custom_vjp": in_custom_vjp,
    "jit": jitted, "while": in_while, "cond": in_unbatched_cond}
REVERSE = ("checkpoint", "custom_jvp", "custom_vjp", "jit", "cond")  # while: forward only


def program(nested: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def f(x: Any, eps: Any = None) -> Any:
        return jax.lax.cond(x[0] > 0, lambda v: 3.0 * nested(v, eps) ** 2,
                            lambda v: jnp.cos(v), x).sum()
    return f


def expected(nested: Callable[[Any, Any], Any]) -> tuple[np.ndarray, np.ndarray]:
    """The site's primal and cotangent per row: by hand in the rows that take the branch (the
    cotangent by ``jax.grad`` of a perturbation there, row by row), NaN in the others."""
    f = program(nested)
    primal = np.where(TAKEN[:, None], np.sin(XS), np.nan)
    cot = np.full_like(XS, np.nan)
    for row in np.flatnonzero(TAKEN):
        cot[row] = jax.grad(lambda e, r=row: f(XS[r], e))(jnp.zeros(2))
    np.testing.assert_allclose(cot[TAKEN], 6.0 * np.sin(XS[TAKEN]), rtol=1e-5)  # by hand
    return primal, cot


@pytest.mark.parametrize("kind", sorted(NESTED))
def test_capture_masks_a_nested_site_under_vmap_and_vmap_of_grad(kind: str) -> None:
    f = program(NESTED[kind])
    primal = np.where(TAKEN[:, None], np.sin(XS), np.nan)
    _, inter = save_intermediates(jax.vmap(f))(XS)
    np.testing.assert_allclose(inter["s"]["primal"], primal, rtol=1e-6)
    if kind not in REVERSE:
        return
    primal, cot = expected(NESTED[kind])
    _, inter = jax.jit(save_intermediates(jax.vmap(jax.grad(f))))(XS)
    np.testing.assert_allclose(inter["s"]["primal"], primal, rtol=1e-6)
    if kind.startswith("custom"):  # a custom rule's function reports its site's primal only
        assert set(inter["s"]) == {"primal"}
    else:
        np.testing.assert_allclose(inter["s"]["cotangent"], cot, rtol=1e-5)


def stream(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    with sowtel.enable(exporter="memory", summary="full") as session:
        with sowtel.at_step(0):
            jax.block_until_ready(fn(*args))
        assert sowtel.flush(timeout=30)
        status = sowtel.status()
    assert status["dropped"] == 0 and not any(status["errors"].values())
    records = session.exporters[0].records
    assert len({r.mode for r in records}) == len(records), records
    return {r.mode: r for r in records}


@pytest.mark.parametrize("kind", ["checkpoint", "jit"])
@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_streaming_sends_the_masked_rows_of_a_nested_site(transport: str, kind: str) -> None:
    f = jax.vmap(jax.grad(program(NESTED[kind])))
    primal, cot = expected(NESTED[kind])
    jit = sowtel.jit if transport == "sowtel.jit" else jax.jit
    by_mode = stream(jit(f), XS)
    assert set(by_mode) == {"primal", "cotangent"}
    np.testing.assert_allclose(by_mode["primal"].value, primal, rtol=1e-6)
    np.testing.assert_allclose(by_mode["cotangent"].value, cot, rtol=1e-5)
    assert by_mode["cotangent"].stats["nan"] == 4.0  # two rows of two


def test_a_site_in_a_scan_in_the_branch_masks_every_iteration() -> None:
    ks = np.array([1.0, -2.0, 0.5], np.float32)

    def f(x: Any, eps: Any = None) -> Any:
        def body(c: Any, k: Any) -> Any:
            e = None if eps is None else eps[k_index(k)]
            return c + site(x * k, e), None

        return jax.lax.cond(x[0] > 0, lambda v: jax.lax.scan(body, v, ks)[0],
                            jnp.cos, x).sum()

    def k_index(k: Any) -> Any:
        return jnp.argmax(ks == k)

    _, inter = save_intermediates(jax.vmap(jax.grad(f)))(XS)
    primal = np.asarray(inter["s"]["primal"])  # (iterations, batch, 2): vmap of a scan
    assert primal.shape == (3, 4, 2)
    np.testing.assert_allclose(primal[:, TAKEN], np.sin(ks[:, None, None] * XS[TAKEN]),
                               rtol=1e-6)
    assert np.isnan(primal[:, ~TAKEN]).all()
    cot = np.asarray(inter["s"]["cotangent"])
    for row in np.flatnonzero(TAKEN):
        want = jax.grad(lambda e, r=row: f(XS[r], e))(jnp.zeros((3, 2)))
        np.testing.assert_allclose(cot[:, row], want, rtol=1e-5)
    assert np.isnan(cot[:, ~TAKEN]).all()


def test_nested_batched_conds_report_the_rows_that_take_both() -> None:
    def f(x: Any) -> Any:
        inner = jax.jit(lambda v: jax.lax.cond(v[1] > 0, lambda u: sow(u * 2.0, "s"),
                                               lambda u: u, v))
        return jax.lax.cond(x[0] > 0, inner, lambda v: v, x)

    _, inter = save_intermediates(jax.vmap(f))(XS)
    both = TAKEN & (XS[:, 1] > 0)
    assert both.tolist() == [True, False, False, False]
    want = np.where(both[:, None], XS * 2.0, np.nan)
    np.testing.assert_allclose(inter["s"]["primal"], want, rtol=1e-6)


def test_a_cond_without_nested_sows_is_jaxs_own_rule() -> None:
    # sowtel's rule runs only in front of conds that need it: the jaxpr of a vmapped cond
    # without sows, or with sows in the branches only, is the one JAX's rule gives.
    def plain(x: Any) -> Any:
        return jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)

    def own(x: Any) -> Any:
        return jax.lax.cond(x[0] > 0, lambda v: sow(jnp.sin(v), "s"), jnp.cos, x)

    with sowtel.enable(exporter="memory"):
        for fn in (plain, own):
            text = str(jax.make_jaxpr(jax.vmap(fn))(XS))
            assert "broadcast_in_dim 0" not in text and "eq" in text, text
        nested = str(jax.make_jaxpr(jax.vmap(program(jitted)))(XS))
        assert "sow" in nested and "pjit" not in nested.split("sow")[0][-200:]


def rule_in_loop(rule: str, loop: str) -> Callable[[Any, Any], Any]:
    """A ``custom_jvp`` / ``custom_vjp`` function's site inside a loop of one pass in the
    branch: binding the function in the loop's body traces it to a jaxpr of its own."""
    def nested(v: Any, eps: Any) -> Any:
        def step(c: Any) -> Any:
            return NESTED[rule](c, eps)

        if loop == "scan":
            return jax.lax.scan(lambda c, _: (step(c), None), v, None, length=1)[0]
        if loop == "fori":
            return jax.lax.fori_loop(0, 1, lambda i, c: step(c), v)
        return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, step(c[1])),
                                  (0, v))[1]
    return nested


@pytest.mark.parametrize("loop", ["scan", "fori", "while"])
@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
def test_a_custom_rules_site_in_a_loop_in_the_branch_is_masked(rule: str, loop: str) -> None:
    f = program(rule_in_loop(rule, loop))
    primal = np.where(TAKEN[:, None], np.sin(XS), np.nan)
    _, inter = save_intermediates(jax.vmap(f))(XS)
    got = np.asarray(inter["s"]["primal"])
    assert got.shape == ((4, 2) if loop == "while" else (1, 4, 2))  # a scan's: (T, B, ...)
    np.testing.assert_allclose(got.reshape(4, 2), primal, rtol=1e-6)
    if loop == "while":  # forward only
        return
    # The loss's gradient is untouched, and equals the one without the site's function.
    grads, inter = jax.jit(save_intermediates(jax.vmap(jax.grad(f))))(XS)
    np.testing.assert_allclose(np.asarray(inter["s"]["primal"]).reshape(4, 2), primal,
                               rtol=1e-6)
    assert set(inter["s"]) == {"primal"}  # a custom rule's function: its primal only
    plain = program(rule_in_loop(rule, loop))
    want = jax.vmap(jax.grad(lambda x: plain(x, jnp.zeros(2))))(XS)
    np.testing.assert_allclose(grads, want, rtol=1e-6)


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_streaming_masks_a_custom_rules_site_in_a_loop_in_the_branch(transport: str) -> None:
    f = jax.vmap(jax.grad(program(rule_in_loop("custom_vjp", "scan"))))
    jit = sowtel.jit if transport == "sowtel.jit" else jax.jit
    by_mode = stream(jit(f), XS)
    assert set(by_mode) == {"primal"}
    want = np.where(TAKEN[:, None], np.sin(XS), np.nan)
    np.testing.assert_allclose(np.asarray(by_mode["primal"].value).reshape(4, 2), want,
                               rtol=1e-6)
    assert by_mode["primal"].stats["nan"] == 4.0  # two rows of two


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_a_branch_no_row_takes_still_streams_its_masked_site(transport: str) -> None:
    # vmap runs the branch on every row, so its site streams, NaN in every row, as capture
    # reports it: the record says so (nan counts every element) rather than going missing.
    def f(x: Any) -> Any:
        return jax.lax.cond(x[0] > 10.0, lambda v: sow(jnp.sin(v), "s") * 2.0,
                            jnp.cos, x).sum()

    _, inter = save_intermediates(jax.vmap(f))(XS)
    assert np.isnan(inter["s"]["primal"]).all()
    jit = sowtel.jit if transport == "sowtel.jit" else jax.jit
    by_mode = stream(jit(jax.vmap(jax.grad(f))), XS)
    assert set(by_mode) == {"primal", "cotangent"}
    for record in by_mode.values():
        assert record.shape == (4, 2) and record.stats["nan"] == 8.0
        assert np.isnan(np.asarray(record.value)).all()
