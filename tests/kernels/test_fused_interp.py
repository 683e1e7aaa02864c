"""The fused MoE kernel (runtime/fused.py) run by Triton's interpreter on the CPU, in the vLLM venv
(`make test-kernels`; elsewhere Triton is absent and these skip). Each group of cases runs in one
subprocess with TRITON_INTERPRET=1 (tests/kernels/fused_cases.py), so the interpreter never reaches
other tests' kernels. Shapes are small: the interpreter runs each program in numpy.

A fourth subprocess compiles both programs for sm90 (H100/H200) with Triton's real compiler, to
PTX and cubin, for every format: the interpreter accepts code the compiler refuses.

Tolerances (relative to the largest output value):
- float32 compute, every quantized format against gguf-py's dequantization and a float64 matmul:
  2e-5. The kernel decodes with the same float32 products as gguf-py, so what differs is the order
  of the matmul's float32 sums over 256 inputs (measured ~3e-7; worst case ~256 * 2^-24 = 1.5e-5).
- float32 slots (plain and [in, out]): the same 2e-5, against float64.
- float16 slots against the torch path, which rounds where the kernel does (each projection,
  SiLU(gate), the product, the down output): 2e-3, a few float16 ulps (2^-11) of drift (measured 1.6e-4).
- bfloat16 (slots, or Q4_K decoded into bfloat16) against the torch path: 3e-2. The interpreter
  converts float32 to bfloat16 by truncation, not round-to-nearest as torch and CUDA do (pinned
  below), so each of the five roundings is biased by up to one 2^-8 ulp, and the bias adds up over the
  down matmul's inputs (measured 1.6e-2 to 1.9e-2). On CUDA the GPU tests hold bfloat16 to the torch
  path much tighter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES = Path(__file__).with_name("fused_cases.py")
SRC = Path(__file__).resolve().parents[2] / "src"
FLOAT32, FLOAT16, BFLOAT16 = 2e-5, 2e-3, 3e-2


@cache
def started() -> dict[str, subprocess.Popen]:
    """The three groups, started together on first use (two cores: about 1.5x faster than in turn)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    compiler = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    return {group: subprocess.Popen([sys.executable, str(CASES), group], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=compiler if group == "compile" else env)
            for group in ("models", "gpt_oss", "compile", "formats", "floats")}


@cache
def run(group: str) -> dict:
    out, err = started()[group].communicate(timeout=600)
    assert started()[group].returncode == 0, out[-3000:] + err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["MXFP4", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K+Q6_K down", "Q8_0 fused gate_up"])
def test_quantized_slots_match_gguf_dequantization(case):
    assert run("formats")[case] < FLOAT32


def test_quantized_slots_in_bfloat16_match_the_torch_path():
    assert run("formats")["Q4_K bf16"] < BFLOAT16


@pytest.mark.parametrize("case,tolerance", [("float32", FLOAT32), ("float32 transposed", FLOAT32),
                                            ("float16", FLOAT16), ("bfloat16", BFLOAT16)])
def test_float_slots(case, tolerance):
    assert run("floats")[case] < tolerance


@pytest.mark.parametrize("planner", ["host planner", "device planner"])
def test_offloaded_decode_on_the_kernel_equals_plain(planner):
    assert run("models")[planner] is True


@pytest.mark.parametrize("planner", ["host planner", "device planner"])
def test_gpt_oss_decode_on_the_kernel_equals_plain(planner):
    assert run("gpt_oss")[planner] is True


@pytest.mark.parametrize("source", ["gguf MXFP4", "hf MXFP4"])
def test_gpt_oss_mxfp4_on_the_kernel_equals_dequantized_slots(source):
    assert run("gpt_oss")[source] < FLOAT32


def test_gguf_q4_k_m_on_the_kernel_equals_dequantized_slots():
    assert run("models")["gguf Q4_K_M"] < FLOAT32


@pytest.mark.parametrize("case", [f"{fmt}/{dt}/0" for fmt in range(6) for dt in (["bf16", "fp16", "fp32"] if fmt == 0
                                                                                  else ["bf16"])]
                         + ["0/bf16/1", "5/bf16/1"])
def test_both_programs_compile_for_sm90(case):
    """Triton's compiler (no GPU needed) for Hopper: format (0 float, then fused.QUANT's ids) / dtype /
    activation (0 SiLU, 1 GPT-OSS's clamped GLU with biases)."""
    assert run("compile")[case] is True


def test_the_interpreter_truncates_to_bfloat16():
    """Why the bfloat16 tolerance is loose: if Triton's interpreter starts rounding to nearest, this
    fails and BFLOAT16 can come down."""
    script = """
import torch, triton, triton.language as tl
@triton.jit
def cast(x_ptr, o_ptr):
    r = tl.arange(0, 16)
    tl.store(o_ptr + r, tl.load(x_ptr + r).to(tl.bfloat16))
x = torch.rand(16, generator=torch.Generator().manual_seed(0)) + 1
o = torch.zeros(16, dtype=torch.bfloat16)
cast[(1,)](x, o)
print(torch.equal(o.float(), (x.view(torch.int32) & ~0xFFFF).view(torch.float32)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.stdout.strip().endswith("True"), done.stdout[-2000:] + done.stderr[-2000:]
