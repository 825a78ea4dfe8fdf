"""The ``jsonl`` exporter: one JSON object per record, full values in ``.npy`` sidecar files.

Each line of ``<logdir>/<filename>`` is a JSON object with the fields of
:class:`~sowtel.records.Record`: ``name``, ``mode``, ``tag``, ``step``, ``index`` (null, an
integer, or a list for nested scans), ``wall_time``, ``summary``, ``shape`` (a list), ``dtype``,
``stats`` (an object), ``histogram`` (``{"edges": [...], "counts": [...]}`` or null),
``process_index``, ``seq``, ``order``, ``scans`` (for a site inside a scan: a list of
``[entry, reverse]``, outermost first; absent otherwise) and ``value_file``. ``order`` and
``scans`` with ``index`` give the record's place in its step's execution order
(:func:`sowtel.records.order_key`); files written before they existed read back with
``order`` 0 and no ``scans``.

Only plain JSON is written (every line parses with a strict JSON parser): the non-finite floats
NaN, +inf and -inf are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, which
Python's ``float()`` reads back. A ``full`` record's value goes to a sidecar file saved with
``numpy.save(..., allow_pickle=False)`` in the folder ``<stem>_values/`` next to the JSON file;
``value_file`` holds its path relative to the JSON file's folder (null when there is no value).
Dtypes numpy cannot store without pickling (``bfloat16``, ``float8_*``) are stored as float32,
with ``value_dtype`` naming what was stored. Record names never choose paths: sidecar names are
sanitised to letters, digits, ``_ - .`` and numbered, so every file stays inside ``logdir``.

The file is opened in append mode, so runs logged to the same place accumulate. Each
``write()`` hands its lines to the operating system at once, whole or not at all: a write cut
short (a full disk) is truncated away and raised, so the lines on disk are exactly the records
counted as exported. A file deleted while the exporter runs (the logdir removed) is noticed
before the next write, warned about once, and created again. A file with more than one hard
link is refused like a symbolic link.

Symbolic links inside ``logdir`` are never followed: a ``<filename>`` or ``<stem>_values``
that is a link (planted to make the exporter write elsewhere) is refused with ``ValueError``
when the exporter is made, and files are opened with ``O_NOFOLLOW`` and sidecars created
exclusively inside the opened ``<stem>_values`` folder, so a link planted later is not followed
either (that value is not saved: its line says ``value_error``, and ``values_not_saved``
counts it). ``logdir`` itself may be a link:
it is the folder you chose.

Example:
    >>> import tempfile
    >>> import numpy as np
    >>> from sowtel.exporters.jsonl import JsonlExporter, read_records
    >>> from sowtel.records import Record
    >>> logdir = tempfile.mkdtemp()
    >>> jsonl = JsonlExporter(logdir=logdir)
    >>> jsonl.write([Record(name="h", mode="primal", tag="intermediates", step=0, index=None,
    ...                     wall_time=0.0, summary="full", shape=(2,), dtype="float32",
    ...                     value=np.array([1.0, 2.0], np.float32))])
    >>> jsonl.close()
    >>> [r.value.tolist() for r in read_records(f"{logdir}/records.jsonl")]
    [[1.0, 2.0]]
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sowtel import errors
from sowtel.exporters import check_logdir
from sowtel.records import Record
from sowtel.to_records import RecordBatch, SiteColumns

_orjson: Any
try:  # a fast encoder when installed (a dependency of sowtel); the standard one otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    _orjson = None

__all__ = ["JsonlExporter", "read_records", "record_to_json", "iter_lines", "iter_line_blocks",
           "json_float"]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Where the platform has them (POSIX): open without following a link, and open a folder only.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FD = os.open in os.supports_dir_fd
logger = logging.getLogger("sowtel")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _default_filename() -> str:
    try:
        import jax

        index, count = int(jax.process_index()), int(jax.process_count())
    except Exception:  # noqa: BLE001 - no usable JAX backend: a job of one process
        return "records.jsonl"
    return "records.jsonl" if count <= 1 else f"records_process_{index}.jsonl"


def _float(x: Any) -> float | str:
    x = float(x)
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _unfloat(x: Any) -> float:
    return _NONFINITE[x] if isinstance(x, str) else float(x)


def _index(index: Any) -> Any:
    if index is None:
        return None
    if isinstance(index, tuple):
        return [int(i) for i in index]
    return int(index)


def _safe_component(text: str, limit: int = 80) -> str:
    # One path component that cannot climb out of its folder, whatever the record name holds.
    safe = _UNSAFE.sub("_", text).lstrip(".-")[:limit]
    return safe or "value"


def record_to_json(record: Record, value_file: str | None = None) -> dict[str, Any]:
    """The JSON object written for ``record`` (plain JSON types only).

    Example:
        >>> from sowtel.records import Record
        >>> record_to_json(Record(name="h", mode="primal", tag="intermediates", step=1,
        ...                       index=(0, 2), wall_time=5.0, summary="health", shape=(3,),
        ...                       dtype="float32", stats={"nan": 1.0}))["stats"]
        {'nan': 1.0}
    """
    hist = record.histogram
    return {
        "name": str(record.name),
        "mode": str(record.mode),
        "tag": str(record.tag),
        "step": int(record.step),
        "index": _index(record.index),
        "wall_time": _float(record.wall_time),
        "summary": str(record.summary),
        "shape": [int(d) for d in record.shape],
        "dtype": str(record.dtype),
        "stats": {str(k): _float(v) for k, v in record.stats.items()},
        "histogram": None if hist is None else {
            "edges": [_float(e) for e in np.asarray(hist[0]).ravel()],
            "counts": [_float(c) for c in np.asarray(hist[1]).ravel()],
        },
        "process_index": int(record.process_index),
        "seq": int(record.seq),
        "order": int(record.order),
        **({"scans": _scans(record.scans)} if record.scans else {}),
        "value_file": value_file,
    }


def _scans(scans: Any) -> list[list[Any]]:
    return [[int(entry), bool(reverse)] for entry, reverse in scans]


def _plain_rows(table: np.ndarray) -> list[Any]:
    """``table.tolist()`` with the non-finite numbers spelt as :func:`_float` spells them."""
    rows = table.tolist()
    if np.isfinite(table).all():
        return rows  # type: ignore[no-any-return]
    bad = np.argwhere(~np.isfinite(table))
    for where in bad.tolist():
        *outer, last = where
        row = rows
        for i in outer:
            row = row[i]
        row[last] = _float(row[last])
    return rows  # type: ignore[no-any-return]


def columns_lines(columns: SiteColumns) -> str:
    """The JSON lines of a table of summaries (no full values), as :func:`record_to_json`
    writes each record, encoded with orjson when it is installed.

    Example:
        >>> from sowtel.records import HEALTH_KEYS
        >>> c = SiteColumns(names=("w",), shapes=((),), dtypes=("float32",), mode="primal",
        ...                 tag="intermediates", summary="health", step=2, wall_time=0.0,
        ...                 process_index=0, order=0, index=[None], seqs=[5],
        ...                 stat_keys=HEALTH_KEYS, stats=np.zeros((1, 1, 4)))
        >>> json.loads(columns_lines(c))["stats"]["nan"]
        0.0
    """
    keys = [str(k) for k in columns.stat_keys]
    edges = counts = None
    if columns.edges is not None and columns.counts is not None:
        edges, counts = _plain_rows(columns.edges), _plain_rows(columns.counts)
    dumps = _dumps
    # What the records of one leaf share is encoded once; per record only the index, the
    # statistics, the histogram and seq are.
    frames = []
    for leaf, name in enumerate(columns.names):
        head = dumps({"name": name, "mode": columns.mode, "tag": columns.tag,
                      "step": int(columns.step)})[:-1] + ',"index":'
        middle = "," + dumps({
            "wall_time": _float(columns.wall_time), "summary": columns.summary,
            "shape": [int(d) for d in columns.shapes[leaf]], "dtype": columns.dtypes[leaf],
        })[1:-1] + ',"stats":'
        tail = f',"process_index":{int(columns.process_index)},"seq":'
        frames.append((head, middle, tail))
    # The execution-order fields are the table's: written after seq, as record_to_json does.
    ordered = f',"order":{int(columns.order)}' + (
        f',"scans":{dumps(_scans(columns.scans))}' if columns.scans else "")
    out: list[str] = []
    if edges is None and keys:
        # No histogram: every record's statistics come from one encoding of the whole table,
        # cut into records; a line is then one string formatting.
        width = len(keys)
        table = columns.stats
        if _orjson is not None and np.isfinite(table).all():
            # orjson writes a float64 array as it writes the same floats from a list.
            body = _orjson.dumps(np.ascontiguousarray(table, dtype=np.float64).reshape(-1),
                                 option=_orjson.OPT_SERIALIZE_NUMPY).decode()[1:-1]
        else:
            body = dumps([v for row in _plain_rows(table) for leaf in row for v in leaf])[1:-1]
        numbers = body.split(",") if body else []
        shape = "{" + ",".join(dumps(k).replace("%", "%%") + ":%s" for k in keys) + "}"
        lines = [f"{head.replace('%', '%%')}%s{middle.replace('%', '%%')}{shape}"
                 f',"histogram":null{tail.replace("%", "%%")}%d{ordered},"value_file":null}}\n'
                 for head, middle, tail in frames]
        at = 0
        for index, seq in zip(columns.index, columns.seqs, strict=True):
            plain_index = str(index) if type(index) is int else dumps(_index(index))
            seq = int(seq)
            for line in lines:
                out.append(line % (plain_index, *numbers[at:at + width], seq))
                at += width
        return "".join(out)
    stats = _plain_rows(columns.stats)
    for p, (index, seq) in enumerate(zip(columns.index, columns.seqs, strict=True)):
        plain_index = dumps(_index(index))
        for leaf, (head, middle, tail) in enumerate(frames):
            hist = "null" if edges is None or counts is None else dumps(
                {"edges": edges[p][leaf], "counts": counts[p][leaf]})
            row = dumps(dict(zip(keys, stats[p][leaf], strict=True)))
            out.append(f'{head}{plain_index}{middle}{row}'
                       f',"histogram":{hist}{tail}{int(seq)}{ordered},"value_file":null}}\n')
    return "".join(out)


def _dumps(obj: Any) -> str:
    if _orjson is not None:
        return _orjson.dumps(obj).decode()  # type: ignore[no-any-return]
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


class JsonlExporter:
    """Appends one JSON line per record to ``<logdir>/<filename>``; see the module docstring.

    Args:
      logdir: the folder to write into; created if missing. A path that is a file, or that
        cannot be created or written, raises ``ValueError`` here rather than losing records later.
      filename: the JSON-lines file's name inside ``logdir`` (a bare name, no folders). By
        default ``records.jsonl``; in a job of several JAX processes (``jax.distributed``)
        ``records_process_<k>.jsonl``, one file per process, so processes sharing a ``logdir``
        never write to one file.

    Example:
        >>> import sowtel  # doctest: +SKIP
        >>> sowtel.enable(exporter="jsonl", logdir="runs/exp1")  # doctest: +SKIP
    """

    label = "jsonl"

    def __init__(self, logdir: str | os.PathLike[str] = "runs",
                 filename: str | None = None) -> None:
        if filename is None:
            filename = _default_filename()
        if not isinstance(filename, str) or not filename or filename in (".", "..") or any(
            sep and sep in filename for sep in ("/", "\\", os.sep, os.altsep)
        ):
            raise errors.BadOptionError(
                "filename", filename, "must be a bare file name such as 'records.jsonl' (no "
                "folders); put folders in logdir=", shown=repr(filename))
        if "\0" in filename or len(os.fsencode(filename)) > 240:
            raise errors.BadOptionError(
                "filename", filename, "holds a NUL character or is over 240 bytes (a file "
                "name, and its <stem>_values folder, must fit this system's 255): choose a "
                "short file name such as 'records.jsonl'",
                shown=f"{filename[:60]!r}{'...' if len(filename) > 60 else ''}")
        if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
            raise errors.BadOptionError("logdir", logdir,
                                        "must be a folder path such as 'runs/exp1'")
        check_logdir(logdir)
        self.logdir = Path(logdir)
        if self.logdir.exists() and not self.logdir.is_dir():
            raise errors.UnwritableLogdirError(
                f"logdir={os.fspath(logdir)!r}", "is a file, not a folder: pass a folder path "
                "(it is created if missing)")
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise errors.UnwritableLogdirError(
                f"logdir={os.fspath(logdir)!r}", f"cannot be created ({e.strerror or e}): pass "
                "a folder path you can write to") from e
        self.path = self.logdir / filename
        self._filename = filename
        self._values_name = f"{Path(filename).stem or 'records'}_values"
        self._values_dir = self.logdir / self._values_name
        self._values_fd: int | None = None
        self._next_value: int | None = None
        #: Full values whose sidecar could not be saved (their lines say ``value_error``).
        self.values_not_saved = 0
        #: How often the logdir was found deleted while writing, and re-created.
        self.recreated = 0
        self._warned: set[str] = set()
        for planted in (self.path, self._values_dir):
            if planted.is_symlink():
                raise _link_refused(logdir, planted.name)
        self._fd = _open_records_file(self.logdir, filename)
        # Where the file ends once every line written is whole; None when it is.
        self._cut_at: int | None = None

    def _open_values_dir(self) -> int | None:
        """The sidecar folder, created if missing and opened without following a link."""
        self._values_dir.mkdir(exist_ok=True)
        if not _DIR_FD:  # no dir_fd here (Windows): check the folder by name instead
            if self._values_dir.is_symlink():
                raise OSError(errno.ELOOP, "a symbolic link, not followed", str(self._values_dir))
            return None
        return os.open(self._values_dir, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)

    def _save_value(self, record: Record) -> tuple[str | None, dict[str, Any]]:
        value = np.asarray(record.value)
        extra: dict[str, Any] = {}
        if value.dtype.isbuiltin == 2 or value.dtype.kind == "V":
            # Extension dtypes (bfloat16, float8) would be saved as raw void bytes.
            value = value.astype(np.float32)
            extra["value_dtype"] = "float32"
        if self._next_value is None:
            self._values_fd = self._open_values_dir()
            listed = self._values_fd if self._values_fd is not None else self._values_dir
            self._next_value = len(os.listdir(listed))
        stem = f"s{int(record.step)}-{_safe_component(record.name)}-{_safe_component(record.mode)}"
        where = {} if self._values_fd is None else {"dir_fd": self._values_fd}
        while True:
            name = f"{self._next_value:09d}-{stem}.npy"
            target: Any = name if self._values_fd is not None else self._values_dir / name
            self._next_value += 1
            try:
                # Exclusive creation: an earlier run's sidecar in the same folder is never
                # replaced, and a link in its place is never followed.
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666,
                             **where)
            except FileExistsError:
                continue
            try:
                with os.fdopen(fd, "wb") as f:
                    np.save(f, value, allow_pickle=False)
                break
            except ValueError as e:  # object arrays cannot be saved without pickle
                os.unlink(target, **where)
                return None, {"value_error": f"not saved: {e}"}
        return f"{self._values_name}/{name}", extra

    def write_batch(self, batch: RecordBatch) -> None:
        """Writes a batch: its columnar parts encoded table by table (see
        :func:`columns_lines`), other records as :meth:`write` does, in the batch's order."""
        self._check_still_there()
        text: list[str] = []
        for part in batch.parts:
            if isinstance(part, SiteColumns) and part.values is None:
                text.append(columns_lines(part))
            else:
                if text:
                    self._append("".join(text))
                    text = []
                self.write(part.records() if isinstance(part, SiteColumns) else part)
        if text:
            self._append("".join(text))

    def write(self, records: Sequence[Record]) -> None:
        self._check_still_there()
        lines = []
        for record in records:
            value_file: str | None = None
            extra: dict[str, Any] = {}
            if record.value is not None:
                try:
                    value_file, extra = self._save_value(record)
                except OSError as e:
                    # The line is still written, saying what was lost: the record is exported,
                    # its value is not (counted in values_not_saved, warned about once).
                    extra = {"value_error": f"not saved: {e}"}
                    self.values_not_saved += 1
                    self._warn_once("value", "sowtel jsonl: the value of %r (%s, step %s) could "
                                    "not be saved to a sidecar file (%s); its line says "
                                    "value_error, and later such values are only counted in "
                                    "values_not_saved", record.name, record.mode, record.step, e)
            obj = record_to_json(record, value_file)
            obj.update(extra)
            lines.append(_dumps(obj))
        if lines:
            self._append("\n".join(lines) + "\n")

    # -- the file layer: whole lines or nothing, a deleted logdir noticed, links never followed

    def _append(self, text: str) -> None:
        """Appends ``text`` (whole lines) to the file, all of it or none of it.

        A write cut short (a full disk, a file size limit) is undone by truncating the file back
        to where it ended, and the error raised, so the lines on disk are exactly those of the
        writes that succeeded. If even the truncation fails, it is tried again before the next
        write and on close.
        """
        if self._cut_at is not None:
            os.ftruncate(self._fd, self._cut_at)
            self._cut_at = None
        data = memoryview(text.encode("utf-8"))
        start = os.fstat(self._fd).st_size
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError:
            if written:
                try:
                    os.ftruncate(self._fd, start)
                except OSError:
                    self._cut_at = start
            raise

    def _check_still_there(self) -> None:
        """Re-creates the file (and logdir) if they were deleted while the exporter ran.

        A deleted file has no links left: writing on into it would count records as exported
        that no one can ever read. One ``fstat`` per write notices it.
        """
        if self._values_fd is not None and os.fstat(self._values_fd).st_nlink == 0:
            # The sidecar folder was deleted: made again (or found missing) at the next value.
            self._close_values_dir()
            self._next_value = None
        if os.fstat(self._fd).st_nlink != 0:
            return
        self._warn_once("deleted", "sowtel jsonl: %s was deleted while records were written to "
                        "it; re-creating it (and its folder), records from now on go there",
                        self.path)
        self.recreated += 1
        self._close_values_dir()
        self._next_value = None
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            fd = _open_records_file(self.logdir, self._filename)
        except (OSError, ValueError) as e:
            raise OSError(f"{self.path} was deleted and cannot be created again: {e}") from e
        os.close(self._fd)
        self._fd, self._cut_at = fd, None

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def _close_values_dir(self) -> None:
        if self._values_fd is not None:
            fd, self._values_fd = self._values_fd, None
            os.close(fd)

    def flush(self) -> None:
        """Nothing to do: every ``write`` hands its lines to the operating system at once."""

    def close(self) -> None:
        self._close_values_dir()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                if self._cut_at is not None:
                    os.ftruncate(fd, self._cut_at)
            finally:
                os.close(fd)


def _open_records_file(logdir: Path, filename: str) -> int:
    """Opens ``logdir/filename`` for appending; refuses a link, a non-file, a file of two names.

    Opened without following a link and without blocking (a FIFO planted under the name is
    refused, not waited on). A file with more than one hard link is refused as a symbolic link
    is: the other name may be anywhere, outside the logdir. A cut last line left by a process
    that died while writing is removed (with a warning), so the next line starts on a line of
    its own.
    """
    path = logdir / filename
    # Read and write: a cut last line is looked for (pread) before appending.
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted since the check above
            raise _link_refused(logdir, filename) from e
        if e.errno == errno.ENAMETOOLONG:
            raise errors.UnwritableLogdirError(
                f"logdir={os.fspath(logdir)!r} with filename={filename!r}", "is longer than "
                "this system allows a path or a file name to be: choose a shorter logdir or "
                "filename=") from e
        raise errors.UnwritableLogdirError(
            f"logdir={os.fspath(logdir)!r}:", f"cannot write {filename!r} there "
            f"({e.strerror or e}): pass a folder you can write to") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise errors.UnwritableLogdirError(
                f"logdir={os.fspath(logdir)!r}:", f"{filename!r} there is not a regular file (a "
                "FIFO, a device?), and the jsonl exporter appends only to regular files: remove "
                "it, or choose another logdir or filename=")
        if st.st_nlink > 1:
            raise errors.UnwritableLogdirError(
                f"logdir={os.fspath(logdir)!r}:", f"{filename!r} there has {st.st_nlink} hard "
                "links, and the jsonl exporter never writes to a file that is also known by "
                "another name (it may be outside the logdir): remove that file, or choose "
                "another logdir or filename=")
        _remove_cut_last_line(fd, path, st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_cut_last_line(fd: int, path: Path, size: int) -> None:
    if size == 0:
        return
    # Read backwards in blocks until the last newline: lines are short, one block is typical.
    end = size
    while end > 0:
        start = max(0, end - 65536)
        block = os.pread(fd, end - start, start)
        if end == size and block.endswith(b"\n"):
            return
        at = block.rfind(b"\n")
        if at >= 0:
            keep = start + at + 1
            break
        end = start
    else:
        keep = 0
    os.ftruncate(fd, keep)
    logger.warning("sowtel jsonl: %s ended in a cut line (%d bytes, left by a write that did not "
                   "finish); removed it before appending", path, size - keep)


def _link_refused(logdir: str | os.PathLike[str], name: str) -> errors.UnwritableLogdirError:
    return errors.UnwritableLogdirError(
        f"logdir={os.fspath(logdir)!r}:", f"{name!r} there is a symbolic link, and the jsonl "
        "exporter never follows links out of its logdir: remove the link, or choose another "
        "logdir")


def read_records(path: str | os.PathLike[str], *, load_values: bool = True) -> list[Record]:
    """Reads a file written by :class:`JsonlExporter` back into records.

    Sidecar values are loaded with ``allow_pickle=False`` and only from inside the JSON file's
    folder, and only from regular files whose ``.npy`` header matches their size; anything
    else (a ``value_file`` pointing elsewhere, a FIFO, a header claiming more data than the
    file holds) raises ``ValueError`` naming the file and the rule. A last line cut short (a
    write that did not finish) is left out with a warning naming the file and line; a bad line
    elsewhere raises ``ValueError`` naming its line number.

    Example:
        >>> read_records("runs/records.jsonl")  # doctest: +SKIP
        [Record(name='h', mode='primal', ...), ...]
    """
    path = Path(path)
    base = path.parent.resolve()
    out: list[Record] = []
    for number, raw in iter_lines(path, stacklevel=3):
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise bad_line(path, number, e) from None
        value = None
        if load_values and obj.get("value_file"):
            file = (base / obj["value_file"]).resolve()
            if base not in file.parents:
                raise errors.BadRecordsFileError(
                    f"{path}:{number}:", f"value_file={obj['value_file']!r} points outside "
                    f"{base}; refusing to read it")
            value = _load_sidecar(file, f"{path}:{number}")
            if obj.get("value_dtype") and obj["value_dtype"] != obj["dtype"]:
                try:
                    value = value.astype(np.dtype(obj["dtype"]))
                except TypeError:
                    pass  # the dtype's package is not imported; keep what was stored
        index = obj["index"]
        hist = obj.get("histogram")
        out.append(Record(
            name=obj["name"], mode=obj["mode"], tag=obj["tag"], step=obj["step"],
            index=tuple(index) if isinstance(index, list) else index,
            wall_time=_unfloat(obj["wall_time"]), summary=obj["summary"],
            shape=tuple(obj["shape"]), dtype=obj["dtype"], value=value,
            stats={k: _unfloat(v) for k, v in obj["stats"].items()},
            histogram=None if hist is None else (
                np.array([_unfloat(e) for e in hist["edges"]]),
                np.array([_unfloat(c) for c in hist["counts"]]),
            ),
            process_index=obj.get("process_index", 0), seq=obj.get("seq", 0),
            order=obj.get("order", 0),
            scans=tuple((int(e), bool(r)) for e, r in obj.get("scans", ())),
        ))
    return out


def iter_lines(path: str | os.PathLike[str], *,
               stacklevel: int = 2) -> Iterator[tuple[int, bytes]]:
    """The non-empty lines of a file :class:`JsonlExporter` wrote, with their line numbers, read
    a block at a time, as :func:`read_records` reads them: from a regular file only; a last
    line cut short (no newline, not JSON: a write that did not finish) is left out with a
    warning naming the file and the line.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write(b'{"a": 1}\\n\\n{"a": 2}\\n')
        >>> [n for n, _ in iter_lines(f.name)]
        [1, 3]
    """
    for first, lines in iter_line_blocks(path, stacklevel=stacklevel + 1):
        for number, line in enumerate(lines, first):
            if line.strip():
                yield number, line


def iter_line_blocks(path: str | os.PathLike[str], *, size: int = 1 << 22,
                     stacklevel: int = 2) -> Iterator[tuple[int, list[bytes]]]:
    """The lines of a file :class:`JsonlExporter` wrote, about ``size`` bytes of them at a time:
    ``(number of the first, lines)``, each line without its newline (empty lines included, so
    numbers count on). The rules of :func:`iter_lines`: a regular file only; a last line cut
    short is left out with a warning.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write(b'{"a": 1}\\n{"a": 2}\\n{"a"')
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     blocks = list(iter_line_blocks(f.name))
        >>> blocks, "line 3, the last, is cut short" in str(caught[0].message)
        ([(1, [b'{"a": 1}', b'{"a": 2}'])], True)
    """
    path = Path(path)
    number = 1
    with _open_regular(path, "a jsonl file") as f:
        rest = b""
        while True:
            data = f.read(size)
            if not data:
                break
            data = rest + data
            end = data.rfind(b"\n")
            if end < 0:
                rest = data
                continue
            lines = data[:end].split(b"\n")
            rest = data[end + 1:]
            yield number, lines
            number += len(lines)
    if rest.strip():
        try:
            json.loads(rest)
        except ValueError:
            warnings.warn(
                f"{path}: line {number}, the last, is cut short (a write that did not finish); "
                f"read the {number - 1} lines before it", stacklevel=stacklevel)
            return
        yield number, [rest]


def bad_line(path: str | os.PathLike[str], number: int,
             error: Exception) -> errors.BadRecordsFileError:
    """The error for a line of a jsonl file that is not a record's JSON object."""
    where = (f" ({error.msg}, column {error.colno})"
             if isinstance(error, json.JSONDecodeError) else f" ({error})")
    return errors.BadRecordsFileError(
        f"{path}:", f"line {number} is not a JSON object{where}: this is not a file the jsonl "
        "exporter wrote whole")


def json_float(x: Any) -> float:
    """A number as the exporter writes it, NaN and infinities as strings, back to a float.

    Example:
        >>> json_float("-Infinity"), json_float(2)
        (-inf, 2.0)
    """
    return _NONFINITE[x] if isinstance(x, str) else float(x)


def _open_regular(path: Path, what: str) -> Any:
    """``path`` opened for reading in binary, refusing (without blocking) all but a regular file."""
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise errors.BadRecordsFileError(
                repr(str(path)), "is not a regular file (a FIFO, a device or a folder?): "
                f"{what} is read only from a regular file, as a pipe or a device could block "
                "forever; copy it to a file first")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _load_sidecar(file: Path, where: str) -> np.ndarray:
    """A sidecar ``.npy``, checked before anything is allocated: header and size must agree."""
    try:
        f = _open_regular(file, "a sidecar value")
    except ValueError as e:
        raise errors.prefixed(e, where) from None
    with f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version} is not one numpy.save writes "
                                 "for these values")
        except ValueError as e:
            raise errors.BadRecordsFileError(
                f"{where}:", f"the sidecar {str(file)!r} is not a valid .npy file ({e})") from None
        if dtype.hasobject:
            raise errors.BadRecordsFileError(
                f"{where}:", f"the sidecar {str(file)!r} holds Python objects, which are never "
                "unpickled")
        need = math.prod(shape) * dtype.itemsize
        have = os.fstat(f.fileno()).st_size - f.tell()
        if need != have:
            raise errors.BadRecordsFileError(
                f"{where}:", f"the sidecar {str(file)!r} claims a {dtype} array of shape "
                f"{shape} ({need} bytes) but holds {have} bytes of data: it is truncated or "
                "crafted, and is not read")
        f.seek(0)
        return np.load(f, allow_pickle=False)
