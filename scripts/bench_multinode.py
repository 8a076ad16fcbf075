"""What the KV transfer adds to TTFT through real servers on two "nodes": a prefill server and a
decode server (`splitserve serve --role ...`) in two network namespaces
(tests/integration/netns.py), NIXL over TCP only, the link between them limited by tc.

Per transfer mode (a pair of servers for each: ``whole`` hands the KV over after the pass,
``layerwise`` streams it by layer during the pass (decode pulls what prefill announces),
``push`` has prefill WRITE its layers, as written, into blocks decode reserved (both in runs of
layers: ``--prefill-param kv_stream_min_gap_s=0`` for each layer alone), ``-fp8`` adds the fp8
encoding), link rate and prompt length (exact token counts, 100m checkpoint in bfloat16 by
default), prompts are sent one at a time from inside the decode node. The first token streams
as soon as prefill samples it; decoding starts once the KV is in, so what the transfer adds to
the time a user waits is the first-to-second token gap less one decode step (the median gap
between the request's later tokens; it asks for 8). A push's first token waits for its KV: for
``push`` the added time also counts the mean time prefill's answers waited for their last
WRITEs after the pass. Printed per cell: the prompt pass (prefill's own busy seconds per pass),
TTFT, the added time and its fraction of the pass, *ready* (when decode could run the
request's first step: the second token less a step; medians), and the decode server's handoff
time per request (the time in its READs; none for ``push``); at the end, with ``whole`` among
the modes, each other cell's ready time over whole's (streaming's honest gain: a pass it
lengthened counts against it). With ``--stall``, a greedy stream
runs meanwhile and the script prints its longest gap between tokens while each prompt's KV
crosses. By default each mode's pair runs alone, one mode after another; with
``--interleave`` every mode's pair is up at once (ports 8000 + 10 i) and each cell sends its
prompts in turns across the modes, so that the host's speed, which varies from second to second
on a shared machine (BENCHMARKS.md, "How steady the machine is"), weighs on every mode alike;
with ``--rounds N`` the whole grid is taken N times, ``--repeats`` prompts per cell each time,
and each cell's numbers are over all of its rounds (its slow and fast stretches alike).
Needs root.

Run: python scripts/bench_multinode.py [--model 100m] [--rates 1,10,0.05] [--repeats 5]
     [--modes whole,layerwise,layerwise-fp8,push,push-fp8] [--lengths 128,1024,4096]
     [--split-cores] [--interleave] [--rounds N]
     [--prefill-param KEY=VALUE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import CACHE, exact_prompts, tokenizer_for
from link_ceiling import netns, parse_rates  # link_ceiling finds tests/integration/netns.py

from splitserve.testing.checkpoints import PRESETS, write_random_checkpoint

CLIENT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "multinode_client.py"
SPLITSERVE = Path(sys.executable).with_name("splitserve")
LENGTHS = (128, 1024, 4096)
MAX_MODEL_LEN = 4352
TOKENS = 8
"""Tokens per timed request: the gaps after the second give its decode step."""
FP8 = ["--kv-transfer-dtype", "fp8"]
MODES = {
    "whole": (["--no-kv-stream-layers"], []),
    "whole-fp8": (["--no-kv-stream-layers", *FP8], []),
    "layerwise": (["--kv-stream-layers"], []),
    "layerwise-fp8": (["--kv-stream-layers", *FP8], []),
    "push": (["--no-kv-stream-layers"], ["--kv-push"]),
    "push-fp8": (["--no-kv-stream-layers", *FP8], ["--kv-push", *FP8]),
}
"""The prefill and decode servers' flags of each transfer mode."""


def checkpoint(name: str) -> str:
    """The preset with room for a 4k prompt (the presets' own context is 2k), under .cache/."""
    out = CACHE / f"ckpt-{name}-4k"
    if not (out / "config.json").is_file():
        write_random_checkpoint(
            out, **PRESETS[name], tokenizer="bpe", max_position_embeddings=MAX_MODEL_LEN
        )
    return str(out)


def run_client(node: netns.Node, *args: str) -> Any:
    done = node.run([sys.executable, str(CLIENT), *args], timeout=600, check=False)
    if done.returncode != 0:
        sys.exit(f"client {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


@dataclass(frozen=True)
class Pair:
    """One mode's prefill and decode servers, each in its node on the same ports."""

    mode: str
    http: int

    @property
    def grpc(self) -> int:
        return self.http + 1

    @property
    def metrics(self) -> int:
        return self.http + 2

    def ports(self) -> list[str]:
        return ["--http-port", str(self.http), "--grpc-port", str(self.grpc),
                "--metrics-port", str(self.metrics)]  # fmt: skip


DEFAULT_PAIR = Pair("", 8000)
"""The ports of ``splitserve serve``'s defaults (the other scripts' servers)."""


def counters(node: netns.Node, model: str, *names: str, pair: Pair = DEFAULT_PAIR) -> list[float]:
    values = run_client(node, "gauges", f"http://127.0.0.1:{pair.metrics}/metrics")
    return [values.get(f"splitserve_{name}|{model}", 0.0) for name in names]


def per_event(before: list[float], after: list[float]) -> float:
    """(seconds after - before) / (events after - before)."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1)


def server_args(model: str, dtype: str, max_model_len: int, work: Path) -> list[str]:
    """The flags both servers share, with a fresh handle key under ``work``."""
    key = work / "handle.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    return ["--model", model, "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--key-file", str(key)]  # fmt: skip


@contextmanager
def serving(
    node: netns.Node,
    args: list[str],
    log: Path,
    cores: str | None = None,
    pair: Pair = DEFAULT_PAIR,
) -> Iterator[None]:
    """`splitserve serve ARGS` in ``node``, ready, for the ``with`` block; stopped after it.
    With ``cores``, the whole server (every thread it makes) runs on those cores only."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    pin = ["taskset", "-c", cores] if cores else []
    with log.open("wb") as out:
        proc = node.popen([*pin, str(SPLITSERVE), "serve", *args, *pair.ports()], env=env,
                          stdout=out, stderr=out)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not run_client(node, "ready", f"http://127.0.0.1:{pair.http}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{node.name} did not start: {log}")
            time.sleep(2)
        yield
    finally:
        proc.terminate()
        proc.wait(60)


def stall_row(decode: netns.Node, pair: Pair, rate: float | None, prompts: Path) -> dict[str, Any]:
    length = max(LENGTHS)
    url = f"127.0.0.1:{pair.grpc}"
    got = run_client(decode, "stall", url, "A stream that keeps going", str(prompts))
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


Counts = tuple[list[float], list[float], list[float]]
"""A pair's counters: prefill's busy seconds and passes, decode's handoff seconds and
handoffs, prefill's push wait seconds and pushes."""


def read(cluster: netns.Cluster, pair: Pair) -> Counts:
    prefill, decode = cluster["prefill0"], cluster["decode"]
    return (
        counters(prefill, "prefill", "engine_busy_seconds_total", "engine_steps_total", pair=pair),
        counters(decode, "llm", "kv_handoff_seconds_total", "kv_handoffs_total", pair=pair),
        counters(
            prefill, "prefill", "kv_push_wait_seconds_total", "kv_pushes_sent_total", pair=pair
        ),
    )


def send(cluster: netns.Cluster, pair: Pair, texts: list[str], path: Path) -> list[list[float]]:
    """Each prompt's token arrival times, the prompts sent one at a time from the decode node."""
    path.write_text(json.dumps(texts))
    return run_client(cluster["decode"], "timing", f"127.0.0.1:{pair.grpc}", str(path), str(TOKENS))


def cell_row(
    mode: str, rate: float | None, length: int, counts: Counts, stamps: list[list[float]]
) -> dict[str, Any]:
    """A cell's row from what its timed prompts added to the counters and their token times."""
    none = [0.0, 0.0]
    # A decode step: the median gap after the second token. One gap alone misleads: two
    # responses sometimes reach the client together, a gap of ~0.
    steps = [statistics.median(b - a for a, b in itertools.pairwise(t[1:])) for t in stamps]
    added = statistics.median(t[1] - t[0] - step for t, step in zip(stamps, steps, strict=True))
    # A push's answer (and so its first token) waits for its last WRITEs after the pass: that
    # wait is the transfer's share of the request's time (mean over the cell's pushes).
    push_wait = per_event(none, counts[2])
    added += push_wait
    pass_s = per_event(none, counts[0])
    # When decode could run the request's first step (the KV and the first token in), from the
    # request's start: comparable across modes, whichever token waits for the KV.
    ready = statistics.median(t[1] - step for t, step in zip(stamps, steps, strict=True))
    return {
        "mode": mode,
        "rate_gbit": rate,
        "tokens": length,
        "pass_s": pass_s,
        "ttft_s": statistics.median(t[0] for t in stamps),
        "second_token_s": statistics.median(t[1] - t[0] for t in stamps),
        "step_s": statistics.median(steps),
        "added_s": added,
        "added_of_pass": added / pass_s,
        "handoff_s": per_event(none, counts[1]),
        "push_wait_s": push_wait,
        "ready_s": ready,
    }


@dataclass
class Tally:
    """A cell's counter deltas and token times, summed over the rounds that measured it."""

    counts: Counts = field(default_factory=lambda: ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]))
    stamps: list[list[float]] = field(default_factory=list)

    def add(self, before: Counts, after: Counts, stamps: list[list[float]]) -> None:
        for total, b, a in zip(self.counts, before, after, strict=True):
            total[0] += a[0] - b[0]
            total[1] += a[1] - b[1]
        self.stamps += stamps

    def row(self, mode: str, rate: float | None, length: int) -> dict[str, Any]:
        return cell_row(mode, rate, length, self.counts, self.stamps)


def measure(
    cluster: netns.Cluster, pairs: list[Pair], prompts: Path, tallies: dict[str, Tally]
) -> None:
    """One cell per pair, the same prompts for each, added to the pair's tally. The first
    prompt warms the servers to the cell's length, outside the counters (the pass column is the
    timed prompts' own); the timed ones go in turns, one prompt per pair, starting at the next
    pair each turn."""
    warm, *timed = json.loads(prompts.read_text())
    for pair in pairs:
        send(cluster, pair, [warm], prompts.with_suffix(".warm.json"))
    before = {p.mode: read(cluster, p) for p in pairs}
    if len(pairs) == 1:  # all at once: one client for the cell
        stamps = {pairs[0].mode: send(cluster, pairs[0], timed, prompts.with_suffix(".timed.json"))}
    else:
        stamps = {p.mode: [] for p in pairs}
        for k, text in enumerate(timed):
            for pair in pairs[k % len(pairs) :] + pairs[: k % len(pairs)]:
                stamps[pair.mode] += send(cluster, pair, [text], prompts.with_suffix(f".{k}.json"))
    for pair in pairs:
        tallies[pair.mode].add(before[pair.mode], read(cluster, pair), stamps[pair.mode])


def report(row: dict[str, Any]) -> None:
    rate = row["rate_gbit"]
    label = "unlimited" if rate is None else f"{rate:g} Gbit/s"
    print(
        f"{row['mode']:>13}  link {label:>10}  {row['tokens']:5d} tokens  pass "
        f"{row['pass_s'] * 1e3:7.1f} ms  TTFT {row['ttft_s'] * 1e3:7.1f} ms  added "
        f"{row['added_s'] * 1e3:6.1f} ms = {row['added_of_pass']:6.1%} of the pass  "
        f"ready {row['ready_s'] * 1e3:7.1f} ms  (handoff {row['handoff_s'] * 1e3:6.1f} ms)",
        flush=True,
    )


def versus_whole(rows: list[dict[str, Any]]) -> None:
    """Per cell, the request's ready time over that of the same prompts handed over whole: what
    streaming or pushing gained, the pass it may have lengthened included."""
    cells = [r for r in rows if "mode" in r]  # not the --stall rows
    whole = {(r["rate_gbit"], r["tokens"]): r["ready_s"] for r in cells if r["mode"] == "whole"}
    for row in cells:
        key = (row["rate_gbit"], row["tokens"])
        if row["mode"] == "whole" or key not in whole:
            continue
        rate = "unlimited" if key[0] is None else f"{key[0]:g} Gbit/s"
        print(
            f"{row['mode']:>13}  link {rate:>10}  {row['tokens']:5d} tokens  ready "
            f"{row['ready_s'] / whole[key]:.3f}x whole's ({row['ready_s'] * 1e3:7.1f} / "
            f"{whole[key] * 1e3:7.1f} ms)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="1,10")
    ap.add_argument("--repeats", type=int, default=5, help="timed prompts per cell and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="passes over every rate and length, each cell's prompts taken in every one, so "
        "that each cell spans the whole run's stretches of the host",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", default="whole,layerwise,layerwise-fp8", help=f"of {list(MODES)}")
    ap.add_argument(
        "--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, in tokens"
    )
    ap.add_argument(
        "--split-cores",
        action="store_true",
        help="prefill on core 0, decode on core 1 (each server and every thread it makes), as on "
        "two hosts; default: both servers on every core",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="every mode's servers up at once, each cell's prompts sent in turns across the modes",
    )
    ap.add_argument(
        "--prefill-param",
        action="append",
        default=[],
        help="KEY=VALUE for the prefill servers (e.g. kv_stream_min_tokens=0)",
    )
    ap.add_argument(
        "--stall",
        action="store_true",
        help="also: a stream's longest token gap while 4k-token prompts are handed over",
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        sys.exit(f"bench_multinode: unknown modes {unknown} (of {list(MODES)})")
    if args.rounds < 1:
        sys.exit("bench_multinode: --rounds must be at least 1")
    if args.interleave and args.stall:
        sys.exit("bench_multinode: --stall runs with one mode's servers at a time")
    if (reason := netns.available()) is not None:
        sys.exit(f"bench_multinode: {reason}")
    model = checkpoint(args.model)
    tokenizer = tokenizer_for(model)
    work = Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    common = server_args(model, args.dtype, MAX_MODEL_LEN, work)
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) >= MAX_MODEL_LEN:
        sys.exit(f"bench_multinode: prompts must be shorter than {MAX_MODEL_LEN} tokens")
    seeds = itertools.count()

    def fresh_prompts(length: int) -> Path:
        """New prompts for every cell: none repeats a cached prefix of an earlier one."""
        seed = next(seeds)
        path = work / f"prompts-{seed}.json"
        texts = exact_prompts(tokenizer, args.repeats + 1, length, seed=seed)
        path.write_text(json.dumps(texts))
        return path

    rows: list[dict[str, Any]] = []
    with netns.Cluster(("prefill0", "decode")) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        # A 4k prompt's KV takes ~8 s at 0.05 Gbit/s: the transfer deadline (10 s) of a pull or
        # a push must not bind.
        decode_args = [*common, "--role", "decode", "--advertise-host", decode.address,
                       "--param", "kv_transfer_timeout_s=60"]  # fmt: skip
        prefill_args = [*common, "--role", "prefill", "--advertise-host", prefill.address,
                        "--param", "kv_transfer_timeout_s=60"]  # fmt: skip
        for item in args.prefill_param:
            prefill_args += ["--param", item]
        decode_cores = prefill_cores = None
        if args.split_cores:
            decode_cores, prefill_cores = "1", "0"
            decode_args += ["--decode-cores", "1", "--server-cores", "1"]
            prefill_args += ["--prefill-cores", "0", "--server-cores", "0"]
        pairs = [Pair(mode, 8000 + 10 * i if args.interleave else 8000) for i, mode in
                 enumerate(modes)]  # fmt: skip
        groups = [pairs] if args.interleave else [[p] for p in pairs]
        for group in groups:
            with ExitStack() as up:
                for pair in group:
                    prefill_flags, decode_flags = MODES[pair.mode]
                    to_prefill = f"--prefill-url={prefill.address}:{pair.grpc}"
                    up.enter_context(
                        serving(
                            decode,
                            [*decode_args, to_prefill, *decode_flags],
                            work / f"decode-{pair.mode}.log",
                            cores=decode_cores,
                            pair=pair,
                        )
                    )
                    up.enter_context(
                        serving(
                            prefill,
                            [*prefill_args, *prefill_flags],
                            work / f"prefill-{pair.mode}.log",
                            cores=prefill_cores,
                            pair=pair,
                        )
                    )
                tallies: dict[tuple[str, float | None, int], Tally] = {}
                for turn in range(1, args.rounds + 1):
                    for rate in parse_rates(args.rates):
                        for node in cluster:
                            netns.set_rate(node, rate)
                        for length in lengths:
                            cell = {
                                p.mode: tallies.setdefault((p.mode, rate, length), Tally())
                                for p in group
                            }
                            measure(cluster, group, fresh_prompts(length), cell)
                            if turn < args.rounds:
                                link = "unlimited" if rate is None else f"{rate:g} Gbit/s"
                                print(f"round {turn}: {link}, {length} tokens", flush=True)
                                continue
                            for pair in group:
                                rows.append(cell[pair.mode].row(pair.mode, rate, length))
                                report(rows[-1])
                        if args.stall and turn == args.rounds:
                            prompts = fresh_prompts(max(LENGTHS))
                            rows.append(stall_row(decode, group[0], rate, prompts))
    versus_whole(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
