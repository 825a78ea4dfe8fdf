"""The README, docs/tensorboard.md and the demo's own docstring say what the demo does.

Numbers and names the documents state about ``sowtel demo`` are checked against the demo: its
default steps, its sites in program order, its records per step. The README's screenshot
carries, as PNG text chunks, the steps and sites of the run it was taken from
(``python -m benchmarks.screenshots``): a demo that changes without a new screenshot fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.screenshots import SITES_KEY, STEPS_KEY, VIEW_KEY
from sowtel import demo

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TENSORBOARD_DOC = (REPO / "docs" / "tensorboard.md").read_text()
RAW = "https://raw.githubusercontent.com/sowtel/sowtel/main/"


@pytest.fixture(scope="module")
def ran() -> dict:
    """Two steps of the demo: its sites in program order and its records per step."""
    from sowtel.exporters.memory import MemoryExporter

    memory = MemoryExporter()
    demo.train(2, memory, progress=False)
    records = sorted(memory.records, key=lambda r: (r.step, r.order))
    sites = list(dict.fromkeys(r.name for r in records if r.mode == "primal"))
    return {"sites": sites, "per_step": len(records) // 2}


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def test_the_documents_state_the_demos_default_steps():
    steps = demo.DEFAULT_STEPS
    [readme] = re.findall(r"make demo\s+# trains a small model for ([0-9,]+) steps", README)
    assert int(readme.replace(",", "")) == steps
    [doc] = re.findall(r"`--steps` \(default ([0-9]+)", TENSORBOARD_DOC)
    assert int(doc) == steps
    # The screenshot's caption, as the README shows it.
    assert f"{steps:,} training steps" in README


def test_the_documents_list_the_demos_sites_and_records(ran):
    demo_doc = section(TENSORBOARD_DOC, "## `sowtel demo`")
    assert re.findall(r"^\| `([^`]+)` \|", demo_doc, re.M) == ran["sites"]
    [per_step] = re.findall(r"\(([0-9]+) records per step\)", demo_doc)
    assert int(per_step) == ran["per_step"]
    assert re.findall(r"^- ``([^`]+)``:", demo.__doc__ or "", re.M) == ran["sites"]
    # The demo writes no per-block scalar series by default: its docstring must not promise
    # them (it once listed blocks/h[0]).
    assert "blocks/h[0]" not in (demo.__doc__ or "")


def test_the_readme_screenshot_is_of_the_demo_as_it_is(ran):
    [image] = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert image.startswith(RAW), image
    local = REPO / image[len(RAW):]
    # docs/tensorboard.md shows the same picture.
    assert f"({local.relative_to(REPO / 'docs')})" in TENSORBOARD_DOC
    text = Image.open(local).text  # type: ignore[attr-defined]
    assert int(text[STEPS_KEY]) == demo.DEFAULT_STEPS, (
        "the README's screenshot is of another number of steps: retake it with "
        "python -m benchmarks.screenshots docs/images/sowtel-depth-view.png")
    assert text[SITES_KEY].split(",") == ran["sites"]
    assert text[VIEW_KEY].startswith("run=demo")


def test_pasted_dashboard_blocks_start_one_session_each():
    # A Python block a reader pastes whole must not stack sessions with two enable() calls.
    for doc in (REPO / "dashboards" / "README.md", REPO / "docs" / "tensorboard.md"):
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            assert block.count("sowtel.enable(") <= 1, (doc.name, block)
