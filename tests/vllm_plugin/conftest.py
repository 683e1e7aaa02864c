"""vLLM plug-in tests: run in .venv-vllm (`make test-vllm`); elsewhere they skip.

A tiny Qwen3-MoE (4 MoE layers, 16 experts, top-4, hidden 128: vLLM's CPU kernel wants
multiples of 32) is built from a transformers config and saved with save_pretrained: no
downloads, no tokenizer (prompts are token ids). vLLM runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, 'uni' executor: 4-10 s per engine on a loaded
2-core machine) with its compile cache in a temporary folder, one per xdist worker.
"""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

# A compile cache per xdist worker: two engines compiling the same model must not write one folder.
_CACHE = os.environ.get("VLLM_CACHE_ROOT") or tempfile.mkdtemp(prefix="vllm-cache-")
os.environ["VLLM_CACHE_ROOT"] = os.path.join(_CACHE, os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

LAYERS, EXPERTS, TOP_K = 4, 16, 4
PROMPTS = [[3 + i, 10, 20 + i, 30, 40 + 2 * i] for i in range(4)]
MAX_TOKENS = 8


def build_tiny_qwen3_moe(path: str) -> str:
    import torch
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(hidden_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                            num_experts_per_tok=TOP_K, num_experts=EXPERTS, intermediate_size=96,
                            moe_intermediate_size=48,  # vLLM pads it to 64: the padding is exercised
                            decoder_sparse_step=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 2.0)      # strong, varied routing: tokens spread over the experts
            elif ".experts." in name or name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0, 0.2)      # experts that matter: a wrong expert changes the logits
    model.save_pretrained(path)
    return path


def build_tiny_qwen2_moe(path: str) -> str:
    """Qwen2-MoE: routed experts plus a shared expert scaled by its own sigmoid gate
    (vLLM's runner runs the shared expert beside the routed ones and adds the outputs)."""
    import torch
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(hidden_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                            num_experts_per_tok=TOP_K, num_experts=EXPERTS, intermediate_size=96,
                            moe_intermediate_size=48, shared_expert_intermediate_size=64,
                            decoder_sparse_step=1, norm_topk_prob=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    torch.manual_seed(1)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 2.0)
            elif ".experts." in name or name.endswith(("gate_up_proj", "down_proj")) or "shared_expert" in name:
                p.normal_(0, 0.2)  # the shared expert and its gate matter too
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_qwen3_moe(str(tmp_path_factory.mktemp("tiny-qwen3-moe")))


def llm_kwargs(model: str, eager: bool = True, config: dict | None = None) -> dict:
    return dict(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=eager,
                max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.2,
                kv_cache_memory_bytes=1 << 26, distributed_executor_backend="uni", seed=0,
                additional_config={} if config is None else {"expertcache": config})


def generate(model: str, config: dict | None = None, eager: bool = True, prompts=PROMPTS):
    """Greedy tokens and their logprobs for ``prompts`` in one batch; the engine is shut down after.

    Returns (tokens per prompt, logprob of each chosen token, the plug-in's session or None).
    """
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from expertcache.vllm import session as sessions

    llm = LLM(**llm_kwargs(model, eager, config))
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                           detokenize=False), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                    for o in outs]
        session = sessions._current if config is not None else None
        return tokens, logprobs, session
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def generate_sets(model: str, config: dict | None, prompt_sets, eager: bool = True):
    """``generate`` for several batches on one engine (one start): [(tokens, logprobs)], session."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from expertcache.vllm import session as sessions

    llm = LLM(**llm_kwargs(model, eager, config))
    try:
        results = []
        for prompts in prompt_sets:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                               detokenize=False), use_tqdm=False)
            results.append(([list(o.outputs[0].token_ids) for o in outs],
                             [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                              for o in outs]))
        return results, (sessions._current if config is not None else None)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


@pytest.fixture(scope="session")
def reference(tiny_model):
    """vLLM's own greedy tokens and logprobs, without the plug-in (eager)."""
    tokens, logprobs, _ = generate(tiny_model)
    return tokens, logprobs
