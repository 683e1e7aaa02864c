"""Trace-driven simulation: replay through SlotTable, fast exact kernels, curves, cost model.

Torch-free by design (the probe imports torch lazily, only when asked to measure a GPU).
"""

from .replay import Prepared, ReplayResult, replay, resolve_policy, slots_for_fraction

__all__ = ["Prepared", "ReplayResult", "replay", "resolve_policy", "slots_for_fraction"]
