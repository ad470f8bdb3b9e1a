#!/usr/bin/env bash
# The CUDA checks, for a machine whose python3 holds a CUDA build of torch
# (CI has none: there every CUDA test skips).  Builds the extensions in
# place with that python, then runs the CUDA tests and the transfer suite,
# then `tract bench transfer --device cuda`, tests/cuda/profile.py (where
# the CUDA path's time goes, stage by stage) and tests/cuda/digest_threads.py
# (the checksums' hashing by thread count).  Logs go to $OUT (default
# out/cuda).  Usage: bash tests/cuda/check.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-out/cuda}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/tract-numba-cache}
"$PY" - <<'PY' 2>&1 | tee "$OUT/device.txt"
import platform, torch, numpy, numba
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "numpy", numpy.__version__, "numba", numba.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY
started=$(date +%s)
if ! "$PY" setup.py -q build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
fi
echo "built in $(( $(date +%s) - started )) s"
status=0
timeout "${PYTEST_TIMEOUT:-300}" "$PY" -m pytest -q -ra -p no:cacheprovider --durations=10 \
    tests/test_cuda.py tests/test_transfer.py "$@" 2>&1 | tee "$OUT/pytest.log" || status=1
timeout "${BENCH_TIMEOUT:-300}" "$PY" -m tract.cli bench transfer --device cuda \
    2>&1 | tee "$OUT/bench.txt" || status=1
timeout "${BENCH_TIMEOUT:-300}" "$PY" tests/cuda/profile.py 2>&1 | tee "$OUT/profile.txt" || status=1
timeout "${BENCH_TIMEOUT:-300}" "$PY" tests/cuda/digest_threads.py 2>&1 | tee "$OUT/threads.txt" || status=1
exit $status
