#!/usr/bin/env bash
# The GPU run: every kernel test on the device, then the benchmark table.
# Usage (on a CUDA machine, from the repository root): bash tests/run_gpu.sh [OUT_DIR]
set -u
out=${1:-${OUT:-/tmp/tqgen-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQGEN_CACHE_DIR="$out/modules"
python3 - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 2>&1 | tee "$out/pytest-gpu.log" | tail -25
tests_rc=${PIPESTATUS[0]}
python3 -m tqgen.cli bench configs/k8v4-d128.yaml configs/k4v4-d128.yaml configs/k3v4-d128.yaml configs/k3v3-d128.yaml \
    --json "$out/bench.json" ${TQGEN_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | grep -v '^\['
echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
