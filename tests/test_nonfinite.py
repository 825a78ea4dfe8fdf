"""enable(on_nonfinite=..., health_every=..., flight_recorder=...): alerts, health checks and
post-mortems of the step that made a NaN."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel.postmortem import configure_inspect, inspect_dump, run_inspect


def _model(w: jax.Array, x: jax.Array) -> jax.Array:
    def layer(h: jax.Array, wi: jax.Array) -> tuple[jax.Array, None]:
        return sowtel.sow(jnp.tanh(h * wi), "act"), None

    h = jax.lax.scan(layer, x, w)[0]
    return jnp.sum(sowtel.sow(jnp.log(h), "logh"))  # NaN where h < 0


def _step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss, g = jax.value_and_grad(_model)(w, x)
    return w - 0.1 * g, loss


GOOD = jnp.ones(3)
BAD = jnp.array([1.0, -1.0, 1.0])  # a negative activation: log is NaN in one element


def test_raise_at_flush_names_site_mode_step_and_index() -> None:
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", on_nonfinite="raise"):
        w, _ = step(w, GOOD)
        assert sowtel.flush() is True
        w2, _ = step(w, BAD)
        with pytest.raises(sowtel.NonFiniteError) as info:
            sowtel.flush()
        err = info.value
        assert (err.site, err.mode, err.step, err.index) == ("logh", "primal", 1, None)
        assert "site 'logh' (primal) at step 1" in str(err) and "1 NaN" in str(err)
        assert sowtel.flush() is True  # raised once


def test_raise_at_the_next_step_call_before_it_runs() -> None:
    calls = []

    def counted(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _step(w, x)

    step = sowtel.jit(counted)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", on_nonfinite="raise") as session:
        step(w, BAD)
        session.dispatcher.flush(30.0)  # the records are checked (without delivering the alert)
        with pytest.raises(sowtel.NonFiniteError, match="at step 0"):
            calls.append(step(w, GOOD))
        assert calls == []  # the call raised before running
        step(w, GOOD)  # the alert was delivered once: training may go on


def test_warn_and_callable_policies() -> None:
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", on_nonfinite="warn"):
        step(w, BAD)
        with pytest.warns(sowtel.NonFiniteWarning, match="logh"):
            sowtel.flush()
    seen: list[sowtel.Record] = []
    with sowtel.enable(exporter="memory", on_nonfinite=seen.append):
        for x in (GOOD, BAD, BAD, GOOD, BAD):
            step(w, x)
        sowtel.flush()
    # Once an episode (non-finite steps up to the next all-finite one): the first non-finite
    # record of steps 1 and 4, the forward site first; step 2 continues step 1's episode.
    assert [(r.name, r.mode, r.step) for r in seen] == [("logh", "primal", 1),
                                                        ("logh", "primal", 4)]


def test_health_every_step_catches_the_nan_at_its_step() -> None:
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", every=10, health_every=1,
                       on_nonfinite="raise") as session:
        for k in range(12):
            x = BAD if k == 7 else GOOD
            try:
                step(w, x)
            except sowtel.NonFiniteError as err:  # raised by a later call, naming step 7
                assert err.step == 7 and k > 7
                break
        else:
            with pytest.raises(sowtel.NonFiniteError, match="at step 7"):
                sowtel.flush()
        sowtel.flush()
        records = session.exporters[0].records
    kinds = {(r.step, r.summary) for r in records if r.name == "logh" and r.mode == "primal"}
    assert (0, "stats") in kinds and (7, "health") in kinds and (3, "health") in kinds
    at7 = [r for r in records if r.step == 7 and r.name == "logh" and r.mode == "primal"]
    assert at7[0].stats == {"size": 3.0, "nan": 1.0, "posinf": 0.0, "neginf": 0.0}
    # A scanned site's health is per iteration, as its statistics are.
    assert sorted(r.index for r in records if r.step == 3 and r.name == "act"
                  and r.mode == "primal") == [0, 1, 2, 3]


@pytest.mark.parametrize("every", [1, 10])
def test_health_every_step_under_a_host_at_step(every: int) -> None:
    # The README's loop: `with sowtel.at_step(i): step(...)` around a sowtel.jit step. A step
    # at which no site logs still checks every site's health, and the NaN of step 3 is
    # reported as step 3 (it was reported at step 10, the next logging step).
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    raised: list[sowtel.NonFiniteError] = []
    ran: set[int] = set()
    with sowtel.enable(exporter="memory", every=every, health_every=1,
                       on_nonfinite="raise") as session:
        for i in range(12):
            try:
                with sowtel.at_step(i):
                    step(w, BAD if i >= 3 else GOOD)
                ran.add(i)
            except sowtel.NonFiniteError as err:  # raised before the step ran
                raised.append(err)
            if i == 5:  # every record so far checked, the alert delivered at this flush
                try:
                    sowtel.flush()
                except sowtel.NonFiniteError as err:
                    raised.append(err)
        with contextlib.suppress(sowtel.NonFiniteError):
            sowtel.flush()
        records = session.exporters[0].records
    assert [e.step for e in raised] == [3]  # one alert for the episode of steps 3 to 11
    assert "site 'logh' (primal) at step 3" in str(raised[0])
    kinds = {(r.step, r.summary) for r in records if r.name == "logh" and r.mode == "primal"}
    logging_steps = {0, 10} if every == 10 else set(range(12))
    assert kinds == {(k, "stats" if k in logging_steps else "health") for k in ran}
    assert {1, 2, 3, 9} <= ran
    at3 = [r for r in records if r.step == 3 and r.name == "logh" and r.mode == "primal"]
    assert at3[0].stats["nan"] == 1.0


def test_flight_recorder_dump_writes_a_postmortem(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sowtel.enable(exporter="jsonl", logdir=str(tmp_path), on_nonfinite="dump") as s:
            for k in range(5):
                step(w, BAD if k == 3 else GOOD)
            sowtel.flush()
            guard = s.guard
    alerts = [w for w in caught if issubclass(w.category, sowtel.NonFiniteWarning)]
    assert len(alerts) == 1 and "post-mortem in" in str(alerts[0].message)
    folder = tmp_path / "postmortem" / "step_3"
    assert guard.postmortems == [folder]
    dump = folder / "step_3.safetensors"
    inter = sowtel.load(dump)
    # Every site, full values and cotangents: the forward values against a direct computation.
    h = BAD
    for i in range(4):
        h = jnp.tanh(h * w[i])
        np.testing.assert_allclose(inter["act"]["primal"][i], h, rtol=1e-6)
    np.testing.assert_allclose(inter["logh"]["primal"], jnp.log(h), rtol=1e-6)
    assert set(inter["act"]) == {"primal", "cotangent"}
    # sowtel inspect names the first non-finite site in program order: the forward logh.
    report = inspect_dump(dump)
    assert (report.origin.entry.name, report.origin.entry.mode) == ("logh", "primal")
    parser = argparse.ArgumentParser()
    configure_inspect(parser)
    assert run_inspect(parser.parse_args([str(folder)])) == 0
    text = capsys.readouterr().out
    assert "the first in program order is 'logh' (primal)" in text
    assert "first_nonfinite_operation" in text and "log at " in text
    located = json.loads((folder / "locate.json").read_text())
    first = located["events"][0]
    assert (first["primitive"], first["phase"], first["site"]) == ("log", "forward",
                                                                    "act (primal)")
    assert first["file"] == os.path.abspath(__file__) and "log" in (
        folder / "locate.txt").read_text()


def test_flight_recorder_keeps_references_and_skips_donated_arguments() -> None:
    plain = sowtel.jit(_step)
    donating = sowtel.jit(_step, donate_argnums=0)
    x = GOOD
    with sowtel.enable(exporter="memory", flight_recorder=1) as s:
        w = jnp.ones((4, 3))
        plain(w, x)
        kept = s.guard._kept
        assert kept[-1].args[0] is w and kept[-1].args[1] is x  # a reference, no copy
        n = len(kept)
        donating(jnp.ones((4, 3)), x)
        assert len(kept) == n  # donated: not recorded unless asked
        for _ in range(20):
            plain(w, x)
        sowtel.flush()
        plain(w, x)
        # One checked step, and those still on their way: never more than K + 8.
        assert 1 <= len(kept) <= 9
    with sowtel.enable(exporter="memory", flight_recorder=1, record_donated=True) as s:
        w = jnp.ones((4, 3))
        donating(w, x)
        assert s.guard._kept[-1].args[0] is not w  # a copy, made before the call donated w
        np.testing.assert_array_equal(s.guard._kept[-1].args[0], jnp.ones((4, 3)))


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="on_nonfinite='explode' is not a policy"):
        sowtel.enable(exporter="memory", on_nonfinite="explode")
    with pytest.raises(ValueError, match="health_every=0 must be None or an int >= 1"):
        sowtel.enable(exporter="memory", health_every=0)
    with pytest.raises(ValueError, match="flight_recorder=-1"):
        sowtel.enable(exporter="memory", flight_recorder=-1)
    assert not sowtel.status()["enabled"]


def _nan_record(step: int, nan: float = 1.0) -> sowtel.Record:
    return sowtel.Record(name="h", mode="primal", tag="intermediates", step=step, index=None,
                         wall_time=0.0, summary="health", shape=(4,), dtype="float32",
                         stats={"size": 4.0, "nan": nan, "posinf": 0.0, "neginf": 0.0})


def test_a_later_alert_never_replaces_one_not_delivered_yet() -> None:
    from sowtel.nonfinite import make_guard

    # The dispatcher may check episodes 23 and 25 before the training thread's next call:
    # both alerts are delivered, the earlier first (steps 24 and 26 are finite: 25 and 27
    # begin episodes of their own; 28 continues 27's).
    guard = make_guard("warn", None, None, False, None, ("intermediates",))
    guard.observe([_nan_record(23)])
    guard.observe([_nan_record(25), _nan_record(24, nan=0.0), _nan_record(27),
                   _nan_record(26, nan=0.0), _nan_record(28)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sowtel.NonFiniteWarning)
        guard.deliver()
    assert [str(w.message).split(" at step ")[1][:2] for w in caught] == ["23", "25", "27"]
    assert guard.episodes == 3
    # Under "raise", one alert a call, oldest first; the next waits for the next call.
    guard = make_guard("raise", None, None, False, None, ("intermediates",))
    guard.observe([_nan_record(23)])
    guard.observe([_nan_record(24, nan=0.0), _nan_record(25)])
    for step in (23, 25):
        with pytest.raises(sowtel.NonFiniteError) as info:
            guard.deliver()
        assert info.value.step == step
    guard.deliver()  # nothing left


def _dump_run(tmp_path: Path, *, slow: bool, at_step: bool, steps: int = 60,
              **options: object) -> tuple[list[str], list[str], list[str]]:
    """60 cheap steps, NaN from step 10 on, under on_nonfinite="dump" and health every step.
    Returns the post-mortem folders, the NonFiniteWarnings and sowtel's log lines."""
    import logging

    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines()
    logging.getLogger("sowtel").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sowtel.enable(exporter="jsonl", logdir=str(tmp_path), health_every=1,
                               on_nonfinite="dump", **options) as session:
                for i in range(steps):
                    with sowtel.at_step(i) if at_step else contextlib.nullcontext():
                        step(w, BAD if i >= 10 else GOOD)
                    if slow:
                        # A slow loop, made deterministic: every record checked before the
                        # next step, as when each step takes longer than its records' checks.
                        session.dispatcher.flush(60.0)
                sowtel.flush()
                folders = [p.name for p in session.guard.postmortems]
    finally:
        logging.getLogger("sowtel").removeHandler(handler)
    alerts = [str(c.message) for c in caught if issubclass(c.category, sowtel.NonFiniteWarning)]
    return folders, alerts, lines


@pytest.mark.parametrize("at_step", [False, True])
@pytest.mark.parametrize("slow", [False, True])
def test_one_episode_one_alert_one_postmortem_of_its_first_step(
        tmp_path: Path, slow: bool, at_step: bool) -> None:
    folders, alerts, lines = _dump_run(tmp_path, slow=slow, at_step=at_step)
    assert folders == ["step_10"]
    assert sorted(p.name for p in (tmp_path / "postmortem").iterdir()) == ["step_10"]
    assert len(alerts) == 1 and "at step 10" in alerts[0] and "step_10" in alerts[0]
    # No advice to set health_every=1 (it is set), no line a step.
    assert lines == ["sowtel: first non-finite value at step 10 in logh (primal)"]


def test_the_first_bad_step_is_dumped_when_checks_lag_far_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The dispatcher converts each batch late (a loaded host): the steps' records are checked
    # long after the steps ran. The flight recorder holds every step still unchecked (waiting
    # for the checks beyond nonfinite.HOLD of them), so step 10 is still there to dump.
    import time

    from sowtel.session import Session

    convert = Session._convert

    def late(self: Session, items: list[object]) -> object:
        time.sleep(0.05)
        return convert(self, items)

    monkeypatch.setattr(Session, "_convert", late)
    folders, alerts, _ = _dump_run(tmp_path, slow=False, at_step=True, steps=30)
    assert folders == ["step_10"] and len(alerts) == 1


def test_postmortems_are_capped_per_session(tmp_path: Path) -> None:
    # Episodes at steps 1, 3, 5 and 7 (finite steps between): one alert each, and
    # post-mortems of the first max_postmortems=2 episodes only, then one log line.
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sowtel.enable(exporter="jsonl", logdir=str(tmp_path), on_nonfinite="dump",
                           max_postmortems=2) as session:
            for i in range(9):
                step(w, BAD if i % 2 else GOOD)
            sowtel.flush()
            folders = [p.name for p in session.guard.postmortems]
    alerts = [str(c.message) for c in caught if issubclass(c.category, sowtel.NonFiniteWarning)]
    assert folders == ["step_1", "step_3"]
    assert [a.split(" at step ")[1].split(":")[0] for a in alerts] == ["1", "3", "5", "7"]
    assert ["post-mortem in" in a for a in alerts] == [True, True, False, False]
    with pytest.raises(ValueError, match="max_postmortems=-1 must be an int >= 0"):
        sowtel.enable(exporter="memory", on_nonfinite="dump", max_postmortems=-1)


def test_the_earliest_alert_wins_whatever_path_it_came_by(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    # A NaN streamed at step 5 is checked when the dispatcher converts it (held back here
    # until the export is done); one sowtel.export-ed at step 30 is noticed at once. Step 5
    # must still be the first non-finite, and the first NonFiniteError; step 30's comes after.
    import threading

    from sowtel.session import Session

    gate = threading.Event()
    convert = Session._convert

    def gated(self: Session, items: list[object]) -> object:
        gate.wait(60.0)
        return convert(self, items)

    monkeypatch.setattr(Session, "_convert", gated)
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", on_nonfinite="raise") as session:
        with sowtel.at_step(5):
            step(w, BAD)
        sowtel.export({"late": {"primal": np.array([1.0, np.nan])}}, step=30)
        assert session.status()["first_nonfinite"] == (30, "late", "primal")
        gate.set()
        with pytest.raises(sowtel.NonFiniteError) as first:
            sowtel.flush()
        assert (first.value.step, first.value.site) == (5, "logh")
        assert session.status()["first_nonfinite"] == (5, "logh", "primal")
        with pytest.raises(sowtel.NonFiniteError) as second:
            sowtel.flush()
        assert (second.value.step, second.value.site) == (30, "late")
        assert sowtel.flush() is True


def test_episodes_on_the_callback_transport() -> None:
    # enable() + jax.jit: the same rule, one alert a failure episode (steps 1-2, then 4).
    step = jax.jit(_step)
    w = jnp.ones((4, 3))
    seen: list[sowtel.Record] = []
    with sowtel.enable(exporter="memory", on_nonfinite=seen.append):
        for i, x in enumerate((GOOD, BAD, BAD, GOOD, BAD)):
            with sowtel.at_step(i):
                step(w, x)
        sowtel.flush()
    assert [(r.name, r.step) for r in seen] == [("logh", 1), ("logh", 4)]


def test_a_step_whose_records_come_in_several_batches_continues_its_episode() -> None:
    from sowtel.nonfinite import make_guard

    # Host callbacks deliver a step's records in several batches: the finite first part of
    # step 2 must not end the episode that step 1 began; steps 3 and 4, all finite, do.
    seen: list[sowtel.Record] = []
    guard = make_guard(seen.append, None, None, False, None, ("intermediates",))
    for step, nan in ((1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0), (3, 0.0), (4, 0.0), (5, 1.0),
                      (6, 1.0)):
        guard.observe([_nan_record(step, nan=nan)])
    assert [r.step for r in seen] == [1, 5] and guard.episodes == 2


def test_the_flight_recorder_waits_for_checks_once_then_lets_go(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A dispatcher that never checks (its conversion blocked): the call beyond HOLD unchecked
    # steps waits HOLD_TIMEOUT once, says so once, and the calls after it never wait.
    import threading
    import time

    from sowtel import nonfinite
    from sowtel.session import Session

    gate = threading.Event()
    convert = Session._convert

    def blocked(self: Session, items: list[object]) -> object:
        gate.wait(60.0)
        return convert(self, items)

    monkeypatch.setattr(Session, "_convert", blocked)
    monkeypatch.setattr(nonfinite, "HOLD_TIMEOUT", 2.0)
    step = sowtel.jit(_step)
    w = jnp.ones((4, 3))
    with sowtel.enable(exporter="memory", flight_recorder=1) as session:
        step(w, GOOD)  # compiled before timing
        took = []
        for _ in range(nonfinite.HOLD + 4):
            t = time.perf_counter()
            step(w, GOOD)
            took.append(time.perf_counter() - t)
        assert sum(t >= 2.0 for t in took) == 1  # one wait, of HOLD_TIMEOUT
        assert len(session.guard._kept) <= nonfinite.HOLD + 1
        gate.set()
    said = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and "without waiting" in said[0]


def test_every_path_asks_the_one_non_finite_rule() -> None:
    """Guard, exporters, trackers, post-mortem rows and the plugin's count tags agree on what
    is non-finite, odd records included: only -inf, a count that is itself NaN (a damaged
    record), a bfloat16 full value, and a healthy record."""
    import io

    import ml_dtypes

    from sowtel.dumps import DumpEntry
    from sowtel.exporters._tracker import StepMetrics
    from sowtel.exporters.console import ConsoleExporter
    from sowtel.postmortem import EntryStats
    from sowtel.records import NONFINITE_KINDS, Record, is_nonfinite, nonfinite_count
    from sowtel.tensorboard_plugin import _COUNT_TAG
    from sowtel.to_records import RecordBatch, first_nonfinite

    def rec(stats, value=None, dtype="float32"):
        return Record(name="h", mode="primal", tag="t", step=3, index=None, wall_time=0.0,
                      summary="full" if value is not None else "stats", shape=(2,),
                      dtype=dtype, value=value, stats=stats)

    base = {"size": 2.0, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "l2": 1.4,
            "mean_abs": 1.0, "zeros": 0.0}
    cases = [
        (rec({**base, "nan": 0.0, "posinf": 0.0, "neginf": 2.0}), 2),
        (rec({**base, "nan": float("nan"), "posinf": 0.0, "neginf": 0.0}), 1),
        (rec({}, np.array([1.0, np.inf], ml_dtypes.bfloat16), "bfloat16"), None),
        (rec({**base, "nan": 0.0, "posinf": 0.0, "neginf": 0.0}), 0),
    ]
    for r, count in cases:
        bad = count is None or count > 0
        assert is_nonfinite(r) is bad
        if count is not None:
            assert nonfinite_count(r.stats) == r.nonfinite == count
            entry = DumpEntry("h", "h", "primal", (), (2,), "float32", "h::primal")
            assert EntryStats(entry, r.stats).nonfinite == count
        assert (first_nonfinite(RecordBatch([(r,)])) is not None) is bad
        out = io.StringIO()
        ConsoleExporter(out).write([r])
        assert ("NONFINITE" in out.getvalue()) is bad
        # A tracker writes a series' counts from its first non-finite record on.
        [batch] = StepMetrics().convert([r])
        assert any(k.endswith("/neginf") for k in batch.scalars) is bad
    # The plugin finds count series by the same kinds.
    assert [bool(_COUNT_TAG.match(f"h/primal/{k}")) for k in (*NONFINITE_KINDS, "zeros")] == [
        True, True, True, False]
