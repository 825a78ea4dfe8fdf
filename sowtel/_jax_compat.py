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
  their frames, so host-side records can carry iteration indices.
- ``traced_for``: what the innermost trace is tracing (``"while_cond"``, ``"scan"``, ...).
- ``manual_axes``: the mesh axes that are manual here (inside ``shard_map`` / ``pmap``).
- ``as_jaxpr`` / ``jaxpr_and_consts``: sub-jaxprs of an equation's parameters. JAX 0.10 wraps a
  ``Jaxpr`` and its constants in a ``ClosedJaxpr``; 0.11 merged the two (``ClosedJaxpr`` became an
  alias of ``Jaxpr``, its ``.jaxpr`` a legacy accessor returning itself); 0.12 removed the alias.
- ``scan_split_counts``: how many of a ``scan`` equation's inputs are constants and carries
  (``num_consts`` / ``num_carry`` up to 0.10, the flat trees ``ft_in`` / ``ft_out`` since 0.11).
- ``distributed_client``: the ``jax.distributed`` coordinator's client
  (``jax._src.distributed.global_state.client``), whose key-value store lets processes check
  that they agree; ``None`` when it is gone (then nothing is checked).
- ``effects_barrier``: ``jax.effects_barrier`` that returns, rather than raises, the error of an
  earlier failed computation (JAX re-raises it there: 0.12 once, 0.10 and 0.11 at every later
  barrier and at exit, as they keep the failed token).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
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
from jax._src.lax.control_flow import loops as _loops

try:  # The fast path; absent or renamed in other JAX versions.
    from jax._src import callback as _callback
    from jax._src import sharding_impls as _sharding_impls
    from jax._src.lib import xla_client as _xc

    _HAVE_FAST_CALLBACK = hasattr(_callback, "emit_python_callback")
except ImportError:  # pragma: no cover - depends on the JAX version
    _HAVE_FAST_CALLBACK = False

__all__ = [
    "ad", "batching", "core", "dispatch", "effects", "mlir", "pe",
    "allow_effect", "callback_path", "emit_host_callback", "enclosing_loops", "in_transpose",
    "requires_devices", "global_devices",
    "as_jaxpr", "branch_path", "distributed_client", "effects_barrier", "is_tracing",
    "jaxpr_and_consts", "manual_axes", "module_state", "register_uncached_lowering",
    "scan_split_counts", "traced_for",
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


def is_tracing() -> bool:
    """True while JAX traces (inside jit, grad, vmap...); False when code runs eagerly."""
    return not isinstance(core.trace_ctx.trace, core.EvalTrace)


def traced_for() -> str | None:
    """What the innermost trace traces (``"scan"``, ``"while_cond"``, ``"jit"``, ...), if known."""
    trace = core.trace_ctx.trace
    frame = getattr(trace, "frame", None)
    dbg = getattr(frame, "debug_info", None)
    return getattr(dbg, "traced_for", None)


# The functions are wrapped by JAX's traceback filtering; the frames are those of the originals.
_SCAN_CODE = inspect.unwrap(_loops.scan).__code__
_WHILE_CODE = inspect.unwrap(_loops.while_loop).__code__


def enclosing_loops() -> tuple[tuple[int, bool], ...] | None:
    """``((length, reverse), ...)`` of the scans tracing this code, outermost first.

    ``None`` when a ``while_loop`` encloses the code (its iteration count is not static, so
    records get no index). Reads the ``length`` and ``reverse`` locals of ``lax.scan``'s frame.
    """
    loops: list[tuple[int, bool]] = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _WHILE_CODE:
            return None
        if code is _SCAN_CODE:
            length = frame.f_locals.get("length")
            if not isinstance(length, int):
                return None
            loops.append((length, bool(frame.f_locals.get("reverse", False))))
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(reversed(loops))


def manual_axes() -> tuple[str, ...]:
    """Mesh axes that are manual where this code is traced (inside shard_map or pmap)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(mesh.manual_axes)
    return tuple(a for a in mesh.axis_names if a in manual)


# A distinct ClosedJaxpr class exists up to JAX 0.10 only: since 0.11 a Jaxpr carries its consts.
_CLOSED_JAXPR: Any = getattr(core, "ClosedJaxpr", None)
if _CLOSED_JAXPR is core.Jaxpr:
    _CLOSED_JAXPR = None


def as_jaxpr(value: Any) -> Any:
    """The jaxpr to walk if ``value`` (an equation parameter) is a jaxpr, closed or not; else None.

    Example:
        >>> import jax
        >>> closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
        >>> [e.primitive.name for e in as_jaxpr(closed).eqns], as_jaxpr(3)
        (['add'], None)
    """
    if _CLOSED_JAXPR is not None and isinstance(value, _CLOSED_JAXPR):
        return value.jaxpr
    return value if isinstance(value, core.Jaxpr) else None


def jaxpr_and_consts(value: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of a jaxpr, closed or not: evaluate ``jaxpr`` with ``consts`` bound
    to its ``constvars`` (an open jaxpr has none).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr, consts = jaxpr_and_consts(jax.make_jaxpr(lambda x: x + jnp.arange(2.0))(1.0))
        >>> len(jaxpr.constvars) == len(consts), len(jaxpr.invars)
        (True, 1)
    """
    if _CLOSED_JAXPR is not None and isinstance(value, _CLOSED_JAXPR):
        return value.jaxpr, list(value.consts)
    return value, list(getattr(value, "consts", ()))


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


def distributed_client() -> Any:
    """The ``jax.distributed`` client (key-value store, barriers), or None if unavailable."""
    try:
        from jax._src import distributed as _distributed
    except ImportError:  # pragma: no cover - depends on the JAX version
        return None
    client = getattr(getattr(_distributed, "global_state", None), "client", None)
    needed = ("key_value_set", "blocking_key_value_get")
    return client if all(hasattr(client, n) for n in needed) else None


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
