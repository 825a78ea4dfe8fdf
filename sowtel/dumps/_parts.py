"""The parts of a multi-process dump (one file per process), read as one dump of global values.

The public face is :func:`sowtel.dumps.load` and :func:`sowtel.dumps.find_dumps`; any part,
the list of parts or their folder opens as a :class:`~sowtel.dumps._read.DumpReader`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from sowtel import errors
from sowtel.dumps._format import (
    NAME_TO_DTYPE,
    PART_FILE,
    STEP_FILE,
    STEP_PART,
    SUFFIX,
    DumpEntry,
    DumpInfo,
    check_path,
    rebuild,
)
from sowtel.dumps._read import DumpFile, SiteStructure, build_tree, not_regular


def skeleton(node: Any, where: str) -> Any:
    """A structure without tensor keys and shards: what every part of a dump shares."""
    def leaf(kind: str, body: Any, path: tuple[Any, ...]) -> Any:
        return "leaf" if kind == "leaf" else ("global", tuple(body["shape"]), body["dtype"])

    return rebuild(node, leaf, where)


def check_tiling(where: str, shape: tuple[int, ...],
                  boxes: Sequence[tuple[tuple[int, int], ...]]) -> None:
    """Raises unless ``boxes`` cover ``shape`` exactly once, as the blocks of a grid.

    JAX shards an array along each axis into blocks, so the shards of a value are the products
    of per-axis blocks. Per axis the distinct blocks must tile ``[0, n)``, and the shards must be
    every product of them, each once: then every element is held exactly once.
    """
    if math.prod(shape) == 0:
        return  # nothing to assemble
    per_axis = []
    for axis, n in enumerate(shape):
        blocks = sorted({box[axis] for box in boxes})
        at = 0
        for b, e in blocks:
            if b != at or e <= b:
                raise errors.DumpPartsError(
                    f"{where}: the parts' shards {'overlap' if b < at else 'leave a gap'} "
                    f"along axis {axis} at {at}, so they are not the shards of one value")
            at = e
        if at != n:
            raise errors.DumpPartsError(
                f"{where}: no part holds elements {at}..{n - 1} along axis {axis}")
        per_axis.append(len(blocks))
    if len(boxes) != math.prod(per_axis) or len(set(boxes)) != len(boxes):
        raise errors.DumpPartsError(
            f"{where}: the parts hold {len(boxes)} shards where {math.prod(per_axis)} distinct "
            "blocks tile the value: a shard is missing or held twice")


class DumpSet(SiteStructure):
    """The per-process parts of one multi-process dump, read as one dump of global values.

    Checked from the headers alone before any data is read: one part per process, all of one
    step and one structure, and shards that tile every global value exactly once.
    """

    def __init__(self, parts: Sequence[DumpFile]) -> None:
        for f in parts:
            if f.process is None:
                raise errors.DumpPartsError(
                    f"{str(f.path)!r} is a whole dump, not one process's part: a list of paths "
                    "names the parts of one multi-process dump (step_<k>.process_<p>"
                    ".safetensors)")
        by_index: dict[int, DumpFile] = {}
        count = parts[0].process[1]  # type: ignore[index]
        for f in parts:
            index, n = f.process  # type: ignore[misc]
            if n != count:
                raise errors.DumpPartsError(
                    f"{str(f.path)!r} is a part of a {n}-process dump and {str(parts[0].path)!r} "
                    f"of a {count}-process one: they are not parts of one dump")
            if index in by_index:
                raise errors.DumpPartsError(
                    f"{str(by_index[index].path)!r} and {str(f.path)!r} are both process "
                    f"{index}'s part: give each process's part once")
            by_index[index] = f
        missing = [k for k in range(count) if k not in by_index]
        if missing:
            raise errors.DumpPartsError(
                f"the part{'s' if len(missing) > 1 else ''} of process"
                f"{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
                f"{' ...' if len(missing) > 8 else ''} of this {count}-process dump "
                f"{'are' if len(missing) > 1 else 'is'} missing: give all {count} parts")
        self.parts = [by_index[k] for k in range(count)]
        first = self.parts[0]
        def shape_of(f: DumpFile) -> list[Any]:
            return [[name, [[m, skeleton(n, name)] for m, n in modes]] for name, modes in f.sites]

        shape = shape_of(first)
        for f in self.parts[1:]:
            if f.step != first.step:
                raise errors.DumpPartsError(
                    f"{str(f.path)!r} is of step {f.step} and {str(first.path)!r} of step "
                    f"{first.step}: they are not parts of one dump")
            if shape_of(f) != shape or f.stacked != first.stacked:
                raise errors.DumpPartsError(
                    f"{str(f.path)!r} and {str(first.path)!r} hold different sites, modes or "
                    "structures: they are not parts of one dump")
        self.path, self.step, self.sites, self.stacked = first.path, first.step, first.sites, \
            first.stacked
        held: dict[tuple[Any, ...], list[Any]] = {}
        for f in self.parts:
            for e in f.entries:
                held.setdefault((e.site, e.mode, e.leaf), []).extend(e.shards)
        entries = []
        for e in first.entries:
            shards = tuple(held[(e.site, e.mode, e.leaf)])
            check_tiling(f"{e.name!r} ({e.mode}) of the dump {str(first.path)!r}", e.shape,
                          [box for _, _, box in shards])
            entries.append(dataclasses.replace(e, shards=shards))
        self.entries = tuple(entries)

    def info(self) -> DumpInfo:
        first = self.parts[0].info()
        return dataclasses.replace(
            first, entries=self.entries, nbytes=sum(f.size - f.data_start for f in self.parts),
            process=None, parts=tuple(f.path for f in self.parts))

    def verify(self) -> None:
        for f in self.parts:
            f.verify()

    def reader(self, lazy: bool) -> Any:
        """A function from an entry to its global value, assembled from every part's shards."""
        bufs = [f.buffer(lazy) for f in self.parts]

        def read(entry: DumpEntry) -> np.ndarray:
            out = np.empty(entry.shape, np.dtype(NAME_TO_DTYPE[entry.dtype]))
            for process, key, box in entry.shards:
                f = self.parts[process]
                out[tuple(slice(b, e) for b, e in box)] = f.array(bufs[process], key)
            return out

        return read

    def tree(self, lazy: bool) -> Any:
        return build_tree(self, lazy)


def find_dumps(folder: str | os.PathLike[str]) -> dict[int, Path]:
    """:func:`sowtel.dumps.find_dumps` (documented there)."""
    p = Path(check_path(folder, "folder"))
    if not p.exists():
        raise FileNotFoundError(f"{str(p)!r} does not exist: give a folder of sowtel dumps")
    if not p.is_dir():
        raise NotADirectoryError(f"{str(p)!r} is a file, not a folder of dumps")
    found: dict[int, Path] = {}
    parts: dict[tuple[int, int], Path] = {}
    lowest: dict[int, int] = {}  # per step dumped in parts: its lowest process
    for child in p.iterdir():
        m = STEP_FILE.match(child.name) or STEP_PART.match(child.name)
        if m and child.exists() and not child.is_file() and not child.is_dir():
            # A FIFO or a device named like a dump: refused, as load() refuses it, rather than
            # silently leaving a step out.
            raise not_regular(child, child.stat().st_mode)
        if not (m and child.is_file()):
            continue
        step = int(m.group(1))
        if m.re is STEP_PART:
            index = int(m.group(2))
            if (step, index) in parts:
                raise errors.DumpPartsError(
                    f"{str(p)!r} holds two parts of process {index} for step {step}: "
                    f"{parts[(step, index)].name!r} and {child.name!r}; remove one")
            parts[(step, index)] = child
            if step in found and not STEP_PART.match(found[step].name):
                raise errors.DumpPartsError(
                    f"{str(p)!r} holds a whole dump and per-process parts for step {step}: "
                    f"{found[step].name!r} and {child.name!r}; remove one")
            if step not in found or index < lowest[step]:
                found[step], lowest[step] = child, index
            continue
        if step in found:
            what = ("a whole dump and per-process parts" if STEP_PART.match(found[step].name)
                    else "two dumps")
            raise errors.DumpPartsError(
                f"{str(p)!r} holds {what} for step {step}: {found[step].name!r} and "
                f"{child.name!r}; remove one"
            )
        found[step] = child
    if not found:
        raise errors.DumpPartsError(
            f"{str(p)!r} holds no dumps (files named step_<k>.safetensors): write them with "
            "sowtel.dump(intermediates, folder, step=k)"
        )
    return dict(sorted(found.items()))


def siblings(part: DumpFile) -> list[Path]:
    """The paths of the other processes' parts of the dump ``part`` belongs to, by name."""
    index, count = part.process  # type: ignore[misc]
    m = PART_FILE.match(part.path.name)
    if not m or int(m.group(2)) != index:
        raise errors.DumpPartsError(
            f"{str(part.path)!r} is process {index}'s part of a {count}-process dump, and its "
            "name (not <name>.process_<p>.safetensors) does not say where the others are: "
            f"give all {count} parts, sowtel.load([...]) or sowtel inspect PART PART ...")
    return [part.path.with_name(f"{m.group(1)}.process_{k}{SUFFIX}")
            for k in range(count) if k != index]


def open_dump(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
          ) -> DumpFile | DumpSet:
    """A dump: one file, or every part of a multi-process dump (from any part, or all)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise errors.DumpPartsError(
                "an empty list of paths: give the parts of a multi-process dump")
        return DumpSet([DumpFile(p) for p in path])
    f = DumpFile(cast("str | os.PathLike[str]", path))
    if f.process is None:
        return f
    others = siblings(f)
    absent = [q for q in others if not q.exists()]
    if absent:
        names = ", ".join(repr(q.name) for q in absent[:4]) + (" ..." if len(absent) > 4 else "")
        raise errors.DumpPartsError(
            f"{str(f.path)!r} is process {f.process[0]}'s part of a {f.process[1]}-process dump, "
            f"and {len(absent)} of the other parts {'is' if len(absent) == 1 else 'are'} not "
            f"beside it: {names}; copy every process's part into one folder")
    return DumpSet([f, *(DumpFile(q) for q in others)])


def open_step(step: int, path: Path) -> DumpFile | DumpSet:
    f = open_dump(path)
    if f.step is not None and f.step != step:
        raise errors.BadDumpError(
            path, f"is named for step {step} but its header says step {f.step}: "
            "rename the file to match its step"
        )
    return f


