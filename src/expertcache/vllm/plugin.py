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
    _shield_llvmlite()
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


def _shield_llvmlite() -> None:
    """Keep numba (which runs the built-in policies) from breaking vLLM's kernel dispatcher.

    vLLM 0.32's CPU worker rebinds Triton kernels by scanning every module namespace and
    calling ``vars(value).get("kernel")`` on each value that ``hasattr(value, "__dict__")``.
    llvmlite's ``binding.ffi.lib`` answers any attribute with a wrapped C function, so
    ``vars(lib)`` is not a dict and the scan raises AttributeError: any vLLM engine made
    after numba was imported fails to start. Giving ``lib`` an empty ``__dict__`` entry in
    its own function table makes the scan skip it; llvmlite never looks that name up.
    ``tests/vllm_plugin`` pins this (engines made after the kernels compiled).
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
