"""``sowtel.tap(fn)``: sites placed by rule, in code that has no sow.

``tap(fn)`` returns a function that computes what ``fn`` computes and in which every output of
a chosen primitive (by default every matrix product and convolution: ``dot_general`` and
``conv_general_dilated``) is a site, as if ``sowtel.sow`` had been written right after it. A
tapped site is a site: :func:`sowtel.save_intermediates` captures it with its derivatives,
``sowtel.enable()`` streams it from ``jax.jit`` programs and :func:`sowtel.jit` returns its
summaries, filters and ``every=`` apply, and a tap in a scanned layer stack is a depth site.

Names come from JAX's name stack, then the primitive: ``jax.named_scope``, Flax Linen's module
paths, haiku's module names and :func:`sowtel.scope` give ``Model/Block_1/Dense_0/dot_general``.
A name given twice in one call is numbered by the rule repeated sows follow (``name_0``,
``name_1``, ... in trace order).

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def mlp(w1, w2, x):
    ...     with jax.named_scope("hidden"):
    ...         h = jnp.tanh(x @ w1)
    ...     return jnp.sum(h @ w2)
    >>> w1, w2, x = jnp.ones((3, 4)), jnp.ones((4, 2)), jnp.ones((5, 3))
    >>> grads, inter = sowtel.save_intermediates(jax.grad(sowtel.tap(mlp)))(w1, w2, x)
    >>> {name: sorted(modes) for name, modes in inter.items()}
    {'hidden/dot_general': ['cotangent', 'primal'], 'dot_general': ['cotangent', 'primal']}

How it works: with nothing enabled (no session streams ``tag``, no ``save_intermediates`` of
``tag`` traces it) ``tap(fn)`` calls ``fn`` as it is, so ``jax.jit(tap(fn))`` compiles to
exactly ``jax.jit(fn)``'s program. Otherwise it traces ``fn`` to a jaxpr and evaluates it again
with the capture pass's evaluator (:func:`sowtel._interpret.eval_taps`), which binds every
equation as it was traced and sows the chosen outputs; the constructs around a site (``jit``,
``scan``, ``cond``, ``while_loop`` bodies, ``checkpoint``, ``custom_jvp`` / ``custom_vjp``
functions, ``shard_map``) are rebuilt by the evaluator's construct rules, so a site in a scan
body is sown in the scan body. ``vmap``, ``grad``, ``jvp`` and the other transformations
applied *around* the tapped function apply to its sites: ``jax.grad(tap(loss))`` gives every
matrix product's cotangent.

What is not tapped (documented in docs/watch.md):

- equations of a backward pass that ``fn`` itself runs (``tap(train_step)`` where the step
  calls ``jax.grad``): its forward products are primal sites, but their cotangents were taken
  before the tap saw them (a warning says so). Tap the function that is differentiated,
  ``jax.grad(tap(loss))``, to get them;
- a ``while_loop`` cond function (a site can never stream from there) and the functions a
  library's primitive holds other than as closed jaxprs (lineax's solves, ``custom_root`` on
  JAX 0.12): they run as they are (a warning gives the count). A primitive holding closed
  jaxprs (``custom_linear_solve``, so ``cg`` and ``jnp.linalg.solve``) is bound with them
  tapped: a product in its matvec is a site each time the solver applies it;
- ``custom_vjp``'s ``fwd`` and ``bwd`` and ``custom_jvp``'s rule: the primal function is
  tapped, and its sites are primal sites under every transformation (the rules, which still
  give the function's derivatives, define none for values inside it).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.extend as jex

from sowtel import _interpret, capture, errors, naming
from sowtel import _jax_compat as jc
from sowtel.context import current_context
from sowtel.naming import check_name, check_tag
from sowtel.primitive import sow, sow_p

__all__ = ["tap", "site_name"]

#: What ``primitives`` holds: primitive names, or predicates on an equation.
PrimitiveRule = str | Callable[[Any], bool]

DEFAULT_PRIMITIVES = ("dot_general", "conv_general_dilated")

# Scopes JAX itself puts on the name stack, not the user's: jax.checkpoint's recomputation.
_JAX_SCOPES = frozenset({"rematted_computation"})
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def _known_primitives() -> frozenset[str]:
    """The names of the primitives that ``jax.lax`` and ``jax.extend.core.primitives`` export."""
    names: set[str] = set()
    for module in (jax.lax, jex.core.primitives):
        names.update(v.name for v in vars(module).values() if isinstance(v, jex.core.Primitive))
    return frozenset(names)


def site_name(scopes: Iterable[str], primitive: str) -> str:
    """THE name of a tapped site: its scopes, then its primitive, made a valid sow name.

    The rule, so that any name stack gives a name and never an error: each scope is split at
    ``/``; in each segment every character that is not a letter, digit, ``_``, ``-`` or ``.``
    becomes ``_``; a segment of dots only (``.``, ``..``) has its dots made ``_``; empty
    segments are dropped.

    Example:
        >>> site_name(["Model", "Block 1/attn", "", ".."], "dot_general")
        'Model/Block_1/attn/__/dot_general'
    """
    segments = []
    for part in [*scopes, primitive]:
        for segment in part.split("/"):
            segment = _BAD_CHARS.sub("_", segment)
            if segment and set(segment) == {"."}:
                segment = "_" * len(segment)
            if segment:
                segments.append(segment)
    return check_name("/".join(segments) or "tap")


def _scopes(eqn: Any) -> tuple[list[str], bool]:
    """The user's scopes on ``eqn``'s own name stack (relative to the equation around it), and
    whether it holds the transform ``transpose`` (a backward pass made the equation)."""
    scopes, transposed = [], False
    for kind, name in jc.equation_name_stack(eqn):
        if kind == "transform":
            transposed = transposed or name == "transpose"
        elif name.startswith(naming.SCOPE_MARK):
            scopes.append(name[len(naming.SCOPE_MARK):])
        elif name not in _JAX_SCOPES:
            scopes.append(name)
    return scopes, transposed


def _enclosing_scopes() -> list[str]:
    """The scopes around the tapped call (a ``jax.named_scope``, the Linen module calling it),
    which the equations of its own trace do not carry. Not ``sowtel.scope``'s: its prefix names
    the sites already (as it names a sow)."""
    return [name for kind, name in jc.current_name_stack()
            if kind == "scope" and not name.startswith(naming.SCOPE_MARK)
            and name not in _JAX_SCOPES]


def _unread(eqn: Any) -> list[Any]:
    """The jaxprs of ``eqn`` that run as they are, never a site: a ``while_loop``'s cond
    function, and those of a library's primitive (``custom_linear_solve``, lineax's solves)."""
    kind = jc.construct(eqn)
    if kind == "while":
        return [jc.loop_parts(eqn)["cond"][0]]
    if kind is None:  # a library's primitive: all but the functions it holds as closed jaxprs
        read = {id(jc.as_jaxpr(c)) for c in jc.closed_sub_jaxprs(eqn)}
        return [j for j in jc.sub_jaxprs(eqn) if id(j) not in read]
    return []


def _bodies(eqn: Any) -> list[Any]:
    """The jaxprs the evaluator's rule for ``eqn`` evaluates (those a site can be sown in)."""
    kind = jc.construct(eqn)
    if kind in ("call", "custom_jvp", "custom_vjp"):
        return [jc.call_body(eqn)[0]]
    if kind in ("checkpoint", "scan", "scan3", "shard_map", "while"):
        return [jc.loop_parts(eqn)["body"][0]]  # a while's cond function: never a site
    if kind == "cond":
        return [branch[0] for branch in jc.loop_parts(eqn)["branches"]]
    if kind is None:  # a library's primitive: bound with the closed jaxprs it holds re-tapped
        return [jc.as_jaxpr(closed) for closed in jc.closed_sub_jaxprs(eqn)]
    return []


class _Plan:
    """Where the sites of one traced call are: found once, before the jaxpr is evaluated."""

    def __init__(self, jaxpr: Any, chosen: Callable[[Any], bool], scopes: list[str]) -> None:
        self.found: list[tuple[tuple[int, ...], str]] = []  # (path, unnumbered name)
        self.holding: set[tuple[int, ...]] = set()
        self.sown: set[str] = set()  # the names of the user's own sows
        self.seen: set[str] = set()  # primitive names present, for messages
        self.backward = 0  # chosen equations of a backward pass the function runs itself
        self.inside: dict[str, int] = {}  # chosen equations in a primitive run as it is
        self._chosen = chosen
        self._paths: set[tuple[int, ...]] = set()
        self._walk(jaxpr, (), scopes, False)

    def _walk(self, jaxpr: Any, path: tuple[int, ...], scopes: list[str],
              transposed: bool) -> bool:
        holds = False
        for eqn in jaxpr.eqns:
            here = (*path, id(eqn))
            own, back = _scopes(eqn)
            inner, back = [*scopes, *own], transposed or back
            self.seen.add(str(eqn.primitive.name))
            if eqn.primitive is sow_p:
                self.sown.add(eqn.params["site"].name)
                continue
            if self._chosen(eqn):
                if back:
                    self.backward += 1
                elif here in self._paths:
                    holds = True  # a jaxpr held twice (a solver's matvec as its vecmat too)
                else:
                    self._paths.add(here)
                    self.found.append((here, site_name(inner, str(eqn.primitive.name))))
                    holds = True
            if any([self._walk(body, here, inner, back) for body in _bodies(eqn)]):
                self.holding.add(here)
                holds = True
            unread = _unread(eqn)
            if unread and not back:
                count = sum(self._count(j) for j in unread)
                if count:
                    why = "cond function" if jc.construct(eqn) else "primitive with no rule"
                    where = f"{jc.eqn_name(eqn)} {why}"
                    self.inside[where] = self.inside.get(where, 0) + count
        return holds

    def _count(self, jaxpr: Any) -> int:
        """The chosen equations in ``jaxpr`` and the jaxprs it holds."""
        return sum(bool(self._chosen(e)) + sum(self._count(j) for j in jc.sub_jaxprs(e))
                   for e in jaxpr.eqns)


def _clashes(base: str, sown: set[str]) -> bool:
    """Whether a tap named ``base`` (numbered or not) could take the name of a user's sow."""
    return any(s == base or re.fullmatch(re.escape(s) + r"_\d+", base)
               or re.fullmatch(re.escape(base) + r"_\d+", s) for s in sown)


def _names(plan: _Plan) -> dict[tuple[int, ...], str]:
    """The site name of each path: unique beside the user's sows, numbered when repeated."""
    renamed = {}
    for _, base in plan.found:
        if base not in renamed:
            name = base
            while _clashes(naming.scoped(name), plan.sown):
                name += "_tap"
            renamed[base] = name
    final = naming.occurrence_names([(renamed[base], "primal") for _, base in plan.found])
    return {path: name for (path, _), name in zip(plan.found, final, strict=True)}


def _name_filter(patterns: Any, what: str) -> Callable[[str], bool] | None:
    if patterns is None:
        return None
    if callable(patterns):
        return patterns  # type: ignore[no-any-return]
    if isinstance(patterns, str):
        patterns = (patterns,)
    patterns = tuple(patterns)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise errors.BadOptionError(
            f"tap {what}", patterns, "is not a filter: pass a glob pattern, a list of glob "
            "patterns (such as ['*/Dense_*/dot_general']) or a callable on the site name")
    return functools.partial(_matches_any, patterns)


def _matches_any(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _primitive_rule(primitives: Any) -> Callable[[Any], bool]:
    if isinstance(primitives, (str, jex.core.Primitive)) or callable(primitives):
        primitives = (primitives,)
    try:
        rules = list(primitives)
    except TypeError:
        raise errors.BadOptionError(
            "tap primitives", primitives, f"is not a sequence of primitive names or "
            f"predicates: pass e.g. primitives={DEFAULT_PRIMITIVES!r}") from None
    if not rules:
        raise errors.BadOptionError(
            "tap primitives", primitives, "selects nothing: pass the names of the primitives "
            f"whose outputs become sites (the default is {DEFAULT_PRIMITIVES!r}) or predicates "
            "taking an equation, such as lambda eqn: eqn.primitive.name == 'tanh'")
    known = _known_primitives()
    names: set[str] = set()
    predicates: list[Callable[[Any], bool]] = []
    for rule in rules:
        if isinstance(rule, jex.core.Primitive):
            names.add(rule.name)
        elif isinstance(rule, str):
            if rule not in known:
                close = difflib.get_close_matches(rule, sorted(known), n=3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise errors.BadOptionError(
                    "tap primitives", primitives, f"holds {rule!r}, which is not the name of a "
                    f"JAX primitive{hint}; the names are those of jax.lax's primitives, such as "
                    f"{DEFAULT_PRIMITIVES!r}. For a primitive of your own, pass it (the "
                    "jax.extend.core.Primitive) or a predicate: lambda eqn: "
                    f"eqn.primitive.name == {rule!r}")
            names.add(rule)
        elif callable(rule):
            predicates.append(rule)
        else:
            raise errors.BadOptionError(
                "tap primitives", primitives, f"holds {rule!r}, which is neither a primitive "
                "name nor a predicate: pass strings such as 'dot_general', primitives, or "
                "callables taking an equation")

    def chosen(eqn: Any) -> bool:
        return eqn.primitive.name in names or any(bool(p(eqn)) for p in predicates)

    return chosen


def _active(tag: str) -> bool:
    """Whether a sow of ``tag`` bound now would bind anything (see :func:`sowtel.sow`)."""
    ctx = current_context()
    if ctx is None:
        return False
    return ctx.capture == tag or (not ctx.quiet and ctx.stream is not None
                                  and tag in ctx.stream.tags)


def tap(fn: Callable[..., Any], *,
        primitives: Sequence[PrimitiveRule] | PrimitiveRule = DEFAULT_PRIMITIVES,
        include: Any = None, exclude: Any = None,
        tag: str = "intermediates") -> Callable[..., Any]:
    """Returns ``fn`` with every output of the chosen primitives made a site.

    ``tap(fn)(*args, **kwargs)`` returns ``fn(*args, **kwargs)``; each output of an equation
    whose primitive is chosen is sown, as if ``sowtel.sow(out, name, tag=tag)`` followed it,
    under the name JAX's name stack gives it (``Model/Block_1/Dense_0/dot_general``, see
    :func:`site_name` for the characters a name cannot hold). Under a transformation the sites
    report what a sow there reports:

    ==================================  ==========================================
    around the tapped function          what a tapped site reports
    ==================================  ==========================================
    plain call, ``jit``                 primal
    ``grad``, ``vjp``                   primal, cotangent
    ``jvp``, ``linearize``              primal, tangent
    ``vmap``                            the whole batch
    inside ``fn``: ``scan``             every iteration (captured: stacked)
    inside ``fn``: ``while_loop``       every iteration (captured: the last)
    inside ``fn``: ``cond``             the branch taken
    inside ``fn``: ``checkpoint``       the primal once, not per recomputation
    inside ``fn``: a ``custom_jvp`` /   primal only
    ``custom_vjp`` function
    inside ``fn``: ``grad``             primal only (see the module's docstring)
    ==================================  ==========================================

    Args:
      fn: any JAX function (a training step, a ``model.apply``, a haiku ``apply``...).
      primitives: names of JAX primitives (``"dot_general"``, ``"conv_general_dilated"``,
        ``"tanh"``, ...), ``jax.extend.core.Primitive`` objects, or predicates called with each
        equation (a ``jax.extend.core.JaxprEqn``: ``eqn.primitive.name``, ``eqn.params``,
        ``eqn.outvars[0].aval``) that return whether its outputs become a site.
      include: glob patterns (or one) or a callable on the site name: only matching sites.
      exclude: glob patterns (or one) or a callable on the site name: no matching site.
        Both see the names as reported (numbered when repeated, without an enclosing
        :func:`sowtel.scope`); a pattern that matches no site of a call is warned about.
      tag: the tag of the sites (as ``sow``'s).

    Raises:
      ValueError: ``fn`` is not callable; a primitive name JAX does not have; empty
        ``primitives``; a filter that is neither patterns nor a callable.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def f(w, xs):
        ...     def layer(h, w_i):
        ...         return jnp.tanh(h @ w_i), None
        ...     return jax.lax.scan(layer, xs, w)[0].sum()
        >>> w, xs = jnp.ones((6, 3, 3)), jnp.ones((2, 3))
        >>> _, inter = sowtel.save_intermediates(sowtel.tap(f))(w, xs)
        >>> inter["dot_general"]["primal"].shape, inter["dot_general"].stacked
        ((6, 2, 3), {'primal': (('scan', 6),)})
    """
    if not callable(fn):
        raise errors.NotCallableError(fn, "sowtel.tap",
                                      "sowtel.tap(train_step) or sowtel.tap(model.apply)")
    check_tag(tag)
    chosen = _primitive_rule(primitives)
    keep_in = _name_filter(include, "include")
    keep_out = _name_filter(exclude, "exclude")
    warned: set[str] = set()

    def sow_outputs(outs: list[Any], name: str) -> list[Any]:
        if len(outs) == 1:
            return [sow(outs[0], name, tag=tag)]
        return list(sow(list(outs), name, tag=tag))

    @functools.wraps(fn)
    def tapped(*args: Any, **kwargs: Any) -> Any:
        if not _active(tag):
            return fn(*args, **kwargs)  # nothing would be sown: fn's own trace, exactly
        dyn, dynamic, merged = capture.over_dynamic(fn, args, kwargs)
        with naming.scopes_in_name_stack():
            jaxpr, consts, out_tree = capture.trace_flat(merged, dyn, (fn, args, kwargs, dynamic))
        plan = _Plan(jaxpr, chosen, _enclosing_scopes())
        names = _names(plan)
        kept = {path: name for path, name in names.items()
                if (keep_in is None or keep_in(name)) and not (keep_out is not None
                                                               and keep_out(name))}
        _warn_unmatched(fn, plan, names, include, exclude, warned)
        tap_pass = _interpret.TapPass(names=kept, holding=_holding(plan, kept), sow=sow_outputs)
        outs = _interpret.eval_taps(jaxpr, consts, dyn, tap_pass)
        lost = [name for name in kept.values() if name not in tap_pass.placed]
        if lost:  # never silently: a construct whose rule evaluated another body than planned
            raise NotImplementedError(
                f"sowtel.tap({getattr(fn, '__name__', fn)!r}) could not place the site "
                f"{lost[0]!r} ({len(lost)} in all): the construct around it was evaluated from "
                "another jaxpr than the one read. Exclude it (exclude=...) and sow it by hand, "
                "or report it with the construct's primitive")
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return tapped


def _holding(plan: _Plan, kept: dict[tuple[int, ...], str]) -> set[tuple[int, ...]]:
    """The constructs around a kept site (a construct holding only filtered sites is bound
    as it is)."""
    return {path[:n] for path in kept for n in range(1, len(path))} & plan.holding


def _warn_unmatched(fn: Any, plan: _Plan, names: dict[tuple[int, ...], str], include: Any,
                    exclude: Any, warned: set[str]) -> None:
    """Warns, once per pattern, of a glob that matched no site of this call."""
    available = list(dict.fromkeys(names.values()))
    shown = ", ".join(map(repr, available[:8])) + (", ..." if len(available) > 8 else "")
    where = getattr(fn, "__name__", repr(fn))
    if plan.backward and "backward" not in warned:
        warned.add("backward")
        warnings.warn(
            f"sowtel.tap({where}) taps a function that differentiates inside: its "
            f"{plan.backward} chosen equations of the backward pass are not sites, and its "
            "sites get no cotangent (the derivatives were taken before the tap saw them). To "
            "stream cotangents, tap the function that is differentiated, e.g. "
            "jax.grad(sowtel.tap(loss)) inside the step", stacklevel=3)
    for inside, count in plan.inside.items():
        if inside not in warned:
            warned.add(inside)
            warnings.warn(
                f"sowtel.tap({where}): {count} chosen equation(s) inside a {inside} are not "
                "tapped: it runs as it is (see sowtel.tap's docstring). Sow a value there by "
                "hand to watch it", stacklevel=3)
    if not plan.found and not plan.inside and not plan.backward and "nothing" not in warned:
        warned.add("nothing")
        warnings.warn(
            f"sowtel.tap({where}) found no equation to tap: the primitives it holds are "
            f"{sorted(plan.seen)}; choose some with primitives=", stacklevel=3)
        return
    for what, patterns in (("include", include), ("exclude", exclude)):
        if patterns is None or callable(patterns):
            continue
        for p in (patterns,) if isinstance(patterns, str) else patterns:
            if p not in warned and not any(fnmatch.fnmatchcase(n, p) for n in available):
                warned.add(p)
                warnings.warn(
                    f"sowtel.tap({where}) {what} pattern {p!r} matches no site; the sites are "
                    f"{shown}", stacklevel=3)
