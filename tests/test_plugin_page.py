"""The SOWTEL tab as an engineer sees it: headless Chromium on a real TensorBoard.

Three runs are served by one ``sowtel dashboard``: the README tour's MLP (no scan: plain sites
and logged scalars only), ``sowtel demo`` (a scanned site among plain ones) and a 48-layer x
1,000-step run whose gradients vanish with depth and whose layer 40 goes NaN at step 700. The
page is checked through its DOM (what is listed, in which order, what each chart holds) and
kept as full-page screenshots under ``artifacts/`` (``sowtel-tab-*.png``).
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from test_demo_dashboard import (
    ARTIFACTS,
    ENV,
    REPO,
    free_port,
    get_json,
    sowtel_cmd,
    stop,
    wait_for,
)

from benchmarks.chromium import Chromium
from sowtel.alerts import alert, make_alerts
from sowtel.exporters.tensorboard import TensorBoardExporter
from sowtel.records import Record

DEEP_LAYERS, DEEP_STEPS, NAN_AT = 48, 1000, (700, 40)
DEMO_STEPS = 300
# The embedding's gradient std falls as 0.05 (1 - 0.6 (1 - exp(-step / 250))): below 0.025 from
# step 448 (250 ln 6 = 447.9) on, one episode; layer 40's NaN count goes above 0 at step 700.
DEEP_ALERTS = [alert("embed/h", mode="cotangent", stat="std", below=0.025),
               alert("blocks/*", mode="cotangent", stat="nan", above=0)]


def deep_records(steps: int = DEEP_STEPS) -> list[list[Record]]:
    """A 48-layer scanned site, a step at a time: activations spread more with depth, the
    gradient's norm falls by a decade every 18 layers (from 0.3 down to 6e-4) and shrinks as
    training goes; layer 40's gradient holds 3 NaN at step 700. Beside it, a plain embedding
    and the loss."""
    rng = np.random.default_rng(3)
    layers = np.arange(DEEP_LAYERS)
    out = []
    for step in range(steps):
        progress = 1 - np.exp(-step / 250)
        spread = (0.4 + 0.012 * layers * (1 + progress)) * rng.lognormal(0, 0.02, DEEP_LAYERS)
        grad = 0.3 * 10 ** (-layers / 18) * (1 + 2 * np.exp(-step / 120)) * rng.lognormal(
            0, 0.08, DEEP_LAYERS)
        batch = []
        for mode, scale, order in (("primal", spread, 1), ("cotangent", grad, 4)):
            for j in layers:
                nan = 3.0 if (mode, step, j) == ("cotangent", *NAN_AT) else 0.0
                batch.append(record("blocks/h", mode, step, float(scale[j]), nan, j, order))
        batch.append(record("embed/h", "primal", step, 0.6 + 0.05 * progress, 0.0, None, 0))
        batch.append(record("embed/h", "cotangent", step, 0.05 * (1 - 0.6 * progress), 0.0,
                            None, 5))
        loss = 2.0 * np.exp(-step / 200) + 0.05 + 0.01 * rng.random()
        batch.append(Record(name="loss", mode="primal", tag="intermediates", step=step,
                            index=None, wall_time=1e9 + step, summary="stats", shape=(),
                            dtype="float32", order=2,
                            stats={"size": 1.0, "mean": loss, "std": 0.0, "min": loss,
                                   "max": loss, "l2": loss, "mean_abs": loss, "nan": 0.0,
                                   "posinf": 0.0, "neginf": 0.0, "zeros": 0.0}))
        out.append(batch)
    return out


def record(name: str, mode: str, step: int, std: float, nan: float, index, order: int
           ) -> Record:
    size = 4096.0
    mean = 0.05 * std
    return Record(name=name, mode=mode, tag="intermediates", step=step, index=index,
                  wall_time=1e9 + step, summary="stats", shape=(16, 256), dtype="float32",
                  order=order,
                  stats={"size": size, "mean": mean, "std": std, "min": -3.1 * std,
                         "max": 3.3 * std, "l2": float(np.sqrt(size * (mean ** 2 + std ** 2))),
                         "mean_abs": 0.8 * std, "nan": nan, "posinf": 0.0, "neginf": 0.0,
                         "zeros": 0.0})


def mlp_run(logdir: Path) -> None:
    """The README tour's training loop, as the README writes it."""
    import jax
    import jax.numpy as jnp

    import sowtel

    def mse(params, inputs, targets):
        h = sowtel.sow(jnp.tanh(inputs @ params["w1"]), "mlp/h")
        return jnp.mean((h @ params["w2"] - targets) ** 2)

    @sowtel.jit
    def train_step(params, inputs, targets):
        value, grads = jax.value_and_grad(mse)(params, inputs, targets)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 1)) / 4}
    inputs = jax.random.normal(k3, (32, 8))
    targets = jnp.sin(inputs[:, :1])
    sowtel.enable(logdir=str(logdir), every=10)
    for i in range(100):
        with sowtel.at_step(i):
            params, value = train_step(params, inputs, targets)
        if i % 10 == 0:
            sowtel.log({"train/loss": float(value), "lr": 0.1}, step=i)
    sowtel.disable()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The three runs (and a second demo run, to compare) behind one ``sowtel dashboard``,
    and a function that opens the tab at a view and waits until the page says it is ready."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is missing: install Debian's chromium (make system-deps does)"
    top = tmp_path_factory.mktemp("page")
    mlp_run(top / "mlp")
    exporter = TensorBoardExporter(logdir=top / "deep")
    # The alert rules judge each step's batch as a session's dispatcher does, and hand what
    # fired to the exporter after the records.
    rules = make_alerts(DEEP_ALERTS, "warn")
    for batch in deep_records():
        exporter.write(batch)
        rules.observe(batch)
        exporter.write_alerts(rules.take_fired())
    exporter.close()
    for run, seed_steps in (("demo", DEMO_STEPS), ("demo-short", 120)):
        out = subprocess.run(sowtel_cmd("demo", "--steps", str(seed_steps), "--logdir",
                                        str(top / run)),
                             cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
    port = free_port()
    proc = subprocess.Popen(sowtel_cmd("dashboard", "--logdir", str(top), "--port", str(port)),
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    browser = None
    try:
        def loaded() -> bool:
            depth = get_json(f"{base}/data/plugin/sowtel/depth?run=deep&site=blocks/h&"
                             "mode=cotangent&stat=l2", timeout=60)
            return isinstance(depth, dict) and len(depth["steps"]) == DEEP_STEPS

        wait_for("TensorBoard to load the runs", loaded, 240, proc)
        browser = Chromium(chromium, top / "profile")

        def open_view(view: str, shot: str | None = None) -> Chromium:
            browser.call("Emulation.setDeviceMetricsOverride", page=True, width=1400,
                         height=1000, deviceScaleFactor=1, mobile=False)
            browser.call("Page.navigate", page=True, url="about:blank")
            browser.call("Page.navigate", page=True, url=f"{base}/#sowtel&{view}")
            wait_for(f"the tab at {view}", lambda: browser.frame(
                "doc.body.getAttribute('data-ready') === '1'"), 120, proc)
            if shot:
                ARTIFACTS.mkdir(exist_ok=True)
                png = browser.full_screenshot()
                assert png[:8] == b"\x89PNG\r\n\x1a\n"
                (ARTIFACTS / shot).write_bytes(png)
            return browser

        yield open_view
    finally:
        if browser is not None:
            browser.close()
        stop(proc)


# What the page shows, read from its DOM.
OVERVIEW = """[...doc.querySelectorAll('#overview-table tbody tr')].map(tr => [
  tr.dataset.site, tr.dataset.mode, [...tr.children].map(td => td.textContent.trim())])"""
CARDS = """[...doc.querySelectorAll('.card')].map(c => [c.dataset.site, c.dataset.mode,
  c.querySelectorAll('svg.chart path.line').length,
  [...c.querySelectorAll('svg.chart text')].map(t => t.textContent)])"""
DEPTH = """(() => {
  const canvas = [...doc.querySelectorAll('#depth canvas.heatmap')];
  const lines = doc.querySelector('#depth svg.lines');
  return {heatmaps: canvas.map(c => [c.width, c.height, c.dataset.scale]),
          lines: lines && [lines.getAttribute('width'), lines.dataset.scale,
                           lines.querySelectorAll('path.layer').length,
                           lines.querySelectorAll('path.raw').length,
                           [...lines.querySelectorAll('text')].map(t => t.textContent)],
          legend: [...doc.querySelectorAll('#legend .key[data-layer]')].map(k => k.textContent),
          site: doc.querySelector('#site') && doc.querySelector('#site').value,
          mode: doc.querySelector('#mode') && doc.querySelector('#mode').value,
          status: doc.querySelector('#status') && doc.querySelector('#status').textContent,
          health: doc.querySelector('#health').textContent};
})()"""


def test_the_readme_tours_mlp_shows_every_site_and_logged_scalar(page):
    browser = page("run=mlp", "sowtel-tab-mlp.png")
    rows = browser.frame(OVERVIEW)
    assert [(site, mode) for site, mode, _ in rows] == [
        ("lr", "value"), ("train/loss", "value"), ("mlp/h", "primal"), ("mlp/h", "cotangent")]
    by = {(s, m): cells for s, m, cells in rows}
    assert by[("mlp/h", "primal")][1:3] == ["activation (primal)", "std"]
    assert by[("mlp/h", "cotangent")][1:3] == ["gradient (cotangent)", "l2 norm"]
    assert by[("lr", "value")][3] == "0.1" and by[("mlp/h", "primal")][-1] == "none"
    cards = browser.frame(CARDS)
    assert [(s, m) for s, m, *_ in cards] == [(s, m) for s, m, _ in rows]
    for site, mode, n_lines, texts in cards:
        # One line; ticks on both axes, and the axes say what they are.
        assert n_lines == 1, (site, mode)
        assert "training step" in texts and {"0", "20", "40", "60", "80"} <= set(texts), texts
    # No scan here: no depth picture, and no empty dropdowns.
    assert browser.frame("doc.querySelector('#depth').children.length") == 0
    assert "No NaN or infinity recorded in run mlp" in browser.frame(
        "doc.querySelector('#health').textContent")


def test_the_demo_lists_its_sites_in_program_order_with_the_depth_picture(page):
    browser = page("run=demo", "sowtel-tab-demo.png")
    rows = browser.frame(OVERVIEW)
    assert [(site, mode) for site, mode, _ in rows] == [
        ("embed/h", "primal"), ("embed/h", "cotangent"), ("blocks/h", "primal"),
        ("blocks/h", "cotangent"), ("head/out", "primal"), ("head/out", "cotangent"),
        ("loss", "primal")]
    loss = rows[-1][2]
    assert loss[1:3] == ["value", "value"], loss  # a sown scalar: its value
    depth = browser.frame(DEPTH)
    assert (depth["site"], depth["mode"]) == ("blocks/h", "primal")
    assert depth["status"].startswith(f"4 layers × {DEMO_STEPS} steps")
    # The heatmap and the lines share one x axis: the same width, the same plot margins.
    [(width, _, scale)] = depth["heatmaps"]
    lines_width, line_scale, n_layers, n_raw, texts = depth["lines"]
    assert int(lines_width) == width and n_layers == 4 and n_raw == 4
    # Activations' std spans well under a decade: linear scales, labelled.
    assert scale == "linear" and line_scale == "linear"
    assert "training step" in texts and "std" in texts
    assert depth["legend"] == ["0", "1", "2", "3"]
    cards = browser.frame(CARDS)
    assert [(s, m) for s, m, *_ in cards] == [
        ("embed/h", "primal"), ("embed/h", "cotangent"), ("head/out", "primal"),
        ("head/out", "cotangent"), ("loss", "primal")]


def test_the_48_layer_run_opens_on_its_first_nan_with_a_readable_legend(page):
    browser = page("run=deep", "sowtel-tab-deep.png")
    depth = browser.frame(DEPTH)
    step, layer = NAN_AT
    assert (f"First non-finite value: site blocks/h, gradient (cotangent), step {step}, "
            f"index {layer}") in depth["health"]
    # The alert rules' alerts, in the health panel, earliest first: one an episode.
    alerts = browser.frame("[...doc.querySelectorAll('#alerts li')].map(li => li.textContent)")
    assert len(alerts) == 2, alerts
    assert alerts[0].startswith("alert at step 448: 'embed/h' (cotangent) std = 0.0249")
    assert alerts[0].endswith("below 0.025; rule alert('embed/h', mode='cotangent', stat='std', "
                              "below=0.025)")
    assert alerts[1].startswith(f"alert at step {step}: 'blocks/h' (cotangent, index {layer}) "
                                "nan = 3, above 0;")
    assert "2 alert(s) of the alert rules" in depth["health"]
    assert (depth["site"], depth["mode"]) == ("blocks/h", "cotangent")
    assert depth["status"].startswith(f"{DEEP_LAYERS} layers × {DEEP_STEPS} steps")
    [(_, height, scale)] = depth["heatmaps"]
    # Gradients spanning three decades: a log colour scale, and one row per layer.
    assert scale == "log" and depth["lines"][1] == "log" and height >= DEEP_LAYERS * 3
    assert depth["legend"] == [str(j) for j in range(DEEP_LAYERS)]
    rows = {(s, m): cells for s, m, cells in browser.frame(OVERVIEW)}
    assert rows[("blocks/h", "cotangent")][-1] == (
        f"from step {step} (index {layer}), 1 step(s)")
    # The heatmap's magenta cell is layer 40's at step 700.
    colour = browser.frame(f"""(() => {{
      const c = doc.querySelector('#depth canvas.heatmap');
      const rowH = Math.max(3, Math.min(18, Math.floor(380 / {DEEP_LAYERS})));
      const x = 76 + ({step} / {DEEP_STEPS - 1}) * (c.width - 76 - 120);
      return [...c.getContext('2d').getImageData(Math.round(x), 8 + {layer} * rowH + 1, 1, 1)
              .data].slice(0, 3); }})()""")
    assert colour == [224, 0, 108]


def test_hover_highlight_smoothing_and_the_view_in_the_address(page):
    browser = page("run=deep&site=blocks/h&mode=primal&stat=std&smooth=0.9&layer=40")
    depth = browser.frame(DEPTH)
    assert (depth["site"], depth["mode"]) == ("blocks/h", "primal")
    assert browser.frame("doc.querySelector('#stat').value") == "std"
    assert browser.frame("doc.querySelector('#smoothing').value") == "0.9"
    # Layer 40 is drawn on top and thicker; the others fade.
    picked = browser.frame("""[...doc.querySelectorAll('#depth svg.lines path.layer')]
      .filter(p => p.getAttribute('stroke-width') === '2.6').map(p => p.dataset.key)""")
    assert picked == ["40"]
    # Hovering the lines shows the step and value of the nearest line.
    shown = browser.frame("""(() => {
      const svg = doc.querySelector('#depth svg.lines');
      const r = svg.getBoundingClientRect();
      svg.dispatchEvent(new win.MouseEvent('mousemove', {clientX: r.left + r.width / 2,
        clientY: r.top + r.height / 2, bubbles: true}));
      const tip = doc.querySelector('.tooltip');
      return [tip.style.display, tip.textContent];
    })()""")
    assert shown[0] == "block" and shown[1].startswith("step ") and "layer 40" in shown[1]
    # Picking another layer in the legend writes it into the address.
    browser.frame("doc.querySelector('#legend .key[data-layer=\"3\"]').click()")
    wait_for("the address to change", lambda: "layer=3" in str(browser.evaluate(
        "location.hash")), 10)
    hash_ = urllib.parse.unquote(str(browser.evaluate("location.hash")))
    assert hash_.startswith("#sowtel&") and "site=blocks/h" in hash_ and "stat=std" in hash_


def test_two_runs_side_by_side_and_overlaid(page):
    browser = page("run=demo&cmp=demo-short&site=blocks/h&mode=cotangent",
                   "sowtel-tab-compare.png")
    depth = browser.frame(DEPTH)
    # One heatmap per run on one colour scale, the second run's lines dashed over the first.
    assert len(depth["heatmaps"]) == 2 and depth["heatmaps"][0][2] == depth["heatmaps"][1][2]
    dashed = browser.frame("""[...doc.querySelectorAll('#depth svg.lines path.layer')]
      .filter(p => p.getAttribute('stroke-dasharray')).length""")
    assert depth["lines"][2] == 8 and dashed == 4
    header = browser.frame("[...doc.querySelectorAll('#overview-table th')].map(t => "
                           "t.textContent)")
    assert "last: demo" in header and "last: demo-short" in header
    cards = browser.frame(CARDS)
    assert all(n == 2 for _, _, n, _ in cards), cards
