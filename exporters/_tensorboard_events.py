"""The TensorBoard exporter's event files: TFRecord framing and the file itself.

An event file is a sequence of TFRecord frames (length, its masked CRC-32C, the data, its
masked CRC-32C), each holding one serialized ``Event``. The exporter writes the file itself,
synchronously, and builds the bytes of its hottest events (one scalar per statistic) by hand
instead of through protobuf objects: :func:`value_head` and :func:`event_bytes` follow the wire
format of ``Summary.Value`` and ``Event``.

Example:
    >>> import tempfile
    >>> from tensorboardX.proto.event_pb2 import Event
    >>> with tempfile.TemporaryDirectory() as run_dir:
    ...     f = EventFile(run_dir)
    ...     f.add(Event(step=3, wall_time=0.0))
    ...     f.close()
    ...     Event.FromString(frame(Event(step=3))[12:-4]).step
    3
    >>> Event.FromString(event_bytes(0.0, 7, b"")).step
    7
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

__all__ = ["EventFile", "frame", "frame_bytes", "event_bytes", "value_head", "file_counter"]

#: Unique event-file names even for several exporters in one process within the same second.
file_counter = itertools.count()


def frame(event: Event) -> bytes:
    return frame_bytes(event.SerializeToString())


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it: two's complement, ten bytes if negative
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def value_head(tag: str) -> bytes:
    """A ``Summary.value`` entry holding ``tag`` and a ``simple_value``, up to the value's four
    bytes (the wire format: field 1 of Summary; in Value, tag is field 1, simple_value 2)."""
    name = tag.encode()
    inner = b"\x0a" + _varint(len(name)) + name + b"\x15"
    return b"\x0a" + _varint(len(inner) + 4) + inner


def event_bytes(wall_time: float, step: int, summary: bytes) -> bytes:
    """An ``Event`` (wall_time: field 1, step: 2, summary: 5) around serialized ``summary``."""
    return b"".join((b"\x09", struct.pack("<d", wall_time), b"\x10", _varint(step), b"\x2a",
                     _varint(len(summary)), summary))


def frame_bytes(data: bytes) -> bytes:
    # TFRecord framing: length, its masked CRC-32C, the data, its masked CRC-32C.
    header = struct.pack("<Q", len(data))
    return b"".join((header, struct.pack("<I", masked_crc32c(header)), data,
                     struct.pack("<I", masked_crc32c(data))))


class EventFile:
    """One TFRecord event file, written synchronously: no queue, no thread.

    tensorboardX's ``FileWriter.flush()`` only flushes what its background thread already
    dequeued; writing here directly means a flush really puts every event on the disk.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._pending = bytearray()
        self._fd = -1
        self._open()

    def _open(self) -> None:
        stamp = f"{int(time.time()):010d}.{socket.gethostname()}"
        name = f"events.out.tfevents.{stamp}.{os.getpid()}.{next(file_counter):04d}.sowtel"
        self.path = os.path.join(self.run_dir, name)
        # O_EXCL: a file (or a link) already there under this name is never written through.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                           | getattr(os, "O_NOFOLLOW", 0), 0o644)
        self._size = 0
        self._rotate = False
        self._pending[:0] = frame(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add(self, event: Event) -> None:
        self._pending += frame(event)

    def deleted(self) -> bool:
        """Whether the event file lost its name (its run folder deleted while training)."""
        return self._fd >= 0 and os.fstat(self._fd).st_nlink == 0

    def recreate(self) -> None:
        """Starts a new event file in a re-created run folder; pending events go there."""
        self._close_fd()
        os.makedirs(self.run_dir, exist_ok=True)
        self._open()

    def add_bytes(self, event: bytes) -> None:
        """Adds a serialized ``Event``."""
        self._pending += frame_bytes(event)

    def write_out(self, sync: bool) -> None:
        """Hands pending events to the OS (and to the disk if ``sync``); raises OSError."""
        if self._rotate:
            self._close_fd()
            try:
                self._open()
            except OSError:
                self._pending.clear()  # bounded memory while no file can be created
                raise
        buf, self._pending = memoryview(bytes(self._pending)), bytearray()
        written = 0
        try:
            while written < len(buf):
                written += os.write(self._fd, buf[written:])
            if sync:
                os.fsync(self._fd)
        except OSError:
            self._size += written
            if self._size == 0:
                # Nothing reached this file: keep it, and its header for the next attempt.
                self._pending[:0] = frame(Event(wall_time=time.time(),
                                                 file_version="brain.Event:2"))
            else:
                # A record cut in the middle would make every later one unreadable, and one
                # written whole may have been cut before: go on in a new file.
                self._rotate = True
            raise
        self._size += written

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def close(self) -> None:
        try:
            if self._pending:
                self.write_out(sync=True)
        finally:
            self._close_fd()
