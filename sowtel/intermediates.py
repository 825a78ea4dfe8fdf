"""Checks of what :func:`sowtel.save_intermediates` captured (``capture.py`` builds it).

A capture that finds nothing is almost always a mistake: no ``sow`` in the function, or sows
of another ``tag=``. :func:`nothing_captured` says which, naming the tags the function does sow.

Example:
    >>> import jax.numpy as jnp, sowtel
    >>> from sowtel.capture import trace_flat
    >>> f = lambda x: sowtel.sow(x, "h", tag="debug") * 2
    >>> print(nothing_captured(f, "intermediates", lambda: trace_flat(f, [jnp.ones(2)])))
    save_intermediates(tag='intermediates') captured nothing: <lambda> sows only with the tag(s)
    ['debug']; pass tag='debug', or sow with tag='intermediates'
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from sowtel import primitive
from sowtel.context import CONTEXT, Context

__all__ = ["nothing_captured", "sown_tags"]


class _TagProbe(str):
    """A ``capture`` tag that equals no sow's tag and records the tags sows compare with it:
    a sow of another tag binds nothing, so the traced program holds no trace of it."""

    seen: dict[str, None]

    def __new__(cls) -> _TagProbe:
        probe = super().__new__(cls, "\0sowtel tag probe")
        probe.seen = {}
        return probe

    def __eq__(self, other: object) -> bool:
        # Only a sow's own comparison (in sowtel.primitive) names a tag it sows: JAX's caches
        # compare whole contexts too, and so this probe with other captures' tags.
        if (isinstance(other, str) and not isinstance(other, _TagProbe)
                and sys._getframe(1).f_code.co_filename == primitive.__file__):
            self.seen.setdefault(other)
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def sown_tags(trace: Callable[[], Any]) -> list[str]:
    """The tags of the sows that ``trace()`` traces, in the order they were traced."""
    probe = _TagProbe()
    with CONTEXT(Context(capture=probe)):
        trace()
    return list(probe.seen)


def nothing_captured(fn: Callable[..., Any], tag: str, trace: Callable[[], Any]) -> str:
    """The warning for a capture of ``tag`` that found nothing in ``fn``; ``trace()`` traces
    ``fn`` again, to find the tags it does sow."""
    seen = sown_tags(trace)
    what = getattr(fn, "__name__", None) or type(fn).__name__
    if not seen:
        return (f"save_intermediates(tag={tag!r}) captured nothing: {what} sows no value; tag "
                "the values to capture with sowtel.sow(x, 'name') inside it")
    return (f"save_intermediates(tag={tag!r}) captured nothing: {what} sows only with the "
            f"tag(s) {seen}; pass tag={seen[0]!r}, or sow with tag={tag!r}")
