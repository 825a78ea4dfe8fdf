"""Watching models without editing them: sowtel.flax.capture (Linen), sowtel.nnx.capture and
sowtel.nnx.jit (NNX), sowtel.equinox.capture and filter_jit; each with an Optax optimizer.

Values are checked against the frameworks' own ways of reaching them (Flax's
capture_intermediates, direct calls of submodules) and cotangents against jax.grad of an
explicit perturbation of the module's output."""

from __future__ import annotations

import doctest
import functools
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sowtel
import sowtel.equinox
import sowtel.flax
import sowtel.nnx
import sowtel.optax
from sowtel.exporters.memory import MemoryExporter


def _program(fn, *args) -> str:  # type: ignore[no-untyped-def]
    """The lowered program of ``jax.jit(fn)``, without the module's name (the function's)."""
    return re.sub(r"module @\S+", "module", jax.jit(fn).lower(*args).as_text())


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
X = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]])
Y = jnp.array([[1.0], [-1.0]])


# -- Linen ------------------------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.tanh(nn.Dense(4)(x))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Block()(Block()(x))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(Encoder()(x))


def _linen_loss(params, x, y, capture=True):  # type: ignore[no-untyped-def]
    if capture:
        with sowtel.flax.capture():
            pred = Model().apply(params, x)
    else:
        pred = Model().apply(params, x)
    return jnp.mean((pred - y) ** 2)


def _perturbed_linen_loss(eps, params, x, y, target):  # type: ignore[no-untyped-def]
    """The loss with ``eps`` added to the output of the module at path ``target``."""
    def add(next_fun, args, kwargs, context):  # type: ignore[no-untyped-def]
        out = next_fun(*args, **kwargs)
        mod = context.module
        if context.method_name == "__call__" and mod.scope is not None and tuple(
                mod.scope.path) == target:
            out = out + eps
        return out

    with nn.intercept_methods(add):
        pred = Model().apply(params, x)
    return jnp.mean((pred - y) ** 2)


def test_linen_capture_names_values_and_cotangents() -> None:
    params = Model().init(jax.random.key(0), X)
    _, inter = sowtel.save_intermediates(jax.grad(_linen_loss))(params, X, Y)
    names = {"Encoder_0/Block_0/Dense_0/__call__", "Encoder_0/Block_0/__call__",
             "Encoder_0/Block_1/Dense_0/__call__", "Encoder_0/Block_1/__call__",
             "Encoder_0/__call__", "Dense_0/__call__", "__call__"}
    assert set(inter) == names
    # Flax's own capture_intermediates gives every __call__ output.
    _, state = Model().apply(params, X, capture_intermediates=True, mutable=["intermediates"])
    flat = {"/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]}
    for name in names:  # Flax files each output as a one-element tuple: <path>/__call__/0
        np.testing.assert_allclose(inter[name]["primal"], flat[name + "/0"], rtol=1e-6)
    for target in [("Encoder_0", "Block_0"), ("Encoder_0",), ("Dense_0",)]:
        name = "/".join(target) + "/__call__"
        zeros = jnp.zeros_like(inter[name]["primal"])
        expected = jax.grad(_perturbed_linen_loss)(zeros, params, X, Y, target)
        np.testing.assert_allclose(inter[name]["cotangent"], expected, rtol=1e-5, atol=1e-7)


def test_linen_capture_filter_and_identical_program() -> None:
    params = Model().init(jax.random.key(0), X)

    def loss(params, x):  # type: ignore[no-untyped-def]
        with sowtel.flax.capture(filter="*/Block_1/__call__"):
            return Model().apply(params, x).sum()

    _, inter = sowtel.save_intermediates(loss)(params, X)
    assert list(inter) == ["Encoder_0/Block_1/__call__"]
    _, inter = sowtel.save_intermediates(lambda p, x: _linen_loss(p, x, Y, capture=False))(
        params, X)
    assert list(inter) == []
    # Nothing enabled: the capture context adds nothing to the compiled program.
    with_capture = _program(_linen_loss, params, X, Y)
    without = _program(lambda p, x, y: _linen_loss(p, x, y, capture=False), params, X, Y)
    assert with_capture == without
    with pytest.raises(TypeError, match="filter"):
        with sowtel.flax.capture(filter=3):
            pass


@pytest.mark.parametrize("transport", ["callback", "sowtel.jit"])
def test_linen_training_streams_with_optax(transport: str) -> None:
    params = Model().init(jax.random.key(0), X)
    tx = sowtel.optax.watch(optax.adam(1e-2), every=2)
    state = tx.init(params)

    def step(params, state, x, y):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(_linen_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    memory = MemoryExporter()
    compiled = sowtel.jit(step) if transport == "sowtel.jit" else jax.jit(step)
    losses = []
    with sowtel.enable(exporter=memory):
        for k in range(4):
            with sowtel.at_step(k):
                params, state, loss = compiled(params, state, X, Y)
            losses.append(float(loss))
        sowtel.flush()
    assert losses[-1] < losses[0]
    got = {(r.name, r.mode, r.step) for r in memory.records}
    assert ("Encoder_0/Block_1/__call__", "cotangent", 3) in got
    assert ("optim/grads/params/Dense_0/kernel", "primal", 2) in got
    assert not any(n.startswith("optim/") and s % 2 for n, _, s in got)


# -- NNX --------------------------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(3, 4, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)]) if hasattr(
            nnx, "List") else [nnx.Linear(4, 4, rngs=rngs) for _ in range(2)]
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):  # type: ignore[no-untyped-def]
        h = nnx.relu(self.hidden(x))
        for block in self.blocks:
            h = jnp.tanh(block(h))
        return self.out(h)


def _nnx_loss(model, x, y):  # type: ignore[no-untyped-def]
    with sowtel.nnx.capture(model):
        return jnp.mean((model(x) - y) ** 2)


def test_nnx_capture_names_values_and_cotangents() -> None:
    model = NnxMLP(nnx.Rngs(0))
    _, inter = sowtel.save_intermediates(nnx.grad(_nnx_loss))(model, X, Y)
    assert set(inter) == {"hidden/__call__", "blocks/0/__call__", "blocks/1/__call__",
                          "out/__call__", "__call__"}
    h = model.hidden(X)
    np.testing.assert_allclose(inter["hidden/__call__"]["primal"], h, rtol=1e-6)

    def rest(h):  # type: ignore[no-untyped-def]
        h = nnx.relu(h)
        for block in model.blocks:
            h = jnp.tanh(block(h))
        return jnp.mean((model.out(h) - Y) ** 2)

    np.testing.assert_allclose(inter["hidden/__call__"]["cotangent"], jax.grad(rest)(h),
                               rtol=1e-5, atol=1e-7)
    # The classes are as they were after the context.
    assert "__call__" not in nnx.Linear.__dict__ or not hasattr(
        nnx.Linear.__call__, "__sowtel_original__")
    graphdef, state = nnx.split(model)
    with_capture = _program(lambda s, x: _nnx_loss(nnx.merge(graphdef, s), x, Y), state, X)
    without = _program(lambda s, x: jnp.mean((nnx.merge(graphdef, s)(x) - Y) ** 2), state, X)
    assert with_capture == without


def _nnx_step(model, optimizer, x, y):  # type: ignore[no-untyped-def]
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def test_nnx_jit_trains_in_place_exactly_as_nnx_jit() -> None:
    runs = []
    for jitter, session in ((nnx.jit, False), (sowtel.nnx.jit, False), (sowtel.nnx.jit, True)):
        model = NnxMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, sowtel.optax.watch(optax.adam(1e-2)), wrt=nnx.Param)
        step = jitter(_nnx_step)
        memory = MemoryExporter()
        losses = []
        with sowtel.enable(exporter=memory, every=2) if session else _nothing():
            for _ in range(5):
                losses.append(float(step(model, optimizer, X, Y)))
            sowtel.flush()
        runs.append((losses, nnx.state(model, nnx.Param), memory.records))
    (ref_losses, ref_params, _), *others = runs
    assert ref_losses[-1] < ref_losses[0] - 1e-3  # nnx.jit trains
    for losses, params, _ in others:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    records = runs[2][2]
    got = {(r.name, r.mode, r.step) for r in records}
    assert {s for _, _, s in got} == {0, 2, 4}
    assert ("blocks/1/__call__", "cotangent", 4) in got
    assert ("optim/updates/out/kernel", "primal", 2) in got


def test_nnx_jit_donated_state_trains_the_same() -> None:
    runs = []
    for donate in (False, True):
        model = NnxMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        step = sowtel.nnx.jit(_nnx_step, donate_state=donate)
        runs.append([float(step(model, optimizer, X, Y)) for _ in range(3)])
    assert runs[0] == runs[1] and runs[0][2] < runs[0][0]


def test_nnx_jit_outputs_and_errors() -> None:
    model = NnxMLP(nnx.Rngs(0))
    f = sowtel.nnx.jit(lambda m, x, k: (m(x) * k, m.out))
    y, out = f(model, X, 2)
    np.testing.assert_allclose(y, model(X) * 2, rtol=1e-6)
    assert isinstance(out, nnx.Linear)
    with pytest.raises(TypeError, match="in_shardings"):
        sowtel.nnx.jit(lambda m: m, in_shardings=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))
    with pytest.raises(TypeError, match="nnx.Module"):
        with sowtel.nnx.capture(lambda x: x):
            pass


# -- NNX graph transforms hand the code copies of the captured modules ------------------------


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):  # type: ignore[no-untyped-def]
        return jnp.tanh(self.lin(x)) + x


def _stacked_blocks() -> NnxBlock:
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> NnxBlock:
        return NnxBlock(rngs)

    return make(nnx.Rngs(0))  # type: ignore[no-any-return]


H = jnp.array([0.5, -1.0, 0.25, 1.5])


def _scan_blocks(blocks, x, remat: bool = False):  # type: ignore[no-untyped-def]
    body = nnx.remat(lambda b, x: b(x)) if remat else (lambda b, x: b(x))
    return nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(blocks, x)


def _blocks_by_hand(blocks, x, eps=None):  # type: ignore[no-untyped-def]
    """The layers' outputs from the stacked parameters; ``eps`` perturbs each site."""
    kernel, bias = blocks.lin.kernel[...], blocks.lin.bias[...]
    lins, outs = [], []
    for i in range(kernel.shape[0]):
        lin = x @ kernel[i] + bias[i] + (0 if eps is None else eps["lin/__call__"][i])
        x = jnp.tanh(lin) + x + (0 if eps is None else eps["__call__"][i])
        lins.append(lin)
        outs.append(x)
    return x, {"lin/__call__": jnp.stack(lins), "__call__": jnp.stack(outs)}


class NnxStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = _stacked_blocks()
        self.scale = nnx.Param(jnp.float32(2.0))

    def __call__(self, x):  # type: ignore[no-untyped-def]
        return _scan_blocks(self.blocks, x) * self.scale[...]


@pytest.mark.parametrize("remat", [False, True])
def test_nnx_capture_follows_scan_and_remat_copies(remat: bool) -> None:
    blocks = _stacked_blocks()
    graphdef = nnx.graphdef(blocks)

    def loss(blocks, x):  # type: ignore[no-untyped-def]
        with sowtel.nnx.capture(blocks):
            return jnp.sum(_scan_blocks(blocks, x, remat) ** 2)

    _, inter = sowtel.save_intermediates(nnx.grad(loss, argnums=1))(blocks, H)
    assert set(inter) == {"__call__", "lin/__call__"}
    _, want = _blocks_by_hand(blocks, H)
    zeros = {k: jnp.zeros_like(v) for k, v in want.items()}
    cot = jax.grad(lambda e: jnp.sum(_blocks_by_hand(blocks, H, e)[0] ** 2))(zeros)
    for name in want:  # one value per layer, stacked as a sow in a scan
        assert inter[name]["primal"].shape == (3, 4)
        np.testing.assert_allclose(inter[name]["primal"], want[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(inter[name]["cotangent"], cot[name], rtol=1e-5, atol=1e-6)
    assert nnx.graphdef(blocks) == graphdef  # the marks are gone
    # With nothing enabled the marks change nothing in the program.
    graphdef, state = nnx.split(blocks)
    with_capture = _program(lambda s, x: loss(nnx.merge(graphdef, s), x), state, H)
    without = _program(
        lambda s, x: jnp.sum(_scan_blocks(nnx.merge(graphdef, s), x, remat) ** 2), state, H)
    assert with_capture == without


def test_nnx_capture_follows_vmap_and_jit_copies() -> None:
    blocks = _stacked_blocks()

    kernel, bias = blocks.lin.kernel[...], blocks.lin.bias[...]
    want = jnp.tanh(jnp.einsum("i,kij->kj", H, kernel) + bias) + H
    for graph in (True, False):  # NNX's graph mode, and its tree mode (modules as pytrees)
        def ensemble(blocks, x, graph=graph):  # type: ignore[no-untyped-def]
            with sowtel.nnx.capture(blocks, filter="__call__"):
                return nnx.vmap(lambda b, x: b(x), in_axes=(0, None), graph=graph)(blocks, x)

        out, inter = sowtel.save_intermediates(ensemble)(blocks, H)
        assert list(inter) == ["__call__"]  # the batch axis (the members) first
        np.testing.assert_allclose(inter["__call__"]["primal"], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)

    # Streamed through sowtel.nnx.jit, one record per layer of the scan, with its index.
    model = NnxStack(nnx.Rngs(1))

    @sowtel.nnx.jit
    def step(model, x):  # type: ignore[no-untyped-def]
        with sowtel.nnx.capture(model):
            return model(x)

    memory = MemoryExporter()
    with sowtel.enable(exporter=memory, summary="full"):
        step(model, H)
        sowtel.flush()
    layers = sorted((r.index, r.value) for r in memory.records if r.name == "blocks/__call__")
    _, want = _blocks_by_hand(model.blocks, H)
    assert [i for i, _ in layers] == [0, 1, 2]
    for i, value in layers:
        np.testing.assert_allclose(value, want["__call__"][i], rtol=1e-5, atol=1e-6)
    assert {r.name for r in memory.records} == {"blocks/__call__", "blocks/lin/__call__",
                                                "__call__"}


def test_nnx_capture_says_when_a_copy_cannot_be_captured() -> None:
    blocks = _stacked_blocks()
    graphdef, state = nnx.split(blocks)  # a copy split before the context: it has no mark
    other = nnx.Linear(4, 2, rngs=nnx.Rngs(3))  # not the model, not its structure either

    def run(blocks, state, x):  # type: ignore[no-untyped-def]
        with sowtel.nnx.capture(blocks):
            y = jax.lax.scan(lambda c, s: (nnx.merge(graphdef, s)(c), None), x, state)[0]
            return other(y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, inter = sowtel.save_intermediates(run)(blocks, state, H)
    assert inter == {}
    messages = [str(w.message) for w in caught]
    said = {re.search(r"captured module '([^']*)'", m).group(1)  # type: ignore[union-attr]
            for m in messages if "but it is neither that module nor a copy" in m}
    assert said == {"__call__", "lin/__call__"}
    assert any("captured nothing" in m for m in messages)

    # The model's own modules, filtered out or not, and a module of another structure: silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sowtel.nnx.capture(blocks, filter="lin/*"):
            _, inter = sowtel.save_intermediates(lambda b, x: other(_scan_blocks(b, x)))(
                blocks, H)
    assert list(inter) == ["lin/__call__"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- Equinox ----------------------------------------------------------------------------------


def _eqx_model() -> eqx.nn.MLP:
    return eqx.nn.MLP(3, 1, width_size=4, depth=2, activation=jnp.tanh, key=jax.random.key(0))


def _eqx_loss(model, x, y):  # type: ignore[no-untyped-def]
    pred = jax.vmap(sowtel.equinox.capture(model))(x)
    return jnp.mean((pred - y) ** 2)


def test_equinox_capture_names_values_and_cotangents() -> None:
    model = _eqx_model()
    grads, inter = sowtel.save_intermediates(eqx.filter_grad(_eqx_loss))(model, X, Y)
    assert set(inter) == {"layers/0/__call__", "layers/1/__call__", "layers/2/__call__",
                          "__call__"}
    assert type(grads) is type(model)  # the gradients keep the model's structure
    h0 = jax.vmap(model.layers[0])(X)
    np.testing.assert_allclose(inter["layers/0/__call__"]["primal"], h0, rtol=1e-6)

    def rest(h):  # type: ignore[no-untyped-def]
        h = jnp.tanh(h)
        h = jnp.tanh(jax.vmap(model.layers[1])(h))
        return jnp.mean((jax.vmap(model.layers[2])(h) - Y) ** 2)

    np.testing.assert_allclose(inter["layers/0/__call__"]["cotangent"], jax.grad(rest)(h0),
                               rtol=1e-5, atol=1e-7)
    wrapped = sowtel.equinox.capture(model)
    assert wrapped.layers[0].weight.shape == (4, 3)  # attributes read through
    params, static = eqx.partition(model, eqx.is_array)
    with_capture = _program(lambda p, x: _eqx_loss(eqx.combine(p, static), x, Y), params, X)
    without = _program(lambda p, x: jnp.mean((jax.vmap(eqx.combine(p, static))(x) - Y) ** 2),
                       params, X)
    assert with_capture == without


def test_equinox_filter_jit_trains_as_eqx_filter_jit() -> None:
    tx = sowtel.optax.watch(optax.adam(1e-2), every=2)

    def step(model, state, x, y):  # type: ignore[no-untyped-def]
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    runs = []
    for jitter, session in ((eqx.filter_jit, False), (sowtel.equinox.filter_jit, True)):
        model = _eqx_model()
        state = tx.init(eqx.filter(model, eqx.is_array))
        compiled = jitter(step)
        memory = MemoryExporter()
        losses = []
        with sowtel.enable(exporter=memory) if session else _nothing():
            for _ in range(4):
                model, state, loss = compiled(model, state, X, Y)
                losses.append(float(loss))
            sowtel.flush()
        runs.append((losses, model, memory.records))
    (ref_losses, ref_model, _), (losses, model, records) = runs
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)),
                    jax.tree_util.tree_leaves(eqx.filter(ref_model, eqx.is_array)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    got = {(r.name, r.mode, r.step) for r in records}
    assert ("layers/2/__call__", "cotangent", 3) in got
    assert ("optim/grads/layers/0/weight", "primal", 2) in got
    assert not any(n.startswith("optim/") and s % 2 for n, _, s in got)
    with pytest.raises(ValueError, match="donate"):
        sowtel.equinox.filter_jit(step, donate="some")


class _EqxNormed(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key: jax.Array) -> None:
        self.lin = eqx.nn.Linear(3, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")

    def __call__(self, x, state):  # type: ignore[no-untyped-def]
        return self.bn(self.lin(x), state)


def test_equinox_capture_of_a_stateful_module_keeps_the_state_unbatched() -> None:
    # (y, state) from vmap(..., out_axes=(0, None)): the state is one value for the batch and
    # stays so under capture (it used to get a batch axis, and the call failed). A stateful
    # layer's site is its output without the state.
    model, state = eqx.nn.make_with_state(_EqxNormed)(jax.random.key(0))

    def forward(model, x, state, watched):  # type: ignore[no-untyped-def]
        call = sowtel.equinox.capture(model) if watched else model
        return jax.vmap(call, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(x, state)

    y_ref, state_ref = forward(model, X, state, False)
    (y, new_state), inter = sowtel.save_intermediates(forward)(model, X, state, True)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    np.testing.assert_allclose(inter["bn/__call__"]["primal"], y_ref, rtol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(new_state),
                         jax.tree_util.tree_leaves(state_ref), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    memory = MemoryExporter()
    with sowtel.enable(exporter=memory):
        _, streamed_state = eqx.filter_jit(forward)(model, X, state, True)
        sowtel.flush()
    shapes = {r.name: r.shape for r in memory.records}
    assert shapes["bn/__call__"] == (2, 4)
    for got, want in zip(jax.tree_util.tree_leaves(streamed_state),
                         jax.tree_util.tree_leaves(state_ref), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("module", [sowtel.flax, sowtel.nnx, sowtel.equinox])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_watch_models_example_trains_three_frameworks() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "watch_models.py"), "memory"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("linen", "nnx", "equinox"):
        assert f"{name}: final loss 0.0" in done.stdout, done.stdout
    assert "66 series" in done.stdout


@pytest.mark.parametrize("framework", ["nnx", "equinox"])
def test_framework_jit_repr_and_lowered_programs(framework: str) -> None:
    if framework == "nnx":
        model, wrap = NnxMLP(nnx.Rngs(0)), sowtel.nnx.jit

        def forward(m, x):  # type: ignore[no-untyped-def]
            return sowtel.sow(m(x), "y")
    else:
        model, wrap = _eqx_model(), sowtel.equinox.filter_jit

        def forward(m, x):  # type: ignore[no-untyped-def]
            return sowtel.sow(jax.vmap(m)(x), "y")

    f = wrap(forward)
    label = {"nnx": "sowtel.nnx.jit", "equinox": "sowtel.equinox.filter_jit"}[framework]
    assert repr(f) == f"{label}({forward.__qualname__!r})"
    plain = f.lower(model, X)
    with sowtel.enable(exporter="memory"):
        logging = f.lower_logging(model, X, step=0)
    # The logging program returns the step's summaries beside the plain program's outputs.
    n_plain = len(jax.tree_util.tree_leaves(plain.out_info))
    assert len(jax.tree_util.tree_leaves(logging.out_info)) > n_plain > 0
    # Bound as a method, the wrapper gets the instance as its first argument.
    holder = type("Holder", (), {"step": f})()
    assert isinstance(holder.step, functools.partial) and holder.step.args == (holder,)


# -- the whole calling convention of what each wrapper stands for ------------------------------


def _main(lowered: Any) -> str:
    """The signature line of a lowered program's entry function."""
    return next(line for line in lowered.as_text().splitlines() if "func.func public @main" in line)


def _donated(lowered: Any) -> list[str]:
    """The shapes of a lowered program's donated (output-aliased) parameters."""
    return re.findall(r"tensor<([0-9x]+)xf32> \{tf\.aliasing_output", _main(lowered))


class _Scaled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x, *, scale=1.0):  # type: ignore[no-untyped-def]
        return self.linear(x) * scale

    @sowtel.nnx.jit
    def jitted_method(self, x):  # type: ignore[no-untyped-def]
        return sowtel.sow(self(x), "method")


def _scaled_step(model, optimizer, x, y, how="mse", *, scale=1.0):  # type: ignore[no-untyped-def]
    def loss(model):  # type: ignore[no-untyped-def]
        with sowtel.nnx.capture(model):
            err = model(x, scale=scale) - y
        return jnp.mean(err ** 2) if how == "mse" else jnp.mean(jnp.abs(err))

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


@pytest.mark.parametrize("options, rest, call", [
    ({"static_argnames": ("how",)}, (Y,), {"how": "mae"}),
    ({"static_argnums": 4}, (Y, "mae"), {}),
    ({"donate_argnames": ("model", "optimizer")}, (), {"y": Y}),
    ({"donate_argnums": (0, 1), "keep_unused": True, "inline": False}, (Y,), {}),
    ({"graph": True}, (), {"y": Y, "scale": 2.0}),
])
def test_nnx_jit_takes_nnx_jit_options_and_keywords(options: dict, rest: tuple,
                                                    call: dict) -> None:
    runs = []
    for jitter, session in ((nnx.jit, False), (sowtel.nnx.jit, False), (sowtel.nnx.jit, True)):
        model = _Scaled(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, sowtel.optax.watch(optax.sgd(0.1)), wrt=nnx.Param)
        step = jitter(**options)(_scaled_step)  # the decorator form, with options
        memory = MemoryExporter()
        with sowtel.enable(exporter=memory) if session else _nothing():
            losses = [float(step(model, optimizer, X, *rest, **call)) for _ in range(3)]
            sowtel.flush()
        runs.append((losses, nnx.state(model, nnx.Param), memory.records))
    (want, params, _), *others = runs
    assert want[-1] < want[0]
    for losses, got, _ in others:
        assert losses == want
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params),
                        strict=True):
            np.testing.assert_array_equal(a, b)
    assert {(r.name, r.step) for r in runs[2][2]} >= {("linear/__call__", 2),
                                                      ("optim/grads/linear/kernel", 2)}


def test_nnx_jit_static_and_donated_arguments_behave_as_under_nnx_jit() -> None:
    model = _Scaled(nnx.Rngs(0))
    f = sowtel.nnx.jit(lambda m, x, n: m(x) * len(n), static_argnums=2)
    np.testing.assert_allclose(f(model, X, "abc"), model(X) * 3, rtol=1e-6)  # a str: static
    with pytest.raises(ValueError, match="[Nn]on-hashable"):
        f(model, X, ["a"])
    g = sowtel.nnx.jit(lambda m, x: x + m(x), donate_argnums=1)
    x = jnp.array(X)
    g(model, x)
    assert x.is_deleted() and not model.linear.kernel[...].is_deleted()
    h = sowtel.nnx.jit(lambda m, x: m(x), donate_argnames="m")
    h(model, X)
    np.testing.assert_allclose(h(model, X), model(X), rtol=1e-6)  # donated, then updated
    assert _Scaled(nnx.Rngs(0)).jitted_method(X).shape == (2, 1)  # the method form
    with pytest.raises(TypeError, match="out_shardings"):
        sowtel.nnx.jit(lambda m: m, out_shardings=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))
    with pytest.raises(TypeError, match="static_argnums"):
        sowtel.nnx.jit(lambda m: m, static_argnums="0")


def test_equinox_filter_jit_binds_arguments_as_eqx_filter_jit() -> None:
    # donate="all-except-first" keeps the first parameter's buffers, given by keyword too.
    f = sowtel.equinox.filter_jit(lambda model, x: jax.vmap(model)(x) + x,
                                  donate="all-except-first")
    model = _eqx_model()
    assert _donated(f.lower(model=model, x=X)) == ["2x3"]  # x, not the model's arrays
    assert _donated(f.lower(model, X)) == ["2x3"]
    np.testing.assert_array_equal(f(model=model, x=jnp.array(X)), jax.vmap(model)(X) + X)
    # A module as the function: its arrays are arguments (traced), as under eqx.filter_jit.
    jitted = sowtel.equinox.filter_jit(model)
    np.testing.assert_array_equal(jitted(X[0]), eqx.filter_jit(model)(X[0]))
    main = _main(jitted.lower(X[0]))
    assert ": tensor<4x3xf32>" in main  # the first layer's weight is a parameter


def test_equinox_capture_keeps_stateful_layers_stateful() -> None:
    # eqx.nn.Sequential hands the state only to layers that are StatefulLayers (isinstance).
    net, state = eqx.nn.make_with_state(eqx.nn.Sequential)([
        eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.BatchNorm(4, "b"),
        eqx.nn.Lambda(jnp.tanh)])

    def loss(net, state, x, capture=True):  # type: ignore[no-untyped-def]
        net = sowtel.equinox.capture(net) if capture else net
        y, state = jax.vmap(net, in_axes=(0, None), out_axes=(0, None), axis_name="b")(x, state)
        return jnp.sum(y ** 2), state

    (value, new_state), inter = sowtel.save_intermediates(loss)(net, state, X)
    want, want_state = loss(net, state, X, capture=False)
    np.testing.assert_array_equal(value, want)
    for a, b in zip(jax.tree_util.tree_leaves(new_state), jax.tree_util.tree_leaves(want_state),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # A stateful layer's site is its output, without the state it threads on.
    assert set(inter) == {"layers/0/__call__", "layers/1/__call__", "layers/2/__call__",
                          "__call__"}
    normed = np.asarray(inter["layers/1/__call__"]["primal"])
    assert normed.shape == (2, 4)
    np.testing.assert_allclose(normed.mean(0), 0, atol=1e-5)  # normalised over the batch
    np.testing.assert_allclose(inter["__call__"]["primal"], np.tanh(normed), rtol=1e-6)
