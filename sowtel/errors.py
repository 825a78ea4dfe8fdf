"""The catalogue of the errors sowtel raises where a user's call breaks one of its rules.

Each error is a class here, with the wrong pattern and the right one side by side, and a
message that names the offending value, the rule it broke and what to do instead. Each
subclasses the built-in error that sowtel raised before the catalogue (``ValueError``,
``TypeError``, ``RuntimeError``), so ``except ValueError`` keeps catching it. Every class is
raised somewhere (``tests/test_errors.py`` checks it). The catalogue holds the rules of the
public calls (``sow``, ``at_step``, ``save_intermediates``, ``enable``, ``export``, ``log``);
the exporters' and the dump files' own checks raise from their modules.

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
    "EnableWhileTracingError", "NoSessionError", "CATALOGUE",
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


class NotCallableError(SowtelError, TypeError):
    """``save_intermediates`` given something that is not a function.

    Wrong: ``save_intermediates(loss(params))``.   Right: ``save_intermediates(loss)(params)``.
    """

    def __init__(self, fn: Any) -> None:
        super().__init__(
            f"save_intermediates needs a callable, got {type(fn).__name__} {fn!r:.60}: "
            "pass the function itself, e.g. save_intermediates(jax.grad(loss))")


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


#: Every error of the catalogue, in the order of the calls they guard.
CATALOGUE: tuple[type[SowtelError], ...] = (
    BadNameError, BadTagError, NotPositiveIntError, NotAnArrayError, UnknownSummaryError,
    SowInWhileCondError, BatchedStepError, BadStepError, DuplicateSiteError, NotCallableError,
    DuplicatePolicyError, BranchMismatchError, EnableWhileTracingError, NoSessionError,
)
