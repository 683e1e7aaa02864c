"""The equality every quantized-model test asserts: offloaded logits and greedy tokens equal a
reference's (float32, within 1e-4; on CUDA the reference runs on CUDA too)."""

from __future__ import annotations

import copy

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
    """On CUDA (float32): pinned quantized host bytes; logits within 1e-4 and greedy tokens equal
    to the same reference run on CUDA (the uncached model on the same device: cuBLAS and the
    CPU sum in different orders, and GPT-OSS's logits differed from the CPU reference by more than
    1e-3 on an H200 in both slot formats; benchmarks/gpu_check.py's ``diag`` step prints how
    the CPU and CUDA references, and ours, differ)."""
    ref_cuda = copy.deepcopy(ref).cuda()
    logits, tokens = (t.cpu() for t in expected(ref_cuda, prompt.cuda()))
    del ref_cuda
    model = expertcache.offload(path, slots=6, device="cuda", dtype="float32", slot_format=slot_format)
    cache = model.expertcache
    assert cache.host_mode[0] == "pinned"
    assert all(t.is_pinned() for host in cache.hosts for t in host.tensors.values())
    with torch.no_grad():
        got = model(prompt.cuda()).logits.cpu()
        out = model.generate(prompt.cuda(), max_new_tokens=10, do_sample=False).cpu()
    assert (got - logits).abs().max().item() <= 1e-4
    assert torch.equal(out, tokens)
    return model
