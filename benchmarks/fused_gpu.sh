#!/usr/bin/env bash
# The fused kernel's GPU checks (issue 31) in one command, for the device tool:
#     run(command="bash benchmarks/fused_gpu.sh", carry=[".whl"], timeout_s=540)
# (.whl/: `make gpu-wheels`, for gguf, which the GPU image lacks and the format tests need.)
# Steps, each under its own limit (470 s in all): the fused kernel's CUDA tests (~25 Triton
# compiles, ~90 s), bench_fused.py (~60 s; its kernels are in Triton's cache by then), then the CUDA
# tests of the runtime and the device step (~100 s), which now run on the kernel.
# What comes back in $OUT: bench_fused.json and bench_fused.txt.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RES=${OUT:-$(mktemp -d)}
W=$(mktemp -d)
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W" .whl/gguf-*.whl || echo "fused_gpu: gguf wheel failed"
fi
export PYTHONPATH=src:$W PYTHONUNBUFFERED=1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "=== fused tests $(date -u +%T)"
timeout 200 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_fused_gpu.py 2>&1 | tail -25
echo "=== bench_fused $(date -u +%T)"
timeout 120 "$PY" benchmarks/bench_fused.py --json "$RES/bench_fused.json" 2>&1 | tee "$RES/bench_fused.txt"
echo "=== runtime CUDA tests $(date -u +%T)"
timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_devicestep.py 2>&1 | tail -25
echo "=== done $(date -u +%T)"
