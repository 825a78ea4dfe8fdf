"""From the first NaN alert to the line of code: two real cases (see docs/debugging-nans.md).

1. A scanned 8-layer model whose hand-written backward pass takes the log of a negative number
   in one layer, at one step of training. The session checks every site's health at every
   step (``health_every=1``) beside full statistics every 10 steps, and on the first non-finite
   value writes a post-mortem (``on_nonfinite="dump"``): every site's value and cotangent at
   that step, and the operation that made the NaN.
2. Attention logits that overflow in bfloat16 in a hand-written softmax, found by running the
   step once through ``sowtel.locate_nonfinite``.

Run: ``python examples/debugging_nans.py [LOGDIR]`` (default: a temporary folder).
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from typing import Any

import jax
import jax.numpy as jnp

import sowtel
from sowtel.postmortem import format_report, inspect_dump

# ------------------------------------------------------------------------ 1. a scanned model


@jax.custom_vjp
def signed_power(x: jax.Array, p: jax.Array) -> jax.Array:
    """sign(x) * |x| ** p, with a hand-written derivative."""
    return jnp.sign(x) * jnp.abs(x) ** p


def _signed_power_fwd(x: jax.Array, p: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
    y = signed_power(x, p)
    return y, (x, p, y)


def _signed_power_bwd(res: tuple[Any, ...], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, p, y = res
    dx = g * p * jnp.abs(x) ** (p - 1.0)
    dp = jnp.sum(g * y * jnp.log(x))  # the bug: log(|x|) was meant
    return dx, dp


signed_power.defvjp(_signed_power_fwd, _signed_power_bwd)


def model(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    def layer(h: jax.Array, lp: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        with sowtel.scope("layer"):
            h = sowtel.sow(jnp.tanh(h @ lp["w"] + lp["b"]), "pre")
            h = sowtel.sow(signed_power(h, lp["p"]), "act")  # the layer's activation
        return h, None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean((h - 0.5) ** 2)


@sowtel.jit
def train_step(params: dict[str, jax.Array], x: jax.Array) -> tuple[Any, jax.Array]:
    loss, grads = jax.value_and_grad(model)(params, x)
    grads = sowtel.sow(grads, "grads")  # the gradients are sites too: watched every step
    return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), loss


def init(layers: int = 8, width: int = 16) -> dict[str, jax.Array]:
    eye = jnp.eye(width)
    return {"w": jnp.stack([eye * 0.9] * layers), "b": jnp.zeros((layers, width)),
            "p": jnp.full((layers,), 1.5)}


def batch(step: int) -> jax.Array:
    x = jnp.full((4, 16), 0.5)
    # At step 23 one input is negative: its activations stay negative through every layer.
    return x.at[2, 3].set(-0.5) if step == 23 else x


def scanned_model_case(logdir: str) -> None:
    params = init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sowtel.NonFiniteWarning)
        with sowtel.enable(exporter="jsonl", logdir=logdir, every=10, health_every=1,
                           on_nonfinite="dump") as session:
            for step in range(30):
                params, loss = train_step(params, batch(step))
            sowtel.flush()
            print("alert:", session.status()["first_nonfinite"])
            folder = session.guard.postmortems[0]
    for w in caught:
        print("warning:", w.message)
    print("post-mortem folder:", folder.relative_to(logdir))
    report = inspect_dump(folder / f"{folder.name}.safetensors")
    print(format_report(report).splitlines()[-1])
    print("locate_nonfinite:", (folder / "locate.txt").read_text().splitlines()[0])


# ------------------------------------------------------------- 2. attention logits in bf16


def attention(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array) -> jax.Array:
    q, k, v = x @ wq, x @ wk, x @ wv
    logits = q @ k.T / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    weights = jnp.exp(logits)  # a hand-written softmax, without subtracting the max
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights @ v


def transformer(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for i, p in enumerate(params):
        with sowtel.scope(f"block{i}"):
            x = x + sowtel.sow(attention(x, p["wq"], p["wk"], p["wv"]), "attn")
    return jnp.sum(x.astype(jnp.float32) ** 2)


def attention_case() -> None:
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 9)
    params = [{n: (jax.random.normal(k, (32, 32)) * 0.2).astype(dtype)
               for n, k in zip(("wq", "wk", "wv"), keys[3 * i:3 * i + 3], strict=True)}
              for i in range(3)]
    params[2]["wq"] = params[2]["wq"] * 12.0  # a layer whose queries grew large
    x = jax.random.normal(jax.random.key(1), (8, 32)).astype(dtype)
    loss, grads = jax.value_and_grad(transformer)(params, x)
    print("bf16 loss:", float(loss))
    report = sowtel.locate_nonfinite(jax.grad(transformer))(params, x)
    print("locate_nonfinite:", report.first)


def main(argv: list[str]) -> None:
    logdir = argv[0] if argv else tempfile.mkdtemp(prefix="sowtel-nans-")
    scanned_model_case(logdir)
    attention_case()


if __name__ == "__main__":
    main(sys.argv[1:])
