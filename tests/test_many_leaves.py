"""A sown pytree of many leaves is summarised a group at a time, not a leaf at a time: the
program holds one set of reductions per summary dtype group whatever the number of leaves,
and every leaf's record is the one its own summary gives (both transports)."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel.summaries import (
    ARRAYS_PER_LEAF,
    decode_device_summary,
    host_summary,
    pack_plan,
    packed_summary,
    packing_of,
)

_REDUCE = re.compile(r"stablehlo\.reduce[( ]")


def _tree(n: int, ints: int = 0) -> dict[str, Any]:
    # Leaves of many sizes (up to 250 elements): a per-leaf summary could not share one
    # traced function between them, so the program text shows each leaf's reductions.
    tree = {f"f{i:03d}": np.linspace(-1.0, 1.0, i * 7 % 250 + 1, dtype=np.float32)
            for i in range(n)}
    tree.update({f"i{i:03d}": np.arange(i * 7 % 250 + 1, dtype=np.int32) for i in range(ints)})
    return tree


def _step(t: Any) -> Any:
    return sowtel.sow(jax.tree_util.tree_map(lambda x: x * 2, t), "params")


def _reduces(transport: str, tree: dict[str, Any]) -> int:
    with sowtel.enable(exporter="memory"):
        if transport == "sowtel.jit":
            text = sowtel.jit(_step).lower_logging(tree).as_text()
        else:
            text = jax.jit(_step).lower(tree).as_text()
    return len(_REDUCE.findall(text))


@pytest.mark.parametrize("transport", ["sowtel.jit", "callback"])
def test_reductions_are_per_dtype_group_not_per_leaf(transport: str) -> None:
    floats_300 = _reduces(transport, _tree(300))
    floats_30 = _reduces(transport, _tree(30))
    # Ten times the leaves, the same reductions: one group's, not one set a leaf.
    assert floats_300 == floats_30, (floats_300, floats_30)
    assert floats_300 < 30, floats_300
    # A second summary dtype group (integers: no non-finite counts) adds one group's, once.
    mixed = _reduces(transport, _tree(150, ints=150))
    assert floats_300 < mixed <= 2 * floats_300, (mixed, floats_300)
    assert mixed == _reduces(transport, _tree(15, ints=15))


RNG = np.random.default_rng(3)
MIXED = [
    np.float32(-2.5),  # a scalar
    RNG.normal(size=(4, 5)).astype(np.float32),
    np.array([1.0, np.nan, -2.0, np.inf, 0.0, -np.inf, 3.0], np.float32),
    np.full(5, np.nan, np.float32),  # no finite element
    np.zeros((0, 3), np.float32),  # empty
    np.array([3e38, -3e38, 1e38], np.float32),  # finite, whose squares overflow
    jnp.asarray(RNG.normal(size=(3, 7)), jnp.bfloat16),
    jnp.asarray([1.0, float("nan"), float("inf")], jnp.bfloat16),
    RNG.normal(size=33).astype(np.float16),
    RNG.integers(-5, 5, size=(6, 2)).astype(np.int32),
    np.array([0, 0, 7], np.int8),
    RNG.random(9) > 0.5,
    np.zeros((0,), np.int32),
    (1000.0 + RNG.normal(size=5000)).astype(np.float32),  # above PACK_SMALL: sized groups
    RNG.normal(size=5000).astype(np.float32) * 1e30,
    np.where(RNG.random(5000) > 0.99, np.nan, RNG.normal(size=5000)).astype(np.float32),
    RNG.normal(size=(2, 3)),  # float64 (float32 as JAX takes it, without x64)
]
MIXED = [jnp.asarray(v) for v in MIXED]
WIDE = 5  # numpy's histogram of a range wider than float32's largest (3e38 - -3e38) fails


@pytest.mark.parametrize("form", ["separate", "variadic"])
@pytest.mark.parametrize("summary", ["stats", "histogram", "health"])
def test_packed_summaries_equal_each_leafs_host_summary(summary: str, form: str) -> None:
    arrays = jax.jit(lambda vs: packed_summary(vs, summary, 30, form)[0])(MIXED)
    packing = packing_of(pack_plan(MIXED, summary), len(MIXED), summary)
    # Three groups (float32, float32 of integers and bools, 5,000-element float32) and the
    # two empty values on their own.
    assert packing.count == 5 * ARRAYS_PER_LEAF[summary] == len(arrays)
    per_leaf = packing.unpack([np.asarray(a) for a in arrays])
    per = len(per_leaf) // len(MIXED)
    # What device_summary sends for one value, as the host decodes it.
    shapes = {"stats": [(6,), (4,)], "histogram": [(6,), (4,), (30,)], "health": [(3,)]}
    for i, value in enumerate(MIXED):
        mine = per_leaf[i * per:(i + 1) * per]
        assert [a.shape for a in mine] == shapes[summary], i
        assert all(a.dtype == np.int32 for a in mine[1:]), i
        got = decode_device_summary(mine, summary, int(np.size(value)))
        host_value = np.asarray(value.astype(jnp.float32) if value.dtype == jnp.bfloat16
                                else value)
        spans = summary != "histogram" or i != WIDE
        host = host_summary(host_value, summary if spans else "stats")
        assert list(got["stats"]) == list(host["stats"]), i
        low = np.asarray(value).dtype in (np.float16, jnp.bfloat16)
        for k, expected in host["stats"].items():
            if form == "variadic" and k in ("mean", "std", "l2") and host["stats"]["std"] > 1.8e19:
                continue  # the variadic form's variance overflows there (documented)
            if np.isnan(expected):
                assert np.isnan(got["stats"][k]), (i, k)
            else:
                tol = 2e-3 if low else 2e-5
                np.testing.assert_allclose(got["stats"][k], expected, rtol=tol, atol=tol,
                                           err_msg=f"leaf {i} {k}")
        if summary == "histogram" and spans:
            (d_edges, d_counts), (h_edges, h_counts) = got["histogram"], host["histogram"]
            np.testing.assert_allclose(d_edges, h_edges, rtol=1e-5)
            if not low:
                np.testing.assert_array_equal(d_counts, h_counts, err_msg=f"leaf {i}")


@pytest.mark.parametrize("transport", ["sowtel.jit", "callback"])
def test_records_of_a_packed_site_in_a_scan_are_each_leafs(transport: str) -> None:
    leaves = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.array([1.0, jnp.nan]),
              "c": jnp.arange(4, dtype=jnp.int32), "d": jnp.float32(2.0)}

    def step(t: Any) -> Any:
        def body(c: Any, k: Any) -> tuple[Any, None]:
            c = jax.tree_util.tree_map(lambda x: x + k.astype(x.dtype), c)
            return sowtel.sow(c, "v"), None

        return jax.lax.scan(body, t, jnp.arange(3))[0]

    with sowtel.enable(exporter="memory") as session:
        fn = sowtel.jit(step) if transport == "sowtel.jit" else jax.jit(step)
        jax.block_until_ready(fn(leaves))
        assert sowtel.flush(timeout=60)
    records = session.exporters[0].records
    assert len(records) == 3 * len(leaves)
    expected = leaves
    by_index: dict[Any, dict[str, Any]] = {}
    for r in records:
        by_index.setdefault(r.index, {})[r.name] = r
    assert len(by_index) == 3
    for k, index in enumerate(sorted(by_index, key=str)):
        expected = jax.tree_util.tree_map(lambda x, k=k: x + sum(range(k + 1)), leaves)
        for name, value in expected.items():
            r = by_index[index][f"v/{name}"]
            host = host_summary(np.asarray(value), "stats")["stats"]
            assert r.shape == tuple(np.shape(value)) and r.dtype == str(value.dtype)
            for key, want in host.items():
                got = r.stats[key]
                assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want), (
                    transport, index, name, key, got, want)


@pytest.mark.parametrize("form", ["separate", "variadic"])
def test_a_group_past_pack_bytes_is_cut_into_packs_that_stay_exact(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sowtel.summaries as summaries

    # 20 leaves of 5,000 float32 (20 kB each) in packs of at most 8 leaves' bytes: 3 packs
    # (8, 8, 4) of one size class, sharing one conditional; a NaN in the second pack and an
    # overflowing square in the third take the masked path, of every pack at once.
    monkeypatch.setattr(summaries, "PACK_BYTES", 8 * 5000 * 4)
    leaves = [jnp.asarray(RNG.normal(size=5000), jnp.float32) + i for i in range(20)]
    leaves[10] = leaves[10].at[7].set(jnp.nan)
    leaves[17] = leaves[17] * 1e30
    plan = pack_plan(leaves, "stats")
    assert plan is not None and [len(m) for m in plan.values()] == [8, 8, 4]
    arrays = jax.jit(lambda vs: packed_summary(vs, "stats", 30, form)[0])(leaves)
    per_leaf = packing_of(plan, len(leaves), "stats").unpack([np.asarray(a) for a in arrays])
    for i, value in enumerate(leaves):
        got = decode_device_summary(per_leaf[2 * i:2 * i + 2], "stats", 5000)["stats"]
        host = host_summary(np.asarray(value), "stats")["stats"]
        for k, expected in host.items():
            if form == "variadic" and k in ("mean", "std", "l2") and host["std"] > 1.8e19:
                continue  # the variadic form's variance overflows there (documented)
            np.testing.assert_allclose(got[k], expected, rtol=2e-5, atol=2e-5,
                                       err_msg=f"leaf {i} {k}")
