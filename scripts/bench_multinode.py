"""What the KV transfer adds through real servers on two "nodes": a prefill server and a decode
server (`splitserve serve --role ...`) in two network namespaces (tests/integration/netns.py),
NIXL over TCP only, the link between them limited by tc.

Per link rate and prompt length (exact token counts, 100m checkpoint in bfloat16 by default),
prompts are sent one at a time from inside the decode node; printed: TTFT and the time from the
first to the second token (medians), and the decode server's own handoff time per request
(``splitserve_kv_handoff_seconds_total`` / ``..._handoffs_total``). The first token streams
before the pull, so the transfer shows up between the first and second tokens. With
``--stall``, a greedy stream runs meanwhile and the script prints its longest gap between tokens
while each prompt's KV crosses (what a pull costs the other streams), against its median gap.
Needs root.

Run: python scripts/bench_multinode.py [--model 100m] [--rates 1,10,unlimited] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import CACHE, exact_prompts, tokenizer_for
from link_ceiling import netns, parse_rates  # link_ceiling finds tests/integration/netns.py

from splitserve.testing.checkpoints import PRESETS, write_random_checkpoint

CLIENT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "multinode_client.py"
SPLITSERVE = Path(sys.executable).with_name("splitserve")
LENGTHS = (128, 1024, 4096)
MAX_MODEL_LEN = 4352


def checkpoint(name: str) -> str:
    """The preset with room for a 4k prompt (the presets' own context is 2k), under .cache/."""
    out = CACHE / f"ckpt-{name}-4k"
    if not (out / "config.json").is_file():
        write_random_checkpoint(
            out, **PRESETS[name], tokenizer="bpe", max_position_embeddings=MAX_MODEL_LEN
        )
    return str(out)


def run_client(node: netns.Node, *args: str) -> Any:
    done = node.run([sys.executable, str(CLIENT), *args], timeout=600)
    return json.loads(done.stdout)


def handoff_counters(node: netns.Node) -> tuple[float, float]:
    values = run_client(node, "gauges", "http://127.0.0.1:8002/metrics")
    return (
        values["splitserve_kv_handoff_seconds_total|llm"],
        values["splitserve_kv_handoffs_total|llm"],
    )


def start(node: netns.Node, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "UCX_TLS": "tcp"}
    with log.open("wb") as out:
        proc = node.popen([str(SPLITSERVE), "serve", *args], env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while not run_client(node, "ready", "http://127.0.0.1:8000"):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{node.name} did not start: {log}")
        time.sleep(2)
    return proc


def stall_row(
    decode: netns.Node, tokenizer: Any, rate: float | None, repeats: int, work: Path
) -> dict[str, Any]:
    length = max(LENGTHS)
    path = work / "stall-prompts.json"
    path.write_text(json.dumps(exact_prompts(tokenizer, repeats, length)))
    got = run_client(decode, "stall", "127.0.0.1:8001", "A stream that keeps going", str(path))
    row = {
        "rate_gbit": rate,
        "stall_tokens": length,
        "stall_s": statistics.median(got["stall"]),
        "median_gap_s": got["median_gap"],
        "handoff_window_s": statistics.median(got["handoff_window"]),
    }
    label = "unlimited" if rate is None else f"{rate:g} Gbit/s"
    print(
        f"link {label:>10}  a stream's longest gap while {length}-token prompts' KV crosses: "
        f"{row['stall_s'] * 1e3:7.1f} ms (its median gap {row['median_gap_s'] * 1e3:5.1f} ms; "
        f"first->second of the prompts {row['handoff_window_s'] * 1e3:7.1f} ms)",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="1,10,unlimited")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kv-transfer-dtype", default="auto", help="the prefill server's (auto or fp8)"
    )
    ap.add_argument(
        "--stall",
        action="store_true",
        help="also: a stream's longest token gap while 4k-token prompts are handed over",
    )
    args = ap.parse_args()
    if (reason := netns.available()) is not None:
        sys.exit(f"bench_multinode: {reason}")
    model = checkpoint(args.model)
    tokenizer = tokenizer_for(model)
    work = Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    key = work / "handle.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    common = ["--model", model, "--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN),
              "--key-file", str(key)]  # fmt: skip
    rows: list[dict[str, Any]] = []
    with netns.Cluster(("prefill0", "decode")) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        servers = [
            start(prefill, [*common, "--role", "prefill", "--advertise-host", prefill.address,
                            "--kv-transfer-dtype", args.kv_transfer_dtype], work / "prefill.log"),
            start(decode, [*common, "--role", "decode", "--advertise-host", decode.address,
                           f"--prefill-url={prefill.address}:8001"], work / "decode.log"),
        ]  # fmt: skip
        try:
            for rate in parse_rates(args.rates):
                for node in cluster:
                    netns.set_rate(node, rate)
                for length in LENGTHS:
                    prompts = exact_prompts(tokenizer, args.repeats + 1, length)
                    path = work / f"prompts-{length}.json"
                    path.write_text(json.dumps(prompts))
                    before = handoff_counters(decode)
                    stamps = run_client(decode, "timing", "127.0.0.1:8001", str(path))[1:]
                    after = handoff_counters(decode)
                    handoff = (after[0] - before[0]) / max(after[1] - before[1], 1)
                    row = {
                        "rate_gbit": rate,
                        "tokens": length,
                        "ttft_s": statistics.median(t[0] for t in stamps),
                        "second_token_s": statistics.median(t[1] - t[0] for t in stamps),
                        "handoff_s": handoff,
                    }
                    rows.append(row)
                    label = "unlimited" if rate is None else f"{rate:g} Gbit/s"
                    print(
                        f"link {label:>10}  {length:5d} tokens  TTFT {row['ttft_s'] * 1e3:8.1f} "
                        f"ms  first->second {row['second_token_s'] * 1e3:7.1f} ms  "
                        f"handoff {handoff * 1e3:7.1f} ms",
                        flush=True,
                    )
                if args.stall:
                    rows.append(stall_row(decode, tokenizer, rate, args.repeats, work))
        finally:
            for proc in servers:
                proc.terminate()
                proc.wait(60)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
