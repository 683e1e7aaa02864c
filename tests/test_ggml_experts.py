"""ggml's quantized CPU kernels (``cpu_kernel='ggml'``) against the exact torch path.

ggml quantizes the activations to its dot-product type (Q8_0 / Q8_K) before the dot
products, so results differ from dequantize-then-matmul. The documented tolerance
(docs/cpu.md): one matmul within 1.5% relative (L2) of the exact product (measured
0.5-0.8%); a tiny model's logits within 20% relative L2 (measured 1-14%: the fixtures'
random K-quant blocks have weights of std 20-80, which amplifies every difference) with
the same top-1 token for at least 90% of positions (measured 94-100%). Every way a CPU
run computes experts (the cpu miss path, baseline cpu, CPU slots, a resident run on the
host bytes) runs the same kernel on the same bytes, so they agree with each other to
float rounding: a wrong slot or expert index could not hide there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from expertcache.config import CacheConfig
from expertcache.quant import ggml
from expertcache.quant.dequant import dequantize
from expertcache.quant.formats import quant_format
from gguf_models import write_gguf
from quant_fixtures import random_blocks

pytestmark = pytest.mark.skipif(not ggml.available()[0], reason=f"ggml kernels: {ggml.available()[1]}")

TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4"]
MATMUL_TOL, LOGIT_TOL, TOP1 = 0.015, 0.20, 0.90
# every CPU way of computing experts: (label, offload settings)
GRAPH = "resident, one graph"
# the per-layer path's ways (cpu_graph='off': resident and baseline cpu would run the one-graph
# forward, tests/test_ggml_graph.py), then the graph, held to the tolerance against exact only
CPU_RUNS = [("resident", dict(baseline="resident", cpu_graph="off")),
            ("baseline cpu", dict(baseline="cpu", cpu_graph="off")),
            ("cpu slots, fetch", dict(slots=5)), ("cpu slots, miss cpu", dict(slots=5, miss="cpu")),
            ("cpu slots, miss auto", dict(slots=5, miss="auto")), (GRAPH, dict(baseline="resident"))]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", TYPES)
def test_one_matmul_is_within_the_tolerance_of_the_exact_product(name):
    fmt, rng = quant_format(name), np.random.default_rng(1)
    E, rows, cols, N = 3, 64, 512, 6
    q = torch.from_numpy(random_blocks(name, E * rows, cols, rng).reshape(E, -1).copy())   # [E, bytes]
    exact = dequantize(q, fmt, (E, rows, cols), torch.float32)                             # [E, rows, cols]
    x, ids, out = torch.randn(N, cols), torch.tensor([2, 0, 1, 1, 2, 0], dtype=torch.int32), torch.empty(N, rows)
    ggml.MatmulId([ggml.Weight(fmt.ggml_type, rows, cols, E, q.shape[1])], N, 1)(
        [q.data_ptr()], x.data_ptr(), ids.data_ptr(), [out.data_ptr()])
    ref = torch.stack([exact[e] @ x[p] for p, e in enumerate(ids.tolist())])              # [N, rows]
    assert _rel(out, ref) < MATMUL_TOL


@pytest.mark.parametrize("per_expert", [False, True])
def test_k_experts_per_token_read_the_token_row_or_their_own_row(per_expert):
    """The resident path's graphs: ids [T, K]; x [T, H] read by all K experts of a token, or
    [T, K, H] one row per pair (the down matmul)."""
    fmt, rng = quant_format("Q4_K"), np.random.default_rng(3)
    E, rows, cols, T, K = 4, 32, 256, 3, 2
    q = torch.from_numpy(random_blocks("Q4_K", E * rows, cols, rng).reshape(E, -1).copy())  # [E, bytes]
    exact = dequantize(q, fmt, (E, rows, cols), torch.float32)                             # [E, rows, cols]
    ids = torch.tensor([[3, 0], [1, 3], [2, 2]], dtype=torch.int32)                        # [T, K]
    x = torch.randn(T, K, cols) if per_expert else torch.randn(T, cols)
    out = torch.empty(T, K, rows)
    ggml.MatmulId([ggml.Weight(fmt.ggml_type, rows, cols, E, q.shape[1])], T, 1, K, per_expert)(
        [q.data_ptr()], x.data_ptr(), ids.data_ptr(), [out.data_ptr()])
    ref = torch.stack([torch.stack([exact[e] @ (x[t, k] if per_expert else x[t]) for k, e in enumerate(row)])
                       for t, row in enumerate(ids.tolist())])                              # [T, K, rows]
    assert _rel(out, ref) < MATMUL_TOL


def test_a_slot_wider_than_the_expert_is_read_at_its_stride():
    """Slots fit the largest layer's expert (Q4_K_M mixes Q6_K in): the stride is the slot's."""
    fmt, rng = quant_format("Q4_0"), np.random.default_rng(2)
    E, rows, cols = 3, 32, 256
    q = torch.from_numpy(random_blocks("Q4_0", E * rows, cols, rng).reshape(E, -1).copy())
    wide = torch.zeros(E, q.shape[1] + 96, dtype=torch.uint8)
    wide[:, :q.shape[1]] = q
    x, ids = torch.randn(2, cols), torch.tensor([2, 1], dtype=torch.int32)
    outs = [torch.empty(2, rows) for _ in range(2)]
    for data, out in zip((q, wide), outs):
        ggml.MatmulId([ggml.Weight(fmt.ggml_type, rows, cols, E, data.shape[1])], 2, 1)(
            [data.data_ptr()], x.data_ptr(), ids.data_ptr(), [out.data_ptr()])
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml.MatmulId([ggml.Weight(fmt.ggml_type, rows, 100, E, 4096)], 2, 1)


@pytest.mark.parametrize("family,name", [("qwen3_moe", t) for t in TYPES] + [("gpt_oss", "MXFP4")])
def test_every_cpu_path_runs_ggml_within_the_tolerance(tmp_path, family, name):
    path = write_gguf(tmp_path / "m.gguf", family, name)
    ids = torch.randint(0, 260, (1, 24), generator=torch.Generator().manual_seed(3))

    def logits(**settings):
        model = expertcache.offload(path, device="cpu", **settings)
        with torch.no_grad():
            return model(ids).logits[0], model.expertcache                               # [T, vocab]

    exact, cache = logits(baseline="resident", cpu_kernel="torch")
    assert cache.cpu_kernel == "torch" and cache.slot_format == "dequantized"
    first = None
    for label, settings in CPU_RUNS:
        fast, cache = logits(cpu_kernel="ggml", **settings)
        pool = cache.stats().pool
        assert (pool["cpu_kernel"], cache.slot_format) == ("ggml", "quantized"), label
        assert "libggml-python" in pool["cpu_kernel_reason"]
        assert _rel(fast, exact) < LOGIT_TOL, label
        assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= TOP1, label
        if label == GRAPH:  # another summation order (and repacked weights): the tolerance above
            continue
        if first is None:
            first = fast
            assert pool["host_resident"] and cache.pool.slots == 0 and cache.slot_bytes == 0
        else:  # same kernel, same bytes: only the summation order differs
            assert _rel(fast, first) < 1e-5, label


def test_steps_wholly_on_the_host_take_the_routed_pass(tmp_path, monkeypatch):
    # resident and baseline cpu compute every pair from the host's bytes: one routed pass per
    # step, never the per-pair gather; CPU slots mix slot hits with host misses (per pair).
    from expertcache.runtime import cpukernel, experts

    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    ids = torch.randint(0, 260, (1, 12), generator=torch.Generator().manual_seed(4))
    calls = {"routed": 0, "pairs": 0}
    routed, pairs = cpukernel.GgmlExperts.routed, experts.ggml_experts

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(cpukernel.GgmlExperts, "routed", count("routed", routed))
    monkeypatch.setattr(experts, "ggml_experts", count("pairs", pairs))
    for settings, per_pair in [(dict(baseline="resident", cpu_graph="off"), False),
                               (dict(baseline="cpu", cpu_graph="off"), False), (dict(slots=5, miss="cpu"), True)]:
        model = expertcache.offload(path, device="cpu", cpu_kernel="ggml", **settings)
        calls.update(routed=0, pairs=0)
        with torch.no_grad():
            model(ids)
            model(ids[:, :1])  # a decode-sized step too
        assert calls["routed"] > 0 and (calls["pairs"] > 0) == per_pair, (settings, calls)


@pytest.mark.parametrize("family,fused", [("qwen3_moe", True), ("qwen2_moe", True), ("gpt_oss", False)])
def test_a_silu_gated_layer_runs_its_whole_mlp_in_one_graph(tmp_path, family, fused):
    # SiluMlpId (gate, up, silu * up, down in one ggml graph) must equal the two graphs with
    # the module's own activation between them; GPT-OSS's clamped gate keeps the latter. The
    # choice leans on transformers' _default_apply_gate and SiLUActivation: pinned here.
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    path = write_gguf(tmp_path / "m.gguf", family, "MXFP4" if family == "gpt_oss" else "Q4_K")
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml")
    cache, module = model.expertcache, next(m for _, m in model.named_modules() if hasattr(m, "_expertcache"))
    kernel, host = cache.kernels[0], cache.hosts[0]
    assert kernel._silu_gate(module) is fused
    if fused:
        assert type(module)._apply_gate is _default_apply_gate and isinstance(module.act_fn, SiLUActivation)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, kernel.part[kernel.down.parts[0]].shape[0], generator=gen)   # [3, H]
    ids = torch.stack([torch.randperm(cache.num_experts, generator=gen)[:cache.top_k] for _ in range(3)])
    weights = torch.rand(3, cache.top_k, generator=gen)
    one = kernel.routed(module, hidden, ids, weights, host.tensors)                      # [3, H]
    kernel._fusable = False
    two = kernel.routed(module, hidden, ids, weights, host.tensors)
    assert _rel(one, two) < 1e-6


def test_auto_is_ggml_and_torch_stays_exact(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    ids = torch.tensor([[5, 9, 200, 31]])
    auto = expertcache.offload(path, device="cpu", baseline="cpu")
    exact = expertcache.offload(path, device="cpu", baseline="cpu", cpu_kernel="torch")
    plain = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="torch", slot_format="dequantized")
    assert auto.expertcache.cpu_kernel == "ggml" and exact.expertcache.cpu_kernel == "torch"
    assert auto.expertcache.summary()["cpu_kernel"] == "ggml"
    with torch.no_grad():
        assert torch.equal(exact(ids).logits, plain(ids).logits)  # the torch path is today's, bit for bit
        assert not torch.equal(auto(ids).logits, plain(ids).logits)


def test_a_type_without_a_kernel_falls_back_with_its_name(tmp_path):
    from test_hf_quant import write_fp8

    path, _ = write_fp8(tmp_path / "fp8")
    for choice in ("auto", "ggml"):
        cache = expertcache.offload(path, device="cpu", baseline="cpu", cpu_kernel=choice).expertcache
        pool = cache.stats().pool
        assert pool["cpu_kernel"] == "torch" and "F8_E4M3" in pool["cpu_kernel_reason"], pool
        assert cache.slot_format == "dequantized"


def test_bad_settings_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="unknown cpu_kernel 'fast'; use one of auto, ggml, torch"):
        CacheConfig(baseline="cpu", cpu_kernel="fast")
    monkeypatch.setattr(ggml, "available", lambda: (False, "libggml-python is not installed "
                                                           f"({ggml.INSTALL_HINT})"))
    with pytest.raises(ValueError, match=r"pip install 'expertcache\[ggml\]'"):
        ggml.choose("ggml", [quant_format("Q4_K")])
    kernel, why = ggml.choose("auto", [quant_format("Q4_K")])
    assert kernel == "torch" and "not installed" in why


REFERENCE = Path(__file__).parent / "data" / "llamacpp_logits.npz"


@pytest.mark.parametrize("name", TYPES)
def test_ggml_is_at_least_as_close_to_llamacpp_as_the_exact_path(tmp_path, name):
    """llama.cpp's own logits for the same file and tokens (tests/make_llamacpp_reference.py made
    them). Measured: ggml 1e-6 relative (the same kernels), the exact path 0.5-6%."""
    ref = np.load(REFERENCE)
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", name)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == str(ref[f"{name}_sha256"]), (
        f"the {name} fixture changed (sha256 {digest}); rerun tests/make_llamacpp_reference.py "
        "with llama.cpp to refresh tests/data/llamacpp_logits.npz")
    llama, ids = torch.from_numpy(ref[f"{name}_logits"]), torch.from_numpy(ref["tokens"]).unsqueeze(0)
    dist = {}
    for kernel in ("torch", "ggml"):
        model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel=kernel, cpu_graph="off")
        with torch.no_grad():
            dist[kernel] = _rel(model(ids).logits[0], llama)
    assert dist["ggml"] <= dist["torch"], dist
    assert dist["ggml"] < 1e-4, dist  # llama.cpp's own kernels: float rounding apart


def test_a_folder_without_ggml_named_by_the_env_var_says_so(tmp_path, monkeypatch):
    """``$EXPERTCACHE_GGML_LIB`` picks the libraries; a folder without them is reported, not used."""
    monkeypatch.setenv(ggml.LIB_ENV, str(tmp_path))
    ggml._load.cache_clear()
    try:
        ok, why = ggml.available()
        assert not ok and str(tmp_path) in why and ggml.LIB_ENV in why
    finally:
        monkeypatch.delenv(ggml.LIB_ENV)
        ggml._load.cache_clear()
        assert ggml.available()[0]
