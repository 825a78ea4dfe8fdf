"""Reference computations the tests check sowtel against, written directly with numpy."""

from __future__ import annotations

import math

import numpy as np


def numpy_stats(x: np.ndarray) -> dict[str, float]:
    """The "stats" summary computed directly with numpy in float64, as DESIGN §4 defines it."""
    x = np.asarray(x)
    v = (np.abs(x) if np.iscomplexobj(x) else x).astype(np.float64).ravel()
    fin = v[np.isfinite(v)]
    return {
        "size": float(v.size),
        "mean": float(np.mean(fin)) if fin.size else math.nan,
        "std": float(np.std(fin)) if fin.size else math.nan,
        "min": float(np.min(fin)) if fin.size else math.nan,
        "max": float(np.max(fin)) if fin.size else math.nan,
        "l2": float(np.linalg.norm(fin)) if fin.size else math.nan,  # no finite element
        "mean_abs": float(np.mean(np.abs(fin))) if fin.size else math.nan,
        "nan": float(np.isnan(v).sum()),
        "posinf": float(np.isposinf(v).sum()),
        "neginf": float(np.isneginf(v).sum()),
        "zeros": float((v == 0).sum()),
    }
