"""Rebuild the CPU benchmark's model: a Qwen3-MoE GGUF made by llama.cpp's own tools.

A random but realistically shaped transformers Qwen3-MoE (hidden 1024, 64 experts, top-8,
expert FF 768, 6 layers, Qwen's 151936-token vocabulary: 1.25 B parameters) is saved
locally, converted by llama.cpp's ``convert_hf_to_gguf.py`` to F16 and quantized by
``llama-quantize`` to Q4_K_M. Nothing is downloaded: the llama.cpp sources come from the
llama-cpp-python sdist (``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36``,
unpacked; ``vendor/llama.cpp`` built with cmake: targets llama-bench llama-quantize llama).

The tokenizer is a byte-level BPE of the 256 byte symbols and five merges (padded by the converter to the
vocabulary size); the converter does not know its pre-tokenizer hash, so it is told
'qwen2' (what Qwen3's own files map to). Weights are seeded: same command, same file.

    python benchmarks/make_cpu_model.py --llama-cpp /work/refs/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --out /work/refs/cpu-model

The second shape of issue 32 (many layers, a small vocabulary: the per-layer cost shows):

    python benchmarks/make_cpu_model.py --llama-cpp ... --out /work/refs/cpu-model-12L --layers 12 --vocab 4096

A Mixtral-shaped one (``--family mixtral``: 8 experts, top-2, expert FF 1536, no q/k norms;
llama.cpp writes it as arch ``llama`` with its q and k rows permuted):

    python benchmarks/make_cpu_model.py --llama-cpp ... --out /tmp/mixtral-12L --family mixtral --layers 12 --vocab 4096

A DeepSeek-V3-shaped one (``--family deepseek_v3``: MLA with q_lora 512 / kv_lora 256, 8 heads of
128 + 64 rope dims, 64 experts top-8 in 8 groups (top 4), a shared expert, a dense first layer,
sigmoid routing with its selection bias, DeepSeek-V3's YaRN; llama.cpp writes it as ``deepseek2``
with kv_b_proj split into k_b / v_b):

    python benchmarks/make_cpu_model.py --llama-cpp ... --out /tmp/deepseek-6L --family deepseek_v3 --vocab 4096
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SHAPE = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             vocab_size=151936, moe_intermediate_size=768, intermediate_size=3072, num_experts=64,
             num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
DEEPSEEK = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                vocab_size=151936, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, intermediate_size=3072, moe_intermediate_size=512, n_routed_experts=64,
                num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096})
MIXTRAL = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
               vocab_size=151936, intermediate_size=1536, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)

# Run inside a fresh interpreter: the converter's own gguf-py first, the pre-tokenizer named.
CONVERT = """
import sys
sys.path.insert(0, {llama!r} + "/gguf-py"); sys.path.insert(0, {llama!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import conversion.llama as llama  # Mixtral: the BPE tokenizer.json as is (no sentencepiece model to try)
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", {hf!r}, "--outtype", "f16", "--outfile", {out!r}]
convert_hf_to_gguf.main()
"""


def save_hf(out: Path, seed: int, shape: dict, family: str = "qwen3_moe") -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    torch.manual_seed(seed)
    # a small vocabulary: the tokenizer's own <|endoftext|> (256 bytes + 5 merges) ends text
    eos = 261 if shape["vocab_size"] < SHAPE["vocab_size"] else 151643
    config_class, model_class = {"mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
                                 "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}.get(
        family, (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM))
    config = config_class(**shape, bos_token_id=eos, eos_token_id=eos)
    config.architectures = [model_class.__name__]
    if family == "deepseek_v3":  # DeepSeek-V3's config.json names it; the converter writes the gating from it
        config.scoring_func = "sigmoid"
    model = model_class(config).to(torch.bfloat16).eval()
    if family == "deepseek_v3":
        with torch.no_grad():  # the selection bias starts at zero: make it count
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0, 0.1)
    model.save_pretrained(out)
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]  # llama.cpp wants some
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree, built (build/bin)")
    p.add_argument("--out", required=True, type=Path, help="folder for hf/, model-f16.gguf, model-Q4_K_M.gguf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", type=Path, help="llama-quantize (default: build/bin under --llama-cpp)")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers (default 6)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="vocabulary size (default Qwen's 151936)")
    p.add_argument("--family", choices=("qwen3_moe", "mixtral", "deepseek_v3"), default="qwen3_moe")
    args = p.parse_args()
    llama, out = args.llama_cpp.resolve(), args.out.resolve()
    quantize = args.quantize or llama / "build" / "bin" / "llama-quantize"
    if not (llama / "convert_hf_to_gguf.py").exists() or not quantize.exists():
        sys.exit(f"{llama} needs convert_hf_to_gguf.py and build/bin/llama-quantize (build it with cmake)")
    hf, f16, q4 = out / "hf", out / "model-f16.gguf", out / "model-Q4_K_M.gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").exists():
        shape = {"mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK}.get(args.family, SHAPE)
        save_hf(hf, args.seed, {**shape, "num_hidden_layers": args.layers, "vocab_size": args.vocab}, args.family)
    if not f16.exists():
        code = CONVERT.format(llama=str(llama), hf=str(hf), out=str(f16))
        subprocess.run([sys.executable, "-c", code], check=True)
    subprocess.run([str(quantize), str(f16), str(q4), "Q4_K_M"], check=True)
    print(q4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
