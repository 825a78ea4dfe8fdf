"""Transformations around and inside the capture pass that once broke or changed a program.

Each case runs on both ends of the supported JAX range. Values are checked against numbers
derived by hand, derivatives against ``jax.grad`` / ``jax.jacfwd`` of the same function with an
explicit perturbation in place of the sow (``eps``), or against the user's own custom rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transform_cases
from transform_cases import POLICIES, jit, scan_loss, scan_primal, square_loss, stream

import sowtel
from sowtel import _jax_compat as jc
from sowtel import save_intermediates, sow

streaming = transform_cases.streaming  # the transport fixture of every transform test

X = np.array([0.5, 1.0], np.float32)
XS = np.array([1.0, 2.0, 3.0], np.float32)


def close(a: Any, b: Any) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@contextmanager
def flag(name: str, value: bool) -> Iterator[None]:
    before = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


# -- jax.checkpoint of a scan, differentiated ----------------------------------------------
# (Its grad, captured and streamed: the checkpoint_scan cases of tests/transform_cases.py.)


def test_vmap_and_jvp_of_grad_of_checkpointed_scan_are_captured() -> None:
    xs = jnp.array([0.7, -0.2], jnp.float32)
    grad_eps = jax.grad(lambda e, x: scan_loss(x, e))
    _, inter = save_intermediates(jax.vmap(jax.grad(scan_loss)))(xs)
    # Row b of the batch, iteration i (the order of the two axes is the capture matrix's
    # subject; here the values).
    batch_first = lambda v: v if v.shape == (2, 3) else np.asarray(v).T  # noqa: E731
    close(batch_first(inter["s"]["cotangent"]),
          jax.vmap(lambda x: grad_eps(jnp.zeros(3), x))(xs))
    close(batch_first(inter["s"]["primal"]),
          np.stack([scan_primal(0.7, False), scan_primal(-0.2, False)]))

    x = jnp.float32(0.7)
    _, inter = save_intermediates(
        lambda x, t: jax.jvp(jax.grad(scan_loss), (x,), (t,)))(x, jnp.float32(1.0))
    assert sorted(inter["s"]) == ["cotangent", "cotangent.tangent", "primal", "tangent"]
    close(inter["s"]["cotangent.tangent"],
          jax.jacfwd(lambda x: grad_eps(jnp.zeros(3), x))(x))
    close(inter["s"]["tangent"],
          jax.jacfwd(lambda x: jnp.asarray(scan_primal_jnp(x)))(x))


def scan_primal_jnp(x: Any) -> list[Any]:
    c, out = x, []
    for i in range(3):
        out.append(jnp.sin(c * XS[i]))
        c = c + out[-1]
    return out


# -- checkpoint policies that save the sown value's input ----------------------------------


def explicit_cotangent(x: Any) -> Any:
    return jax.grad(lambda e: square_loss(x, e))(jnp.zeros_like(x))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpoint_policy_hessian_capture(policy: str) -> None:
    # The policy's grad, captured and streamed: the transform matrix's checkpoint_policy cases.
    pol = POLICIES[policy]
    hess, inter = save_intermediates(jax.hessian(lambda x: square_loss(x, policy=pol)))(X)
    close(hess, np.diag(2 * np.cos(2 * X)))
    assert sorted(inter["h"]) == ["cotangent", "cotangent.tangent", "primal", "tangent"]
    # jacfwd over jacrev: the tangent basis leads, then jacrev's one-row basis.
    close(inter["h"]["cotangent.tangent"][:, 0, :], jax.jacfwd(explicit_cotangent)(X).T)
    close(inter["h"]["tangent"], np.diag(np.cos(X)))


# -- second order through jax.checkpoint: one site, each mode once ---------------------------


def remat_loss(x: Any, eps: Any = None) -> Any:
    def inner(x: Any) -> Any:
        h = jnp.sin(x)
        return ((sow(h, "h") if eps is None else h + eps) ** 2).sum()

    return jax.checkpoint(inner)(x)


def jvp_of_grad(x: Any, t: Any) -> Any:
    return jax.jvp(jax.grad(remat_loss), (x,), (t,))


def test_jvp_of_grad_through_checkpoint_reports_each_mode_once() -> None:
    t = jnp.array([1.0, -2.0], jnp.float32)
    _, inter = save_intermediates(jvp_of_grad)(X, t)
    assert list(inter) == ["h"]
    cot_of = lambda x: jax.grad(lambda e: remat_loss(x, e))(jnp.zeros(2))  # noqa: E731
    close(inter["h"]["tangent"], np.cos(X) * t)
    close(inter["h"]["cotangent"], cot_of(jnp.asarray(X)))
    close(inter["h"]["cotangent.tangent"], jax.jvp(cot_of, (jnp.asarray(X),), (t,))[1])


def test_jvp_of_grad_through_checkpoint_streams_one_name() -> None:
    records = stream(jax.jit(jvp_of_grad), X, jnp.ones(2, jnp.float32))
    assert {r.name for r in records} == {"h"}
    assert sorted(r.mode for r in records) == [
        "cotangent", "cotangent.tangent", "primal", "tangent"]


# -- custom rules when save_intermediates is itself differentiated --------------------------


@jax.custom_vjp
def clip_grad(x: Any) -> Any:
    return sow(x * 3.0, "c")


def _clip_fwd(x: Any) -> Any:
    return clip_grad(x), None


def _clip_bwd(_: Any, g: Any) -> Any:
    return (jnp.clip(g, -0.1, 0.1),)


clip_grad.defvjp(_clip_fwd, _clip_bwd)


def clip_loss(x: Any) -> Any:
    return clip_grad(x).sum()


def test_grad_of_capture_keeps_the_custom_vjp_rule() -> None:
    x = jnp.ones(2, jnp.float32)
    close(jax.grad(clip_loss)(x), [0.1, 0.1])  # the rule, without sowtel
    close(jax.grad(lambda x: save_intermediates(clip_loss)(x)[0])(x), [0.1, 0.1])
    (loss, inter), grad = jax.value_and_grad(save_intermediates(clip_loss), has_aux=True)(x)
    close(grad, [0.1, 0.1])
    close(loss, 6.0)
    close(inter["c"]["primal"], [3.0, 3.0])
    # A captured value differentiated: through the function that computed it (3 x).
    close(jax.grad(lambda x: save_intermediates(clip_loss)(x)[1]["c"]["primal"].sum())(x),
          [3.0, 3.0])
    close(jax.vmap(jax.grad(lambda x: save_intermediates(clip_loss)(x)[0]))(jnp.ones((3, 2))),
          np.full((3, 2), 0.1))


@jax.custom_jvp
def sin_rule_sows(x: Any) -> Any:
    return jnp.sin(x)


@sin_rule_sows.defjvp
def _sin_rule_sows_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return jnp.sin(x), sow(jnp.cos(x), "rule") * t


@jax.custom_jvp
def sin_sows(x: Any) -> Any:
    return sow(jnp.sin(x), "fn")


@sin_sows.defjvp
def _sin_sows_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return sin_sows(x), jnp.cos(x) * t * 2.0  # calls its own function; a rule of its own


def test_sow_in_custom_jvp_rule_differentiated_from_outside_raises() -> None:
    f = lambda x: sin_rule_sows(x).sum()  # noqa: E731
    x, t = jnp.asarray(X), jnp.ones(2, jnp.float32)
    # Differentiated inside, the rule's sow is captured.
    _, inter = save_intermediates(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
    close(inter["rule"]["primal"], np.cos(X))
    with pytest.raises(ValueError, match="sow 'rule' is in the jvp rule of a custom_jvp"):
        jax.jvp(save_intermediates(f), (x,), (t,))
    with pytest.raises(ValueError, match="sow 'rule' is in the jvp rule of a custom_jvp"):
        jax.grad(lambda x: save_intermediates(f)(x)[0])(x)


def test_custom_jvp_rule_calling_its_function_differentiates_from_outside() -> None:
    f = lambda x: (sin_sows(x) + jax.nn.relu(x)).sum()  # noqa: E731
    x, t = jnp.array([0.5, -1.0], jnp.float32), jnp.ones(2, jnp.float32)
    (y, inter), (y_dot, inter_dot) = jax.jvp(save_intermediates(f), (x,), (t,))
    close(y, np.sin([0.5, -1.0]).sum() + 0.5)
    close(y_dot, (2 * np.cos([0.5, -1.0])).sum() + 1.0)  # the user's rule: twice cos
    close(inter["fn"]["primal"], np.sin([0.5, -1.0]))
    close(inter_dot["fn"]["primal"], np.cos([0.5, -1.0]))  # the value's own derivative


def test_a_derivative_taken_inside_a_custom_jvp_function_reports_its_modes() -> None:
    # A sow in a custom_jvp function reports its primal only (the rule gives the derivative),
    # but a grad the function itself takes is the function's own: its cotangent is reported.
    def inner(h: Any) -> Any:
        return jnp.sum(sow(jnp.sin(h), "in") ** 2)

    @jax.custom_jvp
    def f(h: Any) -> Any:
        return jax.grad(inner)(h)

    f.defjvp(lambda p, t: (f(p[0]), t[0]))
    x = np.array([0.4, -0.3, 0.7], np.float32)
    for outer in (lambda x: f(x).sum(), jax.grad(lambda x: f(x).sum())):
        _, inter = save_intermediates(outer)(x)
        assert set(inter["in"]) == {"primal", "cotangent"}
        close(inter["in"]["primal"], np.sin(x))
        close(inter["in"]["cotangent"], 2 * np.sin(x.astype(np.float64)))  # d(s²)/ds


# -- the next JAX: jax_scan3 and jax_remat3 -------------------------------------------------


def carry_scan(x: Any) -> Any:
    def body(c: Any, xi: Any) -> Any:
        s = sow(jnp.sin(c * xi), "s")
        return c + s, s

    return jax.lax.scan(body, x, jnp.asarray(XS))


def test_scan3_loop_is_captured_and_streamed_with_its_index() -> None:
    with flag("jax_scan3", True):
        (c, ys), inter = save_intermediates(carry_scan)(jnp.float32(1.0))
        records = stream(jax.jit(carry_scan), jnp.float32(1.0))
    close(inter["s"]["primal"], scan_primal(1.0, False))
    close(ys, scan_primal(1.0, False))
    close(c, 1.0 + scan_primal(1.0, False).sum())
    assert inter["s"].stacked == {"primal": (("scan", 3),)}
    assert [(r.step, r.index) for r in records] == [(0, 0), (0, 1), (0, 2)]
    close([float(r.value) for r in records], scan_primal(1.0, False))


def test_reverse_scan3_is_captured_as_it_runs() -> None:
    def loop(x: Any) -> Any:
        def body(c: Any, xi: Any) -> Any:
            return c * 2.0 + xi, sow(c, "c")

        return jax.lax.scan(body, x, jnp.asarray(XS), reverse=True)

    with flag("jax_scan3", True):
        want = jax.jit(loop)(jnp.float32(1.0))
        got, inter = save_intermediates(loop)(jnp.float32(1.0))
        records = stream(jax.jit(loop), jnp.float32(1.0))
    close(got[0], want[0])  # the program's own result, with sowtel on or off
    close(got[1], want[1])
    close(inter["c"]["primal"], want[1])  # the value sown in iteration i at index i
    close([float(r.value) for r in sorted(records, key=lambda r: r.index)], want[1])


def test_scan3_construct_and_body_are_visible_to_the_capture_pass() -> None:
    def loop(x: Any) -> Any:
        return jax.lax.scan(lambda c, xi: (c + xi, c), x, jnp.asarray(XS))

    with flag("jax_scan3", True):
        closed = jax.make_jaxpr(loop)(jnp.float32(1.0))
    [eqn] = [e for e in closed.eqns if jc.sub_jaxprs(e)]
    assert jc.construct(eqn) == "scan3"
    assert jc.loop_parts(eqn)["length"] == 3


@pytest.mark.parametrize("kind", ["grad", "hessian"])
def test_remat3_checkpoint_reports_each_mode_once(kind: str) -> None:
    with flag("jax_remat3", True):
        fn = jax.grad(remat_loss) if kind == "grad" else jax.hessian(remat_loss)
        _, inter = save_intermediates(fn)(X)
    close(inter["h"]["primal"], np.sin(X))
    cot = jax.grad(lambda e: remat_loss(jnp.asarray(X), e))(jnp.zeros(2))
    if kind == "grad":
        assert sorted(inter["h"]) == ["cotangent", "primal"]
        close(inter["h"]["cotangent"], cot)
    else:
        assert sorted(inter["h"]) == ["cotangent", "cotangent.tangent", "primal", "tangent"]
        close(inter["h"]["cotangent"][0], cot)


# -- the host-callback fallback ---------------------------------------------------------------


def test_streams_through_debug_callback_when_the_fast_callback_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOWTEL_CALLBACK", raising=False)
    monkeypatch.setattr(jc, "_HAVE_FAST_CALLBACK", False)
    assert jc.callback_path() == "debug"
    records = stream(jax.jit(jax.grad(lambda x: square_loss(x))), X)
    assert [(r.name, r.mode) for r in records] == [("h", "primal"), ("h", "cotangent")]
    close(records[1].value, 2 * np.sin(X))
    records = stream(jax.jit(carry_scan), jnp.float32(1.0))
    assert [r.index for r in records] == [0, 1, 2]


@jax.custom_vjp
def scaled_grad(x: Any) -> Any:
    return sow(x * 3.0, "fwd_value")


def _scaled_fwd(x: Any) -> Any:
    return scaled_grad(x), None


def _scaled_bwd(_: Any, g: Any) -> Any:
    return (sow(g * 0.5, "bwd_value"),)


scaled_grad.defvjp(_scaled_fwd, _scaled_bwd)


def test_sow_in_custom_vjp_bwd_differentiated_from_outside_raises() -> None:
    f = lambda x: scaled_grad(x).sum()  # noqa: E731
    x = jnp.ones(2, jnp.float32)
    grad, inter = save_intermediates(jax.grad(f))(x)  # differentiated inside: captured
    close(grad, [0.5, 0.5])
    close(inter["bwd_value"]["cotangent"], [0.5, 0.5])
    with pytest.raises(ValueError, match="sow 'bwd_value' is in the bwd of a custom_vjp"):
        jax.grad(lambda x: save_intermediates(f)(x)[0])(x)


# -- a custom rule's sow in a loop under vmap, differentiated: one index per loop ------------


def test_custom_vjp_in_vmapped_scan_under_grad_streams_one_index(streaming: str) -> None:
    # grad(vmap(scan(custom_vjp))): vmap rebinds the scan with a batched copy of its body, and
    # the custom_vjp's fwd is traced again by the jvp rule of that copy: still one loop.
    rows = np.stack([XS, XS * 0.5 - 1.0])  # (2 rows, 3 iterations)

    def f(x: Any) -> Any:
        scanned = lambda row: jax.lax.scan(  # noqa: E731
            lambda c, v: (c + scaled_grad(v) * 2.0, None), 0.0, row)[0]
        return jax.vmap(scanned)(x).sum()

    records = stream(jit(streaming)(jax.grad(f)), rows)
    by_name = {name: sorted((r for r in records if r.name == name), key=lambda r: r.index)
               for name in ("fwd_value", "bwd_value")}
    assert [(r.mode, r.index, r.step) for r in by_name["fwd_value"]] == [
        ("primal", i, 0) for i in range(3)]
    assert [(r.mode, r.index, r.step) for r in by_name["bwd_value"]] == [
        ("cotangent", i, 0) for i in range(3)]
    for i, r in enumerate(by_name["fwd_value"]):
        close(r.value, rows[:, i] * 3.0)  # the rows' i-th inputs, tripled
    for r in by_name["bwd_value"]:
        close(r.value, [1.0, 1.0])  # the bwd gets the cotangent 2 and halves it


@jax.custom_jvp
def sin_sown(x: Any) -> Any:
    return sow(jnp.sin(x), "cj")


@sin_sown.defjvp
def _sin_sown_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return sin_sown(x), jnp.cos(x) * t


@pytest.mark.parametrize("outer", ["jvp", "grad"])
def test_custom_jvp_in_vmapped_fori_differentiated_streams_one_index(
        outer: str, streaming: str) -> None:
    # The custom_jvp function is traced again by the jvp rule of the vmapped loop's batched
    # copy: one loop, its two iterations, whether forward or reverse mode drives it.
    rows = jnp.asarray(np.stack([X, X * 2.0]))

    def f(x: Any) -> Any:
        looped = lambda r: jax.lax.fori_loop(0, 2, lambda i, c: sin_sown(c + i), r)  # noqa: E731
        return jax.vmap(looped)(x).sum()

    fn = ((lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))) if outer == "jvp"
          else jax.grad(f))
    records = sorted(stream(jit(streaming)(fn), rows), key=lambda r: r.index)
    assert [(r.mode, r.index, r.step) for r in records] == [("primal", 0, 0), ("primal", 1, 0)]
    first = np.sin(np.stack([X, X * 2.0]).astype(np.float64))  # iteration 0 adds 0
    close(records[0].value, first)
    close(records[1].value, np.sin(first + 1.0))  # iteration 1 adds 1 to the carry


def test_custom_jvp_in_scan_under_jvp_of_grad_streams_one_index(streaming: str) -> None:
    # jvp-of-grad linearizes the scan, then differentiates the primal half it rebinds (a copy
    # of the body): the custom_jvp function traced there is still in the one loop.

    def f(x: Any) -> Any:
        return jax.lax.scan(lambda c, s: (sin_sown(c + s), None), x, jnp.arange(2.0))[0].sum()

    x = jnp.asarray(X)
    second = jit(streaming)(lambda x, t: jax.jvp(jax.grad(f), (x,), (t,)))
    records = stream(second, x, jnp.ones_like(x))
    primal = sorted((r for r in records if r.mode == "primal"), key=lambda r: r.index)
    assert [(r.index, r.step) for r in primal] == [(0, 0), (1, 0)]
    first = np.sin(X.astype(np.float64))
    close(primal[0].value, first)
    close(primal[1].value, np.sin(first + 1.0))
    assert all(isinstance(r.index, int) for r in records), records


# -- errors raised while tracing under sowtel name the user's function and arguments ----------


def bool_of_tracer(params: Any, n: Any, *, scale: Any = 1.0) -> Any:
    h = sow(params["w"] * scale, "h")
    return h.sum() if n > 0 else -h.sum()  # a Python branch on a traced argument


def bool_of_pytree_leaf(params: Any, n: Any) -> Any:
    h = sow(params["w"] * n, "h")
    return h.sum() if params["b"] > 0 else -h.sum()


def shape_from_argument(params: Any, n: Any) -> Any:
    return sow(jnp.ones(n) * params["w"].sum(), "h").sum()  # a shape from a traced argument


ERRORS: dict[str, Callable[..., Any]] = {
    "bool_of_argument": bool_of_tracer,
    "bool_of_pytree_leaf": bool_of_pytree_leaf,
    "shape_of_argument": shape_from_argument,
}
ERROR_ARGS = ({"w": jnp.ones(3), "b": jnp.float32(1.0)}, jnp.int32(2))


def tracing_error(call: Callable[[], Any]) -> tuple[str, str, str]:
    """The error's type, the function it says was traced (name and source line), and the
    argument it says the value came from."""
    import re

    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is compared below
        call()
    text = str(info.value)
    function = re.search(r"tracing the function (\S+ at \S+) for", text)
    argument = re.search(r"argument (\S+?)[.,\s]", text)
    assert function is not None and argument is not None, text
    return type(info.value).__name__, function.group(1), argument.group(1)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_tracing_errors_name_the_users_function_as_jax_jit_does(case: str) -> None:
    fn = ERRORS[case]
    expected = tracing_error(lambda: jax.jit(fn)(*ERROR_ARGS))
    assert expected[1].startswith(fn.__name__ + " at ") and __file__ in expected[1]
    calls: dict[str, Callable[[], Any]] = {
        "save_intermediates": lambda: save_intermediates(fn)(*ERROR_ARGS),
        "jit(save_intermediates)": lambda: jax.jit(save_intermediates(fn))(*ERROR_ARGS),
        "locate_nonfinite": lambda: sowtel.locate_nonfinite(fn)(*ERROR_ARGS),
    }
    with sowtel.enable(exporter="memory"):
        got = {"sowtel.jit": tracing_error(lambda: sowtel.jit(fn)(*ERROR_ARGS))}
        got["jax.jit, streaming"] = tracing_error(lambda: jax.jit(fn)(*ERROR_ARGS))
    got.update({where: tracing_error(call) for where, call in calls.items()})
    assert got == dict.fromkeys(got, expected)


def test_tracing_errors_name_keyword_and_static_arguments_as_jax_jit_does() -> None:
    kwargs = {"scale": jnp.float32(2.0)}
    expected = tracing_error(lambda: jax.jit(bool_of_tracer)(*ERROR_ARGS, **kwargs))
    with sowtel.enable(exporter="memory"):
        assert tracing_error(lambda: sowtel.jit(bool_of_tracer)(*ERROR_ARGS, **kwargs)) == expected
        static = sowtel.jit(lambda k, params, n: bool_of_tracer(params, n * k),
                            static_argnums=0)
        assert tracing_error(lambda: static(3, *ERROR_ARGS))[2] == "n"
    assert tracing_error(lambda: save_intermediates(bool_of_tracer)(*ERROR_ARGS, **kwargs)) == (
        expected)
    grad = jax.grad(bool_of_tracer)  # names its function, as jax.jit(jax.grad(...)) does
    assert tracing_error(lambda: save_intermediates(grad)(*ERROR_ARGS)) == tracing_error(
        lambda: jax.jit(grad)(*ERROR_ARGS))


def test_tracing_errors_in_framework_wrappers_name_the_users_function() -> None:
    import sowtel.equinox
    import sowtel.nnx

    expected = tracing_error(lambda: jax.jit(bool_of_tracer)(*ERROR_ARGS))[1]
    for wrapped in (sowtel.equinox.filter_jit(bool_of_tracer), sowtel.nnx.jit(bool_of_tracer)):
        call = functools.partial(wrapped, *ERROR_ARGS)
        assert tracing_error(call)[1] == expected  # the plain program
        with sowtel.enable(exporter="memory"):
            assert tracing_error(call)[1] == expected  # the logging program
