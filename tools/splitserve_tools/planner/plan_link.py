"""``splitserve plan link serve|measure``: measure the KV handoff between two hosts, for
``plan search --link-json``."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path
from typing import Any


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected positive token counts like 128,1024, got {text!r}"
        )
    return values


def _key(args: argparse.Namespace) -> bytes:
    from splitserve.transport.key import load_key, read_key_file

    return read_key_file(args.key_file) if args.key_file else load_key()


def cmd_link_serve(args: argparse.Namespace) -> None:
    from splitserve.transport.nixl import default_advertise_host
    from splitserve_tools.planner.link_probe import LAYOUT, LinkOwner, model_layout

    layout = model_layout(args.model, args.dtype) if args.model else LAYOUT
    host = args.host or default_advertise_host()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with LinkOwner(
        _key(args),
        host,
        args.port,
        layout=layout,
        max_tokens=args.max_tokens,
        transfer_dtype=args.kv_transfer_dtype,
    ) as owner:
        print(
            f"link owner at {owner.address} ({layout.block_bytes // layout.block_size} bytes "
            "of KV per token); measure from the other host with",
            flush=True,
        )
        print(f"  splitserve plan link measure {owner.address} --out link.json", flush=True)
        owner.serve(stop)
        print(f"served {owner.served} handoffs")


def cmd_link_measure(args: argparse.Namespace) -> None:
    from splitserve_tools.planner.fit import link_fit
    from splitserve_tools.planner.link_probe import measure

    def show(row: dict[str, Any]) -> None:
        print(
            f"{row['tokens']:6d} tokens  {row['bytes'] / 2**20:7.1f} MiB as "
            f"{row['wire_bytes'] / 2**20:5.1f} MiB {row['encoding']:4s}  "
            f"{row['seconds'] * 1e3:8.2f} ms (export {row['export_seconds'] * 1e3:.2f})  "
            f"{row['gbit_s']:6.2f} Gbit/s",
            flush=True,
        )

    rows = measure(
        args.address, _key(args), lengths=args.lengths, repeats=args.repeats, host=args.host,
        progress=show,
    )  # fmt: skip
    encoding = rows[0]["encoding"]  # the owner's: one per `plan link serve`
    fit = link_fit(rows, None, encoding)
    print(
        f"{encoding} handoff across the link: {fit.fixed_s * 1e3:.2f} ms + bytes at "
        f"{fit.bytes_per_s * 8 / 1e9:.2f} Gbit/s"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.out} (splitserve plan search ... --link-json {args.out})")


def add_link_parser(psub: argparse._SubParsersAction) -> None:
    link = psub.add_parser(
        "link",
        help="measure the KV handoff between two hosts (for plan search --link-json)",
        description="Run `serve` on the prefill host and `measure` on the decode host, both "
        "with the deployment's key; `measure` writes what `plan search --link-json` prices "
        "cross-node placements with (NIXL over UCX: set UCX_TLS as the servers will run).",
    )
    lsub = link.add_subparsers(dest="link_command", required=True)
    s = lsub.add_parser("serve", help="hand out leases of random KV until stopped")
    s.add_argument("--host", help="address the other host dials (default: this host's name)")
    s.add_argument("--port", type=int, default=0, help="handle endpoint port (default: any)")
    s.add_argument("--model", help="a checkpoint whose KV layout to use (default: 100m's)")
    s.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-tokens", type=int, default=4096, help="the longest handoff served")
    s.add_argument(
        "--kv-transfer-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="how the blocks travel, as `serve --kv-transfer-dtype` (fp8: encoded at export)",
    )
    s.set_defaults(func=cmd_link_serve)
    m = lsub.add_parser("measure", help="time handoffs from a `serve` host")
    m.add_argument("address", help="the tcp://HOST:PORT that `serve` printed")
    m.add_argument("--lengths", type=_lengths, default=(128, 1024, 4096), help="prompt tokens")
    m.add_argument("--repeats", type=int, default=7, help="handoffs per length (median)")
    m.add_argument("--host", help="this host's address for the release channel")
    m.add_argument("--out", type=Path, help="write the rows as JSON here")
    for p in (s, m):
        p.add_argument(
            "--key-file", help="the deployment's handle key (default: $SPLITSERVE_HANDLE_KEY)"
        )
    m.set_defaults(func=cmd_link_measure)
