"""Triton entry of ``llm_colocated`` (baseline, one engine loop); logic in splitserve.triton."""

from splitserve.triton.colocated import ColocatedModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
