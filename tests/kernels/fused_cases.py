"""Cases for the fused MoE kernel under Triton's interpreter: run as a script (a subprocess with
TRITON_INTERPRET=1, so the interpreter never leaks into other tests), prints one JSON line
{case: relative error (or a bool)}. tests/kernels/test_fused_interp.py states the tolerances."""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: fixtures

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from expertcache.quant.formats import quant_format
from expertcache.runtime import fused, fused_kernels
from expertcache.runtime.compute import grouped_over_slots
from expertcache.runtime.quantized import Codec, Kind, Part
from quant_fixtures import random_blocks

H = I = 256                                     # K-quant rows: multiples of 256
S = 3                                           # pool rows; id 3 = computed elsewhere
ROWS = torch.tensor([[2, 0], [1, 3], [0, 2]])
X = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
W = torch.rand(3, 2, generator=torch.Generator().manual_seed(2))


def reference(gate, up, down, x=X) -> torch.Tensor:
    """float64 experts output from per-row weight lists ([out, in] each)."""
    out = torch.zeros(x.shape[0], down[0].shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ROWS.shape[1]):
            r = int(ROWS[t, k])
            if r < S:
                xt = x[t].double()
                h = torch.nn.functional.silu(xt @ gate[r].double().T) * (xt @ up[r].double().T)
                out[t] += float(W[t, k]) * (h @ down[r].double().T)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def quantized(types: dict[str, str], join: str, dtype: torch.dtype, seed: int) -> float:
    """Slots of random ggml blocks; reference: gguf-py's dequantization and a float64 matmul."""
    rng = np.random.default_rng(seed)
    if join == "one":
        shapes = {"gu": (2 * I, H), "d": (H, I)}
        kinds = (Kind("gate_up_proj", "one", ("gu",)), Kind("down_proj", "one", ("d",)))
    else:
        shapes = {"g": (I, H), "u": (I, H), "d": (H, I)}
        kinds = (Kind("gate_up_proj", "concat", ("g", "u")), Kind("down_proj", "one", ("d",)))
    fmts = {p: quant_format(types.get(p, types["*"])) for p in shapes}
    blocks = {p: np.stack([random_blocks(fmts[p], *shapes[p], rng) for _ in range(S)]) for p in shapes}
    codec = Codec(tuple(Part(p, fmts[p], shapes[p]) for p in shapes), kinds, dtype)
    pool = {p: torch.from_numpy(b.reshape(S, -1).copy()) for p, b in blocks.items()}
    dq = {p: [torch.from_numpy(dequantize(b[s], GGMLQuantizationType(fmts[p].ggml_type))) for s in range(S)]
          for p, b in blocks.items()}
    gate, up = (dq["g"], dq["u"]) if join != "one" else ([w[:I] for w in dq["gu"]], [w[I:] for w in dq["gu"]])
    got = fused.fused_experts(X, W, ROWS, fused.quant_layout(pool, codec))
    if dtype == torch.float32:
        return rel(got, reference(gate, up, dq["d"]))
    # bf16: against the torch path on the same dequantized weights, which rounds where the kernel does
    weights = {"gate_up_proj": torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)]).to(dtype),
               "down_proj": torch.stack(dq["d"]).to(dtype)}
    module = _silu_module()
    want = grouped_over_slots(module, X.to(dtype), ROWS, W, weights, _groups(), False)
    return rel(got, want)


def floats(dtype: torch.dtype, transposed: bool) -> float:
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(S, 2 * I, H, generator=g) / 16).to(dtype)          # [S, out, in]
    down = (torch.randn(S, H, I, generator=g) / 16).to(dtype)
    pool = ({"gate_up_proj": gate_up.transpose(1, 2).contiguous(), "down_proj": down.transpose(1, 2).contiguous()}
            if transposed else {"gate_up_proj": gate_up, "down_proj": down})
    got = fused.fused_experts(X.to(dtype), W, ROWS, fused.float_layout(pool, transposed))
    if dtype == torch.float32:
        return rel(got, reference([w[:I] for w in gate_up], [w[I:] for w in gate_up], list(down)))
    want = grouped_over_slots(_silu_module(), X.to(dtype), ROWS, W, pool, _groups(), False, transposed)
    return rel(got, want)


def _groups() -> list[tuple[int, int]]:
    flat = [r for r in ROWS.reshape(-1).tolist() if r < S]
    return sorted((r, flat.count(r)) for r in set(flat))


def _silu_module() -> torch.nn.Module:
    from tiny_moe import tiny_model
    return tiny_model("qwen3_moe").model.layers[0].mlp.experts


def offloaded(planner: str) -> bool:
    """A tiny Qwen3-MoE offloaded with the kernel serving the slots (the CPU let in, as on CUDA):
    greedy tokens equal plain transformers', and the kernel ran."""
    from expertcache import offload
    from tiny_moe import tiny_model

    ref = tiny_model("qwen3_moe")
    model = offload(copy.deepcopy(ref), slots=6, planner=planner)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=5, do_sample=False)
        got = model.generate(ids, max_new_tokens=5, do_sample=False)
    return (torch.equal(want, got) and CALLS[0] > 0 and model.expertcache.stats().pool["expert_kernel"] == fused.NAME
            and model.expertcache.summary()["planner"] == planner)


def gpt_oss(planner: str) -> bool:
    """GPT-OSS (transposed [in, out] slots, interleaved gate/up rows, biases, its clamped GLU) on the
    kernel: greedy tokens equal plain transformers'."""
    from expertcache import offload
    from tiny_moe import tiny_model

    ref = tiny_model("gpt_oss")
    model = offload(copy.deepcopy(ref), slots=6, planner=planner)
    ids = torch.tensor([[3, 4, 5, 6]])
    before = CALLS[0]
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=4, do_sample=False)
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    return torch.equal(want, got) and CALLS[0] > before and model.expertcache.stats().pool["expert_kernel"] == fused.NAME


def gpt_oss_mxfp4(source: str) -> float:
    """GPT-OSS's MXFP4 experts in quantized slots on the kernel against dequantized slots on the torch
    path: from a GGUF (gate and up parts, F32 bias parts) or an HF checkpoint (repacked, one
    interleaved gate_up part). Relative logits difference, float32 compute."""
    import expertcache

    folder = Path(tempfile.mkdtemp())
    if source == "gguf":
        from gguf_models import write_gguf
        path = write_gguf(folder / "oss.gguf", "gpt_oss", "MXFP4")
    else:
        from test_hf_quant import write_gpt_oss_mxfp4
        path = write_gpt_oss_mxfp4(folder / "oss", hidden=64)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    before = CALLS[0]
    with torch.no_grad():
        q = expertcache.offload(path, slots=6, slot_format="quantized", cpu_kernel="torch")
        got = q(ids).logits
        assert q.expertcache.stats().pool["expert_kernel"] == fused.NAME and CALLS[0] > before
        fused.ENABLED = False
        want = expertcache.offload(path, slots=6, slot_format="dequantized", cpu_kernel="torch")(ids).logits
        fused.ENABLED = True
    return rel(got, want)


def gguf_q4_k_m() -> float:
    """A tiny GGUF in llama.cpp's Q4_K_M mix (Q4_K gate/up, Q6_K down), quantized slots on the kernel,
    against dequantized slots on the torch path: relative logits difference (float32 compute)."""
    import expertcache
    from gguf_models import write_gguf

    path = write_gguf(Path(tempfile.mkdtemp()) / "q4km.gguf", "qwen3_moe", "Q4_K", down_type="Q6_K")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        q = expertcache.offload(path, slots=6, slot_format="quantized", cpu_kernel="torch")
        got = q(ids).logits
        assert q.expertcache.stats().pool["expert_kernel"] == fused.NAME and CALLS[0] > 0
        assert "no scratch" in q.expertcache.stats().pool["expert_kernel_reason"]
        fused.ENABLED = False
        d = expertcache.offload(path, slots=6, slot_format="dequantized", cpu_kernel="torch")
        want = d(ids).logits
        fused.ENABLED = True
    return rel(got, want)


def compiled_for_sm90() -> dict:
    """Both programs compiled for an H100/H200 (sm90) by Triton's own compiler, down to PTX and
    ptxas' cubin, for every format: what the interpreter cannot see (it ran a kernel reading a plain
    int global, which the compiler refuses). Needs no GPU. {format/dtype: True} or the error line."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, types: dict, consts: dict):
        names = fn.arg_names                                     # the kernel's own argument order
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        return triton.compile(ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()}),
                              target=GPUTarget("cuda", 90, 32))

    out = {}
    cases = [(fmt, dt, 0) for fmt in range(6) for dt in (["bf16", "fp16", "fp32"] if fmt == 0 else ["bf16"])]
    for fmt, dt, act in cases + [(0, "bf16", 1), (5, "bf16", 1)]:      # + GPT-OSS: float and MXFP4
        w, a = (f"*{dt}" if fmt == 0 else "*u8"), f"*{dt}"
        block = dict(PREC="ieee" if dt == "fp32" else "tf32", UPCAST=False, BM=16, BN=64, BK=64, HAS_BIAS=act == 1)
        weight = lambda p: {f"{p}_ptr": w, f"{p}_slot": "i64", f"{p}_row": "i64", f"{p}_col": "i64", f"{p}_off": "i64"}
        bias = lambda p: {f"{p}_ptr": "*fp32", f"{p}_slot": "i64", f"{p}_step": "i32", f"{p}_off": "i32"}
        up = dict(x_ptr=a, pair_ptr="*i32", brow_ptr="*i32", act_ptr=a, **weight("g"), **weight("u"), **bias("gb"),
                  **bias("ub"), alpha="fp32", limit="fp32", H="i32", I="i32", top_k="i32", num_pairs="i32")
        down = dict(act_ptr=a, pair_ptr="*i32", brow_ptr="*i32", tw_ptr="*fp32", out_ptr="*fp32", **weight("d"),
                    **bias("db"), H="i32", I="i32", num_pairs="i32")
        try:
            for fn, sig, consts in ((fused_kernels._gate_up, up, dict(FMT_G=fmt, FMT_U=fmt, ACT=act, **block)),
                                    (fused_kernels._down, down, dict(FMT_D=fmt, **block))):
                kernel = build(fn, sig, consts)
                assert "cubin" in kernel.asm
            out[f"{fmt}/{dt}/{act}"] = True
        except Exception as e:  # noqa: BLE001  reported per case
            out[f"{fmt}/{dt}/{act}"] = str(e).strip().splitlines()[-1][:300]
    return out


CALLS = [0]


def main() -> None:
    if sys.argv[1] == "compile":  # the real compiler, not the interpreter
        print(json.dumps(compiled_for_sm90()))
        return
    fused.device_refusal = (lambda device: None if fused.ENABLED else "off")  # the CPU let in, as CUDA
    real = fused_kernels.launch

    def counted(*args, **kwargs):
        CALLS[0] += 1
        return real(*args, **kwargs)

    fused_kernels.launch = counted
    which = sys.argv[1]
    out = {}
    if which == "formats":
        for seed, name in enumerate(sorted(fused.QUANT)):
            out[name] = quantized({"*": name}, "concat", torch.float32, seed)
        out["Q4_K+Q6_K down"] = quantized({"*": "Q4_K", "d": "Q6_K"}, "concat", torch.float32, 7)
        out["Q8_0 fused gate_up"] = quantized({"*": "Q8_0"}, "one", torch.float32, 8)
        out["Q4_K bf16"] = quantized({"*": "Q4_K"}, "concat", torch.bfloat16, 9)
    elif which == "floats":
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            out[str(dtype).split(".")[-1]] = floats(dtype, False)
        out["float32 transposed"] = floats(torch.float32, True)
    elif which == "gpt_oss":
        out["host planner"] = gpt_oss("host")
        out["device planner"] = gpt_oss("device")
        out["gguf MXFP4"] = gpt_oss_mxfp4("gguf")
        out["hf MXFP4"] = gpt_oss_mxfp4("hf")
    elif which == "models":
        out["host planner"] = offloaded("host")
        out["device planner"] = offloaded("device")
        out["gguf Q4_K_M"] = gguf_q4_k_m()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
