"""Added TTFT and per-token time of the OpenAI-compatible frontend vs gRPC straight to Triton.

One Triton server (`llm`, disaggregated) and the frontend in a process of its own
(`python -m splitserve.openai`), as deployed. The same prompts go both ways,
interleaved wave by wave (the order flips every wave), greedy with EOS ignored, so both paths
produce the same tokens; the script checks that they do. Per-token time is
(last token - first token) / (output tokens - 1). Medians over requests.
Run: python scripts/bench_openai.py --model tiny --model 100m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import tritonclient.grpc.aio as grpcaio
from bench_common import checkpoint, exact_prompts, loopback, tokenizer_for

from splitserve.deploy.serve import start_server
from splitserve_client.generate import GenerateArgs
from splitserve_client.stream import RequestRecord, stream_generate
from splitserve_tools.bench.openai_target import OpenAITarget

NAME = "bench"
PATHS = ("grpc", "openai")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def per_token(record: RequestRecord) -> float:
    if len(record.token_times) < 2 or record.output_tokens < 2:
        return float("nan")
    return (record.token_times[-1] - record.token_times[0]) / (record.output_tokens - 1)


def start_frontend(grpc_url: str, port: int, model_dir: str | None) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "splitserve.openai",
        "--triton-url",
        grpc_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        NAME,
    ]
    if model_dir is not None:
        cmd += ["--model-dir", model_dir]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("the OpenAI frontend did not become healthy")


async def run_waves(
    grpc_url: str, base_url: str, prompts: list[str], concurrency: int, output_len: int
) -> dict[str, list[RequestRecord]]:
    client = grpcaio.InferenceServerClient(grpc_url)
    target = OpenAITarget(base_url, NAME)

    async def one(path: str, prompt: str) -> RequestRecord:
        if path == "grpc":
            args = GenerateArgs(prompt, grpc_url, "llm", True, output_len, ignore_eos=True)
            return await stream_generate(client, args)
        return await target.generate(prompt, output_len)

    records: dict[str, list[RequestRecord]] = {path: [] for path in PATHS}
    try:
        for wave, start in enumerate(range(0, len(prompts), concurrency)):
            batch = prompts[start : start + concurrency]
            for path in PATHS if wave % 2 == 0 else PATHS[::-1]:
                records[path] += await asyncio.gather(*(one(path, p) for p in batch))
    finally:
        await client.close()
        await target.close()
    for path, recs in records.items():
        errors = [r.error for r in recs if r.error]
        if errors:
            raise RuntimeError(f"{path}: {len(errors)} requests failed, e.g. {errors[0]}")
    return records


def summarize(
    name: str, concurrency: int, records: dict[str, list[RequestRecord]], output_len: int
) -> dict[str, Any]:
    grpc, api = records["grpc"], records["openai"]
    same = sum(a.text == b.text for a, b in zip(grpc, api, strict=True))
    counts = {r.output_tokens for r in grpc + api}
    if counts != {output_len}:
        raise RuntimeError(f"output lengths {counts}, expected {output_len}")
    row: dict[str, Any] = {"model": name, "concurrency": concurrency, "requests": len(api)}
    for path, recs in records.items():
        row[f"{path}_ttft_ms"] = 1e3 * median([r.ttft for r in recs])
        row[f"{path}_tpot_ms"] = 1e3 * median([per_token(r) for r in recs])
    row["same_text"] = f"{same}/{len(api)}"
    return row


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = checkpoint(name)
    sizes = [args.waves * c for c in args.concurrencies]
    prompts = exact_prompts(tokenizer_for(model), max(sizes), args.prompt_len)
    port = args.base_port
    opts = loopback(model, "disagg", port, {"max_model_len": str(args.max_model_len)})
    server = start_server(opts)
    frontend = None
    rows = []
    try:
        frontend = start_frontend(server.grpc_url, port + 3, None if name == "tiny" else model)
        base_url = f"http://127.0.0.1:{port + 3}/v1"
        warm = prompts[: max(args.concurrencies)]
        asyncio.run(run_waves(server.grpc_url, base_url, warm, len(warm), args.output_len))
        for c, size in zip(args.concurrencies, sizes, strict=True):
            records = asyncio.run(
                run_waves(server.grpc_url, base_url, prompts[:size], c, args.output_len)
            )
            rows.append(summarize(name, c, records, args.output_len))
    finally:
        if frontend is not None:
            frontend.terminate()
            frontend.wait(30)
        server.stop()
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':<7}{'conc':>5}{'n':>4}{'TTFT grpc':>11}{'TTFT api':>10}{'added':>8}{'ratio':>7}"
        f"{'TPOT grpc':>11}{'TPOT api':>10}{'added':>8}{'ratio':>7}{'same':>7}"
    )
    print("\n" + head + "\n" + " " * 16 + "(ms)" + " " * 44 + "(ms)")
    for r in rows:
        t_g, t_a = r["grpc_ttft_ms"], r["openai_ttft_ms"]
        p_g, p_a = r["grpc_tpot_ms"], r["openai_tpot_ms"]
        print(
            f"{r['model']:<7}{r['concurrency']:>5}{r['requests']:>4}"
            f"{t_g:>11.1f}{t_a:>10.1f}{t_a - t_g:>+8.1f}{t_a / t_g:>7.2f}"
            f"{p_g:>11.2f}{p_a:>10.2f}{p_a - p_g:>+8.2f}{p_a / p_g:>7.2f}{r['same_text']!s:>7}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", help="tiny or a preset (100m)")
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--waves", type=int, default=8, help="waves per concurrency and path")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--base-port", type=int, default=18200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [r for m in args.model or ["tiny"] for r in bench_model(m, args)]
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
