"""imatrix placement in the runtime: offload(imatrix=..., imatrix_mode=...) on a tiny model (CPU)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import tiny_model  # noqa: E402

from expertcache.integrations.transformers import offload  # noqa: E402

# 2 MoE layers x 8 experts, top-2: layer 0 leans on experts 5 and 1, layer 1 on 2
COUNTS = np.array([[3, 40, 2, 1, 0, 90, 4, 6], [10, 1, 70, 1, 1, 1, 30, 2]])


@pytest.fixture(scope="module")
def reference():
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def counts_file(tmp_path):
    path = tmp_path / "counts.npy"
    np.save(path, COUNTS)
    return path


def _logits(model, ids):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _pool_matches_host(cache, keys):
    for key in keys:
        layer, expert = divmod(key, cache.num_experts)
        slot = cache.table.slot_of(key)
        for kind, tensor in cache.pool.tensors.items():
            assert torch.equal(tensor[slot], cache.hosts[layer].tensors[kind][expert])


@pytest.mark.parametrize("mode", ["pin", "seed"])
def test_placement_is_loaded_and_outputs_do_not_change(reference, ids, counts_file, mode):
    model = offload(copy.deepcopy(reference), slots=6, imatrix=counts_file, imatrix_mode=mode)
    cache = model.expertcache
    # pin: half of 6 slots -> the 3 highest shares (0,5), (1,2), (0,1); seed: all 6 slots
    placed = {5, 8 + 2, 1} if mode == "pin" else {5, 10, 1, 14, 8, 7}
    assert set(cache.table.resident()) == placed
    assert cache.table.pinned == (frozenset(placed) if mode == "pin" else frozenset())
    _pool_matches_host(cache, placed)                      # the slots hold the right weights now
    assert cache.stats().total().accesses == 0 and sum(map(sum, cache.h2d)) == 0  # setup is not traffic
    tokens, logits = _logits(model, ids)
    ref_tokens, ref_logits = _logits(reference, ids)
    assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max().item() <= 1e-5
    if mode == "pin":
        assert placed <= set(cache.table.resident())       # still there after generating
        _pool_matches_host(cache, placed)


def test_bad_imatrix_fails_before_the_model_is_taken_apart(reference, tmp_path):
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.ones((3, 8)))
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="counts are for 3 layers x 8 experts but the model has 2"):
        offload(model, slots=6, imatrix=wrong)
    assert getattr(model, "expertcache", None) is None
    assert any("experts" in name for name, _ in model.named_parameters())  # weights still in place


def test_imatrix_needs_cache_slots(reference, counts_file):
    with pytest.raises(ValueError, match="imatrix placement needs cache slots"):
        offload(copy.deepcopy(reference), baseline="cpu", imatrix=counts_file)
    # the default pin budget never starves the pool: 3 slots, top-2 -> only 1 pinned
    small = offload(copy.deepcopy(reference), slots=3, imatrix=counts_file, imatrix_mode="pin")
    assert small.expertcache.table.pinned == frozenset({5})


def test_generate_cli_passes_the_imatrix_flags():
    from expertcache.cli import build_parser

    args = build_parser().parse_args(["generate", "ckpt", "--prompt", "hi", "--slots", "8",
                                      "--imatrix", "imatrix.gguf", "--imatrix-mode", "seed"])
    assert (args.imatrix, args.imatrix_mode) == ("imatrix.gguf", "seed")
