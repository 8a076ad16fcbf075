#!/usr/bin/env bash
# One call on a GPU machine (no network needed): the GPU tests, the cuda_ipc handoff against a
# plain device-to-device copy, decode steps against the HBM roofline, and the Triton GPU layout
# end to end when a tritonserver binary is there. Full log and JSON results under $OUT
# (default .gpu_check/); the summary table comes last. Wheels in .whl/ (scripts/gpu/
# fetch_wheels.sh) are installed first. Exit status 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/.gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STATUS="$OUT/status.tsv"
: >"$LOG"
: >"$STATUS"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/backends:$PWD/client:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"

record() { printf '%s\t%s\n' "$1" "$2" >>"$STATUS"; }

step() { # step NAME TIMEOUT_S COMMAND...: run it, its output into the log, its outcome recorded
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name: $*" >>"$LOG"
    timeout "$limit" "$@" >"$OUT/.step" 2>&1
    rc=$?
    cat "$OUT/.step" >>"$LOG"
    case $rc in
    0) record "$name" "passed $(grep -E '(passed|failed|skipped)' "$OUT/.step" | tail -1)" ;;
    124) record "$name" "TIMED OUT after ${limit}s" ;;
    *) record "$name" "FAILED (exit $rc, see gpu_check.log)" ;;
    esac
    rm -f "$OUT/.step"
}

if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/splitserve-site .whl/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH="/tmp/splitserve-site:$PYTHONPATH"
        record "wheels from .whl/" "installed $(ls .whl | tr '\n' ' ')"
    else
        record "wheels from .whl/" "FAILED to install (see gpu_check.log)"
    fi
fi
"$PY" -c "import zmq" 2>/dev/null ||
    record "pyzmq" "MISSING: run scripts/gpu/fetch_wheels.sh where pip works, carry .whl/"
nvidia-smi >>"$LOG" 2>&1
"$PY" - >>"$LOG" 2>&1 <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(i, torch.cuda.get_device_name(i))
PYEOF
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step "pytest: kernels, cuda_ipc, GPU layouts" 420 "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/kernels tests/transport/test_cuda_ipc.py tests/transport/test_cuda_ipc_processes.py \
    tests/unit/test_render_gpu.py

if [ "$CUDA" = 1 ]; then
    step "handoff benchmark" 240 "$PY" scripts/gpu/bench_handoff.py --out "$OUT/handoff.json"
    step "decode benchmark" 420 "$PY" scripts/gpu/bench_decode.py --out "$OUT/decode.json"
else
    record "handoff benchmark" "skipped: no CUDA device"
    record "decode benchmark" "skipped: no CUDA device"
fi

if [ "$CUDA" != 1 ]; then
    record "Triton GPU layout end to end" "skipped: no CUDA device"
elif [ -x /opt/tritonserver/bin/tritonserver ] || "$PY" -c "import pytriton" 2>/dev/null; then
    step "Triton GPU layout end to end" 300 "$PY" scripts/gpu/e2e_triton.py --out "$OUT/e2e.json"
else
    record "Triton GPU layout end to end" \
        "skipped: no tritonserver binary here (run in the NGC image, docs/gpu.md)"
fi

"$PY" scripts/gpu/summary.py "$OUT" | tee "$OUT/summary.txt"
! grep -qE $'\t(FAILED|TIMED OUT|MISSING)' "$STATUS"
