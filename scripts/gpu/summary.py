"""The summary table of scripts/gpu_check.sh, from the JSON files its steps wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HANDOFF_TARGET = 0.8


def _load(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rows(out: Path) -> list[tuple[str, str, str]]:
    status = dict(
        line.split("\t", 1) for line in (out / "status.tsv").read_text().splitlines() if line
    )
    table = [(step, state, "") for step, state in status.items()]
    handoff = _load(out / "handoff.json")
    if isinstance(handoff, dict):
        ratio = handoff["fetch_vs_copy"]
        verdict = "meets" if ratio >= HANDOFF_TARGET else "below"
        table.append(
            (
                "handoff 1 GPU, 2 processes",
                f"{handoff['fetch_gbps']:.0f} GB/s vs d2d {handoff['d2d_copy_gbps']:.0f} GB/s",
                f"ratio {ratio:.2f} ({verdict} {HANDOFF_TARGET}), data ok: {handoff['data_ok']}",
            )
        )
    decode = _load(out / "decode.json")
    if isinstance(decode, list):
        for r in decode:
            table.append(
                (
                    f"decode step, {r['kernels']}, batch {r['batch']}",
                    f"{r['step_ms']:.2f} ms (floor {r['roofline_ms']:.2f} ms)",
                    f"{100 * r['fraction_of_roofline']:.0f}% of HBM roofline, "
                    f"{r['tokens_per_s']:.0f} tok/s",
                )
            )
    return table


def main() -> None:
    out = Path(sys.argv[1])
    table = [("check", "result", "detail"), *rows(out)]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    for n, row in enumerate(table):
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("-+-".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
