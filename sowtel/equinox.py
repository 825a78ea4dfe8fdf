"""Equinox: module outputs as sites (``sowtel.equinox.capture``) and ``eqx.filter_jit`` with
streaming (``sowtel.equinox.filter_jit``).

Equinox models are pytrees, and steps over them are compiled with ``eqx.filter_jit`` (every
array traced, everything else static). :func:`filter_jit` keeps those semantics and streams the
step's sites as :func:`sowtel.jit` does: summaries as outputs of the compiled step, the plain
program on steps that log nothing.

:func:`capture` returns the model with each callable submodule wrapped, so that the output of
its ``__call__`` is a site named by its path in the model (``layers/0/__call__``; ``__call__``
for the model itself). Wrap inside the loss function: the gradients keep the model's own
structure.

Equinox is imported when first needed, so ``import sowtel`` never requires it.

Example:
    >>> import jax, jax.numpy as jnp, equinox as eqx, sowtel, sowtel.equinox
    >>> model = eqx.nn.MLP(2, 1, width_size=3, depth=1, key=jax.random.key(0))
    >>> @sowtel.equinox.filter_jit
    ... def grads(model, x):
    ...     return eqx.filter_grad(
    ...         lambda m: sowtel.equinox.capture(m, filter="layers/*")(x).sum())(model)
    >>> with sowtel.enable(exporter="memory") as session:
    ...     g = grads(model, jnp.ones(2))
    ...     _ = sowtel.flush()
    >>> records = session.exporters[0].records
    >>> sorted({(r.name, r.mode) for r in records})  # doctest: +NORMALIZE_WHITESPACE
    [('layers/0/__call__', 'cotangent'), ('layers/0/__call__', 'primal'),
     ('layers/1/__call__', 'cotangent'), ('layers/1/__call__', 'primal')]
    >>> type(g) is type(model)
    True
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax

from sowtel import _module_sites, errors, naming
from sowtel.jit import Jitted, SplitJitted, name_after

__all__ = ["capture", "filter_jit"]


def _eqx() -> Any:
    try:
        import equinox as eqx
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "sowtel.equinox needs Equinox: pip install 'sowtel[equinox]'") from err
    return eqx


# -- capture ----------------------------------------------------------------------------------


def _key_text(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


_SOWN_CLASSES: dict[bool, Any] = {}


def _sown_class(stateful: bool) -> Any:
    """``Sown``: an Equinox module that calls the module it wraps and sows the output; for an
    ``eqx.nn.StatefulLayer`` one that is a ``StatefulLayer`` too, since ``eqx.nn.Sequential``
    tells by ``isinstance`` which layers to hand the state."""
    if stateful in _SOWN_CLASSES:
        return _SOWN_CLASSES[stateful]
    eqx = _eqx()

    class Sown(eqx.Module):  # type: ignore[name-defined,misc]
        module: Any
        site: str = eqx.field(static=True)
        base: str | None = eqx.field(static=True)
        options: tuple[tuple[str, Any], ...] = eqx.field(static=True)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = self.module(*args, **kwargs)
            return _module_sites.sow_output(out, self.site, self.base, **dict(self.options))

        def __getattr__(self, name: str) -> Any:
            # The parent's code may read its child's fields (self.linear.weight): they are
            # the wrapped module's.
            if name == "module":
                raise AttributeError(name)
            return getattr(self.module, name)

    if not stateful:
        _SOWN_CLASSES[stateful] = Sown
        return Sown

    class SownStateful(Sown, eqx.nn.StatefulLayer):  # type: ignore[name-defined,misc]
        def is_stateful(self) -> bool:
            return bool(self.module.is_stateful())

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not self.module.is_stateful():
                return Sown.__call__(self, *args, **kwargs)
            # (output, state): the site is the output; the state is threaded on as it came.
            out, state = self.module(*args, **kwargs)
            return _module_sites.sow_output(out, self.site, self.base,
                                            **dict(self.options)), state

    _SOWN_CLASSES[stateful] = SownStateful
    return SownStateful


def capture(model: Any, filter: Any = None, *, tag: str = "intermediates",
            summary: str | None = None, every: int | None = None) -> Any:
    """``model`` with the output of every callable submodule's ``__call__`` made a site.

    Each ``eqx.Module`` in ``model`` that has a ``__call__`` (and ``model`` itself) is wrapped
    in a small module that calls it and sows its output as ``<path>/__call__``, the path being
    the attribute and index path in the model (``layers/0/__call__``). Attributes of a wrapped
    module still read through. The sites stream (with their cotangents under ``grad``) and
    :func:`sowtel.save_intermediates` captures them; outputs that are not pytrees of arrays
    are left alone.

    Call it inside the loss (``capture(model)(x)``), so that ``grad`` sees the model's own
    structure. With nothing enabled the wrapped model computes exactly what ``model`` does and
    the compiled program is the same.

    Args:
      model: an ``eqx.Module``.
      filter: ``None`` (every module), a function ``filter(module, "__call__") -> bool``, or
        glob patterns on the site name (as ``enable(include=...)`` matches).
      tag, summary, every: as for :func:`sowtel.sow`, for every site made here.

    Example:
        >>> import jax, jax.numpy as jnp, equinox as eqx, sowtel, sowtel.equinox
        >>> model = eqx.nn.Sequential([eqx.nn.Linear(2, 3, key=jax.random.key(0)),
        ...                            eqx.nn.Lambda(jnp.tanh)])
        >>> _, inter = sowtel.save_intermediates(
        ...     lambda m, x: sowtel.equinox.capture(m)(x))(model, jnp.ones(2))
        >>> list(inter)
        ['layers/0/__call__', 'layers/1/__call__', '__call__']
    """
    eqx = _eqx()
    if not isinstance(model, eqx.Module):
        raise errors.NotAModuleError("sowtel.equinox.capture", "an eqx.Module", model)
    select = _module_sites.check_filter(filter, "sowtel.equinox.capture")
    _module_sites.check_options(tag, every)
    options = (("tag", tag), ("summary", summary), ("every", every))
    base = naming.current_prefix()

    def wrap(node: Any, path: tuple[str, ...]) -> Any:
        def is_child(x: Any) -> bool:
            return x is not node and isinstance(x, eqx.Module)

        children, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_child)
        leaves = [wrap(leaf, (*path, *(_key_text(k) for k in key_path))) if is_child(leaf)
                  else leaf for key_path, leaf in children]
        node = jax.tree_util.tree_unflatten(treedef, leaves)
        name = _module_sites.site_name(path, "__call__")
        if callable(node) and select(node, "__call__", name):
            sown = _sown_class(isinstance(node, eqx.nn.StatefulLayer))
            return sown(node, name, base, options)
        return node

    return wrap(model, ())


# -- filter_jit -------------------------------------------------------------------------------


class _Static:
    """Static (non-array) parts of a call, hashable for the jit cache: a pytree structure and its
    leaves, compared by value as ``eqx.filter_jit`` compares them."""

    def __init__(self, value: Any) -> None:
        self.leaves: list[Any]
        self.treedef: Any
        self.leaves, self.treedef = jax.tree_util.tree_flatten(value)
        try:
            self._hash = hash((self.treedef, tuple(self.leaves)))
        except TypeError as err:
            raise TypeError(
                f"sowtel.equinox.filter_jit: a non-array argument is not hashable ({err}); "
                "non-array arguments are static and must be hashable, as under eqx.filter_jit"
            ) from None

    @property
    def value(self) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Static) and self.treedef == other.treedef
                and self.leaves == other.leaves)


class _StaticOut:
    """A pytree node with no leaves that carries a static output through ``jax.jit``."""

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_StaticOut, lambda s: ((), s.value),
                                   lambda v, _: _StaticOut(v))

DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")


class FilterJitted(SplitJitted):
    """What :func:`filter_jit` returns: call it as the ``eqx.filter_jit`` function."""

    _label = "sowtel.equinox.filter_jit"

    def __init__(self, fun: Callable[..., Any], donate: str, options: dict[str, Any]) -> None:
        eqx = _eqx()

        def pure(first: Any, rest: Any, static: _Static) -> tuple[Any, _StaticOut]:
            (head, _), (f, tail, kwargs) = eqx.combine((first, rest), static.value)
            out = f(*head, *tail, **kwargs)
            dynamic, static_out = eqx.partition(out, eqx.is_array)
            return dynamic, _StaticOut(static_out)

        name_after(pure, fun)
        donated = {"all": (0, 1), "warn": (0, 1), "all-except-first": (1,),
                   "warn-except-first": (1,), "none": ()}[donate]
        self._quiet = donate in ("all", "all-except-first")
        self._fun = fun
        try:
            self._signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):  # no signature to read: the call's own arguments
            self._signature = None
        self._jitted = Jitted(pure, {**options, "static_argnums": 2, "donate_argnums": donated})
        functools.update_wrapper(self, fun)

    def _split(self, args: Any, kwargs: Any) -> tuple[Any, Any, _Static]:
        eqx = _eqx()
        if self._signature is not None:
            # As eqx.filter_jit binds them: the first argument is the first parameter's, by
            # position or keyword (donate="all-except-first" keeps it).
            bound = self._signature.bind(*args, **kwargs)
            args, kwargs = bound.args, bound.kwargs
        # The function is an argument too: the arrays of a module or a bound method called are
        # traced (and donated with the rest), as under eqx.filter_jit.
        first, rest = (args[:1], ()), (self._fun, args[1:], kwargs)
        dynamic, static = eqx.partition((first, rest), eqx.is_array)
        return dynamic[0], dynamic[1], _Static(static)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        eqx = _eqx()
        with warnings.catch_warnings():
            if self._quiet:
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            dynamic, static_out = self._jitted(*self._split(args, kwargs))
        return eqx.combine(dynamic, static_out.value)


def filter_jit(fun: Callable[..., Any] | None = None, /, *, donate: str = "none",
               **jax_jit_options: Any) -> Any:
    """``eqx.filter_jit`` that streams: arrays traced, everything else static; sites stream.

    Every JAX or NumPy array in the arguments (at any depth, inside modules too) is traced;
    every other value is static (part of the cache key, so it must be hashable). The result
    may hold non-array values. Streaming is :func:`sowtel.jit`'s: with no session, or on a step
    that logs nothing, the program is the plain one; on a logging step the summaries come back
    as outputs.

    Args:
      fun: the function (a training step, a model call).
      donate: as for ``eqx.filter_jit``: ``"none"`` (default), ``"all"``,
        ``"all-except-first"``, ``"warn"``, ``"warn-except-first"`` (the buffers of the arrays
        passed in may be reused for the results).
      jax_jit_options: further ``jax.jit`` options (``keep_unused``, ``device``, ...).

    Example:
        >>> import jax.numpy as jnp, sowtel, sowtel.equinox
        >>> @sowtel.equinox.filter_jit
        ... def scale(x, how):
        ...     return {"y": sowtel.sow(x * how["by"], "y"), "tag": how["tag"]}
        >>> scale(jnp.ones(2), {"by": 3.0, "tag": "tripled"})
        {'tag': 'tripled', 'y': Array([3., 3.], dtype=float32)}
    """
    if fun is None:
        return lambda f: filter_jit(f, donate=donate, **jax_jit_options)
    if not callable(fun):
        raise errors.NotCallableError(fun, "sowtel.equinox.filter_jit",
                                      "sowtel.equinox.filter_jit(train_step)")
    if donate not in DONATE:
        raise errors.BadOptionError(
            "sowtel.equinox.filter_jit donate", donate, f"is not one of {DONATE}")
    for option in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        if option in jax_jit_options:
            raise errors.UnsupportedOptionError(
                "sowtel.equinox.filter_jit", option, "non-array arguments are static already, "
                "and donate= chooses what is donated")
    return FilterJitted(fun, donate, jax_jit_options)
