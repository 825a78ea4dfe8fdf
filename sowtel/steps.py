"""Steps: :func:`at_step`, the step records of the sows inside carry.

A step given inside traced code (a device value) travels with the sow as an extra operand
(:func:`traced_step` reads it while the sow is bound); a step given around the call (a Python
int) is a host step (:func:`host_step`): on a step that logs nothing, the call runs the program
compiled without sows.

Example:
    >>> with at_step(3):
    ...     host_step()
    3
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax.numpy as jnp
import numpy as np

from sowtel import _jax_compat as jc
from sowtel import errors
from sowtel.context import CONTEXT, RECEIVERS, current_context

__all__ = ["at_step", "host_step", "traced_step"]


_STEP = threading.local()


@contextmanager
def at_step(step: Any) -> Iterator[None]:
    """Records of sows inside carry ``step`` as their step; ``every=N`` skips the other steps.

    Two ways to use it:

    - **inside traced code** (in the jitted function), ``step`` is a device value (an integer
      tracer or array): records carry it, and ``every=N`` is decided on the device, so a step
      that does not log sends nothing to the host;
    - **around the call** of a jitted function, ``step`` is a Python int: a step that logs
      nothing runs the program compiled without sows (the same program as with streaming off),
      and one that logs runs the instrumented one. Two programs are compiled, and the steps
      that do not log cost nothing at all.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> @jax.jit
        ... def train_step(params, step):
        ...     with sowtel.at_step(step):              # device-side step
        ...         h = sowtel.sow(params * 2, "h", every=10)
        ...     return h.sum()
        >>> @jax.jit
        ... def plain_step(params):
        ...     return sowtel.sow(params * 2, "h").sum()
        >>> with sowtel.enable(exporter="memory", every=10):
        ...     for step in range(20):
        ...         with sowtel.at_step(step):          # host-side step
        ...             _ = plain_step(jnp.ones(3))
    """
    if isinstance(step, bool) or not (
        isinstance(step, (int, np.integer))
        or (hasattr(step, "dtype") and jnp.issubdtype(step.dtype, jnp.integer))
    ):
        raise errors.BadStepError(step)
    if hasattr(step, "shape") and tuple(step.shape) != ():
        raise errors.BadStepError(step, tuple(step.shape))
    if not jc.is_tracing() and not isinstance(step, jc.core.Tracer):
        with _host_step(int(step)):
            yield
        return
    stack = _STEP.__dict__.setdefault("stack", [])
    stack.append(step)
    try:
        yield
    finally:
        stack.pop()


# The step of the innermost host-side at_step, per thread (and per asyncio task).
HOST_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "sowtel_host_step", default=None)


def host_step() -> int | None:
    """The step of the host-side :func:`at_step` around this call, in this thread; or None.

    Example:
        >>> with at_step(7):
        ...     inside = host_step()
        >>> inside, host_step()
        (7, None)
    """
    return HOST_STEP.get()


@contextmanager
def _host_step(step: int) -> Iterator[None]:
    token = HOST_STEP.set(step)
    try:
        ctx = current_context()
        policy = RECEIVERS.active
        if ctx is None or ctx.stream is None or policy is None:
            yield
            return
        if _in_asyncio_task():
            # Tasks share their thread, and JAX's jit context is per thread: a quiet step's
            # switch held across an await would reach the other tasks' calls (a logging step
            # run quiet loses its records). So in a task every step runs the instrumented
            # program, in a block the callbacks read their step from, and the host drops the
            # records of steps that do not log.
            with policy.host_step_block(step):
                yield
            return
        logs = policy.logs_at(step)
        with (policy.host_step_block(step) if logs else contextlib.nullcontext()), \
                CONTEXT(dataclasses.replace(ctx, quiet=not logs)):
            yield
    finally:
        HOST_STEP.reset(token)


def _in_asyncio_task() -> bool:
    asyncio = sys.modules.get("asyncio")  # never imported: no task can be running
    if asyncio is None:
        return False
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no running event loop in this thread
        return False


def traced_step() -> Any | None:
    """The step of the innermost :func:`at_step` entered while tracing (a device value), or
    None: sows bound now carry it as their ``"step"`` extra."""
    stack = _STEP.__dict__.get("stack")
    return stack[-1] if stack else None
