"""The cost model: per-token time from hits and misses, hardware profiles, expert sizes and
the slot pool's sizing (docs/cost-model.md).

Torch-free, below both ``runtime/`` (the ``auto`` miss path, pool sizing) and ``sim/``
(predicted tok/s, ``expertcache plan``): one model, so prediction and run agree.
"""

from .expertsize import ModelExperts, model_experts
from .hardware import DEFAULT, PRESETS, load_hardware, probe, save_profile
from .model import (ExpertCost, Hardware, bytes_moved, chosen_path, miss_times, prefer_cpu,
                    token_time, tokens_per_second)
from .pool import COMPUTE_BYTES, PoolSizing, default_dtype, resolve_slot_format, staging_slots

__all__ = ["COMPUTE_BYTES", "DEFAULT", "PRESETS", "ExpertCost", "Hardware", "ModelExperts",
           "PoolSizing", "bytes_moved", "chosen_path", "default_dtype", "load_hardware", "miss_times",
           "model_experts", "prefer_cpu", "probe", "resolve_slot_format", "save_profile", "staging_slots",
           "token_time", "tokens_per_second"]
