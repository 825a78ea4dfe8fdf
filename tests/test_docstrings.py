"""Every example in the public docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "sowtel", "sowtel.primitive", "sowtel.capture", "sowtel.session", "sowtel.summaries",
    "sowtel.records", "sowtel.dispatcher", "sowtel.dumps", "sowtel.postmortem",
    "sowtel.exporters", "sowtel.exporters.memory", "sowtel.exporters.console",
    "sowtel.exporters.jsonl", "sowtel._jax_compat", "sowtel._jax_compat._jaxprs",
    "sowtel._jax_compat._lowering", "sowtel.jit",
    "sowtel.dumps._format", "sowtel.locate", "sowtel.nonfinite", "sowtel.to_records",
    "sowtel.tensorboard_plugin", "sowtel.tensorboard_plugin._run", "sowtel.exporters.tensorboard",
    "sowtel.exporters._tensorboard_layout", "sowtel.dashboard", "sowtel.dashboards",
    "sowtel.intermediates", "sowtel.compare", "sowtel._run_read",
    "sowtel.exporters._tensorboard_order",
    "sowtel._interpret", "sowtel._interpret_rules", "sowtel.alerts", "sowtel.tap",
    "sowtel.receiver", "sowtel._reductions", "sowtel.context", "sowtel.steps", "sowtel.sites",
    "sowtel._cond_rows", "sowtel.naming", "sowtel.errors", "sowtel.dispatcher._worker",
    "sowtel.dispatcher._ledger",
    "sowtel.exporters._tensorboard_events",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"
    if name in ("sowtel", "sowtel.primitive", "sowtel.capture", "sowtel.session", "sowtel.jit",
                "sowtel.to_records", "sowtel.locate", "sowtel.compare", "sowtel._run_read",
                "sowtel.alerts", "sowtel.tap", "sowtel.context", "sowtel.steps",
                "sowtel.sites"):
        assert result.attempted > 0
