"""llama.cpp imatrix files and other per-expert counts: read, report, place.

``read`` an imatrix GGUF for per-layer expert counts, ``load_counts`` from any
source (imatrix, trace, popularity JSON, .npy), ``coverage`` per layer,
``placement_keys`` for a slot budget, and ``apply_imatrix`` / ``place`` to pin
or seed a SlotTable with the plan.
"""

from .apply import MODES, apply_imatrix, place, plan_keys, table_plan
from .counts import ExpertCounts
from .placement import coverage, placement_keys, plan_coverage
from .reader import ImatrixError, LegacyImatrixError, read
from .sources import load_counts, trace_counts

__all__ = ["MODES", "ExpertCounts", "ImatrixError", "LegacyImatrixError", "apply_imatrix", "coverage",
           "load_counts", "place", "placement_keys", "plan_keys", "plan_coverage", "read", "table_plan",
           "trace_counts"]
