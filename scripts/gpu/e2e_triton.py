"""End to end on GPUs: ``splitserve serve --device gpu`` (disagg, prefill and decode on one GPU,
two stub processes, CUDA IPC handoff), then one HTTP generate request; writes JSON (``--out``)."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from splitserve.deploy.launcher import free_ports
from splitserve.deploy.serve import ServeOptions, build_spec, start_server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    http, grpc, metrics = free_ports(3)
    opts = ServeOptions(
        model="tiny",
        layout="disagg",
        device="gpu",
        prefill_gpus=args.gpus,
        decode_gpus=args.gpus,
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        host="127.0.0.1",
    )
    server = start_server(build_spec(opts))
    result: dict[str, object] = {"ok": False}
    try:
        body = json.dumps(
            {"text_input": "Hello", "max_tokens": 32, "exclude_input_in_output": True}
        ).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/llm/generate", body)
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        result = {
            "ok": bool(answer.get("text_output")),
            "latency_s": time.perf_counter() - start,
            "answer": answer,
        }
    finally:
        server.stop()
        result["log_tail"] = server.log_tail()[-4000:]
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}))


if __name__ == "__main__":
    main()
