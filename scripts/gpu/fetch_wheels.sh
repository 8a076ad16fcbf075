#!/usr/bin/env bash
# Run here (with network), before a GPU session: puts into .whl/ the wheels that
# scripts/gpu_check.sh installs on the GPU machine, which has no network (Python 3.12, x86-64).
# Missing there: pyzmq, nvidia-pytriton (the tritonserver binary, for the end-to-end step) and
# numpy < 2 (the Python backend's stub mangles BYTES tensors under numpy 2; the image has 2.x).
# Together about 60 MB: under the 64 MiB that travels with the tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_35_x86_64 \
    -d .whl "pyzmq>=25" "nvidia-pytriton==0.5.13" "numpy==1.26.4"
ls -l .whl
