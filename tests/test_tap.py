"""``sowtel.tap``: sites placed by rule, checked against independent computations.

Cotangents against ``jax.grad`` of an explicit perturbation added at the tapped output; names
against Flax Linen's own ``capture_intermediates`` paths; streamed records against captured
values; the disabled program against the untapped one.
"""

from __future__ import annotations

import importlib
import re
import warnings

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel

W1 = jnp.arange(12.0).reshape(3, 4) / 10.0
W2 = jnp.arange(8.0).reshape(4, 2) / 10.0 - 0.3
X = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)


def _program(fn, *args) -> str:
    """The optimized HLO, less what differs between any two functions: names and source info."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)
    return text


def mlp(w1, w2, x, e1=0.0, e2=0.0):
    """Two products; ``e1``/``e2`` are perturbations added at their outputs."""
    with jax.named_scope("hidden"):
        h = jnp.tanh(x @ w1 + e1)
    with jax.named_scope("head"):
        out = h @ w2 + e2
    return jnp.sum(jnp.sin(out) ** 2)


def scanned(ws, x, es=None):
    """A stack of layers in a scan; ``es[i]`` is added at layer ``i``'s product."""
    es = jnp.zeros((ws.shape[0], *x.shape[:-1], ws.shape[-1])) if es is None else es

    def layer(h, inputs):
        w, e = inputs
        with jax.named_scope("layer"):
            return jnp.tanh(h @ w + e), None

    return jnp.sum(jax.lax.scan(layer, x, (ws, es))[0] ** 2)


WS = jnp.stack([jnp.eye(3) * (0.5 + i / 4) + 0.1 for i in range(4)])


def records(session):
    return sorted(session.exporters[0].records, key=lambda r: (r.step, r.order, r.seq))


# ---------------------------------------------------------------------------------------------
# Nothing enabled: the program is fn's.


def test_disabled_program_is_fns_own():
    assert _program(sowtel.tap(mlp), W1, W2, X) == _program(mlp, W1, W2, X)
    assert (_program(jax.grad(sowtel.tap(scanned)), WS, X)
            == _program(jax.grad(scanned), WS, X))
    model, x = Model(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    assert _program(sowtel.tap(model.apply), params, x) == _program(model.apply, params, x)
    # A session that streams another tag leaves the program alone too.
    with sowtel.enable(exporter="memory", tags=("other",)):
        assert _program(sowtel.tap(mlp), W1, W2, X) == _program(mlp, W1, W2, X)


# ---------------------------------------------------------------------------------------------
# Derivatives, against independent computations.


def test_cotangents_are_perturbation_gradients():
    grads, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(mlp), argnums=(0, 1)))(
        W1, W2, X)
    assert list(inter) == ["hidden/dot_general", "head/dot_general"]
    zeros1, zeros2 = jnp.zeros((5, 4)), jnp.zeros((5, 2))
    d1, d2 = jax.grad(lambda e1, e2: mlp(W1, W2, X, e1, e2), argnums=(0, 1))(zeros1, zeros2)
    np.testing.assert_allclose(inter["hidden/dot_general"]["cotangent"], d1, rtol=1e-5)
    np.testing.assert_allclose(inter["head/dot_general"]["cotangent"], d2, rtol=1e-5)
    np.testing.assert_allclose(inter["hidden/dot_general"]["primal"], X @ W1, rtol=1e-6)
    # The results are the untapped function's.
    expected = jax.grad(mlp, argnums=(0, 1))(W1, W2, X)
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_scan_stacked_cotangents_are_perturbation_gradients():
    _, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(scanned)))(WS, X)
    site = inter["layer/dot_general"]
    assert site.stacked == {"primal": (("scan", 4),), "cotangent": (("scan", 4),)}
    es = jnp.zeros((4, 5, 3))
    np.testing.assert_allclose(site["cotangent"], jax.grad(lambda e: scanned(WS, X, e))(es),
                               rtol=1e-5, atol=1e-7)
    h, firsts = X, []
    for w in WS:
        firsts.append(h @ w)
        h = jnp.tanh(h @ w)
    np.testing.assert_allclose(site["primal"], jnp.stack(firsts), rtol=1e-5)


def test_tangents_under_jvp_and_batch_under_vmap():
    t1 = jnp.ones_like(W1)
    _, inter = sowtel.save_intermediates(
        lambda w1, t: jax.jvp(lambda w: sowtel.tap(mlp)(w, W2, X), (w1,), (t,)))(W1, t1)
    np.testing.assert_allclose(inter["hidden/dot_general"]["tangent"], X @ t1, rtol=1e-6)
    xs = jnp.stack([X, 2 * X])
    _, inter = sowtel.save_intermediates(
        jax.vmap(sowtel.tap(lambda x: mlp(W1, W2, x))))(xs)
    np.testing.assert_allclose(inter["hidden/dot_general"]["primal"], xs @ W1, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Constructs inside the tapped function.


@pytest.mark.filterwarnings("ignore:save_intermediates.*captured nothing")
def test_constructs_inside():
    def f(x, flag):
        y = jax.lax.cond(flag > 0, lambda v: v @ W1, lambda v: jnp.zeros((5, 4)), x)
        z = jax.checkpoint(lambda v: jnp.tanh(v @ W2))(y)
        inner = jax.jit(lambda v: v @ W1)
        return z.sum() + inner(x).sum() + inner(2 * x).sum()

    (_, inter) = sowtel.save_intermediates(jax.grad(sowtel.tap(f)))(X, 1)
    assert list(inter) == ["dot_general_0", "dot_general_1", "dot_general_2", "dot_general_3"]
    np.testing.assert_allclose(inter["dot_general_0"]["primal"], X @ W1, rtol=1e-6)  # cond
    np.testing.assert_allclose(inter["dot_general_1"]["primal"], (X @ W1) @ W2, rtol=1e-5)
    np.testing.assert_allclose(inter["dot_general_3"]["primal"], 2 * X @ W1, rtol=1e-5)
    # checkpoint: the cotangent once, as the perturbation's gradient
    d = jax.grad(lambda e: jnp.tanh((X @ W1) @ W2 + e).sum())(jnp.zeros((5, 2)))
    np.testing.assert_allclose(inter["dot_general_1"]["cotangent"], d, rtol=1e-5)
    # the untaken branch: its site is filled
    _, inter = sowtel.save_intermediates(sowtel.tap(f))(X, 0)
    assert np.isnan(inter["dot_general_0"]["primal"]).all()

    def loop(x):  # a while body: the last iteration's value
        return jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] @ WS[0]),
                                  (0, x))[1]

    _, inter = sowtel.save_intermediates(sowtel.tap(loop))(X)
    # A product in the cond function: not a site, and said so.
    in_cond = sowtel.tap(lambda x: jax.lax.while_loop(
        lambda s: jnp.sum(s @ WS[0]) < 100.0, lambda s: 2.0 * s, x))
    with pytest.warns(UserWarning, match=r"1 chosen equation\(s\) inside a while cond function"):
        sowtel.save_intermediates(in_cond, duplicates="number")(X)
    np.testing.assert_allclose(inter["dot_general"]["primal"], X @ WS[0] @ WS[0] @ WS[0],
                               rtol=1e-5, atol=1e-6)
    with sowtel.enable(exporter="memory") as session:  # streamed: every iteration
        jax.jit(sowtel.tap(loop))(X)
        sowtel.flush()
    assert [r.name for r in records(session)] == ["dot_general"] * 3


A2 = jnp.array([[3.0, 1.0], [1.0, 2.0]])


def _richardson(b):
    """A library primitive running the user's function: ``custom_linear_solve`` whose solve
    takes one Richardson step from the diagonal guess (it applies the matvec once)."""
    def solve(mv, r):
        x0 = r / jnp.diag(A2)
        return x0 + (r - mv(x0)) / jnp.diag(A2)

    return jax.lax.custom_linear_solve(lambda x: A2 @ x, b, solve, symmetric=True).sum()


def test_library_primitives_are_tapped_inside():
    """A product inside a library's primitive (the matvec of ``custom_linear_solve``, and so
    of ``cg``) is a site wherever the primitive runs it, captured and streamed through both
    transports (``sowtel.jit`` streams it by its host callback, as a sow written there)."""
    b = jnp.array([1.0, 2.0])
    x0 = np.array([1.0 / 3.0, 1.0])  # b / diag(A)
    mv = np.asarray(A2) @ x0  # [2, 7/3]: what the solve's one matvec computes
    value, inter = sowtel.save_intermediates(sowtel.tap(_richardson))(b)
    [name] = inter
    np.testing.assert_allclose(inter[name]["primal"], mv, rtol=1e-6)
    np.testing.assert_allclose(value, (x0 + (np.asarray(b) - mv) / np.diag(A2)).sum(),
                               rtol=1e-6)
    for transport in (jax.jit, sowtel.jit):
        with sowtel.enable(exporter="memory") as session:
            transport(jax.grad(sowtel.tap(_richardson)))(b)
            assert sowtel.flush(timeout=60)
        [r] = records(session)
        assert (r.name, r.mode) == (name, "primal")
        assert r.stats["mean"] == pytest.approx(mv.mean(), rel=1e-6)
    # cg: each iteration's matvec is an occurrence of the site, numbered in trace order.
    def solve_cg(b):
        return jax.scipy.sparse.linalg.cg(lambda v: A2 @ v, b, maxiter=3)[0]

    x, inter = sowtel.save_intermediates(sowtel.tap(solve_cg), duplicates="number")(b)
    np.testing.assert_allclose(np.asarray(A2) @ np.asarray(x), b, rtol=1e-5)
    assert inter and all(set(modes) == {"primal"} for modes in inter.values())
    residual_mv = np.asarray(A2) @ np.zeros(2)  # cg starts from x0 = 0: its first matvec
    assert any(np.allclose(v["primal"], residual_mv) for v in inter.values())


def test_custom_derivative_functions_are_tapped_as_primal_sites():
    @jax.custom_jvp
    def cj(x):
        return jnp.tanh(x @ W1)

    cj.defjvp(lambda p, t: (cj(p[0]), (1 - cj(p[0]) ** 2) * (t[0] @ W1)))

    @jax.custom_vjp
    def cv(x):
        return x @ W1

    cv.defvjp(lambda x: (x @ W1, None), lambda _, g: (2.0 * g @ W1.T,))  # a rule of its own

    def f(x):
        return cj(x).sum() + cv(x).sum()

    _, inter = sowtel.save_intermediates(sowtel.tap(f))(X)
    np.testing.assert_allclose(inter["dot_general_0"]["primal"], X @ W1, rtol=1e-6)
    np.testing.assert_allclose(inter["dot_general_1"]["primal"], X @ W1, rtol=1e-6)
    # Differentiated from outside: the rules give the results (cv's doubles its gradient), the
    # sites inside stay primal (a rule defines no derivative of a value inside its function).
    g, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(f)))(X)
    np.testing.assert_allclose(g, jax.grad(f)(X), rtol=1e-6)
    assert {name: list(modes) for name, modes in inter.items()} == {
        "dot_general_0": ["primal"], "dot_general_1": ["primal"]}
    np.testing.assert_allclose(inter["dot_general_1"]["primal"], X @ W1, rtol=1e-6)


def test_shard_map_sites_per_shard_and_an_enclosing_scope():
    mesh = jax.make_mesh((8,), ("i",))
    xs = jax.device_put(jnp.linspace(-1.0, 1.0, 24).reshape(8, 3),
                        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i")))
    spec = jax.sharding.PartitionSpec("i")
    product = jax.shard_map(lambda v: v @ W1, mesh=mesh, in_specs=spec, out_specs=spec)

    def f(x):
        return jnp.sum(jnp.sin(product(x)))

    def scoped(x):
        with sowtel.scope("outer"):
            return sowtel.tap(f)(x)

    _, inter = sowtel.save_intermediates(jax.grad(scoped))(xs)
    site = inter["outer/dot_general"]
    assert site.stacked["primal"] == (("shard", 8),)
    np.testing.assert_allclose(np.asarray(site["primal"]).reshape(8, 4), xs @ W1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(site["cotangent"]).reshape(8, 4), jnp.cos(xs @ W1),
                               rtol=1e-5)


def test_backward_pass_inside_fn_is_not_tapped():
    with pytest.warns(UserWarning, match=r"differentiates inside: its 2 chosen equations of "
                                         r"the backward pass.*jax.grad\(sowtel.tap\(loss\)\)"):
        _, inter = sowtel.save_intermediates(sowtel.tap(jax.grad(mlp)))(W1, W2, X)
    # Forward products only (the transposed ones are the backward pass's), as primal sites.
    assert list(inter) == ["hidden/dot_general", "head/dot_general"]
    assert all(list(modes) == ["primal"] for modes in inter.values())


# ---------------------------------------------------------------------------------------------
# Names.


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(4)(x))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(1)(x)


def test_names_are_flax_module_paths():
    model, x = Model(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    _, state = model.apply(params, x, capture_intermediates=lambda m, _: isinstance(m, nn.Dense),
                           mutable=["intermediates"])
    flat = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
    flax_outputs = {"/".join(k.key for k in path[:-2]): value for path, value in flat}
    assert sorted(flax_outputs) == ["Block_0/Dense_0", "Block_1/Dense_0", "Dense_0"]
    _, inter = sowtel.save_intermediates(sowtel.tap(model.apply))(params, x)
    assert sorted(inter) == sorted(f"Model/{p}/dot_general" for p in flax_outputs)
    for path, value in flax_outputs.items():
        bias = params["params"]
        for part in path.split("/"):
            bias = bias[part]
        np.testing.assert_allclose(inter[f"Model/{path}/dot_general"]["primal"] + bias["bias"],
                                   value, rtol=1e-6)


def test_names_sanitised_numbered_and_scoped():
    def f(x):
        with jax.named_scope("my layer"), jax.named_scope(".."):
            a = x @ W1
        with sowtel.scope("enc"):
            b = (x @ W1) @ W1.T
        return a.sum() + b.sum()

    _, inter = sowtel.save_intermediates(sowtel.tap(f))(X)
    assert list(inter) == ["my_layer/__/dot_general", "enc/dot_general_0", "enc/dot_general_1"]
    site_name = importlib.import_module("sowtel.tap").site_name
    assert site_name(["a:b", "", "."], "dot_general") == "a_b/_/dot_general"


def test_a_tap_inside_a_module_or_named_scope_is_named_under_it():
    class Tapped(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", lambda key: W1)
            return sowtel.tap(lambda v: jnp.tanh(v @ w))(x)

    model = Tapped()
    params = model.init(jax.random.key(0), X)

    def f(x):
        with jax.named_scope("outer"):
            return model.apply(params, x).sum()

    _, inter = sowtel.save_intermediates(f)(X)
    assert list(inter) == ["outer/Tapped/dot_general"]
    np.testing.assert_allclose(inter["outer/Tapped/dot_general"]["primal"], X @ W1, rtol=1e-6)


def test_user_sows_keep_their_names_and_taps_do_not_collide():
    def f(x):
        h = sowtel.sow(x @ W1, "dot_general")
        return sowtel.sow(jnp.tanh(h), "act").sum()

    _, inter = sowtel.save_intermediates(sowtel.tap(f))(X)
    assert list(inter) == ["dot_general_tap", "dot_general", "act"]
    np.testing.assert_allclose(inter["dot_general_tap"]["primal"], inter["dot_general"]["primal"])


@pytest.mark.filterwarnings("ignore:save_intermediates.*captured nothing")
def test_include_exclude_and_predicates():
    both = sowtel.tap(mlp, include="hidden/*")
    _, inter = sowtel.save_intermediates(both)(W1, W2, X)
    assert list(inter) == ["hidden/dot_general"]
    _, inter = sowtel.save_intermediates(sowtel.tap(mlp, exclude=lambda n: "hidden" in n))(
        W1, W2, X)
    assert list(inter) == ["head/dot_general"]
    by_rule = sowtel.tap(mlp, primitives=["tanh", lambda eqn: eqn.primitive.name == "sin"])
    _, inter = sowtel.save_intermediates(by_rule)(W1, W2, X)
    assert list(inter) == ["hidden/tanh", "sin"]  # sin is outside "head"
    np.testing.assert_allclose(inter["hidden/tanh"]["primal"], jnp.tanh(X @ W1), rtol=1e-6)
    with pytest.warns(UserWarning, match=r"include pattern 'decoder/\*' matches no site.*"
                                         r"'hidden/dot_general'"):
        sowtel.save_intermediates(sowtel.tap(mlp, include=["decoder/*"]), duplicates="number")(
            W1, W2, X)
    with pytest.warns(UserWarning, match="found no equation to tap.*'tanh'"):
        sowtel.save_intermediates(sowtel.tap(jnp.tanh))(X)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"'dot_generl', which is not the name of a JAX primitive "
                                         r"\(did you mean 'dot_general'"):
        sowtel.tap(mlp, primitives=["dot_generl"])
    with pytest.raises(ValueError, match=r"primitives=\(\) selects nothing.*dot_general"):
        sowtel.tap(mlp, primitives=())
    with pytest.raises(ValueError, match="sowtel.tap needs a callable, got int 3"):
        sowtel.tap(3)
    with pytest.raises(ValueError, match="tap include=.*is not a filter"):
        sowtel.tap(mlp, include=[1])
    with pytest.raises(ValueError, match="neither a primitive name nor a predicate"):
        sowtel.tap(mlp, primitives=[1.5])


# ---------------------------------------------------------------------------------------------
# Streaming: both transports, sowtel.jit, Linen nn.scan(nn.remat(...)), haiku.


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(8)(x)), None


class ScanModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        stack = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(1)(x)


def test_linen_scan_remat_streamed_through_sowtel_jit():
    model, x = ScanModel(), jnp.linspace(-1, 1, 24).reshape(3, 8)
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    def step(p, x):  # the loss is tapped: its sites get cotangents
        g = jax.grad(sowtel.tap(loss))(p, x)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    _, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(loss)))(params, x)
    with sowtel.enable(exporter="memory") as session:
        new = sowtel.jit(step)(params, x)
        sowtel.flush()
    got = records(session)
    layer = [r for r in got if r.name == "ScanModel/layers/Dense_0/dot_general"]
    assert sorted((r.mode, r.index) for r in layer) == sorted(
        (m, i) for m in ("primal", "cotangent") for i in range(3))
    for r in layer:
        value = inter["ScanModel/layers/Dense_0/dot_general"][r.mode][r.index]
        np.testing.assert_allclose(r.stats["mean"], float(jnp.mean(value)), rtol=1e-4,
                                   atol=1e-7)
    assert {r.name for r in got} == set(inter)
    expected = jax.jit(step)(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(expected),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # sowtel.jit(tap(step)) with the gradient taken inside: the forward products, primal.
    with sowtel.enable(exporter="memory") as session, pytest.warns(UserWarning,
                                                                   match="differentiates"):
        sowtel.jit(sowtel.tap(lambda p, x: jax.grad(loss)(p, x)))(params, x)
        sowtel.flush()
    assert {(r.name, r.mode) for r in records(session)} == {(n, "primal") for n in inter}


def test_haiku_model_streamed_through_sowtel_jit_and_callbacks():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([6, 2])(x)))
    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    params = net.init(jax.random.key(1), x)

    def loss(p, x):
        return jnp.sum(net.apply(p, x) ** 2)

    names = ["mlp/linear_0/dot_general", "mlp/linear_1/dot_general"]
    _, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(loss)))(params, x)
    assert list(inter) == names
    np.testing.assert_allclose(inter[names[0]]["primal"], x @ params["mlp/~/linear_0"]["w"],
                               rtol=1e-6)
    for transport in (sowtel.jit, jax.jit):
        with sowtel.enable(exporter="memory") as session:
            transport(jax.grad(sowtel.tap(loss)))(params, x)
            sowtel.flush()
        got = records(session)
        assert sorted((r.name, r.mode) for r in got) == sorted(
            (n, m) for n in names for m in ("primal", "cotangent")), transport
        for r in got:
            np.testing.assert_allclose(r.stats["l2"], float(jnp.linalg.norm(inter[r.name][r.mode])),
                                       rtol=1e-4)


def test_a_tapped_program_is_the_hand_sown_program():
    from benchmarks import hlo_structure

    def hand_sown(ws, x):
        def layer(h, w):
            with jax.named_scope("layer"):
                return jnp.tanh(sowtel.sow(h @ w, "layer/dot_general")), None

        return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

    with sowtel.enable(exporter="memory"):
        tapped = jax.jit(jax.grad(sowtel.tap(scanned))).lower(WS, X).compile().as_text()
        by_hand = jax.jit(jax.grad(hand_sown)).lower(WS, X).compile().as_text()
        # sowtel.jit's logging program: the summaries returned as outputs, no callback.
        tapped_jit = sowtel.jit(jax.grad(sowtel.tap(scanned))).lower_logging(WS, X)
        by_hand_jit = sowtel.jit(jax.grad(hand_sown)).lower_logging(WS, X)
    assert "callback" in tapped  # streaming: the sites are in the program
    assert hlo_structure(tapped) == hlo_structure(by_hand)  # up to how XLA named things
    tapped_jit, by_hand_jit = tapped_jit.compile().as_text(), by_hand_jit.compile().as_text()
    assert "callback" not in tapped_jit and len(tapped_jit) > len(_program(scanned, WS, X))
    assert hlo_structure(tapped_jit) == hlo_structure(by_hand_jit)


def test_filters_of_the_session_apply_to_tapped_sites():
    with sowtel.enable(exporter="memory", include=["head/*"], modes=("cotangent",)) as session:
        jax.jit(jax.grad(sowtel.tap(mlp)))(W1, W2, X)
        sowtel.flush()
    assert [(r.name, r.mode) for r in records(session)] == [("head/dot_general", "cotangent")]


def test_alert_rules_and_the_depth_view_see_tapped_scanned_sites(tmp_path):
    """A tapped product in a scanned stack is a depth site (one tensor a step for the SOWTEL
    tab) and alert rules judge it per layer, as a hand-placed sow."""
    from tensorboard.backend.event_processing import event_accumulator

    from sowtel.exporters.memory import MemoryExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    # The largest activation of layer l's product, to set a bound only layers >= 2 cross.
    h, peaks = X, []
    for w in WS:
        peaks.append(float(jnp.max(h @ w)))
        h = jnp.tanh(h @ w)
    bound = (sorted(peaks)[1] + sorted(peaks)[2]) / 2
    over = sorted(i for i, p in enumerate(peaks) if p > bound)
    memory = MemoryExporter()
    rule = sowtel.alert("layer/*", mode="primal", stat="max", above=bound)
    with sowtel.enable(exporter=[memory, TensorBoardExporter(tmp_path)], alerts=[rule],
                       on_alert=lambda found: None):
        sowtel.jit(jax.grad(sowtel.tap(scanned)))(WS, X)
        assert sowtel.flush(timeout=60)
    assert [(a.name, a.index) for a in memory.alerts] == [("layer/dot_general", i)
                                                          for i in over]
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={
        event_accumulator.TENSORS: 0})
    acc.Reload()
    assert {"layer/dot_general/primal/depth",
            "layer/dot_general/cotangent/depth"} <= set(acc.Tags()["tensors"])


def test_tag_selects_the_pass_that_sees_the_sites():
    acts = sowtel.tap(mlp, tag="acts")
    _, inter = sowtel.save_intermediates(acts, tag="acts")(W1, W2, X)
    assert list(inter) == ["hidden/dot_general", "head/dot_general"]
    with pytest.warns(UserWarning, match="captured nothing"):  # another tag: fn's own trace
        _, inter = sowtel.save_intermediates(acts)(W1, W2, X)
    assert inter == {}
    with sowtel.enable(exporter="memory", tags=("acts",)) as session:
        jax.jit(acts)(W1, W2, X)
        sowtel.flush()
    assert {(r.name, r.tag) for r in records(session)} == {
        ("hidden/dot_general", "acts"), ("head/dot_general", "acts")}


def test_no_warnings_from_a_plain_tap():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sowtel.save_intermediates(sowtel.tap(mlp))(W1, W2, X)
