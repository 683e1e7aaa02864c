"""CUDA paths: pinned host experts, a fixed-address pool on the device, the copy stream and
its events, at most one device-to-host sync per MoE layer step. Run by benchmarks/gpu_check.sh."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False); "
                              "run benchmarks/gpu_check.sh on a GPU machine"),
]

from tiny_moe import tiny_model  # noqa: E402

from expertcache.integrations.transformers import offload  # noqa: E402
from cuda_sync import forbid_syncs_in_steps  # noqa: E402


def _decode(model, ids, n=12):
    with torch.no_grad():
        out = model.generate(ids.to(model.device), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits).float().cpu()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("kwargs", [dict(slots=3), dict(slots=4, partition="per-layer", miss="cpu"),
                                    dict(slots=3, miss="auto"), dict(baseline="copy-every-pass", staging=1)],
                         ids=["fetch", "cpu-per-layer", "auto", "copy-every-pass-1-staging"])
def test_cuda_equals_cpu_reference(family, kwargs):
    reference = tiny_model(family)
    ids = torch.randint(2, 96, (1, 13), generator=torch.Generator().manual_seed(2))
    ref_tokens, ref_logits = _decode(reference, ids)
    model = offload(copy.deepcopy(reference), device="cuda", **kwargs)
    tokens, logits = _decode(model, ids)
    assert (logits - ref_logits).abs().max().item() <= 1e-4  # TF32/cuBLAS vs CPU sums
    assert torch.equal(tokens, ref_tokens)


def test_pinned_host_fixed_device_pool_and_copy_stream():
    model = offload(tiny_model("mixtral"), slots=3, device="cuda")
    cache = model.expertcache
    assert all(t.is_pinned() for host in cache.hosts for t in host.tensors.values())
    assert all(t.device.type == "cuda" for t in cache.pool.tensors.values())
    assert cache.pool.copy_stream is not None
    assert cache.pool.copy_stream != torch.cuda.current_stream()
    before = cache.pool.data_ptrs()
    _decode(model, torch.randint(2, 96, (1, 20)), n=30)
    assert cache.stats().total().evictions > 0
    assert cache.pool.data_ptrs() == before
    # no expert weights left on the device outside the pool
    assert not any(p.device.type == "cuda" and p.ndim == 3 for p in model.parameters())


@pytest.mark.parametrize("miss", ["fetch", "cpu"])
def test_one_sync_per_moe_layer_step(monkeypatch, miss):
    """Only reading the ids synchronises, plus fetching the activations in steps that compute on
    the host; any other implicit sync inside a step raises (sync debug mode)."""
    model = offload(tiny_model("qwen3_moe"), slots=3, device="cuda", miss=miss)
    calls = forbid_syncs_in_steps(monkeypatch)
    _decode(model, torch.randint(2, 96, (1, 9)), n=10)
    assert calls["steps"] > 0 and calls["to_host"] == calls["steps"]
    assert calls["acts"] == 0 if miss == "fetch" else 0 < calls["acts"] <= calls["steps"]


def test_stress_small_pool_many_steps_stays_exact():
    """Many evictions with copies racing compute: events must keep every read consistent."""
    reference = tiny_model("olmoe", experts=16, layers=2)
    ids = torch.randint(2, 96, (1, 40), generator=torch.Generator().manual_seed(9))
    ref_tokens, ref_logits = _decode(reference, ids, n=48)
    model = offload(copy.deepcopy(reference), slots=2, device="cuda", staging=1)
    tokens, logits = _decode(model, ids, n=48)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.equal(tokens, ref_tokens)


def test_budget_larger_than_free_device_memory():
    free = torch.cuda.mem_get_info()[0]
    with pytest.raises(ValueError, match="free"):
        offload(tiny_model("mixtral"), gpu_memory=free * 2, device="cuda")


def test_the_first_preload_sees_the_zeroed_pool_finished():
    """The pool is zero-filled on the compute stream and preloaded on the copy stream: the copy
    stream starts behind the fill, so every slot holds its expert, never zeros (review 2)."""
    reference = tiny_model("qwen3_moe", experts=16, layers=2)
    cache = offload(copy.deepcopy(reference), baseline="resident", device="cuda").expertcache
    torch.cuda.synchronize()
    table, pool = cache.table, cache.pool
    for layer, host in enumerate(cache.hosts):
        for expert in range(cache.num_experts):
            slot = table.slot_of(layer * cache.num_experts + expert)
            for kind, t in pool.tensors.items():
                assert torch.equal(t[slot].cpu(), host.tensors[kind][expert]), (layer, expert, kind)


def test_prefill_with_two_staging_banks_stays_exact():
    """A long prompt with copy-every-pass and 4 staging slots runs many staged rounds in two
    alternating banks (review 5): copies of a round overlap the round before, reads stay exact."""
    reference = tiny_model("olmoe", experts=16, layers=2)
    ids = torch.randint(2, 96, (1, 40), generator=torch.Generator().manual_seed(4))
    ref_tokens, ref_logits = _decode(reference, ids, n=6)
    model = offload(copy.deepcopy(reference), baseline="copy-every-pass", staging=4, device="cuda")
    tokens, logits = _decode(model, ids, n=6)
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert torch.equal(tokens, ref_tokens)


def test_pinned_experts_are_locked_in_place_to_the_byte():
    """Host experts are page-locked without torch's power-of-two pinned blocks (review 9)."""
    from expertcache.runtime.host import resident

    data = torch.randn(3, 805, 301, dtype=torch.bfloat16, device="cuda")  # 1.45 MB
    out = resident(data, "pinned")
    assert out.is_pinned() and out.device.type == "cpu" and out.data_ptr() % 4096 == 0
    assert torch.equal(out, data.cpu())
    slot = torch.empty_like(data)
    slot.copy_(out, non_blocking=True)  # DMA from the registered pages
    torch.cuda.synchronize()
    assert torch.equal(slot, data)
