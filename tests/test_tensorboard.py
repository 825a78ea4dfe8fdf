"""The TensorBoard exporter, read back with TensorBoard's own event loader."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from reference import numpy_stats
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.plugins.custom_scalar import layout_pb2

from sowtel.exporters import resolve
from sowtel.exporters.tensorboard import (
    ALERT_TAG,
    COUNT_STATS,
    DEFAULT_STATS_BY_MODE,
    LAYOUT_TAG,
    TensorBoardExporter,
)
from sowtel.records import STAT_KEYS, Record
from sowtel.summaries import host_summary

REPO = Path(__file__).resolve().parents[1]
UNLIMITED = {ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0, ea.COMPRESSED_HISTOGRAMS: 0}


def load(run_dir: str | os.PathLike[str]) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(os.fspath(run_dir), size_guidance=UNLIMITED)
    acc.Reload()
    return acc


def record(name: str, step: int, *, mode: str = "primal", index=None, summary: str = "stats",
           x: np.ndarray | None = None, stats=None, histogram=None, wall_time: float = 1e9,
           process_index: int = 0) -> Record:
    value = None
    if x is not None and summary == "full":
        value = x
    elif x is not None:
        s = host_summary(x, summary)
        stats, histogram = s["stats"], s["histogram"]
    return Record(name=name, mode=mode, tag="intermediates", step=step, index=index,
                  wall_time=wall_time + step, summary=summary,
                  shape=() if x is None else tuple(np.shape(x)), dtype="float32", value=value,
                  stats=stats or {}, histogram=histogram, process_index=process_index)


def assert_scalars(acc: ea.EventAccumulator, prefix: str, steps: list[int],
                   arrays: list[np.ndarray]) -> None:
    for stat in STAT_KEYS:
        events = acc.Scalars(f"{prefix}/{stat}")
        assert [e.step for e in events] == steps, (prefix, stat)
        want = [numpy_stats(a)[stat] for a in arrays]
        # TensorBoard stores scalars as float32.
        np.testing.assert_allclose([e.value for e in events], want, rtol=2e-6, atol=1e-6,
                                   err_msg=f"{prefix}/{stat}")


def test_scalars_and_histograms_read_back_equal_independent_numbers(tmp_path):
    rng = np.random.default_rng(0)
    steps = [0, 1, 2, 5]
    embed = [rng.normal(size=(8, 32)).astype(np.float32) for _ in steps]
    embed[2][0, :3] = [np.nan, np.inf, -np.inf]
    embed[3][1, :5] = 0.0
    grads = [rng.normal(scale=1e-3, size=(64,)).astype(np.float32) for _ in steps]
    scan = {i: [rng.uniform(-i - 1, i + 1, size=(16,)) for _ in steps] for i in range(3)}
    nested = [rng.normal(size=(4,)) for _ in steps]
    full = [rng.standard_t(3, size=(200,)) for _ in steps]
    records = []
    for k, step in enumerate(steps):
        records.append(record("embed/h", step, x=embed[k]))
        records.append(record("embed/h", step, mode="cotangent", x=grads[k]))
        records += [record("blocks/h", step, index=i, x=scan[i][k]) for i in range(3)]
        records.append(record("inner", step, index=(1, 0), x=nested[k]))
        records.append(record("head/out", step, summary="histogram", x=embed[k]))
        records.append(record("full_value", step, summary="full", x=full[k]))
        records.append(record("health_only", step, summary="health", x=embed[k]))
        records.append(record("shape_only", step, summary="shape", x=embed[k]))
    exporter = TensorBoardExporter(logdir=tmp_path, stats="all", depth="both")
    # In two batches, shuffled inside each, as unordered host callbacks deliver them.
    half = len(records) // 2
    for batch in (records[:half], records[half:]):
        exporter.write([batch[i] for i in rng.permutation(len(batch))])
    exporter.close()

    acc = load(tmp_path)
    assert_scalars(acc, "embed/h/primal", steps, embed)
    assert_scalars(acc, "embed/h/cotangent", steps, grads)
    for i in range(3):
        assert_scalars(acc, f"blocks/h[{i}]/primal", steps, scan[i])
    assert_scalars(acc, "inner[1,0]/primal", steps, nested)
    assert_scalars(acc, "head/out/primal", steps, embed)
    assert_scalars(acc, "full_value/primal", steps, full)

    tags = acc.Tags()
    health = sorted(t for t in tags["scalars"] if t.startswith("health_only/"))
    assert health == sorted(f"health_only/primal/{k}" for k in ("size", "nan", "posinf", "neginf"))
    assert [e.value for e in acc.Scalars("health_only/primal/nan")] == [0, 0, 1, 0]
    assert not [t for t in tags["scalars"] + tags["histograms"] if t.startswith("shape_only")]
    # Histograms only where buckets exist: device-bucketed and full values.
    assert sorted(tags["histograms"]) == ["full_value/primal", "head/out/primal"]

    for name, arrays in (("head/out/primal", embed), ("full_value/primal", full)):
        events = acc.Histograms(name)
        assert [e.step for e in events] == steps
        for e, x in zip(events, arrays, strict=True):
            h = e.histogram_value
            fin = np.asarray(x, np.float64)[np.isfinite(x)]
            counts, edges = np.histogram(fin, bins=30, range=(fin.min(), fin.max()))
            assert list(h.bucket) == counts.tolist()
            np.testing.assert_allclose(h.bucket_limit, edges[1:], rtol=1e-6)
            assert h.num == fin.size
            np.testing.assert_allclose([h.min, h.max], [fin.min(), fin.max()], rtol=1e-6)
            np.testing.assert_allclose(h.sum, fin.sum(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(h.sum_squares, np.sum(fin * fin), rtol=1e-5)


def test_device_buckets_are_written_as_they_are(tmp_path):
    # Buckets that no host re-bucketing of these stats could produce: they must pass through.
    edges = np.array([-1.0, 0.0, 2.0, 3.0])
    counts = np.array([5.0, 0.0, 7.0])
    stats = {"size": 12.0, "mean": 0.5, "std": 1.0, "min": -1.0, "max": 3.0, "l2": 4.0,
             "mean_abs": 1.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0, "zeros": 0.0}
    exporter = TensorBoardExporter(logdir=tmp_path)
    exporter.write([record("h", 3, summary="histogram", stats=stats, histogram=(edges, counts))])
    exporter.close()
    [event] = load(tmp_path).Histograms("h/primal")
    h = event.histogram_value
    assert event.step == 3
    assert list(h.bucket_limit) == [0.0, 2.0, 3.0] and list(h.bucket) == [5.0, 0.0, 7.0]
    assert (h.min, h.max, h.num, h.sum, h.sum_squares) == (-1.0, 3.0, 12.0, 6.0, 16.0)


def read_layout(acc: ea.EventAccumulator) -> dict[str, dict[str, layout_pb2.Chart]]:
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors(LAYOUT_TAG)[-1].tensor_proto.string_val[0])
    return {c.title: {ch.title: ch for ch in c.chart} for c in layout.category}


def matching(chart: layout_pb2.Chart, tags: list[str]) -> list[str]:
    [regex] = chart.multiline.tag
    return sorted(t for t in tags if re.match(regex, t))


def test_custom_scalars_layout_has_one_readable_chart_per_site_and_mode(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=10)
    bad = np.array([1.0, np.nan, 2.0])
    exporter = TensorBoardExporter(logdir=tmp_path)
    exporter.write([record("c", 0, x=x), record("c", 0, mode="cotangent", x=x * 1e-9)])
    # A site first seen later is added to the layout, in name order; counts get a chart once
    # a series has a non-finite element.
    exporter.write([record("c", 1, x=x), record("c", 1, mode="tangent", index=2, x=x),
                    record("a/b", 1, x=x), record("a/b", 1, mode="cotangent", x=x),
                    record("a/b", 2, mode="cotangent", x=bad)])
    exporter.close()
    acc = load(tmp_path)
    categories = read_layout(acc)
    assert list(categories) == ["a/b", "c"]
    assert list(categories["a/b"]) == [
        "primal (activation): std", "cotangent (gradient): l2 norm", "NaN and infinities"]
    # c's tangent has scan iterations: one headline curve, the l2 norm over all of them. Modes
    # come in one order everywhere: primal, tangent, cotangent.
    assert list(categories["c"]) == ["primal (activation): std", "tangent: l2 norm",
                                     "cotangent (gradient): l2 norm"]
    assert matching(categories["a/b"]["primal (activation): std"], acc.Tags()["scalars"]) == [
        "a/b/primal/std"]
    scalars = acc.Tags()["scalars"]
    assert matching(categories["c"]["cotangent (gradient): l2 norm"], scalars) == [
        "c/cotangent/l2"]
    assert matching(categories["c"]["tangent: l2 norm"], scalars) == ["c/tangent/l2"]
    [l2] = acc.Scalars("c/tangent/l2")
    assert l2.value == pytest.approx(np.linalg.norm(x), rel=1e-6)
    assert matching(categories["a/b"]["NaN and infinities"], scalars) == [
        "a/b/cotangent/nan", "a/b/cotangent/neginf", "a/b/cotangent/posinf"]
    every_chart = [t for charts in categories.values() for ch in charts.values()
                   for t in matching(ch, scalars)]
    assert not [t for t in every_chart if t.endswith(("/size", "/zeros", "/mean_abs"))]
    # A version of the layout per batch that changed it, all at step 0; TensorBoard's
    # custom-scalars plugin shows the last one (the one checked above).
    assert [e.step for e in acc.Tensors(LAYOUT_TAG)] == [0, 0]


def test_default_statistics_and_counts_only_from_their_first_non_zero_step(tmp_path):
    rng = np.random.default_rng(4)
    xs = [rng.normal(size=(6,)) for _ in range(4)]
    xs[2][1] = np.inf
    exporter = TensorBoardExporter(logdir=tmp_path)
    exporter.write([record("h", s, x=x) for s, x in enumerate(xs)])
    exporter.write([record("g", s, x=xs[0]) for s in range(2)])
    exporter.write([record("health", s, summary="health", x=x) for s, x in enumerate(xs)])
    exporter.close()
    acc = load(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    assert {t for t in scalars if t.startswith("g/")} == {
        f"g/primal/{k}" for k in DEFAULT_STATS_BY_MODE["primal"]}
    assert {t for t in scalars if t.startswith("h/")} == {
        f"h/primal/{k}" for k in (*DEFAULT_STATS_BY_MODE["primal"], *COUNT_STATS)}
    # From step 2 on, zero again at step 3: the curve shows the return to zero.
    assert [(e.step, e.value) for e in acc.Scalars("h/primal/posinf")] == [(2, 1.0), (3, 0.0)]
    assert [e.step for e in acc.Scalars("h/primal/mean")] == [0, 1, 2, 3]
    # A health summary has only its counts: they are written at every step.
    assert {t for t in scalars if t.startswith("health/")} == {
        f"health/primal/{k}" for k in COUNT_STATS}
    assert [e.value for e in acc.Scalars("health/primal/posinf")] == [0, 0, 1, 0]


def test_default_statistics_are_chosen_per_mode_and_equal_numpy(tmp_path):
    # A value: mean, std, max|x|; a derivative: l2, std, max|x|; one number: that number.
    # Nothing that is flat for most sites: a cotangent's mean, a zero-mean tanh's min and max.
    rng = np.random.default_rng(5)
    x = np.tanh(rng.normal(size=(4, 8)))
    g = rng.normal(scale=1e-6, size=(4, 8))
    g[0, 0] = -3e-5  # the largest magnitude is negative
    exporter = TensorBoardExporter(logdir=tmp_path)
    exporter.write([record("h", 0, x=x), record("h", 0, mode="cotangent", x=g),
                    record("h", 0, mode="tangent", summary="full", x=g),
                    record("loss", 0, x=np.float32(0.25))])
    exporter.close()
    acc = load(tmp_path)
    got = {t: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"]}
    assert got == pytest.approx({
        "h/primal/mean": x.mean(), "h/primal/std": x.std(), "h/primal/max_abs": abs(x).max(),
        "h/cotangent/l2": np.linalg.norm(g), "h/cotangent/std": g.std(),
        "h/cotangent/max_abs": 3e-5, "h/tangent/l2": np.linalg.norm(g),
        "h/tangent/std": g.std(), "h/tangent/max_abs": 3e-5, "loss/primal/mean": 0.25},
        rel=1e-5)
    # A sown scalar loss is titled by what it is: its value.
    assert read_layout(acc)["loss"].keys() == {"value"}


def test_custom_scalars_categories_come_in_program_order_from_a_jit_step(tmp_path):
    import jax
    import jax.numpy as jnp

    import sowtel

    def loss(p, x):
        h = sowtel.sow(jnp.tanh(x @ p["w"]), "zz/embed")

        def block(h, w):
            return sowtel.sow(h + jnp.tanh(h @ w), "mid/blocks"), None

        h, _ = jax.lax.scan(block, h, p["blocks"])
        out = sowtel.sow(h.sum(axis=1), "aa/head", summary="histogram")
        return sowtel.sow(jnp.mean(out ** 2), "b/loss")

    params = {"w": jnp.ones((3, 4)) / 4, "blocks": jnp.ones((2, 4, 4)) / 8}
    step = sowtel.jit(jax.grad(loss))
    with sowtel.enable(exporter="tensorboard", logdir=tmp_path):
        for i in range(2):
            with sowtel.at_step(i):
                step(params, jnp.ones((5, 3)))
    categories = read_layout(load(tmp_path))
    # The order of the sows, not of the names, whatever path each site's records took.
    assert list(categories) == ["zz/embed", "mid/blocks", "aa/head", "b/loss"]
    assert list(categories["b/loss"]) == ["value"]
    assert list(categories["mid/blocks"]) == ["primal (activation): l2 norm",
                                              "cotangent (gradient): l2 norm"]


def test_statistics_are_selectable(tmp_path):
    x = np.array([0.0, 3.0, 4.0])
    exporter = TensorBoardExporter(logdir=tmp_path, stats=["l2", "zeros", "nan"])
    exporter.write([record("h", 0, x=x)])
    exporter.close()
    acc = load(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == ["h/primal/l2", "h/primal/nan", "h/primal/zeros"]
    assert [e.value for e in acc.Scalars("h/primal/l2")] == [5.0]
    assert [e.value for e in acc.Scalars("h/primal/zeros")] == [1.0]
    assert [e.value for e in acc.Scalars("h/primal/nan")] == [0.0]  # asked for: always written
    for bad in (["mean", "median"], [], 3, "everything"):
        with pytest.raises(ValueError, match=r"is not a choice of statistics: use 'default'"):
            TensorBoardExporter(logdir=tmp_path, stats=bad)  # type: ignore[arg-type]
    only_mean = TensorBoardExporter(logdir=tmp_path / "m", stats="mean")  # one, by name
    only_mean.write([record("h", 0, x=x)])
    only_mean.close()
    assert load(tmp_path / "m").Tags()["scalars"] == ["h/primal/mean"]
    with pytest.raises(TypeError, match=r"scalar_derivatives=1 must be True or False"):
        TensorBoardExporter(logdir=tmp_path, scalar_derivatives=1)  # type: ignore[arg-type]


def test_derivatives_of_scalar_sites_are_skipped_unless_asked(tmp_path):
    loss = np.float64(2.5)
    for asked, run in ((False, tmp_path / "default"), (True, tmp_path / "asked")):
        exporter = TensorBoardExporter(logdir=run, scalar_derivatives=asked)
        exporter.write([record("loss", 0, x=loss), record("loss", 0, mode="cotangent", x=1.0),
                        record("h", 0, mode="cotangent", x=np.ones(3)),
                        record("loss", 1, mode="tangent", x=np.float64(np.nan))])
        exporter.close()
        acc = load(run)
        scalars = acc.Tags()["scalars"]
        derivative = sorted(t for t in scalars if t.startswith("loss/") and "/primal/" not in t)
        assert bool(derivative) == asked, derivative
        assert "loss/primal/mean" in scalars and "h/cotangent/l2" in scalars
        # A sown scalar is one chart: its value (the mean), not five equal curves.
        assert not [t for t in scalars if t.startswith("loss/primal/") and t != "loss/primal/mean"]
        assert ("loss/cotangent/mean" in scalars) == asked
        # A skipped record still raises the non-finite alert.
        [alert] = acc.Tensors(ALERT_TAG + "/text_summary")
        assert "`loss` (tangent)" in alert.tensor_proto.string_val[0].decode()


def test_first_non_finite_record_becomes_one_text_alert(tmp_path):
    ok = np.ones(4)
    bad = np.array([1.0, np.nan, np.inf, np.nan])
    worse = np.array([np.nan] * 4)
    exporter = TensorBoardExporter(logdir=tmp_path)
    exporter.write([record("w", 0, x=ok), record("w", 1, x=ok)])
    exporter.write([record("g", 2, mode="cotangent", index=3, x=bad)])
    exporter.write([record("w", 3, x=worse)])
    exporter.close()
    [alert] = load(tmp_path).Tensors(ALERT_TAG + "/text_summary")
    message = alert.tensor_proto.string_val[0].decode()
    assert alert.step == 2
    assert "step 2" in message and "`g`" in message and "cotangent" in message
    assert "2 NaN, 1 +inf, 0 -inf of 4 elements" in message


def test_events_are_readable_as_soon_as_write_returns(tmp_path):
    exporter = TensorBoardExporter(logdir=tmp_path, flush_secs=3600)
    for step in range(3):
        exporter.write([record("h", step, x=np.arange(4.0) + step)])
        # No flush(): a reader must see the step already.
        assert [e.step for e in load(tmp_path).Scalars("h/primal/mean")] == list(range(step + 1))
    exporter.close()


def test_events_are_synced_to_disk_every_flush_secs(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(time.monotonic()),
                                                  real_fsync(fd))[1])
    exporter = TensorBoardExporter(logdir=tmp_path, flush_secs=0.2)
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < 2.0:
        exporter.write([record("h", step, x=np.ones(3))])
        step += 1
        time.sleep(0.01)
    exporter.close()
    gaps = np.diff([start] + synced)
    # Without the periodic sync the only fsync would come at close, 2 s in; a loaded machine may
    # stretch one loop turn, so the bound leaves room for that.
    assert len(synced) >= 4 and gaps.max() < 0.2 + 0.5, gaps


def test_registered_as_tensorboard(tmp_path):
    [exporter] = resolve("tensorboard", logdir=tmp_path / "run")
    assert isinstance(exporter, TensorBoardExporter)
    assert exporter.logdir == str(tmp_path / "run") and (tmp_path / "run").is_dir()
    exporter.close()


def test_site_names_never_leave_logdir(tmp_path):
    logdir = tmp_path / "inside" / "run"
    names = ["../../escape", "/etc/abs", "..", "a/../../b", "C:\\win\\x", "sp ace?*|<>:\"",
             "uni/ünï/😀", "dots/./.."]
    exporter = TensorBoardExporter(logdir=logdir)
    exporter.write([record(n, 0, x=np.ones(2), summary="histogram") for n in names])
    exporter.close()
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 1 and files[0].parent == Path("inside/run"), files
    assert files[0].name.startswith("events.out.tfevents.")
    tags = load(logdir).Tags()
    # The names are kept exactly, as tags inside the event file.
    assert sorted(tags["histograms"]) == sorted(f"{n}/primal" for n in names)


def test_logdir_that_is_a_file_fails_at_construction(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"logdir .*file' exists and is not a directory"):
        TensorBoardExporter(logdir=f)
    with pytest.raises(ValueError, match=r"logdir .*file/sub' cannot be created .*Not a dir"):
        TensorBoardExporter(logdir=f / "sub")


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(TypeError, match=r"logdir=3 is not a path"):
        TensorBoardExporter(logdir=3)  # type: ignore[arg-type]
    for bad in (0, -1, float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"flush_secs=.* must be a positive number"):
            TensorBoardExporter(logdir=tmp_path, flush_secs=bad)  # type: ignore[arg-type]


def run_python(code: str, *, timeout: float = 120,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout, cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def test_unwritable_logdir_fails_at_construction():
    # Root may write anywhere, so the check drops to an unprivileged user when tests run as root.
    top = tempfile.mkdtemp()
    try:
        os.chmod(top, 0o755)
        locked = os.path.join(top, "locked")
        os.mkdir(locked, 0o555)
        code = f"""
            import os
            from sowtel.exporters.tensorboard import TensorBoardExporter
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            for path in ({locked!r}, {os.path.join(locked, "sub")!r}):
                try:
                    TensorBoardExporter(logdir=path)
                except ValueError as e:
                    print("ERROR", e)
        """
        out = run_python(code)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) == 2, out
        assert re.search(r"logdir '.*locked' is not writable \(Permission denied\)", lines[0])
        assert re.search(r"logdir '.*locked/sub' cannot be created \(Permission denied\)",
                         lines[1])
        assert os.listdir(locked) == []
    finally:
        os.chmod(os.path.join(top, "locked"), 0o755)
        subprocess.run(["rm", "-rf", top], check=True)


def test_write_error_is_counted_raised_and_the_next_batch_goes_to_a_new_file(tmp_path):
    # A file-size limit makes the kernel refuse writes past 64 KiB, as a full disk would.
    code = f"""
        import resource, os
        import numpy as np
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from sowtel.exporters.tensorboard import TensorBoardExporter
        from sowtel.records import Record
        from sowtel.summaries import host_summary
        s = host_summary(np.arange(100.0), "histogram")
        exporter = TensorBoardExporter(logdir={str(tmp_path)!r})
        failures = []
        for step in range(400):
            r = Record(name="h", mode="primal", tag="t", step=step, index=None, wall_time=1.0,
                       summary="histogram", shape=(100,), dtype="float32", **s)
            try:
                exporter.write([r])
            except OSError as e:
                failures.append((step, str(e)))
        exporter.close()
        print(len(failures), exporter.errors)
        print(failures[0][1])
        print(" ".join(str(step) for step, _ in failures))
    """
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    count, errors = map(int, out.stdout.splitlines()[0].split())
    assert count == errors >= 2
    assert "File too large" in out.stdout.splitlines()[1]
    assert "free disk space or choose another logdir" in out.stdout.splitlines()[1]
    failed = {int(s) for s in out.stdout.splitlines()[2].split()}
    files = sorted(tmp_path.iterdir())
    # Each failure moves on to a new file (the last one may have had no write after it).
    assert count <= len(files) <= count + 1
    assert all(f.stat().st_size <= 64 * 1024 for f in files)
    # Every step but the failed ones is read back: the files stay readable after a torn write.
    steps = [e.step for e in load(tmp_path).Scalars("h/primal/mean")]
    assert steps == [s for s in range(400) if s not in failed]


# -- end to end: sows in a jitted training step, streamed through sowtel.enable ----------------

def test_streamed_sows_read_back_equal_stats_of_the_same_arrays(tmp_path):
    import jax
    import jax.numpy as jnp

    import sowtel

    scales = np.array([0.5, -2.0, 1.5], np.float32)

    def loss(w, x, step):
        with sowtel.at_step(step):
            sowtel.sow(x, "input", summary="full")
            h = sowtel.sow(jnp.tanh(x @ w), "layer/h")

            def body(c, s):
                return sowtel.sow(c * s, "scan/c"), None

            c, _ = jax.lax.scan(body, h, jnp.asarray(scales))
            out = sowtel.sow(c, "out", summary="histogram")
        return 0.5 * jnp.sum(out ** 2)

    grad = jax.jit(jax.grad(loss))
    rng = np.random.default_rng(3)
    w = rng.normal(size=(5, 16)).astype(np.float32)
    xs = [rng.normal(size=(8, 5)).astype(np.float32) for _ in range(3)]
    with sowtel.enable(exporter="tensorboard", logdir=tmp_path, stats="all", depth="both"):
        for step, x in enumerate(xs):
            grad(w, x, step)
        sowtel.flush()
        assert sowtel.status()["errors"] == {"tensorboard": 0}

    # The same arrays, computed independently in float64. loss = sum(out^2)/2, so the
    # cotangent of every value is d loss / d value = out * (product of the later scales).
    hs = [np.tanh(x.astype(np.float64) @ w) for x in xs]
    cs = {i: [h * np.prod(scales[: i + 1]) for h in hs] for i in range(3)}
    outs = cs[2]
    later = {i: np.prod(scales[i + 1:]) for i in range(3)}
    acc = load(tmp_path)
    steps = [0, 1, 2]
    assert_scalars(acc, "input/primal", steps, xs)
    assert_scalars(acc, "layer/h/primal", steps, hs)
    assert_scalars(acc, "layer/h/cotangent", steps, [o * np.prod(scales) for o in outs])
    for i in range(3):
        assert_scalars(acc, f"scan/c[{i}]/primal", steps, cs[i])
        assert_scalars(acc, f"scan/c[{i}]/cotangent", steps, [o * later[i] for o in outs])
    assert_scalars(acc, "out/primal", steps, outs)
    assert_scalars(acc, "out/cotangent", steps, outs)
    assert sorted(acc.Tags()["histograms"]) == [
        "input/primal", "out/cotangent", "out/primal"]
    for tag, arrays in (("out/primal", outs), ("input/primal", xs)):
        for event, x in zip(acc.Histograms(tag), arrays, strict=True):
            counts, edges = np.histogram(x, bins=30, range=(x.min(), x.max()))
            assert list(event.histogram_value.bucket) == counts.tolist(), tag
            np.testing.assert_allclose(event.histogram_value.bucket_limit, edges[1:],
                                       atol=1e-6 * (x.max() - x.min()))


def test_enable_fails_at_once_on_a_bad_logdir(tmp_path):
    import sowtel

    f = tmp_path / "not_a_dir"
    f.write_text("")
    with pytest.raises(ValueError, match=r"logdir .*not_a_dir' exists and is not a directory"):
        sowtel.enable(exporter="tensorboard", logdir=f)
    assert sowtel.status()["enabled"] is False


def test_disk_full_during_training_is_counted_reported_and_training_goes_on(tmp_path):
    code = f"""
        import resource
        import jax, jax.numpy as jnp
        import sowtel
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, 32 * 1024))

        @jax.jit
        def step_fn(x, step):
            with sowtel.at_step(step):
                h = sowtel.sow(jnp.sin(x), "h", summary="histogram")
            return x + h.mean()

        x = jnp.arange(64.0)
        with sowtel.enable(exporter="tensorboard", logdir={str(tmp_path)!r}, on_full="block"):
            for step in range(300):
                x = step_fn(x, step)
                if step % 10 == 9:
                    sowtel.flush()  # batches of 10 records: several fit in one file
            s = sowtel.status()
        print("steps done", step + 1, "errors", s["errors"]["tensorboard"],
              "exported", s["exported"]["tensorboard"])
    """
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    m = re.search(r"steps done (\d+) errors (\d+) exported (\d+)", out.stdout)
    assert m, out.stdout
    done, errors, exported = map(int, m.groups())
    assert done == 300 and errors >= 3 and 100 < exported <= 300 - 10 * errors
    # Reported once, with the reason and what to do.
    assert out.stderr.count("sowtel exporter tensorboard raised in") == 1, out.stderr
    assert "File too large" in out.stderr and "free disk space" in out.stderr
    steps = [e.step for e in load(tmp_path).Scalars("h/primal/mean")]
    # A failed batch may have put its first records on disk before the limit hit; the record
    # cut in the middle is lost, and everything else stays readable.
    assert exported <= len(steps) < 300 and steps == sorted(set(steps)) and steps[-1] >= 280


def test_each_jax_process_writes_its_own_run(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
        import sys
        import jax, jax.numpy as jnp
        jax.distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=2,
                                   process_id=int(sys.argv[1]), initialization_timeout=60)
        import sowtel
        pid = jax.process_index()
        f = jax.jit(lambda x: sowtel.sow(x * (pid + 1), "h").sum())
        with sowtel.enable(exporter="tensorboard", logdir={str(tmp_path)!r}):
            f(jnp.arange(4.0))
        jax.distributed.shutdown()
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(i)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert sorted(os.listdir(tmp_path)) == ["process_0", "process_1"]
    for i in range(2):
        [mean] = load(tmp_path / f"process_{i}").Scalars("h/primal/mean")
        assert mean.value == pytest.approx(1.5 * (i + 1))


def test_layout_has_no_count_chart_until_a_count_is_non_zero_even_with_all_statistics(tmp_path):
    exporter = TensorBoardExporter(logdir=tmp_path, stats="all")
    exporter.write([record("h", 0, x=np.ones(3)), record("g", 0, summary="health", x=np.ones(3))])
    exporter.close()
    categories = read_layout(load(tmp_path))
    assert list(categories["h"]) == ["primal (activation): std"]
    assert list(categories["g"]) == ["NaN and infinities"]  # all that a health summary has


def test_histogram_every_n_reaches_tensorboards_loader(tmp_path):
    """``enable(histogram_every=2)`` through ``sowtel.jit``: at steps 2 and 4 every site,
    inside a scan (a histogram per layer, beside the depth tensor) or not, has a histogram
    equal to numpy's of the same value; the other steps have none."""
    import jax
    import jax.numpy as jnp

    import sowtel

    rng = np.random.default_rng(11)
    w = rng.normal(scale=0.8, size=(3, 6, 6)).astype(np.float32)
    xs = [rng.normal(size=(4, 6)).astype(np.float32) for _ in range(5)]

    @sowtel.jit
    def forward(w, x):
        def layer(h, wi):
            return sowtel.sow(jnp.tanh(h @ wi), "layers/h"), None

        h, _ = jax.lax.scan(layer, sowtel.sow(x * 3.0, "embed"), w)
        return jnp.sum(h)

    with sowtel.enable(exporter="tensorboard", logdir=tmp_path, histogram_every=2):
        for x in xs:
            forward(w, x)
        assert sowtel.flush(timeout=60)
    acc = load(tmp_path)

    def values(x: np.ndarray) -> dict[str, np.ndarray]:
        out, h = {"embed/primal": x * 3.0}, x.astype(np.float64) * 3.0
        for i, wi in enumerate(w.astype(np.float64)):
            h = np.tanh(h @ wi)
            out[f"layers/h[{i}]/primal"] = h
        return out

    assert sorted(acc.Tags()["histograms"]) == sorted(values(xs[0]))
    for tag in values(xs[0]):
        events = acc.Histograms(tag)
        assert [e.step for e in events] == [2, 4], tag
        for e in events:
            value = values(xs[e.step])[tag].astype(np.float64)
            h = e.histogram_value
            assert h.num == value.size and sum(h.bucket) == value.size, tag
            want, edges = np.histogram(value, bins=len(h.bucket),
                                       range=(value.min(), value.max()))
            np.testing.assert_array_equal(h.bucket, want, err_msg=tag)
            np.testing.assert_allclose(h.bucket_limit, edges[1:], rtol=1e-5, atol=1e-6,
                                       err_msg=tag)
            assert (h.min, h.max) == pytest.approx((value.min(), value.max()), rel=1e-5)
    # The depth tensor is written at every step, histograms or not.
    assert [e.step for e in acc.Tensors("layers/h/primal/depth")] == [0, 1, 2, 3, 4]


def test_a_site_gone_all_nan_reads_nan_and_its_counts_are_scalar_series(tmp_path):
    # The demo's loop: a scanned site blocks/h and an unscanned one, streamed through
    # sowtel.jit inside a host at_step. From step 2 on the input is all NaN: the l2 curves read
    # NaN there (not 0), and the Scalars tab has a NaN count series for both sites, the
    # scanned one included, from step 2 on.
    import jax
    import jax.numpy as jnp

    import sowtel

    def model(w, x):
        def block(h, wi):
            return sowtel.sow(jnp.tanh(h * wi), "blocks/h"), None

        h, _ = jax.lax.scan(block, x, w)
        return sowtel.sow(h * 2.0, "head").sum()

    step = sowtel.jit(model)
    w = jnp.ones((3, 4))
    with sowtel.enable(exporter="tensorboard", logdir=tmp_path, histogram_every=None):
        for i in range(4):
            with sowtel.at_step(i):
                step(w, jnp.full(4, jnp.nan) if i >= 2 else jnp.full(4, 0.5))
    acc = load(tmp_path)
    scalars = set(acc.Tags()["scalars"])
    h1 = np.tanh(0.5)
    l2 = acc.Scalars("blocks/h/primal/l2")
    assert [e.step for e in l2] == [0, 1, 2, 3]
    layers = [np.tanh(0.5), np.tanh(h1), np.tanh(np.tanh(h1))]
    np.testing.assert_allclose([e.value for e in l2[:2]],
                               [np.sqrt(4 * sum(v * v for v in layers))] * 2, rtol=1e-6)
    assert np.isnan([e.value for e in l2[2:]]).all()
    head = acc.Scalars("head/primal/std")
    assert head[0].value == pytest.approx(0.0, abs=1e-6) and np.isnan(head[3].value)
    for site, per_step in (("blocks/h", 12.0), ("head", 4.0)):
        nan = acc.Scalars(f"{site}/primal/nan")
        assert [(e.step, e.value) for e in nan] == [(2, per_step), (3, per_step)], site
        assert {f"{site}/primal/posinf", f"{site}/primal/neginf"} <= scalars
