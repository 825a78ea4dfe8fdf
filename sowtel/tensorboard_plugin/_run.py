"""One run as the plugin's routes read it: its sites, and their series, bounded per request.

Every answer is bounded whatever the event files hold: a series has at most ``max_steps``
steps (TensorBoard's own downsampling, which keeps the last step), a depth table at most
``limit`` positions from ``offset`` on, and never more than :data:`MAX_CELLS` cells. A file
that does not hold what the exporter writes (a crafted or damaged one) is read around: a tag or
a point that cannot be understood is skipped, never a reason for a failed request. A tensor
whose shape claims more values than its file stores is refused before TensorBoard expands it
(a 100-byte tensor of shape ``[2, 50000000]`` would take gigabytes), so the memory a request
takes stays in proportion to what the event files hold.

Example:
    >>> check_bound({"max_steps": "50"}, "max_steps", 1000, 5000)
    50
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sowtel.records import COUNT_STATS, mode_order

__all__ = ["BadRequest", "RunIndex", "SiteInfo", "Points", "DepthBlock", "DepthCache",
           "check_bound",
           "auto_stat", "MAX_CELLS"]

#: The most cells (steps x positions) one depth answer may hold.
MAX_CELLS = 2_000_000
# A scalar tag of one scan position: {name}[i]/{mode}/{stat} or {name}[i,j]/{mode}/{stat}, with
# at most 8 indices (as a depth tensor's index rows) of at most 18 digits (an int64).
_INDEX = r"[0-9]{1,18}(?:,[0-9]{1,18}){0,7}"
_INDEXED_TAG = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<index>" + _INDEX + r")\]"
                          r"/(?P<mode>[^/\[\]]+)/(?P<stat>[a-z_0-9]+)$")
# A plain scalar tag {name}/{mode}/{stat}, mode being primal/tangent/cotangent or a composition.
_MODE = r"(?:primal|tangent|cotangent)(?:\.(?:tangent|cotangent))*"
_PLAIN_TAG = re.compile(r"^(?P<name>[^\[\]]+)/(?P<mode>" + _MODE + r")/(?P<stat>[a-z_0-9]+)$")
_MODE_ONLY = re.compile("^" + _MODE + "$")
# The one number in a path segment that makes a family of repeats: block12/attn, attn_3 (a
# longer run of digits than an int64 holds is part of a name, not a number).
_NUMBERED = re.compile(r"(?<![0-9])([0-9]{1,18})(?![0-9])")
# The mode and statistic of a scalar of sowtel.log (its name is the tag itself).
LOGGED = "value"
# Index rows of a depth tensor hold small non-negative integers.
_MAX_INDEX = 2 ** 31
# The fields of a TensorProto that store its values one by one (tensor_content aside).
_VALUE_FIELDS = ("half_val", "float_val", "double_val", "int_val", "string_val", "scomplex_val",
                 "int64_val", "bool_val", "dcomplex_val", "uint32_val", "uint64_val")


class BadRequest(ValueError):
    """A query the plugin cannot answer: its message is the 400 answer's ``error``."""


def check_bound(args: Any, key: str, default: int, most: int, least: int = 1) -> int:
    """The integer query parameter ``key`` (``default`` when absent), within its bounds."""
    raw = args.get(key)
    if raw in (None, ""):
        return default
    try:
        value = int(str(raw))
    except ValueError:
        raise BadRequest(f"{key}={raw!r} is not a whole number: pass {least} to {most}, or "
                         f"leave it out for {default}") from None
    if not least <= value <= most:
        raise BadRequest(f"{key}={value} is out of range: pass {least} to {most}, or leave it "
                         f"out for {default}")
    return value


def family_of(name: str) -> tuple[str, int] | None:
    """A site of numbered repeats as ``(family, number)``, else None: the last number in the
    name becomes ``*``, so ``block0/attn`` ... ``block47/attn`` form ``block*/attn``.

    Example:
        >>> family_of("block12/attn"), family_of("loss")
        (('block*/attn', 12), None)
    """
    matches = list(_NUMBERED.finditer(name))
    if not matches:
        return None
    m = matches[-1]
    return name[:m.start()] + "*" + name[m.end():], int(m.group(1))


def auto_stat(mode: str, stats: Iterable[str]) -> str | None:
    """The statistic shown when none is asked for: a value's spread (``std``), a derivative's
    magnitude (``l2``), the number itself for a site that is one number.

    Example:
        >>> auto_stat("primal", ["mean", "std"]), auto_stat("cotangent", ["std", "l2"])
        ('std', 'l2')
        >>> auto_stat("primal", ["mean"]), auto_stat("value", ["value"])
        ('mean', 'value')
    """
    have = [k for k in stats if k not in COUNT_STATS and k != "size"]
    for k in ((LOGGED,) if mode == LOGGED else ("std", "mean") if mode == "primal"
              else ("l2", "std", "mean")):
        if k in have:
            return k
    return sorted(have)[0] if have else None


@dataclasses.dataclass
class SiteInfo:
    """What the run's tags say of one site: its kind, modes, statistics and positions."""

    site: str
    kind: str  # "scan", "repeat", "plain" or "logged"
    stats: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # mode -> stats
    positions: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    members: dict[int, str] = dataclasses.field(default_factory=dict)  # repeat: number -> name
    depth: dict[str, tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    order: int | None = None  # from a depth tensor's metadata

    def add(self, mode: str, stats: Iterable[str]) -> None:
        self.stats.setdefault(mode, set()).update(stats)

    @property
    def modes(self) -> list[str]:
        return sorted(self.stats, key=mode_order)

    def describe(self) -> dict[str, Any]:
        """The ``sites`` route's entry."""
        stats = sorted({k for s in self.stats.values() for k in s} - {"size"})
        return {"site": self.site, "kind": self.kind, "modes": self.modes, "stats": stats,
                "stats_by_mode": {m: sorted(self.stats[m] - {"size"}) for m in self.modes},
                "positions": len(self.positions) or len(self.members) or None}


class RunIndex:
    """The sites of one run, from its tags (no data read but the layout's last version).

    ``provider`` is TensorBoard's data provider; ``read`` its reads bound to the request's
    context and experiment, and ``plugin_name`` the name of sowtel's tensors.
    """

    def __init__(self, provider: Any, ctx: Any, eid: str, run: str, plugin_name: str,
                 parse_content: Callable[[Any], dict[str, Any]], depth_suffix: str,
                 nonfinite_tag: str, cache: DepthCache | None = None) -> None:
        from tensorboard.data import provider as tb_provider

        self._provider, self._ctx, self._eid, self.run = provider, ctx, eid, run
        self._cache = cache if cache is not None else DepthCache()
        self._versions: dict[str, tuple[Any, ...]] = {}
        self._filter = tb_provider.RunTagFilter
        self._plugin = plugin_name
        self.nonfinite_tag = nonfinite_tag
        tensors = dict(provider.list_tensors(
            ctx, experiment_id=eid, plugin_name=plugin_name,
            run_tag_filter=self._filter(runs=[run])).get(run, {}))
        self.scalar_tags = set(provider.list_scalars(
            ctx, experiment_id=eid, plugin_name="scalars",
            run_tag_filter=self._filter(runs=[run])).get(run, {}))
        self.has_tensors = bool(tensors)
        self.has_nonfinite = nonfinite_tag in tensors
        self.sites: dict[str, SiteInfo] = {}
        #: Tags that are not what the exporter writes, skipped: ``[(tag, why), ...]``.
        self.skipped: list[tuple[str, str]] = []
        for tag, series in tensors.items():
            if tag == nonfinite_tag or not tag.endswith(depth_suffix):
                continue
            name, _, mode = tag[:-len(depth_suffix)].rpartition("/")
            if not name or not _MODE_ONLY.match(mode) or "[" in name or "]" in name:
                self.skipped.append((tag, "not {site}/{mode}/depth"))
                continue
            try:
                meta = parse_content(series.plugin_content)
            except ValueError as e:
                self.skipped.append((tag, str(e)))
                continue
            site = self._site(name, "scan")
            self._versions[tag] = (eid, run, tag, series.max_step, series.max_wall_time)
            stats = set(meta["stats"])
            site.add(mode, stats | ({"max_abs"} if {"min", "max"} <= stats else set()))
            site.depth[mode] = (tag, meta)
            if "order" in meta and (site.order is None or meta["order"] < site.order):
                site.order = meta["order"]
        plain: dict[str, dict[str, set[str]]] = {}
        for tag in self.scalar_tags:
            m = _INDEXED_TAG.match(tag)
            if m and _MODE_ONLY.match(m["mode"]):
                site = self._site(m["name"], "scan")
                site.add(m["mode"], [m["stat"]])
                site.positions.add(tuple(int(i) for i in m["index"].split(",")))
                continue
            m = _PLAIN_TAG.match(tag)
            if m:
                plain.setdefault(m["name"], {}).setdefault(m["mode"], set()).add(m["stat"])
            elif "[" not in tag and not tag.startswith("sowtel/"):
                self._site(tag, "logged").add(LOGGED, [LOGGED])
        families: dict[str, dict[int, str]] = {}
        for name in plain:
            fam = family_of(name)
            if fam is not None and name not in self.sites:
                families.setdefault(fam[0], {})[fam[1]] = name
        for name, modes in plain.items():
            if self.sites.get(name, SiteInfo(name, "")).kind == "scan":
                continue  # the headline curve of a scanned site
            fam = family_of(name)
            if fam is not None and len(families.get(fam[0], ())) >= 2:
                site = self._site(fam[0], "repeat")
                site.members[fam[1]] = name
            else:
                site = self._site(name, "plain")
            for mode, stats in modes.items():
                site.add(mode, stats)
        self._ranks = self._program_ranks()

    def _site(self, name: str, kind: str) -> SiteInfo:
        site = self.sites.get(name)
        if site is None:
            site = self.sites[name] = SiteInfo(name, kind)
        elif site.kind != kind and kind == "scan":
            site.kind = kind  # a scanned site's headline curve was seen first
        return site

    def _program_ranks(self) -> dict[str, int]:
        """Each site's place in the run's custom-scalars layout, which lists its categories
        in program order; empty where the run has none (or one that does not parse)."""
        try:
            points = self.read_tensors("custom_scalars__config__", 1, plugin="custom_scalars")
            if not points:
                return {}
            from tensorboard.plugins.custom_scalar import layout_pb2

            raw = np.asarray(points[-1].numpy).reshape(-1)[0]
            layout = layout_pb2.Layout.FromString(raw if isinstance(raw, bytes)
                                                  else str(raw).encode())
        except Exception:  # noqa: BLE001 - any damaged layout: order by metadata and names
            return {}
        return {c.title: i for i, c in enumerate(layout.category)}

    def ordered(self) -> list[SiteInfo]:
        """Every site: logged scalars first (as the layout lists them), then program order
        (the layout's categories, a family by its first member; a depth tensor's ``order``),
        then by name."""
        def key(site: SiteInfo) -> tuple[Any, ...]:
            names = list(site.members.values()) if site.members else [site.site]
            known = [self._ranks[n] for n in names if n in self._ranks]
            rank = min(known) if known else None
            return (site.kind != "logged", rank is None, rank or 0, site.order is None,
                    site.order or 0, site.site)

        return sorted(self.sites.values(), key=key)

    def depth_sites(self) -> list[SiteInfo]:
        return [s for s in self.ordered() if s.kind in ("scan", "repeat")]

    def find(self, site: str, mode: str, stat: str | None,
             kinds: tuple[str, ...]) -> SiteInfo:
        """The site asked for, with its mode and statistic; BadRequest naming the choices."""
        info = self.sites.get(site)
        if info is None or info.kind not in kinds:
            known = [s.site for s in self.ordered() if s.kind in kinds]
            what = ("a site inside a scan or repeated by number" if "plain" not in kinds
                    else "a site or logged scalar")
            raise BadRequest(f"site={site!r} is not {what} in run {self.run!r}: pick one of "
                             f"{known[:50] or 'none (the run holds none)'}")
        if mode not in info.stats:
            raise BadRequest(f"mode={mode!r} is not recorded for site {site!r}: pick one of "
                             f"{info.modes}")
        if stat is not None and stat not in info.stats[mode]:
            raise BadRequest(f"stat={stat!r} is not recorded for site {site!r} ({mode}): pick "
                             f"one of {sorted(info.stats[mode] - {'size'})}")
        return info

    # -- reading -------------------------------------------------------------------------------

    def read_scalars(self, tags: Iterable[str], downsample: int) -> dict[str, list[Any]]:
        """The points of the run's scalar ``tags`` (those it has); a tag TensorBoard cannot
        read is left out and listed in :attr:`skipped`."""
        tags = [t for t in tags if t in self.scalar_tags]
        if not tags:
            return {}
        try:
            return self._scalars(tags, downsample)
        except Exception:  # noqa: BLE001 - one unreadable tag: find it, read the others
            if len(tags) == 1:
                self.skipped.append((tags[0], "TensorBoard cannot read its points as numbers"))
                return {}
        found: dict[str, list[Any]] = {}
        for tag in tags:
            found.update(self.read_scalars([tag], downsample))
        return found

    def _scalars(self, tags: list[str], downsample: int) -> dict[str, list[Any]]:
        data = self._provider.read_scalars(
            self._ctx, experiment_id=self._eid, plugin_name="scalars", downsample=downsample,
            run_tag_filter=self._filter(runs=[self.run], tags=tags))
        return dict(data.get(self.run, {}))

    def read_tensors(self, tag: str, downsample: int, plugin: str | None = None) -> list[Any]:
        """The points of tensor ``tag`` (``.step``, ``.numpy``). Each is checked before it is
        converted (where the provider lets the plugin see it as stored): BadRequest naming the
        tag, the step and what is wrong, for a tensor that is not what its shape says."""
        plugin = plugin or self._plugin
        stored = self._stored_tensors(tag, plugin, downsample)
        if stored is None:  # a provider that converts out of sight: its own points
            try:
                data = self._provider.read_tensors(
                    self._ctx, experiment_id=self._eid, plugin_name=plugin,
                    downsample=downsample,
                    run_tag_filter=self._filter(runs=[self.run], tags=[tag]))
            except Exception:  # noqa: BLE001 - TensorBoard's own words would be internals
                raise BadRequest(f"tag {tag!r} of run {self.run!r} holds a tensor TensorBoard "
                                 "cannot read: the event file is damaged or not one sowtel "
                                 "writes") from None
            return list(data.get(self.run, {}).get(tag, []))
        from tensorboard.data import provider as tb_provider
        from tensorboard.util import tensor_util

        out = []
        for step, wall_time, proto in stored:
            why = tensor_flaw(proto)
            if why is None:
                try:
                    value = tensor_util.make_ndarray(proto)
                except Exception:  # noqa: BLE001 - said below, in words about the file
                    why = (f"its stored data does not fill its shape "
                           f"{[d.size for d in proto.tensor_shape.dim]}")
            if why is not None:
                raise BadRequest(f"tag {tag!r} of run {self.run!r} at step {step}: {why}; the "
                                 "event file is damaged or not one sowtel writes")
            out.append(tb_provider.TensorDatum(step=step, wall_time=wall_time, numpy=value))
        return out

    def _stored_tensors(self, tag: str, plugin: str, downsample: int
                        ) -> list[tuple[int, float, Any]] | None:
        """``(step, wall_time, TensorProto)`` of a tag's points as TensorBoard stores them,
        before any conversion; None where its provider is not one of TensorBoard's two (or
        not as this TensorBoard version has them), which then reads them itself."""
        from tensorboard.backend.event_processing import data_provider as local
        from tensorboard.data import grpc_provider

        mux = getattr(self._provider, "_multiplexer", None)
        if isinstance(self._provider, local.MultiplexerDataProvider) and mux is not None:
            try:
                events = mux.Tensors(self.run, tag)
            except KeyError:
                return []
            except Exception:  # noqa: BLE001 - another version's store: its provider reads
                return None
            events = [events[i] for i in _evenly(len(events), downsample)]
            return [(int(e.step), float(e.wall_time), e.tensor_proto) for e in events]
        stub = getattr(self._provider, "_stub", None)
        if isinstance(self._provider, grpc_provider.GrpcDataProvider) and stub is not None:
            from tensorboard.data.proto import data_provider_pb2

            req = data_provider_pb2.ReadTensorsRequest(experiment_id=self._eid)
            req.plugin_filter.plugin_name = plugin
            req.run_tag_filter.runs.names[:] = [self.run]
            req.run_tag_filter.tags.names[:] = [tag]
            req.downsample.num_points = downsample
            try:
                res = stub.ReadTensors(req)
            except Exception:  # noqa: BLE001 - its provider reads, and says what failed
                return None
            return [(int(step), float(wt), value) for run in res.runs if run.run_name == self.run
                    for entry in run.tags if entry.tag_name == tag
                    for step, wt, value in zip(entry.data.step, entry.data.wall_time,
                                               entry.data.value, strict=False)]
        return None

    def depth_arrays(self, info: SiteInfo, mode: str) -> list[DepthBlock]:
        """The well-formed depth tensors of a scanned site and mode, as blocks of steps of one
        shape (a step written again: its last tensor). TensorBoard converts every point of
        a tag on each read, whatever downsampling is asked for: the blocks are kept
        (:class:`DepthCache`) until the tag gets a new point."""
        if mode not in info.depth:
            return []
        tag, meta = info.depth[mode]
        version = self._versions.get(tag)
        found = self._cache.get(version)
        if found is not None:
            return found  # type: ignore[no-any-return]
        rank, names = meta["index_rank"], list(meta["stats"])
        last: dict[int, np.ndarray] = {}
        for datum in self.read_tensors(tag, 10**9):
            arr = _table(datum.numpy, rank + len(names))
            if arr is not None and arr.shape[1]:  # a step of no columns holds no position
                last[int(datum.step)] = arr
        shapes: dict[tuple[int, ...], list[int]] = {}
        for step in sorted(last):
            shapes.setdefault(last[step].shape, []).append(step)
        blocks = []
        for steps in shapes.values():
            stack = np.stack([last[step] for step in steps])
            index = stack[:, :rank]
            ok = np.all(np.isfinite(index) & (index >= 0) & (index < _MAX_INDEX)
                        & (index == np.round(index)), axis=1)
            blocks.append(DepthBlock(np.array(steps, np.int64),
                                     np.where(ok[:, None], index, 0).astype(np.int64),
                                     stack[:, rank:], ok, names))
        self._cache.put(version, blocks, sum(b.nbytes for b in blocks))
        return blocks

    def scalar_points(self, prefixes: dict[str, tuple[int, ...]], mode: str, stat: str,
                      downsample: int, points: Points | None = None) -> Points:
        """The statistic and counts of per-position scalars: ``prefixes`` maps each position's
        tag prefix (``blocks/h[3]``, ``block3/attn``; its tags ``{prefix}/{mode}/{stat}``) to
        its position. A step is kept where the statistic was read (counts come once non-zero,
        and may be sampled at other steps). Added to ``points`` if given."""
        points = Points() if points is None else points
        keys = (stat, *COUNT_STATS) + (("min", "max") if stat == "max_abs" else ())
        wanted = {f"{prefix}/{mode}/{k}": (prefix, k) for prefix in prefixes for k in keys}
        found: dict[tuple[int, str], dict[str, float]] = {}
        for tag, data in self.read_scalars(wanted, downsample).items():
            prefix, k = wanted[tag]
            for p in data:
                found.setdefault((int(p.step), prefix), {})[k] = float(p.value)
        for (step, prefix), cell in sorted(found.items()):
            value = cell.get(stat)
            if value is None and stat == "max_abs" and "min" in cell and "max" in cell:
                value = max(abs(cell["min"]), abs(cell["max"]))
            if value is None:
                continue
            counts = [cell[k] for k in COUNT_STATS if k in cell]
            points.add(step, [prefixes[prefix]], np.array([value]),
                       np.array([sum(counts) if counts else math.nan]))
        return points


@dataclasses.dataclass
class DepthBlock:
    """Steps of a depth tensor of one shape: ``steps`` (S), ``index`` (S x rank x P ints),
    ``rows`` (S x statistics x P) and ``ok`` (S x P), whether a column holds a position."""

    steps: np.ndarray
    index: np.ndarray
    rows: np.ndarray
    ok: np.ndarray
    names: list[str]

    @property
    def nbytes(self) -> int:
        return int(self.steps.nbytes + self.index.nbytes + self.rows.nbytes + self.ok.nbytes)

    def stat(self, stat: str) -> np.ndarray:
        """``stat`` at each step and column (NaN where the tensors lack it)."""
        if stat in self.names:
            return self.rows[:, self.names.index(stat)]
        if stat == "max_abs" and "min" in self.names and "max" in self.names:
            return np.fmax(np.abs(self.rows[:, self.names.index("min")]),
                           np.abs(self.rows[:, self.names.index("max")]))
        return np.full(self.ok.shape, np.nan, np.float32)

    def counts(self) -> np.ndarray:
        found = [self.rows[:, self.names.index(k)] for k in COUNT_STATS if k in self.names]
        return np.sum(found, axis=0) if found else np.full(self.ok.shape, np.nan, np.float32)


class Points:
    """Values and non-finite counts by (step, position), as they are read; a later point of
    the same step and position wins (the exporter writes a step again when more of it came)."""

    def __init__(self) -> None:
        self.cells: dict[int, dict[tuple[int, ...], tuple[float, float]]] = {}

    def add(self, step: int, positions: list[tuple[int, ...]], values: np.ndarray,
            counts: np.ndarray) -> None:
        row = self.cells.setdefault(step, {})
        for p, v, c in zip(positions, values.tolist(), counts.tolist(), strict=True):
            row[p] = (v, c)

    def steps(self) -> list[int]:
        return sorted(self.cells)

    def positions(self) -> list[tuple[int, ...]]:
        return sorted({p for row in self.cells.values() for p in row})

    def grid(self, steps: list[int], positions: list[tuple[int, ...]]
             ) -> tuple[np.ndarray, np.ndarray]:
        col = {p: j for j, p in enumerate(positions)}
        values = np.full((len(steps), len(positions)), np.nan)
        counts = np.full((len(steps), len(positions)), np.nan)
        for i, step in enumerate(steps):
            for p, (v, c) in self.cells.get(step, {}).items():
                j = col.get(p)
                if j is not None:
                    values[i, j], counts[i, j] = v, c
        return values, counts


def thin(steps: list[int], most: int) -> list[int]:
    """At most ``most`` of ``steps``, evenly spread, the first and last kept.

    Example:
        >>> thin(list(range(10)), 4)
        [0, 3, 6, 9]
    """
    if len(steps) <= most:
        return steps
    if most == 1:
        return steps[-1:]
    picks = np.unique(np.round(np.linspace(0, len(steps) - 1, most)).astype(int))
    return [steps[i] for i in picks]


def json_grid(grid: np.ndarray, digits: int | None = None) -> list[Any]:
    """A grid (or row) for JSON: ``null`` where not finite, which JSON cannot hold; with
    ``digits`` significant digits (7 keeps float32's precision in half the text).

    Example:
        >>> json_grid(np.array([[1 / 3, np.nan]]), 4)
        [[0.3333, None]]
    """
    finite = np.isfinite(grid).ravel().tolist()
    form = "{:." + str(digits) + "g}" if digits else None
    cells = [None if not ok else float(form.format(v)) if form else v
             for v, ok in zip(grid.ravel().tolist(), finite, strict=True)]
    if grid.ndim == 2:
        width = grid.shape[1]
        return [cells[i * width:(i + 1) * width] for i in range(grid.shape[0])]
    return cells


def tensor_flaw(proto: Any) -> str | None:
    """Why a stored TensorProto is not the tensor its shape says, in words about the file; None
    for one that converts to no more values than it stores. TensorBoard fills a shape from a
    single stored value, so a shape of millions with one value would take that much memory.

    Example:
        >>> from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
        >>> shape = tensor_shape_pb2.TensorShapeProto(
        ...     dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in (2, 10**9)])
        >>> tensor_flaw(tensor_pb2.TensorProto(dtype=1, tensor_shape=shape, float_val=[1.0]))
        'its shape [2, 1000000000] claims 2,000,000,000 values but it stores 1'
    """
    dims = [int(d.size) for d in proto.tensor_shape.dim]
    if any(d < 0 for d in dims):
        return f"its shape {dims} has a negative or unknown size"
    if proto.tensor_content:
        return None  # read as stored: no more values than bytes
    size = math.prod(dims)
    stored = max((len(getattr(proto, f)) for f in _VALUE_FIELDS if hasattr(proto, f)),
                 default=0)
    if size > max(stored, 1):
        return f"its shape {dims} claims {size:,} values but it stores {stored:,}"
    return None


def _evenly(n: int, most: int) -> list[int]:
    """At most ``most`` of ``range(n)``, evenly spread, the last kept."""
    return thin(list(range(n)), most) if most else []


def index_value(parts: tuple[int, ...]) -> int | list[int]:
    return parts[0] if len(parts) == 1 else list(parts)


def _table(value: Any, rows: int) -> np.ndarray | None:
    """A depth tensor as float32 ``rows x positions`` (as written), or None if not one."""
    try:
        arr = np.asarray(value)
        if arr.dtype.kind not in "fiub" or arr.ndim != 2 or arr.shape[0] != rows:
            return None
        with np.errstate(over="ignore"):
            return arr.astype(np.float32, copy=False)
    except (TypeError, ValueError):
        return None


class DepthCache:
    """Converted depth tensors of the tags read lately, at most ``most_bytes`` of them, the
    least recently used dropped first; shared by the requests TensorBoard serves in threads.

    Example:
        >>> cache = DepthCache(most_bytes=10)
        >>> cache.put(("a",), [1], 8); cache.put(("b",), [2], 8)
        >>> cache.get(("a",)) is None, cache.get(("b",))
        (True, [2])
    """

    def __init__(self, most_bytes: int = 256 << 20) -> None:
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[Any, tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self.most_bytes = most_bytes

    def get(self, key: Any) -> Any:
        if key is None:
            return None
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Any, value: Any, nbytes: int) -> None:
        if key is None:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes -= old[1] if old else 0
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while self._bytes > self.most_bytes and len(self._items) > 1:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped


def nonfinite_rows(raw: Any) -> list[tuple[str, str, Any, float]]:
    """The rows of one step's non-finite list (``[[name, mode, index, count], ...]`` as
    JSON), the well-formed ones only: a crafted file is read around, not trusted.

    Example:
        >>> nonfinite_rows(b'[["h", "primal", [2], 3], ["g", "cotangent", 4, 1], [1, 2]]')
        [('h', 'primal', 2, 3.0), ('g', 'cotangent', 4, 1.0)]
    """
    try:
        rows = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: deep nesting
        return []
    out = []
    for row in rows if isinstance(rows, list) else []:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
                and isinstance(row[1], str) and isinstance(row[3], (int, float))):
            continue
        index = row[2]
        if isinstance(index, list) and index and all(
                isinstance(i, int) and not isinstance(i, bool) for i in index):
            index = index[0] if len(index) == 1 else index
        elif not (index is None or (isinstance(index, int) and not isinstance(index, bool))):
            continue
        try:
            count = float(row[3])
        except OverflowError:  # an integer of hundreds of digits
            continue
        out.append((row[0], row[1], index, count))
    return out
