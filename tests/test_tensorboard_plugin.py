"""The ``sowtel`` TensorBoard plugin, served by a real TensorBoard (``sowtel dashboard``).

Event files are written by the TensorBoard exporter, read back by TensorBoard's own loader, and
every number the plugin's routes return is checked against statistics computed here with numpy.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea
from test_demo_dashboard import (
    ARTIFACTS,
    ENV,
    REPO,
    Chromium,
    free_port,
    get_json,
    sowtel_cmd,
    stop,
    wait_for,
)

from sowtel.exporters.tensorboard import TensorBoardExporter
from sowtel.records import STAT_KEYS, Record
from sowtel.summaries import host_summary
from sowtel.tensorboard_plugin import PLUGIN_NAME, family_of, parse_content

STEPS = [0, 1, 2, 5]
LAYERS = 5


def record(name: str, step: int, x: np.ndarray, *, mode: str = "primal", index=None,
           order: int = 0) -> Record:
    return Record(name=name, mode=mode, tag="intermediates", step=step, index=index,
                  wall_time=1e9 + step, summary="stats", shape=x.shape, dtype=str(x.dtype),
                  stats=host_summary(x, "stats")["stats"], order=order)


def make_records() -> tuple[list[Record], dict[str, dict]]:
    """A scanned site (5 layers, a NaN planted in one gradient), a nested scan, and four
    numbered repeats; with the arrays, to check against. Their program order (the records'
    ``order``: the repeats, the nested scan, the scanned site) is not their names' order."""
    rng = np.random.default_rng(7)
    arrays: dict[str, dict] = {"blocks/h": {}, "inner": {}, "layer*/out": {}}
    records = []
    for step in STEPS:
        for i in range(LAYERS):
            x = rng.normal(scale=10.0 ** -i, size=(4, 8)).astype(np.float32)
            g = rng.normal(scale=10.0 ** i, size=(4, 8)).astype(np.float32)
            if (step, i) == (2, 3):
                g[0, 0] = np.nan
            arrays["blocks/h"][("primal", step, i)] = x
            arrays["blocks/h"][("cotangent", step, i)] = g
            records += [record("blocks/h", step, x, index=i, order=6),
                        record("blocks/h", step, g, mode="cotangent", index=i, order=9)]
        for i in range(2):
            for j in range(3):
                y = rng.normal(size=(3,)).astype(np.float32) * (i + 1) + j
                arrays["inner"][("primal", step, (i, j))] = y
                records.append(record("inner", step, y, index=(i, j), order=5))
        for k in range(4):
            z = rng.normal(size=(6,)).astype(np.float32) * (k + 1)
            arrays["layer*/out"][("primal", step, k)] = z
            records.append(record(f"layer{k}/out", step, z, order=1 + k))
    return records, arrays


def write_runs(top: Path) -> dict[str, dict]:
    records, arrays = make_records()
    # Batches of 7 cut steps anywhere, as the dispatcher's batches do; and one record of step
    # 1 arrives after step 2's, as unordered host callbacks may deliver it.
    late = next(i for i, r in enumerate(records)
                if (r.name, r.mode, r.step, r.index) == ("blocks/h", "primal", 1, 4))
    ordered = records[:late] + records[late + 1:]
    cut = next(i for i, r in enumerate(ordered) if r.step == 2) + 3
    ordered.insert(cut, records[late])
    for run, depth in (("compact", "tensor"), ("scalars", "scalars")):
        exporter = TensorBoardExporter(logdir=top / run, depth=depth)
        for start in range(0, len(ordered), 7):
            exporter.write(ordered[start:start + 7])
        exporter.close()
    return arrays


def start(top: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(sowtel_cmd("dashboard", "--logdir", str(top), "--port", str(port)),
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    return proc, f"http://127.0.0.1:{port}/data/plugin/{PLUGIN_NAME}"


def route(base: str, name: str, **query: str) -> dict:
    data = get_json(f"{base}/{name}?{urllib.parse.urlencode(query)}")
    assert isinstance(data, dict)
    return data


def numpy_stat(x: np.ndarray, stat: str) -> float:
    fin = np.asarray(x, np.float64)[np.isfinite(x)]
    return {"std": fin.std(), "l2": np.linalg.norm(fin), "mean": fin.mean(),
            "max": fin.max(), "max_abs": abs(fin).max()}[stat]


def test_the_plugin_is_registered_for_tensorboard_through_its_entry_point():
    [entry] = [e for e in importlib.metadata.entry_points(group="tensorboard_plugins")
               if e.name == PLUGIN_NAME]
    from tensorboard.plugins import base_plugin

    plugin = entry.load()
    assert issubclass(plugin, base_plugin.TBPlugin) and plugin.plugin_name == PLUGIN_NAME


def test_compact_depth_tensors_are_small_and_read_back_by_tensorboards_loader(tmp_path):
    arrays = write_runs(tmp_path)
    compact = ea.EventAccumulator(str(tmp_path / "compact"), size_guidance={"tensors": 0})
    compact.Reload()
    scalars = compact.Tags()["scalars"]
    # No per-layer tags but the one record that came after a later step of its site (every
    # statistic, as the depth view reads them all): a headline l2 per mode, and the numbered
    # repeats as plain sites.
    assert sorted(t for t in scalars if "[" in t) == sorted(
        f"blocks/h[4]/primal/{k}" for k in (*STAT_KEYS, "max_abs") if k != "size")
    assert {"blocks/h/primal/l2", "blocks/h/cotangent/l2", "inner/primal/l2"} <= set(scalars)
    # A step cut over batches is written again whole: the last point of a step is its norm.
    last = {e.step: e.value for e in compact.Scalars("blocks/h/cotangent/l2")}
    assert sorted(last) == STEPS
    for step in STEPS:
        whole = np.concatenate([arrays["blocks/h"][("cotangent", step, i)].ravel()
                                for i in range(LAYERS)])
        assert last[step] == pytest.approx(np.linalg.norm(whole[np.isfinite(whole)]), rel=1e-5)
    per_layer = ea.EventAccumulator(str(tmp_path / "scalars"))
    per_layer.Reload()
    assert len([t for t in per_layer.Tags()["scalars"] if t.startswith("blocks/h[")]) >= 2 * 5 * 3
    size = lambda run: sum(f.stat().st_size for f in (tmp_path / run).iterdir())  # noqa: E731
    assert size("compact") < size("scalars")
    # The depth tensor's metadata names its rows and its site's place in the program.
    for tag, order in (("blocks/h/primal/depth", 6), ("blocks/h/cotangent/depth", 9),
                       ("inner/primal/depth", 5)):
        meta = parse_content(compact.SummaryMetadata(tag).plugin_data.content)
        assert (meta["order"], meta["index_rank"]) == (order, 1 + tag.startswith("inner")), tag
        assert {"mean", "std", "l2"} <= set(meta["stats"]), tag


def test_family_of_numbered_repeats():
    assert family_of("block12/attn") == ("block*/attn", 12)
    assert family_of("encoder/layer_3/mlp") == ("encoder/layer_*/mlp", 3)
    assert family_of("h") is None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    top = tmp_path_factory.mktemp("plugin")
    arrays = write_runs(top)
    proc, base = start(top)
    try:
        wait_for("the sowtel plugin's runs", lambda: len(route(base, "runs")["runs"]) == 2, 90,
                 proc)
        yield {"base": base, "arrays": arrays, "proc": proc, "top": top}
    finally:
        stop(proc)


@pytest.mark.parametrize("run", ["compact", "scalars"])
def test_depth_route_equals_numpy_statistics_of_the_same_arrays(served, run):
    base, arrays = served["base"], served["arrays"]
    for mode, stat in (("primal", "std"), ("cotangent", "l2"), ("primal", "mean")):
        data = route(base, "depth", run=run, site="blocks/h", mode=mode, stat=stat)
        assert data["steps"] == STEPS and data["index"] == list(range(LAYERS))
        for i, step in enumerate(STEPS):
            for j in range(LAYERS):
                want = numpy_stat(arrays["blocks/h"][(mode, step, j)], stat)
                assert data["values"][i][j] == pytest.approx(want, rel=1e-5, abs=1e-7), (
                    run, mode, stat, step, j)
        if mode == "cotangent":
            # The planted NaN: counted at its step and layer.
            assert data["nonfinite"][STEPS.index(2)][3] == 1
    nested = route(base, "depth", run=run, site="inner", mode="primal", stat="max_abs")
    assert nested["index"] == [[i, j] for i in range(2) for j in range(3)]
    for i, step in enumerate(STEPS):
        for j, (a, b) in enumerate((a, b) for a in range(2) for b in range(3)):
            want = numpy_stat(arrays["inner"][("primal", step, (a, b))], "max_abs")
            assert nested["values"][i][j] == pytest.approx(want, rel=1e-6)
    family = route(base, "depth", run=run, site="layer*/out", mode="primal", stat="std")
    assert family["index"] == [0, 1, 2, 3]
    for i, step in enumerate(STEPS):
        for k in range(4):
            want = numpy_stat(arrays["layer*/out"][("primal", step, k)], "std")
            assert family["values"][i][k] == pytest.approx(want, rel=1e-5)


def test_sites_health_and_errors(served):
    base = served["base"]
    listing = get_json(base.rsplit("/data/", 1)[0] + "/data/plugins_listing")
    assert isinstance(listing, dict) and listing[PLUGIN_NAME]["enabled"] is True
    for run in ("compact", "scalars"):
        # In program order, as the records' order says, not by name.
        assert [s["site"] for s in route(base, "sites", run=run)["sites"]] == [
            "layer*/out", "inner", "blocks/h"], run
    sites = {s["site"]: s for s in route(base, "sites", run="compact")["sites"]}
    assert sites["blocks/h"]["modes"] == ["primal", "cotangent"]
    assert sites["layer*/out"]["kind"] == "repeat" and sites["layer*/out"]["positions"] == 4
    for run in ("compact", "scalars"):
        health = route(base, "health", run=run)
        first = health["first"]
        assert (first["site"], first["mode"], first["step"], first["index"]) == (
            "blocks/h", "cotangent", 2, 3)
        assert [(s["site"], s["mode"], s["first_step"], s["steps"]) for s in health["sites"]] == [
            ("blocks/h", "cotangent", 2, 1)]
    for query, words in (({"run": "compact", "site": "nope", "mode": "primal", "stat": "std"},
                          "site='nope' is not a site inside a scan or repeated by number in "
                          "run 'compact': pick one of ['layer*/out', 'inner', 'blocks/h']"),
                         ({"run": "compact", "site": "blocks/h", "mode": "tangent",
                           "stat": "std"}, "mode='tangent' is not recorded for site"),
                         ({"run": "compact", "site": "blocks/h", "mode": "primal"},
                          "the query parameter stat= is missing")):
        with pytest.raises(urllib.error.HTTPError) as e:
            route(base, "depth", **query)
        assert e.value.code == 400
        assert words in json.loads(e.value.read())["error"]


def test_streamed_training_reaches_the_depth_route_as_the_records_say(tmp_path):
    import jax
    import jax.numpy as jnp

    import sowtel

    def loss(w, x, step):
        with sowtel.at_step(step):
            def layer(h, wi):
                return sowtel.sow(jnp.tanh(h @ wi), "layers/h"), None

            h, _ = jax.lax.scan(layer, x, w)
        return jnp.sum(h ** 2)

    rng = np.random.default_rng(0)
    w = rng.normal(scale=0.8, size=(6, 4, 4)).astype(np.float32)
    grad = jax.jit(jax.grad(loss))
    with sowtel.enable(exporter=["memory", "tensorboard"], logdir=tmp_path / "run") as session:
        for step in range(3):
            grad(w, rng.normal(size=(2, 4)).astype(np.float32), step)
        sowtel.flush()
        records = list(session.exporters[0].records)
    proc, base = start(tmp_path)
    try:
        wait_for("the run", lambda: route(base, "runs")["runs"] == ["run"], 90, proc)
        for mode in ("primal", "cotangent"):
            data = route(base, "depth", run="run", site="layers/h", mode=mode, stat="l2")
            want = {(r.step, r.index): r.stats["l2"] for r in records
                    if r.name == "layers/h" and r.mode == mode}
            assert data["steps"] == [0, 1, 2] and data["index"] == list(range(6))
            got = {(s, j): data["values"][i][j] for i, s in enumerate(data["steps"])
                   for j in data["index"]}
            assert got == pytest.approx(want, rel=1e-6)
    finally:
        stop(proc)


def test_plugin_page_in_headless_chromium_shows_the_depth_view(served, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is missing: install Debian's chromium (make system-deps does)"
    page = served["base"].rsplit("/data/", 1)[0] + "/#sowtel"
    browser = Chromium(chromium, tmp_path / "profile")
    try:
        started = time.monotonic()
        browser.call("Page.navigate", page=True, url=page)
        # The plugin runs in TensorBoard's iframe; read its document once it says it is ready.
        frame_doc = ("(() => { const f = document.querySelector('iframe'); "
                     "return f && f.contentDocument; })()")
        ready = (f"(() => {{ const d = {frame_doc}; if (!d || !d.body || "
                 "d.body.getAttribute('data-ready') !== '1') return null; "
                 "return {sites: [...d.querySelectorAll('#overview-table tbody tr')].map("
                 "  tr => tr.dataset.site + ' ' + tr.dataset.mode),"
                 " health: d.querySelector('#health').textContent,"
                 " canvas: d.querySelectorAll('canvas.heatmap').length,"
                 " lines: d.querySelectorAll('svg.lines path.layer').length}; })()")
        shown = wait_for("the depth view", lambda: browser.evaluate(ready), 90, served["proc"])
        first_paint = time.monotonic() - started
        shot = browser.screenshot()
    finally:
        browser.close()
    assert shown["sites"] == ["layer*/out primal", "inner primal", "blocks/h primal",
                              "blocks/h cotangent"]  # program order
    assert "First non-finite value: site blocks/h, gradient (cotangent), step 2, index 3" in (
        shown["health"])
    # It opens on the site that went non-finite: a heatmap, and one line per layer.
    assert shown["canvas"] == 1 and shown["lines"] == LAYERS
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "sowtel-plugin.png").write_bytes(shot)
    (ARTIFACTS / "sowtel-plugin-first-paint.txt").write_text(f"{first_paint:.2f} s\n")
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
