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

import dataclasses
import io
import json
import math
import os
import re
import secrets
import socket
import stat
import time
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import ml_dtypes
import numpy as np

from sowtel.build import (  # records and intermediates structure, shared with streaming
    _check_intermediates,
    _check_mode,
    _check_step,
    _is_leaf,
    _stacking,
    leaf_name,
    program_order,
    records_from_intermediates,
)

__all__ = [
    "DumpEntry",
    "DumpInfo",
    "dump",
    "load",
    "info",
    "find_dumps",
    "part_name",
    "records_from_intermediates",
    "leaf_name",
    "program_order",
    "MAX_DEPTH",
    "MAX_CONTAINERS",
    "count_containers",
]

FORMAT = "sowtel.dump"
FORMAT_VERSION = 1
#: The kinds of stacked axes (:attr:`sowtel.Intermediates.stacked`) a dump may record.
STACKING_KINDS = ("scan", "shard")
SUFFIX = ".safetensors"
_STEP_FILE = re.compile(r"^step_(\d+)\.safetensors$")
# One process's part of a multi-process dump: <name>.process_<p>.safetensors.
_PART_FILE = re.compile(r"^(.*)\.process_(\d+)\.safetensors$", re.DOTALL)
_STEP_PART = re.compile(r"^step_(\d+)\.process_(\d+)\.safetensors$")
# How many processes a per-process dump may claim (the parts are looked for one by one).
MAX_PROCESSES = 1 << 16
# How many axes a global value in a per-process dump may have (numpy's own limit).
_MAX_RANK = 64

# safetensors dtype codes and the numpy dtypes they hold. The writer takes the numpy name
# (``bfloat16``), the file stores the code (``BF16``), the reader maps the code back.
_CODE_TO_DTYPE: dict[str, np.dtype] = {
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
_NAME_TO_DTYPE = {dt.name: dt for dt in _CODE_TO_DTYPE.values()}
_SUPPORTED_NAMES = set(_NAME_TO_DTYPE)

#: How deeply a dump's pytrees and metadata may nest (containers above a leaf). dump() refuses
#: deeper values and load() deeper files, so no reader ever recurses without bound.
MAX_DEPTH = 100

#: How many JSON arrays and objects a dump's header may hold (see :func:`count_containers`):
#: dump() refuses to write more and readers refuse to parse more, so a crafted header costs at
#: most a few hundred MB however it is built. A leaf takes about four.
MAX_CONTAINERS = 1_000_000

# A header larger than this is not something dump() writes (it is the safetensors library's own
# limit); refusing it keeps a corrupted length field from making load() allocate gigabytes.
_MAX_HEADER = 100_000_000
# Checksums are computed over chunks of this many bytes read into one reused buffer, so
# checking a file never holds more of it than this.
_CHUNK = 1 << 23
# What sowtel_version may hold (PEP 440 versions, and "unknown"): it is printed as it is.
_VERSION = re.compile(r"[A-Za-z0-9.+!_-]{1,100}")


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


def _check_json(value: Any, where: str, depth: int = 0) -> None:
    # Strict JSON types only: a tuple would come back as a list and a NaN is not JSON, so the
    # metadata would not round-trip exactly.
    if isinstance(value, (list, dict)) and depth >= MAX_DEPTH:
        raise ValueError(
            f"metadata{where} is nested deeper than {MAX_DEPTH} levels: keep metadata flatter"
        )
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"metadata{where} = {value!r} is not JSON: use a finite number or a string"
            )
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"metadata{where} has key {k!r}: JSON object keys must be strings")
            _check_json(v, f"{where}[{k!r}]", depth + 1)
        return
    raise ValueError(
        f"metadata{where} = {value!r} ({type(value).__name__}) is not JSON: metadata holds only "
        "dicts with string keys, lists, strings, finite numbers, bools and None"
    )


# ----------------------------------------------------------------------------- encoding


class _Encoder:
    """Turns ``{name: {mode: pytree}}`` into a JSON structure and a flat {key: array} dict."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        # Where the first value spanning processes, and the first that does not, were met.
        self.first_global: str | None = None
        self.first_local: str | None = None

    def _key(self, site: str, mode: str, leaf: tuple[Any, ...], shard: str = "") -> str:
        # Readable keys for other safetensors tools; the JSON structure is what load() trusts.
        base = "::".join([site, mode, *(["/".join(str(p) for p in leaf)] if leaf else [])])
        base += shard
        key, n = base, 1
        while key in self.tensors:
            key, n = f"{base}#{n}", n + 1
        return key

    def node(self, x: Any, site: str, mode: str, leaf: tuple[Any, ...]) -> Any:
        where = f"intermediates[{site!r}][{mode!r}]" + "".join(f"[{p!r}]" for p in leaf)
        if x is None:
            return None
        if type(x) in (dict, list, tuple) and len(leaf) >= MAX_DEPTH:
            raise ValueError(
                f"{where} is nested deeper than {MAX_DEPTH} levels: a dump holds pytrees at most "
                f"{MAX_DEPTH} containers deep; flatten the value first"
            )
        if type(x) is dict:
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ValueError(
                        f"{where} has dict key {k!r} ({type(k).__name__}): a dump stores dict "
                        "keys that are strings or ints; rename the key"
                    )
                items.append([k, self.node(v, site, mode, (*leaf, k))])
            return {"dict": items}
        if type(x) is list or type(x) is tuple:
            kind = "list" if type(x) is list else "tuple"
            return {kind: [self.node(v, site, mode, (*leaf, i)) for i, v in enumerate(x)]}
        if _is_leaf(x) and not isinstance(x, (str, bytes)):
            if getattr(x, "is_fully_addressable", True) is False:
                self.first_global = self.first_global or where
                return self._global(x, where, site, mode, leaf)
            self.first_local = self.first_local or where
            key = self._key(site, mode, leaf)
            self.tensors[key] = _host_array(x, where)
            return {"leaf": key}
        raise TypeError(
            f"{where} is a {type(x).__module__}.{type(x).__qualname__}: a dump stores pytrees "
            "made of dicts, lists, tuples, None and arrays only, so that loading it never runs "
            "code; convert it first (a namedtuple with ._asdict(), a flax FrozenDict with "
            "flax.core.unfreeze, a dataclass with dataclasses.asdict)"
        )


    def _global(self, x: Any, where: str, site: str, mode: str, leaf: tuple[Any, ...]) -> Any:
        """A jax.Array spanning processes: the shards this process holds, each stored once.

        Of the copies of a shard (a replicated axis), only the one with ``replica_id`` 0 is
        stored, in whichever process holds it, so the parts of all processes tile the global
        value exactly once.
        """
        shape = tuple(int(n) for n in x.shape)
        dtype = np.dtype(x.dtype).name
        _check_dtype(dtype, where)
        shards, seen = [], set()
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            box = tuple(_span(i, n) for i, n in zip(shard.index, shape, strict=True))
            if box in seen:
                continue
            seen.add(box)
            key = self._key(site, mode, leaf, "@" + ",".join(f"{b}:{e}" for b, e in box))
            self.tensors[key] = _host_array(shard.data, where)
            shards.append([key, [list(b) for b in box]])
        return {"global": {"shape": list(shape), "dtype": dtype, "shards": shards}}


def _span(index: Any, n: int) -> tuple[int, int]:
    start, stop, stride = index.indices(n)
    if stride != 1:  # jax shards are contiguous blocks
        raise ValueError(f"a shard index {index!r} with a stride {stride} is not a block")
    return start, max(start, stop)


def _check_dtype(name: str, where: str) -> None:
    if name not in _SUPPORTED_NAMES:
        raise ValueError(
            f"{where} has dtype {name}, which a dump cannot hold: supported "
            f"dtypes are {', '.join(sorted(_SUPPORTED_NAMES))}; cast it first "
            "(for example x.astype(np.float32))"
        )


def _host_array(x: Any, where: str) -> np.ndarray:
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    arr = np.asarray(x)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    _check_dtype(arr.dtype.name, where)
    return arr


def part_name(path: str | os.PathLike[str], process_index: int) -> Path:
    """The file one process writes for a dump to ``path`` of values that span processes.

    Example:
      >>> part_name("dumps/step_3.safetensors", 1).as_posix()
      'dumps/step_3.process_1.safetensors'
    """
    p = Path(_fspath(path))
    stem = p.name[:-len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name
    return p.with_name(f"{stem}.process_{process_index}{SUFFIX}")


def _crc(buf: Any) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def _array_crc(arr: np.ndarray) -> int:
    return _crc(arr.reshape(-1).view(np.uint8).data) if arr.size else 0


def _header_crc(fields: dict[str, Any], table: dict[str, tuple[str, list[int]]]) -> int:
    canonical = json.dumps([fields, sorted((k, *v) for k, v in table.items())], sort_keys=True)
    return _crc(canonical.encode())


def _sowtel_version() -> str:
    try:
        from importlib.metadata import version

        return version("sowtel")
    except Exception:  # an uninstalled checkout still writes a readable dump
        return "unknown"


def _fspath(path: Any, what: str = "path") -> str:
    """``os.fspath(path)``, or a TypeError naming the value and what a path is."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}={path!r} is not a path: pass a str or a pathlib.Path")
    return os.fspath(path)


def _target(path: str | os.PathLike[str], step: int | None) -> Path:
    raw = _fspath(path)
    p = Path(raw)
    if raw.endswith(("/", os.sep)) or p.is_dir():
        if step is None:
            raise ValueError(
                f"dump into the folder {raw!r} needs step=: files in a folder of dumps are "
                "named step_<k>.safetensors; pass step=k, or a file path"
            )
        if step < 0:
            raise ValueError(f"step={step} must be >= 0 to name a file in the folder {raw!r}")
        return p / f"step_{step}{SUFFIX}"
    return p



# ----------------------------------------------------------------------------- writing the file


_DTYPE_TO_CODE = {dt.name: code for code, dt in _CODE_TO_DTYPE.items()}
# Where the platform has them (POSIX): open without following a link, open a folder only, and
# name files relative to an open folder.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FD = {os.open, os.stat, os.unlink, os.rename}.issubset(os.supports_dir_fd)
# A dump's temporary file: .<name>.<host>.<pid>.<random>.tmp, beside the final file. The host and
# the process say whose it is (so stale ones of dead processes can be removed); the random part
# makes the name unguessable. Older versions wrote .<name>.<pid>.tmp.
_TMP_FILE = re.compile(r"^\..*\.([A-Za-z0-9-]{1,40})\.(\d{1,10})\.[0-9a-f]{16}\.tmp$", re.DOTALL)
_OLD_TMP_FILE = re.compile(r"^\..*\.safetensors\.(\d{1,10})\.tmp$", re.DOTALL)
# A temporary file of the old form is removed only once this old: its name does not say which
# machine wrote it, and a folder may be shared between machines.
_OLD_TMP_AGE = 3600.0


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


def _safetensors_header(tensors: dict[str, np.ndarray], fields: dict[str, str]) -> bytes:
    """The length field and JSON header of a safetensors file holding ``tensors`` in order."""
    header: dict[str, Any] = {"__metadata__": fields}
    at = 0
    for key, arr in tensors.items():
        header[key] = {"dtype": _DTYPE_TO_CODE[arr.dtype.name], "shape": list(arr.shape),
                       "data_offsets": [at, at + arr.nbytes]}
        at += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > _MAX_HEADER or count_containers(text) > MAX_CONTAINERS:
        raise ValueError(
            f"this dump's header would be {len(text)} bytes with {count_containers(text)} JSON "
            f"containers, over the limits of {_MAX_HEADER} bytes and {MAX_CONTAINERS} "
            "containers that load() reads: dump fewer leaves per file (split the sites over "
            "several dumps), or shorter metadata")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id: never treated as a dead writer's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def _remove_stale_temporaries(folder: Path, at: dict[str, Any]) -> None:
    """Removes temporary files of dumps into ``folder`` whose writing process has died.

    A process killed while writing a dump leaves its hidden temporary file behind (a dump of
    gigabytes leaves gigabytes). Only files named as this machine's dumps name them, of
    processes that no longer exist, are removed; a file of the old name form (no machine
    named) only once it is an hour old. Removing is best effort: a file that cannot be removed
    is left.
    """
    host = _host_tag()
    try:
        names = os.listdir(at.get("dir_fd", folder))
    except OSError:
        return
    for name in names:
        if not name.endswith(".tmp") or not name.startswith("."):
            continue
        new, old = _TMP_FILE.match(name), _OLD_TMP_FILE.match(name)
        where = name if at else folder / name
        try:
            if new:
                stale = new.group(1) == host and not _alive(int(new.group(2)))
            else:
                stale = bool(old) and not _alive(int(old.group(1))) and (
                    time.time() - os.stat(where, follow_symlinks=False, **at).st_mtime
                    >= _OLD_TMP_AGE)
            if stale:
                os.unlink(where, **at)
        except OSError:
            continue


def _write_file(target: Path, header: bytes, tensors: dict[str, np.ndarray]) -> None:
    """Writes the dump file at ``target`` through a temporary file that no one else can steer.

    The temporary file gets an unguessable name and is created exclusively without following
    a link, relative to the opened folder; it is written through its descriptor only (its mode
    is the umask's, as for any new file: nothing is ever changed by path) and renamed into
    place only if the name still holds the file written, checked again after the rename. A
    file or link swapped in under the temporary name is never written through, never
    changed, and never becomes the dump.
    """
    folder = target.parent
    at: dict[str, Any] = {}
    if _DIR_FD:
        at = {"dir_fd": os.open(folder, os.O_RDONLY | _DIRECTORY | _CLOEXEC)}
    try:
        _remove_stale_temporaries(folder, at)
        for _ in range(100):
            tmp = (f".{target.name[:100]}.{_host_tag()}.{os.getpid()}."
                   f"{secrets.token_hex(8)}.tmp")
            try:
                fd = os.open(tmp if at else folder / tmp,
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC,
                             0o666, **at)
                break
            except FileExistsError:  # someone made that name first: draw another
                continue
        else:
            raise FileExistsError(f"no free temporary name for a dump in {str(folder)!r}")
        ours = os.fstat(fd)
        try:
            try:
                _write_all(fd, header)
                for arr in tensors.values():
                    if arr.dtype.byteorder == ">":  # safetensors is little-endian
                        arr = arr.astype(arr.dtype.newbyteorder("<"))
                    if arr.size:
                        _write_all(fd, arr.reshape(-1).view(np.uint8))
            finally:
                os.close(fd)
            _replace_if_ours(folder, tmp, target.name, ours, at)
        except BaseException:
            _unlink_if_ours(folder, tmp, ours, at)
            raise
    finally:
        if at:
            os.close(at["dir_fd"])


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) and stat.S_ISREG(b.st_mode)


def _lstat(folder: Path, name: str, at: dict[str, Any]) -> os.stat_result | None:
    try:
        return os.stat(name if at else folder / name, follow_symlinks=False, **at)
    except FileNotFoundError:
        return None


def _replace_if_ours(folder: Path, tmp: str, name: str, ours: os.stat_result,
                     at: dict[str, Any]) -> None:
    found = _lstat(folder, tmp, at)
    if found is None or not _same_file(ours, found):
        raise ValueError(
            f"the temporary file {tmp!r} of a dump into {str(folder)!r} was replaced by "
            "something else while it was written (another user who can write to that folder?): "
            "nothing was written through it and no dump was made; dump into a folder only you "
            "can write to")
    rename = {"src_dir_fd": at["dir_fd"], "dst_dir_fd": at["dir_fd"]} if at else {}
    os.replace(tmp if at else folder / tmp, name if at else folder / name, **rename)
    found = _lstat(folder, name, at)
    if found is None or not _same_file(ours, found):
        # Swapped between the check and the rename: what was moved into place is not the dump.
        if found is not None and not stat.S_ISDIR(found.st_mode):
            os.unlink(name if at else folder / name, **at)
        raise ValueError(
            f"the temporary file of the dump {str(folder / name)!r} was replaced while it was "
            "renamed (another user who can write to that folder?): what was moved into place "
            "was removed and no dump was made; dump into a folder only you can write to")


def _unlink_if_ours(folder: Path, tmp: str, ours: os.stat_result, at: dict[str, Any]) -> None:
    found = _lstat(folder, tmp, at)
    if found is not None and _same_file(ours, found):
        try:
            os.unlink(tmp if at else folder / tmp, **at)
        except OSError:
            pass



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
    _check_intermediates(intermediates, "intermediates")
    if step is not None:
        step = _check_step(step)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (JSON object), got {type(metadata).__name__}")
    _check_json(metadata, "")
    encoder = _Encoder()
    sites = [
        [name, [[mode, encoder.node(value, name, mode, ())] for mode, value in modes.items()]]
        for name, modes in intermediates.items()
    ]
    stacked = {
        name: {mode: [list(axis) for axis in axes] for mode, axes in _stacking(modes).items()}
        for name, modes in intermediates.items() if _stacking(modes)
    }
    if encoder.first_global is not None and encoder.first_local is not None:
        raise ValueError(
            f"{encoder.first_local} is a value of this process alone, and {encoder.first_global} "
            "a jax.Array spanning the devices of several processes: a dump of values that span "
            "processes is written in parts, one per process, which hold global values only. "
            "Dump the process-local values separately (in one process, or to a name per "
            "process), or make them global (jax.make_array_from_process_local_data)"
        )
    fields = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "sowtel_version": _sowtel_version(),
        "created": repr(time.time()),
        "step": json.dumps(step),
        "metadata": json.dumps(metadata),
        "sites": json.dumps(sites),
    }
    if stacked:  # absent from dumps with nothing stacked, and from those older versions wrote
        fields["stacked"] = json.dumps(stacked)
    target = _target(path, step)
    if encoder.first_global is not None:
        import jax

        process = {"index": int(jax.process_index()), "count": int(jax.process_count())}
        fields["process"] = json.dumps(process)
        target = part_name(target, process["index"])
    table = {k: (a.dtype.name, list(a.shape)) for k, a in encoder.tensors.items()}
    checksums = {"header": _header_crc(fields, table),
                 "tensors": {k: _array_crc(a) for k, a in encoder.tensors.items()}}
    header = _safetensors_header(encoder.tensors,
                                 {**fields, "checksums": json.dumps(checksums)})
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_file(target, header, encoder.tensors)
    return target


# ----------------------------------------------------------------------------- reading


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes of ``f`` (fewer only at its end): an unbuffered read may return less."""
    parts, left = [], n
    while left:
        part = f.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def _not_regular(path: Path, mode: int) -> ValueError:
    return ValueError(
        f"{str(path)!r} is not a regular file (it is {_kind_of(mode)}): sowtel reads dumps only "
        "from regular files, as reading a pipe or a device could block or never end; copy it "
        "to a file first"
    )


def _open_regular(path: Path) -> io.FileIO:
    """Opens ``path`` for reading unbuffered, refusing anything but a regular file.

    The file is checked before it is opened (a socket cannot be opened at all) and again on the
    open descriptor, so a FIFO swapped in between is refused too. Opening does not block: with
    ``O_NONBLOCK`` a FIFO without a writer opens at once, and is then refused.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        return cast(io.FileIO, os.fdopen(fd, "rb", buffering=0))
    except BaseException:
        os.close(fd)
        raise


def _describe_foreign(path: Path, f: BinaryIO, head: bytes) -> str | None:
    """Names what a non-dump file is, reading headers only (never unpickling)."""
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle; sowtel never unpickles files, since that runs code from the file"
    if path.suffix.lower() in (".pkl", ".pickle", ".pt", ".pth", ".ckpt") and head[:2] != b"PK":
        return "a pickle file by its name; sowtel never unpickles files"
    if head[:6] == b"\x93NUMPY":
        f.seek(0)
        pickled = _npy_has_object(f)
        return ("a NumPy .npy file holding pickled objects; rejected without unpickling"
                if pickled else "a NumPy .npy file")
    if head[:4] == b"PK\x03\x04":
        f.seek(0)
        return _describe_zip(f)
    return None


def _npy_has_object(f: Any) -> bool:
    # read_array_header_* parse the header with ast.literal_eval: data, never code.
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            _, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            _, _, dtype = np.lib.format.read_array_header_2_0(f)
        return bool(dtype.hasobject)
    except Exception:
        return False


def _describe_zip(f: BinaryIO) -> str:
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
            pickles = [n for n in names if n.endswith((".pkl", ".pickle"))]
            if pickles:
                return (f"a zip archive containing the pickle {pickles[0]!r} (a PyTorch "
                        "checkpoint?); rejected without unpickling")
            for n in names:
                if n.endswith(".npy"):
                    with z.open(n) as member:
                        if _npy_has_object(member):
                            return (f"a NumPy .npz archive whose member {n!r} holds pickled "
                                    "objects; rejected without unpickling")
            if any(n.endswith(".npy") for n in names):
                return "a NumPy .npz archive"
            return "a zip archive"
    except zipfile.BadZipFile:
        return "a truncated or corrupted zip archive"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # JSON allows a key twice and Python keeps the last one: a dump never holds one twice, so a
    # header that does is refused rather than read as something other readers would not see.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice!r} appears twice in one JSON object")
    return out


class _DumpFile:
    """A parsed, validated dump header, and access to its arrays.

    Everything in the header is checked here, before any array is read: the tensor table, the
    header checksum, each field's type, and the structure (every node, every dict key, no site,
    mode or dict key twice, nothing nested deeper than :data:`MAX_DEPTH`), so the code that
    walks the structure afterwards meets only what ``dump`` writes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(_fspath(path))
        p = self.path
        if not p.exists():
            raise FileNotFoundError(f"{str(p)!r} does not exist: give the path of a sowtel dump")
        if p.is_dir():
            raise IsADirectoryError(f"{str(p)!r} is a folder: open its step_<k>.safetensors files")
        with _open_regular(p) as f:
            st = os.fstat(f.fileno())
            self.size = st.st_size
            self._identity = (st.st_size, st.st_mtime_ns)
            head = _read_exactly(f, 16)
            n = int.from_bytes(head[:8], "little")
            # A safetensors header is recognised first: its length field may well start with
            # the bytes a pickle starts with.
            if head[8:9] != b"{" or n > _MAX_HEADER:
                foreign = _describe_foreign(p, f, head)
                if foreign is not None:
                    raise ValueError(f"{str(p)!r} is not a sowtel dump: it is {foreign}")
            if len(head) < 9:
                raise ValueError(
                    f"{str(p)!r} is truncated or not a sowtel dump: {self.size} bytes is too short "
                    "for a safetensors header"
                )
            if head[8:9] != b"{" or n > _MAX_HEADER:
                raise ValueError(
                    f"{str(p)!r} is not a sowtel dump (nor a safetensors file): it does not start "
                    "with a safetensors header; dumps are written by sowtel.dump"
                )
            if 8 + n > self.size:
                raise ValueError(
                    f"{str(p)!r} is truncated: its header claims {n} bytes but the file has only "
                    f"{self.size - 8} after the length field"
                )
            f.seek(8)
            raw = _read_exactly(f, n)
        self.data_start = 8 + n
        containers = count_containers(raw)
        if containers > MAX_CONTAINERS:
            raise ValueError(
                f"{str(p)!r} is corrupted or crafted: its header holds {containers} JSON arrays "
                f"and objects, more than the {MAX_CONTAINERS} sowtel.dump ever writes; refused "
                "before parsing it")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(p)!r} is corrupted: its header is not valid JSON ({e})") from e
        header = self._json(text, "header")
        if not isinstance(header, dict):
            raise ValueError(f"{str(p)!r} is corrupted: its header is not a JSON object")
        try:
            self._parse(header)
        except (OSError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - any other surprise is a malformed header too
            raise self._bad(f"its header is malformed ({type(e).__name__}: {e})") from e

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"{str(self.path)!r} is corrupted: {why}")

    def _json(self, text: Any, what: str) -> Any:
        """Parses one JSON text of the header; every failure is a ValueError naming the file."""
        if not isinstance(text, str):
            raise self._bad(f"its {what} is a {type(text).__name__}, not a JSON string")
        try:
            return json.loads(text, object_pairs_hook=_unique_keys)
        except RecursionError:
            raise self._bad(
                f"its {what} is nested too deeply to read (dumps nest at most {MAX_DEPTH} levels)"
            ) from None
        except ValueError as e:
            raise self._bad(f"its {what} is not valid JSON ({e})") from None

    def _parse(self, header: dict[str, Any]) -> None:
        fields = header.pop("__metadata__", None)
        if not isinstance(fields, dict) or fields.get("format") != FORMAT:
            raise ValueError(
                f"{str(self.path)!r} is a safetensors file but not a sowtel dump (its header has "
                f"no format={FORMAT!r}): sowtel inspect/diff read files written by sowtel.dump; "
                "open other safetensors files with safetensors.safe_open"
            )
        version = fields.get("format_version")
        if version != str(FORMAT_VERSION):
            raise ValueError(
                f"{str(self.path)!r} is a sowtel dump of format version {version!r}, which this "
                f"sowtel ({_sowtel_version()}) does not read (it reads {FORMAT_VERSION}): "
                "upgrade sowtel"
            )
        for key, value in fields.items():
            if not isinstance(value, str):  # safetensors metadata maps strings to strings
                raise self._bad(
                    f"its header field {key!r} is a {type(value).__name__}, not a string")
        # Tensor table: dtypes, shapes, and spans that tile the data section exactly.
        self.spans: dict[str, tuple[int, int, np.dtype, tuple[int, ...]]] = {}
        table: dict[str, tuple[str, list[int]]] = {}
        for key, t in header.items():
            try:
                dtype = _CODE_TO_DTYPE[t["dtype"]]
                shape = tuple(t["shape"])
                begin, end = t["data_offsets"]
                if not all(type(d) is int for d in (*shape, begin, end)):
                    raise TypeError("shape and data_offsets must be integers")
            except (KeyError, TypeError, ValueError) as e:
                raise self._bad(f"the entry of tensor {key!r} is malformed ({e!r})") from e
            if any(d < 0 for d in shape) or begin < 0 or end < begin:
                raise self._bad(f"tensor {key!r} has shape {shape} and offsets {[begin, end]}")
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise self._bad(
                    f"tensor {key!r} of shape {shape} and dtype {dtype.name} should span "
                    f"{math.prod(shape) * dtype.itemsize} bytes, its offsets give {end - begin}"
                )
            self.spans[key] = (begin, end, dtype, shape)
            table[key] = (dtype.name, list(shape))
        covered = 0
        for begin, end, *_ in sorted(self.spans.values(), key=lambda s: (s[0], s[1])):
            if begin != covered:
                raise self._bad(f"tensor data overlaps or leaves a gap at byte {covered}")
            covered = end
        data_len = self.size - self.data_start
        if data_len != covered:
            what = "truncated" if data_len < covered else "corrupted"
            raise ValueError(
                f"{str(self.path)!r} is {what}: its tensors need {covered} bytes of data, the "
                f"file holds {data_len}"
            )
        checksums = self._json(fields.pop("checksums", None), "header field checksums")
        try:
            self.crcs: dict[str, int] = {k: int(v) for k, v in checksums["tensors"].items()}
            header_crc = int(checksums["header"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise self._bad(f"its checksums are missing or malformed ({e!r})") from e
        if _header_crc(fields, table) != header_crc:
            raise self._bad("the header checksum does not match (the header was altered)")
        for name in ("step", "metadata", "sowtel_version", "created", "sites"):
            if name not in fields:
                raise self._bad(f"its header field {name!r} is missing")
        step = self._json(fields["step"], "header field step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise self._bad(f"its header field step is {step!r}: a step is an integer or null")
        self.step: int | None = step
        metadata = self._json(fields["metadata"], "header field metadata")
        if not isinstance(metadata, dict):
            raise self._bad(f"its header field metadata is {type(metadata).__name__}, not a "
                            "JSON object")
        try:
            _check_json(metadata, "")
        except ValueError as e:
            raise self._bad(f"its header field metadata is not valid: {e}") from None
        self.metadata: dict[str, Any] = metadata
        self.sowtel_version = fields["sowtel_version"]
        if not _VERSION.fullmatch(self.sowtel_version):
            raise self._bad(f"its header field sowtel_version is {self.sowtel_version!r}, not a "
                            "version number")
        try:
            self.created = float(fields["created"])
        except ValueError:
            self.created = math.nan
        if not (math.isfinite(self.created) and self.created >= 0):
            raise self._bad(f"its header field created is {fields['created']!r}, not a Unix time")
        self.process: tuple[int, int] | None = None
        if "process" in fields:
            proc = self._json(fields["process"], "header field process")
            if not (isinstance(proc, dict) and set(proc) == {"index", "count"}
                    and all(type(v) is int for v in proc.values())
                    and 0 <= proc["index"] < proc["count"] <= MAX_PROCESSES):
                raise self._bad(
                    f"its header field process is {fields['process']!r}: it is "
                    f'{{"index": p, "count": n}} with 0 <= p < n <= {MAX_PROCESSES}')
            self.process = (proc["index"], proc["count"])
        self.sites = self._json(fields["sites"], "header field sites")
        self.stacked = self._check_stacked(
            self._json(fields.get("stacked", "{}"), "header field stacked"))
        self.entries = self._entries()

    def _entries(self) -> tuple[DumpEntry, ...]:
        out: list[DumpEntry] = []
        used: set[str] = set()

        def walk(node: Any, site: str, mode: str, leaf: tuple[Any, ...]) -> None:
            where = f"the structure of {site!r} ({mode})"
            if node is None:
                return
            if not isinstance(node, dict) or len(node) != 1:
                raise self._bad(f"{where} has a malformed node")
            ((kind, body),) = node.items()
            if kind not in ("leaf", "global") and len(leaf) >= MAX_DEPTH:
                raise self._bad(f"{where} is nested deeper than {MAX_DEPTH} levels, which "
                                "sowtel.dump never writes")
            if kind == "leaf":
                if not isinstance(body, str) or body not in self.spans or body in used:
                    raise self._bad(f"the structure names tensor {body!r}, absent or used twice")
                used.add(body)
                _, _, dtype, shape = self.spans[body]
                axes = self.stacked.get(site, {}).get(mode, ())
                if shape[:len(axes)] != tuple(n for _, n in axes):
                    axes = ()
                out.append(DumpEntry(leaf_name(site, leaf), site, mode, leaf, shape,
                                     dtype.name, body, axes))
            elif kind == "global":
                out.append(self._global_entry(body, site, mode, leaf, used))
            elif kind in ("list", "tuple") and isinstance(body, list):
                for i, child in enumerate(body):
                    walk(child, site, mode, (*leaf, i))
            elif kind == "dict" and isinstance(body, list):
                keys: set[Any] = set()
                for item in body:
                    if not (isinstance(item, list) and len(item) == 2):
                        raise self._bad(f"{where} has a bad dict item")
                    key = item[0]
                    if isinstance(key, bool) or not isinstance(key, (str, int)):
                        raise self._bad(f"{where} has the dict key {key!r}: dict keys are "
                                        "strings or integers")
                    if key in keys:
                        raise self._bad(f"{where} has the dict key {key!r} twice")
                    keys.add(key)
                    walk(item[1], site, mode, (*leaf, key))
            else:
                raise self._bad(f"{where} has a node {kind!r}")

        if not isinstance(self.sites, list):
            raise self._bad("its site list is not a list")
        names: set[str] = set()
        for item in self.sites:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                    and item[0] and isinstance(item[1], list)):
                raise self._bad("its site list has a malformed site")
            if item[0] in names:
                raise self._bad(f"its site list names the site {item[0]!r} twice")
            names.add(item[0])
            modes: set[str] = set()
            for pair in item[1]:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise self._bad(f"site {item[0]!r} has a malformed mode")
                try:
                    _check_mode(pair[0], f"site {item[0]!r}")
                except ValueError as e:
                    raise self._bad(str(e)) from None
                if pair[0] in modes:
                    raise self._bad(f"site {item[0]!r} has the mode {pair[0]!r} twice")
                modes.add(pair[0])
                walk(pair[1], item[0], pair[0], ())
        if used != set(self.spans):
            raise self._bad(f"tensors {sorted(set(self.spans) - used)} belong to no site")
        return tuple(out)

    def _global_entry(self, body: Any, site: str, mode: str, leaf: tuple[Any, ...],
                      used: set[str]) -> DumpEntry:
        """The entry of a value spanning processes: its global shape and this file's shards."""
        where = f"the global value {leaf_name(site, leaf)!r} ({mode})"
        if self.process is None:
            raise self._bad(f"{where} is in a dump that is not one process's part")
        if not (isinstance(body, dict) and set(body) == {"shape", "dtype", "shards"}):
            raise self._bad(f"{where} is malformed")
        shape, dtype, shards = body["shape"], body["dtype"], body["shards"]
        if not (isinstance(shape, list) and len(shape) <= _MAX_RANK
                and all(type(n) is int and n >= 0 for n in shape)):
            raise self._bad(f"{where} has the shape {shape!r}")
        if not (isinstance(dtype, str) and dtype in _SUPPORTED_NAMES):
            raise self._bad(f"{where} has the dtype {dtype!r}")
        if not isinstance(shards, list):
            raise self._bad(f"{where} has a malformed shard list")
        held = []
        for item in shards:
            ok = (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                  and isinstance(item[1], list) and len(item[1]) == len(shape))
            box = item[1] if ok else []
            ok = ok and all(isinstance(b, list) and len(b) == 2 and type(b[0]) is type(b[1]) is int
                            and 0 <= b[0] <= b[1] <= n for b, n in zip(box, shape, strict=True))
            if not ok:
                raise self._bad(f"{where} has a malformed shard")
            key = item[0]
            if key not in self.spans or key in used:
                raise self._bad(f"{where} names the tensor {key!r}, absent or used twice")
            used.add(key)
            _, _, tensor_dtype, tensor_shape = self.spans[key]
            span = tuple((b, e) for b, e in box)
            if tensor_dtype.name != dtype or tensor_shape != tuple(e - b for b, e in span):
                raise self._bad(f"{where} has a shard at {span} whose tensor {key!r} is "
                                f"{tensor_dtype.name}{list(tensor_shape)}")
            held.append((self.process[0], key, span))
        axes = self.stacked.get(site, {}).get(mode, ())
        if tuple(shape[:len(axes)]) != tuple(n for _, n in axes):
            axes = ()
        return DumpEntry(leaf_name(site, leaf), site, mode, leaf, tuple(shape), dtype, "",
                         axes, tuple(held))

    def _check_stacked(self, stacked: Any) -> dict[str, dict[str, tuple[tuple[str, int], ...]]]:
        out: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {}
        if not isinstance(stacked, dict):
            raise self._bad("its stacked axes are not a JSON object")
        for site, modes in stacked.items():
            if not isinstance(modes, dict):
                raise self._bad(f"the stacked axes of {site!r} are not a JSON object")
            for mode, axes in modes.items():
                if not (isinstance(axes, list) and all(
                        isinstance(a, list) and len(a) == 2 and a[0] in STACKING_KINDS
                        and type(a[1]) is int and a[1] >= 0 for a in axes)):
                    raise self._bad(f"the stacked axes of {site!r} ({mode}) are malformed")
                out.setdefault(site, {})[mode] = tuple((a[0], a[1]) for a in axes)
        return out

    def info(self) -> DumpInfo:
        return DumpInfo(
            path=self.path, step=self.step, metadata=self.metadata,
            sowtel_version=self.sowtel_version, created=self.created,
            sites=tuple(s[0] for s in self.sites), entries=self.entries,
            nbytes=self.size - self.data_start, process=self.process,
        )

    def verify(self) -> None:
        """Checks every tensor's data against its CRC-32, streaming through the file.

        The data is read in file order, in chunks of at most ``_CHUNK`` bytes into one reused
        buffer, so checking a file of any size holds only a chunk of it, and a mismatch is
        raised as soon as the tensor holding it has been read.
        """
        chunk = memoryview(bytearray(min(_CHUNK, max(1, self.size - self.data_start))))
        with _open_regular(self.path) as f:
            self._check_unchanged(f)
            f.seek(self.data_start)
            for key, (begin, end, _, _) in sorted(self.spans.items(), key=lambda kv: kv[1][0]):
                crc, left = 0, end - begin
                while left:
                    got = f.readinto(chunk[:min(left, len(chunk))])
                    if not got:
                        raise ValueError(f"{str(self.path)!r} changed while being read: it "
                                         "is shorter than its header says")
                    crc = zlib.crc32(chunk[:got], crc)
                    left -= got
                if crc != self.crcs.get(key):
                    raise self._bad(f"the data of tensor {key!r} fails its checksum")

    def _check_unchanged(self, f: io.FileIO) -> None:
        st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != self._identity:
            raise ValueError(f"{str(self.path)!r} changed while being read: read it again")

    def buffer(self, lazy: bool) -> np.ndarray:
        """The whole file as uint8: memory-mapped (lazy) or read into memory (writable)."""
        with _open_regular(self.path) as f:
            self._check_unchanged(f)
            if lazy:
                return np.asarray(np.memmap(f, dtype=np.uint8, mode="r", shape=(self.size,)))
            buf = np.empty(self.size, dtype=np.uint8)
            view, got = buf.data, 0
            while got < self.size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            self._check_unchanged(f)
        if got != self.size:
            raise ValueError(f"{str(self.path)!r} changed while being read ({got} of {self.size})")
        return buf

    def array(self, buf: np.ndarray, key: str) -> np.ndarray:
        """One tensor of ``buf`` (from :meth:`buffer`); its checksum is :meth:`verify`'s job."""
        begin, end, dtype, shape = self.spans[key]
        return buf[self.data_start + begin: self.data_start + end].view(dtype).reshape(shape)

    def reader(self, lazy: bool) -> Any:
        """A function from an entry of :attr:`entries` to its array (see :meth:`buffer`)."""
        buf = self.buffer(lazy)

        def read(entry: DumpEntry) -> np.ndarray:
            if entry.shards or not entry.key:
                raise ValueError(
                    f"{str(self.path)!r} is one process's part of a multi-process dump: "
                    f"{entry.name!r} is a global value; read it with all the parts")
            return self.array(buf, entry.key)

        return read

    def tree(self, lazy: bool) -> Any:
        """The intermediates; with ``lazy=False`` checked against their checksums first."""
        return _tree(self, lazy)


def _tree(f: _DumpFile | _DumpSet, lazy: bool) -> Any:
    """The intermediates of a dump or of the parts of one; checksums first unless ``lazy``."""
    if not lazy:
        f.verify()
    read = f.reader(lazy)
    entries = {(e.site, e.mode, e.leaf): e for e in f.entries}

    def build(node: Any, site: str, mode: str, leaf: tuple[Any, ...]) -> Any:
        if node is None:
            return None
        ((kind, body),) = node.items()
        if kind in ("leaf", "global"):
            return read(entries[(site, mode, leaf)])
        if kind == "list":
            return [build(c, site, mode, (*leaf, i)) for i, c in enumerate(body)]
        if kind == "tuple":
            return tuple(build(c, site, mode, (*leaf, i)) for i, c in enumerate(body))
        return {k: build(c, site, mode, (*leaf, k)) for k, c in body}

    # The same container save_intermediates returns, so the site order survives jit too.
    from sowtel.capture import Intermediates

    out = Intermediates()
    for name, modes in f.sites:
        site = out[name] = Intermediates(
            (mode, build(node, name, mode, ())) for mode, node in modes)
        site.stacked = dict(f.stacked.get(name, {}))
    return out


def _skeleton(node: Any) -> Any:
    """A structure node without tensor keys and shards: what every part of a dump shares."""
    if node is None:
        return None
    ((kind, body),) = node.items()
    if kind == "leaf":
        return kind
    if kind == "global":
        return (kind, tuple(body["shape"]), body["dtype"])
    if kind == "dict":
        return (kind, tuple((k, _skeleton(c)) for k, c in body))
    return (kind, tuple(_skeleton(c) for c in body))


def _check_tiling(where: str, shape: tuple[int, ...],
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
                raise ValueError(
                    f"{where}: the parts' shards {'overlap' if b < at else 'leave a gap'} "
                    f"along axis {axis} at {at}, so they are not the shards of one value")
            at = e
        if at != n:
            raise ValueError(f"{where}: no part holds elements {at}..{n - 1} along axis {axis}")
        per_axis.append(len(blocks))
    if len(boxes) != math.prod(per_axis) or len(set(boxes)) != len(boxes):
        raise ValueError(
            f"{where}: the parts hold {len(boxes)} shards where {math.prod(per_axis)} distinct "
            "blocks tile the value: a shard is missing or held twice")


class _DumpSet:
    """The per-process parts of one multi-process dump, read as one dump of global values.

    Checked from the headers alone before any data is read: one part per process, all of one
    step and one structure, and shards that tile every global value exactly once.
    """

    def __init__(self, parts: Sequence[_DumpFile]) -> None:
        for f in parts:
            if f.process is None:
                raise ValueError(
                    f"{str(f.path)!r} is a whole dump, not one process's part: a list of paths "
                    "names the parts of one multi-process dump (step_<k>.process_<p>"
                    ".safetensors)")
        by_index: dict[int, _DumpFile] = {}
        count = parts[0].process[1]  # type: ignore[index]
        for f in parts:
            index, n = f.process  # type: ignore[misc]
            if n != count:
                raise ValueError(
                    f"{str(f.path)!r} is a part of a {n}-process dump and {str(parts[0].path)!r} "
                    f"of a {count}-process one: they are not parts of one dump")
            if index in by_index:
                raise ValueError(
                    f"{str(by_index[index].path)!r} and {str(f.path)!r} are both process "
                    f"{index}'s part: give each process's part once")
            by_index[index] = f
        missing = [k for k in range(count) if k not in by_index]
        if missing:
            raise ValueError(
                f"the part{'s' if len(missing) > 1 else ''} of process"
                f"{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
                f"{' ...' if len(missing) > 8 else ''} of this {count}-process dump "
                f"{'are' if len(missing) > 1 else 'is'} missing: give all {count} parts")
        self.parts = [by_index[k] for k in range(count)]
        first = self.parts[0]
        shape = [[name, [[m, _skeleton(n)] for m, n in modes]] for name, modes in first.sites]
        for f in self.parts[1:]:
            if f.step != first.step:
                raise ValueError(f"{str(f.path)!r} is of step {f.step} and {str(first.path)!r} "
                                 f"of step {first.step}: they are not parts of one dump")
            if [[name, [[m, _skeleton(n)] for m, n in modes]] for name, modes in f.sites] != shape \
                    or f.stacked != first.stacked:
                raise ValueError(
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
            _check_tiling(f"{e.name!r} ({e.mode}) of the dump {str(first.path)!r}", e.shape,
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
            out = np.empty(entry.shape, np.dtype(_NAME_TO_DTYPE[entry.dtype]))
            for process, key, box in entry.shards:
                f = self.parts[process]
                out[tuple(slice(b, e) for b, e in box)] = f.array(bufs[process], key)
            return out

        return read

    def tree(self, lazy: bool) -> Any:
        return _tree(self, lazy)


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
    p = Path(_fspath(folder, "folder"))
    if not p.exists():
        raise FileNotFoundError(f"{str(p)!r} does not exist: give a folder of sowtel dumps")
    if not p.is_dir():
        raise NotADirectoryError(f"{str(p)!r} is a file, not a folder of dumps")
    found: dict[int, Path] = {}
    parts: dict[tuple[int, int], Path] = {}
    lowest: dict[int, int] = {}  # per step dumped in parts: its lowest process
    for child in p.iterdir():
        m = _STEP_FILE.match(child.name) or _STEP_PART.match(child.name)
        if m and child.exists() and not child.is_file() and not child.is_dir():
            # A FIFO or a device named like a dump: refused, as load() refuses it, rather than
            # silently leaving a step out.
            raise _not_regular(child, child.stat().st_mode)
        if not (m and child.is_file()):
            continue
        step = int(m.group(1))
        if m.re is _STEP_PART:
            index = int(m.group(2))
            if (step, index) in parts:
                raise ValueError(
                    f"{str(p)!r} holds two parts of process {index} for step {step}: "
                    f"{parts[(step, index)].name!r} and {child.name!r}; remove one")
            parts[(step, index)] = child
            if step in found and not _STEP_PART.match(found[step].name):
                raise ValueError(
                    f"{str(p)!r} holds a whole dump and per-process parts for step {step}: "
                    f"{found[step].name!r} and {child.name!r}; remove one")
            if step not in found or index < lowest[step]:
                found[step], lowest[step] = child, index
            continue
        if step in found:
            what = ("a whole dump and per-process parts" if _STEP_PART.match(found[step].name)
                    else "two dumps")
            raise ValueError(
                f"{str(p)!r} holds {what} for step {step}: {found[step].name!r} and "
                f"{child.name!r}; remove one"
            )
        found[step] = child
    if not found:
        raise ValueError(
            f"{str(p)!r} holds no dumps (files named step_<k>.safetensors): write them with "
            "sowtel.dump(intermediates, folder, step=k)"
        )
    return dict(sorted(found.items()))


def _siblings(part: _DumpFile) -> list[Path]:
    """The paths of the other processes' parts of the dump ``part`` belongs to, by name."""
    index, count = part.process  # type: ignore[misc]
    m = _PART_FILE.match(part.path.name)
    if not m or int(m.group(2)) != index:
        raise ValueError(
            f"{str(part.path)!r} is process {index}'s part of a {count}-process dump, and its "
            "name (not <name>.process_<p>.safetensors) does not say where the others are: "
            f"give all {count} parts, sowtel.load([...]) or sowtel inspect PART PART ...")
    return [part.path.with_name(f"{m.group(1)}.process_{k}{SUFFIX}")
            for k in range(count) if k != index]


def _open(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
          ) -> _DumpFile | _DumpSet:
    """A dump: one file, or every part of a multi-process dump (from any part, or all)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError("an empty list of paths: give the parts of a multi-process dump")
        return _DumpSet([_DumpFile(p) for p in path])
    f = _DumpFile(cast("str | os.PathLike[str]", path))
    if f.process is None:
        return f
    others = _siblings(f)
    absent = [q for q in others if not q.exists()]
    if absent:
        names = ", ".join(repr(q.name) for q in absent[:4]) + (" ..." if len(absent) > 4 else "")
        raise ValueError(
            f"{str(f.path)!r} is process {f.process[0]}'s part of a {f.process[1]}-process dump, "
            f"and {len(absent)} of the other parts {'is' if len(absent) == 1 else 'are'} not "
            f"beside it: {names}; copy every process's part into one folder")
    return _DumpSet([f, *(_DumpFile(q) for q in others)])


def _open_step(step: int, path: Path) -> _DumpFile | _DumpSet:
    f = _open(path)
    if f.step is not None and f.step != step:
        raise ValueError(
            f"{str(path)!r} is named for step {step} but its header says step {f.step}: "
            "rename the file to match its step"
        )
    return f


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
    return _DumpFile(path).info()


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
        return _open(path).tree(lazy)
    p = Path(_fspath(path))
    if p.is_dir():
        return {step: _open_step(step, f).tree(lazy) for step, f in find_dumps(p).items()}
    return _open(p).tree(lazy)
