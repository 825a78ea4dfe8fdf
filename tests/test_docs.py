"""Every Python code block of README.md and docs/*.md runs as written.

The convention: a fenced block whose info string is ``python`` runs; the blocks of one file run
in order, in one fresh Python process (a later block may use what an earlier one defined), with
a scratch directory as the working directory, so files a block writes (``runs/``, dumps) land
there. A block that is deliberately not runnable on its own (a signature, a fragment of a
larger program) is marked by the line just before its opening fence::

    <!-- fragment -->

Keep such blocks few: a fragment is documentation nobody checks. A failure names the file and
the block's first line, and the traceback points into the Markdown file itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
# Eight CPU devices, as tests/conftest.py sets, for the shard_map and pmap examples.
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
       "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)(.*)$")

# Runs the blocks handed over as JSON, each compiled with its Markdown file and line as its
# file name, so that a traceback shows where in the document it failed.
_RUNNER = """
import json, sys
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for path, line, source in blocks:
    print(f"--- {path}:{line}", flush=True)
    exec(compile("\\n" * (line) + source, path, "exec"), namespace)
"""


def python_blocks(path: Path) -> tuple[list[tuple[int, str]], list[int]]:
    """(first line, source) of each runnable python block, and the lines of fragments."""
    lines = path.read_text().splitlines()
    blocks: list[tuple[int, str]] = []
    fragments: list[int] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        if lang == "python":
            if i > 0 and lines[i - 1].strip() == FRAGMENT:
                fragments.append(i + 1)
            else:
                blocks.append((i + 1, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks, fragments


def test_the_convention_finds_blocks_and_fragments(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```python\nx = 1\n```\n<!-- fragment -->\n```python\nf(x)\n```\n"
                   "```sh\nmake test\n```\n````python\ny = '```'\n````\n")
    blocks, fragments = python_blocks(doc)
    assert blocks == [(2, "x = 1\n"), (12, "y = '```'\n")]
    assert fragments == [6]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_runs(doc, tmp_path):
    blocks, _ = python_blocks(doc)
    if not blocks:
        return  # a document without Python blocks has nothing to run
    payload = json.dumps([(str(doc.relative_to(REPO)), line, src) for line, src in blocks])
    out = subprocess.run([sys.executable, "-c", _RUNNER], input=payload, cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=540)
    ran = re.findall(r"^--- (.*)$", out.stdout, re.M)
    assert out.returncode == 0, (
        f"{ran[-1] if ran else doc.name} failed:\n{out.stderr[-4000:]}")
    assert len(ran) == len(blocks)


def test_fragments_are_few():
    counts = {doc.name: (len(python_blocks(doc)[0]), len(python_blocks(doc)[1])) for doc in DOCS}
    runnable = sum(r for r, _ in counts.values())
    fragments = sum(f for _, f in counts.values())
    assert fragments <= max(3, runnable // 4), counts


def test_docs_cite_only_documents_in_the_repository():
    for doc in [*DOCS, REPO / "dashboards" / "README.md"]:
        text = doc.read_text()
        assert not re.search(r"DESIGN\b", text), f"{doc.name} cites a design document"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, not here"
