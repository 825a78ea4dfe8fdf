"""The README's screenshot of the SOWTEL tab, taken from a real ``sowtel demo`` run.

``python -m benchmarks.screenshots docs/images/sowtel-depth-view.png`` runs the demo with its
default number of steps into a scratch folder, serves it with ``sowtel dashboard``, opens the tab
in headless Chromium and keeps the part from the top of the page to the end of the depth view.
The PNG carries what it shows as text chunks (``sowtel-demo-steps``, ``sowtel-demo-sites``,
``sowtel-view``), so ``tests/test_readme.py`` fails when the demo changes and the image does not.

Example:
    $ python -m benchmarks.screenshots docs/images/sowtel-depth-view.png
    docs/images/sowtel-depth-view.png: 1400 x 1230, the demo's 3000 steps
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.chromium import Chromium

#: The view the README shows: the demo's run, its scanned blocks' activations.
VIEW = "run=demo&site=blocks/h&mode=primal"
#: The keys of the PNG text chunks that say what the image shows.
STEPS_KEY, SITES_KEY, VIEW_KEY = "sowtel-demo-steps", "sowtel-demo-sites", "sowtel-view"


def demo_sites() -> list[str]:
    """The sites the demo sows, in program order, from two of its steps."""
    from sowtel.demo import train
    from sowtel.exporters.memory import MemoryExporter

    memory = MemoryExporter()
    train(2, memory, progress=False)
    sites: dict[str, None] = {}
    for r in sorted(memory.records, key=lambda r: (r.step, r.order)):
        if r.mode == "primal":
            sites.setdefault(r.name)
    return list(sites)


def take(out: str, steps: int | None = None, width: int = 1400) -> tuple[int, int]:
    """Runs the demo, and writes the tab's screenshot to ``out``; returns its size."""
    from PIL import Image, PngImagePlugin

    from sowtel.demo import DEFAULT_STEPS

    steps = DEFAULT_STEPS if steps is None else steps
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise RuntimeError("Chromium is missing: install Debian's chromium (make system-deps)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="sowtel-shot-") as top:
        subprocess.run([sys.executable, "-m", "sowtel.cli", "demo", "--steps", str(steps),
                        "--logdir", os.path.join(top, "demo")], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from sowtel.dashboard import pick_port

        port = pick_port("127.0.0.1", None)
        server = subprocess.Popen([sys.executable, "-m", "sowtel.cli", "dashboard", "--logdir",
                                   top, "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        browser = None
        try:
            base = f"http://127.0.0.1:{port}"
            query = f"{base}/data/plugin/sowtel/depth?run=demo&site=blocks/h&mode=primal&stat=std"
            _wait(lambda: b'"steps"' in urllib.request.urlopen(query, timeout=30).read(), 120)
            browser = Chromium(binary, Path(top) / "profile", width=width)
            browser.call("Page.navigate", page=True, url=f"{base}/#sowtel&{VIEW}")
            _wait(lambda: browser.frame("doc.body.getAttribute('data-ready') === '1'"), 120)
            png = browser.full_screenshot(width)
            bottom = browser.evaluate(
                "(() => { const f = document.querySelector('iframe'); const d = "
                "f.contentDocument.querySelector('#legend'); return f.getBoundingClientRect()"
                ".top + d.getBoundingClientRect().bottom + 16; })()")
        finally:
            if browser is not None:
                browser.close()
            server.terminate()
            server.wait()
    image = Image.open(io.BytesIO(png))
    image = image.crop((0, 0, image.width, min(image.height, int(bottom))))
    info = PngImagePlugin.PngInfo()
    info.add_text(STEPS_KEY, str(steps))
    info.add_text(SITES_KEY, ",".join(demo_sites()))
    info.add_text(VIEW_KEY, VIEW)
    image.save(out, pnginfo=info, optimize=True)
    return image.size


def _wait(ready, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {seconds:.0f} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where the PNG goes")
    parser.add_argument("--steps", type=int, default=None, help="demo steps (its default)")
    args = parser.parse_args(argv)
    width, height = take(args.out, args.steps)
    print(f"{args.out}: {width} x {height}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
