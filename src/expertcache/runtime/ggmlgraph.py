"""CPU decode as one ggml graph a forward (issue 32): llama.cpp's way, on the model we loaded.

A GGUF model on the CPU with ggml already computes its experts and dense weights with ggml's
kernels on the mapped file (``cpukernel.py``, ``cpudense.py``), but each token still walks
transformers' eager modules: a few hundred small torch calls a layer. Here the whole decode
step is one ggml graph, built once per cache capacity and re-run per token: the embedding
(``get_rows`` on the file's bytes), the RMS norms, q / k / v / o, RoPE, attention over a KV
cache held in ggml tensors (``flash_attn_ext`` with a mask; the cache written with
``set_rows``), the router's softmax and top-k (``argsort_top_k``, ``get_rows`` on the probs,
normalised as the family does), the experts through ``mul_mat_id`` on the host's quantized
bytes, shared experts, the final norm and the lm_head. Python fills four small inputs (token,
position, write row, one mask cell) and runs the graph: one call a token.

Prompts of one sequence run through the graph too, in chunks of at most ``_CHUNK`` tokens
(graphs per chunk length), keeping only the logits asked for (``logits_to_keep``).

Quantized weights are repacked at load for ggml's faster CPU kernels where ggml can
(``cpu_repack``, quant/ggmlrepack.py: llama.cpp's default, the file's pages then released);
the rest is read where the loaded model keeps it (the mapped file's bytes for quantized
tensors, transformers' float32 parameters for F32 norms and routers).
The graph follows transformers' conventions (its weights, rotate-half RoPE, a scaled RoPE's
frequencies as its rotary module computed them), so it computes what the eager path computes,
with ggml's arithmetic.

The KV cache: per layer one float32 buffer ``[capacity, kv_heads * head_dim]`` (a row a
token, llama.cpp's layout), grown by doubling; DeepSeek's MLA one ``[capacity, latent + rope]``
holding what transformers caches there (keys: the normed latent; values: the rotated k_pe),
its two column spans the layer's K and V. The caller's ``DynamicCache`` keeps working:
after each step its layers hold views of these buffers; rows written by the eager path (any
forward the graph does not take) are copied in before the next graph step (the hand-over).

Sliding layers (transformers' ``layer_types``) keep a ring of ``window + _CHUNK`` rows instead
(``ring_rows``: position p in row p mod R), which a chunk of new tokens never overwrites while
one of them still sees it, and read it through a mask of their own (a token sees its last
``sliding_window`` positions): their memory and attention stay the same however long the
context (GPT-OSS: half its layers). The caller's ``DynamicSlidingWindowLayer`` reads the last
``window - 1`` rows in order, as transformers keeps them (a copy where they wrap the ring).

Families: Qwen3-MoE and Qwen2-MoE (shared expert, qkv biases), GPT-OSS (attention sinks
through ``flash_attn_ext_add_sinks``, sliding and full layers in turn, YaRN RoPE read from
transformers' frequencies (``freq_factors``, its attention factor on cos and sin), q / k / v / o
biases, the router's bias and softmax over the top-k logits, expert biases by ``add_id``, the
clamped SwiGLU by ``swiglu_oai``), Mixtral (Qwen3-MoE's graph without q/k norms; its router
always renormalises the top-k weights) and OLMoE (q/k RMS norms over all heads' values before
the head split; top-k weights as ``norm_topk_prob`` says: not renormalised in llama.cpp's
files) and DeepSeek-V3 (llama.cpp's deepseek2 files). DeepSeek's multi-head latent attention
runs in llama.cpp's absorbed form: q's no-RoPE part is taken into the latent by kv_b_proj's k
rows (a transposed float32 copy, made at load), attention runs over the cached latent and k_pe
(``flash_attn_ext`` with K of latent + rope dims, V the latent: a view of the same rows), and
each head's latent output leaves through kv_b_proj's v rows; transformers expands the latent
into every head's k and v instead: the same q.k and output up to float rounding, without the
expansion's cost growing with the context. Its RoPE dims are rotated as adjacent pairs (ggml's
normal mode) and de-interleaved after, as ``apply_rotary_pos_emb_interleave`` leaves them and
the cache holds them; the softmax scale is the module's ``scaling`` (YaRN's mscale folded in).
Its routing (``build_moe_ffn``'s ops): sigmoid scores, the selection bias added for the choice,
groups scored by their top-2 sum, the best ``topk_group`` kept (the rest ``fill``-ed with -inf
through ``set_rows``), top-k among them, weights from the unbiased scores, normalised (+ 1e-20)
and scaled; its shared experts and dense first layers are the dense MLP. Others keep the eager
path and ``support()`` and ``summary()['cpu_graph_reason']`` say why (GPT-OSS from an HF MXFP4
checkpoint: gate and up alternate in one tensor).
Experts: read from the host's bytes (``resident``, and ``baseline='cpu'``, whose every expert
is computed from them); a run with a CPU slot cache keeps the per-layer path; a resident run
over the RAM tier (``host_memory='tiered'``) reads the tier's rows, in segments (runtime/ggmltier.py).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..quant import ggmlgraph as gg
from ..quant.ggmlgraph import GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_I32, GGML_TYPE_I64
from ..stats import DECODE, PREFILL
from .cpudense import GgmlEmbedding, GgmlLinear
from .threads import ggml_threads

# the families whose quantized experts reach ggml here (the GGUF files loaders/gguf.py reads)
FAMILIES = {"qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "olmoe", "deepseek_v3"}
# why a family is not among them
_NOT_BUILT: dict[str, str] = {}
# RoPE types whose frequencies change with the sequence length (``dynamic_rope_update``)
_DYNAMIC_ROPE = {"dynamic", "longrope"}
_MIN_CAPACITY = 256          # KV rows first allocated (grown by doubling)
_CHUNK = 256                 # a prompt runs in graphs of at most this many tokens
_PROMPT_GRAPHS = 3           # graphs for multi-token forwards kept (a graph per length)
_ALLOWED_KWARGS = {"input_ids", "past_key_values", "cache", "use_cache", "attention_mask", "position_ids",
                   "cache_position", "logits_to_keep", "return_dict"}
_FALSE_KWARGS = {"output_attentions", "output_hidden_states", "output_router_logits"}


class Unsupported(Exception):
    """Why this model (or this forward) stays on the eager path."""


# -- what the model holds, as ggml sees it ---------------------------------------------
def _linear(module: torch.nn.Module) -> tuple[int, tuple[int, int], int, torch.Tensor | None]:
    """(ggml type, ne (in, out), data address, bias or None) of a Linear as the model holds it."""
    if isinstance(module, GgmlLinear):
        return module.ggml_type, (module.cols, module.rows), module.data.data_ptr(), module.bias
    if isinstance(module, torch.nn.Linear):
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            raise Unsupported(f"a {w.dtype} linear weight (the graph reads float32 or the file's bytes)")
        return GGML_TYPE_F32, (w.shape[1], w.shape[0]), w.data_ptr(), module.bias
    raise Unsupported(f"{type(module).__name__} where a Linear was expected")


def _vector(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise Unsupported(f"a {t.dtype} norm or bias (the graph reads float32)")
    return t


def _eps(norm: torch.nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise Unsupported(f"{type(norm).__name__}: no epsilon")


def support(model: torch.nn.Module, cache) -> str | None:
    """None when the graph can decode this model, else why not (one line)."""
    try:
        _Spec(model, cache)
    except Unsupported as err:
        return str(err)
    return None


class _Spec:
    """The model's shape and weights, checked once: what a graph is built from."""

    tiered = False  # experts from the RAM tier's rows: runtime/ggmltier.py's subclass

    def __init__(self, model: torch.nn.Module, cache) -> None:
        cfg = model.config
        self.family = getattr(cfg, "model_type", None)
        if self.family not in FAMILIES:
            why = _NOT_BUILT.get(self.family, "not built as one graph yet")
            raise Unsupported(f"{self.family}: {why} (families: {', '.join(sorted(FAMILIES))})")
        if cache.kernels is None or cache.device.type != "cpu":
            raise Unsupported("experts are not on ggml's CPU kernels")
        if not (cache.host_resident or (cache.pool.slots == 0 and cache.miss == "cpu")):
            raise Unsupported("slots cache experts: the graph reads the host's bytes (resident, baseline cpu)")
        if cache.planner is not None:
            raise Unsupported("planner='device'")
        if getattr(cache, "tier", None) is not None and not self.tiered:
            raise Unsupported("host_memory='tiered': the RAM tier holds a share of the experts, and the "
                              "graph reads every expert's bytes in place")
        self.cache = cache
        self.windows = _windows(cfg)       # per layer: the sliding window, or None (full attention)
        self.window = next((w for w in self.windows if w), None)
        inner = model.model
        self._rope(cfg, inner.rotary_emb)
        self.hidden = cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.mla = _mla_dims(cfg, self.n_rot) if self.family == "deepseek_v3" else None
        if self.mla is None and self.n_rot != self.head_dim:
            raise Unsupported("partial rotary embedding")
        # the KV cache as transformers' DynamicCache holds it: heads, and the widths of a row of
        # keys and of values (MLA: one "head", the latent and the rotary key, in one buffer)
        if self.mla is None:
            self.cache_heads, self.kv_widths = self.kv_heads, (self.kv_heads * self.head_dim,) * 2
        else:
            self.cache_heads, self.kv_widths = 1, (self.mla["latent"], self.mla["rope"])
        if getattr(cfg, "clip_qkv", None) is not None:
            raise Unsupported("clip_qkv")
        embed = model.get_input_embeddings()
        if isinstance(embed, GgmlEmbedding):
            self.embed = (embed.ggml_type, (embed.cols, embed.rows), embed.data.data_ptr())
        elif isinstance(embed, torch.nn.Embedding) and embed.weight.dtype == torch.float32:
            self.embed = (GGML_TYPE_F32, (embed.weight.shape[1], embed.weight.shape[0]), embed.weight.data_ptr())
        else:
            raise Unsupported(f"embedding {type(embed).__name__}")
        self.vocab = self.embed[1][1]
        self.final_norm = (_vector(inner.norm.weight), _eps(inner.norm))
        self.lm_head = _linear(model.get_output_embeddings())
        self.layers = [self._layer(i, layer) for i, layer in enumerate(inner.layers)]

    def _rope(self, cfg, rope: torch.nn.Module) -> None:
        """RoPE as transformers' rotary module computes it. A scaled type (YaRN: GPT-OSS) is read
        from the module's frequencies, not rebuilt with ggml's own YaRN: ggml rounds YaRN's ramp
        to whole dimensions, transformers (``truncate=False``) does not. The graph divides ggml's
        base frequencies by ``freq_factors`` to land on transformers' and scales cos and sin by
        its ``attention_scaling``."""
        rope_type = getattr(rope, "rope_type", "default")
        if rope_type in _DYNAMIC_ROPE:
            raise Unsupported(f"rope type {rope_type} (its frequencies change with the length)")
        inv = rope.inv_freq.float()
        self.n_rot = 2 * inv.numel()
        self.rope_base = float(1.0 / inv[1] ** (-1.0 / (2.0 / self.n_rot))) if inv.numel() > 1 else 10000.0
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None)) if isinstance(params, dict) else None
        if theta is not None:
            self.rope_base = float(theta)
        self.attn_factor = float(getattr(rope, "attention_scaling", 1.0))
        self.freq_factors = None
        if rope_type != "default":
            self.freq_factors = _freq_factors(inv, self.rope_base, self.n_rot)     # [D / 2]

    def _layer(self, i: int, layer: torch.nn.Module) -> dict:
        spec = {"in_norm": (_vector(layer.input_layernorm.weight), _eps(layer.input_layernorm)),
                "post_norm": (_vector(layer.post_attention_layernorm.weight), _eps(layer.post_attention_layernorm)),
                "window": self.windows[i]}
        spec |= self._mla_attention(i, layer.self_attn) if self.mla else self._attention(layer.self_attn)
        return self._ffn(i, layer.mlp, spec)

    def _attention(self, attn: torch.nn.Module) -> dict:
        if abs(float(getattr(attn, "scaling", self.head_dim ** -0.5)) - self.head_dim ** -0.5) > 1e-12:
            raise Unsupported("attention scaling other than 1/sqrt(head_dim)")
        spec = {"q": _linear(attn.q_proj), "k": _linear(attn.k_proj), "v": _linear(attn.v_proj),
                "o": _linear(attn.o_proj)}
        sinks = getattr(attn, "sinks", None)                                     # GPT-OSS: [N]
        if sinks is not None:
            spec["sinks"] = _vector(sinks.data)
        for name, heads in (("q_norm", self.heads), ("k_norm", self.kv_heads)):
            norm = getattr(attn, name, None)
            if norm is None:
                continue
            if norm.weight.numel() not in (self.head_dim, heads * self.head_dim):
                raise Unsupported(f"{name} over {norm.weight.numel()} values: neither one head nor all")
            # Qwen3: per head; OLMoE: over all heads' values at once, before the head split
            spec[name] = (_vector(norm.weight), _eps(norm), norm.weight.numel() != self.head_dim)
        if "q_norm" in spec and spec["q_norm"][2] != spec.get("k_norm", spec["q_norm"])[2]:
            raise Unsupported("q_norm and k_norm over different spans (one head, all heads)")
        return spec

    def _mla_attention(self, i: int, attn: torch.nn.Module) -> dict:
        """DeepSeek's multi-head latent attention as the graph computes it (llama.cpp's absorbed
        form): q's no-RoPE part is taken into the latent space by kv_b_proj's k rows, and the
        attention's output (a latent a head) out of it by its v rows; q.k and the output are
        transformers' (which expands the cached latent into every head's k and v) up to float
        rounding. kv_b_proj's k rows are copied once, transposed (mul_mat reads its weights
        along their rows): heads x latent x nope float32 more a layer."""
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        if type(attn).forward is not ds.DeepseekV3Attention.forward:
            raise Unsupported(f"layer {i}: {type(attn).__name__}: an attention other than DeepSeek-V3's")
        m, N = self.mla, self.heads
        kv_b = attn.kv_b_proj
        if not isinstance(kv_b, torch.nn.Linear) or kv_b.weight.dtype != torch.float32 or kv_b.bias is not None:
            raise Unsupported(f"layer {i}: kv_b_proj not a float32 Linear without bias (the graph splits its rows)")
        w = kv_b.weight.detach()                                     # [N * (P + Dv), L]
        if tuple(w.shape) != (N * (m["nope"] + m["v"]), m["latent"]) or not w.is_contiguous():
            raise Unsupported(f"layer {i}: kv_b_proj of shape {tuple(w.shape)}")
        spec = {"kv_a": _linear(attn.kv_a_proj_with_mqa), "kv_a_norm": (_vector(attn.kv_a_layernorm.weight),
                _eps(attn.kv_a_layernorm)), "o": _linear(attn.o_proj), "scale": float(attn.scaling),
                # [N, L, P]: a head's k rows transposed; the v rows are read in place
                "k_b": w.view(N, -1, m["latent"])[:, :m["nope"]].transpose(1, 2).contiguous(), "kv_b": w}
        if attn.q_lora_rank is None:
            spec["q"] = _linear(attn.q_proj)
        else:
            spec |= {"q_a": _linear(attn.q_a_proj), "q_b": _linear(attn.q_b_proj),
                     "q_a_norm": (_vector(attn.q_a_layernorm.weight), _eps(attn.q_a_layernorm))}
        return spec

    def _ffn(self, i: int, mlp: torch.nn.Module, spec: dict) -> dict:
        experts = getattr(mlp, "experts", None)
        if experts is None:  # a dense layer (Qwen's mlp_only_layers, decoder_sparse_step)
            spec["mlp"] = self._dense_mlp(mlp)
            return spec
        handle = getattr(experts, "_expertcache", None)
        if handle is None:
            raise Unsupported(f"layer {i}: experts not attached")
        cache, index = handle
        kernel = cache.kernels[index]
        host = cache.hosts[index]
        parts = {p: host.tensors[p] for p in (*kernel.first.parts, *kernel.down.parts)}
        experts_ = [(kernel.part[p].fmt.ggml_type, *kernel.part[p].shape, t) for p, t in parts.items()]
        if self.family == "gpt_oss":
            spec["moe"] = _oai_moe(i, mlp, kernel, host) | {"experts": experts_, "index": index}
            return spec
        if not kernel._silu_gate(experts):
            raise Unsupported(f"layer {i}: an expert gate other than SiLU(gate) * up")
        router = mlp.gate
        if self.family == "deepseek_v3":
            spec["moe"] = _deepseek_router(i, mlp) | {"experts": experts_, "index": index}
            spec["shared"], spec["shared_gate"] = self._dense_mlp(mlp.shared_experts), None
            return spec
        spec["moe"] = {"router": _vector(router.weight), "top_k": router.top_k, "norm": _renormalises(i, router),
                       "experts": experts_, "index": index}
        if getattr(mlp, "shared_expert", None) is not None:
            spec["shared"] = self._dense_mlp(mlp.shared_expert)
            gate = getattr(mlp, "shared_expert_gate", None)
            spec["shared_gate"] = None if gate is None else _linear(gate)
        return spec

    @staticmethod
    def _dense_mlp(mlp: torch.nn.Module) -> dict:
        from transformers.activations import SiLUActivation

        if type(getattr(mlp, "act_fn", None)) not in (SiLUActivation, torch.nn.SiLU):
            raise Unsupported(f"{type(mlp).__name__}: an activation other than SiLU")
        return {"gate": _linear(mlp.gate_proj), "up": _linear(mlp.up_proj), "down": _linear(mlp.down_proj)}


def _renormalises(i: int, router: torch.nn.Module) -> bool:
    """Whether this softmax router divides its top-k weights by their sum: Qwen and OLMoE as
    ``norm_topk_prob`` says (OLMoE: False), Mixtral always (its router has no such switch:
    checked against transformers' code, so another router is not taken for it)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    if type(router).forward is MixtralTopKRouter.forward:
        return True
    if not hasattr(router, "norm_topk_prob"):
        raise Unsupported(f"layer {i}: {type(router).__name__}: a router whose top-k weights the graph cannot read")
    return bool(router.norm_topk_prob)


def _mla_dims(cfg, n_rot: int) -> dict:
    """DeepSeek's MLA sizes: heads' no-RoPE (nope) and RoPE dims of q and k, v's dims, the latent;
    whether the RoPE dims come in adjacent pairs (``rope_interleave``: transformers de-interleaves
    them as it rotates, and caches them so)."""
    dims = {"nope": cfg.qk_nope_head_dim, "rope": cfg.qk_rope_head_dim, "v": cfg.v_head_dim,
            "latent": cfg.kv_lora_rank, "interleave": bool(getattr(cfg, "rope_interleave", False))}
    if n_rot != dims["rope"]:
        raise Unsupported(f"a rotary embedding over {n_rot} dims, not the {dims['rope']} RoPE dims of MLA")
    return dims


def _deepseek_router(i: int, mlp: torch.nn.Module) -> dict:
    """DeepSeek-V3's routing, checked against transformers' code: sigmoid scores, the selection
    bias added for the choice only, groups (each scored by the sum of its top 2) of which the
    best ``topk_group`` are kept, the top-k experts among them; weights from the unbiased
    scores, divided by their sum (+ 1e-20) where ``norm_topk_prob``, times the scaling factor."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    router = mlp.gate
    if type(mlp).forward is not ds.DeepseekV3MoE.forward or type(router).forward is not ds.DeepseekV3TopkRouter.forward:
        raise Unsupported(f"layer {i}: a MoE block or router other than DeepSeek-V3's")
    E, G, kept = router.num_experts, router.num_group, router.topk_group
    if E % G or (G > 1 and E // G < 2) or router.top_k > kept * (E // G):
        raise Unsupported(f"layer {i}: {E} experts in {G} groups, {kept} kept, top-{router.top_k}: "
                          "groups the router cannot score or choose from")
    return {"router": _vector(router.weight), "top_k": router.top_k, "norm": bool(router.norm_topk_prob),
            "sigmoid": {"bias": _vector(router.e_score_correction_bias), "groups": G, "kept": kept,
                        "scale": float(router.routed_scaling_factor)}}


def _windows(cfg) -> list[int | None]:
    """Each layer's sliding window (transformers' ``layer_types``), or None for full attention."""
    types = getattr(cfg, "layer_types", None)
    if types is None and getattr(cfg, "sliding_window", None):   # Mixtral's: every layer, no layer_types
        raise Unsupported(f"a sliding window ({cfg.sliding_window}) without layer_types")
    types = types or ["full_attention"] * cfg.num_hidden_layers
    windows = []
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise Unsupported(f"layer {i}: {kind} layers")
        window = getattr(cfg, "sliding_window", None) if kind == "sliding_attention" else None
        if kind == "sliding_attention" and not (isinstance(window, int) and window > 0):
            raise Unsupported(f"layer {i}: a sliding layer without a sliding window")
        windows.append(window)
    return windows


def _freq_factors(inv_freq: torch.Tensor, base: float, n_rot: int) -> torch.Tensor:
    """[n_rot / 2] float32 divisors of ggml's RoPE frequencies that give ``inv_freq``.

    ggml's frequency of pair i is ``base ** (-2 / n_rot)`` multiplied i times in float32 (its
    ``theta_scale``); dividing by that same float32 product over transformers' frequency leaves
    transformers' frequency within float rounding."""
    scale = np.float32(base ** (-2.0 / n_rot))
    ggml_freq = np.empty(inv_freq.numel(), dtype=np.float32)
    f = np.float32(1.0)
    for i in range(ggml_freq.size):
        ggml_freq[i] = f
        f = np.float32(f * scale)
    return (torch.from_numpy(ggml_freq).double() / inv_freq.double()).float().contiguous()


def _oai_moe(i: int, mlp: torch.nn.Module, kernel, host) -> dict:
    """GPT-OSS's MoE as the graph computes it, checked against transformers' own code: the
    router's softmax over its top-k logits (with a bias), experts with biases, and the clamped
    SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, g = min(gate, l) (ggml's
    ``swiglu_oai``, which computes exactly this)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as oss

    experts, router = mlp.experts, mlp.router
    if type(router).forward is not oss.GptOssTopKRouter.forward:
        raise Unsupported(f"layer {i}: a router other than GPT-OSS's softmax over the top-k logits")
    if getattr(type(experts), "_apply_gate", None) is not oss.GptOssExperts._apply_gate:
        raise Unsupported(f"layer {i}: an expert gate other than GPT-OSS's clamped SwiGLU")
    if kernel.first.join != "interleave" or len(kernel.first.parts) != 2:
        raise Unsupported(f"layer {i}: GPT-OSS experts whose gate and up rows alternate in one tensor "
                          "(an HF MXFP4 checkpoint): the graph reads gate and up as two tensors (GGUF)")
    if kernel.first_bias is None or kernel.down_bias is None:
        raise Unsupported(f"layer {i}: GPT-OSS experts without biases")
    biases = []
    for p in (*kernel.first_bias.parts, *kernel.down_bias.parts):      # gate, up, down: [E, rows]
        if kernel.part[p].fmt.ggml_type != GGML_TYPE_F32:
            raise Unsupported(f"layer {i}: a {kernel.part[p].fmt.name} expert bias (the graph adds float32)")
        biases.append((kernel.part[p].shape[0], host.tensors[p]))
    return {"router": _vector(router.weight), "router_bias": _vector(router.bias), "top_k": router.top_k,
            "softmax_topk": True, "biases": biases, "swiglu_oai": (float(experts.alpha), float(experts.limit))}


# -- the graph ------------------------------------------------------------------------
class _StepGraph:
    """One decode step's graph for ``tokens`` new tokens over a KV cache of ``capacity`` rows."""

    def __init__(self, spec: _Spec, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int,
                 n_threads: int, repacked=None, keep: int = 0) -> None:
        # T tokens, C cache rows (R: a sliding layer's ring), H hidden, D head dim, N heads, M kv heads,
        # E experts, K top-k, V vocab
        self.spec, self.tokens = spec, tokens
        self.capacity = full_rows(spec, kv) or 1   # no full layer: the causal mask unread
        self.ring = ring_rows(spec)
        self.keep = keep or tokens  # logits of the last ``keep`` tokens (a prefill needs the last one)
        self.repacked = repacked   # quant.ggmlrepack.Repacked or None: weights ggml reads repacked
        g = self.g = gg.Graph(self._headers(spec, tokens))
        T, C = tokens, self.capacity
        self.tok, self.tok_addr = g.input(GGML_TYPE_I32, (T,), 4)
        self.pos, self.pos_addr = g.input(GGML_TYPE_I32, (T,), 4)
        self.rows, self.rows_addr = g.input(GGML_TYPE_I64, (T,), 8)
        self.mask, self.mask_addr = g.input(GGML_TYPE_F16, (C, T), 2)
        # sliding layers: rows of the ring, and a mask over it (transformers': a token sees the
        # ``window`` positions up to its own)
        R = self.ring
        self.swa_rows, swa_rows_addr = g.input(GGML_TYPE_I64, (T,), 8) if R else (None, None)
        self.swa, swa_addr = g.input(GGML_TYPE_F16, (R, T), 2) if R else (None, None)
        self.freq_factors = None if spec.freq_factors is None else self._vec(spec.freq_factors)
        self.ids = []                                                          # [K, T] per MoE layer
        x = g.get_rows(g.leaf(spec.embed[0], spec.embed[1], spec.embed[2]), self.tok)   # [H, T]
        for layer, (k_buf, v_buf) in zip(spec.layers, kv):
            x = self._layer(layer, x, k_buf, v_buf)
        if self.keep < T:                                                          # [H, keep]
            x = g.view_2d(x, spec.hidden, self.keep, gg.nb(x, 1), (T - self.keep) * gg.nb(x, 1))
        w, eps = spec.final_norm
        x = g.mul(g.rms_norm(x, eps), self._vec(w))
        self.logits = self._mm(spec.lm_head, x)                                  # [V, keep]
        # the top-k ids are a view of the sorted [E, T]: that whole tensor stays readable
        sorted_ = [gg.view_src(t) for t in self.ids]
        self.work_bytes = g.finish([self.logits, *sorted_], n_threads)
        self._ids_views = [gg.int32_array(s_, (T, gg.ne(s_)[0]))[:, :gg.ne(t)[0]] for s_, t in zip(sorted_, self.ids)]
        self._mask = gg.f16_array(self.mask_addr, (T, C))                        # [T, C] 0 or -inf
        self._swa = None if swa_addr is None else gg.f16_array(swa_addr, (T, R))               # [T, R]
        self._swa_rows = None if swa_rows_addr is None else gg.int64_array(swa_rows_addr, (T,))
        self._tok = gg.int32_array(self.tok_addr, (T,))      # numpy views of the inputs, made once
        self._pos = gg.int32_array(self.pos_addr, (T,))
        self._rows = gg.int64_array(self.rows_addr, (T,))
        self._filled = -1                                    # mask cells set to 0: [0, _filled)

    def _headers(self, spec: _Spec, tokens: int) -> int:
        """Tensor headers the graph may make: about 60 ops a layer and 2 per top-k rank (the sum
        over ranks), counted twice."""
        return (160 + 4 * 64) * len(spec.layers) + 256

    def _vec(self, t: torch.Tensor):
        return self.g.leaf(GGML_TYPE_F32, (t.numel(),), t.data_ptr())

    def _weight(self, ggml_type: int, ne: tuple[int, ...], ptr: int, stride: int | None = None):
        """A weight as the graph reads it: its repacked copy where there is one, else in place."""
        t = None if self.repacked is None else self.repacked.tensor(ggml_type, ne, ptr, stride)
        return self.g.leaf(ggml_type, ne, ptr, stride=stride) if t is None else t

    def _mm(self, lin, x):
        ggml_type, ne, ptr, bias = lin
        y = self.g.mul_mat(self._weight(ggml_type, ne, ptr), x)
        return y if bias is None else self.g.add(y, self._vec(_vector(bias)))

    def _norm(self, x, norm):
        w, eps = norm
        return self.g.mul(self.g.rms_norm(x, eps), self._vec(w))

    def _layer(self, L: dict, x, k_buf: torch.Tensor, v_buf: torch.Tensor):
        g = self.g
        h = self._norm(x, L["in_norm"])                                          # [H, T]
        o = self._mla(L, h, k_buf) if "kv_a" in L else self._attention(L, h, k_buf, v_buf)
        x = g.add(o, x)
        h = self._norm(x, L["post_norm"])
        y = self._moe(L["moe"], h) if "moe" in L else self._dense(L["mlp"], h)
        if "shared" in L:
            sh = self._dense(L["shared"], h)                                     # [H, T]
            if L["shared_gate"] is not None:
                sh = g.mul(sh, g.sigmoid(self._mm(L["shared_gate"], h)))          # gate [1, T]
            y = g.add(y, sh)
        return g.add(y, x)

    def _attention(self, L: dict, h, k_buf: torch.Tensor, v_buf: torch.Tensor):
        """Multi-head (grouped-query) attention's output [H, T]; the KV rows written."""
        g, s, T, C = self.g, self.spec, self.tokens, k_buf.shape[0]   # C: capacity, or the ring
        D, N, M = s.head_dim, s.heads, s.kv_heads
        q, k, v = self._mm(L["q"], h), self._mm(L["k"], h), self._mm(L["v"], h)  # [N*D | M*D, T]
        whole = "q_norm" in L and L["q_norm"][2]
        if whole:                                                                # OLMoE: all heads
            q, k = self._norm(q, L["q_norm"][:2]), self._norm(k, L["k_norm"][:2])
        q, k = g.reshape_3d(q, D, N, T), g.reshape_3d(k, D, M, T)               # [D, N | M, T]
        if "q_norm" in L and not whole:                                          # Qwen3: per head
            q, k = self._norm(q, L["q_norm"][:2]), self._norm(k, L["k_norm"][:2])
        q = g.rope(q, self.pos, s.n_rot, gg.ROPE_NEOX, s.rope_base, 1.0, self.freq_factors, s.attn_factor)
        k = g.rope(k, self.pos, s.n_rot, gg.ROPE_NEOX, s.rope_base, 1.0, self.freq_factors, s.attn_factor)
        kc = g.leaf(GGML_TYPE_F32, (M * D, C), k_buf.data_ptr())                 # [M*D, C]
        vc = g.leaf(GGML_TYPE_F32, (M * D, C), v_buf.data_ptr())
        rows = self.rows if L["window"] is None else self.swa_rows
        g.expand(g.set_rows(kc, g.reshape_2d(k, M * D, T), rows))               # written before it is read
        g.expand(g.set_rows(vc, v, rows))                                       # v: [M*D, T]
        row = 4 * M * D
        kv_k = g.view_3d(kc, D, C, M, row, 4 * D, 0)                            # [D, C, M]
        kv_v = g.view_3d(vc, D, C, M, row, 4 * D, 0)
        qp = g.permute(q, 0, 2, 1, 3)                                            # [D, T, N]
        mask = self.mask if L["window"] is None else self.swa
        sinks = self._vec(L["sinks"]) if "sinks" in L else None
        a = g.attention(qp, kv_k, kv_v, mask, D ** -0.5, sinks)                 # [D, N, T]
        return self._mm(L["o"], g.reshape_2d(a, D * N, T))                       # [H, T]

    def _mla(self, L: dict, h, buf: torch.Tensor):
        """DeepSeek's multi-head latent attention's output [H, T] (llama.cpp's absorbed form,
        ``_Spec._mla_attention``); a cache row is the normed latent, then the rotated k_pe (what
        transformers caches as keys and values), one buffer ``buf`` [C, L + R] for both."""
        # T tokens, C cache rows, N heads, P nope dims, R rope dims, Dv v dims, Lc latent, H hidden
        g, s, T, C = self.g, self.spec, self.tokens, buf.shape[0]
        m, N = s.mla, s.heads
        P, R, Dv, Lc = m["nope"], m["rope"], m["v"], m["latent"]
        if "q" in L:
            q = self._mm(L["q"], h)                                              # [N*(P+R), T]
        else:
            q = self._mm(L["q_b"], self._norm(self._mm(L["q_a"], h), L["q_a_norm"]))
        q = g.reshape_3d(q, P + R, N, T)
        kv = self._mm(L["kv_a"], h)                                              # [Lc+R, T]
        c = self._norm(g.view_2d(kv, Lc, T, gg.nb(kv, 1), 0), L["kv_a_norm"])   # [Lc, T]
        k_pe = self._rope_pairs(g.view_3d(kv, R, 1, T, gg.nb(kv, 1), gg.nb(kv, 1), Lc * 4))        # [R, 1, T]
        q_pe = self._rope_pairs(g.view_3d(q, R, N, T, gg.nb(q, 1), gg.nb(q, 2), P * 4))            # [R, N, T]
        row = 4 * (Lc + R)
        cache = g.leaf(GGML_TYPE_F32, (Lc + R, C), buf.data_ptr())              # [Lc+R, C]
        g.expand(g.set_rows(cache, g.concat(c, g.reshape_2d(k_pe, R, T), 0), self.rows))
        k = g.view_3d(cache, Lc + R, C, 1, row, row * C, 0)                      # [Lc+R, C, 1]
        v = g.view_3d(cache, Lc, C, 1, row, row * C, 0)                          # [Lc, C, 1]
        # q's nope part into the latent: per head, k_b [P, Lc] (transposed) times q_nope [P]
        q_nope = g.view_4d(q, P, 1, N, T, gg.nb(q, 1), gg.nb(q, 1), gg.nb(q, 2), 0)                # [P, 1, N, T]
        k_b = L["k_b"]
        q_lat = g.mul_mat(g.leaf(GGML_TYPE_F32, (P, Lc, N), k_b.data_ptr()), q_nope)              # [Lc, 1, N, T]
        qq = g.concat(g.reshape_3d(q_lat, Lc, N, T), q_pe, 0)                   # [Lc+R, N, T]
        a = g.attention(g.permute(qq, 0, 2, 1, 3), k, v, self.mask, L["scale"])  # [Lc, N, T]
        # out of the latent: per head, kv_b's v rows [Dv, Lc], read in place
        kv_b = L["kv_b"]
        v_b = g.leaf(GGML_TYPE_F32, (Lc, Dv, N), kv_b.data_ptr() + P * Lc * 4, stride=(P + Dv) * Lc * 4)
        a = g.mul_mat(v_b, g.reshape_4d(a, Lc, 1, N, T))                         # [Dv, 1, N, T]
        return self._mm(L["o"], g.reshape_2d(a, Dv * N, T))                      # [H, T]

    def _rope_pairs(self, x):
        """MLA's RoPE dims ``x`` [R, n, T] rotated, in transformers' layout: with
        ``rope_interleave`` adjacent pairs (ggml's normal mode), the result de-interleaved
        (the pairs' first values, then their second: ``apply_rotary_pos_emb_interleave``)."""
        g, s = self.g, self.spec
        R, n, T = gg.ne(x)[:3]
        mode = gg.ROPE_NORMAL if s.mla["interleave"] else gg.ROPE_NEOX
        y = g.rope(x, self.pos, R, mode, s.rope_base, 1.0, self.freq_factors, s.attn_factor)       # [R, n, T]
        if not s.mla["interleave"]:
            return y
        y = g.cont(g.permute(g.reshape_4d(y, 2, R // 2, n, T), 1, 0, 2, 3))    # [R/2, 2, n, T]
        return g.reshape_3d(y, R, n, T)

    def _dense(self, mlp: dict, h):
        g = self.g
        return self._mm(mlp["down"], g.mul(g.silu(self._mm(mlp["gate"], h)), self._mm(mlp["up"], h)))

    def _moe(self, moe: dict, h):
        g, T, H = self.g, self.tokens, self.spec.hidden
        K = moe["top_k"]
        router = moe["router"]
        E = router.shape[0]
        logits = g.mul_mat(g.leaf(GGML_TYPE_F32, (H, E), router.data_ptr()), h)  # [E, T]
        if "router_bias" in moe:
            logits = g.add(logits, self._vec(moe["router_bias"]))
        if moe.get("softmax_topk"):   # GPT-OSS: the top-k logits, then a softmax over those k
            sel = g.argsort_top_k(logits, K)                                      # [K, T] int32
            w = g.get_rows(g.reshape_3d(logits, 1, E, T), sel)                   # [1, K, T]
            w = g.reshape_3d(g.soft_max(g.reshape_2d(w, K, T)), 1, K, T)
            self.ids.append(sel)
            return self._oai_experts(moe, h, sel, w)
        if "sigmoid" in moe:
            probs, sel = self._group_choice(moe, logits)                         # [E, T], [K, T]
        else:
            probs = g.soft_max(logits)
            sel = g.argsort_top_k(probs, K)                                       # [K, T] int32
        self.ids.append(sel)
        w = g.get_rows(g.reshape_3d(probs, 1, E, T), sel)                        # [1, K, T]
        if moe["norm"]:
            w2 = g.reshape_2d(w, K, T)
            total = g.sum_rows(w2)                                                # [1, T]
            if "sigmoid" in moe:                                                  # DeepSeek's + 1e-20
                total = g.scale_bias(total, 1.0, 1e-20)
            w = g.reshape_3d(g.div(w2, total), 1, K, T)
        if "sigmoid" in moe and moe["sigmoid"]["scale"] != 1.0:
            w = g.scale(w, moe["sigmoid"]["scale"])
        return self._moe_experts(moe, h, sel, w)

    def _group_choice(self, moe: dict, logits):
        """DeepSeek-V3's choice (``_deepseek_router``; llama.cpp's ``build_moe_ffn``): sigmoid
        scores [E, T] and the top-k [K, T] of the biased scores within the kept groups."""
        g, T = self.g, self.tokens
        E, K, sig = gg.ne(logits)[0], moe["top_k"], moe["sigmoid"]
        G, kept = sig["groups"], sig["kept"]
        scores = g.sigmoid(logits)                                                # [E, T]
        choice = g.add(scores, self._vec(sig["bias"]))                           # [E, T]
        if G > 1:
            per = E // G
            groups = g.reshape_3d(choice, per, G, T)                             # [E/G, G, T]
            top2 = g.argsort_top_k(groups, 2)                                     # [2, G, T]
            best = g.get_rows(g.reshape_4d(groups, 1, per, G, T), top2)          # [1, 2, G, T]
            score = g.reshape_2d(g.sum_rows(g.reshape_3d(best, 2, G, T)), G, T)  # [G, T]
            keep = g.argsort_top_k(score, kept)                                   # [kept, T]
            rows = g.get_rows(groups, keep)                                       # [E/G, kept, T]
            masked = g.set_rows(g.fill(groups, float("-inf")), rows, keep)       # the others -inf
            choice = g.reshape_2d(masked, E, T)
        return scores, g.argsort_top_k(choice, K)

    def _moe_experts(self, moe: dict, h, sel, w):
        """The routed experts' sum [H, T] for ids ``sel`` [K, T] and weights ``w`` [1, K, T]: on
        the host's bytes here (ggmltier.py overrides it: the RAM tier's rows, a segment split)."""
        weights = [self._weight(t, (cols, rows, data.shape[0]), data.data_ptr(), data.stride(0))
                   for t, rows, cols, data in moe["experts"]]                    # [cols, rows, E]
        return self._silu_experts(weights, h, sel, w)

    def _silu_experts(self, weights: list, h, ids, w):
        """sum over ranks of w * down(silu(gate) * up) [H, T]: ``weights`` gate, up, down or
        gate_up, down stacked [cols, rows, n]; ``ids`` [K, T] the rows of the stacks; ``w`` [1, K, T]."""
        return self._sum_ranks(self.g.mul(self._silu_pairs(weights, h, ids), w))

    def _silu_pairs(self, weights: list, h, ids):
        """Each pair's down(silu(gate) * up) [H, K, T], unweighted (``_silu_experts``)."""
        g, T, H = self.g, self.tokens, self.spec.hidden
        K = gg.ne(ids)[0]
        hx = g.reshape_3d(h, H, 1, T)
        if len(weights) == 3:   # gate, up, down
            gate, up = g.mul_mat_id(weights[0], hx, ids), g.mul_mat_id(weights[1], hx, ids)   # [I, K, T]
        else:                   # one fused gate_up [2I]: gate rows first
            gu = g.mul_mat_id(weights[0], hx, ids)                                # [2I, K, T]
            half = gg.ne(gu)[0] // 2
            gate = g.view_3d(gu, half, K, T, gg.nb(gu, 1), gg.nb(gu, 2), 0)
            up = g.view_3d(gu, half, K, T, gg.nb(gu, 1), gg.nb(gu, 2), half * 4)
        par = g.swiglu_split(gate, up)                                            # silu(gate) * up
        return g.mul_mat_id(weights[-1], par, ids)                                # [H, K, T]

    def _oai_experts(self, moe: dict, h, sel, w):
        """GPT-OSS's experts: biases added per pair's expert (``add_id``), the clamped SwiGLU."""
        weights = [self._weight(t, (cols, rows, data.shape[0]), data.data_ptr(), data.stride(0))
                   for t, rows, cols, data in moe["experts"]]                    # gate, up, down
        biases = [self.g.leaf(GGML_TYPE_F32, (n, data.shape[0]), data.data_ptr(), stride=data.stride(0))
                  for n, data in moe["biases"]]                                 # [n, E] each
        return self._sum_ranks(self.g.mul(self._oai_pairs(moe, weights, biases, h, sel), w))

    def _oai_pairs(self, moe: dict, weights: list, biases: list, h, ids):
        """Each GPT-OSS pair's output [H, K, T], unweighted: gate, up, down stacked [cols, rows, n]
        and their biases [rows, n], read at ``ids`` [K, T] (expert ids here, the RAM tier's rows
        in ggmltier.py)."""
        g, T, H = self.g, self.tokens, self.spec.hidden
        hx = g.reshape_3d(h, H, 1, T)
        gate = g.add_id(g.mul_mat_id(weights[0], hx, ids), biases[0], ids)       # [I, K, T]
        up = g.add_id(g.mul_mat_id(weights[1], hx, ids), biases[1], ids)
        alpha, limit = moe["swiglu_oai"]
        par = g.swiglu_oai(gate, up, alpha, limit)                                # [I, K, T]
        return g.add_id(g.mul_mat_id(weights[2], par, ids), biases[2], ids)      # [H, K, T]

    def _sum_ranks(self, ex):
        """[H, K, T] -> [H, T]: the sum over ranks as one sum_rows of a [K, H, T] copy (llama.cpp
        adds K views: more nodes, each a barrier of the thread pool)."""
        g = self.g
        return g.reshape_2d(g.sum_rows(g.cont(g.permute(ex, 1, 0, 2, 3))), self.spec.hidden, self.tokens)

    def run(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [keep, V] of the last ``keep`` of ``tokens`` at positions start.. (every
        token's KV rows written): each token attends to the rows before it and itself (causal)."""
        T = self.tokens
        self._tok[:] = tokens
        self._pos[:] = self._rows[:] = range(start, start + T)
        W, R = self.spec.window, self.ring
        if R:
            self._swa_rows[:] = np.arange(start, start + T) % R
        if T == 1 and start == self._filled:   # the next decode token: one more cell to see
            self._mask[0, start] = 0
            if R:                               # and in the ring, a window back, one fewer
                self._swa[0, start % R] = 0
                if start >= W:
                    self._swa[0, (start - W) % R] = -np.inf
        else:                                   # [T, C]: row t sees cells 0 .. start + t
            cells, pos = np.arange(self.capacity)[None, :], start + np.arange(T)[:, None]
            self._mask[:] = np.where(cells <= pos, 0, -np.inf)
            if R:                               # sliding: ring row r holds position held[r]
                last = start + T - 1
                held = last - (last - np.arange(R)[None, :]) % R                 # [1, R]
                self._swa[:] = np.where((held >= 0) & (held <= pos) & (held > pos - W), 0, -np.inf)
        self._filled = start + 1 if T == 1 else -1
        out = torch.empty(self.keep, self.spec.vocab)                             # [keep, V]
        self.logits.contents.data = out.data_ptr()
        self._compute()
        return out

    def _compute(self) -> None:
        """Run the graph (the RAM tier's graph runs it in segments: runtime/ggmltier.py)."""
        self.g.run()

    def routed(self) -> list[np.ndarray]:
        """Each MoE layer's chosen experts of the last run, [T, K] int32 (views: copy to keep)."""
        return self._ids_views


# -- the decode path ------------------------------------------------------------------
@lru_cache(maxsize=None)
def ring_rows(spec: _Spec) -> int:
    """Rows of a sliding layer's ring (0 without sliding layers): the window a chunk's first
    token looks back over, plus the chunk; so a chunk's writes never land on a row one of its
    tokens still sees."""
    return spec.window + _CHUNK if spec.window else 0


def full_rows(spec: _Spec, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Rows of the full-attention layers' buffers (the cache's capacity; 0 before any)."""
    return next((k.shape[0] for (k, _), w in zip(kv, spec.windows) if w is None), 0)


def _kv_buffers(spec: _Spec, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V rows [rows, width] float32: two buffers; MLA one [rows, latent + rope]
    whose columns are the keys (the latent) and the values (k_pe), as llama.cpp holds its MLA
    cache: the graph reads both, and the latent alone as V, from the one row."""
    wk, wv = spec.kv_widths
    if spec.mla is None:
        return torch.empty(rows, wk), torch.empty(rows, wv)
    buf = torch.empty(rows, wk + wv)
    return buf[:, :wk], buf[:, wk:]


def _graph_layer_class(base: type) -> type:
    """``base`` (transformers' ``DynamicLayer`` or ``DynamicSlidingWindowLayer``) whose keys and
    values are the graph's KV rows, made into tensors only when something reads them (the eager
    path; ``get_seq_length`` reads the length alone): a graph step then costs the cache no
    Python. The first write by anyone else (the eager path's ``torch.cat``, ``crop``) turns the
    layer back into one holding its own tensors. A sliding layer reads the last ``window - 1``
    rows, as transformers keeps them, and its ``cumulative_length`` is the decoder's length."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    sliding = issubclass(base, DynamicSlidingWindowLayer)

    class GraphLayer(base):
        _graph = None  # (decoder, layer index) while the rows live in the decoder's buffers

        def _get(self, name: str, which: int):
            if self._graph is not None:
                decoder, index = self._graph
                return decoder.view(index, which)
            return self.__dict__.get(name)

        def _release(self) -> None:
            """Hold views of the rows (and the length) now: the decoder stops writing for us."""
            decoder, index = self._graph
            self.__dict__["_keys"], self.__dict__["_values"] = decoder.view(index, 0), decoder.view(index, 1)
            self.__dict__["_cumulative_length"] = decoder.length
            self._graph = None

        def _set(self, name: str, value) -> None:
            if self._graph is not None:  # someone else writes
                self._release()
            self.__dict__[name] = value

        keys = property(lambda self: self._get("_keys", 0), lambda self, v: self._set("_keys", v))
        values = property(lambda self: self._get("_values", 1), lambda self, v: self._set("_values", v))
        if sliding:
            cumulative_length = property(
                lambda self: self._graph[0].length if self._graph is not None else self.__dict__["_cumulative_length"],
                lambda self, v: self._set("_cumulative_length", v))

        def get_seq_length(self) -> int:
            return self._graph[0].length if self._graph is not None else super().get_seq_length()

        def __deepcopy__(self, memo):
            """A plain ``base`` layer holding copies of the rows (never a copy of the decoder)."""
            import copy

            layer = base.__new__(base)
            hidden = ("_graph", "_keys", "_values", "_cumulative_length", "cumulative_length")
            state = {k: v for k, v in vars(self).items() if k not in hidden}
            layer.__dict__.update(copy.deepcopy(state, memo))
            layer.keys, layer.values = self.keys.clone(), self.values.clone()
            if sliding:
                layer.cumulative_length = self.cumulative_length
            return layer

    GraphLayer.__name__ = GraphLayer.__qualname__ = "Graph" + base.__name__
    return GraphLayer


class GraphDecoder:
    """The model's ``forward`` for one-token decode steps of one sequence (batch 1) with a
    ``DynamicCache``; every other forward (prefill, batches, a custom mask, gradients) goes to
    the eager forward, and the KV cache is handed over both ways."""

    _spec_class, _graph_class = _Spec, _StepGraph  # the RAM tier's subclass: runtime/ggmltier.py
    note = ""                                      # added to cpu_graph_reason

    def __init__(self, model: torch.nn.Module, cache, eager) -> None:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        self.spec = self._spec_class(model, cache)   # raises Unsupported
        self.cache, self.eager = cache, eager
        self.threads = ggml_threads()
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []    # per layer K, V [C or R, M*D] float32
        self._capacity = 0
        self.graphs: dict[tuple[int, int], _StepGraph] = {}
        self.owner = None                    # weakref to the DynamicCache whose layers read the buffers
        self.length = 0                      # rows of the owner's cache in the buffers
        self.steps = 0                       # tokens decoded by the graph
        self.prefills = 0                    # other forwards run by the graph: prompts, several tokens
        self.config = model.config
        self.eager_calls: dict[str, int] = {}  # why forwards went eager
        self.enabled = True
        # per layer: the cache layer types a forward's cache may hold there (transformers' own,
        # ours), and the one the hand-over makes
        bases = [DynamicLayer if w is None else DynamicSlidingWindowLayer for w in self.spec.windows]
        self._layer_types = [(b, _graph_layer_class(b)) for b in bases]
        self._moe_layers = [L["moe"]["index"] for L in self.spec.layers if "moe" in L]
        self.repacked, self.repack_reason = _repack(self.spec, cache.config.cpu_repack)

    @property
    def capacity(self) -> int:
        """Positions the cache holds before it grows (sliding layers: any, in their ring)."""
        return self._capacity

    def kv_bytes(self) -> int:
        return sum(k.numel() * 4 + v.numel() * 4 for k, v in self.kv)

    def view(self, layer: int, which: int) -> torch.Tensor:
        """Layer ``layer``'s keys (0) or values (1) as transformers holds them: [1, M, m, D], the
        last m of the n rows (m = n, or at most window - 1 on a sliding layer: rows of its ring,
        copied where they wrap around it)."""
        M, n, window = self.spec.cache_heads, self.length, self.spec.windows[layer]
        buf = self.kv[layer][which]                              # [C or R, M*D] (MLA: columns of one buffer)
        D = buf.shape[1] // M
        m, first = (n, 0) if window is None else (min(n, window - 1), (n - min(n, window - 1)) % buf.shape[0])
        if first + m > buf.shape[0]:                                               # wraps: in order
            buf, first = buf.index_select(0, torch.arange(n - m, n) % buf.shape[0]), 0
        row = buf.stride(0)
        return buf.as_strided((1, M, m, D), (m * M * D, D, row, 1), buf.storage_offset() + first * row)

    def __call__(self, *args, **kwargs):
        why = self._refusal(args, kwargs)
        if why is not None:
            self.eager_calls[why] = self.eager_calls.get(why, 0) + 1
            return self.eager(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = _past(kwargs)
        if past is None:   # a prompt without a cache: the one transformers would make
            from transformers.cache_utils import DynamicCache
            past = DynamicCache(config=self.config)
        n, T = past.get_seq_length(), ids.shape[1]
        self._hand_over(past, n, T)
        logits = self._run(ids[0].tolist(), n, kwargs.get("logits_to_keep") or 0)   # [keep, V]
        self.length = n + T
        if T == 1 and n:
            self.steps += 1
        else:
            self.prefills += 1
        logits = logits.view(1, logits.shape[0], -1)
        if kwargs.get("return_dict") is False:
            return logits, past
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(logits=logits, cache=past)

    def _refusal(self, args: tuple, kwargs: dict) -> str | None:
        """Why this forward runs eagerly, or None for the graph."""
        if not self.enabled:
            return "disabled"
        if len(args) > 1 or any(k not in _ALLOWED_KWARGS and not (k in _FALSE_KWARGS and not v)
                                for k, v in kwargs.items()):
            return "arguments the graph does not take"
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            return "not one sequence of token ids"
        if torch.is_grad_enabled():
            return "gradients enabled"
        if kwargs.get("use_cache") is False:
            return "use_cache=False"
        past = _past(kwargs)
        if past is not None and not self._matches(past):
            return "no DynamicCache whose layers match the model's (full attention, sliding windows)"
        n = 0 if past is None else past.get_seq_length()
        T = ids.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.shape != (1, n + T) or not bool(mask.all())):
            return "an attention mask with padding"
        for name in ("position_ids", "cache_position"):
            given = kwargs.get(name)
            if given is not None and given.reshape(-1).tolist() != list(range(n, n + T)):
                return f"{name} other than the next positions"
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int) or not 0 <= keep <= T:
            return "logits_to_keep other than a count of last tokens"
        if T > _CHUNK and not 0 < keep <= T % _CHUNK + (_CHUNK if T % _CHUNK == 0 else 0):
            return f"logits of more than the last chunk of a prompt over {_CHUNK} tokens"
        if n and not self._in_sync(past) and past.layers[0].keys.dtype != torch.float32:
            return "a cache not in float32"
        return None

    def _matches(self, past) -> bool:
        """Whether ``past`` is a DynamicCache whose layers are the model's kinds: full attention, or
        sliding with the model's window and no recorded past (transformers' or ours, each)."""
        from transformers.cache_utils import DynamicCache

        if not isinstance(past, DynamicCache) or len(past.layers) != len(self.spec.layers):
            return False
        return all(type(layer) in types and not getattr(layer, "record_past", False)
                   and getattr(layer, "sliding_window", window) == window
                   for layer, types, window in zip(past.layers, self._layer_types, self.spec.windows))

    def _in_sync(self, past) -> bool:
        """Whether ``past``'s layers read this decoder's rows (no hand-over needed)."""
        return (self.owner is not None and self.owner() is past
                and all(getattr(layer, "_graph", None) is not None and layer._graph[0] is self
                        for layer in past.layers))

    def _hand_over(self, past, n: int, T: int) -> None:
        """Make the buffers hold ``past``'s n rows, with room for T more, and ``past``'s layers
        read them (their own tensors are dropped: the KV cache is held once)."""
        in_sync = self._in_sync(past)
        if in_sync and n + T <= self.capacity:
            return
        if not in_sync:
            self._detach_owner()
        rows = [(layer.keys, layer.values) for layer in past.layers]            # [1, M, n, D] each
        if n + T > self.capacity:
            cap = max(_MIN_CAPACITY, self.capacity)
            while cap < n + T:
                cap *= 2
            # empty: rows past the cache's length are masked, and ggml skips masked rows
            ring = ring_rows(self.spec)
            self.kv = [_kv_buffers(self.spec, c) for c in (cap if w is None else ring for w in self.spec.windows)]
            self._capacity = cap
            self.graphs.clear()
        for (keys, values), (kb, vb) in zip(rows, self.kv) if n else ():         # -> positions n - m .. n
            m = keys.shape[2]     # n, or the last window - 1 on a sliding layer (those before: masked)
            at = torch.arange(n - m, n) % kb.shape[0]                            # rows (a ring's wrap)
            kb.index_copy_(0, at, keys[0].transpose(0, 1).reshape(m, kb.shape[1]))
            vb.index_copy_(0, at, values[0].transpose(0, 1).reshape(m, vb.shape[1]))
        del rows
        for index, layer in enumerate(past.layers):
            for name in ("keys", "values", "_keys", "_values", "cumulative_length", "_cumulative_length"):
                layer.__dict__.pop(name, None)
            layer.__class__ = self._layer_types[index][1]
            layer._graph = (self, index)
            layer.device, layer.is_initialized = torch.device("cpu"), True  # a prompt run here: never initialised
        import weakref
        self.owner, self.length = weakref.ref(past), n

    def _detach_owner(self) -> None:
        """The cache whose layers read the buffers gets its own copies of its rows: another
        cache's rows are about to be written there."""
        owner = self.owner() if self.owner is not None else None
        if owner is not None:
            for layer in owner.layers:
                if getattr(layer, "_graph", None) is not None and layer._graph[0] is self:
                    layer._release()   # views of the rows, then copies: the buffers get new rows
                    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        self.owner = None

    def _run(self, tokens: list[int], start: int, keep: int) -> torch.Tensor:
        """Logits [keep or T, V] of ``tokens`` written at rows start..: a prompt in chunks of at
        most _CHUNK tokens (llama.cpp's batches: the graph's buffers stay sized by the chunk), the
        logits of the last; the routing counted once for the whole forward, as eagerly."""
        routed, logits = [], None
        for at in range(0, len(tokens), _CHUNK):
            chunk = tokens[at:at + _CHUNK]
            last = at + _CHUNK >= len(tokens)
            graph = self._graph(len(chunk), keep if last else 1)
            logits = graph.run(chunk, start + at)
            routed.append([ids.copy() for ids in graph.routed()] if not last else graph.routed())
        self._count(routed, len(tokens))
        return logits

    def _graph(self, T: int, keep: int) -> _StepGraph:
        keep = keep if 0 < keep < T else T
        key = (T, keep, self.capacity)
        graph = self.graphs.get(key)
        if graph is None:
            prompts = [k for k in self.graphs if k[0] > 1]
            if T > 1 and len(prompts) >= _PROMPT_GRAPHS:   # prompt lengths vary: keep a few graphs
                del self.graphs[prompts[0]]
            graph = self.graphs[key] = self._graph_class(self.spec, self.kv, T, self.threads, self.repacked, keep)
        return graph

    def _count(self, routed: list[list[np.ndarray]], T: int) -> None:
        """The forward's routing into the cache's table (its counters: hits, accesses), each
        MoE layer one step over all its tokens, as the eager path counts it."""
        table, cache = self.cache.table, self.cache
        phase = cache.phase if cache.phase is not None else (PREFILL if T > 1 else DECODE)
        for i, layer in enumerate(self._moe_layers):
            ids = [chunk[i].reshape(-1) for chunk in routed]
            table.step(layer, (ids[0] if len(ids) == 1 else np.concatenate(ids)).tolist(), phase)


def _weights(spec: _Spec):
    """(ggml type, ne, address, stride or None) of every weight a graph multiplies with."""
    names = ("q", "k", "v", "o", "shared_gate", "q_a", "q_b", "kv_a")   # the last three: DeepSeek's MLA
    for lin in (spec.lm_head, *(L[n] for L in spec.layers for n in names if L.get(n))):
        yield lin[0], lin[1], lin[2], None
    for L in spec.layers:
        for mlp in (L.get("mlp"), L.get("shared")):
            for lin in (mlp or {}).values():
                yield lin[0], lin[1], lin[2], None
        for t, rows, cols, data in L["moe"]["experts"] if "moe" in L else ():
            yield t, (cols, rows, data.shape[0]), data.data_ptr(), data.stride(0)


def _repack(spec: _Spec, choice: str):
    """(``Repacked`` holding every weight ggml repacks, or None; why), at load: llama.cpp's
    default layout for its faster CPU kernels (quant/ggmlrepack.py). 'auto' repacks while the
    quantized weights take under half the free memory: a model near the RAM's size stays read
    in place from the file, paged by the OS."""
    from ..quant.ggmlrepack import Repacked
    from .device import host_room

    if choice == "off":
        return None, "cpu_repack='off': weights read in place"
    repacked = Repacked()
    if repacked.buft is None:
        return None, "ggml has no CPU_REPACK buffer type here: weights read in place"
    quantized = [w for w in _weights(spec) if w[0] not in (GGML_TYPE_F32, GGML_TYPE_F16)]
    size = sum(repacked.nbytes(t, ne) for t, ne, _, _ in quantized)
    free = host_room()   # under a memory cgroup the limit binds first (bench_tiers' mmap run was killed)
    if free is not None and size > free // 2:
        return None, (f"cpu_repack='auto': weights read in place ({size / 2**30:.1f} GiB of quantized "
                      f"weights, over half the {free / 2**30:.1f} GiB free)")
    for w in quantized:
        repacked.tensor(*w)
    if not repacked.tensors:
        return None, "no weight of a type ggml repacks on this CPU: weights read in place"
    return repacked, (f"{repacked.tensors} weights repacked for ggml's CPU kernels "
                      f"({repacked.bytes / 2**20:.0f} MiB, the file's pages released)")


def _past(kwargs: dict):
    """The cache a forward was given (``cache``; ``past_key_values`` before transformers 5.24)."""
    past = kwargs.get("cache")
    return kwargs.get("past_key_values") if past is None else past


def attach(model: torch.nn.Module, cache, choice: str = "auto", decoder_class=None) -> tuple[str, str]:
    """Decode through one graph a token where this model allows it: ('on' | 'off', why).
    ``decoder_class``: a ``GraphDecoder`` subclass (the RAM tier's: runtime/ggmltier.py)."""
    if choice == "off":
        return "off", "cpu_graph='off' asked for"
    decoder_class = decoder_class or GraphDecoder
    try:
        decoder = decoder_class(model, cache, model.forward)
    except Unsupported as err:
        return "off", f"{err}: per-layer ggml and torch ops"
    model.forward = decoder   # an instance attribute: nn.Module.__call__ (and its hooks) runs it
    model._expertcache_graph = decoder
    return "on", (f"one ggml graph a forward ({decoder.spec.family}, {len(decoder.spec.layers)} layers, "
                  f"{decoder.threads} threads; prompts in chunks of {_CHUNK}); {decoder.repack_reason}{decoder.note}")
