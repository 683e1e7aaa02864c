"""A GGUF's dense weights on the CPU through ggml (``runtime/cpudense.py``): the lm_head,
attention and shared-expert linears by ``ggml_mul_mat``, the embedding by ``ggml_get_rows``,
on the file's bytes.

Tolerances as for the experts (docs/cpu.md): logits within 20% relative L2 of the exact
path with the same top-1 token at 90% of positions; llama.cpp's own logits for the same
file and tokens at least as close as the exact path, and within 1e-4 where the dense
weights are Q8_0 (``LLAMA_TOL``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from expertcache.quant import ggml
from expertcache.runtime.cpudense import GgmlEmbedding, GgmlLinear
from gguf_models import write_gguf
from make_llamacpp_reference import DENSE, dense_key

pytestmark = pytest.mark.skipif(not ggml.available()[0], reason=f"ggml kernels: {ggml.available()[1]}")

LOGIT_TOL, TOP1 = 0.20, 0.90
# distance to llama.cpp's logits, per fixture: Q8_0 dense weights run llama.cpp's kernels
# (measured 0); with Q4_0 dense weights llama.cpp 0.3.36 is 1.4% away from ggml (the
# exact path 2.3%), the same with its weight repacking off: cause not found yet
LLAMA_TOL = {"dense_qwen3_moe_Q4_K_Q8_0": 1e-4, "dense_qwen2_moe_Q8_0_Q4_0": 0.02}
REFERENCE = Path(__file__).parent / "data" / "llamacpp_logits.npz"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family,experts,dense", DENSE)
def test_dense_ggml_matches_llamacpp_and_the_exact_path(tmp_path, family, experts, dense):
    ref, key = np.load(REFERENCE), dense_key(family, experts, dense)
    path = write_gguf(tmp_path / "m.gguf", family, experts, dense_type=dense)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(ref[f"{key}_sha256"]), (
        f"the {key} fixture changed; rerun tests/make_llamacpp_reference.py")
    llama, ids = torch.from_numpy(ref[f"{key}_logits"]), torch.from_numpy(ref["tokens"]).unsqueeze(0)
    logits, models = {}, {}
    for kernel in ("torch", "ggml"):
        # the per-layer path's linears (the one-graph forward: test_ggml_graph.py)
        models[kernel] = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel=kernel,
                                             cpu_graph="off")
        with torch.no_grad():
            logits[kernel] = models[kernel](ids).logits[0]                            # [T, vocab]
    fast, exact = logits["ggml"], logits["torch"]
    assert _rel(fast, llama) < LLAMA_TOL[key] and _rel(fast, llama) <= _rel(exact, llama)
    assert _rel(fast, exact) < LOGIT_TOL
    assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= TOP1
    # memory: the quantized linears and the embedding hold no float copy, only the file's bytes
    model = models["ggml"]
    assert isinstance(model.lm_head, GgmlLinear) and isinstance(model.model.embed_tokens, GgmlEmbedding)
    big = [n for n, p in model.named_parameters() if p.ndim == 2 and not n.endswith("gate.weight")]
    assert not big, big  # only the F32 routers (and the shared expert's gate) stay 2-D float tensors
    assert _param_bytes(model) < 0.05 * _param_bytes(models["torch"])
    pool = model.expertcache.stats().pool
    assert pool["dense_kernel"] == "ggml" and "no float copy" in pool["dense_kernel_reason"]
    assert models["torch"].expertcache.stats().pool["dense_kernel"] == "torch"


def test_decode_steps_match_the_full_forward(tmp_path):
    """Graphs are cached per token count: one-token steps against a 6-token forward."""
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0", dense_type="Q8_0")
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml")
    ids = torch.tensor([[5, 9, 200, 31, 77, 140]])
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        out = model(ids[:, :3], use_cache=True)
        for t in range(3, 6):
            out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
    assert _rel(out.logits[0, -1], full) < 1e-5


def test_a_dense_type_without_a_kernel_falls_back_by_name(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "qwen2_moe", "Q8_0", dense_type="Q4_0")
    q4_0 = 2  # ggml's type number for Q4_0: pretend this library has no kernel for it
    has_kernel = ggml.has_kernel
    monkeypatch.setattr(ggml, "has_kernel", lambda t: t != q4_0 and has_kernel(t))
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml")
    pool = model.expertcache.stats().pool
    assert pool["cpu_kernel"] == "ggml"  # the Q8_0 experts still run on ggml
    assert "no ggml CPU kernel for Q4_0" in pool["dense_kernel_reason"], pool["dense_kernel_reason"]
    assert not any(isinstance(m, (GgmlLinear, GgmlEmbedding)) for m in model.modules())
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32


def test_tied_embeddings_compute_the_lm_head_on_the_embedding_bytes(tmp_path, monkeypatch):
    import gguf

    add = gguf.GGUFWriter.add_tensor
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor",  # a file without output.weight: tied
                        lambda self, name, *a, **k: None if name == "output.weight" else add(self, name, *a, **k))
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0", dense_type="Q8_0")
    ids, logits = torch.tensor([[5, 9, 200, 31]]), {}
    for kernel in ("torch", "ggml"):
        model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel=kernel)
        with torch.no_grad():
            logits[kernel] = model(ids).logits[0]
    assert model.config.tie_word_embeddings and isinstance(model.lm_head, GgmlLinear)
    assert model.lm_head.data is model.model.embed_tokens.data
    assert _rel(logits["ggml"], logits["torch"]) < LOGIT_TOL


def test_a_linear_reads_any_input_layout_and_refuses_a_wrong_width():
    # float32 contiguous inputs are read in place (the decode path); others are copied first
    from expertcache.quant.formats import quant_format
    from quant_fixtures import random_blocks

    fmt = quant_format("Q8_0")
    data = torch.from_numpy(random_blocks("Q8_0", 48, 64, np.random.default_rng(0)).reshape(-1).copy())
    linear = GgmlLinear(data, fmt.ggml_type, 48, 64, bias=False)
    x = torch.randn(2, 3, 64)
    ref = linear(x)                                                               # [2, 3, 48]
    assert ref.shape == (2, 3, 48) and ref.dtype == torch.float32
    strided = torch.randn(64, 3, 2).permute(2, 1, 0)                              # [2, 3, 64], not contiguous
    strided.copy_(x)
    assert torch.equal(linear(strided), ref)
    half = linear(x.bfloat16())
    assert half.dtype == torch.bfloat16 and _rel(half.float(), ref) < 0.02
    with pytest.raises(ValueError, match="input of 32 features for a linear of 64"):
        linear(torch.randn(1, 32))
