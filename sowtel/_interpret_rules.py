"""The evaluator's rules for JAX's constructs: ``call``, ``custom_jvp`` / ``custom_vjp``,
``checkpoint``, ``scan``, ``while_loop``, ``cond`` / ``switch`` and ``shard_map``.

Each rule re-binds its construct with the public API (``jax.lax.scan``, ``jax.lax.switch``...)
around a body that the evaluation running (:class:`Evaluation`, a pass of
:mod:`sowtel._interpret`) evaluates, and threads the body's captured sows (:class:`Captured`)
out as extra outputs: stacked per iteration by a scan and per shard by a ``shard_map``, the
last iteration's for a ``while_loop``, filled (NaN / 0) in a cond's branches not taken. What
each construct gives is the table of :mod:`sowtel.capture`.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def f(x):
    ...     return jax.lax.cond(x > 0, lambda x: sowtel.sow(x * 2.0, "h"), lambda x: x, x)
    >>> _, inter = sowtel.save_intermediates(f)(jnp.float32(-1.0))
    >>> inter["h"]["primal"]
    Array(nan, dtype=float32)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sowtel import _jax_compat as jc
from sowtel import errors, naming
from sowtel.context import CONTEXT, Context, current_context
from sowtel.primitive import fill_like, sow_p

__all__ = ["RULES", "Captured", "Evaluation", "Stacking", "bind_plain", "call_rule",
           "custom_jvp_rule", "fill_value", "keep_last_iteration", "leaves_of", "stacked_scan",
           "unflat"]


#: How a value was stacked: ``(("scan", length) | ("shard", count), ...)``, outermost first.
Stacking = tuple[tuple[str, int], ...]


@dataclasses.dataclass
class Captured:
    name: str
    mode: str
    treedef: Any
    leaves: list[Any]
    stacked: Stacking = ()
    site: Any = None  # the streaming site whose summary ``leaves`` are (summary passes)
    # The library primitive that ran this site again (a solver's derivative rules rebind it,
    # on the tangent or transposed system): another occurrence, see sowtel._interpret.
    rerun: str | None = None

    def stacked_in(self, kind: str, count: int) -> Captured:
        return dataclasses.replace(self, stacked=((kind, count), *self.stacked))

    def with_leaves(self, leaves: list[Any]) -> Captured:
        return dataclasses.replace(self, leaves=list(leaves))


def leaves_of(caps: list[Captured]) -> list[Any]:
    return [leaf for c in caps for leaf in c.leaves]


def unflat(meta: list[Captured], flat: list[Any]) -> list[Captured]:
    out, i = [], 0
    for c in meta:
        n = len(c.leaves)
        out.append(c.with_leaves(flat[i:i + n]))
        i += n
    return out


def fill_value(aval: Any) -> Any:
    """NaN for floating (and complex) dtypes, 0 otherwise: a site whose code did not run; laid
    out as the value it stands for where that is on explicit mesh axes (a cond's branches must
    return the same types)."""
    value = fill_like(aval.shape, aval.dtype)
    sharding = jc.explicit_sharding_of(aval)
    return value if sharding is None else jax.sharding.reshard(value, sharding)



class Evaluation(Protocol):
    """What a rule reads of the evaluation running it (``sowtel._interpret.Pass``)."""

    tag: str | None  # the tag save_intermediates captures, None in other passes
    summary: Any  # sowtel.jit's summary pass, or None

    def eval(self, jaxpr: Any, consts: Any, args: Any) -> tuple[list[Any], list[Captured]]: ...

    def eval_body(self, body: tuple[Any, list[Any]],
                  args: Any) -> tuple[list[Any], list[Captured]]: ...

    def has_capture(self, jaxpr: Any) -> bool: ...

    def first_capture_name(self, jaxpr: Any) -> str: ...

    def in_loop(self, kind: str, length: int = 0,
                reverse: bool = False) -> contextlib.AbstractContextManager[None]: ...

    # The two hooks where passes differ in what a loop keeps of its iterations: capture keeps
    # every iteration of a scan (stacked) and the last of a while_loop (keep_last_iteration);
    # locate_nonfinite keeps the first iteration that made a non-finite value.
    def scanned(self, caps: list[Captured], length: int,
                reverse: bool) -> list[Captured]: ...

    def kept_in_while(self, caps: list[Captured],
                      kept: list[Any]) -> list[Captured]: ...


def bind_plain(eqn: Any, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def call_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    return st.eval(*jc.call_body(eqn), invals)


def _inlined(st: Evaluation, eqn: Any, args: Any,
             meta: list[Captured]) -> tuple[list[Any], list[Any]]:
    """A custom rule's function run inline: its outputs and its captures' leaves, the captures'
    structure kept in ``meta`` (the custom_jvp and custom_vjp rules' shared body)."""
    outs, caps = call_rule(st, eqn, list(args))
    meta[:] = caps
    return outs, leaves_of(caps)


def custom_jvp_rule(st: Evaluation, eqn: Any,
                    invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    """Captures inside a ``custom_jvp`` function, keeping its rule for transformations outside.

    Where ``save_intermediates`` is itself differentiated, JAX runs the function's jvp rule
    instead of the function: the outputs then come from the user's rule, the captured values
    from running the function, with their own derivatives. A sow in the rule itself (not in
    the function it may call) then raises: the rule runs after the intermediates are returned.
    """
    meta: list[Captured] = []
    tag = st.tag

    def captures(*args: Any) -> list[Any]:
        return _inlined(st, eqn, args, meta)[1]

    @jax.custom_jvp
    def fun(*args: Any) -> tuple[list[Any], list[Any]]:
        return _inlined(st, eqn, args, meta)

    def plain(*args: Any) -> list[Any]:
        return bind_plain(eqn, list(args))

    @fun.defjvp
    def fun_jvp(primals: Any, tangents: Any) -> tuple[Any, Any]:
        if tag is not None:
            _check_rule_sows(lambda p, t: jax.jvp(plain, p, t), (primals, tangents), tag,
                             {c.name for c in meta}, "jvp rule of a custom_jvp function")
        outs, outs_dot = jax.jvp(plain, primals, tangents)
        flat, flat_dot = jax.jvp(captures, primals, tangents)
        return (outs, flat), (outs_dot, flat_dot)

    outs, flat = fun(*invals)
    return list(outs), unflat(meta, flat)


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


def _custom_vjp_rule(st: Evaluation, eqn: Any,
                     invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    """Captures inside a ``custom_vjp`` function, keeping its rule for transformations outside.

    Where ``save_intermediates`` is itself differentiated (``jax.grad`` of a function that calls
    it), the outputs' cotangents go through the user's ``fwd`` / ``bwd``, as without sowtel;
    the captured values' own cotangents (when a caller differentiates them) through the
    function that computed them.
    """
    meta: list[Captured] = []
    tag = st.tag

    def captures(*args: Any) -> list[Any]:
        return _inlined(st, eqn, args, meta)[1]

    @jax.custom_vjp
    def fun(*args: Any) -> tuple[list[Any], list[Any]]:
        return _inlined(st, eqn, args, meta)

    def fun_fwd(*args: Any) -> tuple[Any, Any]:
        outs, outs_vjp = jax.vjp(lambda *a: bind_plain(eqn, list(a)), *args)
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
    return list(outs), unflat(meta, flat)


def _remat_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    p = jc.loop_parts(eqn)
    meta: list[Captured] = []

    def body(*args: Any) -> tuple[list[Any], list[Any]]:
        outs, caps = st.eval_body(p["body"], args)
        meta[:] = caps
        return outs, leaves_of(caps)

    fn = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])
    outs, flat = fn(*invals)
    return list(outs), unflat(meta, flat)


def _scan_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    p = jc.loop_parts(eqn)
    jaxpr, jconsts = p["body"]
    n_consts, n_carry = p["n_consts"], p["n_carry"]
    consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[
        n_consts + n_carry:]
    meta: list[Captured] = []

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
        outs, caps = st.eval(jaxpr, jconsts, [*consts, *carry, *x])
        meta[:] = caps
        return outs[:n_carry], (outs[n_carry:], leaves_of(caps))

    with st.in_loop("scan", p["length"], p["reverse"]):
        carry, (ys, flat) = jax.lax.scan(
            body, list(init), list(xs), length=p["length"], reverse=p["reverse"],
            unroll=p["unroll"])
    return [*carry, *ys], st.scanned(unflat(meta, flat), p["length"], p["reverse"])


def _scan3_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    """A ``jax_scan3`` loop: its body reads and writes its carry through references, which it
    closes over (non-extensive operands); extensive operands are sliced per iteration."""
    p = jc.loop_parts(eqn)
    jaxpr, jconsts = p["body"]
    extensive = list(p["extensives"])
    xs = [a for a, e in zip(invals, extensive, strict=True) if e]
    meta: list[Captured] = []

    def body(x: list[Any]) -> tuple[list[Any], list[Any]]:
        it = iter(x)
        args = [next(it) if e else a for a, e in zip(invals, extensive, strict=True)]
        outs, caps = st.eval(jaxpr, jconsts, args)
        meta[:] = caps
        return outs, leaves_of(caps)

    with st.in_loop("scan", p["length"], p["reverse"]):
        ys, flat = jc.scan3_over(body, xs, length=p["length"], reverse=p["reverse"],
                                 unroll=p["unroll"])
    return list(ys), st.scanned(unflat(meta, flat), p["length"], p["reverse"])


def _while_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    p = jc.loop_parts(eqn)
    cond, body = p["cond"], p["body"]
    if st.has_capture(cond[0]):
        raise ValueError(
            f"sow {st.first_capture_name(cond[0])!r} is inside a while_loop cond function: it "
            "can never be captured there; sow it in the body instead"
        )
    nc, nb = p["n_cond_consts"], p["n_body_consts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    meta: list[Captured] = []

    def body_fn(state: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
        carry, kept = state
        outs, caps = st.eval_body(body, [*body_consts, *carry])
        # What the loop carries of its sites (kept is empty where the shapes are traced).
        caps = st.kept_in_while(caps, kept)
        meta[:] = caps
        return outs, leaves_of(caps)

    def cond_fn(state: tuple[list[Any], list[Any]]) -> Any:
        pred = st.eval_body(cond, [*cond_consts, *state[0]])[0][0]
        # vmap of a loop whose predicate it batched: the body selects the rows still running,
        # and the loop runs while any does (as JAX lowers it).
        return jnp.any(pred) if jnp.ndim(pred) else pred

    summary_pass = st.summary
    if summary_pass is not None:
        summary_pass.in_while += 1
    try:
        with st.in_loop("while"):
            shapes = jax.eval_shape(body_fn, (list(init), []))[1]
            state = jax.lax.while_loop(cond_fn, body_fn,
                                       (list(init), [fill_value(s) for s in shapes]))
    finally:
        if summary_pass is not None:
            summary_pass.in_while -= 1
    return list(state[0]), unflat(meta, state[1])


def stacked_scan(caps: list[Captured], length: int) -> list[Captured]:
    """What capture keeps of a scan's sites: every iteration, stacked."""
    return [c.stacked_in("scan", length) for c in caps]


def keep_last_iteration(caps: list[Captured], kept: list[Any]) -> list[Captured]:
    """What capture keeps of a while_loop's sites: ``caps`` (this iteration's) over ``kept``.

    A site's value is its last forward iteration's. A loop that runs in a backward pass (a
    checkpointed while_loop's bwd, as Equinox's) runs the iterations last first: there the
    last forward iteration's cotangent is the first one it computes (its iterations that
    recompute forward code fill the site, as an untaken branch does: NaN, or 0 for other
    dtypes; those are skipped).
    """
    if not kept:
        return caps
    flat = leaves_of(caps)
    first = [naming.runs_backward(c.mode) for c in caps for _ in c.leaves]
    flat = [jnp.where(jnp.all(_is_fill(old)), new, old) if keep_first else new
            for new, old, keep_first in zip(flat, kept, first, strict=True)]
    return unflat(caps, flat)


def _is_fill(x: Any) -> Any:
    """Where ``x`` holds :func:`fill_value`'s value (a site whose code did not run)."""
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x == 0


def _cond_rule(st: Evaluation, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    branches = jc.loop_parts(eqn)["branches"]
    index, operands = invals[0], invals[1:]
    metas: list[list[Captured]] = [[] for _ in branches]

    def make(i: int) -> Callable[..., Any]:
        def branch(*ops: Any) -> tuple[list[Any], list[Any]]:
            outs, caps = st.eval_body(branches[i], ops)
            metas[i][:] = caps
            return outs, leaves_of(caps)

        return branch

    fns = [make(i) for i in range(len(branches))]
    # Union of the branches' sites by (name, mode, occurrence), in order of first appearance.
    union: collections.OrderedDict[tuple[str, str, int], tuple[Captured, list[Any]]] = (
        collections.OrderedDict())
    per_branch_keys: list[list[tuple[str, str, int]]] = []
    for i, fn in enumerate(fns):
        flat_shapes = jax.eval_shape(fn, *operands)[1]
        caps = unflat(metas[i], flat_shapes)
        slots = naming.occurrence_slots([(c.name, c.mode) for c in caps])
        keys = []
        for c, slot in zip(caps, slots, strict=True):
            k = (c.name, c.mode, slot)
            keys.append(k)
            if k in union:
                prev_shapes = [(s.shape, s.dtype) for s in union[k][1]]
                if prev_shapes != [(s.shape, s.dtype) for s in c.leaves]:
                    raise errors.BranchMismatchError(
                        c.name, c.mode, prev_shapes, [(s.shape, s.dtype) for s in c.leaves])
            else:
                union[k] = (c, list(c.leaves))
        per_branch_keys.append(keys)

    def widen(i: int) -> Callable[..., Any]:
        def branch(*ops: Any) -> tuple[list[Any], list[Any]]:
            outs, flat = fns[i](*ops)
            mine = dict(zip(per_branch_keys[i], unflat(metas[i], flat), strict=True))
            full = []
            for k, (_, shapes) in union.items():
                full.extend(mine[k].leaves if k in mine else [fill_value(s) for s in shapes])
            return outs, full

        return branch

    outs, flat = jax.lax.switch(index, [widen(i) for i in range(len(branches))], *operands)
    meta = [c for c, _ in union.values()]
    return list(outs), unflat(meta, flat)


def _shard_map_rule(st: Evaluation, eqn: Any,
                    invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    p = jc.loop_parts(eqn)
    mesh = p["mesh"]
    manual = tuple(a for a in mesh.axis_names if a in p["manual"])
    meta: list[Captured] = []

    def inner(*args: Any) -> tuple[tuple[Any, ...], list[Any]]:
        outs, caps = st.eval_body(p["body"], args)
        meta[:] = caps
        return tuple(outs), [jnp.expand_dims(leaf, 0) for leaf in leaves_of(caps)]

    fn = jax.shard_map(
        inner, mesh=mesh, in_specs=tuple(p["in_specs"]),
        out_specs=(tuple(p["out_specs"]), PartitionSpec(manual)),
        axis_names=set(p["manual"]), check_vma=p["check_vma"],
    )
    outs, flat = fn(*invals)
    shards = int(np.prod([mesh.shape[a] for a in manual]))
    return list(outs), [c.stacked_in("shard", shards) for c in unflat(meta, flat)]


# By construct (``_jax_compat.construct`` maps JAX's primitive names to these).
RULES: dict[str, Callable[[Evaluation, Any, list[Any]], tuple[list[Any], list[Captured]]]] = {
    "call": call_rule,
    "custom_jvp": custom_jvp_rule,
    "custom_vjp": _custom_vjp_rule,
    "checkpoint": _remat_rule,
    "scan": _scan_rule,
    "scan3": _scan3_rule,
    "while": _while_rule,
    "cond": _cond_rule,
    "shard_map": _shard_map_rule,
}
