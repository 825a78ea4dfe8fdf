"""Site names: scopes, repeated names (streaming numbers them as capture does), validation
whatever is enabled, and the regressions found by ported test suites (disable_jit + scan,
vmap batch axes of derivatives, custom_jvp under an outer jvp)."""

from __future__ import annotations

import doctest
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
from sowtel import save_intermediates, sow

X = jnp.array([0.3, -0.7, 1.1])


def _records(session):
    assert sowtel.flush()
    return session.exporters[0].records


def _by_name_mode(records, step=0):
    return {(r.name, r.mode): r for r in records if r.step == step}


# ---------------------------------------------------------------------------------------------
# Scopes.


def _scoped_model(x):
    with sowtel.scope("encoder"):
        for i in range(2):
            with sowtel.scope(f"layer{i}"):
                x = jnp.tanh(sow(x * 2.0, "act"))
    return jnp.sum(sow(x, "out") ** 2)


def test_scopes_nest_in_capture_and_streaming() -> None:
    names = ["encoder/layer0/act", "encoder/layer1/act", "out"]
    _, inter = save_intermediates(_scoped_model)(X)
    assert list(inter) == names
    np.testing.assert_allclose(inter["encoder/layer0/act"]["primal"], X * 2.0, rtol=1e-6)
    np.testing.assert_allclose(inter["encoder/layer1/act"]["primal"],
                               np.tanh(np.asarray(X) * 2.0) * 2.0, rtol=1e-6)
    with sowtel.enable(exporter="memory") as session:
        jax.jit(_scoped_model)(X)  # traced
        _scoped_model(X)           # eager
    # Host callbacks may arrive in any order (JAX runs them on several threads): in the order
    # the program ran them, by their order key.
    records = sorted(_records(session), key=lambda r: (r.step, r.order_key))
    assert [r.name for r in records if r.step == 0] == names
    assert [r.name for r in records if r.step == 1] == names


def test_scope_is_read_when_the_sow_is_traced() -> None:
    f = jax.jit(lambda x: sow(x, "h").sum())
    with sowtel.scope("outer"):
        _, inter = save_intermediates(f)(X)
    assert list(inter) == ["outer/h"]
    with sowtel.scope("a/b"), sowtel.scope("c"):
        _, inter = save_intermediates(lambda x: sow(x, "h"))(X)
    assert list(inter) == ["a/b/c/h"]


def test_a_jitted_function_called_under_two_scopes_gets_both_names() -> None:
    inner = jax.jit(lambda x: jnp.sin(sow(x, "h")))

    def f(x):
        with sowtel.scope("first"):
            y = inner(x)
        with sowtel.scope("second"):
            return inner(y).sum()

    _, inter = save_intermediates(f)(X)
    assert list(inter) == ["first/h", "second/h"]
    np.testing.assert_allclose(inter["second/h"]["primal"], np.sin(np.asarray(X)), rtol=1e-6)
    with sowtel.enable(exporter="memory") as session:
        jax.jit(f)(X)
    assert sorted(r.name for r in _records(session)) == ["first/h", "second/h"]


@pytest.mark.parametrize(
    ("prefix", "message"),
    [("", "sowtel.scope prefix must be non-empty"), ("a//b", "empty segment"),
     ("/abs", "starts with '/'"), ("x y", "has the character(s) ' '"), (3, "must be a str"),
     ("..", "has a '..' segment")],
)
def test_bad_scope_prefixes(prefix: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        with sowtel.scope(prefix):  # type: ignore[arg-type]
            pass


# ---------------------------------------------------------------------------------------------
# Repeated names.


def _block(x):
    return jnp.tanh(sow(x * 1.5, "rep/act"))


def _three_blocks(x):
    for _ in range(3):
        x = _block(x)
    return jnp.sum(x ** 2)


def test_repeated_names_stream_numbered_like_capture() -> None:
    _, inter = save_intermediates(jax.grad(_three_blocks), duplicates="number")(X)
    names = ["rep/act_0", "rep/act_1", "rep/act_2"]
    assert list(inter) == names
    step = jax.jit(jax.grad(_three_blocks))
    with sowtel.enable(exporter="memory") as session:
        with pytest.warns(UserWarning, match=r"'rep/act' is used more than once.*cannot be "
                                             r"told apart"):
            for _ in range(5):
                step(X)
    records = _records(session)
    # Never merged: each occurrence is its own series with one point per step.
    for name in names:
        for mode in ("primal", "cotangent"):
            assert sorted(r.step for r in records if (r.name, r.mode) == (name, mode)) == [
                0, 1, 2, 3, 4]
    assert {r.name for r in records} == set(names)
    # Same numbers as capture, cotangents numbered as their primal.
    for (name, mode), record in _by_name_mode(records).items():
        value = np.asarray(inter[name][mode])
        np.testing.assert_allclose(record.stats["mean"], value.mean(), rtol=1e-5)
        np.testing.assert_allclose(record.stats["max"], value.max(), rtol=1e-5)
    # The cotangent of occurrence i, by hand: d/dh of sum(tanh(...)^2) through the later blocks.
    h0 = np.asarray(X) * 1.5
    h1 = np.tanh(h0) * 1.5
    h2 = np.tanh(h1) * 1.5
    ct2 = 2 * np.tanh(h2) * (1 - np.tanh(h2) ** 2)
    ct1 = ct2 * 1.5 * (1 - np.tanh(h1) ** 2)
    ct0 = ct1 * 1.5 * (1 - np.tanh(h0) ** 2)
    for name, ct in zip(names, (ct0, ct1, ct2), strict=True):
        np.testing.assert_allclose(inter[name]["cotangent"], ct, rtol=1e-5)


def test_repeated_name_warns_once_per_name() -> None:
    def twice(x):
        return sow(x, "warn/once").sum() + sow(x * 2, "warn/once").sum()

    with sowtel.enable(exporter="memory") as session:
        with pytest.warns(UserWarning, match="'warn/once' is used more than once"):
            jax.jit(twice)(X)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.jit(lambda x: twice(x) * 2)(X)  # another program, same name: no new warning
    assert sorted({r.name for r in _records(session)}) == ["warn/once_0", "warn/once_1"]


def test_a_name_in_both_branches_of_a_cond_is_one_site() -> None:
    def f(x, p):
        y = jax.lax.cond(p, lambda v: sow(v * 2.0, "br"), lambda v: sow(v * 3.0, "br"), x)
        return jnp.sum(y ** 2)

    for p, factor in ((True, 2.0), (False, 3.0)):
        _, inter = save_intermediates(jax.grad(f))(X, p)
        with sowtel.enable(exporter="memory") as session:
            jax.jit(jax.grad(f))(X, p)
        records = _by_name_mode(_records(session))
        assert set(records) == {("br", "primal"), ("br", "cotangent")} == {
            (n, m) for n in inter for m in inter[n]}
        np.testing.assert_allclose(records[("br", "primal")].stats["mean"],
                                   float(np.mean(np.asarray(X) * factor)), rtol=1e-5)
        np.testing.assert_allclose(records[("br", "cotangent")].stats["mean"],
                                   float(np.mean(2 * factor * np.asarray(X))), rtol=1e-5)


def test_a_jitted_function_called_several_times_streams_as_one_site() -> None:
    # Documented limitation: the inner function is compiled once, so its three calls share one
    # site; its records carry one name, three per step (capture, which runs each call, numbers).
    inner = jax.jit(lambda x: jnp.tanh(sow(x, "shared")))

    def f(x):
        return inner(inner(inner(x))).sum()

    _, inter = save_intermediates(f, duplicates="number")(X)
    assert list(inter) == ["shared_0", "shared_1", "shared_2"]
    with sowtel.enable(exporter="memory") as session:
        jax.jit(f)(X)
    records = _records(session)
    assert [r.name for r in records] == ["shared"] * 3
    np.testing.assert_allclose(sorted(r.stats["mean"] for r in records),
                               sorted(float(np.mean(v["primal"])) for v in inter.values()),
                               rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# One name rule for every path.

BAD_NAMES = ["../../etc/x", "/abs", "a b", "h[3]", "a//b", "<img src=x onerror=alert(1)>",
             "trailing\n"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_export_refuses_what_sow_and_log_refuse_with_the_same_error(name: str) -> None:
    with pytest.raises(ValueError) as sown:
        sow(X, name)
    rule = str(sown.value)  # "sow name ... has ...: <what is allowed>"
    with sowtel.enable(exporter="memory") as session:
        with pytest.raises(ValueError) as logged:
            sowtel.log({name: 1.0}, step=0)
        with pytest.raises(ValueError) as exported:
            sowtel.export({name: {"primal": np.ones(3, np.float32)}}, step=0)
        assert sowtel.flush()
        assert session.exporters[0].records == []  # nothing of them was handed over
    assert str(logged.value) == f"sowtel.log: {rule}"
    assert str(exported.value) == f"sowtel.export: {rule}"


CLASHING = {"a/b": np.float32(1.0), "a": {"b": np.float32(2.0)}, "k[0]": np.float32(3.0),
            "x y": np.float32(4.0), "..": np.float32(5.0), "%2F": np.float32(6.0)}
ESCAPED = {"v/a%2Fb": 1.0, "v/a/b": 2.0, "v/k%5B0%5D": 3.0, "v/x%20y": 4.0, "v/%2E%2E": 5.0,
           "v/%252F": 6.0}


@pytest.mark.parametrize("path", ["sowtel.jit", "callbacks", "export"])
def test_pytree_keys_give_one_valid_name_a_leaf(path: str) -> None:
    tree = jax.tree_util.tree_map(jnp.asarray, CLASHING)

    def f(t):
        return jax.tree_util.tree_reduce(lambda a, b: a + b, sow(t, "v"))

    captured = save_intermediates(f)(tree)[1] if path == "export" else None
    with sowtel.enable(exporter="memory") as session:
        if path == "sowtel.jit":
            sowtel.jit(f)(tree)
        elif path == "callbacks":
            jax.jit(f)(tree)
        else:
            sowtel.export(captured, step=0)
        records = _records(session)
    got = {r.name: r.stats["mean"] for r in records}
    # Every leaf its own name, each a valid one: "a/b" as a key is not the path a -> b.
    assert len(records) == len(ESCAPED) and got == ESCAPED
    for name in got:
        sowtel.naming.check_name(name.replace("%", "_"))


def test_a_key_like_an_index_makes_no_phantom_site_in_the_plugin(tmp_path) -> None:
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider
    from tensorboard.backend.event_processing import plugin_event_multiplexer as pem

    from sowtel.tensorboard_plugin import DEPTH_SUFFIX, NONFINITE_TAG, PLUGIN_NAME, parse_content
    from sowtel.tensorboard_plugin._run import RunIndex

    def f(x):
        return sow({"k[0]": x, "w": x * 2.0}, "blocks")["w"].sum()

    with sowtel.enable(exporter="tensorboard", logdir=tmp_path / "run"):
        for step in range(2):
            with sowtel.at_step(step):
                sowtel.jit(f)(X)
    # TensorBoard's own reader, as the plugin gets it.
    multiplexer = pem.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(tmp_path))
    ctx = context.RequestContext()
    index = RunIndex(provider, ctx, "", "run", PLUGIN_NAME, parse_content, DEPTH_SUFFIX,
                     NONFINITE_TAG)
    assert sorted(index.sites) == ["blocks/k%5B0%5D", "blocks/w"]
    assert all(not info.positions for info in index.sites.values())  # no scan index read


# ---------------------------------------------------------------------------------------------
# Validation whatever is enabled.

BAD_CALLS = {
    "non-array leaf": (lambda x: sow({"a": x, "b": "label"}, "t"),
                       r"sow 't': the leaf at \['b'\] is a str"),
    "bad name": (lambda x: sow(x, "a b"), r"sow name 'a b' has the character\(s\) ' '"),
    "bad tag": (lambda x: sow(x, "ok", tag=""), "sow tag must be a non-empty str"),
    "dot-dot segment": (lambda x: sow(x, "ok/../up"), "has a '..' segment"),
    "while cond": (lambda x: jax.lax.while_loop(lambda c: sow(c, "in_cond").sum() < 3.0,
                                                lambda c: c + 1.0, x),
                   "'in_cond' is inside a while_loop cond function"),
}


@pytest.mark.parametrize("state", ["disabled", "streaming", "capturing"])
@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_same_error_whatever_is_enabled(case: str, where: str, state: str) -> None:
    fn, message = BAD_CALLS[case]
    run = jax.jit(fn) if where == "jit" else fn
    with pytest.raises(ValueError, match=message):
        if state == "streaming":
            with sowtel.enable(exporter="memory"):
                run(X)
        elif state == "capturing":
            save_intermediates(run)(X)
        else:
            run(X)


def test_validation_keeps_the_disabled_program() -> None:
    # Validating binds nothing: the compiled program is the one without sows (byte for byte
    # after removing names), and the very object comes back.
    tree = {"a": X, "b": (X * 2, 3.0)}
    assert sow(tree, "t") is tree
    with_sows = jax.jit(lambda t: jax.tree.map(lambda v: v * 2, sow(t, "t"))).lower(tree)
    without = jax.jit(lambda t: jax.tree.map(lambda v: v * 2, t)).lower(tree)
    strip = lambda text: re.sub(r"(module @|func.func public @)\S+", "", text)  # noqa: E731
    assert strip(with_sows.as_text(dialect="hlo")) == strip(without.as_text(dialect="hlo"))
    assert "sow" not in with_sows.as_text()


# ---------------------------------------------------------------------------------------------
# Peer-suite regressions.


def _scan_sum(xs, eps=None):
    def body(c, x_e):
        x, e = x_e
        h = x * 2.0 + c
        h = sow(h, "h") if e is None else h + e
        return c + jnp.sin(h), None

    return jax.lax.scan(body, 0.0, (xs, eps))[0]


def test_scan_under_disable_jit_is_stacked() -> None:
    xs = jnp.array([0.1, 0.5, -0.3])
    with jax.disable_jit():
        grads, inter = save_intermediates(jax.grad(_scan_sum))(xs)
        _, numbered = save_intermediates(_scan_sum, duplicates="number")(xs)
    assert list(inter) == ["h"] and list(numbered) == ["h"]
    assert inter["h"].stacked == {"primal": (("scan", 3),), "cotangent": (("scan", 3),)}
    c, hs = 0.0, []
    for x in np.asarray(xs):
        hs.append(x * 2.0 + c)
        c = c + np.sin(hs[-1])
    np.testing.assert_allclose(inter["h"]["primal"], hs, rtol=1e-6)
    # Cotangent: the gradient with respect to an explicit zero perturbation of each h.
    expected = jax.grad(lambda e: _scan_sum(xs, e))(jnp.zeros(3))
    np.testing.assert_allclose(inter["h"]["cotangent"], expected, rtol=1e-5)
    np.testing.assert_allclose(grads, jax.grad(_scan_sum)(xs), rtol=1e-6)


W = jnp.array([1.0, -2.0, 0.5, 3.0])


def _dot(x, eps=None):
    return jnp.dot(sow(x, "x") if eps is None else x + eps, W)


def _nonlinear(x, eps=None):
    return jnp.sum(jnp.sin(sow(x, "x") if eps is None else x + eps) * W)


@pytest.mark.parametrize("fn", [_dot, _nonlinear], ids=["unbatched-cotangent", "batched"])
@pytest.mark.parametrize("wrap", ["vmap(grad)", "vmap(jit(grad))", "jit(vmap(grad))"])
def test_vmap_gives_the_derivative_the_primal_batch_axis(fn, wrap: str) -> None:
    xs = jnp.arange(12.0).reshape(3, 4) / 10
    g = jax.grad(fn)
    wrapped = {"vmap(grad)": jax.vmap(g), "vmap(jit(grad))": jax.vmap(jax.jit(g)),
               "jit(vmap(grad))": jax.jit(jax.vmap(g))}[wrap]
    _, inter = save_intermediates(wrapped)(xs)
    assert inter["x"]["primal"].shape == inter["x"]["cotangent"].shape == (3, 4)
    expected = jax.vmap(jax.grad(lambda x, e: fn(x, e), argnums=1))(xs, jnp.zeros((3, 4)))
    np.testing.assert_allclose(inter["x"]["cotangent"], expected, rtol=1e-6)
    with sowtel.enable(exporter="memory") as session:  # one record carries the whole batch
        jax.jit(wrapped)(xs)
    records = _by_name_mode(_records(session))
    assert records[("x", "cotangent")].shape == records[("x", "primal")].shape == (3, 4)
    np.testing.assert_allclose(records[("x", "cotangent")].stats["mean"],
                               float(np.mean(expected)), rtol=1e-5)


def test_vmap_gives_the_tangent_the_primal_batch_axis() -> None:
    xs = jnp.arange(12.0).reshape(3, 4) / 10
    t = jnp.array([1.0, 0.0, -1.0, 2.0])  # one tangent for the whole batch: unbatched
    _, inter = save_intermediates(jax.vmap(lambda x: jax.jvp(_dot, (x,), (t,))))(xs)
    assert inter["x"]["tangent"].shape == (3, 4)
    np.testing.assert_allclose(inter["x"]["tangent"], np.broadcast_to(t, (3, 4)))


def test_jacobians_keep_their_unbatched_shapes() -> None:
    x = jnp.array([0.2, -0.4, 0.6, 0.1])
    f = lambda x: jnp.sin(sow(x, "x")) * W  # noqa: E731
    _, rev = save_intermediates(jax.jacrev(f))(x)
    _, fwd = save_intermediates(jax.jacfwd(f))(x)
    assert rev["x"]["primal"].shape == (4,) and rev["x"]["cotangent"].shape == (4, 4)
    assert fwd["x"]["primal"].shape == (4,) and fwd["x"]["tangent"].shape == (4, 4)
    # Row i of the cotangents: the gradient of output i with respect to a perturbation of x.
    expected = jax.jacrev(lambda e: jnp.sin(x + e) * W)(jnp.zeros(4))
    np.testing.assert_allclose(rev["x"]["cotangent"], expected, rtol=1e-6)


@jax.custom_jvp
def _scaled_sin(x):
    return sow(jnp.sin(x), "inside")


@_scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), 10.0 * t  # deliberately not sin's derivative: the rule must be kept


def test_custom_jvp_under_an_outer_jvp_keeps_its_rule_and_is_captured() -> None:
    x, t = jnp.array([0.5, 1.0]), jnp.array([1.0, 2.0])
    wrapped = save_intermediates(_scaled_sin)
    (out, inter), (out_dot, inter_dot) = jax.jvp(wrapped, (x,), (t,))
    np.testing.assert_allclose(out, np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(out_dot, 10.0 * t, rtol=1e-6)  # the user's rule
    np.testing.assert_allclose(inter["inside"]["primal"], np.sin(x), rtol=1e-6)
    # The captured value's own derivative (it is sin(x), whatever the rule says).
    np.testing.assert_allclose(inter_dot["inside"]["primal"], np.cos(x) * t, rtol=1e-6)
    grads = jax.grad(lambda x: wrapped(x)[0].sum())(x)
    np.testing.assert_allclose(grads, jax.grad(lambda x: _scaled_sin(x).sum())(x), rtol=1e-6)
    # Not differentiated: captured once, the same value.
    out, inter = jax.jit(wrapped)(x)
    np.testing.assert_allclose(inter["inside"]["primal"], np.sin(x), rtol=1e-6)


def test_docstring_examples() -> None:
    import sowtel.naming

    result = doctest.testmod(sowtel.naming, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted >= 4
