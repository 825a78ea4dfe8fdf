"""Sites named by Flax module path: ``sowtel.flax.sow``, ``module_scopes`` and ``capture``.

Flax's own ``Module.sow`` files a value under the path of the module that sows it, so a block
class used three times gives three entries. ``sowtel.flax`` names sowtel sites the same way:

- :func:`sow` inside a Linen module names the site ``<module path>/<name>``, for example
  ``Encoder_0/Block_2/act``;
- :func:`module_scopes` around ``model.apply`` (or ``init``) names every plain
  :func:`sowtel.sow` called by a module method that way, with no change to the model's code;
- :func:`capture` around ``model.apply`` makes the output of every module's ``__call__`` (or
  of the methods a filter selects) a site named ``<module path>/<method>``, for example
  ``Encoder_0/Block_2/__call__``, with no ``sow`` in the model at all: it streams, with its
  cotangent under ``grad``, and :func:`sowtel.save_intermediates` captures it.

Flax NNX modules carry no path of their own: wrap each call of a reused submodule in
:func:`sowtel.scope` (``with sowtel.scope(f"blocks/{i}"): x = block(x)``), or use
:func:`sowtel.nnx.capture`, which names module outputs by their attribute path.

Flax is imported when first needed, so ``import sowtel`` never requires it.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, sowtel, sowtel.flax
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return sowtel.flax.sow(self, nn.tanh(nn.Dense(2)(x)), "act")
    >>> class Model(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         x = Block()(x)
    ...         return Block()(x).sum()
    >>> params = Model().init(jax.random.key(0), jnp.ones(2))
    >>> _, inter = sowtel.save_intermediates(Model().apply)(params, jnp.ones(2))
    >>> list(inter)
    ['Block_0/act', 'Block_1/act']
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sowtel import _module_sites, errors, naming
from sowtel.primitive import sow as _sow

__all__ = ["sow", "module_path", "module_scopes", "capture"]

_INTERCEPTING = threading.local()  # inside module_scopes, the module path is already the scope


def _is_linen_module(module: Any) -> bool:
    try:
        import flax.linen as nn
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "sowtel.flax needs Flax: pip install flax (or sowtel[flax])") from err
    return isinstance(module, nn.Module)


def module_path(module: Any) -> str:
    """The ``/``-joined path of a bound Linen module (``""`` for the top-level module).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, sowtel.flax
        >>> class Inner(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         print(sowtel.flax.module_path(self))
        ...         return x
        >>> class Outer(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return Inner(name="inner")(x)
        >>> _ = Outer().init(jax.random.key(0), jnp.ones(1))
        inner
    """
    if not _is_linen_module(module):
        raise errors.NotAModuleError(
            "sowtel.flax", "a flax.linen.Module (pass `self` inside a method)", module,
            "; for Flax NNX use sowtel.scope")
    scope = module.scope
    if scope is None:
        raise errors.UnboundModuleError(module)
    return "/".join(str(part) for part in scope.path)


def sow(module: Any, value: Any, name: str, **kwargs: Any) -> Any:
    """``sowtel.sow(value, "<module path>/<name>", **kwargs)``, from a Linen module's method.

    The site is named by the path of ``module`` (``self``), as ``Module.sow`` files values, so a
    module class used several times gives one site per instance: ``Block_0/act``,
    ``Block_1/act``, ... Enclosing :func:`sowtel.scope` prefixes still apply. Returns ``value``.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, sowtel, sowtel.flax
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         h = sowtel.flax.sow(self, nn.relu(nn.Dense(3, name="hidden")(x)), "act")
        ...         return nn.Dense(1)(h).sum()
        >>> params = MLP().init(jax.random.key(0), jnp.ones(2))
        >>> _, inter = sowtel.save_intermediates(jax.grad(MLP().apply))(params, jnp.ones(2))
        >>> list(inter), list(inter["act"])
        (['act'], ['primal', 'cotangent'])
    """
    path = module_path(module)
    if getattr(_INTERCEPTING, "depth", 0):
        return _sow(value, name, **kwargs)
    return _sow(value, f"{path}/{name}" if path else name, **kwargs)


@contextmanager
def module_scopes() -> Iterator[None]:
    """Names every ``sowtel.sow`` called by a Linen module method ``<module path>/<name>``.

    Wrap ``model.init`` / ``model.apply`` (inside the jitted function, or around a call that
    traces it): plain ``sowtel.sow(x, "act")`` calls in modules need no change. A sow in the
    top-level module keeps its name; :func:`sowtel.scope` prefixes entered outside the wrapper
    stay in front. Uses ``flax.linen.intercept_methods``.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, sowtel, sowtel.flax
        >>> class Block(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return sowtel.sow(nn.tanh(nn.Dense(2)(x)), "act")
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = Block()(x)
        ...         return Block()(x).sum()
        >>> params = Model().init(jax.random.key(0), jnp.ones(2))
        >>> def loss(params, x):
        ...     with sowtel.flax.module_scopes():
        ...         return Model().apply(params, x)
        >>> _, inter = sowtel.save_intermediates(loss)(params, jnp.ones(2))
        >>> list(inter)
        ['Block_0/act', 'Block_1/act']
    """
    import flax.linen as nn

    base = naming.current_prefix()

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any,
                    context: Any) -> Any:
        path = "/".join(str(part) for part in context.module.scope.path) if (
            context.module.scope is not None) else ""
        parts = [p for p in (base, path) if p]
        with naming.absolute_prefix("/".join(parts) if parts else None):
            return next_fun(*args, **kwargs)

    _INTERCEPTING.depth = getattr(_INTERCEPTING, "depth", 0) + 1
    try:
        with nn.intercept_methods(interceptor):
            yield
    finally:
        _INTERCEPTING.depth -= 1


@contextmanager
def capture(filter: Any = None, *, tag: str = "intermediates", summary: str | None = None,
            every: int | None = None) -> Iterator[None]:
    """Makes the outputs of Linen module methods sites, named ``<module path>/<method>``.

    Flax's ``capture_intermediates`` for sowtel: inside the context every call of a selected
    method of a bound Linen module sows its output, so it streams (with its tangent or
    cotangent under ``jvp`` / ``grad``) and :func:`sowtel.save_intermediates` captures it. A
    module called twice gives ``..._0`` and ``..._1``, as repeated sows do. Outputs that are not
    pytrees of arrays are left alone. Uses ``flax.linen.intercept_methods``.

    Enter it where the model runs: inside the jitted step, around ``model.apply`` (it is read
    when the step is traced). With nothing enabled it adds nothing to the compiled program.

    Args:
      filter: which calls become sites: ``None`` every module's ``__call__``; a function
        ``filter(module, method_name) -> bool`` (as ``capture_intermediates`` takes); or glob
        patterns on the site name, matched as ``enable(include=...)`` matches (``*`` matches
        ``/`` too: ``"Block_*"`` selects ``Block_0/__call__`` and ``Block_0/Dense_0/__call__``).
      tag, summary, every: as for :func:`sowtel.sow`, for every site made here.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, sowtel, sowtel.flax
        >>> class Block(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.tanh(nn.Dense(2)(x))
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return Block()(Block()(x)).sum()
        >>> params = Model().init(jax.random.key(0), jnp.ones(2))
        >>> def loss(params, x):
        ...     with sowtel.flax.capture(filter=lambda module, method: isinstance(module, Block)):
        ...         return Model().apply(params, x)
        >>> _, inter = sowtel.save_intermediates(jax.grad(loss))(params, jnp.ones(2))
        >>> sorted(inter), list(inter["Block_1/__call__"])
        (['Block_0/__call__', 'Block_1/__call__'], ['primal', 'cotangent'])
    """
    import flax.linen as nn

    select = _module_sites.check_filter(filter, "sowtel.flax.capture")
    _module_sites.check_options(tag, every)
    base = naming.current_prefix()

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any,
                    context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if module.scope is None:
            return out
        name = _module_sites.site_name(module.scope.path, context.method_name)
        if not select(module, context.method_name, name):
            return out
        return _module_sites.sow_output(out, name, base, tag=tag, summary=summary, every=every)

    with nn.intercept_methods(interceptor):
        yield
