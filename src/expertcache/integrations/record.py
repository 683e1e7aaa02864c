"""Record a live routing trace from a transformers MoE model (``expertcache trace record``).

A forward hook on each MoE layer's router module captures ``(logits, top_k_weights,
top_k_index)`` exactly as the model routed (recomputing top-k from router logits is
wrong for DeepSeek-V3's biased, group-limited choice). Tokens of a forward with more
than one new token are phase 0 (prompt), single-token forwards phase 1 (generation):
the same rule the runtime uses to count prefill and decode.

The runtime plans the prompt as one step per layer and each generated token as one
step per layer; the trace's meta says so (``"prefill_steps": "batched"``), and the
simulator replays it in that order (``trace.steps``) to the live run's exact hits and
misses.

Why here and not in ``trace/``: this module hooks transformers modules and needs torch,
like the rest of ``integrations/``; ``trace/`` stays plain data (numpy only) that the
simulator and the CLI import without torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..runtime.clock import new_tokens
from ..stats import PREFILL
from ..trace.format import Trace, save_trace


def record(model, prompt_ids, max_new_tokens: int, router_logits: bool = False,
           **generate_kwargs) -> Trace:
    """Greedy-generate ``max_new_tokens`` after ``prompt_ids`` [1, P] and return the routing trace.

    Works on a plain model and on an offloaded one (then the cache counts the same run).
    ``router_logits``: also keep every expert's raw router score (``Trace.logits``, float16
    ``[L, T, E]``: 2 bytes per expert per layer per token), the data a policy that
    predicts from the router's near misses would be studied on.
    """
    import torch

    from ..loaders.common import find_experts

    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.ndim != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be a [1, tokens] tensor (one sequence), got "
                         f"{getattr(prompt_ids, 'shape', type(prompt_ids).__name__)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive whole number, got {max_new_tokens!r}")
    experts = find_experts(model)
    routers = [_router_of(model, name) for name, _ in experts]
    index: list[list] = [[] for _ in routers]     # per layer: [T_forward, K] tensors
    weights: list[list] = [[] for _ in routers]
    logits: list[list | None] = [[] if router_logits else None for _ in routers]
    phases: list[np.ndarray] = []
    # decode as one ggml graph a token runs no router module: record on the eager path
    graph = getattr(model, "_expertcache_graph", None)
    graph_was = graph.enabled if graph is not None else None
    if graph is not None:
        graph.enabled = False
    hooks = [r.register_forward_hook(_capture(index[i], weights[i], logits[i]))
             for i, r in enumerate(routers)]
    hooks.append(model.register_forward_pre_hook(_phase_capture(phases), with_kwargs=True))
    try:
        with torch.no_grad():
            model.generate(prompt_ids.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                           **generate_kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        if graph is not None:
            graph.enabled = graph_was
    ex = np.stack([torch.cat(rows).cpu().numpy() for rows in index]).astype(np.int16)       # [L, T, K]
    wt = np.stack([torch.cat(rows).float().cpu().numpy() for rows in weights]).astype(np.float16)
    lg = (np.stack([torch.cat(rows).float().cpu().numpy() for rows in logits]).astype(np.float16)
          if router_logits else None)                                                     # [L, T, E]
    return Trace(ex, _meta(model, experts, ex), wt, np.concatenate(phases).astype(np.uint8), lg)


def _router_of(model, experts_name: str):
    parent = model.get_submodule(experts_name.rpartition(".")[0])
    for attr in ("gate", "router"):
        router = getattr(parent, attr, None)
        if router is not None and hasattr(router, "top_k"):
            return router
    raise ValueError(f"{experts_name}: no router module (gate/router with top_k) next to the experts; "
                     "recording needs the router's output")


def _capture(index_rows: list, weight_rows: list, logit_rows: list | None):
    def hook(module, args, out):
        # every supported router returns (logits [T, E], top_k_weights [T, K], top_k_index [T, K])
        weight_rows.append(out[1].detach())
        index_rows.append(out[2].detach())
        if logit_rows is not None:
            logit_rows.append(out[0].detach().reshape(out[2].shape[0], -1))
    return hook


def _phase_capture(phases: list):
    def hook(module, args, kwargs):
        n = new_tokens(args, kwargs) or 1
        phases.append(np.full(n, 0 if n > 1 else 1, dtype=np.uint8))
    return hook


def _meta(model, experts, ex: np.ndarray) -> dict:
    module = experts[0][1]
    cache = getattr(model, "expertcache", None)
    if cache is not None:
        expert_bytes = cache.expert_bytes
    else:
        expert_bytes = sum(p[0].numel() * p.element_size() for p in module.parameters(recurse=False))
    return {"model": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
            "num_experts": int(module.num_experts), "top_k": int(ex.shape[2]),
            "n_moe_layers": int(ex.shape[0]), "expert_bytes": int(expert_bytes),
            "prefill_steps": "batched", "source": "expertcache trace record"}


def record_trace(model: str | Path, prompt: str, output: str | Path, max_new_tokens: int = 32, *,
                 device: str | None = None, router_logits: bool = False) -> Trace:
    """Load ``model`` (whatever ``offload`` takes: a checkpoint directory, a GGUF file, an
    HF-quantized directory), record ``prompt`` plus ``max_new_tokens`` greedy tokens, save the
    trace to ``output`` and return it. Nothing is downloaded.

    Quantized models load through ``offload`` with nothing cached (their experts stay
    quantized on the host): the routing is the model's own, whichever way experts run."""
    from ..loaders import check_model_path, load_tokenizer, model_kind
    from ..loaders.checkpoint import load_checkpoint
    from .transformers import offload

    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty")
    path = Path(model)
    check_model_path(path)
    tokenizer = load_tokenizer(path)
    if model_kind(path) == "checkpoint":
        loaded = load_checkpoint(path, None).eval()
        if device:
            loaded.to(device)
    else:  # on the host the experts run there; on a device the used ones stream in
        on_host = device is None or str(device) == "cpu"
        loaded = offload(path, baseline="cpu" if on_host else "copy-every-pass",
                         device=device or "cpu").eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    trace = record(loaded, ids, max_new_tokens, router_logits=router_logits)
    save_trace(trace, output)
    return trace
