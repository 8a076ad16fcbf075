"""The planner's handoff model against the cross-node table: predicted vs measured time until
decode holds a prompt's KV, per transfer mode, link rate and prompt length.

Inputs, all from one sitting: a profile of the checkpoint (`splitserve plan profile`, the
prefill server's cores), the link's handoff rows (`scripts/bench_link.py --json`, raw and fp8
encodings at the table's rates) and the table itself (`scripts/bench_multinode.py --json`).
Per cell the planner prices what the simulator charges a lone request: the prompt pass (the
profile's prefill fit on ``--cores``), the serving overhead before the first token (the
profile's ``request_s``) and what loading the KV adds after the pass
(``StepModel.loaded_s``: the whole transfer, or for a streamed handoff what the pass did not
hide), with the link fitted to that rate and encoding. Measured: the pass (prefill's busy
seconds per pass), TTFT, and the added time (first-to-second token gap less a decode step).
Compared: "ready" = TTFT + added (for a push less its wait, which both count), the time at
which decode can run the request's first step; and "given the pass", the same prediction with
the served pass scaled to the cell's measured one, which splits a miss into the pass (the
machine's speed during the cell) and everything else the planner prices.

With ``--calibration``, the served pass (its factor over the profiled one, whole and while it
streams) and the time per request before the pass are first fitted to another such table
(``splitserve_tools.planner.served_pass``), which should share no prompt length with
``--bench``; ``--out-profile`` saves the profile so calibrated (for ``plan search``).

  python scripts/plan_handoff_validate.py --model .cache/ckpt-100m-4k --profile P.json \
      --link-json link.json --bench multinode.json [--calibration cal.json] [--cores 2] \
      [--json out.json] [--out-profile P2.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from splitserve.serving.serving_config import ServingConfig
from splitserve_tools.planner.fit import link_fit
from splitserve_tools.planner.placement import Role
from splitserve_tools.planner.profile import Profile
from splitserve_tools.planner.served_pass import Cell, fit_served_pass
from splitserve_tools.planner.simulate import step_model

TOLERANCE = 0.15


def predict(
    profile: Profile,
    link: list[dict[str, Any]],
    row: dict[str, Any],
    cores: int,
    layers: int,
    least: int,
    gap_s: float,
) -> dict[str, float]:
    """What the planner charges one request of ``row``'s cell, unloaded; prefill streamed
    prompts of ``least`` tokens and more, in runs of layers ``gap_s`` of pass apart."""
    encoding = "fp8" if row["mode"].endswith("fp8") else "raw"
    handoff = link_fit(link, row["rate_gbit"], encoding)
    if row["mode"].startswith(("layerwise", "push")):
        # Pushes move every prompt by layer.
        least = 0 if row["mode"].startswith("push") else least
        handoff = replace(
            handoff, stream_layers=layers, stream_min_tokens=least, stream_min_gap_s=gap_s
        )
    model = step_model(replace(profile, handoff=handoff), Role(1, cores))
    tokens = int(row["tokens"])
    pass_s = model.prompt_pass([tokens])
    added_s = model.loaded_s(-(-tokens // model.block_size))
    ttft_s = profile.serving.request_s + pass_s
    return {"pass_s": pass_s, "ttft_s": ttft_s, "added_s": added_s, "ready_s": ttft_s + added_s}


def calibrated(profile: Profile, rows: list[dict[str, Any]], cores: int, least: int) -> Profile:
    cells = [Cell.from_row(r, least) for r in rows if "tokens" in r]
    serving = fit_served_pass(profile.serving, profile.unit(cores).prefill, cells)
    print(
        f"calibrated on {len(cells)} cells ({sorted({c.tokens for c in cells})} tokens): a "
        f"served pass {serving.pass_factor:.3f}x the profiled one, "
        f"{serving.stream_pass_factor:.3f}x that while it streams; "
        f"{serving.request_s * 1e3:.1f} ms per request before the pass"
    )
    return replace(profile, serving=serving)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the checkpoint (its layer count)")
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--link-json", type=Path, required=True)
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--calibration", type=Path, help="a bench_multinode.py table to fit to")
    ap.add_argument("--cores", type=int, default=2, help="the prefill server's cores")
    ap.add_argument(
        "--kv-stream-min-tokens",
        type=int,
        default=ServingConfig.kv_stream_min_tokens,
        help="the tables' prefill servers' kv_stream_min_tokens (bench_multinode.py "
        "--prefill-param; default the server's)",
    )
    ap.add_argument(
        "--kv-stream-min-gap-s",
        type=float,
        default=ServingConfig.kv_stream_min_gap_s,
        help="the tables' prefill servers' kv_stream_min_gap_s (default the server's)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--out-profile", type=Path, help="save the calibrated profile here")
    args = ap.parse_args()
    layers = int(json.loads((args.model / "config.json").read_text())["num_hidden_layers"])
    profile = Profile.load(args.profile)
    if args.calibration:
        table = json.loads(args.calibration.read_text())
        profile = calibrated(profile, table, args.cores, args.kv_stream_min_tokens)
        if args.out_profile:
            profile.save(args.out_profile)
    link = json.loads(args.link_json.read_text())
    rows = [r for r in json.loads(args.bench.read_text()) if "tokens" in r]
    print(
        f"{'mode':>13} {'link':>9} {'tokens':>6}  {'pass ms (pred/meas)':>19}  "
        f"{'added ms (pred/meas)':>20}  {'ready ms (pred/meas)':>20}  ready pred/meas  "
        "given the pass"
    )
    out = []
    for row in rows:
        pred = predict(
            profile, link, row, args.cores, layers, args.kv_stream_min_tokens,
            args.kv_stream_min_gap_s,
        )  # fmt: skip
        # A push's wait for its last WRITEs is in its TTFT and in its added time alike.
        ready = row["ttft_s"] + row["added_s"] - row.get("push_wait_s", 0.0)
        ratio = pred["ready_s"] / ready
        # The same prediction with the served pass scaled to the one this cell measured (what
        # streaming hides depends on it too): the host's speed during the cell moves its pass
        # (BENCHMARKS.md, "How steady the machine is"), not the rest of what is priced.
        scale = row["pass_s"] / pred["pass_s"]
        serving = replace(profile.serving, pass_factor=profile.serving.pass_factor * scale)
        on_pass = predict(
            replace(profile, serving=serving), link, row, args.cores, layers,
            args.kv_stream_min_tokens, args.kv_stream_min_gap_s,
        )  # fmt: skip
        given = on_pass["ready_s"] / ready
        rate = "unlimited" if row["rate_gbit"] is None else f"{row['rate_gbit']:g} Gb/s"
        print(
            f"{row['mode']:>13} {rate:>9} {row['tokens']:>6}  "
            f"{pred['pass_s'] * 1e3:8.1f} / {row['pass_s'] * 1e3:8.1f}  "
            f"{pred['added_s'] * 1e3:9.1f} / {row['added_s'] * 1e3:8.1f}  "
            f"{pred['ready_s'] * 1e3:9.1f} / {ready * 1e3:8.1f}  {ratio:6.3f}  {given:13.3f}",
            flush=True,
        )
        out.append(
            {
                **row,
                "predicted": pred,
                "ready_s": ready,
                "ready_ratio": ratio,
                "given_pass": given,
                "pass_ratio": pred["pass_s"] / row["pass_s"],
                "predicted_on_pass": on_pass,
            }
        )
    for key, what in (
        ("ready_ratio", "ready time"),
        ("given_pass", "ready time given the measured pass"),
        ("pass_ratio", "the pass alone"),
    ):
        errors = [abs(r[key] - 1) for r in out]
        within = sum(e <= TOLERANCE for e in errors)
        print(
            f"{what} within {TOLERANCE:.0%}: {within} of {len(out)} cells; error median "
            f"{statistics.median(errors):.1%}, worst {max(errors):.1%}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
