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
