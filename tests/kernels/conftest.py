"""Without CUDA, the Triton kernels run in Triton's interpreter on CPU tensors; the variable
must be set before the kernels are first imported (``triton.jit`` reads it then)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
