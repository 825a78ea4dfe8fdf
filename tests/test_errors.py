"""The error catalogue (sowtel.errors): each error is raised where its rule is broken, keeps its
built-in kind, names the offending value, and documents the wrong and the right pattern."""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sowtel
import sowtel.dashboard
import sowtel.exporters
import sowtel.nnx
import sowtel.optax
from sowtel import errors
from sowtel.exporters.jsonl import JsonlExporter, read_records
from sowtel.exporters.memory import MemoryExporter

SOURCES = [pathlib.Path(sowtel.__file__).resolve().parent,
           pathlib.Path(sowtel.exporters.__file__).resolve().parent]
ONE = {"h": {"primal": np.ones(2, np.float32)}}


def _sow_twice(x: Any) -> Any:
    return sowtel.sow(x, "h") + sowtel.sow(x * 2.0, "h")


def _cond_mismatch(x: Any) -> Any:
    return jax.lax.cond(x[0] > 0, lambda v: sowtel.sow(v, "h").sum(),
                        lambda v: sowtel.sow(v[:1], "h").sum(), x)


def _enable_inside_jit() -> None:
    jax.jit(lambda x: (sowtel.enable(exporter="memory"), x)[1])(1.0)


def _sow_in_while_cond() -> None:
    jax.lax.while_loop(lambda c: sowtel.sow(c, "c") < 3.0, lambda c: c + 1.0, 0.0)


def _batched_step() -> None:
    def f(step: Any, x: Any) -> Any:
        with sowtel.at_step(step):
            return sowtel.sow(x, "h")

    with sowtel.enable(exporter="memory"):
        jax.vmap(f)(jnp.arange(2), jnp.ones(2))


def _same_memory_twice() -> None:
    memory = MemoryExporter()
    sowtel.enable(exporter=[memory, memory])


def _extra_missing() -> None:
    saved = sys.modules.get("sowtel.exporters.wandb")
    sys.modules["sowtel.exporters.wandb"] = None  # type: ignore[assignment]  # import fails
    try:
        sowtel.enable(exporter="wandb")
    finally:
        if saved is None:
            del sys.modules["sowtel.exporters.wandb"]
        else:
            sys.modules["sowtel.exporters.wandb"] = saved


def _logdir_is_a_file(tmp: pathlib.Path) -> None:
    (tmp / "notes.txt").write_text("x")
    JsonlExporter(logdir=tmp / "notes.txt")


def _write_after_close(tmp: pathlib.Path) -> None:
    from sowtel.exporters.tensorboard import TensorBoardExporter

    board = TensorBoardExporter(logdir=tmp / "tb")
    board.close()
    board.write([])


def _not_a_dump(tmp: pathlib.Path) -> None:
    (tmp / "model.ckpt").write_bytes(b"\x00" * 64)
    sowtel.load(tmp / "model.ckpt")


def _bad_records_line(tmp: pathlib.Path) -> None:
    (tmp / "records.jsonl").write_text("not json\n")
    read_records(tmp / "records.jsonl")


def _write_a_records_stats() -> None:
    with sowtel.enable(exporter="memory") as session:
        sowtel.log({"loss": 1.0}, step=0)
        assert sowtel.flush()
    session.exporters[0].records[0].stats["value"] = 2.0


# Raised only where several processes run: checked by the multi-process test named.
ELSEWHERE = {"MismatchedProcessesError": ("test_multiprocess.py",
                                          "test_settings_that_differ_between_processes")}


def _unbound_linen_module() -> None:
    import flax.linen as nn

    import sowtel.flax

    sowtel.flax.sow(nn.Dense(3), jnp.ones(2), "act")


# (error, what breaks its rule, the value or text its message must name); a call taking an
# argument gets a fresh folder.
CASES: list[tuple[type[Exception], Callable[..., Any], str]] = [
    (errors.BadNameError, lambda: sowtel.sow(1.0, "block 0/h"), "'block 0/h'"),
    (errors.BadNameError, lambda: sowtel.sow(1.0, "../h"), "'..'"),
    (errors.BadTagError, lambda: sowtel.sow(1.0, "h", tag=""), "''"),
    (errors.NotPositiveIntError, lambda: sowtel.sow(1.0, "h", every=0), "every=0"),
    (errors.NotAnArrayError, lambda: sowtel.sow({"a": "text"}, "v"), "['a']"),
    (errors.UnknownSummaryError, lambda: sowtel.sow(1.0, "h", summary="mean"), "'mean'"),
    (errors.SowInWhileCondError, _sow_in_while_cond, "'c'"),
    (errors.BatchedStepError, _batched_step, "'h'"),
    (errors.BadStepError, lambda: sowtel.at_step(1.5).__enter__(), "1.5"),
    (errors.DuplicateSiteError, lambda: sowtel.save_intermediates(_sow_twice)(1.0), "'h'"),
    (errors.NotCallableError, lambda: sowtel.save_intermediates(3), "int 3"),
    (errors.DuplicatePolicyError,
     lambda: sowtel.save_intermediates(_sow_twice, duplicates="ignore"), "'ignore'"),
    (errors.BranchMismatchError,
     lambda: sowtel.save_intermediates(_cond_mismatch)(jnp.ones(2)), "'h'"),
    (errors.EnableWhileTracingError, _enable_inside_jit, "traced call"),
    (errors.NoSessionError, lambda: sowtel.log({"loss": 1.0}, step=0), "sowtel.log"),
    (errors.BadOptionError, lambda: sowtel.enable(exporter="memory", on_full="wait"),
     "on_full='wait'"),
    (errors.BadOptionTypeError, lambda: sowtel.dump(ONE, 3), "path=3"),
    (errors.UnknownExporterError, lambda: sowtel.enable(exporter="tensorbaord"), "'tensorbaord'"),
    (errors.NotAnExporterError, lambda: sowtel.enable(exporter=MemoryExporter), "MemoryExporter()"),
    (errors.DuplicateExporterError, _same_memory_twice, "positions 0 and 1"),
    (errors.UnusedExporterOptionError, lambda: sowtel.enable(exporter="memory", logdirr="x"),
     "logdirr"),
    (errors.MissingExtraError, _extra_missing, "pip install 'sowtel[wandb]'"),
    (errors.UnwritableLogdirError, _logdir_is_a_file, "notes.txt' is a file, not a folder"),
    (errors.ExporterClosedError, _write_after_close, "TensorBoardExporter.write() after close()"),
    (errors.NotDumpableError,
     lambda tmp: sowtel.dump(ONE, tmp / "a.safetensors", metadata={"lr": float("nan")}),
     "metadata['lr'] = nan"),
    (errors.NotDumpableTypeError,
     lambda tmp: sowtel.dump({"h": {"primal": {"cfg": object()}}}, tmp / "a.safetensors"),
     "['cfg'] is a builtins.object"),
    (errors.BadDumpError, _not_a_dump, "model.ckpt' is not a sowtel dump"),
    (errors.DumpPartsError, lambda: sowtel.load([]), "an empty list of paths"),
    (errors.BadRecordsFileError, _bad_records_line, "line 1 is not a JSON object"),
    (errors.BadRunError, lambda tmp: sowtel.compare_runs(tmp, tmp), "holds no run"),
    (errors.NotAModuleError, lambda: sowtel.optax.watch(3), "GradientTransformation"),
    (errors.UnboundModuleError, _unbound_linen_module, "is not bound"),
    (errors.UnsupportedOptionError, lambda: sowtel.nnx.jit(lambda s: s, in_shardings=0),
     "does not take in_shardings="),
    (errors.ReadOnlyStatsError, _write_a_records_stats, "read-only"),
    (errors.BadCommandLineError, lambda: sowtel.dashboard.pick_port("127.0.0.1", 70000),
     "--port 70000 is not a TCP port"),
    (errors.BadIntermediatesError,
     lambda tmp: sowtel.dump({"h": np.ones(2)}, tmp / "a.safetensors"),
     "intermediates['h'] must be a dict {mode: value}"),
]


@pytest.mark.parametrize(("error", "call", "named"), CASES,
                         ids=[f"{e.__name__}-{i}" for i, (e, _, _) in enumerate(CASES)])
def test_each_error_is_raised_where_its_rule_breaks(error: type[Exception],
                                                    call: Callable[..., Any], named: str,
                                                    tmp_path: pathlib.Path) -> None:
    builtins = [b for b in error.__mro__ if b.__module__ == "builtins"
                and b not in (Exception, BaseException, object)]
    with pytest.raises(tuple(builtins)) as caught:
        call(tmp_path) if inspect.signature(call).parameters else call()
    for builtin in builtins:  # the kinds it had before the catalogue
        assert isinstance(caught.value, builtin)
    assert type(caught.value) is error
    assert isinstance(caught.value, errors.SowtelError)
    assert named in str(caught.value), str(caught.value)


def test_the_catalogue_lists_every_error_and_each_is_raised_in_the_source() -> None:
    defined = {name for name, obj in vars(errors).items() if isinstance(obj, type)
               and issubclass(obj, errors.SowtelError) and obj is not errors.SowtelError}
    assert defined == {e.__name__ for e in errors.CATALOGUE}
    assert defined == {e.__name__ for e, _, _ in CASES} | set(ELSEWHERE)
    for name, (module, test) in ELSEWHERE.items():
        text = (pathlib.Path(__file__).parent / module).read_text()
        assert f"def {test}" in text and f'"{name}"' in text, name
    text = "\n".join(p.read_text() for source in SOURCES for p in source.rglob("*.py")
                     if p.name != "errors.py")
    for error in errors.CATALOGUE:
        assert re.search(rf"errors\.{error.__name__}\(", text), error.__name__
        doc = error.__doc__ or ""
        assert "Wrong:" in doc and "Right:" in doc, error.__name__


def test_a_rule_checked_for_a_call_keeps_its_entry_with_the_calls_name() -> None:
    with sowtel.enable(exporter="memory"):
        with pytest.raises(errors.BadNameError) as logged:
            sowtel.log({"a b": 1.0}, step=0)
        with pytest.raises(errors.BadNameError) as exported:
            sowtel.export({"a b": {"primal": np.ones(2)}}, step=0)
    assert str(logged.value).startswith("sowtel.log: ")
    assert str(exported.value).startswith("sowtel.export: ")
    assert "'a b' has the character(s) ' '" in str(logged.value)
