"""sowtel.sow inside Flax Linen modules: model.apply, jit and grad."""

from __future__ import annotations

import doctest

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sowtel
import sowtel.flax


class MLP(nn.Module):
    use_perturb: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16)(x))
        h = self.perturb("act", h) if self.use_perturb else sowtel.sow(h, "mlp/act")
        return nn.Dense(1)(h)


def _loss(model, params, x, y, perturbations=None):
    variables = {"params": params}
    if perturbations is not None:
        variables["perturbations"] = perturbations
    pred = model.apply(variables, x)
    return jnp.mean((pred[:, 0] - y) ** 2)


def test_flax_cotangent_equals_module_perturb_gradient() -> None:
    x = jax.random.normal(jax.random.key(0), (8, 4))
    y = jnp.sin(x[:, 0])
    params = MLP().init(jax.random.key(1), x)["params"]

    loss = lambda p: _loss(MLP(), p, x, y)  # noqa: E731
    for wrapped in (sowtel.save_intermediates(jax.grad(loss)),
                    jax.jit(sowtel.save_intermediates(jax.grad(loss))),
                    sowtel.save_intermediates(jax.jit(jax.grad(loss)))):
        grads, inter = wrapped(params)
        assert list(inter) == ["mlp/act"]
        assert list(inter["mlp/act"]) == ["primal", "cotangent"]

        # Flax's own way: a zero perturbation collection and the gradient with respect to it.
        perturbed = MLP(use_perturb=True)
        zeros = perturbed.init(jax.random.key(1), x)["perturbations"]
        expected = jax.grad(lambda pert, m=perturbed: _loss(m, params, x, y, pert))(zeros)
        np.testing.assert_allclose(inter["mlp/act"]["cotangent"], expected["act"], rtol=1e-5,
                                   atol=1e-7)
        # And the primal is the activation itself.
        dense = params["Dense_0"]
        np.testing.assert_allclose(
            inter["mlp/act"]["primal"], np.tanh(np.asarray(x) @ dense["kernel"] + dense["bias"]),
            rtol=1e-5, atol=1e-6)
        reference = jax.grad(loss)(params)
        np.testing.assert_allclose(grads["Dense_1"]["kernel"], reference["Dense_1"]["kernel"],
                                   rtol=1e-5)


def test_flax_apply_streams_under_jit() -> None:
    x = jnp.ones((2, 4))
    model = MLP()
    params = model.init(jax.random.key(0), x)["params"]
    apply = jax.jit(model.apply)
    with sowtel.enable(exporter="memory") as session:
        out = apply({"params": params}, x)
        assert sowtel.flush()
    [record] = session.exporters[0].records
    assert (record.name, record.mode, record.shape) == ("mlp/act", "primal", (2, 16))
    h = np.tanh(np.asarray(x) @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    np.testing.assert_allclose(record.stats["mean"], h.mean(), rtol=1e-5)
    assert out.shape == (2, 1)


# ---------------------------------------------------------------------------------------------
# Reused modules: one site per instance, named by module path (Linen) or scope (NNX).


class Block(nn.Module):
    mode: str = "flax_sow"  # "flax_sow" | "plain" (named by module_scopes) | "perturb"

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(4)(x))
        if self.mode == "perturb":
            return self.perturb("act", h)
        if self.mode == "plain":
            return sowtel.sow(h, "act")
        return sowtel.flax.sow(self, h, "act")


class Encoder(nn.Module):
    mode: str = "flax_sow"

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = Block(self.mode)(x)
        return x


class Model(nn.Module):
    mode: str = "flax_sow"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(Encoder(self.mode)(x))


LINEN_NAMES = [f"Encoder_0/Block_{i}/act" for i in range(3)]
XS = jax.random.normal(jax.random.key(3), (5, 4))
YS = jnp.cos(XS[:, 1])


def _linen_loss(params, mode="flax_sow", perturbations=None):
    variables = {"params": params}
    if perturbations is not None:
        variables["perturbations"] = perturbations
    pred = Model(mode).apply(variables, XS)
    return jnp.mean((pred[:, 0] - YS) ** 2)


def _linen_loss_scoped(params):
    with sowtel.flax.module_scopes():
        return _linen_loss(params, "plain")


def _check_against_stream(inter, records, names):
    assert sorted({r.name for r in records}) == sorted(names)
    by = {(r.name, r.mode): r for r in records}
    assert set(by) == {(n, m) for n in names for m in ("primal", "cotangent")}
    for (name, mode), record in by.items():
        value = np.asarray(inter[name][mode])
        assert record.shape == value.shape
        np.testing.assert_allclose(record.stats["mean"], value.mean(), rtol=1e-4, atol=1e-8)
        np.testing.assert_allclose(record.stats["l2"], np.linalg.norm(value), rtol=1e-4)


@pytest.mark.parametrize("loss", [_linen_loss, _linen_loss_scoped], ids=["flax.sow",
                                                                           "module_scopes"])
def test_linen_reused_block_named_by_module_path(loss) -> None:
    params = Model().init(jax.random.key(0), XS)["params"]
    grads, inter = sowtel.save_intermediates(jax.grad(loss))(params)
    assert list(inter) == LINEN_NAMES
    # Cotangents equal Flax's own: gradients of a zero perturbation at each module path.
    zeros = Model("perturb").init(jax.random.key(0), XS)["perturbations"]
    expected = jax.grad(lambda p: _linen_loss(params, "perturb", p))(zeros)
    for i, name in enumerate(LINEN_NAMES):
        np.testing.assert_allclose(inter[name]["cotangent"],
                                   expected["Encoder_0"][f"Block_{i}"]["act"], rtol=1e-5,
                                   atol=1e-8)
    # Primals, by hand from the parameters.
    h = np.asarray(XS)
    for i, name in enumerate(LINEN_NAMES):
        dense = params["Encoder_0"][f"Block_{i}"]["Dense_0"]
        h = np.tanh(h @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"]))
        np.testing.assert_allclose(inter[name]["primal"], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["Dense_0"]["kernel"],
                               jax.grad(_linen_loss)(params)["Dense_0"]["kernel"], rtol=1e-5)
    # Streamed through host callbacks and through sowtel.jit: the same names, the same values.
    for jit in (jax.jit, sowtel.jit):
        with sowtel.enable(exporter="memory") as session:
            jit(jax.grad(loss))(params)
            assert sowtel.flush()
        _check_against_stream(inter, session.exporters[0].records, LINEN_NAMES)


def test_flax_sow_needs_a_bound_linen_module() -> None:
    with pytest.raises(TypeError, match="needs a flax.linen.Module"):
        sowtel.flax.sow(object(), jnp.ones(2), "act")
    with pytest.raises(ValueError, match="is not bound"):
        sowtel.flax.sow(Block(), jnp.ones(2), "act")


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, eps=None):
        h = jnp.tanh(self.linear(x))
        return sowtel.sow(h, "act") if eps is None else h + eps


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x, eps=None):
        for i, block in enumerate(self.blocks):
            with sowtel.scope(f"blocks/{i}"):
                x = block(x, None if eps is None else eps[i])
        return self.head(x)


NNX_NAMES = [f"blocks/{i}/act" for i in range(3)]


def test_nnx_reused_block_named_by_scope() -> None:
    graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))

    def loss(state, eps=None):
        pred = nnx.merge(graphdef, state)(XS, eps)
        return jnp.mean((pred[:, 0] - YS) ** 2)

    _, inter = sowtel.save_intermediates(jax.grad(loss))(state)
    assert list(inter) == NNX_NAMES
    expected = jax.grad(lambda e: loss(state, e))([jnp.zeros((5, 4))] * 3)
    for i, name in enumerate(NNX_NAMES):
        np.testing.assert_allclose(inter[name]["cotangent"], expected[i], rtol=1e-5, atol=1e-8)
    model = nnx.merge(graphdef, state)
    h = np.asarray(XS)
    for block, name in zip(model.blocks, NNX_NAMES, strict=True):
        h = np.tanh(h @ np.asarray(block.linear.kernel[...]) + np.asarray(block.linear.bias[...]))
        np.testing.assert_allclose(inter[name]["primal"], h, rtol=1e-5, atol=1e-6)
    for jit in (jax.jit, sowtel.jit):
        with sowtel.enable(exporter="memory") as session:
            jit(jax.grad(loss))(state)
            assert sowtel.flush()
        _check_against_stream(inter, session.exporters[0].records, NNX_NAMES)


def test_reused_block_without_names_streams_numbered_like_capture() -> None:
    # The plain sow in the block and no module_scopes: three sites named "act".
    params = Model().init(jax.random.key(0), XS)["params"]
    loss = lambda p: _linen_loss(p, "plain")  # noqa: E731
    with sowtel.scope("unnamed"):  # a name of this test's own: the warning comes once a name
        _, inter = sowtel.save_intermediates(jax.grad(loss), duplicates="number")(params)
    names = ["unnamed/act_0", "unnamed/act_1", "unnamed/act_2"]
    assert list(inter) == names
    with sowtel.enable(exporter="memory") as session:
        with pytest.warns(UserWarning, match="'unnamed/act' is used more than once"):
            with sowtel.scope("unnamed"):
                jax.jit(jax.grad(loss))(params)
        assert sowtel.flush()
    _check_against_stream(inter, session.exporters[0].records, names)
    with sowtel.enable(exporter="memory") as session:  # sowtel.jit numbers them the same way
        with sowtel.scope("unnamed"):
            sowtel.jit(jax.grad(loss))(params)
        assert sowtel.flush()
    _check_against_stream(inter, session.exporters[0].records, names)


def test_docstring_examples() -> None:
    result = doctest.testmod(sowtel.flax, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4


class ScanLayer(nn.Module):
    """One layer of a scan-over-layers stack: h -> tanh(h W + b), sown as ``act``."""

    @nn.compact
    def __call__(self, h, _):
        h = sowtel.sow(jnp.tanh(nn.Dense(4)(h)), "act")
        return h, None


class ScanStack(nn.Module):
    """Three ScanLayers under ``nn.scan``: per-layer parameters, or one set broadcast."""

    broadcast: bool

    @nn.compact
    def __call__(self, x):
        if self.broadcast:
            stack = nn.scan(ScanLayer, variable_broadcast="params",
                            split_rngs={"params": False}, length=3)
        else:
            stack = nn.scan(ScanLayer, variable_axes={"params": 0},
                            split_rngs={"params": True}, length=3)
        h, _ = stack(name="layers")(x, None)
        return jnp.sum(h * h)


def _scan_stack_reference(params, x, perturbations):
    """ScanStack by hand (jnp only), with ``perturbations[l]`` added to layer l's output."""
    dense = params["layers"]["Dense_0"]
    h = x
    for layer in range(3):
        kernel, bias = dense["kernel"], dense["bias"]
        if kernel.ndim == 3:
            kernel, bias = kernel[layer], bias[layer]
        h = jnp.tanh(h @ kernel + bias) + perturbations[layer]
    return jnp.sum(h * h)


@pytest.mark.parametrize("transport", ["capture", "callback", "sowtel.jit"])
@pytest.mark.parametrize("broadcast", [True, False], ids=["variable_broadcast", "variable_axes"])
def test_sow_in_nn_scan_body_with_capture_and_streaming(broadcast: bool, transport: str) -> None:
    model = ScanStack(broadcast=broadcast)
    x = jax.random.normal(jax.random.key(0), (2, 4))
    params = model.init(jax.random.key(1), x)["params"]

    def loss(params):
        return model.apply({"params": params}, x)

    zero = jnp.zeros((3, 2, 4))
    want_primal = []
    h = x
    dense = params["layers"]["Dense_0"]
    for layer in range(3):
        kernel, bias = dense["kernel"], dense["bias"]
        if not broadcast:
            kernel, bias = kernel[layer], bias[layer]
        h = np.tanh(np.asarray(h, np.float64) @ np.asarray(kernel, np.float64) + bias)
        want_primal.append(h)
    want_cot = jax.grad(_scan_stack_reference, argnums=2)(params, x, zero)
    # The same compiled program without sowtel. A tanh whose sown value only a fused
    # reduction consumes is the one case streaming may round differently (docs/benchmarks.md,
    # "the case left"): float32 rounding apart, about 1e-5 relative here.
    want_grad = jax.jit(jax.grad(loss))(params)
    if transport == "capture":
        grad, inter = jax.jit(sowtel.save_intermediates(jax.grad(loss)))(params)
        primal, cot = inter["act"]["primal"], inter["act"]["cotangent"]
    else:
        step = jax.jit(jax.grad(loss)) if transport == "callback" else sowtel.jit(jax.grad(loss))
        with sowtel.enable(exporter="memory", summary="full") as session:
            grad = step(params)
            sowtel.flush()
        records = session.exporters[0].records

        def stacked(mode):
            got = sorted((r for r in records if r.mode == mode), key=lambda r: r.index)
            assert [(r.name, r.index) for r in got] == [("act", i) for i in range(3)]
            return np.stack([r.value for r in got])

        primal, cot = stacked("primal"), stacked("cotangent")
    np.testing.assert_allclose(np.asarray(primal), np.stack(want_primal), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cot), want_cot, rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), grad, want_grad)
