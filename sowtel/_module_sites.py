"""The one rule that turns a module method's output into a site, for every framework's capture.

``sowtel.flax.capture`` (Linen), ``sowtel.nnx.capture`` and ``sowtel.equinox.capture`` each find
module calls their own way; what they sow, under which name, and which calls a ``filter``
selects is decided here, so the three name and select sites alike.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax

from sowtel import errors, naming
from sowtel.naming import check_tag
from sowtel.primitive import sow as _sow

#: ``filter(module, method_name) -> bool``, as Flax's ``capture_intermediates`` takes it.
Selector = Callable[[Any, str, str], bool]


def check_filter(filter: Any, what: str) -> Selector:
    """``filter`` as a function of ``(module, method name, site name)``.

    ``None`` selects every ``__call__``; a callable is called as ``filter(module, method_name)``
    (the form of Flax's ``capture_intermediates``); a string or a sequence of strings are glob
    patterns matched against the site name (``"Encoder_0/*"``; ``*`` matches ``/`` too).
    """
    if filter is None:
        return lambda module, method, name: method == "__call__"
    if isinstance(filter, str):
        filter = (filter,)
    if callable(filter):
        return lambda module, method, name: bool(filter(module, method))
    if isinstance(filter, Sequence) and filter and all(isinstance(p, str) for p in filter):
        patterns = tuple(filter)
        return lambda module, method, name: any(fnmatch.fnmatchcase(name, p) for p in patterns)
    raise errors.BadOptionTypeError(
        f"{what} filter", filter, "is not a filter: pass None (every __call__), a function "
        "filter(module, method_name) -> bool, or glob patterns on the site name such as "
        "'Block_*/__call__'")


def site_name(path: Sequence[Any], method: str) -> str:
    """``<module path>/<method>`` (``__call__`` alone for the top-level module)."""
    return "/".join([*(str(p) for p in path), method])


def sow_output(value: Any, name: str, base: str | None, *, tag: str, summary: str | None,
               every: int | None) -> Any:
    """Sows ``value`` as ``name`` under the prefix ``base`` when it is a pytree of arrays.

    A method whose output holds something other than arrays (a string, a Python number, a
    module) is left as it is: such an output has nothing to stream. Returns ``value``.
    """
    leaves = jax.tree_util.tree_leaves(value)
    if not leaves or not all(isinstance(leaf, jax.Array) for leaf in leaves):
        return value
    with naming.absolute_prefix(base):
        return _sow(value, name, tag=tag, summary=summary, every=every)


def check_options(tag: str, every: int | None) -> None:
    from sowtel.context import check_positive_int

    check_tag(tag)
    if every is not None:
        check_positive_int(every, "capture every")
