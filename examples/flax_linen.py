"""Flax Linen: a sow in a module's __call__ works under model.apply, jit and grad.

Run: python examples/flax_linen.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import sowtel


class Block(nn.Module):
    width: int = 32

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(self.width)(x))
        h = sowtel.sow(h, "block/hidden")
        return nn.Dense(1)(h)


def main() -> None:
    model = Block()
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jnp.cos(x[:, 0])
    params = model.init(jax.random.key(1), x)["params"]

    def loss(params):
        return jnp.mean((model.apply({"params": params}, x)[:, 0] - y) ** 2)

    grads, inter = jax.jit(sowtel.save_intermediates(jax.grad(loss)))(params)
    hidden = inter["block/hidden"]
    print("hidden activation", hidden["primal"].shape,
          "| gradient at it:", float(jnp.abs(hidden["cotangent"]).mean()))


if __name__ == "__main__":
    main()
