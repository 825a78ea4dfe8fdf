"""``save_intermediates``: every sown value and derivative, returned as arrays.

``save_intermediates(fn)`` traces ``fn`` (with its ``grad``, ``jvp``, ``vmap``... applied inside)
to a jaxpr in which each sow is a ``sow_p`` equation marked for capture, then evaluates that
jaxpr again with each captured sow turned into an extra output. Inside control flow the extra
outputs are threaded through with the public API:

==================================  ===================================================
construct                           what ``intermediates[name][mode]`` holds
==================================  ===================================================
``lax.scan`` / ``fori_loop`` (static bounds) / ``lax.map``
                                    every iteration, stacked on a new leading axis
                                    (nested scans nest: ``[outer, inner, ...]``);
                                    ``lax.map(batch_size=b)``: one axis of ``len(xs)``
``lax.while_loop`` body             the last iteration's value (NaN / 0 if it never ran);
                                    its cotangent, where a backward pass runs the loop
                                    last iteration first, that value's
``lax.while_loop`` cond             not allowed: ``ValueError``
``lax.cond`` / ``lax.switch``       the taken branch's value; a site only in untaken
                                    branches is NaN (floating) or 0 (other dtypes);
                                    under ``vmap`` with a batched predicate, per row
``jax.checkpoint``                  the primal once (not per recomputation), each derivative once
``custom_jvp`` / ``custom_vjp``     sows in the primal / ``fwd``: primal;
                                    sows in ``bwd``: cotangent; both keep their rules where
                                    ``save_intermediates`` is differentiated from outside
``shard_map`` / ``pmap``            per-shard values stacked on a new leading axis of shards
``vmap`` (inside or outside)        the batch axis leading the value's own axes, after
                                    the stacked ones: ``vmap`` of a scan is ``(T, B, ...)``
a library's primitive               what its implementation runs, under these rules
(``custom_linear_solve``, ``cg``,   (``cg``'s matvec: its initial guess's, and its
``custom_root`` on JAX >= 0.12,     loop's last iteration's), primal only; differentiated
lineax, any ``jax.extend`` one)     inside, each rerun of its derivative rules is another
                                    occurrence (``duplicates="number"``: ``name_1``, ...)
==================================  ===================================================

Each site's ``{mode: value}`` dict records in ``stacked`` which leading axes scans and shard_maps
added (see :class:`Intermediates`).

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def f(x):
    ...     return (sowtel.sow(x * 3.0, "y") ** 2).sum()
    >>> grads, inter = sowtel.save_intermediates(jax.grad(f))(jnp.ones(2))
    >>> inter["y"]["primal"], inter["y"]["cotangent"]
    (Array([3., 3.], dtype=float32), Array([6., 6.], dtype=float32))
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sowtel import _interpret, naming
from sowtel import _jax_compat as jc
from sowtel.intermediates import nothing_captured
from sowtel.primitive import (
    CONTEXT,
    Context,
    check_tag,
    current_context,
    fill_like,
    sow_p,
    taken_rows,
)

__all__ = ["Intermediates", "TapPass", "eval_taps", "save_intermediates", "trace_flat"]


#: How a value was stacked: ``(("scan", length) | ("shard", count), ...)``, outermost first.
Stacking = tuple[tuple[str, int], ...]


class Intermediates(dict):  # type: ignore[type-arg]
    """A dict that keeps its insertion order through ``jit`` (plain dicts come back sorted).

    ``save_intermediates`` returns ``{name: {mode: value}}`` as nested ``Intermediates``, names
    in the order sites ran, modes as primal, tangent, cotangent, then compositions.

    A site's ``{mode: value}`` dict also says which leading axes of a value are not the value's
    own: ``stacked[mode]`` is ``(("scan", length) | ("shard", count), ...)``, outermost first,
    for each mode whose value a ``scan`` or a ``shard_map`` stacked (modes with nothing
    stacked are absent). :func:`sowtel.export` and :func:`sowtel.dump` use it to give one
    record per iteration and shard, as streaming does.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def f(xs):
        ...     return jax.lax.scan(lambda c, x: (c + sowtel.sow(x * 2.0, "h"), None), 0.0, xs)[0]
        >>> _, inter = sowtel.save_intermediates(f)(jnp.arange(3.0))
        >>> inter["h"]["primal"], inter["h"].stacked
        (Array([0., 2., 4.], dtype=float32), {'primal': (('scan', 3),)})
    """

    stacked: dict[str, Stacking]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stacked = {}

    def __repr__(self) -> str:
        return f"Intermediates({dict.__repr__(self)})"


def _flatten_intermediates(d: Intermediates) -> tuple[Any, tuple[Any, ...]]:
    keys = tuple(d)
    stacked = tuple(sorted(getattr(d, "stacked", {}).items()))
    return [(jax.tree_util.DictKey(k), d[k]) for k in keys], (keys, stacked)


def _unflatten_intermediates(aux: tuple[Any, ...], values: Any) -> Intermediates:
    keys, stacked = aux
    out = Intermediates(zip(keys, values, strict=True))
    out.stacked = dict(stacked)
    return out


jax.tree_util.register_pytree_with_keys(
    Intermediates, _flatten_intermediates, _unflatten_intermediates,
)

DUPLICATE_POLICIES = ("error", "number")


@dataclasses.dataclass
class _Captured:
    name: str
    mode: str
    treedef: Any
    leaves: list[Any]
    stacked: Stacking = ()
    site: Any = None  # the streaming site whose summary ``leaves`` are (summary passes)
    # The library primitive that ran this site again (a solver's derivative rules rebind it,
    # on the tangent or transposed system): another occurrence, see sowtel._interpret.
    rerun: str | None = None

    def stacked_in(self, kind: str, count: int) -> _Captured:
        return dataclasses.replace(self, stacked=((kind, count), *self.stacked))

    def with_leaves(self, leaves: list[Any]) -> _Captured:
        return dataclasses.replace(self, leaves=list(leaves))


def _flat(caps: list[_Captured]) -> list[Any]:
    return [leaf for c in caps for leaf in c.leaves]


def _unflat(meta: list[_Captured], flat: list[Any]) -> list[_Captured]:
    out, i = [], 0
    for c in meta:
        n = len(c.leaves)
        out.append(c.with_leaves(flat[i:i + n]))
        i += n
    return out


def _fill_like(aval: Any) -> Any:
    """NaN for floating (and complex) dtypes, 0 otherwise: a site whose code did not run; laid
    out as the value it stands for where that is on explicit mesh axes (a cond's branches must
    return the same types)."""
    value = fill_like(aval.shape, aval.dtype)
    sharding = jc.explicit_sharding_of(aval)
    return value if sharding is None else jax.sharding.reshard(value, sharding)


# ---------------------------------------------------------------------------------------------
# What a pass turns into extra outputs.


@dataclasses.dataclass
class SummaryPass:
    """A pass that returns streaming sites' summaries instead of captured values (``sowtel.jit``).

    ``reduce(params, leaves)`` runs where a streaming sow runs (per scan iteration, per shard,
    in its branch of a cond) and returns ``(site, arrays)``: the arrays to return for the site
    (its summary, and a flag that says it ran), or None to leave the site out. Sows the pass
    cannot express keep their host callback: those inside a ``while_loop`` body (whose
    iteration count is not static) or inside a primitive it has no rule for (a library's
    solver, see :mod:`sowtel._interpret`), and every other site of the same name (``fallback``),
    so that its occurrences are numbered as the callback transport numbers them. The pass
    notes that it met one in ``callbacks``, and tells ``stride`` the ``every=`` of each.
    """

    reduce: Callable[[dict[str, Any], list[Any]], tuple[Any, list[Any]] | None]
    in_while: int = 0
    callbacks: bool = False
    # The loops around the equation evaluated now, each (kind, length, reverse, entry cell):
    # see naming.program_loops and records.loop_entries. ``reduce`` gets them as "enclosing".
    loops: list[tuple[str, int, bool, list[int]]] = dataclasses.field(default_factory=list)
    # The names the program gives its sites that call back (settled once it is evaluated).
    names: naming.ProgramNames = dataclasses.field(default_factory=naming.ProgramNames)
    stride: Callable[[int], None] | None = None
    fallback: frozenset[str] = frozenset()

    def keep_callbacks(self, sites: Any) -> None:
        """Notes that these sows (their parameters) keep their host callbacks."""
        for p in sites:
            self.callbacks = True
            if self.stride is not None:
                self.stride(int(p["every"]))


#: ``_Captured.site`` of a streamed site a summary pass returns nothing for: it streams through
#: its host callback (in a ``while_loop`` body), or is not due at this step. Listed all the
#: same, so that ``sowtel.jit`` numbers the program's sites as the host callbacks do.
CALLS_BACK, NOT_DUE = "calls back", "not due"


@dataclasses.dataclass
class TapPass:
    """A pass that sows the outputs of chosen equations (``sowtel.tap``) as it re-binds a jaxpr.

    Equations are told apart by their path: the ``id`` of each equation evaluated around them,
    outermost first, then their own (a jaxpr evaluated from two places, as a jitted function
    called twice, gives two paths; a construct rule that traces a body twice, as the cond rule
    does, gives the same path twice). ``names[path]`` is the site name of the equation at
    ``path`` (absent: not a site); ``holding`` holds the paths of constructs whose bodies hold
    a site, the only ones whose construct rules run (every other equation is bound as it is,
    the user's own sows included). ``sow(outputs, name)`` sows them and returns what to use;
    ``placed`` collects the names sown, so that a site planned but never met is an error.
    """

    names: dict[tuple[int, ...], str]
    holding: set[tuple[int, ...]]
    sow: Callable[[list[Any], str], list[Any]]
    path: list[int] = dataclasses.field(default_factory=list)
    placed: set[str] = dataclasses.field(default_factory=set)  # the names sown so far

    def holds(self) -> bool:
        """Whether the equation evaluated now is a construct whose body holds a site."""
        return tuple(self.path) in self.holding

    def after(self, outs: list[Any]) -> list[Any]:
        """The outputs of the equation evaluated now, sown if it is a site."""
        name = self.names.get(tuple(self.path))
        if name is None:
            return outs
        self.placed.add(name)
        return self.sow(outs, name)


@dataclasses.dataclass
class Pass:
    """One evaluation of a jaxpr: which pass runs, given to the evaluator and every rule.

    ``tag``: the tag ``save_intermediates`` captures (None in a summary or tap pass);
    ``summary`` / ``tap``: the summary pass of ``sowtel.jit`` or the tap pass of ``sowtel.tap``;
    ``reruns``: what the library primitives of the pass ran (see sowtel._interpret);
    ``transposed``: how many transposed equations (a backward pass) enclose the one evaluated.
    A pass is passed explicitly: one started while another is evaluated (a trace inside a
    rule) is its own.
    """

    tag: str | None = None
    summary: SummaryPass | None = None
    tap: TapPass | None = None
    reruns: _interpret.Reruns = dataclasses.field(default_factory=_interpret.Reruns)
    transposed: int = 0

    def eval(self, jaxpr: Any, consts: Any, args: Any) -> tuple[list[Any], list[_Captured]]:
        """Evaluates ``jaxpr`` in this pass: its outputs and the captured sows, in trace order."""
        return _eval(self, jaxpr, consts, args)

    def eval_body(self, body: tuple[Any, list[Any]],
                  args: Any) -> tuple[list[Any], list[_Captured]]:
        """:meth:`eval` of a ``(jaxpr, consts)`` pair, as ``_jax_compat`` gives a body."""
        return _eval(self, body[0], body[1], args)

    def wanted(self, params: dict[str, Any]) -> bool:
        """Whether this pass turns the sow of these parameters into outputs."""
        return _wanted(params, summaries=self.summary is not None)

    def has_capture(self, jaxpr: Any) -> bool:
        """Whether ``jaxpr`` holds a sow this pass wants."""
        return _has_wanted(jaxpr, self.summary is not None)


def eval_capture(jaxpr: Any, consts: list[Any], args: list[Any],
                 tag: str) -> tuple[list[Any], list[_Captured]]:
    """Evaluates ``jaxpr`` with the sows captured for ``tag`` turned into extra outputs."""
    return Pass(tag=tag).eval(jaxpr, consts, args)


def eval_taps(jaxpr: Any, consts: list[Any], args: list[Any], tap_pass: TapPass) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` (values or tracers of the trace calling it), sowing the
    outputs of the equations ``tap_pass`` names (``sowtel.tap``): everything else is bound as
    it was traced, so the sows go through the transformations around the call."""
    return Pass(tap=tap_pass).eval(jaxpr, consts, args)[0]


def eval_summaries(jaxpr: Any, consts: list[Any], args: list[Any],
                   summary_pass: SummaryPass) -> tuple[list[Any], list[_Captured]]:
    """Evaluates ``jaxpr`` with its streaming sows turned into summary outputs (``sowtel.jit``).

    Returns the jaxpr's outputs and, per site that ran the reduction, a ``_Captured`` whose
    ``leaves`` are the arrays ``summary_pass.reduce`` gave (stacked over scans and shards, filled
    with NaN / 0 in the branches not taken) and whose ``site`` is the streaming site.
    """
    streams = functools.partial(_wanted, summaries=True)
    summary_pass.fallback = frozenset(
        p["site"].name for p in _interpret.fallback_sites(jaxpr, streams))
    return Pass(summary=summary_pass).eval(jaxpr, consts, args)


def _wanted(params: dict[str, Any], summaries: bool) -> bool:
    if params["recompute"]:
        return False
    return params["stream"] is not None if summaries else bool(params["capture"])


# ---------------------------------------------------------------------------------------------
# Which jaxprs hold a captured sow.


@functools.lru_cache(maxsize=4096)
def _has_wanted(jaxpr: Any, summaries: bool) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            if _wanted(eqn.params, summaries):
                return True
        elif _interpret.hides_sows(eqn) or any(_has_wanted(j, summaries)
                                               for j in jc.sub_jaxprs(eqn)):
            return True
    return False


def _first_capture_name(st: Pass, jaxpr: Any) -> str:
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p and st.wanted(eqn.params):
            return eqn.params["site"].name
        for j in jc.sub_jaxprs(eqn):
            if st.has_capture(j):
                return _first_capture_name(st, j)
    return "?"


# ---------------------------------------------------------------------------------------------
# The evaluator: runs a jaxpr, returning its outputs and the captured sows, in trace order.


def _eval(st: Pass, jaxpr: Any, consts: Any, args: Any) -> tuple[list[Any], list[_Captured]]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jc.core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    captured: list[_Captured] = []
    tap = st.tap
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        transposed = jc.eqn_transposed(eqn)
        st.transposed += transposed
        if tap is not None:
            tap.path.append(id(eqn))
        try:
            # Re-bound in the backward pass where JAX's made it: the lowering of what is bound
            # as it is (a library's primitive) tells a recomputation by that (see _eval_sow).
            with (jc.backward_pass_names() if transposed else contextlib.nullcontext()), \
                    jc.eqn_context(eqn):
                outs, caps = _eval_eqn(st, eqn, invals)
                if tap is not None:
                    outs = tap.after(outs)
        finally:
            st.transposed -= transposed
            if tap is not None:
                tap.path.pop()
        captured.extend(caps)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars], captured


def _bind_plain(eqn: Any, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval_eqn(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    prim = eqn.primitive
    tap = st.tap
    if tap is not None:
        # sowtel.tap: a construct holding a site runs its rule (its body evaluated, so the site
        # is sown inside it); everything else, a sow included, is bound as it was traced.
        if not tap.holds():
            return _bind_plain(eqn, invals), []
        if jc.construct(eqn) in ("custom_jvp", "custom_vjp"):
            return _tap_custom_rule(st, eqn, invals)
        rule = _RULES.get(jc.construct(eqn) or "")
        return (_tap_library_rule if rule is None else rule)(st, eqn, invals)
    if prim is sow_p:
        return _eval_sow(st, eqn, invals)
    subs = jc.sub_jaxprs(eqn)
    if not any(st.has_capture(j) for j in subs):
        if _interpret.hides_sows(eqn):
            return _library_rule(st, eqn, invals)
        if jc.construct(eqn) == "custom_jvp" and st.tag is not None:
            # Its rule may sow: checked if save_intermediates is differentiated from outside.
            return _custom_jvp_rule(st, eqn, invals)
        return _bind_plain(eqn, invals), []
    rule = _RULES.get(jc.construct(eqn) or "")
    if rule is None:
        return _library_rule(st, eqn, invals)
    return rule(st, eqn, invals)


def _tap_custom_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """``sowtel.tap`` inside a ``custom_jvp`` / ``custom_vjp`` function: the outputs keep the
    function's rules (it is bound as it is); its sites are those of its function run again on
    the same operands, where no derivative reaches them (the rules define none for values
    inside the function: a derivative there would be a zero, not the value's), so they are
    primal sites under every transformation, as a sow there is."""
    outs = _bind_plain(eqn, invals)
    st.eval(*jc.call_body(eqn), [jax.lax.stop_gradient(x) for x in invals])
    return outs, []


def _tap_library_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """``sowtel.tap`` inside a library's primitive (``custom_linear_solve``, which ``cg`` and
    ``jnp.linalg.solve`` use): bound with each of the functions it holds as closed jaxprs
    evaluated again by the tap pass, so its sites are sown inside it, and run each time the
    primitive and its derivative rules run them (as a sow written there does)."""
    def retapped(closed: Any) -> Any:
        jaxpr, consts = jc.jaxpr_and_consts(closed)

        def body(*args: Any) -> list[Any]:
            return st.eval(jaxpr, consts, list(args))[0]

        shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                       weak_type=getattr(v.aval, "weak_type", False))
                  for v in jaxpr.invars]
        return jax.make_jaxpr(body)(*shapes)

    params = eqn.primitive.get_bind_params(jc.replace_closed_jaxprs(eqn, retapped))
    out = eqn.primitive.bind(*invals, **params)
    return (list(out) if eqn.primitive.multiple_results else [out]), []


def _library_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """A primitive with no construct rule (a library's solver, see :mod:`sowtel._interpret`):
    ``sowtel.jit`` binds it as it is, its sites keeping their host callbacks; capture evaluates
    what it runs."""
    summary_pass = st.summary
    if summary_pass is None:
        return _interpret.library_rule(eqn, invals, tag=st.tag, wanted=st.wanted,
                                       evaluate=st.eval, bind=_bind_plain, reruns=st.reruns)
    summary_pass.keep_callbacks(_interpret.sites_of(eqn, st.wanted))
    summary_pass.callbacks = True  # hidden sows too, where their jaxpr cannot be read
    return _bind_plain(eqn, invals), []


def _recomputed_in_backward_pass(st: Pass, p: dict[str, Any]) -> bool:
    """A primal site (or a tangent of one, under ``jvp`` of ``grad``) evaluated in the
    backward pass is forward code run again there: a
    ``custom_vjp`` bwd re-evaluating a jaxpr traced in the forward pass, a solver's transposed
    solve running the user's function. It is silent, as ``jax.checkpoint``'s recomputation is
    (the lowering applies the same rule to the callback transport)."""
    return naming.forward_mode(p["mode"]) and st.transposed > 0


def _eval_sow(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    p = eqn.params
    site = p["site"]
    n = len(invals) - len(site.extras)
    outs = invals[:n]
    if _recomputed_in_backward_pass(st, p):
        return list(outs), []
    summary_pass = st.summary
    if summary_pass is not None:
        return _summarise_sow(summary_pass, p, invals, n)
    if p["stream"] is not None and not p["recompute"]:
        outs = sow_p.bind(*invals, **{**p, "capture": False})  # keeps streaming live
    if not p["capture"] or p["recompute"]:
        return list(outs), []
    captured = taken_rows(list(outs), site, list(invals[n:]))
    return list(outs), [_Captured(site.name, p["mode"], site.treedef, captured, site=site)]


def _summarise_sow(summary_pass: SummaryPass, p: dict[str, Any], invals: list[Any],
                   n: int) -> tuple[list[Any], list[_Captured]]:
    site, leaves = p["site"], list(invals[:n])
    if not _wanted(p, summaries=True):
        return leaves, []
    if summary_pass.in_while or site.name in summary_pass.fallback:
        # The host callback in this program (the call's step comes from the host side).
        summary_pass.keep_callbacks([p])
        return list(sow_p.bind(*invals, **{**p, "capture": False})), []
    here = dataclasses.replace(site, loops=naming.program_loops(summary_pass.loops))
    reduced = summary_pass.reduce({**p, "site": here, "enclosing": tuple(summary_pass.loops)},
                                  taken_rows(leaves, site, list(invals[n:])))
    if reduced is None:
        return leaves, [_Captured(site.name, p["mode"], None, [], site=NOT_DUE)]
    stream_site, arrays = reduced
    return leaves, [_Captured(site.name, p["mode"], None, list(arrays), site=stream_site)]


@contextlib.contextmanager
def _in_loop(st: Pass, kind: str, length: int = 0, reverse: bool = False) -> Iterator[None]:
    """Notes, for the summary pass, that the equations evaluated inside sit in this loop."""
    summary_pass = st.summary
    if summary_pass is None:
        yield
        return
    summary_pass.loops.append((kind, length, reverse, []))
    try:
        yield
    finally:
        summary_pass.loops.pop()


def _call_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    return st.eval(*jc.call_body(eqn), invals)


def _custom_jvp_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """Captures inside a ``custom_jvp`` function, keeping its rule for transformations outside.

    Where ``save_intermediates`` is itself differentiated, JAX runs the function's jvp rule
    instead of the function: the outputs then come from the user's rule, the captured values
    from running the function, with their own derivatives. A sow in the rule itself (not in
    the function it may call) then raises: the rule runs after the intermediates are returned.
    """
    inline = _call_rule
    meta: list[_Captured] = []
    tag = st.tag

    def captures(*args: Any) -> list[Any]:
        _, caps = inline(st, eqn, list(args))
        meta[:] = caps
        return _flat(caps)

    @jax.custom_jvp
    def fun(*args: Any) -> tuple[list[Any], list[Any]]:
        outs, caps = inline(st, eqn, list(args))
        meta[:] = caps
        return outs, _flat(caps)

    def plain(*args: Any) -> list[Any]:
        return _bind_plain(eqn, list(args))

    @fun.defjvp
    def fun_jvp(primals: Any, tangents: Any) -> tuple[Any, Any]:
        if tag is not None:
            _check_rule_sows(lambda p, t: jax.jvp(plain, p, t), (primals, tangents), tag,
                             {c.name for c in meta}, "jvp rule of a custom_jvp function")
        outs, outs_dot = jax.jvp(plain, primals, tangents)
        flat, flat_dot = jax.jvp(captures, primals, tangents)
        return (outs, flat), (outs_dot, flat_dot)

    outs, flat = fun(*invals)
    return list(outs), _unflat(meta, flat)


def _sow_names(jaxpr: Any) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p and eqn.params["capture"]:
            names.append(eqn.params["site"].name)
        for sub in jc.sub_jaxprs(eqn):
            names.extend(_sow_names(sub))
    return names


def _check_rule_sows(rule: Callable[..., Any], args: tuple[Any, ...], tag: str,
                     captured: set[str], where: str) -> None:
    """Raises if a custom rule sows for ``tag`` (other than by calling its function, whose
    sites are ``captured``): traced once, where ``save_intermediates`` is differentiated from
    outside, so runs the rule after it has returned its intermediates."""
    ctx = current_context() or Context()
    with CONTEXT(Context(stream=ctx.stream, capture=tag)):
        closed = jax.make_jaxpr(rule)(*args)
    lost = [n for n in _sow_names(jc.jaxpr_and_consts(closed)[0]) if n not in captured]
    if lost:
        raise ValueError(
            f"sow {lost[0]!r} is in the {where}, which runs here only because "
            "save_intermediates is itself differentiated from outside (jax.jvp or jax.grad of "
            "the function it returns): the rule runs after the intermediates are returned, so "
            "its values cannot be captured, and sowtel never drops them silently. "
            "Differentiate inside instead, e.g. "
            "save_intermediates(lambda x, t: jax.jvp(f, (x,), (t,))), or sow outside the rule."
        )


def _add_cotangents(a: Any, b: Any) -> Any:
    if getattr(a, "dtype", None) == jax.dtypes.float0:
        return a  # an integer input: no cotangent
    return a + b


def _custom_vjp_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """Captures inside a ``custom_vjp`` function, keeping its rule for transformations outside.

    Where ``save_intermediates`` is itself differentiated (``jax.grad`` of a function that calls
    it), the outputs' cotangents go through the user's ``fwd`` / ``bwd``, as without sowtel;
    the captured values' own cotangents (when a caller differentiates them) through the
    function that computed them.
    """
    meta: list[_Captured] = []
    tag = st.tag

    def captures(*args: Any) -> list[Any]:
        _, caps = _call_rule(st, eqn, list(args))
        meta[:] = caps
        return _flat(caps)

    @jax.custom_vjp
    def fun(*args: Any) -> tuple[list[Any], list[Any]]:
        outs, caps = _call_rule(st, eqn, list(args))
        meta[:] = caps
        return outs, _flat(caps)

    def fun_fwd(*args: Any) -> tuple[Any, Any]:
        outs, outs_vjp = jax.vjp(lambda *a: _bind_plain(eqn, list(a)), *args)
        flat, flat_vjp = jax.vjp(captures, *args)
        return (outs, flat), (outs_vjp, flat_vjp)

    def fun_bwd(res: Any, cts: Any) -> tuple[Any, ...]:
        (outs_vjp, flat_vjp), (ct_outs, ct_flat) = res, cts
        if tag is not None:
            _check_rule_sows(outs_vjp, (ct_outs,), tag, set(),
                             "bwd of a custom_vjp function")
        return tuple(map(_add_cotangents, outs_vjp(ct_outs), flat_vjp(ct_flat)))

    fun.defvjp(fun_fwd, fun_bwd)
    outs, flat = fun(*invals)
    return list(outs), _unflat(meta, flat)


def _remat_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    p = jc.loop_parts(eqn)
    meta: list[_Captured] = []

    def body(*args: Any) -> tuple[list[Any], list[Any]]:
        outs, caps = st.eval_body(p["body"], args)
        meta[:] = caps
        return outs, _flat(caps)

    fn = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])
    outs, flat = fn(*invals)
    return list(outs), _unflat(meta, flat)


def _scan_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    p = jc.loop_parts(eqn)
    jaxpr, jconsts = p["body"]
    n_consts, n_carry = p["n_consts"], p["n_carry"]
    consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[
        n_consts + n_carry:]
    meta: list[_Captured] = []

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
        outs, caps = st.eval(jaxpr, jconsts, [*consts, *carry, *x])
        meta[:] = caps
        return outs[:n_carry], (outs[n_carry:], _flat(caps))

    with _in_loop(st, "scan", p["length"], p["reverse"]):
        carry, (ys, flat) = jax.lax.scan(
            body, list(init), list(xs), length=p["length"], reverse=p["reverse"],
            unroll=p["unroll"])
    return [*carry, *ys], [c.stacked_in("scan", p["length"]) for c in _unflat(meta, flat)]


def _scan3_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    """A ``jax_scan3`` loop: its body reads and writes its carry through references, which it
    closes over (non-extensive operands); extensive operands are sliced per iteration."""
    p = jc.loop_parts(eqn)
    jaxpr, jconsts = p["body"]
    extensive = list(p["extensives"])
    xs = [a for a, e in zip(invals, extensive, strict=True) if e]
    meta: list[_Captured] = []

    def body(x: list[Any]) -> tuple[list[Any], list[Any]]:
        it = iter(x)
        args = [next(it) if e else a for a, e in zip(invals, extensive, strict=True)]
        outs, caps = st.eval(jaxpr, jconsts, args)
        meta[:] = caps
        return outs, _flat(caps)

    with _in_loop(st, "scan", p["length"], p["reverse"]):
        ys, flat = jc.scan3_over(body, xs, length=p["length"], reverse=p["reverse"],
                                 unroll=p["unroll"])
    return list(ys), [c.stacked_in("scan", p["length"]) for c in _unflat(meta, flat)]


def _while_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    p = jc.loop_parts(eqn)
    cond, body = p["cond"], p["body"]
    if st.has_capture(cond[0]):
        raise ValueError(
            f"sow {_first_capture_name(st, cond[0])!r} is inside a while_loop cond function: it "
            "can never be captured there; sow it in the body instead"
        )
    nc, nb = p["n_cond_consts"], p["n_body_consts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    meta: list[_Captured] = []

    def body_fn(state: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        carry, kept = state
        outs, caps = st.eval_body(body, [*body_consts, *carry])
        meta[:] = caps
        flat = _flat(caps)
        if kept:
            # A site's value is its last forward iteration's. A loop that runs in a backward
            # pass (a checkpointed while_loop's bwd, as Equinox's) runs the iterations last
            # first: there the last forward iteration's cotangent is the first one it computes
            # (its iterations that recompute forward code fill the site, as an untaken branch
            # does: NaN, or 0 for other dtypes; those are skipped).
            first = [naming.runs_backward(c.mode) for c in caps for _ in c.leaves]
            flat = [jnp.where(jnp.all(_is_fill(old)), new, old) if keep_first else new
                    for new, old, keep_first in zip(flat, kept, first, strict=True)]
        return outs, flat

    def cond_fn(state: tuple[list[Any], list[Any]]) -> Any:
        pred = st.eval_body(cond, [*cond_consts, *state[0]])[0][0]
        # vmap of a loop whose predicate it batched: the body selects the rows still running,
        # and the loop runs while any does (as JAX lowers it).
        return jnp.any(pred) if jnp.ndim(pred) else pred

    summary_pass = st.summary
    if summary_pass is not None:
        summary_pass.in_while += 1
    try:
        with _in_loop(st, "while"):
            shapes = jax.eval_shape(body_fn, (list(init), []))[1]
            state = jax.lax.while_loop(cond_fn, body_fn,
                                       (list(init), [_fill_like(s) for s in shapes]))
    finally:
        if summary_pass is not None:
            summary_pass.in_while -= 1
    return list(state[0]), _unflat(meta, state[1])


def _is_fill(x: Any) -> Any:
    """Where ``x`` holds :func:`_fill_like`'s value (a site whose code did not run)."""
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x == 0


def _cond_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    branches = jc.loop_parts(eqn)["branches"]
    index, operands = invals[0], invals[1:]
    metas: list[list[_Captured]] = [[] for _ in branches]

    def make(i: int) -> Callable[..., Any]:
        def branch(*ops: Any) -> tuple[list[Any], list[Any]]:
            outs, caps = st.eval_body(branches[i], ops)
            metas[i][:] = caps
            return outs, _flat(caps)

        return branch

    fns = [make(i) for i in range(len(branches))]
    # Union of the branches' sites by (name, mode, occurrence), in order of first appearance.
    union: collections.OrderedDict[tuple[str, str, int], tuple[_Captured, list[Any]]] = (
        collections.OrderedDict())
    per_branch_keys: list[list[tuple[str, str, int]]] = []
    for i, fn in enumerate(fns):
        flat_shapes = jax.eval_shape(fn, *operands)[1]
        caps = _unflat(metas[i], flat_shapes)
        slots = naming.occurrence_slots([(c.name, c.mode) for c in caps])
        keys = []
        for c, slot in zip(caps, slots, strict=True):
            k = (c.name, c.mode, slot)
            keys.append(k)
            if k in union:
                prev_shapes = [(s.shape, s.dtype) for s in union[k][1]]
                if prev_shapes != [(s.shape, s.dtype) for s in c.leaves]:
                    raise ValueError(
                        f"sow {c.name!r} ({c.mode}) has different shapes or dtypes in the "
                        f"branches of a cond/switch ({prev_shapes} vs "
                        f"{[(s.shape, s.dtype) for s in c.leaves]}): give the sites distinct names"
                    )
            else:
                union[k] = (c, list(c.leaves))
        per_branch_keys.append(keys)

    def widen(i: int) -> Callable[..., Any]:
        def branch(*ops: Any) -> tuple[list[Any], list[Any]]:
            outs, flat = fns[i](*ops)
            mine = dict(zip(per_branch_keys[i], _unflat(metas[i], flat), strict=True))
            full = []
            for k, (_, shapes) in union.items():
                full.extend(mine[k].leaves if k in mine else [_fill_like(s) for s in shapes])
            return outs, full

        return branch

    outs, flat = jax.lax.switch(index, [widen(i) for i in range(len(branches))], *operands)
    meta = [c for c, _ in union.values()]
    return list(outs), _unflat(meta, flat)


def _shard_map_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[_Captured]]:
    p = jc.loop_parts(eqn)
    mesh = p["mesh"]
    manual = tuple(a for a in mesh.axis_names if a in p["manual"])
    meta: list[_Captured] = []

    def inner(*args: Any) -> tuple[tuple[Any, ...], list[Any]]:
        outs, caps = st.eval_body(p["body"], args)
        meta[:] = caps
        return tuple(outs), [jnp.expand_dims(leaf, 0) for leaf in _flat(caps)]

    fn = jax.shard_map(
        inner, mesh=mesh, in_specs=tuple(p["in_specs"]),
        out_specs=(tuple(p["out_specs"]), PartitionSpec(manual)),
        axis_names=set(p["manual"]), check_vma=p["check_vma"],
    )
    outs, flat = fn(*invals)
    shards = int(np.prod([mesh.shape[a] for a in manual]))
    return list(outs), [c.stacked_in("shard", shards) for c in _unflat(meta, flat)]


# By construct (``_jax_compat.construct`` maps JAX's primitive names to these).
_RULES: dict[str, Callable[[Pass, Any, list[Any]], tuple[list[Any], list[_Captured]]]] = {
    "call": _call_rule,
    "custom_jvp": _custom_jvp_rule,
    "custom_vjp": _custom_vjp_rule,
    "checkpoint": _remat_rule,
    "scan": _scan_rule,
    "scan3": _scan3_rule,
    "while": _while_rule,
    "cond": _cond_rule,
    "shard_map": _shard_map_rule,
}


# ---------------------------------------------------------------------------------------------
# Assembling {name: {mode: value}}.


def _mode_rank(mode: str) -> tuple[int, int, str]:
    base = {"primal": 0, "tangent": 1, "cotangent": 2}
    parts = mode.split(".")
    return (len(parts), base.get(parts[0], 3), mode)


def _join_maps(caps: list[_Captured]) -> list[_Captured]:
    """Gives a site in ``lax.map(f, xs, batch_size=b)`` one axis of the map's length ``n``.

    ``lax.map`` runs ``vmap(f)`` in a scan over ``n // b`` batches, then once more on the
    ``n % b`` left: the site is captured as a scan-stacked ``(n // b, ..., b, ...)`` and, with a
    remainder, a second ``(..., n % b, ...)``. Both become one ``(n, ...)``, stacked as a scan
    of length ``n`` where the map's scan was, as an unbatched ``lax.map`` gives it.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, c in enumerate(caps):
        mapped = getattr(c.site, "mapped", None)
        if mapped is not None:
            groups.setdefault((mapped[0], c.name, c.mode), []).append(i)
    dropped: set[int] = set()
    out = list(caps)
    for members in groups.values():
        # One map call gives its batches' site and, when b does not divide n, its remainder's,
        # next to each other (in either order: a backward pass runs them reversed); a jitted
        # function holding the map, called k times, gives k of those.
        _, n, b, *_ = caps[members[0]].site.mapped
        size = 2 if n % b else 1
        calls = [members[start:start + size] for start in range(0, len(members), size)]
        if any(sorted(caps[i].site.mapped[3] for i in call) != [False, True][:size]
               for call in calls):
            continue
        for call in calls:
            main, *rest = sorted(call, key=lambda i: caps[i].site.mapped[3])
            _join_map_call(caps, out, dropped, main, *rest)
    return [c for i, c in enumerate(out) if i not in dropped]


def _join_map_call(caps: list[_Captured], out: list[_Captured], dropped: set[int], main: int,
                   rest: int | None = None) -> None:
    """Joins one ``lax.map`` call's batches' site ``caps[main]`` and its remainder's
    ``caps[rest]`` into ``out[main]`` (see :func:`_join_maps`)."""
    c = caps[main]
    _, n, _, _, outer, _, _ = c.site.mapped
    scans = [k for k, (kind, _) in enumerate(c.stacked) if kind == "scan"]
    axis = _map_axis(c)
    if len(scans) <= outer or axis is None:
        return
    k = scans[outer]  # the map's scan among the axes stacked around the site
    # The map's vmap axis joins the scan's.
    moved = [jnp.moveaxis(leaf, axis, k + 1) for leaf in c.leaves]
    leaves = [x.reshape(*x.shape[:k], -1, *x.shape[k + 2:]) for x in moved]
    if rest is not None:
        r = caps[rest]
        r_axis = _map_axis(r)
        if r_axis is None:
            return
        tails = [jnp.moveaxis(leaf, r_axis, k) for leaf in r.leaves]
        leaves = [jnp.concatenate([a, b], axis=k)
                  for a, b in zip(leaves, tails, strict=True)]
        dropped.add(rest)
    stacked = (*c.stacked[:k], ("scan", n), *c.stacked[k + 1:])
    out[main] = dataclasses.replace(c, leaves=leaves, stacked=stacked)


def _map_axis(c: _Captured) -> int | None:
    """Where the axis of ``lax.map``'s own ``vmap`` lies in a captured site's leaves.

    After the stacked axes come the batch axes, the last vmap applied first: those of vmaps
    around the map, then the map's, then those inside it (their number counted when sown);
    None where the leaves have fewer batch axes than that (a vmap that batched nothing).
    """
    _, _, _, _, _, inside, ndim = c.site.mapped
    around = c.leaves[0].ndim - len(c.stacked) - ndim - inside
    return None if around < 0 else len(c.stacked) + around


def _join_branches(caps: list[_Captured]) -> list[_Captured]:
    """Joins a name's sites in sibling branches of a ``vmap``-ped cond into one site.

    With a batched predicate JAX runs every branch on every row, so each branch's site was
    captured with the rows that did not take it filled (NaN / 0, see
    :func:`sowtel.primitive.taken_rows`). A row takes one branch: where the first site holds a
    fill, the other holds the row's value or a fill too, so one ``where`` joins them.
    """
    keyed = [(i, c) for i, c in enumerate(caps) if getattr(c.site, "branch", None) is not None]
    if not keyed:
        return caps
    slots: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    first: dict[tuple[Any, ...], int] = {}
    joined = list(caps)
    dropped: set[int] = set()
    for i, c in keyed:
        cond, branch = c.site.branch
        seen = slots.setdefault((cond, branch), [])
        seen.append((c.name, c.mode))
        key = (cond, c.name, c.mode, naming.occurrence_slots(seen)[-1])
        if key not in first:
            first[key] = i
            continue
        j = first[key]
        kept = joined[j]
        if [(x.shape, x.dtype) for x in kept.leaves] != [(x.shape, x.dtype) for x in c.leaves]:
            raise ValueError(
                f"sow {c.name!r} ({c.mode}) has different shapes or dtypes in the branches of "
                "a cond/switch: give the sites distinct names")
        leaves = [jnp.where(jnp.isnan(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a == 0,
                            b, a) for a, b in zip(kept.leaves, c.leaves, strict=True)]
        joined[j] = kept.with_leaves(leaves)
        dropped.add(i)
    return [c for i, c in enumerate(joined) if i not in dropped]


def _assemble(caps: list[_Captured], duplicates: str) -> dict[str, dict[str, Any]]:
    caps = _join_maps(_join_branches(caps))
    final = naming.occurrence_names([(c.name, c.mode) for c in caps])
    by_key: collections.OrderedDict[tuple[str, str], list[tuple[str, _Captured]]] = (
        collections.OrderedDict())
    for c, key in zip(caps, final, strict=True):
        by_key.setdefault((c.name, c.mode), []).append((key, c))
    names: list[str] = []
    for c in caps:
        if c.name not in names:
            names.append(c.name)
    result: Intermediates = Intermediates()
    for name in names:
        modes = sorted(((m, group) for (n, m), group in by_key.items() if n == name),
                       key=lambda item: _mode_rank(item[0]))
        repeated = any(len(group) > 1 for _, group in modes)
        if repeated and duplicates == "error":
            count = max(len(group) for _, group in modes)
            again = next((c for _, group in modes for _, c in group if c.rerun), None)
            if again is not None:
                raise ValueError(
                    f"sow {name!r} ({again.mode}) runs again in a second {again.rerun!r} "
                    "primitive that runs the functions of an earlier one: the derivative rules "
                    "of a solver (the implicit-function theorem) run them again, on the "
                    "solution and on the tangent or transposed system, so the site has "
                    f"{count} occurrences, each the value of one run. Pass "
                    "save_intermediates(..., duplicates='number') to capture every run as "
                    f"{name}_0, {name}_1, ... (the names streaming gives them), capture the "
                    "solver undifferentiated (save_intermediates(f), not "
                    "save_intermediates(jax.grad(f))), or sow a value computed outside the "
                    "solver's functions (its solution, or a residual after it).")
            raise ValueError(
                f"sow name {name!r} is used {count} times; names must be unique under "
                "duplicates='error': rename the sites, or pass "
                "save_intermediates(..., duplicates='number') to get "
                f"{name}_0, {name}_1, ..."
            )
        for mode, group in modes:
            # Occurrence order (a backward mode's sites ran last-first): name_0 first.
            for key, c in (reversed(group) if naming.runs_backward(mode) else group):
                value = jax.tree_util.tree_unflatten(c.treedef, c.leaves)
                site = result.setdefault(key, Intermediates())
                site[mode] = value
                if c.stacked:
                    site.stacked[mode] = c.stacked
    return result


# ---------------------------------------------------------------------------------------------
# The public wrapper.


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "aval")


def over_dynamic(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 dynamic: Callable[[Any], bool] = _is_dynamic
                 ) -> tuple[list[Any], list[int], Callable[..., Any]]:
    """``fn(*args, **kwargs)`` as a function of its dynamic leaves (those ``dynamic`` holds
    for; others act static): returns those leaves, their positions among the leaves of
    ``(args, kwargs)``, and the function taking them positionally."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if dynamic(x)]

    def merged(*d: Any) -> Any:
        full = list(leaves)
        for i, x in zip(positions, d, strict=True):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    return [leaves[i] for i in positions], positions, merged


class _StaticKey:
    """Hashable wrapper of static leaves; falls back to identity for unhashable ones."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple[Any, ...]) -> None:
        self.items = items
        try:
            self._hash = hash(items)
        except TypeError:
            self._hash = hash(tuple(id(x) for x in items))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _StaticKey) or len(other.items) != len(self.items):
            return False
        try:
            return bool(self.items == other.items)
        except Exception:  # noqa: BLE001 - arbitrary user objects
            return all(a is b for a, b in zip(self.items, other.items, strict=True))


def trace_flat(fn: Callable[..., Any], dyn: Any,
               user: tuple[Callable[..., Any], Any, Any, list[int]] | None = None
               ) -> tuple[Any, list[Any], Any]:
    """Traces ``fn(*dyn)`` to ``(jaxpr, consts, out_tree)``: a jaxpr on flat outputs, for the
    capture pass (``save_intermediates``) and the summary pass (``sowtel.jit``) to evaluate.

    ``user``: ``(fun, args, kwargs, dynamic)`` when ``fn`` calls the user's ``fun`` with the
    leaves ``dyn`` of ``(args, kwargs)`` at the positions ``dynamic``: an error raised while
    tracing then names ``fun`` and its arguments, as ``jax.jit(fun)`` would, not ``fn``.

    Example:
        >>> import jax.numpy as jnp
        >>> jaxpr, consts, tree = trace_flat(lambda x: {"y": x + 1}, [jnp.ones(2)])
        >>> [e.primitive.name for e in jaxpr.eqns], tree
        (['add'], PyTreeDef({'y': *}))
    """
    out_tree: list[Any] = []

    def flat_fn(*d: Any) -> list[Any]:
        leaves, tree = jax.tree_util.tree_flatten(fn(*d))
        out_tree.append(tree)
        return leaves

    if user is not None:
        jc.trace_as(flat_fn, *user)
    # Under disable_jit, lax.scan would unroll while tracing: one site per iteration.
    with jax.disable_jit(False):
        closed = jax.make_jaxpr(flat_fn)(*dyn)
    jaxpr, consts = jc.jaxpr_and_consts(closed)
    return jaxpr, consts, out_tree[-1]


def save_intermediates(
    fn: Callable[..., Any], *, tag: str = "intermediates", duplicates: str = "error"
) -> Callable[..., tuple[Any, dict[str, dict[str, Any]]]]:
    """Wraps ``fn`` to also return every value sown in it, with its derivatives.

    ``wrapped(*args, **kwargs)`` returns ``(fn(*args, **kwargs), intermediates)`` where
    ``intermediates[name][mode]`` has the pytree structure that was sown. ``mode`` is
    ``"primal"``, ``"tangent"``, ``"cotangent"`` or a composition (``"cotangent.tangent"``
    under ``jax.hessian``):

    =================================================  ==================================
    wrapped function                                   keys
    =================================================  ==================================
    plain call                                         primal
    ``jax.grad`` / ``jax.vjp`` / ``jax.value_and_grad``  primal, cotangent
    ``jax.jvp`` / ``jax.linearize``                    primal, tangent
    =================================================  ==================================

    ``save_intermediates`` is the outermost transformation (put ``grad`` and friends inside
    ``fn``); the wrapper is itself jittable and compiles ``fn`` once per argument shapes.
    Arguments that are not arrays (ints, strings, ...) act as static arguments. Dict order is
    the order in which sites ran.

    Args:
      fn: the function to run.
      tag: capture only sites sown with this tag.
      duplicates: ``"error"``: a name sown twice raises ``ValueError``; ``"number"``: every
        occurrence of a repeated name becomes ``name_0``, ``name_1``, ... in trace order.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def f(x):
        ...     return jnp.sum(sowtel.sow(jnp.sin(x), "s") ** 2)
        >>> (y, t), inter = sowtel.save_intermediates(
        ...     lambda x, t: jax.jvp(f, (x,), (t,)))(jnp.zeros(2), jnp.ones(2))
        >>> inter["s"]["tangent"]
        Array([1., 1.], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(
            f"save_intermediates needs a callable, got {type(fn).__name__} {fn!r:.60}: "
            "pass the function itself, e.g. save_intermediates(jax.grad(loss))"
        )
    if duplicates not in DUPLICATE_POLICIES:
        raise ValueError(
            f"duplicates={duplicates!r} is not a duplicate policy: use 'error' or 'number'"
        )
    check_tag(tag)
    cache: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
    # The message of a trace that captured nothing, warned about once by the first call.
    empty: list[str] = []

    def build(treedef: Any, static: dict[int, Any], n_leaves: int) -> Callable[..., Any]:
        def merged(dyn: list[Any]) -> tuple[Any, Any]:
            it = iter(dyn)
            leaves = [static[i] if i in static else next(it) for i in range(n_leaves)]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            return fn(*args, **kwargs)

        def run(*dyn: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
            ctx = current_context() or Context()
            dynamic = [i for i in range(n_leaves) if i not in static]
            leaves = [static[i] if i in static else None for i in range(n_leaves)]
            for i, x in zip(dynamic, dyn, strict=True):
                leaves[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            with CONTEXT(Context(stream=ctx.stream, capture=tag)):
                jaxpr, consts, out_tree = trace_flat(lambda *d: merged(list(d)), dyn,
                                                     (fn, args, kwargs, dynamic))
            outs, caps = eval_capture(jaxpr, consts, list(dyn), tag)
            captured = _assemble(caps, duplicates)
            if not captured and not empty:
                empty.append(nothing_captured(fn, tag, lambda: trace_flat(
                    lambda *d: merged(list(d)), dyn)))
            return jax.tree_util.tree_unflatten(out_tree, outs), captured

        return jax.jit(run)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        static = {i: x for i, x in enumerate(leaves) if not _is_dynamic(x)}
        dyn = [x for x in leaves if _is_dynamic(x)]
        key = (treedef, tuple(static), _StaticKey(tuple(static.values())))
        runner = cache.get(key)
        if runner is None:
            runner = build(treedef, static, len(leaves))
            cache[key] = runner
            while len(cache) > 64:
                cache.popitem(last=False)
        result = runner(*dyn)
        if empty and empty[0]:
            warnings.warn(empty[0], stacklevel=2)
            empty[0] = ""
        return result  # type: ignore[no-any-return]

    return wrapped
