"""Small models in the shape of well-known JAX training code, trained a few steps four ways.

Each model is written here after a familiar pattern (a nanoGPT-like transformer in Flax Linen, an
lm1b-like model sharded over 8 host devices, Flax NNX MNIST-style networks and scan over layers,
``nn.scan(nn.remat(...))`` around a flash-attention-style ``custom_vjp``, an Equinox GRU
classifier, a ``shard_map`` data-parallel MLP) on synthetic data, with sows at its interesting
points. The promise checked: training through ``sowtel.jit``, through the callback transport
(``jax.jit`` with a session on) and through ``save_intermediates`` gives the losses training
without sowtel gives, and the sown values and their derivatives are right (spot-checked against
the model run with an explicit perturbation at the site instead of the sow).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sowtel
import sowtel.flax
from sowtel import save_intermediates, sow

JAX_NEW = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
STEPS = 3
WAYS = ("sowtel.jit", "callback", "capture")


def site(x: Any, name: str, eps: Any) -> Any:
    """A sow, or (``eps`` a dict) the explicit perturbation the derivative checks compare with
    (sites it does not name are left as they are)."""
    if eps is None:
        return sow(x, name)
    return x + eps[name] if name in eps else x


def sgd(params: Any, grads: Any, lr: float = 0.1) -> Any:
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def train(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batches: list[Any],
          way: str) -> tuple[list[np.ndarray], list[Any]]:
    """The losses of ``step`` (``(state, batch) -> (state, loss)``) over ``batches``, run
    ``way``, and the records streamed."""
    if way == "sowtel.jit":
        fn = sowtel.jit(step)
    elif way == "capture":
        captured = jax.jit(save_intermediates(step))

        def fn(s: Any, b: Any) -> Any:
            return captured(s, b)[0]
    else:
        fn = jax.jit(step)
    streaming = way in ("sowtel.jit", "callback")
    ctx: Any = contextlib.nullcontext()
    if streaming:
        ctx = sowtel.enable(exporter="memory", summary="stats")
    losses, records = [], []
    with ctx as session:
        for b in batches:
            state, loss = fn(state, b)
            losses.append(np.asarray(loss))
        if streaming:
            assert sowtel.flush(timeout=60)
            status = sowtel.status()
            assert status["dropped"] == 0 and not any(status["errors"].values()), status
            records = list(session.exporters[0].records)
    return losses, records


def check_training(step: Callable[[Any, Any], tuple[Any, Any]], state: Any,
                   batches: list[Any], sites: set[str]) -> None:
    """Each way trains to the losses of plain ``jax.jit``, and streams every one of ``sites``."""
    want, _ = train(step, state, batches, "plain")
    assert np.all(np.isfinite(want)) and want[-1] < want[0], want  # it learns (the batch repeats)
    for way in WAYS:
        got, records = train(step, state, batches, way)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=way)
        if way != "capture":
            names = {r.name for r in records}
            assert sites <= names, (way, sorted(names))
            assert {r.mode for r in records} >= {"primal", "cotangent"}, way
            assert {r.step for r in records if r.name in sites} == set(range(STEPS)), way


def check_site_cotangent(loss: Callable[[Any, Any], Any], args: tuple, name: str,
                         shape: tuple[int, ...], captured_axes: tuple[int, ...] | None = None
                         ) -> None:
    """The captured primal and cotangent of ``name`` against the model run with a zero
    perturbation at the site: its value, and ``jax.grad`` with respect to the perturbation.
    ``loss(*args, eps)`` with ``eps=None`` sows; ``eps`` a dict perturbs. ``captured_axes``:
    where the perturbation's axes are in the captured layout (a transpose), if not in order."""
    _, inter = jax.jit(save_intermediates(jax.grad(lambda *a: loss(*a, None))))(*args)
    zero = {name: jnp.zeros(shape, jnp.float32)}
    expected = jax.jit(jax.grad(lambda e: loss(*args, e)))(zero)[name]
    if captured_axes is not None:
        expected, shape = np.transpose(expected, captured_axes), expected.shape
        shape = tuple(shape[i] for i in captured_axes)
    np.testing.assert_allclose(inter[name]["cotangent"], expected, rtol=2e-4, atol=1e-6)
    assert inter[name]["primal"].shape == shape


# -- nanoGPT-like, Flax Linen -----------------------------------------------------------------

VOCAB, CTX, WIDTH, HEADS = 13, 8, 16, 2


class CausalSelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        b, t, c = x.shape
        q, k, v = jnp.split(nn.Dense(3 * c, name="c_attn")(x), 3, axis=-1)
        heads = lambda a: a.reshape(b, t, HEADS, c // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = heads(q), heads(k), heads(v)
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(c // HEADS)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        att = sowtel.flax.sow(self, jax.nn.softmax(att, axis=-1), "att")
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
        return nn.Dense(c, name="c_proj")(y)


class GPTBlock(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = x + CausalSelfAttention(name="attn")(nn.LayerNorm(name="ln_1")(x))
        h = nn.gelu(nn.Dense(4 * WIDTH, name="c_fc")(nn.LayerNorm(name="ln_2")(x)))
        h = sowtel.flax.sow(self, h, "mlp_act")
        return x + nn.Dense(WIDTH, name="c_proj")(h)


class GPT(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, idx: Any, eps: Any = None) -> Any:
        wte = nn.Embed(VOCAB, WIDTH, name="wte")
        x = wte(idx) + self.param("wpe", nn.initializers.normal(0.02), (CTX, WIDTH))
        for i in range(self.layers):
            x = GPTBlock(name=f"h_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        x = sowtel.flax.sow(self, x, "final") if eps is None else x + eps["final"]
        return wte.attend(x)  # tied weights, as nanoGPT


def lm_batches(n: int, batch: int = 2) -> list[tuple[Any, Any]]:
    """One batch of token sequences, ``n`` times (so a few steps visibly lower the loss)."""
    seq = np.random.default_rng(0).integers(0, VOCAB, (batch, CTX + 1))
    return [(jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:]))] * n


def cross_entropy(logits: Any, targets: Any) -> Any:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def test_nanogpt_linen_trains_the_same_and_sows_right() -> None:
    model = GPT()
    batches = lm_batches(STEPS)
    params = model.init(jax.random.key(0), batches[0][0])

    def step(params: Any, batch: Any) -> Any:
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
        return sgd(params, grads, 0.5), loss

    check_training(step, params, batches, {"h_0/attn/att", "h_1/mlp_act", "final"})

    # The final LayerNorm's output: its cotangent against a perturbation there.
    x, y = batches[0]

    def loss(params: Any, eps: Any) -> Any:
        return cross_entropy(model.apply(params, x, eps), y)

    check_site_cotangent(loss, (params,), "final", (2, CTX, WIDTH))


# -- lm1b-like, sharded over 8 host devices -----------------------------------------------------


def shard_as(x: Any, spec: Any) -> Any:
    """Lays ``x`` out as ``spec``: a constraint on an automatic mesh, a reshard on an explicit
    one (where ``with_sharding_constraint`` only asserts)."""
    axis_types = getattr(jax.sharding.get_abstract_mesh(), "axis_types", ())
    if axis_types and all(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


class ShardedLM(nn.Module):
    @nn.compact
    def __call__(self, idx: Any, eps: Any = None) -> Any:
        # One-hot times the table: a gather from a replicated table with batch-sharded indices
        # has no single output sharding on an explicit-axes mesh, a matmul has.
        table = self.param("embed", nn.initializers.normal(1.0), (VOCAB, WIDTH))
        x = jax.nn.one_hot(idx, VOCAB, dtype=table.dtype) @ table
        x = shard_as(x, P("data", None, "model"))
        h = nn.relu(nn.Dense(2 * WIDTH, name="mlp_in")(nn.LayerNorm()(x)))
        h = shard_as(h, P("data", None, "model"))
        h = site(h, "mlp_act", eps)  # [B@data, T, H@model]
        x = x + nn.Dense(WIDTH, name="mlp_out")(h)
        return nn.Dense(VOCAB, name="logits")(x)


def sharded_lm_setup(axis_type: Any) -> tuple[Any, Any, Any, list[Any]]:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    model = ShardedLM()
    data = NamedSharding(mesh, P("data"))
    batches = [jax.device_put(b, data) for b in lm_batches(STEPS, batch=4)]
    with jax.set_mesh(mesh):
        params = model.init(jax.random.key(1), batches[0][0])
    return mesh, model, params, batches


def lm1b_case(axis_type: Any) -> None:
    mesh, model, params, batches = sharded_lm_setup(axis_type)

    def step(params: Any, batch: Any) -> Any:
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
        return sgd(params, grads, 0.5), loss

    with jax.set_mesh(mesh):
        check_training(step, params, batches, {"mlp_act"})
        x, y = batches[0]
        check_site_cotangent(lambda p, e: cross_entropy(model.apply(p, x, e), y), (params,),
                             "mlp_act", (4, CTX, 2 * WIDTH))


def test_lm1b_sharded_auto_mesh_trains_the_same() -> None:
    lm1b_case(jax.sharding.AxisType.Auto)


def test_lm1b_sharded_explicit_mesh_trains_the_same() -> None:
    lm1b_case(jax.sharding.AxisType.Explicit)


# -- Flax NNX: an MNIST-style CNN and scan over layers ------------------------------------------


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(8 * 2 * 2, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x: Any, eps: Any = None) -> Any:
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.conv1(x)))
        x = site(pool(nnx.relu(self.conv2(x))), "conv2", eps)
        x = x.reshape(x.shape[0], -1)
        x = site(nnx.relu(self.linear1(x)), "hidden", eps)
        return self.linear2(x)


def mnist_batches(n: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(2)
    return [(jnp.asarray(rng.normal(size=(4, 8, 8, 1)), jnp.float32),
             jnp.asarray(rng.integers(0, 10, 4)))] * n


def classifier_step(forward: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A train step of ``forward(state, x, eps) -> logits``; the NNX models use their functional
    form (split once, merge inside), so the state is the pytree that crosses the jit."""

    def loss_fn(state: Any, batch: Any, eps: Any = None) -> Any:
        x, y = batch
        return cross_entropy(forward(state, x, eps), y)

    def step(state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(state, batch)
        return sgd(state, grads, 0.2), loss

    step.loss_fn = loss_fn  # type: ignore[attr-defined]
    return step


def test_nnx_mnist_cnn_trains_the_same_and_sows_right() -> None:
    graphdef, state = nnx.split(CNN(nnx.Rngs(0)))
    step = classifier_step(lambda s, x, e: nnx.merge(graphdef, s)(x, e))
    batches = mnist_batches(STEPS)
    check_training(step, state, batches, {"conv2", "hidden"})
    check_site_cotangent(lambda s, e: step.loss_fn(s, batches[0], e), (state,), "hidden", (4, 16))


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return x + jnp.tanh(self.linear(x))


def scanned_layers(layers: int) -> tuple[Callable[[Any, Any, Any], Any], Any]:
    """Layers created under vmap (stacked parameters) and applied by a scan over layers; returns
    the forward function and its state."""
    layer_def, _ = nnx.split(Layer(nnx.Rngs(0)))
    keys = jax.random.split(jax.random.key(3), layers)
    stacked = jax.vmap(lambda k: nnx.split(Layer(nnx.Rngs(params=k)))[1])(keys)
    head_def, head = nnx.split(nnx.Linear(WIDTH, 10, rngs=nnx.Rngs(5)))

    def forward(state: Any, x: Any, eps: Any) -> Any:
        stacked, head = state

        def body(h: Any, layer: Any) -> Any:
            params, e = layer
            h = nnx.merge(layer_def, params)(h)
            return (sow(h, "layer_out") if e is None else h + e), None

        h, _ = jax.lax.scan(body, x, (stacked, None if eps is None else eps["layer_out"]))
        return nnx.merge(head_def, head)(h)

    return forward, (stacked, head)


def test_nnx_scan_over_layers_trains_the_same_and_sows_right() -> None:
    forward, state = scanned_layers(3)
    step = classifier_step(forward)
    rng = np.random.default_rng(4)
    batches = [(jnp.asarray(rng.normal(size=(4, WIDTH)), jnp.float32),
                jnp.asarray(rng.integers(0, 10, 4)))] * STEPS
    check_training(step, state, batches, {"layer_out"})
    check_site_cotangent(lambda s, e: step.loss_fn(s, batches[0], e), (state,), "layer_out",
                         (3, 4, WIDTH))
    # One record per layer (the scan index), each step.
    _, records = train(step, state, batches, "sowtel.jit")
    primal = [r for r in records if r.mode == "primal" and r.step == 0]
    assert sorted(r.index for r in primal) == [0, 1, 2]


# -- nn.scan(nn.remat(...)) around a flash-attention-style custom_vjp -------------------------


@jax.custom_vjp
def attention(q: Any, k: Any, v: Any) -> Any:
    """Softmax attention with a hand-written backward, as flash-attention kernels have."""
    return _attention_fwd(q, k, v)[0]


def _attention_fwd(q: Any, k: Any, v: Any) -> Any:
    s = q @ k.T / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, axis=-1)
    return p @ v, (q, k, v, p)


@jax.jit
def _attention_bwd(res: Any, dout: Any) -> Any:
    q, k, v, p = res
    dv = p.T @ dout
    dp = dout @ v.T
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    ds = sow(ds, "attn_dscores")  # a sow in the jitted backward: a cotangent
    scale = 1.0 / np.sqrt(q.shape[-1])
    return ds @ k * scale, ds.T @ q * scale, dv


attention.defvjp(_attention_fwd, _attention_bwd)


class FlashBlock(nn.Module):
    @nn.compact
    def __call__(self, x: Any, _: Any) -> Any:
        q, k, v = (nn.Dense(WIDTH, name=n)(x) for n in ("q", "k", "v"))
        x = x + sowtel.flax.sow(self, attention(q, k, v), "attn_out")
        return x + nn.Dense(WIDTH, name="mlp")(jnp.tanh(x)), None


class FlashStack(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        stack = nn.scan(nn.remat(FlashBlock), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(10, name="head")(x)


def flash_step(model: Any) -> Callable[[Any, Any], Any]:
    def step(params: Any, batch: Any) -> Any:
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, x), y))(params)
        return sgd(params, grads, 0.2), loss

    return step


def flash_setup() -> tuple[Any, Any, list[Any]]:
    rng = np.random.default_rng(5)
    batch = (jnp.asarray(rng.normal(size=(CTX, WIDTH)), jnp.float32),
             jnp.asarray(rng.integers(0, 10, CTX)))
    model = FlashStack()
    return model, model.init(jax.random.key(6), batch[0]), [batch] * STEPS


def test_scan_remat_flash_attention_trains_the_same() -> None:
    model, params, batches = flash_setup()
    check_training(flash_step(model), params, batches, {"layers/attn_out"})


def test_flash_attention_custom_vjp_matches_autodiff() -> None:
    # The hand-written backward is right: grads equal those of the same attention by autodiff.
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(CTX, WIDTH)), jnp.float32) for _ in range(3))
    f = lambda a: lambda *qkv: jnp.sum(jnp.sin(a(*qkv)))  # noqa: E731
    np.testing.assert_allclose(
        jax.grad(f(attention), argnums=(0, 1, 2))(q, k, v),
        jax.grad(f(lambda *a: _attention_fwd(*a)[0]), argnums=(0, 1, 2))(q, k, v), rtol=1e-4,
        atol=1e-6)


def test_flash_attention_backward_sow_is_a_cotangent() -> None:
    model, params, batches = flash_setup()
    _, inter = jax.jit(save_intermediates(flash_step(model)))(params, batches[0])
    assert set(inter["attn_dscores"]) == {"cotangent"}
    # Streamed, one record per layer (the scan index) and step.
    _, records = train(flash_step(model), params, batches, "callback")
    got = sorted((r.step, r.index) for r in records if r.name == "attn_dscores")
    assert got == [(s, i) for s in range(STEPS) for i in range(3)]


# -- Equinox: a GRU classifier, like its train_rnn example --------------------------------------


class RNN(eqx.Module):
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, key: Any) -> None:
        ckey, lkey = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(2, 8, key=ckey)
        self.linear = eqx.nn.Linear(8, 1, use_bias=False, key=lkey)
        self.bias = jnp.zeros(1)

    def __call__(self, xs: Any, eps: Any = None) -> Any:
        def body(h: Any, inp: Any) -> Any:
            x, e = inp
            h = self.cell(x, h)
            return site(h, "hidden", None if e is None else {"hidden": e}), None

        e = None if eps is None else eps["hidden"]
        h, _ = jax.lax.scan(body, jnp.zeros(8), (xs, e))
        return jax.nn.sigmoid(self.linear(h) + self.bias)


def spirals(n: int, length: int) -> tuple[Any, Any]:
    """Clockwise and anticlockwise arcs, labelled by direction (the train_rnn task)."""
    rng = np.random.default_rng(8)
    t = np.linspace(0, 2 * np.pi, length)
    start = rng.uniform(0, 2 * np.pi, (n, 1))
    y = rng.integers(0, 2, n)
    direction = np.where(y == 1, 1.0, -1.0)[:, None]
    xs = np.stack([np.cos(start + direction * t), np.sin(start + direction * t)], axis=-1)
    return jnp.asarray(xs + 0.1 * rng.normal(size=xs.shape), jnp.float32), jnp.asarray(y)


def rnn_loss(params: Any, static: Any, batch: Any, eps: Any = None) -> Any:
    model = eqx.combine(params, static)
    xs, y = batch
    if eps is None:
        pred = jax.vmap(model)(xs)[:, 0]
    else:
        pred = jax.vmap(model)(xs, eps)[:, 0]
    return -jnp.mean(y * jnp.log(pred) + (1 - y) * jnp.log(1 - pred))


def test_equinox_rnn_trains_the_same_and_sows_right() -> None:
    params, static = eqx.partition(RNN(jax.random.key(9)), eqx.is_array)
    batch = spirals(4, 6)

    def step(params: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(rnn_loss)(params, static, batch)
        return sgd(params, grads, 0.5), loss

    check_training(step, params, [batch] * STEPS, {"hidden"})

    def one_sequence(params: Any, eps: Any) -> Any:
        return -jnp.log(eqx.combine(params, static)(batch[0][1], eps)[0])

    check_site_cotangent(one_sequence, (params,), "hidden", (6, 8))


def test_equinox_rnn_batched_capture_stacks_time_then_batch() -> None:
    # vmap of a scan: the scan's axis first, then the batch (the documented layout: the same
    # as a scan of a vmap, and as streaming sends it, one record per step holding the batch).
    params, static = eqx.partition(RNN(jax.random.key(9)), eqx.is_array)
    batch = spirals(4, 6)
    check_site_cotangent(lambda p, e: rnn_loss(p, static, batch, e), (params,), "hidden",
                         (4, 6, 8), captured_axes=(1, 0, 2))


# -- shard_map, as in JAX's tutorial: data-parallel MLP with collectives ------------------------


def test_shard_map_data_parallel_mlp_trains_the_same_and_sows_right() -> None:
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(10)
    params = {"w1": jnp.asarray(rng.normal(size=(4, 8)) * 0.5, jnp.float32), "b1": jnp.zeros(8),
              "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.5, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    batch = jax.device_put((x, y), NamedSharding(mesh, P("batch")))

    def local_loss(params: Any, x: Any, y: Any, eps: Any) -> Any:
        h = site(jnp.tanh(x @ params["w1"] + params["b1"]), "hidden", eps)
        return jax.lax.pmean(jnp.mean((h @ params["w2"] - y) ** 2), "batch")

    def loss(params: Any, batch: Any, eps: Any = None) -> Any:
        spec = (P(), P("batch"), P("batch"), None if eps is None else {"hidden": P("batch")})
        return jax.shard_map(local_loss, mesh=mesh, in_specs=spec, out_specs=P())(
            params, *batch, eps)

    def step(params: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, batch)
        return sgd(params, grads, 0.3), value

    check_training(step, params, [batch] * STEPS, {"hidden"})
    # Per shard: [shard, rows per shard, hidden] captured; the perturbation is global rows.
    _, inter = jax.jit(save_intermediates(jax.grad(loss)))(params, batch)
    expected = jax.grad(lambda e: loss(params, batch, {"hidden": e}))(jnp.zeros((16, 8)))
    np.testing.assert_allclose(inter["hidden"]["cotangent"], np.reshape(expected, (8, 2, 8)),
                               rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(inter["hidden"]["primal"].reshape(16, 8),
                               np.tanh(x @ params["w1"] + params["b1"]), rtol=1e-5, atol=1e-6)
