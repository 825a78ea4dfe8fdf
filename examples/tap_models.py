"""Watch code that has no sow: sowtel.tap makes every matrix product a site.

A haiku MLP and a Flax Linen model whose layers are an nn.scan of nn.remat blocks, trained a few
steps each with sowtel.jit; the loss is tapped, so every product streams its activation and,
from the backward pass, its cotangent (one record per scanned layer).

Run: python examples/tap_models.py
"""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp

import sowtel

X = jax.random.normal(jax.random.key(0), (32, 4))
Y = jnp.sin(X[:, :1])


def train(loss, params, steps=3):
    @sowtel.jit
    def step(params):
        grads = jax.grad(sowtel.tap(loss))(params)  # the one line: tap what grad differentiates
        return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)

    for _ in range(steps):
        params = step(params)
    return params


def report(label, session):
    sowtel.flush()
    records = session.exporters[0].records
    sites = sorted({(r.name, r.mode) for r in records})
    print(f"{label}: {len(records)} records, {len(sites)} series")
    for name, mode in sites:
        last = [r for r in records if (r.name, r.mode) == (name, mode)][-1]
        where = "" if last.index is None else f" (layer {last.index})"
        print(f"  {name:40s} {mode:9s} l2 {last.stats['l2']:.4f}{where}")


# haiku: module names come from haiku's own name scopes.
mlp = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 16, 1])(x)))
hk_params = mlp.init(jax.random.key(1), X)


def hk_loss(params):
    return jnp.mean((mlp.apply(params, X) - Y) ** 2)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(16)(x)), None


class ScanModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        layers = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=4)
        x, _ = layers(name="layers")(x, None)
        return nn.Dense(1)(x)


linen_params = ScanModel().init(jax.random.key(2), X)


def linen_loss(params):
    return jnp.mean((ScanModel().apply(params, X) - Y) ** 2)


if __name__ == "__main__":
    with sowtel.enable(exporter="memory") as session:
        train(hk_loss, hk_params)
        report("haiku", session)
    with sowtel.enable(exporter="memory") as session:
        train(linen_loss, linen_params)
        report("linen nn.scan(nn.remat)", session)
