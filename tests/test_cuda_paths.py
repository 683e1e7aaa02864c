"""The CUDA-only decisions of the runtime, checked on the CPU (issue 24's review findings).

Each test pins one choice that a CPU run would otherwise never take: which dtype and
device get torch's grouped matmul, the window of pool slots one grouped matmul reads, the
order of a step's device passes (hits before misses, two staging banks), and when the
activations cross to the host.
"""

from __future__ import annotations

import copy

import pytest
import torch

from expertcache import offload
from expertcache.runtime import compute
from expertcache.runtime.compute import fast_grouped_mm, grouped_over_slots
from expertcache.runtime.experts import plan_rounds
from tiny_moe import tiny_model


@pytest.mark.parametrize("device,dtype,capability,fast", [
    ("cuda", torch.bfloat16, (9, 0), True),      # H100 / H200
    ("cuda", torch.bfloat16, (10, 0), True),     # B200
    ("cuda", torch.bfloat16, (8, 0), False),     # A100: torch's loop, which reads offsets back
    ("cuda", torch.float32, (9, 0), False),      # fp32 on Hopper: the same syncing loop
    ("cuda", torch.float16, (9, 0), False),
    ("cpu", torch.bfloat16, None, False),        # the host: our loop over used slots is faster
])
def test_grouped_matmul_only_where_torch_has_the_fast_kernel(device, dtype, capability, fast):
    assert fast_grouped_mm(device, dtype, capability) is fast


def test_grouped_matmul_reads_only_the_window_of_used_slots(monkeypatch):
    """A step over slots 5..7 of a 12-slot pool hands torch a 3-group weight, and the result
    equals the loop over slots (the pool never appears whole in one grouped call)."""
    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    S, (E, I2, H) = 12, experts.gate_up_proj.shape
    g = torch.Generator().manual_seed(0)
    pool = {"gate_up_proj": torch.randn(S, I2, H, generator=g),
            "down_proj": torch.randn(S, H, I2 // 2, generator=g)}
    slot_idx = torch.tensor([[5, 7], [7, S], [6, 5]])    # S: a pair computed elsewhere
    weights = torch.rand(3, 2, generator=g)
    hidden = torch.randn(3, H, generator=g)
    seen = []
    real = compute.GROUPED_MM

    def spy(x, w, offs):
        seen.append((tuple(w.shape), offs.tolist()))
        return real(x, w, offs=offs)

    monkeypatch.setattr(compute, "GROUPED_MM", spy)
    grouped = grouped_over_slots(experts, hidden, slot_idx, weights, pool, [(5, 2), (6, 1), (7, 2)], True)
    looped = grouped_over_slots(experts, hidden, slot_idx, weights, pool, [(5, 2), (6, 1), (7, 2)], False)
    assert [shape[0] for shape, _ in seen] == [3, 3]     # gate_up and down: slots 5, 6, 7 only
    assert seen[0][1] == [2, 3, 5]                       # offsets of the window's groups
    assert torch.allclose(grouped, looped, atol=1e-5)
    # a window never spans more weight elements than one grouped call may index: here at most
    # two slots' worth, so slots 5..7 take two calls per matmul, slots 5-6 and then 7
    seen.clear()
    monkeypatch.setattr(compute, "GROUPED_MAX_ELEMENTS", 2 * I2 * H)
    split = grouped_over_slots(experts, hidden, slot_idx, weights, pool, [(5, 2), (6, 1), (7, 2)], True)
    assert [(shape[0], offs) for shape, offs in seen] == [(2, [2, 3]), (1, [2])] * 2
    assert torch.allclose(split, looped, atol=1e-5)


def test_passes_compute_hits_before_the_misses_copies_on_cuda():
    hits, loads = {1: 0, 2: 1}, {3: 2}
    rounds = plan_rounds(hits, loads, [], range(4, 6), None, overlap=True)
    assert [r[0] for r in rounds] == [{1: 0, 2: 1}, {3: 2}]   # hits alone first
    # on the CPU copies are synchronous: one pass, one matmul
    assert [r[0] for r in plan_rounds(hits, loads, [], range(4, 6), None, overlap=False)] == [{1: 0, 2: 1, 3: 2}]
    # staged experts join the pass that waits for copies, never the hits' pass
    rounds = plan_rounds(hits, {}, [7], range(4, 6), None, overlap=True)
    assert rounds == [({1: 0, 2: 1}, []), ({7: 4}, [(7, 4)])]
    rounds = plan_rounds(hits, loads, [7], range(4, 6), None, overlap=True)
    assert rounds[-1] == ({3: 2, 7: 4}, [(7, 4)])


def test_staged_rounds_alternate_two_staging_banks_on_cuda():
    """Round r+1's copies go to the bank round r does not read, so they overlap its compute."""
    staged = [10, 11, 12, 13, 14, 15, 16]
    rounds = plan_rounds({}, {}, staged, range(8, 12), None, overlap=True)
    banks = [sorted(slot for _, slot in copies) for _, copies in rounds]
    assert banks == [[8, 9], [10, 11], [8, 9], [10]]
    assert [e for _, copies in rounds for e, _ in copies] == staged      # every bypass, once
    for (_, a), (_, b) in zip(rounds, rounds[1:]):
        assert not {s for _, s in a} & {s for _, s in b}                # consecutive: disjoint
    # one round's worth fits the staging slots whole: no banks needed
    assert len(plan_rounds({}, {}, staged[:4], range(8, 12), None, overlap=True)) == 1
    # the CPU keeps whole-width rounds
    rounds = plan_rounds({}, {}, staged, range(8, 12), None, overlap=False)
    assert [len(c) for _, c in rounds] == [4, 3]
    # a scratch cap (quantized slots) bounds every pass
    rounds = plan_rounds({1: 0, 2: 1, 3: 2}, {}, staged, range(8, 12), 2, overlap=True)
    assert max(len(m) for m, _ in rounds) == 2


def test_activations_cross_to_the_host_only_for_steps_computed_there(monkeypatch):
    """With miss='cpu', a step whose experts are all resident computes nothing on the host, so
    its hidden states stay on the device; a step with misses copies them there once."""
    from expertcache.runtime import experts as experts_mod

    reference = tiny_model("qwen3_moe")
    layers, experts = reference.config.num_hidden_layers, reference.config.num_experts
    ids = torch.randint(2, reference.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    calls = []
    real = experts_mod._acts_to_host
    monkeypatch.setattr(experts_mod, "_acts_to_host", lambda *a: calls.append(1) or real(*a))
    model = offload(copy.deepcopy(reference), slots=layers * experts, miss="cpu")
    with torch.no_grad():
        want = reference(ids).logits
        first = model(ids).logits    # cold: every layer's step misses, computed on the host
        assert len(calls) == layers
        calls.clear()
        model.expertcache.reset_stats()
        second = model(ids).logits   # warm: every expert resident
    assert model.expertcache.stats().total().misses == 0
    assert calls == []
    assert torch.allclose(first, want, atol=1e-5) and torch.allclose(second, want, atol=1e-5)


class FakeCudart:
    """torch.cuda.cudart() as a recorder: registration succeeds unless told otherwise."""

    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr, nbytes, flags))
        return 712 if self.fail else 0   # 712: cudaErrorHostMemoryAlreadyRegistered

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0


def test_pinned_host_copies_are_registered_to_the_byte_in_one_copy(monkeypatch):
    """Large experts are locked in their own page-aligned mapping of exactly their size (no
    power-of-two rounding by torch's pinned allocator), unlocked when freed."""
    import gc

    from expertcache.runtime.host import resident

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    data = torch.randn(3, 805, 301, dtype=torch.bfloat16)   # 1.45 MB: not a power of two
    out = resident(data, "pinned")
    assert torch.equal(out, data) and out.data_ptr() != data.data_ptr()
    assert out.data_ptr() % 4096 == 0
    assert fake.calls == [("register", out.data_ptr(), data.numel() * 2, 3)]  # portable | mapped
    ptr = out.data_ptr()
    del out
    gc.collect()
    assert fake.calls[-1] == ("unregister", ptr)


def test_a_failed_registration_falls_back_to_torchs_pinned_copy(monkeypatch):
    from expertcache.runtime.host import resident

    fake = FakeCudart(fail=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # no CUDA here
    data = torch.randn(1 << 18)
    out = resident(data, "pinned")
    assert torch.equal(out, data)
    assert [c[0] for c in fake.calls] == ["register", "clear"]  # the error is cleared, not left


def test_auto_weighs_misses_with_this_machines_rates_unless_given_a_profile():
    reference = tiny_model("qwen3_moe")
    summary = offload(copy.deepcopy(reference), slots=4, miss="auto").expertcache.summary()
    assert summary["hardware"] == "measured at load" and "cpu_gflops" in summary["hardware_source"]
    given = offload(copy.deepcopy(reference), slots=4, miss="auto", hardware="h200").expertcache
    assert given.summary()["hardware"] == "h200"


def test_no_grouped_matmul_takes_more_groups_than_the_limit(monkeypatch):
    """Issue 29, defect 1: torch's CUDA grouped matmul refuses more than 1024 groups. With the
    limit forced to 2, the host path's windows and the device step's kernel both split the pool,
    every call stays within it, and the outputs equal the loop over slots."""
    from expertcache.runtime.devicepath import slots_kernel

    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    S, (E, I2, H) = 7, experts.gate_up_proj.shape
    g = torch.Generator().manual_seed(1)
    pool = {"gate_up_proj": torch.randn(S, I2, H, generator=g),
            "down_proj": torch.randn(S, H, I2 // 2, generator=g)}
    rows = torch.tensor([[5, 0], [6, 2], [0, 3], [6, 5]])
    weights, hidden = torch.rand(4, 2, generator=g), torch.randn(4, H, generator=g)
    groups = sorted((s, rows.reshape(-1).tolist().count(s)) for s in set(rows.reshape(-1).tolist()))
    want = grouped_over_slots(experts, hidden, rows, weights, pool, groups, False)
    seen, real = [], compute.GROUPED_MM
    monkeypatch.setattr(compute, "GROUPED_MM", lambda x, w, offs: seen.append(w.shape[0]) or real(x, w, offs=offs))
    monkeypatch.setattr(compute, "GROUPED_MAX_GROUPS", 2)
    host = grouped_over_slots(experts, hidden, rows, weights, pool, groups, True)
    assert seen and max(seen) <= 2
    assert torch.allclose(host, want, atol=1e-5)
    seen.clear()
    device = slots_kernel(experts, pool, False)(hidden, weights, rows)
    assert seen == [2, 2, 2, 1] * 2          # the 7 pool rows in windows of 2, per projection
    assert torch.allclose(device, want, atol=1e-5)


def test_slot_counts_equal_histc_without_histc():
    """Issue 29, defect 3: pairs per slot by a scatter-add (histc on CUDA ints syncs)."""
    ids = torch.tensor([0, 0, 2, 5, 5, 5, 7])
    counts = compute.slot_counts(ids, 9)
    assert counts.dtype == torch.int32
    assert counts.tolist() == torch.histc(ids.float(), bins=9, min=0, max=8).int().tolist()
