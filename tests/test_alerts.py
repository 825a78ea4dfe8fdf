"""Alert rules (``sowtel.alert``, ``enable(alerts=..., on_alert=...)``) against the loop users
write: logged losses, sites' statistics through ``sowtel.jit`` and the callback transport, a
scanned layer stack, and each action."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel.alerts import Alert, AlertRule, _Window, alert


def test_the_window_gives_numpys_median_and_mad():
    rng = np.random.default_rng(0)
    for size in (2, 3, 7, 8, 100):
        window = _Window(size)
        for k in range(3 * size):
            # Repeats and ties included: a flat stretch, then noise, then integers.
            x = 1.0 if k < size // 2 else (float(rng.integers(0, 4)) if k % 3 else
                                           float(rng.normal()))
            window.push(x)
            values = np.array(list(window.order))
            median = float(np.median(values))
            assert window.median() == pytest.approx(median, abs=1e-12)
            assert window.mad(median) == pytest.approx(
                float(np.median(np.abs(values - median))), abs=1e-12)
            assert len(window) == min(k + 1, size)


def _log_run(values, rules, **options):
    seen: list[Alert] = []
    with sowtel.enable(exporter="memory", alerts=rules, on_alert=seen.append, **options):
        for step, v in enumerate(values):
            sowtel.log({"train/loss": float(v)}, step=step)
        assert sowtel.flush(timeout=30)
        status = sowtel.status()
    return seen, status


def _decaying(steps, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    clean = 0.2 + 2.0 * np.exp(-t / 300.0)
    return clean * (1.0 + 0.01 * rng.normal(size=steps))


def test_no_false_alert_over_a_thousand_steps_of_a_decaying_noisy_loss():
    seen, status = _log_run(_decaying(1000), [alert("train/loss", spike=6.0, window=100)])
    assert seen == [] and status["alerts"] == 0


def test_a_tenfold_spike_in_a_logged_loss_fires_at_its_step():
    values = _decaying(400, seed=1)
    values[250] *= 10.0
    seen, status = _log_run(values, [alert("train/loss", spike=6.0, window=100)])
    assert [(a.name, a.step, a.kind) for a in seen] == [("train/loss", 250, "spike")]
    [a] = seen
    assert a.value == pytest.approx(values[250]) and a.stat == "value"
    window = values[150:250]
    assert a.median == pytest.approx(float(np.median(window)))
    assert a.deviation == pytest.approx(
        1.4826 * float(np.median(np.abs(window - np.median(window)))))
    assert status["alerts"] == 1
    assert "alert at step 250" in str(a) and "'train/loss'" in str(a)


def test_the_first_steps_need_a_history_before_a_spike_can_fire():
    # 1, 2, 4, ... doubles each step: every value is far from its predecessors' median.
    seen, _ = _log_run([2.0 ** k for k in range(20)], [alert("train/loss", spike=3.0)])
    assert seen == []
    seen, _ = _log_run([2.0 ** k for k in range(21)], [alert("train/loss", spike=3.0)])
    assert [a.step for a in seen] == [20]
    seen, _ = _log_run([1.0] * 20 + [1.0 + 1e-3], [alert("train/loss", spike=3.0)])
    assert [a.step for a in seen] == [20]  # a flat history: any real change is a spike
    seen, _ = _log_run([1.0] * 3 + [5.0], [alert("train/loss", spike=3.0, window=3)])
    assert [a.step for a in seen] == [3]  # a window smaller than 20 needs that many values


def test_one_alert_per_episode_and_it_rearms():
    values = [1.0, 5.0, 6.0, 7.0, 1.0, 1.0, 8.0, 0.1]
    seen, status = _log_run(values, [alert("train/loss", above=4.0, below=0.5)])
    assert [(a.step, a.kind) for a in seen] == [(1, "above"), (6, "above"), (7, "below")]
    assert status["alerts"] == 3


def test_bad_rules_name_the_argument_and_the_rule():
    cases = [
        (dict(), "no bound"),
        (dict(spike=6.0, window=1), "window=1 must be an int >= 2"),
        (dict(spike=0.0), "spike=0.0 must be > 0"),
        (dict(above=1.0, stat="median"), "stat='median' is not a statistic"),
        (dict(above=1.0, mode="forward"), "mode='forward' is not a mode"),
        (dict(above=1.0, action="page"), "action='page' is not an action"),
        (dict(above=math.inf), "above=inf must be finite"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            alert("train/loss", **kwargs)
    for pattern in ("train loss", "/abs", "a//b", ""):
        with pytest.raises(ValueError, match="pattern"):
            alert(pattern, above=1.0)
    with pytest.raises(ValueError, match="must be a list of sowtel.alert"):
        sowtel.enable(exporter="memory", alerts=["train/loss"])
    with pytest.raises(ValueError, match="on_alert='page' is not an action"):
        sowtel.enable(exporter="memory", alerts=[alert("x", above=1.0)], on_alert="page")
    assert not sowtel.status()["enabled"]  # nothing was left enabled by the refusals


def _mlp_step(grow_at: int):
    """A sowtel.jit step whose hidden cotangent's l2 grows 1000x at step ``grow_at``."""
    def loss(w, x, scale):
        h = sowtel.sow(jnp.tanh(x @ w), "mlp/h", every=1)
        return jnp.sum(h * scale)

    @sowtel.jit
    def step(w, x, k):
        scale = jnp.where(k == grow_at, 1000.0, 1.0)
        return w - 1e-3 * jax.grad(loss)(w, x, scale)

    return step


@pytest.mark.parametrize("transport", ["sowtel.jit", "callback"])
def test_an_exploding_gradient_l2_is_caught_at_its_step(transport):
    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32) * 0.3
    x = jnp.ones((3, 4), jnp.float32)
    step = _mlp_step(13)
    if transport == "callback":
        step = jax.jit(step.__wrapped__)
    rule = alert("mlp/*", mode="cotangent", stat="l2", above=100.0)
    seen: list[Alert] = []
    # every=10 for the session; the watched site streams every step (its own every=1).
    with sowtel.enable(exporter="memory", every=10, health_every=1, alerts=[rule],
                       on_alert=seen.append):
        for k in range(20):
            with sowtel.at_step(k):
                w = step(w, x, k)
        assert sowtel.flush(timeout=60)
    assert [(a.name, a.mode, a.step, a.kind) for a in seen] == [
        ("mlp/h", "cotangent", 13, "above")]
    assert seen[0].value == pytest.approx(1000.0 * math.sqrt(24.0), rel=1e-5)


def test_a_scanned_layer_stack_alerts_name_the_layer():
    def layer(h, w):
        return sowtel.sow(jnp.tanh(h @ w), "blocks/h"), None

    @sowtel.jit
    def forward(ws, x):
        return jax.lax.scan(layer, x, ws)[0].sum()

    ws = jnp.stack([jnp.eye(4) * (50.0 if i == 3 else 0.5) for i in range(6)])
    seen: list[Alert] = []
    rule = alert("blocks/*", stat="max", above=0.99)
    with sowtel.enable(exporter="memory", alerts=[rule], on_alert=seen.append):
        forward(ws, jnp.ones((2, 4)))
        assert sowtel.flush(timeout=60)
    # Layer 3 saturates tanh; the layers after it shrink again (0.5 * tanh(...)).
    assert [(a.name, a.index, a.stat) for a in seen] == [("blocks/h", 3, "max")]


def test_raise_warn_and_nonfinite_errors_are_alert_errors():
    assert issubclass(sowtel.NonFiniteError, sowtel.AlertError)
    with sowtel.enable(exporter="memory", alerts=[alert("train/loss", above=1.0)],
                       on_alert="raise"):
        sowtel.log({"train/loss": 0.5}, step=0)
        with pytest.raises(sowtel.AlertError, match="alert at step 1") as err:
            sowtel.log({"train/loss": 2.0}, step=1)
        assert err.value.alert.step == 1 and err.value.alert.kind == "above"
        sowtel.flush()  # delivered once: nothing left to raise
    rule = alert("train/loss", above=1.0, action="warn")  # a rule's own action wins
    with sowtel.enable(exporter="memory", alerts=[rule], on_alert="raise"):
        with pytest.warns(sowtel.AlertWarning, match="alert at step 3"):
            sowtel.log({"train/loss": 2.0}, step=3)


def test_raise_reaches_the_next_sowtel_jit_call():
    step = _mlp_step(2)
    w = jnp.ones((4, 8), jnp.float32) * 0.1
    x = jnp.ones((3, 4), jnp.float32)
    rule = alert("mlp/h", mode="cotangent", stat="l2", above=100.0)
    with sowtel.enable(exporter="memory", alerts=[rule], on_alert="raise") as session:
        for k in range(3):
            w = step(w, x, k)
        # The dispatcher judges step 2's records off the training thread: wait until it has
        # (by its counter, not by time), then the next call raises before it runs.
        assert session.dispatcher.flush(60.0)
        assert sowtel.status()["alerts"] == 1
        with pytest.raises(sowtel.AlertError) as err:
            step(w, x, 3)
        assert err.value.alert.step == 2
        assert sowtel.flush(timeout=60)  # delivered once


def test_dump_writes_the_post_mortem_of_the_alerting_step(tmp_path: Path):
    step = _mlp_step(4)
    w = jnp.ones((4, 8), jnp.float32) * 0.1
    x = jnp.ones((3, 4), jnp.float32)
    rule = alert("mlp/h", mode="cotangent", stat="l2", above=100.0, action="dump")
    with sowtel.enable(exporter="jsonl", logdir=str(tmp_path), alerts=[rule]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k in range(6):
                w = step(w, x, k)
                sowtel.flush(timeout=60)  # judged and delivered at each step: a slow loop
    found = [w for w in caught if issubclass(w.category, sowtel.AlertWarning)]
    assert len(found) == 1 and "post-mortem in" in str(found[0].message)
    folder = tmp_path / "postmortem" / "step_4"
    dumped = sowtel.load(str(folder / "step_4.safetensors"))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(dumped["mlp/h"]["cotangent"])),
                               1000.0 * math.sqrt(24.0), rtol=1e-5)


def test_a_rule_is_a_frozen_dataclass_that_prints_as_it_was_made():
    rule = alert("blocks/*", mode="cotangent", stat="l2", above=1e3)
    assert isinstance(rule, AlertRule)
    assert str(rule) == "alert('blocks/*', mode='cotangent', stat='l2', above=1000.0)"
    with pytest.raises(AttributeError):
        rule.above = 1.0  # type: ignore[misc]


def test_alerts_reach_the_exporters_where_users_look(tmp_path: Path):
    """An exploding gradient through ``sowtel.jit`` (the README's loop, ``every=10``): its
    alert is a line of TensorBoard's Text tab (read back with TensorBoard's own loader), a span
    event on the step's OpenTelemetry span (the SDK's own exporter), a console line and an
    entry of the memory exporter's ``alerts``, behind the records of its step."""
    import io

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tensorboard.backend.event_processing import event_accumulator

    from sowtel.exporters.console import ConsoleExporter
    from sowtel.exporters.memory import MemoryExporter
    from sowtel.exporters.otel import RULE_ALERT_EVENT_NAME, OTelExporter
    from sowtel.exporters.tensorboard import RULE_ALERT_TAG, TensorBoardExporter

    w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32) * 0.3
    x = jnp.ones((3, 4), jnp.float32)
    step = _mlp_step(13)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    memory, console = MemoryExporter(), io.StringIO()
    exporters = [memory, ConsoleExporter(console), TensorBoardExporter(tmp_path / "tb"),
                 OTelExporter(tracer_provider=provider)]
    rules = [alert("mlp/*", mode="cotangent", stat="l2", above=100.0)]
    with sowtel.enable(exporter=exporters, every=10, health_every=1, alerts=rules,
                       on_alert=lambda found: None):
        for k in range(20):
            with sowtel.at_step(k):
                w = step(w, x, k)
        assert sowtel.flush(timeout=60)
    [found] = memory.alerts
    assert (found.step, found.name, found.mode, found.stat) == (13, "mlp/h", "cotangent", "l2")
    line = str(found)
    assert line.startswith("alert at step 13: 'mlp/h' (cotangent) l2 = 4898.98, above 100;")
    # The memory exporter got the alert after the records it was judged on.
    assert any(r.step == 13 and r.name == "mlp/h" and r.mode == "cotangent"
               for r in memory.records)
    assert [ln for ln in console.getvalue().splitlines() if "ALERT" in ln] == [
        f"[sowtel] ALERT {line}"]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={
        event_accumulator.TENSORS: 0})
    acc.Reload()
    [text] = acc.Tensors(f"{RULE_ALERT_TAG}/text_summary")
    assert (text.step, text.tensor_proto.string_val) == (13, [f"- {line}".encode()])
    events = [(span.attributes["sowtel.step"], event) for span in spans.get_finished_spans()
              for event in span.events if event.name == RULE_ALERT_EVENT_NAME]
    assert len(events) == 1
    span_step, event = events[0]
    assert span_step == 13 and dict(event.attributes) == {
        "sowtel.name": "mlp/h", "sowtel.mode": "cotangent", "sowtel.step": 13,
        "sowtel.alert.stat": "l2", "sowtel.alert.value": pytest.approx(1000.0 * math.sqrt(24)),
        "sowtel.alert.kind": "above", "sowtel.alert.rule": str(rules[0]),
        "sowtel.alert.text": line}
