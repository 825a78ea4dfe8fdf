"""The rows a vmapped cond runs a branch for, handed to the sows nested in that branch.

Under ``vmap`` of a ``cond`` (or ``switch``) whose predicate is batched, JAX runs every branch
on every row and selects. A site in a branch reports its values in the rows that took the
branch and NaN / 0 in the others (``primitive.taken_rows``). For a sow written in the branch
itself, the rows come from JAX's own batching rule while it runs the branch
(``_jax_compat.batched_branch_predicate``). A sow nested deeper (in a jitted function, a loop,
another cond or a checkpoint in the branch) is bound inside that construct's own body, which
JAX batches out of the rule's reach. For such a cond, this module's rule runs in front of
JAX's one and does what it does, with one difference: each branch is run under ``jax.vmap``
with the rows that take it set in :data:`sowtel.primitive.ROWS`, and its constructs that hold
a sow are traced again by the evaluator (``_interpret.eval_taps``), so that every sow in them is
bound anew inside ``jax.vmap`` and closes over the rows. The constructs pass what their bodies
close over on as their inputs, as they do for any closure. A ``custom_jvp`` / ``custom_vjp``
function is bound as it is: ``vmap`` runs its function again, with the rows set. Primitives
the evaluator has no rule for (a library's solver, ``shard_map``) are bound as they are and
their sows report every row.

Every other cond goes to JAX's rule unchanged: one whose predicate is not batched, and one
whose branches hold no sow below their own equations.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, sowtel
    >>> def f(x):
    ...     inner = jax.jit(lambda v: sowtel.sow(v * 2.0, "s"))
    ...     return jax.lax.cond(x > 0, inner, lambda v: v, x)
    >>> _, inter = sowtel.save_intermediates(jax.vmap(f))(jnp.array([1.0, -1.0]))
    >>> np.asarray(inter["s"]["primal"])
    array([ 2., nan], dtype=float32)
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from sowtel import _interpret
from sowtel import _jax_compat as jc
from sowtel.primitive import FRESH_ROWS, ROWS, sow_p

# The constructs whose bodies the evaluator traces again (see tap's bodies): the others that
# hold a sow are bound as they are.
_RETRACED = ("call", "checkpoint", "scan", "scan3", "while", "cond")

_KEYS = itertools.count(1 << 40)  # cond keys of their own (SiteStatic.branch), apart from ids
_NESTED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _bodies(eqn: Any) -> list[Any]:
    kind = jc.construct(eqn)
    if kind == "call":
        return [jc.call_body(eqn)[0]]
    if kind in ("checkpoint", "scan", "scan3", "while"):
        return [jc.loop_parts(eqn)["body"][0]]
    if kind == "cond":
        return [branch[0] for branch in jc.loop_parts(eqn)["branches"]]
    return []


def _holds_sow(jaxpr: Any) -> bool:
    return any(e.primitive is sow_p or any(_holds_sow(j) for j in jc.sub_jaxprs(e))
               for e in jaxpr.eqns)


def _nested_sow(jaxpr: Any) -> bool:
    """Whether a sow sits below an equation of ``jaxpr`` (not in ``jaxpr`` itself)."""
    try:
        return _NESTED[jaxpr]
    except (KeyError, TypeError):
        pass
    found = any(e.primitive is not sow_p and any(_holds_sow(j) for j in jc.sub_jaxprs(e))
                for e in jaxpr.eqns)
    try:
        _NESTED[jaxpr] = found
    except TypeError:
        pass
    return found


def _holding(jaxpr: Any, path: tuple[int, ...], out: set[tuple[int, ...]]) -> bool:
    """Adds to ``out`` the paths (as the evaluator counts them) of the constructs it traces
    again: those holding a sow, through constructs it traces again."""
    holds = False
    for eqn in jaxpr.eqns:
        here = (*path, id(eqn))
        if eqn.primitive is sow_p:
            holds = True
            continue
        if jc.construct(eqn) in _RETRACED:
            if any([_holding(body, here, out) for body in _bodies(eqn)]):
                out.add(here)
                holds = True
        elif any(_holds_sow(j) for j in jc.sub_jaxprs(eqn)):
            holds = True
    return holds


@contextlib.contextmanager
def _fresh_rows(eqn: Any) -> Iterator[None]:
    """Binding ``eqn``: a custom rule's function holding a sow is traced with the rows."""
    if jc.construct(eqn) not in ("custom_jvp", "custom_vjp") or not any(
            _holds_sow(j) for j in jc.sub_jaxprs(eqn)):
        yield
        return
    token = FRESH_ROWS.set(ROWS.get())
    try:
        yield
    finally:
        FRESH_ROWS.reset(token)


def _batch_cond(original: Callable[..., Any], axis_data: Any, args: Any, dims: Any,
                **params: Any) -> Any:
    branches = params["branches"]
    if (dims[0] is None or "branches_platforms" in params
            or not any(_nested_sow(jc.jaxpr_and_consts(b)[0]) for b in branches)):
        return original(axis_data, args, dims, **params)
    index, *ops = jc.batched_cond_operands(axis_data, args, dims)
    key = next(_KEYS)
    outs = []
    for i, branch in enumerate(branches):
        jaxpr, consts = jc.jaxpr_and_consts(branch)
        holding: set[tuple[int, ...]] = set()
        _holding(jaxpr, (), holding)
        tap_pass = _interpret.TapPass(names={}, holding=holding, sow=lambda o, _: o,
                                      around=_fresh_rows)

        def run(taken: Any, *row: Any, jaxpr: Any = jaxpr, consts: Any = consts, i: int = i,
                tap_pass: _interpret.TapPass = tap_pass) -> list[Any]:
            token = ROWS.set((taken, key, i, jc.current_trace()))
            try:
                return _interpret.eval_taps(jaxpr, consts, list(row), tap_pass)
            finally:
                ROWS.reset(token)

        taken = jax.lax.eq(index, jax.lax.full_like(index, i))
        selected = [jc.select_branch_inputs(taken, x) for x in ops]
        outs.append(jax.vmap(run, **jc.vmap_axis(axis_data))(taken, *selected))
    out = [jc.select_branch_outputs(index, list(o)) for o in zip(*outs, strict=True)]
    return out, [0] * len(out)


jc.wrap_cond_batching(_batch_cond)
