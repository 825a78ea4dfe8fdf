"""The one place sowtel touches JAX's private API.

Checked on the JAX versions in ``JAX_VERSIONS_CHECKED`` (0.10.2 through 0.12.x). Everything else
in sowtel imports JAX internals from here, and nothing else asks which JAX version runs, so a JAX
upgrade is a change to this file alone. Each function says what it relies on and what happens
when that is gone.

- ``emit_host_callback``: the fast host callback (``jax._src.callback.emit_python_callback``,
  ~2 µs a call); ``SOWTEL_CALLBACK=debug`` (or the private API missing) selects the public
  ``jax.debug.callback`` instead (~30 µs a call, same records).
- ``in_transpose``: whether user code runs inside a backward pass (custom_vjp ``bwd``), read from
  the name stack that JAX's ``backward_pass`` extends with ``transpose(...)``.
- ``enclosing_loops``: the lengths of the ``lax.scan`` calls tracing the current code, read from
  their frames (and from those of the scan rules that call user code again: ``_scan_jvp``,
  ``_scan_transpose``), so host-side records can carry iteration indices.
- ``in_custom_vjp_bwd``: whether a ``custom_vjp`` ``bwd`` is traced, from the frame of
  ``ad._custom_lin_transpose`` (0.12: also ``_custom_lin_transpose_fancy``); False if gone.
  ``custom_vjp_bwd_role`` also says whether a derivative the bwd takes (``ad.linearize`` /
  ``ad.jvp`` frames nearer) traces the code: forward code the bwd runs again.
- ``track_loop_lowerings`` / ``lowering_loops`` / ``expanding_scan3``: the scans and while
  loops around the equation being lowered, by lowering ``scan_p`` and ``while_p`` through
  JAX's own rules inside a note (``mlir._lowerings``), and the ``jax_scan3`` loops being
  expanded (``call_hi_primitive_p.to_lojax``); nothing is noted where they are gone.
- ``trace_as``: the debug info ``jax.jit(fun)`` gives (``api_util.debug_info``), set on a flat
  function as ``__fun_debug_info__``, so that tracing errors name the user's function.
- ``in_custom_jvp_function``: whether a ``custom_jvp`` function (not its rule) is traced, from
  the frames of ``custom_jvp.__call__`` and of its rule's wrapper ``_flatten_jvp``; False if
  gone.
- ``enclosing_map``: ``lax.map(batch_size=b)``'s length and batch size, from its frame, and
  the ``vmap`` calls inside it (frames of ``jax.vmap``'s ``vmap_f``).
- ``batched_branch_predicate``: under ``vmap`` of a ``cond`` with a batched predicate, the rows
  that take the branch being run, from the ``predicate`` local of ``_cond_batching_rule``; when
  it is gone, every row reports the branch's values (as before).
- ``wrap_cond_batching``, ``batched_cond_operands``, ``select_branch_inputs``,
  ``select_branch_outputs``, ``vmap_axis``: a rule in front of JAX's batching rule of
  ``cond`` (its ``fancy_primitive_batchers`` entry), doing what JAX's does for a batched
  predicate with JAX's own selects (``_bcast_select``, ``_bcast_select_n``); where the entry is
  gone, JAX's rule runs alone and nested sows report every row.
- ``current_trace`` / ``trace_encloses``: the trace a bind goes to, and whether a ``vmap``'s
  trace encloses it (``parent_trace`` links, a ``BatchTrace``'s ``tag``);
  ``in_fresh_jaxpr_trace``: whether it stages a jaxpr (``DynamicJaxprTrace``).
- ``traced_for``: what the innermost trace is tracing (``"while_cond"``, ``"scan"``, ...).
- ``manual_axes``: the mesh axes that are manual here (inside ``shard_map`` / ``pmap``).
- ``as_jaxpr`` / ``jaxpr_and_consts``: sub-jaxprs of an equation's parameters. JAX 0.10 wraps a
  ``Jaxpr`` and its constants in a ``ClosedJaxpr``; 0.11 merged the two (``ClosedJaxpr`` became an
  alias of ``Jaxpr``, its ``.jaxpr`` a legacy accessor returning itself); 0.12 removed the alias.
- ``construct`` / ``eqn_params`` / ``sub_jaxprs`` / ``call_body`` / ``eqn_context``: what the
  capture pass reads of an equation. JAX names one construct several ways (``pjit`` / ``jit``,
  ``remat2`` / ``checkpoint``, the ``eval_jaxpr`` call 0.12 stages where a checkpointed scan is
  differentiated), and the ``jax_scan3`` / ``jax_remat3`` upgrades hide the body in an object
  (``call_hi_primitive``'s ``_prim``): ``construct`` maps all of them to one construct name, and
  ``sub_jaxprs`` finds jaxprs inside those objects too, so a sow there is never missed.
- ``implementation`` / ``expand``: what a primitive sowtel has no construct rule for runs, as
  JAX code: a hi primitive's expansion (``to_lojax``: 0.12's ``custom_root``), else the rule
  ``def_impl`` gave it (``custom_linear_solve``, lineax's ``linear_solve``, a library's own
  ``jax.extend`` primitive), traced to a jaxpr. ``None`` where there is none, or where it only
  binds the primitive again (an impl that compiles the primitive by itself).
- ``scan3_over``: a ``jax_scan3`` loop rebuilt around a new body (``scan_nocarry``, the loop
  ``lax.scan`` builds under the flag), so it runs as JAX runs it. Up to 0.12 JAX's scan3 runs
  its iterations in order even when ``reverse=True`` (``SCAN3_REVERSES``).
- ``register_remat3_rule``: the rule ``jax_remat3``'s checkpoint applies to a primitive.
- ``scan_split_counts``: how many of a ``scan`` equation's inputs are constants and carries
  (``num_consts`` / ``num_carry`` up to 0.10, the flat trees ``ft_in`` / ``ft_out`` since 0.11).
- ``distributed_client``: the ``jax.distributed`` coordinator's client
  (``jax._src.distributed.global_state.client``), whose key-value store lets processes check
  that they agree; ``None`` when it is gone (then nothing is checked).
- ``wrap_cond_lowering`` / ``lowered_case_op`` / ``at_branch_end``: a lowering of ``cond``
  around JAX's own (``mlir._lowerings``, its ``branches`` parameter), and the
  ``stablehlo.case`` op it appended, to add operations at the end of a branch.
- ``effects_barrier``: ``jax.effects_barrier`` that returns, rather than raises, the error of an
  earlier failed computation (JAX re-raises it there: 0.12 once, 0.10 and 0.11 at every later
  barrier and at exit, as they keep the failed token).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import core as core
from jax._src import dispatch as dispatch
from jax._src import effects as effects
from jax._src import source_info_util
from jax._src.interpreters import ad as ad
from jax._src.interpreters import batching as batching
from jax._src.interpreters import mlir as mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow import conditionals as _conditionals
from jax._src.lax.control_flow import loops as _loops

try:  # The fast path; absent or renamed in other JAX versions.
    from jax._src import callback as _callback
    from jax._src import sharding_impls as _sharding_impls
    from jax._src.lib import xla_client as _xc

    _HAVE_FAST_CALLBACK = hasattr(_callback, "emit_python_callback")
except ImportError:  # pragma: no cover - depends on the JAX version
    _HAVE_FAST_CALLBACK = False

from sowtel._jax_compat._frames import (  # re-exported: jc.<name>
    SCAN3_REVERSES,
    SCAN_NOCARRY,
    SCAN_NOCARRY_CODE,
    batched_branch_predicate,
    batched_cond_operands,
    current_trace,
    custom_vjp_bwd_role,
    enclosing_loops,
    enclosing_map,
    in_custom_jvp_function,
    in_custom_vjp_bwd,
    in_flax_broadcast_trace,
    in_fresh_jaxpr_trace,
    select_branch_inputs,
    select_branch_outputs,
    trace_encloses,
    vmap_axis,
    wrap_cond_batching,
)
from sowtel._jax_compat._jaxprs import (  # re-exported: jc.<name>
    CLOSED,
    CLOSED_JAXPR,
    as_jaxpr,
    jaxpr_and_consts,
)
from sowtel._jax_compat._lowering import (  # re-exported: jc.<name>
    LOOP_NOTES,
    at_branch_end,
    branch_path,
    distributed_client,
    effects_barrier,
    expanding_scan3,
    lowered_case_op,
    lowering_loops,
    module_state,
    register_uncached_lowering,
    track_loop_lowerings,
    wrap_cond_lowering,
)

__all__ = [
    "ad", "batching", "core", "dispatch", "effects", "mlir", "pe",
    "allow_effect", "batched_branch_predicate", "callback_path", "emit_host_callback",
    "enclosing_loops", "enclosing_map", "in_custom_jvp_function", "in_custom_vjp_bwd",
    "closed_sub_jaxprs", "replace_closed_jaxprs",
    "in_transpose", "custom_vjp_bwd_role", "track_loop_lowerings", "lowering_loops",
    "lowering_in_transpose", "track_transposed_lowerings", "eqn_transposed",
    "current_name_stack",
    "backward_pass_names",
    "expanding_scan3", "trace_as",
    "requires_devices", "global_devices",
    "as_jaxpr", "branch_path", "distributed_client", "effects_barrier", "is_tracing",
    "jaxpr_and_consts", "manual_axes", "module_state", "register_uncached_lowering",
    "scan_split_counts", "traced_for", "wrap_cond_lowering", "lowered_case_op",
    "at_branch_end",
    "call_body", "construct", "eqn_context", "eqn_name", "eqn_params", "loop_parts",
    "register_remat3_rule", "scan3_over", "sub_jaxprs", "SCAN3_REVERSES",
    "implementation", "expand",
    "SCAN_NOCARRY",
    "SCAN_NOCARRY_CODE",
    "batched_cond_operands",
    "current_trace",
    "in_flax_broadcast_trace",
    "select_branch_inputs",
    "select_branch_outputs",
    "trace_encloses",
    "in_fresh_jaxpr_trace",
    "vmap_axis",
    "wrap_cond_batching",
    "CLOSED",
    "CLOSED_JAXPR",
    "LOOP_NOTES",
]

JAX_VERSIONS_CHECKED = ("0.10.2", "0.11.2", "0.12.0.1")


def callback_path() -> str:
    """``"fast"`` (emit_python_callback) or ``"debug"`` (jax.debug.callback): SOWTEL_CALLBACK."""
    choice = os.environ.get("SOWTEL_CALLBACK", "fast").strip().lower()
    if choice not in ("fast", "debug"):
        raise ValueError(
            f"SOWTEL_CALLBACK={choice!r} is not a callback path: use 'fast' or 'debug'"
        )
    return "fast" if (choice == "fast" and _HAVE_FAST_CALLBACK) else "debug"


def allow_effect(effect_type: type) -> None:
    """Lets an effect be lowered and appear in control flow, remat and custom derivatives."""
    for effect_set in (
        effects.lowerable_effects,
        effects.control_flow_allowed_effects,
        effects.remat_allowed_effects,
        effects.custom_derivatives_allowed_effects,
        effects.partial_eval_kept_effects,
    ):
        effect_set.add_type(effect_type)


def requires_devices(primitive: Any) -> None:
    """Programs holding ``primitive`` are lowered knowing their devices, as JAX's own callbacks
    are, so that a host callback can be placed on a chosen process's device."""
    dispatch.prim_requires_devices_during_lowering.add(primitive)


def global_devices(ctx: Any) -> tuple[Any, ...] | None:
    """Inside a lowering rule: the program's devices when it is automatically partitioned over
    the devices of several processes (``None`` otherwise, and inside ``shard_map``)."""
    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, _sharding_impls.ShardingContext):
        return None
    devices = axis_context.device_assignment or ()
    return tuple(devices) if len({d.process_index for d in devices}) > 1 else None


def _first_device_of(ctx: Any, process: int) -> int:
    """The program's logical id of the first device of ``process`` (0 when it has none)."""
    devices = getattr(ctx.module_context.axis_context, "device_assignment", None) or ()
    return next((i for i, d in enumerate(devices) if d.process_index == process), 0)


def _callback_sharding(ctx: Any, process: int = 0) -> tuple[Any, bool]:
    """The sharding a host callback needs here, and whether to use the fallback instead.

    Under automatic SPMD partitioning the callback runs once, on the first device of
    ``process`` (its operands, already reduced on device, are gathered there); inside a fully
    manual shard_map it runs per device.
    """
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        if set(axis_context.manual_axes) != set(axis_context.mesh.axis_names):
            return None, True  # partial-manual shard_map: jax.debug.callback handles it
        if _config.use_shardy_partitioner.value:
            return _callback._get_sdy_array_list_for_callbacks(ctx.avals_out), False
        op = _xc.OpSharding()
        op.type = _xc.OpSharding.Type.MANUAL
        return op, False
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        if _config.use_shardy_partitioner.value:
            device = _first_device_of(ctx, process)
            arr = _sharding_impls.SdyArray(mesh_shape=(), dim_shardings=(),
                                           logical_device_ids=(device,))
            return _sharding_impls.SdyArrayList((arr,)), False
        op = _xc.OpSharding()
        op.type = _xc.OpSharding.Type.MAXIMAL
        op.tile_assignment_dimensions = [1]
        op.tile_assignment_devices = [_first_device_of(ctx, process)]
        return op, False
    return None, False


def _partial_auto_axes(ctx: Any) -> tuple[str, ...]:
    """The mesh axes not manual here, inside a partially manual shard_map; else ``()``."""
    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        return ()
    manual = set(axis_context.manual_axes)
    return tuple(a for a in axis_context.mesh.axis_names if a not in manual)


def _on_first_of(auto: tuple[str, ...], emit: Callable[..., list[Any]]) -> Callable[..., Any]:
    """``emit`` run once per manual shard, on the first device along the ``auto`` axes.

    JAX's own lowering of ``jax.debug.callback`` there does the same but closes over the
    operands in an inner shard_map, which JAX refuses for values on ``Explicit`` mesh axes
    (checked on 0.10.2 and 0.12): here they are passed in, replicated first.
    """
    from jax.sharding import PartitionSpec

    def run(*args: Any) -> list[Any]:
        args = tuple(jax.sharding.reshard(a, PartitionSpec()) if _explicitly_sharded(a) else a
                     for a in args)

        def body(*a: Any) -> list[Any]:
            first = jax.lax.axis_index(auto) == 0
            jax.lax.cond(first, lambda: emit(*a), lambda: [])
            return []

        specs = tuple(PartitionSpec() for _ in args)
        return jax.shard_map(body, in_specs=specs, out_specs=[], axis_names=set(auto))(*args)

    return run


def _explicitly_sharded(x: Any) -> bool:
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(p is not None for p in spec)


_warned_fallback_process = False


def _warn_fallback_process(process: int) -> None:
    global _warned_fallback_process
    _warned_fallback_process = True
    logging.getLogger("sowtel").warning(
        "sowtel: the jax.debug.callback fallback (SOWTEL_CALLBACK=debug, or a partially manual "
        "shard_map) places the host callback of a global site where JAX does, on device 0: "
        "process 0 exports those records, not export_process=%d", process)


def emit_host_callback(
    ctx: Any, callback: Callable[..., None], operands: Sequence[Any], avals: Sequence[Any],
    *, process: int = 0,
) -> None:
    """Emits, inside a lowering rule, a call of ``callback(*numpy_arrays)`` with no results.

    The callback receives host numpy arrays. It must not raise (sowtel's receiver never does).
    Under automatic partitioning it runs in ``process`` (on its first device of the program);
    the ``jax.debug.callback`` fallback runs it where JAX puts it (device 0).
    """
    use_fallback = callback_path() == "debug"
    sharding = None
    if not use_fallback:
        sharding, use_fallback = _callback_sharding(ctx, process)
    if use_fallback:
        if process != 0 and not _warned_fallback_process:
            _warn_fallback_process(process)

        def via_debug_callback(*args: Any) -> list[Any]:
            jax.debug.callback(callback, *args)
            return []

        auto = _partial_auto_axes(ctx)
        if auto:
            via_debug_callback = _on_first_of(auto, via_debug_callback)
        mlir.lower_fun(via_debug_callback, multiple_results=True)(ctx, *operands)
        return

    def host_call(*args: Any) -> tuple[()]:
        callback(*args)
        return ()

    _callback.emit_python_callback(
        ctx, host_call, None, list(operands), list(avals), [],
        has_side_effect=True, returns_token=True, partitioned=False, sharding=sharding,
    )


def in_transpose() -> bool:
    """True while JAX runs a backward pass (a custom_vjp ``bwd`` is being called)."""
    stack = source_info_util.current_name_stack().stack
    return any(
        isinstance(s, source_info_util.Transform) and s.name == "transpose" for s in stack
    )


def _stack_transposed(ctx: Any) -> bool:
    stack = getattr(getattr(ctx, "name_stack", None), "stack", ())
    return any(isinstance(s, source_info_util.Transform) and s.name == "transpose"
               for s in stack)


def lowering_in_transpose(ctx: Any) -> bool:
    """True where the lowering context ``ctx`` lowers code of a backward pass: its name stack
    (``LoweringRuleContext.name_stack``, 0.10.2 to 0.12) holds the transform ``transpose``, or
    that of an equation lowered around it does (a jit, loop or cond body's lowering starts a
    name stack of its own; see :func:`track_transposed_lowerings`)."""
    return LOOP_NOTES.transposed > 0 or _stack_transposed(ctx)


def track_transposed_lowerings() -> None:
    """Makes :func:`lowering_in_transpose` see through the equations whose bodies are lowered
    with a name stack of their own: ``jit``, ``scan``, ``while``, ``cond`` and the call
    primitives lowered by ``mlir.core_call_lowering`` (0.12's ``eval_jaxpr``, ``closed_call``),
    by wrapping the lowering rule each has now (call it after any other wrapper of these
    rules), and any
    primitive whose lowering JAX caches (``mlir._cached_lowering_miss``, 0.10.2 to 0.12, which
    lowers it as a function of its own with an empty name stack: a library's solver, whose
    rule traces its implementation there)."""
    from jax._src import pjit as _pjit

    miss = getattr(mlir, "_cached_lowering_miss", None)
    if miss is not None and not getattr(miss, "_sowtel", False):
        def cached_lowering_miss(ctx: Any, eqn: Any, *args: Any, **params: Any) -> Any:
            transposed = eqn_transposed(eqn)
            LOOP_NOTES.transposed += transposed
            try:
                return miss(ctx, eqn, *args, **params)
            finally:
                LOOP_NOTES.transposed -= transposed

        cached_lowering_miss._sowtel = True  # type: ignore[attr-defined]
        mlir._cached_lowering_miss = cached_lowering_miss

    calls = [p for p, e in mlir._lowerings.items()
             if getattr(e.rule, "func", None) is getattr(mlir, "core_call_lowering", None)]
    for prim in (_pjit.jit_p, _loops.scan_p, _loops.while_p, _conditionals.cond_p, *calls):
        entry = mlir._lowerings[prim]

        def lowering(ctx: Any, *args: Any, _rule: Callable[..., Any] = entry.rule,
                     **params: Any) -> Any:
            transposed = _stack_transposed(ctx)
            LOOP_NOTES.transposed += transposed
            try:
                return _rule(ctx, *args, **params)
            finally:
                LOOP_NOTES.transposed -= transposed

        mlir.register_lowering(prim, lowering, inline=entry.inline)


def trace_as(flat_fun: Callable[..., Any], fun: Callable[..., Any], args: Sequence[Any],
             kwargs: dict[str, Any], dynamic: Sequence[int]) -> Callable[..., Any]:
    """``flat_fun``, which takes the leaves of ``(args, kwargs)`` at the positions ``dynamic``,
    made to trace under the name, source line and argument names that ``jax.jit(fun)`` gives
    (what tracing errors name).

    Sets ``__fun_debug_info__``, which ``api_util.debug_info`` returns as the function's debug
    info (0.10.2 to 0.12), to ``api_util.debug_info("jit", fun, args, kwargs)`` with the names
    of the dynamic leaves. Where that is gone, errors name ``flat_fun`` and its arguments.
    """
    try:
        from jax._src import api_util

        dbg = api_util.debug_info("jit", fun, args, kwargs)
        names = dbg.arg_names
        count = len(jax.tree_util.tree_leaves((args, kwargs)))
        picked = (tuple(names[i] for i in dynamic)
                  if names is not None and len(names) == count else None)
        flat_fun.__fun_debug_info__ = dbg._replace(arg_names=picked)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - only names for error messages are at stake
        pass
    return flat_fun


def is_tracing() -> bool:
    """True while JAX traces (inside jit, grad, vmap...); False when code runs eagerly."""
    return not isinstance(core.trace_ctx.trace, core.EvalTrace)


def traced_for() -> str | None:
    """What the innermost trace traces (``"scan"``, ``"while_cond"``, ``"jit"``, ...), if known."""
    trace = core.trace_ctx.trace
    frame = getattr(trace, "frame", None)
    dbg = getattr(frame, "debug_info", None)
    return getattr(dbg, "traced_for", None)




def manual_axes() -> tuple[str, ...]:
    """Mesh axes that are manual where this code is traced (inside shard_map or pmap)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(mesh.manual_axes)
    return tuple(a for a in mesh.axis_names if a in manual)



# The construct each higher-order primitive is, under every name JAX gives it.
_CONSTRUCTS = {
    "jit": "call", "pjit": "call", "closed_call": "call", "core_call": "call",
    "eval_jaxpr": "call",
    "custom_jvp_call": "custom_jvp",
    "custom_vjp_call": "custom_vjp", "custom_vjp_call_jaxpr": "custom_vjp",
    "remat2": "checkpoint", "checkpoint": "checkpoint",
    "scan": "scan", "while": "while", "cond": "cond", "shard_map": "shard_map",
}
# jax_scan3 / jax_remat3 bind call_hi_primitive with the construct as an object in _prim.
_HI_CONSTRUCTS = {"Scan3": "scan3", "RematTraced": "checkpoint"}
_HI_CALL = "call_hi_primitive"
# Where a "call" construct keeps its body.
_CALL_BODY = {"jit": "jaxpr", "pjit": "jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


def _hi_prim(eqn: Any) -> Any:
    return eqn.params.get("_prim") if eqn.primitive.name == _HI_CALL else None


def construct(eqn: Any) -> str | None:
    """The construct an equation is (``"call"``, ``"scan"``, ``"scan3"``, ``"checkpoint"``,
    ``"custom_jvp"``, ``"custom_vjp"``, ``"while"``, ``"cond"``, ``"shard_map"``), whatever
    JAX names it; ``None`` for a primitive the capture pass does not know.

    Example:
        >>> import jax
        >>> closed = jax.make_jaxpr(jax.jit(lambda x: x + 1))(1.0)
        >>> [construct(e) for e in closed.eqns]
        ['call']
    """
    hi = _hi_prim(eqn)
    if hi is not None:
        return _HI_CONSTRUCTS.get(type(hi).__name__)
    return _CONSTRUCTS.get(eqn.primitive.name)


def eqn_name(eqn: Any) -> str:
    """The name to show for an equation: its primitive's, or the class a hi primitive holds."""
    hi = _hi_prim(eqn)
    return type(hi).__name__ if hi is not None else str(eqn.primitive.name)


def eqn_params(eqn: Any) -> dict[str, Any]:
    """The construct's parameters: the equation's, or those of the object a hi primitive holds."""
    hi = _hi_prim(eqn)
    if hi is not None:
        return dict(getattr(hi, "params", {}))
    return dict(eqn.params)


def sub_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr an equation holds, in lists, tuples and hi primitives' objects included.

    Example:
        >>> import jax
        >>> pick = lambda x: jax.lax.cond(x > 0, jax.numpy.sin, jax.numpy.cos, x)
        >>> closed = jax.make_jaxpr(pick)(1.0)
        >>> len(sub_jaxprs(closed.eqns[-1]))
        2
    """
    found: list[Any] = []

    def walk(value: Any, depth: int) -> None:
        jaxpr = as_jaxpr(value)
        if jaxpr is not None:
            found.append(jaxpr)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item, depth)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth)
        elif depth < 2 and isinstance(getattr(value, "params", None), dict):
            walk(value.params, depth + 1)  # a hi primitive's object

    walk(eqn.params, 0)
    return found


def closed_sub_jaxprs(eqn: Any) -> list[Any]:
    """The closed jaxprs among an equation's parameters (in tuples and named tuples too): those
    :func:`replace_closed_jaxprs` can replace. A library's primitive holds its functions so
    (``custom_linear_solve``'s ``jaxprs``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> solve = lambda b: jax.lax.custom_linear_solve(lambda x: 2.0 * x, b,
        ...                                               lambda mv, r: r / 2.0)
        >>> eqn = jax.make_jaxpr(solve)(jnp.ones(2)).eqns[-1]
        >>> len(closed_sub_jaxprs(eqn)) >= 2
        True
    """
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, CLOSED):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)

    for value in eqn.params.values():
        walk(value)
    return found


def replace_closed_jaxprs(eqn: Any, replace: Callable[[Any], Any]) -> dict[str, Any]:
    """``eqn``'s parameters with each closed jaxpr of :func:`closed_sub_jaxprs` replaced by
    ``replace(closed)`` (same inputs and outputs), tuples and named tuples rebuilt as they were.
    Checked on JAX 0.10.2 and 0.12 (``custom_linear_solve``: a named tuple of closed jaxprs,
    some None; since 0.11 every jaxpr carries its consts, so every jaxpr is a closed one)."""
    def walk(value: Any) -> Any:
        if isinstance(value, CLOSED):
            return replace(value)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(walk(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(walk(v) for v in value)
        return value

    return {k: walk(v) for k, v in eqn.params.items()}


def implementation(eqn: Any) -> Callable[..., list[Any]] | None:
    """What an equation's primitive computes, as JAX code: ``f(*operands) -> [outputs]``.

    A hi primitive (``call_hi_primitive``, JAX >= 0.11) runs its object's expansion
    (``to_lojax``); any other primitive the rule ``def_impl`` gave it (read from the instance,
    where ``Primitive.def_impl`` stores it: the class's default only raises). None without one.
    Checked on JAX 0.10.2 and 0.12.
    """
    prim = eqn.primitive
    if _hi_prim(eqn) is not None:
        rule = getattr(prim, "to_lojax", None)
    else:
        rule = vars(prim).get("impl")
    if rule is None:
        return None
    params = dict(eqn.params)

    def run(*args: Any) -> list[Any]:
        out = rule(*args, **params)
        return list(out) if prim.multiple_results else [out]

    return run


def expand(eqn: Any, operands: Sequence[Any] | None = None) -> tuple[Any, list[Any]] | None:
    """``(jaxpr, consts)`` of what ``eqn`` runs (:func:`implementation`), traced on its
    ``operands`` (values or tracers; by default, its inputs' types). None where the primitive
    has no implementation, where tracing it fails, or where the implementation binds the
    primitive again (an impl that compiles the primitive alone, as ``scan``'s does): there is
    nothing there to look into.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> solve = lambda mv, b: b / 2.0
        >>> eqn = jax.make_jaxpr(lambda b: jax.lax.custom_linear_solve(
        ...     lambda x: 2.0 * x, b, solve))(jnp.ones(2)).eqns[0]
        >>> jaxpr, _ = expand(eqn)
        >>> [e.primitive.name for e in jaxpr.eqns]
        ['div']
    """
    run = implementation(eqn)
    if run is None:
        return None
    if operands is None:
        operands = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                         weak_type=getattr(v.aval, "weak_type", False))
                    for v in eqn.invars]
    try:
        with jax.disable_jit(False):
            closed = jax.make_jaxpr(run)(*operands)
    except Exception:  # noqa: BLE001 - an impl that does not trace: nothing to look into
        return None
    jaxpr, consts = jaxpr_and_consts(closed)
    return None if _binds(jaxpr, eqn) else (jaxpr, consts)


def _binds(jaxpr: Any, eqn: Any) -> bool:
    """Whether ``jaxpr`` (nested jaxprs included) binds ``eqn`` again: its primitive with the
    same parameters (a nested use of the primitive holds others)."""
    for inner in jaxpr.eqns:
        if inner.primitive is eqn.primitive and inner.params.keys() == eqn.params.keys() and all(
                inner.params[k] is v for k, v in eqn.params.items()):
            return True
        if any(_binds(sub, eqn) for sub in sub_jaxprs(inner)):
            return True
    return False


def call_body(eqn: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of the body of a ``"call"``, ``"custom_jvp"`` or ``"custom_vjp"``
    construct (called on its operands to give its outputs)."""
    key = _CALL_BODY.get(eqn.primitive.name, "call_jaxpr")
    return jaxpr_and_consts(eqn.params[key])


def eqn_context(eqn: Any) -> Any:
    """The context manager to bind an equation's primitive in (its ``ctx``, if it has one)."""
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def loop_parts(eqn: Any) -> dict[str, Any]:
    """What the capture pass reads of a loop or checkpoint construct, by construct:

    - ``"scan"``: ``body`` (jaxpr, consts), ``n_consts``, ``n_carry``, ``length``, ``reverse``,
      ``unroll``;
    - ``"scan3"``: ``body``, ``extensives`` (per operand: sliced per iteration, or not),
      ``length``, ``reverse``, ``unroll``;
    - ``"while"``: ``cond`` and ``body`` (jaxpr, consts), ``n_cond_consts``, ``n_body_consts``;
    - ``"checkpoint"``: ``body``, ``policy``, ``prevent_cse`` (one bool);
    - ``"cond"``: ``branches`` (a list of (jaxpr, consts); the operands follow the index);
    - ``"shard_map"``: ``body``, ``mesh``, ``in_specs``, ``out_specs``, ``manual`` (the axes
      it makes manual), ``check_vma``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> step = lambda c, x: (c + x, x)
        >>> closed = jax.make_jaxpr(lambda c: jax.lax.scan(step, c, jnp.ones(3)))(0.0)
        >>> parts = loop_parts(closed.eqns[-1])
        >>> parts["n_consts"], parts["n_carry"], parts["length"]
        (0, 1, 3)
    """
    kind = construct(eqn)
    p = eqn_params(eqn)
    if kind == "scan":
        n_consts, n_carry = scan_split_counts(p)
        return dict(body=jaxpr_and_consts(p["jaxpr"]), n_consts=n_consts, n_carry=n_carry,
                    length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    if kind == "scan3":
        return dict(body=jaxpr_and_consts(p["jaxpr"]), extensives=list(p["extensives"]),
                    length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    if kind == "while":
        return dict(cond=jaxpr_and_consts(p["cond_jaxpr"]), body=jaxpr_and_consts(p["body_jaxpr"]),
                    n_cond_consts=p["cond_nconsts"], n_body_consts=p["body_nconsts"])
    if kind == "checkpoint":
        # jax_remat3 may hold one prevent_cse flag per input; one for all is the safe reading.
        # (0.10's has none: JAX's default, True).
        prevent_cse = p.get("prevent_cse", True)
        prevent_cse = prevent_cse if isinstance(prevent_cse, bool) else True
        return dict(body=jaxpr_and_consts(p["jaxpr"]), policy=p["policy"], prevent_cse=prevent_cse)
    if kind == "cond":
        return dict(branches=[jaxpr_and_consts(b) for b in p["branches"]])
    if kind == "shard_map":
        return dict(body=jaxpr_and_consts(p["jaxpr"]), mesh=p["mesh"], in_specs=p["in_specs"],
                    out_specs=p["out_specs"], manual=p["newly_manual_axes"],
                    check_vma=p["check_vma"])
    raise ValueError(f"loop_parts: {eqn_name(eqn)!r} is not a loop, checkpoint, cond or shard_map")


def scan3_over(body: Callable[[list[Any]], Any], xs: list[Any], *, length: int,
               reverse: bool, unroll: Any) -> Any:
    """``body`` over the leading axis of ``xs``, stacking its outputs, as a ``jax_scan3`` loop:
    the loop ``lax.scan`` builds under that flag, so it runs as the original one does. The
    references the body closes over (the carry) are read and written as in the original.
    """
    assert SCAN_NOCARRY is not None, "a jax_scan3 loop on a JAX without scan3"
    return SCAN_NOCARRY(lambda x: body(list(x)), list(xs), length=length, reverse=reverse,
                         unroll=unroll)


def register_remat3_rule(prim: Any, rule: Callable[..., list[Any]]) -> None:
    """Makes ``jax_remat3``'s checkpoint run ``prim`` as ``rule(*args, **params)`` where it
    rematerialises it (its default binds ``prim`` again, unchanged), and as itself in the
    forward pass. Nothing happens on a JAX without ``jax_remat3``.
    """
    try:
        from jax._src.interpreters import remat as _remat
    except ImportError:  # pragma: no cover - depends on the JAX version
        return
    rules = getattr(_remat, "rules", None)
    if rules is None:  # pragma: no cover - depends on the JAX version
        return
    takes_trace = "custom_vjp_rules" in inspect.signature(_remat.RematTrace.__init__).parameters

    # 0.12: rule(trace, *args) -> (out, residuals, rem(residuals, *args));
    # 0.10: rule(policy, *args) -> (out, rem(*args)).
    def remat_rule(_trace_or_policy: Any, *args: Any, **kw: Any) -> Any:
        out = prim.bind(*args, **kw)
        if takes_trace:
            return out, None, lambda _res, *a: rule(*a, **kw)
        return out, lambda *a: rule(*a, **kw)

    rules[prim] = remat_rule


def scan_split_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: its inputs are consts, carry, xs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> step = lambda c, x: (c + x, c * x)
        >>> closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(step, c, xs))(0.0, jnp.ones(3))
        >>> [scan_split_counts(e.params) for e in closed.eqns if e.primitive.name == "scan"]
        [(0, 1)]
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)



# ---------------------------------------------------------------------------------------------
# Where an equation came from (locate_nonfinite): its user frames and its name stack.


def equation_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the user frames that traced ``eqn``, innermost first.

    Reads ``eqn.source_info.traceback`` through ``source_info_util.user_frames`` (frames outside
    JAX and the standard library); an empty list when JAX kept no traceback.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqn = jax.make_jaxpr(lambda x: jnp.log(x))(1.0).eqns[0]
        >>> [line for _, line, _ in equation_frames(eqn)][:1] != []
        True
    """
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return []
    return [(f.file_name, int(f.start_line), f.function_name)
            for f in source_info_util.user_frames(traceback)]


def equation_name_stack(eqn: Any) -> list[tuple[str, str]]:
    """The name stack of ``eqn`` as ``("scope" | "transform", name)`` pairs, outermost first.

    JAX's ``backward_pass`` adds the transform ``transpose`` and remat the scope
    ``rematted_computation``; ``jax.named_scope`` (and Flax's named calls) add scopes. The stack
    of an equation inside a sub-jaxpr (a scan body, a jit) is relative to the enclosing equation.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> eqns = jax.make_jaxpr(jax.grad(lambda x: jnp.sin(x) * 2.0))(1.0).eqns
        >>> ("transform", "transpose") in equation_name_stack(eqns[-1])
        True
    """
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return [("transform" if isinstance(e, source_info_util.Transform) else "scope", e.name)
            for e in stack]


def current_name_stack() -> list[tuple[str, str]]:
    """The name stack code traced now gets, as :func:`equation_name_stack` gives an equation's
    (``source_info_util.current_name_stack``, 0.10.2 to 0.12): the scopes entered around a
    call that is traced to a jaxpr of its own, whose equations do not carry them."""
    return [("transform" if isinstance(e, source_info_util.Transform) else "scope", e.name)
            for e in source_info_util.current_name_stack().stack]


def eqn_transposed(eqn: Any) -> bool:
    """Whether ``eqn``'s own name stack (relative to the equation around it, see
    :func:`equation_name_stack`) holds the transform ``transpose``: JAX's backward pass made it."""
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return any(isinstance(e, source_info_util.Transform) and e.name == "transpose"
               for e in stack)


def backward_pass_names() -> Any:
    """A context manager under which what is bound carries the transform ``transpose`` in its
    name stack, as JAX's backward pass gives it (``source_info_util.transform_name_stack``,
    0.10.2 to 0.12): the capture pass re-binds a backward pass's equations under it."""
    return source_info_util.transform_name_stack("transpose")


def explicit_sharding_of(x: Any) -> Any | None:
    """The sharding of a value laid out on explicit mesh axes (``AxisType.Explicit``), else
    None: a value made to stand in for it (a cond branch's filler) must carry the same type.

    Checked on JAX 0.10.2 and 0.12: ``aval.sharding`` is a ``NamedSharding`` whose mesh has
    ``axis_types``."""
    aval = getattr(x, "aval", x)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if spec is None or not types or explicit is None or all(p is None for p in spec):
        return None
    return sharding if any(t == explicit for t in types) else None
