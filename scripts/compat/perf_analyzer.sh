#!/usr/bin/env bash
# CI smoke: Triton's perf_analyzer (tritonclient 2.51.0 wheel) streaming over gRPC to `llm`.
#
#   scripts/compat/perf_analyzer.sh [--model-dir CKPT|tiny] [--target llm] [--concurrency 2]
#                                   [--max-tokens 16] [--requests 8]
#
# Starts Splitserve on free loopback ports (or uses SPLITSERVE_GRPC_URL + SPLITSERVE_HTTP_URL),
# sends text_input/max_tokens/ignore_eos as a [1]-shaped request (our max_batch_size 0 inputs),
# and fails unless perf_analyzer reports a non-zero throughput and no errors.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL_DIR=tiny; TARGET=llm; CONCURRENCY=2; MAX_TOKENS=16; REQUESTS=8
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model-dir) MODEL_DIR="$2"; shift 2 ;;
        --target) TARGET="$2"; shift 2 ;;
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --max-tokens) MAX_TOKENS="$2"; shift 2 ;;
        --requests) REQUESTS="$2"; shift 2 ;;
        *) die "unknown option $1" ;;
    esac
done

perf_analyzer_env
layout=disagg; [[ "$TARGET" == llm_colocated ]] && layout=colocated
start_splitserve "$MODEL_DIR" "$layout"

WORK="$(mktemp -d "$COMPAT/pa-XXXXXX")"
cat >"$WORK/input.json" <<EOF
{"data": [
  {"text_input": ["The quick brown fox jumps over the lazy dog."],
   "max_tokens": [$MAX_TOKENS], "ignore_eos": [true], "stream": [true]},
  {"text_input": ["Disaggregated serving splits prefill from decode."],
   "max_tokens": [$MAX_TOKENS], "ignore_eos": [true], "stream": [true]}
]}
EOF

t0=$SECONDS
set +e
"$PERF_ANALYZER" -m "$TARGET" -u "$GRPC_URL" -i grpc --streaming \
    --input-data "$WORK/input.json" --concurrency-range "$CONCURRENCY" \
    --measurement-mode count_windows --measurement-request-count "$REQUESTS" \
    --stability-percentage 999 --max-trials 3 \
    --profile-export-file "$WORK/profile.json" 2>&1 | tee "$WORK/out.txt"
rc=${PIPESTATUS[0]}
set -e
say "perf_analyzer exited $rc after $((SECONDS - t0)) s; output in $WORK"
[[ $rc -eq 0 ]] || die "perf_analyzer failed"
grep -qE "Throughput: [0-9.]*[1-9]" "$WORK/out.txt" || die "no throughput in the output"
! grep -qiE "error|failed" "$WORK/out.txt" || die "errors in the output"
# Every request must have streamed: at least one response (some requests several), at most
# max_tokens and the FINAL (fewer where the server's sender fell behind and joined tokens).
"$PROJECT_VENV/bin/python" - "$WORK/profile.json" "$MAX_TOKENS" <<'EOF'
import json, sys
profile = json.load(open(sys.argv[1]))
reqs = [r for exp in profile["experiments"] for r in exp["requests"]]
counts = sorted({len(r["response_timestamps"]) for r in reqs})
print(f"perf_analyzer.sh: {len(reqs)} requests, responses per request {counts}", file=sys.stderr)
if not reqs or min(counts) < 1 or not 2 <= max(counts) <= int(sys.argv[2]) + 1:
    sys.exit(f"expected 1 to {int(sys.argv[2]) + 1} responses per request, streamed, got {counts}")
EOF
echo "perf_analyzer.sh: OK"
