"""The accounting of records: where every record received went, per exporter and in total.

:meth:`sowtel.dispatcher.Dispatcher.status` reads every counter at one moment (under the
dispatcher's lock, the workers' counts included); the rules that turn those counters into
accounts live here.

Example:
    >>> merge_reasons({"queue_full": 2}, {"stalled": 1, "closed": 0})
    {'queue_full': 2, 'stalled': 1}
"""

from __future__ import annotations

from typing import Any

__all__ = ["accounts", "merge_reasons"]


def merge_reasons(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Drop counts by reason of the queue (``a``) and of one exporter (``b``), without zeros."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return {k: v for k, v in out.items() if v}


def accounts(status: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Where every record received went, per exporter label and in ``"total"`` (the sums).

    For each label, ``received == exported + dropped + failed + late + pending``, and
    ``pending`` is 0 once :meth:`Dispatcher.flush` returned True or the dispatcher is closed.
    ``received`` counts every record once per exporter (``status["received"]`` plus the
    session's ``late``).

    Example:
        >>> from sowtel.dispatcher import Dispatcher
        >>> d = Dispatcher([], convert=list)
        >>> d.close()
        >>> accounts(d.status())["total"]
        {'received': 0, 'exported': 0, 'dropped': 0, 'failed': 0, 'late': 0, 'pending': 0}
    """
    late = int(status.get("late", 0))
    per: dict[str, dict[str, int]] = {}
    for label, exported in status["exported"].items():
        per[label] = {
            "received": status["received"] + late,
            "exported": exported,
            "dropped": sum(status["drop_reasons"][label].values()),
            "failed": status["failed"][label],
            "late": late,
            "pending": status["pending"][label],
        }
    keys = ("received", "exported", "dropped", "failed", "late", "pending")
    per["total"] = {k: sum(a[k] for a in per.values()) for k in keys}
    return per
