"""The ``sowtel`` TensorBoard plugin: training health across depth and steps.

A deep model repeats its layers, under ``lax.scan`` or as numbered modules (``block0/`` ...
``block47/``). Its health is a picture over two axes, depth and training step: where gradients
vanish or explode, which layer's activations grow, where the first NaN appeared. The plugin
draws that picture for every site of a run written by the TensorBoard exporter:

- a heatmap of one statistic of a site over layers x steps (a colour scale in orders of
  magnitude for ``l2``, ``std``, ``mean_abs``), with the value under the pointer, and a line
  chart with one distinguishable line per layer;
- a health overview on top: the first non-finite record (site, mode, step, index) and every
  site that has had a non-finite value.

It is installed with the ``[tensorboard]`` extra (entry point ``tensorboard_plugins``) and is
active whenever a run holds sowtel data. Its data is JSON, so notebooks can read it too:

``GET /data/plugin/sowtel/depth?run=RUN&site=NAME&mode=MODE&stat=STAT``
    ``{"steps": [...], "index": [...], "values": [[...], ...], "nonfinite": [[...], ...]}``:
    ``values[i][j]`` is the statistic at ``steps[i]`` for position ``index[j]`` (a scan
    iteration, a ``[i, j]`` pair for nested scans, or the number of a repeated scope), ``null``
    where the position did not run that step or its statistic is not finite; ``nonfinite[i][j]``
    counts its NaN and infinite elements (``null`` where unknown). ``NAME`` is a site inside a
    scan (``h``), or a family of numbered repeats with ``*`` in place of the number
    (``block*/attn``).
``GET /data/plugin/sowtel/sites?run=RUN``
    ``{"sites": [{"site", "modes", "stats", "positions", "kind"}, ...]}`` in program order
    where known; ``kind`` is ``"scan"`` or ``"repeat"``.
``GET /data/plugin/sowtel/health?run=RUN``
    ``{"first": {"site", "mode", "step", "index", "text"} | null, "sites": [{"site", "mode",
    "first_step", "steps"}, ...]}``.
``GET /data/plugin/sowtel/runs``
    ``{"runs": [...]}``, the runs holding sowtel data.

Both of the exporter's layouts are read: the compact one (a site's statistics at every scan
position as one tensor a step, tag ``{name}/{mode}/depth``) and per-position scalars
(``{name}[3]/{mode}/{stat}``).

Example:
    $ sowtel dashboard --logdir runs
    TensorBoard: http://127.0.0.1:6006/
    sowtel's depth view: http://127.0.0.1:6006/#sowtel
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["PLUGIN_NAME", "DEPTH_SUFFIX", "NONFINITE_TAG", "NONFINITE_CONTENT", "SowtelPlugin",
           "depth_content", "parse_content", "family_of"]

#: The plugin's name: its URL prefix ``/data/plugin/sowtel`` and the ``plugin_name`` of the
#: compact depth tensors the TensorBoard exporter writes.
PLUGIN_NAME = "sowtel"
#: The tag of a site's compact depth tensor is ``{name}/{mode}`` + this suffix.
DEPTH_SUFFIX = "/depth"
#: Version of the compact tensor's layout, in its metadata content.
CONTENT_VERSION = 1
#: A string tensor at every step that had a NaN or infinity: JSON ``[[name, mode, index,
#: count], ...]``, the records of that step with non-finite elements.
NONFINITE_TAG = "sowtel/nonfinite"
#: The metadata content of :data:`NONFINITE_TAG`.
NONFINITE_CONTENT = b'{"version": 1, "kind": "nonfinite"}'

_STATIC = os.path.join(os.path.dirname(__file__), "static")
_COUNT_STATS = ("nan", "posinf", "neginf")
# A scalar tag of one scan position: {name}[i]/{mode}/{stat} or {name}[i,j]/{mode}/{stat}.
_INDEXED_TAG = re.compile(r"^(?P<name>[^\[\]]+)\[(?P<index>[0-9]+(?:,[0-9]+)*)\]"
                          r"/(?P<mode>[^/]+)/(?P<stat>[a-z_0-9]+)$")
# A plain scalar tag {name}/{mode}/{stat}, mode being primal/tangent/cotangent or a composition.
_PLAIN_TAG = re.compile(r"^(?P<name>[^\[\]]+)/(?P<mode>(?:primal|tangent|cotangent)"
                        r"(?:\.(?:tangent|cotangent))*)/(?P<stat>[a-z_0-9]+)$")
# The one number in a path segment that makes a family of repeats: block12/attn, attn_3.
_NUMBERED = re.compile(r"(?<![0-9])([0-9]+)(?![0-9])")
# The tag of the exporter's custom-scalars layout (its categories are sites, in program order).
_LAYOUT_TAG = "custom_scalars__config__"
# TensorBoard's text plugin stores the exporter's alert under this tag.
_ALERT_TAG = "sowtel/alerts/text_summary"
_ALERT_TEXT = re.compile(r"step (?P<step>-?[0-9]+), site `(?P<site>[^`]+)` \((?P<mode>[^,)]+)"
                         r"(?:, index (?P<index>[^)]+))?\)")


def depth_content(stats: Iterable[str], index_rank: int, order: int | None = None,
                  scans: Iterable[tuple[int, bool]] = ()) -> bytes:
    """The metadata content of a compact depth tensor: which rows hold what.

    The tensor of one step has ``index_rank + len(stats)`` rows and one column a scan position
    that ran that step: the first ``index_rank`` rows hold the position's index (one row for a
    scan, two for nested scans), the others one statistic each, in ``stats`` order. ``order``
    is the site's place in its program (the records' ``order``), by which the plugin lists
    sites; files written without it are listed after those with it, by name. ``scans`` (the
    records' ``scans``, ``[entry, reverse]`` per scan), with ``order`` and a position's index,
    gives the position's place in its step's execution order
    (:func:`sowtel.records.order_key`).

    Example:
        >>> parse_content(depth_content(["mean", "l2"], 1, order=3))
        {'version': 1, 'stats': ['mean', 'l2'], 'index_rank': 1, 'order': 3}
        >>> parse_content(depth_content(["l2"], 1, order=5, scans=[(4, True)]))["scans"]
        [[4, True]]
    """
    meta: dict[str, Any] = {"version": CONTENT_VERSION, "stats": list(stats),
                            "index_rank": int(index_rank)}
    if order is not None:
        meta["order"] = int(order)
    listed = [[int(entry), bool(reverse)] for entry, reverse in scans]
    if listed:
        meta["scans"] = listed
    return json.dumps(meta).encode()


def parse_content(content: bytes) -> dict[str, Any]:
    """Reads :func:`depth_content`; raises ValueError for content of another layout.

    Example:
        >>> parse_content(b'{"version": 1, "stats": ["l2"], "index_rank": 2}')["index_rank"]
        2
    """
    try:
        meta = json.loads(content.decode() if isinstance(content, bytes) else content)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"sowtel depth metadata is not JSON: {e}") from e
    if (not isinstance(meta, dict) or meta.get("version") != CONTENT_VERSION
            or not isinstance(meta.get("stats"), list)
            or not isinstance(meta.get("index_rank"), int)
            or not isinstance(meta.get("order", 0), int)):
        raise ValueError(f"sowtel depth metadata {meta!r} is not version {CONTENT_VERSION}")
    return meta


def family_of(name: str) -> tuple[str, int] | None:
    """A site of numbered repeats as ``(family, number)``, else None.

    The family replaces the last number in the name by ``*``, so ``block0/attn`` ...
    ``block47/attn`` form one family with 48 positions.

    Example:
        >>> family_of("block12/attn")
        ('block*/attn', 12)
        >>> family_of("encoder/layer_3/mlp")
        ('encoder/layer_*/mlp', 3)
        >>> family_of("loss") is None
        True
    """
    matches = list(_NUMBERED.finditer(name))
    if not matches:
        return None
    m = matches[-1]
    return name[:m.start()] + "*" + name[m.end():], int(m.group(1))


def _index_value(parts: tuple[int, ...]) -> int | list[int]:
    return parts[0] if len(parts) == 1 else list(parts)


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


class _Series:
    """One (site, mode)'s statistics, a row of positions per step: what the routes are made of."""

    def __init__(self) -> None:
        # stat -> [(step, positions, values)], values[j] at positions[j]
        self.rows: dict[str, list[tuple[int, list[tuple[int, ...]], np.ndarray]]] = {}

    def put(self, stat: str, step: int, positions: list[tuple[int, ...]],
            values: np.ndarray) -> None:
        self.rows.setdefault(stat, []).append((int(step), positions, np.asarray(values)))

    def _grid(self, stat: str, steps: list[int], positions: list[tuple[int, ...]]) -> np.ndarray:
        # ``stat`` at each (step, position), NaN where not recorded; a later row of the same
        # step (the exporter writes a step again when more of its positions arrive) wins.
        row = {s: i for i, s in enumerate(steps)}
        col = {p: j for j, p in enumerate(positions)}
        grid = np.full((len(steps), len(positions)), np.nan)
        for step, pos, vals in self.rows.get(stat, []):
            if step in row:
                grid[row[step], [col[p] for p in pos]] = vals
        return grid

    def table(self, stat: str) -> dict[str, Any]:
        rows = self.rows.get(stat, [])
        steps = sorted({r[0] for r in rows})
        positions = sorted({p for r in rows for p in r[1]})
        values = self._grid(stat, steps, positions)
        counts = [self._grid(k, steps, positions) for k in _COUNT_STATS]
        known = np.logical_or.reduce([~np.isnan(c) for c in counts])
        total = np.where(known, np.nansum(counts, axis=0), np.nan)
        return {"steps": steps, "index": [_index_value(p) for p in positions],
                "values": _json_grid(values), "nonfinite": _json_grid(total)}

    def nonfinite_cells(self) -> Iterable[tuple[int, tuple[int, ...]]]:
        """(step, position) of every cell with a non-zero NaN or infinity count."""
        for k in _COUNT_STATS:
            for step, pos, vals in self.rows.get(k, []):
                for j in np.flatnonzero(np.asarray(vals) > 0):
                    yield step, pos[j]


def _json_grid(grid: np.ndarray) -> list[list[float | None]]:
    # JSON has no NaN or infinity: such cells are null.
    cells: list[list[float | None]] = grid.astype(object).tolist()
    for row, finite in zip(cells, np.isfinite(grid).tolist(), strict=True):
        for j, ok in enumerate(finite):
            if not ok:
                row[j] = None
    return cells


class SowtelPlugin:
    """TensorBoard's ``sowtel`` plugin (loaded through the ``tensorboard_plugins`` entry point).

    The class derives from TensorBoard's ``TBPlugin`` when TensorBoard imports it; its routes
    read the run's data through TensorBoard's data provider, so they see exactly what
    TensorBoard loaded.

    Example:
        >>> from tensorboard import default  # doctest: +SKIP
        >>> SowtelPlugin in default.get_dynamic_plugins()  # doctest: +SKIP
        True
    """

    plugin_name = PLUGIN_NAME

    def __init__(self, context: Any) -> None:
        self._provider = context.data_provider

    # -- TensorBoard's plugin interface ----------------------------------------------------------

    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        return {
            "/index.js": self._static("index.js", "text/javascript"),
            "/runs": self._json(lambda ctx, eid, args: {"runs": self._runs(ctx, eid)}),
            "/sites": self._json(lambda ctx, eid, args: {
                "sites": self._sites(ctx, eid, _arg(args, "run"))}),
            "/depth": self._json(self._depth_route),
            "/health": self._json(lambda ctx, eid, args: self._health(
                ctx, eid, _arg(args, "run"))),
        }

    def is_active(self) -> bool:
        # TensorBoard asks this only when no tensor of plugin "sowtel" is loaded: a run may
        # still hold per-position scalars (the exporter's per-scalar layout).
        try:
            return bool(self._runs(None, ""))
        except Exception:  # a provider that cannot answer yet: the tab stays hidden
            return False

    def data_plugin_names(self) -> tuple[str, ...]:
        return (PLUGIN_NAME,)

    def frontend_metadata(self) -> Any:
        from tensorboard.plugins import base_plugin

        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="sowtel",
                                            disable_reload=False)

    # -- HTTP ------------------------------------------------------------------------------------

    def _static(self, filename: str, mimetype: str) -> Callable[..., Any]:
        from tensorboard.backend import http_util
        from werkzeug import wrappers

        @wrappers.Request.application
        def serve(request: Any) -> Any:
            with open(os.path.join(_STATIC, filename), "rb") as f:
                return http_util.Respond(request, f.read(), mimetype)

        return serve

    def _json(self, fn: Callable[[Any, str, Any], Any]) -> Callable[..., Any]:
        from tensorboard import plugin_util
        from tensorboard.backend import http_util
        from werkzeug import wrappers

        @wrappers.Request.application
        def serve(request: Any) -> Any:
            ctx = plugin_util.context(request.environ)
            eid = plugin_util.experiment_id(request.environ)
            try:
                body = fn(ctx, eid, request.args)
            except ValueError as e:
                return http_util.Respond(request, {"error": str(e)}, "application/json",
                                         code=400)
            return http_util.Respond(request, body, "application/json")

        return serve

    # -- reading the run -------------------------------------------------------------------------

    def _runs(self, ctx: Any, eid: str) -> list[str]:
        runs = set(self._provider.list_tensors(ctx, experiment_id=eid,
                                               plugin_name=PLUGIN_NAME))
        for run, tags in self._provider.list_scalars(ctx, experiment_id=eid,
                                                     plugin_name="scalars").items():
            if any(_INDEXED_TAG.match(t) or _PLAIN_TAG.match(t) for t in tags):
                runs.add(run)
        return sorted(runs)

    def _tensor_tags(self, ctx: Any, eid: str, run: str) -> dict[str, Any]:
        from tensorboard.data import provider

        found = self._provider.list_tensors(ctx, experiment_id=eid, plugin_name=PLUGIN_NAME,
                                            run_tag_filter=provider.RunTagFilter(runs=[run]))
        return dict(found.get(run, {}))

    def _scalar_tags(self, ctx: Any, eid: str, run: str) -> dict[str, Any]:
        from tensorboard.data import provider

        found = self._provider.list_scalars(ctx, experiment_id=eid, plugin_name="scalars",
                                            run_tag_filter=provider.RunTagFilter(runs=[run]))
        return dict(found.get(run, {}))

    def _sites(self, ctx: Any, eid: str, run: str) -> list[dict[str, Any]]:
        sites: dict[str, dict[str, Any]] = {}

        def add(site: str, kind: str, mode: str, stats: Iterable[str], position: Any,
                member: str, order: int | None = None) -> None:
            entry = sites.setdefault(site, {"site": site, "kind": kind, "modes": set(),
                                            "stats": set(), "positions": set(),
                                            "members": set(), "order": None})
            entry["modes"].add(mode)
            entry["stats"].update(stats)
            entry["members"].add(member)
            if position is not None:
                entry["positions"].add(position)
            if order is not None and (entry["order"] is None or order < entry["order"]):
                entry["order"] = order

        for tag, series in self._tensor_tags(ctx, eid, run).items():
            if tag == NONFINITE_TAG or not tag.endswith(DEPTH_SUFFIX):
                continue
            name, mode = tag[:-len(DEPTH_SUFFIX)].rsplit("/", 1)
            meta = parse_content(series.plugin_content)
            add(name, "scan", mode, meta["stats"], None, name, meta.get("order"))
        for tag in self._scalar_tags(ctx, eid, run):
            m = _INDEXED_TAG.match(tag)
            if m:
                add(m["name"], "scan", m["mode"], [m["stat"]], m["index"], m["name"])
                continue
            m = _PLAIN_TAG.match(tag)
            if m and (fam := family_of(m["name"])):
                add(fam[0], "repeat", m["mode"], [m["stat"]], fam[1], m["name"])
        ranks = self._program_ranks(ctx, eid, run)
        # A family needs at least two members to be a depth axis.
        out = []
        for entry in sites.values():
            if entry["kind"] == "repeat" and len(entry["positions"]) < 2:
                continue
            known = [ranks[m] for m in entry["members"] if m in ranks]
            rank = min(known) if known else None
            out.append(((rank is None, rank or 0, entry["order"] is None, entry["order"] or 0,
                         entry["site"]),
                        {"site": entry["site"], "kind": entry["kind"],
                         "modes": sorted(entry["modes"], key=_mode_order),
                         "stats": sorted(entry["stats"] - {"size"}),
                         "positions": len(entry["positions"]) or None}))
        # Program order: the exporter's custom-scalars layout lists every site in it (the
        # members of a family by their own names), and a depth tensor's metadata carries its
        # site's order; a file with neither lists its sites by name.
        return [e for _, e in sorted(out, key=lambda pair: pair[0])]

    def _program_ranks(self, ctx: Any, eid: str, run: str) -> dict[str, int]:
        """Each site's place in the run's custom-scalars layout (the exporter writes its
        categories in program order); empty where the run has none."""
        from tensorboard.data import provider

        try:
            data = self._provider.read_tensors(
                ctx, experiment_id=eid, plugin_name="custom_scalars", downsample=1,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[_LAYOUT_TAG]))
            points = data.get(run, {}).get(_LAYOUT_TAG, [])
            if not points:
                return {}
            from tensorboard.plugins.custom_scalar import layout_pb2

            raw = np.asarray(points[-1].numpy).reshape(-1)[0]
            layout = layout_pb2.Layout.FromString(raw if isinstance(raw, bytes)
                                                  else str(raw).encode())
        except Exception:  # no layout loaded, or one that does not parse: order by metadata
            return {}
        return {c.title: i for i, c in enumerate(layout.category)}

    def _series(self, ctx: Any, eid: str, run: str, site: str, mode: str,
                stats: Iterable[str]) -> _Series:
        from tensorboard.data import provider

        wanted = set(stats)
        series = _Series()
        tag = f"{site}/{mode}{DEPTH_SUFFIX}"
        tensors = self._tensor_tags(ctx, eid, run)
        if tag in tensors:
            meta = parse_content(tensors[tag].plugin_content)
            rank, names = meta["index_rank"], meta["stats"]
            rows = {k: rank + i for i, k in enumerate(names) if k in wanted}
            data = self._provider.read_tensors(
                ctx, experiment_id=eid, plugin_name=PLUGIN_NAME, downsample=10**9,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
            for datum in data.get(run, {}).get(tag, []):
                arr = np.asarray(datum.numpy, dtype=np.float64)
                if arr.ndim != 2 or arr.shape[0] != rank + len(names):
                    continue
                positions = [tuple(p) for p in arr[:rank].T.astype(int).tolist()]
                for k, r in rows.items():
                    series.put(k, datum.step, positions, arr[r])
        # Per-position scalars: {site}[i]/{mode}/{stat} (the exporter's other layout, and the
        # records that came after a later step of their site), or the members of a family.
        fam = site if "*" in site else None
        tags: dict[str, tuple[str, tuple[int, ...]]] = {}
        for t in self._scalar_tags(ctx, eid, run):
            if fam is None:
                m = _INDEXED_TAG.match(t)
                if m and m["name"] == site and m["mode"] == mode and m["stat"] in wanted:
                    tags[t] = (m["stat"], tuple(int(i) for i in m["index"].split(",")))
            else:
                m = _PLAIN_TAG.match(t)
                if m and m["mode"] == mode and m["stat"] in wanted:
                    f = family_of(m["name"])
                    if f is not None and f[0] == fam:
                        tags[t] = (m["stat"], (f[1],))
        for t, points in self._read_scalars(ctx, eid, run, tags).items():
            stat, position = tags[t]
            for p in points:
                series.put(stat, p.step, [position], np.array([p.value]))
        return series

    def _read_scalars(self, ctx: Any, eid: str, run: str, tags: Iterable[str]) -> dict[str, Any]:
        """Every point of ``tags`` in ``run``: ``{tag: [ScalarDatum, ...]}``."""
        from tensorboard.data import provider

        tags = list(tags)
        if not tags:
            return {}
        data = self._provider.read_scalars(
            ctx, experiment_id=eid, plugin_name="scalars", downsample=10**9,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags))
        return dict(data.get(run, {}))

    def _depth_route(self, ctx: Any, eid: str, args: Any) -> dict[str, Any]:
        run, site, mode, stat = (_arg(args, k) for k in ("run", "site", "mode", "stat"))
        series = self._series(ctx, eid, run, site, mode, (stat, *_COUNT_STATS))
        if stat not in series.rows:
            known = {s["site"]: s for s in self._sites(ctx, eid, run)}
            if site not in known:
                raise ValueError(
                    f"site={site!r} has no depth data in run {run!r}: pick one of "
                    f"{sorted(known) or 'none (the run holds no scanned or repeated site)'}")
            entry = known[site]
            if mode not in entry["modes"]:
                raise ValueError(f"mode={mode!r} is not recorded for site {site!r}: pick one of "
                                 f"{entry['modes']}")
            raise ValueError(f"stat={stat!r} is not recorded for site {site!r}: pick one of "
                             f"{entry['stats']}")
        return series.table(stat)

    def _health(self, ctx: Any, eid: str, run: str) -> dict[str, Any]:
        first: dict[str, Any] | None = None
        alert = self._alert(ctx, eid, run)
        if alert is not None:
            first = alert
        bad: dict[tuple[str, str], dict[str, Any]] = {}
        from tensorboard.data import provider

        if self._tensor_tags(ctx, eid, run):
            # A run with sowtel tensors comes from an exporter that lists every record with a
            # NaN or infinity, step by step, under NONFINITE_TAG (absent: there was none).
            data = self._provider.read_tensors(
                ctx, experiment_id=eid, plugin_name=PLUGIN_NAME, downsample=10**9,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[NONFINITE_TAG]))
            for datum in data.get(run, {}).get(NONFINITE_TAG, []):
                raw = np.asarray(datum.numpy).reshape(-1)[0]
                for name, mode, index, _ in json.loads(
                        raw.decode() if isinstance(raw, bytes) else str(raw)):
                    _mark(bad, name, mode, datum.step,
                          index if index is None or len(index) > 1 else index[0])
            return self._health_answer(first, bad)
        for site in self._sites(ctx, eid, run):
            for mode in site["modes"]:
                series = self._series(ctx, eid, run, site["site"], mode, _COUNT_STATS)
                _collect_nonfinite(series, site["site"], mode, bad)
        # Sites outside scans: their counts are plain scalars.
        count_tags = {}
        for t in self._scalar_tags(ctx, eid, run):
            m = _PLAIN_TAG.match(t)
            if m and m["stat"] in _COUNT_STATS:
                count_tags[t] = (m["name"], m["mode"])
        for t, points in self._read_scalars(ctx, eid, run, count_tags).items():
            name, mode = count_tags[t]
            for p in points:
                if p.value > 0:
                    _mark(bad, name, mode, p.step, None)
        return self._health_answer(first, bad)

    @staticmethod
    def _health_answer(first: dict[str, Any] | None,
                       bad: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
        sites = sorted(bad.values(), key=lambda e: (e["first_step"], e["site"], e["mode"]))
        for e in sites:
            e["steps"] = len(e.pop("_steps"))
        if first is None and sites:
            e = sites[0]
            first = {"site": e["site"], "mode": e["mode"], "step": e["first_step"],
                     "index": e["first_index"], "text": None}
        return {"first": first, "sites": sites}

    def _alert(self, ctx: Any, eid: str, run: str) -> dict[str, Any] | None:
        from tensorboard.data import provider

        try:
            data = self._provider.read_tensors(
                ctx, experiment_id=eid, plugin_name="text", downsample=1,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[_ALERT_TAG]))
        except Exception:  # the text plugin's data may be absent: no alert then
            return None
        points = data.get(run, {}).get(_ALERT_TAG, [])
        if not points:
            return None
        raw = np.asarray(points[0].numpy).reshape(-1)
        text = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        m = _ALERT_TEXT.search(text)
        if m is None:
            return {"site": None, "mode": None, "step": None, "index": None, "text": text}
        index: Any = m["index"]
        if index is not None:
            nums = [int(v) for v in re.findall(r"-?[0-9]+", index)]
            index = nums[0] if len(nums) == 1 else nums
        return {"site": m["site"], "mode": m["mode"], "step": int(m["step"]), "index": index,
                "text": text}


def _mark(bad: dict[tuple[str, str], dict[str, Any]], site: str, mode: str, step: int,
          index: Any) -> None:
    e = bad.setdefault((site, mode), {"site": site, "mode": mode, "first_step": step,
                                      "first_index": index, "_steps": set()})
    e["_steps"].add(step)
    if step < e["first_step"]:
        e["first_step"], e["first_index"] = step, index


def _collect_nonfinite(series: _Series, site: str, mode: str,
                       bad: dict[tuple[str, str], dict[str, Any]]) -> None:
    for step, position in series.nonfinite_cells():
        _mark(bad, site, mode, step, _index_value(position))


def _mode_order(mode: str) -> tuple[int, int, str]:
    return (mode.count("."), {"primal": 0, "tangent": 1, "cotangent": 2}.get(mode, 3), mode)


def _arg(args: Any, key: str) -> str:
    value = args.get(key)
    if not value:
        raise ValueError(f"the query parameter {key}= is missing: pass run=, site=, mode= and "
                         "stat= (see GET /data/plugin/sowtel/sites?run=RUN for the choices)"
                         if key != "run" else
                         "the query parameter run= is missing: GET /data/plugin/sowtel/runs "
                         "lists the runs")
    return str(value)


@functools.cache
def _as_tensorboard_plugin() -> type:
    # TensorBoard instantiates what the entry point loads; deriving from TBPlugin there keeps
    # this module importable (and testable) without TensorBoard.
    from tensorboard.plugins import base_plugin

    return type("SowtelPlugin", (SowtelPlugin, base_plugin.TBPlugin), {})


def __getattr__(name: str) -> Any:
    if name == "TensorBoardPlugin":
        return _as_tensorboard_plugin()
    raise AttributeError(name)
