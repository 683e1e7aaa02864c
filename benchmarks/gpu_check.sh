#!/usr/bin/env bash
# The GPU check: one command that fits a 15-minute GPU lease (under 8 minutes of run).
#
# On the GPU machine (an H200 image: python3 3.12, torch 2.11 + CUDA 13, transformers 5.17,
# numba, no gguf), from the repository root. Prepare here, once:
#     make gpu-wheels gpu-trace        # .whl/: gguf (the image lacks it); .gpu-trace/: a real trace
#     bash benchmarks/gpu_check.sh --rehearse    # the same steps on this CPU, toy sizes, < 3 min
# then start it there with the device tool:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu-trace"], timeout_s=540)
# and give the machine back. What comes back: $OUT/gpu_check.log (everything printed),
# $OUT/gpu_check.json (every figure), $OUT/gpu_check.png, $OUT/bench_quantized.png; commit
# them under benchmarks/results/gpu_check-<date>/.
#
# Steps, most valuable first, each under its own timeout (they sum to 400 s; the printed
# output streams as it comes, and every step saves what it measured before its limit):
#   tests    100 s  the CUDA tests (pytest -m gpu)
#   real     180 s  exactness and steady decode at Qwen3-30B-A3B's expert size (12 bf16 layers,
#                   routed by the carried trace): plain transformers, resident, cache 25% / 50%
#                   with fetch, cpu and auto, copy-every-pass, cpu (--cpu-moe), planner device
#                   vs host when the checkout has it; H2D bytes, syncs and host us per MoE step
#   quant     70 s  Q4_K quantized slots against bf16 slots on one memory budget (bench_quantized.py)
#   dequant   30 s  what dequantizing Q4_K slots per use costs next to the step's matmuls
#   summary   20 s  one table, gpu_check.json, gpu_check.png
# Numba compiles once per run into the work folder (NUMBA_CACHE_DIR), shared by the steps.
#
# Output: $OUT when set (the device tool's folder that comes back: at most 8 files), else
# benchmarks/results/gpu_check-<UTC time>/ (a temporary folder for --rehearse).
set -u
cd "$(dirname "$0")/.."
REHEARSE=
[ "${1:-}" = "--rehearse" ] && REHEARSE=--rehearse
PY=${PYTHON:-python3}
if [ -n "$REHEARSE" ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -n "${OUT:-}" ]; then RES=$OUT
elif [ -n "$REHEARSE" ]; then RES=$(mktemp -d -t gpu_check_rehearsal.XXXX)
else RES=benchmarks/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ); fi
WORK=$(mktemp -d -t gpu_check_work.XXXX)   # the steps' own files: never in $RES (8 files come back)
mkdir -p "$RES"
exec > >(tee "$RES/gpu_check.log") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=$WORK/numba MPLBACKEND=Agg
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}

echo "gpu_check ${REHEARSE:-on the device} $(date -u +%FT%TZ), python: $PY, results: $RES"
if compgen -G ".whl/*.whl" > /dev/null; then  # the packages the image lacks, carried as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site || echo "gpu_check: installing .whl/ failed"
fi
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi")
"$PY" - "$WORK/env.json" <<'PYEOF'
import importlib, json, sys
import torch
env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
for name in ("transformers", "numba", "gguf", "triton", "accelerate"):
    try:
        env[name] = importlib.import_module(name).__version__
    except ImportError as e:
        env[name] = f"missing ({e})"
print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
json.dump(env, open(sys.argv[1], "w"))
PYEOF
if [ -z "$REHEARSE" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch ($PY); on a CPU use --rehearse"; exit 2
fi

step() {  # name limit command...: stream its output, record rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo; echo "=== $name (limit ${limit} s) $(date -u +%T)"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$WORK/$name.txt"
  rc=${PIPESTATUS[0]}
  echo "$name $rc $((SECONDS - t0)) $limit" >> "$WORK/steps.txt"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

GPU_TESTS=(tests/test_gpu.py tests/test_bench_gpu.py tests/test_dequant_gpu.py tests/test_gguf_gpu.py
           tests/test_hf_quant_gpu.py)
step tests 100 "$PY" -m pytest -m gpu "${GPU_TESTS[@]}" -q -rs -p no:cacheprovider
step real 180 "$PY" benchmarks/gpu_check.py real --work "$WORK" $REHEARSE
if [ -n "$REHEARSE" ]; then QSIZE=(--hidden 256 --expert-ff 256 --layers 2 --tokens 24 --repeats 1 --device cpu)
else QSIZE=(--layers 4 --tokens 48 --repeats 1 --device cuda); fi
TRACE=.gpu-trace/qwen3-30b-a3b-code.npz
[ -f "$TRACE" ] && QSIZE+=(--trace "$TRACE")
step quant 70 "$PY" benchmarks/bench_quantized.py "${QSIZE[@]}" --json "$WORK/bench_quantized.json" \
  --plot "$RES/bench_quantized.png"
step dequant 30 "$PY" benchmarks/gpu_check.py dequant --work "$WORK" $REHEARSE
timeout 20 "$PY" benchmarks/gpu_check.py summary --work "$WORK" --out "$RES"
rm -rf "$WORK"
exec >&- 2>&-
wait "$TEE"  # the log is whole before the command returns
