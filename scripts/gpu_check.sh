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

SITE=/tmp/splitserve-site
NUMPY1=/tmp/splitserve-numpy1
install_wheels() { # install_wheels TARGET WHEEL...
    local target=$1
    shift
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "$@" >>"$LOG" 2>&1
}
WHEELS=$(compgen -G ".whl/*.whl" | grep -v '/numpy-' || true)
if [ -n "$WHEELS" ]; then
    # shellcheck disable=SC2086
    if install_wheels "$SITE" $WHEELS; then
        export PYTHONPATH="$SITE:$PYTHONPATH"
        record "wheels from .whl/" "installed $(echo $WHEELS | xargs -n1 basename | tr '\n' ' ')"
    else
        record "wheels from .whl/" "FAILED to install (see gpu_check.log)"
    fi
fi
# The Python backend's stub mangles BYTES tensors under numpy 2 and ignores PYTHONPATH: it takes
# python3 from PATH and that venv's site-packages. The end-to-end step therefore runs from a venv
# of its own whose .pth puts numpy < 2 (a carried wheel), the wheels and the repo ahead of the
# image's site-packages.
E2E_PY="$PY"
if compgen -G ".whl/numpy-1*.whl" >/dev/null && install_wheels "$NUMPY1" .whl/numpy-1*.whl &&
    "$PY" -m venv --without-pip /tmp/splitserve-venv >>"$LOG" 2>&1; then
    venv_site=$(/tmp/splitserve-venv/bin/python -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s\n' "$NUMPY1" "$SITE" "$PWD/backends" "$PWD/client" "$PWD/kernels" >"$venv_site/splitserve.pth"
    # Every site directory of the image's Python (a Debian one has dist-packages besides).
    "$PY" -c 'import site; [print(f"import site; site.addsitedir({d!r})") for d in site.getsitepackages()]' \
        >>"$venv_site/splitserve.pth"
    E2E_PY=/tmp/splitserve-venv/bin/python
elif compgen -G ".whl/numpy-1*.whl" >/dev/null; then
    record "end-to-end venv (numpy < 2)" "FAILED to set up (see gpu_check.log)"
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
"$E2E_PY" -c "import numpy; print('end-to-end venv: numpy', numpy.__version__)" >>"$LOG" 2>&1
lscpu | grep -E 'Model name|^CPU\(s\)' >>"$LOG" 2>&1
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step "pytest: GPU kernels, engine vs transformers, cuda_ipc, GPU layouts" 220 \
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_gpu_engine.py tests/kernels/test_fp8.py \
    tests/kernels/test_attention_reference.py tests/transport/test_cuda_ipc.py \
    tests/transport/test_cuda_ipc_processes.py tests/unit/test_render_gpu.py

if [ "$CUDA" = 1 ]; then
    step "handoff benchmark" 90 "$PY" scripts/gpu/bench_handoff.py --out "$OUT/handoff.json"
    step "decode benchmark" 120 "$PY" scripts/gpu/bench_decode.py --out "$OUT/decode.json"
else
    record "handoff benchmark" "skipped: no CUDA device"
    record "decode benchmark" "skipped: no CUDA device"
fi

if [ "$CUDA" != 1 ]; then
    record "Triton GPU layout end to end" "skipped: no CUDA device"
elif [ -x /opt/tritonserver/bin/tritonserver ] || "$E2E_PY" -c "import pytriton" 2>/dev/null; then
    step "Triton GPU layout end to end" 120 "$E2E_PY" scripts/gpu/e2e_triton.py --out "$OUT/e2e.json"
else
    record "Triton GPU layout end to end" \
        "skipped: no tritonserver binary here (run in the NGC image, docs/gpu.md)"
fi

"$PY" scripts/gpu/summary.py "$OUT" | tee "$OUT/summary.txt"
! grep -qE $'\t(FAILED|TIMED OUT|MISSING)' "$STATUS"
