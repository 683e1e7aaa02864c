#!/usr/bin/env bash
# One check for a session that has the GPU machine (under 8 minutes):
#   1. the CUDA tests (pytest -m gpu): pinned memory, copy stream + events, fixed slot
#      addresses, one device->host sync per MoE layer step, exact logits on CUDA; the torch
#      dequantizers bit for bit on CUDA, GGUF and HF MXFP4 / FP8 models in both slot formats;
#   2. pinned vs pageable host->device bandwidth;
#   3. decode at real expert sizes (Qwen3-30B-A3B experts: hidden 2048, FF 768, 128 experts,
#      top-8, bf16; 4 MoE layers to stay in time): resident / copy-every-pass / cpu baselines
#      and the cache (lru, 25% of experts) with fetch and cpu miss paths;
#   4. `expertcache bench` (the benchmark issue) at real Qwen3-30B-A3B expert sizes, 8 layers;
#   5. benchmarks/bench_quantized.py (issue 11): the same decode in bf16 and in Q4_K (Q4_K/Q6_K
#      blocks, 2.92 MiB experts) on one pool budget, bf16 / quantized / dequantized slots and
#      the baselines, 8 layers: the figures the CPU run cannot give;
#   6. benchmarks/bench_overhead.py on CUDA: all-resident decode through expertcache against
#      plain transformers on the same weights (the host-side cost per MoE step, which limits
#      GPU decode once hits are high);
#   7. benchmarks/bench_vllm.py --device cuda (issue 16): vLLM with and without the expertcache
#      plug-in (100 / 50 / 25% slots, eager; 50% with piecewise CUDA graphs, the MoE op outside
#      them), tokens equal to vLLM's; needs a CUDA build of vLLM 0.32 in $VLLM_PYTHON (default:
#      the same python), skipped with a note otherwise.
# Prints one table; writes everything under benchmarks/results/gpu_check-<UTC time>/.
# Usage (repository root): bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=benchmarks/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
ec() { "$PY" -c 'import sys; from expertcache.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }

(nvidia-smi || true) > "$OUT/nvidia-smi.txt" 2>&1
# GPU_CHECK_DRY=1: run the same steps on the CPU at tiny sizes (to check this script without a GPU)
DRY=${GPU_CHECK_DRY:-0}
if [ "$DRY" != 1 ] && ! "$PY" -c "import torch; assert torch.cuda.is_available(); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" > "$OUT/torch.txt" 2>&1; then
  echo "gpu_check: no CUDA device visible to torch ($PY); see $OUT/torch.txt"; exit 2
fi
export GPU_CHECK_DRY=$DRY

GPU_TESTS=(tests/test_gpu.py tests/test_bench_gpu.py tests/test_dequant_gpu.py tests/test_gguf_gpu.py
           tests/test_hf_quant_gpu.py)
timeout 180 "$PY" -m pytest -m gpu "${GPU_TESTS[@]}" -q -rs -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
echo $? > "$OUT/pytest.rc"

timeout 150 "$PY" - "$OUT" <<'PYEOF' > "$OUT/run.txt" 2>&1
import copy, json, os, sys, time
import torch
import transformers as tf
from expertcache import offload

out = sys.argv[1]
res = {}

# -- host -> device bandwidth, pinned vs pageable (256 MiB) ----------------------------
def h2d(pinned):
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty_like(src, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    return 10 * src.numel() / (time.perf_counter() - t) / 1e9
dry = os.environ.get("GPU_CHECK_DRY") == "1"
dev = "cpu" if dry else "cuda"
res["device"] = "cpu (dry run)" if dry else torch.cuda.get_device_name()
res["h2d_pinned_GBps"], res["h2d_pageable_GBps"] = (0.0, 0.0) if dry else (h2d(True), h2d(False))

# -- decode at real expert sizes -------------------------------------------------------
H, FF = (64, 32) if dry else (2048, 768)
cfg = tf.Qwen3MoeConfig(hidden_size=H, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=FF,
                        intermediate_size=3 * H, decoder_sparse_step=1, vocab_size=4096,
                        max_position_embeddings=4096, eos_token_id=None, pad_token_id=0)
torch.manual_seed(0)
base = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if dry else torch.bfloat16).eval()
with torch.no_grad():  # varied routing, as a trained router gives
    for n, p in base.named_parameters():
        if n.endswith("mlp.gate.weight"):
            p.normal_(0, 0.5)
ids = torch.randint(1, 4096, (1, 128), generator=torch.Generator().manual_seed(1))
E_total = cfg.num_hidden_layers * cfg.num_experts
runs = {"resident": dict(baseline="resident"), "copy-every-pass": dict(baseline="copy-every-pass"),
        "cpu (--cpu-moe)": dict(baseline="cpu"), "lru 25% fetch": dict(slots=E_total // 4),
        "lru 25% cpu": dict(slots=E_total // 4, miss="cpu"), "lru 25% auto": dict(slots=E_total // 4, miss="auto")}
res["decode"] = {}
for name, kw in runs.items():
    model = offload(copy.deepcopy(base), device=dev, **kw)
    times = []
    class Clock:
        def put(self, v): times.append(time.perf_counter())
        def end(self): pass
    with torch.no_grad():
        model.generate(ids.to(dev), max_new_tokens=8, do_sample=False)  # warm-up
        model.expertcache.reset_stats(); times.clear()
        seq = model.generate(ids.to(dev), max_new_tokens=64, do_sample=False, streamer=Clock())
    steps = [b - a for a, b in zip(times[1:], times[2:])]
    steady = steps[16:]
    st = model.expertcache.stats()
    res["decode"][name] = {"prefill_s": times[1] - times[0], "steady_tok_s": len(steady) / sum(steady),
                           "hit_rate_decode": st.total("decode").hit_rate,
                           "h2d_MB_per_decode_token": st.h2d_bytes("decode") / max(len(steps), 1) / 1e6,
                           "slot_MB": model.expertcache.slot_bytes / 1e6, "tokens": seq[0, -8:].tolist()}
    del model
    if not dry:
        torch.cuda.empty_cache()
ref = res["decode"]["resident"]["tokens"]
res["all_tokens_equal_resident"] = all(r["tokens"] == ref for r in res["decode"].values())
json.dump(res, open(f"{out}/gpu_check.json", "w"), indent=2)
PYEOF
echo $? > "$OUT/run.rc"

# the benchmark issue's command at real expert sizes (Qwen3-30B-A3B, bf16, first 8 MoE layers)
TRACE=../shared/traces/qwen3-30b-a3b-code.npz
SRC=(--preset qwen3-30b-a3b)
[ -f "$TRACE" ] && SRC=(--trace "$TRACE" --preset qwen3-30b-a3b)
if [ "$DRY" = 1 ]; then SIZE=(--scale 0.05 --layers 2 --tokens 32 --device cpu --dtype fp32)
else SIZE=(--scale 1 --layers 8 --tokens 128 --device cuda --dtype bf16); fi
if ec bench --help > /dev/null 2>&1; then
  timeout 150 "$PY" -c 'import sys; from expertcache.cli import main; sys.exit(main(sys.argv[1:]))' bench "${SRC[@]}" "${SIZE[@]}" --fraction 0.125,0.25 \
    --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo $? > "$OUT/bench.rc"
else
  echo "expertcache bench is not available in this checkout" > "$OUT/bench.txt"; echo 0 > "$OUT/bench.rc"
fi

# issue 11: bf16 vs Q4_K decode on one pool budget (real sizes, 8 layers, 128 tokens, 2 repeats)
if [ "$DRY" = 1 ]; then QSIZE=(--hidden 256 --expert-ff 256 --layers 2 --tokens 32 --repeats 1 --device cpu)
else QSIZE=(--layers 8 --tokens 128 --repeats 2 --device cuda); fi
if [ -f benchmarks/bench_quantized.py ]; then
  timeout 180 "$PY" benchmarks/bench_quantized.py "${QSIZE[@]}" --json "$OUT/bench_quantized.json" \
    --plot "$OUT/bench_quantized.png" > "$OUT/bench_quantized.txt" 2>&1
  echo $? > "$OUT/bench_quantized.rc"
else
  echo "benchmarks/bench_quantized.py is not in this checkout" > "$OUT/bench_quantized.txt"; echo 0 > "$OUT/bench_quantized.rc"
fi

# all-resident decode through expertcache vs plain transformers on the device (runtime overhead)
if [ "$DRY" = 1 ]; then OSIZE=(--device cpu --tokens 8 --repeats 1)
else OSIZE=(--device cuda --dtype bfloat16 --tokens 48 --repeats 3); fi
timeout 60 "$PY" benchmarks/bench_overhead.py "${OSIZE[@]}" --json "$OUT/bench_overhead.json" \
  > "$OUT/bench_overhead.txt" 2>&1
echo $? > "$OUT/bench_overhead.rc"

# issue 16: vLLM with the expertcache plug-in (docs/vllm.md)
VPY=${VLLM_PYTHON:-$PY}
if [ "$DRY" != 1 ] && "$VPY" -c "import vllm, expertcache.vllm" > /dev/null 2>&1; then
  timeout 300 "$VPY" benchmarks/bench_vllm.py --device cuda --tokens 64 --repeats 2 \
    --json "$OUT/bench_vllm.json" > "$OUT/bench_vllm.txt" 2>&1
  echo $? > "$OUT/bench_vllm.rc"
else
  echo "skipped: no vLLM for $VPY (pip install 'vllm==0.32.*' and this package with [vllm]), or a dry run" \
    > "$OUT/bench_vllm.txt"
  echo 0 > "$OUT/bench_vllm.rc"
fi

"$PY" - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
tests = open(f"{out}/pytest.txt").read().strip().splitlines()
print(f"{'check':34} result")
print(f"{'pytest -m gpu':34} {tests[-1] if tests else 'no output'} (rc {open(f'{out}/pytest.rc').read().strip()})")
path = f"{out}/gpu_check.json"
if os.path.exists(path):
    r = json.load(open(path))
    print(f"{'H2D pinned / pageable':34} {r['h2d_pinned_GBps']:.1f} / {r['h2d_pageable_GBps']:.1f} GB/s")
    print(f"{'tokens equal to resident':34} {r['all_tokens_equal_resident']}")
    print(f"{'decode (4 layers, real experts)':34} {'steady tok/s':>12} {'hit(dec)':>9} {'H2D MB/tok':>11} {'pool MB':>9}")
    for name, d in r["decode"].items():
        print(f"  {name:32} {d['steady_tok_s']:12.1f} {d['hit_rate_decode']:9.3f} "
              f"{d['h2d_MB_per_decode_token']:11.1f} {d['slot_MB']:9.0f}")
else:
    print(f"{'real-size decode':34} failed (rc {open(f'{out}/run.rc').read().strip()}): see {out}/run.txt")
bench = open(f"{out}/bench.txt").read().strip().splitlines()
print(f"{'expertcache bench (rc ' + open(f'{out}/bench.rc').read().strip() + ')':34} last lines of {out}/bench.txt:")
for line in bench[-12:]:
    print(f"  {line}")
for name, lines in (("bench_quantized", 14), ("bench_overhead", 5), ("bench_vllm", 9)):
    rc = open(f"{out}/{name}.rc").read().strip()
    print(f"{name + ' (rc ' + rc + ')':34} last lines of {out}/{name}.txt:")
    for line in open(f"{out}/{name}.txt").read().strip().splitlines()[-lines:]:
        print(f"  {line}")
print(f"results in {out}")
PYEOF
