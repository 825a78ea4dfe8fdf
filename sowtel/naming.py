"""Naming sites: ``scope`` prefixes, and numbering a name sown more than once in one program.

A site's name is the name given to :func:`sowtel.sow`, prefixed by every enclosing
:func:`scope` (joined with ``/``). Scopes are read when the sow is traced, so they work the same
in eager code, inside ``jax.jit``, for streaming and for :func:`sowtel.save_intermediates`.

A name sown more than once in one traced program (a block called three times) is never merged
into one series: ``save_intermediates(duplicates="number")`` and streaming both name the
occurrences ``name_0``, ``name_1``, ... in trace order (cotangents carry the number of their
primal), and streaming warns once per name. Occurrences of a sow inside one separately jitted
function that is called several times share one compiled body: they cannot be told apart while
streaming, so give them distinct names with :func:`scope`.

Example:
    >>> import jax, jax.numpy as jnp, sowtel
    >>> def block(x):
    ...     return jnp.tanh(sowtel.sow(x, "act"))
    >>> def model(x):
    ...     for i in range(2):
    ...         with sowtel.scope(f"block{i}"):
    ...             x = block(x)
    ...     return x.sum()
    >>> _, inter = sowtel.save_intermediates(model)(jnp.ones(2))
    >>> list(inter)
    ['block0/act', 'block1/act']
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sowtel import _jax_compat as jc

if TYPE_CHECKING:
    from sowtel.primitive import StreamSite

__all__ = ["scope", "scoped", "runs_backward", "numbered", "number_in_program"]

_SCOPES = threading.local()


def _stack() -> list[str | None]:
    stack: list[str | None] | None = getattr(_SCOPES, "stack", None)
    if stack is None:
        stack = _SCOPES.stack = []
    return stack


def current_prefix() -> str | None:
    """The prefix that sows traced now get (``None`` outside any scope)."""
    stack = _stack()
    return stack[-1] if stack else None


def scoped(name: str) -> str:
    """``name`` under the current scope (``name`` itself outside any scope)."""
    stack = getattr(_SCOPES, "stack", None)
    prefix = stack[-1] if stack else None
    return name if prefix is None else f"{prefix}/{name}"


@contextmanager
def scope(prefix: str) -> Iterator[None]:
    """Names every sow traced inside ``<prefix>/<name>``; scopes nest with ``/``.

    ``prefix`` follows the rules of sow names (letters, digits, ``_ - . /``; no empty, ``.`` or
    ``..`` segment, no leading ``/``). The scope is read when a sow is traced: wrap the code that
    calls the sows (inside the jitted function, or around a module's call), in eager code and
    traced code alike; it names streamed records and :func:`sowtel.save_intermediates` keys the
    same way.

    Example:
        >>> import jax.numpy as jnp, sowtel
        >>> def f(x):
        ...     with sowtel.scope("encoder"):
        ...         with sowtel.scope("layer0"):
        ...             x = sowtel.sow(x * 2.0, "act")
        ...     return x.sum()
        >>> _, inter = sowtel.save_intermediates(f)(jnp.ones(2))
        >>> list(inter)
        ['encoder/layer0/act']
    """
    from sowtel.primitive import check_name  # primitive imports this module

    try:
        check_name(prefix)
    except ValueError as err:
        raise ValueError(str(err).replace("sow name", "sowtel.scope prefix", 1)) from None
    with absolute_prefix(scoped(prefix)):
        yield


@contextmanager
def absolute_prefix(prefix: str | None) -> Iterator[None]:
    """Sows traced inside are named ``<prefix>/<name>``, whatever scopes enclose this one."""
    stack = _stack()
    stack.append(prefix)
    try:
        yield
    finally:
        stack.pop()


# ---------------------------------------------------------------------------------------------
# Repeated names: one rule for capture and for streaming.


def runs_backward(mode: str) -> bool:
    """Backward passes run sites in reverse, so these modes are numbered from the end."""
    return "cotangent" in mode.split(".")


def numbered(name: str, occurrence: int) -> str:
    """The name of occurrence ``occurrence`` of a repeated ``name``."""
    return f"{name}_{occurrence}"


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_repeated(name: str) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"sow name {name!r} is used more than once in one program: streaming names the "
        f"occurrences {numbered(name, 0)!r}, {numbered(name, 1)!r}, ... in trace order (as "
        "save_intermediates(duplicates='number') does). Give each a distinct name with "
        "sowtel.scope or sowtel.flax.sow. A sow inside one separately jitted function that is "
        "called several times is compiled once, so its occurrences cannot be told apart: they "
        "stream as one site",
        stacklevel=2,
    )


class NumberedSite:
    """A streaming site and the others of its name in the same program.

    Its name is settled on the first callback, when the whole program has been lowered: until
    then it is not known whether the name repeats.
    """

    __slots__ = ("_site", "_position", "_program", "_resolved")

    def __init__(self, site: StreamSite, position: int, program: dict[Any, Any]) -> None:
        self._site = site
        self._position = position
        self._program = program
        self._resolved: StreamSite | None = None

    def __call__(self) -> StreamSite:
        resolved = self._resolved
        if resolved is None:
            resolved = self._resolved = self._resolve()
        return resolved

    def _resolve(self) -> StreamSite:
        import dataclasses

        site = self._site
        if self._program[("repeated", site.name)] is False:
            return site
        count = len(self._program[(site.name, site.mode)])
        occurrence = count - 1 - self._position if runs_backward(site.mode) else self._position
        name = numbered(site.name, occurrence)
        return dataclasses.replace(
            site, name=name,
            leaf_names=tuple(name + leaf[len(site.name):] for leaf in site.leaf_names))


def number_in_program(ctx: Any, site: StreamSite) -> NumberedSite:
    """Notes ``site`` among the sites of the program being lowered (lowering follows trace order).

    Called by the streaming lowering; returns what the host callback calls to get the site
    under its final name.
    """
    program = jc.module_state(ctx)
    group = program.setdefault((site.name, site.mode), [])
    group.append(site)
    if len(group) == 2:
        program[("repeated", site.name)] = True
        _warn_repeated(site.name)
    else:
        program.setdefault(("repeated", site.name), False)
    return NumberedSite(site, len(group) - 1, program)
