"""The on-disk format of a dump: names, limits, dtype codes, checksums, and its one node walker.

A dump is a safetensors file whose header's ``__metadata__`` describes the intermediates (see
``docs/dumps.md``). Everything both the writer (:mod:`sowtel.dumps._write`) and the readers
(:mod:`sowtel.dumps._read`, :mod:`sowtel.dumps._parts`) must agree on lives here, once: the
structure nodes (``null``, ``{"leaf": key}``, ``{"global": ...}``, ``{"list": [...]}``,
``{"tuple": [...]}``, ``{"dict": [[key, node], ...]}``) are walked only by :func:`rebuild`.

Example:
    >>> rebuild({"dict": [["w", {"leaf": "k"}], [0, None]]}, lambda kind, body, path: body, "x")
    {'w': 'k', 0: None}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from sowtel import errors

FORMAT = "sowtel.dump"
FORMAT_VERSION = 1
#: The kinds of stacked axes (:attr:`sowtel.Intermediates.stacked`) a dump may record.
STACKING_KINDS = ("scan", "shard")
SUFFIX = ".safetensors"
STEP_FILE = re.compile(r"^step_(\d+)\.safetensors$")
# One process's part of a multi-process dump: <name>.process_<p>.safetensors.
PART_FILE = re.compile(r"^(.*)\.process_(\d+)\.safetensors$", re.DOTALL)
STEP_PART = re.compile(r"^step_(\d+)\.process_(\d+)\.safetensors$")
# How many processes a per-process dump may claim (the parts are looked for one by one).
MAX_PROCESSES = 1 << 16
# How many axes a global value in a per-process dump may have (numpy's own limit).
MAX_RANK = 64

# safetensors dtype codes and the numpy dtypes they hold. The writer takes the numpy name
# (``bfloat16``), the file stores the code (``BF16``), the reader maps the code back.
CODE_TO_DTYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype(np.complex64),
}
NAME_TO_DTYPE = {dt.name: dt for dt in CODE_TO_DTYPE.values()}
SUPPORTED_NAMES = set(NAME_TO_DTYPE)

#: How deeply a dump's pytrees and metadata may nest (containers above a leaf). dump() refuses
#: deeper values and load() deeper files, so no reader ever recurses without bound.
MAX_DEPTH = 100

#: How many JSON arrays and objects a dump's header may hold (see :func:`count_containers`):
#: dump() refuses to write more and readers refuse to parse more, so a crafted header costs at
#: most a few hundred MB however it is built. A leaf takes about four.
MAX_CONTAINERS = 1_000_000

# A header larger than this is not something dump() writes (it is the safetensors library's own
# limit); refusing it keeps a corrupted length field from making load() allocate gigabytes.
MAX_HEADER = 100_000_000
# Checksums are computed over chunks of this many bytes read into one reused buffer, so
# checking a file never holds more of it than this.
CHUNK = 1 << 23
# What sowtel_version may hold (PEP 440 versions, and "unknown"): it is printed as it is.
VERSION_TEXT = re.compile(r"[A-Za-z0-9.+!_-]{1,100}")


# ----------------------------------------------------------------------------- public types


@dataclasses.dataclass(frozen=True)
class DumpEntry:
    """One array leaf of a dump, as listed in its header (no data read).

    Attributes:
      name: the record-style name: the site's name, or ``site/<leaf path>`` for a pytree leaf.
      site: the name the value was sown under.
      mode: ``"primal"``, ``"tangent"``, ``"cotangent"`` or a composition.
      leaf: the path of the leaf inside the sown value (``()`` for a single array).
      shape, dtype: of the stored array (``dtype`` is a numpy name such as ``"bfloat16"``).
      key: the tensor's key inside the safetensors file.
      stacked: the leading axes a scan or shard_map added (``(("scan", 4),)``; see
        :attr:`sowtel.Intermediates.stacked`), ``()`` when none or when the shape does not
        start with them.
      shards: for a value of a multi-process dump (see :func:`dump`), whose ``shape`` is the
        global shape and ``key`` is ``""``: ``(process, key, ((start, stop) per axis))`` for
        each shard the file (or, after :func:`load` combined the parts, the job) holds;
        ``()`` for an ordinary array.

    Example:
      >>> DumpEntry("pair/0", "pair", "primal", (0,), (2,), "float32", "pair::primal::0").leaf
      (0,)
    """

    name: str
    site: str
    mode: str
    leaf: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: str
    key: str
    stacked: tuple[tuple[str, int], ...] = ()
    shards: tuple[tuple[int, str, tuple[tuple[int, int], ...]], ...] = ()


@dataclasses.dataclass(frozen=True)
class DumpInfo:
    """What a dump's header says, read without touching its data (see :func:`info`).

    Attributes:
      path: the file.
      step: the ``step=`` given to :func:`dump`, or ``None``.
      metadata: the ``metadata=`` given to :func:`dump` (``{}`` when none).
      sowtel_version: the version of sowtel that wrote it.
      created: Unix time of writing.
      sites: site names in program order.
      entries: every array leaf, sites in program order, then modes and leaves in stored order.
      nbytes: total bytes of array data.
      process: ``(index, count)`` for one process's part of a multi-process dump, else
        ``None``.
      parts: the files of a multi-process dump, by process, once :func:`load` (or ``sowtel
        inspect``) has combined them; ``()`` for a single file.

    Example:
      >>> import tempfile, numpy as np
      >>> with tempfile.TemporaryDirectory() as d:
      ...     i = info(dump({"h": {"primal": np.zeros(3)}}, d + "/x.safetensors", step=2))
      >>> (i.step, i.sites, i.entries[0].shape, i.nbytes)
      (2, ('h',), (3,), 24)
    """

    path: Path
    step: int | None
    metadata: dict[str, Any]
    sowtel_version: str
    created: float
    sites: tuple[str, ...]
    entries: tuple[DumpEntry, ...]
    nbytes: int
    process: tuple[int, int] | None = None
    parts: tuple[Path, ...] = ()

    def modes(self, site: str) -> tuple[str, ...]:
        """The modes stored for ``site``, in stored order."""
        return tuple(dict.fromkeys(e.mode for e in self.entries if e.site == site))


# ----------------------------------------------------------------------------- validation


def check_json(value: Any, where: str, depth: int = 0) -> None:
    # Strict JSON types only: a tuple would come back as a list and a NaN is not JSON, so the
    # metadata would not round-trip exactly.
    if isinstance(value, (list, dict)) and depth >= MAX_DEPTH:
        raise errors.NotDumpableError(
            f"metadata{where}", f"is nested deeper than {MAX_DEPTH} levels: keep metadata flatter")
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise errors.NotDumpableError(
                f"metadata{where} = {value!r}", "is not JSON: use a finite number or a string")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_json(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise errors.NotDumpableError(
                    f"metadata{where}", f"has key {k!r}: JSON object keys must be strings")
            check_json(v, f"{where}[{k!r}]", depth + 1)
        return
    raise errors.NotDumpableError(
        f"metadata{where} = {value!r} ({type(value).__name__})", "is not JSON: metadata holds "
        "only dicts with string keys, lists, strings, finite numbers, bools and None")


def part_name(path: str | os.PathLike[str], process_index: int) -> Path:
    """The file one process writes for a dump to ``path`` of values that span processes.

    Example:
      >>> part_name("dumps/step_3.safetensors", 1).as_posix()
      'dumps/step_3.process_1.safetensors'
    """
    p = Path(check_path(path))
    stem = p.name[:-len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name
    return p.with_name(f"{stem}.process_{process_index}{SUFFIX}")


def crc32(buf: Any) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def array_crc(arr: np.ndarray) -> int:
    return crc32(arr.reshape(-1).view(np.uint8).data) if arr.size else 0


def header_crc(fields: dict[str, Any], table: dict[str, tuple[str, list[int]]]) -> int:
    canonical = json.dumps([fields, sorted((k, *v) for k, v in table.items())], sort_keys=True)
    return crc32(canonical.encode())


def sowtel_version() -> str:
    try:
        from importlib.metadata import version

        return version("sowtel")
    except Exception:  # an uninstalled checkout still writes a readable dump
        return "unknown"


def check_path(path: Any, what: str = "path") -> str:
    """``os.fspath(path)``, or a TypeError naming the value and what a path is."""
    if not isinstance(path, (str, os.PathLike)):
        raise errors.BadOptionTypeError(what, path, "is not a path: pass a str or a pathlib.Path")
    return os.fspath(path)


# The safetensors dtype code of each numpy dtype name a dump may hold.
DTYPE_TO_CODE = {dt.name: code for code, dt in CODE_TO_DTYPE.items()}


def count_containers(text: bytes | str) -> int:
    """An upper bound on the JSON arrays and objects in ``text``, counted without parsing it.

    Every array or object opens with ``[`` or ``{``; brackets inside strings are counted too,
    which only over-counts. A dump's header holds at most :data:`MAX_CONTAINERS`, checked by
    ``dump`` before writing and by every reader before parsing, so a crafted header of millions
    of ``[]`` is refused before it becomes millions of Python objects.

    Example:
      >>> count_containers(b'{"a": [1, [2]], "b": "[x"}')
      4
    """
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")



class MalformedNode(ValueError):
    """A structure node that :func:`sowtel.dump` never writes (readers name their file)."""


def rebuild(node: Any, leaf: Callable[[str, Any, tuple[Any, ...]], Any], where: str,
            path: tuple[Any, ...] = ()) -> Any:
    """The value a structure node describes, with ``leaf(kind, body, path)`` at every array.

    The one walker of a dump's structure: the reader builds values with it, checks headers
    with it (every node is checked as it is met, so a crafted one raises
    :class:`MalformedNode` naming ``where``), and compares the structures of parts. Lists,
    tuples, dicts and ``None`` come back as themselves; ``"leaf"`` and ``"global"`` nodes as
    ``leaf`` returns. Containers nest at most :data:`MAX_DEPTH` deep.

    Example:
      >>> rebuild({"tuple": [{"leaf": "a"}, None]}, lambda kind, body, path: path, "x")
      ((0,), None)
    """
    if node is None:
        return None
    if not isinstance(node, dict) or len(node) != 1:
        raise MalformedNode(f"{where} has a malformed node")
    ((kind, body),) = node.items()
    if kind in ("leaf", "global"):
        return leaf(kind, body, path)
    if len(path) >= MAX_DEPTH:
        raise MalformedNode(f"{where} is nested deeper than {MAX_DEPTH} levels, which "
                            "sowtel.dump never writes")
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [rebuild(child, leaf, where, (*path, i)) for i, child in enumerate(body)]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(body, list):
        out: dict[Any, Any] = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2):
                raise MalformedNode(f"{where} has a bad dict item")
            key = item[0]
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise MalformedNode(f"{where} has the dict key {key!r}: dict keys are strings "
                                    "or integers")
            if key in out:
                raise MalformedNode(f"{where} has the dict key {key!r} twice")
            out[key] = rebuild(item[1], leaf, where, (*path, key))
        return out
    raise MalformedNode(f"{where} has a node {kind!r}")
