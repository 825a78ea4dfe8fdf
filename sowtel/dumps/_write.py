"""Writing a dump: values to structure nodes and tensors, tensors to a file no one can steer.

The public face is :func:`sowtel.dumps.dump`; the format is :mod:`sowtel.dumps._format`.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sowtel import errors
from sowtel.dumps._format import (
    DTYPE_TO_CODE,
    FORMAT,
    FORMAT_VERSION,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_HEADER,
    SUFFIX,
    SUPPORTED_NAMES,
    array_crc,
    check_json,
    check_path,
    count_containers,
    header_crc,
    part_name,
    sowtel_version,
)
from sowtel.intermediates import check_intermediates, check_step, is_leaf, stacking

# ----------------------------------------------------------------------------- encoding


class Encoder:
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
            raise errors.NotDumpableError(
                where, f"is nested deeper than {MAX_DEPTH} levels: a dump holds pytrees at most "
                f"{MAX_DEPTH} containers deep; flatten the value first")
        if type(x) is dict:
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise errors.NotDumpableError(
                        where, f"has dict key {k!r} ({type(k).__name__}): a dump stores dict "
                        "keys that are strings or ints; rename the key")
                items.append([k, self.node(v, site, mode, (*leaf, k))])
            return {"dict": items}
        if type(x) is list or type(x) is tuple:
            kind = "list" if type(x) is list else "tuple"
            return {kind: [self.node(v, site, mode, (*leaf, i)) for i, v in enumerate(x)]}
        if is_leaf(x) and not isinstance(x, (str, bytes)):
            if getattr(x, "is_fully_addressable", True) is False:
                self.first_global = self.first_global or where
                return self._global(x, where, site, mode, leaf)
            self.first_local = self.first_local or where
            key = self._key(site, mode, leaf)
            self.tensors[key] = host_array(x, where)
            return {"leaf": key}
        raise errors.NotDumpableTypeError(
            where, f"is a {type(x).__module__}.{type(x).__qualname__}: a dump stores pytrees "
            "made of dicts, lists, tuples, None and arrays only, so that loading it never runs "
            "code; convert it first (a namedtuple with ._asdict(), a flax FrozenDict with "
            "flax.core.unfreeze, a dataclass with dataclasses.asdict)")


    def _global(self, x: Any, where: str, site: str, mode: str, leaf: tuple[Any, ...]) -> Any:
        """A jax.Array spanning processes: the shards this process holds, each stored once.

        Of the copies of a shard (a replicated axis), only the one with ``replica_id`` 0 is
        stored, in whichever process holds it, so the parts of all processes tile the global
        value exactly once.
        """
        shape = tuple(int(n) for n in x.shape)
        dtype = np.dtype(x.dtype).name
        check_dtype(dtype, where)
        shards, seen = [], set()
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            box = tuple(shard_span(i, n) for i, n in zip(shard.index, shape, strict=True))
            if box in seen:
                continue
            seen.add(box)
            key = self._key(site, mode, leaf, "@" + ",".join(f"{b}:{e}" for b, e in box))
            self.tensors[key] = host_array(shard.data, where)
            shards.append([key, [list(b) for b in box]])
        return {"global": {"shape": list(shape), "dtype": dtype, "shards": shards}}


def shard_span(index: Any, n: int) -> tuple[int, int]:
    start, stop, stride = index.indices(n)
    if stride != 1:  # jax shards are contiguous blocks
        raise ValueError(f"a shard index {index!r} with a stride {stride} is not a block")
    return start, max(start, stop)


def check_dtype(name: str, where: str) -> None:
    if name not in SUPPORTED_NAMES:
        raise errors.NotDumpableError(
            where, f"has dtype {name}, which a dump cannot hold: supported dtypes are "
            f"{', '.join(sorted(SUPPORTED_NAMES))}; cast it first (for example "
            "x.astype(np.float32))")


def host_array(x: Any, where: str) -> np.ndarray:
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    arr = np.asarray(x)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    check_dtype(arr.dtype.name, where)
    return arr


def target_path(path: str | os.PathLike[str], step: int | None) -> Path:
    raw = check_path(path)
    p = Path(raw)
    if raw.endswith(("/", os.sep)) or p.is_dir():
        if step is None:
            raise errors.BadOptionError(
                "step", step, f"is missing, and a dump into the folder {raw!r} needs step=: files "
                "in a folder of dumps are named step_<k>.safetensors; pass step=k, or a file "
                "path")
        if step < 0:
            raise errors.BadOptionError("step", step,
                                        f"must be >= 0 to name a file in the folder {raw!r}")
        return p / f"step_{step}{SUFFIX}"
    return p



# ----------------------------------------------------------------------------- writing the file

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


def safetensors_header(tensors: dict[str, np.ndarray], fields: dict[str, str]) -> bytes:
    """The length field and JSON header of a safetensors file holding ``tensors`` in order."""
    header: dict[str, Any] = {"__metadata__": fields}
    at = 0
    for key, arr in tensors.items():
        header[key] = {"dtype": DTYPE_TO_CODE[arr.dtype.name], "shape": list(arr.shape),
                       "data_offsets": [at, at + arr.nbytes]}
        at += arr.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > MAX_HEADER or count_containers(text) > MAX_CONTAINERS:
        raise errors.NotDumpableError(
            "this dump's header", f"would be {len(text)} bytes with {count_containers(text)} "
            f"JSON containers, over the limits of {MAX_HEADER} bytes and {MAX_CONTAINERS} "
            "containers that load() reads: dump fewer leaves per file (split the sites over "
            "several dumps), or shorter metadata")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def host_tag() -> str:
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


def remove_stale_temporaries(folder: Path, at: dict[str, Any]) -> None:
    """Removes temporary files of dumps into ``folder`` whose writing process has died.

    A process killed while writing a dump leaves its hidden temporary file behind (a dump of
    gigabytes leaves gigabytes). Only files named as this machine's dumps name them, of
    processes that no longer exist, are removed; a file of the old name form (no machine
    named) only once it is an hour old. Removing is best effort: a file that cannot be removed
    is left.
    """
    host = host_tag()
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
            elif old:
                stale = not _alive(int(old.group(1))) and (
                    time.time() - os.stat(where, follow_symlinks=False, **at).st_mtime
                    >= _OLD_TMP_AGE)
            else:
                continue
            if stale:
                os.unlink(where, **at)
        except OSError:
            continue


def write_file(target: Path, header: bytes, tensors: dict[str, np.ndarray]) -> None:
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
        remove_stale_temporaries(folder, at)
        for _ in range(100):
            tmp = (f".{target.name[:100]}.{host_tag()}.{os.getpid()}."
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



def write_dump(
    intermediates: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """:func:`sowtel.dumps.dump` (documented there)."""
    check_intermediates(intermediates, "intermediates")
    if step is not None:
        step = check_step(step)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise errors.BadOptionTypeError("metadata", metadata, f"is a {type(metadata).__name__}, "
                                        "not a dict (JSON object)")
    check_json(metadata, "")
    encoder = Encoder()
    sites = [
        [name, [[mode, encoder.node(value, name, mode, ())] for mode, value in modes.items()]]
        for name, modes in intermediates.items()
    ]
    stacked = {
        name: {mode: [list(axis) for axis in axes] for mode, axes in stacking(modes).items()}
        for name, modes in intermediates.items() if stacking(modes)
    }
    if encoder.first_global is not None and encoder.first_local is not None:
        raise errors.NotDumpableError(
            encoder.first_local, f"is a value of this process alone, and {encoder.first_global} "
            "a jax.Array spanning the devices of several processes: a dump of values that span "
            "processes is written in parts, one per process, which hold global values only. "
            "Dump the process-local values separately (in one process, or to a name per "
            "process), or make them global (jax.make_array_from_process_local_data)"
        )
    fields = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "sowtel_version": sowtel_version(),
        "created": repr(time.time()),
        "step": json.dumps(step),
        "metadata": json.dumps(metadata),
        "sites": json.dumps(sites),
    }
    if stacked:  # absent from dumps with nothing stacked, and from those older versions wrote
        fields["stacked"] = json.dumps(stacked)
    target = target_path(path, step)
    if encoder.first_global is not None:
        import jax

        process = {"index": int(jax.process_index()), "count": int(jax.process_count())}
        fields["process"] = json.dumps(process)
        target = part_name(target, process["index"])
    table = {k: (a.dtype.name, list(a.shape)) for k, a in encoder.tensors.items()}
    checksums = {"header": header_crc(fields, table),
                 "tensors": {k: array_crc(a) for k, a in encoder.tensors.items()}}
    header = safetensors_header(encoder.tensors,
                                 {**fields, "checksums": json.dumps(checksums)})
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file(target, header, encoder.tensors)
    return target


