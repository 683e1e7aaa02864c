"""Tiny random MoE models of the seven supported families, built from config (no downloads).

2 decoder layers, 8 experts, top-2, hidden 32: every family builds in milliseconds and
round-trips through save_pretrained bit-exactly, so tests can compare the cached
runtime against the plain model.
"""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "granitemoe")

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=96, max_position_embeddings=128, num_experts_per_tok=2,
               bos_token_id=1, eos_token_id=None, pad_token_id=0)


def tiny_config(family: str, *, experts: int = 8, top_k: int = 2, layers: int = 2, hidden: int = 32):
    import transformers as tf

    common = {**_COMMON, "num_experts_per_tok": top_k, "num_hidden_layers": layers,
              "hidden_size": hidden}
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=experts)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=24, num_experts=experts,
                                 decoder_sparse_step=1)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                                 num_experts=experts, decoder_sparse_step=1, head_dim=8)
    if family == "olmoe":
        return tf.OlmoeConfig(**common, intermediate_size=24, num_experts=experts)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=24, num_local_experts=experts, head_dim=8,
                               layer_types=["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1),
                               sliding_window=16)
    if family == "deepseek_v3":
        # first layer dense, the rest MoE: exercises MoE-layer indexing that skips dense layers
        return tf.DeepseekV3Config(**{**common, "num_hidden_layers": layers + 1, "num_key_value_heads": 4},
                                   intermediate_size=48, moe_intermediate_size=24,
                                   n_routed_experts=experts, n_shared_experts=1, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    if family == "granitemoe":
        return tf.GraniteMoeConfig(**common, intermediate_size=24, num_local_experts=experts)
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def tiny_model(family: str, seed: int = 0, **kwargs):
    """A float32 causal LM in eval mode with random weights (biases and routers made non-trivial)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), dtype=torch.float32)
    with torch.no_grad():  # zero-initialised routers/biases would make every expert tie
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or name.endswith("router.weight"):
                p.normal_(0, 2.0)  # strong, varied routing: tokens spread over the experts
            elif "bias" in name and ("experts" in name or "router" in name):
                p.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return model.eval()


def save_checkpoint(model, path) -> None:
    """save_pretrained the model plus a tiny word-level tokenizer (ids 2..95 for words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>"] + [f"w{i}" for i in range(model.config.vocab_size - 2)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="<pad>", bos_token="<s>")
    model.save_pretrained(path)
    fast.save_pretrained(path)
