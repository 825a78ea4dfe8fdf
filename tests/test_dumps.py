"""sowtel.dump / sowtel.load and the records of captured intermediates.

Round trips are checked bit for bit (so NaN payloads and -0.0 count) over generated pytrees, and
against the safetensors library's own reader; records are checked against statistics computed
here with numpy and against the device summary of the same values.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import numpy_stats
from safetensors import safe_open
from safetensors.numpy import save_file

import sowtel
from sowtel import dumps
from sowtel.capture import Intermediates
from sowtel.dumps import _format as _dump_format
from sowtel.dumps import dump, find_dumps, info, load, records_from_intermediates
from sowtel.records import STAT_KEYS
from sowtel.summaries import decode_device_summary, device_summary

DTYPES = [
    np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
    np.dtype(np.float64), np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32),
    np.dtype(np.int64), np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32),
    np.dtype(np.uint64), np.dtype(np.bool_), np.dtype(np.complex64),
    np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2),
]


# ----------------------------------------------------------------------------- strategies


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    # Arbitrary bytes reinterpreted as the dtype: every bit pattern (NaN payloads, infinities,
    # subnormals, -0.0) is a value the dump must keep.
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    if dtype == np.bool_:
        arr = arr & 1  # a bool byte other than 0/1 is not a bool numpy can produce
    return arr.view(dtype).reshape(shape)


KEYS = st.one_of(st.text(min_size=0, max_size=6), st.integers(-5, 5))
LEAVES = st.one_of(arrays(), st.none())
TREES = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(KEYS, children, max_size=3),
    ),
    max_leaves=8,
)
SITE_NAMES = st.from_regex(r"[A-Za-z0-9_\-]{1,6}(/[A-Za-z0-9_\-]{1,6}){0,2}", fullmatch=True)
MODES = st.sampled_from(["primal", "tangent", "cotangent", "cotangent.tangent",
                         "tangent.cotangent"])
INTERMEDIATES = st.dictionaries(
    SITE_NAMES, st.dictionaries(MODES, TREES, min_size=1, max_size=3), max_size=4
)


def assert_same_intermediates(a, b) -> None:
    """load() gives back save_intermediates' containers for the two outer levels."""
    assert type(b) is Intermediates and list(b) == list(a)
    for name in a:
        assert type(b[name]) is Intermediates and list(b[name]) == list(a[name])
        for mode in a[name]:
            assert_identical(a[name][mode], b[name][mode])


def assert_identical(a, b) -> None:
    """Same containers (exact types), keys in the same order, same dtypes, shapes and bytes."""
    if a is None:
        assert b is None
        return
    if isinstance(a, (dict, list, tuple)):
        assert type(b) is type(a), (type(a), type(b))
        assert len(a) == len(b)
        if isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                assert_identical(a[k], b[k])
        else:
            for x, y in zip(a, b, strict=True):
                assert_identical(x, y)
        return
    a = np.asarray(a)
    assert isinstance(b, np.ndarray)
    assert b.dtype == a.dtype and b.shape == a.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes()


# safetensors' numpy reader has no float8 types yet; those tensors are compared by load() only.
_LIBRARY_READS = {dt.name for dt in DTYPES} - {"float8_e4m3fn", "float8_e5m2"}


def leaves_by_key(path: Path, entries) -> dict[str, np.ndarray]:
    readable = [e.key for e in entries if e.dtype in _LIBRARY_READS]
    with safe_open(os.fspath(path), framework="np") as f:
        assert sorted(f.keys()) == sorted(e.key for e in entries)
        return {k: f.get_tensor(k) for k in readable}


# ----------------------------------------------------------------------------- round trips


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(intermediates=INTERMEDIATES, step=st.one_of(st.none(), st.integers(0, 10**12)),
       metadata=st.dictionaries(st.text(max_size=5), st.one_of(
           st.integers(), st.text(max_size=5), st.booleans(), st.none(),
           st.floats(allow_nan=False, allow_infinity=False),
           st.lists(st.integers(), max_size=3)), max_size=3))
def test_round_trip_is_exact_for_generated_pytrees(intermediates, step, metadata):
    with tempfile.TemporaryDirectory() as d:
        path = dump(intermediates, Path(d) / "x.safetensors", step=step, metadata=metadata)
        back = load(path)
        assert_same_intermediates(intermediates, back)
        assert_same_intermediates(intermediates, load(path, lazy=True))
        head = info(path)
        assert head.step == step and head.metadata == metadata
        assert head.sites == tuple(intermediates)
        assert head.sowtel_version == sowtel.__version__
        # The safetensors library reads every stored array to the same bytes.
        by_key = leaves_by_key(path, head.entries)
        flat = {(e.site, e.mode, e.leaf): e.key for e in head.entries}
        for (site, mode, leaf), key in flat.items():
            if key not in by_key:
                continue
            value = back[site][mode]
            for p in leaf:
                value = value[p]
            assert by_key[key].tobytes() == value.tobytes()
            assert by_key[key].shape == value.shape


def test_scalars_zero_size_and_every_dtype_round_trip(tmp_path):
    inter = {
        f"s{i}": {"primal": np.zeros((), dt), "tangent": np.zeros((0, 3), dt),
                  "cotangent": np.arange(6).astype(dt).reshape(2, 3)}
        for i, dt in enumerate(DTYPES)
    }
    inter["py"] = {"primal": [1.5, 2, True, np.float32(0.25)]}
    back = load(dump(inter, tmp_path / "a.safetensors"))
    for i, dt in enumerate(DTYPES):
        site = back[f"s{i}"]
        assert site["primal"].shape == () and site["primal"].dtype == dt
        assert site["tangent"].shape == (0, 3) and site["tangent"].dtype == dt
        assert site["cotangent"].tolist() == np.arange(6).astype(dt).reshape(2, 3).tolist()
    # Python and numpy scalars come back as 0-d arrays of numpy's dtype for them.
    got = [(a.shape, a.dtype.name, a.item()) for a in back["py"]["primal"]]
    assert got == [((), "float64", 1.5), ((), "int64", 2), ((), "bool", True),
                   ((), "float32", 0.25)]


def test_bfloat16_keeps_every_bit_pattern(tmp_path):
    bits = np.arange(2**16, dtype=np.uint16)
    x = bits.view(ml_dtypes.bfloat16)
    back = load(dump({"all": {"primal": x}}, tmp_path / "bf.safetensors"))["all"]["primal"]
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), bits)


def test_eager_arrays_are_writable_lazy_ones_are_memory_mapped_and_read_only(tmp_path):
    x = np.arange(1 << 20, dtype=np.float32)
    path = dump({"big": {"primal": x}}, tmp_path / "big.safetensors")
    eager = load(path)["big"]["primal"]
    eager[0] = 7.0  # writable, and a copy: the file is untouched
    lazy = load(path, lazy=True)["big"]["primal"]
    assert not lazy.flags.writeable
    assert lazy[0] == 0.0 and lazy[-1] == x[-1]
    base = lazy
    while not isinstance(base, np.memmap) and getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(base, np.memmap), "lazy arrays should be views of a memory map"
    with pytest.raises(ValueError, match="read-only"):
        lazy[0] = 1.0


def test_jax_arrays_from_save_intermediates_round_trip(tmp_path):
    def f(x):
        h = sowtel.sow(jnp.tanh(x).astype(jnp.bfloat16), "h")
        pair = sowtel.sow((x * 2, {"sq": x * x}), "pair")
        count = sowtel.sow(jnp.sum(x > 0).astype(jnp.int32), "count")
        return jnp.sum(h.astype(jnp.float32)) + jnp.sum(pair[0]) + jnp.sum(pair[1]["sq"]) + count

    x = jnp.linspace(-1.0, 1.0, 6)
    _, inter = sowtel.save_intermediates(jax.grad(f))(x)
    back = sowtel.load(sowtel.dump(inter, tmp_path / "g.safetensors", step=1))
    assert_same_intermediates(jax.tree.map(np.asarray, inter), back)
    # Like save_intermediates' result, the loaded sites keep their order through jit.
    assert list(jax.jit(lambda t: t)(back)) == list(inter) == ["h", "pair", "count"]
    assert back["h"]["primal"].dtype == ml_dtypes.bfloat16
    assert type(back["pair"]["primal"]) is tuple
    np.testing.assert_array_equal(back["pair"]["cotangent"][0], np.ones(6, np.float32))
    np.testing.assert_array_equal(back["pair"]["cotangent"][1]["sq"], np.ones(6, np.float32))
    assert back["count"]["primal"].shape == () and back["count"]["primal"] == 3


# ----------------------------------------------------------------------------- folders


def test_folder_of_dumps_one_per_step(tmp_path):
    folder = tmp_path / "dumps"
    for step in (10, 2, 0):
        written = dump({"h": {"primal": np.full(2, step)}}, f"{folder}/", step=step)
        assert written == folder / f"step_{step}.safetensors"
    # An existing folder without the trailing slash is a folder too.
    assert dump({"h": {"primal": np.full(2, 5)}}, folder, step=5).name == "step_5.safetensors"
    (folder / "README.txt").write_text("not a dump")
    assert list(find_dumps(folder)) == [0, 2, 5, 10]
    by_step = load(folder)
    assert list(by_step) == [0, 2, 5, 10]
    assert {k: v["h"]["primal"].tolist() for k, v in by_step.items()} == {
        k: [k, k] for k in (0, 2, 5, 10)}
    lazy = load(folder, lazy=True)
    assert lazy[10]["h"]["primal"].tolist() == [10, 10]


def test_folder_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"needs step=.*step_<k>\.safetensors"):
        dump({"h": {"primal": np.ones(1)}}, tmp_path)
    with pytest.raises(ValueError, match="step=-1 must be >= 0"):
        dump({"h": {"primal": np.ones(1)}}, tmp_path, step=-1)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no dumps"):
        load(empty)
    # A file renamed to another step is caught, not silently mislabelled.
    dump({"h": {"primal": np.ones(1)}}, tmp_path, step=3)
    os.replace(tmp_path / "step_3.safetensors", tmp_path / "step_4.safetensors")
    with pytest.raises(ValueError, match="named for step 4 but its header says step 3"):
        load(tmp_path)
    dump({"h": {"primal": np.ones(1)}}, tmp_path / "step_04.safetensors", step=4)
    with pytest.raises(ValueError, match="two dumps for step 4"):
        load(tmp_path)


def test_dump_never_leaves_a_partial_file(tmp_path):
    target = tmp_path / "x.safetensors"
    dump({"h": {"primal": np.ones(3)}}, target)
    with pytest.raises(ValueError):
        dump({"h": {"primal": np.ones(3)}, "bad": {"primal": np.ones(2, np.complex128)}}, target)
    assert load(target)["h"]["primal"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


# ----------------------------------------------------------------------------- bad input


def test_bad_intermediates_and_metadata_are_rejected_clearly(tmp_path):
    p = tmp_path / "x.safetensors"
    cases = [
        ([np.ones(2)], TypeError, r"must be a dict \{name: \{mode: value\}\}"),
        ({"h": np.ones(2)}, TypeError, r"intermediates\['h'\] must be a dict \{mode: value\}"),
        ({"h": {"forward": np.ones(2)}}, ValueError, "mode 'forward' is not a mode"),
        ({"": {"primal": np.ones(2)}}, ValueError, "non-empty string"),
        ({"h": {"primal": np.ones(2, np.complex128)}}, ValueError,
         r"intermediates\['h'\]\['primal'\] has dtype complex128.*cast it"),
        ({"h": {"primal": {"w": np.array(["a"])}}}, ValueError, r"\['w'\] has dtype str"),
        ({"h": {"primal": collections.namedtuple("P", "a")(np.ones(1))}}, TypeError,
         r"P: a dump stores pytrees made of dicts, lists, tuples, None and arrays.*_asdict"),
        ({"h": {"primal": {(1, 2): np.ones(1)}}}, ValueError, r"dict key \(1, 2\)"),
        ({"h": {"primal": "text"}}, TypeError, "str: a dump stores pytrees"),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            dump(value, p)
    for metadata, message in [
        ({"t": (1, 2)}, r"metadata\['t'\] = \(1, 2\) \(tuple\) is not JSON"),
        ({"x": float("nan")}, r"metadata\['x'\] = nan is not JSON"),
        ({1: "a"}, "has key 1: JSON object keys must be strings"),
        ({"a": [object()]}, r"metadata\['a'\]\[0\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            dump({"h": {"primal": np.ones(1)}}, p, metadata=metadata)
    with pytest.raises(TypeError, match=r"metadata=\[1\] is a list, not a dict"):
        dump({"h": {"primal": np.ones(1)}}, p, metadata=[1])
    with pytest.raises(TypeError, match=r"step=True must be an int"):
        dump({"h": {"primal": np.ones(1)}}, p, step=True)
    assert not p.exists()


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere\.safetensors' does not exist"):
        load(tmp_path / "nowhere.safetensors")


@pytest.fixture
def good_dump(tmp_path) -> Path:
    inter = {"a": {"primal": np.arange(10, dtype=np.float32)},
             "b": {"primal": {"w": np.ones((3, 3)), "n": np.int32(4)}}}
    return dump(inter, tmp_path / "good.safetensors", step=1, metadata={"k": "v"})


def test_every_truncation_is_caught_with_the_path_named(good_dump, tmp_path):
    raw = good_dump.read_bytes()
    bad = tmp_path / "cut.safetensors"
    for cut in range(len(raw)):
        bad.write_bytes(raw[:cut])
        with pytest.raises(ValueError, match=r"'.*cut\.safetensors' is (truncated|corrupted|not)"):
            load(bad)


def test_every_single_byte_corruption_is_caught(good_dump, tmp_path):
    raw = good_dump.read_bytes()
    bad = tmp_path / "flip.safetensors"
    header_end = 8 + int.from_bytes(raw[:8], "little")
    # Every byte of the data, and a sample of the header (padding spaces may change freely).
    positions = list(range(header_end, len(raw))) + list(range(0, header_end, 7))
    for pos in positions:
        flipped = bytearray(raw)
        flipped[pos] ^= 0x01
        if raw[pos:pos + 1] == b" ":
            continue  # JSON whitespace: still the same header
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError, match="flip.safetensors"):
            load(bad)


def _pickle_trap(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when unpickled: proof of whether anything unpickled it."""

    class Trap:
        def __reduce__(self):
            return (Path.touch, (marker,))

    return pickle.dumps(Trap(), protocol=4)


def test_pickles_are_rejected_and_never_unpickled(tmp_path):
    # The trap works: unpickling it does create the marker.
    proof = tmp_path / "proof"
    pickle.loads(_pickle_trap(proof))
    assert proof.exists()

    marker = tmp_path / "unpickled"
    trap = _pickle_trap(marker)
    plain = tmp_path / "x.pkl"
    plain.write_bytes(trap)
    renamed = tmp_path / "x.safetensors"
    renamed.write_bytes(trap)
    npy_trap = tmp_path / "obj.npz"
    np.savez(npy_trap, x=np.array([None, 1], dtype=object))
    # Make the object array's payload the trap, keeping NumPy's own .npy header.
    with zipfile.ZipFile(npy_trap) as z:
        member = z.read("x.npy")
    header_len = member.index(b"\n") + 1
    with zipfile.ZipFile(npy_trap, "w") as z:
        z.writestr("x.npy", member[:header_len] + trap)
    torch_like = tmp_path / "model.pt"
    with zipfile.ZipFile(torch_like, "w") as z:
        z.writestr("archive/data.pkl", trap)
    npy = tmp_path / "obj.npy"
    np.save(npy, np.array([{"a": 1}], dtype=object), allow_pickle=True)

    expected = {
        plain: "is a Python pickle; sowtel never unpickles files",
        renamed: "is a Python pickle",
        npy_trap: r"NumPy \.npz archive whose member 'x\.npy' holds pickled objects",
        torch_like: r"zip archive containing the pickle 'archive/data\.pkl'",
        npy: r"NumPy \.npy file holding pickled objects",
    }
    for path, message in expected.items():
        for call in (load, info, lambda p: load(p, lazy=True)):
            with pytest.raises(ValueError, match=message):
                call(path)
    assert not marker.exists(), "a file was unpickled"


def test_files_that_are_not_dumps(tmp_path):
    foreign = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, foreign)
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a dump at all")
    npz = tmp_path / "arrays.npz"
    np.savez(npz, x=np.zeros(2))
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    huge_header = tmp_path / "huge.safetensors"
    huge_header.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    cases = {
        foreign: "is a safetensors file but not a sowtel dump",
        text: "is not a sowtel dump",
        npz: r"is a NumPy \.npz archive",
        empty: "is truncated or not a sowtel dump: 0 bytes",
        huge_header: "is not a sowtel dump",
    }
    for path, message in cases.items():
        with pytest.raises(ValueError, match=message):
            load(path)


def _rewritten(path: Path, out: Path, edit) -> Path:
    """A copy of a dump whose header JSON ``edit`` changed in place."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return out


def test_a_newer_format_version_is_refused_with_advice(good_dump, tmp_path):
    newer = _rewritten(good_dump, tmp_path / "newer.safetensors",
                       lambda h: h["__metadata__"].update(format_version="99"))
    with pytest.raises(ValueError, match="format version '99'.*upgrade sowtel"):
        load(newer)


@pytest.mark.parametrize("stacked", ['[]', '{"h": []}', '{"h": {"primal": [["loop", 3]]}}',
                                     '{"h": {"primal": [["scan", -1]]}}',
                                     '{"h": {"primal": [["scan", 2.5]]}}'])
def test_malformed_stacked_axes_are_refused_even_with_a_valid_checksum(tmp_path, stacked):
    def forge(header):
        fields = header["__metadata__"]
        fields.pop("checksums")
        fields["stacked"] = stacked
        table = {k: (_dump_format.CODE_TO_DTYPE[v["dtype"]].name, v["shape"])
                 for k, v in header.items() if k != "__metadata__"}
        fields["checksums"] = json.dumps({
            "header": _dump_format.header_crc(fields, table),
            "tensors": {k: _dump_format.array_crc(np.arange(3.0)) for k in table}})

    path = dump({"h": {"primal": np.arange(3.0)}}, tmp_path / "ok.safetensors")
    forged = _rewritten(path, tmp_path / "forged.safetensors", forge)
    with pytest.raises(ValueError, match="stacked axes"):
        load(forged)


# ----------------------------------------------------------------------------- records


def assert_stats_close(got: dict[str, float], want: dict[str, float], rtol: float) -> None:
    assert list(got) == list(STAT_KEYS)
    for k in STAT_KEYS:
        if math.isnan(want[k]):
            assert math.isnan(got[k]), (k, got[k])
        else:
            assert got[k] == pytest.approx(want[k], rel=rtol, abs=1e-6), (k, got[k], want[k])


def test_records_name_each_leaf_and_match_numpy():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    w[0, 0], w[1, 1], w[2, 2] = np.nan, np.inf, -np.inf
    inter = {
        "h": {"primal": rng.normal(size=5).astype(ml_dtypes.bfloat16)},
        "params": {"primal": {"w": w, "b": np.zeros(3, np.float32)}},
        "pair": {"primal": (np.arange(4, dtype=np.int32), np.array([True, False, True]))},
        "nested": {"primal": {"layers": [{"k": np.ones(2)}, None]}},
    }
    records = records_from_intermediates(inter, step=4)
    names = [r.name for r in records]
    assert names == ["h", "params/w", "params/b", "pair/0", "pair/1", "nested/layers/0/k"]
    assert [r.seq for r in records] == list(range(6))
    leaves = [inter["h"]["primal"], w, inter["params"]["primal"]["b"],
              *inter["pair"]["primal"], np.ones(2)]
    for r, leaf in zip(records, leaves, strict=True):
        assert (r.mode, r.tag, r.step, r.index, r.summary) == (
            "primal", "intermediates", 4, None, "stats")
        assert r.shape == leaf.shape and r.dtype == leaf.dtype.name
        assert r.value is None and r.histogram is None
        assert_stats_close(r.stats, numpy_stats(leaf), rtol=1e-5)
    assert records[1].nonfinite == 3


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32,
                                   np.bool_])
def test_host_records_match_the_device_summary(dtype):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(16, 8)) * 3).astype(dtype)
    if np.issubdtype(np.dtype(dtype), np.floating):
        x[0, :3] = [np.nan, np.inf, -np.inf]
    [rec] = records_from_intermediates({"x": {"primal": x}}, step=0, summary="histogram")
    device = jax.jit(lambda v: device_summary(v, "histogram"))(jnp.asarray(x))
    want = decode_device_summary([np.asarray(a) for a in device], "histogram", x.size)
    assert_stats_close(rec.stats, want["stats"], rtol=1e-5)
    edges, counts = rec.histogram
    np.testing.assert_allclose(edges, want["histogram"][0], rtol=1e-6)
    np.testing.assert_array_equal(counts, want["histogram"][1])


def test_records_summaries_full_health_shape():
    x = np.array([1.0, np.nan, 3.0], np.float32)
    [full] = records_from_intermediates({"x": {"tangent": x}}, step=2, summary="full", tag="t")
    assert full.tag == "t" and full.mode == "tangent"
    np.testing.assert_array_equal(full.value, x)
    [health] = records_from_intermediates({"x": {"primal": x}}, step=2, summary="health")
    assert health.stats == {"size": 3.0, "nan": 1.0, "posinf": 0.0, "neginf": 0.0}
    [shape] = records_from_intermediates({"x": {"primal": x}}, step=2, summary="shape")
    assert shape.stats == {} and shape.shape == (3,) and shape.dtype == "float32"
    with pytest.raises(ValueError, match="summary='mean' is not a summary"):
        records_from_intermediates({"x": {"primal": x}}, step=2, summary="mean")
    with pytest.raises(TypeError, match="step=1.5 must be an int"):
        records_from_intermediates({"x": {"primal": x}}, step=1.5)


def test_record_order_is_program_order_under_grad():
    def f(x):
        a = sowtel.sow(x * 2.0, "a")
        b = sowtel.sow(jnp.sin(a), "b")
        return jnp.sum(sowtel.sow(b * b, "c"))

    _, inter = sowtel.save_intermediates(jax.grad(f))(jnp.arange(3.0))
    order = [(r.name, r.mode) for r in records_from_intermediates(inter, step=0)]
    # Forward pass in site order, then the backward pass in reverse site order.
    assert order == [("a", "primal"), ("b", "primal"), ("c", "primal"),
                     ("c", "cotangent"), ("b", "cotangent"), ("a", "cotangent")]


def _loss(w, x):
    h = sowtel.sow(jnp.tanh(x @ w["k"]), "hidden")
    out = sowtel.sow({"logits": h * 2.0, "bias": w["b"]}, "head")
    return jnp.mean(out["logits"] ** 2) + jnp.sum(out["bias"])


def test_export_gives_the_records_streaming_gives(tmp_path):
    from sowtel.exporters.memory import MemoryExporter

    w = {"k": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.5, -0.5, np.nan])}
    x = jnp.linspace(0.0, 2.0, 8).reshape(2, 4)
    streamed, exported = MemoryExporter(), MemoryExporter()
    _, inter = jax.jit(sowtel.save_intermediates(jax.grad(_loss)))(w, x)
    with sowtel.enable(exporter=streamed, summary="stats"):
        jax.jit(jax.grad(_loss))(w, x)
        sowtel.flush()
    with sowtel.enable(exporter=exported):
        assert sowtel.export(inter, step=0) == 6
        sowtel.flush()
    live = {(r.name, r.mode): r for r in streamed.records}
    batch = {(r.name, r.mode): r for r in exported.records}
    assert sorted(batch) == sorted(live)
    assert sorted(batch) == sorted(
        (n, m) for n in ("hidden", "head/logits", "head/bias") for m in ("primal", "cotangent"))
    for key, r in batch.items():
        s = live[key]
        assert (r.step, r.shape, r.dtype, r.tag) == (0, s.shape, s.dtype, s.tag)
        assert_stats_close(r.stats, s.stats, rtol=1e-5)
    assert batch[("head/bias", "primal")].stats["nan"] == 1


def _stacked_loss(w, xs):
    # A reverse scan of layers, each with an inner scan and a pytree site, then a shard_map.
    def layer(h, x):
        def inner(c, y):
            return c + sowtel.sow(jnp.tanh(y * h), "inner").sum(), None

        c, _ = jax.lax.scan(inner, 0.0, x)
        pair = sowtel.sow({"a": h * c, "b": x * 2.0}, "pair")
        return jnp.sin(pair["a"]) + pair["b"].sum(), None

    h, _ = jax.lax.scan(layer, w, xs, reverse=True)
    mesh = jax.make_mesh((4,), ("i",))
    sharded = jax.shard_map(lambda v: sowtel.sow(v * v, "shard"), mesh=mesh,
                            in_specs=jax.sharding.PartitionSpec("i"),
                            out_specs=jax.sharding.PartitionSpec("i"))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    tiled = jax.reshard(jnp.tile(h, 8), spec)
    return jnp.sum(sharded(tiled))


def test_export_of_stacked_values_gives_the_records_streaming_gives(tmp_path):
    from sowtel.exporters.memory import MemoryExporter

    w = jnp.float32(0.3)
    xs = jnp.linspace(-1.0, 1.0, 3 * 2).reshape(3, 2)
    _, inter = jax.jit(sowtel.save_intermediates(jax.grad(_stacked_loss)))(w, xs)
    assert inter["inner"].stacked == {"primal": (("scan", 3), ("scan", 2)),
                                      "cotangent": (("scan", 3), ("scan", 2))}
    assert inter["pair"].stacked["primal"] == (("scan", 3),)
    assert inter["shard"].stacked["cotangent"] == (("shard", 4),)
    # The stacking survives a dump.
    back = load(dump(inter, tmp_path / "d.safetensors"))
    assert {k: v.stacked for k, v in back.items()} == {k: v.stacked for k, v in inter.items()}

    streamed, exported = MemoryExporter(), MemoryExporter()
    with sowtel.enable(exporter=streamed, summary="stats"):
        jax.jit(jax.grad(_stacked_loss))(w, xs)
        sowtel.flush()
    with sowtel.enable(exporter=exported):
        handed = sowtel.export(back, step=0)
        sowtel.flush()
    assert handed == len(exported.records)
    live = {(r.name, r.mode, r.index): r for r in streamed.records}
    batch = {(r.name, r.mode, r.index): r for r in exported.records}
    assert len(batch) == len(exported.records) == 2 * (3 * 2 + 2 * 3 + 4)
    assert sorted(batch, key=repr) == sorted(live, key=repr)
    assert ("inner", "cotangent", (2, 1)) in batch and ("shard", "primal", 3) in batch
    for key, r in batch.items():
        s = live[key]
        assert (r.step, r.shape, r.dtype) == (0, s.shape, s.dtype), key
        assert_stats_close(r.stats, s.stats, rtol=1e-5)
    # Values by hand: iteration i of the reverse scan runs layer on xs[i]; its "pair/b" is 2 xs[i].
    for i in range(3):
        np.testing.assert_allclose(batch[("pair/b", "primal", i)].stats["mean"],
                                   2 * float(np.mean(np.asarray(xs)[i])), rtol=1e-6)
    # One site's records come in index order, whatever order the passes visited them in.
    order = [r.index for r in exported.records if (r.name, r.mode) == ("pair/a", "cotangent")]
    assert order == [0, 1, 2]


def test_export_under_a_vmap_of_save_intermediates_keeps_each_stack_whole():
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + sowtel.sow(x * 2.0, "h"), None), 0.0, xs)[0]

    _, inter = jax.vmap(sowtel.save_intermediates(f))(jnp.ones((5, 3)))
    assert inter["h"]["primal"].shape == (5, 3) and inter["h"].stacked == {"primal": (("scan", 3),)}
    [r] = records_from_intermediates(inter, step=1)
    assert (r.index, r.shape, r.stats["mean"]) == (None, (5, 3), 2.0)


def test_export_reaches_tensorboard_and_opentelemetry(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from tensorboard.backend.event_processing import event_accumulator

    from sowtel.exporters.otel import OTelExporter
    from sowtel.exporters.tensorboard import TensorBoardExporter

    w = {"k": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.5, -0.5, 2.0])}
    x = jnp.linspace(0.0, 2.0, 8).reshape(2, 4)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    steps = (3, 4)
    # Captured first: while a session is enabled, the sows themselves would stream too.
    inters = {step: sowtel.save_intermediates(jax.grad(_loss))(
        jax.tree.map(lambda t, k=step: t * k, w), x)[1] for step in steps}
    with sowtel.enable(exporter=[TensorBoardExporter(tmp_path / "tb"),
                                 OTelExporter(tracer_provider=provider)]):
        for step in steps:
            sowtel.export(inters[step], step=step)
    acc = event_accumulator.EventAccumulator(os.fspath(tmp_path / "tb"),
                                             size_guidance={"scalars": 0})
    acc.Reload()
    for step in steps:
        want = numpy_stats(np.asarray(inters[step]["hidden"]["cotangent"]))
        got = {e.step: e.value for e in acc.Scalars("hidden/cotangent/l2")}
        assert got[step] == pytest.approx(want["l2"], rel=1e-5)
        got_std = {e.step: e.value for e in acc.Scalars("head/logits/primal/std")}
        want_std = numpy_stats(np.asarray(inters[step]["head"]["primal"]["logits"]))["std"]
        assert got_std[step] == pytest.approx(want_std, rel=1e-5)
    by_step = {s.attributes["sowtel.step"]: s for s in spans.get_finished_spans()
               if s.name == "sowtel.step"}
    assert sorted(by_step) == list(steps)
    events = {(e.attributes["sowtel.name"], e.attributes["sowtel.mode"]): e.attributes
              for e in by_step[4].events}
    assert len(events) == 6
    want = numpy_stats(np.asarray(inters[4]["head"]["primal"]["bias"]))
    assert events[("head/bias", "primal")]["sowtel.stat.max"] == pytest.approx(want["max"])


def test_module_is_exposed_as_the_public_api():
    assert sowtel.dump is dumps.dump and sowtel.load is dumps.load
