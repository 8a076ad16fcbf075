#!/usr/bin/env bash
# CI smoke: genai-perf 0.0.16 (own venv, .cache/genai-venv) against `llm` over KServe gRPC
# streaming, with the vLLM-backend and the TensorRT-LLM-backend request conventions.
#
#   scripts/compat/genai_perf.sh [--backend vllm|tensorrtllm|both] [--checkpoint DIR]
#                                [--target llm] [--concurrency 2] [--requests 8]
#                                [--input-tokens 32] [--output-tokens 16]
#
# The checkpoint must have a tokenizer.json: genai-perf makes prompts and counts tokens with it,
# locally (no hub). Default: the 100m preset written under .cache/ckpt-100m.
# Starts Splitserve on free loopback ports (or uses SPLITSERVE_GRPC_URL + SPLITSERVE_HTTP_URL).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

BACKEND=both; CKPT=""; TARGET=llm; CONCURRENCY=2; REQUESTS=8; IN_TOKENS=32; OUT_TOKENS=16
while [[ $# -gt 0 ]]; do
    case "$1" in
        --backend) BACKEND="$2"; shift 2 ;;
        --checkpoint) CKPT="$2"; shift 2 ;;
        --target) TARGET="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --requests) REQUESTS="$2"; shift 2 ;;
        --input-tokens) IN_TOKENS="$2"; shift 2 ;;
        --output-tokens) OUT_TOKENS="$2"; shift 2 ;;
        *) die "unknown option $1" ;;
    esac
done
case "$BACKEND" in
    both) BACKENDS=(vllm tensorrtllm) ;;
    vllm|tensorrtllm) BACKENDS=("$BACKEND") ;;
    *) die "--backend must be vllm, tensorrtllm or both" ;;
esac

genai_perf_env
CKPT="${CKPT:-$(default_checkpoint 100m)}"
CKPT="$(cd "$CKPT" && pwd)"
[[ -f "$CKPT/tokenizer.json" ]] || die "$CKPT has no tokenizer.json (genai-perf needs one)"
layout=disagg; [[ "$TARGET" == llm_colocated ]] && layout=colocated
start_splitserve "$CKPT" "$layout"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$CACHE/hf"
WORK="$(mktemp -d "$COMPAT/genai-XXXXXX")"
failed=()
for backend in "${BACKENDS[@]}"; do
    t0=$SECONDS
    set +e
    # No --warmup-request-count: with it, perf_analyzer 2.51 --streaming hung (seen 2026-12-02).
    timeout "${GENAI_TIMEOUT:-300}" "$GENAI_PERF" profile -m "$TARGET" --endpoint-type kserve --backend "$backend" --streaming \
        -u "$GRPC_URL" --tokenizer "$CKPT" \
        --synthetic-input-tokens-mean "$IN_TOKENS" --synthetic-input-tokens-stddev 0 \
        --output-tokens-mean "$OUT_TOKENS" --output-tokens-mean-deterministic \
        --extra-inputs ignore_eos:true \
        --num-dataset-entries "$REQUESTS" --random-seed 0 \
        --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
        --artifact-dir "$WORK/$backend" 2>&1 | tee "$WORK/$backend.txt"
    rc=${PIPESTATUS[0]}
    set -e
    say "genai-perf --backend $backend exited $rc after $((SECONDS - t0)) s"
    if [[ $rc -ne 0 ]]; then
        failed+=("$backend")
        continue
    fi
    # Every request must stream: at least one response (some requests several), at most one per
    # requested token and the FINAL (fewer where the server's sender fell behind and joined them).
    # (genai-perf's own output_sequence_length re-tokenizes the text, which with random weights
    # differs from the tokens generated: seen 8-16 for 8.)
    if ! "$GENAI_VENV/bin/python" - "$WORK/$backend" "$OUT_TOKENS" <<'EOF'
import json, pathlib, sys
export = next(pathlib.Path(sys.argv[1]).rglob("profile_export.json"))
reqs = [r for e in json.loads(export.read_text())["experiments"] for r in e["requests"]]
counts = sorted({len(r["response_timestamps"]) for r in reqs})
print(f"genai_perf.sh: {len(reqs)} requests, responses per request {counts}", file=sys.stderr)
if not reqs or min(counts) < 1 or not 2 <= max(counts) <= int(sys.argv[2]) + 1:
    sys.exit(f"expected 1 to {int(sys.argv[2]) + 1} responses per request, streamed, got {counts}")
EOF
    then failed+=("$backend"); fi
done
say "artifacts in $WORK"
[[ ${#failed[@]} -eq 0 ]] || die "failed: ${failed[*]}"
echo "genai_perf.sh: OK (${BACKENDS[*]})"
