"""Startup of ``sowtel.jit``: what is traced and compiled, and where.

- a function's logging program is traced once per (function, settings, shapes): a second
  ``sowtel.jit`` of it, or a new session with the same settings, traces nothing again;
- with ``every=N`` the plain program is traced and compiled in a background thread while the
  first logging step runs; steps that log nothing meanwhile run the logging program (no step
  waits for the compilation), and the first step after it uses the plain program;
- with JAX's persistent compilation cache, a second process compiles nothing (JAX's own
  cache-hit and cache-miss events, counted in a fresh process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax.numpy as jnp

import sowtel

ROOT = Path(__file__).resolve().parents[1]


def _counting_step() -> tuple[object, list[str]]:
    traced_in: list[str] = []

    def step(w, x):
        traced_in.append(threading.current_thread().name)
        h = sowtel.sow(jnp.tanh(x @ w), "h")
        return (h ** 2).sum()

    return step, traced_in


def test_logging_program_traced_once_per_function_settings_and_shapes() -> None:
    step, traced_in = _counting_step()
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with sowtel.enable(exporter="memory") as session:
        for _ in range(3):
            sowtel.jit(step)(w, x)  # a new sowtel.jit of the same function each call
        sowtel.flush()
    assert len(traced_in) == 1
    # Each sowtel.jit counts its own calls: three first calls.
    assert [r.step for r in session.exporters[0].records] == [0, 0, 0]
    with sowtel.enable(exporter="memory") as session:  # same settings, a new session
        sowtel.jit(step)(w, x)
        sowtel.flush()
    assert len(traced_in) == 1
    assert len(session.exporters[0].records) == 1
    with sowtel.enable(exporter="memory") as session:
        sowtel.jit(step)(w, jnp.ones((5, 3)))  # new shapes: traced again
        sowtel.flush()
    assert len(traced_in) == 2
    assert session.exporters[0].records[0].shape == (5, 2)


def test_every_n_compiles_the_plain_program_in_the_background() -> None:
    step, traced_in = _counting_step()
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    jitted = sowtel.jit(step)
    with sowtel.enable(exporter="memory", every=3) as session:
        losses = [float(jitted(w, x)) for _ in range(4)]
        sowtel.flush()
    # One trace of the logging program (no separate discovery trace), in this thread; one of
    # the plain program, in the background compile thread; none after.
    assert sorted(traced_in) == sorted([threading.current_thread().name, "sowtel-compile"])
    assert [r.step for r in session.exporters[0].records] == [0, 3]
    assert losses == [losses[0]] * 4 == [float(((jnp.tanh(x @ w)) ** 2).sum())] * 4


_WORKER = """
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
import jax.numpy as jnp, sowtel

@sowtel.jit
def step(w, x):
    h = sowtel.sow(jnp.tanh(x @ w), "h")
    return (h ** 2).sum()

w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
with sowtel.enable(exporter="memory", every=2) as session:
    for _ in range(3):
        step(w, x)
    sowtel.flush()
import threading
for t in threading.enumerate():  # the plain program compiles in the background: let it end
    if t.name == "sowtel-compile":
        t.join(120)
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "steps": [r.step for r in session.exporters[0].records]}))
"""


def test_second_process_with_persistent_cache_compiles_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cache = tmp_path / "jax-cache"

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", _WORKER, str(cache)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run()
    assert first["misses"] >= 2 and first["steps"] == [0, 2]  # the logging and plain programs
    second = run()
    assert second == {"hits": first["misses"], "misses": 0, "steps": [0, 2]}


def test_background_compile_with_donated_arguments() -> None:
    traced_in: list[str] = []

    def step(w, x):
        traced_in.append(threading.current_thread().name)
        h = sowtel.sow(jnp.tanh(x @ w), "h")
        return w * 0.5, (h ** 2).sum()

    jitted = sowtel.jit(step, donate_argnums=0)
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", every=2) as session:
        for _ in range(4):
            w, loss = jitted(w, x)
        sowtel.flush()
    assert sorted(traced_in) == sorted([threading.current_thread().name, "sowtel-compile"])
    assert float(w[0, 0]) == 0.5 ** 4
    assert float(loss) == float((jnp.tanh(x @ jnp.full((3, 2), 0.5 ** 3)) ** 2).sum())
    assert [(r.step, r.stats["max"]) for r in session.exporters[0].records] == [
        (0, float(jnp.tanh(3.0))), (2, float(jnp.tanh(3 * 0.25)))]


def test_steps_that_log_nothing_do_not_wait_for_the_plain_compile() -> None:
    # The plain program's trace, in the compile thread, is held until this test releases it:
    # steps 1 and 2 (every=3 logs at 0 and 3) must return meanwhile, run by the logging
    # program already compiled, with their results and no records. Had they waited, the
    # compile thread would time out after 60 s, which the test reports.
    release = threading.Event()
    held: list[bool] = []
    traced_in: list[str] = []

    def step(w, x):
        traced_in.append(threading.current_thread().name)
        if threading.current_thread().name == "sowtel-compile":
            held.append(release.wait(60))
        h = sowtel.sow(jnp.tanh(x @ w), "h")
        return w * 0.5, (h ** 2).sum()

    def compiling() -> bool:
        return any(t.name == "sowtel-compile" and t.is_alive() for t in threading.enumerate())

    jitted = sowtel.jit(step, donate_argnums=0)
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    losses = []
    with sowtel.enable(exporter="memory", every=3) as session:
        for _ in range(3):
            w, loss = jitted(w, x)
            losses.append(float(loss))
        assert compiling() and not release.is_set()
        release.set()
        for _ in range(2):
            w, loss = jitted(w, x)
            losses.append(float(loss))
        for t in threading.enumerate():  # then the plain program, once it is ready
            if t.name == "sowtel-compile":
                t.join(60)
        assert not compiling()
        w, loss = jitted(w, x)
        losses.append(float(loss))
        sowtel.flush()
    assert held == [True]
    assert sorted(traced_in) == sorted([threading.current_thread().name, "sowtel-compile"])
    assert float(w[0, 0]) == 0.5 ** 6
    assert losses == [float((jnp.tanh(x @ jnp.full((3, 2), 0.5 ** k)) ** 2).sum())
                      for k in range(6)]
    assert [(r.step, r.stats["max"]) for r in session.exporters[0].records] == [
        (0, float(jnp.tanh(3.0))), (3, float(jnp.tanh(3 * 0.125)))]


_EXITING = """
import json, threading
import jax.numpy as jnp, sowtel
from sowtel import _exit

traced_in = []

@sowtel.jit
def step(w, x):
    traced_in.append(threading.current_thread().name)
    return (sowtel.sow(jnp.tanh(x @ w), "h") ** 2).sum()

w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
with sowtel.enable(exporter="memory", every=2) as session:
    _exit.FETCHES.close(timeout=60.0)  # what interpreter exit does first
    losses = [float(step(w, x)) for _ in range(3)]
print(json.dumps({"traced_in": traced_in, "losses": losses,
                  "compiling": [t.name for t in threading.enumerate()
                                if t.name == "sowtel-compile"]}))
"""


def test_no_program_is_compiled_ahead_once_exit_has_begun() -> None:
    # A compile thread that comes back from XLA while Python finalizes aborts the process:
    # once exit has closed the gate, the plain program compiles on the calling thread instead.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _EXITING], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["traced_in"] == ["MainThread", "MainThread"]  # logging, then plain program
    assert out["compiling"] == []
    assert out["losses"] == [out["losses"][0]] * 3
