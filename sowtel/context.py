"""What is switched on where a function is traced: the :class:`Context` a sow reads when it is
bound, the :class:`StreamConfig` of a streaming session, the receivers host callbacks deliver
to, and the ``every=`` strides known per configuration.

The context is part of every jit cache key (:data:`CONTEXT`): toggling :func:`sowtel.enable` or
entering :func:`sowtel.save_intermediates` retraces, and a new session with the same settings
reuses every program compiled for the previous one.

Example:
    >>> config = StreamConfig(tags=("intermediates",))
    >>> with CONTEXT(Context(stream=config)):
    ...     current_context().stream is config
    True
    >>> current_context() is None
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from sowtel import errors

if TYPE_CHECKING:
    from sowtel.sites import StreamSite

__all__ = ["Globs", "StreamConfig", "Context", "CONTEXT", "StreamPolicy", "RECEIVERS",
           "current_context", "check_positive_int", "Strides", "STRIDES", "is_due"]

# What is switched on: a jit-cache-keyed context, read whenever a sow is bound.



@dataclasses.dataclass(frozen=True)
class Globs:
    """A name filter of glob patterns, compared by value (so it can key the jit cache)."""

    patterns: tuple[str, ...]

    def __call__(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


# -- strides: which steps log ------------------------------------------------------------------


def is_due(step: Any, every: int) -> Any:
    """THE stride decision: whether a site of ``every=every`` logs at ``step``.

    ``step`` is a Python int (decided on the host) or an integer device value (decided in the
    program, under a traced :func:`sowtel.at_step`: a traced bool).

    Example:
        >>> is_due(20, 10), is_due(25, 10), is_due(3, 1)
        (True, False, True)
    """
    return step % every == 0


class Strides:
    """THE stride registry: per streaming configuration, the ``every=`` values known so far,
    the configuration's own and those of the sites traced under it.

    A step due at none of them logs nothing (:meth:`due`). :data:`STRIDES` holds what every
    sow bound under a configuration met (a host-side :func:`sowtel.at_step` reads it);
    each :func:`sowtel.jit` function keeps one of its own, for its own sites, whose due
    strides key its logging programs. A few small ints per setting.

    Example:
        >>> config = StreamConfig(every=1)
        >>> strides = Strides()
        >>> strides.add(config, 10)
        >>> sorted(strides.of(config)), strides.due(config, 5), strides.strided(config)
        ([1, 10], frozenset({1}), True)
    """

    def __init__(self) -> None:
        self._known: dict[StreamConfig, set[int]] = {}

    def __contains__(self, config: StreamConfig) -> bool:
        return config in self._known

    def of(self, config: StreamConfig) -> set[int]:
        """The strides known for ``config`` (the live set: additions show in it)."""
        return self._known.setdefault(config, {config.every})

    def add(self, config: StreamConfig, every: int) -> None:
        self.of(config).add(every)

    def known(self, config: StreamConfig) -> set[int]:
        """The strides known for ``config``, its own ``every`` if none (registers nothing)."""
        return self._known.get(config) or {config.every}

    def due(self, config: StreamConfig, step: int) -> frozenset[int]:
        """The strides of ``config`` at which ``step`` logs (:func:`is_due`); empty: it logs
        nothing."""
        return frozenset(e for e in self.known(config) if is_due(step, e))

    def strided(self, config: StreamConfig) -> bool:
        """Whether some steps log nothing (a stride above 1)."""
        return any(e > 1 for e in self.known(config))


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """What a session streams: the part of ``enable()``'s settings that shapes compiled programs.

    It, not the session, keys the jit cache: a new session with the same settings reuses every
    program compiled for the previous one, and the programs deliver to whichever session is
    active when their callbacks run.

    Example:
        >>> config = StreamConfig(tags=("intermediates",), include=Globs(("block*",)))
        >>> config.selects("block0/act", "intermediates"), config.selects("head", "intermediates")
        (True, False)
        >>> config == StreamConfig(tags=("intermediates",), include=Globs(("block*",)))
        True
    """

    tags: tuple[str, ...] = ("intermediates",)
    modes: tuple[str, ...] = ("primal", "tangent", "cotangent")
    include: Callable[[str], bool] | None = None
    exclude: Callable[[str], bool] | None = None
    summary: str = "stats"
    every: int = 1
    #: The process that exports the records of sites whose values span processes.
    export_process: int = 0

    def selects(self, name: str, tag: str) -> bool:
        if tag not in self.tags:
            return False
        if self.include is not None and not self.include(name):
            return False
        return not (self.exclude is not None and self.exclude(name))

    def wants(self, mode: str) -> bool:
        return mode in self.modes or mode.split(".")[-1] in self.modes

    def summary_for(self, site_summary: str | None) -> str:
        return site_summary or self.summary

    def every_for(self, site_every: int | None) -> int:
        every = site_every or self.every
        STRIDES.add(self, every)
        return every

    def strides(self) -> set[int]:
        """The ``every=`` values of this setting and of the sites traced under it so far."""
        return STRIDES.known(self)


# Every sow bound under a configuration adds its every= here.
STRIDES = Strides()


@dataclasses.dataclass(frozen=True)
class Context:
    """What sows bound now should do: stream with ``stream``, and/or be captured for ``capture``."""

    stream: StreamConfig | None = None
    capture: str | None = None
    # Set by a host-side at_step on a step that logs nothing: sows bind nothing, so the call
    # runs the uninstrumented program.
    quiet: bool = False


# Part of every jit cache key: toggling enable() or entering save_intermediates retraces.
CONTEXT = jax.make_user_context(None)


class StreamPolicy(Protocol):
    """What the streaming session does for the primitive (``sowtel.session.Session``)."""

    def receive(self, site: StreamSite, arrays: tuple[np.ndarray, ...]) -> None: ...

    def count_late(self, site: StreamSite) -> None: ...

    def skip(self, site: StreamSite, occurrences: int) -> None: ...

    def logs_at(self, step: int) -> bool: ...

    def host_step_block(self, step: int) -> contextlib.AbstractContextManager[None]: ...


class _Receivers:
    """The session host callbacks deliver to, and the last one closed (which counts late ones)."""

    active: StreamPolicy | None = None
    closed: StreamPolicy | None = None


RECEIVERS = _Receivers()


def current_context() -> Context | None:
    value = CONTEXT.value
    return value if isinstance(value, Context) else None


def check_positive_int(value: Any, what: str) -> int:
    """``value`` as an int if it is one above 0; ``what`` is ``"<function> <argument>"``.

    Example:
        >>> check_positive_int(10, "sow every")
        10
        >>> check_positive_int(0, "sow every")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        sowtel.errors.NotPositiveIntError: sow(every=0): every must be a positive int, such as ...
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        func, _, arg = what.rpartition(" ")
        raise errors.NotPositiveIntError(func, arg, value)
    return int(value)
