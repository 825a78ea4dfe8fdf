"""What a newcomer meets first: the default exporter, sowtel.log, the CLI's small answers, dumps'
permissions, and the warning for a session stacked by re-running ``enable()``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

import sowtel
from sowtel.cli import main
from sowtel.exporters.memory import MemoryExporter
from sowtel.exporters.tensorboard import LAYOUT_TAG, LOG_CATEGORY
from sowtel.records import LOG_TAG, SCALAR_SUMMARY

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(autouse=True)
def no_session_left():
    yield
    while sowtel.status()["enabled"]:
        sowtel.disable()


def load(run_dir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(os.fspath(run_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def test_bare_enable_streams_to_tensorboard_under_runs_and_says_where(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(tmp_path)
    f = jax.jit(lambda x: sowtel.sow(x * 2.0, "y").sum())
    session = sowtel.enable()
    f(jnp.arange(4.0))
    sowtel.disable()
    [run] = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run.name), run.name
    assert [type(e).__name__ for e in session.exporters] == ["TensorBoardExporter"]
    [event] = load(run).Scalars("y/primal/mean")
    assert (event.step, event.value) == (0, 3.0)  # mean of 2 * [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("sowtel: streaming to TensorBoard") == 1
    assert f"in {run}; view it with: sowtel dashboard --logdir runs" in err


def test_enable_with_a_logdir_names_that_run_in_the_dashboard_command(tmp_path, capsys):
    with sowtel.enable(logdir=tmp_path / "exp 1"):
        pass
    err = capsys.readouterr().err
    assert f"sowtel dashboard --logdir '{tmp_path / 'exp 1'}'" in err
    with sowtel.enable(exporter="memory"):
        pass
    assert "TensorBoard" not in capsys.readouterr().err  # only TensorBoard runs are announced


def test_log_sends_host_scalars_as_records_of_their_own_kind():
    with sowtel.enable(exporter="memory") as session:
        assert sowtel.log({"train/loss": 0.5, "lr": np.float32(0.25), "step_ok": True,
                           "acc": jnp.asarray(0.75), "n": 3, "bad": float("nan")}, step=7) == 6
        sowtel.flush()
        records = session.exporters[0].records
    got = {r.name: r.stats["value"] for r in records}
    assert got.keys() == {"train/loss", "lr", "step_ok", "acc", "n", "bad"}
    assert [got[k] for k in ("train/loss", "lr", "step_ok", "acc", "n")] == [
        0.5, 0.25, 1.0, 0.75, 3.0]
    assert np.isnan(got["bad"])  # kept, not dropped
    r = records[0]
    assert (r.summary, r.tag, r.mode, r.step, r.shape, r.index) == (
        SCALAR_SUMMARY, LOG_TAG, "primal", 7, (), None)


def test_log_rejects_bad_input_with_the_rule_and_needs_a_session():
    with pytest.raises(RuntimeError, match=r"call sowtel.enable\(...\) first"):
        sowtel.log({"loss": 1.0}, step=0)
    with sowtel.enable(exporter="memory") as session:
        with pytest.raises(ValueError, match=r"'a b' has the character\(s\) ' '"):
            sowtel.log({"a b": 1.0}, step=0)
        with pytest.raises(ValueError, match=r"scalars\['x'\]='high' is not a number"):
            sowtel.log({"x": "high"}, step=0)
        with pytest.raises(ValueError, match=r"scalars\['v'\]=.* is not a number: .* 0-d array"):
            sowtel.log({"v": np.ones(2)}, step=0)
        with pytest.raises(ValueError, match=r"scalars\['c'\]=\(1\+2j\) is not a number"):
            sowtel.log({"c": 1 + 2j}, step=0)
        with pytest.raises(TypeError, match=r"is a list, not a dict of name -> number"):
            sowtel.log([("loss", 1.0)], step=0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"sowtel.log step=1.5 must be an int"):
            sowtel.log({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]
        sowtel.flush()
        assert session.exporters[0].records == []  # a rejected call sends nothing at all


def test_logged_scalars_are_plain_tensorboard_tags_in_the_sows_run(tmp_path):
    f = jax.jit(lambda x: sowtel.sow(x + 1.0, "h").sum())
    with sowtel.enable(logdir=tmp_path):
        for step in range(3):
            with sowtel.at_step(step):
                f(jnp.zeros(2))
            sowtel.log({"loss": 1.0 / (step + 1), "eval/accuracy": 0.5 + step / 10}, step=step)
    acc = load(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [e.value for e in acc.Scalars("eval/accuracy")] == pytest.approx([0.5, 0.6, 0.7])
    assert [e.value for e in acc.Scalars("h/primal/mean")] == [1.0, 1.0, 1.0]
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors(LAYOUT_TAG)[-1].tensor_proto.string_val[0])
    first = layout.category[0]
    assert first.title == LOG_CATEGORY
    assert [(c.title, list(c.multiline.tag)) for c in first.chart] == [
        ("eval/accuracy", [r"^eval/accuracy$"]), ("loss", ["^loss$"])]


def test_enable_twice_without_with_warns_and_a_scoped_one_does_not():
    first = sowtel.enable(exporter="memory")
    with pytest.warns(RuntimeWarning, match=r"Session\(id=\d+.* is still active, so the new "
                      r"session stacks on it.*call sowtel.disable\(\) first"):
        second = sowtel.enable(exporter="memory")
    sowtel.disable()
    assert sowtel.status()["session"] == first.id  # stacked, as warned: the first resumes
    assert second.status()["enabled"] is False
    sowtel.disable()
    with sowtel.enable(exporter="memory"), warnings.catch_warnings():
        warnings.simplefilter("error")
        with sowtel.enable(exporter="memory"):  # nested scopes are deliberate
            pass


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"sowtel {sowtel.__version__}"


def test_dashboard_warns_about_a_logdir_that_does_not_exist(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "sowtel.cli", "dashboard", "--logdir", "typo-dir", "--port", port],
        cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed before TensorBoard starts
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert line.startswith("sowtel dashboard: warning: --logdir 'typo-dir' does not exist ("
                           f"{tmp_path / 'typo-dir'})"), line


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_dump_files_get_the_umask_permissions(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = sowtel.dump({"h": {"primal": np.ones(3)}}, tmp_path / "d.safetensors")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask
    np.testing.assert_array_equal(sowtel.load(path)["h"]["primal"], np.ones(3))


def test_memory_exporter_is_still_what_tests_and_notebooks_name():
    with sowtel.enable(exporter="memory") as session:
        assert isinstance(session.exporters[0], MemoryExporter)


def run_system_deps(tmp_path, *, uid: int, apt: bool, have: tuple[str, ...] = ()):
    """tests/system-deps.sh with a PATH of stand-ins: ``id``, and ``apt-get`` that records its
    arguments instead of installing (the real one would change this machine)."""
    bin_dir = tmp_path / f"bin-{uid}-{apt}-{len(have)}"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    stubs = {"id": f"echo {uid}"} | {name: "true" for name in have}
    if apt:
        stubs["apt-get"] = f'echo "$@" >> {log}'
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = Path(__file__).parent / "system-deps.sh"
    out = subprocess.run(["/bin/bash", str(script)], env={"PATH": str(bin_dir)},
                         capture_output=True, text=True, timeout=60)
    return out, (log.read_text().splitlines() if log.exists() else [])


def test_system_deps_installs_what_is_missing_as_root_with_apt(tmp_path):
    out, apt_calls = run_system_deps(tmp_path, uid=0, apt=True, have=("chromium",))
    assert out.returncode == 0, out.stderr
    assert apt_calls == ["update -qq", "install -y -qq --no-install-recommends prometheus"]


def test_system_deps_does_nothing_when_everything_is_there(tmp_path):
    out, apt_calls = run_system_deps(tmp_path, uid=0, apt=True, have=("chromium", "prometheus"))
    assert (out.returncode, out.stderr, apt_calls) == (0, "", [])


def test_system_deps_stops_with_the_command_to_run_when_it_cannot_install(tmp_path):
    out, apt_calls = run_system_deps(tmp_path, uid=1000, apt=True)
    assert out.returncode == 1 and apt_calls == []
    assert ("Run:  sudo apt-get install -y --no-install-recommends prometheus chromium"
            in out.stderr)
    out, _ = run_system_deps(tmp_path, uid=1000, apt=False)
    assert out.returncode == 1
    assert "need prometheus chromium" in out.stderr and "brew install prometheus" in out.stderr


def test_logged_scalars_reach_jsonl_console_and_opentelemetry(tmp_path, capsys):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sowtel.exporters.jsonl import read_records

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    with sowtel.enable(exporter=["jsonl", "console", "otel"], logdir=tmp_path,
                       tracer_provider=tracer_provider, meter_provider=MeterProvider()):
        sowtel.log({"train/loss": 0.25}, step=3)
    [record] = read_records(tmp_path / "records.jsonl")
    assert (record.name, record.step, record.summary, record.stats) == (
        "train/loss", 3, SCALAR_SUMMARY, {"value": 0.25})
    assert "step     3  train/loss primal" in capsys.readouterr().out
    [span] = spans.get_finished_spans()
    [event] = span.events
    assert (event.attributes["sowtel.name"], event.attributes["sowtel.stat.value"],
            event.attributes["sowtel.tag"]) == ("train/loss", 0.25, LOG_TAG)
