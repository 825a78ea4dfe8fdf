"""Lowering hooks: the effects barrier, per-module state, uncached lowerings, the branch a
cond lowers and the loops a scan lowers into (checked on JAX 0.10.2, 0.11.2 and 0.12.0.1).
Part of :mod:`sowtel._jax_compat`, which re-exports it."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as core
from jax._src import dispatch as dispatch
from jax._src import effects as effects
from jax._src.interpreters import ad as ad
from jax._src.interpreters import batching as batching
from jax._src.interpreters import mlir as mlir
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.lax.control_flow import loops as _loops

from sowtel._jax_compat._frames import SCAN3_REVERSES
from sowtel._jax_compat._jaxprs import as_jaxpr


def effects_barrier() -> Exception | None:
    """Waits until every dispatched computation's side effects (host callbacks) have run.

    Returns the error of an earlier computation that failed (``jax.effects_barrier`` re-raises
    it) instead of raising it: that error belongs to the computation, and the wait completes
    either way. The failure is then forgotten, so later barriers do not meet it again.

    Example:
        >>> effects_barrier() is None
        True
    """
    try:
        jax.effects_barrier()
    except Exception as error:  # noqa: BLE001 - any failure of the user's computation
        # JAX 0.10 and 0.11 stop at the first failed token and keep every token, so each later
        # barrier (and interpreter exit) would raise again: wait for the others, then drop them.
        tokens = dispatch.runtime_tokens
        for token in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
            try:
                token.block_until_ready()
            except Exception:  # noqa: BLE001, S110 - the same failure, already returned
                pass
        tokens.clear()
        return error
    return None

_MODULE_STATE_KEY = ("sowtel", "module_state")


def module_state(ctx: Any) -> dict[Any, Any]:
    """A dict that lives as long as the program being lowered (one per compiled module).

    Stored in the module context's dict of cached lowerings, whose other keys are JAX's own
    tuples of jaxprs and parameters.
    """
    cache = ctx.module_context.cached_primitive_lowerings
    state: dict[Any, Any] = cache.setdefault(_MODULE_STATE_KEY, {})
    return state


def register_uncached_lowering(prim: Any, rule: Any) -> None:
    """Registers ``rule`` so that every equation of ``prim`` is lowered on its own.

    JAX lowers equal equations (same parameters and shapes) once and calls the result; sites
    that must stay apart in the compiled program (one per occurrence) opt out of that cache.
    """
    try:
        mlir.register_lowering(prim, rule, cacheable=False)
    except TypeError:  # pragma: no cover - a JAX without the lowering cache
        mlir.register_lowering(prim, rule)


def branch_path(ctx: Any) -> tuple[tuple[int, int], ...]:
    """``((case op, branch index), ...)`` of the cond/switch branches being lowered, outermost
    first, read from the MLIR insertion point (the case op as an opaque key).

    Stops at a function boundary: a sow inside a jitted function called from a branch does
    not see the branch.
    """
    from jax._src.lib.mlir import ir

    path: list[tuple[int, int]] = []
    try:
        block = ir.InsertionPoint.current.block
    except ValueError:  # no insertion point: not inside a branch's region
        return ()
    while True:
        owner = block.owner
        if owner is None:
            break
        op = owner.operation
        if op.name == "stablehlo.case":
            for i, region in enumerate(op.regions):
                if any(b == block for b in region.blocks):
                    path.append((hash(op), i))
        if op.name.startswith("func."):
            break
        try:
            block = op.block
        except (ValueError, AttributeError):  # a detached op: no enclosing block
            break
    return tuple(reversed(path))


def wrap_cond_lowering(wrapper: Callable[..., Any]) -> None:
    """Lowers ``lax.cond`` / ``lax.switch`` through ``wrapper(lower, ctx, branches)``, around
    the rule JAX registered for every platform (``mlir._lowerings``): ``lower()`` runs JAX's
    rule, ``branches`` are the branches' jaxprs. A platform-dependent cond (its branches picked
    per platform) is lowered by JAX's rule alone."""
    entry = mlir._lowerings[_conditionals.cond_p]
    rule: Callable[..., Any] = entry.rule

    def lowering(ctx: Any, index: Any, *args: Any, branches: Any, **params: Any) -> Any:
        lower = functools.partial(rule, ctx, index, *args, branches=branches, **params)
        if params.get("branches_platforms") is not None:
            return lower()
        return wrapper(lower, ctx, [as_jaxpr(b) for b in branches])

    mlir.register_lowering(_conditionals.cond_p, lowering, inline=entry.inline)


class _LoopNotes(threading.local):
    def __init__(self) -> None:
        # The loops whose bodies are being lowered, outermost first, each
        # [kind, length, reverse, own, entry]: own, of a scan, says where its own while op is
        # (_OWN_AHEAD: not lowered yet; _OWN_NOW: being lowered; _OWN_DONE: lowered, or none);
        # entry is a list that holds the loop's entry in execution order once a site inside
        # it is lowered (sowtel.records.loop_entries).
        self.lowering: list[list[Any]] = []
        # The jax_scan3 loops being expanded (Scan3.expand), outermost first.
        self.expanding: list[tuple[int, bool]] = []
        # How many equations being lowered around the current one sit in a backward pass
        # (see track_transposed_lowerings).
        self.transposed = 0


LOOP_NOTES = _LoopNotes()
_OWN_AHEAD, _OWN_NOW, _OWN_DONE = 0, 1, 2


def _scan_has_own_loop(length: int, unroll: Any) -> bool:
    """Whether ``_scan_impl`` lowers a scan with a while op of its own (0.10.2 to 0.12): not
    when it unrolls it whole (``unroll`` 0, or one trip of ``unroll`` iterations)."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll == 0:
        return not (unroll is True or unroll == 0)
    trips, remainder = divmod(length, unroll)
    return trips > 0 and not (unroll != 1 and trips == 1 and remainder == 0)


def track_loop_lowerings() -> None:
    """Makes :func:`lowering_loops` know the ``scan`` and ``while_loop`` bodies being lowered,
    by lowering both through JAX's own rules (``mlir._lowerings``) inside a note of the loop.

    JAX lowers a scan (``lower_fun(_scan_impl)``, 0.10.2 to 0.12) as a while op whose body
    evaluates the scan's body: that while op is the scan's own, not a ``while_loop``. Lowering
    follows the program, so the note says where each equation lowered now sits in it.

    A ``jax_scan3`` loop becomes a while loop before lowering (``call_hi_primitive_p.to_lojax``
    runs ``Scan3.expand``, which binds the body's equations again inside that loop's body):
    :func:`expanding_scan3` says which expansions bind an equation now.
    """

    def wrap(prim: Any, kind: str) -> None:
        entry = mlir._lowerings[prim]
        rule: Callable[..., Any] = entry.rule

        def lowering(ctx: Any, *args: Any, **params: Any) -> Any:
            stack = LOOP_NOTES.lowering
            top = stack[-1] if stack else None
            if kind == "while" and top is not None and top[3] == _OWN_AHEAD:
                top[3] = _OWN_NOW  # the scan's own loop
                try:
                    return rule(ctx, *args, **params)
                finally:
                    top[3] = _OWN_DONE
            if kind == "scan":
                length = int(params["length"])
                own = _scan_has_own_loop(length, params.get("unroll", 1))
                note = [kind, length, bool(params["reverse"]), _OWN_AHEAD if own else _OWN_DONE,
                        []]
            else:
                note = [kind, 0, False, _OWN_DONE, []]
            stack.append(note)
            try:
                return rule(ctx, *args, **params)
            finally:
                stack.pop()

        mlir.register_lowering(prim, lowering, inline=entry.inline)

    wrap(_loops.scan_p, "scan")
    wrap(_loops.while_p, "while")
    try:
        from jax._src import hijax as _hijax
    except ImportError:  # pragma: no cover - depends on the JAX version
        return
    hi = getattr(_hijax, "call_hi_primitive_p", None)
    expand = getattr(hi, "to_lojax", None)
    if hi is None or expand is None:  # pragma: no cover - depends on the JAX version
        return

    def to_lojax(*args: Any, _prim: Any) -> Any:
        if type(_prim).__name__ != "Scan3":
            return expand(*args, _prim=_prim)
        p = _prim.params
        LOOP_NOTES.expanding.append((int(p["length"]), bool(p["reverse"]) and SCAN3_REVERSES))
        try:
            return expand(*args, _prim=_prim)
        finally:
            LOOP_NOTES.expanding.pop()

    hi.to_lojax = to_lojax


def expanding_scan3() -> tuple[tuple[int, bool], ...]:
    """``((length, reverse), ...)`` of the ``jax_scan3`` loops whose expansion binds the
    equation bound now, outermost first: it sits directly in the innermost one's body, which
    lowers as a while loop (see :func:`track_loop_lowerings`)."""
    return tuple(LOOP_NOTES.expanding)


def lowering_loops(scan3: Sequence[tuple[int, bool]] = ()
                   ) -> tuple[tuple[str, int, bool, list[int]], ...]:
    """``(("scan", length, reverse, entry) | ("while", 0, False, entry), ...)``: the loops
    around the equation being lowered, outermost first (see :func:`track_loop_lowerings`);
    ``entry`` is the loop's cell for :func:`sowtel.records.loop_entries`. ``scan3``: the
    ``jax_scan3`` loops whose expansions bound it (:func:`expanding_scan3`), which are the
    innermost while loops around it."""
    notes = [(k, n, r, e) for k, n, r, _, e in LOOP_NOTES.lowering]
    at = len(notes)
    for length, reverse in reversed(scan3):
        at = next((i for i in range(at - 1, -1, -1) if notes[i][0] == "while"), -1)
        if at < 0:
            break
        notes[at] = ("scan", length, reverse, notes[at][3])
    return tuple(notes)


def lowered_case_op(num_branches: int) -> Any:
    """The ``stablehlo.case`` op a cond lowering rule has just appended to the current block
    (the last one with ``num_branches`` regions), or None."""
    from jax._src.lib.mlir import ir

    try:
        block = ir.InsertionPoint.current.block
    except ValueError:
        return None
    ops = block.operations
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i].operation
        if op.name == "stablehlo.case" and len(op.regions) == num_branches:
            return op
    return None


@contextlib.contextmanager
def at_branch_end(case_op: Any, branch: int) -> Any:
    """Lowers what follows at the end of a lowered case op's ``branch``, before its return."""
    from jax._src.lib.mlir import ir

    block = case_op.regions[branch].blocks[0]
    ops = block.operations
    with ir.InsertionPoint(ops[len(ops) - 1]):
        yield


def distributed_client() -> Any:
    """The ``jax.distributed`` client (key-value store, barriers), or None if unavailable."""
    try:
        from jax._src import distributed as _distributed
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    client = getattr(getattr(_distributed, "global_state", None), "client", None)
    needed = ("key_value_set", "blocking_key_value_get")
    return client if all(hasattr(client, n) for n in needed) else None

