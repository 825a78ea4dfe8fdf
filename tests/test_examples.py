"""The examples run as a user would run them, and print what they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_plain_jax_example() -> None:
    out = _run(str(EXAMPLES / "plain_jax.py"))
    assert "layer2/act" in out and "cotangent norm" in out
    assert "streamed 18 records at steps [0, 10, 20]" in out


def test_flax_example() -> None:
    out = _run(str(EXAMPLES / "flax_linen.py"))
    assert "hidden activation (16, 32)" in out


def test_optax_example_writes_every_fifth_step(tmp_path: Path) -> None:
    out = _run(str(EXAMPLES / "optax_training.py"), str(tmp_path))
    assert "{'jsonl': 40}" in out
    lines = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in lines}) == list(range(0, 50, 5))
    assert {(r["name"], r["mode"]) for r in lines} == {
        ("hidden", "primal"), ("hidden", "cotangent"), ("logits", "primal"),
        ("logits", "cotangent")}
    hist = next(r for r in lines if r["name"] == "hidden")["histogram"]
    assert sum(hist["counts"]) == 128 * 64


def test_training_loops_example_streams_through_sowtel_jit() -> None:
    out = _run(str(EXAMPLES / "training_loops.py"))
    assert ("optax: 6 records at steps [0, 10, 20]: [('hidden', 'cotangent'), "
            "('hidden', 'primal')]") in out
    assert ("flax linen: 6 records at steps [100, 101, 102]: [('Block_0/act', 'primal'), "
            "('Block_1/act', 'primal')]") in out
    assert "flax nnx: 8 records at steps [0, 1]: [('blocks/0/act', 'cotangent')" in out
    assert "equinox-style: 4 records at steps [0]: [('layer0/act', 'cotangent')" in out


def _line_of(path: Path, text: str) -> int:
    [line] = [i + 1 for i, s in enumerate(path.read_text().splitlines()) if text in s]
    return line


def test_debugging_nans_example_goes_from_the_alert_to_the_line(tmp_path: Path) -> None:
    import numpy as np

    import sowtel

    script = EXAMPLES / "debugging_nans.py"
    out = _run(str(script), str(tmp_path))
    # 1. The NaN of step 23 is caught at step 23 (health every step beside every=10).
    assert "alert: (23, 'grads/p', 'primal')" in out
    assert "post-mortem folder: postmortem/step_23" in out
    # Steps 23 to 29 are NaN (it went into p): one episode, one warning, one post-mortem.
    assert out.count("warning: ") == 1
    assert sorted(p.name for p in (tmp_path / "postmortem").iterdir()) == ["step_23"]
    assert "the first in program order is 'grads/p' (primal)" in out
    folder = tmp_path / "postmortem" / "step_23"
    event = json.loads((folder / "locate.json").read_text())["events"][0]
    assert (event["primitive"], event["phase"], event["loops"]) == ("log", "backward", ["scan"])
    assert (event["file"], event["line"]) == (str(script), _line_of(script, "signed_power(h, "))
    # The layer: the backward scan runs from the last layer down, so the first log of a
    # negative is in the deepest layer whose input to signed_power is negative.
    pre = np.asarray(sowtel.load(folder / "step_23.safetensors")["layer/pre"]["primal"])
    negative = [i for i in range(pre.shape[0]) if (pre[i] < 0).any()]
    assert event["iteration"] == [max(negative)] and max(negative) < pre.shape[0] - 1
    # 2. The bf16 overflow: the exp of the hand-written softmax, in block 2.
    line = _line_of(script, "weights = jnp.exp(logits)")
    assert "bf16 loss: nan" in out
    assert (f"locate_nonfinite: exp at {script}:{line} (attention), forward pass, scope block2"
            in out)


def test_tap_example_streams_haiku_and_linen_scan_products() -> None:
    out = _run(str(EXAMPLES / "tap_models.py"))
    assert "haiku: 18 records, 6 series" in out  # 3 products x 2 modes x 3 steps
    assert "mlp/linear_2/dot_general                 cotangent" in out
    assert "linen nn.scan(nn.remat): 36 records, 6 series" in out  # 4 scanned layers
    assert "ScanModel/layers/Dense_0/dot_general     primal    l2" in out
    assert "(layer 3)" in out
