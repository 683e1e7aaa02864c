"""expertcache inside vLLM: the expert cache as a vLLM general plug-in (docs/vllm.md).

vLLM loads ``plugin.register`` from the entry-point group ``vllm.general_plugins`` in
every process. It replaces vLLM's ``RoutedExperts`` layer class with a subclass that
does nothing unless ``additional_config={"expertcache": {...}}`` is given.

Modules, one job each:
  settings   the ``expertcache`` block of additional_config -> validated ``Settings`` (torch-free)
  plugin     registration (idempotent, any vLLM process), supported versions
  checks     refusals before loading: monolithic kernels, quantized or biased experts, EP/DP
  session    one per model: the SlotTable, the shared slot pool, counters, telemetry, trace
  pool       host experts [E, ...] per layer and the device slot pool [S + staging, ...]
  step       one layer step: plan, copy misses, remap ids, vLLM's modular kernel (rounds)
  op         the step as an opaque torch.library custom op (compiled mode)
  layer      the RoutedExperts subclass vLLM instantiates
  telemetry  stats JSON every N steps and at exit, Prometheus gauges under `vllm serve`
  recorder   routing of counted steps -> the project's trace .npz (replayable by `sim`)
"""
