"""Reading runs for :mod:`sowtel.compare`: the folders the jsonl and TensorBoard exporters write,
a step at a time, never a run whole.

A run is read as *sources*, one jsonl file or one TensorBoard event file each, grouped by the
JAX process that wrote them. A source yields its records a step at a time, in *blocks*: the
records read together (a jsonl line; a depth tensor, one site and mode at every position; one
series' scalars), with the bytes they came from where there are some, so two runs written alike
are compared byte for byte and decoded only where they differ. The sources of a run are merged
by step; a step is handed on once every source has read :data:`WINDOW` later steps (records of
one step may trail a few steps behind in a file) or has ended.

jsonl files are read with :func:`sowtel.exporters.jsonl.iter_line_blocks` (the rules of
``read_records``: a last line cut short is left out with a warning); event files record by
record (:func:`event_records`, checked as TensorBoard's loader checks them) into TensorBoard's
own ``Event`` message. Only event files sowtel wrote are read (their names end in ``.sowtel``).

Example:
    >>> import tempfile
    >>> from sowtel.exporters.jsonl import JsonlExporter
    >>> from sowtel.records import Record
    >>> logdir = tempfile.mkdtemp()
    >>> jsonl = JsonlExporter(logdir=logdir)
    >>> jsonl.write([Record(name="h", mode="primal", tag="intermediates", step=s, index=None,
    ...                     wall_time=0.0, summary="health", shape=(2,), dtype="float32",
    ...                     stats={"size": 2.0, "nan": 0.0, "posinf": 0.0, "neginf": 0.0})
    ...              for s in (0, 1)])
    >>> jsonl.close()
    >>> run = open_run(logdir, "run")
    >>> run.kind, [step.step for step in run_steps(run.processes[None])]
    ('jsonl', [0, 1])
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from sowtel import errors
from sowtel.exporters.jsonl import bad_line, iter_line_blocks, json_float
from sowtel.records import Index, nonfinite_count, order_key

__all__ = ["Entry", "Block", "StepData", "Run", "open_run", "run_steps", "entries",
           "event_records", "WINDOW"]

#: How many later steps every source of a run must have read before a step is compared.
WINDOW = 8
#: The order key of records whose place is not known (files written before keys existed put
#: their sites here, by name) and of ``sowtel.log`` scalars (after the step's sites).
UNKNOWN_ORDER = (sys.maxsize - 1,)
LOG_ORDER = (sys.maxsize,)
#: The statistic every record gets for comparison: its count of NaN and infinite elements.
NONFINITE = "nonfinite"

Key = tuple[str, str, Index]  # (name, mode, index): one record of a step


class Entry(NamedTuple):
    """One record as compared: its statistics, its place in its step, its process."""

    stats: dict[str, float]
    order: tuple[int, ...]
    process_index: int


#: Records read together: ``(raw, count, data, decode)``. ``raw``: the bytes they came from
#: (None: compare them decoded); ``count``: how many records; ``decode(data)`` gives them
#: (``decode`` None: ``data`` is the records). A plain tuple, as a jsonl run makes one a line.
Block = tuple[bytes | None, int, Any, Callable[[Any], dict[Key, Entry]] | None]


def entries(block: Block) -> dict[Key, Entry]:
    """The records of ``block``, decoded."""
    _, _, data, decode = block
    return data if decode is None else decode(data)  # type: ignore[no-any-return]


class StepData:
    """One step of a run: its blocks; TensorBoard's also the counts of its non-finite records
    (``nonfinite``) and the blocks of scalars that take them (``counted``)."""

    __slots__ = ("step", "blocks", "nonfinite", "counted")

    def __init__(self, step: int) -> None:
        self.step = step
        self.blocks: dict[tuple[Any, ...], Block] = {}
        self.nonfinite: dict[Key, float] = {}
        self.counted: list[tuple[Any, ...]] = []

    def merge(self, other: StepData) -> None:
        self.blocks.update(other.blocks)  # a step written again: its latest version
        self.nonfinite.update(other.nonfinite)
        self.counted += other.counted

    def finish(self) -> StepData:
        for key in self.counted:
            block = self.blocks.get(key)
            if block is not None:
                for record, entry in entries(block).items():
                    entry.stats[NONFINITE] = self.nonfinite.get(record, 0.0)
        return self

    def records(self) -> dict[Key, Entry]:
        """Every record of the step, decoded."""
        out: dict[Key, Entry] = {}
        for block in self.blocks.values():
            for key, entry in entries(block).items():
                known = out.get(key)
                out[key] = entry if known is None else known._replace(
                    stats={**known.stats, **entry.stats})
        return out


def _with_nonfinite(stats: dict[str, float]) -> dict[str, float]:
    if "nan" in stats:
        stats[NONFINITE] = float(nonfinite_count(stats))
    return stats


def _index(value: Any) -> Index:
    return tuple(int(i) for i in value) if isinstance(value, list) else value


# ----------------------------------------------------------------------------- jsonl


class JsonlSource:
    """The records of one jsonl file, a step at a time."""

    kind = "jsonl"

    def __init__(self, path: Path, process: int | None) -> None:
        self.path = path
        self.process = process

    def __repr__(self) -> str:
        return str(self.path)

    def chunks(self) -> Iterator[StepData]:
        """The file's records, one :class:`StepData` per stretch of lines of one step."""
        names: dict[tuple[bytes, bytes], Key] = {}
        part: StepData | None = None
        blocks: dict[tuple[Any, ...], Block] = {}
        step_text = b""
        decode = self._decode
        # The first stretch of each recent step, which gathers the step's records (run_steps
        # merges later stretches into it): a step met again must bring records it lacks.
        earlier: collections.OrderedDict[int, StepData] = collections.OrderedDict()
        number = start = 0

        def done(part: StepData) -> StepData:
            first = earlier.get(part.step)
            if first is None:
                earlier[part.step] = part
                if len(earlier) > 2 * WINDOW:
                    earlier.popitem(last=False)
            elif not first.blocks.keys().isdisjoint(part.blocks):
                raise errors.BadRunError(
                    f"{self.path}:", f"step {part.step} comes again at line {start}, with records "
                    "it already had: the file holds two runs one after the other (the jsonl "
                    "exporter appends to a logdir used again); compare runs written to folders "
                    "of their own")
            return part

        for first, lines in iter_line_blocks(self.path, stacklevel=4):
            for number, line in enumerate(lines, first):
                # A line as the exporter writes it: the key and step, wall_time, ..., the
                # statistics, the histogram, the rest. Cut there, no number parsed.
                s = line.find(b',"step":')
                i = line.find(b',"index":', s)
                w = line.find(b',"wall_time":', i)
                t = line.find(b',"stats":', w)
                h = line.find(b',"histogram":', t)
                if 0 < s < i < w < t < h:
                    head = (line[:s], line[i + 9:w])
                    key = names.get(head)
                    if key is None:
                        key = names[head] = self._key(number, *head)
                    if line[s + 8:i] != step_text or part is None:
                        step_text = line[s + 8:i]
                        step = self._step(number, step_text)
                        if part is None or step != part.step:
                            if part is not None:
                                yield done(part)
                            part, start = StepData(step), number
                            blocks = part.blocks
                    blocks[key] = (line[t + 9:h], 1, (number, line), decode)
                    continue
                if not line.strip():
                    continue
                step, key = self._parsed(number, line)
                step_text = b""
                if part is None or step != part.step:
                    if part is not None:
                        yield done(part)
                    part, start = StepData(step), number
                    blocks = part.blocks
                blocks[key] = (None, 1, (number, line), decode)
        if part is not None:
            yield done(part)

    def _step(self, number: int, text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise bad_line(self.path, number, ValueError("step is not an integer")) from None

    def _key(self, number: int, head: bytes, index: bytes) -> Key:
        try:
            obj = orjson.loads(head + b"}")
            return (str(obj["name"]), str(obj["mode"]), _index(orjson.loads(index)))
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise bad_line(self.path, number, e) from None

    def _parsed(self, number: int, line: bytes) -> tuple[int, Key]:
        """A line in another layout than the exporter's own: parsed whole."""
        try:
            obj = orjson.loads(line)
            return int(obj["step"]), (str(obj["name"]), str(obj["mode"]), _index(obj["index"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise bad_line(self.path, number, e) from None

    def _decode(self, data: tuple[int, bytes]) -> dict[Key, Entry]:
        number, line = data
        try:
            obj = orjson.loads(line)
            index = _index(obj["index"])
            key = (str(obj["name"]), str(obj["mode"]), index)
            stats = _with_nonfinite({str(k): json_float(v) for k, v in obj["stats"].items()})
            if obj.get("tag") == "log":
                order: tuple[int, ...] = LOG_ORDER
            elif "order" in obj:
                order = order_key(obj["order"], obj.get("scans", ()), index)
            else:  # written before the order was: arrival order
                order = (int(obj.get("seq", 0)),)
            process = int(obj.get("process_index", 0))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise bad_line(self.path, number, e) from None
        return {key: Entry(stats, order, process)}


# ----------------------------------------------------------------------------- TensorBoard

# A scalar tag of a site: {name}/{mode}/{stat} or {name}[i,j]/{mode}/{stat}.
_SITE_TAG = re.compile(r"^(?P<name>[^\[\]]+?)(?:\[(?P<index>[0-9]+(?:,[0-9]+)*)\])?"
                       r"/(?P<mode>(?:primal|tangent|cotangent)(?:\.(?:primal|tangent|cotangent))*)"
                       r"/(?P<stat>[a-z_0-9]+)$")


class _Shared:
    """What the event files of one process share: each tag's metadata (written once per tag
    and file, so a later file may hold none) and the order of the series written as scalars."""

    def __init__(self) -> None:
        self.meta: dict[str, dict[str, Any]] = {}
        self.orders: dict[tuple[str, str], tuple[int, tuple[tuple[int, bool], ...]]] = {}


class TensorBoardSource:
    """The records of one event file the TensorBoard exporter wrote, a step at a time."""

    kind = "tensorboard"

    def __init__(self, path: Path, process: int | None, shared: _Shared) -> None:
        self.path = path
        self.process = process
        self.shared = shared
        self._process_index = process or 0

    def __repr__(self) -> str:
        return str(self.path)

    def chunks(self) -> Iterator[StepData]:
        """The file's events that hold records, one :class:`StepData` each."""
        from tensorboard.compat.proto.event_pb2 import Event

        for raw in event_records(self.path):
            event = Event.FromString(raw)
            if event.HasField("summary"):
                part = self._event(event)
                if part is not None:
                    yield part

    def _event(self, event: Any) -> StepData | None:
        from sowtel.exporters.tensorboard import LAYOUT_TAG, ORDER_TAG
        from sowtel.tensorboard_plugin import DEPTH_SUFFIX, NONFINITE_TAG, PLUGIN_NAME

        shared = self.shared
        part = StepData(int(event.step))
        plain: dict[Key, dict[str, float]] = {}
        logged: dict[Key, dict[str, float]] = {}
        depth: set[tuple[str, str]] = set()
        for v in event.summary.value:
            tag = v.tag
            if v.HasField("metadata") and v.metadata.plugin_data.plugin_name == PLUGIN_NAME:
                try:
                    shared.meta[tag] = json.loads(v.metadata.plugin_data.content)
                except ValueError:
                    pass
            kind = v.WhichOneof("value")
            if kind == "simple_value":
                m = _SITE_TAG.match(tag)
                if m is None:
                    if tag != LAYOUT_TAG:  # sowtel.log
                        logged[(tag, "primal", None)] = {"value": float(v.simple_value)}
                    continue
                raw_index = m.group("index")
                index: Index = None if raw_index is None else _index(
                    [int(i) for i in raw_index.split(",")])
                if isinstance(index, tuple) and len(index) == 1:
                    index = index[0]
                plain.setdefault((m.group("name"), m.group("mode"), index), {})[
                    m.group("stat")] = float(v.simple_value)
            elif kind == "tensor":
                if tag == ORDER_TAG:
                    for name, mode, order, scans in _json_rows(v):
                        shared.orders[(name, mode)] = (
                            int(order), tuple((int(e), bool(r)) for e, r in scans))
                elif tag == NONFINITE_TAG:
                    for name, mode, index, count in _json_rows(v):
                        part.nonfinite[(name, mode, _index(index))] = float(count)
                elif tag.endswith(DEPTH_SUFFIX) and "index_rank" in shared.meta.get(tag, {}):
                    name, mode = tag[:-len(DEPTH_SUFFIX)].rsplit("/", 1)
                    depth.add((name, mode))
                    dims = tuple(d.size for d in v.tensor.tensor_shape.dim)
                    content = bytes(v.tensor.tensor_content)
                    part.blocks[(name, mode, DEPTH_SUFFIX, self._process_index)] = (
                        content, dims[-1] if dims else 0,
                        (name, mode, dims, content, shared.meta[tag]), self._depth)
        for key, stats in plain.items():
            if key[2] is None and key[:2] in depth:
                continue  # the headline l2 of a depth tensor: a function of its rows
            order = shared.orders.get(key[:2])
            entry = Entry(stats, UNKNOWN_ORDER if order is None else order_key(
                order[0], order[1], key[2]), self._process_index)
            part.blocks[key] = (None, 1, {key: entry}, None)
            part.counted.append(key)
        for key, stats in logged.items():
            part.blocks[key] = (None, 1, {key: Entry(stats, LOG_ORDER, self._process_index)}, None)
        return part if part.blocks or part.nonfinite else None

    def _depth(self, data: tuple[Any, ...]) -> dict[Key, Entry]:
        name, mode, dims, content, meta = data
        rank = int(meta["index_rank"])
        stats = list(meta["stats"])
        table = np.frombuffer(content, dtype="<f4").reshape(dims).astype(np.float64)
        order, scans = int(meta.get("order", UNKNOWN_ORDER[0])), meta.get("scans", ())
        out: dict[Key, Entry] = {}
        for column in table.T.tolist():
            parts = tuple(int(i) for i in column[:rank])
            index: Index = parts[0] if rank == 1 else parts
            row = _with_nonfinite(dict(zip(stats, column[rank:], strict=True)))
            out[(name, mode, index)] = Entry(row, order_key(order, scans, index),
                                            self._process_index)
        return out


def event_records(path: Path) -> Iterator[bytes]:
    """The serialized events of an event file, checked as TensorBoard's loader checks them (a
    TFRecord: length, its masked CRC-32C, the event, its masked CRC-32C). Reading stops at a
    record cut short or damaged, with a warning naming the file and the bytes left unread.

    TensorBoard's ``RawEventFileLoader`` computes the checksums in pure Python where TensorFlow
    is not installed (about 5.8 s for the 53 MB of a 48 x 8 site run of 1,000 steps, against
    0.05 s here with the ``crc32c`` package tensorboardX writes with); it is used where that
    package is missing.
    """
    size = os.path.getsize(path)
    read = 0
    try:
        from crc32c import crc32c
    except ImportError:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

        for raw in RawEventFileLoader(str(path)).Load():
            read += len(raw) + 16
            yield raw
    else:
        def masked(data: bytes) -> int:
            crc = crc32c(data)
            return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

        with open(path, "rb") as f:
            while True:
                header = f.read(12)
                if len(header) < 12:
                    break
                (length,), (header_crc,) = struct.unpack("<Q", header[:8]), struct.unpack(
                    "<I", header[8:])
                if masked(header[:8]) != header_crc or length > size - read - 16:
                    break
                body = f.read(length + 4)
                if len(body) < length + 4 or masked(body[:length]) != struct.unpack(
                        "<I", body[length:])[0]:
                    break
                read += length + 16
                yield body[:length]
    if read < size:
        warnings.warn(f"{path}: the last {size - read} bytes are not a whole event (a write "
                      "that did not finish, or a damaged file); read the events before them",
                      stacklevel=5)


def _json_rows(value: Any) -> list[Any]:
    try:
        rows = json.loads(value.tensor.string_val[0])
    except (IndexError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


# ----------------------------------------------------------------------------- runs

_PROCESS_FILE = re.compile(r"^records_process_([0-9]+)\.jsonl$")
_PROCESS_DIR = re.compile(r"^process_([0-9]+)$")
Source = JsonlSource | TensorBoardSource


@dataclasses.dataclass
class Run:
    """A run to compare: its kind and its sources, by process (``None``: a run of one process
    whose files do not say which)."""

    path: Path
    kind: str
    processes: dict[int | None, list[Source]]


def _event_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(sowtel's event files, other tools' event files) directly in ``folder``."""
    files = sorted(p for p in folder.iterdir() if "tfevents" in p.name and p.is_file())
    return ([p for p in files if p.name.endswith(".sowtel")],
            [p for p in files if not p.name.endswith(".sowtel")])


def open_run(path: str | os.PathLike[str], what: str) -> Run:
    """The run written in ``path``: a folder the jsonl or TensorBoard exporter wrote (or a
    folder of ``process_<k>`` runs), or one jsonl or event file. A folder holding both kinds is
    read from its jsonl files (exact numbers; TensorBoard keeps float32). Raises
    ``FileNotFoundError`` or ``ValueError`` naming the path, what it holds and what to give."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist: give the folder a jsonl or "
                                "tensorboard exporter wrote (its logdir)")
    if p.is_file():
        if p.name.endswith(".jsonl"):
            return Run(p, "jsonl", {_jsonl_process(p): [JsonlSource(p, _jsonl_process(p))]})
        if "tfevents" in p.name:
            if not p.name.endswith(".sowtel"):
                raise _foreign(what, p)
            return Run(p, "tensorboard", {None: [TensorBoardSource(p, None, _Shared())]})
        raise errors.BadRunError(f"{what} {str(p)!r}", "is neither a folder nor a jsonl or "
                                 "TensorBoard event file: give the folder a jsonl or "
                                 "tensorboard exporter wrote")
    jsonl = sorted(c for c in p.iterdir() if c.name.endswith(".jsonl") and c.is_file())
    if jsonl:
        processes: dict[int | None, list[Source]] = {}
        for f in jsonl:
            processes.setdefault(_jsonl_process(f), []).append(JsonlSource(f, _jsonl_process(f)))
        return Run(p, "jsonl", processes)
    ours, foreign = _event_files(p)
    if ours:
        m = _PROCESS_DIR.match(p.name)  # one process's run of a job of several
        k = int(m.group(1)) if m else None
        shared = _Shared()
        return Run(p, "tensorboard", {k: [TensorBoardSource(f, k, shared) for f in ours]})
    runs: dict[int | None, list[Source]] = {}
    for child in sorted(c for c in p.iterdir() if c.is_dir()):
        m = _PROCESS_DIR.match(child.name)
        if m is None:
            continue
        found, _ = _event_files(child)
        if found:
            k = int(m.group(1))
            shared = _Shared()
            runs[k] = [TensorBoardSource(f, k, shared) for f in found]
    if runs:
        return Run(p, "tensorboard", runs)
    if foreign:
        raise _foreign(what, p)
    folders = sorted(c.name for c in p.iterdir() if c.is_dir())
    hint = (f" (its folders: {', '.join(folders[:5])}{', ...' if len(folders) > 5 else ''}: "
            "give one of them)") if folders else ""
    raise errors.BadRunError(f"{what} {str(p)!r}", "holds no run: no .jsonl file and no "
                             f"TensorBoard event file sowtel wrote{hint}")


def _jsonl_process(path: Path) -> int | None:
    m = _PROCESS_FILE.match(path.name)
    return int(m.group(1)) if m else None


def _foreign(what: str, p: Path) -> errors.BadRunError:
    return errors.BadRunError(
        f"{what} {str(p)!r}", "holds TensorBoard event files, none written by sowtel (sowtel's "
        "end in .sowtel): it is another tool's run, which holds no sowtel records to compare")


# ----------------------------------------------------------------------------- steps


def run_steps(sources: Sequence[Source], window: int = WINDOW) -> Iterator[StepData]:
    """The steps of ``sources`` merged, in increasing order, each whole.

    A step is handed on once every source has read ``window`` later steps, or has ended. A
    source whose steps go back further than that (a file holding two runs one after the
    other) raises ``ValueError`` naming it.
    """
    streams = [iter(s.chunks()) for s in sources]
    heads: list[StepData | None] = [next(it, None) for it in streams]
    recent: list[collections.deque[int]] = [collections.deque(maxlen=window) for _ in sources]
    pending: dict[int, StepData] = {}
    done = -math.inf
    while True:
        live = [k for k, h in enumerate(heads) if h is not None]
        if not live:
            break
        k = min(live, key=lambda j: heads[j].step)  # type: ignore[union-attr]
        part = heads[k]
        assert part is not None
        if part.step <= done:
            raise errors.BadRunError(
                f"{sources[k]}:", f"its steps go back to {part.step} after step "
                f"{max(recent[k])}, more than {window} steps: the file holds two runs one "
                "after the other (an exporter appends to a logdir used again); compare runs "
                "written to folders of their own")
        known = pending.get(part.step)
        if known is None:
            pending[part.step] = part
        else:
            known.merge(part)
        if part.step not in recent[k]:
            recent[k].append(part.step)
        heads[k] = next(streams[k], None)
        while pending:
            first = min(pending)
            if not all(heads[j] is None or (len(recent[j]) == window and min(recent[j]) > first)
                       for j in range(len(sources))):
                break
            done = first
            yield pending.pop(first).finish()
    for step in sorted(pending):
        yield pending[step].finish()
