"""Exit, sys.exit, Ctrl-C and SIGTERM with ``sowtel.jit`` steps in flight: the process never
aborts, exits with the status that way of ending gives, and keeps every record of every step
completed before it (``on_full="block"``).

Each scenario runs the child of ``benchmarks/bench_exit.py`` (chained steps of a 48-layer,
8-site scan to jsonl and TensorBoard) a bounded number of times; the 50-run check is that
benchmark, with its numbers in the README.
"""

from __future__ import annotations

import pytest

# The child and its checks live with the 50-run benchmark (the repository root is importable:
# conftest.py).
from benchmarks.bench_exit import run_once

RUNS = 5


@pytest.mark.parametrize("how", ["exit", "sys.exit", "sigint", "sigterm"])
def test_exit_with_steps_in_flight_keeps_every_step_and_never_aborts(tmp_path, how):
    for k in range(RUNS):
        logdir = tmp_path / f"run{k}"
        result = run_once(how, str(logdir), steps=20)
        assert result.ok, (k, result.problems)
        # The child reported steps (the scenario really had work in flight), and every one of
        # them is whole in the file (run_once checks it record by record).
        assert result.reported >= (20 if how in ("exit", "sys.exit") else 11)
        assert all(result.per_step.get(s) == 384 for s in range(result.reported))
