"""What one request of the ``sowtel`` plugin costs on large and hostile runs: time, JSON, memory.

Three runs are served by one ``sowtel dashboard`` (a real TensorBoard, in its own process):

1. **Family**: ``eval{i}/h`` written by the TensorBoard exporter at step ``i``, for 5,000 sites
   (what a user who names sites by their step gets): one family of numbered repeats over
   5,000 steps x 5,000 positions, almost all empty. A dense grid of it took 36-61 s, 300 MB of
   JSON and a 2.6 GB peak; the depth route answers a page of positions.
2. **Scan**: one site inside a scan of 2,000 positions, written as the exporter's compact
   depth tensor (``std`` and ``l2``) at each of 2,000 steps (a 48 MB event file).
3. **Bomb**: a 100-byte depth tensor whose shape claims 2 x 50,000,000 values from one stored
   value, which TensorBoard would fill (14 s and a 3.4 GB peak before the plugin refused it).

Each row is one request: its time, the size of its JSON answer, and how far the server's peak
resident memory rose during it (Linux: the peak is reset before each request through
``/proc/PID/clear_refs``). The first depth request of a scan converts its tensors; the next one
reads them from the plugin's cache.

Run: ``python -m benchmarks.bench_plugin_files [--quick] [--markdown FILE]``.

Example:
    >>> from benchmarks import bench_plugin_files
    >>> print(bench_plugin_files.run(quick=True)[0].text())  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import Table, module_main

__all__ = ["run", "main", "family_run", "scan_run", "bomb_run"]


def _stats(std: float) -> dict[str, float]:
    return {"size": 64.0, "mean": 0.0, "std": std, "min": -std, "max": std, "l2": 8 * std,
            "mean_abs": 0.8 * std, "nan": 0.0, "posinf": 0.0, "neginf": 0.0, "zeros": 0.0}


def family_run(logdir: Path, sites: int) -> None:
    """``eval{i}/h`` at step ``i``, through the TensorBoard exporter."""
    from sowtel.exporters.tensorboard import TensorBoardExporter
    from sowtel.records import Record

    exporter = TensorBoardExporter(logdir=logdir)
    for start in range(0, sites, 500):
        exporter.write([Record(name=f"eval{i}/h", mode="primal", tag="intermediates", step=i,
                               index=None, wall_time=1e9 + i, summary="stats", shape=(64,),
                               dtype="float32", stats=_stats(1.0 + i / sites), order=0)
                        for i in range(start, min(start + 500, sites))])
    exporter.close()


def _event_file(logdir: Path) -> Any:
    from sowtel.exporters.tensorboard import _EventFile

    logdir.mkdir(parents=True)
    return _EventFile(str(logdir))


def scan_run(logdir: Path, steps: int, positions: int) -> None:
    """A scanned site's compact depth tensor (index, std, l2) at every step, and its headline
    scalar (as the exporter writes them)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    from sowtel.exporters.tensorboard import _float_tensor, _tensor_metadata
    from sowtel.tensorboard_plugin import depth_content

    f = _event_file(logdir)
    index = np.arange(positions, dtype=np.float32)
    for step in range(steps):
        table = np.stack([index, 1 + index / positions + step / steps, 8 + index / positions])
        f.add(Event(wall_time=1e9 + step, step=step, summary=Summary(value=[Summary.Value(
            tag="blocks/h/primal/depth", tensor=_float_tensor(table),
            metadata=_tensor_metadata(depth_content(["std", "l2"], 1, order=0))
            if step == 0 else None), Summary.Value(tag="blocks/h/primal/l2", simple_value=8.0)])))
    f.close()


def bomb_run(logdir: Path, claimed: int = 50_000_000) -> None:
    """One depth tensor of shape ``[2, claimed]`` storing a single value."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.proto.tensor_pb2 import TensorProto
    from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboardX.proto.types_pb2 import DT_FLOAT

    from sowtel.exporters.tensorboard import _tensor_metadata
    from sowtel.tensorboard_plugin import depth_content

    f = _event_file(logdir)
    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=n) for n in (2, claimed)])
    f.add(Event(wall_time=1e9, step=0, summary=Summary(value=[Summary.Value(
        tag="bomb/primal/depth", metadata=_tensor_metadata(depth_content(["std"], 1)),
        tensor=TensorProto(dtype=DT_FLOAT, tensor_shape=shape, float_val=[1.0]))])))
    f.close()


def _peak_mb(pid: int, reset: bool = False) -> float:
    if reset:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            pass
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ask(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=600) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run(quick: bool = False) -> list[Table]:
    """Builds the three runs, serves them and measures each request; returns the table."""
    from sowtel.dashboard import pick_port

    sites = 1000 if quick else 5000
    steps, positions = (500, 500) if quick else (2000, 2000)
    top = Path(tempfile.mkdtemp(prefix="sowtel-bench-files-"))
    proc = None
    try:
        family_run(top / "family", sites)
        scan_run(top / "scan", steps, positions)
        bomb_run(top / "bomb")
        port = pick_port("127.0.0.1", None)
        proc = subprocess.Popen([sys.executable, "-m", "sowtel.cli", "dashboard", "--logdir",
                                 str(top), "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
        base = f"http://127.0.0.1:{port}/data/plugin/sowtel/"
        q = urllib.parse.urlencode
        family = f"run=family&site={urllib.parse.quote('eval*/h')}&mode=primal&stat=std"
        scan = "run=scan&site=blocks/h&mode=primal&stat=std"
        # Loaded, without asking the plugin for the scan (its first depth answer converts):
        # TensorBoard's own scalars route shows the headline's last step.
        _wait(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=scan&tag="
              f"{urllib.parse.quote('blocks/h/primal/l2')}", proc,
              lambda body: bool(body) and body[-1][1] == steps - 1)
        _wait(f"{base}sites?{q({'run': 'family'})}", proc,
              lambda body: bool(body["sites"]) and body["sites"][0].get("positions") == sites)
        table = Table(f"sowtel plugin: one request on large and hostile runs "
                      f"({sites:,}-site family, {steps:,} x {positions:,} scan)",
                      ["run", "request", "status", "time", "JSON", "peak RSS rise"])
        requests = [
            ("family", "depth (a page of 256 positions)", f"depth?{family}"),
            ("family", "depth, last page, 50 steps",
             f"depth?{family}&offset={sites - 100}&limit=200&max_steps=50"),
            ("family", "overview", "overview?run=family"),
            ("scan", "depth, first (converts)", f"depth?{scan}&max_steps=999"),
            ("scan", "depth (cached)", f"depth?{scan}"),
            ("scan", "overview", "overview?run=scan"),
            ("bomb", "depth", "depth?run=bomb&site=bomb&mode=primal&stat=std"),
        ]
        for run_name, what, path in requests:
            floor = _peak_mb(proc.pid, reset=True)
            t0 = time.perf_counter()
            status, body = _ask(base + path)
            took = time.perf_counter() - t0
            table.add(run_name, what, status, f"{took:.2f} s", f"{len(body) / 1e6:.2f} MB",
                      f"{_peak_mb(proc.pid) - floor:.0f} MB")
        table.notes.append("peak RSS rise: the server's peak resident memory during the "
                           "request, above its resident memory before it")
        return [table]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(top, ignore_errors=True)


def _wait(url: str, proc: subprocess.Popen[bytes], done: Any) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"TensorBoard exited ({proc.returncode}) while loading")
        try:
            status, body = _ask(url)
            if status == 200 and done(json.loads(body)):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"TensorBoard did not load {url} within 600 s")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.bench_plugin_files [--quick] [--markdown FILE]``."""
    return module_main(argv, "bench_plugin_files", __doc__, lambda args: run(args.quick))


if __name__ == "__main__":
    sys.exit(main())
