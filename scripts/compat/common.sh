# Sourced by the compat smoke scripts: tool installs under .cache/ and a throwaway Splitserve
# server on free loopback ports. Nothing here touches the project venv's packages.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$ROOT/.cache"
COMPAT="$CACHE/compat"
PROJECT_VENV="${SPLITSERVE_VENV:-$ROOT/.venv}"
GENAI_VENV="${GENAI_VENV:-$CACHE/genai-venv}"
LOGS="$CACHE/logs"
mkdir -p "$COMPAT" "$LOGS"

die() { echo "$(basename "$0"): $*" >&2; exit 1; }
say() { echo "$(basename "$0"): $*" >&2; }

# perf_analyzer from the tritonclient 2.51.0 wheel needs Debian's libb64 and CUDA's runtime
# library even on CPU-only machines: unpack both under .cache/compat/lib, no root needed.
perf_analyzer_env() {
    PERF_ANALYZER="${PERF_ANALYZER:-$PROJECT_VENV/bin/perf_analyzer}"
    [[ -x "$PERF_ANALYZER" ]] || die "no $PERF_ANALYZER (pip install 'tritonclient[all]==2.51.0')"
    local lib="$COMPAT/lib"
    mkdir -p "$lib"
    if [[ ! -e "$lib/libb64.so.0d" ]]; then
        if [[ -e /usr/lib/x86_64-linux-gnu/libb64.so.0d ]]; then
            ln -sf /usr/lib/x86_64-linux-gnu/libb64.so.0d "$lib/"
        else
            (cd "$COMPAT" && { apt-get download -q libb64-0d >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null 2>&1 && apt-get download -q libb64-0d >/dev/null 2>&1; }; } \
                && dpkg -x libb64-0d_*.deb deb) || die "cannot fetch Debian libb64-0d"
            ln -sf "$COMPAT/deb/usr/lib/x86_64-linux-gnu/libb64.so.0d" "$lib/"
        fi
    fi
    if [[ ! -e "$lib/libcudart.so.12" ]]; then
        local cudart="$COMPAT/cudart/nvidia/cuda_runtime/lib/libcudart.so.12"
        [[ -f "$cudart" ]] || "$PROJECT_VENV/bin/python" -m pip install -q --no-deps \
            --target "$COMPAT/cudart" "nvidia-cuda-runtime-cu12==12.*" \
            || die "cannot install nvidia-cuda-runtime-cu12"
        ln -sf "$cudart" "$lib/"
    fi
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$(dirname "$PERF_ANALYZER"):$PATH"
    "$PERF_ANALYZER" --version >/dev/null 2>&1 || "$PERF_ANALYZER" --help >/dev/null 2>&1 \
        || die "$PERF_ANALYZER does not run (missing libraries?): $(ldd "$PERF_ANALYZER" | grep 'not found')"
}

# genai-perf 0.0.16 in its own venv: it wants numpy 2, the project venv keeps numpy < 2.
genai_perf_env() {
    if [[ ! -f "$GENAI_VENV/.genai-perf-0.0.16" ]]; then
        say "installing genai-perf==0.0.16 into $GENAI_VENV"
        [[ -x "$GENAI_VENV/bin/python" ]] || "${PYTHON:-python3}" -m venv "$GENAI_VENV"
        "$GENAI_VENV/bin/pip" install -q --upgrade pip
        "$GENAI_VENV/bin/pip" install -q "genai-perf==0.0.16"
        touch "$GENAI_VENV/.genai-perf-0.0.16"
    fi
    GENAI_PERF="$GENAI_VENV/bin/genai-perf"
    perf_analyzer_env  # genai-perf drives the perf_analyzer found on PATH
}

free_ports() {  # N -> N free loopback ports on one line
    "$PROJECT_VENV/bin/python" -c "
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(('127.0.0.1', 0))
print(*[s.getsockname()[1] for s in socks])" "$1"
}

# start_splitserve MODEL [LAYOUT]: sets GRPC_URL, HTTP_URL, SERVE_PID; stopped on exit.
# With SPLITSERVE_GRPC_URL and SPLITSERVE_HTTP_URL set, use that server instead.
start_splitserve() {
    if [[ -n "${SPLITSERVE_GRPC_URL:-}" ]]; then
        GRPC_URL="$SPLITSERVE_GRPC_URL"; HTTP_URL="${SPLITSERVE_HTTP_URL:?}"; return
    fi
    local model="$1" layout="${2:-disagg}" http grpc metrics t0=$SECONDS
    read -r http grpc metrics < <(free_ports 3)
    local log="$LOGS/compat-serve-$grpc.log"
    setsid "$PROJECT_VENV/bin/splitserve" serve --model "$model" --layout "$layout" \
        --host 127.0.0.1 --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
        >"$log" 2>&1 &
    SERVE_PID=$!
    trap stop_splitserve EXIT
    GRPC_URL="127.0.0.1:$grpc"; HTTP_URL="127.0.0.1:$http"
    until curl -sf "http://$HTTP_URL/v2/health/ready" >/dev/null 2>&1; do
        kill -0 "$SERVE_PID" 2>/dev/null || { tail -30 "$log" >&2; die "splitserve exited"; }
        (( SECONDS - t0 > ${SERVE_TIMEOUT:-120} )) && { tail -30 "$log" >&2; die "not ready"; }
        sleep 1
    done
    say "splitserve ($model, $layout) ready in $((SECONDS - t0)) s: gRPC $GRPC_URL, HTTP $HTTP_URL"
}

stop_splitserve() {
    [[ -n "${SERVE_PID:-}" ]] || return 0
    kill -TERM "$SERVE_PID" 2>/dev/null || true  # serve_forever stops tritonserver cleanly
    for _ in $(seq 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVE_PID" 2>/dev/null || true
    SERVE_PID=""
}

# A checkpoint with a tokenizer.json (genai-perf tokenizes locally): the 100m preset by default.
default_checkpoint() {
    "$PROJECT_VENV/bin/python" -c "
import sys; sys.path.insert(0, '$ROOT/scripts')
from bench_common import checkpoint; print(checkpoint(sys.argv[1]))" "${1:-100m}"
}
