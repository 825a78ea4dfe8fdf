"""``locate_nonfinite``: the operation that first turned finite values into a NaN or an infinity.

``locate_nonfinite(fn)(*args)`` traces ``fn`` (a whole training step, ``grad`` inside) to a
jaxpr and runs it again, compiled, with a check after every primitive: "are this equation's
outputs finite while its inputs were?". The checks are extra outputs of the one compiled
program (no host callback); on the host the first equation in program order that made a
non-finite value from finite inputs is named with what JAX recorded when it was traced:

- the primitive (``log``, ``div``, ``exp``...) and the user's file and line;
- the pass: ``"forward"`` or ``"backward"`` (an equation of the backward pass keeps the
  traceback of the forward line it differentiates, so the line is that forward line), and
  whether it recomputes a ``jax.checkpoint`` body there;
- the iteration of each enclosing ``lax.scan`` (the index into the scanned ``xs``, in the
  backward pass too) or ``while_loop``;
- the enclosing :func:`sowtel.scope` names, the other named scopes (Flax module paths when
  Flax names its calls, ``jax.named_scope``), and the sow site that ran last before it.

Inside ``custom_vjp``: the ``fwd`` equations are the forward pass; the ``bwd`` equations keep
the line of the call of the ``custom_vjp`` function. Under ``vmap`` the check covers the whole
batch. A ``where`` that hides a NaN (``jnp.where(x > 0, jnp.log(x), 0.0)``) still made one:
``report.events`` lists every such equation in program order, the harmless one first.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def loss(w, x):
    ...     h = jnp.tanh(x @ w)
    ...     return jnp.sum(jnp.log(h))              # log of a negative number
    >>> report = sowtel.locate_nonfinite(jax.grad(loss))(-jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> report.first.primitive, report.first.phase
    ('log', 'forward')
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sowtel import _jax_compat as jc
from sowtel import errors, naming
from sowtel._interpret import (
    Captured,
    CheckedEquation,
    LocatePass,
    any_flag,
    eval_locate,
    nonfinite_flag,
)
from sowtel.context import CONTEXT, Context
from sowtel.naming import check_tag

__all__ = ["NonFiniteEvent", "NonFiniteReport", "locate_nonfinite"]

_SOWTEL_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class NonFiniteEvent:
    """One equation that made a non-finite value from finite inputs.

    Attributes:
      primitive: the JAX primitive (``"log"``, ``"div"``, ...).
      file, line, function: where the user's code traced it (``None`` if JAX kept no traceback);
        for a backward-pass equation, the forward line it differentiates.
      phase: ``"forward"`` or ``"backward"``.
      recomputed: True for a ``jax.checkpoint`` body recomputed in the backward pass.
      loops: the kinds of the enclosing loops, outermost first (``("scan", "scan")``).
      iteration: the iteration of each enclosing loop, outermost first: for a scan the index
        into its ``xs`` (the layer of a scanned model, in either pass), for a while_loop the count.
      scopes: the enclosing ``sowtel.scope`` prefixes joined with ``/`` (``None`` outside any).
      module_path: the other named scopes joined with ``/`` (Flax module paths, ``named_scope``).
      site: the sow site that ran last before it, as ``"name (mode)"``.
      shape, dtype: of its first non-finite output.
      frames: every user frame, innermost first, as ``(file, line, function)``.
      name_stack: JAX's name stack of the equation, as text.
    """

    primitive: str
    file: str | None
    line: int | None
    function: str | None
    phase: str
    recomputed: bool
    loops: tuple[str, ...]
    iteration: tuple[int, ...]
    scopes: str | None
    module_path: str | None
    site: str | None
    shape: tuple[int, ...]
    dtype: str
    frames: tuple[tuple[str, int, str], ...]
    name_stack: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line} ({self.function})" if self.file else "unknown line"
        parts = [f"{self.primitive} at {where}, {self.phase} pass"]
        if self.recomputed:
            parts.append("recomputing a checkpoint")
        if self.iteration:
            parts.append(" ".join(f"{k} iteration {i}"
                                  for k, i in zip(self.loops, self.iteration, strict=True)))
        if self.scopes:
            parts.append(f"scope {self.scopes}")
        if self.module_path:
            parts.append(f"module {self.module_path}")
        if self.site:
            parts.append(f"after site {self.site}")
        parts.append(f"output {self.dtype}{list(self.shape)}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """What :func:`locate_nonfinite` found.

    Attributes:
      first: the first equation in program order that made a non-finite value from finite
        inputs, or ``None``.
      events: every such equation, in program order (``first`` is ``events[0]``).
      nonfinite_inputs: the key paths of arguments that were already non-finite.
      nonfinite_outputs: whether any output of ``fn`` is non-finite.
      result: ``fn(*args)``'s result.
    """

    first: NonFiniteEvent | None
    events: tuple[NonFiniteEvent, ...]
    nonfinite_inputs: tuple[str, ...]
    nonfinite_outputs: bool
    result: Any = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def found(self) -> bool:
        """True when some equation made a non-finite value."""
        return self.first is not None

    def __str__(self) -> str:
        lines = []
        if self.nonfinite_inputs:
            lines.append(f"non-finite inputs: {', '.join(self.nonfinite_inputs)}")
        if self.first is None:
            lines.append("no operation made a non-finite value from finite inputs")
        else:
            lines.append(f"first non-finite value: {self.first}")
            lines.extend(f"  then: {e}" for e in self.events[1:10])
            if len(self.events) > 10:
                lines.append(f"  ... and {len(self.events) - 10} more")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# From the flags back to the program.


def _order_key(slot: CheckedEquation, iteration: tuple[int, ...]) -> tuple[int, ...]:
    """Program order: equation indices, with each loop's iteration in the order it ran (the
    branches of a cond need no place: of one run of it, only one branch's checks can hit)."""
    key: list[int] = []
    it = iter(iteration)
    for level in slot.path:
        if isinstance(level, tuple):
            _, length, reverse = level
            i = next(it)
            key.append(length - 1 - i if reverse else i)
        else:
            key.append(level)
    return tuple(key)


def _location(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's own code: not sowtel, not an installed package."""
    for f in frames:
        path = os.path.abspath(f[0])
        if not path.startswith(_SOWTEL_DIR) and "-packages" + os.sep not in path:
            return f
    return frames[0] if frames else None


def _event(slot: CheckedEquation, iteration: tuple[int, ...], shape: tuple[int, ...],
           dtype: str) -> NonFiniteEvent:
    frames = jc.equation_frames(slot.eqn)
    where = _location(frames)
    scopes, modules = [], []
    for kind, name in slot.stack:
        if kind != "scope" or name == "rematted_computation":
            continue
        if name.startswith(naming.SCOPE_MARK):
            scopes.append(name[len(naming.SCOPE_MARK):])
        else:
            modules.append(name)
    text = "/".join(f"{n}()" if k == "transform" else n for k, n in slot.stack)
    return NonFiniteEvent(
        primitive=slot.eqn.primitive.name,
        file=where[0] if where else None, line=where[1] if where else None,
        function=where[2] if where else None,
        phase="backward" if ("transform", "transpose") in slot.stack else "forward",
        recomputed=("scope", "rematted_computation") in slot.stack,
        loops=tuple(level[0] for level in slot.path if isinstance(level, tuple)),
        iteration=iteration,
        scopes="/".join(scopes) or None, module_path="/".join(modules) or None,
        site=slot.site, shape=shape, dtype=dtype, frames=tuple(frames), name_stack=text,
    )


def _key_text(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<argument>"


def locate_nonfinite(fn: Callable[..., Any], *,
                     tag: str = "intermediates") -> Callable[..., NonFiniteReport]:
    """Wraps ``fn`` to find the first operation that made a NaN or an infinity.

    ``locate_nonfinite(fn)(*args, **kwargs)`` traces ``fn`` (put ``jax.grad`` and the optimizer
    update inside it), compiles it with a finiteness check after every primitive returned as
    extra outputs, runs it once and returns a :class:`NonFiniteReport`: ``report.first`` names
    the primitive, the file and line, the pass (forward or backward), the scan iterations, the
    ``sowtel.scope`` and named-scope paths and the last sow site; ``report.result`` is
    ``fn``'s result. Arguments that are not arrays act as static arguments. The program it runs
    is larger than ``fn``'s (one reduction per primitive): a debugging tool, not a monitor.
    Sows with tag ``tag`` mark where each event is (``event.site``); streaming is off inside.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def f(xs):
        ...     def layer(c, x):
        ...         return c * x, jnp.sqrt(c * x)     # sqrt of a negative at iteration 2
        ...     return jax.lax.scan(layer, 1.0, xs)[1].sum()
        >>> report = sowtel.locate_nonfinite(f)(jnp.array([2.0, 1.0, -1.0]))
        >>> report.first.primitive, report.first.iteration
        ('sqrt', (2,))
    """
    if not callable(fn):
        raise errors.NotCallableError(fn, "locate_nonfinite",
                                      "locate_nonfinite(train_step)(params, batch)")
    check_tag(tag)
    from sowtel.capture import over_dynamic, trace_flat  # capture imports the session stack

    def wrapped(*args: Any, **kwargs: Any) -> NonFiniteReport:
        flat = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
        paths = [p for p, _ in flat]
        # Python floats are static, as in save_intermediates (capture.is_dynamic): one that is
        # not finite is still a non-finite input.
        dyn, dynamic, merged = over_dynamic(fn, args, kwargs)

        with naming.scopes_in_name_stack(), CONTEXT(Context(capture=tag)):
            jaxpr, consts, out_tree = trace_flat(merged, dyn, (fn, args, kwargs, dynamic))
        meta: list[Captured] = []

        def checked(consts: list[Any], dyn: list[Any]) -> Any:
            arg_bads = [jnp.asarray(nonfinite_flag(x), bool) for x in dyn]
            outs, caps = eval_locate(jaxpr, consts, dyn, LocatePass())
            meta[:] = caps
            out_bad = jnp.asarray(any_flag(nonfinite_flag(o) for o in outs), bool)
            return outs, out_bad, arg_bads, [c.leaves for c in caps]

        outs, out_bad, arg_bads, flags = jax.jit(checked)(consts, dyn)
        flags = jax.device_get(flags)
        hits = []
        for cap, (hit, *iters) in zip(meta, flags, strict=True):
            if bool(hit):
                iteration = tuple(int(i) for i in iters)
                hits.append((_order_key(cap.site, iteration), cap.site, iteration))
        hits.sort(key=lambda h: h[0])
        events = []
        for _, slot, iteration in hits:
            aval = next((v.aval for v in slot.eqn.outvars
                         if jnp.issubdtype(v.aval.dtype, jnp.inexact)), slot.eqn.outvars[0].aval)
            events.append(_event(slot, iteration, tuple(aval.shape), str(aval.dtype)))
        bad_at = {i for i, b in zip(dynamic, arg_bads, strict=True) if bool(b)}
        bad_at.update(i for i, (_, x) in enumerate(flat)
                      if isinstance(x, float) and not math.isfinite(x))
        bad_inputs = tuple(_key_text(paths[i]) for i in sorted(bad_at))
        return NonFiniteReport(
            first=events[0] if events else None, events=tuple(events),
            nonfinite_inputs=bad_inputs, nonfinite_outputs=bool(out_bad),
            result=jax.tree_util.tree_unflatten(out_tree, outs),
        )

    return wrapped
