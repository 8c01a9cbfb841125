"""Shared test settings.

``KVSM_HYPOTHESIS_SCALE=10`` runs every property-based test with ten times its
usual number of examples (a deeper search than CI's, for before a release).
"""

from __future__ import annotations

import os

HYPOTHESIS_SCALE = max(1, int(os.environ.get("KVSM_HYPOTHESIS_SCALE", "1")))


def examples(n: int) -> int:
    """``n`` examples, scaled by KVSM_HYPOTHESIS_SCALE."""
    return n * HYPOTHESIS_SCALE
