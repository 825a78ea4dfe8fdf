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

The evaluator runs one pass (:class:`Pass`), passed explicitly to it and to every rule:
the capture pass of ``save_intermediates`` (:func:`eval_capture`), ``sowtel.jit``'s
summary pass (:func:`eval_summaries`), ``sowtel.tap``'s pass (:func:`eval_taps`) and
``sowtel.locate_nonfinite``'s (:func:`eval_locate`). Its rules for JAX's own constructs are in
:mod:`sowtel._interpret_rules`.

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

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import _jax_compat as jc
from sowtel import naming
from sowtel._interpret_rules import (
    RULES,
    Captured,
    Stacking,
    bind_plain,
    custom_jvp_rule,
    keep_last_iteration,
    stacked_scan,
)
from sowtel.context import CONTEXT, Context, current_context
from sowtel.primitive import sow_effect, sow_p, taken_rows

__all__ = ["CALLS_BACK", "NOT_DUE", "Captured", "CheckedEquation", "LocatePass", "Pass", "Reruns",
           "Stacking", "SummaryPass", "TapPass", "any_flag", "eval_capture", "eval_locate",
           "eval_summaries", "eval_taps", "fallback_sites", "hides_sows", "library_rule",
           "nonfinite_flag", "site_params", "sites_of"]

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
    solver, see :func:`library_rule`), and every other site of the same name (``fallback``),
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


#: ``Captured.site`` of a streamed site a summary pass returns nothing for: it streams through
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
    ``around(eqn)``, where given, is the context an equation bound as it is is bound in.
    """

    names: dict[tuple[int, ...], str]
    holding: set[tuple[int, ...]]
    sow: Callable[[list[Any], str], list[Any]]
    around: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None
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


def nonfinite_flag(x: Any) -> Any:
    """Whether ``x`` holds a NaN or an infinity: a bool array, or Python False where it cannot
    (integer values) and a Python bool for a concrete value, so no check is compiled for them."""
    if isinstance(x, float | complex):  # a Python scalar of a literal
        return bool(not np.isfinite(x))
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return False
    if isinstance(x, np.ndarray | np.generic):
        return bool(not np.isfinite(x).all())
    return jnp.logical_not(jnp.all(jnp.isfinite(x)))


def any_flag(flags: Any) -> Any:
    """The or of :func:`nonfinite_flag` values, Python False while none can be True."""
    acc: Any = False
    for f in flags:
        if f is True:
            return True
        if f is not False:
            acc = f if acc is False else jnp.logical_or(acc, f)
    return acc


@dataclasses.dataclass(frozen=True)
class CheckedEquation:
    """An equation the locate pass checks: where it is and what JAX knew of it when traced.

    ``path``: outermost first, the index of each enclosing equation in its jaxpr, and after a
    loop's index the loop as ``(kind, length, reverse)``; ``stack``: the name stacks of the
    enclosing equations and its own, joined; ``site``: the sow site traced last before it.
    """

    eqn: Any
    path: tuple[Any, ...]
    stack: tuple[tuple[str, str], ...]
    site: str | None


@dataclasses.dataclass
class LocatePass:
    """A pass that checks every primitive for a non-finite value made from finite inputs
    (``sowtel.locate_nonfinite``), its sows dropped (streaming is off inside).

    Each checked equation gives a ``Captured`` whose ``site`` is its :class:`CheckedEquation`
    and whose leaves are ``[hit, *iteration]``: whether it made one, and, outermost first,
    the iteration of each enclosing loop where it first did (in the order the loop ran).
    """

    site: str | None = None  # the last sow site traced
    path: list[Any] = dataclasses.field(default_factory=list)
    stacks: list[tuple[tuple[str, str], ...]] = dataclasses.field(default_factory=list)
    # The site on entry to each enclosing equation: every evaluation of a body starts from it
    # (a cond's branches, a body traced twice), so a site is the last one before in the code.
    entry_sites: list[str | None] = dataclasses.field(default_factory=list)
    count: int = 0

    #: The constructs whose bodies are checked equation by equation; any other primitive
    #: (a library's solver, shard_map) is checked as one.
    CONSTRUCTS = frozenset({"call", "custom_jvp", "custom_vjp", "checkpoint", "scan", "while",
                            "cond"})

    def enter(self, index: int, eqn: Any) -> None:
        self.path.append(index)
        self.stacks.append(tuple(jc.equation_name_stack(eqn)))
        self.entry_sites.append(self.site)

    def leave(self) -> None:
        self.path.pop()
        self.stacks.pop()
        self.entry_sites.pop()

    def begin_body(self) -> None:
        if self.entry_sites:
            self.site = self.entry_sites[-1]

    def check(self, eqn: Any, invals: list[Any], outs: list[Any]) -> list[Captured]:
        """The check of a primitive's outputs: a capture when they can be non-finite."""
        made = any_flag(nonfinite_flag(o) for o in outs)
        if made is False:
            return []
        before = any_flag(nonfinite_flag(x) for x in invals)
        hit = made if before is False else jnp.logical_and(made, jnp.logical_not(before))
        if hit is False:
            return []
        where = CheckedEquation(eqn, tuple(self.path),
                                tuple(x for s in self.stacks for x in s), self.site)
        self.count += 1
        return [Captured(f"check{self.count}", "primal", None, [jnp.asarray(hit, bool)],
                         site=where)]

    def scanned(self, caps: list[Captured], reverse: bool) -> list[Captured]:
        """A scan's checks (stacked): the first iteration that hit, in the order it ran."""
        out = []
        for c in caps:
            hits, *inner = c.leaves
            at = hits.shape[0] - 1 - jnp.argmax(hits[::-1]) if reverse else jnp.argmax(hits)
            out.append(c.with_leaves([jnp.any(hits), at, *(i[at] for i in inner)]))
        return out

    def kept_in_while(self, caps: list[Captured], kept: list[Any]) -> list[Captured]:
        """A while_loop's checks: ``[seen, at, *inner]``, ``at`` the first iteration that hit
        once seen, the count of iterations run until then."""
        out, i = [], 0
        for c in caps:
            hit, *inner = c.leaves
            if kept:
                seen, at, *before = kept[i:i + len(inner) + 2]
            else:
                seen, at, before = jnp.zeros((), bool), jnp.zeros((), jnp.int32), inner
            i += len(inner) + 2
            new = jnp.logical_and(hit, jnp.logical_not(seen))
            done = jnp.logical_or(seen, hit)
            out.append(c.with_leaves([done, jnp.where(done, at, at + 1),
                                      *(jnp.where(new, a, b) for a, b in zip(inner, before,
                                                                             strict=True))]))
        return out


@dataclasses.dataclass
class Pass:
    """One evaluation of a jaxpr: which pass runs, given to the evaluator and every rule.

    ``tag``: the tag ``save_intermediates`` captures (None in a summary or tap pass);
    ``summary`` / ``tap`` / ``locate``: the summary pass of ``sowtel.jit``, the tap pass of
    ``sowtel.tap`` or the locate pass of ``sowtel.locate_nonfinite``;
    ``reruns``: what the library primitives of the pass ran (see :class:`Reruns`);
    ``transposed``: how many transposed equations (a backward pass) enclose the one evaluated.
    A pass is passed explicitly: one started while another is evaluated (a trace inside a
    rule) is its own.
    """

    tag: str | None = None
    summary: SummaryPass | None = None
    tap: TapPass | None = None
    locate: LocatePass | None = None
    reruns: Reruns = dataclasses.field(default_factory=Reruns)
    transposed: int = 0

    def eval(self, jaxpr: Any, consts: Any, args: Any) -> tuple[list[Any], list[Captured]]:
        """Evaluates ``jaxpr`` in this pass: its outputs and the captured sows, in trace order."""
        return _eval(self, jaxpr, consts, args)

    def eval_body(self, body: tuple[Any, list[Any]],
                  args: Any) -> tuple[list[Any], list[Captured]]:
        """:meth:`eval` of a ``(jaxpr, consts)`` pair, as ``_jax_compat`` gives a body."""
        return _eval(self, body[0], body[1], args)

    def wanted(self, params: dict[str, Any]) -> bool:
        """Whether this pass turns the sow of these parameters into outputs."""
        return _wanted(params, summaries=self.summary is not None)

    def has_capture(self, jaxpr: Any) -> bool:
        """Whether ``jaxpr`` holds a sow this pass wants (the locate pass wants none)."""
        return self.locate is None and _has_wanted(jaxpr, self.summary is not None)

    def first_capture_name(self, jaxpr: Any) -> str:
        """The name of the first sow in ``jaxpr`` this pass wants ("?" if none)."""
        return _first_capture_name(self, jaxpr)

    @contextlib.contextmanager
    def in_loop(self, kind: str, length: int = 0, reverse: bool = False) -> Iterator[None]:
        """Notes, for the summary pass, that the equations evaluated inside sit in this loop."""
        summary_pass, locate = self.summary, self.locate
        if locate is not None:
            locate.path.append((kind, length, reverse))
            try:
                yield
            finally:
                locate.path.pop()
            return
        if summary_pass is None:
            yield
            return
        summary_pass.loops.append((kind, length, reverse, []))
        try:
            yield
        finally:
            summary_pass.loops.pop()

    def scanned(self, caps: list[Captured], length: int, reverse: bool) -> list[Captured]:
        """What a scan keeps of its body's captures, stacked over its iterations."""
        if self.locate is not None:
            return self.locate.scanned(caps, reverse)
        return stacked_scan(caps, length)

    def kept_in_while(self, caps: list[Captured], kept: list[Any]) -> list[Captured]:
        """What a while_loop carries of its body's captures: ``caps`` (this iteration's) over
        ``kept`` (what it carried in; empty while the loop's shapes are traced)."""
        if self.locate is not None:
            return self.locate.kept_in_while(caps, kept)
        return keep_last_iteration(caps, kept)


def eval_capture(jaxpr: Any, consts: list[Any], args: list[Any],
                 tag: str) -> tuple[list[Any], list[Captured]]:
    """Evaluates ``jaxpr`` with the sows captured for ``tag`` turned into extra outputs."""
    return Pass(tag=tag).eval(jaxpr, consts, args)


def eval_taps(jaxpr: Any, consts: list[Any], args: list[Any], tap_pass: TapPass) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` (values or tracers of the trace calling it), sowing the
    outputs of the equations ``tap_pass`` names (``sowtel.tap``): everything else is bound as
    it was traced, so the sows go through the transformations around the call."""
    return Pass(tap=tap_pass).eval(jaxpr, consts, args)[0]


def eval_summaries(jaxpr: Any, consts: list[Any], args: list[Any],
                   summary_pass: SummaryPass) -> tuple[list[Any], list[Captured]]:
    """Evaluates ``jaxpr`` with its streaming sows turned into summary outputs (``sowtel.jit``).

    Returns the jaxpr's outputs and, per site that ran the reduction, a ``Captured`` whose
    ``leaves`` are the arrays ``summary_pass.reduce`` gave (stacked over scans and shards, filled
    with NaN / 0 in the branches not taken) and whose ``site`` is the streaming site.
    """
    streams = functools.partial(_wanted, summaries=True)
    summary_pass.fallback = frozenset(
        p["site"].name for p in fallback_sites(jaxpr, streams))
    return Pass(summary=summary_pass).eval(jaxpr, consts, args)


def eval_locate(jaxpr: Any, consts: list[Any], args: list[Any],
                locate: LocatePass) -> tuple[list[Any], list[Captured]]:
    """Evaluates ``jaxpr`` checking every primitive (``sowtel.locate_nonfinite``): its outputs
    and one ``Captured`` per check (see :class:`LocatePass`), in trace order."""
    return Pass(locate=locate).eval(jaxpr, consts, args)


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
        elif hides_sows(eqn) or any(_has_wanted(j, summaries)
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


def _eval(st: Pass, jaxpr: Any, consts: Any, args: Any) -> tuple[list[Any], list[Captured]]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jc.core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    captured: list[Captured] = []
    tap, locate = st.tap, st.locate
    if locate is not None:
        locate.begin_body()
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        transposed = jc.eqn_transposed(eqn)
        st.transposed += transposed
        if tap is not None:
            tap.path.append(id(eqn))
        if locate is not None:
            locate.enter(k, eqn)
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
            if locate is not None:
                locate.leave()
        captured.extend(caps)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars], captured


def _eval_eqn(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    prim = eqn.primitive
    tap = st.tap
    if st.locate is not None:
        return _locate_eqn(st, st.locate, eqn, invals)
    if tap is not None:
        # sowtel.tap: a construct holding a site runs its rule (its body evaluated, so the site
        # is sown inside it); everything else, a sow included, is bound as it was traced.
        if not tap.holds():
            with tap.around(eqn) if tap.around is not None else contextlib.nullcontext():
                return bind_plain(eqn, invals), []
        if jc.construct(eqn) in ("custom_jvp", "custom_vjp"):
            return _tap_custom_rule(st, eqn, invals)
        rule = RULES.get(jc.construct(eqn) or "")
        return (_tap_library_rule if rule is None else rule)(st, eqn, invals)
    if prim is sow_p:
        return _eval_sow(st, eqn, invals)
    subs = jc.sub_jaxprs(eqn)
    if not any(st.has_capture(j) for j in subs):
        if hides_sows(eqn):
            return _library_rule(st, eqn, invals)
        if jc.construct(eqn) == "custom_jvp" and st.tag is not None:
            # Its rule may sow: checked if save_intermediates is differentiated from outside.
            return custom_jvp_rule(st, eqn, invals)
        return bind_plain(eqn, invals), []
    rule = RULES.get(jc.construct(eqn) or "")
    if rule is None:
        return _library_rule(st, eqn, invals)
    return rule(st, eqn, invals)


def _locate_eqn(st: Pass, locate: LocatePass, eqn: Any,
                invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    if eqn.primitive is sow_p:
        p = eqn.params
        locate.site = f"{p['site'].name} ({p['mode']})"
        return list(invals[:len(invals) - len(p["site"].extras)]), []
    kind = jc.construct(eqn)
    if kind in locate.CONSTRUCTS and not (kind == "scan" and jc.loop_parts(eqn)["length"] == 0):
        return RULES[kind](st, eqn, invals)
    outs = bind_plain(eqn, invals)
    return outs, locate.check(eqn, invals, outs)


def _tap_custom_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    """``sowtel.tap`` inside a ``custom_jvp`` / ``custom_vjp`` function: the outputs keep the
    function's rules (it is bound as it is); its sites are those of its function run again on
    the same operands, where no derivative reaches them (the rules define none for values
    inside the function: a derivative there would be a zero, not the value's), so they are
    primal sites under every transformation, as a sow there is."""
    outs = bind_plain(eqn, invals)
    st.eval(*jc.call_body(eqn), [jax.lax.stop_gradient(x) for x in invals])
    return outs, []


def _tap_library_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
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


def _library_rule(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
    """A primitive with no construct rule (a library's solver, see :func:`library_rule`):
    ``sowtel.jit`` binds it as it is, its sites keeping their host callbacks; capture evaluates
    what it runs."""
    summary_pass = st.summary
    if summary_pass is None:
        return library_rule(eqn, invals, tag=st.tag, wanted=st.wanted, evaluate=st.eval,
                            bind=bind_plain, reruns=st.reruns)
    summary_pass.keep_callbacks(sites_of(eqn, st.wanted))
    summary_pass.callbacks = True  # hidden sows too, where their jaxpr cannot be read
    return bind_plain(eqn, invals), []


def _recomputed_in_backward_pass(st: Pass, p: dict[str, Any]) -> bool:
    """A primal site (or a tangent of one, under ``jvp`` of ``grad``) evaluated in the
    backward pass is forward code run again there: a
    ``custom_vjp`` bwd re-evaluating a jaxpr traced in the forward pass, a solver's transposed
    solve running the user's function. It is silent, as ``jax.checkpoint``'s recomputation is
    (the lowering applies the same rule to the callback transport)."""
    return naming.forward_mode(p["mode"]) and st.transposed > 0


def _eval_sow(st: Pass, eqn: Any, invals: list[Any]) -> tuple[list[Any], list[Captured]]:
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
    return list(outs), [Captured(site.name, p["mode"], site.treedef, captured, site=site)]


def _summarise_sow(summary_pass: SummaryPass, p: dict[str, Any], invals: list[Any],
                   n: int) -> tuple[list[Any], list[Captured]]:
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
        return leaves, [Captured(site.name, p["mode"], None, [], site=NOT_DUE)]
    stream_site, arrays = reduced
    return leaves, [Captured(site.name, p["mode"], None, list(arrays), site=stream_site)]
