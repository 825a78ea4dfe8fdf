"""The jaxpr evaluator's rules for higher-order primitives it has no construct rule for.

Libraries define their own higher-order primitives: ``lax.custom_linear_solve`` (which
``jnp.linalg.solve`` and ``jax.scipy.sparse.linalg.cg`` use), ``lax.custom_root`` (a primitive
since JAX 0.12), lineax's ``linear_solve`` (where every optimistix solver ends up), or any
primitive made with ``jax.extend``. Whatever its name, a primitive with a sow inside is:

- in ``sowtel.jit``'s summary pass, bound as it is: its sows stream through their host
  callbacks inside the same logging program, with the call's step, as the callback transport
  streams them. Every site of a name that has such a site does the same, so that the sites of
  that name are numbered (``name_0``, ``name_1``, ...) as the callback transport numbers them
  (:func:`fallback_sites`);
- in ``save_intermediates``, evaluated as it runs (:func:`library_rule`): its implementation
  (what ``def_impl`` or a hi primitive's expansion gives, for ``custom_linear_solve`` its
  ``solve`` function, which applies the matvec as the solver does) goes through the capture
  pass like any other code, its outputs keeping the primitive's own derivative rules.

A primitive that its derivative rules bind again (the tangent or transposed solve of an
implicit-function rule) runs the user's functions again, on the solution and on the tangent or
transposed system: each such run is another occurrence of its sites (:class:`Reruns`), numbered
under ``duplicates="number"`` as the callback transport numbers what it streams, and refused
with a message saying so under ``duplicates="error"``.

The evaluator itself lives in :mod:`sowtel.capture` (to move here); it is passed in.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def f(b):
    ...     mv = lambda x: sowtel.sow(2.0 * x, "mv")
    ...     return jax.lax.custom_linear_solve(mv, b, lambda mv, r: r / mv(jnp.ones_like(r)))
    >>> x, inter = sowtel.save_intermediates(f)(jnp.ones(2))
    >>> x, inter["mv"]["primal"]
    (Array([0.5, 0.5], dtype=float32), Array([2., 2.], dtype=float32))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import _jax_compat as jc
from sowtel.context import CONTEXT, Context, current_context
from sowtel.primitive import sow_effect, sow_p

__all__ = ["Reruns", "fallback_sites", "hides_sows", "library_rule", "site_params", "sites_of"]

Wanted = Callable[[dict[str, Any]], bool]


def hides_sows(eqn: Any) -> bool:
    """Whether ``eqn``, a primitive without a construct rule, holds an active sow that no jaxpr
    of its parameters shows (one inside a function a hi primitive keeps, as 0.12's
    ``custom_root`` keeps the linearised function): its effects say so."""
    return (eqn.primitive is not sow_p and jc.construct(eqn) is None
            and sow_effect in getattr(eqn, "effects", ()))


def site_params(jaxpr: Any, wanted: Wanted) -> Iterator[dict[str, Any]]:
    """The parameters of every wanted sow in ``jaxpr``, nested jaxprs and the functions of
    primitives that hide their sows (see :func:`hides_sows`) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            if wanted(eqn.params):
                yield eqn.params
            continue
        for sub in jc.sub_jaxprs(eqn):
            yield from site_params(sub, wanted)
        if hides_sows(eqn):
            expanded = jc.expand(eqn)
            if expanded is not None:
                yield from site_params(expanded[0], wanted)


def sites_of(eqn: Any, wanted: Wanted) -> Iterator[dict[str, Any]]:
    """The parameters of every wanted sow inside ``eqn`` (see :func:`site_params`)."""
    for sub in jc.sub_jaxprs(eqn):
        yield from site_params(sub, wanted)
    if hides_sows(eqn):
        expanded = jc.expand(eqn)
        if expanded is not None:
            yield from site_params(expanded[0], wanted)


def fallback_sites(jaxpr: Any, wanted: Wanted) -> Iterator[dict[str, Any]]:
    """The wanted sows of ``jaxpr`` that the summary pass leaves to their host callbacks: those
    in a ``while_loop`` body (its iteration count is not static) and those in a primitive it
    has no construct rule for (it cannot return values from inside it)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            continue
        kind = jc.construct(eqn)
        if kind == "while" or kind is None:
            yield from sites_of(eqn, wanted)
        else:
            for sub in jc.sub_jaxprs(eqn):
                yield from fallback_sites(sub, wanted)


class Reruns:
    """What the library primitives of one capture pass ran, to tell when one runs it again.

    The derivative rules of a solver bind it again: a tangent solve holds the primal solve's
    jaxprs, a transposed one swaps them, 0.12's ``custom_root`` hands its function to the
    linear map of its derivative. Under ``vmap`` each of them is batched anew, but it still
    runs the same sites. So an equation runs again what an earlier one ran when it holds one
    of its functions (a jaxpr, or a function a hi primitive keeps), or when a site it runs
    (the same site, in the same mode) ran in another one.
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[Any, Any]] = {}  # id -> (the function, its first equation)
        # (site, mode) -> its first equation, and the ids of those running then (around it)
        self._sites: dict[tuple[Any, str], tuple[Any, frozenset[int]]] = {}
        self._expanded: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.running: list[Any] = []  # the library primitives being evaluated, outermost first

    def expand(self, eqn: Any, operands: list[Any]) -> tuple[Any, list[Any]] | None:
        """:func:`sowtel._jax_compat.expand`, once per equation and operand types: a construct
        whose body is traced twice (a cond's, a while's) evaluates the same expansion, whose
        equations (a solver nested in the primitive) then are the same, not reruns."""
        key = (id(eqn), *(jax.typeof(x) for x in operands))
        found = self._expanded.get(key)
        if found is None or found[0] is not eqn:
            found = self._expanded[key] = (eqn, jc.expand(eqn, operands))
        return found[1]  # type: ignore[no-any-return]

    def note(self, eqn: Any) -> Any | None:
        """Notes ``eqn``'s functions; returns an earlier equation holding one (not one that
        ``eqn`` is nested in, as a wrapper holds what it wraps), or None."""
        earlier = None
        functions: list[Any] = list(jc.sub_jaxprs(eqn))
        if jc.eqn_params(eqn) is not eqn.params:  # a hi primitive: the functions it keeps
            functions += [v for v in jc.eqn_params(eqn).values() if callable(v)]
        for fn in functions:
            first = self._held.setdefault(id(fn), (fn, eqn))[1]
            if (first is not eqn and earlier is None
                    and not any(first is outer for outer in self.running)):
                earlier = first
        return earlier

    def ran(self, eqn: Any, caps: list[Any]) -> list[bool]:
        """Notes the sites ``eqn`` ran (``caps``); returns, for each, whether it ran in another
        equation before (not one nested in ``eqn``, whose sites are ``eqn``'s too)."""
        again = []
        for c in caps:
            first, around = self._sites.setdefault(
                (c.site, c.mode), (eqn, frozenset(map(id, self.running))))
            again.append(first is not eqn and id(eqn) not in around)
        return again


def _zero_tangent(x: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def library_rule(eqn: Any, invals: list[Any], *, tag: str | None, wanted: Wanted,
                 evaluate: Callable[..., Any], bind: Callable[[Any, list[Any]], list[Any]],
                 reruns: Reruns) -> tuple[list[Any], list[Any]]:
    """``save_intermediates`` (of ``tag``) of a primitive it has no construct rule for: its
    implementation (:func:`sowtel._jax_compat.expand`) evaluated by
    ``evaluate(jaxpr, consts, args)`` (the capture pass, returning ``(outs, captured)``).

    The outputs keep the primitive's derivative rules where ``save_intermediates`` is itself
    differentiated (``bind`` binds it as it is); the captured values then carry no derivative:
    the implicit rules of a solver never differentiate through its iterations. A primitive
    whose sows are all hidden (:func:`hides_sows`) and that cannot be expanded is bound as it
    is when streaming is on (they may be streaming sows only, and they stream).

    Raises:
      NotImplementedError: the primitive has no implementation to evaluate.
    """
    ctx = current_context() or Context()
    names = [p["site"].name for sub in jc.sub_jaxprs(eqn) for p in site_params(sub, wanted)]
    # Traced in the capture's context: a sow its implementation differentiates (0.12's
    # custom_root linearises its function) captures its derivative too.
    with CONTEXT(Context(stream=ctx.stream, capture=tag)):
        expanded = reruns.expand(eqn, invals)
    name = jc.eqn_name(eqn)
    if expanded is None and not names and ctx.stream is not None:
        return bind(eqn, invals), []
    if expanded is None:
        first_name = names[0] if names else "?"
        raise NotImplementedError(
            f"save_intermediates cannot capture sow {first_name!r} inside a {name!r} primitive: "
            "sowtel has no rule for it, and it has no implementation written in JAX that could "
            "run its functions here, so the values could not be returned (sowtel never drops "
            "them silently). Stream the site instead (sowtel.enable() with jax.jit or "
            "sowtel.jit streams every run), or sow outside the function the primitive calls.")
    earlier = reruns.note(eqn)
    meta: list[Any] = []

    def run(*args: Any) -> tuple[list[Any], list[Any]]:
        reruns.running.append(eqn)
        try:
            outs, caps = evaluate(expanded[0], expanded[1], list(args))
        finally:
            reruns.running.pop()
        again = reruns.ran(eqn, caps)
        # A rerun is another occurrence of its sites, numbered as streaming numbers it; its
        # capture says where it ran, for the error duplicates="error" gives (capture.py).
        caps = [dataclasses.replace(c, rerun=name) if earlier is not None or rerun else c
                for c, rerun in zip(caps, again, strict=True)]
        meta[:] = caps
        return outs, [leaf for c in caps for leaf in c.leaves]

    @jax.custom_jvp
    def fun(*args: Any) -> tuple[list[Any], list[Any]]:
        return run(*args)

    def fun_jvp(primals: Any, tangents: Any) -> tuple[Any, Any]:
        # Only the operands with a tangent are differentiated: a rule may require the others
        # to be symbolic zeros (lineax's does, for its solver's state and options).
        live = [not isinstance(t, jax.custom_derivatives.SymbolicZero) for t in tangents]

        def plain(*moving: Any) -> list[Any]:
            it = iter(moving)
            return bind(eqn, [next(it) if m else p for p, m in zip(primals, live, strict=True)])

        outs, outs_dot = jax.jvp(plain, [p for p, m in zip(primals, live, strict=True) if m],
                                 [t for t, m in zip(tangents, live, strict=True) if m])
        _, flat = run(*primals)
        return (outs, flat), (outs_dot, [_zero_tangent(x) for x in flat])

    fun.defjvp(fun_jvp, symbolic_zeros=True)

    outs, flat = fun(*invals)
    caps, i = [], 0
    for c in meta:
        caps.append(c.with_leaves(flat[i:i + len(c.leaves)]))
        i += len(c.leaves)
    return list(outs), caps
