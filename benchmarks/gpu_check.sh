#!/usr/bin/env bash
# The GPU check: one command that fits a 15-minute GPU lease (its default steps' limits sum to 400 s).
#
# On the GPU machine (an H200 image: python3 3.12, torch 2.11 + CUDA 13, transformers 5.17,
# accelerate, numba, triton, pytest-xdist, pytest-timeout; no gguf, no libggml-python). Prepare here, once:
#     make gpu-wheels gpu-trace        # .whl/: gguf and libggml-python; .gpu-trace/: a real trace
#     bash benchmarks/gpu_check.sh --rehearse    # the same steps on this CPU, toy sizes, < 3 min
# then start it there with the device tool:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu-trace"], timeout_s=480)
# and give the machine back. What comes back: $OUT/gpu_check.log (everything printed),
# $OUT/gpu_check.json (every figure), $OUT/gpu_check_real.png, $OUT/gpu_check_full.png,
# $OUT/bench_quantized.png; commit them under benchmarks/results/gpu_check-<date>/.
# `--steps a,b` runs only those steps (e.g. a second call for the figures a lease has time for).
#
# Steps, most valuable first, each under its own timeout; output streams as it comes and every
# step saves what it measured row by row; a row or test that fails is printed and the rest run.
# The default steps (limits sum to 400 s):
#   bandwidth  10 s  device copy and pinned H2D bandwidth: every decode row's bound comes from them
#   tests      75 s  the quick CUDA tests (pytest -m "gpu and not slow", 8 workers, 50 s a test; each
#                    test's outcome printed as it ends: 60 s cut the summary off on the H200)
#   graphs     90 s  decode with CUDA graphs on and off (gpu_graphs.py): resident, copy-every-pass,
#                    25 / 50 / 100% slots, 1 and 16 sequences, 12 layers, against each row's bound
#   real       95 s  12 bf16 layers at Qwen3-30B-A3B's expert size, routed by the carried trace:
#                    plain transformers, resident, 25% / 50% / 100% slots with both planners,
#                    copy-every-pass, cpu, the accelerate-offload peer, 16 sequences; tok/s, bound
#                    and fraction, teacher-forced exactness, H2D bytes, syncs, host time per step
#   full       60 s  48 layers x 128 experts (Qwen3-30B-A3B's real size, ~58 GB of bf16 experts
#                    pinned on the host): resident, 50% with both planners, copy-every-pass
#   fused      45 s  the fused Triton kernel (bench_fused.py): time at 384 / 1536 / 6144 pool rows,
#                    bytes against the bound, bf16 against Q4_K slots at one budget, the old path
#   diag       15 s  GPT-OSS MXFP4 logits: CPU and CUDA references and ours, module by module
#   summary    10 s  one table, gpu_check.json, the plots
# Only with --steps: graphs-full 90 s (graphs at 48 layers, 50% slots), quant 45 s (bench_quantized.py),
# dequant 15 s (Q4_K dequantize-per-use cost), tests-slow 90 s (the GPU tests marked slow),
# tiers 120 s (bench_tiers.py --device cuda --slots 12: the RAM tier feeding the slots against mmap
# under one memory cgroup limit, issue 33; without a cgroup v1 memory controller it runs unlimited
# and says so; no warm-up run: the earlier steps compiled numba's cache).
# Numba compiles once per run into the work folder (NUMBA_CACHE_DIR), shared by the steps.
#
# Output: $OUT when set (the device tool's folder that comes back: at most 8 files), else
# benchmarks/results/gpu_check-<UTC time>/ (a temporary folder for --rehearse).
set -u
cd "$(dirname "$0")/.."
REHEARSE=
STEPS=bandwidth,tests,graphs,real,full,fused,diag
while [ $# -gt 0 ]; do
  case "$1" in
    --rehearse) REHEARSE=--rehearse ;;
    --steps) STEPS=$2; shift ;;
    *) echo "gpu_check: unknown argument $1 (use --rehearse, --steps a,b)"; exit 2 ;;
  esac
  shift
done
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

echo "gpu_check ${REHEARSE:-on the device} $(date -u +%FT%TZ), python: $PY, steps: $STEPS, results: $RES"
if compgen -G ".whl/*.whl" > /dev/null; then  # the packages the image lacks, carried as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site || echo "gpu_check: installing .whl/ failed"
fi
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi")
"$PY" - "$WORK/env.json" <<'PYEOF'
import json, sys
from importlib import metadata
import torch
env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
for name in ("transformers", "accelerate", "numba", "triton", "gguf", "libggml-python"):
    try:  # the distribution's version: gguf has no __version__
        env[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        env[name] = "missing"
print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
json.dump(env, open(sys.argv[1], "w"))
PYEOF
if [ -z "$REHEARSE" ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch ($PY); on a CPU use --rehearse"; exit 2
fi

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {  # name limit command...: stream its output, record rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  wanted "$name" || return 0
  # a rehearsal runs on a shared CPU (a step took 22 s quiet, over 90 s beside a test suite): it
  # proves the steps run and bring back their files; the limits it must keep are the GPU's
  [ -n "$REHEARSE" ] && limit=$((limit * 4))
  echo; echo "=== $name (limit ${limit} s) $(date -u +%T)"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$WORK/$name.txt"
  rc=${PIPESTATUS[0]}
  echo "$name $rc $((SECONDS - t0)) $limit" >> "$WORK/steps.txt"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

# pytest: a collection error in one file must not stop the others; each test has its own limit
PYTEST=("$PY" -m pytest -v -rfEs -p no:cacheprovider --continue-on-collection-errors)
"$PY" -c "import xdist" 2>/dev/null && [ -z "$REHEARSE" ] && PYTEST+=(-n 8)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout 50)
GPU_TESTS=(tests/test_gpu.py tests/test_bench_gpu.py tests/test_dequant_gpu.py tests/test_gguf_gpu.py
           tests/test_hf_quant_gpu.py tests/test_devicestep.py tests/test_fused_gpu.py
           tests/test_graphs.py tests/test_tiers_gpu.py)

step bandwidth 10 "$PY" benchmarks/gpu_check.py bandwidth --work "$WORK" $REHEARSE
step tests 75 "${PYTEST[@]}" -m "gpu and not slow" "${GPU_TESTS[@]}"
if [ -n "$REHEARSE" ]; then GRAPHS=(--rehearse); else GRAPHS=(--layers 12 --batches 1,16); fi
step graphs 90 "$PY" benchmarks/gpu_graphs.py "${GRAPHS[@]}" --bandwidth "$WORK/bandwidth.json" \
  --json "$WORK/extra_graphs.json"
step real 95 "$PY" benchmarks/gpu_check.py real --work "$WORK" $REHEARSE
if [ -n "$REHEARSE" ]; then GRAPHS=(--rehearse --rows 50); else GRAPHS=(--layers 48 --rows 50 --batches 1); fi
step graphs-full 90 "$PY" benchmarks/gpu_graphs.py "${GRAPHS[@]}" --bandwidth "$WORK/bandwidth.json" \
  --json "$WORK/extra_graphs_full.json"
step full 60 "$PY" benchmarks/gpu_check.py full --work "$WORK" $REHEARSE
if [ -n "$REHEARSE" ]; then FUSED=(--device cpu); else FUSED=(); fi
step fused 45 "$PY" benchmarks/bench_fused.py "${FUSED[@]}" --json "$WORK/extra_fused.json"
if [ -n "$REHEARSE" ]; then QSIZE=(--hidden 256 --expert-ff 256 --layers 2 --tokens 20 --repeats 1 --device cpu)
else QSIZE=(--layers 2 --tokens 40 --repeats 1 --device cuda --sim-tokens 500); fi
TRACE=.gpu-trace/qwen3-30b-a3b-code.npz
[ -f "$TRACE" ] && QSIZE+=(--trace "$TRACE")
step quant 45 "$PY" benchmarks/bench_quantized.py "${QSIZE[@]}" --json "$WORK/bench_quantized.json" \
  --plot "$RES/bench_quantized.png"
step dequant 15 "$PY" benchmarks/gpu_check.py dequant --work "$WORK" $REHEARSE
step diag 15 "$PY" benchmarks/gpu_check.py diag --work "$WORK" $REHEARSE
step tests-slow 90 "${PYTEST[@]}" -m "gpu and slow" "${GPU_TESTS[@]}"
if [ -n "$REHEARSE" ]; then TIERS=(--device cpu --tokens 4); else TIERS=(--device cuda --tokens 32); fi
step tiers 120 "$PY" benchmarks/bench_tiers.py "${TIERS[@]}" --slots 12 --shares 25 --repeats 1 --no-warm-up \
  --dir "$WORK/tiers" --json "$WORK/extra_tiers.json"
timeout 10 "$PY" benchmarks/gpu_check.py summary --work "$WORK" --out "$RES"
rm -rf "$WORK"
exec >&- 2>&-
wait "$TEE"  # the log is whole before the command returns
