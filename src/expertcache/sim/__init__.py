"""Trace-driven simulation: replay through SlotTable, exact fast kernels, curves, ``plan``.

Torch-free by design. Predicted times come from ``expertcache.costmodel``.
"""

from .mrc import optimum_misses, sweep, sweep_sizes
from .replay import Prepared, ReplayResult, replay, resolve_policy, slots_for_fraction

__all__ = ["Prepared", "ReplayResult", "optimum_misses", "replay", "resolve_policy", "slots_for_fraction",
           "sweep", "sweep_sizes"]
