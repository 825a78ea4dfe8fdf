"""Reading one dump file: refusing what is not a dump, checking every rule of the header
before any array is read, and building the values back.

The public face is :func:`sowtel.dumps.load`, :func:`sowtel.dumps.info` and
:func:`sowtel.dumps.open_dump`; :class:`DumpReader` is what other modules (``sowtel inspect``
and ``diff``) use of an open dump.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

import numpy as np

from sowtel import errors
from sowtel.dumps._format import (
    CHUNK,
    CODE_TO_DTYPE,
    FORMAT,
    FORMAT_VERSION,
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_HEADER,
    MAX_PROCESSES,
    MAX_RANK,
    STACKING_KINDS,
    SUPPORTED_NAMES,
    VERSION_TEXT,
    DumpEntry,
    DumpInfo,
    MalformedNode,
    check_json,
    check_path,
    count_containers,
    header_crc,
    rebuild,
    sowtel_version,
)
from sowtel.intermediates import check_mode
from sowtel.naming import leaf_name

# ----------------------------------------------------------------------------- reading


def read_exactly(f: BinaryIO, n: int) -> bytes:
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


def not_regular(path: Path, mode: int) -> ValueError:
    return ValueError(
        f"{str(path)!r} is not a regular file (it is {_kind_of(mode)}): sowtel reads dumps only "
        "from regular files, as reading a pipe or a device could block or never end; copy it "
        "to a file first"
    )


def open_regular(path: Path) -> io.FileIO:
    """Opens ``path`` for reading unbuffered, refusing anything but a regular file.

    The file is checked before it is opened (a socket cannot be opened at all) and again on the
    open descriptor, so a FIFO swapped in between is refused too. Opening does not block: with
    ``O_NONBLOCK`` a FIFO without a writer opens at once, and is then refused.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
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


class DumpReader(Protocol):
    """An open dump, one file or the parts of one: what ``sowtel inspect`` and ``diff`` use.

    Made by :func:`sowtel.dumps.open_dump`, which checks every header first.

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump, open_dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     f = open_dump(dump({"h": {"primal": (np.zeros(2), None)}}, d + "/a.safetensors"))
      ...     f.verify()
      ...     read = f.reader(lazy=False)
      ...     (f.modes("h"), f.structure("h", "primal"), read(f.info().entries[0]).tolist())
      (('primal',), (Ellipsis, None), [0.0, 0.0])
    """

    path: Path
    sites: list[Any]
    stacked: dict[str, dict[str, tuple[tuple[str, int], ...]]]

    def info(self) -> DumpInfo:
        """The header: step, metadata, sites, and every entry (for parts: global values)."""
        ...

    def verify(self) -> None:
        """Checks every array against its checksum; raises ``ValueError`` naming the file."""
        ...

    def reader(self, lazy: bool) -> Callable[[DumpEntry], np.ndarray]:
        """A function from an entry of :meth:`info` to its array (memory-mapped if ``lazy``)."""
        ...

    def modes(self, site: str) -> tuple[str, ...]:
        """The modes stored for ``site`` (those holding only ``None`` too), in stored order."""
        ...

    def structure(self, site: str, mode: str) -> Any:
        """The pytree of ``site``/``mode`` with ``...`` in place of every array."""
        ...


class SiteStructure:
    """The site list of a checked header, as :class:`DumpReader` shows it."""

    sites: list[Any]

    def modes(self, site: str) -> tuple[str, ...]:
        return tuple(m for m, _ in next(v for s, v in self.sites if s == site))

    def structure(self, site: str, mode: str) -> Any:
        node = next(n for s, modes in self.sites if s == site for m, n in modes if m == mode)
        return rebuild(node, lambda kind, body, path: ..., site)


class DumpFile(SiteStructure):
    """A parsed, validated dump header, and access to its arrays.

    Everything in the header is checked here, before any array is read: the tensor table, the
    header checksum, each field's type, and the structure (every node, every dict key, no site,
    mode or dict key twice, nothing nested deeper than :data:`MAX_DEPTH`), so the code that
    walks the structure afterwards meets only what ``dump`` writes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(check_path(path))
        p = self.path
        if not p.exists():
            raise FileNotFoundError(f"{str(p)!r} does not exist: give the path of a sowtel dump")
        if p.is_dir():
            raise IsADirectoryError(f"{str(p)!r} is a folder: open its step_<k>.safetensors files")
        with open_regular(p) as f:
            st = os.fstat(f.fileno())
            self.size = st.st_size
            self._identity = (st.st_size, st.st_mtime_ns)
            head = read_exactly(f, 16)
            n = int.from_bytes(head[:8], "little")
            # A safetensors header is recognised first: its length field may well start with
            # the bytes a pickle starts with.
            if head[8:9] != b"{" or n > MAX_HEADER:
                foreign = _describe_foreign(p, f, head)
                if foreign is not None:
                    raise errors.BadDumpError(p, f"is not a sowtel dump: it is {foreign}")
            if len(head) < 9:
                raise errors.BadDumpError(
                    p, f"is truncated or not a sowtel dump: {self.size} bytes is too short "
                    "for a safetensors header"
                )
            if head[8:9] != b"{" or n > MAX_HEADER:
                raise errors.BadDumpError(
                    p, "is not a sowtel dump (nor a safetensors file): it does not start "
                    "with a safetensors header; dumps are written by sowtel.dump"
                )
            if 8 + n > self.size:
                raise errors.BadDumpError(
                    p, f"is truncated: its header claims {n} bytes but the file has only "
                    f"{self.size - 8} after the length field"
                )
            f.seek(8)
            raw = read_exactly(f, n)
        self.data_start = 8 + n
        containers = count_containers(raw)
        if containers > MAX_CONTAINERS:
            raise errors.BadDumpError(
                p, f"is corrupted or crafted: its header holds {containers} JSON arrays "
                f"and objects, more than the {MAX_CONTAINERS} sowtel.dump ever writes; refused "
                "before parsing it")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise errors.BadDumpError(p, f"is corrupted: its header is not valid JSON ({e})") from e
        header = self._json(text, "header")
        if not isinstance(header, dict):
            raise errors.BadDumpError(p, "is corrupted: its header is not a JSON object")
        try:
            self._parse(header)
        except (OSError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - any other surprise is a malformed header too
            raise self._bad(f"its header is malformed ({type(e).__name__}: {e})") from e

    def _bad(self, why: str) -> errors.BadDumpError:
        return errors.BadDumpError(self.path, f"is corrupted: {why}")

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
            raise errors.BadDumpError(
                self.path, f"is a safetensors file but not a sowtel dump (its header has "
                f"no format={FORMAT!r}): sowtel inspect/diff read files written by sowtel.dump; "
                "open other safetensors files with safetensors.safe_open"
            )
        version = fields.get("format_version")
        if version != str(FORMAT_VERSION):
            raise errors.BadDumpError(
                self.path, f"is a sowtel dump of format version {version!r}, which this "
                f"sowtel ({sowtel_version()}) does not read (it reads {FORMAT_VERSION}): "
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
                dtype = CODE_TO_DTYPE[t["dtype"]]
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
            raise errors.BadDumpError(
                self.path, f"is {what}: its tensors need {covered} bytes of data, the "
                f"file holds {data_len}"
            )
        checksums = self._json(fields.pop("checksums", None), "header field checksums")
        try:
            self.crcs: dict[str, int] = {k: int(v) for k, v in checksums["tensors"].items()}
            stored_crc = int(checksums["header"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise self._bad(f"its checksums are missing or malformed ({e!r})") from e
        if header_crc(fields, table) != stored_crc:
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
            check_json(metadata, "")
        except ValueError as e:
            raise self._bad(f"its header field metadata is not valid: {e}") from None
        self.metadata: dict[str, Any] = metadata
        self.sowtel_version = fields["sowtel_version"]
        if not VERSION_TEXT.fullmatch(self.sowtel_version):
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

        def walk(node: Any, site: str, mode: str) -> None:
            def leaf(kind: str, body: Any, path: tuple[Any, ...]) -> None:
                if kind == "global":
                    out.append(self._global_entry(body, site, mode, path, used))
                    return
                if not isinstance(body, str) or body not in self.spans or body in used:
                    raise self._bad(f"the structure names tensor {body!r}, absent or used twice")
                used.add(body)
                _, _, dtype, shape = self.spans[body]
                axes = self.stacked.get(site, {}).get(mode, ())
                if shape[:len(axes)] != tuple(n for _, n in axes):
                    axes = ()
                out.append(DumpEntry(leaf_name(site, path), site, mode, path, shape,
                                     dtype.name, body, axes))

            try:
                rebuild(node, leaf, f"the structure of {site!r} ({mode})")
            except MalformedNode as e:
                raise self._bad(str(e)) from None

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
                    check_mode(pair[0], f"site {item[0]!r}")
                except ValueError as e:
                    raise self._bad(str(e)) from None
                if pair[0] in modes:
                    raise self._bad(f"site {item[0]!r} has the mode {pair[0]!r} twice")
                modes.add(pair[0])
                walk(pair[1], item[0], pair[0])
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
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK
                and all(type(n) is int and n >= 0 for n in shape)):
            raise self._bad(f"{where} has the shape {shape!r}")
        if not (isinstance(dtype, str) and dtype in SUPPORTED_NAMES):
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

        The data is read in file order, in chunks of at most ``CHUNK`` bytes into one reused
        buffer, so checking a file of any size holds only a chunk of it, and a mismatch is
        raised as soon as the tensor holding it has been read.
        """
        chunk = memoryview(bytearray(min(CHUNK, max(1, self.size - self.data_start))))
        with open_regular(self.path) as f:
            self._check_unchanged(f)
            f.seek(self.data_start)
            for key, (begin, end, _, _) in sorted(self.spans.items(), key=lambda kv: kv[1][0]):
                crc, left = 0, end - begin
                while left:
                    got = f.readinto(chunk[:min(left, len(chunk))])
                    if not got:
                        raise errors.BadDumpError(self.path, "changed while being read: it "
                                                  "is shorter than its header says")
                    crc = zlib.crc32(chunk[:got], crc)
                    left -= got
                if crc != self.crcs.get(key):
                    raise self._bad(f"the data of tensor {key!r} fails its checksum")

    def _check_unchanged(self, f: io.FileIO) -> None:
        st = os.fstat(f.fileno())
        if (st.st_size, st.st_mtime_ns) != self._identity:
            raise errors.BadDumpError(self.path, "changed while being read: read it again")

    def buffer(self, lazy: bool) -> np.ndarray:
        """The whole file as uint8: memory-mapped (lazy) or read into memory (writable)."""
        with open_regular(self.path) as f:
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
            raise errors.BadDumpError(self.path, f"changed while being read ({got} of {self.size})")
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
                raise errors.BadDumpError(
                    self.path, f"is one process's part of a multi-process dump: "
                    f"{entry.name!r} is a global value; read it with all the parts")
            return self.array(buf, entry.key)

        return read

    def tree(self, lazy: bool) -> Any:
        """The intermediates; with ``lazy=False`` checked against their checksums first."""
        return build_tree(self, lazy)


def build_tree(f: DumpReader, lazy: bool) -> Any:
    """The intermediates of a dump or of the parts of one; checksums first unless ``lazy``."""
    if not lazy:
        f.verify()
    read = f.reader(lazy)
    entries = {(e.site, e.mode, e.leaf): e for e in f.info().entries}

    # The same container save_intermediates returns, so the site order survives jit too.
    from sowtel.intermediates import Intermediates

    def value(name: str, mode: str, node: Any) -> Any:
        def leaf(kind: str, body: Any, path: tuple[Any, ...]) -> np.ndarray:
            return read(entries[(name, mode, path)])

        return rebuild(node, leaf, name)

    out = Intermediates()
    for name, modes in f.sites:
        site = out[name] = Intermediates((mode, value(name, mode, node)) for mode, node in modes)
        site.stacked = dict(f.stacked.get(name, {}))
    return out
