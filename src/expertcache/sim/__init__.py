"""Trace-driven simulation: replay through SlotTable, exact fast kernels, curves, cost model.

Torch-free by design (the probe imports torch lazily, only to measure a GPU).
"""

from .costmodel import ExpertCost, Hardware, miss_times, token_time, tokens_per_second
from .hardware import PRESETS as HARDWARE_PRESETS
from .hardware import load_hardware, probe
from .mrc import optimum_misses, sweep, sweep_sizes
from .replay import Prepared, ReplayResult, replay, resolve_policy, slots_for_fraction

__all__ = ["HARDWARE_PRESETS", "ExpertCost", "Hardware", "Prepared", "ReplayResult",
           "load_hardware", "miss_times", "optimum_misses", "probe", "replay", "resolve_policy",
           "slots_for_fraction", "sweep", "sweep_sizes", "token_time", "tokens_per_second"]
