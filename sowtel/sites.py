"""The streaming site: what the host knows of a sow site as one compilation streams it.

A :class:`StreamSite` is built once per site of a compiled program, by :func:`stream_site`
(the callback lowering of ``sow_p`` and :func:`sowtel.jit`'s summary pass alike), and shared
by all the records of that site; :func:`sowtel.naming.renamed` gives it its final name where
the name repeats in the program.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from sowtel.primitive import SiteStatic
    >>> static = SiteStatic(name="params", tag="intermediates",
    ...                     treedef=jax.tree_util.tree_structure({"w": 0, "b": 0}),
    ...                     summary=None, every=None, loops=())
    >>> site = stream_site(static, "primal", [jnp.zeros(3), jnp.zeros((2, 3))],
    ...                    summary="stats", every=1, loops=(), enclosing=(), order=0)
    >>> site.leaf_names, site.sizes, site.n_summary
    (('params/b', 'params/w'), (3, 6), 4)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from sowtel import naming
from sowtel.records import loop_entries
from sowtel.summaries import ARRAYS_PER_LEAF, DEFAULT_BINS, Packing

__all__ = ["StreamSite", "stream_site", "leaf_names"]


@dataclasses.dataclass(frozen=True)
class StreamSite:
    """A streaming site as the host sees it; built once per compilation, shared by its records."""

    name: str
    mode: str
    tag: str
    leaf_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    summary: str
    every: int
    bins: int
    loops: tuple[tuple[int, bool], ...] | None
    extras: tuple[str, ...]
    order: int = 0  # position in the compiled program: lowering follows the jaxpr's order
    # In a cond's branch: every occurrence is sent, the host applies ``every`` (a skipped
    # branch tells the host what it skipped, whatever the step).
    in_branch: bool = False
    # Per enclosing scan (as ``loops``), the order at which it began: records' execution
    # order interleaves the sites of one scan iteration by iteration (records.order_key).
    entries: tuple[int, ...] = ()
    # How the leaves' summaries were packed together (summaries.packed_summary); None: leaf
    # after leaf, as device_summary gives them.
    packing: Packing | None = None

    @functools.cached_property
    def scans(self) -> tuple[tuple[int, bool], ...]:
        """``Record.scans`` of the site's records: ``(entry, reverse)`` per enclosing scan (a
        scan whose entry is unknown counts as entered at the site itself)."""
        loops = self.loops or ()
        entries = self.entries if len(self.entries) == len(loops) else (self.order,) * len(loops)
        return tuple((e, bool(r)) for e, (_, r) in zip(entries, loops, strict=True))

    # Derived once per site, read on every callback.
    @functools.cached_property
    def period(self) -> int:
        """Callbacks per execution of the enclosing scans (1 outside scans)."""
        n = 1
        for length, _ in self.loops or ():
            n *= max(length, 1)
        return n

    @functools.cached_property
    def counter_key(self) -> tuple[str, str, Any]:
        """Occurrences are counted per (name, mode, loops) (and shard)."""
        return (self.name, self.mode, self.loops)

    @functools.cached_property
    def sharded(self) -> bool:
        return bool(self.extras) and self.extras[-1] == "shard"

    @functools.cached_property
    def host_every(self) -> int:
        """The stride the host applies: 1 when the device decides it (under at_step)."""
        return 1 if "step" in self.extras and not self.in_branch else self.every

    @functools.cached_property
    def full_nbytes(self) -> int:
        """Bytes a ``"full"`` record holds (for the queue's byte bound); 0 for summaries."""
        if self.summary != "full":
            return 0
        return sum(n * np.dtype(d).itemsize for n, d in zip(self.sizes, self.dtypes, strict=True))

    @functools.cached_property
    def arrays_per_leaf(self) -> int:
        return ARRAYS_PER_LEAF[self.summary]

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @functools.cached_property
    def n_summary(self) -> int:
        """The summary arrays the device sends (before the extras)."""
        if self.packing is not None:
            return self.packing.count
        return self.arrays_per_leaf * len(self.leaf_names)

    def per_leaf(self, arrays: Sequence[Any]) -> Sequence[Any]:
        """The site's summary arrays leaf after leaf, as :func:`~sowtel.summaries.
        device_summary` gives them (views of packed ones; any leading axes of positions kept)."""
        return arrays if self.packing is None else self.packing.unpack(arrays)


class Sown(Protocol):
    """What a streaming site is built from: the sow site (``sowtel.primitive.SiteStatic``)."""

    @property
    def name(self) -> str: ...

    @property
    def tag(self) -> str: ...

    @property
    def treedef(self) -> Any: ...


def stream_site(site: Sown, mode: str, values: Sequence[Any], *, summary: str, every: int,
                loops: tuple[tuple[int, bool], ...] | None, enclosing: Sequence[Any],
                order: int, extras: tuple[str, ...] = ()) -> StreamSite:
    """THE constructor of a :class:`StreamSite`: the sow ``site`` in ``mode`` with the leaves
    ``values`` (arrays or avals: their shapes and dtypes), streamed as ``summary`` every
    ``every`` steps, indexed by ``loops``; ``enclosing`` are the loops around it where it runs
    (the scans' entries, ``records.loop_entries``), ``order`` its place in the program,
    ``extras`` the extra arrays its callback sends after the summaries."""
    return StreamSite(
        name=site.name, mode=mode, tag=site.tag, leaf_names=leaf_names(site),
        shapes=tuple(tuple(v.shape) for v in values),
        dtypes=tuple(str(v.dtype) for v in values), summary=summary, every=every,
        bins=DEFAULT_BINS, loops=loops, extras=extras, order=order,
        entries=loop_entries(enclosing, order),
    )


def leaf_names(site: Sown) -> tuple[str, ...]:
    """The record names of a site's leaves: ``name`` for an array, ``name/<path>`` in a pytree,
    each key escaped by :func:`sowtel.naming.leaf_segment` (so no two leaves share a name)."""
    skeleton = jax.tree_util.tree_unflatten(site.treedef, range(site.treedef.num_leaves))
    paths = jax.tree_util.tree_flatten_with_path(skeleton)[0]
    return tuple(naming.leaf_name(site.name, path) for path, _ in paths)
