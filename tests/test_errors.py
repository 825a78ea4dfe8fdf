"""The error catalogue (sowtel.errors): each error is raised where its rule is broken, keeps its
built-in kind, names the offending value, and documents the wrong and the right pattern."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import sowtel
from sowtel import errors

SOURCE = pathlib.Path(sowtel.__file__).resolve().parent


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


# (error, what breaks its rule, the value or text its message must name)
CASES: list[tuple[type[Exception], Callable[[], Any], str]] = [
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
]


@pytest.mark.parametrize(("error", "call", "named"), CASES,
                         ids=[f"{e.__name__}-{i}" for i, (e, _, _) in enumerate(CASES)])
def test_each_error_is_raised_where_its_rule_breaks(error: type[Exception],
                                                    call: Callable[[], Any], named: str) -> None:
    builtin = next(b for b in error.__mro__ if b.__module__ == "builtins"
                   and b is not Exception and issubclass(b, Exception))
    with pytest.raises(builtin) as caught:  # the kind it had before the catalogue
        call()
    assert type(caught.value) is error
    assert isinstance(caught.value, errors.SowtelError)
    assert named in str(caught.value), str(caught.value)


def test_the_catalogue_lists_every_error_and_each_is_raised_in_the_source() -> None:
    defined = {name for name, obj in vars(errors).items() if isinstance(obj, type)
               and issubclass(obj, errors.SowtelError) and obj is not errors.SowtelError}
    assert defined == {e.__name__ for e in errors.CATALOGUE}
    assert defined == {e.__name__ for e, _, _ in CASES}
    text = "\n".join(p.read_text() for p in SOURCE.rglob("*.py") if p.name != "errors.py")
    for error in errors.CATALOGUE:
        assert re.search(rf"errors\.{error.__name__}\(", text), error.__name__
        doc = error.__doc__ or ""
        assert "Wrong:" in doc and "Right:" in doc, error.__name__
