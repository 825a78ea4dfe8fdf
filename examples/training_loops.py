"""``sowtel.jit`` training steps in four styles: plain JAX + Optax, Flax Linen, Flax NNX (its
functional split/merge form) and an Equinox-style module (a pytree with its own ``__call__``).

Each step sows activations; ``sowtel.jit`` returns their summaries as outputs of the compiled
step (no host callback in the program), and the session turns them into records off the
training thread. Run: ``python examples/training_loops.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

import sowtel
from sowtel.exporters.memory import MemoryExporter

KEY = jax.random.key(0)
X = jax.random.normal(KEY, (64, 8))
Y = jnp.sin(X[:, :1])


def report(style: str, session: sowtel.Session) -> None:
    records = session.exporters[0].records
    steps = sorted({r.step for r in records})
    sites = sorted({(r.name, r.mode) for r in records})
    print(f"{style}: {len(records)} records at steps {steps}: {sites}")


# -- plain JAX + Optax -------------------------------------------------------------------------

def plain_optax() -> None:
    k1, k2 = jax.random.split(KEY)
    params = {"w1": jax.random.normal(k1, (8, 32)) / 3, "w2": jax.random.normal(k2, (32, 1)) / 6}
    optimizer = optax.adam(1e-2)

    def loss(params, x, y):
        h = sowtel.sow(jax.nn.gelu(x @ params["w1"]), "hidden")
        return jnp.mean((h @ params["w2"] - y) ** 2)

    @sowtel.jit  # drop-in for jax.jit; donate_argnums etc. work as there
    def train_step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = optimizer.init(params)
    with sowtel.enable(exporter=MemoryExporter(), every=10) as session:
        for _ in range(30):
            params, opt_state, value = train_step(params, opt_state, X, Y)
        sowtel.flush()
    report("optax", session)


# -- Flax Linen --------------------------------------------------------------------------------

def flax_linen() -> None:
    import flax.linen as nn

    import sowtel.flax  # optional: imports Flax only when used

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return sowtel.sow(nn.tanh(nn.Dense(16)(x)), "act")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(1)(x)

    model = Model()
    variables = model.init(KEY, X)

    @sowtel.jit
    def train_step(variables, x, y):
        def loss(v):
            with sowtel.flax.module_scopes():  # sites named by module path: Block_0/act, ...
                return jnp.mean((model.apply(v, x) - y) ** 2)

        grads = jax.grad(loss)(variables)
        return jax.tree.map(lambda p, g: p - 0.1 * g, variables, grads)

    with sowtel.enable(exporter=MemoryExporter(), modes=("primal",)) as session:
        for k in range(3):
            with sowtel.at_step(100 + k):  # a host-side step, around the call
                variables = train_step(variables, X, Y)
        sowtel.flush()
    report("flax linen", session)


# -- Flax NNX, functional form -----------------------------------------------------------------

def flax_nnx() -> None:
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            for i, block in enumerate(self.blocks):
                with sowtel.scope(f"blocks/{i}"):  # NNX modules have no path: name the calls
                    x = sowtel.sow(jax.nn.relu(block(x)), "act")
            return self.out(x)

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    @sowtel.jit
    def train_step(state, x, y):
        def loss(state):
            model = nnx.merge(graphdef, state)
            return jnp.mean((model(x) - y) ** 2)

        grads = jax.grad(loss)(state)
        return jax.tree.map(lambda p, g: p - 0.05 * g, state, grads)

    with sowtel.enable(exporter=MemoryExporter()) as session:
        for _ in range(2):
            state = train_step(state, X, Y)
        sowtel.flush()
    report("flax nnx", session)


# -- Equinox-style: the model is a pytree with a __call__ ------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight + self.bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLP:
    layers: list[Linear]

    def __call__(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            x = sowtel.sow(jnp.tanh(layer(x)), f"layer{i}/act")
        return self.layers[-1](x)


def equinox_style() -> None:
    keys = jax.random.split(KEY, 3)
    sizes = [(8, 16), (16, 16), (16, 1)]
    model = MLP([Linear(jax.random.normal(k, s) / s[0] ** 0.5, jnp.zeros(s[1]))
                 for k, s in zip(keys, sizes, strict=True)])

    @sowtel.jit
    def train_step(model, x, y):
        grads = jax.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        return jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)

    with sowtel.enable(exporter=MemoryExporter(), summary="health") as session:
        model = train_step(model, X, Y)
        sowtel.flush()
    report("equinox-style", session)


if __name__ == "__main__":
    plain_optax()
    flax_linen()
    flax_nnx()
    equinox_style()
