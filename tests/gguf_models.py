"""Tiny GGUF MoE models written with gguf-py's writer, for tests (nothing is downloaded).

``write_gguf(path, family, expert_type)`` builds a random transformers model of the family,
writes it the way llama.cpp's converter lays it out (``blk.N.ffn_{gate,up,down}_exps``
``[E, rows, cols]``, everything else F32) with the experts in ``expert_type``, and a
byte-level BPE tokenizer in the file's metadata (Mixtral: a sentencepiece one, as llama.cpp
writes Mixtral's). Mixtral is GGUF architecture ``llama`` with its q and k rows permuted
(``LlamaModel.permute`` in llama.cpp's converter, for ggml's interleaved RoPE); OLMoE is
``olmoe``, unpermuted, with as many kv heads as heads (llama.cpp's OLMoE reads k_norm as
``[n_embd]``) and its norm epsilon written as 1e-5 (llama.cpp's converter sets that). DeepSeek-V3
is ``deepseek2`` as ``DeepseekV2Model`` writes it: MLA as MQA over the latent (head_count_kv 1,
key/value lengths of the latent, the head sizes in ``*_mla``), kv_b_proj split per head into
``attn_k_b`` (transposed) and ``attn_v_b``, the router bias as ``exp_probs_b.bias``, a dense first
layer, sigmoid gating over expert groups, YaRN with ``yarn_log_multiplier``. The expert FF size (384) is not the
architecture's default, on purpose: transformers' qwen3moe config mapping ignores
``expert_feed_forward_length`` (CONTEXT.md), and the loader must read it from the shapes.
K-quants need rows that are multiples of 256: hidden 256, expert FF 512.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from quant_fixtures import random_blocks

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss", "mixtral": "llama",
        "olmoe": "olmoe", "deepseek_v3": "deepseek2"}
HIDDEN, EXPERT_FF, EXPERTS, TOP_K, LAYERS = 256, 512, 8, 2, 2
_QUANTIZABLE = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "BF16", "F16", "F32"}


def tokenizer_lists() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, two specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]  # 1 normal, 3 control
    return tokens, types, merges


def spm_tokenizer_lists() -> tuple[list[str], list[int], list[float]]:
    """A sentencepiece vocabulary as llama.cpp writes Mixtral's: <unk> <s> </s>, the 256 byte
    tokens (byte fallback), then pieces with scores (the merges are recovered from them)."""
    pieces = ["▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "▁c", "at", "▁cat"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)  # 2 unknown, 3 control, 6 byte, 1 normal
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def vocab_size(family: str) -> int:
    return len(spm_tokenizer_lists()[0] if family == "mixtral" else tokenizer_lists()[0])


def tiny_config(family: str, vocab: int, layers: int = LAYERS, experts: int = EXPERTS, sliding_window: int = 16):
    import transformers as tf

    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab, max_position_embeddings=256, num_experts_per_tok=TOP_K,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=vocab - 2, eos_token_id=vocab - 2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=768, moe_intermediate_size=EXPERT_FF,
                                 num_experts=experts, decoder_sparse_step=1, head_dim=64, norm_topk_prob=True)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=768, moe_intermediate_size=EXPERT_FF,
                                 shared_expert_intermediate_size=256, num_experts=experts,
                                 decoder_sparse_step=1)
    if family == "mixtral":
        return tf.MixtralConfig(**common | {"bos_token_id": 1, "eos_token_id": 2}, intermediate_size=EXPERT_FF,
                                num_local_experts=experts)
    if family == "olmoe":
        return tf.OlmoeConfig(**common | {"num_key_value_heads": 4, "rms_norm_eps": 1e-5}, pad_token_id=None,
                              intermediate_size=EXPERT_FF, num_experts=experts, norm_topk_prob=False)
    if family == "deepseek_v3":  # a dense first layer, then ``layers`` MoE ones; YaRN as DeepSeek-V3's
        return tf.DeepseekV3Config(**common | {"num_hidden_layers": layers + 1, "num_key_value_heads": 4},
                                   intermediate_size=768, moe_intermediate_size=EXPERT_FF, n_routed_experts=experts,
                                   n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64, kv_lora_rank=64,
                                   qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                    "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=EXPERT_FF, num_local_experts=experts, head_dim=64,
                               sliding_window=sliding_window,
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                               rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                "original_max_position_embeddings": 4096})
    raise ValueError(f"no GGUF fixture for {family!r}")


def tiny_model(family: str, seed: int = 0, layers: int = LAYERS, experts: int = EXPERTS, sliding_window: int = 16):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family, vocab_size(family), layers, experts,
                                                            sliding_window), dtype=torch.float32)
    with torch.no_grad():  # varied routing, so that tokens spread over the experts
        for name, p in model.named_parameters():
            if family == "deepseek_v3" and name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)  # sigmoid routing: large logits would all score 1.0 and tie
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0, 2.0)
            elif name.endswith(("_bias", "sinks")) or ".bias" in name:
                p.normal_(0, 0.1)  # GPT-OSS biases and sinks start at zero: make them count
            elif family == "olmoe" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.3)  # OLMoE's norms over all heads start at one: make each weight count
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)  # DeepSeek's selection bias starts at zero: make it count
    return model.eval()


def write_gguf(path: str | Path, family: str = "qwen3_moe", expert_type: str = "Q8_0", seed: int = 0,
               layers: int = LAYERS, down_type: str | None = None, tokenizer: bool = True,
               experts: int = EXPERTS, split_max_tensors: int = 0, dense_type: str = "F32",
               sliding_window: int = 16, split_kv_b: bool = True) -> Path:
    """Write a tiny ``family`` model as GGUF with experts in ``expert_type`` (down in ``down_type``,
    or per layer when it is a list: llama.cpp's Q4_K_M mixes Q6_K and Q4_K down projections).

    ``dense_type``: the type of the 2-D non-expert weights (embedding, lm_head, attention,
    shared experts) as llama.cpp's quantizer leaves them; routers and norms stay F32.
    ``sliding_window``: GPT-OSS's window (its sliding layers alternate with full ones).
    ``split_kv_b``: DeepSeek's kv_b_proj as today's converter writes it (``attn_k_b`` transposed
    and ``attn_v_b``, per head), or False: one ``attn_kv_b`` as files before that split.

    ``split_max_tensors`` > 0 writes a split model (``path`` gets ``-0000N-of-0000M``) and
    returns its first part.
    """
    path = Path(path)
    model = tiny_model(family, seed, layers, experts, sliding_window)
    cfg = model.config
    arch = ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _metadata(writer, cfg, arch, tokenizer)
    rng = np.random.default_rng(seed)
    dense_rng = np.random.default_rng(seed + 1)  # the experts' blocks stay as without dense_type
    names = gguf.get_tensor_name_map(_arch_enum(arch), cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if ".experts." in hf_name:
            continue
        data = tensor.float().numpy()
        if hf_name.endswith("self_attn.sinks"):  # gguf-py's name map leaves GPT-OSS's sinks out
            writer.add_tensor(f"blk.{hf_name.split('.')[2]}.attn_sinks.weight", data)
            continue
        if hf_name.endswith("e_score_correction_bias"):  # the converter renames it e_score_correction.bias
            writer.add_tensor(f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias", data)
            continue
        if hf_name.endswith("kv_b_proj.weight") and split_kv_b:  # [heads, rows, cols] each, quantized too
            for name, part in mla_split(data, cfg).items():
                tensor_name = f"blk.{hf_name.split('.')[2]}.{name}.weight"
                if dense_type == "F32":
                    writer.add_tensor(tensor_name, part)
                else:
                    _add_dense_tensor(writer, tensor_name, part, dense_type, dense_rng)
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        if "shared_expert_gate" in base:
            data = data.reshape(-1)  # llama.cpp stores it as a vector
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("attn_q") else cfg.num_key_value_heads
            data = llama_permute(data, heads)
        if data.ndim == 2 and dense_type != "F32" and not gguf_name.endswith("ffn_gate_inp"):
            _add_dense_tensor(writer, f"{gguf_name}.{suffix}", data, dense_type, dense_rng)
            continue
        writer.add_tensor(f"{gguf_name}.{suffix}", data)
    for layer in range(cfg.num_hidden_layers):
        if not hasattr(model.model.layers[layer].mlp, "experts"):
            continue  # DeepSeek's leading dense layers
        parts, biases = expert_parts(model.model.layers[layer].mlp.experts)
        for kind, data in parts.items():
            down = down_type[layer] if isinstance(down_type, (list, tuple)) else down_type
            qtype = down if (kind == "down" and down) else expert_type
            _add_expert_tensor(writer, f"blk.{layer}.ffn_{kind}_exps.weight", data, qtype, rng)
        for kind, data in biases.items():
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.bias", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        return next(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
    return path


def llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter on arch ``llama``'s q and k rows (``LlamaModel.permute``): each head's
    two rotate-half halves interleaved, for ggml's RoPE on adjacent pairs. [rows, cols] -> same."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def mla_split(kv_b: np.ndarray, cfg) -> dict[str, np.ndarray]:
    """llama.cpp's converter on DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] (for MLA's
    absorbed q.k): per head, the k rows transposed (attn_k_b [heads, kv_lora, nope]) and the v
    rows (attn_v_b [heads, v, kv_lora])."""
    heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    per_head = kv_b.reshape(heads, nope + cfg.v_head_dim, kv_b.shape[1])
    return {"attn_k_b": np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)),
            "attn_v_b": np.ascontiguousarray(per_head[:, nope:])}


def expert_parts(experts) -> tuple[dict, dict]:
    """An HF experts module's weights as llama.cpp's GGUF tensors: [E, rows=out, cols=in] each.

    Qwen: gate_up_proj [E, 2I, H] is gate rows then up rows. GPT-OSS: gate_up_proj [E, H, 2I]
    is transposed, gate and up alternate along 2I, and biases come along.
    """
    gate_up = experts.gate_up_proj.detach().float().numpy()
    down = experts.down_proj.detach().float().numpy()
    if not getattr(experts, "is_transposed", False):
        inter = gate_up.shape[1] // 2
        return {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down}, {}
    gate_up = gate_up.transpose(0, 2, 1)  # [E, 2I, H]
    bias = experts.gate_up_proj_bias.detach().float().numpy()
    parts = {"gate": gate_up[:, 0::2], "up": gate_up[:, 1::2], "down": down.transpose(0, 2, 1)}
    biases = {"gate": bias[:, 0::2], "up": bias[:, 1::2],
              "down": experts.down_proj_bias.detach().float().numpy()}
    return parts, biases


def _arch_enum(arch: str):
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


def _metadata(writer, cfg, arch: str, tokenizer: bool) -> None:
    if arch == "deepseek2":
        _deepseek_metadata(writer, cfg)
        _tokenizer_metadata(writer, arch, tokenizer)
        return
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch not in ("llama", "olmoe"):  # llama.cpp writes it where the config names a MoE size
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if arch == "gpt-oss":
        rope = cfg.rope_parameters
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _tokenizer_metadata(writer, arch, tokenizer)


def _deepseek_metadata(writer, cfg) -> None:
    """The keys llama.cpp's converter writes for DeepSeek-V3 (``TextModel`` and ``DeepseekV2Model``'s
    set_gguf_parameters, from a config.json with ``scoring_func: sigmoid`` and no head_dim)."""
    rope = cfg.rope_parameters
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA written as MQA over the latent
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:  # the converter writes it only then (DeepSeek-V2-Lite: q_proj)
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _tokenizer_metadata(writer, arch: str, tokenizer: bool) -> None:
    if tokenizer and arch == "llama":
        tokens, types, scores = spm_tokenizer_lists()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    elif tokenizer:
        tokens, types, merges = tokenizer_lists()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("deepseek-v3" if arch == "deepseek2" else "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(len(tokens) - 2)
        writer.add_eos_token_id(len(tokens) - 2)
        writer.add_add_bos_token(False)


def _add_dense_tensor(writer, name: str, data: np.ndarray, qtype: str, rng) -> None:
    """A [..., rows, cols] weight in ``qtype``, as ``_add_expert_tensor`` writes experts."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in _QUANTIZABLE:
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
    else:
        rows, cols = int(np.prod(data.shape[:-1])), data.shape[-1]
        blocks = random_blocks(qtype, rows, cols, rng)
        writer.add_tensor(name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=kind)


def _add_expert_tensor(writer, name: str, data: np.ndarray, qtype: str, rng) -> None:
    """Quantize with gguf-py where it can; K-quants and IQ types get valid random blocks."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype in _QUANTIZABLE:
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
    else:
        E, rows, cols = data.shape
        blocks = random_blocks(qtype, E * rows, cols, rng).reshape(E, rows, -1)
        writer.add_tensor(name, blocks, raw_dtype=kind)
