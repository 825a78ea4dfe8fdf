"""Checks of what :func:`sowtel.save_intermediates` captured (the capture pass builds it).

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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from sowtel import errors, primitive
from sowtel.context import CONTEXT, Context
from sowtel.records import BASE_MODES, record_index

__all__ = ["Intermediates", "nothing_captured", "sown_tags", "program_order", "check_mode",
           "check_intermediates", "check_step", "is_leaf", "site_leaves", "stacking",
           "stack_indices"]


class Intermediates(dict):  # type: ignore[type-arg]
    """A dict that keeps its insertion order through ``jit`` (plain dicts come back sorted).

    ``save_intermediates`` returns ``{name: {mode: value}}`` as nested ``Intermediates``, names
    in the order sites ran, modes as primal, tangent, cotangent, then compositions.

    A site's ``{mode: value}`` dict also says which leading axes of a value are not the value's
    own: ``stacked[mode]`` is ``(("scan", length) | ("shard", count), ...)``, outermost first,
    for each mode whose value a ``scan`` or a ``shard_map`` stacked (modes with nothing
    stacked are absent). :func:`sowtel.export` and :func:`sowtel.dump` use it to give one
    record per iteration and shard, as streaming does.

    Example:
        >>> import jax, jax.numpy as jnp, sowtel
        >>> def f(xs):
        ...     return jax.lax.scan(lambda c, x: (c + sowtel.sow(x * 2.0, "h"), None), 0.0, xs)[0]
        >>> _, inter = sowtel.save_intermediates(f)(jnp.arange(3.0))
        >>> inter["h"]["primal"], inter["h"].stacked
        (Array([0., 2., 4.], dtype=float32), {'primal': (('scan', 3),)})
    """

    stacked: dict[str, Any]  # mode -> (("scan", length) | ("shard", count), ...)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stacked = {}

    def __repr__(self) -> str:
        return f"Intermediates({dict.__repr__(self)})"


def _flatten_intermediates(d: Intermediates) -> tuple[Any, tuple[Any, ...]]:
    keys = tuple(d)
    stacked = tuple(sorted(getattr(d, "stacked", {}).items()))
    return [(jax.tree_util.DictKey(k), d[k]) for k in keys], (keys, stacked)


def _unflatten_intermediates(aux: tuple[Any, ...], values: Any) -> Intermediates:
    keys, stacked = aux
    out = Intermediates(zip(keys, values, strict=True))
    out.stacked = dict(stacked)
    return out


jax.tree_util.register_pytree_with_keys(
    Intermediates, _flatten_intermediates, _unflatten_intermediates,
)



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


# -- The structure of intermediates: checks, leaves, stacking, program order ------------------
#    (shared by sowtel.export, the dumps and the post-mortem report).


def program_order(site_index: int, mode: str, mode_index: int = 0) -> tuple[int, int, int]:
    """A sort key that puts captured values in the order the program computed them.

    Sites are numbered in program order (the order of ``save_intermediates``' dict). Values
    without a cotangent (primal, tangent) are computed in the forward pass, in site order; each
    reverse pass runs after the one before it and walks the sites the other way, so modes with
    one ``cotangent`` component come next in reverse site order, two in site order again, and so
    on. ``mode_index`` orders the modes of one site within the same pass.

    Example:
      >>> entries = [(0, "primal"), (0, "cotangent"), (1, "primal"), (1, "cotangent")]
      >>> sorted(entries, key=lambda e: program_order(*e))
      [(0, 'primal'), (1, 'primal'), (1, 'cotangent'), (0, 'cotangent')]
    """
    passes = mode.split(".").count("cotangent")
    return (passes, site_index if passes % 2 == 0 else -site_index, mode_index)


def check_mode(mode: Any, where: str) -> str:
    """``mode`` if it is a mode (``"primal"``, ``"cotangent.tangent"``), else ValueError."""
    parts = mode.split(".") if isinstance(mode, str) else None
    if not parts or any(p not in BASE_MODES for p in parts):
        raise errors.BadIntermediatesError(
            f"{where}:", f"mode {mode!r} is not a mode: use one of {', '.join(BASE_MODES)} or "
            "a composition of them joined by '.' (such as 'cotangent.tangent')")
    return str(mode)


def check_intermediates(intermediates: Any, what: str) -> Mapping[str, Mapping[str, Any]]:
    """``intermediates`` if shaped as :func:`sowtel.save_intermediates` returns them
    (``{name: {mode: value}}``), else TypeError or ValueError naming ``what``."""
    if not isinstance(intermediates, Mapping):
        raise errors.BadIntermediatesError(
            what, "must be a dict {name: {mode: value}} as returned by "
            f"sowtel.save_intermediates, got {type(intermediates).__name__}")
    for name, modes in intermediates.items():
        if not isinstance(name, str) or not name:
            raise errors.BadIntermediatesError(f"{what}:",
                                               f"site name {name!r} must be a non-empty string")
        if not isinstance(modes, Mapping):
            raise errors.BadIntermediatesError(
                f"{what}[{name!r}]", "must be a dict {mode: value} such as "
                f"{{'primal': x}}, got {type(modes).__name__}: pass the intermediates exactly "
                "as sowtel.save_intermediates returns them"
            )
        for mode in modes:
            check_mode(mode, f"{what}[{name!r}]")
    return intermediates


def check_step(step: Any, what: str = "step") -> int:
    """``step`` as an int, if it is one (never a bool), else TypeError."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise errors.BadOptionTypeError(what, step, "must be an int (the training step)")
    return int(step)


def is_leaf(x: Any) -> bool:
    """Whether ``x`` is an array leaf of a sown value (an array, a numpy or Python scalar)."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        return True
    # jax.Array and other array-likes, recognised without importing jax.
    return hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")


def site_leaves(value: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """(leaf path, leaf) pairs of a sown value; dict/list/tuple in stored order, else jax's."""
    out: list[tuple[tuple[Any, ...], Any]] = []

    def walk(x: Any, leaf: tuple[Any, ...]) -> None:
        if x is None:
            return
        if type(x) is dict:
            for k, v in x.items():
                walk(v, (*leaf, k))
        elif type(x) is list or type(x) is tuple:
            for i, v in enumerate(x):
                walk(v, (*leaf, i))
        elif is_leaf(x):
            out.append((leaf, x))
        else:
            # Registered pytree nodes (namedtuples, flax structs, dataclasses): jax knows them.
            import jax

            for kp, v in jax.tree_util.tree_flatten_with_path(x)[0]:
                walk(v, (*leaf, *(_key_part(k) for k in kp)))

    walk(value, ())
    return out


def _key_part(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def stacking(modes: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """``{mode: stacked axes}`` of a site's modes dict (empty for a plain dict)."""
    stacked = getattr(modes, "stacked", None)
    return dict(stacked) if isinstance(stacked, dict) else {}


def stack_indices(
    axes: tuple[tuple[str, int], ...], shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], int | tuple[int, ...]]] | None:
    """``(position, record index)`` for each element of a stack, or None when not stacked.

    The record index is the one streaming gives (:func:`sowtel.records.record_index`); listed
    in index order. None when ``shape`` does not start with the stacked axes (a ``vmap``
    around ``save_intermediates`` puts its batch axis first).
    """
    lengths = tuple(n for _, n in axes)
    if not axes or tuple(shape[:len(axes)]) != lengths:
        return None
    out: list[tuple[tuple[int, ...], int | tuple[int, ...]]] = []
    for pos in np.ndindex(*lengths):
        index = record_index([(kind, n, i) for (kind, n), i in zip(axes, pos, strict=True)])
        assert index is not None  # axes is not empty
        out.append((pos, index))
    return out
