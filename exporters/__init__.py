"""sowtel's exporters: where records go.

An exporter is a small class with three methods and no threads of its own (:class:`Exporter`
says what sowtel calls and reads on it, and when); the dispatcher owns batching, queues and
error isolation. Built-in exporters are looked up by name; third-party ones
register under the entry-point group ``sowtel.exporters``.

Example:
    >>> from sowtel.exporters import resolve
    >>> from sowtel.exporters.memory import MemoryExporter
    >>> [e] = resolve("memory")
    >>> isinstance(e, MemoryExporter)
    True
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from sowtel import errors
from sowtel.records import Record

__all__ = ["Exporter", "register", "known_names", "resolve", "check_exporter", "check_distinct",
           "check_logdir"]

# Path limits where the system does not say (Linux's): a whole path, one file or folder name.
_PATH_MAX, _NAME_MAX = 4096, 255


@runtime_checkable
class Exporter(Protocol):
    """Where records go: the three methods sowtel calls on every exporter, and what it may read.

    An exporter has no threads of its own. The dispatcher gives each exporter one worker thread,
    and every method below is called from that thread only: never from the training thread or
    a JAX callback, never two at once. The worker owns the backlog, the batching and the error
    isolation, so an exporter stays a plain sink.

    Each method may raise: the call is counted in ``status()["errors"][label]`` (a write's
    records in ``status()["failed"][label]``), the first failure of the exporter is logged with
    its traceback, later ones are only counted, and the exporter keeps being called. A method
    may block, but one call lasting longer than ``exporter_timeout`` makes the exporter
    *stalled*: records for it are dropped and counted, and ``flush``/``close`` of the session
    stop waiting for it until that call returns. A method must not call ``sowtel.flush`` or a
    dispatcher's ``flush`` (it is ignored: the worker would wait for itself).

    Optional methods, called where the exporter has them, under the same rules:

    ``write_batch(batch)``
        Called *instead of* :meth:`write` when present, with a
        :class:`~sowtel.to_records.RecordBatch` (the columnar tables of ``sowtel.jit`` steps
        kept as they are, so a sink can write a column at a time). The batch, its tables and
        their arrays are shared with the other exporters: read them, never modify them.

    ``write_alerts(alerts)``
        The :class:`sowtel.alerts.Alert` s that ``enable(alerts=...)`` rules fired, a tuple,
        after the records of the batch they were judged on. Whether it exists is looked up
        each time alerts are handed over; an exporter without it is not told.

    Attributes sowtel reads, each optional (``getattr`` with a default), each a plain value
    that may be read from any thread:

    ``label`` (``str``)
        The exporter's key in ``status()`` (``exported``, ``failed``, ``drop_reasons``, ...)
        and in log lines; read once, when the dispatcher is made. Missing or empty: the class
        name. Two exporters of one label get ``label``, ``label#2``, ...
        (:func:`sowtel.dispatcher.labels`). ``"tensorboard"`` with a ``str`` ``logdir`` also
        makes ``enable()`` print the command that views the run.

    ``logdir`` (``str`` or ``os.PathLike``)
        The folder the exporter writes in; read once by ``enable()``: the first exporter that
        has one is where post-mortem dumps (``flight_recorder=``, ``on_nonfinite=``) go, under
        ``<logdir>/postmortem/`` (no exporter has one: under the working directory).

    ``evicted`` (``int``)
        Records the exporter was handed (so counted in ``exported``) and later let go of to stay
        within a bound of its own, as the memory exporter's ``max_records``; shown as
        ``status()["evicted"][label]``, read on the thread calling ``status()``. Anything but an
        ``int`` counts as 0.

    Example:
        >>> from sowtel.exporters.memory import MemoryExporter
        >>> isinstance(MemoryExporter(), Exporter)
        True
        >>> class Means:
        ...     label = "means"
        ...     def write(self, records):
        ...         print([r.stats["mean"] for r in records])
        ...     def flush(self): pass
        ...     def close(self): pass
        >>> check_exporter(Means()).label
        'means'
    """

    def write(self, records: Sequence[Record]) -> None:
        """Takes records, in the order they were received (what the exporter keeps of them).

        Called on the exporter's worker thread whenever records wait for it and it has no
        ``write_batch``, with at most ``WRITE_RECORDS`` (1,024) records and ``WRITE_BYTES`` of
        full values at a time (always at least one record), sized to last about a twentieth of
        ``exporter_timeout`` at the exporter's measured pace. The sequence and its records are
        shared with the other exporters and frozen (read-only stats and arrays): copy what you
        change. A write that raises loses its records (counted in ``failed``); the next write
        gets the records after them.
        """

    def flush(self) -> None:
        """Makes what was written durable or visible (a file's buffer, a network batch).

        Called on the worker thread about every ``flush_interval`` seconds after something was
        written (even under a steady stream), and when ``sowtel.flush()`` or the session's end
        asks for it: then it comes after every record accepted before that call, and the
        caller waits for it (within its timeout). It may be called with nothing new written.
        """

    def close(self) -> None:
        """Releases what the exporter holds (files, connections); called once, last.

        Called on the worker thread when the session or dispatcher closes, after the records
        and a final ``flush``; nothing is called after it. When the close ran out of time while
        the exporter was inside a call, that call is left to finish and ``close`` comes after
        it (its records are counted in ``drop_reasons[label]["close_timeout"]``). What the
        exporter keeps for reading (a memory exporter's records) should stay readable.
        """


# name -> "module:attribute" of a class or factory taking the exporter options as keywords.
_BUILTIN: dict[str, str] = {
    "memory": "sowtel.exporters.memory:MemoryExporter",
    "console": "sowtel.exporters.console:ConsoleExporter",
    "jsonl": "sowtel.exporters.jsonl:JsonlExporter",
    "tensorboard": "sowtel.exporters.tensorboard:TensorBoardExporter",
    "otel": "sowtel.exporters.otel:OTelExporter",
    "wandb": "sowtel.exporters.wandb:WandbExporter",
    "mlflow": "sowtel.exporters.mlflow:MlflowExporter",
    "trackio": "sowtel.exporters.trackio:TrackioExporter",
}
_REGISTERED: dict[str, Callable[..., Exporter]] = {}


def register(name: str, factory: Callable[..., Exporter]) -> None:
    """Registers ``factory(**options) -> Exporter`` under ``name`` for ``enable(exporter=name)``."""
    if not isinstance(name, str) or not name:
        raise errors.BadOptionTypeError("register name", name, "must be a non-empty str")
    _REGISTERED[name] = factory


def _entry_point_factories() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group="sowtel.exporters")}


def known_names() -> list[str]:
    """Every exporter name ``enable()`` accepts: built-in, registered and entry points."""
    return sorted(set(_BUILTIN) | set(_REGISTERED) | set(_entry_point_factories()))


def check_exporter(obj: Any) -> Exporter:
    """Returns ``obj`` if it has callable ``write``, ``flush`` and ``close``; else TypeError.

    A class is refused even though it has those methods: its ``write`` would fail at every
    batch for want of an instance. Instantiating it here would hide the instance (and the
    records a memory exporter keeps) from the caller, so the error says to pass one instead.
    """
    if isinstance(obj, type):
        raise errors.NotAnExporterError(obj, known=known_names())
    missing = [m for m in ("write", "flush", "close") if not callable(getattr(obj, m, None))]
    if missing:
        raise errors.NotAnExporterError(obj, missing)
    return obj


def check_distinct(exporters: Sequence[Any]) -> None:
    """A ``ValueError`` naming the first exporter instance given more than once.

    Each exporter of a session is called from one worker thread of its own; the same instance
    twice would be called from two threads at once and write every record twice. Names (such
    as ``"memory"``) are skipped: each makes an exporter of its own.

    Example:
        >>> from sowtel.exporters.memory import MemoryExporter
        >>> memory = MemoryExporter()
        >>> check_distinct([memory, MemoryExporter()])
        >>> check_distinct([memory, memory])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        sowtel.errors.DuplicateExporterError: exporter 'memory' (<...MemoryExporter ...>) is ...
    """
    seen: dict[int, int] = {}
    for i, exporter in enumerate(exporters):
        if isinstance(exporter, str):
            continue  # a name makes a new exporter each time it is given
        first = seen.setdefault(id(exporter), i)
        if first != i:
            label = getattr(exporter, "label", None)
            name = label if isinstance(label, str) and label else type(exporter).__name__
            raise errors.DuplicateExporterError(name, exporter, first, i)


def _factory(name: str) -> Callable[..., Exporter]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        module, attr = _BUILTIN[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
        except ImportError as e:
            extra = {"tensorboard": "tensorboard", "otel": "otel", "wandb": "wandb",
                     "mlflow": "mlflow", "trackio": "trackio"}.get(name, "all")
            raise errors.MissingExtraError(name, extra, e) from e
    eps = _entry_point_factories()
    if name in eps:
        return eps[name].load()  # type: ignore[no-any-return]
    raise errors.UnknownExporterError(name, known_names())


def _accepted(factory: Callable[..., Exporter], options: dict[str, Any]) -> dict[str, Any] | None:
    """The options ``factory`` takes; None when it takes any keyword (``**options``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins and C types: give them everything
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params
             if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return {k: v for k, v in options.items() if k in names}


def resolve(spec: Any, **options: Any) -> list[Exporter]:
    """Turns ``enable()``'s ``exporter=`` argument into exporter instances.

    ``spec`` is a name, an exporter instance, or a list of either. Each exporter created by
    name gets the ``options`` its constructor takes (so ``logdir=`` reaches TensorBoard and
    ``tracer_provider=`` reaches OpenTelemetry in one list); an option no exporter takes is an
    error. Instances are used as they are.

    Every name, instance and option is checked before any exporter is created, so a mistake
    (an unknown name, a misspelled option, a class instead of an instance) creates no file.
    If creating one exporter fails, those created before it are closed.
    """
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not items:
        raise errors.BadOptionError("exporter", items, "must name at least one exporter")
    plan: list[tuple[Callable[..., Exporter] | None, Any]] = []
    used: set[str] = set()
    named = [item for item in items if isinstance(item, str)]
    for item in items:
        if isinstance(item, str):
            factory = _factory(item)
            mine = _accepted(factory, options)
            chosen = options if mine is None else mine
            used.update(chosen)
            plan.append((factory, chosen))
        else:
            plan.append((None, check_exporter(item)))
    check_distinct(items)
    unused = sorted(set(options) - used)
    if unused:
        raise errors.UnusedExporterOptionError(unused, named)
    out: list[Exporter] = []
    created: list[Exporter] = []
    try:
        for make, arg in plan:
            if make is None:
                out.append(arg)
            else:
                created.append(check_exporter(make(**arg)))
                out.append(created[-1])
    except BaseException:
        for exporter in created:  # nothing was enabled: release what was opened
            try:
                exporter.close()
            except Exception:  # noqa: BLE001 - already reporting the caller's mistake
                pass
        raise
    return out


def check_logdir(logdir: Any, option: str = "logdir") -> str:
    r"""``logdir`` as a path string, or a ``ValueError`` naming the option, value and rule.

    The rules the operating system would otherwise report as bare ``OSError``s: no NUL
    character, no folder name longer than the system allows (255 bytes), no path longer than
    it allows (4,096 bytes), checked on the text alone before anything is created. Room is left
    for the file names an exporter adds.

    Example:
        >>> check_logdir("runs/exp1")
        'runs/exp1'
        >>> check_logdir("runs/a\x00b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        sowtel.errors.BadOptionError: logdir='runs/a\x00b' holds a NUL character (\x00), ...
    """
    text = os.fspath(logdir)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    shown = repr(text) if len(text) <= 120 else f"{text[:60]!r}...{text[-20:]!r}"
    if "\0" in text:
        raise errors.BadOptionError(
            option, text, "holds a NUL character (\\x00), which no path may hold: remove it",
            shown=shown)
    try:
        path_max = os.pathconf(os.path.dirname(os.path.abspath(text)) or "/", "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):
        path_max = _PATH_MAX
    try:
        name_max = os.pathconf("/", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = _NAME_MAX
    # 100 bytes for the files and folders written inside (event files, sidecar folders).
    length = len(os.fsencode(os.path.abspath(text)))
    if length + 100 > path_max:
        raise errors.BadOptionError(
            option, text, f"is {length} bytes long as an absolute path; with the files "
            f"written inside it, it would pass this system's limit of {path_max} bytes per "
            f"path: choose a shorter {option}", shown=shown)
    longest = max(text.replace(os.sep, "/").split("/"), key=lambda c: len(os.fsencode(c)))
    if len(os.fsencode(longest)) > name_max:
        raise errors.BadOptionError(
            option, text, f"has a folder name of {len(os.fsencode(longest))} bytes "
            f"({longest[:40]!r}...), over this system's limit of {name_max} bytes per name: "
            f"choose a shorter {option}", shown=shown)
    return text
