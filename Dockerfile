# Splitserve on GPUs: KIND_GPU instances, KV cache handed from prefill to decode over CUDA IPC.
# Build: docker build -t splitserve .   Run: see docs/gpu.md.
#
# Pinned to NGC 25.01 (Triton 2.54), not the 24.10 (Triton 2.51) that the CPU tests run through
# the nvidia-pytriton wheel: releases after 24.10 fix the cancellation of BLS child requests and
# deadlocks of decoupled BLS calls that return GPU tensors. Splitserve keeps every BLS tensor on
# the CPU anyway; re-run scripts/gpu_check.sh in the image when changing this tag.
FROM nvcr.io/nvidia/tritonserver:25.01-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/splitserve
COPY pyproject.toml README.md ./
COPY backends backends
COPY client client
COPY kernels kernels
COPY tools tools
# CUDA 12 builds of torch (with its triton) and cuda-python, matching the image's CUDA 12. The
# wheel carries the model-repository templates and the C++ CPU kernels' sources. Those kernels
# are not built here: GPU layouts never call them, and they compile with -march=native, for the
# CPU that serves (`python -m splitserve_kernels.build` on that machine builds them ahead).
# NIXL for `--role prefill|decode` across nodes: the `nixl` meta package would also pull its
# CUDA 13 build, hence --no-deps (its own needs, torch and numpy, are installed above).
RUN pip install "torch==2.7.1" "cuda-python>=12.6,<13" && pip install ".[gpu,client,openai]" \
    && pip install --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"

EXPOSE 8000 8001 8002 9000
ENTRYPOINT ["splitserve", "serve"]
CMD ["--device", "gpu", "--model", "tiny", "--layout", "disagg"]
