"""Jaxprs closed or not: JAX up to 0.10 wraps a jaxpr and its consts in a ``ClosedJaxpr``; since
0.11 a ``Jaxpr`` carries its consts itself (checked on 0.10.2, 0.11.2 and 0.12.0.1). Part of
:mod:`sowtel._jax_compat`, which re-exports it."""

from __future__ import annotations

from typing import Any

from jax._src import core

# A distinct ClosedJaxpr class exists up to JAX 0.10 only: since 0.11 a Jaxpr carries its consts.
CLOSED_JAXPR: Any = getattr(core, "ClosedJaxpr", None)
if CLOSED_JAXPR is core.Jaxpr:
    CLOSED_JAXPR = None
# What carries its own consts: a ClosedJaxpr up to 0.10, any Jaxpr since 0.11.
CLOSED: Any = core.Jaxpr if CLOSED_JAXPR is None else CLOSED_JAXPR


def as_jaxpr(value: Any) -> Any:
    """The jaxpr to walk if ``value`` (an equation parameter) is a jaxpr, closed or not; else None.

    Example:
        >>> import jax
        >>> closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
        >>> [e.primitive.name for e in as_jaxpr(closed).eqns], as_jaxpr(3)
        (['add'], None)
    """
    if CLOSED_JAXPR is not None and isinstance(value, CLOSED_JAXPR):
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
    if CLOSED_JAXPR is not None and isinstance(value, CLOSED_JAXPR):
        return value.jaxpr, list(value.consts)
    return value, list(getattr(value, "consts", ()))
