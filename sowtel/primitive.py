"""``sow``: tag an intermediate value, and ``sow_p``, the primitive behind it, with all its rules.

A sow is the identity. What it does beyond that depends on what is switched on where the
function is traced:

- nothing (the default): ``sow`` returns its argument untouched and binds no primitive, so the
  compiled program is byte-identical to one without sows;
- :func:`sowtel.save_intermediates`: the sow binds ``sow_p`` with ``capture=True`` and the
  capture pass turns it into extra outputs;
- :func:`sowtel.enable`: the sow binds ``sow_p`` with ``stream=<the session's StreamConfig>``; its
  lowering computes the summary on the device and sends it to the host in one callback (or,
  under :func:`sowtel.jit`, the capture pass returns the summary as an output).

Under ``jvp`` the tangent flows through a second ``sow_p`` in mode ``"tangent"``; transposing
that one (``grad``, ``vjp``) gives a ``sow_p`` in mode ``"cotangent"`` on the cotangent. Modes
compose (``"cotangent.tangent"`` under ``jax.hessian``), so a site reports each derivative once.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def f(x):
    ...     h = sowtel.sow(jnp.sin(x), "h")
    ...     return (h ** 2).sum()
    >>> loss, inter = sowtel.save_intermediates(jax.value_and_grad(f))(jnp.ones(3))
    >>> sorted(inter["h"])
    ['cotangent', 'primal']
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sowtel import _jax_compat as jc
from sowtel import errors, naming
from sowtel.context import RECEIVERS, StreamConfig, check_positive_int, current_context, is_due
from sowtel.records import SUMMARIES
from sowtel.sites import StreamSite, stream_site
from sowtel.steps import traced_step
from sowtel.summaries import (
    apart_all,
    pack_plan,
    packed_summary,
    packing_of,
    reads_copy,
)

__all__ = ["sow", "sow_p", "SiteStatic"]

# ---------------------------------------------------------------------------------------------
# Validation.

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _is_array_leaf(leaf: Any) -> bool:
    return isinstance(leaf, _ARRAY_TYPES) or (hasattr(leaf, "aval") and hasattr(leaf, "dtype"))


def _check_leaves(value: Any, leaves: list[Any], name: str) -> None:
    if all(map(_is_array_leaf, leaves)):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:  # only to name the leaf
        if not _is_array_leaf(leaf):
            raise errors.NotAnArrayError(name, jax.tree_util.keystr(path) or "<root>", leaf)


def _unflattenable(value: Any, name: str, error: Exception) -> ValueError:
    """The error for a value JAX cannot flatten, naming the dict whose keys do not sort."""

    def unsortable(x: Any, path: str) -> tuple[str, list[Any]] | None:
        if isinstance(x, dict):
            try:
                sorted(x)
            except TypeError:
                return path, list(x)
            children = [(f"{path}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(x)]
        else:
            return None
        for child_path, child in children:
            found = unsortable(child, child_path)
            if found is not None:
                return found
        return None

    found = unsortable(value, "")
    if found is None:
        return ValueError(f"sow {name!r}: JAX cannot flatten the value into a pytree ({error})")
    path, keys = found
    return ValueError(
        f"sow {name!r}: the dict at {path or '<root>'} has keys {', '.join(map(repr, keys))}, "
        "whose types JAX cannot sort to flatten it: use keys of one type (all str, or all int)"
    )


def _as_array_leaf(leaf: Any) -> Any:
    return jnp.asarray(leaf) if isinstance(leaf, (bool, int, float, complex)) else leaf


# ---------------------------------------------------------------------------------------------
# The primitive.


@dataclasses.dataclass(frozen=True)
class SiteStatic:
    """What a sow site is, fixed when ``sow`` is called and carried through every rule."""

    name: str
    tag: str
    treedef: Any
    summary: str | None
    every: int | None
    # ((length, reverse), ...) of the scans around the sow() call, outermost first; None inside
    # a while_loop. Records are indexed by where the site runs in the program instead
    # (naming.program_loops), which differs for a function traced once and evaluated elsewhere.
    loops: tuple[tuple[int, bool], ...] | None
    # Extra operands after the leaves: "batch" (derivative sites: one per leaf, a zero-size
    # slice of its primal, so vmap batches the leaf wherever it batches its primal), "step",
    # "shard", "taken" (under vmap of a cond with a batched predicate: the rows that take the
    # branch).
    extras: tuple[str, ...] = ()
    # In lax.map(batch_size=b): (call key, length, b, remainder, scans around the map, vmaps
    # inside it (its own included), ndim of the first leaf as sown); capture joins the batches
    # and the remainder into one axis of the map's length.
    mapped: tuple[int, int, int, bool, int, int, int] | None = None
    # With a "taken" extra: (key of the vmapped cond, branch index); capture joins a name's
    # sites in sibling branches into one, as it does for an unbatched cond.
    branch: tuple[int, int] | None = None
    # Sown in a custom_jvp function: its derivatives are the rule's, so it reports its primal
    # only, also where JAX differentiates the function's body instead (JAX 0.10 partially
    # evaluates a scan's body with the custom_jvp inlined, losing the rule, under jvp-of-grad).
    custom_jvp: bool = False
    # In a sowtel.jit logging program, a site that streams through its host callback: the
    # names its program settled (naming.ProgramNames), which the callback takes.
    numbering: Any = dataclasses.field(default=None, compare=False)
    # The jax_scan3 loops whose expansion bound it, outermost first: the innermost while
    # loops around it when lowered (see _jax_compat.lowering_loops).
    scan3: tuple[tuple[int, bool], ...] = ()

    def transposed(self) -> SiteStatic:
        loops = None if self.loops is None else tuple((n, not r) for n, r in self.loops)
        return dataclasses.replace(self, loops=loops)


class SowEffect(jc.effects.Effect):
    __str__ = lambda self: "Sow"  # noqa: E731


sow_effect = SowEffect()
jc.allow_effect(SowEffect)


class SowPrimitive(jc.core.Primitive):
    """``sow_p``'s class: binding it in a branch that ``vmap`` runs for every row of a cond
    with a batched predicate adds, as a ``"taken"`` extra, the rows that take the branch."""

    def bind(self, *args: Any, **params: Any) -> Any:
        if (params.get("mode") == "primal" and not params.get("recompute")
                and _in_custom_vjp_bwd()):
            # A primal site bound while a custom_vjp bwd is traced is forward code the bwd
            # runs again (a closure-converted function re-evaluated there, as Equinox's
            # checkpointed while_loop and odeint's adjoint do): silent, see sow().
            params = {**params, "recompute": "primal"}
        site = params.get("site")
        scan3 = jc.expanding_scan3()
        if site is not None and scan3 and site.scan3 != scan3:
            site = dataclasses.replace(site, scan3=scan3)
            params = {**params, "site": site}
        if site is not None:
            rows = ROWS.get()
            found = None
            if rows is not None and (jc.trace_encloses(rows[3]) or (
                    FRESH_ROWS.get() is rows and jc.in_fresh_jaxpr_trace())):
                found = rows[:3]
            else:
                found = jc.batched_branch_predicate()
            if found is not None:
                args, params = _with_rows(args, params, site, *found)
        return super().bind(*args, **params)


# While sowtel's rule of a vmapped cond runs one of its branches under vmap (sowtel._cond_rows):
# (the rows that take it, per row; the cond's key; the branch's index; that vmap's trace). A
# sow bound in that trace or in a body traced inside it takes the rows; one bound below it
# (the batching rule's own bind, with the rows batched as its operand) has them already.
ROWS: contextvars.ContextVar[tuple[Any, int, int, Any] | None] = contextvars.ContextVar(
    "sowtel_rows", default=None)

# While that rule binds a custom_jvp / custom_vjp function in a body traced inside that vmap (a
# loop's): ROWS's value. Binding it there traces the function to a jaxpr of its own, in a trace
# no parent links to the vmap's; a sow bound in such a trace takes the rows too, which that
# jaxpr closes over (the function's closure, passed on as its operands).
FRESH_ROWS: contextvars.ContextVar[tuple[Any, int, int, Any] | None] = contextvars.ContextVar(
    "sowtel_fresh_rows", default=None)


def _with_rows(args: tuple[Any, ...], params: dict[str, Any], site: SiteStatic, taken: Any,
               cond: int, branch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sow's operands and parameters with the rows of a vmapped cond's branch: a ``"taken"``
    extra, or, where an outer cond's rows are there already, both (the rows that take both)."""
    if "taken" not in site.extras:
        site = dataclasses.replace(site, extras=(*site.extras, "taken"), branch=(cond, branch))
        return (*args, taken), {**params, "site": site}
    at = len(args) - len(site.extras) + site.extras.index("taken")
    if site.branch is not None and site.branch[0] == cond:  # this cond's rows, bound again
        return args, params
    both = jnp.logical_and(args[at], taken)
    site = dataclasses.replace(site, branch=(cond, branch))
    return (*args[:at], both, *args[at + 1:]), {**params, "site": site}


sow_p = SowPrimitive("sow")
sow_p.multiple_results = True

# While sow() binds: where it found itself with respect to a custom_vjp bwd (see sow()). The
# binds its bind makes (the derivative rules') run in the same frames: they need not walk them.
_BWD_ROLE: contextvars.ContextVar[str | None | bool] = contextvars.ContextVar(
    "sowtel_bwd_role", default=False)


def _in_custom_vjp_bwd() -> bool:
    role = _BWD_ROLE.get()
    return jc.in_custom_vjp_bwd() if role is False else role is not None


def fill_like(shape: Any, dtype: Any) -> Any:
    """What a site reports where its code did not run: NaN (floating, complex), else 0."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.full(shape, jnp.nan, dtype)
    return jnp.zeros(shape, dtype)


def taken_rows(leaves: list[Any], site: SiteStatic, extras: list[Any]) -> list[Any]:
    """``leaves`` with the rows that did not take the site's branch filled (see ``fill_like``).

    Only under ``vmap`` of a cond with a batched predicate (a ``"taken"`` extra), where every
    branch runs on every row; the mask's axes are the leaves' leading (batch) axes.
    """
    if "taken" not in site.extras:
        return leaves
    mask = extras[site.extras.index("taken")]
    out = []
    for leaf in leaves:
        m = jnp.reshape(mask, (*mask.shape, *(1,) * (leaf.ndim - mask.ndim)))
        out.append(jnp.where(m, leaf, fill_like(leaf.shape, leaf.dtype)))
    return out


def jvp_mode(mode: str) -> str:
    return "tangent" if mode == "primal" else mode + ".tangent"


def transpose_mode(mode: str) -> str:
    if mode == "primal":
        return "cotangent"
    head, _, last = mode.rpartition(".")
    if last == "tangent":
        return (head + "." if head else "") + "cotangent"
    return mode + ".cotangent"


def _bind(leaves: list[Any], extras: list[Any], site: SiteStatic, mode: str,
          recompute: bool | str = False) -> list[Any]:
    """Binds ``sow_p``, deciding from the current context whether it captures and/or streams.

    ``recompute``: the derivative of a silent copy (``jax.checkpoint``'s rematerialisation) is
    silent too, or a site differentiated through a checkpoint would report its tangent twice.
    """
    ctx = current_context()
    capture = bool(ctx is not None and ctx.capture == site.tag)
    stream, summary, every = None, "stats", 1
    config = ctx.stream if ctx is not None and not ctx.quiet else None
    if config is not None and config.selects(site.name, site.tag) and config.wants(mode):
        stream = config
        summary = config.summary_for(site.summary)
        every = config.every_for(site.every)
    return sow_p.bind(
        *leaves, *extras, site=site, mode=mode, capture=capture, stream=stream,
        summary=summary, every=every, recompute=recompute,
    )


def sow(
    value: Any,
    name: str,
    *,
    tag: str = "intermediates",
    summary: str | None = None,
    every: int | None = None,
) -> Any:
    """Tags ``value`` (any pytree of arrays) as ``name`` and returns it unchanged.

    Args:
      value: a pytree of arrays; returned as it is.
      name: letters, digits and ``_ - . /``; ``/`` makes hierarchy (``"block0/attn"``). No empty,
        ``.`` or ``..`` segment and no leading ``/``. Enclosing :func:`sowtel.scope` prefixes
        are prepended; a name sown several times in one program is numbered (``name_0``, ...).
      tag: sites are selected by tag (``save_intermediates(tag=...)``, ``enable(tags=...)``).
      summary: what streaming sends for this site (``"full"``, ``"stats"``, ``"histogram"``,
        ``"health"``, ``"shape"``); ``None`` takes the session's default.
      every: stream this site only on steps divisible by ``every`` (``None``: the session's).

    Returns:
      ``value``. With nothing enabled no primitive is bound at all: a jitted function with sows
      compiles to exactly the program of the same function without them.

    Under transformations, a site reports:

      ============================  ==========================================
      around the sow                what is captured / streamed
      ============================  ==========================================
      plain call, ``jit``           primal
      ``grad``, ``vjp``             primal, cotangent (during the backward pass)
      ``jvp``, ``linearize``        primal, tangent
      ``jax.hessian``               primal, tangent, cotangent, cotangent.tangent
      ``vmap``                      the whole batch (batch axis leading the value's
                                    own axes, after those of enclosing scans); a
                                    leaf vmap does not batch, as it is (no batch axis)
      ``scan`` / ``fori_loop``      every iteration (captured: stacked)
      ``custom_vjp`` ``bwd``        cotangent
      ============================  ==========================================

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def layer(x):
        ...     h = sowtel.sow(jnp.tanh(x), "layer/h")
        ...     return h.sum()
        >>> out, inter = sowtel.save_intermediates(layer)(jnp.zeros(2))
        >>> inter["layer/h"]["primal"]
        Array([0., 0.], dtype=float32)
    """
    naming.check_name(name)
    naming.check_tag(tag)
    if summary is not None and summary not in SUMMARIES:
        raise errors.UnknownSummaryError(summary, SUMMARIES)
    if every is not None:
        check_positive_int(every, "sow every")
    # Validated whatever is enabled: turning streaming on never breaks a working program.
    try:
        leaves, treedef = jax.tree_util.tree_flatten(value)
    except (TypeError, ValueError) as e:  # JAX sorts dict keys: {"a": x, 1: y} fails inside it
        raise _unflattenable(value, name, e) from None
    _check_leaves(value, leaves, name)
    if jc.traced_for() == "while_cond":
        raise errors.SowInWhileCondError(name)
    name = naming.scoped(name)
    ctx = current_context()
    if ctx is None:
        return value
    capture = ctx.capture == tag
    streams = not ctx.quiet and ctx.stream is not None and ctx.stream.selects(name, tag)
    if not (capture or streams):
        return value
    if jc.in_flax_broadcast_trace():
        # A trace Flax's nn.scan discards (it keeps only the loop-invariant outputs): the loop
        # body's own trace sows.
        return value
    leaves = [_as_array_leaf(leaf) for leaf in leaves]
    if not leaves:
        return value
    extras: list[Any] = []
    kinds: list[str] = []
    step = traced_step()
    if step is not None:
        extras.append(jnp.asarray(step))
        kinds.append("step")
    axes = jc.manual_axes() if streams else ()
    if axes:
        extras.append(jax.lax.axis_index(axes))
        kinds.append("shard")
    site = SiteStatic(
        name=name, tag=tag, treedef=treedef, summary=summary, every=every,
        loops=jc.enclosing_loops(), extras=tuple(kinds),
        mapped=_mapped(leaves) if capture else None,
        custom_jvp=jc.in_custom_jvp_function(),
    )
    # A custom_vjp bwd is traced in a backward pass; jitted, or in a scan, cond or checkpoint,
    # its name stack no longer says so, but its caller's frame does.
    role = jc.custom_vjp_bwd_role()
    mode = "primal"
    recompute: bool | str = False
    if role == "rerun":
        # Forward code that the bwd differentiates again (recursive checkpointing, adjoint
        # solvers, a bwd that calls jax.vjp of the forward function): as in jax.checkpoint,
        # the recomputed primal is silent and the derivative the bwd takes reports, since its
        # cotangent is the site's own.
        recompute = "primal"
    elif role == "bwd" or jc.in_transpose():
        mode = "cotangent"
    token = _BWD_ROLE.set(role)
    try:
        outs = _bind(leaves, extras, site, mode, recompute)
    finally:
        _BWD_ROLE.reset(token)
    return jax.tree_util.tree_unflatten(treedef, outs)


def _mapped(leaves: list[Any]) -> tuple[int, int, int, bool, int, int, int] | None:
    """``SiteStatic.mapped`` of a sow in ``lax.map(batch_size=b)`` (None elsewhere)."""
    found = jc.enclosing_map()
    return None if found is None else (*found, jnp.ndim(leaves[0]))


def _split(args: Any, site: SiteStatic) -> tuple[list[Any], list[Any]]:
    n = len(args) - len(site.extras)
    return list(args[:n]), list(args[n:])


def _sow_impl(*args: Any, site: SiteStatic, stream: StreamConfig | None, recompute: bool | str,
              **params: Any) -> list[Any]:
    leaves, _ = _split(args, site)
    if stream is None or recompute:
        return leaves
    # Called eagerly (outside jit) while streaming: JAX compiles the sow alone (and caches it)
    # so it streams too.
    return jc.dispatch.apply_primitive(  # type: ignore[no-any-return]
        sow_p, *args, site=site, stream=stream, recompute=recompute, **params)


sow_p.def_impl(_sow_impl)


def _sow_abstract_eval(*avals: Any, site: SiteStatic, capture: bool,
                       stream: StreamConfig | None,
                       recompute: bool | str, **params: Any) -> tuple[list[Any], Any]:
    leaves, _ = _split(avals, site)
    active = (capture or stream is not None) and not recompute
    return leaves, ({sow_effect} if active else jc.effects.no_effects)


sow_p.def_effectful_abstract_eval(_sow_abstract_eval)


# How silent a sow's tangent is, by how silent the sow is (``recompute``): a classic
# checkpoint's rerun (True) is silent with all its derivatives (the forward pass reports them);
# a jax_remat3 rerun ("primal") is differentiated instead of the forward pass, so its tangent
# is silent ("tangent": the forward pass reports the tangent) but the transpose of that
# tangent, the cotangent, reports.
_SILENT_JVP: dict[bool | str, bool | str] = {False: False, True: True, "primal": "tangent",
                                               "tangent": "tangent"}


def _sow_jvp(primals: Any, tangents: Any, *, site: SiteStatic, mode: str, recompute: bool | str,
             **params: Any) -> tuple[list[Any], list[Any]]:
    out = sow_p.bind(*primals, site=site, mode=mode, recompute=recompute, **params)
    leaves_t, _ = _split(tangents, site)
    _, extras = _split(primals, site)
    differentiable = [jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                      for p in primals[: len(leaves_t)]]
    if not any(differentiable) or site.custom_jvp:
        # Integer and bool leaves have no tangent to report; a custom_jvp function's site
        # has none either (its rule gives the derivative).
        return out, leaves_t
    site_t = site
    if not all(differentiable):
        # The tangent site holds the differentiable leaves, in the sown structure (None elsewhere).
        skeleton = jax.tree_util.tree_unflatten(
            site.treedef, [0 if d else None for d in differentiable])
        site_t = dataclasses.replace(site, treedef=jax.tree_util.tree_structure(skeleton))
    chosen = [jc.ad.instantiate_zeros(t) for t, d in zip(leaves_t, differentiable, strict=True)
              if d]
    if "batch" not in site_t.extras:
        # One witness per reported leaf: vmap batches each derivative leaf where it batches
        # that leaf's primal, and only there. Sliced, not flattened: a value with an explicit
        # sharding cannot always be flattened.
        witnesses = []
        for p, d in zip(primals[: len(leaves_t)], differentiable, strict=True):
            if d:
                p = jnp.atleast_1d(p)
                witnesses.append(jax.lax.slice(p, (0,) * p.ndim, (0,) * p.ndim))
        extras = [*witnesses, *extras]
        site_t = _with_witnesses(site_t, len(witnesses))
    reported = iter(_bind(chosen, extras, site_t, jvp_mode(mode), _SILENT_JVP[recompute]))
    return out, [next(reported) if d else t
                 for t, d in zip(leaves_t, differentiable, strict=True)]


@functools.lru_cache(maxsize=4096)
def _with_witnesses(site: SiteStatic, n: int) -> SiteStatic:
    # Cached: a frozen dataclass's replace() costs about as much as the rest of the rule, and
    # a trace meets the same site once per derivative level.
    return dataclasses.replace(site, extras=(*("batch",) * n, *site.extras))


jc.ad.primitive_jvps[sow_p] = _sow_jvp


def _sow_transpose(cts: Any, *args: Any, site: SiteStatic, mode: str, recompute: bool | str,
                   **params: Any) -> list[Any]:
    leaves, extras = _split(args, site)
    cts = [jc.ad.instantiate_zeros(ct) for ct in cts]
    outs = _bind(cts, extras, site.transposed(), transpose_mode(mode), recompute is True)
    return list(outs) + [None] * len(extras)


jc.ad.primitive_transposes[sow_p] = _sow_transpose


def _sow_batch(args: Any, dims: Any, *, site: SiteStatic, **params: Any) -> tuple[Any, Any]:
    """A sow is the identity under ``vmap`` too: each leaf keeps its own batching.

    A batched leaf gets its batch axis first (the value's own axes follow); a leaf ``vmap``
    leaves unbatched (a closed-over parameter, a carry passed with ``in_axes=None``) stays
    unbatched, so ``out_axes=None`` and everything downstream see what they would without the
    sow. A derivative leaf is batched where its primal leaf is (its witness: the ``"batch"``
    extra), so it keeps its primal's shape. Two kinds of site give every leaf the batch axis,
    as the capture pass needs one layout for all leaves: a site with a ``"taken"`` mask (its
    rows line up with the leaves' leading axes) and a site in ``lax.map(batch_size=b)``
    (``SiteStatic.mapped``: the map's axis joins its scan's).
    """
    leaves, extras = _split(args, site)
    leaf_dims, extra_dims = _split(dims, site)
    not_mapped = None
    if any(d is not not_mapped for k, d in zip(site.extras, extra_dims, strict=True)
           if k not in ("batch", "taken")):
        raise errors.BatchedStepError(site.name)
    sizes = [x.shape[d] for x, d in zip(args, dims, strict=True) if d is not not_mapped]
    if not sizes:
        return sow_p.bind(*args, site=site, **params), list(dims[: len(leaves)])
    size = sizes[0]
    witnessed = [d is not not_mapped
                 for k, d in zip(site.extras, extra_dims, strict=True) if k == "batch"]
    if "taken" in site.extras or site.mapped is not None:
        spread = [True] * len(leaves)
    elif len(witnessed) == len(leaves):
        spread = [d is not not_mapped or w for d, w in zip(leaf_dims, witnessed, strict=True)]
    else:  # no witnesses (a primal site), or not one per leaf
        spread = [d is not not_mapped or any(witnessed) for d in leaf_dims]

    def leading(x: Any, d: Any) -> Any:
        return (jc.batching.moveaxis(x, d, 0) if d is not not_mapped
                else jnp.broadcast_to(x, (size, *x.shape)))

    moved = [leading(x, d) if b else x
             for x, d, b in zip(leaves, leaf_dims, spread, strict=True)]
    # The "taken" mask keeps its axes in step with the leaves' leading (batch) axes.
    extras = [leading(x, d) if k == "taken" else x
              for k, x, d in zip(site.extras, extras, extra_dims, strict=True)]
    outs = sow_p.bind(*moved, *extras, site=site, **params)
    return outs, [0 if b else not_mapped for b in spread]


jc.batching.primitive_batchers[sow_p] = _sow_batch


def _sow_partial_eval_custom(saveable: Any, unks_in: Any, inst_in: Any, eqn: Any) -> Any:
    """Keeps ``jax.checkpoint`` from saving sown values as residuals, and reports primals once.

    With all inputs known the sow runs in the known (forward) jaxpr. When the staged jaxpr holds
    its inputs too (the policy recomputes them), it gets a silent copy (``recompute=True``: no
    effect, no capture, no stream) to rematerialise the output for free, since a sow is the
    identity. When an input is not there (the policy saved it, as ``everything_saveable``
    does), a copy would read a variable the staged jaxpr lacks: the output is then left
    uninstantiated, and saved as a residual where the backward pass needs it, as the input
    would have been (``jax.debug.callback``'s rule makes the same choice).
    """
    n_out = len(eqn.outvars)
    if any(unks_in):
        residuals = [v for v, inst in zip(eqn.invars, inst_in, strict=True) if not inst]
        return None, eqn, [True] * n_out, [True] * n_out, residuals
    if not all(inst_in):
        return eqn, None, [False] * n_out, [False] * n_out, []
    silent = eqn.replace(params={**eqn.params, "recompute": True},
                         effects=jc.effects.no_effects)
    return eqn, silent, [False] * n_out, [True] * n_out, []


jc.pe.partial_eval_jaxpr_custom_rules[sow_p] = _sow_partial_eval_custom


# ---------------------------------------------------------------------------------------------
# Streaming lowering: on-device summary, then one host callback per site.


_lowering_order = itertools.count()

sow_emit_p = jc.core.Primitive("sow_emit")
sow_emit_p.multiple_results = True


def _emit_abstract_eval(*avals: Any, site: StreamSite, export_process: int
                        ) -> tuple[list[Any], Any]:
    return [], {sow_effect}


sow_emit_p.def_effectful_abstract_eval(_emit_abstract_eval)


def _deliver(site: StreamSite, *arrays: np.ndarray) -> None:
    policy = RECEIVERS.active
    if policy is not None:
        policy.receive(site, arrays)
        return
    closed = RECEIVERS.closed  # its session ended before this callback ran
    if closed is not None:
        closed.count_late(site)


def _emit_lowering(ctx: Any, *args: Any, site: StreamSite, export_process: int) -> list[Any]:
    named = naming.number_in_program(ctx, site)  # a name repeated in the program gets numbered
    jc.module_state(ctx)[("numbered", site)] = named
    jc.emit_host_callback(ctx, lambda *a: _deliver(named(), *a), args, ctx.avals_in,
                          process=export_process)
    return []


jc.mlir.register_lowering(sow_emit_p, _emit_lowering)


def _site_summary(ctx: Any, values: list[Any], summary: str, bins: int,
                  plan: dict[tuple[Any, ...], list[int]] | None = None) -> list[Any]:
    """The summary arrays of one occurrence of a site, computed in the program.

    In a program partitioned over the devices of several processes, ``stats`` are computed in
    two levels, as :func:`sowtel.jit` does: each device summarises a block of the value, the
    blocks' summaries are gathered (one all-gather a site) and merged. XLA's CPU backend runs
    each cross-process all-reduce on its own, and a direct summary holds about eight.
    """
    devices = jc.global_devices(ctx) if summary == "stats" else None
    if devices is not None:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from sowtel import multihost

        replicated = NamedSharding(Mesh(np.array(devices), ("sowtel_devices",)),
                                   PartitionSpec())
        partial = multihost.partial_summaries(values, summary, bins, replicated)
        if partial is not None:
            out: list[Any] = []
            for part in partial:
                gathered = jax.lax.with_sharding_constraint(part, replicated)
                out.extend(multihost.merge_partials(gathered))
            return out
    # A pytree's leaves together (the lowering planned the same packing from their avals).
    return packed_summary(values, summary, bins, copy=False, plan=plan)[0]


_warned_counted: set[str] = set()


def _warn_counted_index(name: str) -> None:
    """Warns once per name that a site in a cond inside a scan inside ``shard_map`` gets
    counted indices.

    A host callback cannot read the iteration of the scan it runs in (JAX keeps the counter
    inside its lowering of the loop), so the host numbers a site's occurrences as they arrive,
    and a branch that does not run tells the host what it skipped (:func:`_cond_lowering`).
    Inside ``shard_map`` each device counts its own occurrences, and a skipped branch does not
    say which device skipped it. ``sowtel.jit`` returns each site's summaries stacked over the
    iterations: exact indices.
    """
    if name in _warned_counted:
        return
    _warned_counted.add(name)
    warnings.warn(
        f"sow {name!r} is inside a cond inside a scan inside shard_map: with host callbacks "
        "its records are indexed by counting the iterations in which its branch ran, not by "
        "the iteration itself. Stream the step with sowtel.jit for exact indices (or move the "
        "sow out of the cond)", stacklevel=2)


# -- a branch that does not run keeps the host's count ---------------------------------------
#
# The host numbers a site's callbacks (its step and record index) by counting them. A cond's
# branch that does not run sends nothing, so each branch, as lowered, ends with one callback
# that tells the host how many occurrences of the sites of the other branches it skipped.


class _LoweredSites(threading.local):
    """Per lowering thread: for each cond being lowered, the streamed sites lowered in it."""

    def __init__(self) -> None:
        self.stack: list[dict[tuple[SiteStatic, str], list[Any]]] = []


_LOWERED = _LoweredSites()


def _note_lowered(site: SiteStatic, mode: str, named: Any) -> None:
    for lowered in _LOWERED.stack:
        lowered.setdefault((site, mode), []).append(named)


def _streamed_sites(jaxpr: Any, times: int | None,
                    out: dict[tuple[SiteStatic, str], int | None]) -> None:
    """The streamed sites of ``jaxpr`` and the callbacks each sends per run of it (``times``
    per run of the enclosing jaxpr; ``None``: not static, inside a while_loop)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is sow_p:
            p = eqn.params
            if p["stream"] is not None and not p["recompute"]:
                key = (p["site"], p["mode"])
                before = out.get(key, 0)
                out[key] = None if times is None or before is None else max(before, times)
            continue
        kind = jc.construct(eqn)
        inner = times
        if kind == "while":
            inner = None
        elif kind in ("scan", "scan3") and times is not None:
            inner = times * jc.loop_parts(eqn)["length"]
        for sub in jc.sub_jaxprs(eqn):
            _streamed_sites(sub, inner, out)


def _skipped(occurrences: tuple[tuple[tuple[Any, ...], int], ...]) -> None:
    """The host side of a branch that did not run: ``(named sites, callbacks)`` it skipped."""
    policy = RECEIVERS.active
    if policy is None:
        return
    counts: dict[StreamSite, int] = {}
    for named, n in occurrences:
        for site in {s.counter_key: s for s in (x() for x in named)}.values():
            counts[site] = max(counts.get(site, 0), n)
    for site, n in counts.items():
        policy.skip(site, n)


def _cond_lowering(lowered: Callable[[], Any], ctx: Any, branches: list[Any]) -> Any:
    """JAX's lowering of a cond (``lowered``), each branch ending with a callback that tells
    the host how many occurrences it skipped of the streamed sites only other branches hold."""
    sites: list[dict[tuple[SiteStatic, str], int | None]] = []
    for branch in branches:
        sites.append({})
        _streamed_sites(branch, 1, sites[-1])
    names = [{(s.name, m) for s, m in held} for held in sites]
    skips = [
        {key: n for other, held in enumerate(sites) if other != b for key, n in held.items()
         if (key[0].name, key[1]) not in names[b] and n is not None
         and "shard" not in key[0].extras}
        for b in range(len(branches))]
    if not any(skips):
        return lowered()
    seen: dict[tuple[SiteStatic, str], list[Any]] = {}
    _LOWERED.stack.append(seen)
    try:
        outs = lowered()
    finally:
        _LOWERED.stack.pop()
    case_op = jc.lowered_case_op(len(branches))
    if case_op is None:
        return outs
    for b, skip in enumerate(skips):
        occurrences = tuple((tuple(seen[key]), n) for key, n in skip.items() if key in seen)
        if occurrences:
            quiet = ctx.replace(avals_in=[], avals_out=[], tokens_out=None)
            with jc.at_branch_end(case_op, b):
                jc.emit_host_callback(quiet, functools.partial(_skipped, occurrences), [], [])
    return outs


jc.wrap_cond_lowering(_cond_lowering)
jc.track_loop_lowerings()  # where each site sits in the program: its records' index
jc.track_transposed_lowerings()  # which sites are lowered in a backward pass


def _sow_lowering(ctx: Any, *args: Any, site: SiteStatic, mode: str, capture: bool,
                  stream: StreamConfig | None, summary: str, every: int,
                  recompute: bool | str) -> list[Any]:
    leaves, _ = _split(args, site)
    if stream is None or recompute:
        return leaves
    if naming.forward_mode(mode) and jc.lowering_in_transpose(ctx):
        # Forward code lowered in a backward pass is a recomputation, silent as under
        # jax.checkpoint: a custom_vjp bwd re-evaluating a jaxpr traced in the forward pass
        # (JAX's tracing caches hand a nested loop's body back as it was traced there, so
        # the sow was not bound again in the bwd, where it would have been marked).
        return leaves
    leaf_avals, _ = _split(ctx.avals_in, site)
    # The mask and the witnesses stay on the device.
    sent = tuple(k for k in site.extras if k not in ("taken", "batch"))
    order = next(_lowering_order)
    enclosing = jc.lowering_loops(site.scan3)
    info = stream_site(site, mode, leaf_avals, summary=summary, every=every,
                       loops=naming.program_loops(enclosing), enclosing=enclosing, order=order,
                       extras=sent)
    # Several processes: stats in two levels, leaf by leaf (_site_summary); inside shard_map
    # (a per-shard site) each leaf on its own too.
    pack = jc.global_devices(ctx) is None and "shard" not in site.extras
    groups = pack_plan(list(leaf_avals), summary) if pack else None
    if groups is not None:
        info = dataclasses.replace(info, packing=packing_of(groups, len(leaf_avals), summary))
    in_branch = bool(jc.branch_path(ctx))
    if in_branch:
        info = dataclasses.replace(info, in_branch=True)
    naming.note_branches(ctx, info, site.numbering)
    if in_branch and info.loops and "shard" in site.extras:
        _warn_counted_index(site.name)

    def on_device(*operands: Any) -> list[Any]:
        values, extras = _split(operands, site)
        values = taken_rows(values, site, extras)
        if reads_copy():  # before the every=N cond, whose operands XLA must write out
            values = apart_all(values)
        extras = [x for k, x in zip(site.extras, extras, strict=True)
                  if k not in ("taken", "batch")]

        def emit() -> None:
            arrays = _site_summary(ctx, values, summary, info.bins, groups)
            sow_emit_p.bind(*arrays, *extras, site=info,
                            export_process=stream.export_process)

        if every > 1 and "step" in site.extras and not in_branch:
            step = extras[sent.index("step")]
            jax.lax.cond(is_due(step, every), emit, lambda: None)
        else:
            emit()
        return []

    jc.mlir.lower_fun(on_device, multiple_results=True)(ctx, *args)
    if _LOWERED.stack:
        _note_lowered(site, mode, jc.module_state(ctx)[("numbered", info)])
    return leaves


jc.register_uncached_lowering(sow_p, _sow_lowering)  # one host callback per occurrence


def _sow_silent(*args: Any, **params: Any) -> list[Any]:
    return sow_p.bind(*args, **{**params, "recompute": "primal"})  # type: ignore[no-any-return]


# jax_remat3's checkpoint reruns a sow where it rematerialises: silently, as the partial-eval
# rule above does for the classic checkpoint, so the primal is reported once. Unlike the
# classic one, jax_remat3 differentiates the rerun (not the forward pass): its derivatives
# are the site's own and must report ("primal": only the primal is silent).
jc.register_remat3_rule(sow_p, _sow_silent)
