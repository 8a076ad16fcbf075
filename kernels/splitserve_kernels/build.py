"""``python -m splitserve_kernels.build``: compile the C++ CPU kernels now, not on first use.

The kernels otherwise build when a CPU model first needs them (``splitserve serve`` does it before
tritonserver starts), which makes the first start of an install slower by the build. Run this
once after installing (in a Dockerfile, a deploy step), with the same ``TORCH_EXTENSIONS_DIR``
(and ``HOME``/``XDG_CACHE_HOME``) that the server will see: the build is cached there, per
installed copy of the sources. It compiles with ``-march=native``: build on the machine (or the
CPU model) that serves, not on a different build host.

Exit status 0 with the module's path and the time taken; 1 (with the compiler's output) where
the build failed, so the server would run on the slower torch references.
"""

from __future__ import annotations

import argparse
import sys
import time

from splitserve_kernels import cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitserve_kernels.build", description=__doc__)
    ap.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = ap.parse_args(argv)
    if not cpu.enabled():
        print("SPLITSERVE_KERNELS=reference: the CPU kernels are off, nothing built")
        return 0
    where = cpu.build_dir()
    print(f"building the CPU kernels in {where} ...", flush=True)
    started = time.monotonic()
    try:
        ext = cpu._load(where, verbose=args.verbose)
    except Exception as exc:
        print(f"the CPU kernels did not build: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {time.monotonic() - started:.1f} s: {ext.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
