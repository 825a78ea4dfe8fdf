"""Shared test set-up: 8 forced CPU devices (so shard_map and pmap run on one machine), the
repository root importable (tests reuse ``benchmarks/`` children and drivers), and the
dispatcher fixtures `release` and `made`."""

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from sowtel.dispatcher import Dispatcher  # noqa: E402


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event set at the end of the test: it lets hung exporter threads finish."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def made() -> Iterator[list[Dispatcher]]:
    """Dispatchers the test appends here are closed (bounded) at its end."""
    dispatchers: list[Dispatcher] = []
    yield dispatchers
    for d in dispatchers:
        d.close(timeout=5.0)
