"""The fused MoE kernel (runtime/fused.py) on CUDA: every format against gguf-py's dequantization,
bf16 against the torch path, pools past 1024 rows (issue 29 defect 1) on both kernels, no host sync
and a CUDA graph replay (graph-safe), and decode equal to plain transformers. Run by
benchmarks/gpu_check.sh; about 30 s on an H200 (most of it Triton's compiles)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False); "
                              "run benchmarks/gpu_check.sh on a GPU machine"),
]

from expertcache.runtime import compute, fused  # noqa: E402
from expertcache.runtime.compute import grouped_over_slots  # noqa: E402
from expertcache.runtime.devicepath import slots_kernel  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

CUDA = torch.device("cuda")


def _experts():
    return tiny_model("qwen3_moe").model.layers[0].mlp.experts


def _groups(rows: torch.Tensor, size: int) -> list[tuple[int, int]]:
    flat = [r for r in rows.reshape(-1).tolist() if r < size]
    return sorted((r, flat.count(r)) for r in set(flat))


def _float_pool(S, I, H, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return {"gate_up_proj": (torch.randn(S, 2 * I, H, device=CUDA, generator=g) / 16).to(dtype),
            "down_proj": (torch.randn(S, H, I, device=CUDA, generator=g) / 16).to(dtype)}


def _pairs(T, K, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    rows[0, -1] = S                                             # computed elsewhere
    return rows.to(CUDA), torch.rand(T, K, generator=g).to(CUDA), torch.randn(T, 256, generator=g).to(CUDA)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_float_slots_equal_the_torch_path(dtype, tolerance):
    """Against the loop of matmuls, which rounds where the kernel rounds; what differs is the
    order of float32 sums, and then a rare bf16 rounding the other way (an ulp, 2^-8)."""
    S, I, H = 40, 384, 256
    pool = _float_pool(S, I, H, dtype)
    rows, weights, x = _pairs(6, 8, S)
    got = fused.fused_experts(x.to(dtype), weights, rows, fused.float_layout(pool, False))
    want = grouped_over_slots(_experts(), x.to(dtype), rows, weights, pool, _groups(rows, S), False)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < tolerance


@pytest.mark.parametrize("fmt", sorted(fused.QUANT))
def test_quantized_slots_equal_gguf_dequantization(fmt):
    """Bytes from gguf-py's quantizer or valid random blocks; float32 compute; the reference is
    gguf-py's dequantization and a float64 matmul (2e-5: the order of float32 sums)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    from expertcache.quant.formats import quant_format
    from expertcache.runtime.quantized import Codec, Kind, Part
    from quant_fixtures import random_blocks

    S, I, H, f = 6, 512, 256, quant_format(fmt)
    rng = np.random.default_rng(0)
    shapes = {"g": (I, H), "u": (I, H), "d": (H, I)}
    blocks = {p: np.stack([random_blocks(f, *shp, rng) for _ in range(S)]) for p, shp in shapes.items()}
    codec = Codec(tuple(Part(p, f, shp) for p, shp in shapes.items()),
                  (Kind("gate_up_proj", "concat", ("g", "u")), Kind("down_proj", "one", ("d",))), torch.float32)
    pool = {p: torch.from_numpy(b.reshape(S, -1).copy()).to(CUDA) for p, b in blocks.items()}
    dq = {p: torch.stack([torch.from_numpy(gguf_quants.dequantize(b[s], GGMLQuantizationType(f.ggml_type)))
                          for s in range(S)]).double() for p, b in blocks.items()}
    rows, weights, x = _pairs(5, 4, S)
    got = fused.fused_experts(x, weights, rows, fused.quant_layout(pool, codec)).double().cpu()
    want = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for k in range(4):
            r = int(rows[t, k])
            if r < S:
                xt = x[t].double().cpu()
                h = torch.nn.functional.silu(xt @ dq["g"][r].T) * (xt @ dq["u"][r].T)
                want[t] += float(weights[t, k]) * (h @ dq["d"][r].T)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-5


def test_pools_past_1024_rows_on_both_kernels(monkeypatch):
    """Issue 29 defect 1 on CUDA: 1100 bf16 rows (torch's grouped matmul takes 1024 groups)."""
    S = 1100
    pool = _float_pool(S, 64, 256, torch.bfloat16)
    rows, weights, x = _pairs(4, 8, S)
    rows[1, 0] = S - 1                                          # a row past the first window
    x = x.bfloat16()
    want = grouped_over_slots(_experts(), x, rows, weights, pool, _groups(rows, S), False)
    fused_out = slots_kernel(_experts(), pool, False)(x, weights, rows)
    monkeypatch.setattr(fused, "ENABLED", False)
    grouped_out = slots_kernel(_experts(), pool, False)(x, weights, rows)
    for got in (fused_out, grouped_out):
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 1e-2


def test_no_host_sync_and_a_cuda_graph_replays_it():
    """Graph-safe: no device-to-host sync in a call, and a captured call replayed on new pairs
    equals the eager call."""
    S = 64
    pool = _float_pool(S, 128, 256, torch.bfloat16)
    layout = fused.float_layout(pool, False)
    rows, weights, x = _pairs(2, 8, S)
    x = x.bfloat16()
    fused.fused_experts(x, weights, rows, layout)               # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused.fused_experts(x, weights, rows, layout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, static = torch.cuda.CUDAGraph(), (x.clone(), weights.clone(), rows.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused.fused_experts(*static, layout)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = fused.fused_experts(*static, layout)
    new_rows, new_weights, new_x = _pairs(2, 8, S, seed=7)
    static[0].copy_(new_x.bfloat16())
    static[1].copy_(new_weights)
    static[2].copy_(new_rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused.fused_experts(new_x.bfloat16(), new_weights, new_rows, layout))


@pytest.mark.parametrize("planner", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_on_the_kernel_equals_plain(planner, dtype, family):
    reference = tiny_model(family).to(dtype)
    ids = torch.randint(2, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = copy.deepcopy(reference).to(CUDA).generate(ids.to(CUDA), max_new_tokens=10, do_sample=False)
        model = __import__("expertcache").offload(copy.deepcopy(reference), device="cuda", slots=6, planner=planner)
        got = model.generate(ids.to(CUDA), max_new_tokens=10, do_sample=False)
    pool = model.expertcache.stats().pool
    assert pool["expert_kernel"] == fused.NAME, pool["expert_kernel_reason"]
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("family,types", [("qwen3_moe", ("Q4_K", "Q6_K")), ("gpt_oss", ("MXFP4", None))])
def test_quantized_slots_decode_on_the_kernel_equals_dequantized_slots(tmp_path, family, types):
    """GGUF experts (Q4_K_M's mix; GPT-OSS's MXFP4) in quantized slots on the kernel, no scratch:
    greedy tokens equal dequantized slots on the torch path (float32 compute on both)."""
    pytest.importorskip("gguf")
    import expertcache
    from gguf_models import write_gguf

    path = write_gguf(tmp_path / "m.gguf", family, types[0], down_type=types[1])
    ids = torch.tensor([[3, 4, 5, 6, 7]], device=CUDA)
    with torch.no_grad():
        q = expertcache.offload(path, device="cuda", slots=6, slot_format="quantized", dtype=torch.float32)
        got = q.generate(ids, max_new_tokens=8, do_sample=False)
        assert q.expertcache.stats().pool["expert_kernel"] == fused.NAME, q.expertcache.stats().pool
        fused.ENABLED = False
        try:
            d = expertcache.offload(path, device="cuda", slots=6, slot_format="dequantized", dtype=torch.float32)
            want = d.generate(ids, max_new_tokens=8, do_sample=False)
        finally:
            fused.ENABLED = True
    assert torch.equal(got.cpu(), want.cpu())
