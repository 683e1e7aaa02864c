"""Every supported family gives the uncached model's logits and greedy tokens through the cache.

Tiny random float32 models (2 MoE layers x 8 experts, top-2). Capacities are small
enough that every run evicts and bypasses, so loads, staging rounds and the CPU path
all carry real tokens. Tolerance: max abs logit difference <= 1e-5 over the prompt and
every decode step.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import FAMILIES, tiny_model  # noqa: E402

from expertcache.integrations.transformers import offload  # noqa: E402
from expertcache.costmodel import Hardware  # noqa: E402

NEW_TOKENS = 6

# (label, offload kwargs): policies x partitions x miss paths, all at capacities that evict
CONFIGS = [
    ("lru-global-fetch", dict(slots=3)),
    ("fifo-perlayer-fetch", dict(slots=4, partition="per-layer", eviction="fifo")),
    ("slru-secondhit-cpu", dict(slots=4, eviction="slru", admission="second-hit", miss="cpu")),
    ("lfu-perlayer-auto", dict(slots=4, partition="per-layer", eviction="lfu", miss="auto")),
]

# auto: CPU for an expert with 1 token, fetch for 2 or more (1 B/s over PCIe against 1 FLOP/s on
# the host, memory free: fetch costs 4P s for fp32, the CPU 2P s per token)
SPLIT_COST = Hardware("split", h2d_gbps=1e-9, gpu_mem_gbps=float("inf"), cpu_mem_gbps=float("inf"),
                      cpu_gflops=1e-9, transfer_latency_s=0.0)


def _run(model, ids):
    """Prompt logits, per-step decode logits and greedy tokens."""
    with torch.no_grad():
        prompt_logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return prompt_logits, torch.stack(out.logits), out.sequences


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param)
    ids = torch.randint(2, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    return request.param, model, ids, _run(model, ids)


@pytest.mark.parametrize("label,kwargs", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_cached_equals_uncached(family, label, kwargs):
    name, reference, ids, (ref_prompt, ref_steps, ref_tokens) = family
    model = offload(copy.deepcopy(reference), **kwargs)
    if kwargs.get("miss") == "auto":
        model.expertcache.hardware = SPLIT_COST
    prompt, steps, tokens = _run(model, ids)
    assert (prompt - ref_prompt).abs().max().item() <= 1e-5, f"{name} {label}: prompt logits differ"
    assert (steps - ref_steps).abs().max().item() <= 1e-5, f"{name} {label}: decode logits differ"
    assert torch.equal(tokens, ref_tokens), f"{name} {label}: greedy tokens differ"
    total = model.expertcache.stats().total()
    # the capacities force real cache traffic: otherwise this test would prove nothing
    assert total.misses > 0 and total.hits + total.misses == total.accesses
    assert total.evictions > 0 or total.bypasses > 0, f"{name} {label}: nothing was evicted or bypassed"


def test_the_families_exercise_the_unusual_layouts(family):
    """The equality tests above mean most where a family's layout differs from Mixtral's: the
    tiny models must really have them (a config change could quietly drop one)."""
    from expertcache.loaders.common import find_experts

    name, model = family[0], family[1]
    experts = find_experts(model)
    params = dict(experts[0][1].named_parameters())
    if name == "gpt_oss":  # transposed [E, H, 2I], with biases
        assert params["gate_up_proj"].shape == (8, 32, 48) and "gate_up_proj_bias" in params
    else:  # [E, 2I, H] without biases
        assert params["gate_up_proj"].shape[1:] != (32, 48) and not any("bias" in n for n in params)
    # DeepSeek-V3's first layer is dense: MoE-layer indices must skip it
    dense = 1 if name == "deepseek_v3" else 0
    assert len(experts) == model.config.num_hidden_layers - dense == 2


@pytest.mark.parametrize("baseline", ["resident", "copy-every-pass", "cpu"])
def test_baselines_equal_uncached(family, baseline):
    name, reference, ids, (ref_prompt, ref_steps, ref_tokens) = family
    model = offload(copy.deepcopy(reference), baseline=baseline, staging=1 if baseline != "resident" else None)
    prompt, steps, tokens = _run(model, ids)
    assert (prompt - ref_prompt).abs().max().item() <= 1e-5, f"{name} {baseline}: prompt logits differ"
    assert (steps - ref_steps).abs().max().item() <= 1e-5, f"{name} {baseline}: decode logits differ"
    assert torch.equal(tokens, ref_tokens), f"{name} {baseline}: greedy tokens differ"
    total = model.expertcache.stats().total()
    assert total.hits == (total.accesses if baseline == "resident" else 0)
