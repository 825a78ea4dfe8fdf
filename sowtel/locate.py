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
import numpy as np

from sowtel import _jax_compat as jc
from sowtel import naming
from sowtel.context import CONTEXT, Context
from sowtel.naming import check_tag
from sowtel.primitive import sow_p

__all__ = ["NonFiniteEvent", "NonFiniteReport", "locate_nonfinite"]

# One level of an equation's position: (equation index, cond branch, enclosing loop) where the
# loop is (kind, length, reverse) for the scan or while_loop equation at that index.
_Loop = tuple[str, int, bool]
_Level = tuple[int, int, "_Loop | None"]

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
# Flags: whether a value holds a non-finite element. Python False stands for "cannot" (integer
# values, finite literals), so no check is compiled for them.


def _bad(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
        return False
    if isinstance(x, np.ndarray | np.generic):
        return bool(not np.isfinite(x).all())
    return jnp.logical_not(jnp.all(jnp.isfinite(x)))


def _any(flags: list[Any]) -> Any:
    acc: Any = False
    for f in flags:
        if f is True:
            return True
        if f is not False:
            acc = f if acc is False else jnp.logical_or(acc, f)
    return acc


def _as_array(flag: Any) -> Any:
    return jnp.asarray(flag, dtype=bool)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """An equation checked at run time: where it is, and what JAX knew of it when traced."""

    eqn: Any
    path: tuple[_Level, ...]
    stack: tuple[tuple[str, str], ...]
    site: str | None

    def under(self, index: int, branch: int = 0, loop: _Loop | None = None) -> _Slot:
        return dataclasses.replace(self, path=((index, branch, loop), *self.path))

    def placed(self, index: int) -> _Slot:
        """Fills in the equation index of the outermost level (see ``_placeholder``)."""
        _, branch, loop = self.path[0]
        return dataclasses.replace(self, path=((index, branch, loop), *self.path[1:]))


# A slot's run-time flag: (hit, iterations of the enclosing loops, outermost first).
_Flag = tuple[Any, tuple[Any, ...]]


class _Walk:
    """Evaluates a jaxpr, checking every primitive; control flow keeps the checks per iteration."""

    def __init__(self) -> None:
        self.site: str | None = None  # the last sow site traced

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any], arg_bads: list[Any],
            stack: tuple[tuple[str, str], ...]) -> tuple[list[Any], list[Any], list[_Slot],
                                                           list[_Flag]]:
        env: dict[Any, tuple[Any, Any]] = {}

        def read(v: Any) -> tuple[Any, Any]:
            if isinstance(v, jc.core.Literal):
                return v.val, _bad(np.asarray(v.val))
            return env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = (x, _bad(x))
        for v, x, b in zip(jaxpr.invars, args, arg_bads, strict=True):
            env[v] = (x, b)
        slots: list[_Slot] = []
        flags: list[_Flag] = []
        for k, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            invals, in_bads = [x for x, _ in ins], [b for _, b in ins]
            estack = (*stack, *jc.equation_name_stack(eqn))
            rule = _RULES.get(eqn.primitive.name)
            with eqn.ctx.manager:
                if eqn.primitive is sow_p:
                    p = eqn.params
                    n = len(invals) - len(p["site"].extras)
                    self.site = f"{p['site'].name} ({p['mode']})"
                    outs, out_bads = invals[:n], in_bads[:n]
                elif rule is not None:
                    outs, out_bads, sub_slots, sub_flags = rule(self, eqn, invals, in_bads, estack)
                    slots.extend(s.placed(k) for s in sub_slots)
                    flags.extend(sub_flags)
                else:
                    outs = _bind(eqn, invals)
                    out_bads = [_bad(o) for o in outs]
                    made = _any(out_bads)
                    if made is not False:
                        in_bad = _any(in_bads)
                        hit = made if in_bad is False else jnp.logical_and(
                            made, jnp.logical_not(in_bad))
                        if hit is not False:
                            slots.append(_Slot(eqn, ((k, 0, None),), estack, self.site))
                            flags.append((hit, ()))
            for v, x, b in zip(eqn.outvars, outs, out_bads, strict=True):
                env[v] = (x, b)
        outs_bads = [read(v) for v in jaxpr.outvars]
        return [x for x, _ in outs_bads], [b for _, b in outs_bads], slots, flags


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


_RuleOut = tuple[list[Any], list[Any], list[_Slot], list[_Flag]]


def _placeholder(slots: list[_Slot], branch: int = 0, loop: _Loop | None = None) -> list[_Slot]:
    """Sub-jaxpr slots with a level whose equation index the enclosing ``run`` fills in."""
    return [s.under(-1, branch, loop) for s in slots]


def _inline(key: str) -> Callable[..., _RuleOut]:
    def rule(walk: _Walk, eqn: Any, invals: list[Any], bads: list[Any],
             stack: tuple[tuple[str, str], ...]) -> _RuleOut:
        jaxpr, consts = jc.jaxpr_and_consts(eqn.params[key])
        outs, out_bads, slots, flags = walk.run(jaxpr, consts, invals, bads, stack)
        return outs, out_bads, _placeholder(slots), flags

    return rule


def _scan_rule(walk: _Walk, eqn: Any, invals: list[Any], bads: list[Any],
               stack: tuple[tuple[str, str], ...]) -> _RuleOut:
    p = eqn.params
    length, reverse = int(p["length"]), bool(p["reverse"])
    if length == 0:
        outs = _bind(eqn, invals)
        return outs, [_bad(o) for o in outs], [], []
    jaxpr, jconsts = jc.jaxpr_and_consts(p["jaxpr"])
    nc, ncar = jc.scan_split_counts(p)
    consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
    const_bads, init_bads = bads[:nc], bads[nc:nc + ncar]
    meta: list[_Slot] = []

    def body(carry: tuple[list[Any], list[Any]], x: list[Any]) -> tuple[Any, Any]:
        vals, cbads = carry
        outs, obads, slots, flags = walk.run(
            jaxpr, jconsts, [*consts, *vals, *x], [*const_bads, *cbads, *map(_bad, x)], stack)
        meta[:] = slots
        return (outs[:ncar], [_as_array(b) for b in obads[:ncar]]), (outs[ncar:], flags)

    (carry, carry_bads), (ys, stacked) = jax.lax.scan(
        body, (list(init), [_as_array(b) for b in init_bads]), list(xs),
        length=length, reverse=reverse, unroll=p["unroll"])
    flags: list[_Flag] = []
    for hits, iters in stacked:
        # The first iteration to run: the lowest index, or the highest of a reverse scan.
        at = length - 1 - jnp.argmax(hits[::-1]) if reverse else jnp.argmax(hits)
        flags.append((jnp.any(hits), (at, *(i[at] for i in iters))))
    return ([*carry, *ys], [*carry_bads, *map(_bad, ys)],
            _placeholder(meta, loop=("scan", length, reverse)), flags)


def _while_rule(walk: _Walk, eqn: Any, invals: list[Any], bads: list[Any],
                stack: tuple[tuple[str, str], ...]) -> _RuleOut:
    p = eqn.params
    (cj, cconsts), (bj, bconsts) = (jc.jaxpr_and_consts(p["cond_jaxpr"]),
                                    jc.jaxpr_and_consts(p["body_jaxpr"]))
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
    cond_bads, body_bads, init_bads = bads[:nc], bads[nc:nc + nb], bads[nc + nb:]
    meta: list[_Slot] = []

    def body_fn(vals: list[Any], vbads: list[Any]) -> tuple[list[Any], list[Any], list[_Flag]]:
        outs, obads, slots, flags = walk.run(bj, bconsts, [*body_consts, *vals],
                                             [*body_bads, *vbads], stack)
        meta[:] = slots
        return outs, [_as_array(b) for b in obads], flags

    site = walk.site
    init_bads = [_as_array(b) for b in init_bads]
    shapes = jax.eval_shape(lambda v, b: body_fn(v, b)[2], list(init), init_bads)
    walk.site = site
    state0 = [(jnp.zeros((), bool), jnp.zeros((), jnp.int32),
               tuple(jnp.zeros(i.shape, i.dtype) for i in iters)) for _, iters in shapes]

    def cond(carry: Any) -> Any:
        vals, vbads = carry[0], carry[1]
        return walk.run(cj, cconsts, [*cond_consts, *vals], [*cond_bads, *vbads], stack)[0][0]

    def body(carry: Any) -> Any:
        vals, vbads, n, state = carry
        outs, obads, flags = body_fn(vals, vbads)
        new_state = []
        for (seen, first, inner), (hit, iters) in zip(state, flags, strict=True):
            new = jnp.logical_and(hit, jnp.logical_not(seen))
            new_state.append((jnp.logical_or(seen, hit), jnp.where(new, n, first),
                              tuple(jnp.where(new, i, j) for i, j in zip(iters, inner,
                                                                          strict=True))))
        return outs, obads, n + 1, new_state

    vals, vbads, _, state = jax.lax.while_loop(
        cond, body, (list(init), init_bads, jnp.zeros((), jnp.int32), state0))
    flags = [(seen, (first, *inner)) for seen, first, inner in state]
    return list(vals), list(vbads), _placeholder(meta, loop=("while", -1, False)), flags


def _cond_rule(walk: _Walk, eqn: Any, invals: list[Any], bads: list[Any],
               stack: tuple[tuple[str, str], ...]) -> _RuleOut:
    branches = eqn.params["branches"]
    index, operands, op_bads = invals[0], invals[1:], bads[1:]
    metas: list[list[_Slot]] = [[] for _ in branches]
    site = walk.site

    def run_branch(i: int, ops: list[Any]) -> tuple[list[Any], list[Any], list[_Flag]]:
        walk.site = site
        outs, obads, slots, flags = walk.run(*jc.jaxpr_and_consts(branches[i]), list(ops),
                                             op_bads, stack)
        metas[i][:] = slots
        return outs, [_as_array(b) for b in obads], flags

    shapes = [jax.eval_shape(lambda *ops, i=i: run_branch(i, list(ops))[2], *operands)
              for i in range(len(branches))]

    def widen(i: int) -> Callable[..., Any]:
        def branch(*ops: Any) -> Any:
            outs, obads, flags = run_branch(i, list(ops))
            every: list[_Flag] = []
            for j, sh in enumerate(shapes):
                every.extend(flags if j == i else [
                    (jnp.zeros((), bool), tuple(jnp.zeros(s.shape, s.dtype) for s in iters))
                    for _, iters in sh])
            return outs, obads, every

        return branch

    outs, obads, flags = jax.lax.switch(index, [widen(i) for i in range(len(branches))],
                                        *operands)
    slots = [s for i, m in enumerate(metas) for s in _placeholder(m, branch=i)]
    return list(outs), list(obads), slots, list(flags)


_RULES: dict[str, Callable[..., _RuleOut]] = {
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "remat2": _inline("jaxpr"),
    "checkpoint": _inline("jaxpr"),
    "custom_jvp_call": _inline("call_jaxpr"),
    "custom_vjp_call": _inline("call_jaxpr"),
    "custom_vjp_call_jaxpr": _inline("fun_jaxpr"),
    "scan": _scan_rule,
    "while": _while_rule,
    "cond": _cond_rule,
}


# ---------------------------------------------------------------------------------------------
# From the flags back to the program.


def _order_key(slot: _Slot, iteration: tuple[int, ...]) -> tuple[int, ...]:
    """Program order: equation indices, with each loop's iteration in the order it ran."""
    key: list[int] = []
    it = iter(iteration)
    for index, branch, loop in slot.path:
        key += [index, branch]
        if loop is not None:
            i = next(it)
            key.append(loop[1] - 1 - i if loop[2] else i)
    return tuple(key)


def _location(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    """The innermost frame of the user's own code: not sowtel, not an installed package."""
    for f in frames:
        path = os.path.abspath(f[0])
        if not path.startswith(_SOWTEL_DIR) and "-packages" + os.sep not in path:
            return f
    return frames[0] if frames else None


def _event(slot: _Slot, iteration: tuple[int, ...], shape: tuple[int, ...],
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
        loops=tuple(loop[0] for _, _, loop in slot.path if loop is not None),
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
        raise TypeError(
            f"locate_nonfinite needs a callable, got {type(fn).__name__} {fn!r:.60}: pass the "
            "step function itself, e.g. locate_nonfinite(train_step)(params, batch)"
        )
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
        meta: list[_Slot] = []
        walk = _Walk()

        def checked(consts: list[Any], dyn: list[Any]) -> Any:
            arg_bads = [_as_array(_bad(x)) for x in dyn]
            outs, out_bads, slots, flags = walk.run(jaxpr, consts, dyn, arg_bads, ())
            meta[:] = slots
            return outs, _as_array(_any(out_bads)), arg_bads, flags

        outs, out_bad, arg_bads, flags = jax.jit(checked)(consts, dyn)
        flags = jax.device_get(flags)
        hits = []
        for slot, (hit, iters) in zip(meta, flags, strict=True):
            if bool(hit):
                iteration = tuple(int(i) for i in iters)
                hits.append((_order_key(slot, iteration), slot, iteration))
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
