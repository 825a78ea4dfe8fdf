"""Records, built in one place from what either transport brought to the host.

- the host-callback transport hands over one site occurrence: its summary arrays and extras
  (step, shard index), and the session knows the occurrence count;
- ``sowtel.jit`` hands over a logging program's summary outputs: per site, its summary arrays
  stacked over the scans and shard_maps around it, and a flag saying where it ran.

Both end in :func:`summary_records`, so a site gives the same records either way.

Example:
    >>> import numpy as np
    >>> from sowtel.multihost import owns
from sowtel.primitive import StreamSite
    >>> site = StreamSite(name="h", mode="primal", tag="intermediates", leaf_names=("h",),
    ...                   shapes=((2,),), dtypes=("float32",), summary="health", every=1,
    ...                   bins=30, loops=(), extras=())
    >>> [r] = summary_records(site, [np.array([0, 1, 0])], step=3, index=None, seq=0,
    ...                       wall_time=0.0, process_index=0)
    >>> r.name, r.step, r.stats["posinf"]
    ('h', 3, 1.0)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from sowtel.multihost import owns
from sowtel.primitive import StreamSite
from sowtel.records import Record
from sowtel.summaries import decode_device_summary

__all__ = ["summary_records", "compiled_records"]

Index = int | tuple[int, ...] | None


def _index(parts: Sequence[int]) -> Index:
    return None if not parts else int(parts[0]) if len(parts) == 1 else tuple(map(int, parts))


def summary_records(site: StreamSite, arrays: Sequence[np.ndarray], *, step: int, index: Index,
                    seq: int, wall_time: float, process_index: int) -> list[Record]:
    """One record per leaf of ``site`` from its device summary ``arrays`` (leaf after leaf)."""
    per_leaf = site.arrays_per_leaf
    out = []
    for k, leaf_name in enumerate(site.leaf_names):
        leaf_arrays = list(arrays[k * per_leaf:(k + 1) * per_leaf])
        decoded = decode_device_summary(leaf_arrays, site.summary, site.sizes[k], site.bins)
        value = leaf_arrays[0] if site.summary == "full" else None
        out.append(Record(
            name=leaf_name, mode=site.mode, tag=site.tag, step=step, index=index,
            wall_time=wall_time, summary=site.summary, shape=site.shapes[k],
            dtype=site.dtypes[k], value=value, stats=decoded["stats"],
            histogram=decoded["histogram"], process_index=process_index, seq=seq,
            order=site.order,
        ))
    return out


def compiled_records(sites: Sequence[Any], arrays: Sequence[np.ndarray], *, step: int,
                     seqs: Iterator[int], wall_time: float, process_index: int,
                     lowest: Sequence[np.ndarray] | None = None) -> list[Record]:
    """Records of a ``sowtel.jit`` logging step from its summary outputs, now on the host.

    ``sites`` are the program's ``SiteSummary`` entries, ``arrays`` its outputs in their order.
    Each site's arrays carry leading axes for the scans and shard_maps around it (outermost
    first); its last array says, per position, whether the site ran there (0 in the branches
    of a cond that were not taken: no record). Indices list shard axes first, then scan axes,
    as the callback transport gives them.

    ``lowest`` (several processes, see :func:`sowtel.multihost.fetch`): per array, the lowest
    process holding each element; this process builds only the records it owns there.
    """
    records: list[Record] = []
    at = 0
    for entry in sites:
        mine = arrays[at:at + entry.n_arrays]
        held = lowest[at:at + entry.n_arrays] if lowest is not None else None
        at += entry.n_arrays
        ran = np.asarray(mine[-1])
        kinds = [kind for kind, _ in entry.stacked]
        order = [i for i, k in enumerate(kinds) if k == "shard"] + [
            i for i, k in enumerate(kinds) if k != "shard"]
        # Positions in the order the program ran them: a reversed scan from its last iteration.
        reverse = iter([r for _, r in entry.site.loops or ()])
        backward = [k == "scan" and next(reverse, False) for k in kinds]
        for step_pos in np.ndindex(ran.shape):
            pos = tuple(n - 1 - p if b else p
                        for p, n, b in zip(step_pos, ran.shape, backward, strict=True))
            if held is not None and not owns(held, pos, process_index):
                continue
            if not ran[pos]:
                continue
            records.extend(summary_records(
                entry.site, [np.asarray(a[pos]) for a in mine[:-1]], step=step,
                index=_index([pos[i] for i in order]), seq=next(seqs), wall_time=wall_time,
                process_index=process_index))
    return records
