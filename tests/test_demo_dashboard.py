"""``sowtel demo`` and ``sowtel dashboard`` against a real TensorBoard server and headless Chromium.

Every server and browser a test starts is stopped by it; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

from benchmarks.chromium import Chromium
from sowtel.cli import main
from sowtel.exporters.tensorboard import TensorBoardExporter
from sowtel.records import Record

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONUNBUFFERED": "1"}
SOW_TAG = re.compile(r"^(embed/h|blocks/h|head/out|loss)/(primal|cotangent)/[a-z_0-9]+$")
# The demo's curves: two layers' 3 statistics in two modes (a value's mean, std and max |x|, a
# gradient's l2, std and max |x|), the loss's value, and the scanned blocks' headline l2 norm
# in two modes (their per-layer picture is the sowtel plugin's tensor).
DEMO_SCALARS = 2 * 2 * 3 + 1 + 2
ARTIFACTS = REPO / "artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 10) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def sowtel_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sowtel.cli", *args]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(what: str, fn, timeout: float, proc: subprocess.Popen | None = None):
    """Polls ``fn`` until it returns something truthy; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except (OSError, urllib.error.URLError, ValueError):
            value = None
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"process {proc.args} exited ({proc.returncode}) while waiting for "
                        f"{what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.3)


def sow_tags(base: str) -> dict[str, list[str]]:
    tags = get_json(f"{base}/data/plugin/scalars/tags")
    assert isinstance(tags, dict)
    return {run: sorted(t for t in run_tags if SOW_TAG.match(t)) for run, run_tags in tags.items()}


def points(base: str, run: str, tag: str) -> list[list[float]]:
    query = urllib.parse.urlencode({"run": run, "tag": tag})
    data = get_json(f"{base}/data/plugin/scalars/scalars?{query}")
    assert isinstance(data, list)
    return data


# -- the demo, run to the end ---------------------------------------------------------------------

def test_demo_runs_to_the_end_and_prints_the_dashboard_command(tmp_path):
    logdir = tmp_path / "run"
    out = subprocess.run(sowtel_cmd("demo", "--steps", "20", "--logdir", str(logdir)),
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"sowtel dashboard --logdir {logdir}" in out.stdout.splitlines()[-2]
    assert "SOWTEL tab (#sowtel" in out.stdout.splitlines()[-1]
    assert "20/20" in out.stderr  # the progress bar
    assert re.search(r"280 records streamed, 280 written by tensorboard, 0 dropped", out.stdout)
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0})
    acc.Reload()
    tags = acc.Tags()
    # The scalar loss's cotangent, always 1, is left out.
    assert len([t for t in tags["scalars"] if SOW_TAG.match(t)]) == DEMO_SCALARS
    assert {"blocks/h/primal/depth", "blocks/h/cotangent/depth"} <= set(tags["tensors"])
    assert not [t for t in tags["scalars"] if "[" in t]  # no tag per layer
    assert not [t for t in tags["scalars"] if t.startswith("loss/cotangent/")]
    assert sorted(tags["histograms"]) == ["head/out/cotangent", "head/out/primal"]
    loss = [e.value for e in acc.Scalars("loss/primal/mean")]
    assert len(loss) == 20 and loss[-1] < loss[0]


def test_demo_with_another_exporter(tmp_path):
    out = subprocess.run(sowtel_cmd("demo", "--steps", "3", "--exporter", "jsonl", "--logdir",
                                    str(tmp_path / "j")),
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "42 written by jsonl" in out.stdout
    assert f"Output in {tmp_path / 'j'}" in out.stdout
    written = [p for p in (tmp_path / "j").rglob("*") if p.is_file()]
    assert written and sum(p.stat().st_size for p in written) > 0


def test_demo_rejects_bad_options(tmp_path, capsys):
    assert main(["demo", "--exporter", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--exporter 'nope' is not registered: use one of" in err and "tensorboard" in err
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--steps", "0"])
    assert exit_.value.code == 2 and "0 steps: use at least 1" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("")
    assert main(["demo", "--logdir", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


# -- sowtel dashboard ----------------------------------------------------------------------------

def start_dashboard(*args: str) -> tuple[subprocess.Popen, str]:
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(sowtel_cmd("dashboard", *args), cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.fullmatch(r"TensorBoard: (http://127\.0\.0\.1:(\d+)/)\n", line)
    if not m:
        stop(proc)
        err.seek(0)
        pytest.fail(f"unexpected first line {line!r}; stderr: {err.read()}")
    return proc, m.group(1)


def test_dashboard_picks_a_free_port_when_6006_is_taken_and_serves_the_runs(tmp_path):
    exporter = TensorBoardExporter(logdir=tmp_path / "exp")
    exporter.write([Record(name="h", mode="primal", tag="intermediates", step=s, index=None,
                           wall_time=1e9 + s, summary="stats", shape=(), dtype="float32",
                           stats={"mean": float(s)}) for s in range(3)])
    exporter.close()
    blocker = socket.socket()
    try:
        try:
            blocker.bind(("127.0.0.1", 6006))
            blocker.listen()
        except OSError:
            pass  # something else holds 6006 already: the case under test all the same
        proc, url = start_dashboard("--logdir", str(tmp_path))
        try:
            assert not url.endswith(":6006/")
            assert wait_for("the run", lambda: sow_tags_any(url), 60, proc) == ["h/primal/mean"]
            assert [p[1:] for p in points(url.rstrip("/"), "exp", "h/primal/mean")] == [
                [0, 0.0], [1, 1.0], [2, 2.0]]
            with urllib.request.urlopen(url, timeout=10) as page:
                assert b"TensorBoard" in page.read()
        finally:
            stop(proc)
        assert proc.returncode == 0  # SIGTERM ends it cleanly
    finally:
        blocker.close()


def sow_tags_any(url: str) -> list[str] | None:
    tags = get_json(url + "data/plugin/scalars/tags")
    assert isinstance(tags, dict)
    return sorted(tags.get("exp", {})) or None


def test_dashboard_rejects_a_taken_port_and_a_file_logdir(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["dashboard", "--logdir", str(tmp_path), "--port", str(port)]) == 2
    assert (f"port {port} on 127.0.0.1 is in use: pass another --port, or leave --port out"
            in capsys.readouterr().err)
    assert main(["dashboard", "--logdir", str(tmp_path), "--port", "70000"]) == 2
    assert "--port 70000 is not a TCP port" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("")
    assert main(["dashboard", "--logdir", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


# -- the live demo, watched by a real tensorboard server (last: it runs until the module ends) -

@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[dict[str, object]]:
    """A slowed ``sowtel demo`` writing to a logdir that a ``tensorboard`` server watches."""
    top = tmp_path_factory.mktemp("live")
    logdir = top / "demo"
    # Output goes to files: an unread pipe would fill up and stop the demo's progress bar.
    with open(top / "demo.log", "w") as log:
        demo = subprocess.Popen(
            sowtel_cmd("demo", "--steps", "3000", "--slow", "0.05", "--logdir", str(logdir)),
            cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True,
        )
    port = free_port()
    with open(top / "tensorboard.log", "w") as log:
        server = subprocess.Popen(
            [str(BIN / "tensorboard"), "--logdir", str(top), "--host", "127.0.0.1",
             "--port", str(port), "--reload_interval", "1"],
            env=ENV, stdout=log, stderr=subprocess.STDOUT, text=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for("tensorboard to answer", lambda: get_json(f"{base}/data/runs"), 60, server)
        yield {"demo": demo, "base": base, "logdir": logdir}
    finally:
        stop(demo)
        stop(server)


def test_live_demo_curves_grow_in_a_running_tensorboard(live):
    demo, base = live["demo"], live["base"]
    assert isinstance(demo, subprocess.Popen) and isinstance(base, str)

    def demo_tags() -> list[str] | None:
        tags = sow_tags(base).get("demo", [])
        return tags if len(tags) >= DEMO_SCALARS else None

    tags = wait_for("the demo's sow tags", demo_tags, 90, demo)
    series = sorted({t.rsplit("/", 1)[0] for t in tags})
    assert series == sorted(
        [f"{site}/{mode}" for site in ("embed/h", "head/out", "blocks/h")
         for mode in ("primal", "cotangent")] + ["loss/primal"]
    )
    first = len(points(base, "demo", "blocks/h/cotangent/l2"))
    second = wait_for(
        "more points", lambda: (n := len(points(base, "demo", "blocks/h/cotangent/l2"))) > first
        and n, 30, demo,
    )
    assert demo.poll() is None, "the demo finished before the second poll"
    assert second > first >= 1
    steps = [p[1] for p in points(base, "demo", "loss/primal/mean")]
    assert steps == sorted(steps) and steps[0] == 0


def test_dashboard_in_headless_chromium_shows_sow_charts(live, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is missing: install Debian's chromium (make system-deps does)"
    logdir = live["logdir"]
    assert isinstance(logdir, Path)
    # The dashboard under test is `sowtel dashboard`, on the live demo's runs.
    port = free_port()
    dashboard = subprocess.Popen(
        sowtel_cmd("dashboard", "--logdir", str(logdir.parent), "--port", str(port)),
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert dashboard.stdout is not None
        line = dashboard.stdout.readline()
        assert line.strip() == f"TensorBoard: http://127.0.0.1:{port}/"
        base = f"http://127.0.0.1:{port}"
        wait_for("the sow tags in the dashboard", lambda: sow_tags(base).get("demo"), 60,
                 dashboard)
        flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1400,1000", "--virtual-time-budget=15000"]
        shot = tmp_path / "dashboard.png"
        browser = subprocess.run(
            [*flags, f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
             "--dump-dom", f"{base}/#timeseries"],
            capture_output=True, text=True, timeout=120,
        )
        assert browser.returncode == 0, browser.stderr[-2000:]
        dom = browser.stdout
    finally:
        stop(dashboard)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "tensorboard-dashboard.png")
    # Time-series cards carry their tag in the title of the card's heading.
    titles = re.findall(r'<scalar-card\b.*?<tb-truncated-path[^>]*title="([^"]+)"', dom, re.S)
    shown = [t for t in titles if SOW_TAG.match(t)]
    assert shown, f"no sow chart rendered; card titles: {titles[:10]}"
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 1000)
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB"))
    # TensorBoard's orange header and white chart area, not a blank page.
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50


# Every custom-scalars chart card, through the shadow roots: [element, title, category].
CUSTOM_SCALAR_CARDS = r"""(() => {
  const categoryOf = (el) => {
    for (let p = el; p; p = p.parentElement || (p.getRootNode() && p.getRootNode().host)) {
      if (p.tagName === 'TF-CATEGORY-PAGINATED-VIEW') return p.category.name;
    }
    return null;
  };
  const cards = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      const tag = el.tagName.toLowerCase();
      if (tag.startsWith('tf-custom-scalar-') && tag.endsWith('-chart-card'))
        cards.push([tag.slice('tf-custom-scalar-'.length), el.title, categoryOf(el)]);
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return cards;
})()"""


def test_custom_scalars_page_in_headless_chromium_has_one_chart_per_site_and_mode(live,
                                                                                   tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is missing: install Debian's chromium (make system-deps does)"
    logdir = live["logdir"]
    assert isinstance(logdir, Path)
    port = free_port()
    dashboard = subprocess.Popen(
        sowtel_cmd("dashboard", "--logdir", str(logdir.parent), "--port", str(port)),
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    want = {  # the demo's sites: a scan (4 iterations), two layers, the loss
        ("multi-line-chart-card", "primal (activation): l2 norm", "blocks/h"),
        ("multi-line-chart-card", "cotangent (gradient): l2 norm", "blocks/h"),
        ("multi-line-chart-card", "primal (activation): std", "embed/h"),
        ("multi-line-chart-card", "cotangent (gradient): l2 norm", "embed/h"),
        ("multi-line-chart-card", "primal (activation): std", "head/out"),
        ("multi-line-chart-card", "cotangent (gradient): l2 norm", "head/out"),
        ("multi-line-chart-card", "value", "loss"),
    }
    browser = None
    try:
        wait_for("the sow tags in the dashboard", lambda: sow_tags(base).get("demo"), 60,
                 dashboard)
        browser = Chromium(chromium, tmp_path / "profile")
        browser.call("Page.navigate", page=True, url=f"{base}/#custom_scalars")
        cards = wait_for("the custom-scalars charts",
                         lambda: (c := browser.evaluate(CUSTOM_SCALAR_CARDS)) and len(c) >= 7
                         and c, 90, dashboard)
        time.sleep(3)  # let the curves draw before the screenshot
        shot = browser.screenshot()
    finally:
        if browser is not None:
            browser.close()
        stop(dashboard)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "tensorboard-custom-scalars.png").write_bytes(shot)
    got = collections.Counter(tuple(c) for c in cards)
    assert set(got) == want and all(n == 1 for n in got.values()), sorted(got)
    # Categories in program order, each site's modes in one order: primal, then cotangent.
    assert list(dict.fromkeys(c[2] for c in cards)) == ["embed/h", "blocks/h", "head/out",
                                                        "loss"]
    assert [c[1].split(" ")[0] for c in cards if c[2] == "embed/h"] == ["primal", "cotangent"]
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    pixels = np.asarray(Image.open(ARTIFACTS / "tensorboard-custom-scalars.png").convert("RGB"))
    assert pixels.shape == (1000, 1400, 3)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # charts, not a blank page
