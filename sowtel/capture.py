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
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import _interpret, errors, naming
from sowtel import _jax_compat as jc
from sowtel.context import CONTEXT, Context, current_context
from sowtel.intermediates import Intermediates, nothing_captured
from sowtel.naming import check_tag

__all__ = ["Intermediates", "is_dynamic", "over_dynamic", "save_intermediates", "trace_flat"]

#: How a value was stacked (see sowtel._interpret_rules).
Stacking = _interpret.Stacking
_Captured = _interpret.Captured


DUPLICATE_POLICIES = ("error", "number")


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
            raise errors.BranchMismatchError(c.name, c.mode)
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
                raise errors.DuplicateSiteError(name, count, again.mode, again.rerun)
            raise errors.DuplicateSiteError(name, count)
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


def is_dynamic(leaf: Any) -> bool:
    """THE rule of which leaves of a call's arguments are traced (dynamic), for
    ``save_intermediates``, ``locate_nonfinite``, ``sowtel.tap`` and ``sowtel.jit``'s logging
    step: arrays (JAX's, a tracer included, and NumPy's) and NumPy scalars. Everything else is
    static, Python numbers included (``float`` as ``int``: a new value traces again), as their
    docs say ("arguments that are not arrays act as static arguments").

    Example:
        >>> import jax.numpy as jnp, numpy as np
        >>> [is_dynamic(x) for x in (jnp.ones(2), np.float32(1), 1.5, 2, "s")]
        [True, True, False, False, False]
    """
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "aval")


def over_dynamic(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[list[Any], list[int], Callable[..., Any]]:
    """``fn(*args, **kwargs)`` as a function of its dynamic leaves (:func:`is_dynamic`; others
    act static): returns those leaves, their positions among the leaves of ``(args, kwargs)``,
    and the function taking them positionally."""
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if is_dynamic(x)]

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
        raise errors.NotCallableError(fn)
    if duplicates not in DUPLICATE_POLICIES:
        raise errors.DuplicatePolicyError(duplicates)
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
            outs, caps = _interpret.eval_capture(jaxpr, consts, list(dyn), tag)
            captured = _assemble(caps, duplicates)
            if not captured and not empty:
                empty.append(nothing_captured(fn, tag, lambda: trace_flat(
                    lambda *d: merged(list(d)), dyn)))
            return jax.tree_util.tree_unflatten(out_tree, outs), captured

        return jax.jit(run)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, dict[str, Any]]]:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        static = {i: x for i, x in enumerate(leaves) if not is_dynamic(x)}
        dyn = [x for x in leaves if is_dynamic(x)]
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
