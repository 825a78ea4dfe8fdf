"""Offline dumps of captured intermediates, and the records they turn into.

:func:`sowtel.save_intermediates` returns ``{name: {mode: value}}``; :func:`dump` writes that to
one self-describing `safetensors <https://github.com/huggingface/safetensors>`_ file and
:func:`load` restores it exactly: the same sites in the same (program) order, the same modes,
the same pytree structure (dicts, lists, tuples, ``None``), dtypes, shapes and bits. Nothing in a
dump is ever unpickled or executed: the header is JSON, the values are raw little-endian bytes.

Example:
    >>> import tempfile, numpy as np
    >>> from sowtel.dumps import dump, load
    >>> inter = {"h": {"primal": np.arange(3.0)}, "pair": {"primal": (np.ones(2), None)}}
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = dump(inter, d + "/", step=7, metadata={"run": "baseline"})
    ...     back = load(path)
    >>> path.name
    'step_7.safetensors'
    >>> list(back), back["pair"]["primal"][1] is None
    (['h', 'pair'], True)

File layout (see ``docs/dumps.md``): one safetensors tensor per array leaf; the header's
string-to-string metadata holds ``format`` (``"sowtel.dump"``), ``format_version``,
``sowtel_version``, ``created`` (Unix time), ``step``, ``metadata`` (the caller's JSON),
``sites`` (the structure, a JSON list in program order) and ``checksums`` (CRC-32 of the header
fields and of every tensor, so truncation and corruption are caught on load).

A folder of dumps, one per step, is a supported layout: ``dump(x, "dumps/", step=k)`` writes
``dumps/step_<k>.safetensors`` and ``load("dumps")`` returns ``{step: intermediates}``.

In a multi-process program (``jax.distributed``), values sharded across processes are dumped
per process: every process calls ``dump`` and writes ``step_<k>.process_<p>.safetensors``
holding the shards its devices hold (each shard once), with the value's global shape and each
shard's index in the header. No process waits for another. :func:`load`, ``sowtel inspect``
and ``sowtel diff`` take any part (its siblings are found by name), the folder, or the list of
parts, check that the parts tile every value exactly, and give the global values.
"""


from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sowtel.dumps import _format as _dump_format
from sowtel.dumps import _parts as _dump_parts
from sowtel.dumps import _write as _dump_write
from sowtel.dumps._format import (
    FORMAT,
    FORMAT_VERSION,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_PROCESSES,
    STACKING_KINDS,
    SUFFIX,
    DumpEntry,
    DumpInfo,
    check_path,
    count_containers,
)
from sowtel.dumps._parts import open_step
from sowtel.dumps._read import DumpFile, DumpReader

# Records and the structure of intermediates, shared with streaming.
from sowtel.intermediates import program_order
from sowtel.naming import leaf_name
from sowtel.to_records import records_from_intermediates

__all__ = [
    "DumpEntry",
    "DumpInfo",
    "DumpReader",
    "dump",
    "load",
    "info",
    "open_dump",
    "find_dumps",
    "part_name",
    "records_from_intermediates",
    "leaf_name",
    "program_order",
    "check_path",
    "count_containers",
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_PROCESSES",
    "STACKING_KINDS",
    "SUFFIX",
]

# This module is their public home (and the one whose docstring examples are run for them).
for _public in (DumpEntry, DumpInfo, DumpReader):
    _public.__module__ = __name__


def dump(
    intermediates: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Writes captured intermediates to one safetensors file and returns its path.

    ``intermediates`` is ``{name: {mode: value}}`` as returned by
    :func:`sowtel.save_intermediates` (values may be jax or numpy arrays, or dicts, lists,
    tuples and ``None`` of them). Its order is kept as the sites' program order.
    ``path`` is a file, or a folder (an existing directory, or a path ending with ``/``), in
    which case the file is ``path/step_<step>.safetensors``. ``metadata`` is a JSON dict kept
    in the header. The file is written to a temporary name and renamed, so a reader never sees
    half a dump.

    In a multi-process program, when the values are jax.Arrays spanning the devices of several
    processes (what ``save_intermediates`` of a sharded ``jit`` returns there), every process
    calls ``dump`` with the same arguments and writes its own part, ``step_<step>.process_<p>
    .safetensors`` (see :func:`part_name`): the shards its devices hold, each shard once over
    the job, with the global shape and each shard's index. Nothing is gathered and no process
    waits for another. A dump mixing such values with process-local ones is refused (each
    process's local values would differ); :func:`load` of any part gives the global values.

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     p = dump({"loss": {"primal": np.float32(0.5)}}, d + "/run/", step=3)
      ...     (p.parent.name, p.name)
      ('run', 'step_3.safetensors')
    """
    return _dump_write.write_dump(intermediates, path, step=step, metadata=metadata)


def part_name(path: str | os.PathLike[str], process_index: int) -> Path:
    """The file one process writes for a dump to ``path`` of values that span processes.

    Example:
      >>> part_name("dumps/step_3.safetensors", 1).as_posix()
      'dumps/step_3.process_1.safetensors'
    """
    return _dump_format.part_name(path, process_index)


def find_dumps(folder: str | os.PathLike[str]) -> dict[int, Path]:
    """The dumps of a folder of dumps, ``{step: path}`` in step order.

    A step dumped in parts by several processes (``step_<k>.process_<p>.safetensors``) is
    listed by the part of its lowest process; :func:`load` of that path reads every part.

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     for k in (10, 2):
      ...         _ = dump({"h": {"primal": np.zeros(1)}}, d, step=k)
      ...     list(find_dumps(d))
      [2, 10]
    """
    return _dump_parts.find_dumps(folder)


def open_dump(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> DumpReader:
    """Opens a dump for reading piece by piece: one file, or every part of a multi-process dump.

    Every header is read and checked (and the parts' tiling, for a multi-process dump) before
    this returns; no array is read until :meth:`DumpReader.reader` is used. ``path`` is a file,
    any part of a multi-process dump (the others are found beside it by name), or the list of
    its parts. See :class:`DumpReader`.

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     f = open_dump(dump({"h": {"primal": np.arange(2.0)}}, d + "/a.safetensors"))
      >>> [e.name for e in f.info().entries], f.modes("h")
      (['h'], ('primal',))
    """
    return _dump_parts.open_dump(path)


def info(path: str | os.PathLike[str]) -> DumpInfo:
    """Reads a dump's header (step, metadata, sites, shapes, dtypes) without reading its data.

    Of one process's part of a multi-process dump, this is that file's header: global shapes,
    the shards it holds (:attr:`DumpEntry.shards`) and ``process=(index, count)``.

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     p = dump({"h": {"primal": np.zeros((2, 3), np.float16)}}, d + "/a.safetensors",
      ...              metadata={"seed": 0})
      ...     i = info(p)
      >>> (i.metadata, i.entries[0].dtype, i.entries[0].shape)
      ({'seed': 0}, 'float16', (2, 3))
    """
    return DumpFile(check_path(path)).info()


def load(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
         lazy: bool = False) -> dict[Any, Any]:
    """Reads a dump back: ``{name: {mode: value}}`` exactly as it was dumped.

    The two outer levels are the ``Intermediates`` dicts :func:`sowtel.save_intermediates`
    returns, sites in program order. Every leaf is a numpy array of the stored dtype (a Python
    or numpy scalar comes back as a 0-d array), dicts/lists/tuples/``None`` as they were.
    With ``lazy=False`` the file is read once, checked against its checksums, and the arrays are
    writable. With ``lazy=True`` the file is memory-mapped: nothing is read until an array is
    used, the arrays are read-only, and checksums are not checked (``sowtel inspect`` checks
    them). ``path`` may be a folder of dumps: the result is then ``{step: intermediates}`` in
    step order. Truncated, corrupted and foreign files raise ``ValueError`` naming the path;
    nothing is ever unpickled.

    A multi-process dump (one part per process, see :func:`dump`) is read whole from any of its
    parts (the others are found beside it by name), from a list of all its parts, or from its
    folder: each value is the global array, assembled from the shards of every part once the
    headers show that they tile it exactly. Such values are assembled in memory even with
    ``lazy=True`` (the parts are memory-mapped, their checksums not checked).

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     _ = dump({"h": {"primal": np.arange(3)}}, d, step=0)
      ...     _ = dump({"h": {"primal": np.arange(3) + 1}}, d, step=1)
      ...     by_step = load(d)
      >>> {k: v["h"]["primal"].tolist() for k, v in by_step.items()}
      {0: [0, 1, 2], 1: [1, 2, 3]}
    """
    if isinstance(path, (list, tuple)):
        return _dump_parts.open_dump(path).tree(lazy)
    p = Path(check_path(path))
    if p.is_dir():
        return {step: open_step(step, f).tree(lazy) for step, f in find_dumps(p).items()}
    return _dump_parts.open_dump(p).tree(lazy)

