"""What would go wrong on CUDA, pinned on vLLM's CPU build.

- The kernel is called with the pool's row count, and every id it gets is below it (vLLM's
  Triton path sizes moe_align_block_size by that count; ids at or above it are dropped or
  written out of bounds; the CPU kernel indexes rows directly, so only this check shows it).
- Expert tensors are created on the host even when vLLM builds the model under a device
  context ('meta' stands in for the GPU here); only the pool goes to the device, and a pool
  that does not fit fails at load in one line.
- Shared experts (Qwen2-MoE: a shared expert with its own gate) give vLLM's greedy tokens.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: the plug-in tests run "
                                   "in .venv-vllm (make test-vllm builds it; make test runs them)")

from conftest import EXPERTS, LAYERS, MAX_TOKENS, PROMPTS, TOP_K, build_tiny_qwen2_moe, generate

ALL = LAYERS * EXPERTS
EXPERT_BYTES = (2 * 64 * 128 + 128 * 64) * 4   # w13 + w2 rows of one expert after padding, float32


def test_kernel_gets_ids_below_the_expert_count_it_is_given(tiny_model, reference, monkeypatch):
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel

    calls = []
    original = FusedMoEKernel.apply

    def spy(self, *args, **kwargs):
        w1, ids = kwargs["w1"], kwargs["topk_ids"]
        calls.append((w1.shape[0], kwargs["global_num_experts"], kwargs["expert_map"],
                      int(ids.min()), int(ids.max())))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedMoEKernel, "apply", spy)
    slots = ALL // 2
    tokens, logprobs, session = generate(tiny_model, {"slots": slots, "eviction": "lru"})
    rows = slots + TOP_K
    assert session.pool.rows == rows and len(calls) >= LAYERS * 8
    for pool_rows, count, expert_map, low, high in calls:
        assert (pool_rows, count, expert_map) == (rows, rows, None)
        assert 0 <= low <= high < count
    assert max(c[4] for c in calls) >= EXPERTS  # slot ids beyond E were used: the case that broke
    assert tokens == reference[0]
    if session.stats().total().bypasses <= session.pool.staging:  # one call per step: vLLM's arithmetic
        assert logprobs == reference[1]


def test_experts_are_created_on_the_host_not_on_the_device(tiny_model, monkeypatch):
    """vLLM builds the model under its device context; 'meta' stands in for a GPU too small
    for the experts (the byte budget is a quarter of them). The expert tensors must not
    follow that context; every other parameter must."""
    import torch
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from expertcache.vllm.layer import ExpertCacheRoutedExperts
    from expertcache.vllm.pool import HOST_MARK

    seen = {}
    original = BaseModelLoader.create_model

    class Built(Exception):
        pass

    def create_on_meta(self, *args, **kwargs):
        with torch.device("meta"):
            model = original(self, *args, **kwargs)
        seen["model"] = model
        raise Built("expertcache-test: model built, stopping before weights load")

    monkeypatch.setattr(BaseModelLoader, "create_model", create_on_meta)
    # vLLM caches rotary embeddings across models: the meta one must not reach later engines
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})
    with pytest.raises(Exception, match="expertcache-test: model built"):
        generate(tiny_model, {"gpu_memory": (ALL // 4 + TOP_K) * EXPERT_BYTES})
    model = seen["model"]
    cached = [m for m in model.modules() if isinstance(m, ExpertCacheRoutedExperts)]
    assert len(cached) == LAYERS
    expert_params = set()
    for layer in cached:
        for kind in ("w13_weight", "w2_weight"):
            p = getattr(layer, kind)
            assert p.device.type == "cpu" and getattr(p, HOST_MARK, False), (layer.layer_name, kind)
            assert p.shape[0] == EXPERTS
            expert_params.add(id(p))
    others = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_params]
    assert others and all(p.device.type == "meta" for _, p in others)
    # and nothing expert-stack-sized went to the device
    assert not [n for n, p in others if p.dim() == 3 and p.shape[0] == EXPERTS]
    for layer in cached:
        assert layer.quant_method.requires_device_loading is False  # repacking runs on the host


def test_a_pool_that_does_not_fit_fails_at_load_in_one_line(tiny_model, monkeypatch):
    from expertcache.vllm import pool

    monkeypatch.setattr(pool, "device_free_bytes", lambda device: 10 * EXPERT_BYTES)
    with pytest.raises(Exception) as err:
        generate(tiny_model, {"slots": ALL // 2})
    text = str(err.value).strip()
    assert "expertcache: the slot pool needs" in text and "lower 'slots'" in text
    assert "\n" not in text


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory) -> str:
    return build_tiny_qwen2_moe(str(tmp_path_factory.mktemp("tiny-qwen2-moe")))


def test_shared_experts_give_vllms_tokens(tiny_qwen2_moe):
    ref_tokens, ref_logprobs, _ = generate(tiny_qwen2_moe)
    tokens, logprobs, session = generate(tiny_qwen2_moe, {"slots": ALL // 2, "eviction": "lru"})
    assert tokens == ref_tokens
    exact = session.stats().total().bypasses <= session.pool.staging
    for ours, ref in zip(logprobs, ref_logprobs):
        assert ours == ref if exact else all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                                             for a, b in zip(ours, ref))
    assert all(layer.w13_weight.shape[0] == session.pool.rows for layer in session.layers)
    assert session.stats().total().misses > 0
    # the shared expert matters on this model (transformers, greedy): without it the tokens change
    assert _hf_greedy(tiny_qwen2_moe, zero_shared=False) != _hf_greedy(tiny_qwen2_moe, zero_shared=True)


def _hf_greedy(model_dir: str, zero_shared: bool) -> list[list[int]]:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if zero_shared:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.shared_expert.down_proj.weight.zero_()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(prompt):].tolist())
    return out
