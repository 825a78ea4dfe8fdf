"""sowtel.compare_runs and ``sowtel diff`` of runs: the first divergence of two runs, in execution
order, read from jsonl and TensorBoard runs written through both transports; the execution-order
key the exporters record (``Record.scans``, ``order_key``), and bad input.

The model scans ``LAYERS`` residual blocks, ``a = h @ w`` then ``h = h + tanh(a) + b``, each
sown, between a sown embedding and head. Run B departs from run A in one way, and the answer is
derived by hand from where the change enters the computation:

- ``w[3]`` nudged before step 7: ``a`` of layer 3 is the first value it touches (primal).
- ``b[3]`` nudged before step 7: ``h`` of layer 3, then ``a`` of layer 4. Ordering the records
  site by site (every layer's ``a`` before any ``h``) would name ``blocks/a[4]``: the answer
  needs the scan's sites interleaved iteration by iteration.
- the gradient leaving layer 3 (its input's cotangent) doubled at step 4: layer 3's own
  cotangents are computed before that, so the first to differ is the cotangent of ``h`` of
  layer 2, the layer below, and it is exactly twice run A's.

The values a divergence reports are checked against statistics computed with numpy from
``save_intermediates`` of the same step, replayed without sowtel streaming.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_stats

import sowtel
from sowtel.cli import main as cli
from sowtel.compare import diff_runs
from sowtel.exporters.jsonl import JsonlExporter, read_records, record_to_json
from sowtel.exporters.memory import MemoryExporter
from sowtel.exporters.tensorboard import ORDER_TAG, TensorBoardExporter
from sowtel.records import Record, order_key

LAYERS, WIDTH, STEPS = 6, 8, 10


@jax.custom_vjp
def grad_scale(x: Any, c: Any) -> Any:
    """The identity, whose backward pass multiplies the cotangent by ``c``."""
    return x


def _scale_fwd(x: Any, c: Any) -> tuple[Any, Any]:
    return x, c


def _scale_bwd(c: Any, g: Any) -> tuple[Any, Any]:
    return g * c, jnp.zeros_like(c)


grad_scale.defvjp(_scale_fwd, _scale_bwd)


def loss(params: dict[str, Any], x: Any, y: Any, scales: Any) -> Any:
    h = sowtel.sow(x @ params["embed"], "embed")

    def block(h: Any, layer: Any) -> tuple[Any, None]:
        w, b, c = layer
        h = grad_scale(h, c)  # the gradient leaving this layer for the one below
        a = sowtel.sow(h @ w, "blocks/a")
        return sowtel.sow(h + jnp.tanh(a) + b, "blocks/h"), None

    h, _ = jax.lax.scan(block, h, (params["w"], params["b"], scales))
    out = sowtel.sow(h @ params["head"], "head")
    return jnp.mean((out - y) ** 2)


def train_step(params: dict[str, Any], x: Any, y: Any, scales: Any, k: Any) -> dict[str, Any]:
    with sowtel.at_step(k):
        grads = jax.grad(loss)(params, x, y, scales)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


STEP_FUNCTIONS = {"jit": sowtel.jit(train_step), "callback": jax.jit(train_step)}
# Run B's change: (kind, step, layer).
CASES: dict[str, tuple[str, int, int] | None] = {
    "identical": None, "weight": ("w", 7, 3), "bias": ("b", 7, 3), "gradient": ("scale", 4, 3)}
# The answers, by hand (see the module docstring): (step, name, mode, index).
ANSWERS = {"weight": (7, "blocks/a", "primal", 3), "bias": (7, "blocks/h", "primal", 3),
           "gradient": (4, "blocks/h", "cotangent", 2)}


def initial() -> tuple[dict[str, Any], Any, Any]:
    rng = np.random.default_rng(0)
    params = {"embed": rng.normal(size=(4, WIDTH)) * 0.5,
              "w": rng.normal(size=(LAYERS, WIDTH, WIDTH)) * 0.2,
              "b": rng.normal(size=(LAYERS, WIDTH)) * 0.1,
              "head": rng.normal(size=(WIDTH, 2)) * 0.5}
    x, y = rng.normal(size=(16, 4)), rng.normal(size=(16, 2))
    return ({k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
            jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))


def changed(params: dict[str, Any], case: str, k: int) -> tuple[dict[str, Any], Any]:
    """Run B's parameters and gradient scales at step ``k``."""
    scales = jnp.ones(LAYERS)
    change = CASES[case]
    if change is not None and change[1] == k:
        kind, _, layer = change
        if kind == "scale":
            scales = scales.at[layer].set(2.0)
        else:
            params = {**params, kind: params[kind].at[(layer,) + (0,) * (
                params[kind].ndim - 1)].add(1e-3)}
    return params, scales


def train(step: Any, case: str, steps: int = STEPS, exporters: Any = None) -> list[Any]:
    """Trains ``steps`` steps of run ``case``; returns the parameters and scales of each step."""
    params, x, y = initial()
    seen = []
    for k in range(steps):
        params, scales = changed(params, case, k)
        seen.append((params, scales))
        params = step(params, x, y, scales, k)
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Every case, by both transports, each written as a jsonl run and a TensorBoard run;
    'rerun' is run A trained again."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for transport, step in STEP_FUNCTIONS.items():
        for case in ("identical", "rerun", "weight", "bias", "gradient"):
            where = root / f"{transport}-{case}"
            exporters = [JsonlExporter(logdir=where / "jsonl"),
                         TensorBoardExporter(logdir=str(where / "tb"))]
            with sowtel.enable(exporter=exporters):
                train(step, "identical" if case == "rerun" else case)
                assert sowtel.flush(timeout=60.0)
            out[(transport, case)] = where
    return out


def replayed(case: str, k: int) -> dict[str, Any]:
    """``save_intermediates`` of run ``case``'s step ``k``, replayed with nothing streaming."""
    params, scales = train(jax.jit(train_step), case, steps=k + 1)[k]
    _, x, y = initial()
    _, inter = sowtel.save_intermediates(jax.grad(loss))(params, x, y, scales)
    return inter


@pytest.mark.parametrize("kind", ["jsonl", "tb"])
@pytest.mark.parametrize("transport", ["jit", "callback"])
@pytest.mark.parametrize("case", ["identical", "weight", "bias", "gradient"])
def test_the_first_divergence_is_where_run_b_departs(runs, transport, kind, case):
    a = runs[(transport, "rerun")] / kind
    b = runs[(transport, case)] / kind
    div = sowtel.compare_runs(a, b)
    if case == "identical":
        assert div is None
        report = diff_runs(a, b)
        assert (report.steps, report.sites, report.records) == (STEPS, 4, 4 * LAYERS + 4)
        return
    assert div is not None
    assert (div.step, div.name, div.mode, div.index) == ANSWERS[case], str(div)
    assert div.process_index == 0 and div.absent is None
    assert not div.only_in_a and not div.only_in_b
    # The values reported are the statistics of that record in each run, computed with numpy
    # from the step replayed through save_intermediates.
    step, name, mode, index = ANSWERS[case]
    want = [numpy_stats(np.asarray(replayed(run, step)[name][mode][index], np.float64))
            for run in ("identical", case)]
    tol = 1e-5 if kind == "jsonl" else 1e-6  # the device computes in float32; TensorBoard keeps it
    np.testing.assert_allclose([div.a, div.b], [w[div.stat] for w in want], rtol=1e-4,
                               atol=tol)
    if case == "gradient":  # the doubled gradient, exactly twice run A's
        assert div.b == pytest.approx(2 * div.a, rel=1e-6)
    # What follows it is in execution order too: later in the step, or a later step.
    keys = [(c.step, c.name, c.mode, c.index) for c in div.context]
    assert len(keys) == 5 and all(k[0] >= step for k in keys)
    if case == "bias":
        assert keys[0] == (7, "blocks/a", "primal", 4)


@pytest.mark.parametrize("transport", ["jit", "callback"])
def test_a_jsonl_run_compares_with_a_tensorboard_run(runs, transport):
    a, b = runs[(transport, "rerun")], runs[(transport, "bias")]
    assert sowtel.compare_runs(a / "jsonl", runs[(transport, "identical")] / "tb") is None
    div = sowtel.compare_runs(a / "jsonl", b / "tb")
    assert (div.step, div.name, div.mode, div.index) == ANSWERS["bias"]
    report = diff_runs(b / "tb", a / "jsonl")
    assert report.kinds == ("tensorboard", "jsonl") and report.divergence is not None
    # A folder holding both kinds is read from its jsonl files.
    shutil.copytree(a / "tb", a / "both", dirs_exist_ok=True)
    shutil.copytree(a / "jsonl", a / "both", dirs_exist_ok=True)
    assert diff_runs(a / "both", b / "jsonl").kinds == ("jsonl", "jsonl")


def test_sowtel_diff_prints_the_divergence_and_exits_1(runs, capsys):
    a, b = runs[("jit", "rerun")] / "jsonl", runs[("jit", "bias")] / "jsonl"
    assert cli(["diff", str(a), str(runs[("jit", "identical")] / "jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"no divergence in {STEPS} steps, 4 sites ({4 * LAYERS + 4} records a step)"
    assert cli(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 7, blocks/h[3] (primal): " in out
    lines = out.splitlines()
    top = lines.index("step 7 in execution order:") + 2
    rows = lines[top:lines.index("", top)]
    first = next(i for i, line in enumerate(rows) if line.lstrip().startswith(">>"))
    # The table around it, in execution order: layer 3's a, h, then layer 4's a, h.
    names = [line.replace(">>", "").split()[0] for line in rows]
    assert names[first - 1:first + 3] == ["blocks/a[3]", "blocks/h[3]", "blocks/a[4]",
                                          "blocks/h[4]"]
    assert rows[first].endswith("<- first divergence") and "differs" in rows[first + 1]
    assert rows[first - 1].split()[-1] == "0"  # before it: the same in both
    assert cli(["diff", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["name"] == "blocks/h" and report["divergence"]["index"] == 3
    # A looser tolerance than the nudge's effect: no divergence.
    assert cli(["diff", str(a), str(b), "--rtol", "0.5", "--atol", "1"]) == 0
