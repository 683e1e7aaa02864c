"""The vLLM plug-in's device layer step without vLLM: for any slot map (hits, misses, padding
tokens), the kernel sees every needed expert in a slot or a staging row and the output equals
the experts computed straight from the host store; eager (copies only the misses) and the
fixed grid that traced steps take and the sentinel-skipping copy of CUDA give the same output."""

from __future__ import annotations

import random

import pytest
import torch

from expertcache.vllm.device import layer_step, staging_rows

E, H, I, K, S = 12, 8, 6, 3, 5   # experts, hidden, intermediate, top-k, slots


def experts_out(x, w, rows, w13, w2):
    """A SiLU-gated expert MLP over pool rows: x [T, H], w [T, K], rows [T, K] -> [T, H]."""
    h = torch.einsum("tkoh,th->tko", w13[rows.long()], x)                   # [T, K, 2I]
    g = torch.nn.functional.silu(h[..., :I]) * h[..., I:]                   # [T, K, I]
    return torch.einsum("tk,tkh->th", w, torch.einsum("tkhi,tki->tkh", w2[rows.long()], g))


def skip_sentinels(src, rows, out):
    """The CUDA copy's contract (devicestep's Triton gather): rows naming an expert are copied,
    sentinel rows (E) are left as they are."""
    for i, r in enumerate(rows.tolist()):
        if r < src.shape[0]:
            out[i] = src[r]


@pytest.mark.parametrize("path", ["eager-cpu", "traced-grid", "cuda-skip"])
def test_layer_step_equals_the_experts_from_the_host(path, monkeypatch):
    from expertcache.vllm import device

    if path == "traced-grid":  # the branch traced steps take: all W rows copied
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if path == "cuda-skip":
        monkeypatch.setattr(device, "gather_rows", skip_sentinels)
    rng = random.Random(0)
    torch.manual_seed(0)
    hosts = (torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    T_max = 6
    R = staging_rows(E, K, T_max)
    assert R == E  # 6 tokens x 3 can name every expert
    pool = (torch.full((S + R, 2 * I, H), float("nan")), torch.full((S + R, H, I), float("nan")))
    record = torch.zeros(T_max, K, dtype=torch.int32)
    for _ in range(40):
        resident = rng.sample(range(E), rng.randrange(0, S + 1))
        slot_row = torch.full((E,), -1, dtype=torch.int32)
        for slot, e in zip(rng.sample(range(S), len(resident)), resident):
            slot_row[e] = slot
            for host, rows in zip(hosts, pool):
                rows[slot] = host[e]
        T = rng.randrange(1, T_max + 1)
        ids = torch.tensor([rng.sample(range(E), K) for _ in range(T)], dtype=torch.int32)
        x, w = torch.randn(T, H), torch.rand(T, K)
        seen = []

        def kernel(x, w, rows):
            seen.append(rows)
            return experts_out(x, w, rows, *pool)

        out = layer_step(x, w, ids, slot_row, hosts, pool, record, S, torch.arange(E), kernel)
        torch.testing.assert_close(out, experts_out(x, w, ids, *hosts), rtol=0, atol=0)
        rows = seen[0]
        assert rows.dtype == ids.dtype and 0 <= rows.min() and rows.max() < S + R
        hit = slot_row[ids.long()] >= 0
        assert torch.equal(rows[hit], slot_row[ids.long()][hit])                 # hits read their slot
        missed = sorted(set(ids[~hit].tolist()))
        assert sorted(set(rows[~hit].tolist())) == list(range(S, S + len(missed)))  # staged from row S on
        assert torch.equal(record[:T], ids)
