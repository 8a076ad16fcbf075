"""Goodput across two "nodes", the KV transfer modes side by side: a prefill server and a decode
server (`splitserve serve --role ...`) in two network namespaces (tests/integration/netns.py),
NIXL over TCP, the link between them limited by tc (1 Gbit/s by default).

Both servers are restarted per transfer mode (``whole``: KV after the pass, ``layerwise``:
streamed by layer during it, ``push``: written by prefill into blocks decode reserved, as each
layer is; ``-fp8``: fp8-encoded). Per mode and workload, `splitserve bench --goodput` runs against
``llm`` from inside the decode namespace (open loop, the workload's length mix). Both servers
share this machine's cores: prefill computes on ``--prefill-cores`` (default 0), decode on
``--decode-cores`` (default 1), the split `llm` uses on one server. Printed: a table per workload
(goodput, TTFT and TPOT percentiles at the goodput, the decode server's handoff seconds per
request over the whole search); written under ``--out``: each run's report, ``summary.json`` and
``goodput_<workload>.png`` (attainment vs rate, one curve per mode). Needs root.

Run: python scripts/bench_goodput_multinode.py --out out/goodput_multinode [--rate-gbit 1]
     [--modes whole,layerwise,layerwise-fp8,push] [--workloads chatbot,summarization]
     [-- <extra `splitserve bench` flags, e.g. --max-probes 4 --ttft-slo 3 --tpot-slo 0.1>]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import checkpoint
from bench_multinode import MODES, SPLITSERVE, counters, per_event, server_args, serving
from link_ceiling import exit_on_sigterm, netns

MAX_MODEL_LEN = 2048
HANDOFF = ("kv_handoff_seconds_total", "kv_handoffs_total")
WORKLOAD_FLAGS = {
    "chatbot": ["--num-requests", "80", "--rate-min", "1.5", "--rate-max", "12"],
    "summarization": ["--num-requests", "30", "--rate-min", "0.3", "--rate-max", "2.4"],
}
"""Requests per probe and where each workload's search starts and stops on a 2-core machine
(overridable after ``--``): a summarization probe at 0.3 req/s lasts 100 s."""


def bench(
    decode: netns.Node, model: str, workload: str, report: Path, extra: list[str]
) -> dict[str, Any]:
    """One `splitserve bench --goodput` run from inside the decode namespace; its summary."""
    argv = [str(SPLITSERVE), "bench", "--url", "127.0.0.1:8001", "--target", "llm",
            "--workload", workload, "--tokenizer", model, "--max-model-len", str(MAX_MODEL_LEN),
            "--arrival", "poisson", "--goodput", "--json", str(report),
            *WORKLOAD_FLAGS.get(workload, []), *extra]  # fmt: skip
    done = decode.run(argv, timeout=None, check=False, capture_output=False)
    if done.returncode != 0:
        sys.exit(f"splitserve bench {workload} failed (exit {done.returncode})")
    summary: dict[str, Any] = json.loads(report.read_text())["summary"][0]
    return summary


def table(workload: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{workload}: goodput of `llm` across the link, per transfer mode")
    print(f"{'mode':>14} {'goodput':>8} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17} "
          f"{'handoff ms':>10}")  # fmt: skip
    for row in rows:
        s = row["summary"]
        goodput = "-" if s["goodput_rps"] is None else f"{s['goodput_rps']:.3g}"

        def ms(key: str, s: dict[str, Any] = s) -> str:
            return "nan" if s[key] is None else f"{s[key] * 1e3:.0f}"

        print(
            f"{row['mode']:>14} {goodput:>8} {ms('ttft_p50'):>8}/{ms('ttft_p99'):<8} "
            f"{ms('tpot_p50'):>8}/{ms('tpot_p99'):<8} {row['handoff_s'] * 1e3:10.1f}",
            flush=True,
        )


def plot(workload: str, rows: list[dict[str, Any]], out: Path) -> None:
    """Attainment vs rate, one curve per mode, from the runs' reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    slo: dict[str, float] = {}
    for row in rows:
        report = json.loads(Path(row["report"]).read_text())
        slo = report["slo"]
        probes = sorted((r["rate"], r["attainment"]) for r in report["runs"])
        ax.plot([p[0] for p in probes], [p[1] for p in probes], "o-", label=row["mode"])
    if slo:
        ax.axhline(slo["attainment"], color="grey", ls="--", lw=1)
    ax.set(
        xlabel="rate (req/s)",
        ylabel="SLO attainment",
        ylim=(-0.02, 1.02),
        title=f"{workload} across two namespaces, per KV transfer mode",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"goodput_{workload}.png", dpi=120)
    plt.close(fig)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rate-gbit", type=float, default=1.0)
    ap.add_argument("--modes", default="whole,layerwise,layerwise-fp8", help=f"of {list(MODES)}")
    ap.add_argument("--workloads", default="chatbot,summarization")
    ap.add_argument("--prefill-cores", default="0")
    ap.add_argument("--decode-cores", default="1")
    args = ap.parse_args(argv)
    modes, workloads = args.modes.split(","), args.workloads.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"bench_goodput_multinode: unknown modes {unknown} (of {list(MODES)})")
    if (reason := netns.available()) is not None:
        sys.exit(f"bench_goodput_multinode: {reason}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    model = checkpoint(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-multinode-"))
    common = server_args(model, args.dtype, MAX_MODEL_LEN, work)
    rows: dict[str, list[dict[str, Any]]] = {w: [] for w in workloads}
    with netns.Cluster(("prefill0", "decode")) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        for node in cluster:
            netns.set_rate(node, args.rate_gbit)
        decode_args = [*common, "--role", "decode", "--decode-cores", args.decode_cores,
                       "--advertise-host", decode.address,
                       f"--prefill-url={prefill.address}:8001"]  # fmt: skip
        for mode in modes:
            print(f"\n== {mode} (both servers restarted) ==", flush=True)
            prefill_flags, decode_flags = MODES[mode]
            with serving(decode, [*decode_args, *decode_flags], work / f"decode-{mode}.log"), \
                 serving(prefill, [*common, "--role", "prefill", "--prefill-cores",
                                   args.prefill_cores, "--advertise-host", prefill.address,
                                   *prefill_flags], work / f"prefill-{mode}.log"):  # fmt: skip
                for workload in workloads:
                    print(f"-- {workload}, {mode}", flush=True)
                    report = args.out / f"{workload}-{mode}.json"
                    before = counters(decode, "llm", *HANDOFF)
                    summary = bench(decode, model, workload, report, extra)
                    after = counters(decode, "llm", *HANDOFF)
                    rows[workload].append({
                        "mode": mode,
                        "rate_gbit": args.rate_gbit,
                        "summary": summary,
                        "handoff_s": per_event(before, after),
                        "report": str(report),
                    })  # fmt: skip
    for workload, got in rows.items():
        table(workload, got)
        plot(workload, got, args.out)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
