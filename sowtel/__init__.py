"""sowtel: observability for JAX.

Tag any intermediate value with :func:`sow`; then either stream it, with its tangent or
cotangent, live out of the compiled program (:func:`enable`), or capture it as returned arrays
(:func:`save_intermediates`). With nothing enabled a sow costs nothing: the compiled program is
the same as without it.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def loss(w, x):
    ...     h = sowtel.sow(jnp.tanh(x @ w), "hidden")
    ...     return jnp.mean(h ** 2)
    >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    >>> grads, inter = sowtel.save_intermediates(jax.grad(loss))(w, x)
    >>> sorted(inter["hidden"])
    ['cotangent', 'primal']
    >>> with sowtel.enable(exporter="memory") as session:
    ...     _ = jax.jit(jax.grad(loss))(w, x)
    ...     _ = sowtel.flush()
    >>> sorted({r.mode for r in session.exporters[0].records})
    ['cotangent', 'primal']
"""

from sowtel import (
    _cond_rows,  # noqa: F401  (sowtel's rule for a vmapped cond)
    errors,
)
from sowtel.alerts import AlertError, AlertWarning, alert
from sowtel.capture import save_intermediates
from sowtel.compare import Divergence, compare_runs
from sowtel.dumps import dump, load
from sowtel.intermediates import Intermediates
from sowtel.jit import jit
from sowtel.locate import NonFiniteEvent, NonFiniteReport, locate_nonfinite
from sowtel.naming import scope
from sowtel.nonfinite import NonFiniteError, NonFiniteWarning
from sowtel.primitive import sow
from sowtel.records import Record
from sowtel.session import Session, disable, enable, export, flush, log, status
from sowtel.steps import at_step
from sowtel.tap import tap

__version__ = "0.1.0"

__all__ = [
    "AlertError", "AlertWarning", "Divergence", "Intermediates", "Record", "Session", "alert",
    "at_step", "compare_runs", "disable",
    "dump", "enable", "export",
    "flush", "jit", "load", "locate_nonfinite", "log", "NonFiniteError", "NonFiniteEvent",
    "NonFiniteReport", "NonFiniteWarning",
    "save_intermediates", "scope", "sow", "status", "tap", "errors",
]

# Integrations whose frameworks are optional: imported on first use, so `sowtel.optax.watch`
# works after a plain `import sowtel` and `import sowtel` never needs Flax, Optax or Equinox.
_INTEGRATIONS = ("flax", "nnx", "optax", "equinox")


def __getattr__(name: str) -> object:
    if name in _INTEGRATIONS:
        import importlib

        return importlib.import_module(f"sowtel.{name}")
    raise AttributeError(f"module 'sowtel' has no attribute {name!r}")
