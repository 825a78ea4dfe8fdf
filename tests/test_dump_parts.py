"""Reading the per-process parts of a multi-process dump as one dump of global values.

The parts here are built from ordinary dumps whose headers are rewritten (and re-signed) to say
which process wrote them and where each shard lies in the global value, so every rule of the
reader can be checked in one process. tests/test_multiprocess.py writes real parts from two
``jax.distributed`` processes and reads them back with the same functions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from reference import numpy_stats
from test_hostile import forged

from sowtel import dumps
from sowtel.cli import main
from sowtel.dumps import _read as _dump_read
from sowtel.dumps import dump, find_dumps, info, load
from sowtel.postmortem import diff_dumps, inspect_dump

VALUE = np.arange(24, dtype=np.float32).reshape(6, 4) * 0.5 - 3.0
# Process 0 holds rows 0..2 in two shards, process 1 rows 2..6 in one.
BLOCKS = [[((0, 1), (0, 4)), ((1, 2), (0, 4))], [((2, 6), (0, 4))]]


def write_parts(folder: Path, blocks=BLOCKS, *, value=VALUE, step: int = 0,
                name: str | None = None, count: int | None = None, index_of=None) -> list[Path]:
    """The parts of a dump of ``value`` (site "h", primal) in which process k holds blocks[k]."""
    folder.mkdir(parents=True, exist_ok=True)
    count = len(blocks) if count is None else count
    paths = []
    for k, boxes in enumerate(blocks):
        index = k if index_of is None else index_of(k)
        shards = {f"b{i}": {"primal": value[tuple(slice(b, e) for b, e in box)].copy()}
                  for i, box in enumerate(boxes)}
        plain = dump(shards or {"none": {"primal": None}}, folder / f".plain_{k}.safetensors",
                     step=step)
        node = {"global": {"shape": list(value.shape), "dtype": value.dtype.name,
                           "shards": [[f"b{i}::primal", [list(b) for b in box]]
                                      for i, box in enumerate(boxes)]}}
        target = folder / (name or f"step_{step}.process_{index}.safetensors").format(k=k)
        paths.append(forged(plain, target, process=json.dumps({"index": index, "count": count}),
                            sites=json.dumps([["h", [["primal", node]]]])))
        plain.unlink()
    return paths


def test_parts_read_back_as_the_global_value_from_any_part_the_list_or_the_folder(tmp_path):
    p0, p1 = write_parts(tmp_path / "dumps")
    for read in (lambda: load(p0), lambda: load(p1), lambda: load([p1, p0]),
                 lambda: load(tmp_path / "dumps")[0], lambda: load(p0, lazy=True)):
        got = read()
        assert list(got) == ["h"] and list(got["h"]) == ["primal"]
        np.testing.assert_array_equal(got["h"]["primal"], VALUE)
        assert got["h"]["primal"].dtype == np.float32
    assert find_dumps(tmp_path / "dumps") == {0: p0}


def test_info_of_a_part_is_that_part_and_the_combined_info_lists_every_shard(tmp_path):
    p0, p1 = write_parts(tmp_path)
    i1 = info(p1)
    assert i1.process == (1, 2) and i1.parts == ()
    (entry,) = i1.entries
    assert (entry.name, entry.shape, entry.dtype, entry.key) == ("h", (6, 4), "float32", "")
    assert entry.shards == ((1, "b0::primal", ((2, 6), (0, 4))),)
    whole = dumps.open_dump(p1).info()
    assert whole.process is None and whole.parts == (p0, p1)
    assert [(k, box) for k, _, box in whole.entries[0].shards] == [
        (0, ((0, 1), (0, 4))), (0, ((1, 2), (0, 4))), (1, ((2, 6), (0, 4)))]
    assert whole.nbytes == VALUE.nbytes


def test_inspect_and_diff_report_the_global_value(tmp_path, capsys):
    p0, p1 = write_parts(tmp_path / "parts")
    report = inspect_dump(p0)
    want = numpy_stats(VALUE)
    got = report.rows[0].stats
    for key in ("size", "mean", "std", "min", "max", "l2", "zeros"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert report.rows[0].entry.shape == (6, 4)
    whole = dump({"h": {"primal": VALUE}}, tmp_path / "whole.safetensors")
    assert diff_dumps(p1, whole).equal
    changed = dump({"h": {"primal": VALUE + np.eye(6, 4, dtype=np.float32)}},
                   tmp_path / "changed.safetensors")
    report = diff_dumps(changed, p0)
    assert not report.equal and report.entries[0].beyond == 4
    # The command takes one part, or all of them.
    for argv in (["inspect", str(p0)], ["inspect", str(p0), str(p1)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "global values of 2 processes' parts" in out and "(6, 4)" in out
    assert main(["inspect", "--json", str(p1)]) == 0
    report = json.loads(capsys.readouterr().out)["dumps"][0]
    assert report["parts"] == [str(p0), str(p1)] and report["path"] == str(p0)
    assert report["entries"][0]["stats"]["max"] == pytest.approx(float(VALUE.max()))


def test_a_process_holding_no_shard_still_writes_its_part(tmp_path):
    # A replicated value: only process 0 holds the copy with replica_id 0.
    paths = write_parts(tmp_path, [[((0, 6), (0, 4))], []])
    np.testing.assert_array_equal(load(paths[1])["h"]["primal"], VALUE)
    assert info(paths[1]).entries[0].shards == ()


def test_zero_size_global_values_read_back(tmp_path):
    empty = np.zeros((0, 3), np.float16)
    paths = write_parts(tmp_path, [[((0, 0), (0, 3))], []], value=empty)
    got = load(paths[0])["h"]["primal"]
    assert got.shape == (0, 3) and got.dtype == np.float16


@pytest.mark.parametrize("blocks, words", [
    ([[((0, 3), (0, 4))], [((2, 6), (0, 4))]], "overlap along axis 0"),
    ([[((0, 2), (0, 4))], [((3, 6), (0, 4))]], "leave a gap along axis 0 at 2"),
    ([[((0, 2), (0, 4))], [((2, 5), (0, 4))]], "no part holds elements 5..5 along axis 0"),
    ([[((0, 2), (0, 4))], [((2, 6), (0, 2)), ((0, 2), (0, 4))]], "overlap along axis 1"),
    ([[((0, 3), (0, 2)), ((3, 6), (2, 4))], [((0, 3), (2, 4))]],
     "a shard is missing or held twice"),
    ([[((0, 2), (0, 4))], [((0, 2), (0, 4)), ((2, 6), (0, 4))]],
     "a shard is missing or held twice"),
])
def test_parts_that_do_not_tile_the_value_exactly_are_refused(tmp_path, blocks, words):
    paths = write_parts(tmp_path, blocks)
    with pytest.raises(ValueError, match="'h' \\(primal\\)") as caught:
        load(paths[0])
    assert words in str(caught.value)


def test_incomplete_or_inconsistent_sets_of_parts_are_named(tmp_path):
    p0, p1 = write_parts(tmp_path / "a")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(p0, alone / p0.name)
    with pytest.raises(ValueError, match="step_0.process_1.safetensors'; copy every process"):
        load(alone / p0.name)
    with pytest.raises(ValueError, match="the part of process 1 of this 2-process dump is "
                                         "missing"):
        load([p0])
    with pytest.raises(ValueError, match="are both process 0's part"):
        load([p0, p0])
    (q1,) = write_parts(tmp_path / "b", BLOCKS[1:], step=1, count=2, index_of=lambda k: 1)
    with pytest.raises(ValueError, match="of step 1 .* of step 0: they are not parts of one"):
        load([p0, q1])
    (r1,) = write_parts(tmp_path / "c", BLOCKS[1:], count=3, index_of=lambda k: 1)
    with pytest.raises(ValueError, match="a 3-process dump .* a 2-process one"):
        load([p0, r1])
    other = dump({"g": {"primal": np.ones(2, np.float32)}}, tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match="is a whole dump, not one process's part"):
        load([p0, other])
    (s1,) = write_parts(tmp_path / "d", [[((2, 6), (0, 4))]], value=np.zeros((6, 4)),
                        index_of=lambda k: 1, count=2)
    with pytest.raises(ValueError, match="hold different sites, modes or structures"):
        load([p0, s1])
    renamed = tmp_path / "a" / "renamed.safetensors"
    p0.rename(renamed)
    with pytest.raises(ValueError, match="does not say where the others are"):
        load(renamed)
    assert load([renamed, p1])["h"]["primal"].shape == (6, 4)
    with pytest.raises(ValueError, match="load\\(\\[p0\\]\\)|empty list"):
        load([])


def test_a_folder_with_a_whole_dump_and_parts_of_one_step_is_refused(tmp_path):
    write_parts(tmp_path)
    dump({"h": {"primal": VALUE}}, tmp_path, step=0)
    with pytest.raises(ValueError, match="a whole dump and per-process parts for step 0"):
        find_dumps(tmp_path)


def test_the_command_names_what_is_wrong_with_a_set_and_exits_2(tmp_path, capsys):
    p0, _ = write_parts(tmp_path / "a")
    (q1,) = write_parts(tmp_path / "b", BLOCKS[1:], step=1, count=2, index_of=lambda k: 1)
    assert main(["inspect", str(p0), str(q1)]) == 2
    err = capsys.readouterr().err
    assert "not parts of one dump" in err and "Traceback" not in err
    assert main(["inspect", str(p0), str(q1), "--step", "1"]) == 2
    assert "--step 1 applies to a folder" in capsys.readouterr().err


def test_a_part_read_alone_never_gives_a_partial_value(tmp_path):
    p0, _ = write_parts(tmp_path)
    f = _dump_read.DumpFile(p0)
    with pytest.raises(ValueError, match="one process's part of a multi-process dump"):
        f.tree(lazy=False)
