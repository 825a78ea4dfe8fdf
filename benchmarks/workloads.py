"""The reference workloads every benchmark measures, written once and instrumented many ways.

A workload is a model whose forward pass calls ``tap(x, name)`` at each site it would sow. The
same model code then becomes each variant the benchmarks compare, only the tap changes:

=====================  ======================================================================
tap                    what a site does
=====================  ======================================================================
:func:`no_tap`         nothing: the uninstrumented program
``sowtel.sow``         sowtel (streams or not, depending on what is enabled at lowering time)
:func:`debug_tap`      the naive way: ``jax.debug.callback`` of the full array, forward (primal)
                       and backward (cotangent, through a ``custom_vjp``)
``returning``          the values as extra outputs, written by hand: primals as auxiliary
                       outputs, cotangents as the gradient of a zero perturbation at each site
=====================  ======================================================================

The two reference workloads (DESIGN §8):

- :func:`mlp`: 3 dense layers of 512 (tanh), batch 256, ``value_and_grad`` + SGD, 6 sites;
- :func:`transformer_block`: one pre-norm transformer block, d_model 256, 4 heads, sequence
  128, batch 16, ``value_and_grad`` + Adam (optax), 8 sites.

Example:
    >>> import jax, sowtel
    >>> from benchmarks.workloads import mlp, make_train_step
    >>> work = mlp(batch=4, width=8)
    >>> step = jax.jit(make_train_step(work, sowtel.sow))
    >>> params, opt_state, loss = step(*work.init(), jax.numpy.int32(0))
    >>> work.sites
    ('dense0/pre', 'dense0/act', 'dense1/pre', 'dense1/act', 'dense2/pre', 'dense2/act')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sowtel

__all__ = [
    "Tap", "Workload", "mlp", "transformer_block", "no_tap", "debug_tap", "make_train_step",
    "make_returning_train_step", "make_returning_value_and_grad", "site_shapes",
    "reference_workloads", "gpt", "gpt_reduced",
]

#: ``tap(x, name) -> x``: what a model does at each site.
Tap = Callable[[jax.Array, str], jax.Array]
#: ``loss(params, batch, tap) -> scalar``.
Loss = Callable[[Any, Any, Tap], jax.Array]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its data and its optimizer: everything a training step needs but the tap.

    Attributes:
      name: short label used in tables (``"mlp"``, ``"transformer"``).
      description: one line for the tables.
      sites: the tap names, in forward order.
      loss: ``loss(params, batch, tap) -> scalar``.
      optimizer: the optax transformation of the training step.
      params: initial parameters.
      batch: one fixed batch (inputs, targets).
    """

    name: str
    description: str
    sites: tuple[str, ...]
    loss: Loss
    optimizer: optax.GradientTransformation
    params: Any
    batch: Any

    def init(self) -> tuple[Any, Any, Any]:
        """``(params, opt_state, batch)``, fresh device arrays for one training run."""
        params = jax.tree_util.tree_map(jnp.array, self.params)
        return params, self.optimizer.init(params), self.batch


def activate_session(session: sowtel.Session | None) -> None:
    """Makes ``session`` (or none) the one records go to, keeping the other sessions open: the
    benchmarks run variants with sessions of their own side by side in one process."""
    from sowtel import session as session_module

    with session_module._lock:
        if session is not None and session in session_module._stack:
            session_module._stack.remove(session)
            session_module._stack.append(session)
        session_module._activate(session)


def no_tap(x: jax.Array, name: str) -> jax.Array:
    """The uninstrumented site: returns ``x``."""
    return x


def debug_tap(sink: Callable[[str, str, np.ndarray], None]) -> Tap:
    """The naive instrumentation: ``jax.debug.callback`` of every full array, both directions.

    ``sink(name, mode, array)`` runs on the host for the primal in the forward pass and for the
    cotangent in the backward pass (a ``custom_vjp`` identity carries the second callback).
    """

    def tap(x: jax.Array, name: str) -> jax.Array:
        @jax.custom_vjp
        def logged(v: jax.Array) -> jax.Array:
            jax.debug.callback(lambda a: sink(name, "primal", a), v)
            return v

        def fwd(v: jax.Array) -> tuple[jax.Array, None]:
            return logged(v), None

        def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
            jax.debug.callback(lambda a: sink(name, "cotangent", a), ct)
            return (ct,)

        logged.defvjp(fwd, bwd)
        return logged(x)

    return tap


def site_shapes(work: Workload) -> dict[str, jax.ShapeDtypeStruct]:
    """The shape and dtype of every site's value, found by tracing the loss once."""
    found: dict[str, jax.ShapeDtypeStruct] = {}

    def recording_tap(x: jax.Array, name: str) -> jax.Array:
        found[name] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    jax.eval_shape(lambda p, b: work.loss(p, b, recording_tap), work.params, work.batch)
    return found


def _loss_with_perturbations(work: Workload) -> Callable[..., tuple[jax.Array, dict[str, Any]]]:
    """``loss(params, eps, batch) -> (loss, primals)`` with ``x + eps[name]`` at each site.

    The gradient with respect to ``eps`` (all zeros) is each site's cotangent: the hand-written
    equivalent of what sowtel captures.
    """

    def loss(params: Any, eps: dict[str, jax.Array], batch: Any) -> tuple[jax.Array, Any]:
        primals: dict[str, jax.Array] = {}

        def returning_tap(x: jax.Array, name: str) -> jax.Array:
            primals[name] = x
            return x + eps[name]

        return work.loss(params, batch, returning_tap), primals

    return loss


def make_returning_value_and_grad(work: Workload) -> Callable[..., Any]:
    """``f(params, batch) -> ((loss, grads), {name: {"primal", "cotangent"}})``, by hand.

    What ``sowtel.save_intermediates(jax.value_and_grad(loss))`` returns, written without
    sowtel: primals as auxiliary outputs, cotangents as gradients of zero perturbations.
    """
    shapes = site_shapes(work)
    perturbed = _loss_with_perturbations(work)

    def value_and_grad(params: Any, batch: Any) -> Any:
        eps = {n: jnp.zeros(s.shape, s.dtype) for n, s in shapes.items()}
        (loss, primals), (grads, cts) = jax.value_and_grad(perturbed, argnums=(0, 1),
                                                           has_aux=True)(params, eps, batch)
        inter = {n: {"primal": primals[n], "cotangent": cts[n]} for n in primals}
        return (loss, grads), inter

    return value_and_grad


def make_train_step(work: Workload, tap: Tap, *, at_step: bool = False) -> Callable[..., Any]:
    """``train_step(params, opt_state, batch, step) -> (params, opt_state, loss)``.

    With ``at_step``, the forward and backward passes run inside ``sowtel.at_step(step)``, so
    streamed records carry the step and ``every=N`` is decided on the device.
    """

    def train_step(params: Any, opt_state: Any, batch: Any, step: jax.Array) -> Any:
        with sowtel.at_step(step) if at_step else nullcontext():
            loss, grads = jax.value_and_grad(lambda p: work.loss(p, batch, tap))(params)
        updates, opt_state = work.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_returning_train_step(work: Workload) -> Callable[..., Any]:
    """Like :func:`make_train_step`, also returning every site's primal and cotangent."""
    value_and_grad = make_returning_value_and_grad(work)

    def train_step(params: Any, opt_state: Any, batch: Any, step: jax.Array) -> Any:
        (loss, grads), inter = value_and_grad(params, batch)
        updates, opt_state = work.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, inter

    return train_step


# ---------------------------------------------------------------------------------------------
# The models.


def _dense_init(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
    w = jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)
    return {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}


def mlp(*, batch: int = 256, width: int = 512, layers: int = 3, seed: int = 0) -> Workload:
    """The small-MLP reference workload: ``layers`` dense tanh layers, MSE, SGD.

    Sites ``dense{i}/pre`` (before the activation) and ``dense{i}/act`` (after it): 6 by default.
    """
    keys = jax.random.split(jax.random.key(seed), layers + 2)
    params = [_dense_init(keys[i], width, width) for i in range(layers)]
    x = jax.random.normal(keys[-2], (batch, width), jnp.float32)
    y = jax.random.normal(keys[-1], (batch, width), jnp.float32)

    def loss(params: Any, batch: Any, tap: Tap) -> jax.Array:
        h, target = batch
        for i, layer in enumerate(params):
            h = tap(h @ layer["w"] + layer["b"], f"dense{i}/pre")
            h = tap(jnp.tanh(h), f"dense{i}/act")
        return jnp.mean((h - target) ** 2)

    sites = tuple(f"dense{i}/{k}" for i in range(layers) for k in ("pre", "act"))
    return Workload(
        name="mlp",
        description=f"MLP {layers}x{width}, batch {batch}, value_and_grad + SGD, "
                    f"{len(sites)} sites",
        sites=sites, loss=loss, optimizer=optax.sgd(1e-3), params=params, batch=(x, y),
    )


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def transformer_block(*, d_model: int = 256, heads: int = 4, seq: int = 128, batch: int = 16,
                      mlp_ratio: int = 4, seed: int = 0) -> Workload:
    """The transformer-block reference workload: pre-norm causal self-attention and MLP, Adam.

    Sites (8): ``block/ln1``, ``block/attn/probs`` (the attention weights, batch x heads x seq x
    seq), ``block/attn/out``, ``block/resid1``, ``block/ln2``, ``block/mlp/hidden``,
    ``block/mlp/out``, ``block/out``.
    """
    if d_model % heads:
        raise ValueError(f"d_model={d_model} must be divisible by heads={heads}")
    k = jax.random.split(jax.random.key(seed), 6)
    ones, zeros = jnp.ones((d_model,), jnp.float32), jnp.zeros((d_model,), jnp.float32)
    params = {
        "ln1": {"scale": ones, "bias": zeros},
        "qkv": _dense_init(k[0], d_model, 3 * d_model),
        "proj": _dense_init(k[1], d_model, d_model),
        "ln2": {"scale": ones, "bias": zeros},
        "up": _dense_init(k[2], d_model, mlp_ratio * d_model),
        "down": _dense_init(k[3], mlp_ratio * d_model, d_model),
    }
    x = jax.random.normal(k[4], (batch, seq, d_model), jnp.float32)
    y = jax.random.normal(k[5], (batch, seq, d_model), jnp.float32)
    head_dim = d_model // heads
    causal = jnp.tril(jnp.ones((seq, seq), bool))

    def loss(params: Any, batch: Any, tap: Tap) -> jax.Array:
        x, target = batch
        b, s, _ = x.shape
        h = tap(_layer_norm(x, params["ln1"]), "block/ln1")
        qkv = h @ params["qkv"]["w"] + params["qkv"]["b"]
        q, k_, v = jnp.split(qkv.reshape(b, s, 3 * heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_) / math.sqrt(head_dim)
        scores = jnp.where(causal, scores, -1e9)
        probs = tap(jax.nn.softmax(scores, axis=-1), "block/attn/probs")
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d_model)
        attn = tap(attn @ params["proj"]["w"] + params["proj"]["b"], "block/attn/out")
        r1 = tap(x + attn, "block/resid1")
        h2 = tap(_layer_norm(r1, params["ln2"]), "block/ln2")
        m = tap(jax.nn.gelu(h2 @ params["up"]["w"] + params["up"]["b"]), "block/mlp/hidden")
        m = tap(m @ params["down"]["w"] + params["down"]["b"], "block/mlp/out")
        out = tap(r1 + m, "block/out")
        return jnp.mean((out - target) ** 2)

    sites = ("block/ln1", "block/attn/probs", "block/attn/out", "block/resid1", "block/ln2",
             "block/mlp/hidden", "block/mlp/out", "block/out")
    return Workload(
        name="transformer",
        description=f"transformer block d={d_model}, {heads} heads, seq {seq}, batch {batch}, "
                    f"value_and_grad + Adam, {len(sites)} sites",
        sites=sites, loss=loss, optimizer=optax.adam(1e-4), params=params, batch=(x, y),
    )


def gpt(*, layers: int = 12, d_model: int = 768, heads: int = 12, seq: int = 512,
        batch: int = 16, vocab: int = 8192, mlp_ratio: int = 4, seed: int = 0) -> Workload:
    """A GPT-style decoder: token and position embeddings, ``layers`` pre-norm causal blocks,
    tied output projection, next-token cross-entropy, Adam.

    Two sites a layer: ``layer{i}/attn/out`` (the attention output) and ``layer{i}/mlp/hidden``
    (the MLP hidden activation). The defaults are the full size (a GPU workload); on CPU run it
    smaller (see :func:`gpt_reduced`).
    """
    if d_model % heads:
        raise ValueError(f"d_model={d_model} must be divisible by heads={heads}")
    keys = iter(jax.random.split(jax.random.key(seed), 4 * layers + 4))
    ones, zeros = jnp.ones((d_model,), jnp.float32), jnp.zeros((d_model,), jnp.float32)
    blocks = [{
        "ln1": {"scale": ones, "bias": zeros},
        "qkv": _dense_init(next(keys), d_model, 3 * d_model),
        "proj": _dense_init(next(keys), d_model, d_model),
        "ln2": {"scale": ones, "bias": zeros},
        "up": _dense_init(next(keys), d_model, mlp_ratio * d_model),
        "down": _dense_init(next(keys), mlp_ratio * d_model, d_model),
    } for _ in range(layers)]
    params = {
        "embed": jax.random.normal(next(keys), (vocab, d_model), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (seq, d_model), jnp.float32) * 0.02,
        "blocks": blocks,
        "ln_f": {"scale": ones, "bias": zeros},
    }
    tokens = jax.random.randint(next(keys), (batch, seq + 1), 0, vocab)
    head_dim = d_model // heads
    causal = jnp.tril(jnp.ones((seq, seq), bool))

    def loss(params: Any, batch: Any, tap: Tap) -> jax.Array:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        b, s = inputs.shape
        x = params["embed"][inputs] + params["pos"][:s]
        for i, p in enumerate(params["blocks"]):
            h = _layer_norm(x, p["ln1"])
            qkv = h @ p["qkv"]["w"] + p["qkv"]["b"]
            q, k_, v = jnp.split(qkv.reshape(b, s, 3 * heads, head_dim), 3, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k_) / math.sqrt(head_dim)
            probs = jax.nn.softmax(jnp.where(causal[:s, :s], scores, -1e9), axis=-1)
            attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d_model)
            x = x + tap(attn @ p["proj"]["w"] + p["proj"]["b"], f"layer{i}/attn/out")
            h2 = _layer_norm(x, p["ln2"])
            m = tap(jax.nn.gelu(h2 @ p["up"]["w"] + p["up"]["b"]), f"layer{i}/mlp/hidden")
            x = x + m @ p["down"]["w"] + p["down"]["b"]
        logits = _layer_norm(x, params["ln_f"]) @ params["embed"].T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    sites = tuple(f"layer{i}/{k}" for i in range(layers) for k in ("attn/out", "mlp/hidden"))
    return Workload(
        name="gpt",
        description=f"GPT decoder {layers} layers, d={d_model}, {heads} heads, seq {seq}, "
                    f"batch {batch}, vocab {vocab}, value_and_grad + Adam, {len(sites)} sites",
        sites=sites, loss=loss, optimizer=optax.adam(1e-4), params=params, batch=tokens,
    )


def gpt_reduced() -> Workload:
    """The GPT workload at a size a 2-core CPU runs in well under a second a step: 12 layers
    (24 sites, as at full size), d_model 128, 4 heads, seq 64, batch 4, vocab 2048."""
    return gpt(layers=12, d_model=128, heads=4, seq=64, batch=4, vocab=2048)


def reference_workloads() -> list[Workload]:
    """The two workloads of DESIGN §8, at their reference sizes."""
    return [mlp(), transformer_block()]


class Trainer:
    """One variant's training run: a compiled step and the state it carries from step to step.

    Calling it runs one step and waits for its results.
    """

    def __init__(self, compiled: Any, work: Workload,
                 step_numbers: Sequence[jax.Array] | None = None,
                 session: sowtel.Session | None = None) -> None:
        self.compiled = compiled
        self.params, self.opt_state, self.batch = work.init()
        self.step_numbers = step_numbers or [jnp.int32(i) for i in range(1000)]
        self.calls = 0
        # Records go to the active session: a variant with its own session makes it active
        # before each step (sessions stay open side by side).
        self.session = session

    def activate(self) -> None:
        if self.session is not None:
            activate_session(self.session)

    def __call__(self) -> None:
        self.activate()
        step = self.step_numbers[self.calls % len(self.step_numbers)]
        out = jax.block_until_ready(self.compiled(self.params, self.opt_state, self.batch, step))
        self.params, self.opt_state = out[0], out[1]
        self.calls += 1


def exporter_training_table(
    label: str,
    make_exporters: Callable[[ExitStack], dict[str, Callable[[], Any]]],
    quick: bool = False,
    note: str = "",
) -> Any:
    """The MLP step streaming ``stats`` to each exporter, against the memory exporter and
    against no sows, interleaved in one process. ``make_exporters(stack)`` returns the
    exporter factories to compare (anything they open is closed by ``stack``)."""
    from benchmarks import Table, fmt_ratio, fmt_time, interleave
    from sowtel.exporters.memory import MemoryExporter

    work = mlp()
    args = (*work.init(), jnp.int32(0))
    sown = make_train_step(work, sowtel.sow, at_step=True)
    rounds = 2 if quick else 12
    with ExitStack() as stack:
        variants: dict[str, Callable[[], Any]] = {}
        drains: dict[str, Callable[[], Any]] = {}
        sessions: dict[str, sowtel.Session] = {}
        variants["no sows"] = Trainer(
            jax.jit(make_train_step(work, no_tap)).lower(*args).compile(), work)
        drains["no sows"] = jax.effects_barrier
        exporters = {"memory exporter": lambda: MemoryExporter(max_records=256),
                     **make_exporters(stack)}
        for name, make in exporters.items():
            # Each variant is compiled while its own session is active; sessions stay open side
            # by side, each streaming to its own exporter.
            session = stack.enter_context(sowtel.enable(exporter=make()))
            sessions[name] = session
            variants[name] = Trainer(jax.jit(sown).lower(*args).compile(), work,
                                     session=session)
            drains[name] = session.flush
        timings = interleave(variants, rounds=rounds, steps=10, warmup=2, drains=drains)
        for drain in drains.values():
            drain()
        statuses = {name: s.status() for name, s in sessions.items()}
    base, memory = timings["no sows"], timings["memory exporter"]
    table = Table(
        f"Training step with the {label} exporter: {work.description}",
        ["variant", "step", "vs no sows", "vs memory", "vs memory + drain", "records exported"],
    )
    for name, t in timings.items():
        status = statuses.get(name)
        exported = "" if status is None else str(sum(status["exported"].values()))
        if status is not None and (status["dropped"] or any(status["exporter_dropped"].values())):
            exported += " (some dropped)"
        table.add(name, fmt_time(t.per_step()), fmt_ratio(t.ratio_to(base), t.ratio_spread(base)),
                  fmt_ratio(t.ratio_to(memory), t.ratio_spread(memory)),
                  fmt_ratio(t.ratio_to(memory, with_drain=True)), exported)
    table.notes.append(
        f"{rounds} interleaved rounds of 10 steps per variant; ratios are medians over rounds "
        "of the per-round ratio. 12 records per step (6 sites, primal and cotangent)." + note)
    return table
