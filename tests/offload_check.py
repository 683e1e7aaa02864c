"""The equality every quantized-model test asserts: offloaded logits and greedy tokens equal a
reference's (CPU: within 1e-4 in float32; CUDA: 1e-3 against the CPU reference's sums)."""

from __future__ import annotations

import torch

import expertcache


def expected(ref, prompt: torch.Tensor, new_tokens: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's logits on ``prompt`` and its greedy continuation."""
    with torch.no_grad():
        return ref(prompt).logits, ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False)


def assert_offload_matches(path, prompt, logits, tokens, **kwargs):
    """Offload ``path`` (6 slots unless given) and compare; the cache must have hit and missed."""
    kwargs.setdefault("slots", 6)
    # equality with transformers is asked for: the exact CPU path (ggml's kernels quantize the
    # activations; tests/test_ggml_experts.py checks them against this path and llama.cpp)
    kwargs.setdefault("cpu_kernel", "torch")
    model = expertcache.offload(path, **kwargs)
    with torch.no_grad():
        got = model(prompt).logits
        out = model.generate(prompt, max_new_tokens=tokens.shape[1] - prompt.shape[1], do_sample=False)
    assert (got - logits).abs().max().item() <= 1e-4
    assert torch.equal(out, tokens)
    stats = model.expertcache.stats()
    assert stats.total().misses > 0 and stats.total().hits > 0  # the cache was exercised, not bypassed
    return model


def assert_cuda_matches(path, ref, prompt, slot_format: str):
    """On CUDA (float32): pinned quantized host bytes, logits and tokens of the CPU reference."""
    logits, tokens = expected(ref, prompt)
    model = expertcache.offload(path, slots=6, device="cuda", dtype="float32", slot_format=slot_format)
    cache = model.expertcache
    assert cache.host_mode[0] == "pinned"
    assert all(t.is_pinned() for host in cache.hosts for t in host.tensors.values())
    with torch.no_grad():
        got = model(prompt.cuda()).logits.cpu()
        out = model.generate(prompt.cuda(), max_new_tokens=10, do_sample=False).cpu()
    assert (got - logits).abs().max().item() <= 1e-3  # TF32 / cuBLAS sums against the CPU's
    assert torch.equal(out, tokens)
    return model
