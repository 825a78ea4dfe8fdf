"""sowtel.compare_runs and ``sowtel diff`` of runs: the first divergence of two runs, in execution
order, read from jsonl and TensorBoard runs written through both transports; the execution-order
key the exporters record (``Record.scans``, ``order_key``), and bad input.

The model scans ``LAYERS`` residual blocks, ``a = h @ w`` then ``h = h + tanh(a) + b``, each
sown, between a sown embedding and head. Run B departs from run A in one way, and the answer is
derived by hand from where the change enters the computation:

- ``w[3]`` nudged before step 7: ``a`` of layer 3 is the first value it touches (primal).
- ``b[3]`` nudged before step 7: ``h`` of layer 3, then ``a`` of layer 4. Ordering the records
  site by site (every layer's ``a`` before any ``h``) would name ``blocks/a[4]``: the answer
  needs the scan's sites interleaved iteration by iteration.
- the gradient leaving layer 3 (its input's cotangent) doubled at step 4: layer 3's own
  cotangents are computed before that, so the first to differ is the cotangent of ``h`` of
  layer 2, the layer below, and it is exactly twice run A's.

The values a divergence reports are checked against statistics computed with numpy from
``save_intermediates`` of the same step, replayed without sowtel streaming.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_stats

import sowtel
from sowtel.cli import main as cli
from sowtel.compare import diff_runs
from sowtel.exporters.jsonl import JsonlExporter, read_records, record_to_json
from sowtel.exporters.memory import MemoryExporter
from sowtel.exporters.tensorboard import ORDER_TAG, TensorBoardExporter
from sowtel.records import Record, order_key

LAYERS, WIDTH, STEPS = 6, 8, 10


@jax.custom_vjp
def grad_scale(x: Any, c: Any) -> Any:
    """The identity, whose backward pass multiplies the cotangent by ``c``."""
    return x


def _scale_fwd(x: Any, c: Any) -> tuple[Any, Any]:
    return x, c


def _scale_bwd(c: Any, g: Any) -> tuple[Any, Any]:
    return g * c, jnp.zeros_like(c)


grad_scale.defvjp(_scale_fwd, _scale_bwd)


def loss(params: dict[str, Any], x: Any, y: Any, scales: Any) -> Any:
    h = sowtel.sow(x @ params["embed"], "embed")

    def block(h: Any, layer: Any) -> tuple[Any, None]:
        w, b, c = layer
        h = grad_scale(h, c)  # the gradient leaving this layer for the one below
        a = sowtel.sow(h @ w, "blocks/a")
        return sowtel.sow(h + jnp.tanh(a) + b, "blocks/h"), None

    h, _ = jax.lax.scan(block, h, (params["w"], params["b"], scales))
    out = sowtel.sow(h @ params["head"], "head")
    return jnp.mean((out - y) ** 2)


def train_step(params: dict[str, Any], x: Any, y: Any, scales: Any, k: Any) -> dict[str, Any]:
    with sowtel.at_step(k):
        grads = jax.grad(loss)(params, x, y, scales)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


STEP_FUNCTIONS = {"jit": sowtel.jit(train_step), "callback": jax.jit(train_step)}
# Run B's change: (kind, step, layer).
CASES: dict[str, tuple[str, int, int] | None] = {
    "identical": None, "weight": ("w", 7, 3), "bias": ("b", 7, 3), "gradient": ("scale", 4, 3)}
# The answers, by hand (see the module docstring): (step, name, mode, index).
ANSWERS = {"weight": (7, "blocks/a", "primal", 3), "bias": (7, "blocks/h", "primal", 3),
           "gradient": (4, "blocks/h", "cotangent", 2)}


def initial() -> tuple[dict[str, Any], Any, Any]:
    rng = np.random.default_rng(0)
    params = {"embed": rng.normal(size=(4, WIDTH)) * 0.5,
              "w": rng.normal(size=(LAYERS, WIDTH, WIDTH)) * 0.2,
              "b": rng.normal(size=(LAYERS, WIDTH)) * 0.1,
              "head": rng.normal(size=(WIDTH, 2)) * 0.5}
    x, y = rng.normal(size=(16, 4)), rng.normal(size=(16, 2))
    return ({k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
            jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))


def changed(params: dict[str, Any], case: str, k: int) -> tuple[dict[str, Any], Any]:
    """Run B's parameters and gradient scales at step ``k``."""
    scales = jnp.ones(LAYERS)
    change = CASES[case]
    if change is not None and change[1] == k:
        kind, _, layer = change
        if kind == "scale":
            scales = scales.at[layer].set(2.0)
        else:
            params = {**params, kind: params[kind].at[(layer,) + (0,) * (
                params[kind].ndim - 1)].add(1e-3)}
    return params, scales


def train(step: Any, case: str, steps: int = STEPS, exporters: Any = None) -> list[Any]:
    """Trains ``steps`` steps of run ``case``; returns the parameters and scales of each step."""
    params, x, y = initial()
    seen = []
    for k in range(steps):
        params, scales = changed(params, case, k)
        seen.append((params, scales))
        params = step(params, x, y, scales, k)
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Every case, by both transports, each written as a jsonl run and a TensorBoard run;
    'rerun' is run A trained again."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for transport, step in STEP_FUNCTIONS.items():
        for case in ("identical", "rerun", "weight", "bias", "gradient"):
            where = root / f"{transport}-{case}"
            exporters = [JsonlExporter(logdir=where / "jsonl"),
                         TensorBoardExporter(logdir=str(where / "tb"))]
            with sowtel.enable(exporter=exporters):
                train(step, "identical" if case == "rerun" else case)
                assert sowtel.flush(timeout=60.0)
            out[(transport, case)] = where
    return out


def replayed(case: str, k: int) -> dict[str, Any]:
    """``save_intermediates`` of run ``case``'s step ``k``, replayed with nothing streaming."""
    params, scales = train(jax.jit(train_step), case, steps=k + 1)[k]
    _, x, y = initial()
    _, inter = sowtel.save_intermediates(jax.grad(loss))(params, x, y, scales)
    return inter


@pytest.mark.parametrize("kind", ["jsonl", "tb"])
@pytest.mark.parametrize("transport", ["jit", "callback"])
@pytest.mark.parametrize("case", ["identical", "weight", "bias", "gradient"])
def test_the_first_divergence_is_where_run_b_departs(runs, transport, kind, case):
    a = runs[(transport, "rerun")] / kind
    b = runs[(transport, case)] / kind
    div = sowtel.compare_runs(a, b)
    if case == "identical":
        assert div is None
        report = diff_runs(a, b)
        assert (report.steps, report.sites, report.records) == (STEPS, 4, 4 * LAYERS + 4)
        return
    assert div is not None
    assert (div.step, div.name, div.mode, div.index) == ANSWERS[case], str(div)
    assert div.process_index == 0 and div.absent is None
    assert not div.only_in_a and not div.only_in_b
    # The values reported are the statistics of that record in each run, computed with numpy
    # from the step replayed through save_intermediates.
    step, name, mode, index = ANSWERS[case]
    want = [numpy_stats(np.asarray(replayed(run, step)[name][mode][index], np.float64))
            for run in ("identical", case)]
    tol = 1e-5 if kind == "jsonl" else 1e-6  # the device computes in float32; TensorBoard keeps it
    np.testing.assert_allclose([div.a, div.b], [w[div.stat] for w in want], rtol=1e-4,
                               atol=tol)
    if case == "gradient":  # the doubled gradient, exactly twice run A's
        assert div.b == pytest.approx(2 * div.a, rel=1e-6)
    # What follows it is in execution order too: later in the step, or a later step.
    keys = [(c.step, c.name, c.mode, c.index) for c in div.context]
    assert len(keys) == 5 and all(k[0] >= step for k in keys)
    if case == "bias":
        assert keys[0] == (7, "blocks/a", "primal", 4)


@pytest.mark.parametrize("transport", ["jit", "callback"])
def test_a_jsonl_run_compares_with_a_tensorboard_run(runs, transport):
    a, b = runs[(transport, "rerun")], runs[(transport, "bias")]
    assert sowtel.compare_runs(a / "jsonl", runs[(transport, "identical")] / "tb") is None
    div = sowtel.compare_runs(a / "jsonl", b / "tb")
    assert (div.step, div.name, div.mode, div.index) == ANSWERS["bias"]
    report = diff_runs(b / "tb", a / "jsonl")
    assert report.kinds == ("tensorboard", "jsonl") and report.divergence is not None
    # A folder holding both kinds is read from its jsonl files.
    shutil.copytree(a / "tb", a / "both", dirs_exist_ok=True)
    shutil.copytree(a / "jsonl", a / "both", dirs_exist_ok=True)
    assert diff_runs(a / "both", b / "jsonl").kinds == ("jsonl", "jsonl")


def test_sowtel_diff_prints_the_divergence_and_exits_1(runs, capsys):
    a, b = runs[("jit", "rerun")] / "jsonl", runs[("jit", "bias")] / "jsonl"
    assert cli(["diff", str(a), str(runs[("jit", "identical")] / "jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"no divergence in {STEPS} steps, 4 sites ({4 * LAYERS + 4} records a step)"
    assert cli(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 7, blocks/h[3] (primal): " in out
    lines = out.splitlines()
    top = lines.index("step 7 in execution order:") + 2
    rows = lines[top:lines.index("", top)]
    first = next(i for i, line in enumerate(rows) if line.lstrip().startswith(">>"))
    # The table around it, in execution order: layer 3's a, h, then layer 4's a, h.
    names = [line.replace(">>", "").split()[0] for line in rows]
    assert names[first - 1:first + 3] == ["blocks/a[3]", "blocks/h[3]", "blocks/a[4]",
                                          "blocks/h[4]"]
    assert rows[first].endswith("<- first divergence") and "differs" in rows[first + 1]
    assert rows[first - 1].split()[-1] == "0"  # before it: the same in both
    assert cli(["diff", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["name"] == "blocks/h" and report["divergence"]["index"] == 3
    # A looser tolerance than the nudge's effect: no divergence.
    assert cli(["diff", str(a), str(b), "--rtol", "0.5", "--atol", "1"]) == 0


# -- the execution order the records carry ------------------------------------------------------


def two_scans_and_a_nested_one(ws: Any, x: Any) -> Any:
    """Two scans one after the other (same length, nothing sown between), then a scan whose body
    holds another: the order of their sites can only come from knowing which scan each ran in."""
    h, _ = jax.lax.scan(lambda h, w: (sowtel.sow(jnp.tanh(h @ w), "enc"), None), x, ws)
    h, _ = jax.lax.scan(lambda h, w: (sowtel.sow(jnp.tanh(h @ w), "dec"), None), h, ws)

    def outer(h: Any, w: Any) -> tuple[Any, None]:
        h = sowtel.sow(h * 1.0, "o/pre")
        h, _ = jax.lax.scan(lambda c, v: (sowtel.sow(c * v, "o/in"), None), h, jnp.ones(2))
        return sowtel.sow(h @ w, "o/post"), None

    h, _ = jax.lax.scan(outer, h, ws)
    return jnp.sum(h ** 2)


def _ran(n: int) -> list[tuple[str, str, Any]]:
    """The order two_scans_and_a_nested_one's records ran in, under jax.grad, by hand."""
    fwd = [("enc", "p", i) for i in range(n)] + [("dec", "p", i) for i in range(n)]
    for i in range(n):
        fwd += [("o/pre", "p", i), ("o/in", "p", (i, 0)), ("o/in", "p", (i, 1)),
                ("o/post", "p", i)]
    bwd = []
    for i in reversed(range(n)):  # the backward pass: last iteration first, its body reversed
        bwd += [("o/post", "c", i), ("o/in", "c", (i, 1)), ("o/in", "c", (i, 0)),
                ("o/pre", "c", i)]
    bwd += [("dec", "c", i) for i in reversed(range(n))]
    bwd += [("enc", "c", i) for i in reversed(range(n))]
    return fwd + bwd


@pytest.mark.parametrize("transport", ["jit", "callback"])
def test_records_sorted_by_order_key_are_in_execution_order(transport):
    ws = jnp.stack([jnp.eye(3) * (1 + 0.1 * i) for i in range(2)])
    x = jnp.ones((2, 3))
    memory = MemoryExporter()
    step = (sowtel.jit if transport == "jit" else jax.jit)(jax.grad(two_scans_and_a_nested_one))
    with sowtel.enable(exporter=memory):
        with contextlib.nullcontext() if transport == "jit" else sowtel.at_step(0):
            step(ws, x)
        assert sowtel.flush(timeout=60.0)
    ran = sorted(memory.records, key=lambda r: r.order_key)
    assert [(r.name, r.mode[0], r.index) for r in ran] == _ran(2)
    # Each record's key comes from its site's order and scans, and its index.
    for r in memory.records:
        assert r.order_key == order_key(r.order, r.scans, r.index)
    scans = {(r.name, r.mode[0]): r.scans for r in memory.records}
    # A backward scan runs last-first; two scans one after the other have entries of their
    # own; a nested scan's sites carry the outer scan's entry, then their own.
    assert (scans[("enc", "p")][0][1], scans[("enc", "c")][0][1]) == (False, True)
    assert scans[("enc", "p")][0][0] < scans[("dec", "p")][0][0] < scans[("o/pre", "p")][0][0]
    assert scans[("o/in", "p")][0] == scans[("o/pre", "p")][0]
    assert len(scans[("o/in", "p")]) == 2 and len(scans[("o/post", "p")]) == 1


def test_the_exporters_write_the_order_key_and_read_it_back(tmp_path):
    ws = jnp.stack([jnp.eye(3) * (1 + 0.1 * i) for i in range(2)])
    x = jnp.ones((2, 3))
    memory = MemoryExporter()
    exporters = [memory, JsonlExporter(logdir=tmp_path / "jsonl"),
                 TensorBoardExporter(logdir=str(tmp_path / "tb"))]
    with sowtel.enable(exporter=exporters):
        sowtel.jit(jax.grad(two_scans_and_a_nested_one))(ws, x)
        assert sowtel.flush(timeout=60.0)
    # jsonl: order and scans on every line, the columnar lines as record_to_json writes them.
    lines = [json.loads(line) for line in
             (tmp_path / "jsonl" / "records.jsonl").read_text().splitlines()]
    assert lines == [record_to_json(r) for r in memory.records]
    assert all("order" in line for line in lines)
    assert {len(line.get("scans", [])) for line in lines} == {1, 2}
    back = read_records(tmp_path / "jsonl" / "records.jsonl")
    assert [r.order_key for r in back] == [r.order_key for r in memory.records]
    # TensorBoard, read with its own loader: depth tensors carry order and scans in their
    # metadata; nested scans (o/in) included.
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    by_site = {(r.name, r.mode): (r.order, r.scans) for r in memory.records}
    for tag in acc.Tags()["tensors"]:
        if tag.endswith("/depth"):
            name, mode = tag[:-len("/depth")].rsplit("/", 1)
            meta = json.loads(acc.SummaryMetadata(tag).plugin_data.content)
            order, scans = by_site[(name, mode)]
            assert (meta["order"], meta["scans"]) == (order, [[e, r] for e, r in scans]), tag


def test_tensorboard_writes_the_order_of_scalar_series_once(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    exporter = TensorBoardExporter(logdir=str(tmp_path))
    for step in range(3):
        exporter.write([Record(name=n, mode=m, tag="t", step=step, index=None, wall_time=0.0,
                               summary="stats", shape=(2,), dtype="float32",
                               stats={"mean": 1.0, "std": 0.5}, order=o)
                        for n, m, o in (("h", "primal", 4), ("h", "cotangent", 9))
                        if step or m == "primal"])
    exporter.close()
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    from tensorboard.util import tensor_util

    rows = {e.step: json.loads(tensor_util.make_ndarray(e.tensor_proto).item())
            for e in acc.Tensors(ORDER_TAG)}
    # Each series at the step it first appears, with its order (and no scans).
    assert rows == {0: [["h", "primal", 4, []]], 1: [["h", "cotangent", 9, []]]}


# -- bad input ---------------------------------------------------------------------------------


def write_run(logdir: Path, steps: range, sites: dict[str, float], *, skip: Any = (),
              change: Any = None) -> Path:
    """A jsonl run of plain records: ``sites`` {name: mean}, in that order, at every step."""
    exporter = JsonlExporter(logdir=logdir)
    for step in steps:
        exporter.write([
            Record(name=name, mode="primal", tag="t", step=step, index=None, wall_time=0.0,
                   summary="stats", shape=(4,), dtype="float32",
                   stats={"mean": mean + (change[2] if change and change[:2] == (step, name)
                                          else 0.0), "nan": 0.0},
                   order=k)
            for k, (name, mean) in enumerate(sites.items()) if (step, name) not in skip])
    exporter.close()
    return logdir


def test_sites_in_one_run_only_are_reported_not_raised(tmp_path):
    a = write_run(tmp_path / "a", range(4), {"x": 1.0, "y": 2.0})
    b = write_run(tmp_path / "b", range(4), {"x": 1.0, "y": 2.0, "z": 3.0})
    div = sowtel.compare_runs(a, b)
    assert (div.stat, div.name, div.only_in_a, div.only_in_b) == (None, "z", (), ("z (primal)",))
    assert "sites in one run only: z (primal)" in str(div)
    # With a divergence in a site both have, that one is the answer, the others listed.
    c = write_run(tmp_path / "c", range(4), {"x": 1.0, "y": 2.0, "z": 3.0},
                  change=(2, "y", 0.5))
    div = sowtel.compare_runs(a, c)
    assert (div.step, div.name, div.stat, div.a, div.b) == (2, "y", "mean", 2.0, 2.5)
    assert div.only_in_b == ("z (primal)",)


def test_a_record_missing_at_one_step_is_a_divergence(tmp_path):
    a = write_run(tmp_path / "a", range(5), {"x": 1.0, "y": 2.0})
    b = write_run(tmp_path / "b", range(5), {"x": 1.0, "y": 2.0}, skip={(3, "x")})
    div = sowtel.compare_runs(a, b)
    assert (div.step, div.name, div.stat, div.absent) == (3, "x", None, "B")
    assert "step 3, x (primal): in A only" in str(div)


def test_runs_of_different_lengths_compare_up_to_the_last_common_step(tmp_path):
    a = write_run(tmp_path / "a", range(10), {"x": 1.0})
    b = write_run(tmp_path / "b", range(6), {"x": 1.0})
    report = diff_runs(a, b)
    assert (report.divergence, report.steps, report.only_a, report.only_b) == (None, 6, 6, None)
    assert "A has steps the other lacks from step 6, not compared" in report.format()
    c = write_run(tmp_path / "c", range(0, 10, 2), {"x": 1.0})  # every=2
    report = diff_runs(a, c)
    assert (report.divergence, report.steps, report.only_a) == (None, 5, 1)


def test_bad_runs_get_clear_errors(tmp_path, capsys):
    a = write_run(tmp_path / "a", range(3), {"x": 1.0})
    with pytest.raises(FileNotFoundError, match=r"run_b .*nope' does not exist: give the folder"):
        sowtel.compare_runs(a, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no run: no \.jsonl file and no TensorBoard"):
        sowtel.compare_runs(a, tmp_path / "empty")
    # Another tool's event files.
    from tensorboardX import SummaryWriter

    with SummaryWriter(logdir=str(tmp_path / "other")) as w:
        w.add_scalar("loss", 1.0, 0)
    with pytest.raises(ValueError, match=r"none written by sowtel .* another tool's run"):
        sowtel.compare_runs(a, tmp_path / "other")
    # Runs of different models.
    b = write_run(tmp_path / "b", range(3), {"q": 1.0})
    with pytest.raises(ValueError, match=r"no site in common \(A: x; B: q\): they are runs of "):
        sowtel.compare_runs(a, b)
    c = write_run(tmp_path / "c", range(5, 8), {"x": 1.0})
    with pytest.raises(ValueError, match=r"have no step in common"):
        sowtel.compare_runs(a, c)
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), ("1e-5", TypeError)):
        with pytest.raises(error, match=r"rtol=.* must be a"):
            sowtel.compare_runs(a, a, rtol=bad)
    # The command: exit status 2, the message on stderr.
    for other, message in ((tmp_path / "empty", "holds no run"),
                           (tmp_path / "other", "another tool's run"),
                           (tmp_path / "nope", "does not exist")):
        assert cli(["diff", str(a), str(other)]) == 2
        assert message in capsys.readouterr().err


def test_sowtel_diff_still_compares_dumps(tmp_path, capsys):
    from sowtel.dumps import dump

    x = dump({"h": {"primal": np.array([1.0, 2.0])}}, tmp_path / "x.safetensors")
    y = dump({"h": {"primal": np.array([1.0, 2.5])}}, tmp_path / "y.safetensors")
    assert cli(["diff", str(x), str(x)]) == 0
    assert cli(["diff", str(x), str(y)]) == 1
    assert "DIFFERENT: 1 of 1 arrays differ beyond tolerance" in capsys.readouterr().out
    for k in (0, 1):
        dump({"h": {"primal": np.ones(2)}}, tmp_path / "dumps", step=k)
    assert cli(["diff", str(tmp_path / "dumps"), str(tmp_path / "dumps")]) == 0
    a = write_run(tmp_path / "a", range(3), {"x": 1.0})
    assert cli(["diff", str(a), str(tmp_path / "dumps")]) == 2
    assert "A is a run and B holds dumps" in capsys.readouterr().err


def test_files_cut_short_are_read_to_their_last_whole_record(tmp_path):
    a = write_run(tmp_path / "a", range(6), {"x": 1.0, "y": 2.0})
    b = write_run(tmp_path / "b", range(6), {"x": 1.0, "y": 2.0}, change=(5, "y", 1.0))
    path = b / "records.jsonl"
    path.write_bytes(path.read_bytes()[:-40])  # step 5's y, cut in the middle
    with pytest.warns(UserWarning, match=r"records.jsonl: line 12, the last, is cut short"):
        report = diff_runs(a, b)
    # Step 5 holds x only in B: y is missing there, as a record B did not write.
    assert (report.divergence.step, report.divergence.name, report.divergence.absent) == (
        5, "y", "B")
    # TensorBoard: a cut event.
    for run in ("a", "b"):
        exporter = TensorBoardExporter(logdir=str(tmp_path / f"tb{run}"))
        for step in range(6):
            exporter.write([Record(name="x", mode="primal", tag="t", step=step, index=None,
                                   wall_time=0.0, summary="stats", shape=(4,),
                                   dtype="float32", stats={"mean": 1.0}, order=0)])
        exporter.close()
    (event,) = (tmp_path / "tbb").glob("events.out.tfevents.*")
    event.write_bytes(event.read_bytes()[:-10])
    with pytest.warns(UserWarning, match=r"the last \d+ bytes are not a whole event"):
        report = diff_runs(tmp_path / "tba", tmp_path / "tbb")
    assert (report.divergence, report.steps, report.only_a) == (None, 5, 5)


def test_event_records_are_those_tensorboards_loader_reads(runs, tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    from sowtel._run_read import event_records

    (path,) = (runs[("jit", "bias")] / "tb").glob("events.out.tfevents.*")
    assert list(event_records(path)) == list(RawEventFileLoader(str(path)).Load())
    cut = tmp_path / path.name
    data = path.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.warns(UserWarning, match="not a whole event"):
        ours = list(event_records(cut))
    assert ours == list(RawEventFileLoader(str(cut)).Load()) and ours


def test_records_of_a_step_may_trail_behind_later_steps(tmp_path):
    a = write_run(tmp_path / "a", range(6), {"x": 1.0, "y": 2.0})
    # B's file: step 2's y written after steps 3 and 4 (a straggling callback).
    lines = (a / "records.jsonl").read_text().splitlines()
    late = lines.pop(5)
    lines.insert(8, late)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "records.jsonl").write_text("\n".join(lines) + "\n")
    assert diff_runs(a, tmp_path / "b").divergence is None
    # A file holding two runs one after the other (a logdir used twice) is refused, not mixed
    # up, whether the first run is short or long.
    long = write_run(tmp_path / "long", range(80), {"x": 1.0, "y": 2.0})
    for steps, message in ((6, r"step 0 comes again at line 13, with records it already had"),
                           (40, r"steps go back to 0 after step \d+, more than 8 steps")):
        twice = write_run(tmp_path / f"twice{steps}", range(steps), {"x": 1.0, "y": 2.0})
        write_run(twice, range(steps), {"x": 1.0, "y": 2.0})
        with pytest.raises(ValueError, match=message + r".*holds two runs one after the other"):
            sowtel.compare_runs(long, twice)


def test_files_written_before_the_order_key_are_still_read(runs, tmp_path):
    # Lines without order and scans (as written before they were): read back, and compared
    # in the order they arrived.
    for case in ("rerun", "weight"):
        src = runs[("jit", case)] / "jsonl" / "records.jsonl"
        old = [json.loads(line) for line in src.read_text().splitlines()]
        for line in old:
            line.pop("order")
            line.pop("scans", None)
        (tmp_path / case).mkdir()
        (tmp_path / case / "records.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in old))
    records = read_records(tmp_path / "weight" / "records.jsonl")
    assert {(r.order, r.scans) for r in records} == {(0, ())}
    div = sowtel.compare_runs(tmp_path / "rerun", tmp_path / "weight")
    assert (div.step, div.mode) == (7, "primal")


def test_what_tensorboard_leaves_out_is_no_divergence_against_jsonl(tmp_path):
    # A scalar site's cotangent (always 1.0 for a loss) goes to jsonl, not to TensorBoard.
    jsonl, tb = JsonlExporter(logdir=tmp_path / "jsonl"), TensorBoardExporter(
        logdir=str(tmp_path / "tb"))
    for step in range(3):
        records = [Record(name="loss", mode=mode, tag="t", step=step, index=None,
                          wall_time=0.0, summary="stats", shape=(), dtype="float32",
                          stats={"mean": 1.0 / (step + 1), "nan": 0.0}, order=k)
                   for k, mode in enumerate(("primal", "cotangent"))]
        jsonl.write(records)
        tb.write(records)
    jsonl.close()
    tb.close()
    report = diff_runs(tmp_path / "jsonl", tmp_path / "tb")
    assert report.divergence is None and report.only_in_a == ("loss (cotangent)",)
    assert report.format().splitlines()[-1] == (
        "sites only in A (not compared): loss (cotangent)")
    # Between two jsonl runs it is a site in one run only.
    write_run(tmp_path / "plain", range(3), {"loss": 1.0})
    div = sowtel.compare_runs(tmp_path / "plain", tmp_path / "jsonl", atol=10.0)
    assert (div.stat, div.only_in_b) == (None, ("loss (cotangent)",))


def test_the_table_marks_a_missing_first_record(tmp_path, capsys):
    a = write_run(tmp_path / "a", range(5), {"x": 1.0, "y": 2.0, "z": 3.0})
    b = write_run(tmp_path / "b", range(5), {"x": 1.0, "y": 2.0, "z": 3.0}, skip={(3, "y")})
    assert cli(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 3, y (primal): in A only" in out
    [row] = [line for line in out.splitlines() if line.lstrip().startswith(">>")]
    assert row.split()[1] == "y" and row.endswith("<- first divergence")
