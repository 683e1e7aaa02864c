"""Write tests/data/llamacpp_logits.npz: llama.cpp's own logits for the tiny GGUFs the tests build.

For each expert type (Q4_K, Q6_K, Q8_0, Q4_0, MXFP4) the test fixture ``write_gguf(path,
'qwen3_moe', TYPE)`` is built, and the ``DENSE`` fixtures whose dense weights are quantized too, (deterministic: seeded weights and blocks), its sha256 stored
beside the logits, so that a changed fixture fails the test with a clear message instead of
comparing against another file's logits. llama.cpp runs through llama-cpp-python 0.3.36
(``Llama(..., logits_all=True)``, one thread, F32 KV cache, no flash attention: nothing but
the expert matmuls differs from a float run).

llama-cpp-python is not a dependency: this script is run by hand after a fixture changes,
with the sdist's package on the path and its vendored llama.cpp built as a shared library:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /work/refs
    (unpack; cmake -B build -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON in vendor/llama.cpp;
     cmake --build build --target llama; ln -s ../vendor/llama.cpp/build/bin llama_cpp/lib)
    PYTHONPATH=/work/refs/llama_cpp_python-0.3.36:tests python tests/make_llamacpp_reference.py

(or, without the link, ``LLAMA_CPP_LIB_PATH=.../vendor/llama.cpp/build/bin``; llama-cpp-python
imports ``diskcache``.)
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "llamacpp_logits.npz"
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4")
# fixtures whose dense weights are quantized too (write_gguf's dense_type): (family, experts, dense)
DENSE = (("qwen3_moe", "Q4_K", "Q8_0"), ("qwen2_moe", "Q8_0", "Q4_0"))
# families llama.cpp reads under other archs (Mixtral: ``llama`` with q/k permuted; OLMoE; DeepSeek-V3:
# ``deepseek2``, kv_b_proj split into k_b / v_b, YaRN), F32 dense: the file llama.cpp computes is the
# one the loader un-permutes / rebuilds. ``--families`` adds only these to an existing file (the
# llama.cpp build here segfaulted on the quantized-dense fixtures above).
FAMILIES = (("mixtral", "Q4_K", "F32"), ("olmoe", "Q8_0", "F32"), ("deepseek_v3", "Q8_0", "F32"))
TOKENS = [5, 9, 200, 31, 77, 140, 3, 250, 66, 101, 12, 180, 44, 230, 90, 17]  # ids below the tiny vocab


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dense_key(family: str, experts: str, dense: str) -> str:
    return f"dense_{family}_{experts}_{dense}"


def llamacpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """[T, vocab] float32: llama.cpp's logits at every position."""
    from llama_cpp import GGML_TYPE_F32, Llama

    llm = Llama(str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, flash_attn=False,
                type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], dtype=np.float32)


def main() -> int:
    sys.path.insert(0, str(HERE))
    from gguf_models import write_gguf

    only_families = "--families" in sys.argv[1:]
    out = dict(np.load(OUT)) if only_families else {"tokens": np.array(TOKENS, dtype=np.int64)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in () if only_families else TYPES:
            path = write_gguf(Path(tmp) / f"{name}.gguf", "qwen3_moe", name)
            out[f"{name}_sha256"] = np.array(sha256(path))
            out[f"{name}_logits"] = llamacpp_logits(path, TOKENS)
            print(name, out[f"{name}_sha256"], out[f"{name}_logits"].shape)
        for family, experts, dense in (FAMILIES if only_families else DENSE + FAMILIES):
            key = dense_key(family, experts, dense)
            path = write_gguf(Path(tmp) / f"{key}.gguf", family, experts, dense_type=dense)
            out[f"{key}_sha256"] = np.array(sha256(path))
            out[f"{key}_logits"] = llamacpp_logits(path, TOKENS)
            print(key, out[f"{key}_sha256"], out[f"{key}_logits"].shape)
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(OUT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
