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
    "first_step", "steps"}, ...], "alerts": [{"step", "text"}, ...], "alerts_total": N,
    "skipped": [{"tag", "why"}, ...]}``: the first non-finite record and every site that had
    one, then the alert rules' alerts (the earliest 50 lines; ``alerts_total`` counts them
    all); ``skipped`` the tags of the run that are not what the exporter writes, and why.
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
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sowtel.records import COUNT_STATS, NONFINITE_KINDS
from sowtel.tensorboard_plugin._run import (
    MAX_CELLS,
    BadRequest,
    DepthCache,
    RunIndex,
    SiteInfo,
    auto_stat,
    check_bound,
    family_of,
    index_value,
    json_grid,
    nonfinite_rows,
    thin,
)

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
# The page's files, served as they are (plain ES modules, no build step).
_STATIC_FILES = {"index.js": "text/javascript", "charts.js": "text/javascript"}
_STAT_NAME = re.compile(r"^[a-z_0-9]{1,32}$")
# TensorBoard's text plugin stores the exporter's alert under this tag.
_ALERT_TAG = "sowtel/alerts/text_summary"
# ... and the alert rules' alerts under this one, a text a step (one line an alert).
_RULE_ALERT_TAG = "sowtel/alerts/rules/text_summary"
# Alert lines the health answer lists at most (the earliest), and the most characters of one.
_MOST_ALERTS, _ALERT_CHARS = 50, 1000
_ALERT_TEXT = re.compile(r"step (?P<step>-?[0-9]{1,18}), site `(?P<site>[^`]+)` "
                         r"\((?P<mode>[^,)]+)(?:, index (?P<index>[^)]+))?\)")
# Bounds of one answer: steps of a series, positions of a depth table, overview rows and the
# steps and positions of each row's small chart (defaults, and the most a query may ask).
_STEPS, _MOST_STEPS = 1000, 5000
_POSITIONS, _MOST_POSITIONS = 256, 4096
_ROWS, _MOST_ROWS = 200, 1000
_SPARK_STEPS, _SPARK_POSITIONS = 60, 32
# Sites and modes the health answer lists at most (a crafted file may name millions).
_MOST_HEALTH = 1000
# The longest depth metadata read (the exporter's is under a kilobyte).
_MOST_CONTENT = 65536
logger = logging.getLogger("sowtel")


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
    if len(content) > _MOST_CONTENT:
        raise ValueError(f"sowtel depth metadata of {len(content):,} bytes is longer than "
                         f"{_MOST_CONTENT:,}: the exporter writes a short JSON object")
    try:
        meta = json.loads(content.decode() if isinstance(content, bytes) else content)
    except UnicodeDecodeError:
        raise ValueError("sowtel depth metadata is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sowtel depth metadata is not JSON ({e.msg} at character "
                         f"{e.pos})") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits, deep nesting
        raise ValueError("sowtel depth metadata is JSON nested too deep or with a number too "
                         "long to read") from None
    # A crafted file may hold anything: each field is checked, and the message names it.
    if not isinstance(meta, dict):
        raise ValueError(f"sowtel depth metadata is the JSON {json.dumps(meta)[:40]}, not an "
                         "object")
    if meta.get("version") != CONTENT_VERSION:
        raise ValueError(f"sowtel depth metadata has version {meta.get('version')!r:.40}, not "
                         f"{CONTENT_VERSION}")
    stats = meta.get("stats")
    if (not isinstance(stats, list) or not all(isinstance(k, str) and _STAT_NAME.match(k)
                                                 for k in stats) or len(set(stats)) != len(stats)):
        raise ValueError(f"sowtel depth metadata has stats {stats!r:.120}: it must be a list of "
                         "distinct statistic names (1 to 32 of a-z, 0-9, _)")
    rank = meta.get("index_rank")
    if not (isinstance(rank, int) and _whole(rank) and 1 <= rank <= 8):
        raise ValueError(f"sowtel depth metadata has index_rank {rank!r:.40}: it must be a whole "
                         "number from 1 to 8 (the rows holding a position's index)")
    if "order" in meta and not _whole(meta["order"]):
        raise ValueError(f"sowtel depth metadata has order {meta['order']!r:.40}: it must be a "
                         "whole number (the site's place in its program)")
    return meta


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        self._cache = DepthCache()

    # -- TensorBoard's plugin interface ----------------------------------------------------------

    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        apps = {f"/{name}": self._static(name, mime) for name, mime in _STATIC_FILES.items()}
        apps.update({
            "/runs": self._json(lambda ctx, eid, args: {"runs": self._runs(ctx, eid)}),
            "/sites": self._json(lambda ctx, eid, args: {
                "sites": [s.describe() for s in self._index(ctx, eid, args).ordered()]}),
            "/depth": self._json(self._depth_route),
            "/series": self._json(self._series_route),
            "/overview": self._json(self._overview_route),
            "/health": self._json(lambda ctx, eid, args: self._health(
                self._index(ctx, eid, args))),
        })
        return apps

    def is_active(self) -> bool:
        # TensorBoard asks this only when no tensor of plugin "sowtel" is loaded: a run may
        # still hold sites' scalars (a run without scans, or the per-scalar layout).
        try:
            return bool(self._runs(None, ""))
        except Exception:  # noqa: BLE001 - a provider that cannot answer yet: the tab hides
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
            except BadRequest as e:  # only messages written for users: never Python's own
                return http_util.Respond(request, {"error": str(e)}, "application/json",
                                         code=400)
            except Exception:  # noqa: BLE001 - a defect here: logged, and said plainly
                logger.exception("sowtel plugin: %s failed", request.path)
                return http_util.Respond(
                    request, {"error": f"the sowtel plugin failed to answer {request.path} "
                                       "(a defect: TensorBoard's log has the details)"},
                    "application/json", code=500)
            return http_util.Respond(request, body, "application/json")

        return serve

    # -- reading the run -------------------------------------------------------------------------

    def _runs(self, ctx: Any, eid: str) -> list[str]:
        runs = set(self._provider.list_tensors(ctx, experiment_id=eid,
                                               plugin_name=PLUGIN_NAME))
        for run, tags in self._provider.list_scalars(ctx, experiment_id=eid,
                                                     plugin_name="scalars").items():
            if any(_SITE_TAG.match(t) for t in tags):
                runs.add(run)
        return sorted(runs)

    def _index(self, ctx: Any, eid: str, args: Any) -> RunIndex:
        run = _arg(args, "run")
        if run not in self._runs(ctx, eid):
            raise BadRequest(f"run={run!r} holds no sowtel data: pick one of "
                             f"{self._runs(ctx, eid)[:50]} (GET /data/plugin/sowtel/runs)")
        return RunIndex(self._provider, ctx, eid, run, PLUGIN_NAME, parse_content,
                        DEPTH_SUFFIX, NONFINITE_TAG, self._cache)

    def _depth_route(self, ctx: Any, eid: str, args: Any) -> dict[str, Any]:
        site, mode, stat = (_arg(args, k) for k in ("site", "mode", "stat"))
        max_steps = check_bound(args, "max_steps", _STEPS, _MOST_STEPS)
        offset = check_bound(args, "offset", 0, 2**31, least=0)
        limit = check_bound(args, "limit", _POSITIONS, _MOST_POSITIONS)
        if max_steps * limit > MAX_CELLS:
            raise BadRequest(f"max_steps={max_steps} x limit={limit} is more than {MAX_CELLS:,} "
                             "cells: ask for fewer steps or positions")
        index = self._index(ctx, eid, args)
        info = index.find(site, mode, stat, ("scan", "repeat"))
        return _depth_table(index, info, mode, stat, max_steps, offset, limit)

    def _series_route(self, ctx: Any, eid: str, args: Any) -> dict[str, Any]:
        site, mode, stat = (_arg(args, k) for k in ("site", "mode", "stat"))
        max_steps = check_bound(args, "max_steps", _STEPS, _MOST_STEPS)
        index = self._index(ctx, eid, args)
        info = index.find(site, mode, stat, ("plain", "logged"))
        prefix = info.site if info.kind == "logged" else f"{info.site}/{mode}/{stat}"
        # Every point TensorBoard kept (its scalar reservoir bounds them, 1,000 by default),
        # thinned evenly here: the first step stays, where a random sample may drop it.
        data = index.read_scalars([prefix], 10**9).get(prefix, [])
        counts: dict[int, float] = {}
        if info.kind == "plain":
            tags = [f"{info.site}/{mode}/{k}" for k in COUNT_STATS]
            for points in index.read_scalars(tags, 10**9).values():
                for p in points:
                    counts[int(p.step)] = counts.get(int(p.step), 0.0) + float(p.value)
        by_step = {int(p.step): float(p.value) for p in data}
        steps = thin(sorted(by_step), max_steps)
        return {"steps": steps, "values": json_grid(np.array([by_step[s] for s in steps])),
                "nonfinite": [counts.get(s) for s in steps],
                "downsampled": len(data) > max_steps}

    def _overview_route(self, ctx: Any, eid: str, args: Any) -> dict[str, Any]:
        """Every site and mode in program order, each with the last value of a statistic and a
        small chart of it (a line; a layers x steps picture for a scanned or repeated site)."""
        asked = args.get("stat") or None
        points = check_bound(args, "points", _SPARK_STEPS, 500, least=2)
        offset = check_bound(args, "offset", 0, 2**31, least=0)
        limit = check_bound(args, "limit", _ROWS, _MOST_ROWS)
        index = self._index(ctx, eid, args)
        rows = [(info, mode) for info in index.ordered() for mode in info.modes]
        health = self._health(index)
        bad: dict[tuple[str, str], dict[str, Any]] = {}
        for e in health["sites"]:
            fam = family_of(e["site"])
            key = e["site"] if e["site"] in index.sites or fam is None else fam[0]
            bad.setdefault((key, e["mode"]), e)
        out = []
        for info, mode in rows[offset:offset + limit]:
            stats = info.stats[mode]
            stat = asked if asked in stats else auto_stat(mode, stats)
            row: dict[str, Any] = {
                "site": info.site, "kind": info.kind, "mode": mode, "stat": stat,
                "positions": len(info.positions) or len(info.members) or None,
                "last": None, "spark": None, "nonfinite": None}
            entry = bad.get((info.site, mode))
            if entry is not None:
                row["nonfinite"] = {"first_step": entry["first_step"], "steps": entry["steps"],
                                    "first_index": entry["first_index"]}
            if stat is not None:
                try:
                    _spark(index, info, mode, stat, points, row)
                except BadRequest as e:  # one site a file got wrong: said on its row
                    row["error"] = str(e)
            out.append(row)
        return {"rows": out, "total": len(rows), "offset": offset, "limit": limit,
                "skipped": [{"tag": t, "why": w} for t, w in index.skipped[:20]]}

    def _health(self, index: RunIndex) -> dict[str, Any]:
        answer = self._nonfinite_health(index)
        answer["alerts"], answer["alerts_total"] = self._rule_alerts(index)
        return answer

    def _rule_alerts(self, index: RunIndex) -> tuple[list[dict[str, Any]], int]:
        """The alert rules' alerts (``enable(alerts=...)``): the earliest :data:`_MOST_ALERTS`
        lines as ``{"step", "text"}``, and how many lines there are."""
        try:
            points = index.read_tensors(_RULE_ALERT_TAG, 10**6, plugin="text")
        except Exception:  # noqa: BLE001 - the text plugin's data may be absent: no alerts
            return [], 0
        last = {int(d.step): d for d in points}  # a step written again: its last text
        out: list[dict[str, Any]] = []
        total = 0
        for step in sorted(last):
            raw = np.asarray(last[step].numpy).reshape(-1)
            for cell in raw[:1]:
                text = cell.decode(errors="replace") if isinstance(cell, bytes) else str(cell)
                for line in text.splitlines():
                    line = line.removeprefix("- ").strip()
                    if not line:
                        continue
                    total += 1
                    if len(out) < _MOST_ALERTS:
                        out.append({"step": step, "text": line[:_ALERT_CHARS]})
        return out, total

    def _nonfinite_health(self, index: RunIndex) -> dict[str, Any]:
        first = self._alert(index)
        bad: dict[tuple[str, str], dict[str, Any]] = {}
        if index.has_tensors:
            # A run with sowtel tensors comes from an exporter that lists every record with a
            # NaN or infinity, step by step, under NONFINITE_TAG (absent: there was none).
            try:
                points = index.read_tensors(NONFINITE_TAG, 10**9) if index.has_nonfinite else []
            except BadRequest as e:  # the overview and the health answer list it as skipped
                index.skipped.append((NONFINITE_TAG, str(e)))
                points = []
            for datum in points:
                raw = np.asarray(datum.numpy).reshape(-1)
                for name, mode, position, _ in nonfinite_rows(raw[0] if raw.size else b""):
                    _mark(bad, name, mode, int(datum.step), position)
            return _health_answer(first, bad, index)
        # Otherwise the counts, written as scalars once non-zero: {site}/{mode}/{count} and
        # {site}[i]/{mode}/{count}.
        tags: dict[str, tuple[str, str, Any]] = {}
        for t in index.scalar_tags:
            m = _COUNT_TAG.match(t)
            if m:
                position = m["index"] and index_value(tuple(int(i) for i in
                                                            m["index"].split(",")))
                tags[t] = (m["name"], m["mode"], position)
        for t, data in index.read_scalars(tags, 10**9).items():
            name, mode, position = tags[t]
            for p in data:
                if p.value > 0:
                    _mark(bad, name, mode, int(p.step), position)
        return _health_answer(first, bad, index)

    def _alert(self, index: RunIndex) -> dict[str, Any] | None:
        try:
            points = index.read_tensors(_ALERT_TAG, 1, plugin="text")
        except Exception:  # noqa: BLE001 - the text plugin's data may be absent: no alert then
            return None
        if not points:
            return None
        raw = np.asarray(points[0].numpy).reshape(-1)
        if not raw.size:
            return None
        text = raw[0].decode(errors="replace") if isinstance(raw[0], bytes) else str(raw[0])
        m = _ALERT_TEXT.search(text)
        if m is None:
            return {"site": None, "mode": None, "step": None, "index": None, "text": text}
        position: Any = m["index"]
        if position is not None:
            nums = [int(v) for v in re.findall(r"-?[0-9]{1,18}", position)]
            position = nums[0] if len(nums) == 1 else (nums or None)
        return {"site": m["site"], "mode": m["mode"], "step": int(m["step"]),
                "index": position, "text": text}


# Tags of a site's statistic (what makes a run one of sowtel's), and of its counts.
_SITE_TAG = re.compile(r"^[^\[\]]+(\[[0-9,]+\])?/(primal|tangent|cotangent)(\.[a-z]+)*/[a-z_0-9]+$")
_COUNT_TAG = re.compile(r"^(?P<name>[^\[\]]+)"
                        r"(\[(?P<index>[0-9]{1,18}(?:,[0-9]{1,18}){0,7})\])?"
                        r"/(?P<mode>(?:primal|tangent|cotangent)(?:\.(?:tangent|cotangent))*)"
                        r"/(?:" + "|".join(NONFINITE_KINDS) + r")$")


def _depth_table(index: RunIndex, info: SiteInfo, mode: str, stat: str, max_steps: int,
                 offset: int, limit: int) -> dict[str, Any]:
    """The depth route's answer: ``stat`` at each (step, position) of a page of positions."""
    grid = _depth_grid(index, info, mode, stat, max_steps, offset, limit)
    return {"steps": grid["steps"], "index": [index_value(p) for p in grid["page"]],
            "values": json_grid(grid["values"], 7), "nonfinite": json_grid(grid["counts"]),
            "positions": grid["positions"], "offset": offset, "limit": limit,
            "downsampled": grid["downsampled"]}


def _depth_grid(index: RunIndex, info: SiteInfo, mode: str, stat: str, max_steps: int,
                offset: int, limit: int, spread: int | None = None) -> dict[str, Any]:
    """``stat`` and the non-finite counts at each (step, position) of a page of positions (or,
    with ``spread``, of that many positions spread evenly over all of them), as arrays; the
    steps evenly thinned to ``max_steps``, the first and last kept.

    Positions are numbered as one integer each (row-major over the index rows), so a page and
    a grid are a few numpy calls whatever the depth; only the page's scalars are read (a
    family of 5,000 members reads ``limit`` of them)."""
    blocks = index.depth_arrays(info, mode)
    rank = blocks[0].index.shape[1] if blocks else 1
    scalars: dict[str, tuple[int, ...]]
    if info.kind == "repeat":
        scalars = {name: (number,) for number, name in info.members.items()}
    else:
        scalars = {f"{info.site}[{','.join(map(str, p))}]": p for p in info.positions}
        if not blocks and scalars:
            rank = len(next(iter(scalars.values())))
        scalars = {k: p for k, p in scalars.items() if len(p) == rank}
    tops = [b.index.max(axis=(0, 2)) for b in blocks] + [np.array(p) for p in scalars.values()]
    dims = tuple(int(d) + 1 for d in np.max(tops, axis=0)) if tops else (1,) * rank
    if math.prod(dims) >= 2 ** 62:
        raise BadRequest(f"site {info.site!r} has positions too large to number "
                         f"({dims}): its event file is not one the exporter writes")
    # Each column's position as one number, -1 where the column holds none.
    ids = [np.where(b.ok, np.ravel_multi_index(tuple(np.moveaxis(b.index, 1, 0)), dims), -1)
           for b in blocks]
    known_parts = [i[i >= 0] for i in ids]
    if scalars:
        known_parts.append(np.ravel_multi_index(tuple(np.array(list(scalars.values())).T),
                                                dims))
    known = np.unique(np.concatenate(known_parts)) if known_parts else np.zeros(0, np.int64)
    if spread is None:
        page_ids = known[offset:offset + limit]
    else:
        page_ids = known[np.unique(np.round(np.linspace(
            0, len(known) - 1, min(spread, len(known)))).astype(int))]
    page = [tuple(int(v) for v in p) for p in zip(*np.unravel_index(page_ids, dims),
                                                   strict=True)] if len(page_ids) else []
    points = index.scalar_points({k: p for k, p in scalars.items() if p in set(page)}, mode,
                                 stat, max_steps + 1)
    all_steps = np.unique(np.concatenate([b.steps for b in blocks] + [np.array(
        points.steps(), np.int64)])).tolist()
    steps = thin(all_steps, max_steps)
    row_of = {step: i for i, step in enumerate(steps)}
    chosen = np.array(steps, np.int64)
    values = np.full((len(steps), len(page)), np.nan)
    counts = np.full((len(steps), len(page)), np.nan)
    for b, lin in zip(blocks, ids, strict=True):
        if not len(page_ids) or not len(chosen):
            continue
        at_row = np.minimum(np.searchsorted(chosen, b.steps), len(chosen) - 1)
        rows = np.where(chosen[at_row] == b.steps, at_row, -1)
        if not (rows >= 0).any():
            continue
        cols = np.minimum(np.searchsorted(page_ids, lin), len(page_ids) - 1)
        keep = (page_ids[cols] == lin) & (lin >= 0) & (rows[:, None] >= 0)
        at = (np.broadcast_to(rows[:, None], keep.shape)[keep], cols[keep])
        values[at] = b.stat(stat)[keep]
        counts[at] = b.counts()[keep]
    col_of = {p: j for j, p in enumerate(page)}
    for step, cells in points.cells.items():
        i = row_of.get(step)
        for p, (v, c) in cells.items() if i is not None else ():
            values[i, col_of[p]], counts[i, col_of[p]] = v, c
    return {"steps": steps, "page": page, "values": values, "counts": counts,
            "positions": int(len(known)), "downsampled": len(all_steps) > max_steps}


def _spark(index: RunIndex, info: SiteInfo, mode: str, stat: str, points: int,
           row: dict[str, Any]) -> None:
    """Fills an overview row's ``last`` value and ``spark`` chart."""
    if info.kind in ("plain", "logged"):
        tag = info.site if info.kind == "logged" else f"{info.site}/{mode}/{stat}"
        data = index.read_scalars([tag], 10**9).get(tag, [])
        if data:
            by_step = {int(p.step): float(p.value) for p in data}
            steps = thin(sorted(by_step), points)
            values = np.array([by_step[s] for s in steps])
            row["spark"] = {"steps": steps, "values": json_grid(values, 4)}
            row["last"] = {"step": steps[-1], "value": json_grid(values[-1:])[0]}
        return
    # A scan's tensors hold every layer: all of them give the last value. A family's members
    # are a read each: a few, spread over the family, give the picture.
    grid = _depth_grid(index, info, mode, stat, points, 0, _MOST_POSITIONS,
                       spread=_SPARK_POSITIONS if info.kind == "repeat" else None)
    row["positions"] = grid["positions"]
    values = grid["values"]
    if not grid["steps"] or not values.size:
        return
    last = values[-1]
    finite = last[np.isfinite(last)]
    row["last"] = {"step": grid["steps"][-1],
                   "min": float(finite.min()) if finite.size else None,
                   "max": float(finite.max()) if finite.size else None,
                   "positions": int(finite.size)}
    cols = np.unique(np.round(np.linspace(0, values.shape[1] - 1,
                                          min(_SPARK_POSITIONS, values.shape[1]))).astype(int))
    row["spark"] = {"steps": grid["steps"], "index": [index_value(grid["page"][j]) for j in cols],
                    "values": json_grid(values[:, cols], 4)}


def _mark(bad: dict[tuple[str, str], dict[str, Any]], site: str, mode: str, step: int,
          position: Any) -> None:
    e = bad.get((site, mode))
    if e is None:
        if len(bad) >= _MOST_HEALTH:
            return
        e = bad[(site, mode)] = {"site": site, "mode": mode, "first_step": step,
                                 "first_index": position, "_steps": set()}
    e["_steps"].add(step)
    if step < e["first_step"]:
        e["first_step"], e["first_index"] = step, position


def _health_answer(first: dict[str, Any] | None, bad: dict[tuple[str, str], dict[str, Any]],
                   index: RunIndex) -> dict[str, Any]:
    sites = sorted(bad.values(), key=lambda e: (e["first_step"], e["site"], e["mode"]))
    for e in sites:
        e["steps"] = len(e.pop("_steps"))
    if first is None and sites:
        e = sites[0]
        first = {"site": e["site"], "mode": e["mode"], "step": e["first_step"],
                 "index": e["first_index"], "text": None}
    return {"first": first, "sites": sites,
            "skipped": [{"tag": t, "why": w} for t, w in index.skipped[:20]]}


def _arg(args: Any, key: str) -> str:
    value = args.get(key)
    if not value:
        raise BadRequest(
            f"the query parameter {key}= is missing: pass run=, site=, mode= and stat= (see "
            "GET /data/plugin/sowtel/sites?run=RUN for the choices)" if key != "run" else
            "the query parameter run= is missing: GET /data/plugin/sowtel/runs lists the runs")
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
