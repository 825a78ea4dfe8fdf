"""Optax: stream activation and gradient statistics to a JSON-lines file while training.

Run: python examples/optax_training.py [LOGDIR]
"""

import sys
import tempfile

import jax
import jax.numpy as jnp
import optax

import sowtel


def model(params, x):
    h = sowtel.sow(jax.nn.relu(x @ params["w1"]), "hidden", summary="histogram")
    return sowtel.sow(h @ params["w2"], "logits")


def loss_fn(params, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model(params, x), labels).mean()


def main(logdir: str) -> None:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (10, 64)) * 0.3, "w2": jax.random.normal(k2, (64, 3))}
    x = jax.random.normal(k3, (128, 10))
    labels = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 1).astype(jnp.int32)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def train_step(params, state, step):
        with sowtel.at_step(step):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    with sowtel.enable(exporter="jsonl", logdir=logdir, every=5):
        for step in range(50):
            params, state, loss = train_step(params, state, step)
        sowtel.flush()
        exported = sowtel.status()["exported"]
    print(f"final loss {float(loss):.4f}; records written under {logdir}: {exported}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="sowtel-"))
