"""Multi-process training: sowtel under ``jax.distributed``, one coherent set of records.

JAX's multi-controller runtime runs one Python process per host; every process runs the same
program over a global mesh of devices. sowtel keeps the records of such a job coherent:

- A site whose value is sharded across processes (plain code or a ``scan`` under sharded
  ``jit``) gives **one global record** per occurrence, its statistics reduced on the devices
  over the whole global value (only the summary crosses to a host, never the value), exported
  by the export process alone (process 0 unless ``enable(export_process=k)`` or
  ``$SOWTEL_EXPORT_PROCESS``). Each device summarises its block of the value and the blocks'
  summaries are gathered and merged on the devices: with ``enable()`` + ``jax.jit`` one
  all-gather a site, the host callback then running on the export process's first device;
  with :func:`sowtel.jit` one all-gather a step for all such sites, the export process alone
  turning the (replicated) summaries into records.
- A site inside ``shard_map`` gives **one record per shard**, with the global shard index as
  ``Record.index``, exported by the process whose device ran the shard, and that process's
  ``Record.process_index``.
- :func:`sowtel.enable` is a collective: each process publishes its streaming settings through
  the ``jax.distributed`` coordinator and waits (``SOWTEL_PEER_TIMEOUT`` seconds, 60 by
  default) for every other process's. Different settings raise ``ValueError`` in every
  process; a process that never enables makes the others raise ``RuntimeError`` when the wait
  ends, instead of running programs whose collectives would never meet.
- :func:`initialize` is ``jax.distributed.initialize`` that first checks, within a bounded
  time, that the coordinator can be reached, so a wrong address is a clear error rather than a
  wait of minutes.

Example (one process is a job of one, where all of this is a no-op):
    >>> import sowtel
    >>> from sowtel import multihost
    >>> multihost.agree({"summary": "stats"}, what="enable")
    >>> multihost.peer_timeout()
    60.0
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sowtel import _exit, errors
from sowtel import _jax_compat as jc
from sowtel.records import DEVICE_COUNTS, DEVICE_MOMENTS, MOMENT_COL

__all__ = ["initialize", "agree", "peer_timeout", "fetch", "owns", "spans_processes",
           "replicated_sharding", "gather_full_values", "partial_summaries",
           "combine_partials", "merge_partials", "check_export_process",
           "PEER_TIMEOUT_ENV", "DEFAULT_PEER_TIMEOUT", "EXPORT_PROCESS_ENV"]

logger = logging.getLogger("sowtel")

#: Seconds a process waits for the others at :func:`agree` (and :func:`initialize`).
PEER_TIMEOUT_ENV = "SOWTEL_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 60.0

#: The process that exports records of values spanning processes, when enable() names none.
EXPORT_PROCESS_ENV = "SOWTEL_EXPORT_PROCESS"

_ENV_ADDRESS = "SOWTEL_COORDINATOR_ADDRESS"
_ENV_COUNT = "SOWTEL_NUM_PROCESSES"
_ENV_ID = "SOWTEL_PROCESS_ID"

_rounds: dict[str, itertools.count[int]] = {}
_rounds_lock = threading.Lock()


def _renew_lock() -> None:
    global _rounds_lock
    _rounds_lock = threading.Lock()  # in a forked child; a parent thread may have held it


_exit.after_fork(_renew_lock)
_warned_unowned = False


def peer_timeout() -> float:
    """Seconds to wait for the other processes: ``SOWTEL_PEER_TIMEOUT``, else 60."""
    raw = os.environ.get(PEER_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_PEER_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise errors.BadOptionError(
            PEER_TIMEOUT_ENV, raw, "must be a number of seconds > 0, such as 60")
    return value


def spans_processes() -> bool:
    """Whether this JAX runtime has more than one process (``jax.distributed`` initialised)."""
    return int(jax.process_count()) > 1


# -- launching ------------------------------------------------------------------------------


def _from_env(value: Any, env: str, what: str) -> Any:
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None:
        raise errors.BadOptionError(f"sowtel.multihost.initialize: {what}", None,
                                    f"is not given: pass {what}= or set {env}")
    return raw


def _int(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < 0 or str(number) != str(value).strip():
        raise errors.BadOptionError(
            f"sowtel.multihost.initialize: {what}", value, "must be an int >= 0")
    return number


def _split_address(address: Any) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.BadOptionError(
            "sowtel.multihost.initialize: coordinator_address", address, "must be "
            "'host:port', such as '10.0.0.1:1234' (process 0 listens there)")
    return host.strip("[]"), int(port)


def _wait_reachable(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(
                f"sowtel.multihost.initialize: the coordinator {host}:{port} did not accept a "
                f"connection within {timeout:g} s ({last}): start process 0 (it hosts the "
                f"coordinator) and check the address and port; {PEER_TIMEOUT_ENV} sets the "
                "wait")
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.2, max(left, 0)))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout: float | None = None,
               **jax_options: Any) -> None:
    """``jax.distributed.initialize`` with a bounded check that the coordinator is reachable.

    Arguments left out are read from ``SOWTEL_COORDINATOR_ADDRESS`` (``host:port``),
    ``SOWTEL_NUM_PROCESSES`` and ``SOWTEL_PROCESS_ID``. Processes other than 0 first connect to
    the coordinator's port (process 0 starts it), for ``timeout`` seconds at most (default
    ``SOWTEL_PEER_TIMEOUT``, else 60), and the same bound is JAX's ``initialization_timeout``;
    other keyword arguments go to ``jax.distributed.initialize``.

    Raises:
      ValueError: a missing or malformed address, count or id.
      ConnectionError: the coordinator did not accept a connection in time.

    Example (a job of one process; a real job runs this in each process with its own id):
        >>> from sowtel import multihost
        >>> multihost.initialize("127.0.0.1:1234", 2, 5)
        Traceback (most recent call last):
        ...
        sowtel.errors.BadOptionError: sowtel.multihost.initialize: process_id=5 must be below ...
    """
    address = str(_from_env(coordinator_address, _ENV_ADDRESS, "coordinator_address"))
    count = _int(_from_env(num_processes, _ENV_COUNT, "num_processes"), "num_processes")
    pid = _int(_from_env(process_id, _ENV_ID, "process_id"), "process_id")
    if count < 1:
        raise errors.BadOptionError("sowtel.multihost.initialize: num_processes", count,
                                    "must be >= 1")
    if pid >= count:
        raise errors.BadOptionError("sowtel.multihost.initialize: process_id", pid,
                                    f"must be below num_processes={count}")
    host, port = _split_address(address)
    wait = peer_timeout() if timeout is None else float(timeout)
    if not (math.isfinite(wait) and wait > 0):
        raise errors.BadOptionError(
            "sowtel.multihost.initialize: timeout", timeout, "must be seconds > 0")
    if pid != 0:
        _wait_reachable(host, port, wait)
    jax_options.setdefault("initialization_timeout", max(1, math.ceil(wait)))
    jax.distributed.initialize(coordinator_address=address, num_processes=count,
                               process_id=pid, **jax_options)


# -- agreeing on settings ---------------------------------------------------------------------


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        items = [_describe(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    patterns = getattr(value, "patterns", None)
    if isinstance(patterns, tuple):  # a Globs filter
        return {"patterns": list(patterns)}
    if callable(value):
        return {"callable": f"{getattr(value, '__module__', '?')}."
                            f"{getattr(value, '__qualname__', type(value).__name__)}"}
    return repr(value)


def check_export_process(value: Any) -> int:
    """``enable(export_process=)``: ``value``, else ``$SOWTEL_EXPORT_PROCESS``, else 0, checked
    to be a process of this job.

    Example:
        >>> check_export_process(None)
        0
        >>> try:
        ...     check_export_process(3)
        ... except ValueError as e:
        ...     print(e)
        export_process=3 must be a process of this job: 0 <= export_process < 1
    """
    where = "export_process"
    if value is None:
        env = os.environ.get(EXPORT_PROCESS_ENV, "").strip()
        if not env:
            return 0
        where = f"${EXPORT_PROCESS_ENV}"
        try:
            value = int(env)
        except ValueError:
            raise errors.BadOptionError(
                where, env, "must be an int: the index of the process that "
                "exports global records") from None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.BadOptionError(where, value, "must be an int: the index of the process that "
                                    "exports global records")
    count = jax.process_count()
    if not 0 <= int(value) < count:
        raise errors.BadOptionError(where, value, f"must be a process of this job: "
                                    f"0 <= export_process < {count}")
    return int(value)


def agree(settings: dict[str, Any], *, what: str) -> None:
    """Checks that every process calls ``what`` (``"enable"``) with the same ``settings``.

    A no-op in a job of one process. Otherwise the n-th call in each process publishes its
    settings through the coordinator's key-value store and waits, up to :func:`peer_timeout`
    seconds in all, for the n-th call of every other process.

    Raises:
      ValueError: another process called it with different settings (raised in every process).
      RuntimeError: another process did not call it in time, or the coordinator is gone.
    """
    if not spans_processes():
        return
    client = jc.distributed_client()
    if client is None:  # processes without the coordinator's store: nothing to check with
        return
    me, count = int(jax.process_index()), int(jax.process_count())
    with _rounds_lock:
        n = next(_rounds.setdefault(what, itertools.count()))
    mine = _describe(settings)
    timeout = peer_timeout()
    prefix = f"sowtel/{what}/{n}"
    try:
        client.key_value_set(f"{prefix}/{me}", json.dumps(mine, sort_keys=True))
    except Exception as e:  # noqa: BLE001 - the runtime's error types differ across versions
        raise RuntimeError(
            f"sowtel.{what}(): could not reach the jax.distributed coordinator to check that "
            f"every process {what}s with the same settings: {e}") from None
    deadline = time.monotonic() + timeout
    for other in range(count):
        if other == me:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            raw = client.blocking_key_value_get(f"{prefix}/{other}", left_ms)
        except Exception as e:  # noqa: BLE001 - a deadline or a lost coordinator
            raise RuntimeError(
                f"sowtel.{what}(): process {other} did not call sowtel.{what}() within "
                f"{timeout:g} s of process {me} (call number {n} in this process; {e}). In a "
                f"multi-process job every process must call sowtel.{what}() with the same "
                "settings at the same point, because the programs they run together must "
                f"match; set {PEER_TIMEOUT_ENV} to wait longer") from None
        theirs = json.loads(raw)
        if theirs != mine:
            differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            detail = "; ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} in process "
                               f"{other}" for k in differ)
            raise errors.MismatchedProcessesError(what, me, other, detail)


# -- fetching sowtel.jit summaries ------------------------------------------------------------


def replicated_sharding(tree: Any) -> Any:
    """With several processes: a replicated sharding on the mesh of ``tree``'s first array that
    has a ``NamedSharding`` (``None`` in a job of one process, or when there is none)."""
    if not spans_processes():
        return None
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec())
    return None


# A block summary: the device's moments and counts side by side (THE layout: sowtel.records).
_PARTIAL = len(DEVICE_MOMENTS) + len(DEVICE_COUNTS)


def partial_summaries(leaves: Sequence[Any], summary: str, bins: int,
                      replicated: Any) -> list[Any] | None:
    """Inside a logging program: the first level of a global ``stats`` summary of each leaf.

    With several processes, each of the mesh's ``P`` devices summarises one of ``P`` equal
    blocks of a leaf's flattened value (its own shard, when the value is sharded along its
    leading axis) into 10 numbers: a ``(P, 10)`` array per leaf, still on the devices.
    :func:`combine_partials` then gathers every site's blocks in one transfer and finishes the
    summaries. On XLA's CPU backend, which runs each cross-process all-reduce on its own, this
    replaces about eight all-reduces a site by one all-gather a step.

    ``None`` (use ``device_summary``) for other summaries, for a leaf that does not split into
    ``P`` blocks, and inside ``shard_map`` (where a value is already one device's).
    """
    import jax.numpy as jnp

    from sowtel.summaries import apart, device_summary, reads_copy

    parts = int(replicated.mesh.size) if replicated is not None else 1
    sizes = [int(np.prod(v.shape, dtype=np.int64)) for v in leaves]
    if (summary != "stats" or parts <= 1 or not leaves or any(n == 0 or n % parts for n in sizes)
            or jc.manual_axes()):
        return None
    out = []
    for v, n in zip(leaves, sizes, strict=True):
        # The copy before the reshape, which may move data between devices: XLA must not
        # write the value out of the program's own fusions for it (see summaries.apart).
        rows = jnp.reshape(apart(v) if reads_copy() else v, (parts, n // parts))
        moments, counts = jax.vmap(lambda r: tuple(device_summary(r, "stats", bins)))(rows)
        out.append(jnp.concatenate([moments, counts.astype(moments.dtype)], axis=1))
    return out


def merge_partials(partial: Any) -> tuple[Any, Any]:
    """The ``stats`` arrays ``[moments(6), counts(4)]`` of ``P`` block summaries
    ``(..., P, 10)`` (:func:`sowtel.summaries.device_summary`'s, side by side): counts add,
    extrema take the extremum over the blocks with finite elements, means (of the value and of
    ``|x|``) and variances merge weighted by the blocks' counts (Chan et al.), the variances
    divided by the power of two below the largest magnitude so that no square overflows.

    Example (the blocks [1, 3] and [5, 7] of [1, 3, 5, 7]):
        >>> import jax, jax.numpy as jnp
        >>> from sowtel.summaries import device_summary
        >>> rows = jnp.array([[1.0, 3.0], [5.0, 7.0]])
        >>> moments, counts = jax.vmap(lambda r: tuple(device_summary(r, "stats", 8)))(rows)
        >>> merged, _ = merge_partials(jnp.concatenate([moments, counts.astype(moments.dtype)],
        ...                                            1))
        >>> [round(float(v), 4) for v in merged]  # mean, std, min, max, n, mean |x|
        [4.0, 2.2361, 1.0, 7.0, 4.0, 4.0]
    """
    import jax.numpy as jnp

    ftype = partial.dtype
    mean_r, std_r, min_r, max_r, n_r, abs_r = (
        partial[..., MOMENT_COL[k]] for k in ("mean", "std", "min", "max", "n", "mean_abs"))
    has = n_r > 0
    n = jnp.sum(n_r, axis=-1)
    w = jnp.where(has, n_r / jnp.maximum(n, 1)[..., None], 0)
    mean = jnp.sum(jnp.where(has, w * mean_r, 0), axis=-1)
    big = jnp.max(jnp.where(has, jnp.maximum(jnp.abs(min_r), jnp.abs(max_r)), 0), axis=-1)
    _, exponent = jnp.frexp(jnp.where(big > 0, big, 1))
    scale = jnp.ldexp(jnp.ones((), ftype), exponent - 1)[..., None]
    dev = jnp.where(has, (mean_r - mean[..., None]) / scale, 0)
    sd = jnp.where(has, std_r / scale, 0)
    std = jnp.sqrt(jnp.sum(w * (sd * sd + dev * dev), axis=-1)) * scale[..., 0]
    merged = {"mean": mean, "std": std, "min": jnp.min(jnp.where(has, min_r, jnp.inf), axis=-1),
              "max": jnp.max(jnp.where(has, max_r, -jnp.inf), axis=-1), "n": n,
              "mean_abs": jnp.sum(jnp.where(has, w * abs_r, 0), axis=-1)}
    moments = jnp.stack([merged[k] for k in DEVICE_MOMENTS], axis=-1).astype(ftype)
    counts = jnp.sum(partial[..., len(DEVICE_MOMENTS):_PARTIAL], axis=-2).astype(jnp.int32)
    return moments, counts


def combine_partials(caps: list[Any], orders: set[int], replicated: Any) -> list[Any]:
    """Inside a logging program: the captured sites, with the block summaries of the sites in
    ``orders`` (see :func:`partial_summaries`) gathered, one transfer per dtype, and combined
    into the arrays ``device_summary`` gives."""
    import jax.numpy as jnp

    picks = [(i, j) for i, c in enumerate(caps) if c.site.order in orders
             for j in range(len(c.leaves) - 1)]  # the last leaf is the "ran" flag
    if not picks:
        return caps
    parts = int(replicated.mesh.size)
    by_dtype: dict[str, list[tuple[int, int]]] = {}
    for i, j in picks:
        by_dtype.setdefault(str(caps[i].leaves[j].dtype), []).append((i, j))
    gathered: dict[tuple[int, int], Any] = {}
    for group in by_dtype.values():
        flat = [caps[i].leaves[j].reshape(-1, parts, _PARTIAL) for i, j in group]
        together = jax.lax.with_sharding_constraint(jnp.concatenate(flat, 0), replicated)
        at = 0
        for (i, j), f in zip(group, flat, strict=True):
            lead = caps[i].leaves[j].shape[:-2]
            gathered[(i, j)] = together[at:at + f.shape[0]].reshape(*lead, parts, _PARTIAL)
            at += f.shape[0]
    out = list(caps)
    for i, c in enumerate(caps):
        if c.site.order not in orders:
            continue
        leaves: list[Any] = []
        for j in range(len(c.leaves) - 1):
            leaves.extend(merge_partials(gathered[(i, j)]))
        out[i] = c.with_leaves([*leaves, c.leaves[-1]])
    return out


def gather_full_values(sites: Sequence[Any], arrays: list[Any], replicated: Any) -> list[Any]:
    """Inside a logging program: the ``full`` values of sites outside ``shard_map`` made
    replicated on ``replicated`` (a value sharded across processes would otherwise be held
    in parts that no process can export whole)."""
    if replicated is None:
        return arrays
    out = list(arrays)
    at = 0
    for entry in sites:
        if entry.site.summary == "full" and all(k != "shard" for k, _ in entry.stacked):
            for i in range(at, at + entry.n_arrays - 1):  # the last one is the "ran" flag
                out[i] = jax.lax.with_sharding_constraint(out[i], replicated)
        at += entry.n_arrays
    return out


@functools.lru_cache(maxsize=4096)
def _exporter_of(sharding: Any, shape: tuple[int, ...], prefer: int) -> np.ndarray:
    low = np.full(shape, np.iinfo(np.int32).max, np.int32)
    held = np.zeros(shape, bool)
    for device, index in sharding.devices_indices_map(shape).items():
        low[index] = np.minimum(low[index], int(device.process_index))
        if device.process_index == prefer:
            held[index] = True
    out = np.where(held, np.int32(prefer), low)
    out.flags.writeable = False
    return out


def _exporter(array: Any, prefer: int) -> np.ndarray:
    """Per element of ``array``: ``prefer`` where one of its devices holds the element, else
    the lowest process index holding it."""
    # The same few shardings every step: computed once each.
    return _exporter_of(array.sharding, tuple(array.shape), prefer)


def _whole(index: tuple[Any, ...], shape: tuple[int, ...]) -> bool:
    return all(i.indices(n) == (0, n, 1) for i, n in zip(index, shape, strict=True))


def _local_value(array: Any) -> np.ndarray:
    """The global value of ``array`` with the elements this process holds (zeros elsewhere)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    shape = tuple(array.shape)
    shards = array.addressable_shards
    for shard in shards:  # a replicated summary: one copy is the whole value
        if _whole(shard.index, shape):
            return np.asarray(shard.data)
    out = np.zeros(shape, array.dtype)
    for shard in shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def fetch(arrays: Sequence[Any], export_process: int = 0
          ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Host copies of a logging step's summary arrays, and per array who exports what.

    In a job of one process the second result is ``None``: everything is exported. Otherwise it
    holds, per array and element, the process that exports it (see :func:`owns`):
    ``export_process`` where that process holds the element (every element of a replicated
    global summary), else the lowest process holding it (a ``shard_map`` shard's summary,
    held by the process that ran the shard). The values of elements held only by other
    processes are zeros here.
    """
    if not spans_processes():
        return [np.asarray(a) for a in jax.device_get(list(arrays))], None
    return [_local_value(a) for a in arrays], [_exporter(a, export_process) for a in arrays]


#: Summaries of sowtel.jit steps that no single process held whole, so none exported them:
#: counted (``status()["split_unexported"]``, process-wide), never dropped silently.
SPLIT_UNEXPORTED = [0]


def owns(lowest: Sequence[np.ndarray], pos: tuple[int, ...], process_index: int) -> bool:
    """Whether ``process_index`` exports the records at ``pos`` of one site's summary arrays.

    ``lowest`` is :func:`fetch`'s second result. A position is exported by the process that
    exports every element of its summary: the export process (0 by default) for a replicated
    global summary, the process whose device ran a ``shard_map`` shard for that shard's
    summary; by none when its elements are split between processes (counted).
    """
    global _warned_unowned
    owners = {int(v) for low in lowest for v in np.ravel(low[pos])}
    if len(owners) != 1:  # split across processes: no process holds the whole summary
        if process_index == min(owners):  # counted once in the job, by its lowest holder
            SPLIT_UNEXPORTED[0] += 1
        if not _warned_unowned:
            _warned_unowned = True
            logger.warning("sowtel: a summary of a sowtel.jit step is split across processes "
                           "%s and was not exported (a full value of a site sharded across "
                           "processes, with no NamedSharding among the step's arguments to "
                           "gather it on)", sorted(owners))
        return False
    return owners == {process_index}
