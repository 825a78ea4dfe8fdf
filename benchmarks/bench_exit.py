"""Exit with ``sowtel.jit`` work in flight: exit status and records kept, over many runs.

Each run is a child process that streams chained ``sowtel.jit`` steps of a 48-layer scan with
8 sites a layer (384 ``stats`` records a step) to jsonl and TensorBoard with
``on_full="block"``, and prints ``step i`` after each call returns (its records were accepted
by then). Then it ends one way:

- ``exit``: falls off the end of the script, steps still being fetched, nothing flushed;
- ``sys.exit``: ``sys.exit(3)`` the same way;
- ``sigint``: Ctrl-C (SIGINT) while it trains, sent after its tenth step;
- ``sigterm``: SIGTERM while it trains, sent after its tenth step;
- ``exit-timeout``: as ``exit`` after three times the steps, with an exit timeout of 0.5 s, so
  that exit gives up on the backlog while a step is being fetched (what is given up on is
  counted, not written: only the exit status and the absence of an abort are checked).

A run is good when the process did not abort (no SIGABRT, no "terminate called" on stderr), it
exited with the status that way of ending gives, and the jsonl file holds every record of every
step the child reported, and only whole steps. The table counts good runs per scenario.

Run: ``python -m benchmarks.bench_exit [--quick] [--runs N]`` (``--quick``: 3 runs each; the
default 50). The tests run the same child (``tests/test_exit.py``), 5 times per scenario.

Example:
    >>> from benchmarks import bench_exit
    >>> bench_exit.run_once("exit", "/tmp/x").ok  # doctest: +SKIP
    True
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import Table, module_main

__all__ = ["SCENARIOS", "run_once", "RunResult", "main"]

SCENARIOS = ("exit", "sys.exit", "sigint", "sigterm", "exit-timeout")
PER_STEP = 384  # records a step: 48 layers x 8 sites
STEPS = 100  # steps of the exit and sys.exit scenarios
SIGNAL_AFTER = 10  # the signal scenarios are signalled after this step is reported
EXPECTED_STATUS = {"exit": (0,), "sys.exit": (3,), "sigint": (-signal.SIGINT, 1),
                   "sigterm": (-signal.SIGTERM,), "exit-timeout": (0,)}

CHILD = r"""
import sys
import jax, jax.numpy as jnp
import sowtel

logdir, how = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if how in ("exit", "sys.exit", "exit-timeout") else 10**9
if how == "exit-timeout":
    # Exit gives up on what it cannot flush in half a second, while steps are being fetched.
    import sowtel.dispatcher as where
    where = getattr(sowtel, "_exit", where)
    where.EXIT_TIMEOUT = 0.5
    steps *= 3

def step(x):
    def body(c, _):
        for k in range(8):
            c = jnp.tanh(c) + 0.01 * k
            sowtel.sow(c, f"s{k}")
        return c, None
    return jax.lax.scan(body, x, None, length=48)[0]

f = sowtel.jit(step)
sowtel.enable(exporter=["jsonl", "tensorboard"], logdir=logdir, on_full="block")
x = jnp.linspace(-1.0, 1.0, 1024)
for i in range(steps):
    x = f(x)
    print(f"step {i}", flush=True)
if how == "sys.exit":
    sys.exit(3)
"""


@dataclasses.dataclass
class RunResult:
    """One child run: its exit status, what it reported, what the file holds, and why not ok."""

    status: int
    reported: int
    per_step: dict[int, int]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_once(how: str, logdir: str, timeout: float = 120.0, steps: int = STEPS) -> RunResult:
    """Runs the child once with ``how`` as its way of ending (``steps`` before an exit);
    checks it (see the module doc)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, logdir, how, str(steps)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        # A process started in the background of a shell inherits SIGINT ignored, and Python
        # keeps it ignored: the child gets the default action, so Ctrl-C reaches it as a user's.
        preexec_fn=_default_sigint,
    )
    lines: list[str] = []
    try:
        assert child.stdout is not None
        if how in ("sigint", "sigterm"):
            for line in child.stdout:
                lines.append(line.strip())
                if line.strip() == f"step {SIGNAL_AFTER}":
                    child.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
                    break
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    lines += out.splitlines()
    reported = sum(1 for line in lines if line.startswith("step "))
    per_step: dict[int, int] = collections.Counter()
    path = Path(logdir) / "records.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            per_step[json.loads(line)["step"]] += 1
    problems = []
    if child.returncode == -signal.SIGABRT or "terminate called" in err or "FATAL" in err:
        problems.append(f"aborted (status {child.returncode}): {err[-400:]}")
    if child.returncode not in EXPECTED_STATUS[how]:
        problems.append(f"exit status {child.returncode}, expected {EXPECTED_STATUS[how]}: "
                        f"{err[-400:]}")
    if how == "exit-timeout":
        return RunResult(child.returncode, reported, dict(per_step), problems)
    missing = [s for s in range(reported) if per_step.get(s, 0) != PER_STEP]
    if missing:
        problems.append(f"steps reported but not whole in the file: {missing[:10]} "
                        f"({[per_step.get(s, 0) for s in missing[:10]]} records)")
    partial = [s for s, n in per_step.items() if n != PER_STEP]
    if partial:
        problems.append(f"partial steps in the file: {partial[:10]}")
    return RunResult(child.returncode, reported, dict(per_step), problems)


def table(runs: int) -> Table:
    t = Table(f"Exit with sowtel.jit work in flight: {runs} runs per way of ending",
              ["way of ending", "good runs", "aborts", "steps reported (mean)", "seconds"])
    for how in SCENARIOS:
        good = aborts = reported = 0
        start = time.monotonic()
        first_problem = None
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as logdir:
                r = run_once(how, logdir)
            good += r.ok
            aborts += any(p.startswith("aborted") for p in r.problems)
            reported += r.reported
            first_problem = first_problem or (r.problems[0] if r.problems else None)
        t.add(how, f"{good}/{runs}", str(aborts), f"{reported / runs:.1f}",
              f"{time.monotonic() - start:.0f}")
        if first_problem:
            t.notes.append(f"{how}: {first_problem}")
    return t


def run(quick: bool = False, runs: int | None = None) -> list[Table]:
    """The exit check (``quick``: 3 runs per way of ending, else 50)."""
    return [table(runs or (3 if quick else 50))]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_exit [--quick] [--runs N] [--markdown FILE]``."""
    return module_main(
        argv, "bench_exit", __doc__, lambda args: run(args.quick, args.runs),
        lambda parser: parser.add_argument("--runs", type=int, default=None,
                                           help="runs per way of ending (default 50)"))


if __name__ == "__main__":
    sys.exit(main())
