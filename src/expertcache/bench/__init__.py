"""The decode benchmark: baselines and the cache on real expert weights, timed per phase.

``workload`` (trace + model shape) and ``strategies`` are torch-free; ``model``,
``live``, ``calibrate`` and ``run`` execute through the runtime and need torch, so
they are imported by name, not here.
"""
