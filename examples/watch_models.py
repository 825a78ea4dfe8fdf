"""Watch a model without editing it: a Linen, an NNX and an Equinox model, each trained with a
watched Optax optimizer, module outputs captured automatically, streaming to a tracker.

Run: python examples/watch_models.py [wandb|mlflow|trackio|memory] [DIR]

With a tracker, everything stays on this machine: W&B in offline mode under DIR, MLflow in a
SQLite store in DIR, Trackio in its local store ($TRACKIO_DIR).
"""

import os
import sys
import tempfile

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import sowtel
import sowtel.equinox
import sowtel.flax
import sowtel.nnx
import sowtel.optax

X = jax.random.normal(jax.random.key(0), (32, 4))
Y = jnp.sin(X[:, :1])


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))


def train_linen(steps):
    tx = sowtel.optax.watch(optax.adam(1e-2), every=10)  # the one line of wandb.watch
    params = LinenMLP().init(jax.random.key(1), X)
    state = tx.init(params)

    @sowtel.jit
    def step(params, state):
        def loss(params):
            with sowtel.flax.capture():  # every module's output (and its cotangent) as a site
                return jnp.mean((LinenMLP().apply(params, X) - Y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    for _ in range(steps):
        params, state, value = step(params, state)
    return float(value)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def train_nnx(steps):
    model = NnxMLP(nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, sowtel.optax.watch(optax.adam(1e-2), every=10),
                              wrt=nnx.Param)

    @sowtel.nnx.jit  # nnx.jit's semantics: model and optimizer are updated in place
    def step(model, optimizer):
        def loss(model):
            with sowtel.nnx.capture(model):
                return jnp.mean((model(X) - Y) ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    for _ in range(steps):
        value = step(model, optimizer)
    return float(value)


def train_equinox(steps):
    tx = sowtel.optax.watch(optax.adam(1e-2), every=10)
    model = eqx.nn.MLP(4, 1, width_size=16, depth=1, activation=jnp.tanh,
                       key=jax.random.key(1))
    state = tx.init(eqx.filter(model, eqx.is_array))

    @sowtel.equinox.filter_jit
    def step(model, state):
        def loss(model):
            return jnp.mean((jax.vmap(sowtel.equinox.capture(model))(X) - Y) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    for _ in range(steps):
        model, state, value = step(model, state)
    return float(value)


def exporter_options(tracker, directory):
    if tracker == "wandb":
        return {"mode": "offline", "dir": directory, "project": "sowtel-example"}
    if tracker == "mlflow":
        return {"tracking_uri": f"sqlite:///{os.path.join(directory, 'mlflow.db')}",
                "artifact_location": os.path.join(directory, "artifacts")}
    if tracker == "trackio":
        return {"project": "sowtel-example"}
    return {}


def main(tracker, directory):
    with sowtel.enable(exporter=tracker, summary="histogram",
                       **exporter_options(tracker, directory)) as session:
        for name, train in (("linen", train_linen), ("nnx", train_nnx),
                            ("equinox", train_equinox)):
            with sowtel.scope(name):
                print(f"{name}: final loss {train(30):.4f}")
        sowtel.flush()
        if tracker == "memory":
            names = sorted({r.name for r in session.exporters[0].records})
            print(f"{len(names)} series, for example {names[:2]} and {names[-2:]}")
    print("exported:", sowtel.status()["exported"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "memory",
         sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="sowtel-watch-"))
