"""OpenAI Triton kernels, one module per op, each matching a function of ``reference/``.

Importing this package imports ``triton``; ``splitserve_kernels`` does so only for CUDA tensors.
Under ``TRITON_INTERPRET=1`` (set before the first import) the kernels also run on CPU tensors,
which is how the CPU tests check them.
"""
