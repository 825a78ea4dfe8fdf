"""Records, built in one place from whatever brought the values to the host.

- the host-callback transport hands over one site occurrence: its summary arrays and extras
  (step, shard index), and the session knows the occurrence count;
- ``sowtel.jit`` hands over a logging program's summary outputs: per site, its summary arrays
  stacked over the scans and shard_maps around it, and a flag saying where it ran;
- ``save_intermediates`` results (``sowtel.export``, dumps) are summarised on the host by
  :func:`records_from_intermediates`.

Both streaming transports decode in :func:`sowtel.to_records.site_columns`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from sowtel import naming
from sowtel.records import BASE_MODES, Record, record_index
from sowtel.summaries import check_summary, host_summary

__all__ = ["records_from_intermediates", "leaf_name",
           "program_order"]

# ----------------------------------------------------------------------------- intermediates


def leaf_name(site: str, leaf: tuple[Any, ...]) -> str:
    """The record name of a leaf: the site's name, then the leaf path, each key escaped by
    :func:`sowtel.naming.leaf_segment` (the same rule streaming names records by).

    Example:
      >>> leaf_name("params", ("w",)), leaf_name("pair", (0,)), leaf_name("h", ())
      ('params/w', 'pair/0', 'h')
    """
    return naming.leaf_name(site, leaf)


def program_order(site_index: int, mode: str, mode_index: int = 0) -> tuple[int, int, int]:
    """A sort key that puts captured values in the order the program computed them.

    Sites are numbered in program order (the order of ``save_intermediates``' dict). Values
    without a cotangent (primal, tangent) are computed in the forward pass, in site order; each
    reverse pass runs after the one before it and walks the sites the other way, so modes with
    one ``cotangent`` component come next in reverse site order, two in site order again, and so
    on. ``mode_index`` orders the modes of one site within the same pass.

    Example:
      >>> entries = [(0, "primal"), (0, "cotangent"), (1, "primal"), (1, "cotangent")]
      >>> sorted(entries, key=lambda e: program_order(*e))
      [(0, 'primal'), (1, 'primal'), (1, 'cotangent'), (0, 'cotangent')]
    """
    passes = mode.split(".").count("cotangent")
    return (passes, site_index if passes % 2 == 0 else -site_index, mode_index)



def _check_mode(mode: Any, where: str) -> str:
    parts = mode.split(".") if isinstance(mode, str) else None
    if not parts or any(p not in BASE_MODES for p in parts):
        raise ValueError(
            f"{where}: mode {mode!r} is not a mode: use one of {', '.join(BASE_MODES)} or a "
            "composition of them joined by '.' (such as 'cotangent.tangent')"
        )
    return str(mode)


def _check_intermediates(intermediates: Any, what: str) -> Mapping[str, Mapping[str, Any]]:
    if not isinstance(intermediates, Mapping):
        raise TypeError(
            f"{what} must be a dict {{name: {{mode: value}}}} as returned by "
            f"sowtel.save_intermediates, got {type(intermediates).__name__}"
        )
    for name, modes in intermediates.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{what}: site name {name!r} must be a non-empty string")
        if not isinstance(modes, Mapping):
            raise TypeError(
                f"{what}[{name!r}] must be a dict {{mode: value}} such as "
                f"{{'primal': x}}, got {type(modes).__name__}: pass the intermediates exactly "
                "as sowtel.save_intermediates returns them"
            )
        for mode in modes:
            _check_mode(mode, f"{what}[{name!r}]")
    return intermediates


def _check_step(step: Any, what: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"{what}={step!r} must be an int (the training step)")
    return int(step)



def _is_leaf(x: Any) -> bool:
    if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        return True
    # jax.Array and other array-likes, recognised without importing jax.
    return hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype")



def _site_leaves(value: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """(leaf path, leaf) pairs of a sown value; dict/list/tuple in stored order, else jax's."""
    out: list[tuple[tuple[Any, ...], Any]] = []

    def walk(x: Any, leaf: tuple[Any, ...]) -> None:
        if x is None:
            return
        if type(x) is dict:
            for k, v in x.items():
                walk(v, (*leaf, k))
        elif type(x) is list or type(x) is tuple:
            for i, v in enumerate(x):
                walk(v, (*leaf, i))
        elif _is_leaf(x):
            out.append((leaf, x))
        else:
            # Registered pytree nodes (namedtuples, flax structs, dataclasses): jax knows them.
            import jax

            for kp, v in jax.tree_util.tree_flatten_with_path(x)[0]:
                walk(v, (*leaf, *(_key_part(k) for k in kp)))

    walk(value, ())
    return out


def _key_part(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def _stacking(modes: Any) -> dict[str, tuple[tuple[str, int], ...]]:
    """``{mode: stacked axes}`` of a site's modes dict (empty for a plain dict)."""
    stacked = getattr(modes, "stacked", None)
    return dict(stacked) if isinstance(stacked, dict) else {}


def _stack_indices(
    axes: tuple[tuple[str, int], ...], shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], int | tuple[int, ...]]] | None:
    """``(position, record index)`` for each element of a stack, or None when not stacked.

    The record index is the one streaming gives (:func:`sowtel.records.record_index`); listed
    in index order. None when ``shape`` does not start with the stacked axes (a ``vmap``
    around ``save_intermediates`` puts its batch axis first).
    """
    lengths = tuple(n for _, n in axes)
    if not axes or tuple(shape[:len(axes)]) != lengths:
        return None
    out: list[tuple[tuple[int, ...], int | tuple[int, ...]]] = []
    for pos in np.ndindex(*lengths):
        index = record_index([(kind, n, i) for (kind, n), i in zip(axes, pos, strict=True)])
        assert index is not None  # axes is not empty
        out.append((pos, index))
    return out


def _process_index() -> int:
    try:
        import jax

        return int(jax.process_index())
    except Exception:  # no backend: records made on a plain host are process 0
        return 0


def _host_value(x: Any, site: str, mode: str, leaf: tuple[Any, ...]) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True) is False:
        raise ValueError(
            f"intermediates[{site!r}][{mode!r}]{''.join(f'[{p!r}]' for p in leaf)} is a "
            f"jax.Array of global shape {tuple(x.shape)} spanning the devices of several "
            "processes, which no host holds whole: stream it (sowtel.jit, or enable() with "
            "jax.jit), or sowtel.dump it in every process and sowtel.load the parts in one")
    return np.asarray(x)


def records_from_intermediates(
    intermediates: Mapping[str, Mapping[str, Any]],
    *,
    step: int,
    summary: str = "stats",
    tag: str = "intermediates",
) -> list[Record]:
    """Turns a ``save_intermediates`` result into the records streaming would produce.

    One record per array leaf, in the order the program computed them (see
    :func:`program_order`: the forward pass in site order, then cotangents in reverse site
    order), numbered by ``seq`` in that order; a pytree sown at one site gives records named
    ``name/<leaf path>`` (``"pair/0"``, ``"params/w"``). Summaries are computed on the host with
    :func:`sowtel.summaries.host_summary`, the same definitions the device uses. A value stacked
    by ``scan`` or ``shard_map`` (see :attr:`sowtel.Intermediates.stacked`) gives one record per
    iteration and shard, in index order, with the ``index`` streaming gives them; a value
    whose leading axes do not match its stacking (under a ``vmap`` of ``save_intermediates``)
    gives one record for the whole stack (``index=None``).
    :func:`sowtel.export` calls this and hands the records to the active exporters.

    Example:
      >>> import numpy as np
      >>> recs = records_from_intermediates(
      ...     {"pair": {"primal": (np.array([1.0, 3.0]), np.array(2))}}, step=5)
      >>> [(r.name, r.step, r.stats["mean"]) for r in recs]
      [('pair/0', 5, 2.0), ('pair/1', 5, 2.0)]
    """
    _check_intermediates(intermediates, "intermediates")
    for name in intermediates:
        naming.check_name(name)  # the rule of sow names: records are named by it
    step = _check_step(step)
    check_summary(summary)
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag={tag!r} must be a non-empty string")
    wall_time = time.time()
    process_index = _process_index()
    values = [
        (program_order(i, mode, j), site, mode, value, _stacking(modes).get(mode, ()))
        for i, (site, modes) in enumerate(intermediates.items())
        for j, (mode, value) in enumerate(modes.items())
    ]
    values.sort(key=lambda v: v[0])
    records: list[Record] = []
    for _, site, mode, value, axes in values:
        leaves = [(leaf, _host_value(x, site, mode, leaf)) for leaf, x in _site_leaves(value)]
        stacks = [_stack_indices(axes, arr.shape) for _, arr in leaves]
        # One record per leaf and element of the stack, a stack's leaves together (as streaming
        # sends them); leaves that are not stacked as their site says come whole, after them.
        positions = next((s for s in stacks if s is not None), [])
        parts: list[tuple[tuple[Any, ...], np.ndarray, int | tuple[int, ...] | None]] = [
            (leaf, np.asarray(arr[pos]), index)
            for pos, index in positions
            for (leaf, arr), stack in zip(leaves, stacks, strict=True) if stack is not None
        ]
        parts += [(leaf, arr, None)
                  for (leaf, arr), stack in zip(leaves, stacks, strict=True) if stack is None]
        for leaf, arr, index in parts:
            s = host_summary(arr, summary)
            records.append(Record(
                name=leaf_name(site, leaf), mode=mode, tag=tag, step=step, index=index,
                wall_time=wall_time, summary=summary, shape=tuple(arr.shape),
                dtype=arr.dtype.name, value=arr if summary == "full" else None,
                stats=s["stats"], histogram=s["histogram"], process_index=process_index,
                seq=len(records),
            ))
    return records
