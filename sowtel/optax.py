"""``sowtel.optax.watch``: gradient, update and parameter statistics of any Optax optimizer.

``wandb.watch`` logs gradient and parameter histograms every N steps with one line; this is the
same line for a JAX training step: wrap the optimizer, change nothing else.

    tx = sowtel.optax.watch(optax.adam(1e-3), every=10)

Inside the wrapped transformation's ``update`` these become sites (pytree sites: one series per
leaf, named by the leaf's path in the parameter tree):

======================================  =================================================
site                                    what it is
======================================  =================================================
``optim/grads/<path>``                  the gradients the optimizer receives
``optim/updates/<path>``                the updates it returns (what ``apply_updates`` adds)
``optim/params/<path>``                 the parameters, when ``update`` is given them
``optim/norm/grads``                    the global l2 norm of all gradients (a scalar)
``optim/norm/updates``                  the global l2 norm of all updates
``optim/norm/params``                   the global l2 norm of all parameters
``optim/update_ratio/<path>``           per leaf, ``‖update‖ / (‖param‖ + 1e-8)``: how far a
                                        step moves each parameter array, relative to its size
======================================  =================================================

They stream through both transports like any sow: ``jax.jit`` under :func:`sowtel.enable`
(host callbacks) and :func:`sowtel.jit` (summaries as outputs of the step), and they are captured
by :func:`sowtel.save_intermediates`. ``every=N`` streams them on steps divisible by N only (the
session's ``every`` when None); with :func:`sowtel.jit` the other steps run the plain program.

With nothing enabled the wrapper computes nothing: the step's compiled program is the one of the
unwrapped optimizer (the norms and ratios are only traced while sowtel observes).

Example:
    >>> import jax, jax.numpy as jnp, optax, sowtel, sowtel.optax
    >>> tx = sowtel.optax.watch(optax.sgd(0.5))
    >>> params = {"w": jnp.array([3.0, 4.0])}
    >>> @sowtel.jit
    ... def step(params, state):
    ...     grads = jax.grad(lambda p: (p["w"] ** 2).sum() / 2)(params)
    ...     updates, state = tx.update(grads, state, params)
    ...     return optax.apply_updates(params, updates), state
    >>> with sowtel.enable(exporter="memory") as session:
    ...     params, _ = step(params, tx.init(params))
    ...     _ = sowtel.flush()
    >>> records = session.exporters[0].records
    >>> watched = ("optim/norm", "optim/update_ratio")
    >>> {r.name: round(r.stats["mean"], 3) for r in records
    ...  if r.name.startswith(watched)}  # doctest: +NORMALIZE_WHITESPACE
    {'optim/norm/grads': 5.0, 'optim/norm/updates': 2.5, 'optim/norm/params': 5.0,
     'optim/update_ratio/w': 0.5}
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp

from sowtel import errors
from sowtel.context import check_positive_int, current_context
from sowtel.naming import check_name, check_tag
from sowtel.primitive import sow as _sow

__all__ = ["watch", "RATIO_EPS"]

#: Added to a parameter leaf's norm in ``optim/update_ratio``: a leaf that is all zeros (a bias
#: at initialisation) gives a large finite ratio, never an infinity that would raise alerts.
RATIO_EPS = 1e-8


def _observing() -> bool:
    """Whether a sow traced now could capture or stream (else the wrapper adds no operation)."""
    ctx = current_context()
    return ctx is not None and (ctx.capture is not None
                                or (ctx.stream is not None and not ctx.quiet))


def _norm(tree: Any) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(jnp.sum(jnp.square(jnp.abs(x).astype(jnp.float32))) for x in leaves))


def _leaf_norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(jnp.abs(x).astype(jnp.float32))))


def watch(tx: Any, *, grads: bool = True, updates: bool = True, params: bool = True,
          every: int | None = None, prefix: str = "optim", tag: str = "intermediates",
          summary: str | None = None) -> Any:
    """Wraps an Optax ``GradientTransformation`` so its ``update`` sows what it sees.

    Args:
      tx: any ``optax.GradientTransformation`` (with or without extra arguments).
      grads: sow the incoming gradients (``optim/grads/<path>``) and their global norm.
      updates: sow the outgoing updates (``optim/updates/<path>``) and their global norm.
      params: sow the parameters given to ``update`` (``optim/params/<path>``), their global
        norm, and (with ``updates``) the per-leaf update-to-parameter ratio
        ``optim/update_ratio/<path>``. Nothing is sown for parameters when ``update`` is called
        without them.
      every: stream these sites on steps divisible by ``every`` only (None: the session's).
      prefix: the first segment of the site names (``"optim"``); give each of several watched
        optimizers its own.
      tag: the sites' tag (``enable(tags=...)`` selects by it).
      summary: what streaming sends for these sites (None: the session's default, usually
        ``"stats"``; ``"histogram"`` gives ``wandb.watch``'s histograms).

    Returns:
      a transformation with the same ``init`` and an ``update`` whose results are exactly
      those of ``tx.update``, called the way ``tx.update`` is: ``update(updates, state,
      params=None)``, with ``params`` positional or a keyword, as optax's own wrappers
      (``MultiSteps``, ``chain``, ``masked``, ...) pass it. It is an
      ``optax.GradientTransformationExtraArgs`` (whose ``update`` takes and passes on
      ``**extra_args``) when ``tx`` is one, and a plain ``optax.GradientTransformation``
      when ``tx`` is plain, since optax's wrappers tell the two apart with ``isinstance``.

    Example:
        >>> import jax.numpy as jnp, optax, sowtel, sowtel.optax
        >>> tx = sowtel.optax.watch(optax.sgd(0.1), every=10)
        >>> p = {"w": jnp.ones(2)}
        >>> _, inter = sowtel.save_intermediates(
        ...     lambda g, p: tx.update(g, tx.init(p), p))({"w": jnp.ones(2)}, p)
        >>> list(inter)  # doctest: +NORMALIZE_WHITESPACE
        ['optim/grads', 'optim/norm/grads', 'optim/updates', 'optim/norm/updates',
         'optim/params', 'optim/norm/params', 'optim/update_ratio']
        >>> round(float(inter["optim/update_ratio"]["primal"]["w"]), 6)
        0.1
    """
    import optax

    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise errors.NotAModuleError(
            "sowtel.optax.watch", "an optax.GradientTransformation (with init and update)", tx,
            ": pass e.g. optax.adam(1e-3)")
    for flag, what in ((grads, "grads"), (updates, "updates"), (params, "params")):
        if not isinstance(flag, bool):
            raise errors.BadOptionTypeError(
                f"sowtel.optax.watch {what}", flag, "must be True or False")
    if every is not None:
        check_positive_int(every, "sowtel.optax.watch every")
    check_name(prefix)
    check_tag(tag)
    extra_args = isinstance(tx, optax.GradientTransformationExtraArgs) or (
        not isinstance(tx, optax.GradientTransformation) and _takes_extra_args(tx.update))

    sow_grads, sow_updates, sow_params = grads, updates, params

    def sow(value: Any, name: str) -> Any:
        return _sow(value, f"{prefix}/{name}", tag=tag, summary=summary, every=every)

    def observed(g: Any, state: Any, p: Any, extra: dict[str, Any]) -> tuple[Any, Any]:
        # tx.update is called in optax's own convention (TransformUpdateFn): params third and
        # positional, whatever the caller used; extra arguments as keywords.
        if not _observing():  # the plain program: not one operation more than tx's own
            return tx.update(g, state, p, **extra)  # type: ignore[no-any-return]
        if sow_grads:
            g = sow(g, "grads")
            sow(_norm(g), "norm/grads")
        u, state = tx.update(g, state, p, **extra)
        if sow_updates:
            u = sow(u, "updates")
            sow(_norm(u), "norm/updates")
        if sow_params and p is not None:
            sow(p, "params")
            sow(_norm(p), "norm/params")
            if sow_updates:
                ratio = jax.tree_util.tree_map(
                    lambda du, x: _leaf_norm(du) / (_leaf_norm(x) + RATIO_EPS), u, p)
                sow(ratio, "update_ratio")
        return u, state

    # The names of optax's own signatures: callers pass updates, state and params by keyword.
    if extra_args:
        def update(updates: Any, state: Any, params: Any = None,
                   **extra_args: Any) -> tuple[Any, Any]:
            return observed(updates, state, params, extra_args)

        return optax.GradientTransformationExtraArgs(tx.init, update)

    def update_plain(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return observed(updates, state, params, {})

    return optax.GradientTransformation(tx.init, update_plain)


def _takes_extra_args(update: Any) -> bool:
    """Whether ``update`` (of an object that is no ``GradientTransformation``, such as
    ``optax.MultiSteps``) takes keyword arguments beyond ``params``."""
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):  # no signature to read: take extra arguments, as optax may
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
