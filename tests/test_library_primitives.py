"""Sows inside higher-order primitives sowtel has no construct rule for: ``lax.custom_linear_solve``
(and ``jax.scipy.sparse.linalg.cg``, built on it), ``lax.custom_root`` (a primitive since JAX
0.12), lineax's ``linear_solve`` and a primitive defined here through ``jax.extend``.

``sowtel.jit`` runs every such program ``jax.jit`` runs, with the same results and the records
of the callback transport; ``save_intermediates`` captures what the primitive runs, and each
rerun of a solver's derivative rules as another occurrence of its sites (numbered under
``duplicates="number"``, refused with an error naming the site and the primitive otherwise).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from hop_primitive import opaque_call

import sowtel
from sowtel import sow

H = np.array([0.3, -0.5], np.float32)
A = np.array([[4.0, 1.0], [1.0, 3.0]], np.float32)


def diagonal_solve(h):
    """A custom_linear_solve whose solve applies the matvec once (to ones: the diagonal)."""
    c = 1.5 + jnp.tanh(h) ** 2
    x = jax.lax.custom_linear_solve(lambda v: sow(c * v, "mv"), jnp.sin(h) + 1.0,
                                    lambda mv, r: r / mv(jnp.ones_like(r)), symmetric=True)
    return jnp.sum(jnp.sin(x))


def newton_root(theta):
    """sqrt(2 + theta^2) by six Newton steps in lax.custom_root."""
    def residual(x):
        return sow(x ** 2 - (2.0 + theta ** 2), "res")

    def solve(f, x):
        return jax.lax.fori_loop(0, 6, lambda i, x: x - f(x) / (2 * x), x)

    root = jax.lax.custom_root(residual, jnp.ones_like(theta), solve,
                               lambda g, y: y / g(jnp.ones_like(y)))
    return jnp.sum(jnp.sin(root))


def scaled(h):
    return jnp.asarray(A) * (1.0 + 0.1 * jnp.tanh(h[0]))


def cg_solve(h):
    x, _ = jax.scipy.sparse.linalg.cg(lambda v: sow(scaled(h) @ v, "cgmv"), jnp.sin(h) + 1.0)
    return jnp.sum(jnp.sin(x))


def lineax_solve(h):
    op = lx.FunctionLinearOperator(lambda v: sow(scaled(h) @ v, "lxmv"),
                                   jax.ShapeDtypeStruct((2,), jnp.float32),
                                   lx.positive_semidefinite_tag)
    x = lx.linear_solve(op, jnp.sin(h) + 1.0, lx.CG(rtol=1e-6, atol=1e-6)).value
    return jnp.sum(jnp.sin(x))


def optimistix_root(h):
    """Newton's method on x^3 + x - target: its residual function runs in lineax's solve (the
    Newton step) and in optimistix's loop."""
    target = jnp.sin(h) + 2.0

    def residual(x, args):
        return sow(x ** 3 + x - args, "optx")

    sol = optx.root_find(residual, optx.Newton(rtol=1e-6, atol=1e-6), jnp.ones_like(h),
                         args=target, max_steps=32)
    return jnp.sum(jnp.sin(sol.value))


def extend_call(h, implemented=True):
    def body(x):
        return [sow(jnp.sin(x) * 2.0, "inner") + 0.1]

    return jnp.sum(jnp.tanh(opaque_call(body, h, implemented=implemented)[0]) ** 2)


PROGRAMS: dict[str, Callable[..., Any]] = {
    "custom_linear_solve": diagonal_solve,
    "custom_root": newton_root,
    "cg": cg_solve,
    "lineax": lineax_solve,
    "optimistix": optimistix_root,
    "jax_extend": extend_call,
    "jax_extend_no_impl": lambda h: extend_call(h, implemented=False),
}


def transformed(fn: Callable[..., Any], transform: str) -> tuple[Callable[..., Any], tuple]:
    if transform == "fwd":
        return fn, (H,)
    if transform == "grad":
        return jax.grad(fn), (H,)
    if transform == "jvp":
        return lambda x, t: jax.jvp(fn, (x,), (t,)), (H, H[::-1].copy())
    return jax.vmap(jax.grad(fn)), (np.stack([H, -H]),)


def stream(jit: Callable[..., Any], fn: Callable[..., Any], args: tuple, *,
           steps: tuple[int | None, ...] = (3, 4), **options: Any) -> tuple[list[Any], list[Any]]:
    outs = []
    step_fn = jit(fn)  # one function: without at_step, its calls count the steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the repeated-name warning
        with sowtel.enable(exporter="memory", summary="full", **options) as session:
            for step in steps:
                if step is None:
                    outs.append(jax.block_until_ready(step_fn(*args)))
                    continue
                with sowtel.at_step(step):
                    outs.append(jax.block_until_ready(step_fn(*args)))
            assert sowtel.flush(timeout=60)
            status = sowtel.status()
    assert status["dropped"] == 0 and not any(status["errors"].values()), status
    return outs, list(session.exporters[0].records)


def labels(records: list[Any]) -> list[tuple[Any, ...]]:
    return sorted((r.name, r.mode, r.step, r.index, r.shape) for r in records)


@pytest.mark.parametrize("transform", ["fwd", "grad", "jvp", "vmap_grad"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_sowtel_jit_runs_what_jax_jit_runs_with_the_same_records(program: str,
                                                                  transform: str) -> None:
    fn, args = transformed(PROGRAMS[program], transform)
    plain = jax.jit(fn)(*args)
    by_callback_out, by_callback = stream(jax.jit, fn, args)
    by_outputs_out, by_outputs = stream(sowtel.jit, fn, args)
    assert by_callback, "the program streams something"
    assert labels(by_outputs) == labels(by_callback)
    unmatched = list(by_callback)
    for r in by_outputs:  # the same values too (a name and label may repeat: any match)
        match = next(o for o in unmatched if (o.name, o.mode, o.step, o.index)
                     == (r.name, r.mode, r.step, r.index) and np.allclose(
                         o.value, r.value, rtol=1e-5, atol=1e-6, equal_nan=True))
        unmatched.remove(match)
    for out in (*by_callback_out, *by_outputs_out):
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(plain), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_issues_minimal_case_runs() -> None:
    def f(b):
        mv = lambda x: sow(2.0 * x, "mv")  # noqa: E731
        return jax.lax.custom_linear_solve(mv, b, lambda _, r: r / 2.0).sum()

    outs, records = stream(sowtel.jit, f, (jnp.ones(3),), steps=(None,))
    assert float(outs[0]) == 1.5
    assert records == []  # its solve never applies the matvec: nothing runs, nothing streams


def test_sites_in_a_solver_carry_the_calls_step_and_stream_through_a_callback() -> None:
    fn = sowtel.jit(cg_solve)
    _, records = stream(sowtel.jit, cg_solve, (H,), steps=(None, 7, None))
    # cg applies the matvec once before its loop and once per iteration: every record of a
    # call carries its step (the call count without at_step).
    assert {r.step for r in records} == {0, 7, 2}
    per_call = [sorted((r.name, r.index) for r in records if r.step == s) for s in (0, 7, 2)]
    assert per_call[0] == per_call[1] == per_call[2] and len(per_call[0]) > 2
    with sowtel.enable(exporter="memory"):
        assert "callback" in fn.lower_logging(H, step=0).as_text()
    assert "callback" not in fn.lower(H).as_text()


def test_a_name_sown_outside_and_inside_a_solver_is_numbered_as_by_callbacks() -> None:
    def f(h):
        before = sow(jnp.cos(h), "mv")  # summarised alone; numbered with the solver's site
        return diagonal_solve(h * before)

    for transform in ("fwd", "grad"):
        fn, args = transformed(f, transform)
        _, by_callback = stream(jax.jit, fn, args)
        _, by_outputs = stream(sowtel.jit, fn, args)
        assert labels(by_outputs) == labels(by_callback)
        assert {r.name for r in by_callback} >= {"mv_0", "mv_1"}


def test_a_strided_site_inside_a_solver_streams_on_its_steps() -> None:
    def f(h):
        c = 1.5 + jnp.tanh(h) ** 2
        x = jax.lax.custom_linear_solve(
            lambda v: sow(c * v, "mv", every=2), jnp.sin(h) + 1.0,
            lambda mv, r: r / mv(jnp.ones_like(r)), symmetric=True)
        return jnp.sum(x)

    # The session streams every 5th step; the site every 2nd: steps 0 and 2 of 0..3.
    _, records = stream(sowtel.jit, f, (H,), steps=(None,) * 4, every=5)
    assert sorted(r.step for r in records) == [0, 2]


# -- save_intermediates -------------------------------------------------------------------------


def test_capture_of_a_custom_linear_solve_is_the_value_its_solve_ran() -> None:
    (_, inter) = sowtel.save_intermediates(diagonal_solve)(H)
    np.testing.assert_allclose(inter["mv"]["primal"], 1.5 + np.tanh(H) ** 2, rtol=1e-6)
    assert list(inter["mv"]) == ["primal"]


def test_capture_of_custom_root_stacks_the_solvers_iterations() -> None:
    _, inter = sowtel.save_intermediates(newton_root)(H)
    # fori_loop with static bounds is a scan: one residual per Newton step, by hand.
    x = np.ones(2, np.float64)
    want = []
    for _ in range(6):
        f = x ** 2 - (2.0 + H.astype(np.float64) ** 2)
        want.append(f)
        x = x - f / (2 * x)
    np.testing.assert_allclose(inter["res"]["primal"], np.stack(want), rtol=1e-5, atol=1e-6)
    assert inter["res"].stacked == {"primal": (("scan", 6),)}


def test_capture_of_cg_gives_each_application_of_the_matvec_as_it_ran() -> None:
    _, inter = sowtel.save_intermediates(cg_solve, duplicates="number")(H)
    # Before its loop cg applies the matvec to its initial guess, zero; in the loop, the value
    # captured is the last iteration's (as for any while_loop body).
    np.testing.assert_allclose(inter["cgmv_0"]["primal"], np.zeros(2), atol=1e-7)
    m = np.asarray(scaled(H), np.float64)
    b = np.sin(H.astype(np.float64)) + 1.0
    x, r = np.zeros(2), b.copy()
    p, applied = r.copy(), None
    for _ in range(2):  # a 2x2 system: exact after two conjugate directions
        applied = m @ p
        alpha = (r @ r) / (p @ applied)
        x, r_new = x + alpha * p, r - alpha * applied
        p, r = r_new + (r_new @ r_new) / (r @ r) * p, r_new
    np.testing.assert_allclose(inter["cgmv_1"]["primal"], applied, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'cgmv' is used 2 times"):
        sowtel.save_intermediates(cg_solve)(H)


def test_capture_of_lineax_and_jax_extend_primitives() -> None:
    (_, inter) = sowtel.save_intermediates(extend_call)(H)
    np.testing.assert_allclose(inter["inner"]["primal"], np.sin(H) * 2.0, rtol=1e-6)
    (_, inter) = sowtel.save_intermediates(lineax_solve, duplicates="number")(H)
    # lineax's CG applies the operator to its initial guess (zero) first.
    np.testing.assert_allclose(inter["lxmv_0"]["primal"], np.zeros(2), atol=1e-7)
    assert all(list(site) == ["primal"] for site in inter.values())


RERUN_CASES = [
    ("custom_linear_solve", "mv", "custom_linear_solve"),
    ("cg", "cgmv", "custom_linear_solve"),
    ("lineax", "lxmv", "linear_solve|vprim"),
    ("jax_extend", "inner", "opaque_call"),
]


@pytest.mark.parametrize("transform", ["jvp"])  # a backward pass's reruns are silent (below)
@pytest.mark.parametrize("program, site, construct", RERUN_CASES)
def test_the_reruns_of_a_differentiated_solver_are_occurrences_named_by_the_error(
        program: str, site: str, construct: str, transform: str) -> None:
    fn, args = transformed(PROGRAMS[program], transform)
    with pytest.raises(ValueError, match=rf"sow '{site}' \(primal\) runs again in a second "
                                         rf"'({construct})' primitive.*duplicates='number'"):
        sowtel.save_intermediates(fn)(*args)


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap_grad"])
@pytest.mark.parametrize("program, site, construct", RERUN_CASES)
def test_the_reruns_of_a_differentiated_solver_are_captured_numbered(
        program: str, site: str, construct: str, transform: str) -> None:
    fn, args = transformed(PROGRAMS[program], transform)
    result, inter = sowtel.save_intermediates(fn, duplicates="number")(*args)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(jax.jit(fn)(*args)),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    names = sorted(n for n in inter if n == site or n.startswith(f"{site}_"))
    if transform == "jvp":  # the tangent solve reruns the solver's functions
        assert len(names) >= 2, names
    assert names == [site] or names == [f"{site}_{k}" for k in range(len(names))], names
    assert all("primal" in inter[n] for n in names)
    # The first occurrence is the forward solve's run: the value the undifferentiated program
    # captures (the first of its occurrences where it has several).
    _, forward = sowtel.save_intermediates(PROGRAMS[program], duplicates="number")(H)
    first = forward[site if site in forward else f"{site}_0"]["primal"]
    got = inter[names[0]]["primal"]
    if transform == "vmap_grad":
        got = got[0]  # the batch's first row is H
    np.testing.assert_allclose(got, first, rtol=1e-5, atol=1e-6)
    # The callback transport streams its runs under the same names (it numbers each sow as
    # traced, and sends nothing for one that never runs; capture numbers each run it
    # evaluates, a solver's linearisation included, so it may have more).
    _, records = stream(jax.jit, fn, args, steps=(None,))
    streamed = {r.name for r in records if r.name == site or r.name.startswith(f"{site}_")}
    assert names[0] in streamed and streamed <= set(names), (sorted(streamed), names)


def test_capture_without_an_implementation_names_the_site() -> None:
    with pytest.raises(NotImplementedError, match="sow 'inner' inside a 'sealed_call' "
                                                  "primitive.*Stream the site instead"):
        sowtel.save_intermediates(PROGRAMS["jax_extend_no_impl"])(H)


@pytest.mark.parametrize("program", ["custom_linear_solve", "cg", "lineax", "jax_extend"])
def test_capture_keeps_the_primitives_derivative_when_differentiated_from_outside(
        program: str) -> None:
    fn = PROGRAMS[program]

    def through_capture(h):
        value, _ = sowtel.save_intermediates(fn, duplicates="number")(h)
        return value

    got = jax.grad(through_capture)(H)
    np.testing.assert_allclose(got, jax.grad(fn)(H), rtol=1e-5)
    d = 1e-3  # and against central differences, in float64 on the host
    for i in range(2):
        e = np.zeros(2, np.float32)
        e[i] = d
        fd = (float(fn(H + e)) - float(fn(H - e))) / (2 * d)
        np.testing.assert_allclose(got[i], fd, rtol=2e-2, atol=2e-3)
