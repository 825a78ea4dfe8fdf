"""What the TensorBoard exporter shows first: its default statistics for each mode, and the
custom-scalars layout (the *Custom Scalars* tab) of a run.

The defaults are the statistics that move for most sites (see :data:`DEFAULT_STATS_BY_MODE`):
a ``mean`` of a cotangent is noise around zero, a min-max band of a zero-mean ``tanh`` is two
flat lines at +-1, while a gradient's l2 norm, an activation's spread and the largest magnitude
of either change as training goes.

The layout lists the :func:`sowtel.log` scalars first, then one category per site in program
order (the records' ``order``), each with one chart per mode in the order primal, tangent,
cotangent, then compositions; one statistic per chart, because TensorBoard colours a
custom-scalars chart's lines by run and a derivative's scale is unlike its value's.

Example:
    >>> site = Site()
    >>> _ = site.learn("cotangent", frozenset({"l2", "std"}), False, False, order=2)
    >>> _ = site.learn("primal", frozenset({"mean", "std", "max_abs"}), False, False, order=0)
    >>> list(site_charts("h", site))
    ['primal (activation): std', 'cotangent (gradient): l2 norm']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tensorboardX.summary import custom_scalars

from sowtel.records import COUNT_STATS, DERIVED_STATS, STAT_KEYS, mode_order

__all__ = ["LAYOUT_TAG", "LOG_CATEGORY", "DEFAULT_STATS_BY_MODE", "default_stats", "Site",
           "layout_summary", "site_charts"]

#: Tag under which TensorBoard's custom-scalars plugin looks for its layout.
LAYOUT_TAG = "custom_scalars__config__"
#: Category of the custom-scalars layout holding the scalars of :func:`sowtel.log`.
LOG_CATEGORY = "logged scalars"
#: The statistics the exporter writes by default (``stats="default"``), by mode: a value's
#: location, spread and largest magnitude; a derivative's norm, spread and largest magnitude.
#: A site whose value is one number writes only that number (``mean``), whatever its mode.
DEFAULT_STATS_BY_MODE: dict[str, tuple[str, ...]] = {
    "primal": ("mean", "std", "max_abs"),
    "derivative": ("l2", "std", "max_abs"),
}

# Charts fall back to the first statistic written, in this order.
_CHART_ORDER = {k: i for i, k in enumerate(STAT_KEYS + DERIVED_STATS)}
# The statistic a site's chart shows for each kind of mode, when it is written.
_CHART_STAT = {"primal": "std", "derivative": "l2"}
_STAT_WORDS = {"l2": "l2 norm", "max_abs": "max |x|"}
# Chart titles name a mode with the word ML users know for it.
_MODE_WORDS = {"primal": "activation", "cotangent": "gradient"}


def default_stats(mode: str) -> Sequence[str]:
    """The statistics written by default for a record of ``mode``.

    Example:
        >>> default_stats("primal"), default_stats("cotangent.tangent")
        (('mean', 'std', 'max_abs'), ('l2', 'std', 'max_abs'))
    """
    return DEFAULT_STATS_BY_MODE["primal" if mode == "primal" else "derivative"]


def chart_regex(name: str, mode: str | None, stat: str) -> str:
    """One statistic of one site and mode (any mode for None), every scan iteration."""
    modes = "[^/]+" if mode is None else re.escape(mode)
    return "^" + re.escape(name) + r"(\[[0-9,]+\])?/" + modes + "/" + stat + "$"


class Site:
    """What the custom-scalars layout needs to know of one site."""

    __slots__ = ("modes", "indexed", "nonfinite", "logged", "order", "single")

    def __init__(self) -> None:
        self.modes: dict[str, frozenset[str]] = {}  # mode -> statistics written
        self.indexed = False
        self.nonfinite = False
        self.logged = False  # a name of sowtel.log
        self.order: int | None = None  # the site's place in its program, for sorting
        self.single = False  # its value is one number (a loss): its chart is its value

    def learn(self, mode: str, stats: frozenset[str], indexed: bool, nonfinite: bool,
              order: int = 0, single: bool = False) -> bool:
        """Adds what one record shows; returns whether the layout changed."""
        known = self.modes.get(mode)
        changed = known is None or not known.issuperset(stats)
        if self.order is None or order < self.order:
            changed |= self.order is not None
            self.order = order
        if changed:
            self.modes[mode] = stats if known is None else known | stats
        changed |= ((indexed and not self.indexed) or (nonfinite and not self.nonfinite)
                    or (single and not self.single))
        self.indexed |= indexed
        self.nonfinite |= nonfinite
        self.single |= single
        return changed


def layout_summary(layout: dict[str, Site]) -> Any:
    """The layout's ``Summary``: logged scalars, then the sites in program order."""
    categories: dict[str, dict[str, list[Any]]] = {}
    logged = sorted(name for name, site in layout.items() if site.logged)
    if logged:
        categories[LOG_CATEGORY] = {
            name: ["Multiline", ["^" + re.escape(name) + "$"]] for name in logged}
    for name, site in sorted(layout.items(), key=lambda kv: (kv[1].order or 0, kv[0])):
        if site.modes:
            categories[name] = site_charts(name, site)
    return custom_scalars(categories)


def mode_title(mode: str) -> str:
    """A mode with the word users know beside it: ``cotangent (gradient)``.

    Example:
        >>> mode_title("cotangent"), mode_title("cotangent.tangent")
        ('cotangent (gradient)', 'cotangent.tangent')
    """
    word = _MODE_WORDS.get(mode)
    return f"{mode} ({word})" if word else mode


def site_charts(name: str, site: Site) -> dict[str, list[Any]]:
    """One chart per mode of the site, in mode order, and its counts once one was non-zero."""
    charts: dict[str, list[Any]] = {}
    for mode in sorted(site.modes, key=mode_order):
        written = site.modes[mode]
        shown = sorted((k for k in written if k not in COUNT_STATS and k != "size"),
                       key=lambda k: _CHART_ORDER.get(k, len(_CHART_ORDER)))
        preferred = "mean" if site.single else _CHART_STAT[
            "primal" if mode == "primal" else "derivative"]
        stat = preferred if preferred in written else (shown[0] if shown else None)
        if stat is None:
            continue
        if site.single and stat == "mean":
            title = "value" if mode == "primal" else f"{mode_title(mode)}: value"
        else:
            title = f"{mode_title(mode)}: {_STAT_WORDS.get(stat, stat)}"
        charts[title] = ["Multiline", [chart_regex(name, mode, stat)]]
    if site.nonfinite:
        counts = "(" + "|".join(COUNT_STATS) + ")"
        charts["NaN and infinities"] = ["Multiline", [chart_regex(name, None, counts)]]
    return charts
