"""Third-party JAX libraries nobody wrote for sowtel, trained a few steps four ways.

Each program below uses a library the way its documentation does, on small synthetic data, with
sows where a user would put them: inside lineax's ``linear_solve`` operator, an optimistix
residual, the matvec of ``jax.scipy.sparse.linalg.cg``, ``lax.custom_linear_solve`` and
``lax.custom_root``; the vector field of a diffrax solve (whose default adjoint,
``RecursiveCheckpointAdjoint``, recomputes the forward pass inside a ``custom_vjp``); the body of
Equinox's checkpointed ``while_loop``; the dynamics of ``jax.experimental.ode.odeint``; a Haiku
model; an optimizer stack of optax's own wrappers around ``sowtel.optax.watch``.

The promise checked is sowtel's: turning it on never breaks or changes a working program.

- Each program trains ``STEPS`` steps with plain ``jax.jit``, the callback transport
  (``sowtel.enable`` + ``jax.jit``), ``sowtel.jit`` and ``jax.jit(save_intermediates(step))``;
  the losses agree with plain training to 1e-6, and every site streams at every step with the
  modes it should have.
- Both transports send the same records (name, mode, step, index).
- The captured cotangent of a site equals ``jax.grad`` with respect to an explicit additive
  perturbation at the site.
- Whether each way's losses and parameters are bit-identical to plain training is recorded, not
  asserted: the table is printed at the end of the session and written as JSON beside pytest's
  temporary files (and into ``$SOWTEL_TEST_ARTIFACTS`` when that is set).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffrax
import equinox.internal as eqxi
import haiku as hk
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optax
import optimistix as optx
import pytest
from jax.experimental.ode import odeint

import sowtel
import sowtel.optax
from sowtel import save_intermediates, sow

STEPS = 3
WAYS = ("callback", "sowtel.jit", "capture")
N = 4


def site(x: Any, name: str, eps: Any) -> Any:
    """A sow, or (``eps`` a dict) the explicit perturbation the cotangent checks compare with;
    a site ``eps`` does not name is left as it is."""
    if eps is None:
        return sow(x, name)
    return x + eps[name] if name in eps else x


def _data(seed: int, *shapes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True))


_Q = np.asarray(_data(7, (N, N))[0])
M = jnp.asarray(_Q @ _Q.T / N)  # symmetric positive semi-definite: a + M is positive definite


@dataclass
class Program:
    """A loss ``loss(params, batch, eps)`` trained with SGD (or ``make_step``'s optimizer),
    the sites it streams (base name -> modes every step must carry), and the site whose
    cotangent is checked against a perturbation, with the perturbation's shape."""

    loss: Callable[[Any, Any, Any], Any]
    params: Any
    batch: Any
    sites: dict[str, set[str]]
    cotangent: tuple[str, tuple[int, ...]]
    lr: float = 0.1
    make_step: Callable[[Program], tuple[Callable[..., Any], Any]] | None = None
    # Sites the library itself traces more than once (a solver's matvec in the solve and in its
    # transpose, an ODE solver's stages): numbered name_0, name_1, ... and carrying at least
    # the modes listed. Every other site is one site, with exactly its modes.
    numbered: set[str] = field(default_factory=set)
    # Sites whose forward code the library's custom_vjp runs again in its backward pass (a
    # checkpointed adjoint): a recomputed primal is silent, so training streams as many primal
    # records of them a step as one forward evaluation does.
    recomputed: set[str] = field(default_factory=set)

    def step_and_state(self) -> tuple[Callable[..., Any], Any]:
        if self.make_step is not None:
            return self.make_step(self)

        def step(params: Any, batch: Any) -> tuple[Any, Any]:
            loss, grads = jax.value_and_grad(self.loss)(params, batch, None)
            return jax.tree.map(lambda p, g: p - self.lr * g, params, grads), loss

        return step, self.params


# -- higher-order primitives: lineax, optimistix, cg, custom_linear_solve, custom_root ----------


def _lineax(params: Any, batch: Any, eps: Any) -> Any:
    b, target = batch
    a = jax.nn.softplus(params["a"]) + 0.5

    def matvec(v: Any) -> Any:
        return site(a * v + M @ v, "lineax/matvec", eps)

    operator = lx.FunctionLinearOperator(matvec, jax.ShapeDtypeStruct((N,), jnp.float32),
                                         tags=lx.positive_semidefinite_tag)
    x = lx.linear_solve(operator, b, lx.CG(rtol=1e-6, atol=1e-6, max_steps=64)).value
    x = site(x, "lineax/solution", eps)
    return jnp.mean((x - target) ** 2)


def _optimistix(params: Any, batch: Any, eps: Any) -> Any:
    a, target = batch
    w = jax.nn.softplus(params["w"]) + 1.0

    def residual(y: Any, args: Any) -> Any:
        return site(y ** 3 + args * y - a, "optx/residual", eps)

    solution = optx.root_find(residual, optx.Newton(rtol=1e-6, atol=1e-6), jnp.zeros(N),
                              args=w, max_steps=32)
    y = site(solution.value, "optx/root", eps)
    return jnp.mean((y - target) ** 2)


def _cg(params: Any, batch: Any, eps: Any) -> Any:
    b, target = batch
    a = jax.nn.softplus(params["a"]) + 0.5

    def matvec(v: Any) -> Any:
        return site(a * v + M @ v, "cg/matvec", eps)

    x, _ = jax.scipy.sparse.linalg.cg(matvec, b, tol=1e-6, maxiter=64)
    x = site(x, "cg/solution", eps)
    return jnp.mean((x - target) ** 2)


def _custom_linear_solve(params: Any, batch: Any, eps: Any) -> Any:
    b, target = batch
    a = jax.nn.softplus(params["a"]) + 0.5

    def matvec(v: Any) -> Any:
        return site(a * v, "cls/matvec", eps)

    x = jax.lax.custom_linear_solve(matvec, b, lambda _, r: r / a, symmetric=True)
    x = site(x, "cls/solution", eps)
    return jnp.mean((x - target) ** 2)


def _custom_root(params: Any, batch: Any, eps: Any) -> Any:
    a, target = batch
    w = jax.nn.softplus(params["w"]) + 1.0

    def f(y: Any) -> Any:
        return site(y ** 3 + w * y - a, "root/residual", eps)

    def solve(f: Any, y0: Any) -> Any:  # Newton, elementwise (the Jacobian is diagonal)
        def newton(_: Any, y: Any) -> Any:
            value, slope = jax.jvp(f, (y,), (jnp.ones_like(y),))
            return y - value / slope
        return jax.lax.fori_loop(0, 12, newton, y0)

    def tangent_solve(g: Any, y: Any) -> Any:
        return y / g(jnp.ones_like(y))

    y = jax.lax.custom_root(f, jnp.zeros(N), solve, tangent_solve)
    y = site(y, "root/root", eps)
    return jnp.mean((y - target) ** 2)


# -- forward code recomputed inside a custom_vjp: diffrax, Equinox's checkpointed while --------


def _diffrax(params: Any, batch: Any, eps: Any) -> Any:
    y0, target = batch

    def vector_field(t: Any, y: Any, args: Any) -> Any:
        return site(-jax.nn.softplus(args["k"]) * y + jnp.tanh(args["w"] @ y), "diffrax/vf", eps)

    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field), diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.25, y0=y0,
        args=params, stepsize_controller=diffrax.ConstantStepSize(), max_steps=8)
    y1 = site(solution.ys[-1], "diffrax/y1", eps)  # the default adjoint: checkpointed
    return jnp.mean((y1 - target) ** 2)


LOOP = 3


def _checkpointed_while(params: Any, batch: Any, eps: Any) -> Any:
    x, target = batch

    def body(carry: Any) -> Any:
        i, h = carry
        h = jnp.tanh(params["w"] @ h + x)
        if eps is None:
            h = sow(h, "eqxi/h")
        elif "eqxi/h" in eps:  # the site's value is its last iteration's
            h = h + jnp.where(i == LOOP - 1, eps["eqxi/h"], 0.0)
        return i + 1, h

    _, h = eqxi.while_loop(lambda c: c[0] < LOOP, body, (0, jnp.zeros(N)), max_steps=LOOP,
                           kind="checkpointed")
    return jnp.mean((h - target) ** 2)


def _odeint(params: Any, batch: Any, eps: Any) -> Any:
    y0, target = batch

    def dynamics(y: Any, t: Any, k: Any) -> Any:
        return site(-k * y + jnp.sin(t), "odeint/f", eps)

    ys = odeint(dynamics, y0, jnp.array([0.0, 0.5, 1.0]), jax.nn.softplus(params["k"]) + 0.5,
                rtol=1e-6, atol=1e-6)
    y1 = site(ys[-1], "odeint/y1", eps)
    return jnp.mean((y1 - target) ** 2)


# -- a model library: Haiku ---------------------------------------------------------------------


def _haiku_forward(x: Any, eps: Any) -> Any:
    h = jax.nn.gelu(hk.Linear(8, name="hidden")(x))
    h = site(h, "haiku/hidden", eps)
    block = hk.remat(lambda v: jnp.tanh(hk.Linear(8, name="block")(v)))
    h = site(hk.LayerNorm(-1, create_scale=True, create_offset=True)(block(h)), "haiku/block",
             eps)
    return hk.Linear(1, name="out")(h)


_HAIKU = hk.without_apply_rng(hk.transform(_haiku_forward))


def _haiku(params: Any, batch: Any, eps: Any) -> Any:
    x, y = batch
    return jnp.mean((_HAIKU.apply(params, x, eps) - y) ** 2)


# -- optax's wrappers around a watched optimizer --------------------------------------------------


def _mlp(params: Any, batch: Any, eps: Any) -> Any:
    x, y = batch
    h = site(jnp.tanh(x @ params["w"] + params["b"]), "mlp/hidden", eps)
    return jnp.mean((h @ params["v"] - y) ** 2)


def _optax_stack(program: Program) -> tuple[Callable[..., Any], Any]:
    inner = optax.chain(optax.clip_by_global_norm(1.0),
                        sowtel.optax.watch(optax.inject_hyperparams(optax.adam)(
                            learning_rate=2e-2)))
    mask = {"b": False, "v": True, "w": True}
    tx = optax.MultiSteps(optax.chain(  # masked leaves pass through: sgd moves the bias
        optax.masked(inner, mask), optax.masked(optax.sgd(0.1), jax.tree.map(
            lambda m: not m, mask))), every_k_schedule=2)

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(program.loss)(params, batch, None)
        updates, opt_state = tx.update(grads, opt_state, params=params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (program.params, tx.init(program.params))


def _programs() -> dict[str, Program]:
    vec = lambda seed: _data(seed, (N,), (N,))  # noqa: E731
    haiku_batch = _data(5, (6, 3), (6, 1))
    haiku_params = _HAIKU.init(jax.random.key(0), haiku_batch[0], None)
    solution = {"primal", "cotangent"}
    return {
        "lineax.linear_solve": Program(
            _lineax, {"a": jnp.zeros(N)}, vec(1),
            {"lineax/matvec": {"primal"}, "lineax/solution": solution},
            ("lineax/solution", (N,)), lr=0.5, numbered={"lineax/matvec"}),
        "optimistix.root_find": Program(
            _optimistix, {"w": jnp.zeros(N)}, vec(2),
            {"optx/residual": {"primal"}, "optx/root": solution}, ("optx/root", (N,)), lr=0.5,
            numbered={"optx/residual"}),
        "scipy.sparse.linalg.cg": Program(
            _cg, {"a": jnp.zeros(N)}, vec(3),
            {"cg/matvec": {"primal"}, "cg/solution": solution}, ("cg/solution", (N,)), lr=0.5,
            numbered={"cg/matvec"}),
        "lax.custom_linear_solve": Program(
            _custom_linear_solve, {"a": jnp.zeros(N)}, vec(4),
            {"cls/matvec": {"primal"}, "cls/solution": solution}, ("cls/solution", (N,)),
            lr=0.5, numbered={"cls/matvec"}),
        "lax.custom_root": Program(
            _custom_root, {"w": jnp.zeros(N)}, vec(6),
            {"root/residual": {"primal"}, "root/root": solution}, ("root/root", (N,)), lr=0.5,
            numbered={"root/residual"}),
        "diffrax.diffeqsolve": Program(
            _diffrax, {"k": jnp.zeros(N), "w": 0.3 * _data(8, (N, N))[0]}, vec(9),
            {"diffrax/vf": {"primal", "cotangent"}, "diffrax/y1": solution},
            ("diffrax/y1", (N,)), numbered={"diffrax/vf"}, recomputed={"diffrax/vf"}),
        "equinox.while_loop(checkpointed)": Program(
            _checkpointed_while, {"w": 0.5 * _data(10, (N, N))[0]}, vec(11),
            {"eqxi/h": solution}, ("eqxi/h", (N,)), recomputed={"eqxi/h"}),
        "jax.experimental.ode.odeint": Program(
            _odeint, {"k": jnp.zeros(N)}, vec(12),
            {"odeint/f": {"primal", "cotangent"}, "odeint/y1": solution},
            ("odeint/y1", (N,)), lr=0.5, numbered={"odeint/f"}),
        "haiku": Program(
            _haiku, haiku_params, haiku_batch,
            {"haiku/hidden": solution, "haiku/block": solution}, ("haiku/hidden", (6, 8))),
        "optax.MultiSteps(chain(masked(chain(watch(inject_hyperparams(adam))))))": Program(
            _mlp, {"w": 0.5 * _data(13, (3, 5))[0], "b": jnp.zeros(5),
                   "v": 0.5 * _data(14, (5, 1))[0]}, _data(15, (6, 3), (6, 1)),
            {"mlp/hidden": solution, **{f"optim/{group}/{leaf}": {"primal"}
                                        for group in ("grads", "updates", "params",
                                                      "update_ratio") for leaf in "vw"},
             **{f"optim/norm/{group}": {"primal"} for group in ("grads", "updates", "params")}},
            ("mlp/hidden", (6, 5)),
            make_step=_optax_stack),
    }


PROGRAMS = _programs()


# -- running a program each way, once per session ----------------------------------------------


@dataclass
class Run:
    losses: list[np.ndarray]
    state: Any
    records: list[Any]


_RUNS: dict[tuple[str, str], Run] = {}
#: program -> way -> "bitwise" or the largest relative difference of losses and parameters
BITWISE: dict[str, dict[str, str]] = collections.defaultdict(dict)


def run(program: str, way: str) -> Run:
    """``program`` trained ``STEPS`` steps ``way`` ("plain", "callback", "sowtel.jit",
    "capture"), with the records streamed; run once per session."""
    if (program, way) in _RUNS:
        return _RUNS[(program, way)]
    step, state = PROGRAMS[program].step_and_state()
    batch = PROGRAMS[program].batch
    if way == "sowtel.jit":
        fn = sowtel.jit(step)
    elif way == "capture":
        captured = jax.jit(save_intermediates(step, duplicates="number"))

        def fn(s: Any, b: Any) -> Any:
            return captured(s, b)[0]
    else:
        fn = jax.jit(step)
    streaming = way in ("callback", "sowtel.jit")
    ctx: Any = sowtel.enable(exporter="memory") if streaming else contextlib.nullcontext()
    losses, records = [], []
    with ctx as session:
        for k in range(STEPS):
            with sowtel.at_step(k):
                state, loss = fn(state, batch)
            losses.append(np.asarray(loss))
        if streaming:
            assert sowtel.flush(timeout=120)
            status = sowtel.status()
            assert status["dropped"] == 0 and not any(status["errors"].values()), status
            records = list(session.exporters[0].records)
    _RUNS[(program, way)] = result = Run(losses, jax.device_get(state), records)
    return result


def _relative_difference(got: Run, want: Run) -> float:
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves((got.losses, got.state)),
                    jax.tree_util.tree_leaves((want.losses, want.state)), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30),
                                        initial=0.0)))
    return worst


def _bitwise(got: Run, want: Run) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(
        jax.tree_util.tree_leaves((got.losses, got.state)),
        jax.tree_util.tree_leaves((want.losses, want.state)), strict=True))


def _base(name: str, program: Program) -> str | None:
    """The program's site a record's name belongs to (``name`` or ``name_<k>``)."""
    for base in program.sites:
        if name == base or re.fullmatch(re.escape(base) + r"_\d+", name):
            return base
    return None


@pytest.fixture(scope="module", autouse=True)
def bitwise_table(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the module: the bitwise table, printed and written as JSON."""
    yield
    if not BITWISE:
        return
    lines = [f"sowtel ecosystem matrix, JAX {jax.__version__}: bitwise agreement with plain "
             "jax.jit (else the largest relative difference of losses and parameters)"]
    width = max(len(p) for p in BITWISE)
    for program in sorted(BITWISE):
        cells = "  ".join(f"{way}: {BITWISE[program].get(way, 'not run'):>9}" for way in WAYS)
        lines.append(f"  {program:<{width}}  {cells}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None:  # past pytest's output capture, which would swallow it here
        with (capture.global_and_fixture_disabled() if capture is not None
              else contextlib.nullcontext()):
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line)
    table = {"jax": jax.__version__, "bitwise": BITWISE}
    paths = [tmp_path_factory.getbasetemp() / "ecosystem_bitwise.json"]
    if os.environ.get("SOWTEL_TEST_ARTIFACTS"):
        out = Path(os.environ["SOWTEL_TEST_ARTIFACTS"])
        out.mkdir(parents=True, exist_ok=True)
        paths.append(out / f"ecosystem_bitwise_jax{jax.__version__}.json")
    for path in paths:
        path.write_text(json.dumps(table, indent=2, sort_keys=True))


# -- the checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_trains_as_plain_jit_and_streams_every_site(name: str, way: str) -> None:
    program = PROGRAMS[name]
    want = run(name, "plain")
    assert all(np.isfinite(want.losses)) and want.losses[-1] < want.losses[0], want.losses
    got = run(name, way)
    BITWISE[name][way] = "bitwise" if _bitwise(got, want) else (
        f"{_relative_difference(got, want):.1e}")
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6, atol=1e-7, err_msg=way)
    for a, b in zip(jax.tree_util.tree_leaves(got.state), jax.tree_util.tree_leaves(want.state),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=way)
    if way == "capture":
        return
    seen: dict[str, dict[str, set[int]]] = {}
    for r in got.records:
        base = _base(r.name, program)
        assert base is not None, f"{way}: a record of a site the program does not have: {r.name}"
        if base not in program.numbered:
            assert r.name == base, f"{way}: one site {base!r} streamed as {r.name!r}"
        seen.setdefault(base, {}).setdefault(r.mode, set()).add(r.step)
    for base, modes in program.sites.items():
        assert base in seen, (way, base, sorted({r.name for r in got.records}))
        if base in program.numbered:
            assert set(seen[base]) >= modes, (way, base, sorted(seen[base]))
        else:
            assert set(seen[base]) == modes, (way, base, sorted(seen[base]))
        for mode in seen[base]:
            assert seen[base][mode] == set(range(STEPS)), (way, base, mode, seen[base][mode])


@pytest.mark.parametrize("name", sorted(n for n, p in PROGRAMS.items() if p.recomputed))
def test_recomputed_forward_code_streams_its_primal_once(name: str) -> None:
    program = PROGRAMS[name]
    forward = jax.jit(lambda p, b: program.loss(p, b, None))
    with sowtel.enable(exporter="memory") as session:
        forward(program.params, program.batch)
        assert sowtel.flush(timeout=120)
        once = collections.Counter(_base(r.name, program) for r in session.exporters[0].records
                                   if r.mode == "primal")
    training = collections.Counter(_base(r.name, program) for r in run(name, "callback").records
                                   if r.mode == "primal")
    for base in program.recomputed:
        assert once[base] > 0
        assert training[base] == STEPS * once[base], (base, training[base], once[base])


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_both_transports_send_the_same_records(name: str) -> None:
    keys = {}
    for way in ("callback", "sowtel.jit"):
        keys[way] = collections.Counter((r.name, r.mode, r.step, r.index)
                                        for r in run(name, way).records)
    only_callback = keys["callback"] - keys["sowtel.jit"]
    only_jit = keys["sowtel.jit"] - keys["callback"]
    assert not only_callback and not only_jit, (
        f"callback only: {sorted(only_callback)[:6]}; sowtel.jit only: {sorted(only_jit)[:6]}")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_cotangent_equals_the_perturbation_gradient(name: str) -> None:
    program = PROGRAMS[name]
    target, shape = program.cotangent
    params, batch = program.params, program.batch
    grad = jax.grad(lambda p: program.loss(p, batch, None))
    # The sites a solver repeats are numbered; the checked site is one site (not name_0,
    # name_1), whatever the library does to compute it.
    _, inter = jax.jit(save_intermediates(grad, duplicates="number"))(params)
    assert target in inter, sorted(inter)
    zero = {target: jnp.zeros(shape, jnp.float32)}
    expected = jax.jit(jax.grad(lambda e: program.loss(params, batch, e)))(zero)[target]
    assert inter[target]["primal"].shape == shape
    np.testing.assert_allclose(inter[target]["cotangent"], expected, rtol=2e-4, atol=1e-7)
    # And the gradient with respect to the parameters is the one without sowtel.
    want = jax.jit(grad)(params)
    got = jax.jit(lambda p: save_intermediates(grad, duplicates="number")(p)[0])(params)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
