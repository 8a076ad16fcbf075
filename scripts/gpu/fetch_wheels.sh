#!/usr/bin/env bash
# Run here (with network), before a GPU session: puts into .whl/ the wheels that
# scripts/gpu_check.sh installs on the GPU machine, which has no network (Python 3.12, x86-64).
# Only pyzmq is missing there; nvidia-pytriton (the tritonserver binary) is too large to carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "pyzmq>=25"
ls -l .whl
