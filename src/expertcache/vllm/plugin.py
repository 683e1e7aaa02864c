"""The entry point vLLM calls in each of its processes (group ``vllm.general_plugins``).

Registration is idempotent: a second call in the same process finds our class already
registered and returns. It only swaps the class vLLM builds for ``RoutedExperts``; the
class does nothing unless ``additional_config`` has an ``expertcache`` block.
"""

from __future__ import annotations

import logging

SUPPORTED = ("0.32",)  # vLLM minor versions whose RoutedExperts / forward_modular we read
log = logging.getLogger("expertcache.vllm")


def register() -> None:
    import vllm
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    version = ".".join(vllm.__version__.split(".")[:2])
    if version not in SUPPORTED:
        log.warning("expertcache: vLLM %s is not a supported version (%s); the plug-in stays off",
                    vllm.__version__, ", ".join(SUPPORTED))
        return
    from . import op  # noqa: F401  (registers the custom op once per process)
    from .layer import ExpertCacheRoutedExperts

    present = op_registry_oot.get("RoutedExperts")
    if present is ExpertCacheRoutedExperts:
        return
    if present is not None:
        log.warning("expertcache: another plug-in already replaced RoutedExperts (%s); "
                    "the expert cache stays off", present)
        return
    PluggableLayer.register_oot(ExpertCacheRoutedExperts, name="RoutedExperts")
    from .telemetry import register_collector
    register_collector()
