"""The ``sowtel`` plugin under hostile or odd event files, served by a real TensorBoard.

Each run here is one a user (or a damaged disk, or someone probing the server) can put in a
logdir: a family of 5,000 numbered sites, each at its own step (what ``eval{i}/h`` names
give), and hand-crafted files whose sowtel tags hold what the exporter never writes. Every
route answers every one of them with data or a 400 whose message is written for a person,
never a 500, and never more than a bounded amount of work and memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.proto.tensor_pb2 import TensorProto
from tensorboardX.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboardX.proto.types_pb2 import DT_FLOAT, DT_STRING
from test_demo_dashboard import ENV, REPO, free_port, get_json, sowtel_cmd, stop, wait_for

from sowtel.exporters._tensorboard_events import EventFile as _EventFile
from sowtel.exporters.tensorboard import (
    TensorBoardExporter,
    _float_tensor,
    _tensor_metadata,
)
from sowtel.records import Record
from sowtel.tensorboard_plugin import (
    NONFINITE_CONTENT,
    NONFINITE_TAG,
    depth_content,
    parse_content,
)

FAMILY = 5000
# What a message written for a person never holds: Python's own words for its failures.
INTERNALS = re.compile(r"unpack|Traceback|NoneType|has no attribute|not subscriptable|"
                       r"invalid literal|unhashable|KeyError|IndexError|TypeError|object of type")


def stats(std: float, nan: float = 0.0) -> dict[str, float]:
    return {"size": 64.0, "mean": 0.0, "std": std, "min": -std, "max": std, "l2": 8 * std,
            "mean_abs": 0.8 * std, "nan": nan, "posinf": 0.0, "neginf": 0.0, "zeros": 0.0}


def family_run(logdir: Path) -> None:
    """``eval{i}/h`` at step ``i``: 5,000 sites that form one family of numbered repeats."""
    exporter = TensorBoardExporter(logdir=logdir)
    for start in range(0, FAMILY, 500):
        exporter.write([Record(name=f"eval{i}/h", mode="primal", tag="intermediates", step=i,
                               index=None, wall_time=1e9 + i, summary="stats", shape=(64,),
                               dtype="float32", stats=stats(1.0 + i / FAMILY), order=0)
                        for i in range(start, start + 500)])
    exporter.close()


def tensor_value(tag: str, content: bytes | None, tensor: TensorProto) -> Summary.Value:
    return Summary.Value(tag=tag, tensor=tensor,
                         metadata=None if content is None else _tensor_metadata(content))


def string_tensor(text: bytes) -> TensorProto:
    return TensorProto(dtype=DT_STRING, tensor_shape=TensorShapeProto(), string_val=[text])


def crafted_run(logdir: Path) -> None:
    """Sowtel tags holding what the exporter never writes, beside one well-formed site."""
    logdir.mkdir(parents=True)
    f = _EventFile(str(logdir))
    good = np.array([[0, 1, 2], [0.5, 0.6, 0.7], [1.0, 1.1, 1.2]], dtype=np.float32)
    odd_index = np.array([[0, np.nan, -1, 2.5, 3], [1, 2, 3, 4, 5]], dtype=np.float32)
    for step in range(3):
        values = [
            tensor_value("good/primal/depth", depth_content(["std", "l2"], 1, order=0)
                         if step == 0 else None,
                         _float_tensor(good * np.array([[1], [step + 1], [step + 1]]))),
            # Rows named by numbers, a negative index rank, no mode in the tag.
            tensor_value("numbers/primal/depth", b'{"version": 1, "stats": [1, 2], '
                         b'"index_rank": 1}' if step == 0 else None, _float_tensor(good)),
            tensor_value("negative/primal/depth", b'{"version": 1, "stats": ["l2"], '
                         b'"index_rank": -1}' if step == 0 else None, _float_tensor(good)),
            tensor_value("x/depth", depth_content(["std"], 1) if step == 0 else None,
                         _float_tensor(good[:2])),
            # A string where numbers belong, and index rows that are not positions.
            tensor_value("text/primal/depth", depth_content(["std"], 1) if step == 0 else None,
                         string_tensor(b"not numbers")),
            tensor_value("oddindex/primal/depth", depth_content(["std"], 1)
                         if step == 0 else None, _float_tensor(odd_index)),
            tensor_value("huge/primal/depth", depth_content(["std"], 3) if step == 0 else None,
                         _float_tensor(np.array([[2.0**30]] * 3 + [[1.0]], np.float32))),
            tensor_value("notjson/primal/depth", b"\xff\xfe{" if step == 0 else None,
                         _float_tensor(good)),
        ]
        # The non-finite list: an int index (as a person would write it), then rows of every
        # wrong shape.
        rows = [[["good", "primal", 2, 3]], "not a list", [[1, 2]], [["g", "primal", "x", 1]]]
        values.append(tensor_value(NONFINITE_TAG, NONFINITE_CONTENT if step == 0 else None,
                                   string_tensor(json.dumps(rows[step]).encode())))
        f.add(Event(wall_time=1e9 + step, step=step, summary=Summary(value=values)))
    # The alert and the custom-scalars layout, as bytes that are neither text nor a layout.
    f.add(Event(wall_time=1e9, step=0, summary=Summary(value=[
        Summary.Value(tag="sowtel/alerts/text_summary", tensor=string_tensor(b"\xff\xfe\x00"),
                      metadata=_plugin_metadata("text")),
        Summary.Value(tag="custom_scalars__config__", tensor=string_tensor(b"\x08\xff\xff"),
                      metadata=_plugin_metadata("custom_scalars"))])))
    f.close()


def _plugin_metadata(name: str):
    from tensorboardX.proto.summary_pb2 import SummaryMetadata

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=name))
    return SummaryMetadata.FromString(meta.SerializeToString() + b"\x20\x02")


def peak_rss_mb(pid: int, reset: bool = False) -> float:
    """The process's peak resident memory; with ``reset``, first set back to what it holds now
    (Linux's ``clear_refs``), so the next call measures from here."""
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    top = tmp_path_factory.mktemp("hostile")
    family_run(top / "family")
    crafted_run(top / "crafted")
    odd_run(top / "odd")
    bomb_run(top / "bombs")
    port = free_port()
    proc = subprocess.Popen(sowtel_cmd("dashboard", "--logdir", str(top), "--port", str(port)),
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}/data/plugin/sowtel"
    try:
        def loaded() -> bool:
            sites = get_json(f"{base}/sites?run=family", timeout=60)
            return (isinstance(sites, dict) and bool(sites["sites"])
                    and sites["sites"][0]["positions"] == FAMILY)

        wait_for("TensorBoard to load the runs", loaded, 300, proc)
        wait_for("the crafted runs", lambda: {"crafted", "odd", "bombs"} <= set(
            get_json(f"{base}/runs")["runs"]), 60, proc)
        yield {"base": base, "proc": proc}
    finally:
        stop(proc)


def ask(base: str, route: str, **query: str) -> tuple[int, dict, int]:
    """(status, JSON body, body size) of a GET, whatever its status."""
    url = f"{base}/{route}?{urllib.parse.urlencode(query)}"
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw), len(raw)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw), len(raw)


def test_a_family_of_5000_sites_at_their_own_steps_is_answered_in_bounded_pages(served):
    base, proc = served["base"], served["proc"]
    before = peak_rss_mb(proc.pid)
    started = time.monotonic()
    code, depth, size = ask(base, "depth", run="family", site="eval*/h", mode="primal",
                            stat="std")
    took = time.monotonic() - started
    assert code == 200, depth
    # A page of 256 positions and at most 1,000 steps, out of 5,000 x 5,000.
    assert depth["positions"] == FAMILY and len(depth["index"]) == 256
    assert depth["index"] == list(range(256)) and len(depth["steps"]) == 256
    assert depth["values"][7][7] == pytest.approx(1.0 + 7 / FAMILY, rel=1e-6)
    assert depth["values"][7][8] is None  # eval8/h did not run at step 7
    code, page2, _ = ask(base, "depth", run="family", site="eval*/h", mode="primal",
                         stat="std", offset="4900", limit="200", max_steps="50")
    assert code == 200 and page2["index"] == list(range(4900, 5000))
    assert len(page2["steps"]) == 50 and page2["downsampled"] is True
    code, overview, overview_size = ask(base, "overview", run="family")
    assert code == 200 and [r["site"] for r in overview["rows"]] == ["eval*/h"]
    assert len(overview["rows"][0]["spark"]["index"]) <= 32
    # What a dense grid cost here: 36 s, 300 MB of JSON, 2.6 GB at its peak.
    assert size < 2_000_000 and overview_size < 1_000_000
    assert peak_rss_mb(proc.pid) - before < 300
    print(f"family depth page: {size / 1e3:.0f} kB in {took:.2f} s; peak RSS "
          f"{before:.0f} -> {peak_rss_mb(proc.pid):.0f} MB")
    # Asking for more than a bounded answer is a 400 that says what to ask instead.
    code, body, _ = ask(base, "depth", run="family", site="eval*/h", mode="primal",
                        stat="std", max_steps="5000", limit="4096")
    assert code == 400 and "cells: ask for fewer steps or positions" in body["error"]


def test_crafted_files_get_answers_not_failures(served):
    base = served["base"]
    code, sites, _ = ask(base, "sites", run="crafted")
    assert code == 200
    # The well-formed site is listed; the others are read around.
    assert [s["site"] for s in sites["sites"]] == ["good", "huge", "oddindex", "text"]
    code, overview, _ = ask(base, "overview", run="crafted")
    assert code == 200
    assert {s["tag"] for s in overview["skipped"]} == {
        "numbers/primal/depth", "negative/primal/depth", "x/depth", "notjson/primal/depth"}
    code, depth, _ = ask(base, "depth", run="crafted", site="good", mode="primal", stat="l2")
    assert code == 200 and depth["index"] == [0, 1, 2] and depth["steps"] == [0, 1, 2]
    assert depth["values"][1] == pytest.approx([2.0, 2.2, 2.4])
    # Index rows that are not positions (NaN, negative, fractional) drop those columns.
    code, odd, _ = ask(base, "depth", run="crafted", site="oddindex", mode="primal",
                       stat="std")
    assert code == 200 and odd["index"] == [0, 3]
    code, text, _ = ask(base, "depth", run="crafted", site="text", mode="primal", stat="std")
    assert code == 200 and text["steps"] == [] and text["values"] == []
    # The non-finite row with an int index is read as the index it names.
    code, health, _ = ask(base, "health", run="crafted")
    assert code == 200
    assert [(s["site"], s["mode"], s["first_step"], s["first_index"]) for s in
            health["sites"]] == [("good", "primal", 0, 2)]
    assert health["first"]["text"] is not None  # the alert's bytes, shown as text


@pytest.mark.parametrize("route,query,says", [
    ("depth", {"run": "crafted", "site": "x", "mode": "depth", "stat": "std"},
     "site='x' is not a site inside a scan or repeated by number in run 'crafted': pick one"),
    ("depth", {"run": "crafted", "site": "huge", "mode": "primal", "stat": "std"},
     "site 'huge' has positions too large to number"),
    ("depth", {"run": "crafted", "site": "numbers", "mode": "primal", "stat": "1"},
     "site='numbers' is not a site inside a scan"),
    ("depth", {"run": "crafted", "site": "good", "mode": "primal", "stat": "nope"},
     "stat='nope' is not recorded for site 'good' (primal): pick one of"),
    ("depth", {"run": "crafted", "site": "good", "mode": "primal", "stat": "l2",
               "limit": "ten"}, "limit='ten' is not a whole number: pass 1 to"),
    ("depth", {"run": "crafted", "site": "good", "mode": "primal", "stat": "l2",
               "offset": "-1"}, "offset=-1 is out of range: pass 0 to"),
    ("depth", {"run": "family", "site": "eval*/h", "mode": "primal", "stat": "std",
               "max_steps": "0"}, "max_steps=0 is out of range: pass 1 to 5000"),
    ("series", {"run": "family", "site": "eval*/h", "mode": "primal", "stat": "std"},
     "site='eval*/h' is not a site or logged scalar in run 'family'"),
    ("series", {"run": "crafted", "site": "good"}, "the query parameter mode= is missing"),
    ("overview", {"run": "nope"}, "run='nope' holds no sowtel data: pick one of"),
    ("overview", {"run": "crafted", "points": "1"}, "points=1 is out of range: pass 2 to"),
    ("sites", {}, "the query parameter run= is missing"),
    ("health", {"run": "../../etc"}, "run='../../etc' holds no sowtel data"),
])
def test_bad_queries_get_a_400_written_for_a_person(served, route, query, says):
    code, body, _ = ask(served["base"], route, **query)
    assert code == 400, body
    assert says in body["error"] and not INTERNALS.search(body["error"]), body["error"]


# -- event files that would take a server down: through both of TensorBoard's loaders --------

def shape(*dims: int) -> TensorShapeProto:
    return TensorShapeProto(dim=[TensorShapeProto.Dim(size=n) for n in dims])


BOMB = (2, 25_000_000)  # 50,000,000 float32 values (200 MB) claimed by a 100-byte tensor


def odd_run(logdir: Path) -> None:
    """Fields no parser of the plugin expected: each was a 500 (or gigabytes) before."""
    logdir.mkdir(parents=True)
    f = _EventFile(str(logdir))
    good = np.array([[0, 1, 2], [0.5, 0.6, 0.7]], dtype=np.float32)
    digits = "9" * 5000  # longer than Python reads as an int by default
    values = [
        tensor_value("good/primal/depth", depth_content(["std"], 1, order=0), _float_tensor(good)),
        # Data that does not fill the shape; a step of no columns.
        tensor_value("short/primal/depth", depth_content(["std"], 1), TensorProto(
            dtype=DT_FLOAT, tensor_shape=shape(2, 3), tensor_content=b"\0\0\0\0")),
        tensor_value("empty/primal/depth", depth_content(["std"], 1),
                     _float_tensor(np.zeros((2, 0), np.float32))),
        # Metadata nested 20,000 deep, a 5,000-digit number, an order that is not whole.
        tensor_value("deep/primal/depth", b"[" * 20_000 + b"]" * 20_000, _float_tensor(good)),
        tensor_value("long/primal/depth", b'{"version": 1, "stats": ["std"], "index_rank": 1, '
                     b'"order": ' + digits.encode() + b"}", _float_tensor(good)),
        tensor_value("half/primal/depth", b'{"version": 1, "stats": ["std"], "index_rank": 1, '
                     b'"order": 1.5}', _float_tensor(good)),
        # Numbers of 5,000 digits where tags and the alert hold an index, a family number, a step.
        Summary.Value(tag=f"a[{digits}]/primal/std", simple_value=1.0),
        Summary.Value(tag=f"c[{digits}]/primal/nan", simple_value=1.0),
        Summary.Value(tag=f"eval{digits}/h/primal/std", simple_value=1.0),
        Summary.Value(tag="sowtel/alerts/text_summary", metadata=_plugin_metadata("text"),
                      tensor=string_tensor(f"step {digits}, site `a` (primal, index "
                                           f"[{digits}])".encode())),
    ]
    f.add(Event(wall_time=1e9, step=0, summary=Summary(value=values)))
    # The non-finite list: a count of 400 digits, rows nested 50,000 deep, then a good row.
    for step, rows in enumerate([b'[["good", "primal", 1, ' + b"9" * 400 + b"]]",
                                 b'[["good", "primal", ' + b"[" * 50_000 + b"]" * 50_000 + b", 1]]",
                                 b'[["good", "primal", 2, 3]]']):
        f.add(Event(wall_time=1e9 + step, step=step, summary=Summary(value=[tensor_value(
            NONFINITE_TAG, NONFINITE_CONTENT if step == 0 else None, string_tensor(rows))])))
    f.close()


def bomb_run(logdir: Path) -> None:
    """Tensors whose shape claims millions of values they do not store: TensorBoard would
    fill them from the one value stored."""
    logdir.mkdir(parents=True)
    f = _EventFile(str(logdir))
    f.add(Event(wall_time=1e9, step=0, summary=Summary(value=[
        tensor_value("bomb/primal/depth", depth_content(["std"], 1),
                     TensorProto(dtype=DT_FLOAT, tensor_shape=shape(*BOMB), float_val=[1.0])),
        tensor_value("good/primal/depth", depth_content(["std"], 1, order=0),
                     _float_tensor(np.array([[0, 1], [0.5, 0.6]], np.float32))),
        tensor_value(NONFINITE_TAG, NONFINITE_CONTENT, TensorProto(
            dtype=DT_STRING, tensor_shape=shape(20_000_000), string_val=[b"[]"]))])))
    f.close()


@pytest.fixture(scope="module", params=["data server", "python loader"])
def odd_served(request, tmp_path_factory):
    """The odd and bomb runs, served by TensorBoard's data server (what ``sowtel dashboard``
    gets where it is installed: the server above) and by its Python loader
    (``--load_fast=false``), which hand the plugin its tensors differently."""
    if request.param == "data server":
        yield request.getfixturevalue("served")
        return
    top = tmp_path_factory.mktemp("odd")
    odd_run(top / "odd")
    bomb_run(top / "bombs")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(top),
                             "--port", str(port), "--load_fast=false", "--samples_per_plugin",
                             "sowtel=0", "--reload_interval", "2"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}/data/plugin/sowtel"
    try:
        wait_for("TensorBoard to load the odd runs", lambda: get_json(
            f"{base}/runs", timeout=60)["runs"] == ["bombs", "odd"], 120, proc)
        yield {"base": base, "proc": proc}
    finally:
        stop(proc)


def readable(message: str) -> str:
    assert not INTERNALS.search(message), message
    return message


def test_tensors_claiming_more_values_than_stored_are_refused_before_they_take_memory(
        odd_served):
    base, proc = odd_served["base"], odd_served["proc"]
    before = peak_rss_mb(proc.pid, reset=True)
    started = time.monotonic()
    code, depth, _ = ask(base, "depth", run="bombs", site="bomb", mode="primal", stat="std")
    took = time.monotonic() - started
    assert code == 400, depth
    assert readable(depth["error"]) == (
        "tag 'bomb/primal/depth' of run 'bombs' at step 0: its shape [2, 25000000] claims "
        "50,000,000 values but it stores 1; the event file is damaged or not one sowtel writes")
    # The overview says it on the bomb's row and draws the other site; health lists the
    # non-finite list it could not read.
    code, overview, _ = ask(base, "overview", run="bombs")
    assert code == 200
    rows = {r["site"]: r for r in overview["rows"]}
    assert rows["bomb"]["error"] == depth["error"] and rows["good"]["last"]["positions"] == 2
    code, health, _ = ask(base, "health", run="bombs")
    assert code == 200 and health["sites"] == []
    assert [s["tag"] for s in health["skipped"]] == [NONFINITE_TAG]
    assert "its shape [20000000] claims 20,000,000 values but it stores 1" in readable(
        health["skipped"][0]["why"])
    # Filled, the two would be 200 MB and 160 MB of pointers (and seconds of work).
    grew = peak_rss_mb(proc.pid) - before
    assert grew < 60, f"peak RSS grew {grew:.0f} MB"
    print(f"bomb refused in {took:.2f} s; peak RSS grew {grew:.0f} MB")


def test_malformed_fields_get_answers_whose_messages_name_the_field(odd_served):
    base = odd_served["base"]
    code, sites, _ = ask(base, "sites", run="odd")
    assert code == 200, sites
    listed = [s["site"] for s in sites["sites"]]
    # A number too long for an index or a family number: a plain site, never a position.
    assert listed == ["good", "empty", "eval" + "9" * 5000 + "/h", "short"]
    code, overview, _ = ask(base, "overview", run="odd")
    assert code == 200
    why = {s["tag"]: readable(s["why"]) for s in overview["skipped"]}
    assert why == {
        "deep/primal/depth": "sowtel depth metadata is JSON nested too deep or with a number "
                             "too long to read",
        "long/primal/depth": "sowtel depth metadata is JSON nested too deep or with a number "
                             "too long to read",
        "half/primal/depth": "sowtel depth metadata has order 1.5: it must be a whole number "
                             "(the site's place in its program)"}
    code, short, _ = ask(base, "depth", run="odd", site="short", mode="primal", stat="std")
    assert code == 400 and readable(short["error"]) == (
        "tag 'short/primal/depth' of run 'odd' at step 0: its stored data does not fill its "
        "shape [2, 3]; the event file is damaged or not one sowtel writes")
    code, empty, _ = ask(base, "depth", run="odd", site="empty", mode="primal", stat="std")
    assert code == 200 and empty["positions"] == 0 and empty["index"] == []
    code, good, _ = ask(base, "depth", run="odd", site="good", mode="primal", stat="std")
    assert code == 200 and good["values"] == [pytest.approx([0.5, 0.6, 0.7])]
    # The rows of the non-finite list that cannot be read are left out; the good one counts.
    code, health, _ = ask(base, "health", run="odd")
    assert code == 200, health
    assert [(s["site"], s["first_step"], s["first_index"], s["steps"])
            for s in health["sites"]] == [("good", 2, 2, 1)]
    assert health["first"]["step"] is None and health["first"]["text"].startswith("step 999")


@pytest.mark.parametrize("metadata,says", [
    (b'{"version": 1, "stats": [1, 2], "index_rank": 1}',
     "has stats [1, 2]: it must be a list of distinct statistic names (1 to 32 of a-z, 0-9, _)"),
    (b'{"version": 1, "stats": ["l2"], "index_rank": -1}',
     "has index_rank -1: it must be a whole number from 1 to 8"),
    (b'{"version": 1, "stats": ["l2"], "index_rank": true}', "has index_rank True"),
    (b'{"version": 2, "stats": ["l2"], "index_rank": 1}', "has version 2, not 1"),
    (b'[1]', "is the JSON [1], not an object"),
    (b'{"version": 1', "is not JSON (Expecting ',' delimiter at character 13)"),
    (b'\xff\xfe{', "is not UTF-8 text"),
    (b'{"a": "' + b"x" * 70_000 + b'"}', "of 70,009 bytes is longer than 65,536"),
])
def test_depth_metadata_messages_say_which_field_is_wrong(metadata, says):
    with pytest.raises(ValueError) as e:
        parse_content(metadata)
    assert says in readable(str(e.value))
