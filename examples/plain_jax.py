"""Plain JAX: capture every intermediate and its gradient, then stream them while training.

Run: python examples/plain_jax.py
"""

import jax
import jax.numpy as jnp

import sowtel


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = sowtel.sow(jnp.tanh(x @ w + b), f"layer{i}/act")
    return x


def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x)[:, 0] - y) ** 2)


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    sizes = [(4, 32), (32, 32), (32, 1)]
    params = [(jax.random.normal(k, s) / jnp.sqrt(s[0]), jnp.zeros(s[1]))
              for k, s in zip(keys, sizes, strict=False)]
    x = jax.random.normal(keys[3], (64, 4))
    y = jnp.sin(x[:, 0])

    # Offline: the values and the gradients with respect to them.
    (loss, grads), inter = sowtel.save_intermediates(jax.value_and_grad(loss_fn))(params, x, y)
    for name, modes in inter.items():
        print(f"{name:12s} primal mean {float(modes['primal'].mean()):+.4f}  "
              f"cotangent norm {float(jnp.linalg.norm(modes['cotangent'])):.2e}")

    # Live: the same sites stream from the jitted training step.
    @jax.jit
    def train_step(params, step):
        with sowtel.at_step(step):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    with sowtel.enable(exporter="memory", every=10) as session:
        for step in range(30):
            params, loss = train_step(params, step)
        sowtel.flush()
    records = session.exporters[0].records
    print(f"streamed {len(records)} records at steps {sorted({r.step for r in records})}; "
          f"final loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
