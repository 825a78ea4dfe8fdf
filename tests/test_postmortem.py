"""``sowtel inspect`` and ``sowtel diff``: figures against numpy, NaN origins, exit statuses.

Commands run through ``sowtel.cli.main`` (the same parser the ``sowtel`` script uses), and once
as real processes to check the exit statuses a shell sees.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from PIL import Image
from reference import numpy_stats
from scipy import ndimage

import sowtel
from sowtel.cli import main
from sowtel.dumps import dump
from sowtel.postmortem import diff_dumps, inspect_dump
from sowtel.records import STAT_KEYS


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def mixed(tmp_path) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    w[0, 1], w[2, 3], w[1, 0] = np.nan, np.inf, -np.inf
    inter = {
        "x": {"primal": rng.normal(size=7).astype(np.float32),
              "tangent": rng.normal(size=7).astype(ml_dtypes.bfloat16)},
        "params": {"primal": {"w": w, "count": np.array([0, 3, -2, 0], np.int32)}},
        "mask": {"primal": np.array([True, False, True])},
        "loss": {"primal": np.float64(2.5)},
        "empty": {"primal": np.zeros((0, 4), np.float16)},
        "z": {"primal": (rng.normal(size=5) + 1j * rng.normal(size=5)).astype(np.complex64)},
    }
    return dump(inter, tmp_path / "mixed.safetensors", step=12, metadata={"seed": 0}), inter


def leaves(inter: dict) -> dict[tuple[str, str], np.ndarray]:
    return {
        ("x", "primal"): inter["x"]["primal"], ("x", "tangent"): inter["x"]["tangent"],
        ("params/w", "primal"): inter["params"]["primal"]["w"],
        ("params/count", "primal"): inter["params"]["primal"]["count"],
        ("mask", "primal"): inter["mask"]["primal"], ("loss", "primal"): inter["loss"]["primal"],
        ("empty", "primal"): inter["empty"]["primal"], ("z", "primal"): inter["z"]["primal"],
    }


# ----------------------------------------------------------------------------- inspect


def test_inspect_json_figures_match_numpy(capsys, mixed):
    path, inter = mixed
    status, out, err = run(capsys, "inspect", path, "--json")
    assert status == 0 and err == ""
    report = json.loads(out)  # strict JSON: no NaN tokens
    [d] = report["dumps"]
    assert (d["step"], d["metadata"], d["sites"]) == (
        12, {"seed": 0}, ["x", "params", "mask", "loss", "empty", "z"])
    want = leaves(inter)
    got = {(e["name"], e["mode"]): e for e in d["entries"]}
    assert list(got) == list(want)
    for key, entry in got.items():
        arr = want[key]
        assert entry["shape"] == list(arr.shape) and entry["dtype"] == arr.dtype.name
        expected = numpy_stats(arr)
        assert list(entry["stats"]) == list(STAT_KEYS)
        for k in STAT_KEYS:
            if math.isnan(expected[k]):
                assert entry["stats"][k] is None, (key, k)
            else:
                assert entry["stats"][k] == pytest.approx(expected[k], rel=1e-5, abs=1e-6), (
                    key, k)
    assert [n["name"] for n in d["nonfinite"]] == ["params/w"]
    assert got[("params/w", "primal")]["nonfinite"] is True
    assert report["origin"] == {"path": str(path), "step": 12, "name": "params/w",
                                "site": "params", "mode": "primal", "nonfinite_at": []}


def test_inspect_table_is_aligned_and_flags_non_finite(capsys, mixed):
    path, inter = mixed
    status, out, err = run(capsys, "inspect", path)
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"dump {path}  step=12  sowtel {sowtel.__version__}  8 arrays")
    assert lines[1] == 'metadata {"seed": 0}'
    header = lines[2].split()
    assert header == ["name", "mode", "shape", "dtype", "size", "mean", "std", "min", "max",
                      "l2", "mean_abs", "nan", "+inf", "-inf", "zeros"]
    table = lines[2:11]
    # Numbers are right-aligned, so every row's statistics end in the same column.
    body = [line.split("  <-")[0] for line in table]
    assert len({len(b) for b in body}) == 1, body
    rows = {tuple(line.split()[:2]): line for line in table[1:]}
    flagged = [k for k, line in rows.items() if "NON-FINITE" in line]
    assert flagged == [("params/w", "primal")]
    assert "first in program order (likely origin)" in rows[("params/w", "primal")]
    # The table's figures are numpy's, to the 4 significant digits shown.
    for name, arr in (("params/w", inter["params"]["primal"]["w"]), ("x", inter["x"]["primal"])):
        cells = rows[(name, "primal")].split("  <-")[0].split()[-len(STAT_KEYS):]
        want = numpy_stats(arr)
        for k, cell in zip(STAT_KEYS, cells, strict=True):
            assert float(cell) == pytest.approx(want[k], rel=1e-3), (name, k, cell)
    assert lines[-1].startswith(
        "1 of 8 arrays hold NaN or Inf; the first in program order is 'params/w' (primal)")


def test_inspect_reports_all_finite(capsys, tmp_path):
    path = dump({"h": {"primal": np.ones(3)}}, tmp_path / "ok.safetensors")
    status, out, _ = run(capsys, "inspect", path)
    assert status == 0 and out.splitlines()[-1] == "all values finite"
    assert "NON-FINITE" not in out


def _forward_birth(x):
    inputs = sowtel.sow(x * 1.0, "inputs")
    born = sowtel.sow(jnp.sqrt(inputs - 1.0), "born")  # NaN where x < 1
    spread = sowtel.sow(born * 2.0, "spread")
    return jnp.sum(sowtel.sow(spread + 1.0, "out"))


def _backward_birth(x):
    a = sowtel.sow(x * 1.0, "a")
    b = sowtel.sow(a * 2.0, "b")
    c = sowtel.sow(jnp.sqrt(b), "c")  # finite forward; d sqrt/db is infinite at b == 0
    d = sowtel.sow({"w": c * 3.0, "pair": (c, c + 1.0)}, "d")
    return jnp.sum(d["w"])


@pytest.mark.parametrize(("fn", "x", "origin", "spread"), [
    # A NaN born in the forward pass at "born" spreads forward to "spread" and "out", and
    # backward to the cotangent of "inputs", which is listed first in the dump.
    (_forward_birth, [0.5, 2.0, 5.0], ("born", "primal"),
     {("inputs", "cotangent"), ("spread", "primal"), ("out", "primal")}),
    # An infinity born in the backward pass at "b" spreads to the cotangent of "a", which ran
    # after it but is listed before it.
    (_backward_birth, [0.0, 1.0, 4.0], ("b", "cotangent"), {("a", "cotangent")}),
])
def test_first_non_finite_in_program_order_is_the_origin(capsys, tmp_path, fn, x, origin,
                                                         spread):
    _, inter = sowtel.save_intermediates(jax.grad(fn))(jnp.asarray(x))
    # The premise, checked on the captured values themselves: where the NaN is, and that the
    # first non-finite entry in the dump's own order is not the origin.
    bad = [(name, mode) for name, modes in inter.items() for mode, value in modes.items()
           if any(not np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(value))]
    assert set(bad) == {origin} | spread
    assert bad[0] != origin

    path = sowtel.dump(inter, tmp_path / "nan.safetensors", step=0)
    report = inspect_dump(path)
    assert (report.origin.entry.site, report.origin.entry.mode) == origin
    status, out, _ = run(capsys, "inspect", path)
    assert status == 0
    assert f"the first in program order is {origin[0]!r} ({origin[1]})" in out
    status, out, _ = run(capsys, "inspect", path, "--json")
    assert json.loads(out)["origin"]["site"] == origin[0]


def test_origin_names_the_iteration_of_a_stacked_site(capsys, tmp_path):
    # Layers scanned over, each with an inner scan over heads: log(-1) is born in layer 2,
    # head 1, and spreads to every later layer through the carry.
    def f(w):
        def layer(h, x):
            def head(c, y):
                return c + sowtel.sow(jnp.log(h * y), "head").sum(), None

            c, _ = jax.lax.scan(head, 0.0, x)
            return sowtel.sow(h + c, "layer"), None

        return jax.lax.scan(layer, w, jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, -1.0],
                                                 [1.0, 1.0]]))[0]

    _, inter = sowtel.save_intermediates(f)(jnp.float32(2.0))
    report = inspect_dump(sowtel.dump(inter, tmp_path / "layers.safetensors"))
    # Where the NaNs are, by numpy on the captured values.
    head = np.asarray(inter["head"]["primal"])
    assert [tuple(i) for i in np.argwhere(np.isnan(head))] == [(2, 1), (3, 0), (3, 1)]
    origin = report.origin
    assert (origin.entry.site, origin.entry.stacked) == ("head", (("scan", 4), ("scan", 2)))
    assert origin.nonfinite_at == ((2, 1), (3, 0), (3, 1))
    [layer] = [r for r in report.rows if r.entry.site == "layer"]
    assert layer.nonfinite_at == ((2,), (3,))
    status, out, _ = run(capsys, "inspect", report.info.path)
    assert status == 0
    assert ("the first in program order is 'head' (primal) at indices (2, 1), (3, 0), (3, 1) "
            "of [scan 4 x scan 2]") in out
    assert "<- NON-FINITE at indices 2, 3 of [scan 4]" in out
    status, out, _ = run(capsys, "inspect", report.info.path, "--json")
    assert json.loads(out)["origin"]["nonfinite_at"] == [[2, 1], [3, 0], [3, 1]]


def test_jvp_origin_is_the_tangent_where_it_is_born(tmp_path):
    def f(x):
        a = sowtel.sow(x * 2.0, "a")
        b = sowtel.sow(jnp.abs(a) ** 0.5, "b")  # finite, but the derivative is inf at 0
        return sowtel.sow(b + 1.0, "c")

    x = jnp.array([0.0, 1.0])
    _, inter = sowtel.save_intermediates(lambda t: jax.jvp(f, (x,), (t,)))(jnp.ones(2))
    report = inspect_dump(sowtel.dump(inter, tmp_path / "jvp.safetensors"))
    assert (report.origin.entry.site, report.origin.entry.mode) == ("b", "tangent")
    assert {r.entry.site for r in report.nonfinite if r.entry.mode == "tangent"} == {"b", "c"}


def test_plot_is_a_png_with_one_panel_per_site_and_mode(capsys, tmp_path, mixed):
    path, _ = mixed
    out_png = tmp_path / "hist.png"
    status, out, err = run(capsys, "inspect", path, "--plot", out_png, "--json")
    assert status == 0 and err == ""
    expected = ["x (primal)", "x (tangent)", "params (primal)", "mask (primal)",
                "loss (primal)", "empty (primal)", "z (primal)"]
    assert json.loads(out)["plot"]["panels"] == expected
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(out_png) as im:
        im.verify()
    with Image.open(out_png) as im:
        assert json.loads(im.text["Description"]) == expected
        rgb = np.asarray(im.convert("RGB"))
    # Each panel is a white area on the grey figure: count the large white regions.
    white = (rgb == 255).all(axis=-1)
    labels, n = ndimage.label(white)
    sizes = ndimage.sum(white, labels, range(1, n + 1))
    assert int((sizes > 5000).sum()) == len(expected)


def test_inspect_a_folder_of_dumps(capsys, tmp_path):
    folder = tmp_path / "dumps"
    for step in (1, 2, 3):
        h = np.full(3, float(step))
        if step >= 2:
            h[0] = np.nan
        dump({"h": {"primal": h}}, f"{folder}/", step=step)
    status, out, _ = run(capsys, "inspect", folder)
    assert status == 0
    assert [line.split()[1] for line in out.splitlines() if line.startswith("dump ")] == [
        str(folder / f"step_{k}.safetensors") for k in (1, 2, 3)]
    assert out.splitlines()[-1] == "first non-finite over all steps: step 2, 'h' (primal)"
    status, out, _ = run(capsys, "inspect", folder, "--step", "latest", "--json")
    assert [d["step"] for d in json.loads(out)["dumps"]] == [3]
    status, out, _ = run(capsys, "inspect", folder, "--step", "1")
    assert status == 0 and out.splitlines()[-1] == "all values finite"
    status, _, err = run(capsys, "inspect", folder, "--step", "7")
    assert status == 2 and "has no dump for step 7: its steps are 1, 2, 3" in err
    status, _, err = run(capsys, "inspect", folder, "--step", "soon")
    assert status == 2 and "must be an integer step or 'latest'" in err


def test_inspect_bad_input_is_a_clear_error_not_a_traceback(capsys, tmp_path, mixed):
    path, _ = mixed
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[:-10])
    corrupted = tmp_path / "flip.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    corrupted.write_bytes(bytes(raw))
    pkl = tmp_path / "state.pkl"
    pkl.write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.")
    text = tmp_path / "notes.txt"
    text.write_text("just words")
    cases = {
        tmp_path / "missing.safetensors": "does not exist",
        truncated: "is truncated",
        corrupted: "fails its checksum",
        pkl: "is a Python pickle; sowtel never unpickles files",
        text: "is not a sowtel dump",
    }
    for bad, message in cases.items():
        status, out, err = run(capsys, "inspect", bad)
        assert status == 2 and out == ""
        assert err.startswith("sowtel inspect: error: ") and message in err and str(bad) in err
    status, _, err = run(capsys, "inspect", path, "--step", "3")
    assert status == 2 and "applies to a folder of dumps" in err
    status, _, err = run(capsys, "inspect", path, "--plot", tmp_path / "p.png", "--bins", "0")
    assert status == 2 and "bins=0 must be a positive number" in err


# ----------------------------------------------------------------------------- diff


def _pair(tmp_path, a: dict, b: dict) -> tuple[Path, Path]:
    return dump(a, tmp_path / "a.safetensors"), dump(b, tmp_path / "b.safetensors")


def test_diff_equal_within_and_beyond_tolerance(capsys, tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5)).astype(np.float64)
    y = x * (1 + 4e-6)
    y[1, 2] = x[1, 2] + 3e-3
    a, b = _pair(tmp_path, {"h": {"primal": x, "cotangent": x}},
                 {"h": {"primal": y, "cotangent": x}})
    status, out, err = run(capsys, "diff", a, a)
    assert status == 0 and err == "" and out.splitlines()[-1].startswith("EQUAL: 0 of 2 arrays")
    status, out, _ = run(capsys, "diff", a, b)
    assert status == 1
    assert out.splitlines()[-1] == (
        "DIFFERENT: 1 of 2 arrays differ beyond tolerance; 0 structural differences")
    status, out, _ = run(capsys, "diff", a, b, "--json")
    report = json.loads(out)
    entry = {(e["name"], e["mode"]): e for e in report["entries"]}[("h", "primal")]
    d = np.abs(x - y)
    assert entry["max_abs"] == pytest.approx(d.max(), rel=1e-12)
    assert entry["max_rel"] == pytest.approx((d / np.abs(y)).max(), rel=1e-12)
    assert entry["beyond"] == int((d > 1e-8 + 1e-5 * np.abs(y)).sum()) == 1
    # Loose enough for the one outlier: equal.
    rtol = float(d.max() / np.abs(y).min()) * 1.01
    assert run(capsys, "diff", a, b, "--rtol", str(rtol))[0] == 0
    assert run(capsys, "diff", a, b, "--atol", "0.01")[0] == 0
    # Tight enough for the small relative noise: every element differs.
    status, out, _ = run(capsys, "diff", a, b, "--rtol", "1e-7", "--json")
    assert status == 1 and json.loads(out)["entries"][0]["beyond"] == 20


def test_diff_atol_matters_near_zero_and_nan_matches_nan(capsys, tmp_path):
    a, b = _pair(tmp_path,
                 {"z": {"primal": np.zeros(3)}, "n": {"primal": np.array([np.nan, 1.0, np.inf])}},
                 {"z": {"primal": np.full(3, 1e-9)},
                  "n": {"primal": np.array([np.nan, 1.0, np.inf])}})
    assert run(capsys, "diff", a, b)[0] == 0
    status, out, _ = run(capsys, "diff", a, b, "--atol", "0")
    assert status == 1 and "z" in out and "<- DIFFERS" in out
    c = dump({"z": {"primal": np.zeros(3)}, "n": {"primal": np.array([1.0, np.nan, -np.inf])}},
             tmp_path / "c.safetensors")
    status, out, _ = run(capsys, "diff", a, c, "--json")
    n = {e["name"]: e for e in json.loads(out)["entries"]}["n"]
    assert status == 1 and n["beyond"] == 3 and n["nonfinite_mismatch"] == 3


def test_diff_lists_structural_differences_and_exits_1(capsys, tmp_path):
    a, b = _pair(
        tmp_path,
        {"x": {"primal": np.ones(3), "cotangent": np.ones(3)},
         "only_a": {"primal": np.ones(1)},
         "shape": {"primal": np.ones((2, 3))},
         "dtype": {"primal": np.ones(2, np.float32)},
         "tree": {"primal": (np.ones(2), {"k": np.ones(1)})}},
        {"x": {"primal": np.ones(3)},
         "shape": {"primal": np.ones((3, 2))},
         "dtype": {"primal": np.ones(2, np.float64)},
         "tree": {"primal": [np.ones(2), {"j": np.ones(1)}]},
         "only_b": {"primal": np.ones(1)}},
    )
    status, out, err = run(capsys, "diff", a, b)
    assert status == 1 and err == ""
    structural = out.split("structural differences:\n")[1].split("\nname")[0].splitlines()
    assert [s.strip() for s in structural] == [
        "site 'only_a' only in A",
        "site 'only_b' only in B",
        "'x' mode cotangent only in A",
        "'shape' (primal) has shape (2, 3) in A, (3, 2) in B",
        "'dtype' (primal) has dtype float32 in A, float64 in B",
        "'tree' (primal) has a different pytree structure: A (*, {'k': *}), B [*, {'j': *}]",
        "'tree/1/k' (primal) only in A",
        "'tree/1/j' (primal) only in B",
    ]
    # Arrays that do line up are still compared: equal values, so only structure differs.
    report = diff_dumps(a, b)
    assert {(e.name, e.mode) for e in report.entries} == {
        ("x", "primal"), ("dtype", "primal"), ("tree/0", "primal")}
    assert all(e.equal for e in report.entries) and not report.equal


def test_diff_folders_step_by_step(capsys, tmp_path):
    for side, steps, bump in (("A", (0, 1, 2), 0.0), ("B", (1, 2, 3), 1.0)):
        for step in steps:
            value = np.full(2, float(step)) + (bump if step == 2 else 0.0)
            dump({"h": {"primal": value}}, f"{tmp_path / side}/", step=step)
    status, out, _ = run(capsys, "diff", tmp_path / "A", tmp_path / "B", "--json")
    report = json.loads(out)
    assert status == 1
    assert report["structural"] == ["step 0 only in A", "step 3 only in B"]
    assert [(e["step"], e["equal"]) for e in report["entries"]] == [(1, True), (2, False)]


def test_diff_bad_input_is_a_clear_error(capsys, tmp_path):
    good = dump({"h": {"primal": np.ones(2)}}, tmp_path / "good.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:20])
    pkl = tmp_path / "x.pkl"
    pkl.write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.")
    folder = tmp_path / "dir"
    dump({"h": {"primal": np.ones(2)}}, f"{folder}/", step=0)
    cases = [
        ((good, tmp_path / "missing"), "does not exist"),
        ((cut, good), "is truncated"),
        ((good, pkl), "is a Python pickle"),
        ((good, folder), "one is a folder of dumps and the other a file"),
        ((good, good, "--rtol", "-1"), "rtol=-1.0 must be a finite number >= 0"),
    ]
    for args, message in cases:
        status, out, err = run(capsys, "diff", *args)
        assert status == 2 and out == "" and message in err, (args, err)
        assert err.startswith("sowtel diff: error: ")


def test_real_processes_see_the_exit_statuses(tmp_path):
    a, b = _pair(tmp_path, {"h": {"primal": np.ones(2)}}, {"h": {"primal": np.zeros(2)}})
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def sowtel_cli(*args):
        return subprocess.run([sys.executable, "-m", "sowtel.cli", *map(str, args)],
                              capture_output=True, text=True, env=env, timeout=120)

    same, differ = sowtel_cli("diff", a, a), sowtel_cli("diff", a, b)
    missing = sowtel_cli("inspect", tmp_path / "nope.safetensors")
    assert (same.returncode, differ.returncode, missing.returncode) == (0, 1, 2)
    assert re.search(r"h\s+primal\s+\(2,\)\s+float64\s+1\s+inf\s+2\s+<- DIFFERS", differ.stdout)
    assert "Traceback" not in missing.stderr and "does not exist" in missing.stderr


def test_inspect_flags_nan_and_inf_in_bfloat16(tmp_path, capsys):
    # bfloat16 (kind "V" to numpy) is how models train on TPUs and GPUs: its NaN and
    # infinities are flagged as float32's are, never "all values finite".
    x = np.array([[1.0, 2.0], [np.nan, np.inf]], ml_dtypes.bfloat16)
    path = dump({"h": {"primal": x}}, str(tmp_path / "bf16.safetensors"))
    report = inspect_dump(path)
    [row] = report.rows
    assert (row.stats["nan"], row.stats["posinf"], row.stats["mean"]) == (1.0, 1.0, 1.5)
    assert report.origin is row
    status, out, _ = run(capsys, "inspect", path)
    assert status == 0 and "all values finite" not in out
    assert "1 of 1 arrays hold NaN or Inf; the first in program order is 'h' (primal)" in out
