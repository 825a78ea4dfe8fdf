"""The cases of the transform matrix (tests/test_transform_matrix.py), each written once.

A case is one function ``fn(x, eps)`` with a hook at each site. With ``eps=None`` the hook is
``sowtel.sow``; with ``eps`` a dict it adds an explicit perturbation instead. So every path (the
capture pass and the three streaming transports) is checked against the same references:

- primals against values derived by hand (numpy, written separately per case);
- cotangents against ``jax.grad`` with respect to a zero perturbation at the same point;
- tangents against central finite differences of the hand-derived primal (or a closed form).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import sow

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
    # The transforms the capture pass checks beyond call, grad (eager and jitted) and jvp.
    captured: tuple[str, ...] = ()
    # The transforms the three streaming transports check (each a compile per transport).
    streamed: tuple[str, ...] = ("grad",)
    # A closed form of the sites' tangents along t, where one is written (else finite
    # differences of ``primal``).
    tangent: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]] | None = None
    # What streaming sends where it differs from the capture: a while body streams every
    # iteration (stacked here), the capture keeps the last.
    streamed_primal: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None
    calls: int = 1  # how many times the streaming paths call the compiled function

    def capture_transforms(self) -> tuple[str, ...]:
        base = ("call",) + (("grad", "grad_jit_outside") if self.grad else ()) + (
            ("jvp",) if self.jvp else ())
        return base + self.captured


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


def plain_tangent(x, t):
    return {"h": 2.0 * np.cos(x) * t}


def while_streamed(x):
    return {"w": np.stack([x * 1.5**k for k in (1, 2, 3)])}


CASES: dict[str, Case] = {
    "plain": Case(plain_fn, plain_ref, tangent=plain_tangent,
                  captured=("value_and_grad", "vjp", "linearize"),
                  streamed=("call_stats", "grad", "value_and_grad", "vjp", "jvp")),
    "jit_inside": Case(jit_inside_fn, plain_ref),
    "scan": Case(scan_fn, scan_ref),
    "scan_reverse": Case(reverse_scan_fn, reverse_scan_ref),
    # Called twice: the second call's records are step 1, with the same indices.
    "fori_loop": Case(fori_fn, fori_ref, calls=2),
    "lax_map": Case(map_fn, map_ref),
    "nested_scan": Case(nested_scan_fn, nested_scan_ref),
    "while_body": Case(while_fn, while_ref, grad=False, streamed=("call",),
                       streamed_primal=while_streamed),
    "cond": Case(cond_fn, cond_ref),
    "cond_other_branch": Case(cond_fn, cond_ref, x=-X - 1.0),
    "switch": Case(switch_fn, switch_ref),
    "checkpoint": Case(checkpoint_fn, checkpoint_ref),
    "custom_jvp": Case(custom_jvp_fn, custom_jvp_ref),
    "custom_vjp": Case(custom_vjp_fn, custom_vjp_ref, jvp=False, cotangent=False),
}
