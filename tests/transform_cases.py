"""The cases of the transform matrix (tests/test_transform_matrix.py), each written once.

A case is one function ``fn(x, eps)`` with a hook at each site. With ``eps=None`` the hook is
``sowtel.sow``; with ``eps`` a dict it adds an explicit perturbation instead. So every path (the
capture pass and the three streaming transports) is checked against the same references:

- primals against values derived by hand (numpy, written separately per case);
- cotangents against ``jax.grad`` with respect to a zero perturbation at the same point;
- tangents against central finite differences of the hand-derived primal (or a closed form).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel import sow
from sowtel.records import Record

X = np.array([0.3, -0.7, 1.1, 0.5], np.float32)
T = np.array([1.0, 0.5, -0.25, 2.0], np.float32)


# -- the streaming paths, shared by every transform test ---------------------------------------

STREAMING = ("fast", "debug", "sowtel.jit")


def jit_of(path: str, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """The jit a streaming path compiles with: sowtel.jit, or jax.jit with that callback."""
    if path == "sowtel.jit":
        return sowtel.jit
    # Read at lowering time: each jax.jit of a new function compiles anew, with this path.
    monkeypatch.setenv("SOWTEL_CALLBACK", path)
    return jax.jit


@pytest.fixture(params=STREAMING)
def streaming(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A streaming path, for the tests beside the matrix (``jit(path)`` compiles for it)."""
    jit_of(str(request.param), monkeypatch)
    return str(request.param)


def jit(path: str) -> Callable[..., Any]:
    """The jit of a path the ``streaming`` fixture has set up."""
    return sowtel.jit if path == "sowtel.jit" else jax.jit


def program_order(r: Record) -> Any:
    # Callbacks are unordered, so arrival (seq) order may differ from the program's.
    return (r.step, r.order, r.seq)


def iteration_order(r: Record) -> Any:
    """Program order, a site's records by iteration (as they ran, whatever the arrival)."""
    return (r.step, r.order, r.index or 0)


def stream(fn: Callable[..., Any], *args: Any, calls: int = 1,
           key: Callable[[Record], Any] = program_order, at_step: int | None = None,
           **options: Any) -> list[Record]:
    """The records of ``calls`` calls of ``fn`` to the memory exporter (``summary="full"``
    unless told), none dropped and no exporter error, sorted by ``key``; under a host
    ``at_step`` where one is given."""
    options.setdefault("summary", "full")
    with sowtel.enable(exporter="memory", **options) as session:
        with sowtel.at_step(at_step) if at_step is not None else contextlib.nullcontext():
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        assert sowtel.flush(timeout=60)
        status = sowtel.status()
    assert status["dropped"] == 0 and not any(status["errors"].values())
    return sorted(session.exporters[0].records, key=key)


def by(records: list[Record], mode: str, name: str | None = None) -> list[Record]:
    return [r for r in records if r.mode == mode and (name is None or r.name == name)]


# -- the hooks ------------------------------------------------------------------------------


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
    # The capture transforms, where a case claims only these (else call, grad, grad_jit_outside
    # and jvp, and ``captured``).
    capture: tuple[str, ...] | None = None
    # The loops a site's captured value is stacked over (``Intermediate.stacked``, every mode).
    stacked: tuple[tuple[str, int], ...] | None = None

    def capture_transforms(self) -> tuple[str, ...]:
        if self.capture is not None:
            return self.capture
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


# jax.checkpoint of a scan, with or without a policy, in either direction.
CHECKPOINT_XS = np.array([1.0, 2.0, 3.0], np.float32)
POLICIES = {
    "default": None,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "save_anything_except_these_names":
        jax.checkpoint_policies.save_anything_except_these_names("unused"),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


def scan_loss(x: Any, eps: Any = None, *, reverse: bool = False, policy: Any = None) -> Any:
    """A checkpointed scan of three steps; ``eps`` an array of the three perturbations."""
    def body(c: Any, xi_i: Any) -> Any:
        xi, i = xi_i
        s = jnp.sin(c * xi)
        s = sow(s, "s") if eps is None else s + eps[i]
        return c + s, None

    def run(x: Any) -> Any:
        return jax.lax.scan(body, x, (jnp.asarray(CHECKPOINT_XS), jnp.arange(3)),
                            reverse=reverse)[0]

    return jax.checkpoint(run, policy=policy)(x)


def scan_primal(x: float, reverse: bool) -> np.ndarray:
    c, out = np.float64(x), np.zeros(3)
    for i in (range(3)[::-1] if reverse else range(3)):
        out[i] = np.sin(c * CHECKPOINT_XS[i])
        c = c + out[i]
    return out


def checkpointed_scan(policy: str, reverse: bool, streamed: tuple[str, ...]) -> Case:
    return Case(
        lambda x, eps: scan_loss(x, None if eps is None else eps["s"], reverse=reverse,
                                 policy=POLICIES[policy]),
        lambda x: {"s": scan_primal(x, reverse)}, x=np.float32(0.7), capture=("grad",),
        streamed=streamed, stacked=(("scan", 3),))


# A checkpoint policy that saves the sown value's input; the backward pass needs the value.
def square_loss(x: Any, eps: Any = None, *, policy: Any = None) -> Any:
    def inner(x: Any) -> Any:
        h = jnp.sin(x)
        h = sow(h, "h") if eps is None else h + eps
        return (h * h).sum()

    return jax.checkpoint(inner, policy=policy)(x)


def checkpoint_policy(policy: str, streamed: tuple[str, ...]) -> Case:
    return Case(lambda x, eps: square_loss(x, None if eps is None else eps["h"],
                                           policy=POLICIES[policy]),
                lambda x: {"h": np.sin(x)}, x=np.array([0.5, 1.0], np.float32),
                capture=("grad",), streamed=streamed)


# A custom_vjp whose bwd differentiates the forward function again (jax.vjp): its primal is
# silent there, its cotangent reports.
def _vjp_rerun(jit_bwd: bool, eps: Any = None) -> Callable[[Any, Any], Any]:
    def forward(x, e):
        h = jnp.sin(x) * 1.5
        return jnp.cos(sow(h, "h") if eps is None else h + e) * 2.0

    @jax.custom_vjp
    def g(x, e):
        return forward(x, e)

    def fwd(x, e):
        return forward(x, e), (x, e)

    def bwd(res, ct):
        return jax.vjp(forward, *res)[1](ct)

    g.defvjp(fwd, jax.jit(bwd) if jit_bwd else bwd)
    return g


def rerun_loss(x, eps=None, *, jit_bwd=False):
    g = _vjp_rerun(jit_bwd, eps)
    e = jnp.zeros_like(x) if eps is None else eps
    return jnp.sum(g(x, e) ** 2)


def rerun_in_scan(x, eps=None, *, jit_bwd=False):
    g = _vjp_rerun(jit_bwd, eps)
    e = jnp.zeros_like(x) if eps is None else eps
    return jax.lax.scan(lambda c, xe: (c + g(*xe) ** 2 * (c + 1.0), None), 0.0, (x, e))[0]


RERUN_XS = np.array([0.3, -0.5, 0.2, 0.9], np.float32)


def vjp_rerun(loss: Callable[..., Any], jit_bwd: bool, streamed: tuple[str, ...]) -> Case:
    return Case(lambda x, eps: loss(x, None if eps is None else eps["h"], jit_bwd=jit_bwd),
                lambda x: {"h": np.sin(x) * 1.5}, x=RERUN_XS, jvp=False, capture=("grad",),
                streamed=streamed)


# lax.map(batch_size=b): one leading axis of the map's length, remainder or not.
def mapped(x, b, eps=None):
    # The perturbation of element i (x is arange(7): each element is its own index).
    ys = jax.lax.map(lambda v: site(jnp.stack([v * 2.0, jnp.sin(v)]), "m", None if eps is None
                                    else {"m": v * 0.0 + eps["m"][jnp.int32(v)]}),
                     x, batch_size=b)
    return jnp.sum(ys ** 2)


def map_batched(b: int, streamed: tuple[str, ...]) -> Case:
    return Case(lambda x, eps: mapped(x, b, eps),
                lambda x: {"m": np.stack([x * 2.0, np.sin(x)], axis=1)},
                x=np.arange(7.0, dtype=np.float32), capture=("grad",), streamed=streamed,
                stacked=(("scan", 7),))


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
    # grad of a checkpointed scan, its sites' iterations (a regression of the capture pass).
    "checkpoint_scan": checkpointed_scan("default", False, ("grad",)),
    "checkpoint_scan_reverse": checkpointed_scan("default", True, ()),
    "checkpoint_scan_everything_saveable": checkpointed_scan("everything_saveable", False, ()),
    "checkpoint_scan_everything_saveable_reverse":
        checkpointed_scan("everything_saveable", True, ()),
    **{f"checkpoint_policy_{p}": checkpoint_policy(
        p, ("grad",) if p in ("everything_saveable", "save_anything_except_these_names") else ())
       for p in POLICIES},
    "vjp_rerun": vjp_rerun(rerun_loss, False, ()),
    "vjp_rerun_jitted_bwd": vjp_rerun(rerun_loss, True, ()),
    "vjp_rerun_scan": vjp_rerun(rerun_in_scan, False, ("grad",)),
    "vjp_rerun_scan_jitted_bwd": vjp_rerun(rerun_in_scan, True, ("grad",)),
    # Capture only: streamed, the remainder batch is a second site of the same name.
    **{f"map_batch{b}": map_batched(b, ()) for b in (2, 3, 4, 7)},
}
