"""What JAX's frames and traces say where sowtel's code runs: the loops, maps, custom rules and
vmapped conds around a bind, found from the frames of JAX's own functions (checked on JAX
0.10.2, 0.11.2 and 0.12.0.1; where a function is gone, each lookup answers "not there" and
sowtel falls back as its docs say). Part of :mod:`sowtel._jax_compat`, which re-exports it."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
from jax._src import api as _api
from jax._src import core as core
from jax._src import custom_derivatives as _custom
from jax._src import dispatch as dispatch
from jax._src import effects as effects
from jax._src.interpreters import ad as ad
from jax._src.interpreters import batching as batching
from jax._src.interpreters import mlir as mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.lax.control_flow import loops as _loops

# The functions are wrapped by JAX's traceback filtering; the frames are those of the originals.
_SCAN_CODE = inspect.unwrap(_loops.scan).__code__
_WHILE_CODE = inspect.unwrap(_loops.while_loop).__code__
# Under jax_scan3, lax.scan hands the loop to scan_nocarry, which knows the length when the
# caller gave none.
SCAN_NOCARRY = getattr(_loops, "scan_nocarry", None)
SCAN_NOCARRY_CODE = inspect.unwrap(SCAN_NOCARRY).__code__ if SCAN_NOCARRY else None
#: Whether a jax_scan3 loop honours ``reverse=True``: not on the JAX versions checked (its
#: expansion walks the iterations in order), so records are indexed in the order that ran.
SCAN3_REVERSES = False
_MAP_CODE = inspect.unwrap(_loops.map).__code__
# The function jax.vmap returns: one frame per vmap being traced.
_VMAP_CALL = next((c for c in inspect.unwrap(_api.vmap).__code__.co_consts
                   if getattr(c, "co_name", None) == "vmap_f"), None)


def _codes(module: Any, *names: str) -> frozenset[Any]:
    """The code objects of the functions of ``module`` that exist in this JAX version (of the
    generator a ``linear_util.transformation2``, a curried partial, holds)."""
    found = [getattr(module, n, None) for n in names]
    found = [f.args[0] if isinstance(f, functools.partial) and f.args else f for f in found]
    return frozenset(inspect.unwrap(f).__code__ for f in found if f is not None)


# JAX rules that call user code again while transforming a scan or a while_loop: a custom_jvp
# rule or custom_vjp fwd is traced when a scan's body is differentiated (_scan_jvp,
# _scan_linearize), a custom_vjp bwd when it is transposed (_scan_transpose*), after the
# lax.scan frame has gone.
_SCAN_JVP = _codes(_loops, "_scan_jvp", "_scan_linearize")
_SCAN_TRANSPOSE = _codes(_loops, "_scan_transpose", "_scan_transpose_fancy")
_WHILE_RULES = _codes(_loops, "_while_loop_jvp")
# vmap of a scan rebinds it with a batched copy of its body: a scan rule called from there (a
# jvp under grad(vmap(scan))) holds that copy, which the lax.scan frame above never saw.
_SCAN_BATCH = _codes(_loops, "_scan_batching_rule")
# A custom_vjp bwd runs inside these (0.10: _custom_lin_transpose; 0.12 also the _fancy one).
_CUSTOM_BWD = _codes(ad, "_custom_lin_transpose", "_custom_lin_transpose_fancy")


def enclosing_loops() -> tuple[tuple[int, bool], ...] | None:
    """``((length, reverse), ...)`` of the scans the current code runs in, outermost first.

    ``None`` when a ``while_loop`` encloses the code directly (its iteration count is not
    static, so records get no index); the scans inside a while body, and only those, count.
    Reads the ``length`` and ``reverse`` locals of ``lax.scan``'s frame,
    and of the scan rules that call user code again (a ``custom_jvp`` rule under ``grad``, a
    ``custom_vjp`` ``bwd`` in a transposed scan, which runs in reverse). A scan met twice (its
    ``lax.scan`` frame and its jvp rule) is counted once: both hold the same ``jaxpr``, or the
    outer frame holds the copy the inner one transforms (``vmap``'s batched body under
    ``grad(vmap(scan))``, the primal half of a linearized body under jvp-of-grad).
    """
    return _loops_from(sys._getframe(1))


def _loops_from(frame: Any) -> tuple[tuple[int, bool], ...] | None:
    loops: list[tuple[int, bool]] = []
    seen: set[int] = set()
    in_scan3 = False  # inside scan_nocarry: the lax.scan frame above it is the same loop
    while frame is not None:
        code = frame.f_code
        if code is _WHILE_CODE or code in _WHILE_RULES:
            # A while_loop's iterations are not static, so they have no index; the scans inside
            # its body still index theirs (they run whole on each iteration).
            return tuple(reversed(loops)) if loops else None
        if code in _SCAN_BATCH:
            local = frame.f_locals
            if "jaxpr" in local and _rebound_copy_seen(local, seen):
                seen.add(id(local["jaxpr"]))  # the same loop, seen in its batched copy
            frame = frame.f_back
            continue
        if code is _SCAN_CODE and in_scan3:
            in_scan3 = False
            frame = frame.f_back
            continue
        is_scan = code is _SCAN_CODE or code in _SCAN_JVP or code is SCAN_NOCARRY_CODE
        if is_scan or code in _SCAN_TRANSPOSE:
            local = frame.f_locals
            length = local.get("length")
            if not isinstance(length, int):
                return None
            body = id(local["jaxpr"]) if "jaxpr" in local else id(frame)
            # Counted already where a rule further in transforms the copy this frame rebinds.
            if body not in seen and not _rebound_copy_seen(local, seen):
                reverse = bool(local.get("reverse", False))
                if code is SCAN_NOCARRY_CODE:
                    in_scan3 = True
                    reverse = reverse and SCAN3_REVERSES
                loops.append((length, reverse if is_scan else not reverse))
            seen.add(body)
        frame = frame.f_back
    return tuple(reversed(loops))


def _rebound_copy_seen(local: dict[str, Any], seen: set[int]) -> bool:
    """Whether a scan rule's frame holds, besides its own ``jaxpr``, the body of a rule met
    further in: the copy it rebinds the loop with (batched by vmap, the primal half of a
    linearized scan), which JAX then transforms again (``grad(vmap(scan))``, jvp-of-grad).
    That rule's loop is this one, already counted. A rule's locals hold its own loop's bodies
    only (a nested scan's body sits inside their equations), so any match is this loop."""
    body = local.get("jaxpr")
    return any(id(v) in seen for v in local.values() if v is not body)  # identity, not equality


def in_custom_vjp_bwd() -> bool:
    """True while a ``custom_vjp`` ``bwd`` is traced, wherever it sits (inside a scan, a cond or
    a checkpoint, or jitted itself: there the name stack no longer says ``transpose``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CUSTOM_BWD:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def custom_vjp_bwd_role() -> str | None:
    """Where the code traced now sits with respect to a ``custom_vjp`` ``bwd``: ``None`` outside
    any; ``"bwd"`` in the bwd's own code; ``"rerun"`` inside a derivative the bwd takes itself
    (``jax.vjp``, ``jax.grad``, ``jax.linearize``, ``jax.jvp`` of a function, called in the bwd):
    forward code that the bwd runs again to differentiate it. Read from the frames of
    ``ad._custom_lin_transpose`` (``_fancy`` on 0.12) and of ``ad.linearize`` / ``ad.jvp``
    (which trace the function being differentiated); ``None`` when they are gone."""
    frame = sys._getframe(1)
    derivative = False
    while frame is not None:
        code = frame.f_code
        if code in _CUSTOM_BWD:
            return "rerun" if derivative else "bwd"
        if code in _DERIVATIVES:
            derivative = True
        frame = frame.f_back  # type: ignore[assignment]
    return None


# custom_jvp.__call__ traces the function (and, under a derivative, calls the rule, which
# _flatten_jvp wraps): the nearer of the two frames says which one runs. A derivative that
# starts inside the function (ad.jvp, ad.linearize: jax.jvp, jax.grad, jax.vjp...) is its own.
_CUSTOM_JVP_CALL = inspect.unwrap(_custom.custom_jvp.__call__).__code__
_CUSTOM_JVP_RULE = _codes(_custom, "_flatten_jvp")
_DERIVATIVES = _codes(ad, "jvp", "linearize")


def in_custom_jvp_function() -> bool:
    """True while the function of a ``custom_jvp`` is traced (also when its rule calls it), not
    its rule (a sow in a rule belongs to the rule: ``capture`` refuses it where it is lost),
    nor a derivative taken inside the function (``jax.grad`` of a sowing function there)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in _CUSTOM_JVP_RULE or code in _DERIVATIVES:
            return False
        if code is _CUSTOM_JVP_CALL:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def in_flax_broadcast_trace() -> bool:
    """True while Flax's ``nn.scan`` traces its body once to find the loop-invariant
    (broadcast) outputs, not the loop itself.

    Flax 0.12.12 (``flax.core.axes_scan.scan``, ``body_fn(..., init_mode=True)``) traces that
    body to a jaxpr, removes dead code and refuses any equation left that reads the carry or the
    scanned inputs: an effectful sow is never dead, so it would be refused. Read from the
    frame's ``init_mode`` local; False when Flax is absent or changed (then such a sow fails as
    before, in Flax's check).
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (code.co_name == "body_fn" and code.co_filename.endswith(_FLAX_AXES_SCAN)
                and frame.f_locals.get("init_mode") is True):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def enclosing_map() -> tuple[int, int, int, bool, int, int] | None:
    """``(key, length, batch_size, remainder, outer, vmaps)`` when this code runs in
    ``lax.map(batch_size=b)``.

    ``lax.map`` runs ``n // b`` batches in a scan over a ``vmap``, then the ``n % b`` left in one
    more ``vmap`` (``remainder``: its local ``scan_ys`` is set by then); ``key`` tells the call
    apart from others, ``outer`` counts the scans around it, ``vmaps`` the ``vmap`` calls
    between it and the code (its own included: the frames of ``jax.vmap``'s ``vmap_f``).
    ``None`` outside such a map, or with ``batch_size`` 0 or ``>= n``.
    """
    frame = sys._getframe(1)
    vmaps = 0
    while frame is not None:
        if frame.f_code is _VMAP_CALL:
            vmaps += 1
        if frame.f_code is _MAP_CODE:
            local = frame.f_locals
            size, xs = local.get("batch_size"), jax.tree_util.tree_leaves(local.get("xs"))
            if not size or not xs or local.get("scan_xs", 0) is None:
                return None
            outer = len(_loops_from(frame) or ())
            return id(frame), int(xs[0].shape[0]), int(size), "scan_ys" in local, outer, vmaps
        frame = frame.f_back  # type: ignore[assignment]
    return None


# vmap of a cond whose predicate is batched runs every branch on every row, then selects:
# while it runs branch i, its frame holds ``predicate`` (index == i, per row).
_COND_BATCHING = _codes(_conditionals, "_cond_batching_rule")


def batched_branch_predicate(depth: int = 8) -> tuple[Any, int, int] | None:
    """``(taken, cond key, branch)`` while a vmapped cond runs one of its branches on every row:
    ``taken`` says per row whether the row takes it. None elsewhere.

    Looked for only a few frames up: the branch's equations are bound straight from the rule.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code in _COND_BATCHING:
            local = frame.f_locals
            if "predicate" not in local or not isinstance(local.get("i"), int):
                return None
            return local["predicate"], id(frame), local["i"]
        frame = frame.f_back  # type: ignore[assignment]
    return None


def wrap_cond_batching(rule: Callable[..., Any]) -> None:
    """Puts ``rule(original, axis_data, args, dims, **params)`` in front of JAX's batching rule
    of ``cond`` (a ``fancy_primitive_batchers`` entry, checked on JAX 0.10.2 and 0.12). Where
    the entry is not there, nothing changes."""
    original = batching.fancy_primitive_batchers.get(_conditionals.cond_p)
    if original is None or getattr(original, "_sowtel_wrapped", False):
        return

    def batch_cond(axis_data: Any, args: Any, dims: Any, **params: Any) -> Any:
        return rule(original, axis_data, args, dims, **params)

    batch_cond._sowtel_wrapped = True  # type: ignore[attr-defined]
    batching.fancy_primitive_batchers[_conditionals.cond_p] = batch_cond


def batched_cond_operands(axis_data: Any, args: Any, dims: Any) -> list[Any]:
    """A vmapped cond's index and operands, each with its batch axis first (as JAX's rule)."""
    return [batching.bdim_at_front(x, d, axis_data.size,
                                   mesh_axis=getattr(axis_data, "explicit_mesh_axis", None))
            for x, d in zip(args, dims, strict=True)]


def select_branch_inputs(taken: Any, x: Any) -> Any:
    """``x`` where a row takes the branch, ``stop_gradient(x)`` elsewhere (JAX's rule does so,
    for reverse-mode autodiff's sake)."""
    return _conditionals._bcast_select(taken, x, jax.lax.stop_gradient(x))


def select_branch_outputs(index: Any, outs: list[Any]) -> Any:
    """Per row, the output of the branch ``index`` names (JAX's rule's select)."""
    return _conditionals._bcast_select_n(index, *outs)


_STAGING_TRACE: Any = getattr(_pe, "DynamicJaxprTrace", ())


def current_trace() -> Any:
    """The trace that binding a primitive here goes to."""
    return core.trace_ctx.trace


def in_fresh_jaxpr_trace() -> bool:
    """Whether binding here goes to a trace staging a jaxpr (as a ``custom_jvp`` function's own,
    which ``jax.jit``-style tracing makes), not to a ``vmap``, ``jvp`` or eager one. Checked on
    JAX 0.10.2 and 0.12; where ``DynamicJaxprTrace`` is gone, False (such a site then reports
    every row, as before)."""
    return isinstance(core.trace_ctx.trace, _STAGING_TRACE)


def _same_vmap(here: Any, trace: Any) -> bool:
    tag = getattr(trace, "tag", None)
    return isinstance(here, batching.BatchTrace) and tag is not None and here.tag is tag


def trace_encloses(trace: Any, depth: int = 200) -> bool:
    """Whether ``trace`` is the current trace or one it traces inside (its parents, as
    ``parent_trace`` links them: a body traced inside ``vmap`` has the ``vmap``'s trace there;
    a batching rule runs in the trace below its own). A trace of the same ``vmap`` counts as
    ``trace``: ``vmap`` runs a ``custom_jvp`` function in one of its own."""
    here = core.trace_ctx.trace
    for _ in range(depth):
        if here is None:
            return False
        if here is trace or _same_vmap(here, trace):
            return True
        here = getattr(here, "parent_trace", None)
    return False


def vmap_axis(axis_data: Any) -> dict[str, Any]:
    """``jax.vmap`` keywords that recreate the ``vmap`` a batching rule runs under."""
    return {"axis_name": getattr(axis_data, "name", None),
            "axis_size": axis_data.size,
            "spmd_axis_name": getattr(axis_data, "spmd_name", None)}


_FLAX_AXES_SCAN = os.path.join("flax", "core", "axes_scan.py")
