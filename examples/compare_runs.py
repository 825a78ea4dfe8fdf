"""Two runs that should match, and do not: where do they part?

Trains a small residual network (an embedding, 6 blocks under ``lax.scan``, a head) twice with
``sowtel.jit``, streaming every site's statistics to a jsonl run. Run B is run A with one
weight of block 3 changed by 1e-3 before step 7, as a bad checkpoint restore or a
nondeterministic kernel would change it. ``sowtel diff`` then names the first record that
differs, in the order the program computed them: step 7, block 3's matmul.

    python examples/compare_runs.py [FOLDER]     # runs go to FOLDER/a and FOLDER/b
"""

from __future__ import annotations

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import sowtel
from sowtel.cli import main as sowtel_command

LAYERS, WIDTH = 6, 8


def loss(params, x, y):
    h = sowtel.sow(x @ params["embed"], "embed")

    def block(h, w):
        a = sowtel.sow(h @ w, "blocks/a")
        return sowtel.sow(h + jnp.tanh(a), "blocks/h"), None

    h, _ = jax.lax.scan(block, h, params["blocks"])
    return jnp.mean((sowtel.sow(h @ params["head"], "head") - y) ** 2)


@sowtel.jit
def train_step(params, x, y):
    grads = jax.grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


def train(logdir, change_at=None, steps=10):
    rng = np.random.default_rng(0)
    params = {"embed": jnp.asarray(rng.normal(size=(4, WIDTH)) * 0.5, jnp.float32),
              "blocks": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)) * 0.2, jnp.float32),
              "head": jnp.asarray(rng.normal(size=(WIDTH, 2)) * 0.5, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)
    with sowtel.enable(exporter="jsonl", logdir=logdir):
        for step in range(steps):
            if step == change_at:
                params["blocks"] = params["blocks"].at[3, 0, 0].add(1e-3)
            params = train_step(params, x, y)


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="sowtel-compare-")
    train(f"{folder}/a")
    train(f"{folder}/b", change_at=7)
    print(sowtel.compare_runs(f"{folder}/a", f"{folder}/b"))
    print(f"\n$ sowtel diff {folder}/a {folder}/b")
    status = sowtel_command(["diff", f"{folder}/a", f"{folder}/b"])
    print(f"(exit status {status})")
