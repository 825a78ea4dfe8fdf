"""The catalogue of the errors sowtel raises where a user's call breaks one of its rules.

Each error is a class here, with the wrong pattern and the right one side by side, and a
message that names the offending value, the rule it broke and what to do instead. Each
subclasses the built-in error that sowtel raised before the catalogue (``ValueError``,
``TypeError``, ``RuntimeError``), so ``except ValueError`` keeps catching it. Every class is
raised somewhere (``tests/test_errors.py`` checks it). The catalogue holds the rules a user's
call can break: those of the public calls (``sow``, ``at_step``, ``save_intermediates``,
``enable``, ``export``, ``log``), of the exporters' options, and of the dump files written and
read. What the world does (a disk that fills, an endpoint that does not answer) is not in it:
those are the ``OSError`` s and exporter errors that ``status()["errors"]`` counts.

Example:
    >>> import sowtel
    >>> try:
    ...     sowtel.sow(1.0, "block 0/h")
    ... except sowtel.errors.BadNameError as e:
    ...     print(e)
    sow name 'block 0/h' has the character(s) ' ': use only letters, digits and _ - . / ...
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SowtelError", "BadNameError", "BadTagError", "NotPositiveIntError", "NotAnArrayError",
    "UnknownSummaryError", "SowInWhileCondError", "BatchedStepError", "BadStepError",
    "DuplicateSiteError", "NotCallableError", "DuplicatePolicyError", "BranchMismatchError",
    "EnableWhileTracingError", "NoSessionError", "BadOptionError", "BadOptionTypeError",
    "UnknownExporterError", "NotAnExporterError", "DuplicateExporterError",
    "UnusedExporterOptionError", "MissingExtraError", "UnwritableLogdirError",
    "ExporterClosedError", "NotDumpableError", "NotDumpableTypeError", "BadDumpError",
    "DumpPartsError", "BadRecordsFileError", "BadRunError", "NotAModuleError",
    "UnboundModuleError", "UnsupportedOptionError", "BadIntermediatesError",
    "ReadOnlyStatsError", "MismatchedProcessesError", "BadCommandLineError", "CATALOGUE",
    "prefixed",
]

# Said after every refused name, so each message also says what is allowed.
NAME_RULE = ("a name is segments of letters, digits and _ - . joined by '/', such as "
             "'block0/attn' (no empty, '.' or '..' segment, no leading '/')")


class SowtelError(Exception):
    """What every error of the catalogue is, besides its built-in kind."""


class BadNameError(SowtelError, ValueError):
    """A site, scope or record name breaks the naming rule.

    Wrong: ``sow(x, "block 0/h")``, ``sow(x, "../h")``, ``sow(x, "a//b")``.
    Right: ``sow(x, "block0/h")``: letters, digits and ``_ - . /``, with ``/`` only between
    segments, as names become TensorBoard tags, file names and metric names unescaped.
    """

    def __init__(self, what: str, name: Any, why: str) -> None:
        if why == "type":
            text = f"{what} must be a str, got {type(name).__name__} {name!r}"
        elif why == "empty":
            text = f"{what} must be non-empty, got ''"
        elif why.startswith("chars:"):
            text = (f"{what} {name!r} has the character(s) {why[6:]!r}: use only letters, "
                    "digits and _ - . / ('/' makes hierarchy, as in 'block0/attn')")
        elif why == "leading":
            text = f"{what} {name!r} starts with '/': {NAME_RULE}"
        elif why == "empty segment":
            text = f"{what} {name!r} has an empty segment ('//' or a trailing '/'): {NAME_RULE}"
        else:  # a "." or ".." segment
            text = (f"{what} {name!r} has a {why!r} segment, which is not allowed (names are "
                    f"never paths): {NAME_RULE}")
        super().__init__(text)


class BadTagError(SowtelError, ValueError):
    """A tag is not a non-empty string.

    Wrong: ``sow(x, "h", tag=None)``.   Right: ``sow(x, "h", tag="activations")``.
    """

    def __init__(self, tag: Any) -> None:
        super().__init__(f"sow tag must be a non-empty str, got {tag!r}")


class NotPositiveIntError(SowtelError, ValueError):
    """A count (``every=``, a queue size...) is not an int above 0.

    Wrong: ``sow(x, "h", every=0)``, ``every=2.5``.   Right: ``every=1`` or ``every=10``.
    """

    def __init__(self, func: str, arg: str, value: Any) -> None:
        super().__init__(f"{func}({arg}={value!r}): {arg} must be a positive int, such as 1 "
                         "or 10")


class NotAnArrayError(SowtelError, ValueError):
    """A sown pytree holds a leaf that is not an array.

    Wrong: ``sow({"h": h, "name": "layer1"}, "v")``.
    Right: ``sow({"h": h}, "v")``: sow arrays; keep strings and other values static.
    """

    def __init__(self, name: str, where: str, leaf: Any) -> None:
        super().__init__(
            f"sow {name!r}: the leaf at {where} is a {type(leaf).__name__} ({leaf!r:.60}), "
            "not an array: sow pytrees of arrays only (mark other values static)")


class UnknownSummaryError(SowtelError, ValueError):
    """A site asks for a summary sowtel does not compute.

    Wrong: ``sow(x, "h", summary="mean")``.   Right: ``summary="stats"`` (or another of
    ``sowtel.records.SUMMARIES``).
    """

    def __init__(self, summary: Any, summaries: Any) -> None:
        super().__init__(f"sow summary={summary!r} is not a summary: use one of {summaries}")


class SowInWhileCondError(SowtelError, ValueError):
    """A sow in a ``while_loop``'s cond function, where no value can leave the loop.

    Wrong: ``while_loop(lambda c: sow(c, "c") < 3, body, x)``.
    Right: sow in the body, or before the loop.
    """

    def __init__(self, name: str) -> None:
        super().__init__(
            f"sow {name!r} is inside a while_loop cond function: its value can never be "
            "captured or streamed there; sow it in the body (or before the loop) instead")


class BatchedStepError(SowtelError, ValueError):
    """``at_step`` entered inside a vmapped function with a batched step.

    Wrong: ``vmap(lambda s, x: ...at_step(s)...)(steps, xs)``.
    Right: enter ``at_step(step)`` outside the vmapped function.
    """

    def __init__(self, name: str) -> None:
        super().__init__(f"sow {name!r}: the at_step step (or shard index) is batched by vmap; "
                         "enter at_step outside the vmapped function")


class BadStepError(SowtelError, ValueError):
    """A step that is not an integer scalar.

    Wrong: ``at_step(1.5)``, ``at_step(jnp.arange(2))``.   Right: ``at_step(i)`` with a Python
    int or an integer 0-d array (traced under ``jit`` or not).
    """

    def __init__(self, step: Any, shape: tuple[int, ...] | None = None) -> None:
        if shape is not None:
            text = f"at_step step must be a scalar, got shape {shape}"
        else:
            text = ("at_step step must be an integer scalar (Python int or integer array), "
                    f"got {step!r}")
        super().__init__(text)


class DuplicateSiteError(SowtelError, ValueError):
    """A name sown more than once where ``save_intermediates(duplicates="error")`` asks for
    unique names (a solver's functions run again by its derivative rules included).

    Wrong: ``sow(a, "h"); sow(b, "h")`` under the default ``duplicates="error"``.
    Right: distinct names, or ``save_intermediates(f, duplicates="number")`` for ``h_0``,
    ``h_1``, ...
    """

    def __init__(self, name: str, count: int, mode: str | None = None,
                 rerun: str | None = None) -> None:
        if rerun is not None:
            text = (
                f"sow {name!r} ({mode}) runs again in a second {rerun!r} "
                "primitive that runs the functions of an earlier one: the derivative rules "
                "of a solver (the implicit-function theorem) run them again, on the "
                "solution and on the tangent or transposed system, so the site has "
                f"{count} occurrences, each the value of one run. Pass "
                "save_intermediates(..., duplicates='number') to capture every run as "
                f"{name}_0, {name}_1, ... (the names streaming gives them), capture the "
                "solver undifferentiated (save_intermediates(f), not "
                "save_intermediates(jax.grad(f))), or sow a value computed outside the "
                "solver's functions (its solution, or a residual after it).")
        else:
            text = (f"sow name {name!r} is used {count} times; names must be unique under "
                    "duplicates='error': rename the sites, or pass "
                    "save_intermediates(..., duplicates='number') to get "
                    f"{name}_0, {name}_1, ...")
        super().__init__(text)


class NotCallableError(SowtelError, TypeError, ValueError):
    """A call that wraps a function (``save_intermediates``, ``sowtel.jit``, ``sowtel.tap``,
    ``sowtel.nnx.jit``, ``sowtel.equinox.filter_jit``) given something that is not one (a
    ``TypeError``, and a ``ValueError`` as ``sowtel.tap`` raised before the catalogue).

    Wrong: ``save_intermediates(loss(params))``.   Right: ``save_intermediates(loss)(params)``.
    """

    def __init__(self, fn: Any, call: str = "save_intermediates",
                 example: str = "save_intermediates(jax.grad(loss))") -> None:
        super().__init__(
            f"{call} needs a callable, got {type(fn).__name__} {fn!r:.60}: "
            f"pass the function itself, e.g. {example}")


class DuplicatePolicyError(SowtelError, ValueError):
    """An unknown ``duplicates=`` policy.

    Wrong: ``duplicates="ignore"``.   Right: ``"error"`` or ``"number"``.
    """

    def __init__(self, duplicates: Any) -> None:
        super().__init__(
            f"duplicates={duplicates!r} is not a duplicate policy: use 'error' or 'number'")


class BranchMismatchError(SowtelError, ValueError):
    """One name sown with different shapes or dtypes in the branches of a cond / switch.

    Wrong: ``cond(p, lambda: sow(x, "h"), lambda: sow(x[:2], "h"))``.
    Right: a name per shape (``"h_full"``, ``"h_head"``).
    """

    def __init__(self, name: str, mode: str, shapes: Any = None, other: Any = None) -> None:
        detail = "" if shapes is None else f" ({shapes} vs {other})"
        super().__init__(
            f"sow {name!r} ({mode}) has different shapes or dtypes in the branches of a "
            f"cond/switch{detail}: give the sites distinct names")


class EnableWhileTracingError(SowtelError, RuntimeError):
    """``enable()`` called inside a function JAX is tracing.

    Wrong: ``@jax.jit def step(x): sowtel.enable(...)``.
    Right: ``with sowtel.enable(...):`` around the training loop, outside every transform.
    """

    def __init__(self) -> None:
        super().__init__(
            "sowtel.enable() was called inside a function JAX is tracing (under jit, grad, "
            "vmap, scan...): a session is process-wide state that a compiled program cannot "
            "switch; call enable() before the traced call (e.g. before the training loop)")


class NoSessionError(SowtelError, RuntimeError):
    """``export`` or ``log`` with no session to send to.

    Wrong: ``sowtel.log({"loss": l}, step=i)`` before ``enable``.
    Right: inside ``with sowtel.enable(...):``.
    """

    def __init__(self, call: str) -> None:
        super().__init__(f"{call} needs an active session: call sowtel.enable(...) first")


def _shown(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


class _Where:
    """What an error of a file, a folder or an argument says: where (the path, the option or
    the line, as shown), then what is wrong there and what to do."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where} {problem}")  # type: ignore[call-arg]


class BadOptionError(SowtelError, ValueError):
    """An option of ``enable()``, of an exporter or of a dump call outside the values it takes.

    Wrong: ``enable(on_full="wait")``, ``TensorBoardExporter(flush_secs=0)``,
    ``JsonlExporter(filename="runs/a.jsonl")``.
    Right: ``on_full="drop"`` or ``"block"``; ``flush_secs=2.0``; ``filename="a.jsonl"`` with
    the folder in ``logdir=``. The message names the option, its value and what it takes.
    """

    def __init__(self, option: str, value: Any, rule: str, *, shown: str | None = None) -> None:
        super().__init__(f"{option}={_shown(value) if shown is None else shown} {rule}")


class BadOptionTypeError(BadOptionError, TypeError):
    """An option of ``enable()``, of an exporter or of a dump call of a type it does not take
    (a ``TypeError`` as before, and a :class:`BadOptionError`).

    Wrong: ``TensorBoardExporter(logdir=3)``, ``scalar_derivatives="yes"``.
    Right: ``logdir="runs/exp1"`` (a str or ``pathlib.Path``); ``scalar_derivatives=True``.
    """


class UnknownExporterError(SowtelError, ValueError):
    """``exporter=`` names no exporter sowtel knows.

    Wrong: ``enable(exporter="tensorbaord")``.
    Right: a built-in name (``sowtel.exporters.known_names()``), a name registered with
    ``sowtel.exporters.register``, or an exporter instance.
    """

    def __init__(self, name: Any, known: list[str]) -> None:
        super().__init__(f"unknown exporter {name!r}: known exporters are {', '.join(known)}; "
                         "or pass an object with write/flush/close")


class NotAnExporterError(SowtelError, TypeError):
    """``exporter=`` holds an object that is not an exporter: a class, or an object without
    ``write`` / ``flush`` / ``close``.

    Wrong: ``enable(exporter=MemoryExporter)``.
    Right: ``enable(exporter=MemoryExporter())``, kept to read what it holds.
    """

    def __init__(self, obj: Any, missing: list[str] | None = None,
                 known: list[str] | None = None) -> None:
        if missing is None:
            text = (f"exporter {obj.__qualname__} is a class, not an instance: pass "
                    f"{obj.__qualname__}() (with its options), and keep it to read what it "
                    f"holds; or a built-in name such as 'memory' (known: "
                    f"{', '.join(known or [])})")
        else:
            text = (f"exporter {obj!r} lacks the method(s) {', '.join(missing)}: an exporter "
                    "needs write(records), flush() and close() (see sowtel.exporters.Exporter)")
        super().__init__(text)


class DuplicateExporterError(SowtelError, ValueError):
    """One exporter instance given twice in ``exporter=``: it would be called from two threads
    and write every record twice.

    Wrong: ``enable(exporter=[e, e])``.   Right: ``exporter=[e]``, or two instances.
    """

    def __init__(self, name: str, exporter: Any, first: int, second: int) -> None:
        super().__init__(
            f"exporter {name!r} ({exporter!r}) is given twice, at positions {first} and "
            f"{second} of exporter=: one instance would be called from two threads and write "
            "every record twice; pass it once, or pass two instances")


class UnusedExporterOptionError(SowtelError, TypeError):
    """An option passed to ``enable()`` for the exporters that none of the named ones takes.

    Wrong: ``enable(exporter="memory", logdir="runs/a")``.
    Right: ``enable(exporter="tensorboard", logdir="runs/a")``, or configure an instance.
    """

    def __init__(self, unused: list[str], named: list[str]) -> None:
        super().__init__(
            f"exporter option(s) {', '.join(unused)} are taken by none of the exporters "
            f"{', '.join(named) or '(instances only)'}: check the spelling, or configure the "
            "exporter instance directly")


class MissingExtraError(SowtelError, ImportError):
    """A built-in exporter whose optional dependencies are not installed.

    Wrong: ``enable(exporter="otel")`` without OpenTelemetry installed.
    Right: ``pip install 'sowtel[otel]'`` first (``[tensorboard]``, ``[all]``...).
    """

    def __init__(self, name: str, extra: str, cause: BaseException) -> None:
        super().__init__(f"exporter {name!r} needs optional dependencies: "
                         f"pip install 'sowtel[{extra}]' ({cause})")


class UnwritableLogdirError(_Where, SowtelError, ValueError):
    """An exporter's ``logdir`` (or the file it writes there) cannot be used: a file where a
    folder should be, a folder that cannot be created or written, a symbolic link or a file
    with other names that the exporter will not write through.

    Wrong: ``TensorBoardExporter(logdir="notes.txt")`` (a file), a read-only folder.
    Right: a folder path this process can create files in (it is created if missing).
    """



class ExporterClosedError(SowtelError, RuntimeError):
    """An exporter written to after ``close()``.

    Wrong: ``e.close(); e.write(records)``.   Right: create a new exporter.
    """

    def __init__(self, name: str) -> None:
        super().__init__(f"{name}.write() after close(): create a new exporter")


class NotDumpableError(_Where, SowtelError, ValueError):
    """A value or metadata that a dump file cannot hold: nested too deep, a dict key or a
    dtype it does not store, metadata that is not JSON, values of one process beside values
    that span several.

    Wrong: ``sowtel.dump({"h": x.astype(jnp.int4)}, path)``, ``metadata={"lr": float("nan")}``.
    Right: cast to a supported dtype first; metadata of finite numbers and strings.
    """



class NotDumpableTypeError(NotDumpableError, TypeError):
    """A value of a type a dump file cannot hold (a ``TypeError`` as before, and a
    :class:`NotDumpableError`): a dump stores dicts, lists, tuples, None and arrays only, so
    that loading one never runs code.

    Wrong: ``sowtel.dump({"cfg": MyConfig()}, path)``.   Right: its arrays, or its fields.
    """


class BadDumpError(SowtelError, ValueError):
    """A file read as a dump that is not one sowtel can read: not a sowtel dump, truncated,
    corrupted or crafted, of another format version, or changed while it was read.

    Wrong: ``sowtel.load("model.ckpt")``.
    Right: a file ``sowtel.dump`` wrote (``step_<k>.safetensors``); read it again if it was
    being written.
    """

    def __init__(self, path: Any, problem: str) -> None:
        super().__init__(f"{str(path)!r} {problem}")


class DumpPartsError(SowtelError, ValueError):
    """Files or a folder read as one multi-process dump (or a folder of dumps) that are not:
    parts of different dumps, a part missing or given twice, shards that do not tile a value.

    Wrong: ``sowtel.load(["step_1.process_0.safetensors", "step_2.process_1.safetensors"])``.
    Right: every process's part of one step, each once.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)


class BadRecordsFileError(_Where, SowtelError, ValueError):
    """A records file (the jsonl exporter's) or one of its sidecars that cannot be read as one:
    not a regular file, a sidecar outside its folder, not a valid ``.npy``, truncated.

    Wrong: ``sowtel.exporters.jsonl.read_records("/dev/stdin")``.
    Right: a ``records.jsonl`` the jsonl exporter wrote, with its ``_values`` folder beside it.
    """



def prefixed(error: Exception, call: str) -> Exception:
    """``error`` again, of its own class, its message led by the public ``call`` it came
    through (``"sowtel.log: sow name ..."``): a rule checked for that call keeps its entry.

    Example:
        >>> e = prefixed(BadTagError(""), "sowtel.log")
        >>> type(e).__name__, str(e)
        ('BadTagError', "sowtel.log: sow tag must be a non-empty str, got ''")
    """
    again = type(error).__new__(type(error))
    again.args = (f"{call}: {error}",)
    return again


class BadRunError(_Where, SowtelError, ValueError):
    """A folder or file given to ``sowtel.compare_runs`` / ``sowtel diff-runs`` that holds no
    run sowtel can compare: another tool's event files, no run at all, two runs one after the
    other in one file, or two runs with no step or no site in common.

    Wrong: ``compare_runs("runs", "runs_b")`` on the parent of several runs.
    Right: the logdir one jsonl or TensorBoard exporter wrote, for each of two runs of one
    training.
    """



class NotAModuleError(SowtelError, TypeError):
    """An integration given something other than what it wraps: ``sowtel.flax`` a Linen module,
    ``sowtel.nnx.capture`` an ``nnx.Module``, ``sowtel.equinox.capture`` an ``eqx.Module``,
    ``sowtel.optax.watch`` an optax ``GradientTransformation``.

    Wrong: ``sowtel.optax.watch(optax.adam)``.   Right: ``sowtel.optax.watch(optax.adam(1e-3))``.
    """

    def __init__(self, call: str, needs: str, got: Any, hint: str = "") -> None:
        super().__init__(f"{call} needs {needs}, got {type(got).__name__} {got!r:.60}{hint}")


class UnboundModuleError(SowtelError, ValueError):
    """``sowtel.flax.sow`` (or a scope) given a Linen module outside ``init`` / ``apply``,
    where it has no path to name its sites by.

    Wrong: ``sowtel.flax.sow(Dense(3), x, "h")``.
    Right: ``sowtel.flax.sow(self, x, "h")`` inside a module's method run by ``model.apply``.
    """

    def __init__(self, module: Any) -> None:
        super().__init__(
            f"sowtel.flax: the module {type(module).__name__} is not bound (it has no path): "
            "call it inside model.init / model.apply, or inside a parent's method")


class UnsupportedOptionError(SowtelError, TypeError):
    """A ``jax.jit`` option that a sowtel wrapper does not take, with what to do instead.

    Wrong: ``sowtel.nnx.jit(step, in_shardings=...)``.
    Right: shard the state itself (``nnx.with_partitioning`` and ``jax.device_put``).
    """

    def __init__(self, call: str, option: str, instead: str) -> None:
        super().__init__(f"{call} does not take {option}=: {instead}")


class BadIntermediatesError(_Where, SowtelError, TypeError, ValueError):
    """Intermediates given to ``sowtel.dump`` / ``sowtel.export`` that are not what
    ``save_intermediates`` returns (``{name: {mode: value}}`` with known modes); a ``TypeError``
    for a wrong type and a ``ValueError`` for a wrong name or mode, as before the catalogue.

    Wrong: ``sowtel.dump({"h": x}, path)``.   Right: ``sowtel.dump({"h": {"primal": x}}, path)``.
    """



class ReadOnlyStatsError(SowtelError, TypeError):
    """An exporter (or any reader of records) that writes to a record's ``stats``, which every
    exporter of the session shares.

    Wrong: ``record.stats["mean"] = 0.0``.   Right: ``{**record.stats, "mean": 0.0}``.
    """

    def __init__(self) -> None:
        super().__init__("a record's stats are shared by every exporter and read-only: copy "
                         "them to change them ({**record.stats, ...})")


class MismatchedProcessesError(SowtelError, ValueError):
    """The processes of one multi-process job call ``enable()`` (or another collective call)
    with different settings, though they run the same compiled programs.

    Wrong: ``enable(every=10)`` in process 0 and ``enable(every=5)`` in process 1.
    Right: the same settings in every process (the exporters may differ).
    """

    def __init__(self, call: str, me: int, other: int, detail: str) -> None:
        super().__init__(
            f"sowtel.{call}(): process {me} and process {other} differ in {detail}. Every "
            f"process must call sowtel.{call}() with the same settings, because they run the "
            "same compiled programs; exporters may differ")


class BadCommandLineError(_Where, SowtelError, ValueError):
    """An argument of a ``sowtel`` command (``inspect``, ``diff``, ``plot``, ``dashboard``)
    that does not fit what it names: ``--step`` on a file, a step the folder lacks, a port out
    of range or in use. The command prints the message and exits with status 2.

    Wrong: ``sowtel inspect step_3.safetensors --step 3``.
    Right: ``sowtel inspect runs/dumps --step 3`` (a folder of dumps).
    """



#: Every error of the catalogue, in the order of the calls they guard.
CATALOGUE: tuple[type[SowtelError], ...] = (
    BadNameError, BadTagError, NotPositiveIntError, NotAnArrayError, UnknownSummaryError,
    SowInWhileCondError, BatchedStepError, BadStepError, DuplicateSiteError, NotCallableError,
    DuplicatePolicyError, BranchMismatchError, EnableWhileTracingError, NoSessionError,
    BadOptionError, BadOptionTypeError, UnknownExporterError, NotAnExporterError,
    DuplicateExporterError, UnusedExporterOptionError, MissingExtraError, UnwritableLogdirError,
    ExporterClosedError, NotDumpableError, NotDumpableTypeError, BadDumpError, DumpPartsError,
    BadRecordsFileError, BadRunError, NotAModuleError, UnboundModuleError, UnsupportedOptionError,
    BadIntermediatesError, ReadOnlyStatsError, MismatchedProcessesError, BadCommandLineError,
)
