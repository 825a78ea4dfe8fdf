"""What the built wheel holds, and what the package index page shows (the README).

The wheel is built as pip builds it (an isolated build environment); ``make wheel-check``
then installs it in a fresh environment and runs ``tests/wheel_smoke.py`` there.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from sowtel.dashboard import dashboards_path, run_dashboards

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
HOME = PROJECT["urls"]["Source"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out),
                            str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [path] = out.glob("sowtel-*.whl")
    return path, build.stdout + build.stderr


def test_the_wheel_builds_without_a_packaging_warning(wheel):
    _, log = wheel
    # setuptools warned ("Package would be ignored", 40 lines) at every install before.
    assert not re.search(r"would be ignored|Setuptools\w*Warning|BuildBackendWarning", log), log


def test_the_wheel_ships_the_licence_the_page_and_the_dashboards(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{info}/licenses/LICENSE" in names
    assert {"sowtel/tensorboard_plugin/static/index.js",
            "sowtel/tensorboard_plugin/static/charts.js", "sowtel/py.typed",
            "sowtel/dashboards/README.md", "sowtel/dashboards/grafana/sowtel-metrics.json",
            "sowtel/dashboards/grafana/sowtel-traces.json"} <= names
    licence = zipfile.ZipFile(path).read(f"{info}/licenses/LICENSE").decode()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    metadata = zipfile.ZipFile(path).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Project-URL: Source, {HOME}" in metadata


def test_sowtel_dashboards_says_where_they_are(capsys):
    assert run_dashboards(type("Args", (), {"path": True})()) == 0
    assert capsys.readouterr().out.strip() == dashboards_path()
    assert (Path(dashboards_path()) / "grafana" / "sowtel-metrics.json").is_file()
    assert run_dashboards(type("Args", (), {"path": False})()) == 0
    listing = capsys.readouterr().out
    assert "grafana/sowtel-metrics.json" in listing and "README.md" in listing


def test_the_readme_links_work_on_the_package_index_page():
    # The index shows README.md without the repository: every link and image must be absolute,
    # and those into this repository must name files that exist.
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    assert targets
    for target in targets:
        if target.startswith("#"):
            continue  # a heading of the README itself, shown with it
        assert re.match(r"https?://", target), f"README.md links to {target!r}: not absolute"
        for prefix in (f"{HOME}/blob/main/", f"{HOME}/tree/main/",
                       HOME.replace("github.com", "raw.githubusercontent.com") + "/main/"):
            if target.startswith(prefix):
                local = target[len(prefix):].split("#")[0]
                assert (REPO / local).exists(), f"README.md links to {target}: not here"
