"""``sowtel demo``: trains a small model with sows and streams it to TensorBoard.

The model is a regression MLP on synthetic data (a fixed random "teacher" network makes the
targets): an input layer, a stack of residual blocks run by ``jax.lax.scan`` and an output
head. Its sites show what sowtel streams:

- ``embed/h``: the first layer's activations (``stats``: primal and cotangent curves);
- ``blocks/h``: the activations inside the scan: one depth tensor a step for the *SOWTEL* tab's
  layers x steps heatmap, and the headline curve ``blocks/h/{mode}/l2`` (their l2 norm over
  the 4 blocks); ``depth="scalars"`` would give a series per block instead;
- ``head/out``: the predictions, with ``summary="histogram"`` (buckets computed on device);
- ``loss``: the loss itself (one curve, its value).

Training uses ``jax.value_and_grad``, so every site also streams its cotangent (the gradient of
the loss with respect to that intermediate) from the backward pass. The step is compiled with
``sowtel.jit``, so the summaries come back as outputs of the compiled step, and
``sowtel.at_step`` around the call stamps records with the training step.

Example:
    $ sowtel demo                       # 10-16 s of training on 2 CPU cores
    $ sowtel dashboard --logdir runs    # the command the demo prints
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

__all__ = ["DEFAULT_STEPS", "configure_demo", "run_demo", "train"]

#: Training steps of ``sowtel demo`` without ``--steps``: 10-16 s of training on 2 CPU cores.
DEFAULT_STEPS = 3000

_IN, _WIDTH, _BLOCKS, _BATCH = 16, 128, 4, 256


def _sowtel_command() -> str:
    """How to run ``sowtel`` from here: plain ``sowtel`` when that is this program, else a path."""
    import shutil

    here = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    on_path = shutil.which("sowtel")
    if on_path and os.path.exists(here) and os.path.samefile(on_path, here):
        return "sowtel"
    if os.path.basename(here) == "sowtel":
        return os.path.relpath(here)  # e.g. .venv/bin/sowtel after `make demo`
    return f"{sys.executable} -m sowtel"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} steps: use at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < 60:
        raise argparse.ArgumentTypeError(f"{value} seconds per step: use 0 to 60")
    return value


def configure_demo(parser: argparse.ArgumentParser) -> None:
    """Adds the ``sowtel demo`` options to ``parser``.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser()
        >>> configure_demo(p)
        >>> p.parse_args(["--steps", "10"]).steps
        10
    """
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                        help=f"training steps (default: {DEFAULT_STEPS}, 10-16 s of training)")
    parser.add_argument("--logdir", default=None,
                        help="where the exporter writes (default: runs/demo-<date-time>)")
    parser.add_argument("--exporter", default="tensorboard",
                        help="a registered exporter name (default: tensorboard)")
    # Sleeps this long after each step, so tests can watch a run that is still going.
    parser.add_argument("--slow", type=_seconds, default=0.0, help=argparse.SUPPRESS)


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo for ``args.steps`` steps; returns the exit status (0, or 2 for bad options).

    Example:
        >>> run_demo(argparse.Namespace(steps=50, logdir="runs/try", exporter="tensorboard",
        ...                             slow=0.0))  # doctest: +SKIP
        0
    """
    from sowtel.exporters import known_names, resolve

    if args.exporter not in known_names():
        print(f"sowtel demo: error: --exporter {args.exporter!r} is not registered: use one of "
              f"{', '.join(known_names())}", file=sys.stderr)
        return 2
    default_logdir = args.logdir is None
    logdir = args.logdir or os.path.join(
        "runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    try:
        try:
            exporters = resolve(args.exporter, logdir=logdir)
            writes_logdir = True
        except TypeError:
            # This exporter has no logdir option (memory, console, otel): create it without.
            exporters = resolve(args.exporter)
            writes_logdir = False
    except (ValueError, ImportError) as e:
        print(f"sowtel demo: error: {e}", file=sys.stderr)
        return 2
    shown = "runs" if default_logdir else logdir
    dashboard = f"{_sowtel_command()} dashboard --logdir {shown}"
    if writes_logdir:
        print(f"Writing to {logdir}. Watch it live with:  {dashboard}", flush=True)
    result = train(args.steps, exporters, slow=args.slow)
    print(f"Done: {args.steps} steps, final loss {result['loss']:.4g}. "
          + _describe(result["sowtel"]))
    if writes_logdir and args.exporter == "tensorboard":
        print(f"Open the dashboard:  {dashboard}")
        print("Then the SOWTEL tab (#sowtel at the end of its address): every site at a "
              "glance, every layer of the scanned blocks over the steps, and the run's health.")
    elif writes_logdir:
        print(f"Output in {logdir}")
    return 0


def _describe(status: dict[str, Any]) -> str:
    exported = status.get("exported", {})
    errors = sum(status.get("errors", {}).values())
    dropped = status.get("dropped", 0) + sum(status.get("exporter_dropped", {}).values())
    parts = [f"{status.get('received', 0)} records streamed"]
    parts += [f"{n} written by {label}" for label, n in exported.items()]
    parts.append(f"{dropped} dropped")
    if errors:
        parts.append(f"{errors} exporter errors (see the log above)")
    if status.get("first_nonfinite"):
        parts.append(f"first non-finite value: {status['first_nonfinite']}")
    return ", ".join(parts) + "."


def train(steps: int, exporter: Any, *, slow: float = 0.0, progress: bool = True) -> dict[str, Any]:
    """Trains the demo model for ``steps`` steps while streaming to ``exporter``.

    Returns ``{"loss": final loss, "sowtel": sowtel.status() before disabling}``.

    Example:
        >>> from sowtel.exporters.memory import MemoryExporter   # doctest: +SKIP
        >>> train(20, MemoryExporter(), progress=False)["loss"] > 0  # doctest: +SKIP
        True
    """
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    import sowtel

    def block(h: Any, p: Any) -> tuple[Any, None]:
        w, b = p
        h = h + jnp.tanh(h @ w + b)
        h = sowtel.sow(h, "blocks/h")
        return h, None

    def forward(params: Any, x: Any) -> Any:
        h = jnp.tanh(x @ params["embed"])
        h = sowtel.sow(h, "embed/h")
        h, _ = jax.lax.scan(block, h, (params["blocks_w"], params["blocks_b"]))
        out = (h @ params["head"])[:, 0]
        return sowtel.sow(out, "head/out", summary="histogram")

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        loss = jnp.mean((forward(params, x) - y) ** 2)
        return sowtel.sow(loss, "loss")

    def init(key: Any, scale: float) -> dict[str, Any]:
        k = jax.random.split(key, 4)
        return {
            "embed": jax.random.normal(k[0], (_IN, _WIDTH)) / jnp.sqrt(_IN),
            "blocks_w": jax.random.normal(k[1], (_BLOCKS, _WIDTH, _WIDTH)) * scale
            / jnp.sqrt(_WIDTH),
            "blocks_b": jnp.zeros((_BLOCKS, _WIDTH)),
            "head": jax.random.normal(k[2], (_WIDTH, 1)) / jnp.sqrt(_WIDTH),
        }

    teacher = init(jax.random.key(1), 1.0)

    def teacher_out(x: Any) -> Any:
        h = jnp.tanh(x @ teacher["embed"])
        for i in range(_BLOCKS):
            h = h + jnp.tanh(h @ teacher["blocks_w"][i] + teacher["blocks_b"][i])
        return (h @ teacher["head"])[:, 0]

    @sowtel.jit  # a logging step returns the summaries as outputs: no host callback
    def train_step(params: Any, velocity: Any, step: Any) -> tuple[Any, Any, Any]:
        x = jax.random.normal(jax.random.fold_in(jax.random.key(2), step), (_BATCH, _IN))
        y = teacher_out(x)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
        params = jax.tree.map(lambda p, v: p - 0.01 * v, params, velocity)
        return params, velocity, loss

    params = init(jax.random.key(0), 0.5)
    velocity = jax.tree.map(jnp.zeros_like, params)
    loss = jnp.zeros(())
    with sowtel.enable(exporter=exporter):
        bar = tqdm(range(steps), desc="sowtel demo", unit="step", disable=not progress)
        for step in bar:
            with sowtel.at_step(step):  # records carry the training step
                params, velocity, loss = train_step(params, velocity, jnp.int32(step))
            if step % 25 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            if slow:
                time.sleep(slow)
        bar.close()
        sowtel.flush()
        status = sowtel.status()
    return {"loss": float(loss), "sowtel": status}
