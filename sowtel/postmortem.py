"""Post-mortem of dumps: ``sowtel inspect`` and ``sowtel diff``.

``sowtel inspect DUMP`` prints one row per array of a dump (name, mode, shape, dtype and the
statistics of the ``"stats"`` summary), flags the rows holding NaN or infinities, and names the
first of them in program order as the likely origin: a NaN born at one site spreads to every
site computed after it, so the earliest one is where to look. ``sowtel diff A B`` compares two
dumps entry by entry and exits 1 when they differ beyond tolerance.

Example:
    >>> import tempfile, numpy as np
    >>> from sowtel.dumps import dump
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = dump({"x": {"primal": np.array([1.0, 2.0])},
    ...               "y": {"primal": np.array([np.nan, 0.0])}}, d + "/a.safetensors")
    ...     report = inspect_dump(p)
    >>> report.origin.entry.name, report.rows[0].stats["mean"]
    ('y', 1.5)

Both commands are also functions (:func:`inspect_dump`, :func:`diff_dumps`) returning plain
dataclasses, for notebooks and tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sowtel import errors
from sowtel.dumps import (
    DumpEntry,
    DumpInfo,
    DumpReader,
    check_path,
    find_dumps,
    open_dump,
    program_order,
)
from sowtel.records import (
    NONFINITE_KINDS,
    NONFINITE_LABELS,
    STAT_KEYS,
    inexact,
    nonfinite_count,
)
from sowtel.summaries import host_summary

__all__ = [
    "EntryStats",
    "InspectReport",
    "inspect_dump",
    "EntryDiff",
    "DiffReport",
    "diff_dumps",
    "plot_histograms",
    "configure_inspect",
    "run_inspect",
    "configure_diff",
    "run_diff",
    "printable",
]

# Exit status of a command that could not read its input (argparse uses 2 for bad usage too).
EXIT_ERROR = 2


# ----------------------------------------------------------------------------- inspect


@dataclasses.dataclass(frozen=True)
class EntryStats:
    """One row of ``sowtel inspect``: an array of a dump and its ``"stats"`` summary.

    Example:
      >>> from sowtel.dumps import DumpEntry
      >>> e = DumpEntry("h", "h", "primal", (), (2,), "float32", "h::primal")
      >>> EntryStats(e, {"nan": 1.0, "posinf": 0.0, "neginf": 0.0}).nonfinite
      1
    """

    entry: DumpEntry
    stats: dict[str, float]
    #: For a stacked entry (scan iterations, shards): the stack indices whose slice holds a NaN
    #: or an infinity, in index order (``(2,)``, ``(0, 1)``); empty otherwise.
    nonfinite_at: tuple[tuple[int, ...], ...] = ()

    @property
    def nonfinite(self) -> int:
        """Count of NaN and infinite elements."""
        return nonfinite_count(self.stats)

    def to_json(self) -> dict[str, Any]:
        e = self.entry
        return {
            "name": e.name, "site": e.site, "mode": e.mode, "leaf": list(e.leaf),
            "shape": list(e.shape), "dtype": e.dtype,
            "stats": {k: _json_float(v) for k, v in self.stats.items()},
            "nonfinite": self.nonfinite > 0,
            "stacked": [list(axis) for axis in e.stacked],
            "nonfinite_at": [list(i) for i in self.nonfinite_at],
        }


@dataclasses.dataclass(frozen=True)
class InspectReport:
    """What ``sowtel inspect`` says about one dump.

    Attributes:
      info: the dump's header (path, step, metadata, version, sites).
      rows: one per array, in stored order (sites in program order, then modes, then leaves).
      origin: the first row with a non-finite value in program order (see
        :func:`sowtel.dumps.program_order`), or ``None`` when every value is finite.

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     r = inspect_dump(dump({"h": {"primal": np.ones(4)}}, d + "/a.safetensors"))
      >>> (len(r.rows), r.rows[0].stats["l2"], r.origin)
      (1, 2.0, None)
    """

    info: DumpInfo
    rows: tuple[EntryStats, ...]
    origin: EntryStats | None

    @property
    def nonfinite(self) -> tuple[EntryStats, ...]:
        """The rows holding NaN or infinities, in stored order."""
        return tuple(r for r in self.rows if r.nonfinite)

    def to_json(self) -> dict[str, Any]:
        i = self.info
        return {
            "path": str(i.path), "parts": [str(part) for part in i.parts],
            "step": i.step, "metadata": i.metadata,
            "sowtel_version": i.sowtel_version, "created": i.created, "sites": list(i.sites),
            "entries": [r.to_json() for r in self.rows],
            "nonfinite": [_ref(r) for r in self.nonfinite],
            "origin": _ref(self.origin) if self.origin else None,
        }


def _ref(row: EntryStats) -> dict[str, Any]:
    return {"name": row.entry.name, "site": row.entry.site, "mode": row.entry.mode,
            "nonfinite_at": [list(i) for i in row.nonfinite_at]}


def _json_float(v: float) -> float | None:
    # Strict JSON has no NaN: a statistic of an all-NaN array is reported as null.
    return float(v) if math.isfinite(v) else None


def _execution_keys(info: DumpInfo) -> dict[tuple[str, str], tuple[int, int, int]]:
    site_index = {s: i for i, s in enumerate(info.sites)}
    return {
        (site, mode): program_order(site_index[site], mode, j)
        for site in info.sites
        for j, mode in enumerate(info.modes(site))
    }


def _iter_arrays(
    f: DumpReader, entries: Sequence[DumpEntry]
) -> Iterator[tuple[DumpEntry, np.ndarray]]:
    # Checksums are checked first, streaming through the file, so a corrupted dump is refused
    # before anything is summarised; then the arrays are memory-mapped, so a dump larger than
    # memory is summarised one array at a time (a global value of a multi-process dump is
    # assembled from its parts' shards, one value at a time).
    f.verify()
    read = f.reader(lazy=True)
    for e in entries:
        yield e, read(e)


def _first_nonfinite(info: DumpInfo, rows: Sequence[EntryStats]) -> EntryStats | None:
    keys = _execution_keys(info)
    bad = [(keys[(r.entry.site, r.entry.mode)], i, r) for i, r in enumerate(rows) if r.nonfinite]
    return min(bad, key=lambda b: (b[0], b[1]))[2] if bad else None


def inspect_dump(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
                 ) -> InspectReport:
    """Summarises every array of a dump and finds the first non-finite one in program order.

    The statistics are those of the ``"stats"`` summary (:data:`sowtel.records.STAT_KEYS`),
    computed by :func:`sowtel.summaries.host_summary`. Raises ``ValueError`` naming the path if
    the file is truncated, corrupted (checksums are checked) or not a sowtel dump. A
    multi-process dump (any of its parts, or the list of them) is summarised whole: the
    statistics are those of the global values.

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     r = inspect_dump(dump({"h": {"primal": np.array([3, 4])}}, d + "/a.safetensors"))
      >>> r.rows[0].stats["l2"], r.rows[0].stats["zeros"]
      (5.0, 0.0)
    """
    f = open_dump(path)
    info = f.info()
    rows = []
    for e, arr in _iter_arrays(f, info.entries):
        row = EntryStats(e, host_summary(arr, "stats")["stats"])
        if row.nonfinite and e.stacked and inexact(arr.dtype):
            lengths = tuple(n for _, n in e.stacked)
            bad = ~np.isfinite(arr).reshape(*lengths, -1).all(axis=-1)
            at = tuple(tuple(int(i) for i in ix) for ix in np.argwhere(bad))
            row = dataclasses.replace(row, nonfinite_at=at)
        rows.append(row)
    return InspectReport(info, tuple(rows), _first_nonfinite(info, rows))


def _where(row: EntryStats) -> str:
    """``" at index 2 of [scan 4]"``: where in its stack an entry's non-finite values are."""
    if not row.nonfinite_at:
        return ""
    kinds = " x ".join(f"{kind} {n}" for kind, n in row.entry.stacked)
    shown = [i[0] if len(i) == 1 else i for i in row.nonfinite_at[:6]]
    more = f" and {len(row.nonfinite_at) - 6} more" if len(row.nonfinite_at) > 6 else ""
    which = "index" if len(row.nonfinite_at) == 1 else "indices"
    return f" at {which} {', '.join(map(str, shown))}{more} of [{kinds}]"


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}"


_COLUMNS = ("name", "mode", "shape", "dtype", *STAT_KEYS, "")
_HEADINGS = {k: v for k, v in NONFINITE_LABELS.items() if k != "nan"}  # "nan" stays as is


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters shown as escapes.

    Names, modes and paths come from files anyone may have crafted; printed raw, an escape
    sequence in one could rewrite the terminal (clear it, retitle it, hide rows). Every
    character that is not printable becomes its Python escape; the names themselves are
    unchanged in the dump and in the JSON output (where JSON escapes them).

    Example:
      >>> print(printable("h" + chr(27) + "[2J"))
      h\\x1b[2J
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _table(rows: Sequence[Sequence[str]], numeric_from: int) -> list[str]:
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if numeric_from <= i < len(r) - 1 else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_report(report: InspectReport) -> str:
    """The aligned text table ``sowtel inspect`` prints for one dump.

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     text = format_report(inspect_dump(dump({"h": {"primal": np.ones(2)}},
      ...                                             d + "/a.safetensors")))
      >>> "all values finite" in text
      True
    """
    i = report.info
    head = f"dump {i.path}  step={i.step}  sowtel {i.sowtel_version}  {len(report.rows)} arrays"
    if i.parts:
        head += f"  (global values of {len(i.parts)} processes' parts)"
    lines = [head]
    if i.metadata:
        lines.append(f"metadata {json.dumps(i.metadata, sort_keys=True)}")
    table = [[_HEADINGS.get(c, c) for c in _COLUMNS]]
    for r in report.rows:
        note = ""
        if r.nonfinite:
            note = "<- NON-FINITE" + _where(r)
            if r is report.origin:
                note += ", first in program order (likely origin)"
        e = r.entry
        table.append([e.name, e.mode, str(e.shape), e.dtype,
                      *(_fmt(r.stats[k]) for k in STAT_KEYS), note])
    if report.rows:
        lines += _table(table, numeric_from=4)
    else:
        lines.append("(no arrays)")
    if report.origin is None:
        lines.append("all values finite")
    else:
        o = report.origin
        lines.append(
            f"{len(report.nonfinite)} of {len(report.rows)} arrays hold NaN or Inf; the first in "
            f"program order is {o.entry.name!r} ({o.entry.mode}){_where(o)}: "
            + " ".join(f"{NONFINITE_LABELS[k].lower()}={_fmt(o.stats[k])}"
                       for k in NONFINITE_KINDS) + " - the likely origin"
        )
    return "\n".join(printable(line) for line in lines)


def plot_histograms(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                    out: str | os.PathLike[str],
                    *, bins: int = 30) -> list[str]:
    """Draws one histogram panel per (site, mode) of a dump into a PNG; returns the titles.

    A pytree site's leaves are pooled into its panel. Only finite values are counted; a
    panel's title says how many were NaN or infinite. Needs matplotlib (``sowtel[dumps]``).

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     p = dump({"h": {"primal": np.arange(9.0), "cotangent": np.ones(9)}},
      ...              d + "/a.safetensors")
      ...     plot_histograms(p, d + "/h.png")
      ['h (primal)', 'h (cotangent)']
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib: pip install 'sowtel[dumps]' ({e})") from e
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise errors.BadOptionError("bins", bins, "must be a positive number of histogram buckets")
    f = open_dump(path)
    info = f.info()
    panels: dict[tuple[str, str], list[np.ndarray]] = {}
    for entry, arr in _iter_arrays(f, info.entries):
        a = np.abs(arr) if np.iscomplexobj(arr) else arr
        panels.setdefault((entry.site, entry.mode), []).append(a.astype(np.float64).ravel())
    if not panels:
        raise errors.BadDumpError(info.path, "holds no arrays to plot")
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    # Panels are white on a grey figure, so each one is a distinct white region of the image.
    fig = Figure(figsize=(4.0 * ncols, 3.0 * nrows), facecolor="#e8e8e8", layout="constrained")
    FigureCanvasAgg(fig)
    keys = _execution_keys(info)
    nonfinite = {p: sum(int((~np.isfinite(v)).sum()) for v in parts)
                 for p, parts in panels.items()}
    origin = min((keys[p] for p, n in nonfinite.items() if n), default=None)
    titles = []
    for k, ((site, mode), parts) in enumerate(panels.items()):
        ax = fig.add_subplot(nrows, ncols, k + 1, facecolor="white")
        values = np.concatenate(parts)
        finite = values[np.isfinite(values)]
        bad = nonfinite[(site, mode)]
        title = f"{site} ({mode})"
        titles.append(title)
        if bad:
            is_origin = keys[(site, mode)] == origin
            title += f"  [{bad} non-finite{', likely origin' if is_origin else ''}]"
        ax.set_title(title, fontsize=9, color="red" if bad else "black")
        if finite.size:
            ax.hist(finite, bins=bins, color="#4c72b0")
        else:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center",
                    transform=ax.transAxes)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{info.path.name}  step={info.step}", fontsize=10)
    fig.savefig(os.fspath(out), format="png", dpi=80,
                metadata={"Title": f"sowtel histograms of {info.path.name}",
                          "Description": json.dumps(titles)})
    return titles


def _select_steps(path: Path, step: str | None) -> list[Path]:
    if not path.is_dir():
        if step is not None:
            raise errors.BadCommandLineError(f"--step {step}", "applies to a folder of dumps; "
                                             f"{str(path)!r} is a file")
        return [path]
    found = find_dumps(path)
    if step is None:
        return list(found.values())
    if step == "latest":
        return [found[max(found)]]
    try:
        k = int(step)
    except ValueError:
        raise errors.BadCommandLineError(f"--step {step!r}",
                                         "must be an integer step or 'latest'") from None
    if k not in found:
        raise errors.BadCommandLineError(
            f"--step {k}:", f"{str(path)!r} has no dump for step {k}: its steps are "
            f"{', '.join(map(str, found))}")
    return [found[k]]


def configure_inspect(parser: argparse.ArgumentParser) -> None:
    """Adds ``sowtel inspect``'s arguments to ``parser``."""
    parser.add_argument("path", metavar="PATH", nargs="+",
                        help="a dump file, or a folder of step_<k>.safetensors dumps; several "
                             "files are the per-process parts of one multi-process dump (one "
                             "part is enough when the others lie beside it)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="also draw one histogram panel per (site, mode) into this PNG")
    parser.add_argument("--step", metavar="K",
                        help="for a folder: only step K ('latest' for the last); default all")
    parser.add_argument("--bins", type=int, default=30, help="histogram buckets for --plot")


def run_inspect(args: argparse.Namespace) -> int:
    """Runs ``sowtel inspect``: 0 when it could read the dump(s), 2 when not."""
    try:
        if len(args.path) > 1:
            if args.step is not None:
                raise errors.BadCommandLineError(f"--step {args.step}", "applies to a folder of "
                                                 "dumps, not to the parts of one dump")
            paths: list[Any] = [[Path(p) for p in args.path]]
        else:
            paths = _select_steps(Path(args.path[0]), args.step)
        reports = [inspect_dump(p) for p in paths]
        plotted = None
        if args.plot:
            plotted = plot_histograms(paths[-1], args.plot, bins=args.bins)
    except (OSError, ValueError, ImportError) as e:
        print(f"sowtel inspect: error: {printable(str(e))}", file=sys.stderr)
        return EXIT_ERROR
    first = next((r for r in reports if r.origin is not None), None)
    if args.json:
        out: dict[str, Any] = {"dumps": [r.to_json() for r in reports], "origin": None}
        if first is not None and first.origin is not None:
            out["origin"] = {"path": str(first.info.path), "step": first.info.step,
                             **_ref(first.origin)}
        if plotted is not None:
            out["plot"] = {"path": args.plot, "panels": plotted}
        print(json.dumps(out, indent=2))
        return 0
    print("\n\n".join(format_report(r) for r in reports))
    if len(reports) > 1:
        print()
        if first is not None and first.origin is not None:
            print(printable(f"first non-finite over all steps: step {first.info.step}, "
                            f"{first.origin.entry.name!r} ({first.origin.entry.mode})"))
        else:
            print(f"all values finite in all {len(reports)} steps")
    if plotted is not None:
        print(printable(f"wrote {len(plotted)} histogram panels to {args.plot}"))
    return 0


# ----------------------------------------------------------------------------- diff


@dataclasses.dataclass(frozen=True)
class EntryDiff:
    """How one array differs between dump A and dump B (B is the reference).

    Attributes:
      name, mode: the entry (``name`` is ``site`` or ``site/<leaf path>``).
      step: the step, when diffing folders of dumps, else ``None``.
      shape: the common shape; dtype_a, dtype_b: the two dtypes.
      max_abs: the largest ``|a - b|`` over elements finite in both (0 when there are none).
      max_rel: the largest ``|a - b| / |b|`` over those elements (``inf`` where ``b == 0 != a``).
      beyond: elements not within ``atol + rtol * |b|`` (NaN matches NaN, inf matches inf).
      nonfinite_mismatch: of those, elements where A or B is NaN or infinite.

    Example:
      >>> EntryDiff("h", "primal", None, (2,), "float32", "float32", 0.5, 0.25, 1, 0).equal
      False
    """

    name: str
    mode: str
    step: int | None
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs: float
    max_rel: float
    beyond: int
    nonfinite_mismatch: int

    @property
    def equal(self) -> bool:
        """Whether every element is within tolerance."""
        return self.beyond == 0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["max_abs"] = _json_float(self.max_abs)
        # JSON has no infinity: null means |b| == 0 while |a - b| > 0.
        d["max_rel"] = _json_float(self.max_rel)
        d["equal"] = self.equal
        return d


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What ``sowtel diff`` found.

    Attributes:
      a, b: the two paths; rtol, atol: the tolerance.
      structural: sites, modes, leaves or steps present in only one dump, and differences of
        pytree structure, shape or dtype, one readable sentence each.
      entries: value comparisons of the arrays present in both with the same shape.

    Example:
      >>> DiffReport("a", "b", 1e-5, 1e-8, ("site 'x' only in A",), ()).equal
      False
    """

    a: str
    b: str
    rtol: float
    atol: float
    structural: tuple[str, ...]
    entries: tuple[EntryDiff, ...]

    @property
    def equal(self) -> bool:
        """Same structure, and every value within tolerance: ``sowtel diff`` exits 0."""
        return not self.structural and all(e.equal for e in self.entries)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol,
                "equal": self.equal, "structural": list(self.structural),
                "entries": [e.to_json() for e in self.entries]}


def _signature(f: DumpReader, site: str, mode: str) -> str:
    def render(n: Any) -> str:
        if n is None:
            return "None"
        if n is ...:
            return "*"
        if isinstance(n, list):
            return "[" + ", ".join(render(c) for c in n) + "]"
        if isinstance(n, tuple):
            return "(" + ", ".join(render(c) for c in n) + (",)" if len(n) == 1 else ")")
        return "{" + ", ".join(f"{k!r}: {render(c)}" for k, c in n.items()) + "}"

    return render(f.structure(site, mode))


def _compare_values(a: np.ndarray, b: np.ndarray, rtol: float, atol: float
                    ) -> tuple[float, float, int, int]:
    wide = np.complex128 if (np.iscomplexobj(a) or np.iscomplexobj(b)) else np.float64
    a, b = a.astype(wide), b.astype(wide)
    close = np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    both_finite = np.isfinite(a) & np.isfinite(b)
    d = np.abs(a[both_finite] - b[both_finite])
    ref = np.abs(b[both_finite])
    max_abs = float(d.max()) if d.size else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(d == 0, 0.0, d / ref)
    max_rel = float(rel.max()) if rel.size else 0.0
    beyond = int((~close).sum())
    return max_abs, max_rel, beyond, int((~close & ~both_finite).sum())


def _diff_files(pa: Path, pb: Path, rtol: float, atol: float, step: int | None,
                structural: list[str], entries: list[EntryDiff]) -> None:
    fa, fb = open_dump(pa), open_dump(pb)
    ia, ib = fa.info(), fb.info()
    at = f"step {step}: " if step is not None else ""
    sites_b = set(ib.sites)
    for s in ia.sites:
        if s not in sites_b:
            structural.append(f"{at}site {s!r} only in A")
    structural += [f"{at}site {s!r} only in B" for s in ib.sites if s not in set(ia.sites)]
    by_a = {(e.site, e.mode, e.leaf): e for e in ia.entries}
    by_b = {(e.site, e.mode, e.leaf): e for e in ib.entries}
    pairs: list[tuple[DumpEntry, DumpEntry]] = []
    for site in (s for s in ia.sites if s in sites_b):
        modes_a, modes_b = ia.modes(site), ib.modes(site)
        structural += [f"{at}{site!r} mode {m} only in A" for m in modes_a if m not in modes_b]
        structural += [f"{at}{site!r} mode {m} only in B" for m in modes_b if m not in modes_a]
        # A mode with no array leaves (a None value) has no entries but still has a structure.
        names_a, names_b = list(fa.modes(site)), list(fb.modes(site))
        for mode in (m for m in names_a if m in names_b):
            sig_a = _signature(fa, site, mode)
            sig_b = _signature(fb, site, mode)
            if sig_a != sig_b:
                structural.append(
                    f"{at}{site!r} ({mode}) has a different pytree structure: "
                    f"A {sig_a}, B {sig_b}"
                )
            for key, ea in by_a.items():
                if key[:2] != (site, mode):
                    continue
                eb = by_b.get(key)
                if eb is None:
                    structural.append(f"{at}{ea.name!r} ({mode}) only in A")
                elif ea.shape != eb.shape:
                    structural.append(
                        f"{at}{ea.name!r} ({mode}) has shape {ea.shape} in A, {eb.shape} in B")
                else:
                    if ea.dtype != eb.dtype:
                        structural.append(
                            f"{at}{ea.name!r} ({mode}) has dtype {ea.dtype} in A, "
                            f"{eb.dtype} in B")
                    pairs.append((ea, eb))
            structural += [
                f"{at}{eb.name!r} ({mode}) only in B"
                for key, eb in by_b.items() if key[:2] == (site, mode) and key not in by_a
            ]
    fa.verify()
    fb.verify()
    read_a, read_b = fa.reader(lazy=True), fb.reader(lazy=True)
    for ea, eb in pairs:
        a, b = read_a(ea), read_b(eb)
        max_abs, max_rel, beyond, nonfinite = _compare_values(a, b, rtol, atol)
        entries.append(EntryDiff(ea.name, ea.mode, step, ea.shape, ea.dtype, eb.dtype,
                                 max_abs, max_rel, beyond, nonfinite))


def _check_tolerance(value: Any, what: str) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise errors.BadOptionError(what, value, "must be a finite number >= 0")
    return v


def diff_dumps(a: str | os.PathLike[str], b: str | os.PathLike[str], *,
               rtol: float = 1e-5, atol: float = 1e-8) -> DiffReport:
    """Compares two dumps (or two folders of dumps) entry by entry; B is the reference.

    An element of A matches B when ``|a - b| <= atol + rtol * |b|`` (numpy's ``isclose``), NaN
    matching NaN and an infinity the same infinity. Sites, modes, leaves and (for folders) steps
    present in only one side, and differences of pytree structure, shape or dtype, are listed in
    ``structural``; they never raise. Unreadable files raise ``ValueError`` naming the path.

    Example:
      >>> import tempfile, numpy as np
      >>> from sowtel.dumps import dump
      >>> with tempfile.TemporaryDirectory() as d:
      ...     a = dump({"h": {"primal": np.array([1.0, 2.0])}}, d + "/a.safetensors")
      ...     b = dump({"h": {"primal": np.array([1.0, 2.5])}}, d + "/b.safetensors")
      ...     r = diff_dumps(a, b)
      >>> r.equal, r.entries[0].max_abs, r.entries[0].max_rel
      (False, 0.5, 0.2)
    """
    rtol = _check_tolerance(rtol, "rtol")
    atol = _check_tolerance(atol, "atol")
    pa, pb = Path(check_path(a, "a")), Path(check_path(b, "b"))
    for p in (pa, pb):
        if not p.exists():
            raise FileNotFoundError(f"{str(p)!r} does not exist: give two sowtel dumps to diff")
    structural: list[str] = []
    entries: list[EntryDiff] = []
    if pa.is_dir() != pb.is_dir():
        raise errors.BadCommandLineError(
            f"cannot diff {str(pa)!r} with {str(pb)!r}:", "one is a folder of dumps and the "
            "other a file; give two files, or two folders")
    if pa.is_dir():
        steps_a, steps_b = find_dumps(pa), find_dumps(pb)
        structural += [f"step {k} only in A" for k in steps_a if k not in steps_b]
        structural += [f"step {k} only in B" for k in steps_b if k not in steps_a]
        for k, fa in steps_a.items():
            if k in steps_b:
                _diff_files(fa, steps_b[k], rtol, atol, k, structural, entries)
    else:
        _diff_files(pa, pb, rtol, atol, None, structural, entries)
    return DiffReport(str(pa), str(pb), rtol, atol, tuple(structural), tuple(entries))


def format_diff(report: DiffReport) -> str:
    """The text ``sowtel diff`` prints.

    Example:
      >>> print(format_diff(DiffReport("a", "b", 1e-5, 1e-8, ("site 'x' only in A",), ())))
      diff A=a B=b  (rtol=1e-05, atol=1e-08; B is the reference)
      structural differences:
        site 'x' only in A
      DIFFERENT: 0 of 0 arrays differ beyond tolerance; 1 structural difference
    """
    lines = [f"diff A={report.a} B={report.b}  (rtol={report.rtol:g}, atol={report.atol:g}; "
             "B is the reference)"]
    if report.structural:
        lines.append("structural differences:")
        lines += [f"  {s}" for s in report.structural]
    if report.entries:
        steps = any(e.step is not None for e in report.entries)
        table = [[*(["step"] if steps else []), "name", "mode", "shape", "dtype", "max_abs",
                  "max_rel", "beyond_tol", ""]]
        for e in report.entries:
            dtype = e.dtype_a if e.dtype_a == e.dtype_b else f"{e.dtype_a}/{e.dtype_b}"
            table.append([*([str(e.step)] if steps else []), e.name, e.mode, str(e.shape),
                          dtype, f"{e.max_abs:.3g}", f"{e.max_rel:.3g}", str(e.beyond),
                          "ok" if e.equal else "<- DIFFERS" + (
                              f" ({e.nonfinite_mismatch} NaN/Inf mismatches)"
                              if e.nonfinite_mismatch else "")])
        lines += _table(table, numeric_from=len(table[0]) - 4)
    n_diff = sum(not e.equal for e in report.entries)
    n_struct = len(report.structural)
    verdict = "EQUAL" if report.equal else "DIFFERENT"
    lines.append(
        f"{verdict}: {n_diff} of {len(report.entries)} arrays differ beyond tolerance; "
        f"{n_struct} structural difference{'' if n_struct == 1 else 's'}"
    )
    return "\n".join(printable(line) for line in lines)


def configure_diff(parser: argparse.ArgumentParser) -> None:
    """Adds ``sowtel diff``'s arguments to ``parser``."""
    parser.add_argument("a", metavar="A", help="a dump (or a folder of dumps)")
    parser.add_argument("b", metavar="B", help="the reference dump (or folder) to compare with")
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=float, default=1e-8,
                        help="absolute tolerance (default 1e-8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_diff(args: argparse.Namespace) -> int:
    """Runs ``sowtel diff``: 0 when equal within tolerance, 1 when not, 2 on unreadable input."""
    try:
        report = diff_dumps(args.a, args.b, rtol=args.rtol, atol=args.atol)
    except (OSError, ValueError) as e:
        print(f"sowtel diff: error: {printable(str(e))}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_diff(report))
    return 0 if report.equal else 1
