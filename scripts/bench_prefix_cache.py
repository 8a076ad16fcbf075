"""What the prefix cache saves: the same open-loop workload of prompts that share prefixes
(``multi-turn`` by default) against one server with the cache on and then with
``--no-prefix-cache``, same requests, same rate.

Per target (``llm``, ``llm_colocated``) and cache setting it prints TTFT p50 of first turns and
of later turns, TPOT p50, SLO attainment and the prefill side's hit rate (hits / queries from the
metrics port), then the ratio of later turns' TTFT p50, off / on. Writes each run's
``splitserve bench --json`` report and a summary under ``--out``.

  python scripts/bench_prefix_cache.py --model .cache/ckpt-100m --rate 2 --num-requests 80 \
      --out out/prefix_cache
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

SPLITSERVE = Path(sys.executable).with_name("splitserve")
PORTS = {"http": 18700, "grpc": 18701, "metrics": 18702}
PREFILLERS = {"llm": "prefill", "llm_colocated": "llm_colocated"}
"""Which model computes the prompts of each target (its prefix cache counts)."""


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def counters(names: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Sums over instances of the named ``splitserve_*`` samples, by (name, model)."""
    url = f"http://127.0.0.1:{PORTS['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[tuple[str, str], float] = defaultdict(float)
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names:
            model = rest.split('model="', 1)[1].split('"', 1)[0]
            out[(name, model)] += float(line.rsplit(" ", 1)[1])
    return out


def serve(args: argparse.Namespace, cache: bool, log: Path) -> subprocess.Popen[bytes]:
    flags = [
        "serve", "--model", args.model, "--layout", "both", "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
        "--http-port", str(PORTS["http"]), "--grpc-port", str(PORTS["grpc"]),
        "--metrics-port", str(PORTS["metrics"]),
        "--prefix-cache" if cache else "--no-prefix-cache",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen([str(SPLITSERVE), *flags], stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while not ready(f"http://127.0.0.1:{PORTS['http']}/v2/health/ready"):
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start: {log}")
        time.sleep(1)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summarize(run: dict[str, Any]) -> dict[str, float]:
    reqs = [r for r in run["requests"] if r["error"] is None]
    first = [r["ttft"] for r in reqs if r["turn"] == 0]
    later = [r["ttft"] for r in reqs if r["turn"] > 0]
    return {
        "ttft_first_p50": statistics.median(first) if first else float("nan"),
        "ttft_later_p50": statistics.median(later) if later else float("nan"),
        "tpot_p50": run["tpot_p50"],
        "attainment": run["attainment"],
        "errors": run["errors"],
        "later_turns": len(later),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".cache/ckpt-100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--workload", default="multi-turn")
    ap.add_argument("--rate", type=float, default=2.0, help="requests (turns) per second")
    ap.add_argument("--num-requests", type=int, default=80)
    ap.add_argument("--targets", default="llm,llm_colocated")
    ap.add_argument("--ttft-slo", type=float, default=3.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=Path("out/prefix_cache"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    targets = args.targets.split(",")
    names = ("splitserve_prefix_cache_queries_total", "splitserve_prefix_cache_hits_total")
    summary: dict[str, dict[str, Any]] = {}
    for cache in (True, False):
        label = "on" if cache else "off"
        proc = serve(args, cache, args.out / f"serve-{label}.log")
        try:
            for target in targets:
                before = counters(names)
                report = args.out / f"{target}-{label}.json"
                bench = [
                    "bench", "--url", f"127.0.0.1:{PORTS['grpc']}", "--target", target,
                    "--workload", args.workload, "--tokenizer", args.model,
                    "--max-model-len", str(args.max_model_len), "--rate", str(args.rate),
                    "--num-requests", str(args.num_requests), "--ttft-slo", str(args.ttft_slo),
                    "--tpot-slo", str(args.tpot_slo), "--json", str(report), "--no-progress",
                ]  # fmt: skip
                subprocess.run([str(SPLITSERVE), *bench], check=True, env=os.environ)
                time.sleep(1)  # a metrics refresh
                after = counters(names)
                model = PREFILLERS[target]
                queries = after[(names[0], model)] - before[(names[0], model)]
                hits = after[(names[1], model)] - before[(names[1], model)]
                (run,) = json.loads(report.read_text())["runs"]
                row = {**summarize(run), "hit_rate": hits / queries if queries else 0.0}
                summary[f"{target} cache {label}"] = row
                first, later = row["ttft_first_p50"] * 1e3, row["ttft_later_p50"] * 1e3
                print(
                    f"{target:>14} cache {label:>3}: TTFT p50 first {first:7.1f} ms, later "
                    f"{later:7.1f} ms; TPOT p50 "
                    f"{row['tpot_p50'] * 1e3:6.1f} ms; attainment {row['attainment']:.2f}; "
                    f"hit rate {row['hit_rate']:.2f}; errors {row['errors']}",
                    flush=True,
                )
        finally:
            stop(proc)
    for target in targets:
        on, off = summary[f"{target} cache on"], summary[f"{target} cache off"]
        ratio = off["ttft_later_p50"] / on["ttft_later_p50"]
        summary[f"{target} later-turn TTFT p50 off / on"] = {"ratio": ratio}
        print(f"{target:>14}: later turns' TTFT p50, cache off / on = {ratio:.2f}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
