"""``offload()``: run a Hugging Face transformers MoE model with the two-tier expert cache.

Attaches through transformers' official experts hook (``ExpertsInterface`` +
``set_experts_implementation``): no model class is patched. ``loaders/`` puts the expert
weights in host memory before the rest of the model moves to the device, so the device
never holds all experts.
"""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..loaders import load
from ..runtime.clock import ForwardClock, new_tokens
from ..runtime.cpudense import report_of
from ..runtime.device import resolve_device
from ..runtime.engine import ExpertCache
from ..runtime.experts import IMPLEMENTATION, expertcache_experts_forward
from ..runtime.host import HostExperts
from ..runtime.threads import DecodeThreads


def offload(model_or_path, *, config: CacheConfig | None = None, **settings):
    """Keep ``model_or_path``'s experts in host memory behind a device slot pool; returns the model.

    ``model_or_path``: a loaded transformers MoE model (changed in place), a local
    checkpoint directory, or a GGUF file (``model.gguf`` or the first part of a split
    one; its experts stay quantized: docs/quantized.md).
    ``settings`` are ``CacheConfig``'s fields, checked before anything loads (or pass
    ``config``): ``slots`` or ``gpu_memory``, ``eviction`` / ``admission`` (names, specs such
    as ``'slru:protected=0.5'``, or ``PolicySpec``s; ``eviction_params`` / ``admission_params``
    by name), ``partition``, ``miss``, ``baseline``, ``device``, ``dtype``, ``staging``,
    ``imatrix`` (path to an imatrix .gguf, trace or counts file whose hot experts are placed
    before the first forward; ``imatrix_mode`` 'pin' keeps them, 'seed' lets them be evicted),
    ``slot_format`` ('auto', 'quantized', 'dequantized') and ``host_memory`` ('auto', 'copy',
    'mmap') for quantized experts, ``cpu_kernel`` ('auto', 'ggml', 'torch': how quantized experts
    computed on the CPU do their math, docs/cpu.md), ``hardware`` (a preset or probe profile) for the cost
    model of ``miss='auto'``, ``planner`` ('auto', the default: 'device' where decode is captured in
    graphs, else 'host'; 'host'; or 'device': decode steps on the device, the policy ``lag``
    forwards behind, staging rows in ``staging_blocks`` blocks, by default one per layer;
    docs/runtime.md), ``graphs`` ('auto', 'on', 'off': decode replayed from a
    captured step with the device planner, ``model.expertcache.graphs``; 'auto' on CUDA).
    ``model.expertcache`` then exposes ``stats()``, ``reset_stats()``, ``slot_bytes``, ``config``.
    """
    if config is not None and settings:
        raise TypeError(f"offload() takes either config or settings, not both (got {', '.join(settings)})")
    if config is None:
        config = CacheConfig(**settings)
    device = resolve_device(config.device)
    model, found, hosts = load(model_or_path, config, device)
    return attach(model, found, hosts, config, device)


def attach(model: torch.nn.Module, found, hosts, config: CacheConfig, device: torch.device) -> torch.nn.Module:
    """Build the cache over ``hosts`` (one per experts module in ``found``) and hook it in.

    Shared by every loader: on any refusal (an imatrix file that does not fit, sizing) the
    experts go back and the model is as it was.
    """
    miss = config.effective().miss
    try:
        for name, module in found:
            if miss != "fetch" and getattr(module, "has_post_expert_norm", False):
                raise ValueError(f"{name}: experts with a post-expert norm support only miss='fetch'")
        _check_uniform(hosts, found)
        cache = ExpertCache(config, hosts, _top_k(model, found), device, _hardware(config),
                            _imatrix_counts(config, found))
    except Exception:  # refused: hand the experts back so the model is as it was
        for host, (_, module) in zip(hosts, found):
            host.restore(module)
        raise
    model.to(cache.device)  # the dense part; the experts modules no longer hold their weights
    for layer, (_, module) in enumerate(found):
        module._expertcache = (cache, layer)
    _attach(model, cache)
    return model


def _imatrix_counts(config: CacheConfig, found):
    """The imatrix counts, read and checked once (None without --imatrix)."""
    if config.imatrix is None:
        return None
    from ..imatrix.apply import check_source
    return check_source(config.imatrix, len(found), found[0][1].num_experts)


def _hardware(config: CacheConfig):
    """The cost model's rates for the 'auto' miss path: the profile or preset given, else this
    machine's, measured once per process (a preset's PCIe and CPU rates can be far off)."""
    from ..costmodel import DEFAULT, load_hardware
    from ..costmodel.hardware import measured_here

    if config.hardware is not None:
        return load_hardware(config.hardware)
    return measured_here() if config.effective().miss == "auto" else load_hardware(DEFAULT)


def _check_uniform(hosts: list[HostExperts], found) -> None:
    def layout(host):  # quantized layers may store types that differ, but compute the same weights
        return host.layout() if host.codec is None else host.codec.compute_layout()
    first = layout(hosts[0])
    for host, (name, _) in zip(hosts, found):
        if layout(host) != first:
            raise ValueError(f"{name}: expert shapes or types differ between MoE layers ({layout(host)} vs "
                             f"{first}); one slot pool needs identical experts in every layer")


def _top_k(model: torch.nn.Module, found) -> int:
    k = getattr(model.config, "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"cannot read top-k from {type(model.config).__name__} (num_experts_per_tok)")
    return k


def _attach(model: torch.nn.Module, cache: ExpertCache) -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, expertcache_experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    model.expertcache = cache
    model.register_forward_pre_hook(_phase_hook(cache), with_kwargs=True)
    cache.model = model
    ForwardClock.of(model)  # times every forward from now on: model.expertcache.report()
    if cache.device.type == "cpu" and (cache.kernels is not None or report_of(model).kernel == "ggml"):
        DecodeThreads.attach(model)  # ggml's pool and torch's take turns (runtime/threads.py)
        if cache.tier is None:
            from ..runtime.ggmlgraph import attach as attach_graph
        else:  # experts from the RAM tier's rows
            from ..runtime.ggmltier import attach as attach_graph

        # decode as one ggml graph a token where the family allows (runtime/ggmlgraph.py)
        cache.cpu_graph, cache.cpu_graph_reason = attach_graph(model, cache, cache.config.cpu_graph)


def _phase_hook(cache: ExpertCache):
    """Tell the cache whether this forward is prefill (several new tokens) or decode (one)."""
    def hook(module, args, kwargs):
        cache.set_phase(new_tokens(args, kwargs), _all_tokens(args, kwargs))
    return hook


def _all_tokens(args: tuple, kwargs: dict) -> int | None:
    """Tokens of a forward over the whole batch (``[B, T, ...]`` -> B x T), or None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return ids.shape[0] * ids.shape[1] if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else None
