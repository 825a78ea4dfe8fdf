"""sow itself: identity, validation, and a compiled program untouched while nothing is enabled."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel import save_intermediates, sow

X = jnp.array([0.3, -0.7, 1.1, 0.5])


def _program(fn, *args) -> str:
    """The optimized HLO, less what differs between any two functions: names and source info."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
    text = re.sub(r"\n(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*", "\n", text)
    return text


def _mlp(x, w1, w2, tag_sites: bool):
    hook = (lambda v, n: sow(v, n)) if tag_sites else (lambda v, n: v)
    h = hook(jnp.tanh(x @ w1), "h1")
    out = hook(h @ w2, "out")
    return jnp.mean(out**2)


def _scan(x, tag_sites: bool):
    def body(c, xi):
        v = jnp.sin(c + xi)
        return c + (sow(v, "in_scan") if tag_sites else v), v

    return jax.lax.scan(body, 0.0, x)


PROGRAMS = {
    "plain": lambda t: (lambda x, w1, w2: _mlp(x, w1, w2, t)),
    "grad": lambda t: jax.grad(lambda x, w1, w2: _mlp(x, w1, w2, t), argnums=(1, 2)),
    "vmap": lambda t: jax.vmap(lambda x, w1, w2: _mlp(x, w1, w2, t), in_axes=(0, None, None)),
    "scan": lambda t: (lambda x, w1, w2: _scan(x.ravel(), t)),
}


@pytest.mark.parametrize("kind", list(PROGRAMS))
def test_disabled_program_is_identical(kind: str) -> None:
    args = (jnp.ones((4, 8)), jnp.ones((8, 16)) * 0.1, jnp.ones((16, 2)) * 0.1)
    with_sows = _program(PROGRAMS[kind](True), *args)
    without = _program(PROGRAMS[kind](False), *args)
    assert with_sows == without
    # The comparison is not vacuous: while streaming, the same program changes.
    with sowtel.enable(exporter="memory"):
        assert _program(PROGRAMS[kind](True), *args) != without


def test_sow_is_identity_on_pytrees() -> None:
    tree = {"a": X, "b": (X * 2, jnp.int32(3)), "c": [np.ones(2)]}
    assert sow(tree, "t") is tree  # nothing enabled: the very same object
    with sowtel.enable(exporter="memory"):
        out = jax.jit(lambda t: sow(t, "t"))(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (3, "sow name must be a str, got int 3"),
        (None, "sow name must be a str, got NoneType"),
        ("", "sow name must be non-empty"),
        ("a//b", "empty segment"),
        ("a/", "empty segment"),
        ("a/./b", "has a '.' segment"),
        ("../up", "has a '..' segment"),
        ("/abs", "starts with '/'"),
        ("sp ace", "has the character(s) ' '"),
        ("x:y", "has the character(s) ':'"),
    ],
)
def test_bad_names(name: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        sow(X, name)  # type: ignore[arg-type]


def test_good_names() -> None:
    for name in ("h", "block0/attn", "a.b-c_d", "x/y.z/w"):
        assert sow(X, name) is X


def test_bad_tag_summary_every() -> None:
    with pytest.raises(ValueError, match="sow tag must be a non-empty str, got 5"):
        sow(X, "h", tag=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sow summary='mean' is not a summary"):
        sow(X, "h", summary="mean")
    with pytest.raises(ValueError, match=re.escape("sow(every=0): every must be a positive int")):
        sow(X, "h", every=0)
    with pytest.raises(ValueError, match=re.escape("sow(every=True): every must be a positive")):
        sow(X, "h", every=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b"])
def test_a_refused_name_is_told_what_is_allowed(name: str) -> None:
    with pytest.raises(ValueError) as e:
        sow(X, name)
    assert str(e.value).endswith(
        "a name is segments of letters, digits and _ - . joined by '/', such as 'block0/attn' "
        "(no empty, '.' or '..' segment, no leading '/')"), str(e.value)


def test_save_intermediates_that_captures_nothing_warns_once_naming_the_tags() -> None:
    def tagged(x):
        return jnp.sum(sow(x, "a", tag="debug") * sow(x, "b", tag="probe"))

    wrapped = sowtel.save_intermediates(jax.grad(tagged))
    with pytest.warns(UserWarning) as caught:
        _, inter = wrapped(X)
        wrapped(X)  # the same trace, and another shape: warned about once
        wrapped(jnp.ones(5))
    assert inter == {}
    assert [str(w.message) for w in caught] == [
        "save_intermediates(tag='intermediates') captured nothing: tagged sows only with the "
        "tag(s) ['debug', 'probe']; pass tag='debug', or sow with tag='intermediates'"]
    assert caught[0].filename == __file__  # the caller's line, not JAX's
    with pytest.warns(UserWarning, match="captured nothing: <lambda> sows no value; tag the "
                                         "values to capture with sowtel.sow"):
        sowtel.save_intermediates(lambda x: x * 2)(X)
    # JAX's caches compare contexts too: a capture of this tag earlier in the process must not
    # make a function without sows look as if it sowed with it.
    key = jax.random.key(0)
    draw = lambda k: jax.random.truncated_normal(k, -1.0, 1.0, (3,)).sum()  # noqa: E731
    sowtel.save_intermediates(lambda k: sow(draw(k), "s"))(key)
    with pytest.warns(UserWarning, match="captured nothing: <lambda> sows no value"):
        sowtel.save_intermediates(draw)(key)
    # The right tag captures, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, inter = sowtel.save_intermediates(tagged, tag="probe")(X)
    assert list(inter) == ["b"]


def test_non_array_leaf_names_its_path() -> None:
    def f(x):
        return sow({"ok": x, "bad": [x, "label"]}, "tree")["ok"]

    with pytest.raises(ValueError, match=re.escape("the leaf at ['bad'][1] is a str")):
        save_intermediates(f)(X)
    with sowtel.enable(exporter="memory"), pytest.raises(ValueError, match="is a str"):
        jax.jit(f)(X)


def test_python_scalars_are_accepted_as_arrays() -> None:
    _, inter = save_intermediates(lambda x: sow(2.5, "const") * x)(X)
    assert float(inter["const"]["primal"]) == 2.5


def test_at_step_rejects_non_integers() -> None:
    for bad in (1.5, "3", jnp.float32(2.0), True, jnp.arange(2)):
        with pytest.raises(ValueError, match="at_step step must be"):
            with sowtel.at_step(bad):
                pass
    with sowtel.at_step(jnp.int32(4)), sowtel.at_step(5):
        pass
